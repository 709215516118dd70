#!/usr/bin/env python3
"""Operator latency at scale on the local control plane (a benchmark, not a test).

Creates N MegatronJobs at once (1 pod x 1 GPU each, running long enough to be observed) and reports
p50/p99 of (a) creation to JobSet created and (b) creation to all of the job's pods Running, plus
the operator's peak RSS (VmHWM). Times are client-side: t0 is when the create call returned;
JobSet ADDED and pod Running are taken from watch streams opened before the burst. Extra kwok GPU
nodes are added for the run (and removed afterwards) so every pod can be scheduled.

    .venv/bin/python bench/operator_latency.py --jobs 100 500
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import kubernetes

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "e2e"), str(ROOT / "operator")]

from k8s import Cluster, load_cluster_module, pod_runtime_annotations  # noqa: E402
from mjob import CRD_FILE, GROUP, PLURAL, VERSION, OperatorProcess, free_port  # noqa: E402


def bench_nodes(count: int) -> list[dict]:
    return [{
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": f"bench-{i:03d}", "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {"type": "kwok", "kubernetes.io/hostname": f"bench-{i:03d}", "megatron-bench": "true"}},
        "spec": {"podCIDR": f"10.250.{i}.0/24", "podCIDRs": [f"10.250.{i}.0/24"],
                 "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": {"cpu": "192", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": "8"},
                   "allocatable": {"cpu": "192", "memory": "2Ti", "pods": "110", "nvidia.com/gpu": "8"}},
    } for i in range(count)]


def job(name: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "MegatronJob", "metadata": {"name": name},
            "spec": {"numNodes": 1, "gpusPerNode": 1,
                     "model": {"numLayers": 2, "hiddenSize": 256, "numAttentionHeads": 4, "seqLength": 256,
                               "vocabSize": 1000},
                     "training": {"microBatchSize": 1, "trainIters": 10},
                     "resources": {"nodeSelector": {"megatron-bench": "true"}},
                     "podMetadata": {"annotations": pod_runtime_annotations(3600)}}}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_one(cluster: Cluster, n: int, timeout_s: float) -> dict:
    api = cluster.api_client()
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    ns = f"bench-{n}-{int(time.time())}"
    core.create_namespace({"metadata": {"name": ns}})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # KCM creates the default ServiceAccount
        try:
            core.read_namespaced_service_account("default", ns)
            break
        except kubernetes.client.ApiException:
            time.sleep(0.5)
    created: dict[str, float] = {}
    jobset_at: dict[str, float] = {}
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
            if p.status and p.status.phase == "Running":
                running_at.setdefault(p.metadata.labels.get("megatron-operator.io/job-name"), time.monotonic())
            if stop.is_set():
                break

    threads = [threading.Thread(target=f, daemon=True) for f in (watch_jobsets, watch_pods)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    names = [f"bench-{i:04d}" for i in range(n)]

    def create(name: str) -> None:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job(name))
        created[name] = time.monotonic()

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(create, names))
    burst_s = time.monotonic() - t0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (len(jobset_at) < n or len(running_at) < n):
        time.sleep(1)
    stop.set()
    to_jobset = [jobset_at[k] - created[k] for k in names if k in jobset_at]
    to_running = [running_at[k] - created[k] for k in names if k in running_at]
    result = {
        "jobs": n, "create_burst_s": round(burst_s, 2),
        "jobsets_created": len(to_jobset), "all_pods_running": len(to_running),
        "to_jobset_p50_s": round(pct(to_jobset, 0.5), 2) if to_jobset else None,
        "to_jobset_p99_s": round(pct(to_jobset, 0.99), 2) if to_jobset else None,
        "to_running_p50_s": round(pct(to_running, 0.5), 2) if to_running else None,
        "to_running_p99_s": round(pct(to_running, 0.99), 2) if to_running else None,
        "to_running_mean_s": round(statistics.mean(to_running), 2) if to_running else None,
    }
    core.delete_namespace(ns)
    return result


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for each burst")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    local = load_cluster_module()
    state = local.up()
    cluster = Cluster(kubeconfig=Path(state["kubeconfig"]), run_dir=local.run_dir(), kubectl_path=Path(state["kubectl"]))
    cluster.apply(CRD_FILE)
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s")
    nodes_needed = max(args.jobs) // 8 + 2
    cluster.apply(bench_nodes(nodes_needed))
    op = OperatorProcess(cluster, free_port(), {})
    op.start()
    results = []
    try:
        for n in args.jobs:
            r = run_one(cluster, n, args.timeout)
            r["operator_peak_rss_mib"] = round(peak_rss_mib(op.proc.pid), 1)
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        op.stop()
        cluster.kubectl("delete", "nodes", "-l", "megatron-bench=true", "--wait=false", check=False)
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine":
            f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
            "command": " ".join(sys.argv)}
    print(json.dumps({"meta": meta, "results": results}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
