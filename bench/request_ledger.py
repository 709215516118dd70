#!/usr/bin/env python3
"""Issue 30's figures from one or more ``operator_latency.py`` results: the per-job request ledger and
the targets, ours against the peer of the same run, as the median and the spread over the runs.

    .venv/bin/python bench/request_ledger.py bench/results/operator_throughput_issue30_*.json

Per job and per verb/resource: the API server's own counters (``apiserver_requests_settled``: from the
first create until the start-up writes stopped, after every pod ran), for each system, and the
operator's own count of what it sent (``operator_requests``). Targets (issue 30):

1. Running p99, ours / peer <= 1;
2. API requests per job, ours <= the peer's + 3 (the job's ServiceAccount, Role and RoleBinding);
3. control-plane CPU per job (kube-apiserver + etcd + JobSet + kube-controller-manager), ours / peer
   <= 1.15, with the operator's own CPU per job beside it;
4. JobSet p99, ours / peer <= 1; the operator's peak RSS < 150 MiB at 500 jobs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

#: Requests that are nobody's job (node heartbeats, leader leases, discovery and metrics reads).
BACKGROUND_RESOURCES = ("leases", "nodes", "nodes/status")
CONTROL_PLANE = ("kube-apiserver", "etcd", "jobset", "kube-controller-manager")
RBAC_PER_JOB = 3


#: "settled": from the first create until the start-up writes stopped after every pod ran (the default;
#: it counts what comes after the pods run, e.g. a status write that says Running); "running": until the
#: last pod ran.
WINDOWS = {"settled": "apiserver_requests_settled", "running": "apiserver_requests"}
window = "settled"


def per_job_requests(result: dict[str, Any]) -> dict[str, float]:
    """{"VERB resource": requests per job} in the chosen window, background left out."""
    reqs = result.get(WINDOWS[window]) or result["apiserver_requests"]
    out = {}
    for key, v in reqs.items():
        verb, _, resource = key.partition(" ")
        if resource in BACKGROUND_RESOURCES or verb in ("GET", "LIST") and resource.startswith("/"):
            continue
        out[key] = v["requests"] / result["jobs"]
    return out


def cp_cpu_per_job_ms(result: dict[str, Any]) -> float:
    cpu = (result.get("component_cpu_settled_s") if window == "settled" else None) or result["component_cpu_s"]
    return 1000 * sum(cpu.get(c, 0.0) for c in CONTROL_PLANE) / result["jobs"]


def controller_cpu_s(result: dict[str, Any]) -> float:
    return (result.get("controller_cpu_settled_s") if window == "settled" else None) or result["controller_cpu_s"]


def figures(run: dict[str, Any], n: int) -> dict[str, float] | None:
    """The targets' figures of one run at one size; None when ours or the peer is missing."""
    by = {r["system"]: r for r in run["results"] if r["jobs"] == n}
    ours, peer = by.get("ours"), by.get("peer")
    if not ours or not peer:
        return None
    ours_req, peer_req = sum(per_job_requests(ours).values()), sum(per_job_requests(peer).values())
    out = {
        "running_p99_ours_s": ours["to_running_p99_s"], "running_p99_peer_s": peer["to_running_p99_s"],
        "running_p99_ratio": ours["to_running_p99_s"] / peer["to_running_p99_s"],
        "requests_per_job_ours": ours_req, "requests_per_job_peer": peer_req,
        "requests_margin": peer_req + RBAC_PER_JOB - ours_req,
        "cp_cpu_ms_per_job_ours": cp_cpu_per_job_ms(ours), "cp_cpu_ms_per_job_peer": cp_cpu_per_job_ms(peer),
        "cp_cpu_ratio": cp_cpu_per_job_ms(ours) / cp_cpu_per_job_ms(peer),
        "operator_cpu_ms_per_job": 1000 * controller_cpu_s(ours) / n,
        "peer_cpu_ms_per_job": 1000 * controller_cpu_s(peer) / n,
        "jobset_p99_ratio": ours["to_jobset_p99_s"] / peer["to_jobset_p99_s"],
        "ours_peak_rss_mib": ours["controller_peak_rss_mib"],
    }
    if ours.get("to_status_running_p99_s") is not None:
        out["status_running_p99_ours_s"] = ours["to_status_running_p99_s"]
        out["status_running_p99_over_peer_pods"] = ours["to_status_running_p99_s"] / peer["to_running_p99_s"]
    if "floor" in by:
        out["running_p99_floor_s"] = by["floor"]["to_running_p99_s"]
        out["cp_cpu_ms_per_job_floor"] = cp_cpu_per_job_ms(by["floor"])
    return out


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f} (1 run)"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}, {len(values)} runs)"


