"""The Helm chart (charts/megatron-operator), rendered by the real `helm` binary with various values.

helm-unittest is not available offline, so these tests run `helm template` / `helm lint` and
assert on the parsed objects. Helm is required: without it every test here FAILS with a message
saying how to get it (never a silent skip). It is found at $HELM, then at the pinned build of
e2e/cluster (`e2e/cluster/cluster.py build`), then on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from factory import make_job
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from megatron_operator import __version__, crd
from megatron_operator.cli import build_parser
from megatron_operator.metrics import Metrics
from megatron_operator.render import labels_for, render
from megatron_operator.settings import Settings
from megatron_operator.validation import parse_job
from megatron_trainer.metrics import _GAUGES as TRAINER_GAUGES

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "megatron-operator"
CRD_FILE = ROOT / "crds" / "megatron-operator.io_megatronjobs.yaml"
VERSIONS = ROOT / "e2e" / "cluster" / "versions.env"
RELEASE, NAMESPACE = "rel", "ops"
HELM_TIMEOUT_S = 60


def _pinned_versions() -> dict[str, str]:
    out = {}
    for line in VERSIONS.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


KUBE_VERSION = _pinned_versions()["KUBE_VERSION"]


def helm_binary() -> str:
    """$HELM, else e2e/cluster's pinned build, else `helm` on PATH; a test failure if none exists."""
    if os.environ.get("HELM"):
        if not os.access(os.environ["HELM"], os.X_OK):
            pytest.fail(f"HELM={os.environ['HELM']} is not an executable helm", pytrace=False)
        return os.environ["HELM"]
    cache = Path(os.environ.get("MEGATRON_OPERATOR_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-operator")
    pinned = cache / "bin" / f"helm-{_pinned_versions()['HELM_VERSION']}" / "helm"
    if os.access(pinned, os.X_OK):
        return str(pinned)
    found = shutil.which("helm")
    if found:
        return found
    pytest.fail(f"helm not found: build the pinned one with `.venv/bin/python e2e/cluster/cluster.py build` "
                f"(expected at {pinned}), put helm on PATH, or set HELM=/path/to/helm", pytrace=False)


def helm(*args: str, chart: Path = CHART, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_binary(), *args[:1], *(["--kube-version", KUBE_VERSION] if args[0] in
                                                          ("template", "lint") else []), *args[1:]],
                          capture_output=True, text=True, timeout=HELM_TIMEOUT_S, cwd=chart.parent, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


def render_chart(values: dict[str, Any] | None = None, tmp_path: Path | None = None, chart: Path = CHART,
                 check: bool = True) -> list[dict[str, Any]] | subprocess.CompletedProcess:
    """`helm template` with `values` (as a values file); the parsed objects, or the process when not check."""
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE]
    if values:
        assert tmp_path is not None, "pass tmp_path with values"
        vf = tmp_path / "values.yaml"
        vf.write_text(yaml.safe_dump(values))
        args += ["--values", str(vf)]
    proc = helm(*args, chart=chart, check=check)
    if not check:
        return proc
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def env_of(objs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container(objs)["env"]}


@pytest.fixture(scope="module")
def default_objs() -> list[dict[str, Any]]:
    return render_chart()


ALL_ON = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
                      "prometheusRule": {"enabled": True}},
          "dashboards": {"enabled": True}}


# ---- lint and the default render -------------------------------------------------------------------

@pytest.mark.parametrize("values", [None, ALL_ON, {"watchNamespaces": ["team-a", "team-b"]}],
                         ids=["defaults", "all-features", "namespaced"])
def test_helm_lint_strict(values, tmp_path):
    args = ["lint", "--strict", str(CHART)]
    if values:
        vf = tmp_path / "v.yaml"
        vf.write_text(yaml.safe_dump(values))
        args += ["--values", str(vf)]
    out = helm(*args)
    assert "0 chart(s) failed" in out.stdout


def test_default_render_has_exactly_the_operator_objects(default_objs):
    kinds = sorted(o["kind"] for o in default_objs)
    # the operator's ClusterRole, and the two aggregated into the built-in edit/admin and view roles
    # two admission policies: the trainer's status writes, and the guardrails (on by default: grace
    # period and denied pod metadata keys)
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                     "Deployment", "Service", "ServiceAccount", "ValidatingAdmissionPolicy",
                     "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                     "ValidatingAdmissionPolicyBinding"]
    for o in default_objs:
        if o["kind"] not in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                             "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            assert o["metadata"]["namespace"] == NAMESPACE, o["kind"]
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_chart_app_version_is_the_operator_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__, "bump Chart.yaml appVersion with megatron_operator.__version__"


# ---- the Deployment ---------------------------------------------------------------------------------

def test_deployment_runs_one_active_operator(default_objs):
    spec = one(default_objs, "Deployment")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}  # the old pod is gone before the new one starts
    assert "--peering" not in container(default_objs)["args"]  # standalone: no peering CRDs needed


