#!/usr/bin/env python3
"""GPU end-to-end suite for the trainer: one command per device call, any GPU count.

    python3 e2e/gpu/suite.py --out $OUT --gpus 2 --only layouts,resume,sigterm,bench,memory
    python3 e2e/gpu/suite.py --list     # every scenario, one line each

On a lent device machine through e2e/gpu/run_on_device.sh, which installs the carried wheels first. Each
scenario launches the trainer as the pods run it (`torchrun ... -m megatron_trainer <Megatron-LM flags>`,
or the rendered pods' own command) and checks what it must. The scenarios come in families, each
documented in its module's docstring:

  correctness.py  probe, indexed, layouts, resume, sigterm, reshard, deterministic, pods, preempt,
                  tensorboard: trains, checkpoints, stops and resumes as it should
  performance.py  bench, perf, memory, detcost, objbench, collectives, rope, disk: speed, memory and I/O
                  against the peers and the hardware
  mlm_compare.py  threeway, stepdump: ours against Megatron-LM's own pretrain_gpt.py
  moe.py          moe_qwen3, moe_mixtral: mixture-of-experts shapes, ours against Megatron-LM (issue 50);
                  moe_resume: kill -9 and a bit-exact resume at EP > 1
  scale.py        goodput, diskfull: what a job loses to saves, starts, failures and layout changes; a full
                  checkpoint volume
  hf.py           hf_logits, hf_moe_logits, hf_train, hf_bench, hf_pods, hf_store: Hugging Face import and
                  export
  sft.py          sft_reverse, sft_moe, sft_bench, sft_pods, sft_sigterm: supervised fine-tuning
  te.py           te_paths, te_bench, te_hf_logits, te_fp8: the Transformer Engine path (issue 59; TE installed
                  per ../shared/bench/te/README.md and on PYTHONPATH): its kernels and refusals, ours on TE and local
                  against Megatron-LM on TE and local, the HF import's logits on TE's spec, FP8
  harness.py      what the families share (Run, trainer_args, MODELS, checks, peers, pods_job, the
                  outputs); no scenario

Without --only every scenario runs, in the order of --list. A new family is a module with a SCENARIOS
table (name -> harness.Scenario) and one line in FAMILIES in suite.py.

--object-store: checkpoints of layouts/resume/sigterm/deterministic go to an S3 server on loopback
(versitygw, .run/versitygw.gz, built by `e2e/cluster/cluster.py build versitygw`) through
multi-storage-client (its wheels in .whl), as s3://suite/<run>; credentials from a shared-credentials
file (AWS_SHARED_CREDENTIALS_FILE), as in the pods (docs/object-storage.md).

Results: $OUT/results.json, $OUT/table.txt, $OUT/logs.tar.gz. A compact table is printed last.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import time
import traceback
from pathlib import Path

import correctness
import mlm_compare
import moe
import performance
import scale
import te
from correctness import POD_JOBS, layouts_for
from harness import (
    DEADLINE,
    LOGS,
    MATH_DETERMINISTIC_ENV,
    MODELS,
    OURS_EXTRA,
    WORK,
    Scenario,
    flush_outputs,
    start_object_store,
)
from mlm_compare import MLM_VARIANTS, THREEWAY, THREEWAY_VARIANTS
from moe import MOE_LAYOUTS
from performance import MEMORY_CONFIGS, PERF_VARIANTS, bench_layouts
from te import FP8_RECIPES, HF_ARCHS, HF_VARIANTS, TE_VARIANTS


def optional_family(name: str):
    """The family's module, or None after a line saying why it did not import: hf and sft stay optional, as before
    the split (--only naming one of their scenarios then records a KeyError for it alone)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:  # pragma: no cover - reported by --only hf_*/sft_*
        print(f"{name} scenarios unavailable: {e}", file=sys.stderr)
        return None


# The scenario families, each a module with a SCENARIOS table: a new family is its module and one line here.
FAMILIES = [correctness, performance, mlm_compare, scale, moe, optional_family("hf"), optional_family("sft"), te]

