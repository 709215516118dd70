"""status.derive(): phases, reasons, conditions and events from observed children (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from factory import make_job
from megatron_operator.kueue import WorkloadView
from megatron_operator.memory import FitReport, estimate
from megatron_operator.rules import Problem
from megatron_operator.status import (
    JobSetView,
    Observation,
    PodView,
    changed,
    derive,
    iso,
    tp_group_collision,
)
from megatron_operator.validation import parse_job

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
LAYOUT = {"tensor": 2, "pipeline": 2, "context": 1, "expert": 1, "data": 4}


def js(restarts=0, suspended=False, **conds):
    return JobSetView(name="job", suspended=suspended, restarts=restarts,
                      conditions={k: {"status": "True", "reason": v[0], "message": v[1]} for k, v in conds.items()},
                      created=iso(NOW - timedelta(minutes=5)))


def pods(n, phase="Running", attempt=0, **kw):
    return [PodView(name=f"p{i}", phase=phase, restart_attempt=attempt, **kw) for i in range(n)]


def obs(**kw):
    base = dict(name="job", generation=1, num_nodes=2, world_size=16, layout=LAYOUT, suspend=False,
                queue_name=None, previous={})
    base.update(kw)
    return Observation(**base)


def cond(status, kind):
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_no_jobset_yet_is_pending_creating():
    s, _ = derive(obs(), NOW)
    assert (s["phase"], s["reason"]) == ("Pending", "Creating")
    assert cond(s, "Created")["status"] == "False"


def test_unschedulable_pod_gives_the_schedulers_message():
    p = [PodView("p0", "Pending", unschedulable="0/19 nodes are available: 19 Insufficient nvidia.com/gpu."),
         PodView("p1", "Pending")]
    s, events = derive(obs(jobset=js(), pods=p), NOW)
    assert (s["phase"], s["reason"]) == ("Pending", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in s["message"]
    assert events and events[0].type == "Warning"


def test_image_pull_backoff_is_the_pending_reason():
    p = [PodView("p0", "Pending", waiting_reason="ImagePullBackOff", waiting_message="pull access denied")]
    s, _ = derive(obs(jobset=js(), pods=p), NOW)
    assert (s["phase"], s["reason"]) == ("Pending", "ImagePullBackOff")


@pytest.mark.parametrize(("observed", "event"), [
    (dict(), None),  # Creating: the status says it
    (dict(jobset=js(), pods=pods(2, phase="Pending")), None),  # PodsStarting: the status says it
    (dict(jobset=js(), pods=[PodView("p0", "Pending", waiting_reason="ImagePullBackOff")]),
     ("Normal", "ImagePullBackOff")),  # a reason to wait: an event, as every other phase change
    (dict(jobset=js(), pods=[PodView("p0", "Pending", unschedulable="0/1 nodes are available")]),
     ("Warning", "Unschedulable")),
    (dict(jobset=js(), pods=pods(2)), None),  # a first start: phase, Running condition and startTime say it
])
def test_start_up_phases_that_the_status_tells_get_no_event(observed, event):
    # issue 30: one API write per job and phase in a burst, for an event that repeats the status
    _, events = derive(obs(**observed), NOW)
    assert [(e.type, e.reason) for e in events] == ([event] if event else [])


def test_a_plain_first_start_posts_no_running_event():
    """Creating -> PodsStarting -> Running, each status written: no event at any step (issue 30), and
    the status says each phase."""
    creating, events = derive(obs(), NOW)
    assert (creating["phase"], creating["reason"], events) == ("Pending", "Creating", [])
    starting, events = derive(obs(jobset=js(), pods=pods(2, phase="Pending"), previous=creating), NOW)
    assert (starting["phase"], starting["reason"], events) == ("Pending", "PodsStarting", [])
    running, events = derive(obs(jobset=js(), pods=pods(2), previous=starting), NOW)
    assert (running["phase"], running["startTime"], events) == ("Running", iso(NOW), [])
    assert cond(running, "Running")["status"] == "True"


@pytest.mark.parametrize("waiting", [
    dict(jobset=js(), pods=[PodView("p0", "Pending", waiting_reason="ImagePullBackOff")]),
    dict(jobset=js(), pods=[PodView("p0", "Pending", unschedulable="0/1 nodes are available")]),
    dict(jobset=js(suspended=True), queue_name="team"),  # Queued for Kueue
    dict(jobset=js(suspended=True), suspend=True),  # Suspended
])
def test_running_after_a_wait_that_had_an_event_gets_one(waiting):
    """A job's events do not end on a wait that is over: Running after Queued, Unschedulable, a
    container's waiting reason or a suspension is announced."""
    waited, events = derive(obs(**waiting), NOW)
    assert len(events) == 1 and waited["phase"] in ("Pending", "Suspended")
    extra = {"queue_name": "team"} if "queue_name" in waiting else {}
    running, events = derive(obs(jobset=js(), pods=pods(2), previous=waited, **extra), NOW)
    assert running["phase"] == "Running"
    assert [(e.type, e.reason) for e in events] == [("Normal", "Running")]


