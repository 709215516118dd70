#!/usr/bin/env python3
"""A real local Kubernetes control plane for the e2e tests, on 127.0.0.1, without Docker or internet.

    cluster.py build    build/cache etcd, kube-*, kubectl, kwok(ctl), jobset, kueue, helm (build.sh)
    cluster.py build helm promtool versitygw   only what the unit tests need
    cluster.py up       start the cluster (kwokctl binary runtime) + GPU nodes + JobSet + Kueue
    cluster.py status   exit 0 when the cluster in the run dir answers and JobSet and Kueue are ready
    cluster.py env      print `export KUBECONFIG=...` lines for a shell (eval "$(cluster.py env)")
    cluster.py down     stop everything started by `up` and check that no process is left

Real components only: etcd, kube-apiserver, kube-controller-manager and kube-scheduler are started
by kwokctl's *binary* runtime from the locally built binaries (nothing is downloaded; `up` checks
kwokctl's dry run for URLs). kwok fakes the kubelets: GPU/EFA nodes and pod lifecycles (stages).
The JobSet and Kueue controllers run as host processes with their webhooks on loopback.

Run state lives in $MEGATRON_OPERATOR_RUN (default /tmp/megatron-operator-e2e), outside the repo.
See docs/local-cluster.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
CLUSTER_NAME = "e2e"
FIELD_MANAGER = "megatron-e2e-cluster"

# Pods run this long (uniformly between the two, ms) before kwok completes them. Override per pod
# with the annotations in POD_RUN_ANNOTATIONS (both of them: kwok uses the jitter value alone when
# it is not larger than the delay).
POD_RUN_MIN_MS = 5000
POD_RUN_MAX_MS = 10000
POD_RUN_ANNOTATIONS = (
    "pod-complete.stage.kwok.x-k8s.io/delay",
    "pod-complete.stage.kwok.x-k8s.io/jitter-delay",
)
# Label a Running pod with this (value "true") and kwok fails it; exit code etc. via annotations.
POD_FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_FAIL_EXIT_CODE_ANNOTATION = "pod-container-running-failed.stage.kwok.x-k8s.io/exit-code"

# Label a node with this ("true") and kwok stops its heartbeats and never sets it Ready again: set its
# Ready condition False and kube-controller-manager's node lifecycle controller taints it as for a dead
# kubelet (not-ready NoSchedule and NoExecute). Remove the label and set Ready True to revive it.
NODE_FAILED_LABEL = "e2e.megatron-operator.io/node-failed"

# The rack of each node (4 nodes per rack and pool): a topology level for Kueue's TAS tests.
RACK_LABEL = "e2e.megatron-operator.io/rack"

_CHILDREN: list[subprocess.Popen] = []
PORTS_LOCK = Path(tempfile.gettempdir()) / "megatron-operator-e2e-ports.lock"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
H100 = "NVIDIA-H100-80GB-HBM3"


@dataclass(frozen=True)
class NodePool:
    """A group of identical fake nodes."""

    prefix: str
    count: int
    instance_type: str
    gpus: int
    efa: int
    cpu: int
    memory_gi: int
    pods: int = 250


NODE_POOLS = (
    NodePool("gpu-p5", 16, "p5.48xlarge", gpus=8, efa=32, cpu=192, memory_gi=2048),
    # p5.4xlarge: AWS's 1x H100 size (no EFA). There is no AWS 2-GPU H100 size; the 2-GPU pool is
    # a deliberately synthetic type for packing/fit tests.
    NodePool("gpu-1x", 2, "p5.4xlarge", gpus=1, efa=0, cpu=16, memory_gi=256),
    NodePool("gpu-2x", 2, "kwok-2xh100", gpus=2, efa=0, cpu=32, memory_gi=512),
)

# kwok Stage YAML shipped in the kwok module zip, relative to kustomize/stage/. Supplying any Stage
# drops kwok's defaults, so every lifecycle step we need is listed here.
STAGE_FILES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/general/pod-complete.yaml",  # delay/jitter, overridable per pod by annotation
    "pod/general/pod-delete.yaml",  # deletes once no finalizer is left (Job pods carry job-tracking)
    "pod/chaos/pod-container-running-failed.yaml",
    "pod/chaos/pod-init-container-running-failed.yaml",
)


class ClusterError(RuntimeError):
    """The cluster could not be built, started or stopped; the message says what to look at."""


class ProcessExited(ClusterError):
    """A process we wait for died: waiting longer cannot help."""


def log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Versions, binaries, paths


def versions() -> dict[str, str]:
    out = {}
    for line in (HERE / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def cache_dir() -> Path:
    if os.environ.get("MEGATRON_OPERATOR_CACHE"):
        return Path(os.environ["MEGATRON_OPERATOR_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "megatron-operator"


def run_dir() -> Path:
    return Path(os.environ.get("MEGATRON_OPERATOR_RUN", "/tmp/megatron-operator-e2e"))


def binaries() -> dict[str, Path]:
    v = versions()
    bin_root = cache_dir() / "bin"
    kube = bin_root / f"kubernetes-{v['KUBE_VERSION']}"
    kwok = bin_root / f"kwok-{v['KWOK_VERSION']}"
    return {
        "etcd": bin_root / f"etcd-{v['ETCD_VERSION']}" / "etcd",
        "kube-apiserver": kube / "kube-apiserver",
        "kube-controller-manager": kube / "kube-controller-manager",
        "kube-scheduler": kube / "kube-scheduler",
        "kubectl": kube / "kubectl",
        "kwok": kwok / "kwok",
        "kwokctl": kwok / "kwokctl",
        "jobset": bin_root / f"jobset-{v['JOBSET_VERSION']}" / "jobset",
        "kueue": bin_root / f"kueue-{v['KUEUE_VERSION']}" / "kueue",
    }


def helm_binary() -> Path:
    return cache_dir() / "bin" / f"helm-{versions()['HELM_VERSION']}" / "helm"


def module_dir(module: str, version: str) -> Path:
    """The extracted module zip in build.sh's GOMODCACHE (downloads it through the proxy if absent)."""
    gomodcache = cache_dir() / "gomod"
    path = gomodcache / f"{module}@{version}"
    if path.is_dir():
        return path
    env = dict(os.environ, GOMODCACHE=str(gomodcache), GOFLAGS="-mod=mod", GOTOOLCHAIN="local")
    proc = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise ClusterError(f"go mod download {module}@{version} failed:\n{proc.stdout}{proc.stderr}")
    return Path(json.loads(proc.stdout)["Dir"])


