"""kopf glue: the only module that imports kopf. Thin handlers that call ``controller.Controller``.

- Indexes of MegatronJobs, JobSets and pods (the latter two with a server-side label selector),
  so status is derived from watch caches, not API reads.
- ``observe``: on every event of a job (the initial listing after a start included), of its JobSet or
  of one of its pods, derive the status from the indexes and act on the difference (a new job's
  children are created here); plus one resync loop over all jobs (stall detection, deadlines, a
  status changed behind the operator's back, a create that failed).

No create/update handlers: kopf records their progress in annotations of the object, one more
write per job that costs the API server as much as a status write (the CRD's validation rules run
on every write). No per-object timers or daemons: kopf puts a finalizer on every object that has
one, and a finalizer would make deleting a MegatronJob hang whenever the operator is not running.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any

import kopf

from .controller import Controller
from .kube import PermanentApiError, TransientError
from .names import (
    GROUP,
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    LABEL_JOB_NAME,
    MANAGED_LABELS,
    MANAGED_SELECTOR,
    PLURAL,
    VERSION,
)
from .status import Event, PodView
from .workqueue import WorkQueue

MANAGED = MANAGED_LABELS

#: Threads that observe jobs (and create their children): API calls block them, the GIL does not.
OBSERVE_THREADS = 16


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: kopf diffs each object against its last handled state for create/update/resume
    handlers and daemons, and this operator has none (the module docstring says why). kopf still built
    that state, a deep copy of the object, for every event of every job, JobSet and pod: a quarter of
    its event loop's CPU in a burst of jobs (py-spy,
    docs/benchmarks/operator-throughput.md#2026-11-23-third-run-423fe49)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        raise RuntimeError("a kopf create/update/resume handler or daemon was added: it needs a real diff base "
                           "storage (kopf.AnnotationsDiffBaseStorage) instead of NoDiffBase")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress would live in annotations (the structural CRD would prune kopf's status.kopf,
    # and status belongs to the operator's own fields and the trainer's progress); there is none.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.level = logging.WARNING  # explicit events below; kopf's own only for problems
    # kopf logs "Handler ... succeeded" for every event of every pod, JobSet and job: tens of thousands
    # of lines in a burst of jobs, each formatted and written. Its warnings and errors stay.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    settings.posting.reporting_component = "megatron-operator"
    settings.scanning.disabled = True  # no CRD watching: no cluster-wide CRD read permission needed
    settings.watching.label_selectors[JOBSET_GROUP, JOBSET_PLURAL] = MANAGED_SELECTOR
    settings.watching.label_selectors["v1", "pods"] = MANAGED_SELECTOR
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def _emitter(body: dict[str, Any]):
    def emit(ev: Event) -> None:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message[:1024])
    return emit


# ---- indexes (watch-fed caches) -------------------------------------------------------------------

def _slim(metadata: Any) -> dict[str, Any]:
    """Metadata without managedFields: most of an object's size, and nothing the status needs."""
    return {k: v for k, v in metadata.items() if k != "managedFields"}


def _status_writers(metadata: Any) -> list[dict[str, Any]]:
    """Who wrote which top-level status field (from managedFields, a few bytes): the operator does not
    believe its own fields when another writer changed them (status.foreign_fields)."""
    out = []
    for entry in metadata.get("managedFields") or []:
        fields = ((entry.get("fieldsV1") or {}).get("f:status") or {}) if entry.get("subresource") == "status" else {}
        if fields:
            out.append({"manager": entry.get("manager"), "fieldsV1": {"f:status": {k: {} for k in fields}}})
    return out


# The index functions are async (pure and quick): kopf runs them in its event loop instead of handing
# each event to a thread.

@kopf.index(GROUP, VERSION, PLURAL)
async def jobs_by_key(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, name): {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                                "metadata": {**_slim(body.metadata), "managedFields": _status_writers(body.metadata)},
                                "spec": dict(body.spec),
                                "status": dict(body.status)}}


@kopf.index(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, labels=MANAGED)
async def jobsets_by_job(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, name): {"metadata": _slim(body.metadata), "spec": {"suspend": body.spec.get("suspend")},
                                "status": dict(body.status)}}


@kopf.index("v1", "pods", labels={**MANAGED, LABEL_JOB_NAME: kopf.PRESENT})
async def pods_by_job(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], PodView]:
    return {(namespace, labels[LABEL_JOB_NAME]): PodView.from_pod(dict(body))}


