"""spec.logging.wandb: Weights & Biases experiment tracking (docs/experiment-tracking.md).

The block's room: its schema, its admission rules, the guardrail on its Secret and its part of the rendered
pod and command line. The API key is a Secret's file, named to the trainer by path only; the run's files go to
a volume that outlives the pod.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import Field

from ..expr import Field as ExprField
from ..expr import Filter, Has, Size, StartsWith, cond, fmt, lit
from ..names import CHECKPOINT_MOUNT, WANDB_API_KEY_MOUNT, WANDB_API_KEY_VOLUME, WANDB_SCRATCH_DIR
from ..settings import Settings
from ..vocab.api import ApiModel
from ..vocab.guardrail import Guardrail, Violation
from ..vocab.patterns import ABS_PATH, CONFIG_KEY, DNS_LABEL
from ..vocab.rule import Rule, no_literal_env
from ..vocab.values import f, has

# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


# Weights & Biases names (wandb's own limits: a project name has none of / \\ # ? % : and at most 128
# characters; entities are user or team names). The trainer checks the project the same way (config.py).
WANDB_PROJECT = r"^[^/\\#?%:\x00-\x1f\x7f]{1,128}$"
WANDB_ENTITY = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
WANDB_RUN_NAME = r"^[^\x00-\x1f\x7f]{1,128}$"


class SecretKeySelector(ApiModel):
    """One key of a Secret in the job's namespace."""

    name: str = Field(..., max_length=253, pattern=DNS_LABEL, description="Secret in the job's namespace.")
    key: str = Field("api-key", max_length=253, pattern=CONFIG_KEY, description="The key that holds the value.")


class WandbSpec(ApiModel):
    """Weights & Biases experiment tracking (docs/experiment-tracking.md): the trainer's last rank logs the
    log line's scalars to a W&B run (Megatron-LM's --wandb-* flags). The API key is read from a file of a
    Secret volume, never from args or environment values."""

    project: str = Field(..., max_length=128, pattern=WANDB_PROJECT, description="W&B project "
                         "(--wandb-project): at most 128 characters, none of / \\ # ? % :.")
    entity: str | None = Field(None, max_length=64, pattern=WANDB_ENTITY, description="W&B user or team "
                               "(--wandb-entity). Default: the API key's default entity.")
    name: str | None = Field(None, max_length=128, pattern=WANDB_RUN_NAME, description="Run name "
                             "(--wandb-exp-name). Default: the MegatronJob's name.")
    mode: Literal["online", "offline"] = Field("online", description="online: sent to W&B as it trains (needs "
                                               "apiKeySecret); offline: written to saveDir only, for `wandb sync` "
                                               "later (no key, no network).")
    api_key_secret: SecretKeySelector | None = Field(
        None, description="Secret in the job's namespace holding the API key (kubectl create secret generic "
        "NAME --from-literal=api-key=...). Mounted read-only into the trainer and named by path only "
        "(--wandb-api-key-file); never copied, never in args or env values. Required with mode online.")
    save_dir: str | None = Field(None, max_length=512, pattern=ABS_PATH, description="Directory for the run's "
                                 "files (--wandb-save-dir): on a volume that outlives the pod, the checkpoint "
                                 "PVC (under /checkpoints) or a writable spec.pod.volumeMounts path. Default: "
                                 "<checkpoint dir>/wandb on the checkpoint PVC; without one, /tmp/wandb (online "
                                 "only: the pod's scratch space is lost with the pod).")


# --------------------------------------------------------------------------------------------
# Admission rules
# --------------------------------------------------------------------------------------------


has_wandb = has("logging.wandb")
wandb_offline = has_wandb & f("logging.wandb.mode").eq("offline")
wandb_dir = f("logging.wandb.saveDir")
has_ckpt_pvc = has("checkpoint") & has("checkpoint.pvc")
has_pod = has("pod")
pod_mounts = f("pod.volumeMounts")
# A writable spec.pod mount at or above the directory (mount paths are schema-normalised, so a prefix test is exact).
_writable_mount_above = Size(Filter(pod_mounts, "m", (wandb_dir.eq(ExprField("mountPath", "m"))
                                                      | StartsWith(wandb_dir, ExprField("mountPath", "m") + "/"))
                                    & ~(Has(ExprField("readOnly", "m")) & ExprField("readOnly", "m")))) > 0
# Variables that hold the W&B API key itself (wandb's env settings); WANDB_*_FILE-style paths are no key.
WANDB_KEY_ENV_RE = r"^(WANDB_API_KEY|WANDB_IDENTITY_TOKEN)$"