def test_deployment_is_hardened(default_objs):
    pod = one(default_objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    c = container(default_objs)
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert c["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]


def test_container_command_is_the_cli_run_command(default_objs):
    c = container(default_objs)
    assert c["command"] == ["megatron-operator"]
    args = build_parser().parse_args(c["args"])  # the real CLI accepts exactly these arguments
    assert args.command == "run"
    assert args.namespace is None and args.kubeconfig is None


def test_every_operator_setting_is_set_from_values(default_objs):
    env = env_of(default_objs)
    expected = {"MEGATRON_OPERATOR_" + f.name.upper() for f in fields(Settings)}
    assert expected == {k for k in env if k.startswith("MEGATRON_OPERATOR_")}


def test_default_values_equal_the_operators_own_defaults(default_objs):
    """Installing the chart with no values changes none of the operator's defaults."""
    assert Settings.from_env(env_of(default_objs)) == Settings()


def test_config_values_reach_the_operator(tmp_path):
    objs = render_chart({"config": {"shmGiBPerGpu": 4, "shmMinGiB": 8, "terminationGracePeriodSeconds": 1200,
                                    "maxRestarts": 7, "progressIntervalSeconds": 15, "trainerMetricsPort": 9500,
                                    "rendezvousPort": 29600, "stallTimeoutSeconds": 3600, "runAsUser": 2000,
                                    "resyncIntervalSeconds": 2.5, "kueueTpGroupTopology": "kubernetes.io/hostname",
                                    "tpGroupCollisionSeconds": 0},
                         "metrics": {"port": 9090, "bindAddress": "127.0.0.1"},
                         "trainerImage": {"repository": "registry.example/megatron-trainer", "tag": "2026.11"}},
                        tmp_path)
    env = env_of(objs)
    s = Settings.from_env(env)
    assert s == Settings(default_image="registry.example/megatron-trainer:2026.11", shm_gib_per_gpu=4, shm_min_gib=8,
                         termination_grace_period_s=1200, max_restarts=7, progress_interval_s=15,
                         trainer_metrics_port=9500, rendezvous_port=29600, stall_timeout_s=3600, run_as_user=2000,
                         resync_interval_s=2.5, kueue_tp_group_topology="kubernetes.io/hostname", tp_group_collision_s=0,
                         metrics_port=9090,
                         metrics_host="127.0.0.1", namespaces="")
    c = container(objs)
    assert c["ports"][0]["containerPort"] == 9090
    svc = one(objs, "Service")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]


def test_large_values_render_as_integers_the_operator_parses(tmp_path):
    # Helm reads numbers as float64; the template must not print 1e+06.
    env = env_of(render_chart({"config": {"stallTimeoutSeconds": 1000000}}, tmp_path))
    assert env["MEGATRON_OPERATOR_STALL_TIMEOUT_S"] == "1000000"
    assert Settings.from_env(env).stall_timeout_s == 1000000


@pytest.mark.parametrize("image, expected", [
    ({}, f"ghcr.io/megatron-operator/megatron-operator:{__version__}"),
    ({"tag": "v9"}, "ghcr.io/megatron-operator/megatron-operator:v9"),
    ({"tag": "v9", "digest": "sha256:" + "a" * 64}, "ghcr.io/megatron-operator/megatron-operator@sha256:" + "a" * 64),
])
def test_operator_image_reference(image, expected, tmp_path):
    objs = render_chart({"image": image}, tmp_path) if image else render_chart()
    assert container(objs)["image"] == expected


def test_trainer_image_digest_wins(tmp_path):
    env = env_of(render_chart({"trainerImage": {"repository": "r/t", "tag": "x", "digest": "sha256:" + "b" * 64}},
                              tmp_path))
    assert env["MEGATRON_OPERATOR_DEFAULT_IMAGE"] == "r/t@sha256:" + "b" * 64


def test_pod_placement_and_extra_env(tmp_path):
    objs = render_chart({"nodeSelector": {"pool": "system"},
                         "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops",
                                          "effect": "NoSchedule"}],
                         "priorityClassName": "system-cluster-critical",
                         "imagePullSecrets": [{"name": "regcred"}],
                         "podAnnotations": {"a": "b"}, "podLabels": {"team": "ml"},
                         "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]}, tmp_path)
    pod = one(objs, "Deployment")["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"pool": "system"}
    assert pod["spec"]["tolerations"][0]["key"] == "dedicated"
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["annotations"] == {"a": "b"} and pod["metadata"]["labels"]["team"] == "ml"
    assert env_of(objs)["HTTPS_PROXY"] == "http://proxy:3128"
    # pod labels never leak into the selector (it is immutable)
    assert "team" not in one(objs, "Deployment")["spec"]["selector"]["matchLabels"]


# ---- RBAC ---------------------------------------------------------------------------------------------

# Exactly what the operator and kopf call (operator/megatron_operator/kube.py, handlers.py, kopf's
# watching, patching and event posting). e2e/test_helm.py runs the operator with these rules.
EXPECTED_RULES = [
    (("megatron-operator.io",), ("megatronjobs",), ("list", "watch")),
    (("megatron-operator.io",), ("megatronjobs/status",), ("get", "patch")),
    (("megatron-operator.io",), ("megatronjobs/finalizers",), ("update",)),
    (("jobset.x-k8s.io",), ("jobsets",), ("get", "list", "watch", "create", "patch", "delete")),
    (("kueue.x-k8s.io",), ("workloads",), ("list", "patch")),
    (("",), ("pods",), ("list", "watch")),
    (("",), ("serviceaccounts",), ("get", "create")),
    (("rbac.authorization.k8s.io",), ("roles", "rolebindings"), ("get", "create")),
    (("",), ("events",), ("create",)),
]


def rule_tuples(rules: list[dict[str, Any]]) -> list[tuple]:
    return [(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["verbs"])) for r in rules]


def assert_least_privilege(rules: list[dict[str, Any]]) -> None:
    assert rule_tuples(rules) == EXPECTED_RULES
    for r in rules:
        assert "*" not in r["verbs"] + r["resources"] + r["apiGroups"]
        assert not {"secrets", "configmaps", "nodes", "namespaces", "clusterroles", "clusterrolebindings",
                    "customresourcedefinitions", "serviceaccounts/token", "pods/exec"} & set(r["resources"])
        assert not {"escalate", "bind", "impersonate", "deletecollection", "update"} & set(r["verbs"]) or \
            r["resources"] == ["megatronjobs/finalizers"]
        assert "resourceNames" not in r and "nonResourceURLs" not in r


def operator_cluster_roles(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's own ClusterRoles (not the ones aggregated into the built-in user roles)."""
    return [o for o in by_kind(objs, "ClusterRole")
            if not any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in o["metadata"]["labels"])]


def test_cluster_wide_rbac_is_exactly_what_the_operator_calls(default_objs):
    (role,) = operator_cluster_roles(default_objs)
    assert_least_privilege(role["rules"])
    binding = one(default_objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    sa = one(default_objs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    assert one(default_objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_the_operator_holds_every_permission_it_grants_a_job():
    """RBAC escalation rules: a job's Role may only contain verbs the operator holds itself."""
    granted = {(g, res, v) for gs, ress, vs in EXPECTED_RULES for g in gs for res in ress for v in vs}
    job = parse_job(make_job())
    role = next(o for o in render(job, Settings(), owner_uid="u") if o["kind"] == "Role")
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for res in rule["resources"]:
                for v in rule["verbs"]:
                    assert (g, res, v) in granted, f"the job's Role grants {v} {g}/{res}, the operator lacks it"
    kinds = {o["kind"] for o in render(job, Settings(), owner_uid="u")}
    assert kinds == {"ServiceAccount", "Role", "RoleBinding", "JobSet"}  # each has a create rule above


def test_namespaced_mode_has_roles_in_each_namespace_and_no_cluster_role(tmp_path):
    objs = render_chart({"watchNamespaces": ["team-a", "team-b"],
                         "metrics": {"podMonitor": {"enabled": True}}}, tmp_path)
    assert not operator_cluster_roles(objs) and not by_kind(objs, "ClusterRoleBinding")
    roles, bindings = by_kind(objs, "Role"), by_kind(objs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for role in roles:
        assert_least_privilege(role["rules"])
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"][0]["namespace"] == NAMESPACE  # the operator's SA lives in the release namespace
    env = env_of(objs)
    assert Settings.from_env(env).watched_namespaces() == ["team-a", "team-b"]
    assert one(objs, "PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_rbac_and_serviceaccount_can_be_brought_by_the_admin(tmp_path):
    objs = render_chart({"rbac": {"create": False, "aggregateToDefaultRoles": False},
                         "trainerStatusPolicy": {"enabled": False}, "guardrailsPolicy": {"enabled": False},
                         "serviceAccount": {"create": False, "name": "mo"}}, tmp_path)
    assert {o["kind"] for o in objs} == {"CustomResourceDefinition", "Deployment", "Service"}
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "mo"
    proc = render_chart({"serviceAccount": {"create": False}}, tmp_path, check=False)
    assert proc.returncode != 0 and "serviceAccount.name is required" in proc.stderr


# ---- the CRD ------------------------------------------------------------------------------------------

def test_crd_template_is_the_generated_crd(default_objs):
    """No drift: the chart's CRD == `megatron-operator crd` == crds/ (all from the same models)."""
    rendered = one(default_objs, "CustomResourceDefinition")
    built = crd.build_crd()
    committed = yaml.safe_load(CRD_FILE.read_text())
    assert rendered["metadata"]["name"] == built["metadata"]["name"] == committed["metadata"]["name"]
    assert rendered["spec"] == built["spec"] == committed["spec"]
    assert rendered["apiVersion"] == built["apiVersion"]


def test_generated_crd_file_is_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-chart-crd.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr + "\n(run: python scripts/gen-chart-crd.py)"


def test_crd_keep_policy(default_objs, tmp_path):
    assert one(default_objs, "CustomResourceDefinition")["metadata"]["annotations"] == {
        "helm.sh/resource-policy": "keep"}
    released = one(render_chart({"crds": {"keep": False}}, tmp_path), "CustomResourceDefinition")
    assert "annotations" not in released["metadata"]
    assert not by_kind(render_chart({"crds": {"enabled": False}}, tmp_path), "CustomResourceDefinition")
    argo = one(render_chart({"crds": {"annotations": {"argocd.argoproj.io/sync-options": "Delete=false"}}}, tmp_path),
               "CustomResourceDefinition")
    assert argo["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep",
                                               "argocd.argoproj.io/sync-options": "Delete=false"}


def test_crd_text_is_inserted_verbatim_even_with_template_braces(tmp_path):
    """CEL messages may contain `{{`: the chart must not evaluate the CRD text as a template."""
    chart = tmp_path / "megatron-operator"
    shutil.copytree(CHART, chart)
    spec_file = chart / "files" / "crds" / "megatronjobs.spec.yaml"
    text = spec_file.read_text().replace(
        "description: MegatronJob runs one Megatron-Core pretraining job as a JobSet.",
        "description: 'MegatronJob {{ .Values.oops }} {{- fail \"evaluated\" }}'", 1)
    assert "{{" in text
    spec_file.write_text(text)
    objs = render_chart(chart=chart)
    schema = one(objs, "CustomResourceDefinition")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["description"] == 'MegatronJob {{ .Values.oops }} {{- fail "evaluated" }}'


# ---- values: strict schema, documentation ----------------------------------------------------------------

@pytest.mark.parametrize("values, message", [
    ({"replicaCount": 2}, "replicaCount"),
    ({"config": {"shmGibPerGpu": 4}}, "shmGibPerGpu"),
    ({"crds": {"enable": True}}, "enable"),
    ({"metrics": {"serviceMonitor": {"enabeld": True}}}, "enabeld"),
    ({"config": {"maxRestarts": "3"}}, "maxRestarts"),
    ({"config": {"runAsUser": 0}}, "runAsUser"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"image": {"digest": "latest"}}, "digest"),
    ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
    ({"guardrails": {"allowedImageRegistries": ["nvcr.io,docker.io"]}}, "allowedImageRegistries"),
    ({"guardrails": {"deniedMetadataKeys": [" app"]}}, "deniedMetadataKeys"),
    ({"guardrails": {"allowedNodeSelectorKeys": ["a'] || true || ['"]}}, "allowedNodeSelectorKeys"),
    ({"guardrailsPolicy": {"enabled": "yes"}}, "enabled"),
    ({"extraEnv": [{"name": "MEGATRON_OPERATOR_MAX_RESTARTS", "value": "9"}]}, "extraEnv"),
    ({"metrics": {"prometheusRule": {"jobStalled": {"noProgressFor": "thirty minutes"}}}}, "noProgressFor"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_schema_refuses_typos_and_bad_values(values, message, tmp_path):
    proc = render_chart(values, tmp_path, check=False)
    assert proc.returncode != 0, f"helm accepted {values}"
    assert "schema" in proc.stderr and message in proc.stderr, proc.stderr


# Maps whose keys are data (labels, annotations, quantities), documented as a whole.
FREE_FORM = {"crds.annotations", "serviceAccount.annotations", "metrics.service.annotations", "metrics.serviceMonitor.labels",
             "metrics.podMonitor.labels", "metrics.prometheusRule.labels", "dashboards.labels",
             "dashboards.annotations", "podAnnotations", "podLabels", "nodeSelector", "resources.requests",
             "resources.limits"}


def _keys_with_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line index, dotted path) of every mapping key in values.yaml (list items are values)."""
    out, stack = [], []  # stack of (indent, key)
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][A-Za-z0-9_]*):(\s|$)", line)
        if m:
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            out.append((i, ".".join(k for _, k in stack)))
    return out


def test_every_value_is_documented():
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, path in _keys_with_lines(lines):
        if path.rpartition(".")[0] in FREE_FORM:
            continue
        j = i - 1
        block = []
        while j >= 0 and lines[j].strip().startswith("#"):
            block.append(lines[j].strip())
            j -= 1
        if not any(c.startswith("# --") for c in block):
            undocumented.append(f"line {i + 1}: {path}")
    assert not undocumented, "values without a `# --` comment: " + ", ".join(undocumented)


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for key, sub in (schema.get("properties") or {}).items():
        out.add(prefix + key)
        out |= _schema_paths(sub, prefix + key + ".")
    return out


def _value_paths(values: Any, prefix: str = "") -> set[str]:
    out = set()
    if isinstance(values, dict):
        for key, sub in values.items():
            out.add(prefix + key)
            out |= _value_paths(sub, prefix + key + ".")
    return out


def test_schema_is_strict_and_covers_exactly_the_values():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def strict(node: dict[str, Any], path: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or '<root>'}: additionalProperties must be false"
            for key, sub in node["properties"].items():
                strict(sub, f"{path}.{key}" if path else key)
        if isinstance(node.get("items"), dict):
            strict(node["items"], path + "[]")

    strict(schema, "")
    in_values = {p for p in _value_paths(values) if not any(p.startswith(f + ".") for f in FREE_FORM)}
    assert in_values == _schema_paths(schema) - {
        # typed in the schema but empty (or absent) by default
        "podSecurityContext.fsGroup", "podSecurityContext.supplementalGroups",
        "podSecurityContext.seccompProfile.localhostProfile", "securityContext.privileged",
        "securityContext.runAsNonRoot", "securityContext.runAsUser", "securityContext.runAsGroup",
        "securityContext.capabilities.add", "securityContext.seccompProfile",
        "securityContext.seccompProfile.type", "securityContext.seccompProfile.localhostProfile",
        "affinity.nodeAffinity", "affinity.podAffinity", "affinity.podAntiAffinity"}


# ---- monitoring -------------------------------------------------------------------------------------------

def _metric_names(promql: str) -> set[str]:
    return set(re.findall(r"\b(megatron_(?:trainer|operator)_[a-z_]+)", promql))


def _known_metrics() -> set[str]:
    trainer = {f"megatron_trainer_{name}" for name in TRAINER_GAUGES}
    operator = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for metric in Metrics().registry.collect():
        operator |= {metric.name + suffix for suffix in suffixes[metric.type]}
    return trainer | operator


def test_monitoring_objects(tmp_path):
    objs = render_chart(ALL_ON, tmp_path)
    sm = one(objs, "ServiceMonitor")
    svc = one(objs, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    # The PodMonitor selects what the operator puts on trainer pods, on the port the operator names.
    pm = one(objs, "PodMonitor")
    job = parse_job(make_job())
    jobset = next(o for o in render(job, Settings(), owner_uid="u") if o["kind"] == "JobSet")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels_for("job").items()
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics" and ports["metrics"] == 9400
    keep, relabel = pm["spec"]["podMetricsEndpoints"][0]["relabelings"]
    # Only the pod of node rank 0 serves (the trainer's global rank 0); JobSet labels it job-global-index 0.
    from megatron_operator.names import JOBSET_GLOBAL_INDEX_LABEL

    assert keep == {"sourceLabels": ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_",
                                                                              JOBSET_GLOBAL_INDEX_LABEL)],
                    "regex": "0", "action": "keep"}
    # The operator's per-job series keep the job's namespace (not exported_namespace).
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    assert relabel["targetLabel"] == "megatron_job"
    label = "megatron-operator.io/job-name"
    assert label in pod["metadata"]["labels"]
    assert relabel["sourceLabels"] == ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)]
    assert pm["spec"]["namespaceSelector"] == {"any": True}


def test_alerts_use_only_metrics_that_exist(tmp_path):
    rule = one(render_chart(ALL_ON, tmp_path), "PrometheusRule")
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {"MegatronJobStalled", "MegatronJobRestartsClimbing", "MegatronJobFailed",
                           "MegatronOperatorReconcileErrors"}
    known = _known_metrics()
    for name, r in alerts.items():
        used = _metric_names(r["expr"])
        assert used and used <= known, f"{name} uses unknown metrics {used - known}"
        for text in r["annotations"].values():
            assert "{{ ." not in text, f"{name}: a Helm value leaked into a Prometheus template: {text}"
    assert alerts["MegatronJobStalled"]["for"] == "30m"


def test_alerts_can_be_switched_off_one_by_one(tmp_path):
    values = {"metrics": {"prometheusRule": {"enabled": True, "jobStalled": {"enabled": False},
                                             "restartsClimbing": {"threshold": 5, "window": "6h"}}}}
    rule = one(render_chart(values, tmp_path), "PrometheusRule")
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert "MegatronJobStalled" not in alerts
    assert "[6h]" in alerts["MegatronJobRestartsClimbing"]["expr"]
    assert alerts["MegatronJobRestartsClimbing"]["expr"].rstrip().endswith(">= 5")


def test_service_monitor_needs_the_service(tmp_path):
    proc = render_chart({"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
                        tmp_path, check=False)
    assert proc.returncode != 0 and "needs metrics.service.enabled" in proc.stderr


def test_dashboard_is_valid_and_uses_only_metrics_that_exist(tmp_path):
    text = (CHART / "files" / "dashboards" / "megatron-operator.json").read_text()
    dash = json.loads(text)
    known = _known_metrics()
    used = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            names = _metric_names(target["expr"])
            assert names, f"panel {panel['title']}: no megatron metric in {target['expr']}"
            used |= names
    assert used <= known, f"unknown metrics: {used - known}"
    # every trainer gauge is on the dashboard
    assert {f"megatron_trainer_{g}" for g in TRAINER_GAUGES} <= used
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cm = one(render_chart({"dashboards": {"enabled": True, "namespace": "monitoring"}}, tmp_path), "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["megatron-operator.json"]) == dash


def test_every_metric_is_listed_in_install_md():
    """docs/install.md's metric table names every metric the operator and the trainer export, and no other."""
    text = (Path(__file__).parents[2] / "docs" / "install.md").read_text()
    listed = set(re.findall(r"^\| `(megatron_[a-z_]+)`", text, flags=re.M))
    exported = {f"megatron_trainer_{name}" for name in TRAINER_GAUGES} | {
        m.name + ("_total" if m.type == "counter" else "") for m in Metrics().registry.collect()}
    assert listed == exported


def test_user_roles_aggregate_megatronjobs_but_never_their_status(default_objs, tmp_path):
    agg = {o["metadata"]["name"].rsplit("-", 1)[-1]: o for o in by_kind(default_objs, "ClusterRole")
           if o not in operator_cluster_roles(default_objs)}
    assert set(agg) == {"edit", "view"}
    assert agg["edit"]["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert agg["edit"]["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert agg["view"]["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    for role in agg.values():
        for rule in role["rules"]:
            assert rule["resources"] == ["megatronjobs"] and rule["apiGroups"] == ["megatron-operator.io"]
    assert set(agg["view"]["rules"][0]["verbs"]) == {"get", "list", "watch"}
    assert not operator_cluster_roles(render_chart({"rbac": {"create": False, "aggregateToDefaultRoles": False},
                                                    "serviceAccount": {"create": False, "name": "mo"}}, tmp_path)) \
        and not by_kind(render_chart({"rbac": {"create": True, "aggregateToDefaultRoles": False}}, tmp_path),
                        "ClusterRole")[1:]


def test_trainer_status_policy_guards_every_operator_field(default_objs, tmp_path):
    from megatron_operator.status import OPERATOR_FIELDS

    policy = one(default_objs, "ValidatingAdmissionPolicy", "-trainer-status")
    guarded = [v["message"].split(" ")[0].removeprefix("status.") for v in policy["spec"]["validations"]]
    assert guarded == list(OPERATOR_FIELDS), "update the field list in templates/trainer-status-policy.yaml"
    assert "progress" not in guarded
    # fields the CRD defaults (the API server adds them with the first status write) compare absent == default
    from megatron_operator.spec import MegatronJobStatus
    defaulted = sorted((f.alias or n) for n, f in MegatronJobStatus.model_fields.items()
                       if f.default_factory is not None or f.default not in (None,))
    text = (CHART / "templates" / "trainer-status-policy.yaml").read_text()
    for name in defaulted:
        assert f'"{name}"' in text.split("$fields")[0], f"add {name} to $defaults in trainer-status-policy.yaml"
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == ["megatronjobs/status"]
    binding = one(default_objs, "ValidatingAdmissionPolicyBinding", "-trainer-status")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    off = render_chart({"trainerStatusPolicy": {"enabled": False}}, tmp_path)
    assert [p["metadata"]["name"] for p in by_kind(off, "ValidatingAdmissionPolicy")] == [
        f"{RELEASE}-megatron-operator-guardrails"]


def test_guardrail_values_reach_the_operators_settings(tmp_path):
    objs = render_chart({"guardrails": {"allowedImageRegistries": ["nvcr.io", "registry.example.com/ml"],
                                        "requireQueueName": True, "maxTerminationGracePeriodSeconds": 900,
                                        "deniedMetadataKeys": ["container.apparmor.security.beta.kubernetes.io/"]}},
                        tmp_path)
    settings = Settings.from_env(env_of(objs))
    assert settings.allowed_image_registries == "nvcr.io,registry.example.com/ml"
    assert settings.require_queue_name is True and settings.deny_secret_env is False
    assert settings.max_termination_grace_period_s == 900
    assert settings.denied_metadata_keys == "container.apparmor.security.beta.kubernetes.io/"
    defaults = Settings.from_env(env_of(render_chart({}, tmp_path)))
    assert defaults.require_queue_name is False and defaults.allowed_image_registries == ""


# ---- the guardrails at admission: the policy and the operator say the same ---------------------------

GUARDRAILS_ON = {"allowedImageRegistries": ["nvcr.io", "registry.example.com/ml/"],
                 "allowedPriorityClasses": ["training", "training-high"],
                 "allowedTolerationKeys": ["nvidia.com/gpu", "dedicated"],
                 "allowedNodeSelectorKeys": ["node.kubernetes.io/instance-type"],
                 "maxTerminationGracePeriodSeconds": 900, "requireQueueName": True, "denySecretEnv": True,
                 "denyImagePullSecrets": True,
                 "deniedMetadataKeys": ["container.apparmor.security.beta.kubernetes.io/", "iam.amazonaws.com/",
                                        "azure.workload.identity/",
                                        "App"],
                 "allowedVolumeTypes": ["persistentVolumeClaim", "configMap", "emptyDir", "image", "secret"],
                 "allowedPrivilegedImages": ["nvcr.io/nvidia/k8s/dcgm-exporter", "registry.example.com/ml/priv/"]}

#: (name, overrides of a compliant job). Every guardrail broken once, then the edges that must pass.
#: Maps (nodeSelector, labels, annotations) break with one key each: CEL iterates a map in no fixed
#: order, so with several bad keys the policy names one of them and the operator lists them all.
GUARDRAIL_CASES = [
    ("compliant", {}),
    ("compliant, every field at its edge", {
        "image": "registry.example.com/ml/trainer:1", "priorityClassName": "training-high",
        "resources__tolerations": [{"key": "dedicated", "operator": "Exists"}, {"key": "nvidia.com/gpu"}],
        "resources__nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
        "terminationGracePeriodSeconds": 900, "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {
            "name": "cm", "key": "k"}}}],
        "podMetadata": {"labels": {"team": "x"}, "annotations": {"iam.amazonaws.com": "prefix without /"}}}),
    ("compliant, image omitted and empty lists", {"image": "DELETE", "imagePullSecrets": [], "env": []}),
    ("image from another registry", {"image": "docker.io/library/trainer:1"}),
    ("image registry as a host prefix", {"image": "nvcr.io.evil.example/trainer:1"}),
    ("image registry path without its slash", {"image": "registry.example.com/mlx/trainer:1"}),
    ("priority class", {"priorityClassName": "system-cluster-critical"}),
    ("toleration key", {"resources__tolerations": [{"key": "dedicated"}, {"key": "node-role.kubernetes.io/control-plane",
                                                                         "operator": "Exists"}]}),
    ("toleration of every taint", {"resources__tolerations": [{"operator": "Exists"}]}),
    ("two bad tolerations", {"resources__tolerations": [{"key": "a"}, {"operator": "Exists"}]}),
    ("node selector key", {"resources__nodeSelector": {"kubernetes.io/hostname": "n1"}}),
    ("grace period", {"terminationGracePeriodSeconds": 901}),
    ("no queue", {"queueName": "DELETE"}),
    ("secret env", {"env": [{"name": "A", "value": "1"}, {"name": "T", "valueFrom": {"secretKeyRef": {
        "name": "s", "key": "k"}}}]}),
    ("image pull secrets", {"imagePullSecrets": ["regcred"]}),
    ("denied label, other case", {"podMetadata": {"labels": {"app": "x"}}}),
    ("denied annotation", {"podMetadata": {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}}),
    ("compliant, object store with workload identity", {"checkpoint": {"objectStore": {
        "bucket": "ckpt-bucket", "serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"}}}}),
    ("object-store credentials secret", {"checkpoint": {"objectStore": {"bucket": "ckpt-bucket",
                                                                       "credentialsSecret": "s3-creds"}}}),
    ("denied workload identity annotation", {"checkpoint": {"objectStore": {
        "bucket": "ckpt-bucket", "serviceAccountAnnotations": {"azure.workload.identity/client-id": "x"}}}}),
    # spec.pod (issue 53)
    ("compliant, spec.pod at every edge", {"pod": {
        "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "datasets"}},
                    {"name": "t", "image": {"reference": "nvcr.io/nvidia/tools:1"}},
                    {"name": "s", "emptyDir": {}}],
        "initContainers": [
            {"name": "a", "image": "registry.example.com/ml/sidecar:1", "restartPolicy": "Always",
             "env": [{"name": "C", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}]},
            {"name": "b", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3.3", "securityContext": {"privileged": True}},
            {"name": "c", "image": "registry.example.com/ml/priv/x:1", "securityContext": {
                "capabilities": {"add": ["SYS_PTRACE"]}}},
            {"name": "d", "image": "nvcr.io/nvidia/k8s/dcgm-exporter", "securityContext": {
                "privileged": False, "capabilities": {"add": []}}}],
        "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": [
                {"key": "node.kubernetes.io/instance-type", "operator": "Exists"}]}}]}}}}),
    ("hostPath volume", {"pod": {"volumes": [{"name": "s", "emptyDir": {}},
                                             {"name": "host", "hostPath": {"path": "/var/lib/x", "type": "Directory"}}]}}),
    ("csi volume", {"pod": {"volumes": [{"name": "c", "csi": {"driver": "x.example.com"}}]}}),
    ("secret volume", {"pod": {"volumes": [{"name": "e", "emptyDir": {}},
                                           {"name": "s", "secret": {"secretName": "tracker"}}]}}),
    ("sidecar secret env", {"pod": {"initContainers": [{"name": "a", "image": "nvcr.io/x:1", "env": [
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]}}),
    ("sidecar from another registry", {"pod": {"initContainers": [{"name": "a", "image": "nvcr.io/x:1"},
                                                                  {"name": "b", "image": "docker.io/fluent/fluent-bit:3"}]}}),
    ("image volume from another registry", {"pod": {"volumes": [{"name": "t", "image": {"reference": "ghcr.io/x:1"}}]}}),
    ("privileged sidecar", {"pod": {"initContainers": [{"name": "a", "image": "nvcr.io/nvidia/k8s/dcgm-exporter-evil:1",
                                                        "securityContext": {"privileged": True}}]}}),
    # an entry without '/' is one repository: its tags and digests, never a path below it (issue 62)
    ("privileged image below the listed repository", {"pod": {"initContainers": [{
        "name": "a", "image": "nvcr.io/nvidia/k8s/dcgm-exporter/evil:1", "securityContext": {"privileged": True}}]}}),
    ("capabilities for an image below the listed repository", {"pod": {"initContainers": [{
        "name": "a", "image": "nvcr.io/nvidia/k8s/dcgm-exporter/x", "securityContext": {
            "capabilities": {"add": ["SYS_ADMIN"]}}}]}}),
    ("privileged image below a tag of the listed repository", {"pod": {"initContainers": [{
        "name": "a", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3/evil", "securityContext": {"privileged": True}}]}}),
    ("compliant, the listed repository by digest and by tag and digest", {"pod": {"initContainers": [
        {"name": "a", "image": "nvcr.io/nvidia/k8s/dcgm-exporter@sha256:" + "0" * 64,
         "securityContext": {"privileged": True}},
        {"name": "b", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3.3@sha256:" + "0" * 64,
         "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}}),
    ("privileged prefix without its slash", {"pod": {"initContainers": [{
        "name": "a", "image": "registry.example.com/ml/privx:1", "securityContext": {"privileged": True}}]}}),
    ("added capability", {"pod": {"initContainers": [{"name": "a", "image": "nvcr.io/x:1", "securityContext": {
        "capabilities": {"add": ["NET_ADMIN"]}}}]}}),
    ("node affinity key", {"pod": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "Exists"}]},
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["n1"]}]}]}}}}}),
    ("preferred node affinity key", {"pod": {"affinity": {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": [
            {"key": "zone", "operator": "Exists"}]}}]}}}}),
    ("everything at once", {"image": "docker.io/x:1", "priorityClassName": "p", "queueName": "DELETE",
                            "terminationGracePeriodSeconds": 3600, "imagePullSecrets": ["r"],
                            "resources__tolerations": [{"key": "x"}], "resources__nodeSelector": {"zone": "a"},
                            "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                            "podMetadata": {"labels": {"app": "x"}, "annotations": {"iam.amazonaws.com/role": "r"}}}),
]


def _guardrail_job(overrides: dict[str, Any]) -> dict[str, Any]:
    from factory import DELETE

    base = {"queueName": "team-a", "image": "nvcr.io/nvidia/trainer:1"}
    return make_job(**{k: (DELETE if v == "DELETE" else v) for k, v in {**base, **overrides}.items()})


_CEL_PROGRAMS: dict[str, Any] = {}


def _policy_messages(policy: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """The messages of the policy's failed validations for `obj`, evaluated as the API server does
    (the CRD's defaults applied first) with cel-python plus lowerAscii() and substring() (Kubernetes' CEL strings
    library)."""
    import celpy
    from celeval import apply_defaults

    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    activation = {"object": celpy.json_to_cel(apply_defaults(schema, obj))}
    env = celpy.Environment()
    functions = {"lowerAscii": lambda s: celpy.celtypes.StringType(re.sub("[A-Z]", lambda m: m.group().lower(), s)),
                 "substring": lambda s, start: celpy.celtypes.StringType(s[int(start):])}

    def run(expr: str) -> Any:
        if expr not in _CEL_PROGRAMS:
            _CEL_PROGRAMS[expr] = env.program(env.compile(expr), functions=functions)
        result = _CEL_PROGRAMS[expr].evaluate(activation)
        assert not isinstance(result, celpy.CELEvalError), f"{expr}: {result}"
        return result

    return [str(run(v["messageExpression"])) for v in policy["spec"]["validations"] if not bool(run(v["expression"]))]


@pytest.fixture(scope="module")
def guardrails_on(tmp_path_factory) -> list[dict[str, Any]]:
    return render_chart({"guardrails": GUARDRAILS_ON}, tmp_path_factory.mktemp("guardrails"))


@pytest.mark.parametrize("name,overrides", GUARDRAIL_CASES, ids=[c[0] for c in GUARDRAIL_CASES])
def test_guardrails_policy_refuses_what_the_operator_refuses_with_its_message(guardrails_on, name, overrides):
    from megatron_operator.guardrails import guardrail_problems

    doc = _guardrail_job(overrides)
    operator = guardrail_problems(parse_job(doc), Settings.from_env(env_of(guardrails_on)))
    policy = _policy_messages(one(guardrails_on, "ValidatingAdmissionPolicy", "-guardrails"), doc)
    first_per_field = list({p.field: p.message for p in reversed(operator)}.values())[::-1]
    assert sorted(policy) == sorted(first_per_field), (policy, [p.message for p in operator])
    assert bool(policy) == (not name.startswith("compliant"))


def test_every_guardrail_has_a_validation_and_the_policy_is_generated(guardrails_on):
    from megatron_operator.guardrails import GUARDRAILS

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-chart-guardrails.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr + "\n(run: python scripts/gen-chart-guardrails.py)"
    policy = one(guardrails_on, "ValidatingAdmissionPolicy", "-guardrails")
    assert len(policy["spec"]["validations"]) == len(GUARDRAILS)
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["megatron-operator.io"], "apiVersions": ["*"], "operations": ["CREATE"],
        "resources": ["megatronjobs"]}]
    # the Helm values and the operator's settings are the same guardrails
    values = yaml.safe_load((CHART / "values.yaml").read_text())["guardrails"]
    assert {g.value for g in GUARDRAILS} == set(values)
    binding = one(guardrails_on, "ValidatingAdmissionPolicyBinding", "-guardrails")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


