#!/usr/bin/env python3
"""Operator throughput against the floor and a peer, on the local control plane (a benchmark, not a test).

For each burst size N, in ONE run on the same cluster and interleaved (floor, ours, peer for 100 jobs,
then the same for 500), creates N jobs of 1 pod x 1 GPU at once and reports p50/p99 of
(a) creation to JobSet created and (b) creation to all of the job's pods Running:

- ``floor``: the objects ``render()`` produces for each job (ServiceAccount, Role, RoleBinding,
  JobSet), created directly by this client: what the cluster itself costs, no operator.
- ``ours``: N MegatronJobs, with the operator running as a host process.
- ``peer``: N TrainJobs of the same shape (Kubeflow Trainer's torch-distributed
  ClusterTrainingRuntime), with its controller manager running as a host process, its webhooks on
  loopback. Built by ``bench/build_trainer.sh`` (``make bench-peer``); skipped when not built.

A fresh controller process is started for each burst, so its peak RSS (VmHWM) and its CPU seconds
(utime + stime, from just before the first create to the last pod Running) belong to that burst.
Times are client side: t0 is taken just before the create call; JobSet ADDED, the JobSet's first Job,
its pod's creation and pod Running come from watch streams opened before the burst. The machine's load average is recorded before and after
each burst (the machine is shared; compare ratios from one run, not absolute figures across runs).
Extra kwok GPU nodes are added for the run (and removed afterwards) so every pod can be scheduled.

    .venv/bin/python bench/operator_latency.py --jobs 100 500 --out bench/results/operator_throughput.json
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "e2e"), str(ROOT / "operator"), str(ROOT / "contract"), str(ROOT / "bench")]

from k8s import GPU_TOLERATION, Cluster, load_cluster_module, pod_runtime_annotations  # noqa: E402
from megatron_operator.render import render  # noqa: E402
from megatron_operator.settings import Settings  # noqa: E402
from megatron_operator.validation import parse_job  # noqa: E402
from mjob import CRD_FILE, GROUP, PLURAL, VERSION, OperatorProcess, free_port  # noqa: E402

CACHE = Path(os.environ.get("MEGATRON_OPERATOR_CACHE") or
             Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-operator")
TRAINER_VERSION = os.environ.get("TRAINER_VERSION", "2.3.0")
PEER_DIR = CACHE / "bin" / f"kubeflow-trainer-{TRAINER_VERSION}"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
NODE_LABEL = "megatron-bench"
RUN_S = 3600  # kwok keeps every pod Running this long (longer than any burst)
SETTLE_TIMEOUT_S = 300  # namespace deletion between bursts
SETTLE_QUIET_S = 3.0  # after all pods run: settled when no job's write came in this long ...
SETTLE_WRITES_S = 60.0  # ... or after this long
TEARDOWN_QUIET_S = 15.0  # after a burst's namespace is deleted: until no write came in this long ...
TEARDOWN_WRITES_S = 180.0  # ... or after this long


def bench_nodes(count: int) -> list[dict]:
    return [{
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": f"bench-{i:03d}", "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"type": "kwok", "kubernetes.io/hostname": f"bench-{i:03d}", NODE_LABEL: "true"}},
        "spec": {"podCIDR": f"10.250.{i}.0/24", "podCIDRs": [f"10.250.{i}.0/24"],
                 "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": {"cpu": "192", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": "8"},
                   "allocatable": {"cpu": "192", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": "8"}},
    } for i in range(count)]


def megatron_job(name: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "MegatronJob", "metadata": {"name": name},
            "spec": {"numNodes": 1, "gpusPerNode": 1,
                     "model": {"numLayers": 2, "hiddenSize": 256, "numAttentionHeads": 4, "seqLength": 256,
                               "vocabSize": 1000},
                     "training": {"microBatchSize": 1, "trainIters": 10},
                     "resources": {"nodeSelector": {NODE_LABEL: "true"}},
                     "podMetadata": {"annotations": pod_runtime_annotations(RUN_S)}}}


def floor_objects(name: str, namespace: str) -> list[dict]:
    """What the operator would create for ``megatron_job(name)``: render() of the validated spec."""
    doc = megatron_job(name)
    doc["metadata"]["namespace"] = namespace
    return render(parse_job(doc), Settings())


def train_job(name: str) -> dict:
    """The peer's TrainJob of the same shape: 1 node x 1 GPU, same node selector, toleration, kwok run time."""
    pod_patch = {"metadata": {"annotations": pod_runtime_annotations(RUN_S)},
                 "spec": {"nodeSelector": {NODE_LABEL: "true"}, "tolerations": [GPU_TOLERATION]}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": name},
            "spec": {"runtimeRef": {"name": "torch-distributed"},
                     "trainer": {"numNodes": 1, "numProcPerNode": 1,
                                 "resourcesPerNode": {"limits": {"nvidia.com/gpu": 1}}},
                     "runtimePatches": [{"manager": "megatron-operator.io/bench", "trainingRuntimeSpec": {"template": {
                         "spec": {"replicatedJobs": [{"name": "node", "template": {
                             "spec": {"template": pod_patch}}}]}}}}]}}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def proc_stats(pid: int) -> dict[str, float]:
    """Peak RSS (VmHWM, MiB) and CPU seconds (utime + stime) of a process."""
    hwm = float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {"peak_rss_mib": hwm, "cpu_s": (int(fields[11]) + int(fields[12])) / ticks}