@dataclass(frozen=True)
class RunPaths:
    """Everything `up` writes. Only `down` removes it (logs/ survives for post-mortems)."""

    root: Path

    @property
    def kwok_workdir(self) -> Path:
        return self.root / "kwok"

    @property
    def kwok_cluster(self) -> Path:
        return self.kwok_workdir / "clusters" / CLUSTER_NAME

    @property
    def pki(self) -> Path:
        return self.kwok_cluster / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def state(self) -> Path:
        return self.root / "cluster.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def jobset_dir(self) -> Path:
        return self.root / "jobset"

    @property
    def kueue_dir(self) -> Path:
        return self.root / "kueue"

    @property
    def lock(self) -> Path:
        return self.root.with_name(self.root.name + ".lock")

    def log_files(self) -> dict[str, Path]:
        """Component name -> log file (kwokctl's components, the JobSet and Kueue controllers)."""
        out = {}
        for directory in (self.kwok_cluster / "logs", self.logs):
            if directory.is_dir():
                for f in sorted(directory.glob("*.log")):
                    out.setdefault(f.stem, f)
        return out


def paths() -> RunPaths:
    return RunPaths(run_dir())


# ---------------------------------------------------------------------------------------------
# Small process / network helpers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    cmd: list[str], *, timeout: float, env: dict | None = None, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            [str(c) for c in cmd],
            check=False,
            env=env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"timed out after {timeout} s: {' '.join(map(str, cmd))}") from e
    if check and proc.returncode != 0:
        raise ClusterError(
            f"command failed (rc={proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        )
    return proc


def kubectl(
    p: RunPaths, *args: str, timeout: float = 60, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    return run(
        [
            binaries()["kubectl"],
            f"--kubeconfig={p.kubeconfig}",
            f"--cache-dir={p.root / 'kubectl-cache'}",
            *args,
        ],
        timeout=timeout,
        input=input,
        check=check,
    )


def apply(p: RunPaths, objects: list[dict], timeout: float = 60) -> None:
    doc = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    kubectl(
        p,
        "apply",
        "--server-side",
        "--force-conflicts",
        f"--field-manager={FIELD_MANAGER}",
        "-f",
        "-",
        input=doc,
        timeout=timeout,
    )


def wait_until(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll predicate() until it returns a truthy value; ClusterError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as e:  # keep polling, report the last error on timeout
            last_error = e
        if time.monotonic() > deadline:
            raise ClusterError(
                f"timed out after {timeout} s waiting for {what}"
                + (f"; last error: {last_error}" if last_error else "")
            )
        time.sleep(interval)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited child not reaped yet) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def our_processes(p: RunPaths) -> dict[int, str]:
    """Processes `up` started: kwokctl's components (run from the cluster's bin/ links), JobSet, Kueue.

    Matched on the executable and our config path, so a developer's `kubectl --kubeconfig <run dir>/...`
    is never mistaken for one of ours.
    """
    component_prefix = f"{p.kwok_cluster / 'bin'}/"
    configs = {f"--config={p.jobset_dir / 'config.yaml'}", f"--config={p.kueue_dir / 'config.yaml'}"}
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        args = argv(pid)
        if args and (args[0].startswith(component_prefix) or configs & set(args)) and pid_alive(pid):
            out[pid] = " ".join(args)
    return out


def stop_pid(pid: int, expect_in_cmdline: str, grace_s: float = 10) -> None:
    """SIGTERM then SIGKILL one process, only if its command line still is what we started."""
    if not pid_alive(pid) or expect_in_cmdline not in cmdline(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    with contextlib.suppress(ChildProcessError):  # reap it if it is our child (started by up() in-process)
        os.waitpid(pid, os.WNOHANG)


@contextlib.contextmanager
def locked(path: Path, timeout_s: float = 300):
    """An exclusive flock on `path`, waited for at most `timeout_s`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{path} still locked after {timeout_s} s (another up/down running?)"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Objects the cluster is populated with


def gpu_nodes() -> list[dict]:
    nodes = []
    index = 0
    for pool in NODE_POOLS:
        for i in range(pool.count):
            name = f"{pool.prefix}-{i:02d}"
            resources = {
                "cpu": str(pool.cpu),
                "memory": f"{pool.memory_gi}Gi",
                "pods": str(pool.pods),
                "ephemeral-storage": "7Ti",
                "nvidia.com/gpu": str(pool.gpus),
            }
            if pool.efa:
                resources["vpc.amazonaws.com/efa"] = str(pool.efa)
            nodes.append(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {
                        "name": name,
                        "annotations": {"kwok.x-k8s.io/node": "fake"},
                        "labels": {
                            "type": "kwok",
                            "kubernetes.io/hostname": name,
                            "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "node.kubernetes.io/instance-type": pool.instance_type,
                            "topology.kubernetes.io/zone": "local-a",
                            # racks of 4 nodes per pool, for Kueue's topology-aware scheduling
                            RACK_LABEL: f"{pool.prefix}-rack-{i // 4}",
                            "nvidia.com/gpu.present": "true",
                            "nvidia.com/gpu.product": H100,
                            "nvidia.com/gpu.count": str(pool.gpus),
                        },
                    },
                    "spec": {
                        "podCIDR": f"10.244.{index}.0/24",
                        "podCIDRs": [f"10.244.{index}.0/24"],
                        "taints": [GPU_TAINT],
                    },
                    "status": {
                        "capacity": resources,
                        "allocatable": resources,
                        # kwok's node-initialize keeps these; pods' hostIP comes from InternalIP.
                        "addresses": [
                            {"type": "InternalIP", "address": f"10.128.{index // 250}.{index % 250 + 1}"},
                            {"type": "Hostname", "address": name},
                        ],
                    },
                }
            )
            index += 1
    return nodes


# What a kubelet does when a pod is deleted while it runs: SIGTERM, the container exits (143), the pod
# turns Failed. Only then does the Job controller drop its batch.kubernetes.io/job-tracking finalizer
# and kwok's pod-delete stage can remove the pod; without this stage a Job pod deleted while Running
# (suspend, gang restart, namespace deletion) would stay Terminating for ever and hold its GPUs.
POD_TERMINATE_STAGE = {
    "apiVersion": "kwok.x-k8s.io/v1alpha1",
    "kind": "Stage",
    "metadata": {"name": "pod-terminate-on-delete"},
    "spec": {
        "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
        "selector": {"matchExpressions": [
            {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
            {"key": ".status.phase", "operator": "In", "values": ["Running", "Pending"]},
        ]},
        "weight": 10000,
        "delay": {"durationMilliseconds": 500},
        "next": {"statusTemplate": """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  type: ContainersReady
containerStatuses:
{{ range $index, $item := .spec.containers }}
- image: {{ $item.image | Quote }}
  name: {{ $item.name | Quote }}
  ready: false
  restartCount: 0
  started: false
  state:
    terminated:
      exitCode: 143
      finishedAt: {{ $now | Quote }}
      reason: Error
      message: terminated on pod deletion (SIGTERM)
      startedAt: {{ $now | Quote }}
{{ end }}
phase: Failed
"""},
    },
}


def kwok_stages() -> list[dict]:
    kwok_dir = module_dir("sigs.k8s.io/kwok", f"v{versions()['KWOK_VERSION']}")
    stages = []
    for rel in STAGE_FILES:
        stage = yaml.safe_load((kwok_dir / "kustomize" / "stage" / rel).read_text())
        if stage["metadata"]["name"] == "pod-complete":
            stage["spec"]["delay"]["durationMilliseconds"] = POD_RUN_MIN_MS
            stage["spec"]["delay"]["jitterDurationMilliseconds"] = POD_RUN_MAX_MS
        if stage["metadata"]["name"] in ("node-initialize", "node-heartbeat-with-lease"):
            # a node labelled NODE_FAILED_LABEL gets no more heartbeats and is not made Ready again:
            # its kubelet is gone (pods on it are still terminated on deletion, as by a shutdown)
            stage["spec"]["selector"]["matchExpressions"].append(
                {"key": f'.metadata.labels["{NODE_FAILED_LABEL}"]', "operator": "DoesNotExist"})
        if stage["metadata"]["name"] == "pod-delete":
            # delete soon after the finalizers are gone (the stock jitter runs up to the end of the
            # termination grace period, which the operator sets to minutes)
            stage["spec"]["delay"] = {"durationMilliseconds": 200}
        stages.append(stage)
    stages.append(POD_TERMINATE_STAGE)
    return stages


def kwokctl_config() -> list[dict]:
    b = binaries()
    v = versions()
    return [
        {
            "kind": "KwokctlConfiguration",
            "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
            "options": {
                "runtime": "binary",
                "kubeVersion": f"v{v['KUBE_VERSION']}",
                "etcdVersion": v["ETCD_VERSION"],
                "bindAddress": "127.0.0.1",
                "kubeApiserverBinary": str(b["kube-apiserver"]),
                "kubeControllerManagerBinary": str(b["kube-controller-manager"]),
                "kubeSchedulerBinary": str(b["kube-scheduler"]),
                "kubectlBinary": str(b["kubectl"]),
                "kwokControllerBinary": str(b["kwok"]),
                "etcdBinary": str(b["etcd"]),
                "securePort": True,
                "kubeAuthorization": True,
                "kubeAdmission": True,
                "disableQPSLimits": True,
            },
            # Test data need not survive a power cut: skip fsync (much faster etcd on a slow disk).
            "componentsPatches": [
                {"name": "etcd", "extraArgs": [{"key": "unsafe-no-fsync", "value": "true"}]},
                # One instance each, and no kubelet to restart them: with leader election on, an API
                # server restart makes them lose the lease and exit for good.
                {"name": "kube-controller-manager", "extraArgs": [{"key": "leader-elect", "value": "false"}]},
                {"name": "kube-scheduler", "extraArgs": [{"key": "leader-elect", "value": "false"}]},
                # As on most production clusters: setting blockOwnerDeletion needs update on the owner's
                # finalizers subresource (the chart's RBAC grants exactly that; e2e/test_helm.py proves it).
                {"name": "kube-apiserver", "extraArgs": [
                    {"key": "enable-admission-plugins", "value": "OwnerReferencesPermissionEnforcement"}]},
                # kwok fakes only its own nodes (annotated kwok.x-k8s.io/node=fake): a real kubelet's
                # node (e2e/cluster/node.py) and its pods are left to that kubelet.
                {"name": "kwok-controller", "extraArgs": [
                    {"key": "manage-all-nodes", "value": "false"},
                    {"key": "manage-nodes-with-annotation-selector", "value": "kwok.x-k8s.io/node=fake"}]},
            ],
        },
        *kwok_stages(),
    ]


def jobset_webhooks(port: int, ca_bundle: str) -> list[dict]:
    """JobSet's webhook registrations (config/components/webhook + patches) with url: instead of service:."""

    def hook(name: str, path: str, group: str, resource: str, ops: list[str], pods: bool) -> dict:
        h = {
            "name": name,
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "timeoutSeconds": 10,
            "rules": [
                {
                    "apiGroups": [group],
                    "apiVersions": ["v1alpha2" if group else "v1"],
                    "operations": ops,
                    "resources": [resource],
                }
            ],
        }
        if pods:
            h["objectSelector"] = {
                "matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]
            }
        return h

    g = "jobset.x-k8s.io"
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "jobset-mutating-webhook-configuration"},
            "webhooks": [
                hook(
                    "mjobset.kb.io",
                    "/mutate-jobset-x-k8s-io-v1alpha2-jobset",
                    g,
                    "jobsets",
                    ["CREATE"],
                    False,
                ),
                hook("mpod.kb.io", "/mutate--v1-pod", "", "pods", ["CREATE"], True),
            ],
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "jobset-validating-webhook-configuration"},
            "webhooks": [
                hook(
                    "vjobset.kb.io",
                    "/validate-jobset-x-k8s-io-v1alpha2-jobset",
                    g,
                    "jobsets",
                    ["CREATE", "UPDATE"],
                    False,
                ),
                hook("vpod.kb.io", "/validate--v1-pod", "", "pods", ["CREATE"], True),
            ],
        },
    ]


