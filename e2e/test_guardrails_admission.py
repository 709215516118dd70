"""The chart's guardrails ValidatingAdmissionPolicy on the real API server.

`helm install` with every guardrail set (watching only the test's namespace, so the binding
touches no other test); then, for each guardrail, `kubectl apply` of a MegatronJob that breaks it
is refused with the message the operator gives for the same job and the same settings (computed
here by the operator's own code from the installed Deployment's environment), and compliant jobs,
the edges of every guardrail included, are stored. Only creation is checked: a job stored before
the guardrails that breaks one can still be suspended, relabelled and deleted.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from k8s import Cluster
from megatron_operator.guardrails import guardrail_problems
from megatron_operator.settings import Settings
from megatron_operator.validation import parse_job
from mjob import small_job
from test_helm import Release, e2e_values

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
POLICY_TIMEOUT_S = 30
GUARDRAILS = {"allowedImageRegistries": ["nvcr.io", "registry.example.com/ml/"],
              "allowedPriorityClasses": ["training", "training-high"],
              "allowedTolerationKeys": ["nvidia.com/gpu", "dedicated"],
              "allowedNodeSelectorKeys": ["node.kubernetes.io/instance-type"],
              "maxTerminationGracePeriodSeconds": 900, "requireQueueName": True, "denySecretEnv": True,
              "denyImagePullSecrets": True,
              "deniedMetadataKeys": ["container.apparmor.security.beta.kubernetes.io/", "iam.amazonaws.com/", "App",
                                     "azure.workload.identity/"],
              "allowedVolumeTypes": ["persistentVolumeClaim", "configMap", "secret", "emptyDir", "image"],
              "allowedPrivilegedImages": ["nvcr.io/nvidia/k8s/dcgm-exporter"]}
COMPLIANT = {"queueName": "team-a", "image": "nvcr.io/nvidia/trainer:1"}
SECRET_ENV = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]

#: (name, spec overrides): each breaks one guardrail.
VIOLATIONS = [
    ("registry", {"image": "docker.io/library/trainer:1"}),
    ("registry-host-prefix", {"image": "nvcr.io.evil.example/trainer:1"}),
    ("priority-class", {"priorityClassName": "system-cluster-critical"}),
    ("toleration-key", {"resources__tolerations": [{"key": "dedicated"}, {"key": "node-role.kubernetes.io/control-plane",
                                                                         "operator": "Exists"}]}),
    ("toleration-every-taint", {"resources__tolerations": [{"operator": "Exists"}]}),
    ("node-selector-key", {"resources__nodeSelector": {"kubernetes.io/hostname": "n1"}}),
    ("grace-period", {"terminationGracePeriodSeconds": 901}),
    ("queue-name", {"queueName": None}),
    ("secret-env", {"env": [{"name": "A", "value": "1"}, *SECRET_ENV]}),
    ("image-pull-secrets", {"imagePullSecrets": ["regcred"]}),
    ("label-key", {"podMetadata": {"labels": {"app": "x"}}}),
    ("annotation-key", {"podMetadata": {"annotations": {"container.apparmor.security.beta.kubernetes.io/t": "unconfined"}}}),
    ("object-store-secret", {"checkpoint": {"objectStore": {"bucket": "ckpt-bucket", "credentialsSecret": "s3"}}}),
    ("service-account-annotation", {"checkpoint": {"objectStore": {
        "bucket": "ckpt-bucket", "serviceAccountAnnotations": {"azure.workload.identity/client-id": "c"}}}}),
    # spec.pod (issue 53)
    # (a hostPath the spec rules admit: typed, not a system directory; issue 62)
    ("host-path", {"pod": {"volumes": [{"name": "host", "hostPath": {"path": "/mnt/nvme", "type": "Directory"}}]}}),
    ("csi", {"pod": {"volumes": [{"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io"}}]}}),
    ("secret-volume", {"pod": {"volumes": [{"name": "s", "secret": {"secretName": "tracker"}}]}}),
    ("sidecar-secret-env", {"pod": {"initContainers": [{"name": "a", "image": "nvcr.io/x:1", "env": [
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]}}),
    ("sidecar-registry", {"pod": {"initContainers": [{"name": "logs", "image": "docker.io/fluent/fluent-bit:3",
                                                      "restartPolicy": "Always"}]}}),
    ("image-volume-registry", {"pod": {"volumes": [{"name": "t", "image": {"reference": "ghcr.io/tools:1"}}]}}),
    ("privileged", {"pod": {"initContainers": [{"name": "a", "image": "nvcr.io/x:1",
                                                "securityContext": {"privileged": True}}]}}),
    # an entry without '/' is one repository: never an image below it (issue 62)
    ("privileged-below-repository", {"pod": {"initContainers": [{
        "name": "a", "image": "nvcr.io/nvidia/k8s/dcgm-exporter/evil:1", "securityContext": {"privileged": True}}]}}),
    ("capabilities-below-repository", {"pod": {"initContainers": [{
        "name": "a", "image": "nvcr.io/nvidia/k8s/dcgm-exporter/evil:1",
        "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}}),
    ("capabilities", {"pod": {"initContainers": [{"name": "a", "image": "nvcr.io/x:1",
                                                  "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}]}}),
    ("node-affinity-key", {"pod": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                     "values": ["n1"]}]}]}}}}}),
]
#: (name, spec overrides): at the edge of every guardrail, and must be admitted.
COMPLIANT_EDGES = [
    ("plain", {}),
    ("edges", {"image": "registry.example.com/ml/trainer:1", "priorityClassName": "training-high",
               "resources__tolerations": [{"key": "dedicated", "operator": "Exists"}, {"key": "nvidia.com/gpu"}],
               "resources__nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
               "terminationGracePeriodSeconds": 900,
               "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}],
               "podMetadata": {"labels": {"team": "x"}, "annotations": {"iam.amazonaws.com": "no slash"}}}),
    ("no-image", {"image": None, "imagePullSecrets": [], "env": []}),
    ("object-store-irsa", {"checkpoint": {"objectStore": {"bucket": "ckpt-bucket", "serviceAccountAnnotations": {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/ckpt"}}}}),
    ("pod-edges", {"pod": {
        "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "datasets"}}, {"name": "s", "emptyDir": {}},
                    {"name": "t", "image": {"reference": "registry.example.com/ml/tools:1"}}],
        "volumeMounts": [{"name": "d", "mountPath": "/mnt/datasets"}],
        "initContainers": [
            {"name": "logs", "image": "nvcr.io/fluent-bit:3", "restartPolicy": "Always",
             "volumeMounts": [{"name": "s", "mountPath": "/shared"}]},
            {"name": "dcgm", "image": "nvcr.io/nvidia/k8s/dcgm-exporter:3.3", "restartPolicy": "Always",
             "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}},
            {"name": "dcgm-digest", "image": "nvcr.io/nvidia/k8s/dcgm-exporter@sha256:" + "0" * 64,
             "restartPolicy": "Always", "securityContext": {"privileged": True}}],
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 1, "preference": {"matchExpressions": [{"key": "node.kubernetes.io/instance-type",
                                                              "operator": "Exists"}]}}]}}}}),
]


def job(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    doc = small_job(name, **{k: v for k, v in {**COMPLIANT, **overrides}.items() if v is not None})
    for key in [k for k, v in overrides.items() if v is None]:
        doc["spec"].pop(key, None)
    return doc


def kubectl_apply(cluster: Cluster, namespace: str, doc: dict[str, Any]) -> Any:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)


@pytest.fixture
def guarded(cluster: Cluster, crd: None, namespace: str, tmp_path: Path):
    """A release with every guardrail on, bound to `namespace`; the operator's settings from its Deployment."""
    rel = Release(cluster, f"mo-{secrets.token_hex(3)}", f"mo-sys-{secrets.token_hex(3)}", tmp_path)
    # stored before the guardrails existed: it breaks one (pull secrets) and its spec is never written again
    out = kubectl_apply(cluster, namespace, job("stored-before", {"imagePullSecrets": ["regcred"]}))
    assert out.returncode == 0, out.stderr
    rel.install(e2e_values(watchNamespaces=[namespace], guardrails=GUARDRAILS))
    try:
        env = {e["name"]: e.get("value") for e in rel.deployment()["spec"]["template"]["spec"]["containers"][0]["env"]}
        env = {k: v for k, v in env.items() if k.startswith("MEGATRON_OPERATOR_") and v is not None}
        settings = Settings.from_env(env)
        probe = job("probe", {"image": "docker.io/x:1"})

        def in_force() -> bool:  # the API server loads a new policy within seconds (dry run: nothing stored)
            out = cluster.kubectl("apply", "-n", namespace, "--dry-run=server", "-f", "-", input=yaml.safe_dump(probe),
                                  check=False)
            return out.returncode != 0 and "this cluster runs images only from" in out.stderr

        cluster.wait_for(in_force, POLICY_TIMEOUT_S, "the guardrails policy refusing a job from docker.io",
                         namespace=namespace, kinds=("validatingadmissionpolicies",
                                                     "validatingadmissionpolicybindings", "megatronjobs"))
        # the API server type-checked every expression against the CRD's schema: no warnings
        policy_name = f"{rel.name}-megatron-operator-guardrails"

        def checked() -> dict[str, Any]:
            out = cluster.kubectl("get", "validatingadmissionpolicy", policy_name, "-o", "json").stdout
            status = json.loads(out).get("status") or {}
            return status if status.get("observedGeneration") else {}

        status = cluster.wait_for(checked, POLICY_TIMEOUT_S, f"type checking of {policy_name}",
                                  kinds=("validatingadmissionpolicies",))
        assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
        yield settings, env
    finally:
        rel.uninstall()
        kubernetes.client.CoreV1Api(cluster.api_client()).delete_namespace(rel.namespace)


