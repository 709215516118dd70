"""The operator process against the real local control plane (API server, scheduler, KCM, JobSet
controller, kwok pods): lifecycle, restarts, crash-safety, invalid specs, progress identity,
garbage collection, stall detection, metrics and events (Kueue: e2e/test_kueue.py)."""

from __future__ import annotations

import json
import signal
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes
import pytest
from k8s import POD_FAIL_EXIT_CODE, POD_FAIL_LABEL
from mjob import Jobs, run_for, small_job, wait_gone

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contract"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))
from megatron_operator.render import render_jobset
from megatron_operator.settings import Settings
from megatron_operator.validation import parse_job
from megatron_trainer.progress import Progress, ProgressWriter

pytestmark = pytest.mark.e2e


def table(text: str) -> list[dict[str, str]]:
    """Rows of a kubectl table, split at the header's column offsets (empty cells stay empty)."""
    lines = text.rstrip("\n").splitlines()
    header = lines[0]
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    names = header.split()
    rows = []
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None], strict=True)]
        rows.append(dict(zip(names, cells, strict=False)))
    return rows


def running_pods(jobs: Jobs, name: str, n: int):
    pods = [p for p in jobs.pods(name) if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
    return pods if len(pods) >= n else None


def test_happy_path_to_succeeded_and_kubectl_get(cluster, operator, jobs):
    jobs.create(small_job("happy", podMetadata=run_for(8)))
    running = jobs.wait_phase("happy", ("Running", "Succeeded"))
    assert running["worldSize"] == 2 and running["layout"] == "1/1/2"
    assert running["jobSetName"] == "happy"
    done = jobs.wait_phase("happy", "Succeeded")
    conds = {c["type"]: c["status"] for c in done["conditions"]}
    assert conds["Succeeded"] == "True" and conds["Running"] == "False" and conds["Created"] == "True"
    assert done["startTime"] <= done["completionTime"]
    out = cluster.kubectl("get", "mj", "-n", jobs.ns).stdout
    assert out.splitlines()[0].split() == ["NAME", "PHASE", "GPUS", "TP/PP/DP", "ITERATION", "RESTARTS", "AGE"]
    (row,) = table(out)
    assert row["NAME"] == "happy" and row["PHASE"] == "Succeeded" and row["GPUS"] == "2"
    assert row["TP/PP/DP"] == "1/1/2" and row["ITERATION"] == "" and row["RESTARTS"] == "0"
    reasons = {e.reason for e in jobs.events("happy")}
    assert "Completed" in reasons, reasons
    # the start-up steps the status tells (Created condition, Pending/PodsStarting, the first Running)
    # get no event (issue 30)
    assert not {"JobSetCreated", "PodsStarting", "Creating", "Running"} & reasons, reasons


def test_failure_restarts_then_succeeds(cluster, operator, jobs):
    jobs.create(small_job("flaky", podMetadata=run_for(20), restart={"maxRestarts": 2}))
    jobs.wait_phase("flaky", "Running")
    first = cluster.wait_for(lambda: running_pods(jobs, "flaky", 2), 60, "2 running pods", namespace=jobs.ns)
    jobs.core.patch_namespaced_pod(first[0].metadata.name, jobs.ns, {"metadata": {
        "labels": {POD_FAIL_LABEL: "true"}, "annotations": {POD_FAIL_EXIT_CODE: "137"}}})
    # kwok restarts the gang in about a second, so rather than racing to see the Restarting phase, check
    # what it leaves behind: the event, the condition's transition, and Running with restarts 1
    cluster.wait_for(lambda: any(e.reason == "GangRestart" for e in jobs.events("flaky")), 60,
                     "a GangRestart event", namespace=jobs.ns)
    st = cluster.wait_for(lambda: (s := jobs.status("flaky")).get("phase") == "Running" and s.get("restarts") == 1
                          and s, 60, "Running again with restarts=1", namespace=jobs.ns)
    # Running after a restart is announced (only a first start is not)
    cluster.wait_for(lambda: any(e.reason == "Running" for e in jobs.events("flaky")), 30,
                     "a Running event after the restart", namespace=jobs.ns)
    restarting = {c["type"]: c for c in st["conditions"]}["Restarting"]
    assert restarting["status"] == "False" and restarting["reason"] == "NotRestarting"
    (row,) = table(cluster.kubectl("get", "mj", "flaky", "-n", jobs.ns).stdout)
    assert row["PHASE"] == "Running" and row["RESTARTS"] == "1"  # Running after a restart, not a condition name
    done = jobs.wait_phase("flaky", "Succeeded", timeout=120)
    assert done["restarts"] == 1


def test_restarts_exhausted_is_failed(cluster, operator, jobs):
    jobs.create(small_job("doomed", podMetadata={"labels": {POD_FAIL_LABEL: "true"},
                                                 "annotations": {POD_FAIL_EXIT_CODE: "1"}},
                          restart={"maxRestarts": 1}))
    st = jobs.wait_phase("doomed", "Failed", timeout=180)
    assert st["reason"] == "RestartsExhausted" and st["restarts"] == 1
    assert {c["type"]: c["status"] for c in st["conditions"]}["Failed"] == "True"


def test_admitted_but_invalid_spec_gets_invalid_spec_and_no_jobset(cluster, operator, jobs):
    # The API server cannot predict memory; the operator's check refuses this one (memoryFit Reject).
    doc = small_job("too-big", numNodes=1, gpusPerNode=1, parallelism={"tensor": 1},
                    model={"preset": "gpt-39.1b"}, resources={"gpuType": "H100-80GB", "memoryFit": "Reject"})
    jobs.create(doc)
    st = jobs.wait_phase("too-big", "Failed")
    assert st["reason"] == "InvalidSpec" and "does not fit" in st["message"]
    assert {c["type"]: c["status"] for c in st["conditions"]}["InvalidSpec"] == "True"
    assert jobs.jobset("too-big") is None
    assert any(e.reason == "InvalidSpec" and e.type == "Warning" for e in jobs.events("too-big"))


def test_progress_with_the_jobs_own_identity(cluster, operator, jobs, tmp_path):
    jobs.create(small_job("mine", podMetadata=run_for(120)))
    jobs.create(small_job("theirs", podMetadata=run_for(120)))
    jobs.wait_phase("mine", ("Pending", "Running"))
    cluster.wait_for(lambda: jobs.core.read_namespaced_service_account("mine-trainer", jobs.ns), 30,
                     "the job's ServiceAccount", namespace=jobs.ns)
    token = jobs.core.create_namespaced_service_account_token(
        "mine-trainer", jobs.ns, {"spec": {"expirationSeconds": 600}}).status.token
    (tmp_path / "token").write_text(token)
    cfg = kubernetes.client.Configuration.get_default_copy()
    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    server, ca = cfg.host, cfg.ssl_ca_cert

    def writer(name):
        return ProgressWriter(server, name, jobs.ns, token_path=str(tmp_path / "token"), ca_path=ca)

    sft = {"lines": 800, "used": 790, "skipped": 10, "truncated": 3, "droppedTooLong": 1, "samples": 135,
           "packingEfficiency": 0.9222, "lossTokens": 4368}
    assert writer("mine").write_now(Progress(iteration=42, train_iters=100, loss=2.5, mfu=0.41,
                                             validation_loss=0.016, data=sft))
    progress = jobs.status("mine")["progress"]
    assert progress["iteration"] == 42 and progress["loss"] == 2.5
    # the SFT figures are in the schema (a structural schema would prune unknown fields silently)
    assert progress["validationLoss"] == 0.016 and progress["data"] == sft
    # the job's identity: its own status, nothing else (kubectl auth can-i as the ServiceAccount)
    sa = f"--as=system:serviceaccount:{jobs.ns}:mine-trainer"

    def can(*request: str) -> bool:
        out = cluster.kubectl("auth", "can-i", *request, "-n", jobs.ns, sa, check=False)
        assert out.stdout.strip() in ("yes", "no"), out.stdout + out.stderr
        return out.stdout.strip() == "yes"

    assert can("patch", "megatronjobs/mine", "--subresource=status")
    for request in (("patch", "megatronjobs/theirs", "--subresource=status"), ("patch", "megatronjobs/mine"),
                    ("list", "megatronjobs"), ("create", "megatronjobs"), ("delete", "megatronjobs/mine"),
                    ("get", "secrets"), ("list", "secrets"), ("create", "pods"), ("create", "pods/exec"),
                    ("get", "configmaps"), ("create", "serviceaccounts/token"), ("patch", "jobsets"),
                    ("create", "rolebindings"), ("get", "persistentvolumeclaims")):
        assert not can(*request), request
    # the same token may not touch another job's status
    assert not writer("theirs").write_now(Progress(iteration=1, train_iters=100))
    req = urllib.request.Request(
        f"{server}/apis/megatron-operator.io/v1alpha1/namespaces/{jobs.ns}/megatronjobs/theirs/status"
        "?fieldManager=megatron-trainer", data=b'{"status": {"progress": {"iteration": 1}}}', method="PATCH",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, context=ssl.create_default_context(cafile=ca), timeout=10)
    assert e.value.code == 403
    # field ownership: the operator's status writes leave progress alone
    cluster.wait_for(lambda: jobs.status("mine").get("phase") == "Running", 60, "mine Running", namespace=jobs.ns)
    managers = {m["manager"]: m for m in jobs.get("mine")["metadata"]["managedFields"]
                if m.get("subresource") == "status"}
    assert "f:progress" in json.dumps(managers["megatron-trainer"]["fieldsV1"])
    assert "f:progress" not in json.dumps(managers["megatron-operator"]["fieldsV1"])
    assert jobs.status("mine")["progress"]["iteration"] == 42
    (row,) = table(cluster.kubectl("get", "mj", "mine", "-n", jobs.ns).stdout)
    assert row["ITERATION"] == "42"


def test_stalled_when_iteration_does_not_move(cluster, operator, jobs, tmp_path):
    jobs.create(small_job("stuck", podMetadata=run_for(120)))
    jobs.wait_phase("stuck", "Running")

    def stalled():
        conds = {c["type"]: c for c in jobs.status("stuck").get("conditions", [])}
        return conds.get("Stalled", {}).get("status") == "True" and conds["Stalled"]

    cond = cluster.wait_for(stalled, 60, "condition Stalled=True (stall timeout 15 s)", namespace=jobs.ns)
    assert "no new iteration" in cond["message"]


def test_delete_garbage_collects_everything(cluster, operator, jobs):
    jobs.create(small_job("gc", podMetadata=run_for(120)))
    cluster.wait_for(lambda: running_pods(jobs, "gc", 2), 60, "pods running", namespace=jobs.ns)
    jobs.delete("gc")
    wait_gone(cluster, lambda: jobs.jobset("gc"), "JobSet gc garbage-collected", jobs.ns)
    wait_gone(cluster, lambda: jobs.pods("gc"), "pods of gc garbage-collected", jobs.ns, timeout=90)
    for read in (lambda: jobs.core.read_namespaced_service_account("gc-trainer", jobs.ns),
                 lambda: jobs.rbac.read_namespaced_role("gc-trainer", jobs.ns),
                 lambda: jobs.rbac.read_namespaced_role_binding("gc-trainer", jobs.ns)):
        wait_gone(cluster, read, "the job's identity garbage-collected", jobs.ns)


def test_no_finalizer_so_delete_works_without_the_operator(cluster, operator, jobs):
    jobs.create(small_job("orphan", podMetadata=run_for(120)))
    jobs.wait_phase("orphan", "Running")
    assert not jobs.get("orphan")["metadata"].get("finalizers")
    operator.kill(signal.SIGKILL)
    try:
        jobs.delete("orphan")
        wait_gone(cluster, lambda: jobs.get("orphan"), "MegatronJob deleted while the operator is down", jobs.ns)
        wait_gone(cluster, lambda: jobs.jobset("orphan"), "its JobSet garbage-collected", jobs.ns)
    finally:
        operator.start()


def test_jobset_deleted_by_hand_is_recreated_unless_finished(cluster, operator, jobs):
    jobs.create(small_job("again", podMetadata=run_for(60)))
    jobs.wait_phase("again", "Running")
    uid = jobs.jobset("again")["metadata"]["uid"]
    jobs.custom.delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", jobs.ns, "jobsets", "again")
    cluster.wait_for(lambda: (js := jobs.jobset("again")) and js["metadata"]["uid"] != uid, 60,
                     "the JobSet recreated", namespace=jobs.ns)
    # events are posted asynchronously: wait for it rather than read once
    cluster.wait_for(lambda: any(e.reason == "JobSetRecreated" for e in jobs.events("again")), 30,
                     "a JobSetRecreated event", namespace=jobs.ns)
    # a finished job's JobSet is never recreated
    jobs.create(small_job("finished", podMetadata=run_for(3)))
    jobs.wait_phase("finished", "Succeeded")
    jobs.custom.delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", jobs.ns, "jobsets", "finished")
    wait_gone(cluster, lambda: jobs.jobset("finished"), "JobSet finished deleted", jobs.ns)
    # several resync ticks (1 s): a bug would recreate it, or change the phase, within this window
    cluster.hold(lambda: jobs.jobset("finished") is None and jobs.phase("finished") == "Succeeded", 5,
                 "a finished job's deleted JobSet stays deleted and the job stays Succeeded", namespace=jobs.ns)


def test_suspend_and_resume(cluster, operator, jobs):
    jobs.create(small_job("pause", podMetadata=run_for(60)))
    jobs.wait_phase("pause", "Running")
    jobs.patch_spec("pause", {"suspend": True})
    jobs.wait_phase("pause", "Suspended")
    wait_gone(cluster, lambda: [p for p in jobs.pods("pause") if not p.metadata.deletion_timestamp],
              "pods stopped while suspended", jobs.ns)
    jobs.patch_spec("pause", {"suspend": False})
    jobs.wait_phase("pause", "Running")


def test_a_layout_change_while_suspended_makes_a_jobset_for_the_new_layout(cluster, operator, jobs):
    """issue 49: suspend, edit spec.parallelism, resume, as a user does it, at the real API server (the CRD's rules)
    and JobSet. The trainer's side (the job resumes from its last checkpoint under the new layout, loss continuing)
    ran on 4 x H100: docs/benchmarks/scale.md#2026-11-27-first-4-gpu-calls."""
    jobs.create(small_job("relayout", podMetadata=run_for(120)))  # 2 pods x 1 GPU: DP=2
    jobs.wait_phase("relayout", "Running")
    with pytest.raises(kubernetes.client.ApiException) as e:  # a running job keeps its layout
        jobs.patch_spec("relayout", {"parallelism": {"pipeline": 2}})
    assert e.value.status == 422 and "spec.parallelism may change only while the job is suspended" in e.value.body
    jobs.patch_spec("relayout", {"suspend": True})
    jobs.wait_phase("relayout", "Suspended")
    before = jobs.jobset("relayout")
    assert before["metadata"]["annotations"]["megatron-operator.io/parallelism"] == \
        '{"context":1,"expert":1,"pipeline":1,"tensor":1}'
    with pytest.raises(kubernetes.client.ApiException) as e:  # the layout rules check the new layout
        jobs.patch_spec("relayout", {"parallelism": {"tensor": 3}})
    assert e.value.status == 422 and "may change only while" not in e.value.body
    jobs.patch_spec("relayout", {"parallelism": {"pipeline": 2}})  # PP=2, DP=1 on the same 2 GPUs

    def remade():
        js = jobs.jobset("relayout")
        return js if js and js["metadata"]["uid"] != before["metadata"]["uid"] else None

    js = cluster.wait_for(remade, 60, "a new JobSet for the new layout", namespace=jobs.ns,
                          kinds=("megatronjobs", "jobsets", "events"))
    assert js["spec"]["suspend"] is True  # still suspended until the user resumes
    assert js["metadata"]["annotations"]["megatron-operator.io/parallelism"] == \
        '{"context":1,"expert":1,"pipeline":2,"tensor":1}'
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert "--pipeline-model-parallel-size 2" in " ".join(container.get("command", []) + container.get("args", []))
    (ev,) = [e for e in jobs.events("relayout") if e.reason == "LayoutChanged"]
    assert '"pipeline":2' in ev.message and "resumes from its last checkpoint" in ev.message
    jobs.patch_spec("relayout", {"suspend": False})
    st = jobs.wait_phase("relayout", "Running")
    assert st["layout"] == "1/2/1" and st["parallelism"]["pipeline"] == 2


def test_operator_killed_mid_burst_leaves_exactly_one_jobset_each(cluster, operator, jobs):
    n = 50
    for i in range(n):
        jobs.create(small_job(f"burst-{i:02d}", numNodes=1, podMetadata=run_for(2)))
        if i == 20:
            operator.kill(signal.SIGKILL)
    operator.start()

    def all_done():
        sets = jobs.jobsets()
        phases = [(j.get("status") or {}).get("phase") for j in
                  jobs.custom.list_namespaced_custom_object("megatron-operator.io", "v1alpha1", jobs.ns,
                                                            "megatronjobs")["items"]]
        return len(sets) == n and all(p == "Succeeded" for p in phases) and (len(sets), phases)

    cluster.wait_for(all_done, 300, f"{n} JobSets and {n} Succeeded MegatronJobs after an operator SIGKILL",
                     namespace=jobs.ns, kinds=("megatronjobs", "jobsets"))
    names = sorted(j["metadata"]["name"] for j in jobs.jobsets())
    assert names == [f"burst-{i:02d}" for i in range(n)]
    for js in jobs.jobsets():
        (ref,) = js["metadata"]["ownerReferences"]
        assert ref["kind"] == "MegatronJob" and ref["name"] == js["metadata"]["name"]


def test_metrics_and_healthz(cluster, operator, jobs):
    jobs.create(small_job("metered", podMetadata=run_for(2)))
    jobs.wait_phase("metered", "Succeeded")
    text = operator.metrics()
    assert 'megatron_operator_jobs{phase="Succeeded"}' in text
    assert "megatron_operator_jobset_creation_seconds_count" in text
    assert 'megatron_operator_reconciles_total{kind="MegatronJob",result="success"}' in text
    assert operator.healthy()


def test_a_name_taken_by_a_foreign_object_is_never_used(cluster, operator, jobs):
    """A ServiceAccount (or JobSet) that already carries a child's name is not borrowed: the job
    stays Pending with reason NotOwned, creates nothing after it, and leaves the object untouched."""
    # someone else's identity, e.g. bound to a cloud IAM role
    jobs.core.create_namespaced_service_account(jobs.ns, {"metadata": {
        "name": "victim-trainer", "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/admin"}}})
    jobs.create(small_job("victim", podMetadata=run_for(5)))
    st = cluster.wait_for(lambda: (s := jobs.status("victim")).get("reason") == "NotOwned" and s, 60,
                          "reason NotOwned", namespace=jobs.ns)
    assert st["phase"] == "Pending"
    assert f"ServiceAccount {jobs.ns}/victim-trainer already exists and is not controlled" in st["message"]
    created = {c["type"]: c for c in st["conditions"]}["Created"]
    assert created["status"] == "False" and created["reason"] == "NotOwned"
    assert any(e.reason == "NotOwned" and e.type == "Warning" for e in jobs.events("victim"))
    assert jobs.jobset("victim") is None  # nothing after the conflicting child
    sa = jobs.core.read_namespaced_service_account("victim-trainer", jobs.ns)
    assert not sa.metadata.owner_references  # untouched
    for read in (lambda: jobs.rbac.read_namespaced_role("victim-trainer", jobs.ns),
                 lambda: jobs.rbac.read_namespaced_role_binding("victim-trainer", jobs.ns)):
        with pytest.raises(kubernetes.client.ApiException) as e:
            read()
        assert e.value.status == 404
    # once the object is gone, the job creates its own identity and runs
    jobs.core.delete_namespaced_service_account("victim-trainer", jobs.ns)
    jobs.wait_phase("victim", "Succeeded")
    (ref,) = jobs.core.read_namespaced_service_account("victim-trainer", jobs.ns).metadata.owner_references
    assert ref.uid == jobs.get("victim")["metadata"]["uid"] and ref.controller

    # a JobSet of the job's name that the job does not control, even with the operator's labels
    foreign = render_jobset(parse_job({**small_job("taken"), "metadata": {"name": "taken", "namespace": jobs.ns}}),
                            Settings())
    foreign["spec"]["suspend"] = True
    jobs.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", jobs.ns, "jobsets", foreign)
    jobs.create(small_job("taken", activeDeadlineSeconds=1))
    st = cluster.wait_for(lambda: (s := jobs.status("taken")).get("reason") == "NotOwned" and s, 60,
                          "reason NotOwned for the JobSet", namespace=jobs.ns)
    assert f"JobSet {jobs.ns}/taken already exists" in st["message"]
    js = jobs.jobset("taken")
    assert js["spec"]["suspend"] is True and not js["metadata"].get("ownerReferences")  # not resumed, not adopted
    time.sleep(3)  # several resync ticks (1 s): a bug would delete it for the 1 s deadline, or un-suspend it
    js = jobs.jobset("taken")
    assert js is not None and js["spec"]["suspend"] is True


