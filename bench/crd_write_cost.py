#!/usr/bin/env python3
"""What one MegatronJob write costs the API server, per CRD variant (a benchmark, not a test).

On the local control plane (``e2e/cluster``, started if it is not up), for each CRD variant: install
it, then send ``--requests`` sequential requests of each kind from one client and read two figures
around them:

- the CPU seconds (utime + stime from ``/proc``) of kube-apiserver and etcd, minus their idle rate
  measured just before (the control plane's own background work), per request;
- the API server's own ``apiserver_cel_evaluation_duration_seconds`` (the time its CEL validator
  spent on each object, all rules together), per request.

Kinds of request: ``create`` (POST megatronjobs), ``status`` (server-side apply of the status
subresource with one changed field each time, through the operator's own client call),
``status-merge`` (the same write as a JSON merge patch) and ``spec`` (a merge patch of a mutable spec
field, ``suspend``).

Variants: ``shipped`` (crds/ as in the working tree), ``no-cel`` (the same schema without any
``x-kubernetes-validations``), any ``NAME=PATH`` of another CRD file, and ``NAME=git:REV``: the CRD
of an earlier commit (``crds/megatron-operator.io_megatronjobs.yaml`` at REV, read with git show).
Give variants more than once to alternate them (``main=git:REV shipped main=git:REV shipped``).

    .venv/bin/python bench/crd_write_cost.py --variants shipped no-cel old=/tmp/old.yaml \\
        --out bench/results/crd_write_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import kubernetes

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "e2e"), str(ROOT / "bench"), str(ROOT / "operator"), str(ROOT / "contract")]

import operator_latency  # noqa: E402
from crd_variants import variant_crd  # noqa: E402
from k8s import Cluster, load_cluster_module  # noqa: E402
from megatron_operator.kube import Kube  # noqa: E402
from mjob import CRD_FILE, GROUP, PLURAL, VERSION  # noqa: E402
from operator_latency import component_cpu, megatron_job, new_namespace  # noqa: E402

CRD_NAME = f"{PLURAL}.{GROUP}"
CEL_METRIC = "apiserver_cel_evaluation_duration_seconds"


def control_plane_cpu(run_dir: Path) -> float:
    """CPU seconds so far of kube-apiserver and etcd together (of the cluster in ``run_dir`` only)."""
    cpu = component_cpu(run_dir)
    return cpu.get("kube-apiserver", 0.0) + cpu.get("etcd", 0.0)


def cel_seconds(cluster: Cluster) -> tuple[float, float]:
    """(sum, count) of the API server's CEL evaluation histogram, all label sets together."""
    s = c = 0.0
    for line in cluster.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if line.startswith(CEL_METRIC + "_sum"):
            s += float(line.rsplit(" ", 1)[1])
        elif line.startswith(CEL_METRIC + "_count"):
            c += float(line.rsplit(" ", 1)[1])
    return s, c


def install(cluster: Cluster, crd: dict) -> None:
    """Replace the CRD and wait until the API server serves the new schema (a dry-run probe)."""
    cluster.apply(crd)
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    want = json.dumps(crd["spec"]["versions"][0]["schema"], sort_keys=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
        if json.dumps(got["spec"]["versions"][0]["schema"], sort_keys=True) == want:
            break
        time.sleep(0.5)
    time.sleep(3)  # the API server rebuilds the CR handler (and compiles the rules) on its next request


def idle_rate(run_dir: Path, seconds: float = 5.0) -> float:
    c0, t0 = control_plane_cpu(run_dir), time.monotonic()
    time.sleep(seconds)
    return (control_plane_cpu(run_dir) - c0) / (time.monotonic() - t0)


def measure(cluster: Cluster, label: str, n: int, send) -> dict:
    rate = idle_rate(cluster.run_dir)
    cel0 = cel_seconds(cluster)
    c0, t0 = control_plane_cpu(cluster.run_dir), time.monotonic()
    for i in range(n):
        send(i)
    wall = time.monotonic() - t0
    cpu = control_plane_cpu(cluster.run_dir) - c0 - rate * wall
    cel1 = cel_seconds(cluster)
    return {"request": label, "requests": n, "cpu_ms_per_request": round(1000 * cpu / n, 2),
            "cel_ms_per_request": round(1000 * (cel1[0] - cel0[0]) / n, 3),
            "cel_evaluations": int(cel1[1] - cel0[1]), "idle_cpu_per_s": round(rate, 3),
            "wall_ms_per_request": round(1000 * wall / n, 2)}


def run_variant(cluster: Cluster, name: str, crd: dict, n: int) -> list[dict]:
    install(cluster, crd)
    api = cluster.api_client()
    core = kubernetes.client.CoreV1Api(api)
    custom = kubernetes.client.CustomObjectsApi(api)
    kube = Kube(api)
    ns = f"crd-cost-{name}-{int(time.time())}".lower().replace("_", "-")[:60]
    new_namespace(core, ns)
    try:
        # warm up: the handler, the compiled programs, the client's connection
        for i in range(10):
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, megatron_job(f"warm-{i}"))
        target = "warm-0"

        def create(i: int) -> None:
            custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, megatron_job(f"job-{i:04d}"))

        def status(i: int) -> None:  # the operator's own call
            kube.apply_status(ns, target, {"phase": "Running", "message": f"write {i}", "observedGeneration": 1})

        def status_merge(i: int) -> None:  # the same status write as a JSON merge patch instead of an apply
            kube._call("PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{target}/status",
                       body={"status": {"phase": "Running", "message": f"merge {i}", "observedGeneration": 1}},
                       content_type="application/merge-patch+json", query=[("fieldManager", "crd-write-cost")])

        def spec(i: int) -> None:
            custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, target,
                                                  {"spec": {"suspend": bool(i % 2)}})

        for i in range(10):
            status(i)
        rows = [measure(cluster, "create", n, create), measure(cluster, "status", n, status),
                measure(cluster, "status-merge", n, status_merge), measure(cluster, "spec", n, spec)]
        for r in rows:
            r["variant"] = name
            print(json.dumps(r), flush=True)
        return rows
    finally:
        core.delete_namespace(ns)


def git_commit() -> str:
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "crds", "operator"],
                           capture_output=True, text=True).stdout.strip()
    return operator_latency.git_commit() + ("+uncommitted" if dirty else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["shipped", "no-cel"],
                    help="shipped, no-cel, NAME=PATH of a CRD file, or NAME=git:REV (the CRD at commit REV)")
    ap.add_argument("--requests", type=int, default=200, help="sequential requests of each kind")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    local = load_cluster_module()
    state = local.up()
    cluster = Cluster(kubeconfig=Path(state["kubeconfig"]), run_dir=local.run_dir(),
                      kubectl_path=Path(state["kubectl"]))
    rows: list[dict] = []
    try:
        for v in args.variants:
            name, _, path = v.partition("=")
            rows += run_variant(cluster, name, variant_crd(name, path or None), args.requests)
    finally:
        cluster.apply(CRD_FILE)  # leave the shipped CRD installed
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
            "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
            "command": " ".join(sys.argv),
            "method": "sequential requests from one client; kube-apiserver + etcd CPU from /proc minus the idle "
                      "rate measured for 5 s before; CEL time from the API server's own histogram"}
    doc = {"meta": meta, "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