COMPONENTS = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok", "jobset", "kueue")


def component_cpu(run_dir: Path) -> dict[str, float]:
    """CPU seconds (utime + stime) so far of each control-plane process of this cluster (its command
    line names ``run_dir``: another cluster on the machine, e.g. a CI run's, is not counted), by the
    name of its binary."""
    out: dict[str, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    mine = (str(run_dir).rstrip("/") + "/").encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            argv0 = cmdline.split(b"\0", 1)[0].decode()
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, UnicodeDecodeError, IndexError):
            continue
        if mine not in cmdline:
            continue
        base = Path(argv0).name
        name = next((c for c in COMPONENTS if base == c or base.startswith(c + "-") or base.startswith(c + "_")), None)
        if name is not None:
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def apiserver_requests(cluster: Cluster) -> dict[str, list[float]]:
    """The API server's own counters: {"VERB resource[/subresource]": [requests, seconds spent]}."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for metric, idx in (("apiserver_request_total{", 0), ("apiserver_request_duration_seconds_sum{", 1)):
            if line.startswith(metric):
                labels = dict(kv.split("=", 1) for kv in line[len(metric):line.rindex("}")].replace('"', "").split(",")
                              if "=" in kv)
                if labels.get("verb") in ("WATCH", "CONNECT"):
                    continue
                key = f"{labels.get('verb')} {labels.get('resource')}" + (
                    f"/{labels['subresource']}" if labels.get("subresource") else "")
                out.setdefault(key, [0.0, 0.0])[idx] += float(line.rsplit(" ", 1)[1])
    return out


#: Requests that are not any job's (node heartbeats, leader leases, reads): left out of "settled".
BACKGROUND = ("leases", "nodes", "nodes/status")


def writes(requests: dict[str, list[float]]) -> int:
    """Write requests so far, background left out: settled once this stops growing."""
    return int(sum(n for key, (n, _) in requests.items()
                   if key.split(" ")[0] in ("POST", "PUT", "PATCH", "APPLY", "DELETE")
                   and key.split(" ", 1)[1] not in BACKGROUND))


def diff_requests(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for key, (n, sec) in after.items():
        n0, s0 = before.get(key, [0.0, 0.0])
        if n - n0 >= 1:
            out[key] = {"requests": int(n - n0), "seconds": round(sec - s0, 2)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["requests"]))


# ---- the controllers under test ------------------------------------------------------------------

def prometheus_labels(line: str) -> dict[str, str]:
    """The labels of one exposition line, ``name{a="x",b="y"} 3.0`` -> {"a": "x", "b": "y"} (the operator's
    label values have no commas or quotes)."""
    return dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.rindex("}")].replace('"', "").split(",")
                if "=" in kv)


class Ours:
    name = "ours"

    def __init__(self, cluster: Cluster, profile_dir: Path | None, watch_floor: bool = False):
        self.cluster = cluster
        self.profile_dir = profile_dir
        self.op: OperatorProcess | None = None
        self.spy: subprocess.Popen | None = None
        self.watch_floor = watch_floor
        self.floor_proc: subprocess.Popen | None = None
        self.floor_out = cluster.run_dir / "watch_floor.json"

    def start(self, label: str) -> int:
        self.op = OperatorProcess(self.cluster, free_port(), {})
        self.op.start()
        pid = self.op.proc.pid
        if self.watch_floor:  # bench/watch_floor.py: the same three watches without kopf, beside the operator
            self.floor_out.unlink(missing_ok=True)
            with open(self.cluster.logs_dir / "watch_floor.log", "a") as log:  # the child keeps its own copy
                self.floor_proc = subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "watch_floor.py"), "--kubeconfig",
                     str(self.cluster.kubeconfig), "--out", str(self.floor_out)],
                    stdout=subprocess.DEVNULL, stderr=log)
            self.floor_reading(signal_it=False)  # its start-up reading: SIGUSR1 is handled from now on
        if self.profile_dir is not None:  # py-spy (pip install py-spy) attached for this burst
            self.profile_dir.mkdir(parents=True, exist_ok=True)
            self.spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
                                         "--threads", "--gil", "--format", "speedscope", "--rate", "100",
                                         "-o", str(self.profile_dir / f"ours-{label}.speedscope.json")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return pid

    def floor_reading(self, timeout_s: float = 30.0, signal_it: bool = True) -> dict[str, Any] | None:
        """bench/watch_floor.py's events received and CPU seconds so far (None without --watch-floor)."""
        if self.floor_proc is None:
            return None
        if signal_it:
            self.floor_out.unlink(missing_ok=True)
            self.floor_proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.floor_proc.poll() is not None:
                raise AssertionError(f"watch_floor.py exited (rc={self.floor_proc.returncode}); "
                                     f"log: {self.cluster.logs_dir / 'watch_floor.log'}")
            time.sleep(0.1)
            if self.floor_out.exists():
                return json.loads(self.floor_out.read_text())
        raise AssertionError(f"watch_floor.py wrote no reading in {timeout_s} s")

    def stop(self) -> None:
        if self.floor_proc is not None:
            self.floor_proc.terminate()
            self.floor_proc.wait(timeout=30)
            self.floor_proc = None
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)
            self.spy.wait(timeout=120)
            self.spy = None
        if self.op is not None:
            self.op.stop()
            self.op = None

    def create(self, custom: Any, ns: str, name: str) -> None:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, megatron_job(name))

    def metrics(self) -> dict[str, Any]:
        """The operator's own counters (from its /metrics), cumulative for this burst: status writes, and
        every API request it made by verb and resource (``operator_requests``; events: those it handed to
        kopf to post) with the ones that did not succeed (``operator_failed_requests``, by HTTP status), and
        the watch events its handlers received, by resource (``operator_watch_events``)."""
        out: dict[str, Any] = {"operator_requests": {}, "operator_failed_requests": {}}
        for line in self.op.metrics().splitlines():
            if line.startswith("megatron_operator_status_writes_total"):
                out["operator_status_writes"] = float(line.split()[-1])
            elif line.startswith("megatron_operator_watch_events_total{"):
                resource = prometheus_labels(line)["resource"]
                events = out.setdefault("operator_watch_events", {})
                events[resource] = events.get(resource, 0) + int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("megatron_operator_api_requests_total{"):
                labels = prometheus_labels(line)
                count = int(float(line.rsplit(" ", 1)[1]))
                key = f"{labels['verb']} {labels['resource']}"
                out["operator_requests"][key] = out["operator_requests"].get(key, 0) + count
                if labels["code"] not in ("0", "200", "201") and count:
                    fkey = f"{key} {labels['code']}"
                    out["operator_failed_requests"][fkey] = out["operator_failed_requests"].get(fkey, 0) + count
        return out


