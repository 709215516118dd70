"""Observed children -> MegatronJob status (pure, level-based).

``derive()`` looks only at what exists now (the JobSet, the pods of the current attempt, the
trainer's progress, the previous status for transition times) and returns the operator-owned
status fields plus the events a person should see. Nothing here remembers edges: an operator
restarted at any point derives the same status from the same world.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from .failures import JOBSET_FAIL_ACTION_REASON, PodFailure
from .kueue import WorkloadView
from .memory import FitReport
from .names import (
    ANNOTATION_PARALLELISM,
    FIELD_MANAGER,
    JOBSET_RESTART_ATTEMPT_LABEL,
    JOBSET_UID_LABEL,
    LABEL_TP_GROUP,
    TRAINER_CONTAINER,
)
from .rules import Problem
from .spec import MAX_AVOIDED_NODES, Condition, MegatronJobStatus


class Phase:
    """``status.phase`` (a public API: kubectl columns, the Argo CD health check, alerts)."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionType:
    """``status.conditions[].type``: one per phase but Pending, plus these."""

    CREATED = "Created"
    RUNNING = Phase.RUNNING
    RESTARTING = Phase.RESTARTING
    SUSPENDED = Phase.SUSPENDED
    SUCCEEDED = Phase.SUCCEEDED
    FAILED = Phase.FAILED
    INVALID_SPEC = "InvalidSpec"
    STALLED = "Stalled"
    MEMORY_FIT = "MemoryFit"
    #: Jobs with ``spec.queueName`` only: True while Kueue has not admitted the job (queued, or
    #: preempted and queued again), with Kueue's own message.
    QUEUED = "Queued"
    #: Set once the trainer warns about its checkpoints (status.progress.saveWarning): saves come faster
    #: than one is written, or the volume cannot hold keep + 1 of them. True while the warning stands.
    CHECKPOINT_WARNING = "CheckpointWarning"
    #: A sidecar of the trainer pods (spec.pod.initContainers with restartPolicy Always) stopped and was restarted
    #: by the kubelet: it does not fail the job (the trainer's exit decides), but it is not doing its work. True
    #: while a pod of the job shows it; a finished job keeps what it last showed.
    SIDECAR_WARNING = "SidecarWarning"


class Reason:
    """``status.reason``, condition reasons and Event reasons (docs/troubleshooting.md lists them)."""

    # phase reasons
    INVALID_SPEC = "InvalidSpec"
    CREATING = "Creating"
    COMPLETED = "Completed"
    RESTARTS_EXHAUSTED = "RestartsExhausted"
    FAILED = "Failed"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    NON_RETRIABLE_EXIT_CODE = "NonRetriableExitCode"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    PREEMPTED = "Preempted"  # Kueue evicted the admitted job for a higher-priority one
    GANG_RESTART = "GangRestart"
    DISRUPTION = "Disruption"  # a gang restart after an eviction, preemption or lost node (not counted)
    ALL_PODS_RUNNING = "AllPodsRunning"
    UNSCHEDULABLE = "Unschedulable"
    WAITING = "Waiting"
    PODS_STARTING = "PodsStarting"
    NOT_OWNED = "NotOwned"  # a child's name is taken by an object the job does not control
    # condition reasons
    JOBSET_CREATED = "JobSetCreated"
    NOT_CREATED = "NotCreated"
    NO_PROGRESS = "NoProgress"
    PROGRESSING = "Progressing"
    FITS = "Fits"
    PREDICTED_OUT_OF_MEMORY = "PredictedOutOfMemory"
    SAVE_WARNING = "SaveWarning"
    NO_SAVE_WARNING = "NoSaveWarning"
    SIDECAR_RESTARTED = "SidecarRestarted"
    NO_SIDECAR_RESTARTS = "NoSidecarRestarts"
    # event-only reasons
    JOBSET_RECREATED = "JobSetRecreated"
    LAYOUT_CHANGED = "LayoutChanged"  # spec.parallelism changed while suspended: the JobSet is made again
    SPEC_WARNING = "SpecWarning"  # admitted, but may not run as meant (advice.spec_warnings)
    POD_FAILED = "PodFailed"
    STALLED = "Stalled"
    STALL_RESTART = "StallRestart"
    AVOIDING_NODE = "AvoidingNode"
    TP_GROUPS_COLLIDED = "TPGroupsCollided"  # two TP groups started on one host that has room for one: made again

    @staticmethod
    def not_(condition_type: str) -> str:
        """The reason of a phase condition that is False (``NotRunning``, ...)."""
        return f"Not{condition_type}"


