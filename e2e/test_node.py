"""`helm install` onto a real node: the chart's operator Deployment runs as a real pod.

The node is a kubelet built from the same Kubernetes modules on containerd and runc
(e2e/cluster/node.py), registered beside the kwok GPU nodes. The operator image is the one
`make images` built, loaded into containerd without a registry. The test checks that:

- the kubelet's probes pass: the readiness and liveness counters in its /metrics/probes;
- the metrics Service has the pod's endpoint, and the pod answers on it;
- the operator in the pod takes MegatronJobs to Succeeded, and their GPU pods go to kwok nodes;
- a killed operator pod is recreated by its ReplicaSet, and the new pod carries on reconciling.

Needs root (containerd, runc, mounts, a bridge). node.py installs the Debian packages when they
are missing, and the kubelet is built on first use (`e2e/cluster/build.sh kubelet`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from k8s import Cluster
from mjob import Jobs, run_for, small_job
from test_helm import Release
from test_image import image

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e" / "cluster"))
import node as real_node  # noqa: E402

KUBELET_BUILD_TIMEOUT_S = 1800
ROLLOUT_TIMEOUT_S = 120
PROBE_TIMEOUT_S = 90   # liveness: initialDelaySeconds 15 + one period of 20 s, with room
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def node(cluster: Cluster, image: str) -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.fail("the real node needs root (containerd, runc, mounts, a bridge)", pytrace=False)
    proc = subprocess.run(["bash", str(ROOT / "e2e" / "cluster" / "build.sh"), "kubelet"], capture_output=True,
                          text=True, timeout=KUBELET_BUILD_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"build.sh kubelet failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    real_node.down()  # a node left by an interrupted run
    try:
        state = real_node.up()
    except real_node.cluster.ClusterError as e:
        real_node.down()
        pytest.fail(f"the real node did not come up:\n{e}", pytrace=False)
    yield state
    real_node.down()


def values(state: dict[str, Any], namespace: str, image_ref: str) -> dict[str, Any]:
    repository, tag = image_ref.rsplit(":", 1)
    api = state["apiserver"]
    return {
        "crds": {"enabled": False},
        "watchNamespaces": [namespace],
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "nodeSelector": {"megatron-operator.io/real-node": "true"},
        "tolerations": [{"key": real_node.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
        # no kube-proxy, and the serving certificate does not name the ClusterIP (node.py)
        "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": api["host"]},
                     {"name": "KUBERNETES_SERVICE_PORT", "value": str(api["port"])}],
        "config": {"resyncIntervalSeconds": 1},
    }


def operator_pod(core: kubernetes.client.CoreV1Api, rel: Release) -> Any | None:
    pods = core.list_namespaced_pod(rel.namespace, label_selector=f"app.kubernetes.io/instance={rel.name}").items
    ready = [p for p in pods if p.metadata.deletion_timestamp is None and p.status.phase == "Running"
             and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
    return ready[0] if len(ready) == 1 else None


def probe_successes(kubelet_port: int, pod: str, probe: str) -> float:
    """The kubelet's own count of successful probes of `pod` (its /metrics/probes)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the kubelet's self-signed serving cert
    with urllib.request.urlopen(f"https://127.0.0.1:{kubelet_port}/metrics/probes", timeout=5, context=ctx) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(r'^prober_probe_total\{(.*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("pod") == pod and labels.get("probe_type") == probe and labels.get("result") == "successful":
            total += float(m.group(2))
    return total


def pod_metric(pod_ip: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{pod_ip}:8080/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def gpu_pods_on_kwok_nodes(core: kubernetes.client.CoreV1Api, jobs: Jobs, job: str) -> None:
    pods = jobs.pods(job)
    assert pods, f"no pods for {job}"
    for p in pods:
        node = core.read_node(p.spec.node_name)
        assert node.metadata.annotations.get("kwok.x-k8s.io/node") == "fake", (p.metadata.name, p.spec.node_name)


def test_helm_install_runs_the_operator_as_a_real_pod(cluster, crd, node, image, namespace, tmp_path):
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    # the kubelet's node, not kwok's
    real = core.read_node(node["node"])
    assert real.status.node_info.kubelet_version == f"v{real_node.cluster.versions()['KUBE_VERSION']}"
    assert real.status.node_info.container_runtime_version.startswith("containerd://")
    assert "kwok.x-k8s.io/node" not in (real.metadata.annotations or {})

    rel = Release(cluster, f"mo-{secrets.token_hex(3)}", f"mo-node-{secrets.token_hex(3)}", tmp_path)
    rel.install(values(node, namespace, image))
    jobs = Jobs(cluster, namespace)
    try:
        pod = cluster.wait_for(lambda: operator_pod(core, rel), ROLLOUT_TIMEOUT_S, "the operator pod to be Ready",
                               namespace=rel.namespace)
        assert pod.spec.node_name == node["node"]
        kubelet_port = yaml.safe_load((real_node.node_dir() / "kubelet" / "config.yaml").read_text())["port"]
        for probe in ("Readiness", "Liveness"):
            cluster.wait_for(lambda probe=probe: probe_successes(kubelet_port, pod.metadata.name, probe) >= 1,
                             PROBE_TIMEOUT_S, f"a successful {probe} probe of {pod.metadata.name}",
                             namespace=rel.namespace)

        def endpoint() -> str | None:
            slices = kubernetes.client.DiscoveryV1Api(cluster.api_client()).list_namespaced_endpoint_slice(
                rel.namespace, label_selector=f"kubernetes.io/service-name={rel.name}-megatron-operator-metrics").items
            ready = [a for s in slices for e in s.endpoints or [] if e.conditions.ready for a in e.addresses]
            return ready[0] if ready == [pod.status.pod_ip] else None

        assert cluster.wait_for(endpoint, 60, "the metrics Service's endpoint", namespace=rel.namespace) \
            == pod.status.pod_ip

        jobs.create(small_job("first", podMetadata=run_for(3)))
        jobs.wait_phase("first", "Succeeded", timeout=JOB_TIMEOUT_S)
        gpu_pods_on_kwok_nodes(core, jobs, "first")
        assert pod_metric(pod.status.pod_ip, "megatron_operator_status_writes_total") > 0

        # kill the operator pod: its ReplicaSet recreates it, and the new pod carries on
        core.delete_namespaced_pod(pod.metadata.name, rel.namespace, grace_period_seconds=0)
        new = cluster.wait_for(
            lambda: (p := operator_pod(core, rel)) and p.metadata.name != pod.metadata.name and p,
            ROLLOUT_TIMEOUT_S, "a new operator pod to be Ready", namespace=rel.namespace)
        assert new.spec.node_name == node["node"]
        jobs.create(small_job("second", podMetadata=run_for(3)))
        jobs.wait_phase("second", "Succeeded", timeout=JOB_TIMEOUT_S)
        gpu_pods_on_kwok_nodes(core, jobs, "second")
        assert pod_metric(new.status.pod_ip, "megatron_operator_status_writes_total") > 0
        assert pod_metric(new.status.pod_ip, "megatron_operator_reconcile_errors_total") == 0
    finally:
        logs = sorted((real_node.node_dir() / "pod-logs").glob(f"{rel.namespace}_*/operator/*.log"))
        (cluster.logs_dir / "operator-real-node.log").write_text(
            "".join(f"===== {f}\n{f.read_text(errors='replace')}" for f in logs))
        for name in ("first", "second"):
            with contextlib.suppress(kubernetes.client.ApiException):
                jobs.delete(name)
        rel.uninstall()
        core.delete_namespace(rel.namespace)