def test_guardrails_policy_follows_the_values(tmp_path):
    def validations(objs: list[dict[str, Any]]) -> list[str]:
        found = [p for p in by_kind(objs, "ValidatingAdmissionPolicy") if p["metadata"]["name"].endswith("-guardrails")]
        return [v["messageExpression"].split(":")[0].strip("'") for p in found for v in p["spec"]["validations"]]

    # the defaults: the grace period, the denied pod metadata keys (pods' and the job's ServiceAccount's), and the
    # allow-lists of what spec.pod may add, which are always checked (an empty one allows nothing)
    always = ["spec.pod.volumes", "spec.pod.initContainers[].securityContext.privileged",
              "spec.pod.initContainers[].securityContext.capabilities"]
    assert validations(render_chart()) == ["spec.terminationGracePeriodSeconds", "spec.podMetadata.labels",
                                           "spec.podMetadata.annotations",
                                           "spec.checkpoint.objectStore.serviceAccountAnnotations", *always]
    all_off = {"maxTerminationGracePeriodSeconds": 0, "deniedMetadataKeys": [], "allowedVolumeTypes": []}
    objs = render_chart({"guardrails": all_off}, tmp_path)
    assert validations(objs) == always and [b for b in by_kind(objs, "ValidatingAdmissionPolicyBinding")
                                            if b["metadata"]["name"].endswith("-guardrails")]
    assert validations(render_chart({"guardrailsPolicy": {"enabled": False}}, tmp_path)) == []
    objs = render_chart({"watchNamespaces": ["team-a", "team-b"]}, tmp_path)
    binding = one(objs, "ValidatingAdmissionPolicyBinding", "-guardrails")
    assert binding["spec"]["matchResources"] == {"namespaceSelector": {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]}}


