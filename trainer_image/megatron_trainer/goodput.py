"""Goodput: the share of a job's wall time spent on training steps it keeps, and where the rest went. Pure.

A job's time on its GPUs, from its first trainer process's start, splits into
- productive: training steps whose result the job keeps (iterations a later attempt redoes are not);
- start-up: process start -> first iteration done, every attempt (imports, NCCL, model, load, first step);
- save-blocked: the loop held by saves (its own part and any wait for the previous save, the final save too);
- lost: iterations done, then redone after a failure (resumed from an older checkpoint);
- restart: from a failed attempt's last report to the next attempt's process start (failure detection, the
  gang's teardown, rescheduling, container start; with it the work of the failed attempt after its last
  report, up to one report interval, which no one could count);
- other: the rest of the wall time (logging, evaluation, waits the loop does not time).
Time after an attempt that stopped cleanly (exit 0 after SIGTERM: a suspension, a preemption, a spec change)
until the next one starts is `stopped`: the job held no GPUs then, so it is not in the wall time.

Each attempt's rank 0 keeps the ledger in `goodput.json` beside the checkpoints (the job's durable state,
on a PVC or in the object store) and in status.progress.goodput. The next attempt closes the previous one
from that file: docs/operations.md, "Goodput".
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

LEDGER_NAME = "goodput.json"
VERSION = 1
PARTS = ("productive", "startup", "save_blocked", "lost", "restart")


@dataclass
class Attempt:
    """The current attempt's own figures (seconds; times are epoch seconds)."""

    started: float  # the process's start
    resumed_from: int = 0
    iteration: int = 0
    productive: float = 0.0
    startup: float = 0.0
    save_blocked: float = 0.0
    report_time: float = 0.0
    ended_cleanly: bool = False  # exited 0 after a stop (SIGTERM) or at the end

    @property
    def seconds_per_iteration(self) -> float | None:
        done = self.iteration - self.resumed_from
        return self.productive / done if done > 0 else None


@dataclass
class Ledger:
    since: float  # the first attempt's process start (epoch seconds)
    attempts: int = 1
    closed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    stopped: float = 0.0  # between a clean stop and the next start: no GPUs held, not in the wall time
    current: Attempt | None = None

    def to_json(self) -> str:
        return json.dumps({"version": VERSION, "since": self.since, "attempts": self.attempts, "closed": self.closed,
                           "stopped": self.stopped, "current": asdict(self.current) if self.current else None})

    @classmethod
    def from_json(cls, text: str | None) -> Ledger | None:
        """The ledger a previous attempt wrote, or None when there is none or it is unreadable (a fresh
        ledger then starts: goodput then covers the attempts since)."""
        try:
            raw = json.loads(text or "")
            if not isinstance(raw, dict) or raw.get("version") != VERSION:
                return None
            closed = {k: float(raw["closed"][k]) for k in PARTS}
            current = Attempt(**{k: (bool(v) if k == "ended_cleanly" else int(v) if k in ("resumed_from", "iteration")
                                     else float(v)) for k, v in raw["current"].items()}) if raw.get("current") else None
            ledger = cls(since=float(raw["since"]), attempts=int(raw["attempts"]), closed=closed,
                         stopped=float(raw.get("stopped", 0.0)), current=current)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        numbers = [ledger.since, ledger.stopped, *closed.values()]
        if not all(math.isfinite(x) and x >= 0 for x in numbers):
            return None
        return ledger


def begin(previous: Ledger | None, started: float, resumed_from: int) -> Ledger:
    """The ledger of a new attempt (process start `started`, resuming from iteration `resumed_from`): the
    previous attempt, as its last report left it, is closed first."""
    if previous is None:
        return Ledger(since=started, current=Attempt(started=started, resumed_from=resumed_from,
                                                     iteration=resumed_from, report_time=started))
    closed = dict(previous.closed)
    stopped = previous.stopped
    prev = previous.current
    if prev is not None:
        redone = max(0, prev.iteration - resumed_from)
        spi = prev.seconds_per_iteration or 0.0
        lost = min(prev.productive, redone * spi)
        closed["productive"] += prev.productive - lost
        closed["lost"] += lost
        closed["startup"] += prev.startup
        closed["save_blocked"] += prev.save_blocked
        gap = max(0.0, started - prev.report_time)
        if prev.ended_cleanly:
            stopped += gap
        else:
            closed["restart"] += gap
    return Ledger(since=previous.since, attempts=previous.attempts + 1, closed=closed, stopped=stopped,
                  current=Attempt(started=started, resumed_from=resumed_from, iteration=resumed_from,
                                  report_time=started))


def summary(ledger: Ledger, now: float) -> dict[str, float | int]:
    """The figures of status.progress.goodput (seconds, and the ratio productive / wall)."""
    cur = ledger.current
    parts = dict(ledger.closed)
    if cur is not None:
        parts["productive"] += cur.productive
        parts["save_blocked"] += cur.save_blocked
        # before the first iteration is done, the attempt's whole age is start-up
        parts["startup"] += cur.startup if cur.startup else max(0.0, now - cur.started - cur.productive)
    wall = max(0.0, now - ledger.since - ledger.stopped)
    other = max(0.0, wall - sum(parts.values()))
    out: dict[str, float | int] = {"ratio": round(parts["productive"] / wall, 4) if wall > 0 else 0.0,
                                   "wallSeconds": round(wall, 1), "attempts": ledger.attempts}
    names = {"productive": "productiveSeconds", "startup": "startupSeconds", "save_blocked": "saveBlockedSeconds",
             "lost": "lostSeconds", "restart": "restartSeconds"}
    out.update({names[k]: round(v, 1) for k, v in parts.items()})
    out["otherSeconds"] = round(other, 1)
    return out


def projected(startup_s: float, save_blocked_s: float, save_interval_s: float, restart_s: float,
              failures_per_day: float, days: float = 7.0) -> dict[str, float]:
    """The goodput of a long job from measured per-event costs: a save every `save_interval_s` of training
    blocks the loop `save_blocked_s`; each failure costs a restart, a start-up and on average half a save
    interval of redone work; the job starts once."""
    wall = days * 86400.0
    failures = failures_per_day * days
    per_failure = restart_s + startup_s + save_interval_s / 2
    save_share = save_blocked_s / (save_interval_s + save_blocked_s)
    productive = (wall - startup_s - failures * per_failure) * (1 - save_share)
    return {"wall_s": wall, "failures": failures, "per_failure_s": per_failure, "save_share": save_share,
            "goodput": productive / wall}