def test_a_kueue_job_keeps_its_running_event_through_pods_starting():
    queued, events = derive(obs(jobset=js(suspended=True), queue_name="team"), NOW)
    assert [e.reason for e in events] == ["Queued"]
    admitted, events = derive(obs(jobset=js(), pods=pods(2, phase="Pending"), queue_name="team", previous=queued), NOW)
    assert (admitted["reason"], events) == ("PodsStarting", [])
    running, events = derive(obs(jobset=js(), pods=pods(2), queue_name="team", previous=admitted), NOW)
    assert [(e.type, e.reason) for e in events] == [("Normal", "Running")]


def test_a_wait_outside_kueue_then_pods_starting_then_running_has_no_running_event():
    """The trade made for issue 30, as documented (docs/troubleshooting.md): the status does not
    remember an earlier wait, so once PodsStarting was written the first Running is a plain start. The
    pods' own events (Scheduled, Pulled) close their waits."""
    waited, _ = derive(obs(jobset=js(), pods=[PodView("p0", "Pending", unschedulable="0/1 nodes are available")]),
                       NOW)
    starting, _ = derive(obs(jobset=js(), pods=pods(2, phase="Pending"), previous=waited), NOW)
    running, events = derive(obs(jobset=js(), pods=pods(2), previous=starting), NOW)
    assert (running["phase"], events) == ("Running", [])


def test_running_after_a_restart_gets_an_event():
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    p = pods(2, attempt=0, terminating=True) + pods(1, phase="Pending", attempt=1)
    restarting, _ = derive(obs(jobset=js(restarts=1), pods=p, previous=running), NOW + timedelta(minutes=1))
    back, events = derive(obs(jobset=js(restarts=1), pods=pods(2, attempt=1), previous=restarting),
                          NOW + timedelta(minutes=2))
    assert back["phase"] == "Running" and [e.reason for e in events] == ["Running"]


def test_all_pods_running_is_running_and_start_time_is_set_once():
    s, events = derive(obs(jobset=js(), pods=pods(2)), NOW)
    assert s["phase"] == "Running" and s["startTime"] == iso(NOW)
    assert cond(s, "Running")["status"] == "True" and cond(s, "Created")["status"] == "True"
    assert events == []  # a first start: the status says it (issue 30)
    later, _ = derive(obs(jobset=js(), pods=pods(2), previous=s), NOW + timedelta(hours=1))
    assert later["startTime"] == iso(NOW)


def test_restart_is_restarting_until_the_new_attempt_runs():
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    # attempt 1: old pods terminating, new ones pending
    p = pods(2, attempt=0, terminating=True) + pods(1, phase="Pending", attempt=1)
    s, events = derive(obs(jobset=js(restarts=1), pods=p, previous=running), NOW + timedelta(minutes=1))
    assert (s["phase"], s["restarts"]) == ("Restarting", 1)
    assert cond(s, "Restarting")["status"] == "True" and cond(s, "Running")["status"] == "False"
    assert events[0].type == "Warning"
    back, _ = derive(obs(jobset=js(restarts=1), pods=pods(2, attempt=1), previous=s), NOW + timedelta(minutes=2))
    assert back["phase"] == "Running" and back["restarts"] == 1


def test_pods_of_an_old_attempt_do_not_count_as_running():
    s, _ = derive(obs(jobset=js(restarts=2), pods=pods(2, attempt=1)), NOW)
    assert s["phase"] == "Restarting"


def test_succeeded_and_completion_time():
    s, _ = derive(obs(jobset=js(Completed=("AllJobsCompleted", "jobset completed successfully")), pods=[]), NOW)
    assert s["phase"] == "Succeeded" and s["completionTime"] == iso(NOW)
    assert cond(s, "Succeeded")["status"] == "True"