def cli_validate(doc: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`megatron-operator validate -` with the operator's environment from the installed Deployment."""
    return subprocess.run([sys.executable, "-m", "megatron_operator", "validate", "-"], input=yaml.safe_dump(doc),
                          capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}", **env})


def test_api_server_refuses_each_guardrail_with_the_operators_message(cluster, namespace, guarded):
    settings, env = guarded
    for name, overrides in VIOLATIONS:
        doc = job(name, overrides)
        expected = guardrail_problems(parse_job({**doc, "metadata": {**doc["metadata"], "namespace": namespace}}),
                                      settings)
        assert len(expected) == 1, (name, expected)  # each case breaks exactly one guardrail, once
        out = kubectl_apply(cluster, namespace, doc)
        assert out.returncode != 0, f"{name}: admitted: {out.stdout}"
        assert "ValidatingAdmissionPolicy" in out.stderr and expected[0].message in out.stderr, (
            f"{name}: expected the operator's message\n  {expected[0].message}\ngot\n  {out.stderr}")
        cli = cli_validate(doc, env)  # the pull-request check says the same
        assert cli.returncode == 1 and cli.stderr == f"-: {expected[0].message}\n", (name, cli.stderr)
    stored = json.loads(cluster.kubectl("get", "megatronjobs", "-n", namespace, "-o", "json").stdout)["items"]
    assert [j["metadata"]["name"] for j in stored] == ["stored-before"]


def test_api_server_admits_compliant_jobs_and_checks_only_spec_writes(cluster, namespace, guarded):
    for name, overrides in COMPLIANT_EDGES:
        doc = job(name, overrides)
        assert guardrail_problems(parse_job({**doc, "metadata": {**doc["metadata"], "namespace": namespace}}),
                                  guarded[0]) == []
        assert cli_validate(doc, guarded[1]).returncode == 0, name
        out = kubectl_apply(cluster, namespace, doc)
        assert out.returncode == 0, f"{name}: refused: {out.stderr}"
    # only creation is checked (every guarded field is immutable): a job stored before the guardrails
    # that breaks one can still be suspended, relabelled and deleted; the operator marks it Failed
    cluster.kubectl("patch", "-n", namespace, "megatronjob/stored-before", "--type=merge", "-p",
                    '{"spec": {"suspend": true}}')
    cluster.kubectl("label", "-n", namespace, "megatronjob/stored-before", "team=ml")
    cluster.kubectl("delete", "-n", namespace, "megatronjob/stored-before", "--wait=false")
