"""MegatronJobs under the real Kueue (v0.19.2, JobSet integration) of the local cluster: queueing
with Kueue's own message, preemption by a higher WorkloadPriorityClass, and suspend/resume through
the Workload's spec.active. Each test gets its own ClusterQueue (2 GPUs) and a LocalQueue `team-a`."""

from __future__ import annotations

import contextlib

import kubernetes
import pytest
from k8s import load_cluster_module
from mjob import (
    SESSION_OPERATOR_ENV,
    Jobs,
    OperatorProcess,
    alone_with_the_jobs,
    free_port,
    gpu_filler,
    run_for,
    small_job,
    wait_gone,
)

pytestmark = pytest.mark.e2e

KUEUE = ("kueue.x-k8s.io", "v1beta2")
FLAVOR = "e2e-gpu"
QUEUE = "team-a"
QUOTA_GPUS = 2  # one small_job (2 pods x 1 GPU) at a time
KUEUE_TIMEOUT_S = 90


class Kueue:
    """Kueue objects of one test: a ClusterQueue for its namespace and the LocalQueue `team-a`."""

    def __init__(self, cluster, namespace: str):
        self.cluster, self.ns = cluster, namespace
        self.api = kubernetes.client.CustomObjectsApi(cluster.api_client())
        self.cluster_queue = f"cq-{namespace}"[:63]

    def setup(self, gpus: int = QUOTA_GPUS) -> None:
        self.cluster.apply([
            {"apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
            *({"apiVersion": "/".join(KUEUE), "kind": "WorkloadPriorityClass", "metadata": {"name": name},
               "value": value, "description": f"e2e {name}"} for name, value in (("low", 100), ("high", 1000))),
            {"apiVersion": "/".join(KUEUE), "kind": "ClusterQueue", "metadata": {"name": self.cluster_queue},
             "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}},
                      "preemption": {"withinClusterQueue": "LowerPriority"},
                      "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                          {"name": FLAVOR, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}},
            {"apiVersion": "/".join(KUEUE), "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": self.ns},
             "spec": {"clusterQueue": self.cluster_queue}},
        ])

        def active() -> bool:
            cq = self.api.get_cluster_custom_object(*KUEUE, "clusterqueues", self.cluster_queue)
            return any(c["type"] == "Active" and c["status"] == "True"
                       for c in (cq.get("status") or {}).get("conditions") or [])

        self.cluster.wait_for(active, 30, f"ClusterQueue {self.cluster_queue} Active", namespace=self.ns,
                              kinds=("clusterqueues", "localqueues"))

    def use_topology(self, topology: str, levels: list[str], flavor: str, node_labels: dict[str, str],
                     gpus: int) -> None:
        """Topology-aware scheduling for this test: a Topology of `levels` (node labels, outermost
        first), a ResourceFlavor on the nodes with `node_labels` that uses it, and this test's
        ClusterQueue re-pointed at that flavor with `gpus` GPUs of quota."""
        self.cluster.apply([
            {"apiVersion": "/".join(KUEUE), "kind": "Topology", "metadata": {"name": topology},
             "spec": {"levels": [{"nodeLabel": label} for label in levels]}},
            {"apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor", "metadata": {"name": flavor},
             "spec": {"nodeLabels": node_labels, "topologyName": topology,
                      "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
            {"apiVersion": "/".join(KUEUE), "kind": "ClusterQueue", "metadata": {"name": self.cluster_queue},
             "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": self.ns}},
                      "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                          {"name": flavor, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": gpus}]}]}]}},
        ])

    def teardown(self) -> None:
        # the namespace's deletion removes the LocalQueue and the Workloads; the ClusterQueue is ours
        self.api.delete_cluster_custom_object(*KUEUE, "clusterqueues", self.cluster_queue)

    def workload(self, jobs: Jobs, name: str) -> dict | None:
        js = jobs.jobset(name)
        if js is None:
            return None
        items = self.api.list_namespaced_custom_object(
            *KUEUE, self.ns, "workloads", label_selector=f"kueue.x-k8s.io/job-uid={js['metadata']['uid']}")["items"]
        return items[0] if items else None


@pytest.fixture
def kueue(cluster, namespace):
    k = Kueue(cluster, namespace)
    k.setup()
    yield k
    k.teardown()


def condition(obj: dict | None, kind: str) -> dict:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def queued_job(name: str, seconds: float, **spec):
    return small_job(name, queueName=QUEUE, podMetadata=run_for(seconds), **spec)


