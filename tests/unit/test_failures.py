"""Why a pod failed (failures.py) and how status.derive reports it: lastFailure, the phase message, the
PodFailed event, non-retriable exit codes (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from megatron_operator.failures import PodFailure
from megatron_operator.status import JobSetView, Observation, PodView, derive, iso

NOW = datetime(2026, 11, 23, 5, 0, 0, tzinfo=UTC)
LAYOUT = {"tensor": 1, "pipeline": 1, "context": 1, "expert": 1, "data": 2}
FATAL = "rank 0: exit 3 (bad training data; not retried) during building the data index: Fatal: --data-path: ..."


def pod(name, phase="Failed", code=3, reason="Error", message=FATAL, attempt=0, node="gpu-p5-3",
        finished="2026-11-23T04:59:30Z"):
    """A pod as the API server returns it (what the operator's pod index sees)."""
    term = {"exitCode": code, "reason": reason, "message": message, "finishedAt": finished}
    return {"metadata": {"name": name, "labels": {"jobset.sigs.k8s.io/restart-attempt": str(attempt)}},
            "spec": {"nodeName": node},
            "status": {"phase": phase, "containerStatuses": [
                {"name": "trainer", "state": {"terminated": term} if phase == "Failed" else {"running": {}}}]}}


def js(restarts=0, **conds):
    return JobSetView(name="job", suspended=False, restarts=restarts,
                      conditions={k: {"status": "True", "reason": v[0], "message": v[1]} for k, v in conds.items()},
                      created=iso(NOW - timedelta(minutes=5)))


def obs(**kw):
    base = dict(name="job", generation=1, num_nodes=2, world_size=2, layout=LAYOUT, suspend=False,
                queue_name=None, previous={})
    base.update(kw)
    return Observation(**base)


def test_pod_failure_reads_node_code_reason_and_message():
    f = PodView.from_pod(pod("job-worker-0-0-x", attempt=2)).failure
    assert f == PodFailure(pod="job-worker-0-0-x", node="gpu-p5-3", exit_code=3, reason="Error", message=FATAL,
                           finished_at="2026-11-23T04:59:30Z", restart_attempt=2)
    assert not f.retriable and f.summary() == ("pod job-worker-0-0-x on node gpu-p5-3 failed: exit code 3, Error "
                                               "(bad training data or tokenizer; not retried)")
    assert PodView.from_pod(pod("p", phase="Running")).failure is None


@pytest.mark.parametrize("code, reason, meaning, retriable", [
    (137, "OOMKilled", "killed for exceeding its memory limit", True),
    (143, "Error", "killed by signal 15", True),
    (1, "Error", "error", True),
    (4, "Error", "CUDA out of memory before the first iteration", False),
    (7, "Error", "the object store refuses the checkpoint location (no such bucket, bad credentials, access denied)",
     False),
])
def test_meaning_and_retry(code, reason, meaning, retriable):
    f = PodView.from_pod(pod("p", code=code, reason=reason)).failure
    assert f.meaning() == meaning and f.retriable is retriable


def test_message_is_cut_to_its_last_characters():
    f = PodView.from_pod(pod("p", message="x" * 5000 + "THE END")).failure
    assert len(f.message) == 2000 and f.message.endswith("THE END")


def test_non_retriable_exit_fails_the_job_naming_pod_node_code_and_lines():
    failed_js = js(Failed=("FailJobSetFailurePolicyAction", "FailJobSet failure policy action: first failed "
                                                            "job: job-worker-0"))
    pods = [PodView.from_pod(pod("job-worker-0-0-x")), PodView.from_pod(pod("job-worker-1-0-y", phase="Running"))]
    s, events = derive(obs(jobset=failed_js, pods=pods, previous={"phase": "Running"}), NOW)
    assert (s["phase"], s["reason"]) == ("Failed", "NonRetriableExitCode")
    assert "pod job-worker-0-0-x on node gpu-p5-3 failed: exit code 3, Error" in s["message"]
    assert FATAL in s["message"]
    assert s["lastFailure"] == {"pod": "job-worker-0-0-x", "node": "gpu-p5-3", "exitCode": 3, "reason": "Error",
                                "retriable": False, "message": FATAL, "time": "2026-11-23T04:59:30Z",
                                "restartAttempt": 0}
    failed = next(c for c in s["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "NonRetriableExitCode" and "gpu-p5-3" in failed["message"]
    (ev,) = [e for e in events if e.reason == "PodFailed"]
    assert ev.type == "Warning" and "exit code 3" in ev.message and FATAL in ev.message
    again, events = derive(obs(jobset=failed_js, pods=pods, previous=s), NOW + timedelta(seconds=10))
    assert again["message"] == s["message"] and again["lastFailure"] == s["lastFailure"] and events == []


def test_last_failure_survives_the_gang_recreation_and_the_event_is_not_repeated():
    first, events = derive(obs(jobset=js(restarts=1), pods=[PodView.from_pod(pod("a", code=1))],
                               previous={"phase": "Running", "restarts": 0}), NOW)
    assert first["phase"] == "Restarting" and "last failure: pod a on node gpu-p5-3 failed: exit code 1" in \
        first["message"]
    assert [e.reason for e in events].count("PodFailed") == 1
    again, events = derive(obs(jobset=js(restarts=1), pods=[PodView.from_pod(pod("a", code=1))], previous=first),
                           NOW + timedelta(seconds=5))
    assert "PodFailed" not in [e.reason for e in events]
    new_pods = [PodView(f"b{i}", "Running", restart_attempt=1) for i in range(2)]
    later, _ = derive(obs(jobset=js(restarts=1), pods=new_pods, previous=again), NOW + timedelta(seconds=30))
    assert later["phase"] == "Running" and later["lastFailure"] == first["lastFailure"]


def test_the_first_failure_of_the_latest_attempt_is_the_cause():
    old = PodView.from_pod(pod("old", code=1, attempt=0, finished="2026-11-23T04:00:00Z"))
    cause = PodView.from_pod(pod("cause", code=4, attempt=1, finished="2026-11-23T04:59:00Z"))
    follower = PodView.from_pod(pod("follower", code=143, attempt=1, finished="2026-11-23T04:59:05Z"))
    s, _ = derive(obs(jobset=js(restarts=1), pods=[old, follower, cause], previous={"phase": "Running",
                                                                                     "restarts": 1}), NOW)
    assert s["lastFailure"]["pod"] == "cause" and s["lastFailure"]["retriable"] is False


def test_restarts_exhausted_names_the_last_failure():
    s, _ = derive(obs(jobset=js(restarts=2, Failed=("ReachedMaxRestarts", "jobset failed")),
                      pods=[PodView.from_pod(pod("c", code=137, reason="OOMKilled"))],
                      previous={"phase": "Running", "restarts": 2}), NOW)
    assert s["reason"] == "RestartsExhausted" and "exit code 137, OOMKilled (killed for exceeding its memory limit" \
        in s["message"]



def test_a_pod_stopped_by_the_teardown_does_not_replace_the_cause():
    """kwok (like a kubelet) ends the other pods of the gang with 143 when JobSet deletes them, often
    within the same second as the pod that failed."""
    cause = PodView.from_pod(pod("cause", code=137, reason="OOMKilled"))
    first, _ = derive(obs(jobset=js(), pods=[cause], previous={"phase": "Running"}), NOW)
    assert first["lastFailure"]["pod"] == "cause"
    torn = pod("a-follower", code=143, message="terminated on pod deletion (SIGTERM)")
    torn["metadata"]["deletionTimestamp"] = "2026-11-23T04:59:31Z"
    gone = pod("cause", code=137, reason="OOMKilled")
    gone["metadata"]["deletionTimestamp"] = "2026-11-23T04:59:31Z"
    s, events = derive(obs(jobset=js(restarts=1), pods=[PodView.from_pod(torn), PodView.from_pod(gone)],
                           previous=first), NOW + timedelta(seconds=2))
    assert s["lastFailure"]["pod"] == "cause" and "PodFailed" not in [e.reason for e in events]
    # seen together for the first time: the pod that was not being deleted is the cause
    s, _ = derive(obs(jobset=js(), pods=[PodView.from_pod(torn), cause], previous={"phase": "Running"}), NOW)
    assert s["lastFailure"]["pod"] == "cause"


def test_a_teardown_sigterm_alone_is_not_recorded_as_the_cause():
    torn = pod("follower", code=143, message="terminated on pod deletion (SIGTERM)")
    torn["metadata"]["deletionTimestamp"] = "2026-11-23T04:59:31Z"
    s, events = derive(obs(jobset=js(restarts=1), pods=[PodView.from_pod(torn)], previous={"phase": "Running"}), NOW)
    assert "lastFailure" not in s and "PodFailed" not in [e.reason for e in events]
    alive = pod("stopped", code=143)  # a SIGTERM the pod got without being deleted is a failure of its own
    s, _ = derive(obs(jobset=js(restarts=1), pods=[PodView.from_pod(alive)], previous={"phase": "Running"}), NOW)
    assert s["lastFailure"]["pod"] == "stopped"


def test_a_disrupted_pod_says_so_and_is_not_counted():
    evicted = pod("job-worker-0-0-x", code=143, reason="Error", message="terminated on pod deletion (SIGTERM)")
    evicted["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                        "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}]
    f = PodFailure.from_pod(evicted, "trainer", 0)
    assert f is not None and f.disruption == "EvictionByEvictionAPI: Eviction API: evicting"
    assert f.summary() == ("pod job-worker-0-0-x on node gpu-p5-3 was disrupted (EvictionByEvictionAPI: Eviction "
                           "API: evicting): exit code 143, Error (retried, not counted)")
    assert f.wire()["disruption"] == "EvictionByEvictionAPI: Eviction API: evicting"

    evicted["metadata"]["deletionTimestamp"] = "2026-11-23T04:59:31Z"  # deleted by the eviction: still the cause
    s, _ = derive(obs(jobset=js(restarts=1), pods=[PodView.from_pod(evicted)], previous={"phase": "Running"}), NOW)
    assert s["lastFailure"]["disruption"] == "EvictionByEvictionAPI: Eviction API: evicting"


# ---- failures that blame the node: status.avoidedNodes --------------------------------------------

def disrupted(name, reason, node="gpu-p5-3"):
    p = pod(name, code=143, message="terminated", node=node)
    p["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": reason, "message": "m"}]
    return p


@pytest.mark.parametrize(("doc", "blamed"), [
    (pod("a", code=6, message="CUDA error: uncorrectable ECC error encountered"), "GPU hardware fault"),
    (disrupted("a", "DeletionByTaintManager"), "node not ready or unreachable"),
    (disrupted("a", "DeletionByPodGC"), "node gone"),
    (pod("a", code=1), None),  # NCCL, a lost peer, storage: the job's, or unknown
    (pod("a", code=137, reason="OOMKilled"), None),
    (disrupted("a", "EvictionByEvictionAPI"), None),  # a drain: the node is cordoned anyway
    (disrupted("a", "PreemptionByScheduler"), None),
    (pod("a", code=6, node=None), None),  # never scheduled: no node to blame
])
def test_which_failures_blame_the_node(doc, blamed):
    fault = PodFailure.from_pod(doc, "trainer", 0).node_fault
    assert (fault is None) == (blamed is None) and (blamed is None or blamed in fault), fault


def test_a_gpu_fault_adds_the_node_once_with_an_event_and_keeps_it_after_the_gang_is_gone():
    faulty = [PodView.from_pod(pod("a", code=6, message="ECC")), PodView.from_pod(pod("b", phase="Running"))]
    s, events = derive(obs(jobset=js(restarts=1), pods=faulty, previous={"phase": "Running"}), NOW)
    assert s["avoidedNodes"] == [{"node": "gpu-p5-3", "reason": "GPU hardware fault (uncorrectable ECC, NVLink, "
                                  "GPU lost) on this node", "time": "2026-11-23T04:59:30Z"}]
    assert s["lastFailure"]["retriable"] is True and "retried" in s["message"]
    (ev,) = [e for e in events if e.reason == "AvoidingNode"]
    assert ev.type == "Warning" and "gpu-p5-3" in ev.message
    again, events = derive(obs(jobset=None, pods=[], previous=s), NOW + timedelta(seconds=5))
    assert again["avoidedNodes"] == s["avoidedNodes"] and "AvoidingNode" not in [e.reason for e in events]
    # a second fault on the same node adds nothing; one on another node is appended
    later = [PodView.from_pod(pod("c", code=6, attempt=1, finished="2026-11-23T05:10:00Z")),
             PodView.from_pod(pod("d", code=6, attempt=2, node="gpu-p5-9", finished="2026-11-23T05:20:00Z"))]
    s2, _ = derive(obs(jobset=js(restarts=2), pods=later[:1], previous=again), NOW + timedelta(minutes=15))
    assert [a["node"] for a in s2["avoidedNodes"]] == ["gpu-p5-3"]
    s3, _ = derive(obs(jobset=js(restarts=3), pods=later[1:], previous=s2), NOW + timedelta(minutes=25))
    assert [a["node"] for a in s3["avoidedNodes"]] == ["gpu-p5-3", "gpu-p5-9"]


def test_avoided_nodes_keep_the_latest_16():
    prev = {"phase": "Running", "avoidedNodes": [{"node": f"n{i}", "reason": "r"} for i in range(16)]}
    s, _ = derive(obs(jobset=js(restarts=1), pods=[PodView.from_pod(pod("a", code=6, node="n16"))],
                      previous=prev), NOW)
    assert [a["node"] for a in s["avoidedNodes"]] == [f"n{i}" for i in range(1, 17)]


NCCL_IB = ("rank 3: exit 1 (error; retried) during training: DistBackendError: NCCL error in: "
           "ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error, NCCL version 2.27.3\n"
           "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.\n"
           "Last error:\nNET/IB: Got completion from peer 10.4.0.7<43617> with status=IBV_WC_RETRY_EXC_ERR(12) "
           "opcode=IBV_WC_SEND(0) vendor_err=129 localGid ::ffff:10.4.0.5 remoteGids::ffff:10.4.0.7 hca mlx5_0")


@pytest.mark.parametrize(("message", "peers"), [
    (NCCL_IB, ["10.4.0.7"]),
    ("Last error:\nConnection closed by remote peer 10.4.0.9<57124>", ["10.4.0.9"]),
    ("Last error:\nsocketProgress: Connection closed by remote peer [fd00::12]<40000>; peer 10.4.0.9<1>",
     ["fd00::12", "10.4.0.9"]),
    ("NCCL watchdog: collective operation timeout", []),  # a timeout names nobody
])
def test_the_peers_an_nccl_error_names(message, peers):
    assert PodFailure(pod="p", node="n", exit_code=1, reason="Error", message=message,
                      finished_at=None).nccl_peers() == peers


def test_an_nccl_error_blames_the_node_of_the_peer_it_names_never_the_reporters():
    reporter = PodView.from_pod(pod("job-worker-3-0-x", code=1, message=NCCL_IB, node="gpu-p5-5"))
    peer_nodes = {"10.4.0.7": "gpu-p5-7", "10.4.0.5": "gpu-p5-5"}
    s, events = derive(obs(jobset=js(restarts=1), pods=[reporter], previous={"phase": "Running"},
                           peer_nodes=peer_nodes), NOW)
    (avoided,) = s["avoidedNodes"]
    assert avoided["node"] == "gpu-p5-7"
    assert avoided["reason"] == "NCCL: pod job-worker-3-0-x lost its connection to peer 10.4.0.7 on this node"
    assert "AvoidingNode" in [e.reason for e in events]
    # an address that is not one of the job's pods, or the reporter's own node: nobody is blamed
    for nodes in ({}, {"10.4.0.7": "gpu-p5-5"}):
        s, _ = derive(obs(jobset=js(restarts=1), pods=[reporter], previous={"phase": "Running"}, peer_nodes=nodes),
                      NOW)
        assert "avoidedNodes" not in s


def test_object_store_refusal_reaches_last_failure_with_the_trainers_words():
    """Issue 33: exit 7 fails the job at once; status.lastFailure carries the trainer's classified
    message (the S3 code and a hint, no credential: the trainer's tests check the message itself)."""
    msg = ("rank 0: exit 7 (the object store refuses the checkpoint location; not retried) during start-up: "
           "ObjectStoreError: object store msc://checkpoints/run: SignatureDoesNotMatch (not retriable): the secret "
           "key is wrong (check the credentials Secret); ...")
    failed_js = js(Failed=("FailJobSetFailurePolicyAction", "FailJobSet failure policy action: first failed "
                                                            "job: job-worker-0"))
    pods = [PodView.from_pod(pod("job-worker-0-0-x", code=7, message=msg))]
    s, _ = derive(obs(jobset=failed_js, pods=pods, previous={"phase": "Running"}), NOW)
    assert (s["phase"], s["reason"]) == ("Failed", "NonRetriableExitCode")
    assert s["lastFailure"]["exitCode"] == 7 and s["lastFailure"]["retriable"] is False
    assert "SignatureDoesNotMatch (not retriable)" in s["lastFailure"]["message"]
    assert "object store refuses the checkpoint location" in s["message"]