def test_restarts_exhausted_is_failed_with_reason():
    s, events = derive(obs(jobset=js(restarts=3, Failed=("ReachedMaxRestarts", "jobset failed due to reaching "
                                                                               "max number of restarts"))), NOW)
    assert (s["phase"], s["reason"]) == ("Failed", "RestartsExhausted")
    assert events[0].type == "Warning"


def test_invalid_spec_is_failed_with_condition():
    p = [Problem("spec.training.globalBatchSize", "spec.training.globalBatchSize: 100 is not divisible", "r")]
    s, events = derive(obs(problems=p), NOW)
    assert (s["phase"], s["reason"]) == ("Failed", "InvalidSpec")
    assert cond(s, "InvalidSpec")["status"] == "True"
    assert "globalBatchSize" in cond(s, "InvalidSpec")["message"]
    assert events[0].reason == "InvalidSpec" and events[0].type == "Warning"


def test_finished_job_stays_finished_when_its_jobset_is_gone():
    done, _ = derive(obs(jobset=js(Completed=("AllJobsCompleted", "ok"))), NOW)
    s, events = derive(obs(jobset=None, previous=done), NOW + timedelta(hours=1))
    assert s["phase"] == "Succeeded" and not events
    assert not changed(done, s)


def test_unfinished_job_without_jobset_is_pending_again():
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    s, _ = derive(obs(jobset=None, previous=running), NOW + timedelta(minutes=1))
    assert (s["phase"], s["reason"]) == ("Pending", "Creating")
    assert s["startTime"] == running["startTime"]


def test_suspended_and_kueue_queued():
    s, _ = derive(obs(jobset=js(suspended=True), suspend=True), NOW)
    assert s["phase"] == "Suspended" and cond(s, "Suspended")["status"] == "True"
    assert "Queued" not in {c["type"] for c in s["conditions"]}  # no queueName: no Queued condition
    q, _ = derive(obs(jobset=js(suspended=True), queue_name="team"), NOW)
    assert (q["phase"], q["reason"]) == ("Pending", "Queued")


def kueue_workload(**conds):
    return WorkloadView.from_workload({"metadata": {"name": "wl"}, "spec": {}, "status": {"conditions": [
        {"type": k, "status": v[0], "reason": v[1], "message": v[2]} for k, v in conds.items()]}})


def test_kueue_messages_in_queued_and_preempted():
    waiting = "couldn't assign flavors to pod set workers: insufficient unused quota for nvidia.com/gpu"
    q, events = derive(obs(jobset=js(suspended=True), queue_name="team",
                           workload=kueue_workload(QuotaReserved=("False", "Pending", waiting))), NOW)
    assert (q["phase"], q["reason"]) == ("Pending", "Queued")
    assert q["message"] == f"waiting for Kueue to admit the job from queue team: {waiting}"
    # in a condition too (kubectl wait --for=condition=Queued=false, Argo CD), with Kueue's words
    assert (cond(q, "Queued")["status"], cond(q, "Queued")["reason"]) == ("True", "Queued")
    assert waiting in cond(q, "Queued")["message"]
    admitted, _ = derive(obs(jobset=js(), pods=pods(2), queue_name="team", previous=q), NOW)
    assert (cond(admitted, "Queued")["status"], cond(admitted, "Queued")["reason"]) == ("False", "NotQueued")
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    preempted = "Preempted to accommodate a workload (UID: u) due to prioritization in the ClusterQueue"
    p, events = derive(obs(jobset=js(suspended=True), queue_name="team", previous=running,
                           workload=kueue_workload(Evicted=("True", "Preempted", preempted))), NOW)
    assert (p["phase"], p["reason"]) == ("Pending", "Preempted") and preempted in p["message"]
    assert (cond(p, "Queued")["status"], cond(p, "Queued")["reason"]) == ("True", "Preempted")
    assert p["restarts"] == 0
    assert [(e.type, e.reason) for e in events] == [("Warning", "Preempted")]


def test_disruption_restart_is_reported_and_not_counted():
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    evicted = JobSetView(name="job", suspended=False, restarts=1, disruptions=1, conditions={}, created=iso(NOW))
    s, events = derive(obs(jobset=evicted, pods=pods(2, attempt=1), previous=running), NOW)
    assert (s["phase"], s["reason"], s["restarts"], s["disruptions"]) == ("Restarting", "Disruption", 1, 1)
    assert "does not count against maxRestarts (0 counted)" in s["message"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "Disruption")]
    # a failure afterwards is a counted gang restart
    failed = JobSetView(name="job", suspended=False, restarts=2, disruptions=1, conditions={}, created=iso(NOW))
    f, _ = derive(obs(jobset=failed, pods=pods(2, attempt=2), previous=s), NOW)
    assert (f["reason"], f["restarts"], f["disruptions"]) == ("GangRestart", 2, 1)