def ledger_table(runs: list[dict[str, Any]], n: int) -> list[str]:
    """Requests per job by verb/resource, median over the runs, for every system, and the operator's own."""
    systems = ["floor", "ours", "peer"]
    per: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    own: list[dict[str, float]] = []
    for run in runs:
        for r in run["results"]:
            if r["jobs"] == n and r["system"] in per:
                per[r["system"]].append(per_job_requests(r))
                if r["system"] == "ours" and r.get("operator_requests"):
                    own.append({k: v / n for k, v in r["operator_requests"].items()})
    keys = sorted({k for rows in per.values() for row in rows for k in row} | {k for row in own for k in row},
                  key=lambda k: (k.split(" ", 1)[1], k))
    present = [s for s in systems if per[s]]

    def med(rows: list[dict[str, float]], key: str) -> str:
        vals = [row.get(key, 0.0) for row in rows]
        m = statistics.median(vals) if vals else 0.0
        return f"{m:.2f}" if m >= 0.005 else "-"

    lines = [f"| verb resource | {' | '.join(present)} | the operator's own count |",
             "|---|" + "---|" * (len(present) + 1)]
    for key in keys:
        cells = [med(per[s], key) for s in present] + [med(own, key)]
        if any(c != "-" for c in cells):  # rows under 0.005 per job everywhere: the previous burst's teardown
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    totals = " | ".join(f"**{statistics.median([sum(row.values()) for row in per[s]]):.2f}**" for s in present)
    own_total = f"**{statistics.median([sum(row.values()) for row in own]):.2f}**" if own else "-"
    lines.append(f"| total | {totals} | {own_total} |")
    return lines


def watch_cost_lines(runs: list[dict[str, Any]]) -> list[str]:
    """CPU per watch event: the operator's (its settled CPU over the events its handlers received) and, where the
    run had --watch-floor, bench/watch_floor.py's (the same three watches without kopf, same burst)."""
    lines = []
    for run in runs:
        for r in run["results"]:
            if r["system"] != "ours" or not r.get("operator_watch_events"):
                continue
            events = sum(r["operator_watch_events"].values())
            line = (f"| {r['jobs']} | {events / r['jobs']:.1f} | "
                    f"{1000 * controller_cpu_s(r) / events:.2f} |")
            floor = r.get("watch_floor")
            floor_events = sum(floor["events_settled"].values()) if floor else 0
            if floor_events:
                line += f" {floor_events / r['jobs']:.1f} | {1000 * floor['cpu_settled_s'] / floor_events:.2f} |"
            else:
                line += " - | - |"
            lines.append(line)
    if not lines:
        return []
    return ["| jobs | operator: watch events per job | operator: CPU ms per event | watch floor: events per job | "
            "watch floor: CPU ms per event |", "|---|---|---|---|---|", *lines, ""]


def profile_lines(runs: list[dict[str, Any]], n: int) -> list[str]:
    """kube-apiserver's CPU by category (its own profile, --apiserver-profile), ms per job, median over the runs,
    for each system; the last column is ours minus the peer."""
    per: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        for r in run["results"]:
            cpu = (r.get("apiserver_profile") or {}).get("cpu_s")
            if r["jobs"] == n and cpu:
                per.setdefault(r["system"], []).append({k: 1000 * v / n for k, v in cpu.items()})
    if not per:
        return []
    systems = [s for s in ("floor", "ours", "peer") if s in per]
    cats = list(next(iter(per.values()))[0])
    med = {s: {c: statistics.median(row.get(c, 0.0) for row in per[s]) for c in cats} for s in systems}
    diff = "ours" in med and "peer" in med
    lines = ["kube-apiserver CPU by category, ms per job (its own profile):", "",
             "| category | " + " | ".join(systems) + (" | ours - peer |" if diff else " |"),
             "|---|" + "---|" * (len(systems) + diff)]
    for c in cats + ["total"]:
        vals = {s: (sum(med[s].values()) if c == "total" else med[s][c]) for s in systems}
        if c != "total" and all(v < 0.05 for v in vals.values()):
            continue
        cells = [f"{vals[s]:.1f}" for s in systems] + ([f"{vals['ours'] - vals['peer']:+.1f}"] if diff else [])
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines + [""]


def report(runs: list[dict[str, Any]]) -> str:
    sizes = sorted({r["jobs"] for run in runs for r in run["results"]})
    out = ["runs: " + ", ".join(f"{run['meta']['date']} at {run['meta']['commit']}" for run in runs), ""]
    for n in sizes:
        rows = [f for run in runs if (f := figures(run, n)) is not None]
        if not rows:
            continue
        out.append(f"## {n} jobs")
        out.append("")
        out.append("| figure | median (min-max) |")
        out.append("|---|---|")
        for key in rows[0]:
            vals = [r[key] for r in rows if key in r]
            out.append(f"| {key} | {spread(vals)} |")
        out.append("")
        out.extend(ledger_table(runs, n))
        out.append("")
        out.extend(profile_lines(runs, n))
    out.extend(watch_cost_lines(runs))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="operator_latency.py JSON files (one per run)")
    ap.add_argument("--window", choices=["settled", "running"], default="settled",
                    help="count requests until the start-up writes settled (default) or until the last pod ran")
    args = ap.parse_args()
    global window
    window = args.window
    runs = [json.loads(Path(p).read_text()) for p in args.results]
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