TERMINAL = (Phase.SUCCEEDED, Phase.FAILED)
#: Start-up phases that get no event: the status says all there is (the JobSet is being created, its
#: pods are starting), and a burst of jobs paid one more API write per job for it (issue 30); nor does
#: the first Running that follows them outside Kueue (``_announced``). Every other phase change still
#: gets one: Pending for a reason (Unschedulable, Queued, a container's waiting reason), Running straight
#: after it, under Kueue or after a restart, restarts and the end.
QUIET_PHASES = ((Phase.PENDING, Reason.CREATING), (Phase.PENDING, Reason.PODS_STARTING))
# JobSet's own condition reason when its restarts ran out
_JOBSET_MAX_RESTARTS = "ReachedMaxRestarts"
# The status fields the operator owns (server-side apply): all of them but the trainer's progress.
OPERATOR_FIELDS = tuple(f.alias or n for n, f in MegatronJobStatus.model_fields.items() if n != "progress")
MAX_MESSAGE = 32000


def _announced(phase: str, reason: str, prev: dict[str, Any], queued: bool) -> bool:
    """Whether a phase change gets an event: not a quiet start-up phase, and not the first ``Running``
    of a job that comes to it from one (or from no status yet) outside Kueue. Phase, ``Running``
    condition and ``startTime`` say that a job started, and in a burst the event cost one more API
    write per job and a tenth of the operator's CPU (issue 30). A job in a Kueue queue keeps it (its
    events say Queued first), as does ``Running`` straight after a phase that had an event
    (Unschedulable, a container's waiting reason, Suspended) and every later one (after a restart, a
    stall restart, a suspension)."""
    if (phase, reason) in QUIET_PHASES:
        return False
    plain_start = (phase == Phase.RUNNING and not queued and not prev.get("startTime")
                   and (not prev.get("phase") or (prev.get("phase"), prev.get("reason")) in QUIET_PHASES))
    return not plain_start


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# RFC 3339 date-time (what the API server accepts for format: date-time): fractional seconds of any
# length, Z or a numeric offset, T/t or a space between date and time.
_RFC3339 = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?([Zz]|[+-]\d{2}:\d{2})")
# Clocks of the API server, the nodes and the operator differ a little; later than this is "in the future".
CLOCK_SKEW_S = 60


def parse_time(s: Any) -> datetime | None:
    """An RFC 3339 time as an aware datetime; None for anything else (never raises: a status that
    some writer filled badly must not stop the operator's work on the job)."""
    if not isinstance(s, str) or not (m := _RFC3339.fullmatch(s)):
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    micros = int((m.group(7) or "0")[:6].ljust(6, "0"))
    zone = m.group(8)
    tz = UTC if zone in ("Z", "z") else timezone(
        (1 if zone[0] == "+" else -1) * timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6])))
    try:
        return datetime(year, month, day, hour, minute, min(second, 59), micros, tzinfo=tz).astimezone(UTC)
    except ValueError:  # e.g. month 13
        return None


def past_time(s: Any, now: datetime) -> datetime | None:
    """``parse_time``, but None for a time in the future: such a startTime would stop
    activeDeadlineSeconds from ever firing, a future lastProgressTime the Stalled check."""
    t = parse_time(s)
    return t if t is not None and (t - now).total_seconds() <= CLOCK_SKEW_S else None


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
    failure: PodFailure | None = None  # a Failed pod: its node, exit code, reason and last lines
    ip: str | None = None  # status.podIP: what NCCL names a peer by
    node: str | None = None  # spec.nodeName
    jobset_uid: str | None = None  # the JobSet the pod belongs to (JobSet's label)
    sidecar_failure: str | None = None  # a sidecar that stopped and was restarted: which, how often, how
    tp_group: str | None = None  # the tensor-parallel group of a pod whose group spans pods (label tp-group)


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
            failure=PodFailure.from_pod(pod, TRAINER_CONTAINER, int(attempt) if attempt and attempt.isdigit() else None),
            ip=status.get("podIP"),
            node=(pod.get("spec") or {}).get("nodeName"),
            jobset_uid=(meta.get("labels") or {}).get(JOBSET_UID_LABEL),
            sidecar_failure=_sidecar_failure(pod),
            tp_group=(meta.get("labels") or {}).get(LABEL_TP_GROUP),
        )