# The order a run without --only takes (and --list shows): the suite's order before the families were split out,
# so that indexed's data and layouts' reference runs come before the scenarios that use them (resume, sigterm,
# reshard, pods). A family's scenarios not named here follow, in the order of FAMILIES.
ORDER = ("probe", "indexed", "layouts", "resume", "sigterm", "reshard", "bench", "memory", "perf", "pods", "preempt",
         "tensorboard", "deterministic", "detcost", "objbench", "threeway", "collectives", "rope", "disk",
         "hf_logits", "hf_train", "hf_bench", "hf_pods", "hf_store", "sft_reverse", "sft_bench", "sft_pods",
         "sft_sigterm", "stepdump")


def registry(families, order) -> dict[str, Scenario]:
    """Every family's scenarios by name, in `order` first; a name in two families is a mistake."""
    found: dict[str, Scenario] = {}
    for family in filter(None, families):
        for name, scenario in family.SCENARIOS.items():
            if name in found:
                raise ValueError(f"scenario {name!r} is in two families ({family.__name__} and another)")
            found[name] = scenario
    return {**{name: found[name] for name in order if name in found}, **found}


SCENARIOS = registry(FAMILIES, ORDER)


class ListScenarios(argparse.Action):
    """--list: every scenario with its one line, then exit (like --help, it needs no --out)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        width = max(map(len, SCENARIOS))
        print("\n".join(f"{name:{width}s}  {s.summary}" + (f" [{s.min_gpus}+ GPUs]" if s.min_gpus > 1 else "")
                        for name, s in SCENARIOS.items()))
        parser.exit()


def skip_reason(scenario: Scenario | None, gpus: int, layouts: int, seconds_left: float) -> str | None:
    """Why a scenario does not run in this call, or None. Too few GPUs for its fixed layouts: two ranks on one GPU
    hang in NCCL's set-up instead of failing (hf_logits did on 1 GPU, 2026-11-28). Too little time: its rough
    seconds per layout times `layouts` would end after the deadline."""
    if scenario is not None and gpus < scenario.min_gpus:
        return f"needs {scenario.min_gpus} GPUs, this call has {gpus}"
    need = (scenario.seconds if scenario is not None else 60) * layouts
    if need > seconds_left:
        return f"deadline (needs ~{need} s)"
    return None


def te_ctx(args) -> dict:
    """The te family's settings (e2e/gpu/te.py) from the command line."""
    def names(value: str) -> tuple[str, ...]:
        return tuple(filter(None, value.split(",")))

    return {"te_backends": names(args.te_backends), "te_model": args.te_model, "te_iters": args.te_iters,
            "te_variants": names(args.te_variants), "te_hf_variants": names(args.te_hf_variants),
            "te_hf_archs": names(args.te_hf_archs), "te_fp8_model": args.te_fp8_model,
            "te_fp8_iters": args.te_fp8_iters, "te_fp8_recipes": names(args.te_fp8_recipes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--list", action=ListScenarios, help="print every scenario with one line on what it checks, "
                    "and exit")
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--memory", default=",".join(c[0] for c in MEMORY_CONFIGS), help="memory configs to run")
    ap.add_argument("--layouts", default=None, help="layouts to train (default: all for the GPU count)")
    ap.add_argument("--resume-on", default=None, help="reference layouts for the kill -9 test (default: all)")
    ap.add_argument("--bench-on", default=None, help="benchmark layouts (default: all for the GPU count)")
    ap.add_argument("--model", default="small", choices=sorted(MODELS), help="model of layouts/resume/sigterm/reshard")
    ap.add_argument("--bench-model", default="gpt1b", choices=sorted(MODELS), help="model of the benchmark")
    ap.add_argument("--reshard-from", default=None, help="layout whose checkpoint is resharded (default tpN)")
    ap.add_argument("--reshard-to", default=None, help="layouts to resume it under (default ppN,dpN)")
    ap.add_argument("--perf-variants", default=None, help=f"perf variants (default: all of {sorted(PERF_VARIANTS)})")
    ap.add_argument("--perf-profile", default="", help="perf variants to profile over iteration 22")
    ap.add_argument("--bench-variant", default="foreach",
                    help="PERF_VARIANTS entry ours runs in the benchmark, or 'auto': the fastest one perf measured")
    ap.add_argument("--ours-extra", default="", help="flags appended to every trainer command line (space separated)")
    ap.add_argument("--pod-jobs", default="", help=f"e2e/gpu/jobs of the pods scenario (default {','.join(POD_JOBS)}; "
                    "llama-1gpu runs on one GPU)")
    ap.add_argument("--threeway", default="tp2",
                    help=f"layouts of the threeway scenario, comma-separated, of {sorted(THREEWAY)}; LAYOUT:MODEL "
                    "gives a layout its own model")
    ap.add_argument("--threeway-variants", default="", help="extra variants of ours in threeway, comma-separated, of "
                    f"{sorted(THREEWAY_VARIANTS)} (what each changes: THREEWAY_VARIANTS in e2e/gpu/mlm_compare.py)")
    ap.add_argument("--threeway-mlm-variants", default="", help="extra runs of Megatron-LM in threeway, comma-separated, "
                    f"of {sorted(MLM_VARIANTS)} (MLM_VARIANTS in e2e/gpu/mlm_compare.py)")
    ap.add_argument("--threeway-profile", default="", help="variants of ours in threeway (default, eager, overlap) to "
                    "profile over iteration 22 on the first and last rank")
    ap.add_argument("--threeway-fallback", default=None, choices=sorted(MODELS),
                    help="threeway's model where Megatron-LM runs out of memory on --bench-model")
    ap.add_argument("--goodput-gbs", type=int, default=None, help="goodput's global batch (default 16)")
    ap.add_argument("--goodput-interval", type=int, default=None, help="goodput's save interval (default 10)")
    ap.add_argument("--diskfull-mib", type=int, default=None, help="diskfull's volume, MiB (default 700)")
    ap.add_argument("--threeway-gbs", type=int, default=None,
                    help="threeway's global batch (default: 4 micro-batches per pipeline, or the model's accum)")
    ap.add_argument("--threeway-iters", type=int, default=None,
                    help="iterations of each threeway run (default 26; the median is over 4 .. N-6)")
    ap.add_argument("--threeway-skip-mlm", action="store_true",
                    help="threeway without Megatron-LM (ours alone: a profile or a variant), recorded as not run")
    ap.add_argument("--threeway-skip-overlap", action="store_true",
                    help="at DP > 1, leave out the run of ours with Megatron-LM's overlap flags (ours' default only)")
    ap.add_argument("--stepdump", default="dp1:llama1b",
                    help="layout:model[:Megatron-LM variant[:ours' variant]] of the stepdump scenario, comma-separated "
                         "(layouts as --threeway's; e2e/gpu/stepdump.py)")
    ap.add_argument("--moe-layout", default="ep2", choices=sorted(MOE_LAYOUTS),
                    help="layout of moe_qwen3/moe_mixtral (ep2: 2 GPUs; tp2ep2, ep4: 4 GPUs)")
    ap.add_argument("--moe-iters", type=int, default=None, help="iterations of each MoE run (default 15)")
    ap.add_argument("--moe-warmup", type=int, default=None,
                    help="first iterations of each MoE run left out of its timing (default 5)")
    ap.add_argument("--moe-layers", type=int, default=None, help="layers of the MoE shape (default: moe.MOE_MODELS')")
    ap.add_argument("--moe-gbs", type=int, default=None, help="global batch of the MoE runs (default 32)")
    ap.add_argument("--moe-sequential", default="auto", choices=("auto", "on", "off"),
                    help="ours with SequentialMLP experts as a third run: auto where the deadline leaves time")
    ap.add_argument("--moe-skip-mlm", action="store_true", help="MoE scenarios without Megatron-LM (recorded as not run)")
    ap.add_argument("--moe-levers", default=None,
                    help="comma-separated variants of moe_levers, in order (moe.LEVERS; default all)")
    ap.add_argument("--moe-only", default=None,
                    help="comma-separated: the layouts moe_resume runs (ep2, tp2ep2, ep4) and its variants "
                         "(softmax_aux_loss, sigmoid_expert_bias; none named: both), hf_moe_logits' layouts "
                         "(tp1ep1-grouped, tp1ep2-grouped, tp1ep2-sequential, tp2ep1-grouped, tp2ep2-grouped, "
                         "tp1ep4-grouped); default every one the GPU count holds")
    ap.add_argument("--perf-tp", type=int, default=None, help="TP of the perf runs (default: all GPUs)")
    ap.add_argument("--deadline-s", type=float, default=540, help="stop starting scenarios after this; runs already started are cut OVERRUN_S (30 s) "
                    "after it, so keep it at least 60 s under the device call's limit (wheel install, exit)")
    ap.add_argument("--stop-on-failure", default="layouts", help="scenarios whose failure ends the suite")
    ap.add_argument("--deterministic-attention", choices=("flash", "math"), default="flash",
                    help="MEGATRON_TRAINER_DETERMINISTIC_ATTENTION for every run of the deterministic scenario")
    ap.add_argument("--object-store", action="store_true",
                    help="checkpoints to versitygw on loopback through multi-storage-client (issue 33)")
    ap.add_argument("--objbench-model", default="gpt1b", choices=sorted(MODELS), help="model of objbench")
    ap.add_argument("--te-backends", default="flash,unfused", help="te_paths' --attention-backend values (each must "
                    "train on Transformer Engine; local is always tried and must be refused)")
    ap.add_argument("--te-model", default="llama_mha4b", choices=sorted(MODELS), help="te_bench's model (issue 59's "
                    "3.8B MHA Llama)")
    ap.add_argument("--te-iters", type=int, default=26, help="iterations of each te_bench run (median over 4 .. N-6)")
    ap.add_argument("--te-variants", default="", help=f"extra runs of ours in te_bench, of {sorted(TE_VARIANTS)}")
    ap.add_argument("--te-hf-variants", default=",".join(HF_VARIANTS),
                    help=f"te_hf_logits' TF32 settings, of {list(HF_VARIANTS)} (HF_VARIANTS in e2e/gpu/te.py)")
    ap.add_argument("--te-hf-archs", default=",".join(HF_ARCHS), help="te_hf_logits' fixtures (tests/fixtures/hf)")
    ap.add_argument("--te-fp8-model", default="llama8b_l16", choices=sorted(MODELS), help="te_fp8's model")
    ap.add_argument("--te-fp8-iters", type=int, default=20, help="iterations of each te_fp8 run")
    ap.add_argument("--te-fp8-recipes", default=",".join(FP8_RECIPES), help=f"te_fp8's recipes, of {list(FP8_RECIPES)}")
    args = ap.parse_args()
    unknown = set(filter(None, args.threeway_variants.split(","))) - set(THREEWAY_VARIANTS)
    if unknown:
        ap.error(f"--threeway-variants: unknown {sorted(unknown)}; known: {sorted(THREEWAY_VARIANTS)}")
    unknown = set(filter(None, args.threeway_mlm_variants.split(","))) - set(MLM_VARIANTS)
    if unknown:
        ap.error(f"--threeway-mlm-variants: unknown {sorted(unknown)}; known: {sorted(MLM_VARIANTS)}")
    for flag, given, known in (("--te-variants", args.te_variants, TE_VARIANTS),
                               ("--te-hf-variants", args.te_hf_variants, HF_VARIANTS),
                               ("--te-fp8-recipes", args.te_fp8_recipes, FP8_RECIPES),
                               ("--te-backends", args.te_backends, ("flash", "fused", "unfused", "auto"))):
        unknown = set(filter(None, given.split(","))) - set(known)
        if unknown:
            ap.error(f"{flag}: unknown {sorted(unknown)}; known: {sorted(known)}")
    import torch

    started = time.monotonic()
    DEADLINE[0] = started + args.deadline_s
    gpus = args.gpus or torch.cuda.device_count()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK, ignore_errors=True)
    LOGS.mkdir(parents=True)
    ctx = {"gpus": gpus, "memory_names": set(args.memory.split(",")),
           "layouts": set(args.layouts.split(",")) if args.layouts else None,
           "resume_on": set(args.resume_on.split(",")) if args.resume_on else None,
           "bench_on": set(args.bench_on.split(",")) if args.bench_on else None,
           "model": args.model, "bench_model": args.bench_model,
           "reshard_from": args.reshard_from or f"tp{gpus}",
           "reshard_to": args.reshard_to.split(",") if args.reshard_to else None,
           "perf_variants": args.perf_variants.split(",") if args.perf_variants else None,
           "perf_profile": set(filter(None, args.perf_profile.split(","))), "perf_tp": args.perf_tp,
           "bench_variant": args.bench_variant, "threeway": args.threeway,
           "threeway_variants": set(filter(None, args.threeway_variants.split(","))),
           "threeway_mlm_variants": set(filter(None, args.threeway_mlm_variants.split(","))),
           "threeway_profile": set(filter(None, args.threeway_profile.split(","))),
           "threeway_fallback": args.threeway_fallback, "stepdump": args.stepdump,
           "threeway_gbs": args.threeway_gbs, "threeway_iters": args.threeway_iters,
           "threeway_skip_overlap": args.threeway_skip_overlap, "threeway_skip_mlm": args.threeway_skip_mlm,
           "goodput_gbs": args.goodput_gbs, "goodput_interval": args.goodput_interval,
           "diskfull_mib": args.diskfull_mib,
           "pod_jobs": tuple(filter(None, args.pod_jobs.split(","))),
           "moe_layout": args.moe_layout, "moe_iters": args.moe_iters, "moe_warmup": args.moe_warmup,
           "moe_layers": args.moe_layers, "moe_gbs": args.moe_gbs, "moe_sequential": args.moe_sequential,
           "moe_skip_mlm": args.moe_skip_mlm,
           "moe_levers": args.moe_levers,
           "moe_only": set(args.moe_only.split(",")) if args.moe_only else None}
    OURS_EXTRA[:] = args.ours_extra.split()
    ctx["objbench_model"] = args.objbench_model
    ctx.update(te_ctx(args))
    ctx["det_env"] = dict(MATH_DETERMINISTIC_ENV) if args.deterministic_attention == "math" else {}
    results = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpus": gpus,
               "device": [torch.cuda.get_device_name(i) for i in range(gpus)]}
    ctx["out_dir"], ctx["results"] = out_dir, results
    if args.object_store:
        results["object_store"] = start_object_store()
    n_layouts = len(ctx["layouts"]) if ctx["layouts"] else len(layouts_for(gpus))
    n_bench = len(ctx["bench_on"]) if ctx["bench_on"] else len(bench_layouts(gpus))
    for name in args.only.split(","):
        scale = {"layouts": n_layouts, "bench": n_bench, "reshard": 2, "threeway": len(args.threeway.split(",")), "stepdump": len(args.stepdump.split(",")),
                 "deterministic": len(ctx["layouts"]) if ctx["layouts"] else 3,  # tpN, ppN, dpN
                 "resume": len(ctx["resume_on"]) if ctx["resume_on"] else n_layouts}.get(name, 1)
        # Rough seconds a scenario needs (Scenario.seconds, per layout); one that would not finish before the
        # deadline is skipped.
        why = skip_reason(SCENARIOS.get(name), gpus, scale, DEADLINE[0] - time.monotonic())
        if why:
            results[name] = {"ok": False, "skipped": why}
            print(f"=== {name}: skipped: {why}", flush=True)
            continue
        t0 = time.monotonic()
        print(f"=== {name} (t={t0 - started:.0f}s)", flush=True)
        try:
            results[name] = SCENARIOS[name].run(ctx)
        except Exception as e:
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"=== {name}: ok={results[name].get('ok')} in {results[name]['seconds']} s", flush=True)
        flush_outputs(out_dir, results, ctx)
        if not results[name].get("ok") and name in args.stop_on_failure.split(","):
            break
    table = flush_outputs(out_dir, results, ctx)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