class Floor:
    name = "floor"

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def start(self, label: str) -> None:
        return None  # no controller

    def stop(self) -> None:
        return None

    def create(self, custom: Any, ns: str, name: str) -> None:
        api = custom.api_client
        for obj in floor_objects(name, ns):
            kind = obj["kind"]
            if kind == "JobSet":
                custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets", obj)
            elif kind == "ServiceAccount":
                kubernetes.client.CoreV1Api(api).create_namespaced_service_account(ns, obj)
            elif kind == "Role":
                kubernetes.client.RbacAuthorizationV1Api(api).create_namespaced_role(ns, obj)
            elif kind == "RoleBinding":
                kubernetes.client.RbacAuthorizationV1Api(api).create_namespaced_role_binding(ns, obj)
            else:
                raise ValueError(f"floor: render() produced a {kind}; teach the benchmark to create it")


class Peer:
    """Kubeflow Trainer's controller manager, out of cluster, webhooks on 127.0.0.1 with a self-signed cert."""

    name = "peer"

    def __init__(self, cluster: Cluster, work: Path):
        self.cluster = cluster
        self.work = work
        self.proc: subprocess.Popen | None = None
        self.webhook_port = free_port()
        self.health_port = free_port()

    @staticmethod
    def available() -> bool:
        return (PEER_DIR / "trainer-controller-manager").is_file()

    def install(self) -> None:
        """CRDs, a serving certificate, webhook configurations aimed at loopback, the runtime (once per run)."""
        self.work.mkdir(parents=True, exist_ok=True)
        certs = self.work / "tmp" / "k8s-webhook-server" / "serving-certs"  # controller-runtime's default dir
        certs.mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(certs / "tls.key"), "-out", str(certs / "tls.crt")],
                       check=True, capture_output=True)
        ca = base64.b64encode((certs / "tls.crt").read_bytes()).decode()
        for crd in sorted((PEER_DIR / "manifests" / "base" / "crds").glob("trainer.kubeflow.org_*.yaml")):
            self.cluster.apply(crd)
        for crd in ("clustertrainingruntimes", "trainingruntimes", "trainjobs"):
            self.cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}.trainer.kubeflow.org",
                                 "--timeout=60s")
        hooks = list(yaml.safe_load_all((PEER_DIR / "manifests" / "base" / "webhook" / "manifests.yaml").read_text()))
        for doc in hooks:
            doc["metadata"]["name"] = "kubeflow-trainer-bench-" + doc["kind"].lower()
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}", "caBundle": ca}
        self.cluster.apply(hooks)
        config = {"apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
                  "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}",
                             "readinessEndpointName": "readyz", "livenessEndpointName": "healthz"},
                  "metrics": {"bindAddress": "0"},
                  "webhook": {"port": self.webhook_port, "host": "127.0.0.1"},
                  "leaderElection": {"leaderElect": False},
                  "certManagement": {"enable": False}}
        (self.work / "config.yaml").write_text(yaml.safe_dump(config))
        self.start("install")
        try:
            self.cluster.apply(PEER_DIR / "manifests" / "base" / "runtimes" / "torch_distributed.yaml")
        finally:
            self.stop()

    def start(self, label: str) -> int:
        log = open(self.cluster.logs_dir / "kubeflow-trainer.log", "a")
        log.write(f"\n===== trainer-controller-manager ({label}) =====\n")
        log.flush()
        self.proc = subprocess.Popen(
            [str(PEER_DIR / "trainer-controller-manager"), f"--config={self.work / 'config.yaml'}"],
            env=self.cluster.env(TMPDIR=str(self.work / "tmp")), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.cluster.wait_for(self.ready, 120, "the peer's /readyz")
        return self.proc.pid

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"the peer exited (rc={self.proc.returncode if self.proc else None}); "
                                 f"log: {self.cluster.logs_dir / 'kubeflow-trainer.log'}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.proc = None

    def metrics(self) -> dict[str, float]:
        return {}

    def create(self, custom: Any, ns: str, name: str) -> None:
        custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", ns, "trainjobs", train_job(name))


# ---- one burst -----------------------------------------------------------------------------------

def new_namespace(core: Any, name: str) -> None:
    core.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # KCM creates the default ServiceAccount
        try:
            core.read_namespaced_service_account("default", name)
            return
        except kubernetes.client.ApiException:
            time.sleep(0.5)
    raise TimeoutError(f"namespace {name}: no default ServiceAccount after 60 s")


def object_bytes(api: Any, ns: str) -> dict[str, dict[str, int]]:
    """The size of one JobSet, Job, pod and MegatronJob or TrainJob of the burst as the API server returns them
    (compact JSON), with
    and without metadata.managedFields: what every write and every watch event of that object carries."""
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    lists = {"jobset": lambda: custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets",
                                                                     limit=1, _preload_content=False),
             "job": lambda: batch.list_namespaced_job(ns, limit=1, _preload_content=False),
             "pod": lambda: core.list_namespaced_pod(ns, limit=1, _preload_content=False),
             "megatronjob": lambda: custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, limit=1,
                                                                          _preload_content=False),
             "trainjob": lambda: custom.list_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", ns,
                                                                       "trainjobs", limit=1, _preload_content=False)}
    out = {}
    for kind, call in lists.items():
        try:
            items = json.loads(call().data).get("items") or []
        except kubernetes.client.ApiException as exc:  # the peer's CRD is there only when the peer is
            if exc.status == 404:
                continue
            raise
        if not items:
            continue
        obj = items[0]
        full = len(json.dumps(obj, separators=(",", ":")))
        obj.get("metadata", {}).pop("managedFields", None)
        out[kind] = {"bytes": full, "bytes_without_managed_fields": len(json.dumps(obj, separators=(",", ":")))}
    return out


