"""GPU scenarios of the comparison with Megatron-LM (issues 17 and 29): ours against Megatron-LM's own
pretrain_gpt.py on the same model, layout and global batch, in the same call. Registered in suite.py.

  threeway   issue 17: ours / Megatron-LM's pretrain_gpt.py (.run/mlm_peer.sh, source in .run/mlm) / the
             guides' loop, one layout per call (--threeway dp1|tp2|dp2|pp2, on 4 GPUs tp2pp2, tp2pp2vpp2,
             tp2dp2, tp4, pp4), benchmark model; ours' variants (THREEWAY_VARIANTS) and Megatron-LM's
             (MLM_VARIANTS) for A/B runs
  stepdump   issue 29: Megatron-LM's pretrain_gpt.py and ours run as it runs (threeway's `mlmlike`) with
             a digest of every weight, gradient and updated parameter at the first optimizer steps
             (e2e/gpu/stepdump.py compares them): the first tensor where the two programs differ
             (--stepdump dp1:llama1b)

    bash e2e/gpu/run_on_device.sh --gpus 1 --only stepdump --stepdump dp1:llama1b
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import stepdump
from harness import (
    DEADLINE,
    DP_OVERLAP,
    ITER_RE,
    LOGS,
    MODELS,
    REPO,
    STARTUP_RE,
    WORK,
    Run,
    Scenario,
    all_gpus,
    bounded,
    check,
    ratio_vs_mlm,
    run_mlm_peer,
    run_peer,
    sdpa_kernel,
    throughput_fields,
    trainer_args,
    trainer_summaries,
)

# issue 17's three-way benchmark, one layout per device call: (GPUs, TP, PP); DP is what is left.
THREEWAY = {"dp1": (1, 1, 1), "tp2": (2, 2, 1), "dp2": (2, 1, 1), "pp2": (2, 1, 2),
            # issue 49: 4 GPUs
            "tp2pp2": (4, 2, 2), "tp2pp2vpp2": (4, 2, 2), "tp2dp2": (4, 2, 1), "tp4": (4, 4, 1), "pp4": (4, 1, 4)}
THREEWAY_VPP = {"tp2pp2vpp2": 2}  # virtual pipeline stages per pipeline rank (both programs)


def scenario_threeway(ctx) -> dict:
    """issue 17: ours (the default configuration the operator renders) / Megatron-LM's pretrain_gpt.py /
    the guides' loop (mcore_peer.py; TP x DP only) on the benchmark model, for each layout of
    --threeway (comma-separated), the three loops of a layout one after the other in the same call, same
    global batch; iteration time = median of iterations 4-20; MFU by the classic formula for all three."""
    # "tp2:llama8b,pp2:llama3b": a layout may name its own model (default --bench-model)
    specs = [x.split(":", 1) for x in (ctx.get("threeway") or "tp2").split(",") if x]
    layouts = [x[0] for x in specs]
    models = {x[0]: x[1] for x in specs if len(x) == 2}
    unknown = [x for x in layouts if x not in THREEWAY] + [m for m in models.values() if m not in MODELS]
    if unknown:
        return {"ok": False, "error": f"unknown --threeway layouts or models {unknown}; known: {sorted(THREEWAY)}, "
                                      f"{sorted(MODELS)}"}
    out: dict = {}
    for layout in layouts:
        if time.monotonic() + 150 > DEADLINE[0]:
            out[layout] = {"ok": False, "skipped": "deadline"}
            continue
        out[layout] = threeway_layout(dict(ctx, bench_model=models.get(layout, ctx.get("bench_model"))), layout)
    out["ok"] = bool(layouts) and all(out[x].get("ok") for x in layouts)
    return out


def threeway_layout(ctx, layout: str) -> dict:
    """One layout: Megatron-LM first (the loop that needs more memory: its local spec keeps the s x s
    attention scores), then ours. If Megatron-LM runs out of memory on --bench-model and
    --threeway-fallback names a model, both loops are measured on that model ("what fits"), and ours
    also runs on the model Megatron-LM could not fit, as a record of its own."""
    gpus, tp, pp = THREEWAY[layout]
    vpp, iters = THREEWAY_VPP.get(layout), ctx.get("threeway_iters") or 26
    models = [ctx.get("bench_model", "gpt1b")] + ([ctx["threeway_fallback"]] if ctx.get("threeway_fallback") else [])
    visible = all_gpus(gpus)
    out: dict = {"layout": layout, "gpus": gpus, "virtual_pipeline": vpp, "iterations": iters}
    for i, model in enumerate(models):
        gbs = ctx.get("threeway_gbs") or threeway_gbs(model, gpus, tp, pp)
        if ctx.get("threeway_skip_mlm"):  # ours alone (a profile, a variant): said so in the results
            mlm = {"not_run": "--threeway-skip-mlm"}
        else:
            mlm = run_mlm_peer(f"threeway_mlm_{layout}_{model}", gpus, model, tp, pp, gbs, visible, vpp=vpp,
                               iters=iters)
        if mlm.get("iter_ms"):
            mlm.update(throughput_fields(model, gbs, mlm["iter_ms"], gpus))
        if mlm.get("out_of_memory") and i + 1 < len(models):
            out.setdefault("megatron_lm_did_not_fit", {})[model] = {"global_batch": gbs, **mlm}
            continue
        out.update(model=model, global_batch=gbs, megatron_lm=mlm)
        break
    model, gbs, mlm = out["model"], out["global_batch"], out["megatron_lm"]
    for name in sorted(ctx.get("threeway_mlm_variants", ())):  # Megatron-LM with extra flags, for A/B runs
        key = f"megatron_lm_{name}"
        if time.monotonic() + 150 > DEADLINE[0]:
            out[key] = {"skipped": "deadline"}
            continue
        out[key] = run_mlm_peer(f"threeway_mlm_{name}_{layout}_{model}", gpus, model, tp, pp, gbs, visible,
                                MLM_VARIANTS[name], vpp=vpp, iters=iters)
        if out[key].get("iter_ms"):
            out[key].update(throughput_fields(model, gbs, out[key]["iter_ms"], gpus))
    m = MODELS[model]
    dp = gpus // (tp * pp)
    # "ours" is the configuration the operator renders by default (distributed optimizer, no overlap
    # flags); with DP > 1 the overlap flags Megatron-LM's run gets are measured too, as a variant.
    variants = [("default", [])] + ([("overlap", list(DP_OVERLAP))] if dp > 1 and not ctx.get("threeway_skip_overlap")
                                    else [])
    # ours' default has the full-iteration CUDA graph where the trainer verifies it (--cuda-graph-impl auto:
    # PP=1 here); "eager" measures the same run without it.
    variants = [(name, extra, {}) for name, extra in variants]
    for name in sorted(ctx.get("threeway_variants", ())):
        env, extra = THREEWAY_VARIANTS[name]
        if name != "eager" or pp == 1:
            variants.append((name, extra, env))
    for variant, extra, env in variants:
        key = "ours" if variant == "default" else f"ours_{variant}"
        if key != "ours" and time.monotonic() + 120 > DEADLINE[0]:
            out[key] = {"skipped": "deadline"}
            continue
        out[key] = run_ours_threeway(ctx, f"threeway_{key}_{layout}", model, gpus, tp, pp, gbs, extra, variant, env,
                                     vpp=vpp, iters=iters)
    if model != models[0] and time.monotonic() + 150 < DEADLINE[0]:
        # ours on the model Megatron-LM could not fit: does the default configuration fit, and how fast is it
        big = models[0]
        out["ours_on_" + big] = run_ours_threeway(ctx, f"threeway_ours_{layout}_{big}", big, gpus, tp, pp,
                                                  ctx.get("threeway_gbs") or threeway_gbs(big, gpus, tp, pp), [], "default")
    ours_ms, rc = out["ours"]["iter_ms"], out["ours"]["rc"]
    for key in ["ours", "ours_overlap"] + [f"ours_{v}" for v in THREEWAY_VARIANTS]:  # each run of ours vs Megatron-LM
        prefix = "" if key == "ours" else f"{key}_"
        compare_with_mlm(out, out.get(key, {}), mlm, f"{key}_speedup_vs_megatron_lm",
                         f"{prefix}losses_1_5_max_abs_diff_vs_megatron_lm")
    for name in ctx.get("threeway_mlm_variants", ()):  # a variant of both loops: ours_X against megatron_lm_X
        compare_with_mlm(out, out.get(f"ours_{name}", {}), out.get(f"megatron_lm_{name}", {}),
                         f"ours_{name}_speedup_vs_megatron_lm_{name}",
                         f"ours_{name}_losses_1_5_max_abs_diff_vs_megatron_lm_{name}")
    compare_reruns(out, ctx.get("threeway_variants", ()))
    if pp == 1 and m.get("arch") != "llama":  # the guides' loop builds a GPT only
        out["guides_loop"] = run_peer(f"threeway_peer_{layout}", gpus, model, tp)
    failures: list[str] = []
    check(ours_ms is not None, f"ours rc={rc}", failures)
    check("iter_ms" in mlm or "not_run" in mlm, "Megatron-LM did not run", failures)
    peer = out.get("guides_loop", {})
    ours_tps = out.get("ours", {}).get("tokens_per_s_per_gpu")
    if ours_tps and peer.get("tokens_per_s_per_gpu"):
        # by tokens/s/GPU: the guides' loop steps one micro-batch an iteration, not threeway's global batch
        out["ours_speedup_vs_guides_loop"] = round(ours_tps / peer["tokens_per_s_per_gpu"], 3)
    out["ok"], out["failures"] = not failures, failures
    return out


def compare_with_mlm(out: dict, ours: dict, mlm: dict, speedup_key: str, losses_key: str) -> None:
    """One run of ours against one of Megatron-LM's: its speed-up (`speedup_key`) and the largest difference of
    losses 1-5 (`losses_key`), each set in `out` only where both runs have the figures."""
    ratio = ratio_vs_mlm(ours.get("iter_ms"), mlm)
    if ratio is not None:
        out[speedup_key] = ratio
    a, b = ours.get("losses_1_5") or [], mlm.get("losses_1_5") or []
    if len(a) == 5 and len(b) == 5 and None not in a and None not in b:
        out[losses_key] = round(max(abs(x - y) for x, y in zip(a, b, strict=True)), 6)


def compare_reruns(out: dict, variants) -> None:
    """A variant named X+"again" reruns X's command line (`again`: the default's) in the same call: its losses
    against X's are ours' run-to-run spread, set as ours_Xagain_losses_1_5_max_abs_diff_vs_<X's key>."""
    for name in sorted(variants):
        if name.endswith("again"):
            base = f"ours_{name[:-len('again')]}" if name != "again" else "ours"
            compare_with_mlm(out, out.get(f"ours_{name}", {}), out.get(base, {}), f"ours_{name}_speed_vs_{base}",
                             f"ours_{name}_losses_1_5_max_abs_diff_vs_{base}")


