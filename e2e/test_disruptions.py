"""Disruptions without Kueue, on the real controllers (API server eviction, kube-controller-manager's
taint-eviction controller, kubectl drain, JobSet, the Job controller): a pod evicted, a GPU node that
dies, a node drained. Each restarts the gang without counting against maxRestarts (maxRestarts is 0
here, so a counted restart would fail the job), says what happened, and the job finishes."""

from __future__ import annotations

import kubernetes
import pytest
from k8s import load_cluster_module
from mjob import Jobs, run_for, small_job

pytestmark = pytest.mark.e2e

DISRUPTION_TIMEOUT_S = 120


def disruptable_job(name: str, seconds: float, **spec):
    # Tolerate a NotReady node for 2 s instead of the API server's default 300 s (DefaultTolerationSeconds),
    # as training jobs that want a fast fail-over do.
    tolerations = [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                    "tolerationSeconds": 2}]
    return small_job(name, podMetadata=run_for(seconds), restart={"maxRestarts": 0},
                     resources={"tolerations": tolerations}, **spec)


def running_pods(jobs: Jobs, name: str) -> list:
    pods = [p for p in jobs.pods(name) if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
    return pods if len(pods) == 2 else []


def assert_restarted_without_counting_and_finished(jobs: Jobs, name: str, disruption: str) -> dict:
    """The gang restarted, JobSet did not count it, the job finished, and the status and an Event say
    which pod was disrupted and how (its DisruptionTarget condition, e.g. ``disruption`` =
    EvictionByEvictionAPI)."""
    restarted = jobs.cluster.wait_for(lambda: (jobs.jobset(name)["status"].get("restarts") or 0) >= 1, 60,
                                      "the JobSet restarted the gang", namespace=jobs.ns)
    assert restarted
    js = jobs.jobset(name)
    assert (js["status"].get("restartsCountTowardsMax") or 0) == 0, js["status"]
    done = jobs.wait_phase(name, "Succeeded", timeout=DISRUPTION_TIMEOUT_S)
    assert done["restarts"] >= 1 and done.get("disruptions") == done["restarts"], done
    events = jobs.cluster.wait_for(lambda: [e for e in jobs.events(name) if e.reason == "Disruption"], 30,
                                   "a Disruption event", namespace=jobs.ns)
    assert all(e.type == "Warning" and "does not count against maxRestarts" in e.message for e in events), \
        [(e.type, e.message) for e in events]
    assert done["lastFailure"].get("disruption", "").startswith(f"{disruption}: "), done["lastFailure"]
    return done


def test_eviction_api_on_a_running_pod(cluster, operator, jobs):
    jobs.create(disruptable_job("evicted", 15))
    pods = cluster.wait_for(lambda: running_pods(jobs, "evicted"), 60, "2 running pods", namespace=jobs.ns)
    victim = pods[0].metadata.name
    jobs.core.create_namespaced_pod_eviction(victim, jobs.ns, kubernetes.client.V1Eviction(
        metadata=kubernetes.client.V1ObjectMeta(name=victim, namespace=jobs.ns)))
    done = assert_restarted_without_counting_and_finished(jobs, "evicted", "EvictionByEvictionAPI")
    assert done["lastFailure"]["pod"] == victim


NODE_FAILED_LABEL = load_cluster_module().NODE_FAILED_LABEL


@pytest.fixture
def node_restorer(cluster):
    """Nodes a test broke (failed, cordoned) are revived afterwards, whatever happened."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    saved: dict[str, list] = {}

    def remember(node_name: str) -> None:
        saved[node_name] = [{k: v for k, v in t.to_dict().items() if v is not None}
                            for t in core.read_node(node_name).spec.taints or []]

    yield remember
    for node_name, taints in saved.items():
        core.patch_node(node_name, {"metadata": {"labels": {NODE_FAILED_LABEL: None}}})
        core.patch_node_status(node_name, {"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e: node revived"}]}})
        core.patch_node(node_name, {"spec": {"taints": taints, "unschedulable": None}})
        cluster.wait_for(lambda n=node_name, t=taints: [x.key for x in core.read_node(n).spec.taints or []]
                         == [x["key"] for x in t], 60, f"node {node_name} revived (kcm's taints gone)",
                         kinds=("nodes",))


def test_gpu_node_that_dies(cluster, operator, jobs, node_restorer):
    jobs.create(disruptable_job("node-lost", 40))  # outlasts the node lifecycle controller under load
    pods = cluster.wait_for(lambda: running_pods(jobs, "node-lost"), 60, "2 running pods", namespace=jobs.ns)
    victim = pods[0]
    node_name = victim.spec.node_name
    node_restorer(node_name)
    # The kubelet dies: no more heartbeats (kwok stops playing it, see NODE_FAILED_LABEL) and the node
    # reports NotReady. kube-controller-manager's node lifecycle controller then taints it not-ready
    # (NoSchedule, NoExecute) and its taint-eviction controller deletes the pods that do not tolerate that.
    jobs.core.patch_node(node_name, {"metadata": {"labels": {NODE_FAILED_LABEL: "true"}}})
    not_ready = {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "KubeletNotReady", "message": "e2e: the GPU node died"}]}}
    jobs.core.patch_node_status(node_name, not_ready)
    stale_heartbeats = []

    def not_ready_taints() -> bool:
        # A dead kubelet never says Ready again, but kwok may, once: its heartbeat for this node was queued
        # (600-1210 s ahead) while the node was alive, and kwok 0.8.0 neither cancels it when a newer
        # version of the node matches no stage (the label) nor re-checks the selector when it fires
        # (pkg/kwok/controllers/stage_controller.go, preprocess and playStage). Fired before the node
        # lifecycle controller's next look (every 5 s), it hid the death: once, no taints in 60 s and the
        # node Ready at the dump. Nothing of kwok's is queued for a labelled node after that, so say it again.
        node = jobs.core.read_node(node_name)
        if any(c.type == "Ready" and c.status != "False" for c in node.status.conditions or []):
            stale_heartbeats.append(node.metadata.resource_version)
            jobs.core.patch_node_status(node_name, not_ready)
        return {(t.key, t.effect) for t in node.spec.taints or []} >= {
            ("node.kubernetes.io/not-ready", "NoSchedule"), ("node.kubernetes.io/not-ready", "NoExecute")}

    taints = cluster.wait_for(not_ready_taints, 60, "the node lifecycle controller's not-ready taints",
                              namespace=jobs.ns, kinds=("jobsets.jobset.x-k8s.io", "jobs", "pods", "nodes"))
    if stale_heartbeats:
        print(f"{node_name}: a queued kwok heartbeat set it Ready {len(stale_heartbeats)} time(s); said NotReady again")
    assert taints
    done = assert_restarted_without_counting_and_finished(jobs, "node-lost", "DeletionByTaintManager")
    assert done["lastFailure"]["node"] == node_name
    # recorded for any later JobSet of this job (this one's gang restart avoided it by the taint)
    assert [(a["node"], a["reason"]) for a in done.get("avoidedNodes", [])] == [
        (node_name, "node not ready or unreachable (NoExecute taint)")], done
    # the new gang avoided the dead node (NoSchedule taint)
    assert all(p.spec.node_name != node_name for p in jobs.pods("node-lost") if p.status.phase == "Succeeded")


def test_kubectl_drain(cluster, operator, jobs, node_restorer):
    jobs.create(disruptable_job("drained", 15))
    pods = cluster.wait_for(lambda: running_pods(jobs, "drained"), 60, "2 running pods", namespace=jobs.ns)
    victim = pods[0]
    node_name = victim.spec.node_name
    node_restorer(node_name)
    cluster.kubectl("drain", node_name, "--ignore-daemonsets", "--delete-emptydir-data", "--pod-selector",
                    "megatron-operator.io/job-name=drained", "--timeout=90s", timeout=120)
    assert jobs.core.read_node(node_name).spec.unschedulable is True
    done = assert_restarted_without_counting_and_finished(jobs, "drained", "EvictionByEvictionAPI")
    assert done["lastFailure"]["node"] == node_name
