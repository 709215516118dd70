"""The local control plane behaves like a GPU cluster: real apiserver/scheduler/controllers + JobSet,
kwok nodes and pod lifecycles. These are the properties the operator's e2e tests build on."""

from __future__ import annotations

import copy

import kubernetes
import pytest
from k8s import (
    GPU_TOLERATION,
    POD_FAIL_EXIT_CODE,
    POD_FAIL_LABEL,
    POD_FAIL_REASON,
    Cluster,
    pod_runtime_annotations,
)
from kubernetes.client import ApiException

pytestmark = pytest.mark.e2e

JOBSET_GROUP, JOBSET_VERSION, JOBSETS = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
P5_NODES = 16
SCHEDULE_TIMEOUT_S = 60
COMPLETE_TIMEOUT_S = 120
RESTART_TIMEOUT_S = 180


def make_jobset(name: str, *, replicas: int = 2, gpus: int = 8, efa: int = 32, max_restarts: int = 0,
                pod_annotations: dict[str, str] | None = None) -> dict:
    """The shape the operator renders: one replicatedJob `worker`, a pod per Job, restartPolicy Never,
    backoffLimit 0, GPU + EFA limits, the GPU toleration."""
    limits = {"nvidia.com/gpu": str(gpus), "cpu": "8", "memory": "64Gi"}
    if efa:
        limits["vpc.amazonaws.com/efa"] = str(efa)
    spec = {
        "replicatedJobs": [
            {
                "name": "worker",
                "replicas": replicas,
                "template": {
                    "spec": {
                        "parallelism": 1,
                        "completions": 1,
                        "backoffLimit": 0,
                        "template": {
                            "spec": {
                                "restartPolicy": "Never",
                                "tolerations": [GPU_TOLERATION],
                                "containers": [
                                    {
                                        "name": "trainer",
                                        "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                                        "command": ["torchrun", "train.py"],
                                        "resources": {"limits": limits, "requests": limits},
                                    }
                                ],
                            }
                        },
                    }
                },
            }
        ],
    }
    if max_restarts:
        spec["failurePolicy"] = {"maxRestarts": max_restarts}
    if pod_annotations:
        spec["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"] = {"annotations": pod_annotations}
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": spec,
    }


def create_jobset(client: kubernetes.client.ApiClient, namespace: str, jobset: dict) -> dict:
    return kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, jobset
    )


def get_jobset(client: kubernetes.client.ApiClient, namespace: str, name: str) -> dict:
    return kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name
    )


def condition(obj: dict, type_: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == type_), None)