def test_deadline_exceeded():
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    s, _ = derive(obs(jobset=js(), pods=pods(2), previous=running, deadline_s=60), NOW + timedelta(seconds=61))
    assert (s["phase"], s["reason"]) == ("Failed", "DeadlineExceeded")


def test_completion_wins_over_a_late_deadline_check():
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    s, _ = derive(obs(jobset=js(Completed=("AllJobsCompleted", "ok")), previous=running, deadline_s=60),
                  NOW + timedelta(hours=1))
    assert s["phase"] == "Succeeded"


def test_transition_time_kept_unless_the_condition_flips():
    first, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    again, events = derive(obs(jobset=js(), pods=pods(2), previous=first), NOW + timedelta(minutes=10))
    assert cond(again, "Running")["lastTransitionTime"] == cond(first, "Running")["lastTransitionTime"]
    assert not events and not changed(first, again)


def test_stalled_after_timeout_without_new_iteration():
    running, _ = derive(obs(jobset=js(), pods=pods(2), previous={"progress": {"iteration": 10}}), NOW)
    assert cond(running, "Stalled")["status"] == "False"
    prev = {**running, "progress": {"iteration": 10}}
    s, events = derive(obs(jobset=js(), pods=pods(2), previous=prev, stall_timeout_s=600), NOW + timedelta(minutes=11))
    assert cond(s, "Stalled")["status"] == "True"
    assert [e.reason for e in events] == ["Stalled"]
    # progress resumes: Stalled flips back, and the clock restarts
    prev2 = {**s, "progress": {"iteration": 11}}
    s2, _ = derive(obs(jobset=js(), pods=pods(2), previous=prev2, stall_timeout_s=600), NOW + timedelta(minutes=12))
    assert cond(s2, "Stalled")["status"] == "False" and s2["lastProgressIteration"] == 11


def test_new_iterations_recorded_at_most_four_times_per_stall_timeout():
    """The trainer reports progress every 30 s; the operator records a new iteration (one status write)
    only once a quarter of the stall timeout has passed since the last record, and Stalled is never early."""
    first, _ = derive(obs(jobset=js(), pods=pods(2), previous={"progress": {"iteration": 10}},
                          stall_timeout_s=600), NOW)
    assert first["lastProgressIteration"] == 10 and first["lastProgressTime"] == iso(NOW)
    prev = first
    for k in range(1, 5):  # reports at 30 s intervals, within 150 s (600 / 4): nothing to write
        s, _ = derive(obs(jobset=js(), pods=pods(2), previous={**prev, "progress": {"iteration": 10 + k}},
                          stall_timeout_s=600), NOW + timedelta(seconds=30 * k))
        assert not changed(first, s), k
    later, _ = derive(obs(jobset=js(), pods=pods(2), previous={**first, "progress": {"iteration": 16}},
                          stall_timeout_s=600), NOW + timedelta(seconds=150))
    assert later["lastProgressIteration"] == 16 and later["lastProgressTime"] == iso(NOW + timedelta(seconds=150))
    # past the timeout with an iteration never recorded: recorded now, not Stalled
    late, events = derive(obs(jobset=js(), pods=pods(2), previous={**first, "progress": {"iteration": 12}},
                              stall_timeout_s=600), NOW + timedelta(seconds=601))
    assert cond(late, "Stalled")["status"] == "False" and late["lastProgressIteration"] == 12 and not events
    # the same iteration past the timeout: Stalled
    stalled, events = derive(obs(jobset=js(), pods=pods(2), previous={**first, "progress": {"iteration": 10}},
                                 stall_timeout_s=600), NOW + timedelta(seconds=601))
    assert cond(stalled, "Stalled")["status"] == "True" and [e.reason for e in events] == ["Stalled"]


