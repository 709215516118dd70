"""The operator's Prometheus metrics (its own registry) and the /metrics + /healthz endpoint."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PHASES = ("Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended")
#: megatron_operator_job_time_seconds{kind} -> the status.progress.goodput field
GOODPUT_KINDS = {"wall": "wallSeconds", "productive": "productiveSeconds", "startup": "startupSeconds",
                 "save_blocked": "saveBlockedSeconds", "lost": "lostSeconds", "restart": "restartSeconds",
                 "other": "otherSeconds"}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter("megatron_operator_reconciles_total", "Reconcile passes, by kind and result",
                                  ["kind", "result"], registry=self.registry)
        self.errors = Counter("megatron_operator_reconcile_errors_total", "Failed reconcile passes, by kind and "
                              "error class", ["kind", "error"], registry=self.registry)
        self.jobset_latency = Histogram(
            "megatron_operator_jobset_creation_seconds",
            "Seconds from MegatronJob creation (its creationTimestamp) to its JobSet created",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300), registry=self.registry)
        self.jobs = Gauge("megatron_operator_jobs", "MegatronJobs by phase", ["phase"], registry=self.registry)
        self.status_writes = Counter("megatron_operator_status_writes_total", "Status writes (once per change)",
                                     registry=self.registry)
        self.api_requests = Counter(
            "megatron_operator_api_requests_total",
            "API requests the operator made, by verb and resource as the API server names them (events: the "
            "ones it handed to kopf to post), and HTTP status (0: no answer, or an event: kopf posts it)",
            ["verb", "resource", "code"], registry=self.registry)
        self.watch_events = Counter(
            "megatron_operator_watch_events_total",
            "Watch events kopf handed to the operator's event handlers, by resource (megatronjobs, jobsets, pods)",
            ["resource"], registry=self.registry)
        self.job_phase = Gauge("megatron_operator_job_phase", "1 for the current phase of each MegatronJob",
                               ["namespace", "name", "phase"], registry=self.registry)
        self.job_goodput = Gauge("megatron_operator_job_goodput_ratio",
                                 "Productive training time / wall time of each MegatronJob over all its attempts "
                                 "(status.progress.goodput.ratio, the trainer's goodput ledger)",
                                 ["namespace", "name"], registry=self.registry)
        self.job_time = Gauge("megatron_operator_job_time_seconds",
                              "Where each MegatronJob's wall time went, over all its attempts: productive, startup, "
                              "save_blocked, lost, restart, other (status.progress.goodput)",
                              ["namespace", "name", "kind"], registry=self.registry)
        self._goodput: set[tuple[str, str]] = set()
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        for p in PHASES:
            self.jobs.labels(phase=p).set(0)

    def observe_jobset_created(self, creation_timestamp: str | None) -> None:
        if not creation_timestamp:
            return
        created = datetime.strptime(creation_timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        self.jobset_latency.observe(max(0.0, (datetime.now(UTC) - created).total_seconds()))

    def api_request(self, verb: str, resource: str, code: int) -> None:
        self.api_requests.labels(verb=verb, resource=resource, code=str(code)).inc()

    def set_phase(self, ns: str, name: str, phase: str) -> None:
        with self._lock:
            old = self._phases.get((ns, name))
            if old == phase:
                return
            if old is not None:
                self.job_phase.remove(ns, name, old)
            self.job_phase.labels(namespace=ns, name=name, phase=phase).set(1)
            self._phases[(ns, name)] = phase
            self._refresh()

    def set_goodput(self, ns: str, name: str, goodput: Any) -> None:
        """The trainer's goodput figures (status.progress.goodput) as gauges; figures that are not numbers
        are skipped (the status is the trainer's to write)."""
        if not isinstance(goodput, dict):
            return
        with self._lock:
            ratio = goodput.get("ratio")
            if isinstance(ratio, (int, float)) and not isinstance(ratio, bool):
                self.job_goodput.labels(namespace=ns, name=name).set(ratio)
            for kind, field in GOODPUT_KINDS.items():
                value = goodput.get(field)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.job_time.labels(namespace=ns, name=name, kind=kind).set(value)
            self._goodput.add((ns, name))

    def forget(self, ns: str, name: str) -> None:
        with self._lock:
            old = self._phases.pop((ns, name), None)
            if old is not None:
                self.job_phase.remove(ns, name, old)
            if (ns, name) in self._goodput:
                self._goodput.discard((ns, name))
                try:
                    self.job_goodput.remove(ns, name)
                except KeyError:
                    pass
                for kind in GOODPUT_KINDS:
                    try:
                        self.job_time.remove(ns, name, kind)
                    except KeyError:
                        pass
            self._refresh()

    def _refresh(self) -> None:
        counts = dict.fromkeys(PHASES, 0)
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            self.jobs.labels(phase=phase).set(n)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
