"""The reconcile steps, as a flat list of named functions (no kopf here; ``handlers.py`` is glue).

``observe`` runs for a live MegatronJob on every event of it, its JobSet or its pods (the initial
listing after an operator start included), and from one periodic resync loop (``handlers.py``):
validate, derive the status from what exists (the JobSet and pods come from watch-fed indexes),
act on the difference (create the children of a new job, recreate a JobSet that was deleted while
the job was unfinished, enforce suspend and the deadline), hand the status to the status writer
if it changed, and emit events for transitions. It is idempotent: an operator killed at any point
and restarted leaves exactly one JobSet per MegatronJob (children have fixed names, a create that
finds the object is a success). There is no create handler: kopf would record its progress in an
annotation, one more write per job, each as costly as a status write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import status as st
from .advice import size_problems, spec_warnings
from .guardrails import guardrail_problems
from .kube import Kube, NotOwned, PermanentApiError, TransientError, controller_uid
from .kueue import WorkloadView
from .memory import FitReport, fit_report
from .metrics import Metrics
from .render import parallelism_key, render
from .rules import Problem, derived_layout
from .settings import Settings
from .spec import MegatronJob, MegatronJobSpec
from .status_writer import StatusWriter
from .validation import SpecError, parse_job

log = logging.getLogger(__name__)

EmitFn = Callable[[st.Event], None]

#: After creating a job's JobSet, observations wait this long for the JobSet's watch event before
#: creating it again (a JobSet deleted before the operator ever saw it is recreated after that).
JOBSET_WATCH_GRACE_S = 30.0

#: A new job's first status, when all it says is that the JobSet or its pods are starting, waits this
#: long for a newer one (the status writer's delay): pods that run within it make the first write say
#: Running, one MegatronJob write instead of two (each costs the API server its CEL rules, about 13 ms;
#: issue 30). Any other status (Running, Unschedulable, a container's waiting reason, Queued, a
#: failure) is written at once and replaces the waiting one. The cost: for at most this long after
#: the JobSet was created, ``kubectl get mj`` shows no phase.
FIRST_STATUS_DELAY_S = 10.0

#: The wait before re-placing a job whose TP groups collided (settings.tp_group_collision_s) doubles with each
#: re-placement of that job, up to this many times the setting; it starts again once the job runs.
TP_COLLISION_BACKOFF_MAX = 8


@dataclass
class Parsed:
    job: MegatronJob | None
    problems: list[Problem]
    fit: FitReport | None = None


def parse_body(body: dict[str, Any], settings: Settings | None = None) -> Parsed:
    """Validate the object as the API server gave it (status and server metadata stripped), and
    check the cluster admin's guardrails (``settings``)."""
    doc = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
           "metadata": {k: v for k, v in (body.get("metadata") or {}).items()
                        if k in ("name", "namespace", "labels", "annotations", "uid", "generation")},
           "spec": body.get("spec")}
    try:
        job = parse_job(doc)
    except SpecError as exc:
        return Parsed(None, exc.problems)
    if settings is not None and (problems := guardrail_problems(job, settings) or size_problems(job, settings)):
        return Parsed(job, problems)
    report = fit_report(job)
    if report is not None and report.fits is False and job.spec.resources.memory_fit == "Reject":
        return Parsed(job, [Problem("spec.resources", "spec.resources.memoryFit is Reject and the job does not "
                                    "fit: " + report.summary(), "memory-fit")], report)
    return Parsed(job, [], report)


def _new_gang_wanted(previous: dict[str, Any], desired: dict[str, Any], phase: str) -> bool:
    """The JobSet is to be deleted and created again (it resumes from the last checkpoint): the job
    Stalled with spec.restart.onStall (stallRestarts went up), or a failure added a node to
    avoidedNodes that the scheduler would pick again (a GPU fault, an NCCL peer; a lost node is
    tainted NoSchedule, so JobSet's own gang restart avoids it). JobSet allows no affinity change,
    so the new pods' rule needs a new JobSet."""
    if int(desired.get("stallRestarts") or 0) > int(previous.get("stallRestarts") or 0):
        return True
    failure = desired.get("lastFailure") or {}
    return phase not in st.TERMINAL and bool(st.avoided_nodes(desired) - st.avoided_nodes(previous)) \
        and not failure.get("disruption")