def threeway_gbs(model: str, gpus: int, tp: int, pp: int) -> int:
    """PP=2: 4 micro-batches; a model may ask for more ("accum")."""
    m = MODELS[model]
    return m["mbs"] * (gpus // (tp * pp)) * m.get("accum", 4 if pp > 1 else 1)


# Extra variants of ours in threeway (--threeway-variants): name -> (environment, flags).
FUSED_ENV = {"MEGATRON_TRAINER_COMPILE_NORM": "1", "MEGATRON_TRAINER_CE_FUSION": "1"}
THREEWAY_VARIANTS = {
    "eager": ({}, ["--cuda-graph-impl", "none"]),  # the same run without the full-iteration CUDA graph
    "nofusion": ({}, ["--no-gradient-accumulation-fusion"]),  # weight gradients in bf16, then an fp32 add
    "nccl32": ({"NCCL_MIN_NCHANNELS": "32"}, []),  # more NCCL channels for the TP all-reduces
    "torchadam": ({"MEGATRON_TRAINER_FUSED_ADAM": "0"}, []),  # torch AdamW's foreach kernels, not its fused one
    "sp": ({}, ["--sequence-parallel"]),  # sequence parallelism forced on (the local path's default is off)
    "norope": ({"MEGATRON_TRAINER_COMPILE_ROPE": "0"}, []),  # Megatron's unfused RoPE, eager
    "normcompile": ({"MEGATRON_TRAINER_COMPILE_NORM": "1"}, []),  # RMSNorm through torch.compile
    "cefusion": ({"MEGATRON_TRAINER_CE_FUSION": "1"}, []),  # Megatron's native fused cross entropy
    "fused": (FUSED_ENV, []),  # the compiled norm and the fused cross entropy on top of the defaults
    "ncclsimple": ({"NCCL_PROTO": "Simple"}, []),  # NCCL's Simple protocol forced for every collective
    "nccll128": ({"NCCL_PROTO": "LL128"}, []),  # NCCL's LL128 protocol forced
    "tpoverlap2": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "2"}, []),  # row-parallel forward in 2 overlapped pieces
    "tpoverlap4": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "4"}, []),  # the same in 4 pieces
    # the same, with the GEMM pieces that run beside an all-reduce leaving 16 SMs to NCCL (of 132 on H100/H200)
    "tpoverlap2c16": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "2", "MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "16"}, []),
    "tpoverlap4c16": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "4", "MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "16"}, []),
    # 2 pieces, NCCL held to 8 CTAs (every collective) and 8 SMs left to it
    "tpoverlap2c8cta8": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "2", "MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "8",
                          "NCCL_MAX_CTAS": "8"}, []),
    "unfused": ({}, ["--attention-backend", "unfused"]),  # Megatron's DotProductAttention, as Megatron-LM's local spec
    # ours as close to Megatron-LM's run as its flags go: unfused attention, eager (no CUDA graph), Megatron's
    # unfused RoPE, torch AdamW's foreach kernels, weight gradients in bf16 then added (for the loss comparison)
    "mlmlike": ({"MEGATRON_TRAINER_COMPILE_ROPE": "0", "MEGATRON_TRAINER_FUSED_ADAM": "0"},
                ["--attention-backend", "unfused", "--cuda-graph-impl", "none", "--no-gradient-accumulation-fusion"]),
    # only what changes the forward pass as Megatron-LM's does: unfused attention, eager, unfused RoPE (mlmlike ran
    # out of memory on the 8B at TP=2 on H200 in iteration 2: foreach AdamW's and the bf16 weight gradients' buffers)
    "mlmfwd": ({"MEGATRON_TRAINER_COMPILE_ROPE": "0"}, ["--attention-backend", "unfused", "--cuda-graph-impl", "none"]),
    # the compiled RoPE with Inductor's emulate_precision_casts: eager's bf16 rounding of each intermediate (the
    # default from c3c0f8c); ropefast: compiled without it (the default before)
    "ropeexact": ({"MEGATRON_TRAINER_COMPILE_ROPE": "exact"}, []),
    "ropefast": ({"MEGATRON_TRAINER_COMPILE_ROPE": "1"}, []),
    # micro-batches of 2 sequences, the global batch unchanged (half as many fp32 weight-gradient accumulations)
    "mbs2": ({}, ["--micro-batch-size", "2"]),
    # the same command line once more in the same call: how far ours moves against itself (run-to-run spread)
    "again": ({}, []),
    "unfusedagain": ({}, ["--attention-backend", "unfused"]),
}


