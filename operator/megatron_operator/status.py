"""Observed children -> MegatronJob status (pure, level-based).

``derive()`` looks only at what exists now (the JobSet, the pods of the current attempt, the
trainer's progress, the previous status for transition times) and returns the operator-owned
status fields plus the events a person should see. Nothing here remembers edges: an operator
restarted at any point derives the same status from the same world.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .memory import FitReport
from .names import JOBSET_RESTART_ATTEMPT_LABEL
from .rules import Problem

TERMINAL = ("Succeeded", "Failed")
CORE_CONDITIONS = ("Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


@dataclass(frozen=True)
class PodView:
    """What the status needs of one pod (kept in the operator's pod index)."""

    name: str
    phase: str
    ready: bool = False
    restart_attempt: int | None = None
    unschedulable: str | None = None  # the scheduler's message when PodScheduled=False
    waiting_reason: str | None = None  # e.g. ImagePullBackOff
    waiting_message: str | None = None
    terminating: bool = False

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> PodView:
        meta, status = pod.get("metadata", {}), pod.get("status", {}) or {}
        attempt = (meta.get("labels") or {}).get(JOBSET_RESTART_ATTEMPT_LABEL)
        conds = {c.get("type"): c for c in status.get("conditions") or []}
        sched = conds.get("PodScheduled", {})
        unsched = sched.get("message") if sched.get("status") == "False" and sched.get("reason") == "Unschedulable" else None
        waiting = None
        for cs in status.get("containerStatuses") or []:
            w = (cs.get("state") or {}).get("waiting")
            if w and w.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
                waiting = w
        return cls(
            name=meta.get("name", ""),
            phase=status.get("phase", "Pending"),
            ready=conds.get("Ready", {}).get("status") == "True",
            restart_attempt=int(attempt) if attempt and attempt.isdigit() else None,
            unschedulable=unsched,
            waiting_reason=(waiting or {}).get("reason"),
            waiting_message=(waiting or {}).get("message"),
            terminating=bool(meta.get("deletionTimestamp")),
        )


@dataclass(frozen=True)
class JobSetView:
    name: str
    suspended: bool
    restarts: int
    conditions: dict[str, dict[str, str]]
    created: str | None

    @classmethod
    def from_jobset(cls, js: dict[str, Any]) -> JobSetView:
        status = js.get("status") or {}
        return cls(
            name=js["metadata"]["name"],
            suspended=bool((js.get("spec") or {}).get("suspend")),
            restarts=int(status.get("restarts") or 0),
            conditions={c["type"]: {"status": c.get("status", ""), "reason": c.get("reason", ""),
                                    "message": c.get("message", "")} for c in status.get("conditions") or []},
            created=js["metadata"].get("creationTimestamp"),
        )

    def condition_true(self, kind: str) -> dict[str, str] | None:
        c = self.conditions.get(kind)
        return c if c and c["status"] == "True" else None


@dataclass
class Observation:
    """Everything ``derive`` looks at."""

    name: str
    generation: int
    num_nodes: int
    world_size: int
    layout: dict[str, Any]
    suspend: bool
    queue_name: str | None
    previous: dict[str, Any]  # the current status (operator-owned fields and the trainer's progress)
    problems: list[Problem] = field(default_factory=list)
    jobset: JobSetView | None = None
    pods: list[PodView] = field(default_factory=list)
    fit: FitReport | None = None
    deadline_s: int | None = None
    stall_timeout_s: int = 1800


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def _phase(o: Observation, now: datetime) -> tuple[str, str, str]:
    """(phase, reason, message)."""
    prev_phase = o.previous.get("phase")
    if o.problems:
        return "Failed", "InvalidSpec", "; ".join(p.message for p in o.problems)
    if prev_phase in TERMINAL and (o.jobset is None or prev_phase == "Failed"):
        # A finished job stays finished: its JobSet is never recreated (deleted by hand, by TTL,
        # or by the operator on a deadline).
        return prev_phase, o.previous.get("reason", ""), o.previous.get("message", "")
    js = o.jobset
    if js is None:
        return "Pending", "Creating", "creating the JobSet"
    if c := js.condition_true("Completed"):
        return "Succeeded", "Completed", c.get("message") or "all pods finished"
    if c := js.condition_true("Failed"):
        reason = "RestartsExhausted" if c.get("reason") == "ReachedMaxRestarts" else (c.get("reason") or "Failed")
        return "Failed", reason, c.get("message") or "the JobSet failed"
    if o.deadline_s is not None:
        # counted from the first start, or from the JobSet's creation if the job never ran
        start = parse_time(o.previous.get("startTime")) or parse_time(js.created)
        if start and (now - start).total_seconds() > o.deadline_s:
            return "Failed", "DeadlineExceeded", f"the job ran longer than spec.activeDeadlineSeconds={o.deadline_s}"
    if js.suspended:
        if o.suspend:
            return "Suspended", "Suspended", "spec.suspend is true: pods are stopped, the checkpoint is kept"
        if o.queue_name:
            return "Pending", "Queued", f"waiting for Kueue to admit the job from queue {o.queue_name}"
        return "Suspended", "Suspended", "the JobSet is suspended"
    if js.restarts > int(o.previous.get("restarts") or 0) and o.previous.get("phase"):
        # A gang restart since the last observation is reported as Restarting at least once, even when
        # the new pods are already running by now: the phase history and the event show every restart.
        return "Restarting", "GangRestart", (f"restart {js.restarts}: the whole gang is restarted and resumes "
                                             f"from the last checkpoint")
    current = [p for p in o.pods if not p.terminating and (p.restart_attempt is None or
                                                           p.restart_attempt == js.restarts)]
    running = [p for p in current if p.phase == "Running" or p.phase == "Succeeded"]
    if len(running) >= o.num_nodes:
        return "Running", "AllPodsRunning", f"{o.num_nodes} pods running"
    unsched = next((p for p in current if p.unschedulable), None)
    waiting = next((p for p in current if p.waiting_reason), None)
    if js.restarts > 0:
        detail = f"; {unsched.unschedulable}" if unsched else ""
        return "Restarting", "GangRestart", (f"restart {js.restarts}: {len(running)}/{o.num_nodes} pods running, "
                                             f"resuming from the last checkpoint{detail}")
    if unsched:
        return "Pending", "Unschedulable", f"pod {unsched.name}: {unsched.unschedulable}"
    if waiting:
        return "Pending", waiting.waiting_reason or "Waiting", f"pod {waiting.name}: {waiting.waiting_message or ''}".strip()
    return "Pending", "PodsStarting", f"{len(running)}/{o.num_nodes} pods running"


def _condition(prev: dict[str, dict[str, Any]], kind: str, status: bool | str, reason: str, message: str,
               now: datetime, generation: int) -> dict[str, Any]:
    value = status if isinstance(status, str) else ("True" if status else "False")
    old = prev.get(kind)
    # lastTransitionTime only moves when the status flips
    ltt = old["lastTransitionTime"] if old and old.get("status") == value else iso(now)
    return {"type": kind, "status": value, "reason": reason, "message": message[:32000],
            "lastTransitionTime": ltt, "observedGeneration": generation}


def derive(o: Observation, now: datetime | None = None) -> tuple[dict[str, Any], list[Event]]:
    """The operator-owned status fields and the events for this observation."""
    now = now or datetime.now(UTC)
    prev = o.previous
    prev_conds = {c["type"]: c for c in prev.get("conditions") or []}
    phase, reason, message = _phase(o, now)
    events: list[Event] = []
    if phase != prev.get("phase") or reason != prev.get("reason"):
        warn = phase == "Failed" or reason in ("Unschedulable", "GangRestart") or phase == "Restarting"
        events.append(Event("Warning" if warn else "Normal", reason if phase != "Running" else "Running",
                            f"{phase}: {message}"))

    lay = o.layout
    status: dict[str, Any] = {
        "phase": phase,
        "reason": reason,
        "message": message,
        "observedGeneration": o.generation,
        "worldSize": o.world_size,
        "parallelism": {k: lay[k] for k in ("data", "tensor", "pipeline", "context", "expert")},
        "layout": f"{lay['tensor']}/{lay['pipeline']}/{lay['data']}",
        "restarts": o.jobset.restarts if o.jobset else int(prev.get("restarts") or 0),
    }
    if o.jobset is not None:
        status["jobSetName"] = o.jobset.name
    elif prev.get("jobSetName"):
        status["jobSetName"] = prev["jobSetName"]

    # start / completion times: set once
    start = prev.get("startTime")
    if not start and phase in ("Running", "Restarting", "Succeeded"):
        start = iso(now)
    if start:
        status["startTime"] = start
    completion = prev.get("completionTime")
    if phase in TERMINAL:
        status["completionTime"] = completion or iso(now)

    conds: list[dict[str, Any]] = []
    c = lambda *a: conds.append(_condition(prev_conds, *a, now=now, generation=o.generation))  # noqa: E731
    if o.problems:
        c("InvalidSpec", True, "InvalidSpec", message)
    c("Created", o.jobset is not None or bool(prev.get("jobSetName")),
      "JobSetCreated" if (o.jobset or prev.get("jobSetName")) else "NotCreated",
      f"JobSet {o.jobset.name if o.jobset else prev.get('jobSetName') or ''}".strip())
    for kind in ("Running", "Restarting", "Suspended", "Succeeded", "Failed"):
        on = phase == kind
        c(kind, on, reason if on else f"Not{kind}", message if on else "")

    # Stalled: Running, but the trainer's reported iteration has not moved for stall_timeout_s
    progress = prev.get("progress") or {}
    it = progress.get("iteration")
    last_it, last_t = prev.get("lastProgressIteration"), prev.get("lastProgressTime")
    if it is not None and it != last_it:
        last_it, last_t = it, iso(now)
    if phase == "Running":
        since = parse_time(last_t) or parse_time(start) or now
        idle = (now - since).total_seconds()
        if idle > o.stall_timeout_s:
            msg = (f"no new iteration for {int(idle)} s (last reported: {last_it if last_it is not None else 'none'}); "
                   f"check the trainer logs for a hang (NCCL timeout, data loader, storage)")
            c("Stalled", True, "NoProgress", msg)
            if not prev_conds.get("Stalled") or prev_conds["Stalled"].get("status") != "True":
                events.append(Event("Warning", "Stalled", msg))
        else:
            c("Stalled", False, "Progressing", f"iteration {last_it}" if last_it is not None else "waiting for the "
              "first progress report")
    if last_it is not None:
        status["lastProgressIteration"] = last_it
        status["lastProgressTime"] = last_t

    if o.fit is not None:
        est = o.fit
        status["memory"] = {"perGpuGiB": round(est.per_gpu_gib, 2), **(
            {"capacityGiB": est.capacity_gib, "fits": est.fits} if est.capacity_gib is not None else {})}
        if est.capacity_gib is not None:
            c("MemoryFit", bool(est.fits), "Fits" if est.fits else "PredictedOutOfMemory", est.summary())
            if not est.fits and "MemoryFit" not in prev_conds:
                events.append(Event("Warning", "PredictedOutOfMemory", est.summary()))
    status["conditions"] = conds
    return status, events


OWNED_FIELDS = ("phase", "reason", "message", "observedGeneration", "worldSize", "parallelism", "layout", "restarts",
                "jobSetName", "startTime", "completionTime", "conditions", "lastProgressIteration",
                "lastProgressTime", "memory")


def changed(previous: dict[str, Any], desired: dict[str, Any]) -> bool:
    """True when an operator-owned field differs (so status is written once per change)."""
    return any(previous.get(k) != desired.get(k) for k in OWNED_FIELDS)