# Kueue: the frameworks it manages here, and the API groups whose webhooks it then serves (the
# manifests list webhooks for every framework; a registered path it does not serve would refuse every
# create of that kind, e.g. all pods).
KUEUE_FRAMEWORKS = ("jobset.x-k8s.io/jobset",)
KUEUE_WEBHOOK_GROUPS = ("kueue.x-k8s.io", "jobset.x-k8s.io")
# Kueue's CRDs served through its conversion webhook (config/components/crd/kustomization.yaml).
KUEUE_CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
# Without internal cert management Kueue (v0.15.2, v0.19.2) reads its metrics certificate from this fixed path at
# start-up and exits if it is missing (cmd/kueue/main.go), even with the metrics server off.
KUEUE_METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


def kueue_module() -> Path:
    return module_dir("sigs.k8s.io/kueue", f"v{versions()['KUEUE_VERSION']}")


def kueue_crds(port: int, ca_bundle: str) -> list[dict]:
    """Kueue's CRDs, the converted ones pointing at its webhook on loopback (url: instead of service:)."""
    crds = []
    for f in sorted((kueue_module() / "config/components/crd/bases").glob("*.yaml")):
        crd = yaml.safe_load(f.read_text())
        if crd["spec"]["names"]["plural"] in KUEUE_CONVERTED_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": f"https://127.0.0.1:{port}/convert", "caBundle": ca_bundle},
                    "conversionReviewVersions": ["v1"],
                },
            }
        crds.append(crd)
    return crds


