"""`helm install` onto a real node: the chart's operator Deployment runs as a real pod.

The node is a kubelet built from the same Kubernetes modules on containerd and runc
(e2e/cluster/node.py), registered beside the kwok GPU nodes. The operator image is the one
`make images` built, loaded into containerd without a registry. The test checks that:

- the kubelet's probes pass: the readiness and liveness counters in its /metrics/probes;
- the metrics Service has the pod's endpoint, and the pod answers on it;
- the operator in the pod takes MegatronJobs to Succeeded, and their GPU pods go to kwok nodes;
- a killed operator pod is recreated by its ReplicaSet, and the new pod carries on reconciling.

Needs root (containerd, runc, mounts, a bridge). node.py installs the Debian packages when they
are missing, and the kubelet and CoreDNS are built on first use (`e2e/cluster/build.sh kubelet coredns`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import secrets
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import realnode
import yaml
from k8s import Cluster
from mjob import Jobs, run_for, small_job
from test_helm import Release
from test_image import image

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e" / "cluster"))
import node as real_node  # noqa: E402

ROLLOUT_TIMEOUT_S = 120
PROBE_TIMEOUT_S = 90   # liveness: initialDelaySeconds 15 + one period of 20 s, with room
JOB_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def node(cluster: Cluster, image: str) -> dict[str, Any]:
    with realnode.node_up() as state:  # builds the kubelet and CoreDNS on first use; down afterwards
        yield state


def values(state: dict[str, Any], namespace: str, image_ref: str) -> dict[str, Any]:
    repository, tag = image_ref.rsplit(":", 1)
    api = state["apiserver"]
    return {
        "crds": {"enabled": False},
        "watchNamespaces": [namespace],
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "nodeSelector": {"megatron-operator.io/real-node": "true"},
        "tolerations": [{"key": real_node.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
        # no kube-proxy, and the serving certificate does not name the ClusterIP (node.py)
        "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": api["host"]},
                     {"name": "KUBERNETES_SERVICE_PORT", "value": str(api["port"])}],
        "config": {"resyncIntervalSeconds": 1},
    }


def operator_pod(core: kubernetes.client.CoreV1Api, rel: Release) -> Any | None:
    pods = core.list_namespaced_pod(rel.namespace, label_selector=f"app.kubernetes.io/instance={rel.name}").items
    ready = [p for p in pods if p.metadata.deletion_timestamp is None and p.status.phase == "Running"
             and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
    return ready[0] if len(ready) == 1 else None


def probe_successes(kubelet_port: int, pod: str, probe: str) -> float:
    """The kubelet's own count of successful probes of `pod` (its /metrics/probes)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the kubelet's self-signed serving cert
    with urllib.request.urlopen(f"https://127.0.0.1:{kubelet_port}/metrics/probes", timeout=5, context=ctx) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(r'^prober_probe_total\{(.*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("pod") == pod and labels.get("probe_type") == probe and labels.get("result") == "successful":
            total += float(m.group(2))
    return total


def pod_metric(pod_ip: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{pod_ip}:8080/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def gpu_pods_on_kwok_nodes(core: kubernetes.client.CoreV1Api, jobs: Jobs, job: str) -> None:
    pods = jobs.pods(job)
    assert pods, f"no pods for {job}"
    for p in pods:
        node = core.read_node(p.spec.node_name)
        assert node.metadata.annotations.get("kwok.x-k8s.io/node") == "fake", (p.metadata.name, p.spec.node_name)


def test_helm_install_runs_the_operator_as_a_real_pod(cluster, crd, node, image, namespace, tmp_path):
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    # the kubelet's node, not kwok's
    real = core.read_node(node["node"])
    assert real.status.node_info.kubelet_version == f"v{real_node.cluster.versions()['KUBE_VERSION']}"
    assert real.status.node_info.container_runtime_version.startswith("containerd://")
    assert "kwok.x-k8s.io/node" not in (real.metadata.annotations or {})

    rel = Release(cluster, f"mo-{secrets.token_hex(3)}", f"mo-node-{secrets.token_hex(3)}", tmp_path)
    rel.install(values(node, namespace, image))
    jobs = Jobs(cluster, namespace)
    try:
        pod = cluster.wait_for(lambda: operator_pod(core, rel), ROLLOUT_TIMEOUT_S, "the operator pod to be Ready",
                               namespace=rel.namespace)
        assert pod.spec.node_name == node["node"]
        kubelet_port = yaml.safe_load((real_node.node_dir() / "kubelet" / "config.yaml").read_text())["port"]
        for probe in ("Readiness", "Liveness"):
            cluster.wait_for(lambda probe=probe: probe_successes(kubelet_port, pod.metadata.name, probe) >= 1,
                             PROBE_TIMEOUT_S, f"a successful {probe} probe of {pod.metadata.name}",
                             namespace=rel.namespace)

        def endpoint() -> str | None:
            slices = kubernetes.client.DiscoveryV1Api(cluster.api_client()).list_namespaced_endpoint_slice(
                rel.namespace, label_selector=f"kubernetes.io/service-name={rel.name}-megatron-operator-metrics").items
            ready = [a for s in slices for e in s.endpoints or [] if e.conditions.ready for a in e.addresses]
            return ready[0] if ready == [pod.status.pod_ip] else None

        assert cluster.wait_for(endpoint, 60, "the metrics Service's endpoint", namespace=rel.namespace) \
            == pod.status.pod_ip

        jobs.create(small_job("first", podMetadata=run_for(3)))
        jobs.wait_phase("first", "Succeeded", timeout=JOB_TIMEOUT_S)
        gpu_pods_on_kwok_nodes(core, jobs, "first")
        assert pod_metric(pod.status.pod_ip, "megatron_operator_status_writes_total") > 0

        # kill the operator pod: its ReplicaSet recreates it, and the new pod carries on
        core.delete_namespaced_pod(pod.metadata.name, rel.namespace, grace_period_seconds=0)
        new = cluster.wait_for(
            lambda: (p := operator_pod(core, rel)) and p.metadata.name != pod.metadata.name and p,
            ROLLOUT_TIMEOUT_S, "a new operator pod to be Ready", namespace=rel.namespace)
        assert new.spec.node_name == node["node"]
        jobs.create(small_job("second", podMetadata=run_for(3)))
        jobs.wait_phase("second", "Succeeded", timeout=JOB_TIMEOUT_S)
        gpu_pods_on_kwok_nodes(core, jobs, "second")
        assert pod_metric(new.status.pod_ip, "megatron_operator_status_writes_total") > 0
        assert pod_metric(new.status.pod_ip, "megatron_operator_reconcile_errors_total") == 0
    finally:
        logs = sorted((real_node.node_dir() / "pod-logs").glob(f"{rel.namespace}_*/operator/*.log"))
        (cluster.logs_dir / "operator-real-node.log").write_text(
            "".join(f"===== {f}\n{f.read_text(errors='replace')}" for f in logs))
        for name in ("first", "second"):
            with contextlib.suppress(kubernetes.client.ApiException):
                jobs.delete(name)
        rel.uninstall()
        core.delete_namespace(rel.namespace)


# ---------------------------------------------------------------------------------------------------
# Issue 32: the volumes this turn added, as the operator renders them, on a real kubelet.
# ---------------------------------------------------------------------------------------------------
MOUNT_CHECK_TIMEOUT_S = 120
CREDENTIALS_DIR = "/var/run/secrets/megatron-operator/object-store"
# Runs in the rendered container (as its uid, under its securityContext): what it sees, as JSON. The
# credentials file is hashed, never printed (pod logs are not a place for it).
MOUNT_CHECK = r"""
import errno, hashlib, json, os, sys
paths = json.loads(sys.argv[1])
facts = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "files": {}, "write": {}}
for path in paths["files"]:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        facts["files"][path] = {"mode": st.st_mode & 0o7777, "uid": st.st_uid, "gid": st.st_gid, "sha256": digest}
    except OSError as e:
        facts["files"][path] = {"error": errno.errorcode.get(e.errno, str(e.errno))}
for d in paths["dirs"]:
    try:
        with open(os.path.join(d, ".mount-check"), "w") as f:
            f.write("x")
        os.unlink(os.path.join(d, ".mount-check"))
        facts["write"][d] = "ok"
    except OSError as e:
        facts["write"][d] = errno.errorcode.get(e.errno, str(e.errno))
os.makedirs(paths["export_parent"], exist_ok=True)
with open(os.path.join(paths["export_parent"], "written-in-pod"), "w") as f:
    f.write(str(os.getuid()))
facts["env"] = dict(os.environ)
with open("/proc/1/cmdline", "rb") as f:
    facts["cmdline"] = f.read().decode(errors="replace")
with open("/proc/self/mounts") as f:
    table = {line.split()[1]: line.split()[3].split(",")[0] for line in f}
facts["mounts"] = {d: table.get(os.path.realpath(d)) for d in paths["dirs"]}  # /var/run -> /run in the image
print(json.dumps(facts))
"""


def _host_volume(core, ns: str, claim: str, root: Path, files: dict[str, str], owner: int | None = None) -> str:
    """A hostPath PersistentVolume on `root` holding `files`, pre-bound to the claim `claim` of `ns`."""
    root.mkdir(parents=True)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
        if owner is not None:
            os.chown(p, owner, owner)
    pv = f"{ns}-{claim}"
    core.create_persistent_volume({"metadata": {"name": pv}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
        "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(root), "type": "Directory"},
        "claimRef": {"namespace": ns, "name": claim}}})
    core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": claim}, "spec": {
        "accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
        "resources": {"requests": {"storage": "1Gi"}}}})
    return pv


