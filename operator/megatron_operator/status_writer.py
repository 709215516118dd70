"""The operator's status writes, off the observation threads: one write per job at a time, newest wins.

``Controller.observe`` decides a job's status and hands it to ``StatusWriter.submit``; a few
threads write it (a ``WorkQueue`` whose newest status replaces one still waiting). A job whose
status changes again before its write went out is written once, with the newest status. In a burst
the API server is the bottleneck (every MegatronJob write evaluates the CRD's validation rules:
about 12 ms of API server CPU, docs/benchmarks/operator-throughput.md#2026-11-23-third-run-423fe49), so
every write spared goes to the JobSet controller and the scheduler instead; and the observation threads,
which create the children, never wait behind status writes.

A status may also be submitted with a delay (``submit(..., delay_s=)``): it waits that long, counted
from the first such submit, unless a newer status of the job replaces it. The controller uses it for
a new job's first status when it only says the pods are starting: when they run within the delay,
the job's first write already says Running, one write instead of two (issue 30). A status submitted
without a delay replaces a delayed one and goes at once.

``threads=0`` writes inline, in the caller's thread (the unit tests' mode; delays are not kept).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from typing import Any

from .workqueue import Key, WorkQueue

WriteFn = Callable[[str, str, dict[str, Any]], None]


class StatusWriter:
    def __init__(self, write: WriteFn, threads: int = 2,
                 on_written: Callable[[Key, dict[str, Any]], None] | None = None,
                 on_error: Callable[[Key, dict[str, Any], Exception], None] | None = None):
        self._write = write
        self._on_written = on_written or (lambda key, status: None)
        self._on_error = on_error or (lambda key, status, exc: None)
        self._queue: WorkQueue[dict[str, Any]] | None = (
            WorkQueue(self._write_one, threads, name="status-writer") if threads else None)
        # Delayed statuses: key -> (due, status), and a heap of (due, key) for the one timer thread.
        self._delayed: dict[Key, tuple[float, dict[str, Any]]] = {}
        self._due: list[tuple[float, Key]] = []
        self._cv = threading.Condition()
        self._stopping = False
        self._timer: threading.Thread | None = None
        if self._queue is not None:
            self._timer = threading.Thread(target=self._release_due, name="status-writer-timer", daemon=True)
            self._timer.start()

    def submit(self, key: Key, status: dict[str, Any], delay_s: float = 0.0) -> None:
        """Write ``status`` for ``key`` soon (after ``delay_s`` at most, counted from the first delayed
        submit of the job); replaces a status of the same job still waiting."""
        if self._queue is None:
            self._write_one(key, status)
            return
        with self._cv:
            delayed = self._delayed.pop(key, None)
            if delay_s > 0 and not self._stopping and not self._queue.has(key):
                due = delayed[0] if delayed else time.monotonic() + delay_s
                self._delayed[key] = (due, status)
                if delayed is None:
                    heapq.heappush(self._due, (due, key))
                    self._cv.notify()
                return
        self._queue.add(key, status)

    def pending(self) -> int:
        with self._cv:
            delayed = len(self._delayed)
        return delayed + (self._queue.depth() if self._queue is not None else 0)

    def has(self, key: Key) -> bool:
        """A status of this job is waiting (delayed or not) or being written."""
        if self._queue is None:
            return False
        with self._cv:
            if key in self._delayed:
                return True
        return self._queue.has(key)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is waiting, delayed statuses included (each thread waited for at most
        ``timeout_s``), then stop."""
        if self._queue is None:
            return
        with self._cv:
            self._stopping = True
            delayed, self._delayed, self._due = self._delayed, {}, []
            self._cv.notify_all()
        for key, (_, status) in delayed.items():
            self._queue.add(key, status)
        if self._timer is not None:
            self._timer.join(timeout_s)
        self._queue.stop(timeout_s, drain=True)

    def _release_due(self) -> None:
        """The timer thread: hands each delayed status to the writers when it is due."""
        assert self._queue is not None
        while True:
            with self._cv:
                while not self._stopping and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._due else max(0.0, self._due[0][0] - time.monotonic()))
                if self._stopping:
                    return
                due, key = heapq.heappop(self._due)
                entry = self._delayed.get(key)
                if entry is None or entry[0] != due:
                    continue  # replaced by a status without a delay (written already) meanwhile
                del self._delayed[key]
                self._queue.add(key, entry[1])

    def _write_one(self, key: Key, status: dict[str, Any]) -> None:
        try:
            self._write(key[0], key[1], status)
        except Exception as exc:  # the caller decides (a lost write is derived again)
            self._on_error(key, status, exc)
            return
        self._on_written(key, status)