def jobset_pods(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> list:
    return core.list_namespaced_pod(namespace, label_selector=f"{JOBSET_NAME_LABEL}={name}").items


def test_nodes_are_ready_gpu_nodes(cluster: Cluster):
    nodes = kubernetes.client.CoreV1Api(cluster.api_client()).list_node().items
    p5 = [n for n in nodes if n.metadata.labels.get("node.kubernetes.io/instance-type") == "p5.48xlarge"]
    assert len(p5) == P5_NODES
    small = sorted(int(n.status.allocatable["nvidia.com/gpu"]) for n in nodes if n not in p5)
    assert 1 in small and 2 in small, small
    for node in nodes:
        ready = next(c for c in node.status.conditions if c.type == "Ready")
        assert ready.status == "True", (node.metadata.name, ready)
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in [
            {"key": t.key, "value": t.value, "effect": t.effect} for t in node.spec.taints or []
        ]
        assert node.metadata.labels["nvidia.com/gpu.present"] == "true"
        assert node.metadata.labels["kubernetes.io/hostname"] == node.metadata.name
        assert node.spec.pod_cidr
    for node in p5:
        assert node.metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["vpc.amazonaws.com/efa"] == "32"
        assert node.status.capacity["nvidia.com/gpu"] == "8"


def test_jobset_webhook_defaults(cluster: Cluster, namespace: str):
    """JobSet's mutating webhook (served on loopback) fills restartPolicy and completionMode."""
    jobset = make_jobset("defaults")
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    del pod_spec["restartPolicy"]
    out = kubernetes.client.CustomObjectsApi(cluster.api_client()).create_namespaced_custom_object(
        JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, jobset, dry_run="All"
    )
    job = out["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completionMode"] == "Indexed"
    assert job["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert out["spec"]["successPolicy"]["operator"] == "All"


def test_jobset_runs_on_gpu_nodes_and_completes(cluster: Cluster, namespace: str, wait_for):
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    create_jobset(client, namespace, make_jobset("train"))

    def scheduled():
        pods = [p for p in jobset_pods(core, namespace, "train") if p.spec.node_name]
        return pods if len(pods) == 2 else None

    pods = wait_for(scheduled, SCHEDULE_TIMEOUT_S, "2 pods of JobSet train scheduled")
    jobs = kubernetes.client.BatchV1Api(client).list_namespaced_job(namespace).items
    assert sorted(j.metadata.name for j in jobs) == ["train-worker-0", "train-worker-1"]
    nodes = {n.metadata.name: n for n in core.list_node().items}
    for pod in pods:
        labels = nodes[pod.spec.node_name].metadata.labels
        assert labels["node.kubernetes.io/instance-type"] == "p5.48xlarge", pod.spec.node_name
    assert len({p.spec.node_name for p in pods}) == 2, "8-GPU pods must land on two different nodes"

    done = wait_for(
        lambda: condition(get_jobset(client, namespace, "train"), "Completed"),
        COMPLETE_TIMEOUT_S,
        "JobSet train Completed",
    )
    assert done["status"] == "True"
    final = jobset_pods(core, namespace, "train")
    assert {p.status.phase for p in final} == {"Succeeded"}


def test_jobset_larger_than_any_node_stays_pending(cluster: Cluster, namespace: str, wait_for):
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    create_jobset(client, namespace, make_jobset("too-big", replicas=1, gpus=16))

    def unschedulable():
        for pod in jobset_pods(core, namespace, "too-big"):
            cond = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
            if cond and cond.status == "False" and cond.reason == "Unschedulable":
                return pod, cond
        return None

    pod, cond = wait_for(
        unschedulable, SCHEDULE_TIMEOUT_S, "PodScheduled=False/Unschedulable on the too-big pod"
    )
    assert "Insufficient nvidia.com/gpu" in cond.message, cond.message
    events = wait_for(
        lambda: (
            core.list_namespaced_event(
                namespace, field_selector=f"involvedObject.name={pod.metadata.name},reason=FailedScheduling"
            ).items
        ),
        SCHEDULE_TIMEOUT_S,
        "FailedScheduling event for the too-big pod",
    )
    assert "Insufficient nvidia.com/gpu" in events[0].message, events[0].message

    pod = core.read_namespaced_pod(pod.metadata.name, namespace)
    assert pod.status.phase == "Pending" and not pod.spec.node_name
    jobset = get_jobset(client, namespace, "too-big")
    assert not condition(jobset, "Completed") and not condition(jobset, "Failed"), jobset.get("status")


def test_injected_pod_failure_restarts_the_gang_then_completes(cluster: Cluster, namespace: str, wait_for):
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    # Pods run 30 s (not kwok's default 5-10 s), so that the injected failure reaches a Running pod
    # even on a slow machine (a cold CI run saw the gang complete before the patch took effect).
    create_jobset(client, namespace, make_jobset("flaky", max_restarts=2, pod_annotations=pod_runtime_annotations(30)))

    def running_pods():
        pods = jobset_pods(core, namespace, "flaky")
        return pods if len(pods) == 2 and all(p.status.phase == "Running" for p in pods) else None

    first = wait_for(running_pods, SCHEDULE_TIMEOUT_S, "2 Running pods of JobSet flaky")
    first_uids = {p.metadata.uid for p in first}
    victim = first[0].metadata.name
    resource_version = core.list_namespaced_pod(namespace).metadata.resource_version

    # kwok's chaos stage: a Running pod with this label fails, with the exit code from the annotation.
    core.patch_namespaced_pod(
        victim,
        namespace,
        {
            "metadata": {
                "labels": {POD_FAIL_LABEL: "true"},
                "annotations": {POD_FAIL_EXIT_CODE: "137", POD_FAIL_REASON: "OOMKilled"},
            }
        },
    )

    # Watch from before the patch, so the short-lived Failed state cannot be missed.
    failed = None
    watch = kubernetes.watch.Watch()
    for event in watch.stream(
        core.list_namespaced_pod,
        namespace,
        resource_version=resource_version,
        field_selector=f"metadata.name={victim}",
        timeout_seconds=30,
    ):
        pod = event["object"]
        if pod.status.phase == "Failed":
            failed = pod
            watch.stop()
    assert failed is not None, cluster.diagnostics(namespace)
    terminated = failed.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (137, "OOMKilled")

    def restarted_once():
        jobset = get_jobset(client, namespace, "flaky")
        return jobset if jobset.get("status", {}).get("restarts", 0) >= 1 else None

    restarted = wait_for(restarted_once, RESTART_TIMEOUT_S, "JobSet flaky status.restarts >= 1")
    assert restarted["status"]["restarts"] == 1
    new_pods = wait_for(
        lambda: [
            p
            for p in jobset_pods(core, namespace, "flaky")
            if p.metadata.uid not in first_uids
            and p.metadata.labels.get("jobset.sigs.k8s.io/restart-attempt") == "1"
        ],
        RESTART_TIMEOUT_S,
        "pods of restart attempt 1",
    )
    assert new_pods

    done = wait_for(
        lambda: condition(get_jobset(client, namespace, "flaky"), "Completed"),
        RESTART_TIMEOUT_S,
        "JobSet flaky Completed after one restart",
    )
    assert done["status"] == "True"
    assert get_jobset(client, namespace, "flaky")["status"]["restarts"] == 1


def test_service_account_token_is_limited_by_rbac(cluster: Cluster, namespace: str):
    """RBAC authorization is on and TokenRequest works: a SA token may list pods only where its Role allows."""
    client = cluster.api_client()
    core = kubernetes.client.CoreV1Api(client)
    rbac = kubernetes.client.RbacAuthorizationV1Api(client)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    token = core.create_namespaced_service_account_token(
        "reader", namespace, {"spec": {"expirationSeconds": 600}}
    ).status.token

    config = copy.deepcopy(client.configuration)
    config.cert_file = config.key_file = None
    config.api_key = {"authorization": f"Bearer {token}"}
    as_sa = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))
    try:
        as_sa.list_namespaced_pod(namespace)  # allowed by the Role
        with pytest.raises(ApiException) as denied:
            as_sa.list_namespaced_pod("kube-system")
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied:
            as_sa.list_namespaced_secret(namespace)
        assert denied.value.status == 403
    finally:
        as_sa.api_client.close()


def test_garbage_collector_cascades_owner_deletion(cluster: Cluster, namespace: str, wait_for):
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(
        namespace,
        {
            "metadata": {
                "name": "child",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
                ],
            }
        },
    )
    core.delete_namespaced_config_map("owner", namespace)

    def child_gone() -> bool:
        try:
            core.read_namespaced_config_map("child", namespace)
        except ApiException as e:
            return e.status == 404
        return False

    wait_for(child_gone, 60, "garbage collector to delete the owned ConfigMap", kinds=("configmaps",))
