#!/usr/bin/env python3
"""Jobs of thousands of GPUs on the local control plane (a benchmark, not a test).

1. One MegatronJob of 256 pods x 8 GPUs (2,048 GPUs) on 256 added kwok nodes of 8 GPUs: time from
   creation to its JobSet and to all 256 pods Running, the status it reaches, then a gang restart
   (one pod fails, JobSet recreates all 256) with the operator's CPU seconds and peak RSS over it.
2. One MegatronJob with TP=16 on 8-GPU pods (32 pods, 16 TP groups of 2 pods) on added kwok hosts
   of 32 GPUs: every TP group must land on one host (the operator's required pod affinity, decided
   by the real kube-scheduler); reports how the groups spread over the hosts.

    .venv/bin/python bench/scale_2048.py --out bench/results/scale_2048.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "e2e"), str(ROOT / "operator"), str(ROOT / "contract")]

from k8s import POD_FAIL_EXIT_CODE, POD_FAIL_LABEL, Cluster, load_cluster_module, pod_runtime_annotations  # noqa: E402
from mjob import CRD_FILE, GROUP, PLURAL, VERSION, OperatorProcess, free_port  # noqa: E402
from operator_latency import loadavg, new_namespace, proc_stats  # noqa: E402

NODE_LABEL = "megatron-scale"
JOB_LABEL = "megatron-operator.io/job-name"
TP_LABEL = "megatron-operator.io/tp-group"
RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"


def nodes(prefix: str, count: int, gpus: int, subnet: int) -> list[dict]:
    return [{
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": f"{prefix}-{i:03d}", "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"type": "kwok", "kubernetes.io/hostname": f"{prefix}-{i:03d}", NODE_LABEL: prefix}},
        "spec": {"podCIDR": f"10.{subnet}.{i}.0/24", "podCIDRs": [f"10.{subnet}.{i}.0/24"],
                 "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": {"cpu": "192", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": str(gpus)},
                   "allocatable": {"cpu": "192", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": str(gpus)}},
    } for i in range(count)]


def big_job(name: str, num_nodes: int, tensor: int, pipeline: int, pool: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "MegatronJob", "metadata": {"name": name},
            "spec": {"numNodes": num_nodes, "gpusPerNode": 8,
                     "parallelism": {"tensor": tensor, "pipeline": pipeline},
                     "model": {"numLayers": 32, "hiddenSize": 4096, "numAttentionHeads": 32, "seqLength": 4096,
                               "vocabSize": 32000},
                     "training": {"microBatchSize": 1, "globalBatchSize": 1024, "trainIters": 10},
                     "resources": {"nodeSelector": {NODE_LABEL: pool}},
                     "restart": {"maxRestarts": 5},
                     "podMetadata": {"annotations": pod_runtime_annotations(3600)}}}


class Watcher:
    """The job's JobSet ADDED time from a watch stream; its pods by listing (a long pod watch can end)."""

    def __init__(self, api: Any, ns: str):
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.ns = ns
        self.jobset_at: float | None = None
        threading.Thread(target=self._jobsets, daemon=True).start()

    def _jobsets(self) -> None:
        for ev in kubernetes.watch.Watch().stream(self.custom.list_namespaced_custom_object, "jobset.x-k8s.io",
                                                  "v1alpha2", self.ns, "jobsets", timeout_seconds=3600):
            if ev["type"] == "ADDED" and self.jobset_at is None:
                self.jobset_at = time.monotonic()

    def running(self, attempt: int) -> list[Any]:
        pods = self.core.list_namespaced_pod(self.ns, label_selector=f"{RESTART_LABEL}={attempt}").items
        return [p for p in pods if p.status and p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def wait(pred, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def status(custom: Any, ns: str, name: str) -> dict:
    return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get("status") or {}


def sampler(pid: int, stop: threading.Event, out: dict) -> None:
    """The operator's RSS (VmRSS) every 0.5 s: the peak within a window, not the process's lifetime."""
    peak = 0.0
    while not stop.is_set():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                peak = max(peak, int(line.split()[1]) / 1024)
        stop.wait(0.5)
    out["peak_rss_mib"] = round(peak, 1)


def run_big(cluster: Cluster, op: OperatorProcess, n_pods: int, timeout_s: float) -> dict:
    api = cluster.api_client()
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    ns = f"scale-{int(time.time())}"
    new_namespace(core, ns)
    w = Watcher(api, ns)
    time.sleep(1)
    pid = op.proc.pid
    s0, load0 = proc_stats(pid), loadavg()
    t0 = time.monotonic()
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, big_job("big", n_pods, 8, 4, "big"))
    wait(lambda: w.jobset_at, timeout_s, "the JobSet")
    to_jobset = w.jobset_at - t0
    wait(lambda: len(w.running(0)) == n_pods, timeout_s, f"{n_pods} pods Running", interval=1)
    to_running = time.monotonic() - t0
    st = wait(lambda: (s := status(custom, ns, "big")).get("phase") == "Running" and s, 120, "phase Running")
    to_status = time.monotonic() - t0
    s1 = proc_stats(pid)
    result: dict[str, Any] = {
        "pods": n_pods, "gpus": n_pods * 8, "to_jobset_s": round(to_jobset, 2), "to_all_running_s": round(to_running, 2),
        "to_status_running_s": round(to_status, 2),
        "status": {k: st.get(k) for k in ("phase", "reason", "message", "worldSize", "layout", "restarts", "jobSetName")},
        "operator_cpu_s_to_running": round(s1["cpu_s"] - s0["cpu_s"], 2),
        "operator_peak_rss_mib_so_far": round(s1["peak_rss_mib"], 1),
        "loadavg_before": load0, "loadavg_after_start": loadavg(),
    }
    # Gang restart: one pod fails (kwok exits its container with 137), JobSet recreates all pods.
    victim = sorted(p.metadata.name for p in w.running(0))[0]
    rss: dict[str, float] = {}
    stop = threading.Event()
    th = threading.Thread(target=sampler, args=(pid, stop, rss), daemon=True)
    th.start()
    s2, t1 = proc_stats(pid), time.monotonic()
    core.patch_namespaced_pod(victim, ns, {"metadata": {"labels": {POD_FAIL_LABEL: "true"},
                                                         "annotations": {POD_FAIL_EXIT_CODE: "137"}}})
    wait(lambda: len(w.running(1)) == n_pods, timeout_s, f"{n_pods} pods of restart attempt 1 Running",
         interval=1)
    restart_running = time.monotonic() - t1
    st2 = wait(lambda: (s := status(custom, ns, "big")).get("phase") == "Running" and s.get("restarts") == 1 and s,
               120, "phase Running with restarts 1")
    restart_status = time.monotonic() - t1
    s3 = proc_stats(pid)
    stop.set()
    th.join(5)
    result.update({
        "gang_restart": {
            "to_all_running_again_s": round(restart_running, 2), "to_status_running_restarts_1_s": round(restart_status, 2),
            "status": {k: st2.get(k) for k in ("phase", "reason", "restarts")},
            "operator_cpu_s": round(s3["cpu_s"] - s2["cpu_s"], 2), "operator_peak_rss_mib": rss.get("peak_rss_mib"),
            "loadavg_after": loadavg(),
        }})
    core.delete_namespace(ns)
    wait(lambda: not _exists(core, ns), 300, f"namespace {ns} gone", interval=2)
    return result


def _exists(core: Any, ns: str) -> bool:
    try:
        core.read_namespace(ns)
        return True
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def run_tp16(cluster: Cluster, timeout_s: float) -> dict:
    api = cluster.api_client()
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    ns = f"tp16-{int(time.time())}"
    new_namespace(core, ns)
    w = Watcher(api, ns)
    time.sleep(1)
    t0 = time.monotonic()
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, big_job("tp16", 32, 16, 1, "tp16"))
    wait(lambda: len(w.running(0)) == 32, timeout_s, "32 pods Running", interval=1)
    to_running = time.monotonic() - t0
    groups: dict[str, set[str]] = defaultdict(set)
    for p in w.running(0):
        groups[p.metadata.labels[TP_LABEL]].add(p.spec.node_name)
    per_host = Counter(next(iter(h)) for h in groups.values() if len(h) == 1)
    st = wait(lambda: (s := status(custom, ns, "tp16")).get("phase") == "Running" and s, 120, "phase Running")
    result = {
        "pods": 32, "tp": 16, "tp_groups": len(groups), "to_all_running_s": round(to_running, 2),
        "groups_on_one_host": sum(1 for h in groups.values() if len(h) == 1),
        "distinct_hosts_used": len({h for hs in groups.values() for h in hs}),
        "max_groups_per_host": max(per_host.values()) if per_host else None,
        "group_hosts": {g: sorted(h) for g, h in sorted(groups.items(), key=lambda kv: int(kv[0]))},
        "status": {k: st.get(k) for k in ("phase", "worldSize", "layout")},
    }
    core.delete_namespace(ns)
    wait(lambda: not _exists(core, ns), 300, f"namespace {ns} gone", interval=2)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=256, help="pods of 8 GPUs in the big job")
    ap.add_argument("--tp16-hosts", type=int, default=16, help="kwok hosts of 32 GPUs for the TP=16 job")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    local = load_cluster_module()
    state = local.up()
    cluster = Cluster(kubeconfig=Path(state["kubeconfig"]), run_dir=local.run_dir(), kubectl_path=Path(state["kubectl"]))
    cluster.apply(CRD_FILE)
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s")
    cluster.apply(nodes("big", args.pods, 8, 251) + nodes("tp16", args.tp16_hosts, 32, 252))
    op = OperatorProcess(cluster, free_port(), {})
    op.start()
    try:
        big = run_big(cluster, op, args.pods, args.timeout)
        print(json.dumps(big), flush=True)
        tp16 = run_tp16(cluster, args.timeout)
        print(json.dumps(tp16), flush=True)
    finally:
        op.stop()
        cluster.kubectl("delete", "nodes", "-l", NODE_LABEL, "--wait=false", check=False)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}), shared with other work",
            "command": " ".join(sys.argv)}
    doc = {"meta": meta, "big": big, "tp16": tp16}
    print(json.dumps(doc, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