def test_a_trainer_token_cannot_defeat_the_deadline_by_writing_the_operators_fields(cluster, operator, jobs, tmp_path):
    """The job's own token may patch its status. A forged phase and a far-future startTime written
    with it are not believed (managedFields name the writer), also by an operator that restarted
    and so has no memory of its own writes: activeDeadlineSeconds still ends the job."""
    jobs.create(small_job("forger", podMetadata=run_for(300), activeDeadlineSeconds=20))
    jobs.wait_phase("forger", "Running")
    token = jobs.core.create_namespaced_service_account_token(
        "forger-trainer", jobs.ns, {"spec": {"expirationSeconds": 600}}).status.token
    cfg = kubernetes.client.Configuration.get_default_copy()
    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    # phase Failed alone would make an operator that believed it stop acting on the job (JobSet kept)
    forged = {"status": {"phase": "Failed", "reason": "Forged", "startTime": "2999-01-01T00:00:00Z",
                         "lastProgressTime": "2999-01-01T00:00:00.5Z"}}
    req = urllib.request.Request(
        f"{cfg.host}/apis/megatron-operator.io/v1alpha1/namespaces/{jobs.ns}/megatronjobs/forger/status"
        "?fieldManager=megatron-trainer", data=json.dumps(forged).encode(), method="PATCH",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
    operator.kill(signal.SIGKILL)  # no cache of its own writes after the restart
    try:
        with urllib.request.urlopen(req, context=ssl.create_default_context(cafile=cfg.ssl_ca_cert), timeout=10) as r:
            assert json.load(r)["status"]["startTime"] == "2999-01-01T00:00:00Z"  # the write itself is allowed
    finally:
        operator.start()
    st = cluster.wait_for(lambda: (s := jobs.status("forger")).get("reason") == "DeadlineExceeded" and s, 90,
                          "Failed with reason DeadlineExceeded", namespace=jobs.ns)
    assert st["phase"] == "Failed" and not st["startTime"].startswith("2999")
    wait_gone(cluster, lambda: jobs.jobset("forger"), "the JobSet deleted on the deadline", jobs.ns)