def run_burst(cluster: Cluster, system: Any, n: int, timeout_s: float, apiserver_profile: Path | None = None) -> dict:
    api = cluster.api_client()
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    ns = f"bench-{system.name}-{n}-{int(time.time())}"
    new_namespace(core, ns)
    pid = system.start(str(n))
    created: dict[str, float] = {}
    jobset_at: dict[str, float] = {}
    job_at: dict[str, float] = {}
    pod_at: dict[str, float] = {}
    running_at: dict[str, float] = {}
    stop = threading.Event()

    def watch_jobsets():
        w = kubernetes.watch.Watch()
        for ev in w.stream(custom.list_namespaced_custom_object, "jobset.x-k8s.io", "v1alpha2", ns, "jobsets",
                           timeout_seconds=int(timeout_s) + 60):
            if ev["type"] == "ADDED":
                jobset_at.setdefault(ev["object"]["metadata"]["name"], time.monotonic())
            if stop.is_set():
                break

    def watch_pods():
        w = kubernetes.watch.Watch()
        for ev in w.stream(core.list_namespaced_pod, ns, timeout_seconds=int(timeout_s) + 60):
            p = ev["object"]
            job = (p.metadata.labels or {}).get(JOBSET_NAME_LABEL)  # one pod per job, its JobSet has the job's name
            pod_at.setdefault(job, time.monotonic())
            if p.status and p.status.phase == "Running":
                running_at.setdefault(job, time.monotonic())
            if stop.is_set():
                break

    status_at: dict[str, float] = {}  # ours: the MegatronJob's first status (any phase)
    status_running_at: dict[str, float] = {}  # ours: status.phase Running

    def watch_megatronjobs():
        w = kubernetes.watch.Watch()
        for ev in w.stream(custom.list_namespaced_custom_object, GROUP, VERSION, ns, PLURAL,
                           timeout_seconds=int(timeout_s) + 60):
            obj = ev["object"]
            phase = (obj.get("status") or {}).get("phase")
            if phase:
                status_at.setdefault(obj["metadata"]["name"], time.monotonic())
            if phase == "Running":
                status_running_at.setdefault(obj["metadata"]["name"], time.monotonic())
            if stop.is_set():
                break

    def watch_jobs():
        w = kubernetes.watch.Watch()
        batch = kubernetes.client.BatchV1Api(api)
        for ev in w.stream(batch.list_namespaced_job, ns, timeout_seconds=int(timeout_s) + 60):
            job_at.setdefault((ev["object"].metadata.labels or {}).get(JOBSET_NAME_LABEL), time.monotonic())
            if stop.is_set():
                break

    watchers = [watch_jobsets, watch_jobs, watch_pods] + ([watch_megatronjobs] if system.name == "ours" else [])
    threads = [threading.Thread(target=f, daemon=True) for f in watchers]
    for t in threads:
        t.start()
    time.sleep(1.0)
    names = [f"bench-{i:04d}" for i in range(n)]

    def create(name: str) -> None:
        created[name] = time.monotonic()
        system.create(custom, ns, name)

    load_before = loadavg()
    requests0, cpu0 = apiserver_requests(cluster), component_cpu(cluster.run_dir)
    stats0 = proc_stats(pid) if pid else None
    floor0 = system.floor_reading() if system.name == "ours" else None
    recorder = None
    if apiserver_profile is not None:  # kube-apiserver's own CPU profile over the settled window
        from apiserver_profile import Recorder
        recorder = Recorder([str(cluster.kubectl_path), f"--kubeconfig={cluster.kubeconfig}"],
                            apiserver_profile / f"{system.name}-{n}.pb.gz")
        recorder.start()
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(create, names))
    burst_s = time.monotonic() - t0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (len(jobset_at) < n or len(running_at) < n):
        time.sleep(0.5)
    stats1 = proc_stats(pid) if pid else None
    requests1, cpu1 = apiserver_requests(cluster), component_cpu(cluster.run_dir)
    load_after = loadavg()
    running_s = time.monotonic() - t0
    # Settled: the start-up work that comes after the pods run counts too (ours: the status writes that
    # report Running; the peer's: its TrainJob status writes): wait until every MegatronJob's status says
    # Running (ours) and the API server's per-job writes stop, then read the counters again.
    while system.name == "ours" and time.monotonic() < deadline and len(status_running_at) < n:
        time.sleep(0.5)
    wait_for_quiet_writes(cluster, writes(requests1))
    stats2 = proc_stats(pid) if pid else None
    floor2 = system.floor_reading() if floor0 is not None else None
    requests2, cpu2 = apiserver_requests(cluster), component_cpu(cluster.run_dir)
    settled_s = time.monotonic() - t0
    stop.set()
    profile = None
    if recorder is not None:
        from apiserver_profile import profile_breakdown
        merged = recorder.stop()
        profile = {"file": merged.name if merged else None, "pieces": len(recorder.pieces),
                   "errors": recorder.errors[:3],
                   "cpu_s": {k: round(v, 3) for k, v in profile_breakdown(merged).items()} if merged else None}
    to_jobset = [jobset_at[k] - created[k] for k in names if k in jobset_at]
    to_running = [running_at[k] - created[k] for k in names if k in running_at]
    to_pod = [pod_at[k] - created[k] for k in names if k in pod_at]
    to_job = [job_at[k] - created[k] for k in names if k in job_at]
    to_status = [status_at[k] - created[k] for k in names if k in status_at]
    to_status_running = [status_running_at[k] - created[k] for k in names if k in status_running_at]
    status_after_pods = [status_running_at[k] - running_at[k] for k in names if k in status_running_at
                         and k in running_at]
    extra = system.metrics() if pid else {}

    def q(values: list[float], p: float) -> float | None:
        return round(pct(values, p), 2) if values else None

    result = {
        "system": system.name, "jobs": n, "create_burst_s": round(burst_s, 2),
        "jobsets_created": len(to_jobset), "all_pods_running": len(to_running),
        "to_jobset_p50_s": q(to_jobset, 0.5), "to_jobset_p99_s": q(to_jobset, 0.99),
        "to_running_p50_s": q(to_running, 0.5), "to_running_p99_s": q(to_running, 0.99),
        "to_job_created_p50_s": q(to_job, 0.5), "to_job_created_p99_s": q(to_job, 0.99),
        "to_pod_created_p50_s": q(to_pod, 0.5), "to_pod_created_p99_s": q(to_pod, 0.99),
        **extra,
        "controller_peak_rss_mib": round(stats1["peak_rss_mib"], 1) if stats1 else None,
        "controller_cpu_s": round(stats1["cpu_s"] - stats0["cpu_s"], 2) if stats1 else None,
        "loadavg_before": load_before, "loadavg_after": load_after,
        "component_cpu_s": {k: round(v - cpu0.get(k, 0.0), 1) for k, v in sorted(cpu1.items())},
        "apiserver_requests": diff_requests(requests0, requests1),
        # the same, from the first create until settled (see above), and the controller's CPU over it
        "running_s": round(running_s, 1), "settled_s": round(settled_s, 1),
        "controller_cpu_settled_s": round(stats2["cpu_s"] - stats0["cpu_s"], 2) if stats2 else None,
        "component_cpu_settled_s": {k: round(v - cpu0.get(k, 0.0), 1) for k, v in sorted(cpu2.items())},
        "apiserver_requests_settled": diff_requests(requests0, requests2),
    }
    result["object_bytes"] = object_bytes(api, ns)
    if profile is not None:  # --apiserver-profile: from the first create until settled, plus the last piece's tail
        result["apiserver_profile"] = profile
    if floor2 is not None:  # --watch-floor: the same watches without kopf, over the settled window
        result["watch_floor"] = {"cpu_settled_s": round(floor2["cpu_s"] - floor0["cpu_s"], 2),
                                 "events_settled": {k: v - floor0["events"].get(k, 0)
                                                    for k, v in floor2["events"].items()}}
    if system.name == "ours":
        result.update({"status_seen": len(to_status), "status_running": len(to_status_running),
                       "to_status_p50_s": q(to_status, 0.5), "to_status_p99_s": q(to_status, 0.99),
                       "to_status_running_p50_s": q(to_status_running, 0.5),
                       "to_status_running_p99_s": q(to_status_running, 0.99),
                       "status_running_after_pods_p50_s": q(status_after_pods, 0.5),
                       "status_running_after_pods_p99_s": q(status_after_pods, 0.99)})
    # Who posted which events (a FailedScheduling here means the burst waited for GPUs, not for controllers).
    reasons: dict[str, int] = {}
    for ev in core.list_namespaced_event(ns).items:
        who = ev.reporting_component or (ev.source.component if ev.source else None) or "?"
        key = f"{who} {ev.type} {ev.reason}"
        reasons[key] = reasons.get(key, 0) + (ev.count or 1)
    result["events"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1]))
    # Clean up with the controller still running (as it would be), then stop it.
    core.delete_namespace(ns)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            core.read_namespace(ns)
            time.sleep(1)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                break
            raise
    # The namespace is gone, but JobSet's controller is still working through its deleted JobSets, posting an
    # event for each that the API server refuses (the namespace is terminating or gone; each refusal with the
    # NamespaceLifecycle admission's GET of the namespace). Unless waited out, that lands in the next burst's
    # window: 8.7 requests per job of a 500-job burst once, 2.9 each of POST events, PATCH events and GET
    # namespaces (run 10 of issue 30; jobset.log: "Server rejected event ... because it is being terminated").
    t_quiet = time.monotonic()
    result["teardown_quiet_s"] = round(wait_for_quiet_writes(cluster, writes(apiserver_requests(cluster)),
                                                             TEARDOWN_QUIET_S, TEARDOWN_WRITES_S) - t_quiet, 1)
    system.stop()
    return result


