"""Handles and helpers for e2e tests against the local control plane (e2e/cluster/cluster.py).

The fixtures in e2e/conftest.py hand tests a `Cluster`; everything a test needs to talk to the
cluster goes through it: kubeconfig/kubectl paths, an ApiClient factory, server-side apply, and
`wait_for`, which on timeout dumps what a person would look at (describe, events, log tails).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import yaml

T = TypeVar("T")

FIELD_MANAGER = "megatron-e2e"
# What the dumps describe by default; add your own kinds (e.g. "megatronjobs") per call.
DEFAULT_DUMP_KINDS = ("jobsets.jobset.x-k8s.io", "jobs", "pods")
# Log tails in dumps, most relevant first; other *.log files found in the run dir follow.
LOG_ORDER = (
    "jobset",
    "kueue",
    "kube-scheduler",
    "kube-controller-manager",
    "kwok-controller",
    "kube-apiserver",
    "etcd",
)

# kwok behaviour knobs (see docs/local-cluster.md, "Pod lifecycle").
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_FAIL_EXIT_CODE = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"
POD_FAIL_REASON = "pod-container-running-failed.stage.kwok.x-k8s.io/reason"
POD_RUN_DELAY = "pod-complete.stage.kwok.x-k8s.io/delay"
POD_RUN_JITTER = "pod-complete.stage.kwok.x-k8s.io/jitter-delay"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


CLUSTER_SCRIPT = Path(__file__).resolve().parent / "cluster" / "cluster.py"
# Label of the nodes a test creates for itself (gpu_node): its pods select them, no other test's do.
POOL_LABEL = "megatron-e2e/pool"


def gpu_node(name: str, pool: str, gpus: int, taints: Iterable[dict[str, str]] = ()) -> dict[str, Any]:
    """A fresh kwok node with ``gpus`` GPUs in pool ``pool`` (POOL_LABEL), tainted like the cluster's GPU nodes
    plus ``taints``. Wait for ``schedulable_nodes`` before placing pods on it."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"type": "kwok", "kubernetes.io/hostname": name, POOL_LABEL: pool}},
            "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}, *taints]},
            "status": {"capacity": {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
                       "allocatable": {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}}}


def schedulable_nodes(core: kubernetes.client.CoreV1Api, names: Iterable[str],
                      tolerated: Iterable[str] = ("nvidia.com/gpu",)) -> bool:
    """Every named node Ready, not cordoned, and with no taint but ``tolerated`` (keys). A node is created with
    the not-ready NoSchedule taint (the TaintNodesByCondition admission plugin) and kube-controller-manager lifts
    it only after kwok reports the node Ready: a moment later, and not for two nodes at once. A job placed in
    between finds fewer nodes than the test made."""
    allowed = set(tolerated)
    for name in names:
        node = core.read_node(name)
        ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
        if not ready or node.spec.unschedulable or any(t.key not in allowed for t in node.spec.taints or []):
            return False
    return True


def load_cluster_module():
    """e2e/cluster/cluster.py as a module (it is a script, not part of a package)."""
    import importlib.util
    import sys

    name = "megatron_e2e_cluster"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, CLUSTER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pod_runtime_annotations(seconds: float) -> dict[str, str]:
    """Pod annotations that make kwok complete the pod after exactly `seconds` of Running.

    Both are needed: kwok draws the delay uniformly from [delay, jitter-delay) and uses the
    jitter value alone when it is not larger than the delay.
    """
    value = f"{int(seconds * 1000)}ms"
    return {POD_RUN_DELAY: value, POD_RUN_JITTER: value}


class WaitTimeout(AssertionError):
    """A bounded wait ran out; the message carries the diagnostics dump."""