def kueue_webhooks(port: int, ca_bundle: str) -> list[dict]:
    """Kueue's webhook registrations (config/components/webhook/manifests.yaml) for the groups it serves
    here, with url: instead of service:."""
    configs = []
    for doc in yaml.safe_load_all((kueue_module() / "config/components/webhook/manifests.yaml").read_text()):
        hooks = []
        for hook in doc["webhooks"]:
            if not all(g in KUEUE_WEBHOOK_GROUPS for r in hook["rules"] for g in r["apiGroups"]):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
            hook["timeoutSeconds"] = 10
            hooks.append(hook)
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}  # the install's namePrefix
        doc["webhooks"] = hooks
        configs.append(doc)
    return configs


# ---------------------------------------------------------------------------------------------
# up / down / status


def _kwok_env(p: RunPaths) -> dict:
    # KWOK_WORKDIR keeps kwokctl's state (and cache) in the run dir, not in ~/.kwok.
    return dict(os.environ, KWOK_WORKDIR=str(p.kwok_workdir))


def check_binaries() -> dict[str, Path]:
    b = binaries()
    missing = [str(path) for path in b.values() if not os.access(path, os.X_OK)]
    if missing:
        raise ClusterError(
            "binaries missing (run `e2e/cluster/cluster.py build` first):\n  " + "\n  ".join(missing)
        )
    return b


