"""spec.checkpoint.objectStore: checkpoints (and a Hugging Face export) in an S3-compatible bucket, through NVIDIA's
multi-storage-client (docs/object-storage.md).

The block's room: its schema, its admission rules (one location for the checkpoints, an export apart from them,
no credential as a literal in spec.env), the guardrails on its Secret and its workload identity, and its part of
the rendered objects (the bucket's URL and endpoint flags, the credentials volume, the ServiceAccount's
annotations).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import Field

from ..expr import All, Attr, Filter, Has, Index, Matches, Size, StartsWith, Var, cond, fmt, lit
from ..expr import Field as ExprField
from ..names import (
    OBJECT_STORE_CREDENTIALS_MOUNT,
    OBJECT_STORE_CREDENTIALS_VOLUME,
    S3_ENDPOINT,
    WORKLOAD_IDENTITY_ANNOTATIONS,
)
from ..settings import Settings
from ..vocab.api import ApiModel
from ..vocab.guardrail import Guardrail, Violation, listed, lower_ascii
from ..vocab.patterns import CONFIG_KEY, CREDENTIAL_ENV_RE, DNS_LABEL, REL_PATH, URL_USERINFO_RE
from ..vocab.rule import Rule, no_literal_env
from ..vocab.values import f, has

# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


# S3 bucket names (3-63 of a-z 0-9 . -, alphanumeric at both ends), endpoints (names.S3_ENDPOINT) and region
# names.
S3_BUCKET = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
S3_REGION = r"^[a-z0-9-]{1,32}$"


class ObjectStoreSpec(ApiModel):
    """An S3-compatible bucket for the checkpoints (through NVIDIA's multi-storage-client). Nothing is
    mounted for the data; credentials come from a Secret in the job's namespace (a read-only volume
    with an AWS shared-credentials file) or from workload identity (service-account annotations)."""

    bucket: str = Field(..., min_length=3, max_length=63, pattern=S3_BUCKET, description="Bucket name.")
    prefix: str | None = Field(None, max_length=512, pattern=REL_PATH, description="Key prefix inside the bucket "
                               "(no leading '/', no '.' or '..' parts). Default: the MegatronJob's name.")
    endpoint: str | None = Field(None, max_length=256, pattern=S3_ENDPOINT, description="Endpoint URL of an "
                                 "S3-compatible service, http(s)://HOST[:PORT] (default: AWS S3 for the region).")
    region: str | None = Field(None, max_length=32, pattern=S3_REGION, description="Region, e.g. us-east-1.")
    credentials_secret: str | None = Field(
        None, max_length=253, pattern=DNS_LABEL, description="Secret in the job's namespace holding an AWS "
        "shared-credentials file ([default] aws_access_key_id, aws_secret_access_key; kubectl create secret "
        "generic NAME --from-file=credentials=$HOME/.aws/credentials). Mounted read-only into the trainer, "
        "named by path only (AWS_SHARED_CREDENTIALS_FILE); never copied, never in args or env values.")
    credentials_key: str = Field("credentials", max_length=253, pattern=CONFIG_KEY, description="The key of "
                                 "credentialsSecret that holds the file.")
    service_account_annotations: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] = Field(
        default_factory=dict, max_length=4, description="Workload identity instead of a Secret: annotations for "
        "the job's own ServiceAccount, e.g. eks.amazonaws.com/role-arn (IRSA). Only "
        + ", ".join(WORKLOAD_IDENTITY_ANNOTATIONS) + "; the cluster's guardrails (deniedMetadataKeys) apply.")


# --------------------------------------------------------------------------------------------
# Admission rules (on spec; OBJECT_RULES on the whole MegatronJob)
# --------------------------------------------------------------------------------------------


ckpt_store = has("checkpoint") & has("checkpoint.objectStore")
export_to_store = has("export") & f("export.huggingFace.objectStore")
ckpt_prefix = f("checkpoint.objectStore.prefix")
export_path = f("export.huggingFace.path")
sa_annotations = f("checkpoint.objectStore.serviceAccountAnnotations")
WORKLOAD_IDENTITY_RE = "^(" + "|".join(k.replace(".", r"\.") for k in WORKLOAD_IDENTITY_ANNOTATIONS) + ")$"
# Proxy variables (read by botocore, urllib and requests) also take a URL with user info (URL_USERINFO_RE)
# without its scheme (user:pass@host:3128).
PROXY_ENV_RE = r"(?i)^(http|https|all|ftp)_proxy$"
PROXY_USERINFO_RE = r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^/?#]*@"
# botocore's endpoint variables: AWS_ENDPOINT_URL, and AWS_ENDPOINT_URL_<SERVICE> (S3, STS, ...). A literal
# value takes the shape of spec.checkpoint.objectStore.endpoint (the field's pattern): the variable is
# another way to set the same thing, and must not go around the field's rules.
ENDPOINT_ENV_RE = r"^AWS_ENDPOINT_URL(_[A-Z0-9_]+)?$"

RULES: list[Rule] = [
    Rule("checkpoint-one-location", "checkpoint",
         has("checkpoint.pvc").ne(has("checkpoint.objectStore")), when=has("checkpoint"),
         message=lit("spec.checkpoint: give exactly one of pvc and objectStore")),
    Rule("checkpoint-path-with-pvc", "checkpoint.path",
         ~has("checkpoint.path"), when=ckpt_store,
         message=lit("spec.checkpoint.path: is a directory inside the PVC; with objectStore, set "
                     "objectStore.prefix instead")),
    Rule("tensorboard-needs-checkpoint-pvc", "logging.tensorboard",
         ~ckpt_store, when=f("logging.tensorboard"),
         message=lit("spec.logging.tensorboard: event files are written under the checkpoint PVC, and "
                     "spec.checkpoint.objectStore has none; set tensorboard: false")),
    Rule("object-store-identity-annotations", "checkpoint.objectStore.serviceAccountAnnotations",
         All(sa_annotations, "k", Matches(Var("k"), WORKLOAD_IDENTITY_RE)),
         when=ckpt_store & has("checkpoint.objectStore.serviceAccountAnnotations"),
         message=fmt("spec.checkpoint.objectStore.serviceAccountAnnotations: ",
                     Index(Filter(sa_annotations, "k", ~Matches(Var("k"), WORKLOAD_IDENTITY_RE)), 0),
                     " is not a workload-identity annotation; allowed: " + ", ".join(WORKLOAD_IDENTITY_ANNOTATIONS))),
    Rule("object-store-one-identity", "checkpoint.objectStore",
         ~(has("checkpoint.objectStore.credentialsSecret") & (Size(sa_annotations) > 0)),
         when=ckpt_store & has("checkpoint.objectStore.serviceAccountAnnotations"),
         message=lit("spec.checkpoint.objectStore: give credentialsSecret or serviceAccountAnnotations "
                     "(workload identity), not both")),
    Rule("hf-export-one-location", "export.huggingFace",
         has("export.huggingFace.pvc").ne(f("export.huggingFace.objectStore")), when=has("export"),
         message=lit("spec.export.huggingFace: give exactly one of pvc and objectStore: true")),
    Rule("hf-export-object-store-needs-checkpoint-store", "export.huggingFace.objectStore",
         ckpt_store, when=export_to_store,
         message=lit("spec.export.huggingFace.objectStore: the export goes to the bucket of "
                     "spec.checkpoint.objectStore, and this job has none; set spec.checkpoint.objectStore, or "
                     "export to a pvc")),
    # An export among the checkpoints' keys would mix the two (and its never-overwrite check would refuse
    # the prefix the checkpoints fill). The default prefix is the job's name, which a spec rule cannot see:
    # OBJECT_RULES' hf-export-outside-default-prefix checks it.
    Rule("hf-export-outside-checkpoint-prefix", "export.huggingFace.path",
         ~(export_path.eq(ckpt_prefix) | StartsWith(export_path, ckpt_prefix + "/")
           | StartsWith(ckpt_prefix, export_path + "/")),
         when=export_to_store & ckpt_store & has("checkpoint.objectStore.prefix"),
         message=fmt("spec.export.huggingFace.path: ", export_path,
                     cond(export_path.eq(ckpt_prefix), " is the same prefix as",
                          cond(StartsWith(export_path, ckpt_prefix + "/"), " is inside", " contains")),
                     " spec.checkpoint.objectStore.prefix ", ckpt_prefix,
                     "; export to a prefix apart from the checkpoints, e.g. exports/<name>")),
    Rule("env-no-url-credentials", "env",
         All(f("env"), "e", ~(Has(ExprField("value", "e")) & (
             Matches(ExprField("value", "e"), URL_USERINFO_RE)
             | (Matches(ExprField("name", "e"), PROXY_ENV_RE) & Matches(ExprField("value", "e"), PROXY_USERINFO_RE))))),
         message=fmt("spec.env: ",
                     Attr(Index(Filter(f("env"), "e", Has(ExprField("value", "e")) & (
                         Matches(ExprField("value", "e"), URL_USERINFO_RE)
                         | (Matches(ExprField("name", "e"), PROXY_ENV_RE)
                            & Matches(ExprField("value", "e"), PROXY_USERINFO_RE)))), 0), "name"),
                     " holds a URL with user info (user:password@host), a credential in plain sight of the pods and "
                     "`kubectl get -o yaml`; drop it from the URL and use spec.checkpoint.objectStore."
                     "credentialsSecret, or take the whole value from a Secret (valueFrom.secretKeyRef)")),
    Rule("env-endpoint-url", "env",
         All(f("env"), "e", ~(Has(ExprField("value", "e")) & Matches(ExprField("name", "e"), ENDPOINT_ENV_RE))
             | Matches(ExprField("value", "e"), S3_ENDPOINT)
             | Matches(ExprField("value", "e"), URL_USERINFO_RE)),  # env-no-url-credentials says it
         message=fmt("spec.env: ",
                     Attr(Index(Filter(f("env"), "e", Has(ExprField("value", "e"))
                                       & Matches(ExprField("name", "e"), ENDPOINT_ENV_RE)
                                       & ~Matches(ExprField("value", "e"), S3_ENDPOINT)
                                       & ~Matches(ExprField("value", "e"), URL_USERINFO_RE)), 0), "name"),
                     " must be http(s)://HOST[:PORT] (a port 1-65535; no path, no user info), as "
                     "spec.checkpoint.objectStore.endpoint, which sets the same thing")),
    no_literal_env("env-no-literal-credentials", CREDENTIAL_ENV_RE, "an object-store credential",
                    "spec.checkpoint.objectStore.credentialsSecret (or valueFrom.secretKeyRef)"),
]

# On the whole object (``self`` is the MegatronJob): the default prefix is metadata.name.
job_name = f("metadata.name")
export_store_path = f("spec.export.huggingFace.path")
OBJECT_RULES: list[Rule] = [
    # hf-export-outside-checkpoint-prefix for the default prefix, the job's name (checkpoint_url)
    Rule("hf-export-outside-default-prefix", "spec.export.huggingFace.path",
         ~(export_store_path.eq(job_name) | StartsWith(export_store_path, job_name + "/")),
         when=has("spec.export") & f("spec.export.huggingFace.objectStore") & has("spec.checkpoint")
         & has("spec.checkpoint.objectStore") & ~has("spec.checkpoint.objectStore.prefix"),
         message=fmt("spec.export.huggingFace.path: ", export_store_path,
                     cond(export_store_path.eq(job_name), " is", " is inside"),
                     " the checkpoints' prefix, which is the job's name ", job_name,
                     " (spec.checkpoint.objectStore.prefix is not set); export to a prefix apart from the "
                     "checkpoints, e.g. exports/<name>")),
]


# --------------------------------------------------------------------------------------------
# Guardrails
# --------------------------------------------------------------------------------------------


GUARDRAILS: tuple[Guardrail, ...] = (
    # denySecretEnv covers the credentials Secret: a Secret volume is as much a read of the Secret by the job's
    # pods as a secretKeyRef.
    Guardrail("object-store-secret", "spec.checkpoint.objectStore.credentialsSecret", "denySecretEnv",
              "Secret references are not allowed here; use workload identity "
              "(spec.checkpoint.objectStore.serviceAccountAnnotations) if the cluster allows it",
              "!has(spec.checkpoint) || !has(spec.checkpoint.objectStore) || "
              "!has(spec.checkpoint.objectStore.credentialsSecret)"),
    # Workload identity goes on the job's ServiceAccount, not on the pods, but it is the same power
    # (iam.amazonaws.com/, azure.workload.identity/ are denied by default): the same denied prefixes as the pods'.
    Guardrail(
        "service-account-annotation", "spec.checkpoint.objectStore.serviceAccountAnnotations", "deniedMetadataKeys",
        "{item} is denied on this cluster (denied key prefixes: {limit})",
        "!has(spec.checkpoint) || !has(spec.checkpoint.objectStore) || "
        "!has(spec.checkpoint.objectStore.serviceAccountAnnotations) || "
        "spec.checkpoint.objectStore.serviceAccountAnnotations.all(k, "
        "!LIMIT.exists(d, k.lowerAscii().startsWith(d.lowerAscii())))",
        "spec.checkpoint.objectStore.serviceAccountAnnotations.filter(k, "
        "LIMIT.exists(d, k.lowerAscii().startsWith(d.lowerAscii())))[0]"),
)
_SECRET, _IDENTITY = GUARDRAILS


def guardrail_violations(store: ObjectStoreSpec | None, settings: Settings) -> Iterator[Violation]:
    """The guardrails spec.checkpoint.objectStore breaks on this cluster (the Python twin of their CEL)."""
    if store is None:
        return
    if settings.deny_secret_env and store.credentials_secret:
        yield _SECRET, "", ""
    denied = listed(settings.denied_metadata_keys)
    for k in store.service_account_annotations:
        if any(lower_ascii(k).startswith(lower_ascii(d)) for d in denied):
            yield _IDENTITY, k, ", ".join(denied)


# --------------------------------------------------------------------------------------------
# Render: the bucket's URLs and flags, the credentials' volume and file, the ServiceAccount's annotations
# --------------------------------------------------------------------------------------------


def url(store: ObjectStoreSpec, key: str) -> str:
    """s3://BUCKET/KEY in the bucket: --save/--load (the key is the prefix) and --hf-export."""
    return f"s3://{store.bucket}/{key}"