def live_pods(jobs: Jobs, name: str) -> list:
    return [p for p in jobs.pods(name) if not p.metadata.deletion_timestamp and p.status.phase in ("Pending", "Running")]


def wait_reason(jobs: Jobs, name: str, reason: str, timeout: float = KUEUE_TIMEOUT_S) -> dict:
    return jobs.cluster.wait_for(lambda: (s := jobs.status(name)).get("reason") == reason and s, timeout,
                                 f"MegatronJob {name} reason {reason}", namespace=jobs.ns,
                                 kinds=("megatronjobs", "jobsets", "workloads", "pods"))


def test_second_job_waits_in_the_queue_with_kueues_message_then_runs(cluster, operator, jobs, kueue):
    jobs.create(queued_job("first", 20))
    jobs.wait_phase("first", "Running", timeout=KUEUE_TIMEOUT_S)
    jobs.create(queued_job("second", 3))
    queued = wait_reason(jobs, "second", "Queued")
    wl = cluster.wait_for(lambda: (w := kueue.workload(jobs, "second")) and condition(w, "QuotaReserved").get("message")
                          and w, 30, "the second Workload's QuotaReserved message", namespace=jobs.ns)
    kueue_message = condition(wl, "QuotaReserved")["message"]
    assert "insufficient unused quota for nvidia.com/gpu" in kueue_message, kueue_message
    queued = cluster.wait_for(lambda: kueue_message in (s := jobs.status("second")).get("message", "") and s, 30,
                              "Kueue's message in the MegatronJob's status", namespace=jobs.ns)
    assert queued["phase"] == "Pending" and queued["message"].startswith(f"waiting for Kueue to admit the job from "
                                                                         f"queue {QUEUE}: ")
    assert jobs.jobset("second")["spec"]["suspend"] is True and live_pods(jobs, "second") == []
    waiting = condition({"status": queued}, "Queued")  # kubectl wait --for=condition=Queued=false works on it
    assert (waiting.get("status"), waiting.get("reason")) == ("True", "Queued") and kueue_message in waiting["message"]
    # admitted when the first one finishes (its quota is released), then runs to the end
    jobs.wait_phase("first", "Succeeded", timeout=KUEUE_TIMEOUT_S)
    jobs.wait_phase("second", ("Running", "Succeeded"), timeout=KUEUE_TIMEOUT_S)
    done = jobs.wait_phase("second", "Succeeded", timeout=KUEUE_TIMEOUT_S)
    assert done["restarts"] == 0
    assert (condition({"status": done}, "Queued").get("status"), condition({"status": done}, "Queued").get("reason")) \
        == ("False", "NotQueued")
    assert condition(kueue.workload(jobs, "second"), "Finished").get("status") == "True"
    assert {"Queued", "Running", "Completed"} <= {e.reason for e in jobs.events("second")}


def test_higher_priority_job_preempts_a_running_one_which_resumes_without_using_a_restart(cluster, operator, jobs,
                                                                                           kueue):
    # maxRestarts 0: if the preemption counted as a restart, the JobSet would fail
    jobs.create(queued_job("low", 20, workloadPriorityClass="low", restart={"maxRestarts": 0}))
    jobs.wait_phase("low", "Running", timeout=KUEUE_TIMEOUT_S)
    first_pods = {p.metadata.name for p in live_pods(jobs, "low")}
    jobs.create(queued_job("high", 3, workloadPriorityClass="high"))
    preempted = wait_reason(jobs, "low", "Preempted")
    evicted = condition(kueue.workload(jobs, "low"), "Evicted")
    assert evicted.get("status") == "True" and evicted.get("reason") == "Preempted", evicted
    assert preempted["phase"] == "Pending" and evicted["message"] in preempted["message"], preempted
    wait_gone(cluster, lambda: [p for p in live_pods(jobs, "low") if p.metadata.name in first_pods],
              "the preempted job's pods stopped", jobs.ns)
    jobs.wait_phase("high", "Succeeded", timeout=KUEUE_TIMEOUT_S)
    # re-admitted once the high-priority job is done; runs to the end on fresh pods
    jobs.wait_phase("low", "Running", timeout=KUEUE_TIMEOUT_S)
    done = jobs.wait_phase("low", "Succeeded", timeout=KUEUE_TIMEOUT_S)
    assert done["restarts"] == 0 and (jobs.jobset("low")["status"].get("restarts") or 0) == 0
    warnings = [e for e in jobs.events("low") if e.reason == "Preempted"]
    assert warnings and warnings[0].type == "Warning" and "preempted by Kueue" in warnings[0].message