Snapshot = Callable[[], tuple[dict[str, Any] | None, dict[str, Any] | None, list[st.PodView]]]


class Controller:
    def __init__(self, kube: Kube, settings: Settings, metrics: Metrics, status_threads: int = 0):
        """``status_threads``: workers that write the status (``status_writer``); 0 writes inline."""
        self.kube = kube
        self.settings = settings
        self.metrics = metrics
        self.writer = StatusWriter(lambda ns, name, status: self.kube.apply_status(ns, name, status),
                                   threads=status_threads,
                                   on_written=self._status_written, on_error=self._status_failed)
        # Observations of one job are serialised.
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # Per job: (MegatronJob uid, monotonic time, the JobSet as the create returned it, or None when
        # it was found) of the JobSet this process created and has not yet seen in the JobSet index.
        # Until its watch event arrives (our own status write is one), observations derive from that
        # JobSet: they neither create the children again (four creates that all answer 409) nor write
        # a "creating the JobSet" status that the watch event would replace a moment later.
        self._created: dict[tuple[str, str], tuple[str, float, dict[str, Any] | None]] = {}
        # The status this operator last decided per job (written, or waiting in the status writer).
        # Watch caches lag behind our own writes; without this a second observation could re-derive
        # from a stale status and repeat events.
        self._written: dict[tuple[str, str], dict[str, Any]] = {}
        # Validation and the memory estimate per (uid, generation): the spec of a generation never
        # changes, and observations run on every pod and JobSet event.
        self._parsed: dict[tuple[str, str], tuple[tuple[str, int], Parsed]] = {}
        # Per job: pod IP -> node of its pods seen lately (NCCL names a failed peer by its IP; the
        # peer's pod may be gone, torn down with the gang, when the failure is observed).
        self._peer_nodes: dict[tuple[str, str], dict[str, str]] = {}
        # Per job (by UID): the child whose name is taken by an object this job does not control.
        self._not_owned: dict[tuple[str, str], tuple[str, str]] = {}
        # Per job: (JobSet uid, monotonic time) since when its pods show a TP-group collision (status.tp_group_collision),
        # and (MegatronJob uid, count) of the re-placements made for collisions since it last ran.
        self._collided: dict[tuple[str, str], tuple[str, float]] = {}
        self._replaced: dict[tuple[str, str], tuple[str, int]] = {}

    def parse(self, body: dict[str, Any]) -> Parsed:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        version = (meta.get("uid") or "", int(meta.get("generation") or 0))
        cached = self._parsed.get(key)
        if cached is None or cached[0] != version:
            cached = self._parsed[key] = (version, parse_body(body, self.settings))
        return cached[1]

    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def observe_key(self, key: tuple[str, str], snapshot: Snapshot, emit_for: Callable[[dict], EmitFn],
                    resync: bool = False) -> None:
        """Observe one job under its lock, reading the caches only once the lock is held (the work
        queue never runs two observations of one job at once; the lock keeps that true for callers
        that do not go through it). A job gone from the cache (deleted) is forgotten."""
        with self._lock(key):
            body, jobset, pods = snapshot()
            if body is None:
                self.forget(*key)
                return
            if (body.get("metadata") or {}).get("deletionTimestamp"):
                return
            emit = emit_for(body)

            def counted(ev: st.Event) -> None:
                self.metrics.api_request("POST", "events", 0)  # posted by kopf, in its event loop
                emit(ev)
            self.observe(body, jobset, pods, counted, resync=resync)

    # ---- children ---------------------------------------------------------------------------------

    def not_owned(self, meta: dict[str, Any]) -> str | None:
        """Why this job's children cannot be created (a name taken by an object it does not control)."""
        found = self._not_owned.get((meta["namespace"], meta["name"]))
        return found[1] if found and found[0] == meta.get("uid") else None

    def ensure_children(self, job: MegatronJob, body: dict[str, Any], emit: EmitFn,
                        avoid_nodes: Iterable[str] = ()) -> bool:
        """Create whatever child is missing (the JobSet's pods kept off ``avoid_nodes``); False when a
        child's name is taken by an object this job does not control (nothing after it is created;
        retried on every observation)."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        jobset = None
        for obj in render(job, self.settings, owner_uid=meta["uid"], avoid_nodes=list(avoid_nodes)):
            try:
                created = self.kube.create(obj)
            except NotOwned as exc:
                self._not_owned[key] = (meta["uid"], str(exc))
                return False
            if obj["kind"] == "JobSet" and created:
                jobset = created
                for warning in spec_warnings(job, self.settings):
                    emit(st.Event("Warning", st.Reason.SPEC_WARNING, warning))
                self.metrics.observe_jobset_created(meta.get("creationTimestamp"))
                # A first JobSet gets no event: the status's Created condition (reason JobSetCreated, with
                # its time) says it, and a burst of jobs paid one more API write per job for it (issue 30).
                if (body.get("status") or {}).get("jobSetName"):
                    emit(st.Event("Warning", st.Reason.JOBSET_RECREATED,
                                  f"JobSet {obj['metadata']['name']} was missing and is recreated; training resumes "
                                  f"from the last checkpoint"))
        self._not_owned.pop(key, None)
        self._created[key] = (meta["uid"], time.monotonic(), jobset)
        self.metrics.reconciles.labels(kind="MegatronJob", result="success").inc()
        return True

    def _awaiting_jobset(self, key: tuple[str, str], uid: str) -> tuple[bool, dict[str, Any] | None]:
        """(True, the JobSet as created or None) while this process created the job's JobSet a moment
        ago and its watch event has yet to arrive."""
        created = self._created.get(key)
        if created is None or created[0] != uid or time.monotonic() - created[1] >= JOBSET_WATCH_GRACE_S:
            return False, None
        return True, created[2]

    # ---- the level-based loop -------------------------------------------------------------------

    def observe(self, body: dict[str, Any], jobset: dict[str, Any] | None, pods: Iterable[st.PodView],
                emit: EmitFn, parsed: Parsed | None = None, resync: bool = False) -> None:
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        parsed = parsed or self.parse(body)
        key = (ns, name)
        written = self._written.get(key)
        if written is not None and written.get("_uid") != meta.get("uid"):
            written = None  # a new object with the same name
        # The operator's fields as some other writer left them (a trainer token may patch its job's
        # status: a phase, a future startTime) are not believed; they are derived afresh and rewritten.
        foreign = st.foreign_fields(meta.get("managedFields"))
        stored = {k: v for k, v in (body.get("status") or {}).items() if k not in foreign}
        previous = {**stored, **{k: v for k, v in (written or {}).items() if k != "_uid"}}
        job = parsed.job
        spec = job.spec if job is not None else None  # None: the models refuse it (status says why)
        if jobset is not None and controller_uid(jobset) != meta.get("uid"):
            # A JobSet of this name that this job does not control (another MegatronJob's of the same
            # name still being garbage-collected, or someone else's): never read or act on it.
            jobset = None
        if jobset is not None:
            self._created.pop(key, None)  # seen: from now on a missing JobSet is recreated
            awaiting = False
        else:
            awaiting, jobset = self._awaiting_jobset(key, meta["uid"])
        js_view = st.JobSetView.from_jobset(jobset) if jobset else None
        workload = self.workload(ns, jobset, spec)
        pod_list = list(pods)
        peer_nodes = self._remember_peers(key, pod_list)  # every pod seen, the torn-down gang's too
        if jobset is not None:  # the gang is this JobSet's pods: a deleted JobSet's may linger (GC)
            js_uid = (jobset.get("metadata") or {}).get("uid")
            pod_list = [p for p in pod_list if p.jobset_uid in (None, js_uid)]
        obs = st.Observation(
            name=name, generation=int(meta.get("generation") or 0),
            num_nodes=spec.num_nodes if spec else 0,
            world_size=spec.num_nodes * spec.processes_per_node if spec else None,
            layout=derived_layout(spec.wire()) if spec else None,
            suspend=spec.suspend if spec else False, queue_name=spec.queue_name if spec else None,
            previous=previous, problems=parsed.problems, jobset=js_view,
            pods=pod_list,
            fit=parsed.fit,
            deadline_s=spec.active_deadline_seconds if spec else None,
            stall_timeout_s=self.settings.stall_timeout_s,
            restart_on_stall=spec.restart.on_stall if spec else False,
            not_owned=self.not_owned(meta),
            workload=workload,
            peer_nodes=peer_nodes,
        )
        try:
            desired, events = st.derive(obs)
        except Exception as exc:  # any writer's bad status must not stop the work on this job
            log.warning(f"{ns}/{name}: the stored status cannot be read ({exc}); deriving it afresh")
            obs.previous = {"progress": previous["progress"]} if isinstance(previous.get("progress"), dict) else {}
            desired, events = st.derive(obs)
        phase = desired["phase"]

        # act on the difference
        if job is not None and not parsed.problems:
            if js_view is None and phase not in st.TERMINAL:
                if not awaiting:  # else: found a moment ago; its watch event has yet to arrive
                    try:
                        self.ensure_children(job, body, emit, st.avoided_nodes(desired))
                    except (TransientError, PermanentApiError) as exc:
                        kind = "transient" if isinstance(exc, TransientError) else "api"
                        self.metrics.errors.labels(kind="MegatronJob", error=kind).inc()
                        log.warning(f"{ns}/{name}: children not created, retried on the next event or "
                                    f"resync: {exc}")
                        return  # nothing written, no event
                    _, created = self._awaiting_jobset(key, meta["uid"])
                    if created is not None:  # derive from the JobSet just created, not "creating" it
                        obs.jobset = st.JobSetView.from_jobset(created)
                        desired, events = st.derive(obs)
                if obs.not_owned != self.not_owned(meta):  # a conflict found or gone: report it now
                    obs.not_owned = self.not_owned(meta)
                    desired, events = st.derive(obs)
            elif js_view is not None:
                wanted = parallelism_key(job)
                if phase not in st.TERMINAL and js_view.suspended and js_view.parallelism not in (None, wanted):
                    # spec.parallelism changed while the job was suspended (the CRD allows it only then): the
                    # pods of a new JobSet start with the new layout and resume from the last checkpoint.
                    self.kube.delete_jobset(ns, js_view.name)
                    self._created.pop(key, None)
                    emit(st.Event("Normal", st.Reason.LAYOUT_CHANGED,
                                  f"spec.parallelism changed while suspended ({js_view.parallelism} -> {wanted}): "
                                  f"the JobSet is created again; the job resumes from its last checkpoint under the "
                                  f"new layout"))
                elif phase == st.Phase.FAILED and desired["reason"] == st.Reason.DEADLINE_EXCEEDED:
                    self.kube.delete_jobset(ns, js_view.name)
                elif _new_gang_wanted(previous, desired, phase):
                    self.kube.delete_jobset(ns, js_view.name)  # recreated by the next pass; resumes
                    self._created.pop(key, None)
                elif (collision := self._collision_due(key, meta.get("uid") or "", jobset, js_view, pod_list,
                                                       phase)) is not None:
                    # No pod of it moves by itself and the pods on that host keep their GPUs: place the gang anew
                    # (the job cannot have started: a pod of it was never placed).
                    self.kube.delete_jobset(ns, js_view.name)  # recreated by the next pass
                    self._created.pop(key, None)
                    emit(st.Event("Warning", st.Reason.TP_GROUPS_COLLIDED,
                                  f"{collision.describe()}; the JobSet is created again so that its pods are placed "
                                  f"anew (re-placement {self._replaced[key][1]} of this job)"))
                elif phase not in st.TERMINAL:
                    self.sync_suspend(ns, js_view, job.spec.suspend, bool(job.spec.queue_name), workload)

        # Event-driven passes trust what we wrote; the periodic resync compares with the stored status
        # itself, so a status changed behind our back (or a lost write) converges within one interval.
        stored = body.get("status") or {}
        in_flight = self.writer.has(key) and not st.changed(previous, desired)  # stored lags behind it
        if (foreign & desired.keys()) or (st.changed(stored if resync else previous, desired) and not in_flight):
            if parsed.problems and st.changed(previous, desired):
                self.metrics.reconciles.labels(kind="MegatronJob", result="invalid").inc()
            self._written[key] = {**desired, "_uid": meta.get("uid")}
            first = not stored.get("phase") and (desired["phase"], desired["reason"]) in st.QUIET_PHASES
            self.writer.submit(key, desired, delay_s=FIRST_STATUS_DELAY_S if first else 0.0)
        for ev in events:
            emit(ev)
        self.metrics.set_phase(ns, name, phase)
        self.metrics.set_goodput(ns, name, (previous.get("progress") or {}).get("goodput"))

    def _collision_due(self, key: tuple[str, str], job_uid: str, jobset: dict[str, Any] | None,
                       js: st.JobSetView | None, pods: list[st.PodView], phase: str) -> st.Collision | None:
        """The job's TP-group collision (status.tp_group_collision) once it has lasted settings.tp_group_collision_s
        (doubled for each earlier re-placement of the job, up to TP_COLLISION_BACKOFF_MAX times): then the JobSet
        is to be created again. Counted from the first observation that saw it for this JobSet."""
        grace = self.settings.tp_group_collision_s
        if phase == st.Phase.RUNNING:
            self._replaced.pop(key, None)  # placed: the next collision waits the plain time again
        js_uid = ((jobset or {}).get("metadata") or {}).get("uid")
        found = None
        if grace > 0 and js is not None and js_uid and not js.suspended and phase not in st.TERMINAL:
            found = st.tp_group_collision(pods, js.restarts)
        if found is None:
            self._collided.pop(key, None)
            return None
        seen = self._collided.get(key)
        if seen is None or seen[0] != js_uid:
            seen = self._collided[key] = (js_uid, time.monotonic())
        uid, count = self._replaced.get(key, (job_uid, 0))
        count = count if uid == job_uid else 0
        if time.monotonic() - seen[1] < grace * min(2 ** count, TP_COLLISION_BACKOFF_MAX):
            return None
        del self._collided[key]
        self._replaced[key] = (job_uid, count + 1)
        return found

    def workload(self, ns: str, jobset: dict[str, Any] | None, spec: MegatronJobSpec | None) -> WorkloadView | None:
        """Kueue's Workload of the JobSet, read only while it matters: the JobSet is suspended (queued,
        preempted) or the user asks for suspend."""
        if spec is None or not spec.queue_name or jobset is None:
            return None
        if not (spec.suspend or (jobset.get("spec") or {}).get("suspend")):
            return None
        wl = self.kube.find_workload(ns, jobset["metadata"]["uid"])
        return WorkloadView.from_workload(wl) if wl else None

    def sync_suspend(self, ns: str, js: st.JobSetView, want_suspended: bool, kueue: bool,
                     workload: WorkloadView | None = None) -> None:
        """Make the JobSet's suspend follow spec.suspend. Under Kueue through the Workload's spec.active:
        Kueue un-suspends a JobSet suspended by hand while its Workload is admitted (kueue#1091)."""
        if kueue:
            if workload is not None and workload.active == want_suspended:
                self.kube.set_workload_active(ns, workload.name, not want_suspended)
            return
        if want_suspended and not js.suspended:
            self.kube.set_jobset_suspend(ns, js.name, True)
        elif not want_suspended and js.suspended:
            self.kube.set_jobset_suspend(ns, js.name, False)

    def _status_written(self, key: tuple[str, str], status: dict[str, Any]) -> None:
        self.metrics.status_writes.inc()

    def _status_failed(self, key: tuple[str, str], status: dict[str, Any], exc: Exception) -> None:
        if isinstance(exc, PermanentApiError) and exc.status == 404:
            return  # the job was deleted meanwhile
        self.metrics.errors.labels(kind="MegatronJob", error=type(exc).__name__).inc()
        log.warning(f"{key[0]}/{key[1]}: status not written, derived again on the next event or resync: {exc}")
        written = self._written.get(key)
        if written is not None and {k: v for k, v in written.items() if k != "_uid"} == status:
            self._written.pop(key, None)  # compare with the stored status again, not with this one

    def _remember_peers(self, key: tuple[str, str], pods: Iterable[st.PodView]) -> dict[str, str]:
        """This job's pod IP -> node map, with the pods observed now (bounded: the latest 4096)."""
        seen = self._peer_nodes.setdefault(key, {})
        for p in pods:
            if p.ip and p.node:
                seen.pop(p.ip, None)
                seen[p.ip] = p.node
        while len(seen) > 4096:
            seen.pop(next(iter(seen)))
        return seen

    def forget(self, ns: str, name: str) -> None:
        self.metrics.forget(ns, name)
        self._written.pop((ns, name), None)
        self._parsed.pop((ns, name), None)
        self._not_owned.pop((ns, name), None)
        self._created.pop((ns, name), None)
        self._peer_nodes.pop((ns, name), None)
        self._collided.pop((ns, name), None)
        self._replaced.pop((ns, name), None)
        with self._locks_guard:
            self._locks.pop((ns, name), None)