def _sidecar_failure(pod: dict[str, Any]) -> str | None:
    """The first sidecar (an init container with restartPolicy Always) of ``pod`` that stopped by itself and was
    restarted, described; None when none did. A sidecar stopped by the kubelet when the trainer finished is not
    restarted, so the end of a pod never counts."""
    sidecars = {c.get("name") for c in (pod.get("spec") or {}).get("initContainers") or []
                if c.get("restartPolicy") == "Always"}
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        restarts = int(cs.get("restartCount") or 0)
        if cs.get("name") not in sidecars or restarts <= 0:
            continue
        last = (cs.get("lastState") or {}).get("terminated") or {}
        how = ", ".join(x for x in (f"exit code {last['exitCode']}" if "exitCode" in last else "",
                                     last.get("reason") or "") if x)
        tail = (last.get("message") or "").strip()[-200:]
        return (f"pod {(pod.get('metadata') or {}).get('name', '')}: sidecar {cs.get('name')} restarted "
                f"{restarts} time{'s' if restarts > 1 else ''}" + (f" (last: {how})" if how else "")
                + (f": {tail}" if tail else ""))
    return None


#: The scheduler's words for a node that a pod's required pod affinity rules out (the pod's TP group is elsewhere).
_AFFINITY_MISMATCH = "didn't match pod affinity rules"


@dataclass(frozen=True)
class Collision:
    """Tensor-parallel groups of one job that started on one host, where one of them cannot finish: its next pod is
    pinned to that host (the group's required pod affinity) and the host has no room left for it."""

    node: str
    group: str  # the group that waits
    others: tuple[str, ...]  # the other groups of the job on that node
    pod: str  # the group's pod that waits
    message: str  # the scheduler's message for it

    def describe(self) -> str:
        others = ", ".join(self.others)
        scheduler = self.message.split(". ")[0]  # "0/N nodes are available: ...", without the preemption part
        return (f"tensor-parallel group {self.group} and group{'s' if len(self.others) > 1 else ''} {others} of this "
                f"job started on node {self.node}, which has no room for the rest of group {self.group}: pod "
                f"{self.pod} can only join its group there ({scheduler})")


def tp_group_collision(pods: list[PodView], attempt: int | None = None) -> Collision | None:
    """The job's own placement deadlock, if its pods (of restart attempt ``attempt``) show one: a pod of a TP group
    that spans pods is Unschedulable because its group's required pod affinity pins it to the node where the group's
    other pods are, and that node also holds another group of the job. The scheduler places pod by pod; when only
    one host can take pods, the first pods of two groups can both land there (the preferred anti-affinity between
    groups only ranks the hosts that can take the pod), and then neither group fits. No group moves by itself: the
    pods on that host keep their GPUs. Found from the pods alone (pure); ``None`` when there is none."""
    live = [p for p in pods if p.tp_group is not None and not p.terminating and p.phase in ("Pending", "Running")
            and (attempt is None or p.restart_attempt in (None, attempt))]
    groups_on: dict[str, set[str]] = {}
    hosts_of: dict[str, set[str]] = {}
    for p in live:
        if p.node:
            groups_on.setdefault(p.node, set()).add(p.tp_group)  # type: ignore[arg-type]
            hosts_of.setdefault(p.tp_group, set()).add(p.node)  # type: ignore[arg-type]
    for p in sorted(live, key=lambda q: q.name):
        if p.node or not p.unschedulable or _AFFINITY_MISMATCH not in p.unschedulable:
            continue
        hosts = hosts_of.get(p.tp_group, set())  # type: ignore[arg-type]
        if len(hosts) != 1:
            continue
        (host,) = hosts
        others = groups_on[host] - {p.tp_group}
        if others:
            return Collision(host, p.tp_group, tuple(sorted(others, key=_group_order)), p.name,  # type: ignore[arg-type]
                             p.unschedulable)
    return None


def _group_order(group: str) -> tuple[int, str]:
    return (int(group), "") if group.isdigit() else (1 << 30, group)