def _admit(cluster, namespace: str, doc: dict[str, Any], objs: list[dict[str, Any]]) -> None:
    """What the API server accepts: the MegatronJob (CRD schema + CEL), the rendered JobSet (server-side dry
    run: the JobSet controller would otherwise start it on the kwok nodes), the job's identity (created)."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    custom = kubernetes.client.CustomObjectsApi(cluster.api_client())
    rbac = kubernetes.client.RbacAuthorizationV1Api(cluster.api_client())
    custom.create_namespaced_custom_object("megatron-operator.io", "v1alpha1", namespace, "megatronjobs", doc,
                                           dry_run="All")
    jobset = next(o for o in objs if o["kind"] == "JobSet")
    group, version = jobset["apiVersion"].split("/")
    custom.create_namespaced_custom_object(group, version, namespace, "jobsets", jobset, dry_run="All")
    for o in objs:
        if o["kind"] == "ServiceAccount":
            core.create_namespaced_service_account(namespace, o)
        elif o["kind"] == "Role":
            rbac.create_namespaced_role(namespace, o)
        elif o["kind"] == "RoleBinding":
            rbac.create_namespaced_role_binding(namespace, o)


def _mount_check(cluster, core, node: dict[str, Any], namespace: str, image: str, jobset: dict[str, Any],
                 files: list[str], dirs: list[str], export_parent: str) -> tuple[dict[str, Any], Any]:
    """MOUNT_CHECK in the JobSet's rendered pod template, on the real node (its securityContext, env and
    volumes as rendered; only image, command, GPU limit and placement swapped for a node without GPUs):
    (what it saw, the finished pod). The pod is deleted afterwards."""
    template = copy.deepcopy(jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
    pod_spec = template["spec"]
    container = pod_spec["containers"][0]
    container.update(image=image, imagePullPolicy="Never", command=["python", "-c", MOUNT_CHECK, json.dumps(
        {"files": files, "dirs": dirs, "export_parent": export_parent})])
    del container["resources"]["limits"]["nvidia.com/gpu"]  # the real node has no GPU (kwok's have)
    pod_spec["nodeSelector"] = {"megatron-operator.io/real-node": "true"}
    pod_spec["tolerations"] = [*pod_spec.get("tolerations", []),
                               {"key": real_node.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
    labels = {**template["metadata"]["labels"], "jobset.sigs.k8s.io/job-global-index": "0",
              "jobset.sigs.k8s.io/restart-attempt": "0"}
    try:
        pod = core.create_namespaced_pod(namespace, {"metadata": {"name": "mounts-check", "labels": labels},
                                                     "spec": pod_spec})
        assert pod.spec.node_name in (None, node["node"])
        done = cluster.wait_for(
            lambda: (p := core.read_namespaced_pod("mounts-check", namespace)).status.phase in ("Succeeded", "Failed")
            and p, MOUNT_CHECK_TIMEOUT_S, "the mount check pod to finish", namespace=namespace)
        # the API server cannot reach this kubelet's log endpoint by node name (no DNS for it): the CRI log file
        log = "".join(line.split(" ", 3)[3] for f in sorted((real_node.node_dir() / "pod-logs").glob(
            f"{namespace}_mounts-check_*/trainer/*.log")) for line in f.read_text().splitlines(keepends=True))
        assert done.status.phase == "Succeeded", f"{done.status}\n{log[-3000:]}"
        assert done.spec.node_name == node["node"]
        return json.loads(log.strip().splitlines()[-1]), done
    finally:
        with contextlib.suppress(kubernetes.client.ApiException):
            core.delete_namespaced_pod("mounts-check", namespace, grace_period_seconds=0)


def test_rendered_trainer_volumes_mount_on_a_real_kubelet(cluster, crd, node, image, namespace, tmp_path):
    """The operator's render of a job with an SFT data PVC, HF init and export PVCs and an object-store
    credentials Secret: the API server takes the MegatronJob and the JobSet (server-side dry run) and
    the job's ServiceAccount/Role/RoleBinding; the real kubelet mounts the rendered volumes into the
    rendered container (its securityContext, env and mounts; only image, command, GPU limit and
    placement swapped for a node without GPUs): files at the flags' paths, read-only where rendered
    so, the credentials file 0440 for the fsGroup, the export PVC writable by the trainer's uid, and
    no credential in the pod spec, its env or its command line."""
    from megatron_operator.render import render
    from megatron_operator.settings import Settings
    from megatron_operator.validation import parse_job

    core = kubernetes.client.CoreV1Api(cluster.api_client())
    access, secret = "AKIA" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30)
    credentials = f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n"
    doc = {"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
           "metadata": {"name": "mounts", "namespace": namespace}, "spec": {
               "numNodes": 1, "gpusPerNode": 1,
               "model": {"numLayers": 2, "hiddenSize": 64, "numAttentionHeads": 4, "numQueryGroups": 2,
                         "seqLength": 32, "vocabSize": 128, "activation": "swiglu", "normalization": "RMSNorm",
                         "positionEmbedding": "rope", "addBiasLinear": False},
               "training": {"microBatchSize": 1, "globalBatchSize": 1, "trainIters": 2},
               "data": {"pvc": "sft-data", "format": "chat", "sft": {"train": "sft/train.jsonl"}},
               "init": {"huggingFace": {"pvc": "models", "path": "llama/tiny"}},
               "export": {"huggingFace": {"pvc": "exports", "path": "ft/tiny"}},
               "checkpoint": {"objectStore": {"bucket": "ckpt-bucket", "endpoint": "http://127.0.0.1:9",
                                              "region": "us-east-1", "credentialsSecret": "s3-creds"}}}}
    objs = render(parse_job(doc), Settings())
    jobset = next(o for o in objs if o["kind"] == "JobSet")
    args = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    train, hf_init, hf_export = flag("--sft-train-path"), flag("--hf-init"), flag("--hf-export")
    assert (train, hf_init, hf_export) == ("/data/sft/train.jsonl", "/hf-init/llama/tiny", "/hf-export/ft/tiny")

    _admit(cluster, namespace, doc, objs)

    core.create_namespaced_secret(namespace, {"metadata": {"name": "s3-creds"}, "stringData": {
        "credentials": credentials}})
    chat = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    volumes = {"sft-data": _host_volume(core, namespace, "sft-data", tmp_path / "data", {"sft/train.jsonl": chat}),
               "models": _host_volume(core, namespace, "models", tmp_path / "models",
                                      {"llama/tiny/config.json": '{"model_type": "llama"}\n'}),
               # the export PVC's directory belongs to the trainer's uid, as an RWX share provisioned for it
               "exports": _host_volume(core, namespace, "exports", tmp_path / "exports", {}, owner=1000)}
    try:
        cluster.wait_for(lambda: all(core.read_namespaced_persistent_volume_claim(c, namespace).status.phase
                                     == "Bound" for c in volumes), 60, "the PVCs to bind", namespace=namespace)
        files = [train, f"{hf_init}/config.json", f"{CREDENTIALS_DIR}/credentials"]
        dirs = ["/data", "/hf-init", "/hf-export", CREDENTIALS_DIR, "/tmp", "/dev/shm", "/"]
        facts, done = _mount_check(cluster, core, node, namespace, image, jobset, files, dirs,
                                   os.path.dirname(hf_export))
    finally:
        for pv in volumes.values():
            with contextlib.suppress(kubernetes.client.ApiException):
                core.delete_persistent_volume(pv)

    # the trainer's identity, as rendered
    assert (facts["uid"], facts["gid"]) == (1000, 1000) and 1000 in facts["groups"]
    # files at the paths the rendered flags name, with the content put on the volumes
    sha = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in
           {train: chat, f"{hf_init}/config.json": '{"model_type": "llama"}\n',
            f"{CREDENTIALS_DIR}/credentials": credentials}.items()}
    for path, digest in sha.items():
        assert facts["files"][path].get("sha256") == digest, (path, facts["files"][path])
    # the credentials: one key of the Secret, 0440, group = the fsGroup (boto3 as uid 1000 read it above)
    cred = facts["files"][f"{CREDENTIALS_DIR}/credentials"]
    assert (cred["mode"], cred["gid"]) == (0o440, 1000), cred
    # read-only where rendered so, writable where the trainer writes
    assert facts["write"]["/data"] == facts["write"]["/hf-init"] == facts["write"][CREDENTIALS_DIR] == "EROFS", \
        facts["write"]
    assert facts["mounts"]["/data"] == facts["mounts"]["/hf-init"] == facts["mounts"][CREDENTIALS_DIR] == "ro"
    assert facts["mounts"]["/hf-export"] == "rw" and facts["write"]["/hf-export"] == "ok"
    assert facts["write"]["/tmp"] == facts["write"]["/dev/shm"] == "ok"
    assert facts["write"]["/"] in ("EROFS", "EACCES")  # readOnlyRootFilesystem (and not root)
    written = tmp_path / "exports" / "ft" / "written-in-pod"
    assert written.read_text() == "1000" and written.stat().st_uid == 1000  # on the PVC, as the trainer's uid
    # no credential anywhere but the file: not in the pod (as the API server stores it), env or command
    stored = json.dumps(kubernetes.client.ApiClient().sanitize_for_serialization(done))
    for value in (secret, access):
        assert value not in stored and value not in json.dumps(facts["env"]) and value not in facts["cmdline"]
    assert facts["env"]["AWS_SHARED_CREDENTIALS_FILE"] == f"{CREDENTIALS_DIR}/credentials"


def test_one_pvc_for_hf_init_and_export_mounts_twice_on_a_real_kubelet(cluster, crd, node, image, namespace,
                                                                         tmp_path):
    """Issue 52 (left from issue 32): the usual layout, a model PVC holding the source and, beside it, the
    export (spec.init and spec.export on one claim), with the fine-tuning tokenizer taken from the source
    (no spec.data.tokenizer) and checkpoints on a PVC. The render gives that claim one pod volume mounted twice,
    read-only at /hf-init and writable at /hf-export; the real kubelet must mount both from the one volume: the source
    and its tokenizer readable at the flags' paths, /hf-init refusing writes, and a file written under
    /hf-export landing beside the source on the volume, as the trainer's uid."""
    from megatron_operator.render import render
    from megatron_operator.settings import Settings
    from megatron_operator.validation import parse_job

    core = kubernetes.client.CoreV1Api(cluster.api_client())
    doc = {"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
           "metadata": {"name": "one-pvc", "namespace": namespace}, "spec": {
               "numNodes": 1, "gpusPerNode": 1,
               "model": {"numLayers": 2, "hiddenSize": 64, "numAttentionHeads": 4, "numQueryGroups": 2,
                         "seqLength": 32, "vocabSize": 128, "activation": "swiglu", "normalization": "RMSNorm",
                         "positionEmbedding": "rope", "addBiasLinear": False},
               "training": {"microBatchSize": 1, "globalBatchSize": 1, "trainIters": 2},
               "data": {"pvc": "sft-data", "format": "chat", "sft": {"train": "sft/train.jsonl", "packing": False}},
               "init": {"huggingFace": {"pvc": "models", "path": "llama/tiny"}},
               "export": {"huggingFace": {"pvc": "models", "path": "exports/tiny-ft"}},
               "checkpoint": {"pvc": "ckpt"}}}
    objs = render(parse_job(doc), Settings())
    jobset = next(o for o in objs if o["kind"] == "JobSet")
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    args = pod_spec["containers"][0]["command"]

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    assert (flag("--hf-init"), flag("--hf-export"), flag("--tokenizer-model")) == \
        ("/hf-init/llama/tiny", "/hf-export/exports/tiny-ft", "/hf-init/llama/tiny")
    claims = {v["name"]: (v["persistentVolumeClaim"]["claimName"], v["persistentVolumeClaim"].get("readOnly", False))
              for v in pod_spec["volumes"] if "persistentVolumeClaim" in v}
    # one pod volume per claim (kube-scheduler counts a claim named by two volumes twice: render.py
    # _one_volume_per_claim), writable because the export writes through it; each mount keeps its own readOnly
    assert claims == {"hf-init": ("models", False), "data": ("sft-data", True), "checkpoints": ("ckpt", False)}, claims
    mounts = {m["mountPath"]: (m["name"], m.get("readOnly", False)) for m in pod_spec["containers"][0]["volumeMounts"]}
    assert mounts["/hf-init"] == ("hf-init", True) and mounts["/hf-export"] == ("hf-init", False), mounts

    _admit(cluster, namespace, doc, objs)

    chat = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    source = {"llama/tiny/config.json": '{"model_type": "llama"}\n',
              "llama/tiny/tokenizer_config.json": '{"eos_token": "</s>"}\n'}
    volumes = {"sft-data": _host_volume(core, namespace, "sft-data", tmp_path / "data", {"sft/train.jsonl": chat}),
               # the model PVC's directory belongs to the trainer's uid: the export is written beside the source
               "models": _host_volume(core, namespace, "models", tmp_path / "models", source, owner=1000),
               "ckpt": _host_volume(core, namespace, "ckpt", tmp_path / "ckpt", {}, owner=1000)}
    try:
        cluster.wait_for(lambda: all(core.read_namespaced_persistent_volume_claim(c, namespace).status.phase
                                     == "Bound" for c in volumes), 60, "the PVCs to bind", namespace=namespace)
        files = [flag("--sft-train-path"), *(f"/hf-init/{rel}" for rel in source)]
        dirs = ["/data", "/hf-init", "/hf-export", "/checkpoints", "/tmp", "/"]
        facts, done = _mount_check(cluster, core, node, namespace, image, jobset, files, dirs,
                                   os.path.dirname(flag("--hf-export")))
    finally:
        for pv in volumes.values():
            with contextlib.suppress(kubernetes.client.ApiException):
                core.delete_persistent_volume(pv)

    assert (facts["uid"], facts["gid"]) == (1000, 1000)
    for rel, text in source.items():  # the source and its tokenizer, read through the read-only mount
        assert facts["files"][f"/hf-init/{rel}"].get("sha256") == hashlib.sha256(text.encode()).hexdigest(), rel
    assert facts["files"][flag("--sft-train-path")].get("sha256") == hashlib.sha256(chat.encode()).hexdigest()
    # one claim, two mounts: read-only at /hf-init, writable at /hf-export
    assert facts["mounts"]["/hf-init"] == "ro" and facts["write"]["/hf-init"] == "EROFS", facts
    assert facts["mounts"]["/hf-export"] == "rw" and facts["write"]["/hf-export"] == "ok", facts
    assert facts["mounts"]["/data"] == "ro" and facts["write"]["/data"] == "EROFS"
    assert facts["mounts"]["/checkpoints"] == "rw" and facts["write"]["/checkpoints"] == "ok"
    assert facts["write"]["/"] in ("EROFS", "EACCES")
    # what was written through /hf-export is on the same volume, beside the (untouched) source
    written = tmp_path / "models" / "exports" / "written-in-pod"
    assert written.read_text() == "1000" and written.stat().st_uid == 1000
    assert sorted(p.relative_to(tmp_path / "models").as_posix() for p in (tmp_path / "models").rglob("*")
                  if p.is_file()) == sorted([*source, "exports/written-in-pod"])
    assert done.spec.node_name == node["node"]