def checkpoint_url(store: ObjectStoreSpec, job_name: str) -> str:
    """--save/--load: the bucket's prefix, by default the job's name (hf-export-outside-default-prefix)."""
    return url(store, store.prefix or job_name)


def flags(store: ObjectStoreSpec) -> list[str]:
    """The bucket's endpoint and region (the trainer uses them for the checkpoints and for an export there)."""
    return [*(["--object-store-endpoint", store.endpoint] if store.endpoint else []),
            *(["--object-store-region", store.region] if store.region else [])]


def env(store: ObjectStoreSpec | None) -> list[dict[str, Any]]:
    """A path, never the secret: boto3 reads the file from the Secret volume (``volumes``)."""
    if store is None or not store.credentials_secret:
        return []
    return [{"name": "AWS_SHARED_CREDENTIALS_FILE", "value": f"{OBJECT_STORE_CREDENTIALS_MOUNT}/credentials"}]


def volumes(store: ObjectStoreSpec | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, the trainer's mount of it): the user's own Secret in the job's namespace (the kubelet reads it with
    the pod's rights there; the operator never reads or copies it), one key as the file `credentials`, readable by
    the trainer's group only (fsGroup)."""
    if store is None or not store.credentials_secret:
        return []
    return [({"name": OBJECT_STORE_CREDENTIALS_VOLUME, "secret": {
        "secretName": store.credentials_secret, "defaultMode": 0o440,
        "items": [{"key": store.credentials_key, "path": "credentials"}]}},
        {"name": OBJECT_STORE_CREDENTIALS_VOLUME, "mountPath": OBJECT_STORE_CREDENTIALS_MOUNT, "readOnly": True})]


def service_account_annotations(store: ObjectStoreSpec | None) -> dict[str, str]:
    """Workload identity: the annotations of the job's own ServiceAccount."""
    return dict(store.service_account_annotations) if store is not None else {}
