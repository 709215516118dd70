"""Checkpoints in S3-compatible object storage, through NVIDIA's multi-storage-client (MSC).

The trainer takes `--save/--load s3://BUCKET/PREFIX` with `--object-store-endpoint` and
`--object-store-region`. `configure()` writes an MSC configuration (one profile, no secrets in it)
to a private temporary file, points `MSC_CONFIG` at it and switches on Megatron-Core's opt-in MSC
feature (`megatron.core.msc_utils.MultiStorageClientFeature`, what Megatron-LM's `--enable-msc`
does). Megatron-Core then writes and reads the torch_dist shards through `msc://PROFILE/PREFIX/...`.

Credentials are never a flag or an environment value: boto3's default chain finds them, in a
shared-credentials file (`AWS_SHARED_CREDENTIALS_FILE`, the path of a Secret volume the operator
mounts) or through a web-identity token (IRSA / workload identity).

`MscStore` gives ckpt_layout the few operations the tracker, resume and retention need, with the
object store's semantics: one PUT is atomic (the tracker is one object written after metadata.json),
there are no directories (an `iter_N/` "directory" is a key prefix), and deleting a checkpoint
deletes metadata.json first, so a half-deleted checkpoint reads as incomplete.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)

PROFILE = "checkpoints"
_S3_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")


def is_object_url(path) -> bool:
    return isinstance(path, str) and path.startswith(("s3://", "msc://"))


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty


def parse_s3_url(url: str) -> S3Location:
    m = _S3_RE.match(url)
    if not m:
        raise ValueError(f"{url!r} is not an s3://BUCKET/PREFIX URL (bucket: 3-63 of a-z 0-9 . -)")
    prefix = (m.group(2) or "").strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"{url!r}: the prefix has an empty, '.' or '..' part")
    return S3Location(m.group(1), prefix)


def msc_config(bucket: str, endpoint: str | None, region: str | None, profile: str = PROFILE) -> dict:
    """The MSC configuration of one S3 profile rooted at the bucket. No credentials: boto3's chain."""
    options: dict = {"base_path": bucket}
    if endpoint:
        options["endpoint_url"] = endpoint
    if region:
        options["region_name"] = region
    return {"profiles": {profile: {"storage_provider": {"type": "s3", "options": options}}}}


def msc_url(loc: S3Location, profile: str = PROFILE) -> str:
    return f"msc://{profile}/{loc.prefix}" if loc.prefix else f"msc://{profile}"


_PROFILES: dict = {}
_CONFIG_FILE: list[str] = []  # this process's MSC configuration file, once written


def _remove_config_file(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that inherited the handler
        try:
            os.unlink(path)
        except OSError:
            pass


def configure(url: str, endpoint: str | None, region: str | None, profile: str = PROFILE) -> str:
    """Write the MSC configuration for `url` (s3://BUCKET/PREFIX), enable MSC in Megatron-Core, and
    return the msc:// URL to save to and load from. Idempotent for the same arguments.

    One file per process: a later call rewrites it in place (atomically, with every profile so far), so
    the path a child process inherited in MSC_CONFIG stays valid; it is removed when the process exits."""
    loc = parse_s3_url(url)
    _PROFILES.update(msc_config(loc.bucket, endpoint, region, profile)["profiles"])
    cfg = {"profiles": dict(_PROFILES)}  # every profile this process configured (msc reads it per profile)
    fd, path = tempfile.mkstemp(prefix="msc-config-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)
    if _CONFIG_FILE:
        os.replace(path, _CONFIG_FILE[0])
        path = _CONFIG_FILE[0]
    else:
        _CONFIG_FILE.append(path)
        atexit.register(_remove_config_file, path, os.getpid())
    os.environ["MSC_CONFIG"] = path  # inherited by the async writer process
    try:
        from megatron.core.msc_utils import MultiStorageClientFeature
    except ImportError:  # the pure tests use MscStore without Megatron-Core
        pass
    else:
        MultiStorageClientFeature.enable()
    log.info("checkpoint: object store s3://%s/%s through MSC (endpoint %s, region %s)", loc.bucket, loc.prefix,
             endpoint or "default", region or "default")
    return msc_url(loc, profile)


# ---------------------------------------------------------------------------- errors
class ObjectStoreError(Exception):
    """An object-store failure with its classification (exitcodes decide the exit code)."""

    def __init__(self, message: str, retriable: bool, code: str = ""):
        super().__init__(message)
        self.retriable = retriable
        self.code = code


# S3 error codes: the caller's fault (retrying cannot help) vs the service's (a restart may).
NON_RETRIABLE_CODES = frozenset({
    "NoSuchBucket", "InvalidAccessKeyId", "XAdminUserNotFound", "SignatureDoesNotMatch", "AccessDenied", "AllAccessDisabled",
    "InvalidBucketName", "AuthorizationHeaderMalformed", "ExpiredToken", "InvalidToken", "AccountProblem",
    "NoCredentialsError", "PartialCredentialsError", "InvalidRequest", "403", "404",
})
RETRIABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "EndpointConnectionError",
    "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
})


def _error_code(exc: BaseException) -> str:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code:
                return str(code)
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status:
                return str(status)
        name = type(exc).__name__
        if name in NON_RETRIABLE_CODES or name in RETRIABLE_CODES:
            return name
        for code in NON_RETRIABLE_CODES | RETRIABLE_CODES:
            if not code.isdigit() and re.search(rf"\b{code}\b", str(exc)):
                return code
        exc = exc.__cause__ or exc.__context__
    return ""


