#!/usr/bin/env python3
"""What the API server's CRD validator spends on one MegatronJob, per CRD variant (a benchmark, not a test).

Runs ``bench/cel_cost`` (Go): apiextensions-apiserver's own CEL validator, at the version the test control
plane is built from (e2e/cluster/versions.env), outside a server. For each variant, job and mode it prints
the CPU microseconds and the KiB and objects allocated per validation. The allocations are deterministic:
they compare two CRDs exactly on a busy 2-core machine where the server's own CPU figures move by 10 %
(bench/crd_write_cost.py measures those, on the real server). Allocation is what the server's garbage
collector pays for later.

Modes: ``create`` (the object alone) and ``status`` (an update that changes only status: every status write,
the operator's and the trainer's progress reports; the status subresource keeps the old spec, and every spec
rule runs again).

Jobs: ``bench`` (the latency benchmark's MegatronJob: few fields, no preset) and ``llama`` (a Llama-3-8B
preset on 16 GPUs with checkpoint and data PVCs).

Variants as in crd_variants.py: ``shipped`` (crds/ in the working tree), ``no-cel``, ``NAME=PATH``,
``NAME=git:REV``. ``--per-rule VARIANT`` also prints what each spec-level rule alone allocates (create mode,
llama job), the most expensive first.

    .venv/bin/python bench/cel_validator_cost.py --variants main=git:HEAD shipped \\
        --out bench/results/cel_validator_cost.json

The tool is built into the e2e cache (``$MEGATRON_OPERATOR_CACHE``, else ~/.cache/megatron-operator) with
its Go module cache, so a machine that has built the test control plane builds it offline.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "e2e"), str(ROOT / "operator"), str(ROOT / "contract")]

from crd_variants import variant_crd  # noqa: E402
from crd_write_cost import git_commit  # noqa: E402
from k8s import load_cluster_module  # noqa: E402
from operator_latency import megatron_job  # noqa: E402

CLUSTER = load_cluster_module()  # e2e/cluster/cluster.py: versions(), cache_dir()

TOOL_DIR = ROOT / "bench" / "cel_cost"
JOBS = ("bench", "llama")
MODES = ("create", "status")


def tool_module_version() -> str:
    """The apiextensions-apiserver version bench/cel_cost/go.mod builds against."""
    for line in (TOOL_DIR / "go.mod").read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["k8s.io/apiextensions-apiserver"]:
            return parts[1]
    raise SystemExit("bench/cel_cost/go.mod does not require k8s.io/apiextensions-apiserver")


def build_tool() -> Path:
    kube = CLUSTER.versions()["KUBE_VERSION"]
    want = "v0." + kube.split(".", 1)[1]
    if tool_module_version() != want:
        raise SystemExit(f"bench/cel_cost/go.mod builds apiextensions-apiserver {tool_module_version()}, "
                         f"the test control plane Kubernetes {kube} ({want}): update go.mod")
    cache = CLUSTER.cache_dir()
    gover = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout.strip()
    out = cache / "bin" / f"cel-cost-{kube}" / "cel_cost"
    env = dict(os.environ, GOMODCACHE=str(cache / "gomod"), GOCACHE=str(cache / gover / "go-build"),
               GOFLAGS="-mod=readonly", GOTOOLCHAIN="local", CGO_ENABLED="0",
               GOPROXY=os.environ.get("GOPROXY_OVERRIDE", "https://proxy.golang.org"))
    subprocess.run(["go", "build", "-trimpath", "-o", str(out), "."], cwd=TOOL_DIR, env=env, check=True)
    return out


def job(name: str) -> dict[str, Any]:
    doc = megatron_job("cel-cost")
    doc["metadata"]["namespace"] = "default"
    if name == "llama":
        doc["spec"] = {
            "numNodes": 2, "gpusPerNode": 8, "model": {"preset": "llama3-8b"},
            "parallelism": {"tensor": 2, "pipeline": 2},
            "training": {"microBatchSize": 1, "globalBatchSize": 64, "trainIters": 1000},
            "checkpoint": {"pvc": "ckpt", "interval": 100},
            "data": {"pvc": "data", "paths": [{"prefix": "corpus/text_document"}],
                     "tokenizer": {"type": "HuggingFace", "path": "tokenizer"}},
        }
    return doc


def run_tool(tool: Path, crd: dict, doc: dict, mode: str, n: int, repeats: int, tmp: Path) -> dict[str, Any]:
    crd_file, obj_file = tmp / "crd.yaml", tmp / "obj.json"
    crd_file.write_text(yaml.safe_dump(crd))
    obj_file.write_text(json.dumps(doc))
    runs = []
    for _ in range(repeats):
        proc = subprocess.run([str(tool), "-crd", str(crd_file), "-obj", str(obj_file), "-mode", mode, "-n", str(n)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"cel_cost failed: {proc.stderr.strip()}")
        runs.append(json.loads(proc.stdout))
    best = min(runs, key=lambda r: r["us_per_validation"])
    return {**best, "us_per_validation_all": [round(r["us_per_validation"], 1) for r in runs]}


def spec_rules_variant(crd: dict, rules: list[dict]) -> dict:
    out = copy.deepcopy(crd)
    out["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"] = rules
    return out


def per_rule(tool: Path, crd: dict, n: int, tmp: Path) -> list[dict[str, Any]]:
    """KiB each spec-level rule allocates alone on create (llama job), over the same CRD with one rule
    that reads nothing (``true``): a rule's own field reads, without the validator's fixed cost."""
    doc = job("llama")
    spec_rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    base = run_tool(tool, spec_rules_variant(crd, [{"rule": "true"}]), doc, "create", n, 1, tmp)["kib_allocated_per_validation"]
    out = []
    for rule in spec_rules:
        kib = run_tool(tool, spec_rules_variant(crd, [rule]), doc, "create", n, 1, tmp)["kib_allocated_per_validation"]
        out.append({"kib": round(kib - base, 1), "rule": rule["rule"]})
    return sorted(out, key=lambda r: -r["kib"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["shipped"], help="shipped, no-cel, NAME=PATH, NAME=git:REV")
    ap.add_argument("--n", type=int, default=1000, help="validations per timing")
    ap.add_argument("--repeats", type=int, default=3, help="timings per figure (the fastest is kept)")
    ap.add_argument("--per-rule", metavar="VARIANT", help="also attribute the spec rules of this variant")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    tool = build_tool()
    crds = {}
    for v in args.variants:
        name, _, spec = v.partition("=")
        crds[name] = variant_crd(name, spec or None)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print("| variant | job | mode | us per validation (fastest of runs) | KiB allocated | objects allocated |")
        print("|---|---|---|---|---|---|")
        for name, crd in crds.items():
            for j in JOBS:
                for mode in MODES:
                    r = {"variant": name, "job": j, **run_tool(tool, crd, job(j), mode, args.n, args.repeats, tmp)}
                    if r.get("validation_error"):
                        raise SystemExit(f"{name}/{j}: the rules refuse the job: {r['validation_error']}")
                    rows.append(r)
                    print(f"| {name} | {j} | {mode} | {r['us_per_validation']:.0f} "
                          f"({', '.join(f'{x:.0f}' for x in r['us_per_validation_all'])}) | "
                          f"{r['kib_allocated_per_validation']:.0f} | {r['objects_allocated_per_validation']:.0f} |")
        rules = per_rule(tool, crds[args.per_rule], args.n // 4, tmp) if args.per_rule else None
    if rules:
        print(f"\nspec rules of {args.per_rule}, KiB each allocates alone (create, llama job):")
        for r in rules[:25]:
            print(f"{r['kib']:8.1f}  {r['rule'][:150]}")
    if args.out:
        meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": git_commit(),
                "machine": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
                "command": "bench/cel_validator_cost.py " + " ".join(sys.argv[1:]),
                "validator": f"k8s.io/apiextensions-apiserver {tool_module_version()} (cel.Validator, in-process)"}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": rows, "per_rule": rules}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
