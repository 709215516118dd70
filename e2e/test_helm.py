"""The Helm chart against the real local control plane.

`helm install` puts the chart's objects into the cluster (its Deployment only becomes a fake kwok
pod). The operator then runs as a host process with exactly the installed Deployment's command,
arguments and environment, authenticated as the chart's ServiceAccount (a TokenRequest token in a
kubeconfig that points at the same API server and CA). It must take MegatronJobs through their
whole life (create, suspend, deadline, success) without a single Forbidden, and requests outside
the chart's RBAC must be forbidden.

The MegatronJob CRD is shared by every e2e test (the session `crd` fixture applies crds/ with the
field manager megatron-e2e), so these releases install with crds.enabled=false: taking ownership
of a cluster-wide object other tests use would let one release's uninstall pull it from under
them. The chart's CRD template is checked separately by a server-side dry-run apply.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from k8s import Cluster
from mjob import (
    OPERATOR_START_TIMEOUT_S,
    Jobs,
    OperatorProcess,
    alone_with_the_jobs,
    free_port,
    run_for,
    small_job,
)

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "megatron-operator"
GROUP, VERSION, PLURAL = "megatron-operator.io", "v1alpha1", "megatronjobs"
HELM_TIMEOUT_S = 120
TOKEN_DURATION_S = 3600
JOB_TIMEOUT_S = 180
# What every authenticated identity may do (system:basic-user, system:discovery, system:public-info-viewer).
SELF_REVIEWS = {"selfsubjectaccessreviews", "selfsubjectrulesreviews", "selfsubjectreviews"}


def helm_binary() -> Path:
    name = "megatron_e2e_cluster_helm"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "e2e" / "cluster" / "cluster.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    path = Path(os.environ.get("HELM") or module.helm_binary())
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm not found at {path}: run `.venv/bin/python e2e/cluster/cluster.py build` "
                    f"(or set HELM=/path/to/helm)", pytrace=False)
    return path


@dataclass
class Release:
    """One `helm install` of the chart, and what the operator process needs from it."""

    cluster: Cluster
    name: str
    namespace: str
    home: Path
    helm: Path = field(default_factory=helm_binary)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "HELM_CACHE_HOME": str(self.home / "cache"), "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data"), "KUBECONFIG": str(self.cluster.kubeconfig)}
        proc = subprocess.run([str(self.helm), *args], env=env, capture_output=True, text=True,
                              timeout=HELM_TIMEOUT_S, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    def install(self, values: dict[str, Any], *extra: str) -> None:
        vf = self.home / "values.yaml"
        vf.write_text(yaml.safe_dump(values))
        self.run("install", self.name, str(CHART), "--namespace", self.namespace, "--create-namespace",
                 "--values", str(vf), *extra)

    def uninstall(self) -> None:
        self.run("uninstall", self.name, "--namespace", self.namespace, "--wait", "--timeout", "60s", check=False)

    def deployment(self) -> dict[str, Any]:
        apps = kubernetes.client.AppsV1Api(self.cluster.api_client())
        dep = apps.read_namespaced_deployment(f"{self.name}-megatron-operator", self.namespace)
        return self.cluster.api_client().sanitize_for_serialization(dep)

    def service_account(self) -> str:
        return self.deployment()["spec"]["template"]["spec"]["serviceAccountName"]


def sa_kubeconfig(cluster: Cluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig for the same API server and CA, authenticated with a TokenRequest token of `sa`."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    ctx = next(c["context"] for c in admin["contexts"] if c["name"] == admin["current-context"])
    cl = dict(next(c["cluster"] for c in admin["clusters"] if c["name"] == ctx["cluster"]))
    if "certificate-authority" in cl:
        cl["certificate-authority"] = str((cluster.kubeconfig.parent / cl["certificate-authority"]).resolve())
    token = cluster.kubectl("create", "token", sa, "-n", namespace,
                            f"--duration={TOKEN_DURATION_S}s").stdout.strip()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "chart-sa",
        "clusters": [{"name": "local", "cluster": cl}],
        "users": [{"name": "chart-sa", "user": {"token": token}}],
        "contexts": [{"name": "chart-sa", "context": {"cluster": "local", "user": "chart-sa"}}],
    }))
    path.chmod(0o600)
    return path


@dataclass
class ChartOperator(OperatorProcess):
    """The operator with exactly the chart Deployment's command, args and env, and the SA's kubeconfig."""

    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_name: str = "operator-helm"

    @property
    def log_path(self) -> Path:
        return self.cluster.logs_dir / f"{self.log_name}.log"

    @classmethod
    def from_deployment(cls, cluster: Cluster, dep: dict[str, Any], kubeconfig: Path, log_name: str) -> ChartOperator:
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["megatron-operator"], c["command"]
        script = Path(sys.executable).parent / "megatron-operator"  # the same console script the image runs
        assert os.access(script, os.X_OK), f"{script} missing: pip install -e '.[operator,test]'"
        env = {}
        for e in c.get("env", []):
            assert "valueFrom" not in e, f"cannot reproduce valueFrom env {e['name']} on the host"
            env[e["name"]] = e.get("value", "")
        base = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OPERATOR_", "KUBERNETES_"))}
        base.pop("KUBECONFIG", None)
        port = int(env["MEGATRON_OPERATOR_METRICS_PORT"])
        return cls(cluster, port, {}, argv=[str(script), *c.get("args", [])],
                   env={**base, **env, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                        "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}"},
                   log_name=log_name)

    def start(self) -> None:
        log = open(self.log_path, "a")
        log.write(f"\n===== {' '.join(self.argv)} (chart env, chart ServiceAccount) =====\n")
        log.flush()
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.starts += 1
        self.cluster.wait_for(self.healthy, OPERATOR_START_TIMEOUT_S, "the chart operator's /healthz",
                              kinds=("megatronjobs",))

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
        total = 0.0
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
                if not m or m.group(1) != name:
                    continue
                have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                if labels.items() <= have.items():
                    total += float(m.group(3))
        return total

    def forbidden_lines(self) -> list[str]:
        text = self.log_path.read_text(errors="replace")
        # a 403 anywhere but inside a timestamp ("23:14:40,403" is a millisecond count)
        return [line for line in text.splitlines() if re.search(r"(?<![\d,.:])403\b|[Ff]orbidden", line)]


def rules_of(api: kubernetes.client.ApiClient, namespace: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the identity holds in `namespace`, less what every user holds."""
    review = kubernetes.client.AuthorizationV1Api(api).create_self_subject_rules_review(
        {"spec": {"namespace": namespace}})
    out = set()
    for r in review.status.resource_rules:
        for g in r.api_groups or [""]:
            for res in r.resources or []:
                if res in SELF_REVIEWS:
                    continue
                for v in r.verbs:
                    out.add((g, res, v))
    return out