RULES: list[Rule] = [
    Rule("wandb-online-needs-key", "logging.wandb.apiKeySecret",
         has("logging.wandb.apiKeySecret"), when=has_wandb & f("logging.wandb.mode").eq("online"),
         message=lit("spec.logging.wandb.apiKeySecret: mode online sends the run to Weights & Biases and needs an API "
                     "key from a Secret of the job's namespace; set apiKeySecret: {name: ..., key: api-key}, or "
                     "mode: offline")),
    Rule("wandb-offline-needs-volume", "logging.wandb.saveDir",
         cond(wandb_offline, has("logging.wandb.saveDir") | has_ckpt_pvc, True),
         message=lit("spec.logging.wandb: an offline run lives only in its files, and the pod's /tmp is lost with the "
                     "pod; set spec.checkpoint.pvc (the run goes to <checkpoint dir>/wandb) or saveDir on a writable "
                     "spec.pod.volumeMounts path")),
    Rule("wandb-save-dir-on-volume", "logging.wandb.saveDir",
         # (a conditional, not `when`: the API server then never evaluates saveDir's reads without a saveDir)
         cond(has_wandb & has("logging.wandb.saveDir"),
              (has_ckpt_pvc & StartsWith(wandb_dir, lit(CHECKPOINT_MOUNT + "/"))) | (has_pod & _writable_mount_above),
              True),
         message=fmt("spec.logging.wandb.saveDir: ", wandb_dir, " is not on a volume that outlives the pod; use a "
                     "directory under " + CHECKPOINT_MOUNT + "/ (with spec.checkpoint.pvc) or under a writable "
                     "spec.pod.volumeMounts path")),
    no_literal_env("env-no-literal-wandb-key", WANDB_KEY_ENV_RE, "a Weights & Biases key",
                    "spec.logging.wandb.apiKeySecret"),
]


# --------------------------------------------------------------------------------------------
# Guardrails
# --------------------------------------------------------------------------------------------


GUARDRAILS: tuple[Guardrail, ...] = (
    # The API key Secret, mounted as the object-store credentials are: denySecretEnv covers it.
    Guardrail("wandb-secret", "spec.logging.wandb.apiKeySecret", "denySecretEnv",
              "Secret references are not allowed here; use spec.logging.wandb.mode offline (no key) and "
              "`wandb sync` the run from outside the cluster",
              "!has(spec.logging) || !has(spec.logging.wandb) || !has(spec.logging.wandb.apiKeySecret)"),
)


def guardrail_violations(wandb: WandbSpec | None, settings: Settings) -> Iterator[Violation]:
    """The guardrails spec.logging.wandb breaks on this cluster (the Python twin of their CEL)."""
    if settings.deny_secret_env and wandb is not None and wandb.api_key_secret is not None:
        yield GUARDRAILS[0], "", ""


# --------------------------------------------------------------------------------------------
# Render: the trainer's flags and the key's volume
# --------------------------------------------------------------------------------------------


def save_dir(wandb: WandbSpec, checkpoint_dir: str | None) -> str:
    """--wandb-save-dir: spec.logging.wandb.saveDir, else <checkpoint dir>/wandb on the checkpoint PVC, else the
    pod's scratch (online mode only: wandb-offline-needs-volume)."""
    return wandb.save_dir or (f"{checkpoint_dir}/wandb" if checkpoint_dir else WANDB_SCRATCH_DIR)


def flags(wandb: WandbSpec, job_name: str, checkpoint_dir: str | None) -> list[str]:
    """Names and where the files go; the key only as a path (the Secret volume, ``volumes``)."""
    out = ["--wandb-project", wandb.project]
    if wandb.entity:
        out += ["--wandb-entity", wandb.entity]
    out += ["--wandb-exp-name", wandb.name or job_name, "--wandb-mode", wandb.mode,
            "--wandb-save-dir", save_dir(wandb, checkpoint_dir)]
    if wandb.api_key_secret is not None:
        out += ["--wandb-api-key-file", f"{WANDB_API_KEY_MOUNT}/key"]
    return out


def volumes(wandb: WandbSpec | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, the trainer's mount of it): the API key Secret, as the object-store credentials are mounted: the
    user's own Secret in the job's namespace, read by the kubelet with the pod's rights; one key as the file `key`,
    readable by the trainer's group only (fsGroup)."""
    if wandb is None or wandb.api_key_secret is None:
        return []
    return [({"name": WANDB_API_KEY_VOLUME, "secret": {
        "secretName": wandb.api_key_secret.name, "defaultMode": 0o440,
        "items": [{"key": wandb.api_key_secret.key, "path": "key"}]}},
        {"name": WANDB_API_KEY_VOLUME, "mountPath": WANDB_API_KEY_MOUNT, "readOnly": True})]