def test_suspend_and_resume_under_kueue_go_through_the_workload(cluster, operator, jobs, kueue):
    jobs.create(queued_job("admitted", 15))
    jobs.wait_phase("admitted", "Running", timeout=KUEUE_TIMEOUT_S)
    jobs.create(queued_job("waiting", 3))
    wait_reason(jobs, "waiting", "Queued")

    # a queued job suspended: its Workload is deactivated and it is not admitted when quota frees up
    jobs.patch_spec("waiting", {"suspend": True})
    jobs.wait_phase("waiting", "Suspended", timeout=30)
    cluster.wait_for(lambda: kueue.workload(jobs, "waiting")["spec"].get("active") is False, 30,
                     "the queued job's Workload deactivated", namespace=jobs.ns)

    # an admitted job suspended: Kueue evicts the deactivated Workload and suspends the JobSet for good
    jobs.patch_spec("admitted", {"suspend": True})
    jobs.wait_phase("admitted", "Suspended", timeout=30)
    evicted = cluster.wait_for(lambda: condition(kueue.workload(jobs, "admitted"), "Evicted").get("reason")
                               == "Deactivated" and condition(kueue.workload(jobs, "admitted"), "Evicted"), 30,
                               "the admitted job's Workload evicted as Deactivated", namespace=jobs.ns)
    wait_gone(cluster, lambda: live_pods(jobs, "admitted"), "the suspended job's pods stopped", jobs.ns)

    def both_stay_suspended() -> bool:
        return all(jobs.jobset(n)["spec"]["suspend"] is True and not live_pods(jobs, n)
                   and jobs.phase(n) == "Suspended" for n in ("admitted", "waiting"))

    # no flapping: Kueue does not un-suspend them, and the free quota does not admit the suspended one
    cluster.hold(both_stay_suspended, 6, "both jobs suspended, no pods", namespace=jobs.ns,
                 kinds=("megatronjobs", "jobsets", "workloads", "pods"))
    assert evicted["status"] == "True"

    jobs.patch_spec("admitted", {"suspend": False})
    jobs.patch_spec("waiting", {"suspend": False})
    for name in ("admitted", "waiting"):
        done = jobs.wait_phase(name, "Succeeded", timeout=2 * KUEUE_TIMEOUT_S)
        assert done["restarts"] == 0
        assert kueue.workload(jobs, name)["spec"].get("active") is not False


def test_topology_aware_scheduling_keeps_the_job_in_one_rack(cluster, operator, jobs, kueue):
    """Kueue's TAS from the MegatronJob: podset-required-topology (through spec.podMetadata) on a flavor
    with a Topology of racks and hosts; the kwok nodes carry the rack label."""
    rack = load_cluster_module().RACK_LABEL
    topology, flavor = "e2e-racks", "e2e-tas-p5"
    kueue.use_topology(topology, [rack, "kubernetes.io/hostname"], flavor,
                       {"node.kubernetes.io/instance-type": "p5.48xlarge"}, gpus=32)
    jobs.create(small_job("racked", queueName=QUEUE, numNodes=3, gpusPerNode=8, parallelism={"tensor": 8},
                          podMetadata={"annotations": {**run_for(5)["annotations"],
                                                       "kueue.x-k8s.io/podset-required-topology": rack}}))
    jobs.wait_phase("racked", ("Running", "Succeeded"), timeout=KUEUE_TIMEOUT_S)
    wl = kueue.workload(jobs, "racked")
    (assignment,) = wl["status"]["admission"]["podSetAssignments"]
    assert assignment["flavors"] == {"nvidia.com/gpu": flavor} and assignment.get("topologyAssignment"), assignment
    # Kueue, not chance, placed them: its topology ungater pinned each pod to the host it assigned
    for pod in jobs.pods("racked"):
        assert (pod.spec.node_selector or {}).get("kubernetes.io/hostname") == pod.spec.node_name, pod.spec.node_selector
    nodes = {p.spec.node_name for p in jobs.pods("racked")}
    racks = {jobs.core.read_node(n).metadata.labels[rack] for n in nodes}
    assert len(nodes) == 3 and len(racks) == 1, (nodes, racks)
    jobs.wait_phase("racked", "Succeeded", timeout=KUEUE_TIMEOUT_S)