@dataclass
class Cluster:
    """A running local cluster, as the tests see it."""

    kubeconfig: Path
    run_dir: Path
    kubectl_path: Path
    _clients: list = field(default_factory=list, repr=False)

    # -- clients -------------------------------------------------------------------------------

    def api_client(self) -> kubernetes.client.ApiClient:
        """A fresh kubernetes ApiClient for this cluster (closed at session end)."""
        client = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        self._clients.append(client)
        return client

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a subprocess (e.g. `python -m megatron_operator run`) aimed at this cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), **extra}

    @property
    def logs_dir(self) -> Path:
        """Put the logs of processes a test starts here (`<name>.log`): failure dumps include them."""
        d = self.run_dir / "logs"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = [
            str(self.kubectl_path),
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.run_dir / 'kubectl-cache'}",
            *args,
        ]
        proc = subprocess.run(cmd, check=False, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def apply(
        self,
        objects: str | Path | dict | Iterable[dict],
        namespace: str | None = None,
        field_manager: str = FIELD_MANAGER,
    ) -> list[dict]:
        """Server-side apply a multi-document YAML string/file, one object, or a list of objects.

        Returns the objects as the API server stored them. Namespaced objects without a namespace
        go to `namespace` (when given).
        """
        if isinstance(objects, Path):
            objects = objects.read_text()
        if isinstance(objects, str):
            docs = [d for d in yaml.safe_load_all(objects) if d]
        elif isinstance(objects, dict):
            docs = [objects]
        else:
            docs = list(objects)
        items = []
        for doc in docs:
            items.extend(doc.get("items", []) if doc.get("kind", "").endswith("List") else [doc])
        args = [
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={field_manager}",
            "-o",
            "json",
            "-f",
            "-",
        ]
        if namespace:
            args += ["-n", namespace]
        proc = self.kubectl(*args, input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        out = json.loads(proc.stdout)
        return out.get("items", [out]) if out.get("kind", "").endswith("List") else [out]

    # -- waiting and diagnostics ---------------------------------------------------------------

    def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float,
        what: str,
        *,
        namespace: str | None = None,
        kinds: Iterable[str] = DEFAULT_DUMP_KINDS,
        interval: float = 0.5,
    ) -> T:
        """Poll `predicate` until it returns something truthy and return it.

        Exceptions raised by the predicate count as "not yet" (the last one is reported). On
        timeout raise WaitTimeout with `what`, the last value/error, and a dump of `kinds` and
        events in `namespace` plus controller log tails.
        """
        deadline = time.monotonic() + timeout
        last_value: Any = None
        last_error: BaseException | None = None
        while True:
            try:
                last_value = predicate()
                if last_value:
                    return last_value
            except Exception as e:  # reported on timeout
                last_error = e
            if time.monotonic() >= deadline:
                break
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        msg = [f"timed out after {timeout:g} s waiting for: {what}", f"last value: {_short(last_value)}"]
        if last_error is not None:
            msg.append(f"last error: {type(last_error).__name__}: {_short(last_error)}")
        msg.append(self.diagnostics(namespace, kinds))
        raise WaitTimeout("\n".join(msg))

    def hold(
        self,
        invariant: Callable[[], Any],
        seconds: float,
        what: str,
        *,
        namespace: str | None = None,
        kinds: Iterable[str] = DEFAULT_DUMP_KINDS,
        interval: float = 0.25,
    ) -> None:
        """A bounded negative wait: `invariant` must stay truthy for `seconds`, checked every
        `interval`. Fails at the first violation (AssertionError with the same dump as wait_for),
        not at the end of the window; an exception from the invariant is a violation too."""
        deadline = time.monotonic() + seconds
        checks = 0
        while True:
            try:
                value = invariant()
                error = None
            except Exception as e:
                value, error = None, e
            checks += 1
            if not value:
                detail = f"error: {type(error).__name__}: {_short(error)}" if error else f"value: {_short(value)}"
                raise AssertionError(f"{what}: violated after {seconds - max(0.0, deadline - time.monotonic()):.1f} s "
                                     f"of {seconds:g} s ({checks} checks); {detail}\n"
                                     + self.diagnostics(namespace, kinds))
            if time.monotonic() >= deadline:
                return
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))

    def diagnostics(
        self, namespace: str | None = None, kinds: Iterable[str] = DEFAULT_DUMP_KINDS, log_lines: int = 40
    ) -> str:
        """Describe-like dump of `kinds` and events in `namespace`, nodes summary, and log tails."""
        out = []

        def section(title: str, *args: str, limit: int = 20000) -> None:
            try:
                proc = self.kubectl(*args, check=False, timeout=30)
                text = (proc.stdout + proc.stderr).strip()
            except Exception as e:  # a dump must never raise
                text = f"({type(e).__name__}: {e})"
            if len(text) > limit:
                text = text[:limit] + f"\n... ({len(text) - limit} more characters)"
            out.append(f"===== {title} =====\n{text or '(nothing)'}")

        if namespace:
            kinds = ",".join(kinds)
            section(
                f"kubectl get {kinds} -n {namespace} -o wide", "get", kinds, "-n", namespace, "-o", "wide"
            )
            section(f"kubectl describe {kinds} -n {namespace}", "describe", kinds, "-n", namespace)
            section(f"kubectl events -n {namespace}", "events", "-n", namespace)
        section("kubectl get nodes", "get", "nodes", "-o", "wide", limit=4000)
        for name, path in self.log_files().items():
            out.append(f"===== log {name} ({path}), last {log_lines} lines =====\n{_tail(path, log_lines)}")
        return "\n".join(out)

    def log_files(self) -> dict[str, Path]:
        """Component logs: kwokctl's (etcd, apiserver, kcm, scheduler, kwok), JobSet's, and any test's."""
        found: dict[str, Path] = {}
        for directory in (self.run_dir / "kwok" / "clusters" / "e2e" / "logs", self.run_dir / "logs"):
            if directory.is_dir():
                for f in sorted(directory.glob("*.log")):
                    found.setdefault(f.stem, f)
        ordered = {k: found[k] for k in LOG_ORDER if k in found}
        ordered.update({k: v for k, v in found.items() if k not in ordered})
        return ordered

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200 * lines))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({e})"


def _short(value: Any, limit: int = 2000) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
