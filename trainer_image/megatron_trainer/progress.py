"""`status.progress` of the trainer's own MegatronJob: payload, request and a best-effort writer.

Pure stdlib (urllib + ssl): the trainer image carries no Kubernetes client. A server-side apply
patch with field manager `megatron-trainer` (docs/trainer-contract.md, "Progress"). Every failure is
logged and swallowed: progress is never allowed to stop training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

log = logging.getLogger(__name__)

GROUP = "megatron-operator.io"
VERSION = "v1alpha1"
PLURAL = "megatronjobs"
KIND = "MegatronJob"
FIELD_MANAGER = "megatron-trainer"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class Progress:
    """One snapshot of training progress (the fields of status.progress)."""

    iteration: int | None  # None before the checkpoint is loaded (the field is then left out)
    train_iters: int
    loss: float | None = None
    tokens_per_second: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    last_checkpoint_iteration: int | None = None
    stage: str | None = None  # what the trainer is doing: "loading checkpoint 500", "training", ...
    validation_loss: float | None = None
    data: Mapping[str, int | float] | None = None  # SFT data counts (status.progress.data)
    goodput: Mapping[str, int | float] | None = None  # goodput.summary (status.progress.goodput)
    save_warning: str | None = None  # saves come faster than written, or the volume cannot hold them
    last_save_blocked_seconds: float | None = None  # the loop held by the last save (its wait included)
    last_save_seconds: float | None = None  # the last published save, start to published


def _finite(value: float | None, digits: int) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(float(value), digits)


def build_patch(name: str, namespace: str, progress: Progress, now: datetime | None = None) -> dict:
    """The apply-patch body. Unknown or non-finite figures are left out (the CRD types them as numbers)."""
    now = now or datetime.now(UTC)
    body = {
        "iteration": None if progress.iteration is None else int(progress.iteration),
        "stage": progress.stage[:256] if progress.stage else None,
        "trainIters": int(progress.train_iters),
        "loss": _finite(progress.loss, 6),
        "tokensPerSecond": _finite(progress.tokens_per_second, 1),
        "tflopsPerGpu": _finite(progress.tflops_per_gpu, 2),
        "mfu": _finite(progress.mfu, 4),
        "lastCheckpointIteration": progress.last_checkpoint_iteration,
        "validationLoss": _finite(progress.validation_loss, 6),
        "data": dict(progress.data) if progress.data else None,
        "goodput": dict(progress.goodput) if progress.goodput else None,
        "saveWarning": progress.save_warning[:1024] if progress.save_warning else None,
        "lastSaveBlockedSeconds": _finite(progress.last_save_blocked_seconds, 3),
        "lastSaveSeconds": _finite(progress.last_save_seconds, 1),
        "updateTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "status": {"progress": {k: v for k, v in body.items() if v is not None}},
    }


def status_url(api_server: str, namespace: str, name: str) -> str:
    q = urllib.parse.quote
    query = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
    return (f"{api_server.rstrip('/')}/apis/{GROUP}/{VERSION}/namespaces/{q(namespace, safe='')}/"
            f"{PLURAL}/{q(name, safe='')}/status?{query}")


def build_request(api_server: str, token: str, name: str, namespace: str, progress: Progress,
                  now: datetime | None = None) -> urllib.request.Request:
    """The PATCH request (JSON is valid YAML, so apply-patch+yaml takes it as is)."""
    data = json.dumps(build_patch(name, namespace, progress, now)).encode()
    headers = {"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return urllib.request.Request(status_url(api_server, namespace, name), data=data, headers=headers,
                                  method="PATCH")


def in_cluster_api_server(env: Mapping[str, str]) -> str | None:
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return None
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return f"https://{host}:{port}"


class ProgressWriter:
    """Sends patches from a daemon thread so a slow API server never stalls the training loop.

    `submit()` keeps only the newest snapshot; `write_now()` sends synchronously (tests, final write).
    """

    def __init__(self, api_server: str, name: str, namespace: str, token_path: str | None = None,
                 ca_path: str | None = None, timeout_s: float = 5.0, insecure: bool = False):
        self.api_server, self.name, self.namespace = api_server, name, namespace
        self.token_path = token_path
        self.timeout_s = timeout_s
        if api_server.startswith("https://"):
            self._ctx = ssl.create_default_context(cafile=ca_path if ca_path and os.path.exists(ca_path) else None)
            if insecure:
                self._ctx.check_hostname = False
                self._ctx.verify_mode = ssl.CERT_NONE
        else:
            self._ctx = None
        self._queue: queue.Queue[Progress | None] = queue.Queue(maxsize=1)
        self._thread: threading.Thread | None = None
        self.writes_ok = 0
        self.writes_failed = 0

    @classmethod
    def in_cluster(cls, name: str, namespace: str, env: Mapping[str, str] = os.environ) -> ProgressWriter | None:
        server = in_cluster_api_server(env)
        if server is None:
            return None
        return cls(server, name, namespace, token_path=f"{SA_DIR}/token", ca_path=f"{SA_DIR}/ca.crt")

    def _token(self) -> str:
        # Re-read every time: projected ServiceAccount tokens are rotated by the kubelet.
        if not self.token_path:
            return ""
        try:
            with open(self.token_path) as f:
                return f.read().strip()
        except OSError as e:
            log.warning("progress: cannot read token %s: %s", self.token_path, e)
            return ""

    def write_now(self, progress: Progress) -> bool:
        """One PATCH; True on 2xx. Never raises."""
        try:
            req = build_request(self.api_server, self._token(), self.name, self.namespace, progress)
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ctx) as resp:
                resp.read()
            self.writes_ok += 1
            return True
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace") if e.fp else ""
            log.warning("progress: status write failed: HTTP %s %s", e.code, detail)
        except Exception as e:  # best effort by contract: never let progress stop training
            log.warning("progress: status write failed: %s", e)
        self.writes_failed += 1
        return False

    def submit(self, progress: Progress) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="progress-writer", daemon=True)
            self._thread.start()
        try:
            self._queue.get_nowait()  # drop a stale snapshot not yet sent
        except queue.Empty:
            pass
        try:
            self._queue.put_nowait(progress)
        except queue.Full:
            pass

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self.write_now(item)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                return
            self._thread.join(timeout_s)


class Cadence:
    """True once every `interval_s` (0 disables); the first call is due immediately."""

    def __init__(self, interval_s: float, clock=time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last: float | None = None

    def due(self) -> bool:
        if self.interval_s <= 0:
            return False
        now = self._clock()
        if self._last is None or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False
