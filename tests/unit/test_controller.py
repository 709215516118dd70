"""Controller decisions, table-driven, through a fake ``Kube`` (no cluster; milliseconds).

What the e2e tests prove against the real control plane, decided here first: create the children
once, recreate a JobSet deleted while the job was unfinished, never recreate one of a finished job,
delete the JobSet on a deadline, make the JobSet's suspend follow the spec (never un-suspend under
Kueue, through the Workload's spec.active), write the status only when it changed, trust the cache
of the operator's own writes between resyncs, and refuse an invalid spec with one status write and no children.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from factory import make_job
from megatron_operator import controller as controller_mod
from megatron_operator import status as st
from megatron_operator.controller import Controller
from megatron_operator.kube import NotOwned
from megatron_operator.metrics import Metrics
from megatron_operator.settings import Settings

UID = "00000000-0000-0000-0000-000000000001"


@dataclass
class FakeKube:
    """The calls the controller makes, recorded; ``existing`` holds (kind, name) already there,
    ``workload`` the Kueue Workload that ``find_workload`` answers."""

    existing: set[tuple[str, str]] = field(default_factory=set)
    foreign: set[tuple[str, str]] = field(default_factory=set)  # taken by objects the job does not control
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    workload: dict[str, Any] | None = None

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        key = (obj["kind"], obj["metadata"]["name"])
        self.calls.append(("create", *key))
        if key in self.foreign:
            raise NotOwned(key[0], "team-a", key[1], "it has no controller")
        if key in self.existing:
            return None
        self.existing.add(key)
        return {**obj, "metadata": {**obj["metadata"], "uid": f"{obj['kind']}-uid",
                                    "creationTimestamp": st.iso(datetime.now(UTC))}}

    def apply_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.calls.append(("status", status["phase"], status["reason"]))

    def set_jobset_suspend(self, namespace: str, name: str, suspend: bool) -> None:
        self.calls.append(("suspend", name, suspend))

    def delete_jobset(self, namespace: str, name: str) -> None:
        self.calls.append(("delete", name))

    def find_workload(self, namespace: str, jobset_uid: str) -> dict[str, Any] | None:
        self.calls.append(("find_workload", jobset_uid))
        return self.workload

    def set_workload_active(self, namespace: str, name: str, active: bool) -> None:
        self.calls.append(("active", name, active))

    def of(self, verb: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == verb]


def body(status: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    job = make_job(**overrides)
    job["metadata"].update(uid=UID, generation=1, creationTimestamp=st.iso(datetime.now(UTC)))
    if status is not None:
        job["status"] = status
    return job


def jobset(suspended: bool = False, restarts: int = 0, created: datetime | None = None, owner: str = UID,
           **conditions: str) -> dict[str, Any]:
    return {"metadata": {"name": "job", "uid": "js-uid", "creationTimestamp": st.iso(created or datetime.now(UTC)),
                         "ownerReferences": [{"kind": "MegatronJob", "name": "job", "uid": owner, "controller": True}]},
            "spec": {"suspend": suspended},
            "status": {"restarts": restarts,
                       "conditions": [{"type": k, "status": "True", "reason": v, "message": v}
                                      for k, v in conditions.items()]}}


def running_pods(n: int = 2) -> list[st.PodView]:
    return [st.PodView(name=f"job-p{i}", phase="Running", ready=True, restart_attempt=0) for i in range(n)]


@pytest.fixture
def kube() -> FakeKube:
    return FakeKube()


@pytest.fixture
def ctl(kube: FakeKube) -> Controller:
    return Controller(kube, Settings(), Metrics())  # type: ignore[arg-type]


def observe(ctl: Controller, b: dict[str, Any], js: dict[str, Any] | None, pods=(), resync=False):
    events: list[st.Event] = []
    ctl.observe(b, js, list(pods), events.append, resync=resync)
    return events


def refused(ctl: Controller, b: dict[str, Any]) -> list:
    """Observe a job the operator must refuse: its problems (the status says Failed/InvalidSpec)."""
    observe(ctl, b, None)
    problems = ctl.parse(b).problems
    assert problems, "the operator accepted it"
    return problems


# ---- create / resume ---------------------------------------------------------------------------

def test_a_new_job_gets_every_child_once_and_409_is_success(ctl, kube):
    events = observe(ctl, body(), None)
    kinds = [c[1] for c in kube.of("create")]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "JobSet"]
    assert [e.reason for e in events] == []  # the Created condition says it (issue 30: one write less per job)
    restarted = Controller(kube, Settings(), Metrics())  # type: ignore[arg-type]
    events = observe(restarted, body(), None)  # an operator restart before the JobSet was seen
    assert len(kube.of("create")) == 8 and "JobSetCreated" not in [e.reason for e in events]


def test_observations_before_the_jobset_watch_event_create_nothing_more(ctl, kube, monkeypatch):
    # The first observation creates the children; later ones that still find no JobSet in the index
    # (its watch event is on the way; our own status write is one such event) must not repeat four
    # creates that all answer 409.
    observe(ctl, body(), None)
    observe(ctl, body(), None)
    assert len(kube.of("create")) == 4
    # one status write, derived from the JobSet just created (not "creating the JobSet", which the
    # JobSet's watch event would replace a moment later with a second write)
    assert kube.of("status") == [("status", "Pending", "PodsStarting")]
    observe(ctl, body(), jobset())  # the watch delivered it
    assert len(kube.of("status")) == 1
    observe(ctl, body(status={"phase": "Running", "jobSetName": "job"}), None)  # then it was deleted
    assert [c[1] for c in kube.of("create")][4:] == ["ServiceAccount", "Role", "RoleBinding", "JobSet"]
    other = body()
    other["metadata"]["uid"] = "00000000-0000-0000-0000-000000000002"  # a new object with the same name
    observe(ctl, other, None)
    assert len(kube.of("create")) == 12
    # a JobSet deleted before its watch event ever arrived is recreated once the grace period is over
    monkeypatch.setattr(controller_mod, "JOBSET_WATCH_GRACE_S", 0.0)
    observe(ctl, other, None)
    assert len(kube.of("create")) == 16


def test_a_finished_job_gets_no_children(ctl, kube):
    observe(ctl, body(status={"phase": "Succeeded", "reason": "Completed", "jobSetName": "job"}), None)
    assert kube.of("create") == []


def test_invalid_spec_writes_failed_status_once_and_creates_nothing(ctl, kube):
    b = body(training__globalBatchSize=33)
    (problem,) = refused(ctl, b)
    assert "globalBatchSize" in problem.message
    observe(ctl, b, None)  # the next event changes nothing
    assert kube.of("create") == []
    assert kube.of("status") == [("status", "Failed", "InvalidSpec")]


@pytest.mark.parametrize("overrides", [dict(numNodes=0), dict(numNodes="two"), dict(gpusPerNode=None),
                                       dict(parallelism={"tensor": "x"})])
def test_status_of_a_spec_the_models_refuse_has_no_layout(ctl, kube, overrides):
    """Nothing is derived from a refused spec: no layout columns, and no crash on a zero world size."""
    written = []
    kube.apply_status = lambda ns, name, status: written.append(status)
    observe(ctl, body(**overrides), None)
    assert [(s["phase"], s["reason"]) for s in written] == [("Failed", "InvalidSpec")]
    assert not {"worldSize", "layout", "parallelism"} & set(written[0])
    assert kube.of("create") == []


# ---- observe: act on the difference ------------------------------------------------------------

@pytest.mark.parametrize(("status", "expect_create", "expect_event"), [
    # a JobSet deleted while the job ran is recreated and the user told why
    ({"phase": "Running", "reason": "AllPodsRunning", "jobSetName": "job"}, True, "JobSetRecreated"),
    # a finished job's JobSet (deleted by hand or by TTL) is never recreated
    ({"phase": "Succeeded", "reason": "Completed", "jobSetName": "job"}, False, None),
    ({"phase": "Failed", "reason": "RestartsExhausted", "jobSetName": "job"}, False, None),
])
def test_missing_jobset(ctl, kube, status, expect_create, expect_event):
    kube.existing |= {("ServiceAccount", "job-trainer"), ("Role", "job-trainer"), ("RoleBinding", "job-trainer")}
    events = observe(ctl, body(status=status), None)
    created = [c for c in kube.of("create") if c[1] == "JobSet"]
    assert bool(created) is expect_create
    assert (expect_event in [e.reason for e in events]) if expect_event else not created


def test_deadline_deletes_the_jobset_and_fails_the_job(ctl, kube):
    start = datetime.now(UTC) - timedelta(hours=2)
    b = body(status={"phase": "Running", "reason": "AllPodsRunning", "startTime": st.iso(start)},
             activeDeadlineSeconds=60)
    events = observe(ctl, b, jobset(created=start), running_pods())
    assert kube.of("delete") == [("delete", "job")]
    assert kube.of("status")[-1] == ("status", "Failed", "DeadlineExceeded")
    assert any(e.reason == "DeadlineExceeded" and e.type == "Warning" for e in events)


def workload(active: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": "jobset-job-1a2b3"}, "spec": {"active": active}, "status": {}}


@pytest.mark.parametrize(("spec_suspend", "queue", "js_suspended", "wl", "expected"), [
    (True, None, False, None, [("suspend", "job", True)]),      # user suspends
    (False, None, True, None, [("suspend", "job", False)]),     # user resumes
    (False, None, False, None, []),                             # nothing to do
    # Under Kueue never the JobSet's suspend (Kueue undoes it while admitted): the Workload's spec.active
    (True, "gpu-queue", False, workload(), [("active", "jobset-job-1a2b3", False)]),   # suspend admitted
    (True, "gpu-queue", True, workload(), [("active", "jobset-job-1a2b3", False)]),    # suspend queued
    (True, "gpu-queue", True, workload(active=False), []),                           # already inactive
    (False, "gpu-queue", True, workload(active=False), [("active", "jobset-job-1a2b3", True)]),  # resume
    (False, "gpu-queue", True, workload(), []),                 # queued: admission is Kueue's call
    (True, "gpu-queue", True, None, []),                        # no Workload yet: next observation
])
def test_suspend_follows_the_spec(ctl, kube, spec_suspend, queue, js_suspended, wl, expected):
    overrides: dict[str, Any] = {"suspend": spec_suspend}
    if queue:
        overrides["queueName"] = queue
    kube.workload = wl
    observe(ctl, body(status={"phase": "Running", "reason": "AllPodsRunning"}, **overrides),
            jobset(suspended=js_suspended), running_pods())
    assert kube.of("suspend") + kube.of("active") == expected


def test_workload_is_read_only_while_queued_or_suspending(ctl, kube):
    kube.workload = workload()
    observe(ctl, body(status={"phase": "Running", "reason": "AllPodsRunning"}, queueName="q"), jobset(), running_pods())
    assert kube.of("find_workload") == []  # an admitted, running job costs no extra API call
    observe(ctl, body(queueName="q"), jobset(suspended=True))
    assert kube.of("find_workload") == [("find_workload", "js-uid")]


# ---- status writes -----------------------------------------------------------------------------

def test_status_is_written_once_per_change_and_the_own_write_cache_is_trusted(ctl, kube):
    stale = body(status={})  # the watch cache has not seen our write yet
    observe(ctl, stale, jobset(), running_pods())
    assert kube.of("status") == [("status", "Running", "AllPodsRunning")]
    events = observe(ctl, stale, jobset(), running_pods())  # same world, stale body: nothing again
    assert kube.of("status") == [("status", "Running", "AllPodsRunning")] and events == []


def test_resync_compares_with_the_stored_status_and_repairs_a_lost_write(ctl, kube):
    stale = body(status={})
    observe(ctl, stale, jobset(), running_pods())
    observe(ctl, stale, jobset(), running_pods(), resync=True)  # the stored status still lacks our write
    assert len(kube.of("status")) == 2


def test_a_new_object_with_the_same_name_does_not_inherit_the_cache(ctl, kube):
    observe(ctl, body(status={}), jobset(), running_pods())
    again = body(status={})
    again["metadata"]["uid"] = "00000000-0000-0000-0000-000000000002"
    observe(ctl, again, jobset(), running_pods())
    assert len(kube.of("status")) == 2


def test_completed_jobset_gives_succeeded_and_no_further_action(ctl, kube):
    b = body(status={"phase": "Running", "reason": "AllPodsRunning", "jobSetName": "job"})
    observe(ctl, b, jobset(Completed="AllJobsCompleted"))
    assert kube.of("status")[-1][1] == "Succeeded"
    assert kube.of("suspend") == [] and kube.of("delete") == [] and kube.of("create") == []


# ---- children whose names are taken by objects the job does not control -------------------------

@pytest.mark.parametrize("kind", ["ServiceAccount", "Role", "RoleBinding", "JobSet"])
def test_a_foreign_child_is_never_used_and_the_job_says_which(ctl, kube, kind):
    name = "job" if kind == "JobSet" else "job-trainer"
    kube.foreign.add((kind, name))
    events = observe(ctl, body(), None)
    kinds = [c[1] for c in kube.of("create")]
    assert kinds[-1] == kind and "JobSet" not in [k for k in kinds if k != kind]  # nothing after it
    phase, reason = kube.of("status")[-1][1:]
    assert (phase, reason) == ("Pending", "NotOwned")
    (warning,) = [e for e in events if e.reason == "NotOwned"]
    assert warning.type == "Warning" and f"{kind} team-a/{name} already exists" in warning.message


def test_not_owned_resolves_once_the_foreign_object_is_gone(ctl, kube):
    kube.foreign.add(("ServiceAccount", "job-trainer"))
    observe(ctl, body(), None)
    kube.foreign.clear()  # e.g. the previous same-named job's children were garbage-collected
    observe(ctl, body(status={"phase": "Pending", "reason": "NotOwned"}), None)
    assert [c[1] for c in kube.of("create")][-4:] == ["ServiceAccount", "Role", "RoleBinding", "JobSet"]
    assert kube.of("status")[-1][1:] == ("Pending", "PodsStarting")


def test_a_jobset_of_the_same_name_controlled_by_another_object_is_ignored(ctl, kube):
    kube.existing |= {("ServiceAccount", "job-trainer"), ("Role", "job-trainer"), ("RoleBinding", "job-trainer")}
    kube.foreign.add(("JobSet", "job"))
    b = body(status={"phase": "Running", "reason": "AllPodsRunning"}, activeDeadlineSeconds=1)
    old = datetime.now(UTC) - timedelta(hours=1)
    observe(ctl, b, jobset(suspended=True, created=old, owner="someone-else"), running_pods())
    assert kube.of("delete") == [] and kube.of("suspend") == []  # never acts on another's JobSet
    assert kube.of("status")[-1][1:] == ("Pending", "NotOwned")


def test_a_status_that_cannot_be_read_is_derived_afresh_not_frozen(ctl, kube):
    # e.g. a writer put a string where the operator keeps a count
    b = body(status={"phase": "Running", "reason": "AllPodsRunning", "restarts": "many",
                     "progress": {"iteration": 7}})
    observe(ctl, b, jobset(), running_pods())
    assert kube.of("status") == [("status", "Running", "AllPodsRunning")]


def test_operator_fields_another_writer_changed_are_not_believed(ctl, kube):
    """A trainer token may patch its own status: a terminal phase and a far-future startTime written
    by it (managedFields say so) neither stop the job nor defeat activeDeadlineSeconds."""
    start = datetime.now(UTC) - timedelta(hours=2)
    b = body(status={"phase": "Failed", "reason": "Whatever", "startTime": "2999-01-01T00:00:00Z",
                     "jobSetName": "job"}, activeDeadlineSeconds=60)
    b["metadata"]["managedFields"] = [
        {"manager": "megatron-operator", "operation": "Apply", "subresource": "status",
         "fieldsV1": {"f:status": {"f:phase": {}, "f:reason": {}}}},
        {"manager": "megatron-trainer", "operation": "Update", "subresource": "status",
         "fieldsV1": {"f:status": {"f:phase": {}, "f:startTime": {}, "f:progress": {}}}}]
    observe(ctl, b, jobset(created=start), running_pods())
    assert kube.of("delete") == [("delete", "job")]
    assert kube.of("status")[-1] == ("status", "Failed", "DeadlineExceeded")


def test_foreign_fields_reads_managed_fields_defensively():
    assert st.foreign_fields(None) == set() and st.foreign_fields("x") == set()
    assert st.foreign_fields([{"manager": "kubectl-edit", "fieldsV1": {"f:status": {"f:restarts": {}, "f:progress": {},
                                                                                      "f:nonsense": {}}}},
                              {"manager": "megatron-operator", "fieldsV1": {"f:status": {"f:phase": {}}}},
                              "junk", {"manager": "x", "fieldsV1": None}]) == {"restarts"}


def test_spec_warnings_are_events_when_the_jobset_is_created(ctl, kube):
    events = observe(ctl, body(resources={"memory": "8Gi"}), None)
    (w,) = [e for e in events if e.reason == "SpecWarning"]
    assert w.type == "Warning" and "/dev/shm" in w.message


# ---- the cluster admin's guardrails ---------------------------------------------------------------

@pytest.mark.parametrize(("settings", "overrides", "rule"), [
    (dict(allowed_image_registries="nvcr.io,registry.example.com/ml"), dict(image="docker.io/evil/img:1"),
     "guardrail-image-registry"),
    (dict(allowed_image_registries="registry.example.com/ml"), dict(image="registry.example.com/mlx/img"),
     "guardrail-image-registry"),  # a prefix is a whole path segment
    (dict(allowed_priority_classes="batch-low"), dict(priorityClassName="system-node-critical"),
     "guardrail-priority-class"),
    (dict(allowed_toleration_keys="nvidia.com/gpu"), dict(resources={"tolerations": [{"operator": "Exists"}]}),
     "guardrail-toleration-key"),
    (dict(allowed_node_selector_keys="node.kubernetes.io/instance-type"),
     dict(resources={"nodeSelector": {"kubernetes.io/hostname": "n1"}}), "guardrail-node-selector-key"),
    (dict(max_termination_grace_period_s=900), dict(terminationGracePeriodSeconds=86400), "guardrail-grace-period"),
    (dict(require_queue_name=True), {}, "guardrail-queue-name"),
    (dict(deny_secret_env=True), dict(env=[{"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
     "guardrail-secret-env"),
    (dict(deny_image_pull_secrets=True), dict(imagePullSecrets=["regcred"]), "guardrail-image-pull-secrets"),
    (dict(denied_metadata_keys="container.apparmor.security.beta.kubernetes.io/,app"),
     dict(podMetadata={"annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}),
     "guardrail-metadata-key"),
    (dict(denied_metadata_keys="eks.amazonaws.com/,app"), dict(podMetadata={"labels": {"app": "frontend"}}),
     "guardrail-metadata-key"),
])
def test_guardrails_refuse_before_any_child(kube, settings, overrides, rule):
    ctl = Controller(kube, Settings(**settings), Metrics())  # type: ignore[arg-type]
    problems = refused(ctl, body(**overrides))
    assert [p.rule for p in problems] == [rule]
    assert problems[0].message.startswith(problems[0].field + ":")
    assert kube.of("create") == [] and kube.of("status") == [("status", "Failed", "InvalidSpec")]


@pytest.mark.parametrize(("overrides", "rule"), [
    (dict(podMetadata={"annotations": {"iam.amazonaws.com/role": "arn:aws:iam::1:role/admin"}}),
     "guardrail-metadata-key"),
    (dict(podMetadata={"annotations": {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}),
     "guardrail-metadata-key"),
    (dict(podMetadata={"labels": {"azure.workload.identity/use": "true"}}), "guardrail-metadata-key"),
    (dict(terminationGracePeriodSeconds=7200), "guardrail-grace-period"),
])
def test_default_guardrails_refuse_identity_confinement_and_long_grace(kube, overrides, rule):
    ctl = Controller(kube, Settings(), Metrics())
    assert [p.rule for p in refused(ctl, body(**overrides))] == [rule]
    assert kube.of("create") == []


def test_guardrails_allow_what_they_list(kube):
    settings = Settings(allowed_image_registries="nvcr.io", allowed_priority_classes="batch-low",
                        allowed_toleration_keys="nvidia.com/gpu", require_queue_name=True, deny_secret_env=True,
                        max_termination_grace_period_s=900, denied_metadata_keys="app")
    ctl = Controller(kube, settings, Metrics())  # type: ignore[arg-type]
    observe(ctl, body(image="nvcr.io/nvidia/pytorch:25.01", priorityClassName="batch-low", queueName="q",
                      terminationGracePeriodSeconds=900, resources={"tolerations": [
                          {"key": "nvidia.com/gpu", "operator": "Exists"}]},
                      podMetadata={"labels": {"team": "nlp"}}), None)
    assert [c[1] for c in kube.of("create")] == ["ServiceAccount", "Role", "RoleBinding", "JobSet"]


def test_a_jobset_too_large_to_store_is_refused_before_any_child(ctl, kube):
    # 32 groups x 64 env values of 4 KiB: about 8 MiB, over what etcd stores
    big_env = [{"name": f"E{i}", "value": "x" * 4096} for i in range(64)]
    b = body(numNodes=64, parallelism={"tensor": 16}, model__numAttentionHeads=16, training__globalBatchSize=64,
             env=big_env)
    problems = refused(ctl, b)
    assert [p.rule for p in problems] == ["jobset-size"]
    assert "MiB" in problems[0].message and kube.of("create") == []


def failed_pod(code: int, node: str = "gpu-7", disruption: str | None = None) -> st.PodView:
    doc = {"metadata": {"name": "job-p0", "labels": {"jobset.sigs.k8s.io/restart-attempt": "0"}},
           "spec": {"nodeName": node},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": {
               "exitCode": code, "reason": "Error", "finishedAt": "2026-11-23T05:00:00Z"}}}]}}
    if disruption:
        doc["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": disruption,
                                        "message": "m"}]
    return st.PodView.from_pod(doc)


def test_pods_of_a_deleted_jobset_do_not_count_for_its_successor(ctl, kube):
    # After a stall restart or a node blame the old gang's pods linger until garbage collection;
    # they must not make the new JobSet look Running.
    old_gang = [st.PodView(name=f"job-old{i}", phase="Running", ready=True, restart_attempt=0,
                           jobset_uid="old-js-uid") for i in range(2)]
    b = body(status={"phase": "Pending", "reason": "PodsStarting", "jobSetName": "job"})
    observe(ctl, b, jobset(), old_gang)
    assert kube.of("status")[-1][1:] == ("Pending", "PodsStarting")
    new_gang = [st.PodView(name=f"job-new{i}", phase="Running", ready=True, restart_attempt=0,
                           jobset_uid="js-uid") for i in range(2)]
    observe(ctl, b, jobset(), old_gang + new_gang)
    assert kube.of("status")[-1][1:] == ("Running", "AllPodsRunning")


def test_a_gpu_fault_recreates_the_jobset_once_with_the_node_excluded(ctl, kube):
    created: list[dict] = []
    create = kube.create
    kube.create = lambda obj: (created.append(obj), create(obj))[1]  # type: ignore[method-assign]
    kube.existing |= {("ServiceAccount", "job-trainer"), ("Role", "job-trainer"), ("RoleBinding", "job-trainer")}
    running = {"phase": "Running", "reason": "AllPodsRunning", "jobSetName": "job"}
    pods = [failed_pod(6), *running_pods(1)]
    events = observe(ctl, body(status=running), jobset(restarts=1), pods)
    assert kube.of("delete") == [("delete", "job")]
    assert "AvoidingNode" in [e.reason for e in events]
    observe(ctl, body(status=running), jobset(restarts=1), pods)  # the own-write cache: deleted once
    assert len(kube.of("delete")) == 1
    observe(ctl, body(status=running), None, [failed_pod(6)])  # gone: recreated without the node
    (js,) = [o for o in created if o["kind"] == "JobSet"]
    terms = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    assert terms["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-7"]}]}]


def test_an_nccl_peer_is_blamed_by_the_ip_of_a_pod_seen_before_the_gang_was_torn_down(ctl, kube):
    running = {"phase": "Running", "reason": "AllPodsRunning", "jobSetName": "job"}
    peer = st.PodView(name="job-p1", phase="Running", ready=True, restart_attempt=0, ip="10.4.0.7", node="gpu-9")
    observe(ctl, body(status=running), jobset(), [peer, *running_pods(1)])
    reporter = failed_pod(1)  # on gpu-7; its peer's pod is already gone when the failure is observed
    reporter = st.PodView(**{**reporter.__dict__, "failure": st.PodFailure(
        pod="job-p0", node="gpu-7", exit_code=1, reason="Error", finished_at="2026-11-23T05:00:00Z",
        restart_attempt=0, message="Last error:\nNET/IB: Got completion from peer 10.4.0.7<43617> with status=12")})
    events = observe(ctl, body(status=running), jobset(restarts=1), [reporter])
    assert kube.of("delete") == [("delete", "job")]  # gpu-9 is Ready: the JobSet is recreated without it
    (ev,) = [e for e in events if e.reason == "AvoidingNode"]
    assert "gpu-9" in ev.message and "10.4.0.7" in ev.message


@pytest.mark.parametrize("pod", [failed_pod(143, disruption="DeletionByTaintManager"), failed_pod(1)])
def test_other_failures_leave_the_jobset_to_its_own_gang_restart(ctl, kube, pod):
    # A node not ready is tainted NoSchedule, so JobSet's own restart avoids it (it is still recorded,
    # for any later JobSet); an ordinary error blames no node.
    running = {"phase": "Running", "reason": "AllPodsRunning", "jobSetName": "job"}
    observe(ctl, body(status=running), jobset(restarts=1), [pod, *running_pods(1)])
    assert kube.of("delete") == []


@pytest.mark.parametrize("on_stall, deletes", [(True, 1), (False, 0)])
def test_on_stall_deletes_the_jobset_once_so_that_it_is_recreated(ctl, kube, on_stall, deletes):
    long_ago = datetime.now(UTC) - timedelta(hours=2)
    status = {"phase": "Running", "reason": "AllPodsRunning", "startTime": st.iso(long_ago),
              "progress": {"iteration": 5}, "lastProgressIteration": 5, "lastProgressTime": st.iso(long_ago)}
    b = body(status=status, restart={"onStall": on_stall})
    events = observe(ctl, b, jobset(created=long_ago), running_pods())
    assert len(kube.of("delete")) == deletes
    assert any(e.reason == "StallRestart" for e in events) is on_stall
    observe(ctl, b, jobset(created=long_ago), running_pods())  # the own-write cache: no second restart
    assert len(kube.of("delete")) == deletes


def test_a_layout_changed_while_suspended_gets_a_new_jobset_for_it(ctl, kube):
    """spec.parallelism may change while the job is suspended (the CRD's rule): a suspended JobSet rendered for
    another parallelism is deleted once, with an event, and the next pass creates one for the new layout."""
    from megatron_operator.names import ANNOTATION_PARALLELISM
    from megatron_operator.render import parallelism_key
    from megatron_operator.validation import parse_job

    created: list[dict] = []
    create = kube.create
    kube.create = lambda obj: (created.append(obj), create(obj))[1]  # type: ignore[method-assign]
    kube.existing |= {("ServiceAccount", "job-trainer"), ("Role", "job-trainer"), ("RoleBinding", "job-trainer")}
    suspended = {"phase": "Suspended", "reason": "Suspended", "jobSetName": "job"}
    old = body(status=suspended, suspend=True)
    new = body(status=suspended, suspend=True, parallelism={"tensor": 1, "pipeline": 2})
    new["metadata"]["generation"] = 2  # a spec change
    old_key, new_key = parallelism_key(parse_job(old)), parallelism_key(parse_job(new))
    assert old_key != new_key and '"tensor":1' in new_key

    def js(key: str, suspend: bool = True) -> dict:
        j = jobset(suspended=suspend)
        j["metadata"]["annotations"] = {ANNOTATION_PARALLELISM: key}
        return j

    assert observe(ctl, old, js(old_key)) == [] and kube.of("delete") == []  # the layout it was made for
    events = observe(ctl, new, js(old_key))
    assert kube.of("delete") == [("delete", "job")]
    (ev,) = [e for e in events if e.reason == "LayoutChanged"]
    assert old_key in ev.message and new_key in ev.message
    observe(ctl, new, None)  # gone: made again, still suspended, for the new layout
    (made,) = [o for o in created if o["kind"] == "JobSet"]
    assert made["metadata"]["annotations"][ANNOTATION_PARALLELISM] == new_key and made["spec"]["suspend"] is True
    container = made["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert "--pipeline-model-parallel-size 2" in " ".join(container.get("command", []) + container.get("args", []))
    # a running JobSet is never deleted for it (the CRD allows the change only while suspended), nor one made
    # before the annotation existed
    kube.calls.clear()
    observe(ctl, new, js(old_key, suspend=False), running_pods())
    legacy = jobset(suspended=True)
    observe(ctl, new, legacy)
    assert kube.of("delete") == []


# ---- TP groups that collided on one host ---------------------------------------------------------------------

_AFFINITY = "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match pod affinity rules."


def collided_pods(js_uid: str = "js-uid") -> list[st.PodView]:
    """Both TP groups' first pods on n1 (room for one group), both partners waiting for n1."""
    def pod(name: str, group: str, node: str | None) -> st.PodView:
        return st.PodView(name=name, phase="Running" if node else "Pending", restart_attempt=0, node=node,
                          unschedulable=None if node else _AFFINITY, tp_group=group, jobset_uid=js_uid)
    return [pod("job-tp0-0-0-a", "0", "n1"), pod("job-tp1-1-0-b", "1", "n1"),
            pod("job-tp0-1-0-c", "0", None), pod("job-tp1-0-0-d", "1", None)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(controller_mod, "time", c)
    return c


def test_tp_groups_that_collided_get_a_new_jobset_after_the_setting_and_then_a_longer_wait(ctl, kube, clock):
    tp2 = dict(numNodes=4, gpusPerNode=1, parallelism={"tensor": 2},
               training={"microBatchSize": 1, "globalBatchSize": 2, "trainIters": 1})
    b = body(status={"phase": "Pending", "reason": "Unschedulable", "jobSetName": "job"}, **tp2)
    assert observe(ctl, b, jobset(), collided_pods()) == []  # seen: the clock starts
    clock.t += 29
    observe(ctl, b, jobset(), collided_pods())
    assert kube.of("delete") == []
    clock.t += 1  # settings.tp_group_collision_s (30) after it was first seen
    events = observe(ctl, b, jobset(), collided_pods())
    assert kube.of("delete") == [("delete", "job")]
    (ev,) = [e for e in events if e.reason == "TPGroupsCollided"]
    assert ev.type == "Warning" and "group 0 and group 1 of this job started on node n1" in ev.message
    assert "re-placement 1 of this job" in ev.message
    observe(ctl, b, jobset(), collided_pods())  # the deleted JobSet still in the cache: not deleted twice
    assert len(kube.of("delete")) == 1
    # the new JobSet's pods collide again: the second re-placement waits twice as long
    observe(ctl, b, None, [])  # gone from the cache: made again
    assert kube.of("create")[-1][1] == "JobSet"
    new = jobset()
    new["metadata"]["uid"] = "js-uid-2"
    clock.t += 100
    observe(ctl, b, new, collided_pods("js-uid-2"))
    clock.t += 59
    observe(ctl, b, new, collided_pods("js-uid-2"))
    assert len(kube.of("delete")) == 1
    clock.t += 1
    observe(ctl, b, new, collided_pods("js-uid-2"))
    assert len(kube.of("delete")) == 2


def test_a_collision_that_resolves_itself_within_the_setting_changes_nothing(ctl, kube, clock):
    b = body(status={"phase": "Pending", "reason": "Unschedulable", "jobSetName": "job"})
    observe(ctl, b, jobset(), collided_pods())
    clock.t += 20
    placed = [st.PodView(name=p.name, phase="Running", restart_attempt=0, node=p.node or "n2", tp_group=p.tp_group,
                         jobset_uid="js-uid") for p in collided_pods()]  # the host freed room meanwhile
    observe(ctl, b, jobset(), placed)
    clock.t += 20
    observe(ctl, b, jobset(), collided_pods())  # a new collision: its own 30 s
    assert kube.of("delete") == []


@pytest.mark.parametrize("settings, js", [
    (Settings(tp_group_collision_s=0), jobset()),  # turned off
    (Settings(), jobset(suspended=True)),  # suspended: the pods are going anyway
])
def test_no_re_placement_when_off_or_suspended(kube, clock, settings, js):
    ctl = Controller(kube, settings, Metrics())  # type: ignore[arg-type]
    b = body(status={"phase": "Pending", "reason": "Unschedulable", "jobSetName": "job"})
    for _ in range(3):
        observe(ctl, b, js, collided_pods())
        clock.t += 1000
    assert kube.of("delete") == []


def test_tp_group_collision_s_is_never_negative():
    with pytest.raises(ValueError, match="negative"):
        Settings(tp_group_collision_s=-1)
