"""MegatronJob helpers and fixtures for the e2e tests: install the CRD, run the operator process,
create jobs, read their status. The fixtures ``crd``, ``operator`` and ``jobs`` are registered once, in
e2e/conftest.py: a test asks for them by name and must not import them (an imported session fixture
gets one instance per importing module).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from k8s import GPU_TOLERATION, Cluster, pod_runtime_annotations

ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "crds" / "megatron-operator.io_megatronjobs.yaml"
EXAMPLES = ROOT / "examples"
GROUP, VERSION, PLURAL = "megatron-operator.io", "v1alpha1", "megatronjobs"
OPERATOR_START_TIMEOUT_S = 60
# Phase changes show within one resync tick plus kwok's pod delays.
PHASE_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_job(name: str, **spec_overrides: Any) -> dict[str, Any]:
    """A tiny valid MegatronJob (2 pods x 1 GPU, DP=2) for lifecycle tests: small enough that many
    tests' pods fit on the kwok nodes at once."""
    spec: dict[str, Any] = {
        "numNodes": 2,
        "gpusPerNode": 1,
        "model": {"numLayers": 4, "hiddenSize": 512, "numAttentionHeads": 8, "seqLength": 512, "vocabSize": 1000},
        "training": {"microBatchSize": 1, "trainIters": 10},
    }
    for key, value in spec_overrides.items():
        node = spec
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = copy.deepcopy(value)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "MegatronJob", "metadata": {"name": name}, "spec": spec}


def run_for(seconds: float) -> dict[str, Any]:
    """spec.podMetadata that makes kwok complete each pod after ``seconds`` of Running."""
    return {"annotations": pod_runtime_annotations(seconds)}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


class Jobs:
    """CRUD on MegatronJobs and a view of their children."""

    def __init__(self, cluster: Cluster, namespace: str):
        self.cluster = cluster
        self.ns = namespace
        api = cluster.api_client()
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.core = kubernetes.client.CoreV1Api(api)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(api)

    def create(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, doc)

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def phase(self, name: str) -> str | None:
        return self.status(name).get("phase")

    def patch_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def jobsets(self) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets")["items"]

    def jobset(self, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets", name)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def pods(self, job: str) -> list[Any]:
        return self.core.list_namespaced_pod(self.ns, label_selector=f"megatron-operator.io/job-name={job}").items

    def events(self, name: str) -> list[Any]:
        return self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}").items

    def wait_phase(self, name: str, phases: str | tuple[str, ...], timeout: float = PHASE_TIMEOUT_S) -> dict:
        want = (phases,) if isinstance(phases, str) else phases

        def ready() -> dict | None:
            st = self.status(name)
            return st if st.get("phase") in want else None

        return self.cluster.wait_for(ready, timeout, f"MegatronJob {self.ns}/{name} phase in {want}",
                                     namespace=self.ns, kinds=("megatronjobs", "jobsets", "jobs", "pods"))