# ---------------------------------------------------------------------------------------------------
# Issue 53: spec.pod (extra volumes, an init container, native sidecars) through the whole chain on the
# real kubelet: MegatronJob -> operator -> JobSet -> Job -> pod -> Succeeded.
# ---------------------------------------------------------------------------------------------------
POD_JOB_TIMEOUT_S = 240
# The trainer image is not on the node (5 GB, and no GPU): the job runs the operator image, and spec.pod itself
# puts a stand-in `megatron_trainer.launch` on the trainer's PYTHONPATH from a ConfigMap volume, so the command
# the operator renders runs unchanged. It checks what the issue asks a job with extras to see, writes it to the
# PVC, and exits 0 (or 1, with the reason, when something is missing).
STUB_LAUNCH = r"""
import json, os, sys, time
facts = {"uid": os.getuid(), "argv": sys.argv[1:4]}
def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        return f"<{e.strerror}>"
facts["from_init"] = read("/scratch/from-init")
facts["tracker_key"] = read("/var/run/secrets/tracker/key")
facts["dataset"] = read("/mnt/datasets/input.txt")
facts["token"] = os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token")
deadline = time.monotonic() + 30
while not os.path.exists("/shared/sidecar-alive") and time.monotonic() < deadline:
    time.sleep(0.5)
facts["sidecar_seen"] = os.path.exists("/shared/sidecar-alive")
facts["env_has_key"] = any("tracker-key-" in v for v in os.environ.values())
time.sleep(float(os.environ.get("STUB_RUN_S", "0")))
with open("/mnt/datasets/result.json", "w") as f:
    json.dump(facts, f)
ok = facts["from_init"] == "written by init\n" and facts["sidecar_seen"] and facts["dataset"] == "rows\n"
sys.exit(0 if ok else 1)
"""
SIDECAR_OK = ("import os, time, pathlib\n"
              "pathlib.Path('/shared/sidecar-alive').write_text(str(os.getpid()))\n"
              "while True:\n    time.sleep(1)\n")