# Megatron-LM's extra runs in threeway (--threeway-mlm-variants): name -> flags for pretrain_gpt.py.
# mlmlike with Megatron-Core's own multi-tensor fallbacks (grad-norm and scale per tensor) instead of ours' foreach
THREEWAY_VARIANTS["mlmlikemt"] = ({**THREEWAY_VARIANTS["mlmlike"][0], "MEGATRON_TRAINER_FOREACH_OPS": "0"},
                                  THREEWAY_VARIANTS["mlmlike"][1])
MLM_VARIANTS = {
    "softmaxfp32": ["--attention-softmax-in-fp32"],  # its unfused attention's softmax in fp32, as ours computes it
    "mbs2": ["--micro-batch-size", "2"],  # as ours' mbs2: ours_mbs2 is also compared with this run
    # the two TransformerConfig settings where ours differs from Megatron-LM's command-line defaults (found on the
    # CPU by building both configs): the unfused attention's softmax in fp32 (Megatron-Core's own default, ours) and
    # the loss summed over tokens and divided by their count after the backward (ours)
    "oursconfig": ["--attention-softmax-in-fp32", "--calculate-per-token-loss"],
}


def run_ours_threeway(ctx, name: str, model: str, gpus: int, tp: int, pp: int, gbs: int, extra: list[str],
                      variant: str, variant_env: dict | None = None, vpp: int | None = None, iters: int = 26) -> dict:
    """One run of ours in threeway: median iteration 4 to iters-6 (4-20 of 26), the window mlm_peer.sh takes;
    profiled over iteration 22 when --threeway-profile names the variant (a kernel-time breakdown per rank
    lands in the result)."""
    m = MODELS[model]
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {}
    env.update(variant_env or {})
    profile_dir = LOGS / f"profile_{name}"
    if variant in ctx.get("threeway_profile", ()):
        env["MEGATRON_TRAINER_PROFILE"] = f"22:22:{profile_dir}"
    if vpp:
        extra = list(extra) + ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    ours = Run(name, gpus, trainer_args(model, tp=tp, pp=pp, mbs=m["mbs"], gbs=gbs, iters=iters, lr="3e-4", warmup=4,
                                        extra=extra), env=env, gpus=all_gpus(gpus))
    rc = ours.wait(bounded(300))
    wall = time.monotonic() - ours.started
    ours.close()
    text = ours.text()  # the log, read once
    logged = [(int(x.group(1)), float(x.group(2)), float(x.group(3)), float(x.group(5))) for x in ITER_RE.finditer(text)]
    steady = [ms for i, ms, _, _ in logged if 4 <= i <= iters - 6]
    it_ms = statistics.median(steady) if steady else None
    losses = {i: loss for i, _, loss, _ in logged}
    graph = re.search(r"CUDA graph: (\S+) \(([^)]*)\)", text)
    fusion = re.search(r"wgrad accumulation fusion=([^,\n]+)", text)
    res = {"rc": rc, "model": model, "global_batch": gbs, "iter_ms": it_ms, "flags": extra, "env": variant_env or {},
           "wgrad_fusion": fusion.group(1).strip() if fusion else None, "sdpa_kernel": sdpa_kernel(text),
           "losses_1_5": [losses.get(i) for i in range(1, 6)],
           "peak_alloc_gib_logging_rank": max((peak for *_, peak in logged), default=None),
           "cuda_graph": graph.group(1) if graph else None, "cuda_graph_reason": graph.group(2) if graph else None}
    if rc != 0 and "out of memory" in text.lower():
        res["out_of_memory"] = True
    if it_ms:
        res.update(throughput_fields(model, gbs, it_ms, gpus))
    summary = (trainer_summaries(text) or [None])[-1] or {}
    res["peak_alloc_gib_per_rank"] = [round(r["peak_allocated_gib"], 2) for r in summary.get("memory_per_rank", [])]
    startup = STARTUP_RE.search(text)
    res["startup_to_first_iteration_s"] = float(startup.group(1)) if startup else None
    res["wall_s"] = round(wall, 1)
    if profile_dir.is_dir():
        res["profile"] = profile_breakdown(profile_dir)
    return res


