"""GitOps on a real Argo CD (e2e/argocd.py: application controller + repo server of the version in
e2e/cluster/versions.env, Redis, a Git repository served by `git daemon`) against the local
control plane: the chart as a Helm-source Application, MegatronJobs as a directory Application
(health from the chart's Lua check, sync, drift, Git edits, prune) and a Kueue-queued job.

MegatronJobs are run by the session's host operator (the `operator` fixture), as in every other
e2e test; the chart Application's Deployment becomes a kwok pod (docs/local-cluster.md).
docs/gitops.md says what these tests prove.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from argocd import ArgoCD
from k8s import GPU_TOLERATION, POD_FAIL_EXIT_CODE, POD_FAIL_LABEL, POD_FAIL_REASON
from lupa import lua51
from mjob import Jobs, run_for, small_job, wait_gone

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "megatron-operator"
HEALTH_LUA = CHART / "files" / "argocd" / "health.lua"
SYNC_TIMEOUT_S = 120
PHASE_TIMEOUT_S = 150
KIND = "MegatronJob"


@pytest.fixture(scope="module")
def argocd(cluster, crd, tmp_path_factory):
    a = ArgoCD(cluster, tmp_path_factory.mktemp("argocd"))
    try:
        a.start()
        yield a
    finally:
        a.stop()


def lua_health(obj: dict[str, Any]) -> tuple[str, str]:
    """The chart's health check on `obj` in a Lua 5.1 interpreter, as Argo CD (gopher-lua) runs it."""
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    hs = lua.execute(HEALTH_LUA.read_text())
    return hs["status"], hs["message"]


def health_of(argocd: ArgoCD, app: dict[str, Any], name: str) -> tuple[str, str] | None:
    r = argocd.resource(app, KIND, name)
    if r is None or not r.get("health"):
        return None
    return r["health"].get("status"), r["health"].get("message", "")


def synced_at(app: dict[str, Any], revision: str) -> bool:
    st = app.get("status") or {}
    return (st.get("sync", {}).get("status") == "Synced" and st.get("sync", {}).get("revision") == revision
            and (st.get("operationState") or {}).get("phase") == "Succeeded"
            and (st.get("operationState") or {}).get("syncResult", {}).get("revision") == revision)


def failing_job(name: str, code: int = 3) -> dict[str, Any]:
    """A job whose trainer pods exit with `code` as soon as they run (kwok's failure stage)."""
    return small_job(name, podMetadata={"labels": {POD_FAIL_LABEL: "true"},
                                        "annotations": {POD_FAIL_EXIT_CODE: str(code), POD_FAIL_REASON: "Error",
                                                        **run_for(300)["annotations"]}})


def app_name(prefix: str, namespace: str) -> str:
    """Also the Helm release name: short, so the chart's names stay within 63 characters."""
    return f"{prefix}-{namespace.rsplit('-', 1)[-1]}"


# -- 1. the chart as a Helm-source Application -------------------------------------------------


def test_chart_application_brings_the_operator_up_healthy(cluster, argocd, namespace):
    rev = argocd.git.copy_tree(CHART, f"charts/{namespace}/megatron-operator", "the chart")
    name = app_name("op", namespace)
    values = {"crds": {"enabled": False},  # the CRD is the session's (e2e/test_helm.py says why)
              "tolerations": [GPU_TOLERATION]}
    argocd.application(name, {"path": f"charts/{namespace}/megatron-operator",
                              "helm": {"valuesObject": values}}, namespace)
    try:
        app = argocd.wait(name, lambda a: synced_at(a, rev) and a["status"]["health"]["status"] == "Healthy",
                          SYNC_TIMEOUT_S, f"Synced at {rev[:8]} and Healthy", namespace=namespace)
        st = app["status"]
        assert st["sourceType"] == "Helm", st
        kinds = {(r["kind"], r["name"]) for r in st["resources"]}
        dep = f"{name}-megatron-operator" if "megatron-operator" not in name else name
        assert ("Deployment", dep) in kinds, kinds
        d = argocd.resource(app, "Deployment", dep)
        assert d["health"]["status"] == "Healthy" and d["status"] == "Synced", d
        assert all(r["status"] == "Synced" for r in st["resources"]), st["resources"]
        apps = kubernetes.client.AppsV1Api(cluster.api_client())
        live = apps.read_namespaced_deployment(dep, namespace)
        assert live.status.available_replicas == live.spec.replicas >= 1
        assert live.metadata.annotations.get("argocd.argoproj.io/tracking-id", "").startswith(f"{name}:apps/Deployment")
    finally:
        argocd.delete_application(name)
    assert not kubernetes.client.AppsV1Api(cluster.api_client()).list_namespaced_deployment(namespace).items