# starts (the trainer sees it), then exits 3 every few seconds: the kubelet restarts it, and its exits must never
# fail the trainer's pod or the job
SIDECAR_CRASH = ("import pathlib, sys, time\n"
                 "pathlib.Path('/shared/sidecar-alive').write_text('crashy')\n"
                 "time.sleep(3)\nsys.exit(3)\n")


@contextlib.contextmanager
def _gpus_on(core, node_name: str):
    """The real node advertises one nvidia.com/gpu (an extended resource in the node's status, as Kubernetes'
    'advertise extended resources' does; no device plugin): the rendered pod keeps its GPU limit."""
    core.patch_node_status(node_name, {"status": {"capacity": {"nvidia.com/gpu": "1"}}})
    try:
        yield
    finally:
        core.patch_node_status(node_name, {"status": {"capacity": {"nvidia.com/gpu": None}}})


def _pod_job(name: str, image_ref: str, sidecar: str, run_s: int) -> dict[str, Any]:
    py = ["python", "-c"]
    return {"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob", "metadata": {"name": name},
            "spec": {
                "image": image_ref, "numNodes": 1, "gpusPerNode": 1,
                "model": {"numLayers": 2, "hiddenSize": 64, "numAttentionHeads": 4, "seqLength": 32,
                          "vocabSize": 128},
                "training": {"microBatchSize": 1, "globalBatchSize": 1, "trainIters": 2},
                "terminationGracePeriodSeconds": 30,
                "env": [{"name": "PYTHONPATH", "value": "/opt/stub"}, {"name": "STUB_RUN_S", "value": str(run_s)}],
                "resources": {"nodeSelector": {"megatron-operator.io/real-node": "true"},
                              "tolerations": [{"key": real_node.TAINT_KEY, "operator": "Exists",
                                               "effect": "NoSchedule"}]},
                "pod": {
                    "volumes": [
                        {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets"}},
                        {"name": "tracker", "secret": {"secretName": "tracker", "defaultMode": 0o440,
                                                       "items": [{"key": "api-key", "path": "key"}]}},
                        {"name": "stub", "configMap": {"name": "stub-trainer", "items": [
                            {"key": "init", "path": "megatron_trainer/__init__.py"},
                            {"key": "launch", "path": "megatron_trainer/launch.py"}]}},
                        {"name": "scratch", "emptyDir": {}},
                        {"name": "shared", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
                    "volumeMounts": [
                        {"name": "datasets", "mountPath": "/mnt/datasets"},
                        {"name": "tracker", "mountPath": "/var/run/secrets/tracker", "readOnly": True},
                        {"name": "stub", "mountPath": "/opt/stub", "readOnly": True},
                        {"name": "scratch", "mountPath": "/scratch"},
                        {"name": "shared", "mountPath": "/shared"}],
                    "initContainers": [
                        {"name": "prefetch", "image": image_ref, "command": [
                            *py, "open('/scratch/from-init', 'w').write('written by init\\n')"],
                         "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
                        {"name": "logs", "image": image_ref, "restartPolicy": "Always", "command": [*py, sidecar],
                         "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}]}}}


def _run_pod_job(cluster, node, image, namespace, tmp_path, name: str, sidecar: str, run_s: int):
    """Create the PVC, Secret and ConfigMap, run the job on the real node to a finished phase: (job, result.json)."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    jobs = Jobs(cluster, namespace)
    key = "tracker-key-" + secrets.token_hex(8)
    core.create_namespaced_secret(namespace, {"metadata": {"name": "tracker"}, "stringData": {"api-key": key}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "stub-trainer"},
                                                  "data": {"init": "", "launch": STUB_LAUNCH}})
    pv = _host_volume(core, namespace, "datasets", tmp_path / "datasets", {"input.txt": "rows\n"}, owner=1000)
    try:
        cluster.wait_for(lambda: core.read_namespaced_persistent_volume_claim("datasets", namespace).status.phase
                         == "Bound", 60, "the PVC to bind", namespace=namespace)
        with _gpus_on(core, node["node"]):
            jobs.create(_pod_job(name, image, sidecar, run_s))
            try:
                done = jobs.wait_phase(name, ("Succeeded", "Failed"), timeout=POD_JOB_TIMEOUT_S)
            finally:
                logs = sorted((real_node.node_dir() / "pod-logs").glob(f"{namespace}_*/*/*.log"))
                (cluster.logs_dir / f"pod-job-{name}.log").write_text(
                    "".join(f"===== {f}\n{f.read_text(errors='replace')}" for f in logs))
        result = tmp_path / "datasets" / "result.json"
        facts = json.loads(result.read_text()) if result.exists() else {}
        return jobs, done, facts, key
    finally:
        with contextlib.suppress(kubernetes.client.ApiException):
            core.delete_persistent_volume(pv)


def test_a_job_with_a_pvc_a_secret_an_init_container_and_a_sidecar_runs_to_completion(
        cluster, crd, operator, node, image, namespace, tmp_path):
    """Issue 53: the operator's JobSet for a job with spec.pod runs on the real kubelet: the init container
    writes a file the trainer reads, the sidecar runs beside the trainer (and never exits by itself), the
    trainer reads the dataset PVC and the Secret file, and the job is Succeeded when the trainer exits: the
    kubelet stops the sidecar, it does not hold the job."""
    jobs, done, facts, key = _run_pod_job(cluster, node, image, namespace, tmp_path, "extras", SIDECAR_OK, 0)
    assert done["phase"] == "Succeeded", (done, facts)
    assert facts["from_init"] == "written by init\n" and facts["sidecar_seen"] and facts["dataset"] == "rows\n"
    assert facts["tracker_key"] == key and not facts["env_has_key"]  # by file, never in the environment
    assert facts["uid"] == 1000 and facts["token"]  # the trainer keeps its own token (status.progress)
    assert facts["argv"][0].startswith("--nnodes=1")  # the operator's launcher command line, as rendered
    pod = jobs.pods("extras")[0]
    assert pod.spec.node_name == node["node"] and pod.status.phase == "Succeeded"
    assert pod.spec.automount_service_account_token is False  # only the trainer container has the token
    sidecar = next(s for s in pod.status.init_container_statuses if s.name == "logs")
    assert sidecar.restart_count == 0 and sidecar.state.terminated is not None  # stopped by the kubelet at the end
    assert not [c for c in done.get("conditions", []) if c["type"] == "SidecarWarning"]
    assert key not in json.dumps(kubernetes.client.ApiClient().sanitize_for_serialization(pod))


def test_a_crashing_sidecar_leaves_the_job_succeeded_with_a_warning(cluster, crd, operator, node, image, namespace,
                                                                   tmp_path):
    """Issue 53: a sidecar that keeps exiting 3 is restarted by the kubelet; the trainer finishes and the job is
    Succeeded (a sidecar's exit is never the trainer's failure), with condition SidecarWarning naming it."""
    jobs, done, facts, _ = _run_pod_job(cluster, node, image, namespace, tmp_path, "crashy", SIDECAR_CRASH, 20)
    assert done["phase"] == "Succeeded", (done, facts)
    assert facts.get("from_init") == "written by init\n"
    pod = jobs.pods("crashy")[0]
    sidecar = next(s for s in pod.status.init_container_statuses if s.name == "logs")
    assert sidecar.restart_count >= 1, sidecar

    def warned() -> dict[str, Any] | None:
        conds = {c["type"]: c for c in jobs.status("crashy").get("conditions", [])}
        return conds.get("SidecarWarning")

    cond = cluster.wait_for(warned, 30, "the SidecarWarning condition", namespace=namespace)
    assert cond["status"] == "True" and cond["reason"] == "SidecarRestarted", cond
    assert "sidecar logs restarted" in cond["message"] and "exit code 3" in cond["message"], cond
    assert jobs.phase("crashy") == "Succeeded"
    assert "lastFailure" not in jobs.status("crashy")