def wait_for_quiet_writes(cluster: Cluster, last: int, quiet_s: float = SETTLE_QUIET_S,
                          bound_s: float = SETTLE_WRITES_S) -> float:
    """Until the API server's writes (background left out) stop for ``quiet_s``, at most ``bound_s``;
    returns the monotonic time it ended."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now_writes = writes(apiserver_requests(cluster))
        if now_writes == last:
            break
        last = now_writes
    return time.monotonic()


def ratios(results: list[dict]) -> list[dict]:
    """Ours / floor and ours / peer per size, from the same run."""
    out = []
    for n in sorted({r["jobs"] for r in results}):
        by = {r["system"]: r for r in results if r["jobs"] == n}
        ours = by.get("ours")
        if not ours:
            continue
        row: dict[str, Any] = {"jobs": n}
        for ref in ("floor", "peer"):
            if ref not in by:
                continue
            for k in ("to_jobset_p50_s", "to_jobset_p99_s", "to_running_p50_s", "to_running_p99_s",
                      "controller_peak_rss_mib", "controller_cpu_s"):
                a, b = ours.get(k), by[ref].get(k)
                if a is not None and b:
                    row[f"ours_over_{ref}_{k}"] = round(a / b, 2)
        out.append(row)
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--systems", nargs="+", default=["floor", "ours", "peer"], choices=["floor", "ours", "peer"])
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for each burst")
    ap.add_argument("--watch-floor", action="store_true",
                    help="run bench/watch_floor.py (the operator's three watches without kopf) beside the operator "
                         "and record its CPU and events (watch_floor in the result)")
    ap.add_argument("--profile", default=None, help="record py-spy profiles of the operator into this directory (py-spy --gil: samples the GIL holder)")
    ap.add_argument("--apiserver-profile", default=None, metavar="DIR",
                    help="record kube-apiserver's CPU profile over each burst into DIR/<system>-<jobs>.pb.gz and "
                         "its breakdown by category (bench/apiserver_profile.py) into the result; needs Go")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--crd", default=None,
                    help="a what-if run with another CRD: 'no-cel' (crds/ without its CEL rules) or a CRD file "
                         "(recorded in the JSON's meta)")
    args = ap.parse_args()

    local = load_cluster_module()
    state = local.up()
    cluster = Cluster(kubeconfig=Path(state["kubeconfig"]), run_dir=local.run_dir(), kubectl_path=Path(state["kubectl"]))
    if args.crd == "no-cel":
        from crd_variants import variant_crd
        cluster.apply(variant_crd("no-cel", None))
    else:
        cluster.apply(Path(args.crd) if args.crd else CRD_FILE)
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s")
    systems: list[Any] = []
    for s in args.systems:
        if s == "floor":
            systems.append(Floor(cluster))
        elif s == "ours":
            systems.append(Ours(cluster, Path(args.profile) if args.profile else None, args.watch_floor))
        elif Peer.available():
            systems.append(Peer(cluster, local.run_dir() / "kubeflow-trainer"))
        else:
            print(f"peer skipped: {PEER_DIR / 'trainer-controller-manager'} not built (make bench-peer)",
                  file=sys.stderr)
    cluster.apply(bench_nodes(max(args.jobs) // 8 + 2))
    results = []
    try:
        for s in systems:
            if isinstance(s, Peer):
                s.install()
        for n in args.jobs:
            for s in systems:
                r = run_burst(cluster, s, n, args.timeout,
                              Path(args.apiserver_profile) if args.apiserver_profile else None)
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for s in systems:
            s.stop()
        cluster.kubectl("delete", "nodes", "-l", f"{NODE_LABEL}=true", "--wait=false", check=False)
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
            "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}), shared with other work",
            "command": " ".join(sys.argv), "peer": f"kubeflow trainer v{TRAINER_VERSION}",
            "crd": args.crd or str(CRD_FILE.relative_to(ROOT))}
    doc = {"meta": meta, "results": results, "ratios": ratios(results)}
    print(json.dumps(doc, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