LOCAL_HOSTS = {"127.0.0.1", "localhost", "kubernetes.default.svc.cluster.local"}


def dry_run_downloads(p: RunPaths, config: Path) -> list[str]:
    """What kwokctl would fetch from the network: its dry run prints every step, including
    `# Download <src> to <dest>` (a plain path is only linked) and every URL it would use."""
    b = binaries()
    cmd = [
        b["kwokctl"],
        "-c",
        config,
        "--dry-run",
        "create",
        "cluster",
        "--name",
        CLUSTER_NAME,
        "--kubeconfig",
        "",
    ]
    out = run(cmd, env=_kwok_env(p), timeout=60).stdout
    remote = []
    for line in out.splitlines():
        if line.startswith("# Download ") and not line.split()[2].startswith("/"):
            remote.append(line)
        for url in re.findall(r"https?://[^\s\"']+", line):
            if urllib.parse.urlsplit(url).hostname not in LOCAL_HOSTS:
                remote.append(url)
    return remote


def read_state(p: RunPaths) -> dict | None:
    try:
        return json.loads(p.state.read_text())
    except (OSError, ValueError):
        return None


def is_up(p: RunPaths | None = None) -> bool:
    p = p or paths()
    state = read_state(p)
    if not state or not p.kubeconfig.exists():
        return False
    for component in ("jobset", "kueue"):
        if not pid_alive(state.get(f"{component}_pid", -1)) or not http_ok(
            f"http://127.0.0.1:{state.get(f'{component}_health_port')}/readyz"
        ):
            return False
    return kubectl(p, "get", "--raw=/readyz", timeout=10, check=False).returncode == 0


def up(p: RunPaths | None = None, wait_s: float = 180) -> dict:
    """Start the cluster (or reuse a healthy one in the same run dir). Returns the state dict."""
    p = p or paths()
    with locked(p.lock):
        if is_up(p):
            log(f"already up ({p.root}); reusing it")
            return read_state(p)
        if p.root.exists() and any(p.root.iterdir()):
            log(f"stale run dir {p.root}: cleaning it up first")
            _down(p)
        if p.logs.exists():
            shutil.rmtree(p.logs)
        try:
            # kwokctl picks its ports by probing downwards from 32767, and we probe for JobSet's:
            # two clusters starting at once (other run dirs) could pick the same ones.
            with locked(PORTS_LOCK):
                return _up(p, wait_s)
        except BaseException as e:
            # Never leave half a cluster behind: report, then stop what was started (logs are kept).
            detail = str(e) if isinstance(e, ClusterError) else f"{type(e).__name__}: {e}"
            log(f"up failed, tearing down: {detail}")
            try:
                _down(p)
            except ClusterError as down_error:
                log(f"teardown after failed up also failed: {down_error}")
            if isinstance(e, ClusterError) and "last 30 lines" not in str(e):
                raise ClusterError(f"{e}\n{log_tails(p)}") from e
            raise