# -- 2. MegatronJobs: health from the chart's check, sync status across status updates ---------


@pytest.mark.parametrize("diff", ["default", "server-side"])
def test_job_health_and_sync_follow_the_jobs(cluster, argocd, operator, namespace, diff):
    """Argo CD's default (client-side apply, three-way diff), and server-side apply with server-side
    diff: the same health, and neither needs ignoreDifferences to stay Synced."""
    jobs = Jobs(cluster, namespace)
    docs = {
        "ok": small_job("ok", podMetadata=run_for(20)),
        "bad": failing_job("bad"),
        "paused": small_job("paused", suspend=True),
    }
    path = f"jobs/{namespace}"
    rev = argocd.git.write({f"{path}/{n}.yaml": d for n, d in docs.items()}, "three jobs")
    name = app_name("jobs", namespace)
    argocd.application(name, {"path": path}, namespace, server_side=diff == "server-side")
    seen: dict[str, list[tuple[str, str]]] = {n: [] for n in docs}
    out_of_sync_after_sync: list[Any] = []
    synced = False

    def observe(app: dict[str, Any]) -> bool:
        nonlocal synced
        st = app.get("status") or {}
        if synced_at(app, rev):
            synced = True
        elif synced and st.get("sync", {}).get("status") != "Synced":
            out_of_sync_after_sync.append((st.get("sync"), [r for r in st.get("resources", [])
                                                             if r.get("status") != "Synced"]))
        for n in docs:
            h = health_of(argocd, app, n)
            if h and (not seen[n] or seen[n][-1] != h):
                seen[n].append(h)
        done = {n: (seen[n][-1][0] if seen[n] else None) for n in docs}
        return synced and done == {"ok": "Healthy", "bad": "Degraded", "paused": "Suspended"}

    try:
        app = argocd.wait(name, observe, PHASE_TIMEOUT_S, "ok Healthy, bad Degraded, paused Suspended",
                          namespace=namespace)
        print("health seen by Argo CD:", seen)
        assert not out_of_sync_after_sync, out_of_sync_after_sync
        # Progressing while the job ran, with the phase as our check words it.
        assert any(s == "Progressing" and m.startswith("Running") for s, m in seen["ok"]), seen["ok"]
        # Every verdict Argo CD shows is the chart's Lua run on the live object, word for word.
        for n in docs:
            live = jobs.get(n)
            assert health_of(argocd, app, n) == lua_health(live), (n, live.get("status"))
        assert jobs.phase("ok") == "Succeeded"
        bad = jobs.status("bad")
        assert bad["phase"] == "Failed" and bad["reason"] == "NonRetriableExitCode", bad
        status, message = health_of(argocd, app, "bad")
        assert status == "Degraded" and message.startswith("Failed (NonRetriableExitCode): ")
        assert "exit code 3" in message, message   # the failure cause
        assert health_of(argocd, app, "paused")[0] == "Suspended"
        assert app["status"]["health"]["status"] == "Degraded"   # the worst of the three

        # The live objects differ from Git by defaulted fields and a status the operator keeps
        # writing; Argo CD still compares them equal, also after a hard refresh.
        live_ok = jobs.get("ok")
        defaulted = sorted(set(live_ok["spec"]) - set(docs["ok"]["spec"]))
        print("spec fields the API server defaulted:", defaulted)
        print("live metadata:", {k: live_ok["metadata"].get(k) for k in ("labels", "annotations", "finalizers")})
        # the apply Argo CD used: client-side leaves its last-applied annotation, server-side does not
        client_side = "kubectl.kubernetes.io/last-applied-configuration" in (live_ok["metadata"].get("annotations") or {})
        assert client_side == (diff == "default"), live_ok["metadata"]
        assert set(live_ok["spec"]) > set(docs["ok"]["spec"]), defaulted
        assert live_ok["status"]["phase"] == "Succeeded"
        argocd.refresh(name, hard=True)
        app = argocd.wait(name, lambda a: "argocd.argoproj.io/refresh" not in (a["metadata"].get("annotations") or {})
                          and a["status"]["sync"]["status"] == "Synced", SYNC_TIMEOUT_S,
                          "hard refresh done, still Synced", namespace=namespace)
        assert all(r["status"] == "Synced" for r in app["status"]["resources"]), app["status"]["resources"]
        cluster.hold(lambda: argocd.app(name)["status"]["sync"]["status"] == "Synced", 3 * 3,
                     "Application stays Synced", namespace=namespace)
    finally:
        argocd.delete_application(name)


