"""The work queue: a key waits at most once (values merged), is never handled by two threads at once,
a key added while it is handled is handled once more; a failure stops nothing; stop drains or drops."""

from __future__ import annotations

import threading
import time

from factory import wait_until
from megatron_operator.controller import Controller
from megatron_operator.metrics import Metrics
from megatron_operator.settings import Settings
from megatron_operator.workqueue import WorkQueue
from test_controller import FakeKube, body


class Gate:
    """A process function that blocks on key "a" until released and records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, str], bool]] = []
        self.release = threading.Event()
        self.inside = threading.Event()
        self.running: dict[tuple[str, str], int] = {}
        self.overlap = False
        self._lock = threading.Lock()

    def __call__(self, key: tuple[str, str], resync: bool) -> None:
        with self._lock:
            self.running[key] = self.running.get(key, 0) + 1
            self.overlap |= self.running[key] > 1
            self.calls.append((key, resync))
        if key == ("ns", "a"):
            self.inside.set()
            assert self.release.wait(10)
        with self._lock:
            self.running[key] -= 1


def busy_with_a(threads: int, **kw) -> tuple[Gate, WorkQueue]:
    """A queue of ``threads`` workers, one of them held inside key "a" until ``gate.release``."""
    gate = Gate()
    q = WorkQueue(gate, threads=threads, **kw)
    q.add(("ns", "a"), False)
    assert gate.inside.wait(10)
    return gate, q


def test_events_of_a_waiting_key_add_nothing_and_resync_is_kept():
    gate, q = busy_with_a(1, merge=lambda waiting, new: waiting or new)  # the only worker is busy with "a"
    for _ in range(5):
        q.add(("ns", "b"), False)
    q.add(("ns", "b"), True)
    q.add(("ns", "b"), False)
    assert q.depth() == 1
    gate.release.set()
    wait_until(lambda: len(gate.calls) == 2 and q.depth() == 0)
    assert gate.calls == [(("ns", "a"), False), (("ns", "b"), True)]
    q.stop()


def test_a_key_changed_while_processed_runs_once_more_and_never_twice_at_once():
    gate, q = busy_with_a(4)
    q.add(("ns", "a"), False)
    q.add(("ns", "a"), False)
    time.sleep(0.05)  # three idle workers had the chance to take it
    assert [c for c in gate.calls if c[0] == ("ns", "a")] == [(("ns", "a"), False)]
    gate.release.set()
    wait_until(lambda: len(gate.calls) == 2 and q.depth() == 0)
    assert gate.calls == [(("ns", "a"), False), (("ns", "a"), False)] and not gate.overlap
    q.stop()


def test_a_failing_observation_stops_nothing():
    done = []

    def process(key, resync):
        if key[1] == "bad":
            raise RuntimeError("bug")
        done.append(key[1])

    q = WorkQueue(process, threads=1)
    q.add(("ns", "bad"), False)
    q.add(("ns", "good"), False)
    wait_until(lambda: done == ["good"])
    assert q.alive()
    q.stop()
    assert not q.alive()
    q.add(("ns", "late"), False)  # after stop: ignored, no error
    assert q.depth() == 0


def test_stop_drops_what_waits_unless_asked_to_drain():
    for drain, expected in ((False, ["a"]), (True, ["a", "b", "c"])):
        gate, q = busy_with_a(1)
        q.add(("ns", "b"), False)
        q.add(("ns", "c"), False)
        q.stop(timeout_s=0, drain=drain)  # while "a" is still being handled
        gate.release.set()
        wait_until(lambda q=q: not q.alive())
        assert [k[1] for k, _ in gate.calls] == expected


def test_a_job_gone_from_the_cache_is_forgotten():
    kube = FakeKube()
    ctl = Controller(kube, Settings(), Metrics())  # type: ignore[arg-type]
    b = body()
    ctl.observe_key(("team-a", "job"), lambda: (b, None, []), lambda body: (lambda ev: None))
    assert ("team-a", "job") in ctl._written and ctl.metrics._phases
    ctl.observe_key(("team-a", "job"), lambda: (None, None, []), lambda body: (lambda ev: None))
    assert ("team-a", "job") not in ctl._written and not ctl.metrics._phases
