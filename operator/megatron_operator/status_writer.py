"""The operator's status writes, off the handler threads: one write per job at a time, newest wins.

``Controller.observe`` decides a job's status and hands it to ``StatusWriter.submit``; a few
worker threads write it. A job whose status changes again before its write went out is written
once, with the newest status. In a burst the API server is the bottleneck (every MegatronJob write
evaluates the CRD's validation rules: about 12 ms of API server CPU, docs/benchmarks.md), so every
write spared goes to the JobSet controller and the scheduler instead; and the handler threads,
which create the children, never wait behind status writes.

``threads=0`` writes inline, in the caller's thread (the unit tests' mode).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, str]
WriteFn = Callable[[str, str, dict[str, Any]], None]


class StatusWriter:
    def __init__(self, write: WriteFn, threads: int = 2,
                 on_written: Callable[[Key, dict[str, Any]], None] | None = None,
                 on_error: Callable[[Key, dict[str, Any], Exception], None] | None = None):
        self._write = write
        self._on_written = on_written or (lambda key, status: None)
        self._on_error = on_error or (lambda key, status, exc: None)
        self._pending: dict[Key, dict[str, Any]] = {}  # newest status per job, not yet taken by a worker
        self._queue: deque[Key] = deque()  # jobs with a pending status, in the order they first asked
        self._busy: set[Key] = set()  # a worker is writing this job's status (never two at once: order)
        self._cv = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"status-writer-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, key: Key, status: dict[str, Any]) -> None:
        """Write ``status`` for ``key`` soon; replaces a status of the same job still waiting."""
        if not self._threads:
            self._write_one(key, status)
            return
        with self._cv:
            if key not in self._pending and key not in self._busy:
                self._queue.append(key)
            self._pending[key] = status
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def has(self, key: Key) -> bool:
        """A status of this job is waiting or being written."""
        with self._cv:
            return key in self._pending or key in self._busy

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is waiting (for at most ``timeout_s``), then stop the workers."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout_s)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return  # stopping, nothing left
                key = self._queue.popleft()
                status = self._pending.pop(key)
                self._busy.add(key)
            try:
                self._write_one(key, status)
            finally:
                with self._cv:
                    self._busy.discard(key)
                    if key in self._pending:  # a newer status arrived during the write
                        self._queue.append(key)
                        self._cv.notify()

    def _write_one(self, key: Key, status: dict[str, Any]) -> None:
        try:
            self._write(key[0], key[1], status)
        except Exception as exc:  # the caller decides (a lost write is re-derived); never kill the worker
            self._on_error(key, status, exc)
            return
        self._on_written(key, status)
