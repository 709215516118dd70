"""The status writer: newest status wins, one write per job at a time, failures reported, flushed on stop."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from factory import wait_until
from megatron_operator import controller as controller_mod
from megatron_operator import status as st
from megatron_operator.controller import Controller
from megatron_operator.kube import PermanentApiError, TransientError
from megatron_operator.metrics import Metrics
from megatron_operator.settings import Settings
from megatron_operator.status_writer import StatusWriter
from test_controller import FakeKube, body, jobset, observe, running_pods


class GatedWrites:
    """A write function that blocks until released, and records what it wrote and how many ran at once."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str, Any]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.running = 0
        self.most = 0
        self._lock = threading.Lock()

    def __call__(self, ns: str, name: str, status: dict[str, Any]) -> None:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.entered.set()
        assert self.release.wait(10)
        with self._lock:
            self.running -= 1
            self.written.append((ns, name, status["phase"]))


def test_a_status_replaced_while_waiting_is_written_once_with_the_newest():
    w = GatedWrites()
    writer = StatusWriter(w, threads=1)
    writer.submit(("ns", "a"), {"phase": "Pending"})  # taken by the worker, blocked in the write
    assert w.entered.wait(10)
    writer.submit(("ns", "b"), {"phase": "Pending"})
    writer.submit(("ns", "b"), {"phase": "Starting"})
    writer.submit(("ns", "b"), {"phase": "Running"})
    assert writer.has(("ns", "b")) and writer.pending() == 1
    w.release.set()
    wait_until(lambda: len(w.written) == 2 and not writer.has(("ns", "b")))
    assert w.written == [("ns", "a", "Pending"), ("ns", "b", "Running")]
    writer.stop()


def test_one_job_is_never_written_twice_at_once_and_its_writes_stay_in_order():
    w = GatedWrites()
    writer = StatusWriter(w, threads=4)
    writer.submit(("ns", "a"), {"phase": "Pending"})
    assert w.entered.wait(10)
    writer.submit(("ns", "a"), {"phase": "Running"})  # arrives during the first write
    time.sleep(0.05)  # three idle workers had the chance to take it
    assert w.running == 1 and writer.has(("ns", "a"))
    w.release.set()
    wait_until(lambda: len(w.written) == 2)
    assert [p for _, _, p in w.written] == ["Pending", "Running"] and w.most == 1
    writer.stop()


def test_failures_go_to_the_callback_and_the_worker_carries_on():
    failed, written = [], []

    def write(ns, name, status):
        if name == "bad":
            raise TransientError("HTTP 503")
        written.append(name)

    writer = StatusWriter(write, threads=1, on_written=lambda k, s: None,
                          on_error=lambda k, s, exc: failed.append((k, str(exc))))
    writer.submit(("ns", "bad"), {"phase": "Pending"})
    writer.submit(("ns", "good"), {"phase": "Pending"})
    wait_until(lambda: written == ["good"])
    assert failed == [(("ns", "bad"), "HTTP 503")]
    writer.stop()


def test_stop_writes_what_is_waiting():
    written = []
    writer = StatusWriter(lambda ns, name, status: written.append(name), threads=2)
    for i in range(20):
        writer.submit(("ns", f"j{i}"), {"phase": "Pending"})
    writer.stop()
    assert sorted(written) == sorted(f"j{i}" for i in range(20))


def test_threads_0_writes_inline():
    written = []
    writer = StatusWriter(lambda ns, name, status: written.append(status["phase"]), threads=0)
    writer.submit(("ns", "a"), {"phase": "Pending"})
    assert written == ["Pending"] and not writer.has(("ns", "a"))


def test_a_delayed_status_is_written_once_its_delay_is_over():
    written = []
    writer = StatusWriter(lambda ns, name, status: written.append((time.monotonic(), status["phase"])), threads=1)
    t0 = time.monotonic()
    writer.submit(("ns", "a"), {"phase": "Pending"}, delay_s=0.3)
    writer.submit(("ns", "a"), {"phase": "Pending", "message": "1/2"}, delay_s=0.3)  # keeps the first due time
    assert writer.has(("ns", "a")) and writer.pending() == 1 and written == []
    wait_until(lambda: written)
    assert written[0][1] == "Pending" and 0.3 <= written[0][0] - t0 < 5
    wait_until(lambda: not writer.has(("ns", "a")))
    assert len(written) == 1
    writer.stop()


def test_a_status_without_delay_replaces_a_delayed_one_and_goes_at_once():
    written = []
    writer = StatusWriter(lambda ns, name, status: written.append(status["phase"]), threads=1)
    writer.submit(("ns", "a"), {"phase": "Pending"}, delay_s=30)
    writer.submit(("ns", "a"), {"phase": "Running"})
    wait_until(lambda: written == ["Running"], timeout_s=5)  # not 30 s later
    wait_until(lambda: not writer.has(("ns", "a")))
    writer.submit(("ns", "a"), {"phase": "Pending"}, delay_s=0.05)  # a new delay: the old one is gone
    wait_until(lambda: written == ["Running", "Pending"], timeout_s=5)
    writer.stop()
    assert written == ["Running", "Pending"]