EXPECTED = {
    ("megatron-operator.io", "megatronjobs", "list"), ("megatron-operator.io", "megatronjobs", "watch"),
    ("megatron-operator.io", "megatronjobs/status", "get"), ("megatron-operator.io", "megatronjobs/status", "patch"),
    ("megatron-operator.io", "megatronjobs/finalizers", "update"),
    *(("jobset.x-k8s.io", "jobsets", v) for v in ("get", "list", "watch", "create", "patch", "delete")),
    ("kueue.x-k8s.io", "workloads", "list"), ("kueue.x-k8s.io", "workloads", "patch"),
    ("", "pods", "list"), ("", "pods", "watch"),
    ("", "serviceaccounts", "get"), ("", "serviceaccounts", "create"),
    *(("rbac.authorization.k8s.io", res, v) for res in ("roles", "rolebindings") for v in ("get", "create")),
    ("", "events", "create"),
}


def can_i(cluster: Cluster, kubeconfig: Path, *args: str) -> bool:
    proc = subprocess.run([str(cluster.kubectl_path), f"--kubeconfig={kubeconfig}", "auth", "can-i", *args],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.stdout.strip() == "yes"


FORBIDDEN = [  # requests the operator never makes: all must be refused
    ("get", "secrets"), ("list", "secrets"), ("list", "configmaps"), ("delete", "megatronjobs"),
    ("create", "megatronjobs"), ("update", "megatronjobs"), ("get", "megatronjobs"), ("patch", "megatronjobs"),
    ("create", "pods"),
    ("delete", "pods"), ("create", "serviceaccounts", "--subresource=token"), ("delete", "roles"),
    ("update", "rolebindings"), ("create", "pods", "--subresource=exec"), ("escalate", "roles"), ("bind", "roles"),
    ("impersonate", "serviceaccounts"), ("create", "jobs.batch"),
    ("patch", "jobsets.jobset.x-k8s.io", "--subresource=status"), ("update", "jobsets.jobset.x-k8s.io"),
]
FORBIDDEN_CLUSTER = [("create", "clusterroles"), ("create", "clusterrolebindings"), ("list", "nodes"),
                     ("list", "namespaces"), ("get", "customresourcedefinitions"), ("create", "namespaces")]


@pytest.fixture
def release(cluster: Cluster, crd: None, tmp_path: Path):
    rel = Release(cluster, f"mo-{secrets.token_hex(3)}", f"mo-sys-{secrets.token_hex(3)}", tmp_path)
    yield rel
    rel.uninstall()
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    try:
        core.delete_namespace(rel.namespace)
    except kubernetes.client.ApiException as e:
        if e.status != 404:
            raise


def e2e_values(**extra: Any) -> dict[str, Any]:
    """Chart values for the host-process operator: a free loopback port, a fast resync."""
    return {"crds": {"enabled": False}, "metrics": {"port": free_port(), "bindAddress": "127.0.0.1"},
            "config": {"resyncIntervalSeconds": 1}, **extra}


def start_chart_operator(cluster: Cluster, rel: Release, tmp_path: Path, log_name: str) -> tuple[ChartOperator, Path]:
    kubeconfig = sa_kubeconfig(cluster, rel.namespace, rel.service_account(), tmp_path / "sa.kubeconfig")
    who = subprocess.run([str(cluster.kubectl_path), f"--kubeconfig={kubeconfig}", "auth", "whoami", "-o", "json"],
                         capture_output=True, text=True, timeout=30, check=True)
    username = json.loads(who.stdout)["status"]["userInfo"]["username"]
    assert username == f"system:serviceaccount:{rel.namespace}:{rel.service_account()}"
    op = ChartOperator.from_deployment(cluster, rel.deployment(), kubeconfig, log_name)
    op.start()
    return op, kubeconfig


def run_jobs_through_every_api_call(cluster: Cluster, jobs: Jobs, op: ChartOperator) -> None:
    """Success (create children, status, events), suspend (patch JobSet), deadline (delete JobSet)."""
    jobs.create(small_job("ok", podMetadata=run_for(5)))
    jobs.create(small_job("pause", podMetadata=run_for(600)))
    jobs.create(small_job("late", podMetadata=run_for(600), activeDeadlineSeconds=8))

    done = jobs.wait_phase("ok", "Succeeded", timeout=JOB_TIMEOUT_S)
    assert {c["type"]: c["status"] for c in done["conditions"]}["Succeeded"] == "True"
    # the job's own identity, created by the operator with the chart's permissions
    sa = jobs.core.read_namespaced_service_account("ok-trainer", jobs.ns)
    role = jobs.rbac.read_namespaced_role("ok-trainer", jobs.ns)
    assert role.rules[0].resources == ["megatronjobs/status"] and sa.metadata.owner_references[0].kind == "MegatronJob"
    assert jobs.rbac.read_namespaced_role_binding("ok-trainer", jobs.ns).role_ref.name == "ok-trainer"
    assert "Completed" in {e.reason for e in jobs.events("ok")}  # a first start has no event: the status says it
    assert done.get("startTime")

    jobs.wait_phase("pause", "Running", timeout=JOB_TIMEOUT_S)
    jobs.patch_spec("pause", {"suspend": True})
    jobs.wait_phase("pause", "Suspended")
    assert jobs.jobset("pause")["spec"]["suspend"] is True

    late = jobs.wait_phase("late", "Failed", timeout=JOB_TIMEOUT_S)
    assert late["reason"] == "DeadlineExceeded"
    cluster.wait_for(lambda: jobs.jobset("late") is None, 60, "the operator to delete the late job's JobSet",
                     namespace=jobs.ns)

    # This process (not another operator that may share the cluster) did the work, and was never refused.
    assert op.metric("megatron_operator_reconciles_total", kind="MegatronJob", result="success") >= 3
    assert op.metric("megatron_operator_status_writes_total") > 0
    assert op.metric("megatron_operator_reconcile_errors_total") == 0
    assert not op.forbidden_lines(), "the operator was refused:\n" + "\n".join(op.forbidden_lines()[:20])
    # no finalizer on live jobs: deleting one never depends on the operator
    assert not jobs.get("pause")["metadata"].get("finalizers")


def delete_jobs(cluster: Cluster, jobs: Jobs, op: ChartOperator) -> None:
    """Delete the test's MegatronJobs (no finalizer: this works whether or not the operator runs)."""
    for item in jobs.custom.list_namespaced_custom_object(GROUP, VERSION, jobs.ns, PLURAL)["items"]:
        jobs.delete(item["metadata"]["name"])

    def gone() -> bool:
        return not jobs.custom.list_namespaced_custom_object(GROUP, VERSION, jobs.ns, PLURAL)["items"]

    cluster.wait_for(gone, 60, "the MegatronJobs to be deleted", namespace=jobs.ns,
                     kinds=("megatronjobs",))


def assert_forbidden_outside_rbac(cluster: Cluster, kubeconfig: Path, namespace: str) -> None:
    for request in FORBIDDEN:
        assert not can_i(cluster, kubeconfig, *request, "-n", namespace), f"can {' '.join(request)}"
    for request in FORBIDDEN_CLUSTER:
        assert not can_i(cluster, kubeconfig, *request), f"can {' '.join(request)}"
    # positive control: the same check says yes to what the chart grants
    assert can_i(cluster, kubeconfig, "patch", "megatronjobs", "--subresource=status", "-n", namespace)
    assert can_i(cluster, kubeconfig, "create", "jobsets.jobset.x-k8s.io", "-n", namespace)
    # and a real request is refused, not only predicted to be
    api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
    try:
        with pytest.raises(kubernetes.client.ApiException) as err:
            kubernetes.client.CoreV1Api(api).list_namespaced_secret(namespace)
        assert err.value.status == 403
        with pytest.raises(kubernetes.client.ApiException) as err:
            kubernetes.client.CustomObjectsApi(api).delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, "ok")
        assert err.value.status == 403
    finally:
        api.close()


