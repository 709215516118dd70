"""kopf glue: the only module that imports kopf. Thin handlers that call ``controller.Controller``.

- ``reconcile`` (create and resume, one id): validate, create the children.
- ``observe`` (timer): derive status from the watch-fed JobSet and pod indexes, act on the
  difference, write status once per change.
- indexes of JobSets and pods (server-side label selector ``app.kubernetes.io/managed-by``), so
  the timer reads caches, not the API server.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from .controller import Controller, InvalidSpec
from .kube import PermanentApiError, TransientError
from .render import LABEL_JOB_NAME
from .settings import Settings
from .spec import GROUP, PLURAL, VERSION
from .status import Event, PodView

MANAGED = {"app.kubernetes.io/managed-by": "megatron-operator"}
MANAGED_SELECTOR = "app.kubernetes.io/managed-by=megatron-operator"
# Read once: decorator arguments are fixed at import (operator_main sets the environment first).
_INTERVAL_S = Settings.from_env().resync_interval_s


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress and the diff base live in annotations: the structural CRD would prune
    # kopf's status.kopf, and status belongs to the operator's own fields and the trainer's progress.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # explicit events below; kopf's own only for problems
    settings.posting.reporting_component = "megatron-operator"
    settings.scanning.disabled = True  # no CRD watching: no cluster-wide CRD read permission needed
    settings.watching.label_selectors["jobset.x-k8s.io", "jobsets"] = MANAGED_SELECTOR
    settings.watching.label_selectors["v1", "pods"] = MANAGED_SELECTOR
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16


def _emitter(body: kopf.Body):
    def emit(ev: Event) -> None:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message[:1024])
    return emit


@kopf.index("jobset.x-k8s.io", "v1alpha2", "jobsets", labels=MANAGED)
def jobsets_by_job(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict]:
    return {(namespace, name): {"metadata": dict(body.metadata), "spec": {"suspend": body.spec.get("suspend")},
                                "status": dict(body.status)}}


@kopf.index("v1", "pods", labels={**MANAGED, LABEL_JOB_NAME: kopf.PRESENT})
def pods_by_job(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[tuple[str, str], PodView]:
    return {(namespace, labels[LABEL_JOB_NAME]): PodView.from_pod(dict(body))}


@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile")
@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile")
def reconcile(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    ctl: Controller = memo.controller
    try:
        ctl.reconcile(dict(body), _emitter(body))
        ctl.metrics.reconciles.labels(kind="MegatronJob", result="success").inc()
    except InvalidSpec as exc:
        ctl.metrics.reconciles.labels(kind="MegatronJob", result="invalid").inc()
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    except TransientError as exc:
        ctl.metrics.errors.labels(kind="MegatronJob", error="transient").inc()
        raise kopf.TemporaryError(str(exc), delay=5) from None
    except PermanentApiError as exc:
        ctl.metrics.errors.labels(kind="MegatronJob", error="api").inc()
        raise kopf.TemporaryError(str(exc), delay=30) from None


@kopf.timer(GROUP, VERSION, PLURAL, id="observe", interval=_INTERVAL_S, initial_delay=1)
def observe(body: kopf.Body, namespace: str, name: str, memo: kopf.Memo, jobsets_by_job: kopf.Index,
            pods_by_job: kopf.Index, logger: logging.Logger, **_: Any) -> None:
    ctl: Controller = memo.controller
    key = (namespace, name)
    jobset = next(iter(jobsets_by_job.get(key, [])), None)
    pods = list(pods_by_job.get(key, []))
    try:
        ctl.observe(dict(body), jobset, pods, _emitter(body))
        ctl.metrics.reconciles.labels(kind="JobSet", result="success").inc()
    except (TransientError, PermanentApiError) as exc:
        ctl.metrics.errors.labels(kind="JobSet", error=type(exc).__name__).inc()
        logger.warning(f"status not updated, retrying on the next tick: {exc}")


@kopf.on.event(GROUP, VERSION, PLURAL, id="forget")
def forget(type: str, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED":
        memo.controller.forget(namespace, name)


@kopf.on.startup()
async def serve_metrics(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """/metrics (Prometheus) and /healthz on one port, in kopf's event loop."""
    from aiohttp import web

    ctl: Controller = memo.controller

    async def metrics(_: web.Request) -> web.Response:
        data, ctype = ctl.metrics.exposition()
        return web.Response(body=data, headers={"Content-Type": ctype})

    async def healthz(_: web.Request) -> web.Response:
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
async def stop_metrics(memo: kopf.Memo, **_: Any) -> None:
    runner = getattr(memo, "metrics_runner", None)
    if runner is not None:
        await runner.cleanup()
