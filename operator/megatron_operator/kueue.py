"""Kueue's Workload of a MegatronJob's JobSet, as the status and the suspend step need it (pure).

Kueue (sigs.k8s.io/kueue) admits a queued JobSet through a Workload it creates for it (labelled
``kueue.x-k8s.io/job-uid: <JobSet uid>``). Its conditions carry Kueue's own words for why the job
waits (``QuotaReserved`` False: "couldn't assign flavors ...") or was stopped (``Evicted`` True:
preempted, deactivated). ``spec.active`` is Kueue's supported switch for stopping a job it manages:
setting the JobSet's ``suspend`` instead is undone by Kueue while the Workload is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Workload condition types and the eviction reason of spec.active=false (Kueue's API, the same in v1beta1 and v1beta2)
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
EVICTED_BY_PREEMPTION = "Preempted"
EVICTED_BY_DEACTIVATION = "Deactivated"


@dataclass(frozen=True)
class WorkloadView:
    name: str
    active: bool
    admitted: bool
    waiting_message: str | None = None  # QuotaReserved False: why Kueue does not admit it yet
    evicted_reason: str | None = None  # Evicted True: Preempted, Deactivated, ...
    evicted_message: str | None = None

    @classmethod
    def from_workload(cls, wl: dict[str, Any]) -> WorkloadView:
        conds = {c.get("type"): c for c in (wl.get("status") or {}).get("conditions") or []}

        def true(kind: str) -> dict[str, Any] | None:
            c = conds.get(kind)
            return c if c and c.get("status") == "True" else None

        quota = conds.get(QUOTA_RESERVED)
        evicted = true(EVICTED)
        return cls(
            name=wl["metadata"]["name"],
            active=(wl.get("spec") or {}).get("active", True) is not False,
            admitted=true(ADMITTED) is not None,
            waiting_message=quota.get("message") if quota and quota.get("status") == "False" else None,
            evicted_reason=evicted.get("reason") if evicted else None,
            evicted_message=evicted.get("message") if evicted else None,
        )

    @property
    def preempted(self) -> bool:
        return self.evicted_reason == EVICTED_BY_PREEMPTION