def test_the_policy_checks_only_creation_because_every_guarded_field_is_immutable():
    """A guardrail on a field that may change would need UPDATE in the policy's operations (and a
    matchCondition so that suspend of a job stored before the guardrail is not refused)."""
    from megatron_operator.crd import MUTABLE_SPEC_FIELDS
    from megatron_operator.guardrails import GUARDRAILS

    top_level = {g.field.split(".")[1] for g in GUARDRAILS}
    assert top_level and not top_level & set(MUTABLE_SPEC_FIELDS)
    spec = crd.spec_schema()
    for name in top_level:
        assert {"rule": "self == oldSelf", "message": crd.immutable_message(name), "reason": "FieldValueForbidden"} \
            in spec["properties"][name]["x-kubernetes-validations"], name


# Random jobs near every guardrail's edge: the policy and the operator must agree on each.
_KEYS = ["nvidia.com/gpu", "dedicated", "Dedicated", "dedicated2", "node.kubernetes.io/instance-type",
         "kubernetes.io/hostname", "app", "App2", "application", "team", "iam.amazonaws.com/role",
         "iam.amazonaws.com", "container.apparmor.security.beta.kubernetes.io/t"]
_GUARDRAIL_SPECS = st.fixed_dictionaries({}, optional={
    "image": st.sampled_from(["nvcr.io/x:1", "nvcr.io", "nvcr.iox/y", "registry.example.com/ml/t",
                              "registry.example.com/ml", "registry.example.com/mlx/t", "docker.io/x", "NVCR.io/x"]),
    "priorityClassName": st.sampled_from(["training", "training-high", "train", "system-node-critical"]),
    "resources__tolerations": st.lists(st.fixed_dictionaries({"operator": st.just("Exists")}, optional={
        "key": st.sampled_from(_KEYS[:6])}), max_size=3),
    "resources__nodeSelector": st.dictionaries(st.sampled_from(_KEYS[4:6]), st.just("v"), max_size=2),
    "terminationGracePeriodSeconds": st.sampled_from([30, 899, 900, 901, 86400]),
    "queueName": st.sampled_from(["team-a", "DELETE"]),
    "env": st.lists(st.sampled_from([{"name": "A", "value": "1"},
                                     {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
                                     {"name": "C", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]),
                    max_size=2, unique_by=lambda e: e["name"]),
    "imagePullSecrets": st.lists(st.just("regcred"), max_size=1),
    "pod": st.fixed_dictionaries({
        "volumes": st.lists(st.sampled_from([
            {"persistentVolumeClaim": {"claimName": "d"}}, {"emptyDir": {}}, {"secret": {"secretName": "s"}},
            {"csi": {"driver": "x.example.com"}}, {"hostPath": {"path": "/x", "type": "Directory"}},
            {"image": {"reference": "nvcr.io/t:1"}}, {"image": {"reference": "docker.io/t:1"}}]), max_size=3).map(
                lambda vs: [{"name": f"v{i}", **v} for i, v in enumerate(vs)]),
        "initContainers": st.lists(st.fixed_dictionaries({
            "image": st.sampled_from(["nvcr.io/nvidia/k8s/dcgm-exporter", "nvcr.io/nvidia/k8s/dcgm-exporter:1",
                                      "nvcr.io/nvidia/k8s/dcgm-exporter/evil:1", "nvcr.io/nvidia/k8s/dcgm-exporter@x",
                                      "nvcr.io/nvidia/k8s/dcgm-exporter:1/x",
                                      "nvcr.io/nvidia/k8s/dcgm-exporterx", "registry.example.com/ml/priv/a",
                                      "registry.example.com/ml/privy", "docker.io/x"])}, optional={
            "securityContext": st.fixed_dictionaries({}, optional={
                "privileged": st.booleans(), "capabilities": st.fixed_dictionaries({"add": st.lists(
                    st.just("NET_ADMIN"), max_size=1)})})}), max_size=3).map(
                lambda cs: [{"name": f"c{i}", **c} for i, c in enumerate(cs)]),
    }),
    "podMetadata": st.fixed_dictionaries({"labels": st.dictionaries(st.sampled_from(["app", "application", "team"]),
                                                                    st.just("x"), max_size=2),
                                          "annotations": st.dictionaries(st.sampled_from(_KEYS[10:]), st.just("x"),
                                                                         max_size=2)}),
})


class _Guarded:
    """The rendered policy and the operator's settings (a short repr for hypothesis' reports)."""

    def __init__(self, objs: list[dict[str, Any]]):
        self.policy = one(objs, "ValidatingAdmissionPolicy", "-guardrails")
        self.settings = Settings.from_env(env_of(objs))

    def __repr__(self) -> str:
        return "guardrails: GUARDRAILS_ON"


@pytest.fixture(scope="module")
def guarded(guardrails_on) -> _Guarded:
    return _Guarded(guardrails_on)


@hypothesis_settings(max_examples=150, deadline=None)
@given(overrides=_GUARDRAIL_SPECS)
def test_policy_and_operator_agree_on_random_jobs(guarded, overrides):
    from megatron_operator.guardrails import guardrail_problems

    doc = _guardrail_job(overrides)
    operator = guardrail_problems(parse_job(doc), guarded.settings)
    policy = _policy_messages(guarded.policy, doc)
    assert {m.split(":")[0] for m in policy} == {p.field for p in operator}, (policy, operator)
    assert set(policy) <= {p.message for p in operator}, (policy, operator)  # maps: one of the offenders