def test_tp_group_waits_in_the_queue_until_one_host_fits_it_then_lands_there(cluster, crd, jobs, kueue):
    """issue 16, TP-group placement: with the operator's kueueTpGroupTopology setting, a queued job whose
    tensor-parallel group spans pods (TP=2 on 1-GPU pods) is one Kueue PodSet required on one host.
    With 1 GPU free on each of two 2-GPU nodes the job waits in the queue, holding no GPUs (without
    Kueue the group's first pod takes a GPU and its partner waits forever: test_placement.py); once
    a node is free, Kueue admits it there and both pods run on that node."""
    host = "kubernetes.io/hostname"
    topology, flavor = "e2e-hosts", "e2e-tas-2x"
    pool = {"node.kubernetes.io/instance-type": "kwok-2xh100"}  # 2 nodes x 2 GPUs (e2e/cluster NODE_POOLS)
    nodes = ("gpu-2x-00", "gpu-2x-01")
    kueue.use_topology(topology, [host], flavor, pool, gpus=4)
    fillers = [gpu_filler(jobs, n) for n in nodes]  # another team's pods: 1 GPU free on each node
    cluster.wait_for(lambda: all(jobs.core.read_namespaced_pod(f, jobs.ns).spec.node_name for f in fillers) or None,
                     60, "fillers bound", namespace=jobs.ns)
    with alone_with_the_jobs(cluster, jobs.ns):
        op = OperatorProcess(cluster, free_port(), {**SESSION_OPERATOR_ENV,
                                                    "MEGATRON_OPERATOR_KUEUE_TP_GROUP_TOPOLOGY": host})
        op.start()
        try:
            jobs.create(small_job("tp2", queueName=QUEUE, numNodes=2, gpusPerNode=1, parallelism={"tensor": 2},
                                  resources={"nodeSelector": pool}, podMetadata=run_for(5)))
            js = cluster.wait_for(lambda: jobs.jobset("tp2"), 60, "the JobSet", namespace=jobs.ns)
            (rjob,) = js["spec"]["replicatedJobs"]
            assert rjob["template"]["spec"]["template"]["metadata"]["annotations"][
                "kueue.x-k8s.io/podset-required-topology"] == host
            # Kueue tried and found no host for the group: it stays queued, suspended, without pods
            wl = cluster.wait_for(
                lambda: (w := kueue.workload(jobs, "tp2")) and condition(w, "QuotaReserved").get("status") == "False"
                and condition(w, "QuotaReserved").get("message") and w,
                KUEUE_TIMEOUT_S, "Kueue's verdict on the workload", namespace=jobs.ns,
                kinds=("workloads", "jobsets", "pods"))
            verdict = condition(wl, "QuotaReserved")["message"]
            print(f"Kueue: {verdict}")
            assert "topology" in verdict.lower() or "fit" in verdict.lower(), verdict
            assert wait_reason(jobs, "tp2", "Queued")["phase"] == "Pending"
            assert jobs.jobset("tp2")["spec"]["suspend"] is True and live_pods(jobs, "tp2") == []
            # a whole node frees up: Kueue admits the job there, and both pods of the group run on it
            jobs.core.delete_namespaced_pod(fillers[1], jobs.ns, grace_period_seconds=0)
            jobs.wait_phase("tp2", ("Running", "Succeeded"), timeout=KUEUE_TIMEOUT_S)
            pods = cluster.wait_for(lambda: (ps := [p for p in jobs.pods("tp2") if p.spec.node_name]) and len(ps) == 2
                                    and ps, 60, "both pods bound", namespace=jobs.ns)
            assert {p.spec.node_name for p in pods} == {nodes[1]}, [(p.metadata.name, p.spec.node_name) for p in pods]
            for pod in pods:  # Kueue, not chance, put them there
                assert (pod.spec.node_selector or {}).get(host) == nodes[1], pod.spec.node_selector
            done = jobs.wait_phase("tp2", "Succeeded", timeout=KUEUE_TIMEOUT_S)
            assert done["restarts"] == 0
        finally:
            # gone while this operator runs, so the session's operator never sees it when it resumes
            with contextlib.suppress(kubernetes.client.ApiException):
                jobs.delete("tp2")
            wait_gone(cluster, lambda: jobs.jobset("tp2"), "the JobSet of tp2 deleted", jobs.ns)
            op.stop()