def _up(p: RunPaths, wait_s: float) -> dict:
    b = check_binaries()
    v = versions()
    t_start = time.monotonic()
    timings: dict[str, float] = {}

    def step(name: str, t0: float) -> None:
        timings[name] = round(time.monotonic() - t0, 2)
        log(f"{name}: {timings[name]} s")

    p.root.mkdir(parents=True, exist_ok=True)
    p.logs.mkdir(exist_ok=True)
    config = p.root / "kwokctl.yaml"
    config.write_text(yaml.safe_dump_all(kwokctl_config(), sort_keys=False))

    t0 = time.monotonic()
    remote = dry_run_downloads(p, config)
    if remote:
        raise ClusterError("kwokctl would download something (refusing):\n  " + "\n  ".join(remote))
    step("kwokctl dry run (no download URLs)", t0)

    t0 = time.monotonic()
    try:
        run(
            [
                b["kwokctl"],
                "-c",
                config,
                "create",
                "cluster",
                "--name",
                CLUSTER_NAME,
                "--kubeconfig",
                "",
                "--wait",
                f"{int(wait_s)}s",
                "--timeout",
                f"{int(wait_s)}s",
            ],
            env=_kwok_env(p),
            timeout=wait_s + 60,
        )
    except ClusterError as e:
        raise ClusterError(f"{e}\n{log_tails(p)}") from e
    shutil.copyfile(p.kwok_cluster / "kubeconfig.yaml", p.kubeconfig)
    step("kwokctl create cluster (etcd, apiserver, kcm, scheduler, kwok)", t0)

    t0 = time.monotonic()
    nodes = gpu_nodes()
    apply(p, nodes)
    # Polled rather than `kubectl wait`, which errors out on objects that have no conditions yet.
    wait_until(
        lambda: ready_nodes(p) >= len(nodes), wait_s, f"{len(nodes)} nodes Ready (kwok node-initialize)"
    )
    step(f"{len(nodes)} GPU nodes Ready", t0)

    t0 = time.monotonic()
    crd = (
        module_dir("sigs.k8s.io/jobset", f"v{v['JOBSET_VERSION']}")
        / "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
    )
    kubectl(p, "apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", str(crd), timeout=60)
    # Not `kubectl wait --for=condition=Established`: right after creation the CRD has no
    # status.conditions yet and kubectl 1.36 fails instead of waiting.
    wait_until(lambda: crd_established(p, "jobsets.jobset.x-k8s.io"), 60, "JobSet CRD Established")
    step("JobSet CRD established", t0)

    t0 = time.monotonic()
    state = start_jobset(p, b["jobset"], wait_s)
    step("JobSet controller ready", t0)

    t0 = time.monotonic()
    ca_bundle = base64.b64encode((p.pki / "ca.crt").read_bytes()).decode()
    apply(p, jobset_webhooks(state["jobset_webhook_port"], ca_bundle))
    wait_until(
        lambda: jobset_defaulting_works(p), 30, "JobSet defaulting webhook to answer (server dry run)", 0.5
    )
    step("JobSet webhooks registered and defaulting verified", t0)

    t0 = time.monotonic()
    state.update(start_kueue(p, b["kueue"], ca_bundle, wait_s))
    step("Kueue CRDs, controller and webhooks ready", t0)

    t0 = time.monotonic()
    # kube-controller-manager's serviceaccount controller creates `default` in every namespace.
    wait_until(
        lambda: (
            kubectl(
                p, "get", "serviceaccount", "default", "-n", "default", timeout=10, check=False
            ).returncode
            == 0
        ),
        60,
        "ServiceAccount default/default (kcm)",
        0.5,
    )
    step("kube-controller-manager serviceaccount controller working", t0)

    apiserver = yaml.safe_load(p.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    state.update(
        {
            "run_dir": str(p.root),
            "kubeconfig": str(p.kubeconfig),
            "apiserver": apiserver,
            "kubectl": str(b["kubectl"]),
            "versions": v,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "startup_s": round(time.monotonic() - t_start, 2),
            "timings_s": timings,
        }
    )
    p.state.write_text(json.dumps(state, indent=2))
    (p.root / "env").write_text(env_lines(p))
    log(f"up in {state['startup_s']} s: export KUBECONFIG={p.kubeconfig}")
    return state


def start_jobset(p: RunPaths, jobset_bin: Path, wait_s: float) -> dict:
    """JobSet out of cluster: kwokctl's admin cert (SAN 127.0.0.1) as webhook serving cert."""
    certs = p.jobset_dir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(p.pki / "admin.crt", certs / "tls.crt")
    shutil.copyfile(p.pki / "admin.key", certs / "tls.key")
    webhook_port, health_port = free_port(), free_port()
    config = {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
    }
    config_path = p.jobset_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = p.logs / "jobset.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [
                str(jobset_bin),
                f"--config={config_path}",
                f"--kubeconfig={p.kubeconfig}",
                "--zap-log-level=info",
                "--zap-devel=false",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=p.root,
        )
    (p.jobset_dir / "jobset.pid").write_text(str(proc.pid))
    _CHILDREN.append(proc)  # keep the Popen alive: no ResourceWarning, and down() can reap it

    def ready() -> bool:
        if proc.poll() is not None:
            raise ProcessExited(f"jobset exited with {proc.returncode}; see {log_path}")
        return http_ok(f"http://127.0.0.1:{health_port}/readyz")

    try:
        wait_until(ready, wait_s, "JobSet controller /readyz")
    except ClusterError as e:
        raise ClusterError(f"{e}\n{tail(log_path)}") from e
    return {"jobset_pid": proc.pid, "jobset_webhook_port": webhook_port, "jobset_health_port": health_port}


def start_kueue(p: RunPaths, kueue_bin: Path, ca_bundle: str, wait_s: float) -> dict:
    """Kueue out of cluster, like JobSet: CRDs, the controller (JobSet integration), then its webhooks."""
    webhook_port, health_port = free_port(), free_port()
    crds = kueue_crds(webhook_port, ca_bundle)
    apply(p, crds)
    for crd in crds:
        name = crd["metadata"]["name"]
        wait_until(lambda n=name: crd_established(p, n), 60, f"CRD {name} Established")
    ensure_kueue_metrics_cert(p)
    certs = p.kueue_dir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(p.pki / "admin.crt", certs / "tls.crt")
    shutil.copyfile(p.pki / "admin.key", certs / "tls.key")
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(certs)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        # The visibility API server listens on :8082 of every interface and expects an APIService in
        # the cluster; nothing here uses it.
        "featureGates": {"VisibilityOnDemand": False},
    }
    config_path = p.kueue_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = p.logs / "kueue.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [str(kueue_bin), f"--config={config_path}", f"--kubeconfig={p.kubeconfig}", "--zap-log-level=2"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=p.root,
        )
    (p.kueue_dir / "kueue.pid").write_text(str(proc.pid))
    _CHILDREN.append(proc)

    def ready() -> bool:
        if proc.poll() is not None:
            raise ProcessExited(f"kueue exited with {proc.returncode}; see {log_path}")
        return http_ok(f"http://127.0.0.1:{health_port}/readyz")

    try:
        wait_until(ready, wait_s, "Kueue controller /readyz")
    except ClusterError as e:
        raise ClusterError(f"{e}\n{tail(log_path)}") from e
    apply(p, kueue_webhooks(webhook_port, ca_bundle))
    return {"kueue_pid": proc.pid, "kueue_webhook_port": webhook_port, "kueue_health_port": health_port}