def _observe(memo: kopf.Memo, key: tuple[str, str], jobs: kopf.Index, jobsets: kopf.Index, pods: kopf.Index,
             resync: bool = False) -> None:
    """One observation of one job, on a work-queue thread (``workqueue.WorkQueue``)."""
    ctl: Controller = memo.controller

    def snapshot():
        return (next(iter(jobs.get(key, [])), None), next(iter(jobsets.get(key, [])), None),
                list(pods.get(key, [])))

    try:
        ctl.observe_key(key, snapshot, _emitter, resync=resync)
        ctl.metrics.reconciles.labels(kind="JobSet", result="success").inc()
    except (TransientError, PermanentApiError) as exc:
        ctl.metrics.errors.labels(kind="JobSet", error=type(exc).__name__).inc()
        logging.getLogger(__name__).warning(f"{key[0]}/{key[1]}: status not updated, retried on the next "
                                            f"event or resync: {exc}")


# ---- level-based observation ----------------------------------------------------------------------
# The event handlers are async and only queue the job's key: the observation runs on the work
# queue's threads, which read the caches when they take the key.

def _queue(memo: kopf.Memo, key: tuple[str, str]) -> None:
    memo.indexed.set()  # event handlers only run once every index is filled
    if "ctx" not in memo.event_context:
        # kopf.event() needs the posting context kopf sets for object handlers (the operator-wide
        # event queue and loop); the work-queue threads borrow it: the startup context lacks it, and
        # events were lost with a LookupError. memo is copied per object, so the holder is a dict
        # made at startup and shared by every copy.
        memo.event_context["ctx"] = contextvars.copy_context()
    memo.queue.add(key, False)


@kopf.on.event(GROUP, VERSION, PLURAL, id="observe-job")
async def job_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.controller.metrics.watch_events.labels(resource="megatronjobs").inc()
    _queue(memo, (namespace, name))  # a deleted job is forgotten by its observation (not in the cache)


@kopf.on.event(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, labels=MANAGED, id="observe-jobset")
async def jobset_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    memo.controller.metrics.watch_events.labels(resource="jobsets").inc()
    _queue(memo, (namespace, name))


@kopf.on.event("v1", "pods", labels={**MANAGED, LABEL_JOB_NAME: kopf.PRESENT}, id="observe-pod")
async def pod_event(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    memo.controller.metrics.watch_events.labels(resource="pods").inc()
    _queue(memo, (namespace, labels[LABEL_JOB_NAME]))


async def _resync_loop(memo: kopf.Memo, jobs: kopf.Index) -> None:
    """Every resync interval, queue every job for an observation that also compares with its stored status."""
    interval = memo.controller.settings.resync_interval_s
    while not memo.indexed.is_set():  # never act on half-filled caches
        await asyncio.sleep(0.2)
    while True:
        await asyncio.sleep(interval)
        for key in list(jobs):
            memo.queue.add(key, True)


@kopf.on.startup()
async def start_workers(memo: kopf.Memo, jobs_by_key: kopf.Index, jobsets_by_job: kopf.Index,
                        pods_by_job: kopf.Index, **_: Any) -> None:
    memo.indexed = asyncio.Event()
    memo.event_context = {}

    def process(key: tuple[str, str], resync: bool) -> None:
        base = memo.event_context.get("ctx")
        ctx = base.copy() if base is not None else contextvars.copy_context()
        ctx.run(_observe, memo, key, jobs_by_key, jobsets_by_job, pods_by_job, resync)

    # value: resync (the observation also compares with the stored status) if any request was one
    memo.queue = WorkQueue(process, OBSERVE_THREADS, merge=lambda waiting, new: waiting or new, name="observe")
    memo.resync_task = asyncio.create_task(_resync_loop(memo, jobs_by_key))


@kopf.on.startup()
async def serve_metrics(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """/metrics (Prometheus) and /healthz on one port, in kopf's event loop."""
    from aiohttp import web

    ctl: Controller = memo.controller

    async def metrics(_: web.Request) -> web.Response:
        data, ctype = ctl.metrics.exposition()
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def healthz(_: web.Request) -> web.Response:
        task = getattr(memo, "resync_task", None)
        if task is not None and task.done():
            return web.Response(status=500, text="resync loop stopped")
        queue = getattr(memo, "queue", None)
        if queue is not None and not queue.alive():
            return web.Response(status=500, text="observation threads stopped")
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host=memo.metrics_host, port=memo.metrics_port)
    await site.start()
    memo.metrics_runner = runner
    logger.info(f"serving /metrics and /healthz on {memo.metrics_host}:{memo.metrics_port}")


@kopf.on.cleanup()
async def stop_background(memo: kopf.Memo, **_: Any) -> None:
    task = getattr(memo, "resync_task", None)
    if task is not None:
        task.cancel()
    loop = asyncio.get_running_loop()
    queue = getattr(memo, "queue", None)
    if queue is not None:
        await loop.run_in_executor(None, queue.stop)
    await loop.run_in_executor(None, memo.controller.writer.stop)  # statuses waiting
    runner = getattr(memo, "metrics_runner", None)
    if runner is not None:
        await runner.cleanup()