def test_stop_writes_the_delayed_statuses_too():
    written = []
    writer = StatusWriter(lambda ns, name, status: written.append(name), threads=1)
    writer.submit(("ns", "a"), {"phase": "Pending"}, delay_s=60)
    writer.stop()
    assert written == ["a"]


# ---- through the controller -----------------------------------------------------------------------

def test_a_new_jobs_first_status_waits_for_its_pods_so_one_write_says_running(monkeypatch):
    # issue 30: "pods starting" then "Running" a moment later were two MegatronJob writes per job
    monkeypatch.setattr(controller_mod, "FIRST_STATUS_DELAY_S", 30.0)
    kube = FakeKube()
    ctl = Controller(kube, Settings(), Metrics(), status_threads=1)  # type: ignore[arg-type]
    observe(ctl, body(), None)  # creates the children; "pods starting" waits
    observe(ctl, body(), jobset(), running_pods(1))
    assert kube.of("status") == [] and ctl.writer.has(("team-a", "job"))
    observe(ctl, body(), jobset(), running_pods(), resync=True)  # a resync does not write it either
    wait_until(lambda: kube.of("status") != [], timeout_s=5)
    wait_until(lambda: not ctl.writer.has(("team-a", "job")))
    assert kube.of("status") == [("status", "Running", "AllPodsRunning")]
    ctl.writer.stop()


@pytest.mark.parametrize(("stored", "pods", "written"), [
    # a reason to wait is written at once
    (None, [st.PodView("job-p0", "Pending", unschedulable="0/3 nodes are available")], ("Pending", "Unschedulable")),
    # the first status only: a job that had one gets every later status at once
    ({"phase": "Suspended", "reason": "Suspended", "jobSetName": "job"}, [], ("Pending", "PodsStarting")),
])
def test_only_a_new_jobs_first_starting_status_waits(monkeypatch, stored, pods, written):
    monkeypatch.setattr(controller_mod, "FIRST_STATUS_DELAY_S", 30.0)
    kube = FakeKube()
    ctl = Controller(kube, Settings(), Metrics(), status_threads=1)  # type: ignore[arg-type]
    observe(ctl, body(status=stored), jobset(), pods)
    wait_until(lambda: kube.of("status") != [], timeout_s=5)
    assert kube.of("status") == [("status", *written)]
    ctl.writer.stop()


def test_a_delayed_first_status_is_written_when_the_pods_do_not_start(monkeypatch):
    monkeypatch.setattr(controller_mod, "FIRST_STATUS_DELAY_S", 0.2)
    kube = FakeKube()
    ctl = Controller(kube, Settings(), Metrics(), status_threads=1)  # type: ignore[arg-type]
    t0 = time.monotonic()
    observe(ctl, body(), jobset(), [st.PodView("job-p0", "Pending"), st.PodView("job-p1", "Pending")])
    wait_until(lambda: kube.of("status") != [], timeout_s=5)
    assert time.monotonic() - t0 >= 0.2
    assert kube.of("status") == [("status", "Pending", "PodsStarting")]
    ctl.writer.stop()


def test_a_lost_write_is_derived_again_and_a_deleted_job_is_not_an_error():
    kube = FakeKube()
    ctl = Controller(kube, Settings(), Metrics(), status_threads=1)  # type: ignore[arg-type]
    fail = [TransientError("HTTP 503")]

    def apply_status(ns, name, status):
        if fail:
            raise fail.pop()
        kube.calls.append(("status", status["phase"], status["reason"]))

    kube.apply_status = apply_status
    b = body(status={"phase": "Pending", "reason": "Creating", "jobSetName": "job"})
    observe(ctl, b, jobset(), running_pods())
    wait_until(lambda: not ctl.writer.has(("team-a", "job")))
    assert kube.of("status") == []  # the write failed ...
    assert ctl.metrics.errors.labels(kind="MegatronJob", error="TransientError")._value.get() == 1
    observe(ctl, b, jobset(), running_pods())  # ... so the next event writes it, not trusting the lost one
    wait_until(lambda: kube.of("status") != [])
    assert kube.of("status") == [("status", "Running", "AllPodsRunning")]
    fail.append(PermanentApiError("HTTP 404: not found", status=404))
    observe(ctl, body(status={"phase": "Running", "reason": "AllPodsRunning", "jobSetName": "job"}),
            jobset(Completed="AllJobsCompleted"))
    wait_until(lambda: not ctl.writer.has(("team-a", "job")))
    assert ctl.metrics.errors.labels(kind="MegatronJob", error="PermanentApiError")._value.get() == 0
    ctl.writer.stop()


def test_a_resync_does_not_repeat_a_write_still_in_flight():
    kube = FakeKube()
    gate = GatedWrites()
    kube.apply_status = gate  # type: ignore[method-assign]
    ctl = Controller(kube, Settings(), Metrics(), status_threads=1)  # type: ignore[arg-type]
    b = body(status={"phase": "Pending", "reason": "Creating", "jobSetName": "job"})
    observe(ctl, b, jobset(), running_pods())
    assert gate.entered.wait(10)
    observe(ctl, b, jobset(), running_pods(), resync=True)  # the stored status still says Pending
    assert not ctl.writer.pending()
    gate.release.set()
    wait_until(lambda: not ctl.writer.has(("team-a", "job")))
    assert [p for _, _, p in gate.written] == ["Running"]
    ctl.writer.stop()