def ensure_kueue_metrics_cert(p: RunPaths) -> None:
    """Kueue insists on a metrics certificate at a fixed host path (KUEUE_METRICS_CERT_DIR). Its metrics
    server is off here, so any certificate will do: the cluster's admin certificate, written once."""
    target = KUEUE_METRICS_CERT_DIR
    if (target / "tls.crt").exists() and (target / "tls.key").exists():
        return
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, src in (("tls.key", p.pki / "admin.key"), ("tls.crt", p.pki / "admin.crt")):
            tmp = target / f".{name}.{os.getpid()}"
            shutil.copyfile(src, tmp)
            tmp.chmod(0o600)
            tmp.replace(target / name)
    except OSError as e:
        raise ClusterError(
            f"Kueue needs a certificate in {target} (a fixed path in its main.go when it does not "
            f"manage its own certificates) and it cannot be written: {e}. Create the directory writable "
            f"for this user (e.g. `sudo install -d -o $USER {target}`) and run `up` again."
        ) from e


def ready_nodes(p: RunPaths) -> int:
    nodes = json.loads(kubectl(p, "get", "nodes", "-o", "json", timeout=20).stdout)["items"]
    return sum(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in n.get("status", {}).get("conditions") or []
        )
        for n in nodes
    )


def crd_established(p: RunPaths, name: str) -> bool:
    crd = json.loads(kubectl(p, "get", "crd", name, "-o", "json", timeout=20).stdout)
    conditions = crd.get("status", {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def jobset_defaulting_works(p: RunPaths) -> bool:
    """A server-side dry run goes through the mutating webhook: check JobSet's defaults appear."""
    probe = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "defaulting-probe", "namespace": "default"},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "w",
                    "replicas": 1,
                    "template": {
                        "spec": {"template": {"spec": {"containers": [{"name": "c", "image": "busybox"}]}}}
                    },
                }
            ]
        },
    }
    proc = kubectl(
        p, "create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(probe), timeout=20
    )
    job = json.loads(proc.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"]
    return (
        job.get("completionMode") == "Indexed" and job["template"]["spec"].get("restartPolicy") == "OnFailure"
    )


def status(p: RunPaths | None = None) -> int:
    p = p or paths()
    if is_up(p):
        state = read_state(p)
        print(
            json.dumps(
                {k: state[k] for k in ("kubeconfig", "apiserver", "jobset_pid", "kueue_pid", "started_at")},
                indent=2,
            )
        )
        return 0
    print(f"not up (run dir {p.root})", file=sys.stderr)
    return 1


def mounts_under(root: Path) -> list[str]:
    """Mount points below `root` (not `root` itself), deepest first, in this mount namespace."""
    top = os.path.realpath(root)
    found = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if len(fields) < 5:
                continue
            # mountinfo escapes space, tab, newline and backslash as octal (\040 ...)
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if point.startswith(top.rstrip("/") + "/"):
                found.append(point)
    return sorted(set(found), key=lambda m: (m.count("/"), len(m)), reverse=True)


def unmount_under(root: Path) -> list[str]:
    """Lazily unmount everything below `root`, deepest first; returns what is still mounted."""
    for point in mounts_under(root):
        run(["umount", "-l", point], check=False, timeout=30)
    return mounts_under(root)


def stop_stale_node(p: RunPaths) -> None:
    """Stop the processes of a real node (e2e/cluster/node.py) that an interrupted run left behind.

    node.py's own `down` tears its pods down properly (and removes the node's bridge and NAT rules, which
    this leaves to the next `node.py down`); this is for when it never ran. Each pid is stopped only if
    it is alive and its command line still names that program (kubelet, node.py, containerd).
    """
    node_dir = p.root / "node"
    try:
        state = json.loads((node_dir / "node.json").read_text())
    except (OSError, ValueError):
        return
    for key, expect in (("kubelet_pid", "kubelet"), ("forwarder_pid", "node.py"), ("coredns_pid", "coredns"),
                        ("containerd_pid", "containerd")):
        pid = state.get(key)
        if isinstance(pid, int) and pid > 0 and pid_alive(pid) and expect in cmdline(pid):
            log(f"stopping a stale real node's {expect} (pid {pid})")
            stop_pid(pid, expect)
    address = state.get("dns_address")  # cluster DNS's ClusterIP on the loopback device (node.py start_dns)
    if isinstance(address, str) and re.fullmatch(r"[0-9.]+/32", address):
        subprocess.run(["ip", "addr", "del", address, "dev", "lo"], capture_output=True, check=False)


def down_real_node(p: RunPaths) -> None:
    """A real node that is up (`make demo` leaves one): node.py's own down, while the API server still answers,
    so the kubelet tears its pods down properly (network namespaces, NAT rules, mounts)."""
    node_json = p.root / "node" / "node.json"
    if not node_json.exists():
        return
    # a process of its own: node.py imports this module, and importing it back would close a circle
    proc = subprocess.run([sys.executable, str(HERE / "node.py"), "down"], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "MEGATRON_OPERATOR_RUN": str(p.root)})
    if proc.returncode != 0:  # the stale-node clean-up below still runs
        log(f"node.py down failed (rc={proc.returncode}); stopping the real node's processes by pid:\n"
            f"{proc.stderr[-2000:]}")


