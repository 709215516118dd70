"""The status writer: newest status wins, one write per job at a time, failures reported, flushed on stop."""

from __future__ import annotations

import threading
import time
from typing import Any

from factory import wait_until
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


# ---- through the controller -----------------------------------------------------------------------

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