@dataclass(frozen=True)
class JobSetView:
    name: str
    suspended: bool
    restarts: int
    conditions: dict[str, dict[str, str]]
    created: str | None
    disruptions: int = 0  # restarts JobSet did not count towards maxRestarts (status.restartsCountTowardsMax)
    parallelism: str | None = None  # the spec.parallelism it was rendered for (None: rendered before it was recorded)

    @classmethod
    def from_jobset(cls, js: dict[str, Any]) -> JobSetView:
        status = js.get("status") or {}
        return cls(
            name=js["metadata"]["name"],
            suspended=bool((js.get("spec") or {}).get("suspend")),
            restarts=int(status.get("restarts") or 0),
            disruptions=max(0, int(status.get("restarts") or 0) - int(status.get("restartsCountTowardsMax") or 0)),
            conditions={c["type"]: {"status": c.get("status", ""), "reason": c.get("reason", ""),
                                    "message": c.get("message", "")} for c in status.get("conditions") or []},
            created=js["metadata"].get("creationTimestamp"),
            parallelism=(js["metadata"].get("annotations") or {}).get(ANNOTATION_PARALLELISM),
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
    world_size: int | None  # None (and no layout) for a spec the models refuse
    layout: dict[str, Any] | None
    suspend: bool
    queue_name: str | None
    previous: dict[str, Any]  # the current status (operator-owned fields and the trainer's progress)
    problems: list[Problem] = field(default_factory=list)
    jobset: JobSetView | None = None
    pods: list[PodView] = field(default_factory=list)
    fit: FitReport | None = None
    deadline_s: int | None = None
    stall_timeout_s: int = 1800
    restart_on_stall: bool = False  # spec.restart.onStall
    not_owned: str | None = None  # why the children cannot be created (kube.NotOwned's message)
    workload: WorkloadView | None = None  # Kueue's, looked up while the job is queued or suspended
    peer_nodes: dict[str, str] = field(default_factory=dict)  # pod IP -> node of this job's pods, recent attempts


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def _phase(o: Observation, now: datetime) -> tuple[str, str, str]:
    """(phase, reason, message)."""
    prev_phase = o.previous.get("phase")
    if o.problems:
        return Phase.FAILED, Reason.INVALID_SPEC, "; ".join(p.message for p in o.problems)
    if prev_phase in TERMINAL and (o.jobset is None or prev_phase == Phase.FAILED):
        # A finished job stays finished: its JobSet is never recreated (deleted by hand, by TTL,
        # or by the operator on a deadline).
        return prev_phase, o.previous.get("reason", ""), o.previous.get("message", "")
    js = o.jobset
    if js is None and o.not_owned:
        return Phase.PENDING, Reason.NOT_OWNED, o.not_owned
    if js is None:
        return Phase.PENDING, Reason.CREATING, "creating the JobSet"
    if c := js.condition_true("Completed"):
        return Phase.SUCCEEDED, Reason.COMPLETED, c.get("message") or "all pods finished"
    if c := js.condition_true("Failed"):
        reason = (Reason.RESTARTS_EXHAUSTED if c.get("reason") == _JOBSET_MAX_RESTARTS
                  else (c.get("reason") or Reason.FAILED))
        return Phase.FAILED, reason, c.get("message") or "the JobSet failed"
    if o.deadline_s is not None:
        # counted from the first start, or from the JobSet's creation if the job never ran
        start = past_time(o.previous.get("startTime"), now) or past_time(js.created, now)
        if start and (now - start).total_seconds() > o.deadline_s:
            return Phase.FAILED, Reason.DEADLINE_EXCEEDED, f"the job ran longer than spec.activeDeadlineSeconds={o.deadline_s}"
    if js.suspended:
        if o.suspend:
            return Phase.SUSPENDED, Reason.SUSPENDED, "spec.suspend is true: pods are stopped, the checkpoint is kept"
        if o.queue_name:
            return _queued(o.queue_name, o.workload)
        return Phase.SUSPENDED, Reason.SUSPENDED, "the JobSet is suspended"
    if js.restarts > int(o.previous.get("restarts") or 0) and o.previous.get("phase"):
        # A gang restart since the last observation is reported as Restarting at least once, even when
        # the new pods are already running by now: the phase history and the event show every restart.
        if js.disruptions > int(o.previous.get("disruptions") or 0):
            return Phase.RESTARTING, Reason.DISRUPTION, (
                f"restart {js.restarts}: a pod was evicted, preempted or lost its node; the whole gang is restarted "
                f"and resumes from the last checkpoint; this does not count against maxRestarts "
                f"({js.restarts - js.disruptions} counted)")
        return Phase.RESTARTING, Reason.GANG_RESTART, (f"restart {js.restarts}: the whole gang is restarted and resumes "
                                             f"from the last checkpoint")
    current = [p for p in o.pods if not p.terminating and (p.restart_attempt is None or
                                                           p.restart_attempt == js.restarts)]
    running = [p for p in current if p.phase in ("Running", "Succeeded")]
    if len(running) >= o.num_nodes:
        stage = (o.previous.get("progress") or {}).get("stage")
        detail = f"; trainer: {stage}" if stage and stage != "training" else ""
        return Phase.RUNNING, Reason.ALL_PODS_RUNNING, f"{o.num_nodes} pods running{detail}"
    unsched = next((p for p in current if p.unschedulable), None)
    waiting = next((p for p in current if p.waiting_reason), None)
    if js.restarts > 0:
        detail = f"; {unsched.unschedulable}" if unsched else ""
        disrupted = js.disruptions == js.restarts or (o.previous.get("reason") == Reason.DISRUPTION and
                                                      js.restarts == int(o.previous.get("restarts") or 0))
        if disrupted:
            return Phase.RESTARTING, Reason.DISRUPTION, (
                f"restart {js.restarts} after a disruption (does not count against maxRestarts): "
                f"{len(running)}/{o.num_nodes} pods running, resuming from the last checkpoint{detail}")
        return Phase.RESTARTING, Reason.GANG_RESTART, (f"restart {js.restarts}: {len(running)}/{o.num_nodes} pods running, "
                                             f"resuming from the last checkpoint{detail}")
    if unsched:
        return Phase.PENDING, Reason.UNSCHEDULABLE, f"pod {unsched.name}: {unsched.unschedulable}"
    if waiting:
        return Phase.PENDING, waiting.waiting_reason or Reason.WAITING, f"pod {waiting.name}: {waiting.waiting_message or ''}".strip()
    return Phase.PENDING, Reason.PODS_STARTING, f"{len(running)}/{o.num_nodes} pods running"


def _queued(queue: str, wl: WorkloadView | None) -> tuple[str, str, str]:
    """A suspended JobSet under Kueue: waiting for admission, in Kueue's own words where it has them."""
    detail = f": {wl.waiting_message}" if wl is not None and wl.waiting_message else ""
    if wl is not None and wl.preempted:
        if wl.waiting_message == wl.evicted_message:  # Kueue repeats it until it tries to admit again
            detail = ""
        return Phase.PENDING, Reason.PREEMPTED, (f"preempted by Kueue ({wl.evicted_message}); the pods were stopped "
                                                 f"and the job waits to be admitted again from queue {queue}{detail}")
    return Phase.PENDING, Reason.QUEUED, f"waiting for Kueue to admit the job from queue {queue}{detail}"


class _Conditions:
    """The conditions of one derivation; ``lastTransitionTime`` moves only when a status flips."""

    def __init__(self, previous: dict[str, Any], now: datetime, generation: int):
        self.previous = {c["type"]: c for c in previous.get("conditions") or []}
        self.now, self.generation = now, generation
        self.items: list[Condition] = []

    def was_true(self, kind: str) -> bool:
        return (self.previous.get(kind) or {}).get("status") == "True"

    def transition_time(self, kind: str) -> datetime | None:
        """``lastTransitionTime`` of ``kind`` as set in this derivation (None if it was not set)."""
        return next((c.last_transition_time for c in self.items if c.type == kind), None)

    def set(self, kind: str, status: bool, reason: str, message: str = "") -> None:
        value = "True" if status else "False"
        old = self.previous.get(kind)
        kept = old and old.get("status") == value and past_time(old.get("lastTransitionTime"), self.now)
        changed_at = old["lastTransitionTime"] if kept else iso(self.now)
        self.items.append(Condition(type=kind, status=value, reason=reason, message=message[:MAX_MESSAGE],
                                    last_transition_time=changed_at, observed_generation=self.generation))


def _last_failure(o: Observation) -> tuple[dict[str, Any] | None, PodFailure | None]:
    """(``status.lastFailure``, the failure if it is new). The cause is the first failure of the latest
    attempt: pods stopped because the gang is torn down (deleted, SIGTERM) come after the ones that
    failed by themselves, and within an attempt the failure recorded first stays unless one finished
    strictly earlier. The previous one is kept once the failed pods are gone (the gang was recreated)."""
    previous = o.previous.get("lastFailure")
    # A pod being deleted that exited on SIGTERM was stopped by the teardown of the gang, not its cause
    # (kwok removes the pod that failed within a second, so its follower can be all that is left) -- unless
    # it carries DisruptionTarget: then it was evicted, and that is the cause.
    failed = [p for p in o.pods if p.failure is not None and (p.failure.disruption or not (
        p.terminating and p.failure.exit_code == 143))]
    if not failed:
        return previous, None
    latest = max(p.failure.restart_attempt or 0 for p in failed)  # type: ignore[union-attr]
    cause = min((p for p in failed if (p.failure.restart_attempt or 0) == latest),  # type: ignore[union-attr]
                key=lambda p: (p.terminating and not p.failure.disruption,  # type: ignore[union-attr]
                               p.failure.finished_at or "9999", p.failure.retriable, p.name))  # type: ignore[union-attr]
    found = cause.failure
    assert found is not None
    if previous:
        before = (previous.get("restartAttempt") or 0, previous.get("time") or "")
        if (previous.get("pod"), previous.get("time")) == (found.pod, found.finished_at) or \
                before[0] > (found.restart_attempt or 0) or \
                (before[0] == (found.restart_attempt or 0) and before[1] <= (found.finished_at or "")):
            return previous, None  # the same failure, an older attempt's pod seen late, or a follower
    return found.wire(), found


def blamed_node(failure: PodFailure, peer_nodes: dict[str, str]) -> tuple[str, str] | None:
    """(node, why) when a failure blames a node: its own (a GPU fault, a lost node), or the node of the
    job's pod that an NCCL error names as the peer (never the failed pod's own node: which side of a
    broken link failed, one report cannot tell; the peer is the one it names)."""
    if failure.node_fault is not None and failure.node:
        return failure.node, failure.node_fault
    for addr in failure.nccl_peers():
        node = peer_nodes.get(addr)
        if node and node != failure.node:
            return node, f"NCCL: pod {failure.pod} lost its connection to peer {addr} on this node"
    return None


def _avoided_entries(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in status.get("avoidedNodes") or [] if isinstance(a, dict) and a.get("node")]


def avoided_nodes(status: dict[str, Any]) -> set[str]:
    """The node names in a status's avoidedNodes."""
    return {a["node"] for a in _avoided_entries(status)}


def _avoided_nodes(prev: dict[str, Any], new_failure: PodFailure | None, now: datetime,
                   peer_nodes: dict[str, str]) -> list[dict[str, Any]]:
    """status.avoidedNodes: the previous ones, plus the node a new failure blames."""
    avoided = _avoided_entries(prev)
    blamed = blamed_node(new_failure, peer_nodes) if new_failure is not None else None
    if blamed is None or blamed[0] in avoided_nodes(prev):
        return avoided
    avoided.append({"node": blamed[0], "reason": blamed[1], "time": new_failure.finished_at or iso(now)})
    return avoided[-MAX_AVOIDED_NODES:]


_LAST_FAILURE = "; last failure: "


def _explain(phase: str, reason: str, message: str, failure: dict[str, Any] | None,
             new_failure: PodFailure | None) -> tuple[str, str, str]:
    """Name the failed pod in a failure's phase message (JobSet's own says only which Job failed)."""
    if phase == Phase.FAILED and reason == JOBSET_FAIL_ACTION_REASON:
        reason = Reason.NON_RETRIABLE_EXIT_CODE
        if failure is None:
            return phase, reason, message
    if failure is None or phase not in (Phase.FAILED, Phase.RESTARTING) or reason in (
            Reason.INVALID_SPEC, Reason.DEADLINE_EXCEEDED) or _LAST_FAILURE in message:
        return phase, reason, message  # (a finished job keeps its message, which has it already)
    text = new_failure.describe() if new_failure else _describe_wire(failure)
    return phase, reason, f"{message}{_LAST_FAILURE}{text}"


def _describe_wire(failure: dict[str, Any]) -> str:
    return PodFailure(pod=failure.get("pod", ""), node=failure.get("node"), exit_code=failure.get("exitCode"),
                      reason=failure.get("reason"), message=failure.get("message"),
                      finished_at=failure.get("time"), restart_attempt=failure.get("restartAttempt"),
                      disruption=failure.get("disruption")).describe()


#: A new iteration is recorded in status at most this many times per stall timeout (see derive).
PROGRESS_RECORDS_PER_TIMEOUT = 4


def derive(o: Observation, now: datetime | None = None) -> tuple[dict[str, Any], list[Event]]:
    """The operator-owned status fields (wire form, built through ``MegatronJobStatus``) and the events
    for this observation."""
    now = now or datetime.now(UTC)
    prev = o.previous
    conditions = _Conditions(prev, now, o.generation)
    phase, reason, message = _phase(o, now)
    events: list[Event] = []
    failure, new_failure = _last_failure(o)
    if new_failure:
        events.append(Event("Warning", Reason.POD_FAILED, new_failure.describe()))
    avoided = _avoided_nodes(prev, new_failure, now, o.peer_nodes)
    if avoided != (prev.get("avoidedNodes") or []):
        blamed = avoided[-1]
        events.append(Event("Warning", Reason.AVOIDING_NODE, f"node {blamed['node']}: {blamed['reason']}; the JobSet "
                            f"is recreated without it and the job resumes from its last checkpoint"))
    phase, reason, message = _explain(phase, reason, message, failure, new_failure)
    message = message[:MAX_MESSAGE]
    if (phase != prev.get("phase") or reason != prev.get("reason")) and _announced(phase, reason, prev, bool(o.queue_name)):
        warn = phase in (Phase.FAILED, Phase.RESTARTING) or reason in (Reason.UNSCHEDULABLE, Reason.GANG_RESTART,
                                                                      Reason.NOT_OWNED, Reason.PREEMPTED,
                                                                      Reason.DISRUPTION)
        events.append(Event("Warning" if warn else "Normal", reason if phase != Phase.RUNNING else Phase.RUNNING,
                            f"{phase}: {message}"))

    lay = o.layout
    jobset_name = o.jobset.name if o.jobset is not None else prev.get("jobSetName")
    # start / completion times: set once
    start = prev.get("startTime") if past_time(prev.get("startTime"), now) else None
    if not start and phase in (Phase.RUNNING, Phase.RESTARTING, Phase.SUCCEEDED):
        start = iso(now)
    completion = (prev.get("completionTime") if past_time(prev.get("completionTime"), now) else iso(now)) \
        if phase in TERMINAL else None

    if o.problems:
        conditions.set(ConditionType.INVALID_SPEC, True, Reason.INVALID_SPEC, message)
    if o.jobset is None and o.not_owned:
        conditions.set(ConditionType.CREATED, False, Reason.NOT_OWNED, o.not_owned)
    else:
        conditions.set(ConditionType.CREATED, bool(jobset_name), Reason.JOBSET_CREATED if jobset_name
                       else Reason.NOT_CREATED, f"JobSet {jobset_name or ''}".strip())
    for kind in (ConditionType.RUNNING, ConditionType.RESTARTING, ConditionType.SUSPENDED, ConditionType.SUCCEEDED,
                 ConditionType.FAILED):
        on = phase == kind
        conditions.set(kind, on, reason if on else Reason.not_(kind), message if on else "")

    if o.queue_name:
        waiting = reason in (Reason.QUEUED, Reason.PREEMPTED)
        conditions.set(ConditionType.QUEUED, waiting, reason if waiting else Reason.not_(ConditionType.QUEUED),
                       message if waiting else "")

    # Stalled: Running, but the trainer's reported iteration has not moved for stall_timeout_s.
    # A new iteration is recorded (lastProgressIteration/Time) at most once per stall_timeout_s /
    # PROGRESS_RECORDS_PER_TIMEOUT: recording every report (the trainer's, every 30 s) cost one more
    # status write per report and job. Recording late only makes Stalled late, never early: the stall
    # check below records a new iteration it finds before it counts time (at most 1.25x the timeout).
    progress = prev.get("progress") or {}
    it = progress.get("iteration")
    last_it, last_t = prev.get("lastProgressIteration"), prev.get("lastProgressTime")
    recorded = past_time(last_t, now)
    if it is not None and it != last_it:
        if last_it is None or recorded is None or \
                (now - recorded).total_seconds() >= o.stall_timeout_s / PROGRESS_RECORDS_PER_TIMEOUT:
            last_it, last_t = it, iso(now)
    elif last_it is not None and recorded is None:  # a future (or unreadable) time restarts the clock now
        last_it, last_t = it, iso(now)
    stall_restarts = int(prev.get("stallRestarts") or 0)
    if phase == Phase.RUNNING:
        since = past_time(last_t, now) or past_time(start, now) or now
        # never count the time before the gang (re)entered Running: after a gang restart, its start-up
        running_since = conditions.transition_time(ConditionType.RUNNING) \
            if ConditionType.RUNNING in conditions.previous else None
        if running_since is not None and since < running_since <= now:
            since = running_since
        idle = (now - since).total_seconds()
        if idle > o.stall_timeout_s:
            msg = (f"no new iteration for {int(idle)} s (last reported: {last_it if last_it is not None else 'none'}); "
                   f"check the trainer logs for a hang (NCCL timeout, data loader, storage)")
            if not conditions.was_true(ConditionType.STALLED):
                events.append(Event("Warning", Reason.STALLED, msg))
            if o.restart_on_stall:
                # The controller deletes the JobSet when stallRestarts goes up; it is recreated and
                # resumes from the last checkpoint. The stall clock starts again with the new gang.
                stall_restarts += 1
                last_t = iso(now)
                msg += (f"; spec.restart.onStall: restarting the gang from the last checkpoint "
                        f"(stall restart {stall_restarts})")
                events.append(Event("Warning", Reason.STALL_RESTART, msg))
            conditions.set(ConditionType.STALLED, True, Reason.NO_PROGRESS, msg)
        else:
            conditions.set(ConditionType.STALLED, False, Reason.PROGRESSING,
                           f"iteration {last_it}" if last_it is not None else "waiting for the first progress report")

    # The trainer's checkpoint warning (status.progress.saveWarning) as a condition and, when it first comes
    # up, an event: a slow save interval or a volume too small for keep + 1 checkpoints must not go unseen.
    save_warning = progress.get("saveWarning") if isinstance(progress.get("saveWarning"), str) else None
    if save_warning:
        if not conditions.was_true(ConditionType.CHECKPOINT_WARNING):
            events.append(Event("Warning", Reason.SAVE_WARNING, save_warning))
        conditions.set(ConditionType.CHECKPOINT_WARNING, True, Reason.SAVE_WARNING, save_warning)
    elif ConditionType.CHECKPOINT_WARNING in conditions.previous:
        conditions.set(ConditionType.CHECKPOINT_WARNING, False, Reason.NO_SAVE_WARNING)

    # A sidecar that keeps stopping is reported, never counted as the trainer's failure: the pod's phase (and so
    # the JobSet's) follows its regular container only.
    sidecar = next((p.sidecar_failure for p in o.pods if p.sidecar_failure), None)
    if sidecar:
        if not conditions.was_true(ConditionType.SIDECAR_WARNING):
            events.append(Event("Warning", Reason.SIDECAR_RESTARTED, sidecar))
        conditions.set(ConditionType.SIDECAR_WARNING, True, Reason.SIDECAR_RESTARTED, sidecar)
    elif (was := conditions.previous.get(ConditionType.SIDECAR_WARNING)) is not None:
        if phase in TERMINAL:  # the pods may be gone: keep what the job last showed
            conditions.set(ConditionType.SIDECAR_WARNING, was.get("status") == "True", was.get("reason", ""),
                           was.get("message", ""))
        else:  # e.g. a new gang after a restart
            conditions.set(ConditionType.SIDECAR_WARNING, False, Reason.NO_SIDECAR_RESTARTS)

    memory = None
    if o.fit is not None:
        est = o.fit
        memory = {"perGpuGiB": round(est.per_gpu_gib, 2), **(
            {"capacityGiB": est.capacity_gib, "fits": est.fits} if est.capacity_gib is not None else {})}
        if est.capacity_gib is not None:
            conditions.set(ConditionType.MEMORY_FIT, bool(est.fits),
                           Reason.FITS if est.fits else Reason.PREDICTED_OUT_OF_MEMORY, est.summary())
            if not est.fits and ConditionType.MEMORY_FIT not in conditions.previous:
                events.append(Event("Warning", Reason.PREDICTED_OUT_OF_MEMORY, est.summary()))

    optional = dict(job_set_name=jobset_name, start_time=start, completion_time=completion, memory=memory,
                    last_failure=failure, avoided_nodes=avoided or None, stall_restarts=stall_restarts or None,
                    last_progress_iteration=last_it, last_progress_time=last_t if (last_it is not None or stall_restarts) else None,
                    world_size=o.world_size,
                    parallelism={k: lay[k] for k in ("data", "tensor", "pipeline", "context", "expert")} if lay else None,
                    layout=f"{lay['tensor']}/{lay['pipeline']}/{lay['data']}" if lay else None)
    status = MegatronJobStatus(
        **{k: v for k, v in optional.items() if v not in (None, "")},
        phase=phase, reason=reason, message=message, observed_generation=o.generation,
        restarts=o.jobset.restarts if o.jobset else int(prev.get("restarts") or 0),
        disruptions=o.jobset.disruptions if o.jobset else int(prev.get("disruptions") or 0),
        conditions=conditions.items,
    )
    return status.model_dump(by_alias=True, exclude_none=True, mode="json"), events


def foreign_fields(managed_fields: Any) -> set[str]:
    """The operator's status fields that another field manager has written (from
    ``metadata.managedFields``): a non-apply update that changes a field takes its ownership."""
    out: set[str] = set()
    for entry in managed_fields if isinstance(managed_fields, list) else []:
        if not isinstance(entry, dict) or entry.get("manager") == FIELD_MANAGER:
            continue
        fields = ((entry.get("fieldsV1") or {}).get("f:status") or {}) if isinstance(entry.get("fieldsV1"), dict) else {}
        out |= {k[2:] for k in fields if isinstance(k, str) and k.startswith("f:")} & set(OPERATOR_FIELDS)
    return out


def changed(previous: dict[str, Any], desired: dict[str, Any]) -> bool:
    """True when an operator-owned field differs (so status is written once per change)."""
    return any(previous.get(k) != desired.get(k) for k in OPERATOR_FIELDS)