def down(p: RunPaths | None = None) -> None:
    p = p or paths()
    with locked(p.lock):
        _down(p)


def _down(p: RunPaths) -> None:
    t0 = time.monotonic()
    b = binaries()
    down_real_node(p)
    for pid_file in (p.kueue_dir / "kueue.pid", p.jobset_dir / "jobset.pid"):
        if pid_file.exists():
            stop_pid(int(pid_file.read_text()), str(p.root))
    # Keep the component logs for post-mortems (kwokctl deletes its cluster dir).
    kwok_logs = p.kwok_cluster / "logs"
    if kwok_logs.is_dir():
        p.logs.mkdir(parents=True, exist_ok=True)
        for f in kwok_logs.glob("*.log"):
            shutil.copyfile(f, p.logs / f.name)
    if p.kwok_cluster.exists() and os.access(b["kwokctl"], os.X_OK):
        proc = run(
            # `--kubeconfig ""` is refused by delete ("empty path"): name a file in the run dir so
            # kwokctl never touches ~/.kube/config.
            [
                b["kwokctl"],
                "delete",
                "cluster",
                "--name",
                CLUSTER_NAME,
                "--kubeconfig",
                p.kwok_workdir / "unused",
            ],
            env=_kwok_env(p),
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            log(
                f"kwokctl delete cluster failed (rc={proc.returncode}), stopping processes by pid:\n{proc.stderr[-2000:]}"
            )
    leftovers = our_processes(p)
    for pid in leftovers:
        log(f"stopping leftover pid {pid}: {leftovers[pid][:200]}")
        stop_pid(pid, str(p.root))
    still = our_processes(p)
    if still:
        raise ClusterError(
            "processes still running after down:\n  " + "\n  ".join(f"{k}: {v}" for k, v in still.items())
        )
    stop_stale_node(p)
    # A real node (node.py) leaves kubelet volumes and containerd snapshots mounted under the run dir
    # when its run was killed; rmtree would stop at the first one with EBUSY.
    still_mounted = unmount_under(p.root)
    if still_mounted:
        raise ClusterError(
            "mounts still under the run dir after `umount -l` (unmount them, as root, then run down again):\n  "
            + "\n  ".join(still_mounted)
        )
    for child in p.root.iterdir() if p.root.exists() else ():
        if child != p.logs:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    log(f"down in {time.monotonic() - t0:.1f} s; no process left; logs kept in {p.logs}")


# ---------------------------------------------------------------------------------------------
# Diagnostics and CLI


def tail(path: Path, lines: int = 40) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no {path})"
    return "\n".join(data[-lines:])


def log_tails(p: RunPaths, lines: int = 30) -> str:
    parts = []
    for name, path in p.log_files().items():
        parts.append(f"----- {name} ({path}) last {lines} lines -----\n{tail(path, lines)}")
    return "\n".join(parts) or f"(no logs under {p.root})"


def env_lines(p: RunPaths) -> str:
    b = binaries()
    return (
        f"export KUBECONFIG={p.kubeconfig}\n"
        f"export MEGATRON_E2E_KUBECONFIG={p.kubeconfig}\n"
        f"export MEGATRON_OPERATOR_RUN={p.root}\n"
        f"export PATH={b['kubectl'].parent}:{b['kwokctl'].parent}:{helm_binary().parent}:$PATH\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    build_p = sub.add_parser("build", help="build and cache the binaries (skips what is built)")
    build_p.add_argument("components", nargs="*", metavar="COMPONENT",
                         help="only these of etcd, kubernetes, kwok, jobset, helm, promtool, versitygw, argocd (default: "
                              "all but promtool, versitygw, argocd, kubelet); the unit tests need helm, promtool and versitygw")
    up_p = sub.add_parser("up", help="start the cluster (reuses a healthy one)")
    up_p.add_argument("--wait", type=float, default=180, help="seconds to wait for each readiness step")
    sub.add_parser("down", help="stop everything and check no process is left")
    sub.add_parser("status", help="exit 0 if the cluster answers")
    sub.add_parser("env", help="print shell exports (KUBECONFIG, PATH)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            t0 = time.monotonic()
            rc = subprocess.call(["bash", str(HERE / "build.sh"), *args.components])
            log(f"build: rc={rc} in {time.monotonic() - t0:.0f} s")
            return rc
        if args.cmd == "up":
            up(wait_s=args.wait)
            print(env_lines(paths()), end="")
            return 0
        if args.cmd == "down":
            down()
            return 0
        if args.cmd == "status":
            return status()
        if args.cmd == "env":
            print(env_lines(paths()), end="")
            return 0
    except ClusterError as e:
        log(f"ERROR: {e}")
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