def classify(exc: BaseException, url: str) -> ObjectStoreError:
    """An ObjectStoreError for `exc`, raised while using `url`. The message names the location and the
    S3 error code, never a credential (boto3's messages do not carry the secret key)."""
    code = _error_code(exc)
    retriable = code not in NON_RETRIABLE_CODES  # unknown: a restart may help
    hint = {
        "NoSuchBucket": "the bucket does not exist (create it, or fix spec.checkpoint.objectStore.bucket)",
        "InvalidAccessKeyId": "the access key is unknown to the server (check the credentials Secret)",
        "XAdminUserNotFound": "the access key is unknown to the server (check the credentials Secret)",
        "SignatureDoesNotMatch": "the secret key is wrong (check the credentials Secret)",
        "AccessDenied": "the credentials may not use this bucket/prefix",
        "NoCredentialsError": "no credentials found (credentials Secret or IRSA role)",
    }.get(code, "")
    kind = "retriable" if retriable else "not retriable"
    first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    msg = f"object store {url}: {code or type(exc).__name__} ({kind})" + (f": {hint}" if hint else "") + f"; {first}"
    return ObjectStoreError(msg, retriable, code)


# ---------------------------------------------------------------------------- store
class MscStore:
    """The checkpoint root `msc://PROFILE/PREFIX` for ckpt_layout (paths relative to the root)."""

    def __init__(self, url: str):
        import multistorageclient as msc

        if not url.startswith("msc://"):
            raise ValueError(f"not an msc:// URL: {url}")
        self.url = url.rstrip("/")
        self._msc = msc
        self.client, self.root = msc.resolve_storage_client(self.url)
        self.root = self.root.strip("/")

    def _key(self, rel: str) -> str:
        rel = rel.strip("/")
        return "/".join(p for p in (self.root, rel) if p)

    def _prefix(self, rel: str = "") -> str:
        """The key prefix of the 'directory' rel (with its trailing slash; '' for the bucket root)."""
        key = self._key(rel)
        return key + "/" if key else ""

    def join(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts]])

    def _call(self, fn, *args, missing_ok: bool = False):
        try:
            return fn(*args)
        except Exception as e:
            code = _error_code(e)
            # MSC turns every HTTP 404 into FileNotFoundError (the S3 error is its __context__): a
            # missing key is "not there", but versitygw answers an unknown access key with a 404 too
            # (XAdminUserNotFound), and that must not read as "no checkpoint yet".
            if missing_ok and isinstance(e, FileNotFoundError) and code in ("", "NoSuchKey", "404"):
                return None
            raise classify(e, self.url) from e

    def read_text(self, rel: str) -> str | None:
        data = self._call(self.client.read, self._key(rel), missing_ok=True)
        if data is None:
            return None
        try:
            return data.decode()
        except UnicodeDecodeError:
            return None

    def write_text(self, rel: str, text: str) -> None:
        """One PUT: on S3 an object is replaced atomically, readers see the old or the new body."""
        self._call(self.client.write, self._key(rel), text.encode())

    def is_file(self, rel: str) -> bool:
        return bool(self._call(self.client.is_file, self._key(rel), missing_ok=True))

    def list_dirs(self) -> list[str]:
        """The names of the 'directories' (common prefixes) directly under the root."""
        prefix = self._prefix()
        names = set()
        for obj in self._call(lambda: list(self.client.list(prefix, include_directories=True))) or []:
            key = obj.key.strip("/")
            rest = key[len(prefix):] if key.startswith(prefix) else key
            if rest:
                names.add(rest.split("/", 1)[0])
        return sorted(names)

    def delete_tree(self, rel: str, first: str | None = None) -> None:
        """Delete every object under `rel/`; `first` (e.g. metadata.json) before the others."""
        if first:
            self._call(self.client.delete, self._key(f"{rel}/{first}"), missing_ok=True)
        prefix = self._prefix(rel)
        keys = [o.key for o in self._call(lambda: list(self.client.list(prefix)))]
        if keys:
            self._call(self.client.delete_many, keys)

    def list_keys(self, rel: str = "") -> list[str]:
        """Every key under the 'directory' rel, relative to it (sorted)."""
        prefix = self._prefix(rel)
        keys = [o.key for o in self._call(lambda: list(self.client.list(prefix)))]
        return sorted(k[len(prefix):] if k.startswith(prefix) else k for k in keys)

    def delete_keys(self, rels: list[str]) -> None:
        """Delete these keys (relative to the root), in one request where the store allows."""
        if rels:
            self._call(self.client.delete_many, [self._key(r) for r in rels])

    def upload_file(self, rel: str, local_path) -> None:
        """Upload a local file to one key (boto3's transfer manager: multipart for a large file, read
        from disk a part at a time)."""
        self._call(self.client.upload_file, self._key(rel), str(local_path))

    def ensure_root(self) -> None:
        """Fail early and clearly when the bucket is missing or the credentials are refused:
        one LIST of the prefix (needs s3:ListBucket, which resume needs anyway)."""
        self._call(lambda: next(iter(self.client.list(self._prefix())), None))