def test_stall_clock_starts_when_the_new_gang_is_running():
    """After a stall restart the new gang's start-up (slower than the stall timeout here) is not
    counted: a second restart came right after the first when the pods took longer to run (e2e flake)."""
    prev = {"phase": "Running", "startTime": iso(NOW - timedelta(hours=1)), "stallRestarts": 1,
            "lastProgressTime": iso(NOW - timedelta(seconds=40))}  # the restart, 40 s ago
    starting, _ = derive(obs(jobset=js(), pods=pods(2, phase="Pending"), previous=prev, stall_timeout_s=15),
                         NOW - timedelta(seconds=1))
    assert starting["phase"] != "Running"
    running, events = derive(obs(jobset=js(), pods=pods(2), previous=starting, stall_timeout_s=15), NOW)
    assert running["phase"] == "Running" and running["stallRestarts"] == 1
    assert [e.reason for e in events] == ["Running"]  # no Stalled, no StallRestart
    assert cond(running, "Stalled")["status"] == "False"
    stalled, _ = derive(obs(jobset=js(), pods=pods(2), previous=running, stall_timeout_s=15),
                        NOW + timedelta(seconds=16))
    assert cond(stalled, "Stalled")["status"] == "True"


def test_operator_never_writes_progress():
    s, _ = derive(obs(jobset=js(), pods=pods(2), previous={"progress": {"iteration": 5, "loss": 2.0}}), NOW)
    assert "progress" not in s


def test_layout_column_and_world_size():
    s, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    assert s["layout"] == "2/2/4" and s["worldSize"] == 16 and s["parallelism"]["data"] == 4


def test_memory_fit_condition():
    job = parse_job(make_job(model={"preset": "gpt-18.4b"}, parallelism={"tensor": 1, "pipeline": 1},
                             numNodes=1, gpusPerNode=1, training={"trainIters": 1, "microBatchSize": 1},
                             resources={"gpuType": "H100-80GB"}))
    fit = FitReport(estimate(job), 79.6)
    s, events = derive(obs(fit=fit), NOW)
    assert cond(s, "MemoryFit")["status"] == "False" and s["memory"]["fits"] is False
    assert any(e.reason == "PredictedOutOfMemory" for e in events)


@pytest.mark.parametrize("phase", ["Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"])
def test_exactly_one_core_phase_condition_is_true(phase):
    cases = {
        "Pending": obs(jobset=js(), pods=pods(1, phase="Pending")),
        "Running": obs(jobset=js(), pods=pods(2)),
        "Restarting": obs(jobset=js(restarts=1), pods=[]),
        "Succeeded": obs(jobset=js(Completed=("AllJobsCompleted", ""))),
        "Failed": obs(jobset=js(Failed=("FailedJobs", ""))),
        "Suspended": obs(jobset=js(suspended=True), suspend=True),
    }
    s, _ = derive(cases[phase], NOW)
    assert s["phase"] == phase
    true = [c["type"] for c in s["conditions"] if c["status"] == "True" and c["type"] in
            ("Running", "Restarting", "Suspended", "Succeeded", "Failed")]
    assert true == ([] if phase == "Pending" else [phase])


def test_every_restart_is_reported_as_restarting_once():
    running, _ = derive(obs(jobset=js(), pods=pods(2)), NOW)
    # the operator looks again only after the new pods already run
    s, events = derive(obs(jobset=js(restarts=1), pods=pods(2, attempt=1), previous=running), NOW)
    assert (s["phase"], s["reason"], s["restarts"]) == ("Restarting", "GangRestart", 1)
    assert [e.reason for e in events] == ["GangRestart"]
    s2, _ = derive(obs(jobset=js(restarts=1), pods=pods(2, attempt=1), previous=s), NOW)
    assert s2["phase"] == "Running"


# ---- a status some writer filled badly (issue 15) ---------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("2026-01-01T00:00:00Z", datetime(2026, 1, 1, tzinfo=UTC)),
    ("2026-01-01T00:00:00.5Z", datetime(2026, 1, 1, 0, 0, 0, 500000, tzinfo=UTC)),
    ("2026-01-01T00:00:00.123456789Z", datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)),
    ("2026-01-01t02:00:00+02:00", datetime(2026, 1, 1, tzinfo=UTC)),
    ("2026-01-01 00:00:00-01:30", datetime(2026, 1, 1, 1, 30, tzinfo=UTC)),
    ("2026-13-01T00:00:00Z", None),
    ("yesterday", None),
    ("2026-01-01T00:00:00", None),  # RFC 3339 needs an offset
    (12345, None),
    ("", None),
])
def test_rfc3339_times_are_parsed_fully_and_nothing_raises(text, expected):
    from megatron_operator.status import parse_time
    assert parse_time(text) == expected


