"""The jobs to observe: each at most once in the queue, never observed by two threads at once.

kopf's event handlers only add the job's key here and return (client-go's workqueue semantics):
events of a job that arrive while it waits add nothing, and a job that changes while a worker
observes it is observed once more afterwards. A worker reads the watch caches when it takes the
key, so every event is accounted for. kopf's per-object workers are then done within microseconds
and release the event bodies; when handlers blocked on the API instead, a burst of jobs queued
every pod and JobSet event in kopf, and the operator's memory tripled (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

Key = tuple[str, str]


class WorkQueue:
    def __init__(self, process: Callable[[Key, bool], None], threads: int = 8):
        """``process(key, resync)`` observes one job; ``resync`` is True when any of the requests
        merged into this one came from the periodic resync."""
        self._process = process
        self._queue: deque[Key] = deque()
        self._waiting: dict[Key, bool] = {}  # key -> resync, for keys in the queue or to run again
        self._busy: set[Key] = set()
        self._cv = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"observe-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def add(self, key: Key, resync: bool = False) -> None:
        with self._cv:
            if self._stopping:
                return
            if key in self._waiting:
                self._waiting[key] = self._waiting[key] or resync
                return
            self._waiting[key] = resync
            if key not in self._busy:  # else: queued again when its current observation ends
                self._queue.append(key)
                self._cv.notify()

    def depth(self) -> int:
        with self._cv:
            return len(self._waiting)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking keys; observations under way finish (for at most ``timeout_s``)."""
        with self._cv:
            self._stopping = True
            self._queue.clear()
            self._waiting.clear()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout_s)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                key = self._queue.popleft()
                resync = self._waiting.pop(key)
                self._busy.add(key)
            try:
                self._process(key, resync)
            except Exception:  # a bug on one job must not stop the observation of the others
                log.exception(f"{key[0]}/{key[1]}: observation failed")
            finally:
                with self._cv:
                    self._busy.discard(key)
                    if key in self._waiting:  # it changed during the observation
                        self._queue.append(key)
                        self._cv.notify()