# ---- tests ---------------------------------------------------------------------------------------------------

def test_chart_crd_template_is_accepted_by_the_api_server(cluster, crd, tmp_path):
    """The CRD as the chart renders it (metadata + the generated spec) passes the API server's validation."""
    rel = Release(cluster, "crd-check", "default", tmp_path)
    server = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    out = rel.run("template", "crd-check", str(CHART), "--show-only", "templates/crd.yaml",
                  "--kube-version", server).stdout
    doc = yaml.safe_load(out)
    assert doc["kind"] == "CustomResourceDefinition"
    assert doc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    # A dry run: --force-conflicts only lets it take the fields the crd fixture applied, nothing is stored.
    proc = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--force-conflicts",
                           "--field-manager=helm-crd-check", "-o", "json", "-f", "-", input=out)
    applied = json.loads(proc.stdout)
    assert applied["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert [v["schema"] for v in applied["spec"]["versions"]] == [v["schema"] for v in doc["spec"]["versions"]]


@contextlib.contextmanager
def chart_operator(cluster: Cluster, rel: Release, tmp_path: Path, log_name: str, namespace: str):
    """The chart's operator running with the chart's identity, as (API client of that identity,
    its kubeconfig); on the way out its jobs are deleted and it stops."""
    with alone_with_the_jobs(cluster, namespace):
        op, kubeconfig = start_chart_operator(cluster, rel, tmp_path, log_name)
        try:
            sa_api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
            try:
                yield op, sa_api, kubeconfig
            finally:
                sa_api.close()
        finally:
            try:
                delete_jobs(cluster, Jobs(cluster, namespace), op)
            finally:
                op.stop()


def assert_trainer_identities_may_write_only_progress(cluster: Cluster, namespace: str) -> None:
    """The chart's ValidatingAdmissionPolicy on the real API server: a <job>-trainer token may patch
    status.progress of the job its Role names, and is refused on the operator's fields."""
    api = cluster.api_client()
    core, rbac = kubernetes.client.CoreV1Api(api), kubernetes.client.RbacAuthorizationV1Api(api)
    Jobs(cluster, namespace).create(small_job("probe"))  # no operator: nothing else writes its status
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "probe-trainer"}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "probe-trainer"}, "rules": [{
        "apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": ["probe"], "verbs": ["get", "patch"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "probe-trainer"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "probe-trainer"},
        "subjects": [{"kind": "ServiceAccount", "name": "probe-trainer", "namespace": namespace}]})
    token = core.create_namespaced_service_account_token(
        "probe-trainer", namespace, {"spec": {"expirationSeconds": 600}}).status.token
    cfg = kubernetes.client.Configuration.get_default_copy()
    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    cfg.api_key, cfg.api_key_prefix = {"authorization": token}, {"authorization": "Bearer"}
    cfg.cert_file = cfg.key_file = None
    trainer = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(cfg))

    def patch(status: dict[str, Any], **kw: Any) -> None:
        trainer.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "probe", {"status": status},
                                                      field_manager="megatron-trainer", **kw)

    def policy_in_force() -> bool:  # the API server loads a new policy within seconds (dry run: nothing stored)
        try:
            patch({"phase": "Failed"}, dry_run="All")
            return False
        except kubernetes.client.ApiException as e:
            return e.status in (403, 422) and "only status.progress" in e.body

    cluster.wait_for(policy_in_force, 30, "the trainer-status policy refusing a forged phase", namespace=namespace)
    patch({"progress": {"iteration": 3}})  # allowed
    for forged in ({"phase": "Succeeded"}, {"startTime": "2999-01-01T00:00:00Z"},
                   {"restarts": 7, "progress": {"iteration": 4}},
                   {"conditions": [{"type": "Failed", "status": "True", "reason": "Forged",
                                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]}):
        with pytest.raises(kubernetes.client.ApiException) as e:
            patch(forged)
        assert e.value.status == 403 and "may write only status.progress" in e.value.body, forged
    status = Jobs(cluster, namespace).status("probe")
    assert status.get("progress") == {"iteration": 3} and "phase" not in status and "startTime" not in status


def test_helm_install_cluster_wide_runs_jobs_with_the_charts_identity(cluster, release, namespace, tmp_path):
    release.install(e2e_values())
    dep = release.deployment()
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    with chart_operator(cluster, release, tmp_path, "operator-helm-clusterwide", namespace) as (op, sa_api, kubeconfig):
        # cluster-wide: the same rules in the job namespace and in any other
        assert rules_of(sa_api, namespace) == EXPECTED
        assert rules_of(sa_api, "kube-system") == EXPECTED
        assert can_i(cluster, kubeconfig, "list", "megatronjobs", "--all-namespaces")
        assert_forbidden_outside_rbac(cluster, kubeconfig, namespace)
        run_jobs_through_every_api_call(cluster, Jobs(cluster, namespace), op)

    # the built-in user roles pick up MegatronJobs by aggregation, never their status
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client())
    for role, user in (("edit", "alice"), ("view", "bob")):
        rbac.create_namespaced_role_binding(namespace, {
            "metadata": {"name": f"{user}-{role}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})

    def user_can(user: str, *request: str) -> bool:
        out = cluster.kubectl("auth", "can-i", *request, "-n", namespace, f"--as={user}", check=False)
        return out.stdout.strip() == "yes"

    cluster.wait_for(lambda: user_can("alice", "create", "megatronjobs") and user_can("bob", "list", "megatronjobs"),
                     30, "edit/view aggregated the chart's MegatronJob rules", namespace=namespace)
    assert not user_can("bob", "create", "megatronjobs")
    for user in ("alice", "bob"):
        assert not user_can(user, "patch", "megatronjobs", "--subresource=status")
        assert not user_can(user, "update", "megatronjobs", "--subresource=status")

    with alone_with_the_jobs(cluster, namespace):  # no operator may write the probe job's status
        assert_trainer_identities_may_write_only_progress(cluster, namespace)

    # helm upgrade changes the operator's settings through the Deployment (Recreate rollout)
    release.run("upgrade", release.name, str(CHART), "--namespace", release.namespace, "--reuse-values",
                "--set", "config.maxRestarts=5")
    env = {e["name"]: e.get("value") for e in release.deployment()["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MEGATRON_OPERATOR_MAX_RESTARTS"] == "5"

    # uninstall removes the cluster-scoped RBAC and leaves the (not chart-managed) CRD alone
    release.uninstall()
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client())
    with pytest.raises(kubernetes.client.ApiException) as err:
        rbac.read_cluster_role(f"{release.name}-megatron-operator")
    assert err.value.status == 404
    cluster.kubectl("get", "crd", f"{PLURAL}.{GROUP}")


def test_helm_install_namespaced_watches_only_its_namespaces(cluster, release, namespace, tmp_path):
    release.install(e2e_values(watchNamespaces=[namespace]))
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client())
    names = [r.metadata.name for r in rbac.list_cluster_role(label_selector=f"app.kubernetes.io/instance={release.name}").items]
    # the operator holds no cluster-wide role; only the user roles aggregated into edit/view are cluster-scoped
    assert sorted(names) == [f"{release.name}-megatron-operator-edit", f"{release.name}-megatron-operator-view"]
    assert rbac.read_namespaced_role(f"{release.name}-megatron-operator", namespace).rules

    with chart_operator(cluster, release, tmp_path, "operator-helm-namespaced", namespace) as (op, sa_api, kubeconfig):
        assert rules_of(sa_api, namespace) == EXPECTED
        assert rules_of(sa_api, release.namespace) == set()  # nothing outside the watched namespace
        assert not can_i(cluster, kubeconfig, "list", "megatronjobs", "--all-namespaces")
        assert not can_i(cluster, kubeconfig, "list", "pods", "-n", "kube-system")
        assert_forbidden_outside_rbac(cluster, kubeconfig, namespace)
        run_jobs_through_every_api_call(cluster, Jobs(cluster, namespace), op)