def test_a_future_start_time_does_not_defeat_the_deadline():
    prev = {"phase": "Running", "reason": "AllPodsRunning", "startTime": iso(NOW + timedelta(days=3650))}
    s, events = derive(obs(jobset=js(), pods=pods(2), previous=prev, deadline_s=60), NOW)
    # counted from the JobSet's creation (5 minutes ago) instead
    assert (s["phase"], s["reason"]) == ("Failed", "DeadlineExceeded")
    assert s.get("startTime") != prev["startTime"]  # the future value is not kept


def test_a_fractional_start_time_counts_for_the_deadline():
    prev = {"phase": "Running", "reason": "AllPodsRunning", "startTime": "2026-11-21T11:00:00.5Z"}
    s, _ = derive(obs(jobset=js(), pods=pods(2), previous=prev, deadline_s=60), NOW)
    assert s["reason"] == "DeadlineExceeded"


def test_future_or_garbage_times_elsewhere_do_not_freeze_the_status():
    prev = {"phase": "Running", "reason": "AllPodsRunning", "startTime": "not a time",
            "lastProgressIteration": 5, "lastProgressTime": iso(NOW + timedelta(days=1)),
            "progress": {"iteration": 5},
            "conditions": [{"type": "Running", "status": "True", "reason": "AllPodsRunning",
                            "lastTransitionTime": "garbage"}]}
    s, _ = derive(obs(jobset=js(), pods=pods(2), previous=prev, stall_timeout_s=10), NOW)
    assert s["phase"] == "Running" and s["startTime"] == iso(NOW)
    assert cond(s, "Running")["lastTransitionTime"] == iso(NOW)
    assert s["lastProgressTime"] == iso(NOW)  # a future time restarts the stall clock now, never freezes it


@pytest.mark.parametrize("stage, message", [
    ("loading checkpoint 500", "2 pods running; trainer: loading checkpoint 500"),
    ("building the data index", "2 pods running; trainer: building the data index"),
    ("training", "2 pods running"),
    (None, "2 pods running"),
])
def test_running_message_shows_the_trainers_start_up_stage(stage, message):
    previous = {"phase": "Running", "progress": {"trainIters": 100, **({"stage": stage} if stage else {})}}
    s, _ = derive(obs(jobset=js(), pods=pods(2), previous=previous), NOW)
    assert s["message"] == message


def test_on_stall_restarts_the_gang_once_per_stall_and_counts_it():
    prev = {"phase": "Running", "reason": "AllPodsRunning", "startTime": iso(NOW - timedelta(hours=2)),
            "progress": {"iteration": 5}, "lastProgressIteration": 5,
            "lastProgressTime": iso(NOW - timedelta(hours=1))}
    off, events = derive(obs(jobset=js(), pods=pods(2), previous=prev, stall_timeout_s=1800), NOW)
    assert "stallRestarts" not in off and "StallRestart" not in [e.reason for e in events]
    s, events = derive(obs(jobset=js(), pods=pods(2), previous=prev, stall_timeout_s=1800,
                           restart_on_stall=True), NOW)
    assert s["stallRestarts"] == 1 and s["lastProgressTime"] == iso(NOW)  # the clock restarts with the gang
    assert "restarting the gang from the last checkpoint (stall restart 1)" in cond(s, "Stalled")["message"]
    assert [e.reason for e in events if e.reason.startswith("Stall")] == ["Stalled", "StallRestart"]
    # the next pass (new gang starting) does not restart again until the timeout passes once more
    again, events = derive(obs(jobset=js(), pods=pods(2), previous=s, stall_timeout_s=1800, restart_on_stall=True),
                           NOW + timedelta(minutes=10))
    assert again["stallRestarts"] == 1 and cond(again, "Stalled")["status"] == "False"
    later, _ = derive(obs(jobset=js(), pods=pods(2), previous=again, stall_timeout_s=1800, restart_on_stall=True),
                      NOW + timedelta(minutes=31))
    assert later["stallRestarts"] == 2


def test_on_stall_without_any_progress_report_does_not_loop():
    prev = {"phase": "Running", "reason": "AllPodsRunning", "startTime": iso(NOW - timedelta(hours=2))}
    s, _ = derive(obs(jobset=js(), pods=pods(2), previous=prev, stall_timeout_s=1800, restart_on_stall=True), NOW)
    assert s["stallRestarts"] == 1
    again, _ = derive(obs(jobset=js(), pods=pods(2), previous=s, stall_timeout_s=1800, restart_on_stall=True),
                      NOW + timedelta(seconds=30))
    assert again["stallRestarts"] == 1


