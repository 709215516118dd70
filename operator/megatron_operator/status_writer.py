"""The operator's status writes, off the observation threads: one write per job at a time, newest wins.

``Controller.observe`` decides a job's status and hands it to ``StatusWriter.submit``; a few
threads write it (a ``WorkQueue`` whose newest status replaces one still waiting). A job whose
status changes again before its write went out is written once, with the newest status. In a burst
the API server is the bottleneck (every MegatronJob write evaluates the CRD's validation rules:
about 12 ms of API server CPU, docs/benchmarks.md), so every write spared goes to the JobSet
controller and the scheduler instead; and the observation threads, which create the children,
never wait behind status writes.

``threads=0`` writes inline, in the caller's thread (the unit tests' mode).
"""

from __future__ import annotations

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

    def submit(self, key: Key, status: dict[str, Any]) -> None:
        """Write ``status`` for ``key`` soon; replaces a status of the same job still waiting."""
        if self._queue is None:
            self._write_one(key, status)
        else:
            self._queue.add(key, status)

    def pending(self) -> int:
        return self._queue.depth() if self._queue is not None else 0

    def has(self, key: Key) -> bool:
        """A status of this job is waiting or being written."""
        return self._queue is not None and self._queue.has(key)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is waiting (each thread waited for at most ``timeout_s``), then stop."""
        if self._queue is not None:
            self._queue.stop(timeout_s, drain=True)

    def _write_one(self, key: Key, status: dict[str, Any]) -> None:
        try:
            self._write(key[0], key[1], status)
        except Exception as exc:  # the caller decides (a lost write is derived again)
            self._on_error(key, status, exc)
            return
        self._on_written(key, status)