# Kernel categories of a profile, by the first pattern that matches the kernel's name (lower case).
KERNEL_CATEGORIES = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "sm90_", "sm80_")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("norm", ("rms", "norm")),
    ("softmax_loss", ("softmax", "cross_entropy", "nll", "logsumexp")),
    # torch.compile's kernels (compiled RoPE, SwiGLU): their names list the fused ops ("cat", "_to_copy"),
    # which would otherwise count them as copies
    ("compiled", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy", "cat_", "catarray")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "index", "scatter", "gather")),
)


def kernel_category(name: str) -> str:
    """The first KERNEL_CATEGORIES entry whose pattern is in the kernel's name, else "other"."""
    low = name.lower()
    return next((c for c, pats in KERNEL_CATEGORIES if any(p in low for p in pats)), "other")


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted (start, end) intervals merged where they overlap."""
    out: list[tuple[float, float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(a: float, b: float, union: list[tuple[float, float]]) -> float:
    """How much of [a, b) the merged intervals `union` cover."""
    import bisect

    i = max(0, bisect.bisect_right(union, (a, float("inf"))) - 1)
    got = 0.0
    while i < len(union) and union[i][0] < b:
        got += max(0.0, min(b, union[i][1]) - max(a, union[i][0]))
        i += 1
    return got


def profile_breakdown(directory: Path, big_trace_bytes: int = 6 << 20) -> dict:
    """Per rank, from torch.profiler's Chrome trace of one iteration: GPU kernel time by category, the
    iteration's span on the GPU (first kernel start to last kernel end), the time some kernel was running
    (union over streams) and the GPU-idle share of the span. Traces over `big_trace_bytes` are deleted
    after reading (the logs archive must stay small enough to come back); the operator tables stay."""
    import gzip

    out: dict = {}
    for trace in sorted(directory.glob("rank*.json.gz")):
        try:
            events = json.loads(gzip.open(trace).read()).get("traceEvents", [])
        except Exception as e:  # diagnostics only
            out[trace.name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
        if not kernels:
            out[trace.name.split(".")[0]] = {"kernels": 0}
            continue
        by_cat: dict[str, float] = {}
        top: dict[str, float] = {}
        nccl: list[tuple[float, float]] = []
        compute: list[tuple[float, float]] = []
        for e in kernels:
            cat = kernel_category(str(e.get("name", "")))
            by_cat[cat] = by_cat.get(cat, 0.0) + e["dur"]
            top[e.get("name", "")[:90]] = top.get(e.get("name", "")[:90], 0.0) + e["dur"]
            (nccl if cat == "nccl" else compute).append((e["ts"], e["ts"] + e["dur"]))
        spans = sorted(nccl + compute)
        busy = sum(b - a for a, b in merged(spans))
        span = spans[-1][1] - spans[0][0]
        total = sum(by_cat.values())
        compute = merged(sorted(compute))
        out[trace.name.split(".")[0]] = {
            "kernels": len(kernels), "gpu_span_ms": round(span / 1000, 2), "gpu_busy_ms": round(busy / 1000, 2),
            "gpu_idle_pct_of_span": round(100 * (1 - busy / span), 2) if span else None,
            # communication no compute kernel runs beside (what overlap could still win), and compute alone
            "nccl_exposed_ms": round(sum(b - a - covered(a, b, compute) for a, b in nccl) / 1000, 2),
            "compute_busy_ms": round(sum(b - a for a, b in compute) / 1000, 2),
            "kernel_ms_by_category": {k: round(v / 1000, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "kernel_pct_by_category": {k: round(100 * v / total, 1) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": {k: round(v / 1000, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]}}
        if trace.stat().st_size > big_trace_bytes:
            trace.unlink()
            out[trace.name.split(".")[0]]["trace_deleted"] = "over the size that comes back"
    return out


def scenario_stepdump(ctx) -> dict:
    """Megatron-LM's pretrain_gpt.py, then ours, on each layout:model[:mlm_variant[:ours_variant]] of --stepdump
    (comma-separated; default dp1:llama1b; mlm_variant: one of MLM_VARIANTS, flags for Megatron-LM's run;
    ours_variant: one of THREEWAY_VARIANTS, default mlmlike), each with the step hook; the comparison of every
    rank's dumps.
    At DP > 1 ours also gets the overlap flags Megatron-LM's run has (mlm_peer.sh), so that both split
    their gradients into the same buckets and shards."""
    out: dict = {}
    for spec in filter(None, (ctx.get("stepdump") or "dp1:llama1b").split(",")):
        if time.monotonic() + 150 > DEADLINE[0]:
            out[spec] = {"ok": False, "skipped": "deadline"}
            continue
        out[spec] = _stepdump_one(ctx, spec)
    out["ok"] = bool(out) and all(r.get("ok") for r in out.values())
    return out


def _stepdump_one(ctx, spec: str) -> dict:
    layout, model, mlm_variant, ours_variant = (spec.split(":") + ["", "", ""])[:4]
    model, ours_variant = model or "llama1b", ours_variant or "mlmlike"
    if layout not in THREEWAY or model not in MODELS or (mlm_variant and mlm_variant not in MLM_VARIANTS) \
            or ours_variant not in THREEWAY_VARIANTS:
        return {"ok": False, "error": f"unknown --stepdump {spec}; layouts {sorted(THREEWAY)}, "
                                      f"models {sorted(MODELS)}, Megatron-LM variants {sorted(MLM_VARIANTS)}, "
                                      f"ours' variants {sorted(THREEWAY_VARIANTS)}"}
    tag = f"{layout}_{model}{mlm_variant}{'' if ours_variant == 'mlmlike' else '_' + ours_variant}"
    gpus, tp, pp = THREEWAY[layout]
    if gpus > ctx["gpus"]:
        return {"ok": False, "error": f"--stepdump {layout} needs {gpus} GPUs, the suite has {ctx['gpus']}"}
    mlm_dir = REPO / ".run" / "mlm"
    if not (mlm_dir / "pretrain_gpt.py").is_file():
        return {"ok": False, "error": "Megatron-LM's source (.run/mlm) not carried"}
    gbs = threeway_gbs(model, gpus, tp, pp)
    dumps = {"megatron_lm": WORK / f"stepdump_mlm_{tag}", "ours": WORK / f"stepdump_ours_{tag}"}
    for d in dumps.values():
        shutil.rmtree(d, ignore_errors=True)
    placed = mlm_dir / "sitecustomize.py"  # mlm_peer.sh runs with PYTHONPATH=$MLM_DIR only
    shutil.copy(stepdump.HOOK, placed)
    try:
        mlm = run_mlm_peer(f"stepdump_mlm_{tag}", gpus, model, tp, pp, gbs, all_gpus(gpus),
                           MLM_VARIANTS.get(mlm_variant, ()), env_extra={"STEPDUMP_DIR": str(dumps["megatron_lm"])})
    finally:
        placed.unlink(missing_ok=True)
    env, extra = THREEWAY_VARIANTS[ours_variant]
    if gpus // (tp * pp) > 1:
        extra = [*extra, *DP_OVERLAP]
    env = dict(env, STEPDUMP_DIR=str(dumps["ours"]),
               PYTHONPATH=os.pathsep.join(filter(None, [str(stepdump.HOOK.parent), os.environ.get("PYTHONPATH")])))
    ours = run_ours_threeway(ctx, f"stepdump_ours_{tag}", model, gpus, tp, pp, gbs, extra, ours_variant, env)
    out: dict = {"layout": layout, "model": model, "global_batch": gbs,
                 "megatron_lm": {k: mlm.get(k) for k in ("rc", "iter_ms", "losses_1_5", "error")}
                 | {"flags": list(MLM_VARIANTS.get(mlm_variant, ()))},
                 "ours": {k: ours.get(k) for k in ("rc", "iter_ms", "losses_1_5", "flags", "env")} | {"variant": ours_variant}}
    failures = []
    for rank in range(gpus):
        files = {who: d / f"rank{rank}.json" for who, d in dumps.items()}
        missing = [who for who, f in files.items() if not f.is_file()]
        if missing:
            failures.append(f"rank {rank}: no dump from {', '.join(missing)} (see its log)")
            continue
        loaded = {who: json.loads(f.read_text()) for who, f in files.items()}
        out[f"rank{rank}"] = stepdump.compare(loaded["ours"], loaded["megatron_lm"])
    out["ok"], out["failures"] = not failures, failures
    return out


# name -> Scenario(the function, its line in --list, rough seconds per layout); suite.py registers them.
SCENARIOS = {
    "threeway": Scenario(scenario_threeway, "ours / Megatron-LM's pretrain_gpt.py / the guides' loop per --threeway "
                         "layout: iteration time, MFU, losses 1-5", 170),
    "stepdump": Scenario(scenario_stepdump, "Megatron-LM and ours (mlmlike) with digests of every tensor at the first "
                         "steps: the first one that differs", 200),
}