def test_a_checkpoint_warning_of_the_trainer_becomes_a_condition_and_one_event():
    warning = ("saves every 10 iterations (~12 s) come faster than one is written (the save of iteration 20 took "
               "95 s): the loop waited 83.0 s for it. A save interval of at least 96 iterations avoids it.")
    running = {"progress": {"iteration": 30, "saveWarning": warning}}
    s, events = derive(obs(jobset=js(), pods=pods(2), previous=running), NOW)
    assert cond(s, "CheckpointWarning") | {"lastTransitionTime": None} == {
        "type": "CheckpointWarning", "status": "True", "reason": "SaveWarning", "message": warning,
        "lastTransitionTime": None, "observedGeneration": 1}
    assert [e.reason for e in events].count("SaveWarning") == 1
    again, events = derive(obs(jobset=js(), pods=pods(2), previous={**s, "progress": running["progress"]}), NOW)
    assert "SaveWarning" not in [e.reason for e in events]  # one event per warning, not per derivation
    cleared, _ = derive(obs(jobset=js(), pods=pods(2), previous={**again, "progress": {"iteration": 40}}), NOW)
    assert cond(cleared, "CheckpointWarning")["status"] == "False"
    plain, _ = derive(obs(jobset=js(), pods=pods(2), previous={"progress": {"iteration": 5}}), NOW)
    assert all(c["type"] != "CheckpointWarning" for c in plain["conditions"])


# ---- sidecars (spec.pod.initContainers with restartPolicy Always; issue 53) ------------------------------------

def _pod_with_sidecar(restarts: int, phase: str = "Running", exit_code: int = 3) -> dict:
    return {"metadata": {"name": "job-worker-0-0", "labels": {"jobset.sigs.k8s.io/restart-attempt": "0"}},
            "spec": {"initContainers": [{"name": "prefetch"}, {"name": "logs", "restartPolicy": "Always"}]},
            "status": {"phase": phase, "initContainerStatuses": [
                {"name": "prefetch", "restartCount": 0, "state": {"terminated": {"exitCode": 0}}},
                {"name": "logs", "restartCount": restarts,
                 "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error"}} if restarts else {},
                 "state": {"running": {}}}]}}


def test_a_restarted_sidecar_is_a_warning_condition_and_one_event_not_a_failure():
    pod = PodView.from_pod(_pod_with_sidecar(2))
    assert pod.sidecar_failure == "pod job-worker-0-0: sidecar logs restarted 2 times (last: exit code 3, Error)"
    assert pod.failure is None
    s, events = derive(obs(jobset=js(), pods=[pod, PodView(name="p1", phase="Running", restart_attempt=0)]), NOW)
    assert s["phase"] == "Running"
    c = cond(s, "SidecarWarning")
    assert (c["status"], c["reason"]) == ("True", "SidecarRestarted") and "sidecar logs" in c["message"]
    assert [e.reason for e in events if e.type == "Warning"] == ["SidecarRestarted"]
    assert "lastFailure" not in s
    # the next observation: the same condition, no second event
    s2, events2 = derive(obs(jobset=js(), pods=[pod, PodView(name="p1", phase="Running", restart_attempt=0)],
                             previous=s), NOW + timedelta(seconds=5))
    assert cond(s2, "SidecarWarning")["lastTransitionTime"] == c["lastTransitionTime"]
    assert not [e for e in events2 if e.reason == "SidecarRestarted"]


def test_a_job_whose_sidecar_crashed_is_succeeded_and_keeps_the_warning_after_its_pods_are_gone():
    done = PodView.from_pod(_pod_with_sidecar(1, phase="Succeeded"))
    completed = js(Completed=("AllJobsCompleted", "jobset completed successfully"))
    s, _ = derive(obs(jobset=completed, pods=[done]), NOW)
    assert s["phase"] == "Succeeded" and cond(s, "SidecarWarning")["status"] == "True"
    s2, _ = derive(obs(jobset=completed, pods=[], previous=s), NOW + timedelta(minutes=1))
    assert s2["phase"] == "Succeeded" and cond(s2, "SidecarWarning") == cond(s, "SidecarWarning")