# -- 3. editing Git: a mutable field, an immutable field, prune -----------------------------------


def test_git_edits_mutable_immutable_and_prune(cluster, argocd, operator, namespace):
    jobs = Jobs(cluster, namespace)
    path = f"jobs/{namespace}"
    held = small_job("held", suspend=True)
    runner = small_job("runner", podMetadata=run_for(600))
    rev = argocd.git.write({f"{path}/held.yaml": held, f"{path}/runner.yaml": runner}, "two jobs")
    name = app_name("edit", namespace)
    # Automated sync retries a failed sync 5 times by default (about 2.5 min of backoff, the message
    # is the same with "Retrying attempt #N"); one quick retry keeps the test short.
    argocd.application(name, {"path": path}, namespace, retry={"limit": 1, "backoff": {"duration": "1s"}})
    try:
        argocd.wait(name, lambda a: synced_at(a, rev), SYNC_TIMEOUT_S, f"Synced at {rev[:8]}", namespace=namespace)
        jobs.wait_phase("held", "Suspended")
        jobs.wait_phase("runner", "Running")

        # A mutable field: spec.suspend true -> false resumes the job.
        resumed = copy.deepcopy(held)
        resumed["spec"]["suspend"] = False
        rev = argocd.git.write({f"{path}/held.yaml": resumed}, "resume held")
        argocd.wait(name, lambda a: synced_at(a, rev), SYNC_TIMEOUT_S, f"Synced at {rev[:8]}", namespace=namespace)
        assert jobs.get("held")["spec"]["suspend"] is False
        jobs.wait_phase("held", ("Pending", "Running", "Succeeded"))

        # An immutable field: the sync fails and says which field.
        reshaped = copy.deepcopy(runner)
        reshaped["spec"]["numNodes"] = 4
        bad_rev = argocd.git.write({f"{path}/runner.yaml": reshaped}, "reshape runner")

        def sync_failed(a: dict[str, Any]):
            op = (a.get("status") or {}).get("operationState") or {}
            if op.get("phase") in ("Failed", "Error") and op.get("syncResult", {}).get("revision") == bad_rev:
                return op
            return None

        op = sync_failed(argocd.wait(name, sync_failed, SYNC_TIMEOUT_S, f"sync of {bad_rev[:8]} to fail",
                                     namespace=namespace))
        print("sync operation:", op)
        res = [r for r in op["syncResult"].get("resources", []) if r.get("name") == "runner"]
        assert res and res[0]["status"] == "SyncFailed", op
        assert "spec.numNodes is immutable" in res[0]["message"], res[0]["message"]
        assert "spec.numNodes is immutable" in op["message"], op["message"]
        assert jobs.get("runner")["spec"]["numNodes"] == 2   # nothing changed in the cluster
        app = argocd.app(name)
        assert app["status"]["sync"]["status"] == "OutOfSync"
        assert argocd.resource(app, KIND, "runner")["status"] == "OutOfSync"

        # Back to the old shape (Git equals the cluster again: Synced by comparison, no sync needed),
        # then delete the file: prune removes the job and, through owner references, all it made.
        rev = argocd.git.write({f"{path}/runner.yaml": runner}, "revert runner")
        argocd.wait(name, lambda a: a["status"]["sync"] == {**a["status"]["sync"], "status": "Synced", "revision": rev},
                    SYNC_TIMEOUT_S, f"Synced at {rev[:8]}", namespace=namespace)
        assert jobs.jobset("runner") is not None and jobs.pods("runner")
        kinds = "jobsets.jobset.x-k8s.io,jobs.batch,pods,serviceaccounts,roles,rolebindings,services,configmaps"

        def children() -> list[str]:   # everything the operator, JobSet and Job controllers made for runner
            return cluster.kubectl("get", kinds, "-n", namespace, "-l", "megatron-operator.io/job-name=runner",
                                   "-o", "name").stdout.split()

        before = children()
        print("runner's objects before the prune:", before)
        for kind in ("jobset.jobset.x-k8s.io/", "pod/", "serviceaccount/", "role.rbac.authorization.k8s.io/",
                     "rolebinding.rbac.authorization.k8s.io/"):
            assert any(o.startswith(kind) for o in before), (kind, before)
        rev = argocd.git.write({f"{path}/runner.yaml": None}, "remove runner")
        argocd.wait(name, lambda a: synced_at(a, rev) and argocd.resource(a, KIND, "runner") is None,
                    SYNC_TIMEOUT_S, f"Synced at {rev[:8]} without runner", namespace=namespace)
        wait_gone(cluster, lambda: jobs.get("runner"), "MegatronJob runner pruned", namespace)
        wait_gone(cluster, children, "runner's JobSet, Jobs, pods, ServiceAccount, Role, RoleBinding (nothing orphaned)",
                  namespace, timeout=90)
        assert jobs.get("held")   # the other job is untouched
    finally:
        argocd.delete_application(name)


