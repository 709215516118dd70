"""Keyed work for a few threads: each key at most once in the queue, never handled by two threads at once.

The operator uses it twice:

- **Observations** (``handlers.py``): kopf's event handlers only add the job's key and return
  (client-go's workqueue semantics): events of a job that arrive while it waits add nothing, and a
  job that changes while a thread observes it is observed once more afterwards. A thread reads the
  watch caches when it takes the key, so every event is accounted for. kopf's per-object workers are
  then done within microseconds and release the event bodies; when handlers blocked on the API
  instead, a burst of jobs queued every pod and JobSet event in kopf, and the operator's memory
  tripled (docs/benchmarks/operator-throughput.md#2026-11-23-second-run-a59e1c5).
- **Status writes** (``status_writer.py``): the newest status of a job replaces one still waiting.

Each key carries a value; ``merge(waiting, new)`` combines a new value with one still waiting.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

Key = tuple[str, str]


def newest[V](waiting: V, new: V) -> V:
    return new


class WorkQueue[V]:
    def __init__(self, process: Callable[[Key, V], None], threads: int, merge: Callable[[V, V], V] = newest,
                 name: str = "work"):
        self._process = process
        self._merge = merge
        self._queue: deque[Key] = deque()
        self._waiting: dict[Key, V] = {}  # keys in the queue, or to run again once their run ends
        self._busy: set[Key] = set()
        self._cv = threading.Condition()
        self._stopping = False
        self._drain = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def add(self, key: Key, value: V) -> None:
        with self._cv:
            if self._stopping:
                return
            if key in self._waiting:
                self._waiting[key] = self._merge(self._waiting[key], value)
                return
            self._waiting[key] = value
            if key not in self._busy:  # else: queued again when its current run ends
                self._queue.append(key)
                self._cv.notify()

    def depth(self) -> int:
        with self._cv:
            return len(self._waiting)

    def has(self, key: Key) -> bool:
        """The key is waiting or being handled."""
        with self._cv:
            return key in self._waiting or key in self._busy

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def stop(self, timeout_s: float = 5.0, drain: bool = False) -> None:
        """Take no more keys; with ``drain``, handle those waiting first. Runs under way finish (each
        thread is waited for at most ``timeout_s``)."""
        with self._cv:
            self._stopping, self._drain = True, drain
            if not drain:
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
                if not self._queue or (self._stopping and not self._drain):
                    return
                key = self._queue.popleft()
                value = self._waiting.pop(key)
                self._busy.add(key)
            try:
                self._process(key, value)
            except Exception:  # a bug on one key must not stop the others
                log.exception(f"{key[0]}/{key[1]}: failed")
            finally:
                with self._cv:
                    self._busy.discard(key)
                    if key in self._waiting:  # it changed during the run
                        self._queue.append(key)
                        self._cv.notify()