def test_no_sidecar_condition_without_restarts_and_false_after_a_new_gang():
    quiet = PodView.from_pod(_pod_with_sidecar(0))
    assert quiet.sidecar_failure is None
    s, _ = derive(obs(jobset=js(), pods=[quiet, quiet]), NOW)
    assert "SidecarWarning" not in {c["type"] for c in s["conditions"]}
    # a plain init container that restarted is not a sidecar (and a pod whose init container fails has failed)
    plain = _pod_with_sidecar(0)
    plain["status"]["initContainerStatuses"][0]["restartCount"] = 1
    assert PodView.from_pod(plain).sidecar_failure is None
    warned, _ = derive(obs(jobset=js(), pods=[PodView.from_pod(_pod_with_sidecar(1)), quiet]), NOW)
    s, _ = derive(obs(jobset=js(), pods=[quiet, quiet], previous=warned), NOW + timedelta(minutes=1))
    assert (cond(s, "SidecarWarning")["status"], cond(s, "SidecarWarning")["reason"]) == ("False", "NoSidecarRestarts")


# ---- TP groups that collided on one host (status.tp_group_collision) --------------------------------------------

_AFFINITY = ("0/22 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match pod affinity rules, "
             "20 node(s) didn't match Pod's node affinity/selector. no new claims to deallocate, preemption: 0/22 "
             "nodes are available: 1 No preemption victims found for incoming pod, 21 Preemption is not helpful for "
             "scheduling.")


def _tp(name: str, group: str, node: str | None = None, waiting: str | None = None, **kw) -> PodView:
    return PodView(name, "Running" if node else "Pending", node=node, unschedulable=waiting, tp_group=group,
                   restart_attempt=kw.pop("attempt", 0), **kw)


def test_two_groups_that_started_on_one_full_host_are_a_collision():
    # CI, 2026-11-28: the first pods of both groups on a 2-GPU node, their partners waiting for it
    pods = [_tp("j-tp0-0-0-a", "0", "n1"), _tp("j-tp1-1-0-b", "1", "n1"),
            _tp("j-tp0-1-0-c", "0", waiting=_AFFINITY), _tp("j-tp1-0-0-d", "1", waiting=_AFFINITY)]
    c = tp_group_collision(pods, 0)
    assert (c.node, c.group, c.others, c.pod, c.message) == ("n1", "0", ("1",), "j-tp0-1-0-c", _AFFINITY)
    assert c.describe() == ("tensor-parallel group 0 and group 1 of this job started on node n1, which has no room "
                            "for the rest of group 0: pod j-tp0-1-0-c can only join its group there (0/22 nodes are "
                            "available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match pod affinity rules, 20 "
                            "node(s) didn't match Pod's node affinity/selector)")


@pytest.mark.parametrize("pods", [
    # each group on its own host, one still waiting for room there (another job's GPUs: issue 16, not ours)
    [_tp("a", "0", "n1"), _tp("b", "0", waiting=_AFFINITY), _tp("c", "1", "n2"), _tp("d", "1", "n2")],
    # two groups packed on one host with room for both: all placed
    [_tp("a", "0", "n1"), _tp("b", "0", "n1"), _tp("c", "1", "n1"), _tp("d", "1", "n1")],
    # waiting for another reason (the host is tainted): the scheduler places it once that changes
    [_tp("a", "0", "n1"), _tp("c", "1", "n1"), _tp("b", "0", waiting="0/2 nodes are available: 2 node(s) had "
                                                                   "untolerated taint(s).")],
    # no group of the waiting pod is placed yet: nothing pins it
    [_tp("a", "0", "n1"), _tp("c", "0", "n1"), _tp("b", "1", waiting=_AFFINITY)],
    # the other group's pod on that host is on its way out, or of an earlier attempt
    [_tp("a", "0", "n1"), _tp("b", "0", waiting=_AFFINITY), _tp("c", "1", "n1", terminating=True)],
    [_tp("a", "0", "n1"), _tp("b", "0", waiting=_AFFINITY), _tp("c", "1", "n1", attempt=1)],
    # pods without TP-group labels (every group inside one pod): no affinity, nothing to collide
    [PodView("a", "Running", node="n1"), PodView("b", "Pending", unschedulable=_AFFINITY)],
])
def test_what_is_not_a_collision(pods):
    assert tp_group_collision(pods, 0) is None


def test_the_tp_group_comes_from_the_pod_label():
    pod = {"metadata": {"name": "j-tp1-0-0-x", "labels": {"megatron-operator.io/tp-group": "1"}},
           "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}}
    assert PodView.from_pod(pod).tp_group == "1"
    assert PodView.from_pod({"metadata": {"name": "j-worker-0-0-x"}, "status": {}}).tp_group is None