@dataclass
class OperatorProcess:
    """The operator as a host process (`python -m megatron_operator run`) against the cluster."""

    cluster: Cluster
    metrics_port: int
    extra_env: dict[str, str]
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def log_path(self) -> Path:
        return self.cluster.logs_dir / "operator.log"

    def start(self) -> None:
        env = self.cluster.env(
            PYTHONPATH=f"{ROOT / 'operator'}:{ROOT / 'contract'}",
            PYTHONUNBUFFERED="1",
            MEGATRON_OPERATOR_METRICS_HOST="127.0.0.1",
            **self.extra_env,
        )
        log = open(self.log_path, "a")
        log.write(f"\n===== operator start #{self.starts + 1} =====\n")
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_operator", "run", "--kubeconfig", str(self.cluster.kubeconfig),
             "--metrics-port", str(self.metrics_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        self.cluster.wait_for(self.healthy, OPERATOR_START_TIMEOUT_S, "the operator's /healthz",
                              kinds=("megatronjobs",))

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"the operator exited (rc={self.proc.returncode if self.proc else None}); "
                                 f"log: {self.log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> None:
    """The MegatronJob CRD, installed server-side and Established."""
    cluster.apply(CRD_FILE)

    def established() -> bool:
        out = cluster.kubectl("get", "crd", f"{PLURAL}.{GROUP}", "-o", "json").stdout
        conds = {c["type"]: c["status"] for c in json.loads(out)["status"].get("conditions", [])}
        return conds.get("Established") == "True"

    cluster.wait_for(established, 30, "the MegatronJob CRD to be Established", kinds=("crd",))


# The session's host operator once a test asked for it (see alone_with_the_jobs).
_SESSION_OPERATORS: list[OperatorProcess] = []
#: The session operator's settings (a test that needs one more setting starts its own with these).
SESSION_OPERATOR_ENV = {
    "MEGATRON_OPERATOR_RESYNC_INTERVAL_S": "1",
    "MEGATRON_OPERATOR_STALL_TIMEOUT_S": "15",
    "MEGATRON_OPERATOR_TERMINATION_GRACE_PERIOD_S": "30",
    "MEGATRON_OPERATOR_TP_GROUP_COLLISION_S": "5",
}


def gpu_filler(jobs: Jobs, node: str, gpus: int = 1) -> str:
    """A plain pod that holds ``gpus`` GPUs of ``node`` (what another team's job would do)."""
    name = f"filler-{node}"
    jobs.core.create_namespaced_pod(jobs.ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [GPU_TOLERATION],
                 "containers": [{"name": "c", "image": "busybox",
                                 "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}})
    return name


@pytest.fixture(scope="session")
def operator(cluster: Cluster, crd: None):
    op = OperatorProcess(cluster, free_port(), dict(SESSION_OPERATOR_ENV))
    op.start()
    _SESSION_OPERATORS.append(op)
    yield op
    _SESSION_OPERATORS.remove(op)
    op.stop()


@contextlib.contextmanager
def alone_with_the_jobs(cluster: Cluster, namespace: str, timeout: float = 180):
    """For a test whose own operator must be the only one at work (it counts that operator's
    errors): the session's operator, if an earlier test started it, is stopped meanwhile, and
    MegatronJobs that earlier tests left in namespaces being deleted are gone first. Whatever order
    the test files run in."""
    paused = [op for op in _SESSION_OPERATORS if op.proc is not None and op.proc.poll() is None]
    for op in paused:
        op.stop()
    try:
        def others_gone() -> bool:
            # Only jobs on their way out: jobs a person left running (the demo's, `make demo` before
            # `make test`) never go, and are no earlier test's.
            nss = json.loads(cluster.kubectl("get", "namespaces", "-o", "json").stdout)["items"]
            terminating = {n["metadata"]["name"] for n in nss if n["metadata"].get("deletionTimestamp")}
            out = cluster.kubectl("get", "megatronjobs", "-A", "-o", "json").stdout
            return not [i for i in json.loads(out)["items"]
                        if i["metadata"]["namespace"] != namespace and i["metadata"]["namespace"] in terminating]

        cluster.wait_for(others_gone, timeout, "MegatronJobs of earlier tests to be deleted with their namespaces",
                         kinds=("megatronjobs",))
        yield
    finally:
        for op in paused:
            op.start()


@pytest.fixture
def jobs(cluster: Cluster, namespace: str) -> Jobs:
    return Jobs(cluster, namespace)


def wait_gone(cluster: Cluster, fetch, what: str, namespace: str, timeout: float = 60) -> None:
    def gone() -> bool:
        try:
            return fetch() in (None, [])
        except kubernetes.client.ApiException as e:
            return e.status == 404

    cluster.wait_for(gone, timeout, what, namespace=namespace)


def now() -> float:
    return time.monotonic()
