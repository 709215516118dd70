"""The Argo CD health check (charts/megatron-operator/files/argocd/health.lua) in a real Lua 5.1
interpreter (lupa; Argo CD runs gopher-lua, a Lua 5.1), against statuses the operator's own
status.derive() produces and a few hand-made edge cases."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from factory import make_job
from lupa import lua51  # the test extra's lupa; Argo CD's gopher-lua is Lua 5.1
from megatron_operator.rules import Problem
from megatron_operator.status import JobSetView, Observation, PodView, derive, iso
from megatron_operator.validation import parse_job

ROOT = Path(__file__).resolve().parents[2]
HEALTH_LUA = ROOT / "charts" / "megatron-operator" / "files" / "argocd" / "health.lua"
GITOPS_DOC = ROOT / "docs" / "gitops.md"
NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
LAYOUT = {"tensor": 2, "pipeline": 2, "context": 1, "expert": 1, "data": 4}


def health(obj: dict[str, Any]) -> tuple[str, str]:
    """Run the check as Argo CD does: a global `obj`, the script's returned table."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(HEALTH_LUA.read_text())
    assert set(hs.keys()) <= {"status", "message"}
    return hs["status"], hs["message"]


def job_with(status: dict[str, Any] | None, generation: int = 1) -> dict[str, Any]:
    job = make_job()
    job["metadata"]["generation"] = generation
    if status is not None:
        job["status"] = status
    return job


def js(restarts: int = 0, suspended: bool = False, **conds: tuple[str, str]) -> JobSetView:
    return JobSetView(name="job", suspended=suspended, restarts=restarts,
                      conditions={k: {"status": "True", "reason": v[0], "message": v[1]} for k, v in conds.items()},
                      created=iso(NOW - timedelta(minutes=5)))


def running(n: int = 2, attempt: int = 0) -> list[PodView]:
    return [PodView(name=f"p{i}", phase="Running", restart_attempt=attempt) for i in range(n)]


def derived(**kw: Any) -> dict[str, Any]:
    """A status exactly as the operator writes it."""
    base = {"name": "job", "generation": 1, "num_nodes": 2, "world_size": 16, "layout": LAYOUT, "suspend": False,
            "queue_name": None, "previous": {}}
    base.update(kw)
    status, _ = derive(Observation(**base), NOW)
    return status


CASES = {
    # phase from the operator -> Argo CD health
    "pending-creating": (derived(), "Progressing", "Pending (Creating)"),
    "pending-unschedulable": (derived(jobset=js(), pods=[PodView("p0", "Pending", unschedulable="0/3 nodes")]),
                              "Progressing", "Unschedulable"),
    "queued-in-kueue": (derived(jobset=js(suspended=True), queue_name="team-a"), "Progressing", "Queued"),
    "running": (derived(jobset=js(), pods=running()), "Progressing", "Running (AllPodsRunning)"),
    "restarting": (derived(jobset=js(restarts=1), pods=running(1, attempt=1)), "Progressing", "Restarting"),
    "succeeded": (derived(jobset=js(Completed=("AllJobsCompleted", "done"))), "Healthy", "Succeeded"),
    "failed-restarts-exhausted": (derived(jobset=js(restarts=3, Failed=("ReachedMaxRestarts", "3 restarts"))),
                                  "Degraded", "RestartsExhausted"),
    "failed-invalid-spec": (derived(problems=[Problem("spec.parallelism.tensor", "tensor 3 does not divide 8",
                                                      "tp")]), "Degraded", "InvalidSpec"),
    "suspended": (derived(jobset=js(suspended=True), suspend=True), "Suspended", "Suspended"),
    "stalled": (derived(jobset=js(), pods=running(), stall_timeout_s=60,
                        previous={"phase": "Running", "startTime": iso(NOW - timedelta(hours=1)),
                                  "progress": {"iteration": 40}, "lastProgressIteration": 40,
                                  "lastProgressTime": iso(NOW - timedelta(minutes=30))}),
                "Degraded", "Stalled: no new iteration"),
    "running-not-stalled": (derived(jobset=js(), pods=running(), stall_timeout_s=3600,
                                    previous={"phase": "Running", "startTime": iso(NOW - timedelta(hours=1)),
                                              "progress": {"iteration": 41}, "lastProgressIteration": 40,
                                              "lastProgressTime": iso(NOW - timedelta(minutes=30))}),
                            "Progressing", "Running"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_health_of_operator_statuses(name):
    status, want_health, want_in_message = CASES[name]
    got, message = health(job_with(status))
    assert got == want_health, f"{name}: phase {status['phase']} -> {got} ({message})"
    assert want_in_message in message


def test_cases_cover_every_phase():
    from megatron_operator.metrics import PHASES

    assert {c[0]["phase"] for c in CASES.values()} == set(PHASES)


def test_no_status_yet_is_progressing():
    assert health(job_with(None))[0] == "Progressing"
    assert health(job_with({}))[0] == "Progressing"


def test_invalid_spec_condition_is_degraded_whatever_the_phase():
    status = {"phase": "Pending", "conditions": [{"type": "InvalidSpec", "status": "True", "reason": "InvalidSpec",
                                                  "message": "bad"}]}
    assert health(job_with(status))[0] == "Degraded"
    status["conditions"][0]["status"] = "False"
    assert health(job_with(status))[0] == "Progressing"


def test_unobserved_change_is_progressing_until_the_operator_catches_up():
    status = derived(jobset=js(), pods=running())  # observedGeneration 1
    assert health(job_with(status, generation=2)) == ("Progressing",
                                                      "Waiting for the operator to observe generation 2")
    assert health(job_with(status, generation=1))[0] == "Progressing"
    suspended = derived(jobset=js(suspended=True), suspend=True)
    assert health(job_with(suspended, generation=1))[0] == "Suspended"
    # a finished job stays Healthy/Degraded even if its spec is edited while the operator is down
    done = derived(jobset=js(Completed=("AllJobsCompleted", "done")))
    assert health(job_with(done, generation=5))[0] == "Healthy"


def test_unknown_phase_is_unknown():
    assert health(job_with({"phase": "Exploded"})) == ("Unknown", "Unknown phase Exploded")


def test_real_manifest_shape_parses():
    # the object Argo CD hands the script is the whole live manifest
    job = job_with(derived(jobset=js(), pods=running()))
    parse_job({k: job[k] for k in ("apiVersion", "kind", "metadata", "spec")})
    assert health(job)[0] == "Progressing"


def test_docs_embed_the_shipped_script():
    """docs/gitops.md shows the argocd-cm snippet; it must be the file the chart ships."""
    doc = GITOPS_DOC.read_text()
    blocks = re.findall(r"resource\.customizations\.health\.megatron-operator\.io_MegatronJob: \|\n((?:(?: {4}.*)?\n)+)",
                        doc)
    assert blocks, "docs/gitops.md has no argocd-cm health snippet"
    script = HEALTH_LUA.read_text()
    for block in blocks:
        body = "\n".join(line[4:] for line in block.splitlines()).strip("\n") + "\n"
        assert body == script, "docs/gitops.md's Lua differs from files/argocd/health.lua: copy the file again"