# -- 4. a Kueue-queued job through Argo CD ----------------------------------------------------------


def test_kueue_queued_job_is_progressing_never_degraded(cluster, argocd, operator, namespace):
    from test_kueue import QUEUE, Kueue  # one ClusterQueue of 2 GPUs: one small job at a time

    kueue = Kueue(cluster, namespace)
    kueue.setup()
    jobs = Jobs(cluster, namespace)
    path = f"jobs/{namespace}"
    # Shorter than the session operator's stall timeout (15 s): kwok's pods report no iterations,
    # and a Stalled job is Degraded (test_job_health_and_sync_follow_the_jobs shows it), not Kueue's doing.
    docs = {"first": small_job("first", queueName=QUEUE, podMetadata=run_for(8)),
            "second": small_job("second", queueName=QUEUE, podMetadata=run_for(8))}
    rev = argocd.git.write({f"{path}/{n}.yaml": d for n, d in docs.items()}, "two queued jobs")
    name = app_name("kueue", namespace)
    argocd.application(name, {"path": path}, namespace)
    seen: dict[str, list[tuple[str, str]]] = {n: [] for n in docs}
    app_health: list[str] = []

    def observe(app: dict[str, Any]) -> bool:
        h = ((app.get("status") or {}).get("health") or {}).get("status")
        if h and (not app_health or app_health[-1] != h):
            app_health.append(h)
        for n in docs:
            x = health_of(argocd, app, n)
            if x and (not seen[n] or seen[n][-1] != x):
                seen[n].append(x)
        return synced_at(app, rev) and all(seen[n] and seen[n][-1][0] == "Healthy" for n in docs)

    try:
        argocd.wait(name, observe, 2 * PHASE_TIMEOUT_S, "both queued jobs Healthy (Succeeded)", namespace=namespace)
        print("health seen by Argo CD:", seen, "application:", app_health)
        every = [s for n in docs for s, _ in seen[n]]
        assert "Degraded" not in every and "Degraded" not in app_health, (seen, app_health)
        queued = [(n, m) for n in docs for s, m in seen[n] if s == "Progressing" and m.startswith("Pending (Queued): ")]
        assert queued, seen   # one of them waited for Kueue, and Argo CD said so in Kueue's words
        assert any(f"queue {QUEUE}" in m for _, m in queued), queued
        assert all(jobs.phase(n) == "Succeeded" for n in docs)
    finally:
        argocd.delete_application(name)
        kueue.teardown()


# -- 5. the health check is needed: without it Argo CD calls a failed job Healthy ------------------


def test_without_the_chart_health_check_a_failed_job_looks_healthy(cluster, argocd, operator, namespace):
    """Argo CD has no health check for MegatronJob: without the chart's, it assesses none, and the
    Application is Healthy with a Failed job in it. Putting the key back makes it Degraded."""
    jobs = Jobs(cluster, namespace)
    path = f"jobs/{namespace}"
    rev = argocd.git.write({f"{path}/bad.yaml": failing_job("bad")}, "a failing job")
    name = app_name("nohealth", namespace)
    argocd.set_health_check(False)
    try:
        argocd.application(name, {"path": path}, namespace)
        jobs.wait_phase("bad", "Failed", timeout=PHASE_TIMEOUT_S)
        argocd.refresh(name)
        app = argocd.wait(name, lambda a: synced_at(a, rev) and a["status"]["health"]["status"] == "Healthy"
                          and "argocd.argoproj.io/refresh" not in (a["metadata"].get("annotations") or {}),
                          SYNC_TIMEOUT_S, "Synced, refreshed after the job failed", namespace=namespace)
        assert jobs.phase("bad") == "Failed"
        assert health_of(argocd, app, "bad") is None, argocd.resource(app, KIND, "bad")
        assert app["status"]["health"]["status"] == "Healthy"
        argocd.set_health_check(True)
        app = argocd.wait(name, lambda a: (health_of(argocd, a, "bad") or ("",))[0] == "Degraded",
                          SYNC_TIMEOUT_S, "Degraded once the chart's check is back", namespace=namespace)
        assert app["status"]["health"]["status"] == "Degraded"
    finally:
        argocd.set_health_check(True)
        argocd.delete_application(name)
