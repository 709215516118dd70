"""GPU scenarios of performance: speed, memory and I/O of the trainer against its peers and the hardware's
limits, measured in the same device call. Registered in suite.py.

  bench      GPT 1.35B vs ../shared/bench/mcore_peer.py and, when .run/mlm is carried, Megatron-LM's
             pretrain_gpt.py (same model, same call): tokens/s/GPU,
             MFU (the peer's formula for both), peak memory, blocked time per async save, kill -9
             during an async save -> the previous complete checkpoint is used, start -> first
             resumed iteration
  perf       ours at TP=N under performance variants (PERF_VARIANTS) and the peer: iteration time,
             MFU ratio, optional torch.profiler traces; the variants' first losses must agree
  memory     peak memory of many configurations (calibration data for the memory estimator)
  detcost    issue 17: the speed cost of --deterministic-mode on the benchmark model at TP=N
  objbench   issue 33: the same model saving every 10 iterations to local disk and to the object store
             (--object-store): blocked time per async save, time to publish, bytes/s
  collectives  issue 29: the TP=2 collectives of Llama-3-8B timed alone (e2e/gpu/collectives.py), with
             NCCL's protocol choice (its log kept) and with each NCCL_PROTO forced
  rope       issue 29: Megatron's unfused RoPE on one GPU, eager against torch.compile with and without
             Inductor's emulate_precision_casts: differing elements (output, input gradient) and time
             (bench/rope_numerics.py; needs only megatron-core)
  disk       issue 49: the sequential write speed of the disk the checkpoints go to (dd, O_DIRECT and
             buffered + fdatasync): the physical limit a save's write is measured against
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

from harness import (
    DEADLINE,
    DP_OVERLAP,
    ITER_RE,
    LOGS,
    MATH_DETERMINISTIC_ENV,
    MODELS,
    NO_SP,
    REPO,
    RESUMED_RE,
    SCHEDULED_RE,
    STARTUP_RE,
    STORE,
    STORE_BUCKET,
    WORK,
    Run,
    Scenario,
    all_gpus,
    bounded,
    check,
    ckpt_state,
    compare,
    flush_outputs,
    mlm_second_peer,
    ours_throughput,
    ratio_vs_mlm,
    run_peer,
    sdpa_kernel,
    store_bytes,
    trainer_args,
)


def bench_layouts(gpus: int) -> list[tuple[str, int]]:
    """(name, TP): the peer covers TP x DP layouts only."""
    if gpus == 1:
        return [("dp1", 1)]
    if gpus == 2:
        return [("tp2", 2), ("dp2", 1)]
    return [(f"tp2dp{gpus // 2}", 2), (f"dp{gpus}", 1)]


def scenario_bench(ctx) -> dict:
    import torch

    gpus = ctx["gpus"]
    model = ctx.get("bench_model", "gpt1b")
    m = MODELS[model]
    mb = m["mbs"]
    out = {}
    for name, tp in bench_layouts(gpus):
        if ctx["bench_on"] and name not in ctx["bench_on"]:
            continue
        dp = gpus // tp
        res: dict = {"layout": f"TP{tp} DP{dp}", "gpus": gpus}
        # --- the peer: its own loop, same model, sync save of the model only (its CKPT mode)
        peer_ckpt = WORK / "ckpt" / f"peer_{name}"
        shutil.rmtree(peer_ckpt, ignore_errors=True)
        peer_ckpt.mkdir(parents=True)
        res["peer"] = run_peer(f"bench_peer_{name}", gpus, model, tp, ckpt=peer_ckpt)
        shutil.rmtree(peer_ckpt, ignore_errors=True)
        res["megatron_lm"] = mlm_second_peer(f"bench_mlm_{name}", gpus, model, tp, mb * dp)
        # --- ours: async save at 12, kill -9 while the save of 24 is in flight, restart from 12
        save = WORK / "ckpt" / f"bench_{name}"
        shutil.rmtree(save, ignore_errors=True)
        extra = list(DP_OVERLAP) if dp > 1 else []
        variant = ctx.get("bench_variant") or "foreach"
        if variant == "auto":  # the fastest variant the perf scenario measured
            timed = {k: v["median_iter_ms"] for k, v in ctx.get("perf", {}).items()
                     if isinstance(v, dict) and v.get("median_iter_ms") and v.get("rc") == 0}
            variant = min(timed, key=timed.get) if timed else "foreach"
        v_env, v_extra = variant_for(variant, tp)
        if "--cuda-graph-impl" in v_extra:  # the trainer refuses param-gather overlap with a full-iteration graph
            extra = [a for a in extra if a != "--overlap-param-gather"]
        res["variant"] = {"name": variant, "env": v_env, "extra": v_extra}
        args = trainer_args(model, tp=tp, mbs=mb, gbs=mb * dp, iters=36, lr="3e-4", warmup=4, save=str(save),
                            save_interval=12, extra=extra + v_extra)
        ours_env = {**({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {}), **v_env}
        ours = Run(f"bench_ours_{name}", gpus, args, env=ours_env)
        hit = ours.wait_for(re.compile(r"async save of iteration 24 scheduled"), 400)
        if hit:
            ours.kill_tree()
        ours.wait(60)
        ours.close()
        text = ours.text()
        ms = ours.iteration_ms()
        steady = [ms[i] for i in sorted(ms) if 4 <= i <= 24]
        blocked = [(int(a), round(float(b) - float(c), 3), float(c)) for a, b, c in SCHEDULED_RE.findall(text)]
        peaks = [float(x.group(5)) for x in ITER_RE.finditer(text)]
        after_kill = ckpt_state(save)
        res["ours"] = {"killed_during_async_save_of_24": bool(hit), "median_iter_ms": statistics.median(steady) if steady else None,
                       "async_save_blocked_s": blocked, "peak_mem_gib_rank_logging": max(peaks) if peaks else None,
                       "checkpoints_after_kill": after_kill}
        # The restart is the real command (async worker warm-up included); it is stopped after a few
        # resumed iterations, so no further checkpoint is written.
        again = Run(f"bench_ours_{name}_restart", gpus, args, env=ours_env)
        reached = again.wait_for(re.compile(r"iteration\s+16/"), 400)
        again.kill_tree()
        again.wait(60)
        rc2 = 0 if reached else -1
        again.close()
        resumed = RESUMED_RE.search(again.text())
        load_m = re.search(r"resumed from .* in ([0-9.]+) s", again.text())
        peaks2 = [float(x.group(5)) for x in ITER_RE.finditer(again.text())]
        startup = STARTUP_RE.search(again.text())
        # The restart redoes 13..16 from the checkpoint of 12: the killed run logged them already.
        redo = compare(ours.losses(), again.losses(), 13, rel_tol=0.01)
        res["ours"].update({
            "redo_13_16_vs_killed_run": redo,
            "restart_rc": rc2, "resumed_from": int(resumed.group(2)) if resumed else None,
            "resume_reason": resumed.group(3) if resumed else None,
            "startup_to_first_resumed_iteration_s": float(startup.group(1)) if startup else None,
            "load_s": float(load_m.group(1)) if load_m else None,
            "peak_alloc_gib_logging_rank_after_resume": max(peaks2) if peaks2 else None})
        if res["ours"]["median_iter_ms"]:
            thr = ours_throughput(model, dp, gpus, res["ours"]["median_iter_ms"], res["peer"])
            ratio = thr.pop("mfu_ratio_ours_over_peer", None)
            res["ours"].update(thr)
            if ratio is not None:
                res["mfu_ratio_ours_over_peer"] = ratio
        res["ours_speedup_vs_megatron_lm"] = ratio_vs_mlm(res["ours"]["median_iter_ms"], res["megatron_lm"])
        failures: list[str] = []
        check("mfu_ratio_ours_over_peer" in res, "no ratio", failures)
        check("not_run" in res["megatron_lm"] or res["ours_speedup_vs_megatron_lm"] is not None,
              f"Megatron-LM did not run: {res['megatron_lm'].get('error', '')[-200:]}", failures)
        check(bool(hit), "kill during async save not reached", failures)
        check(after_kill["tracker"] == 12 and after_kill["checkpoints"].get(24) is False,
              f"after kill: {after_kill}", failures)
        check(res["ours"]["resumed_from"] == 12, f"resumed from {res['ours']['resumed_from']}", failures)
        check(rc2 == 0, f"restart rc={rc2}", failures)
        check(redo["ok"], f"redone iterations differ from the killed run: {redo}", failures)
        res["ok"], res["failures"] = not failures, failures
        out[name] = res
        shutil.rmtree(save, ignore_errors=True)
        torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in out.values()), **out}


# Performance variants of ours for `perf` (env, extra flags). "old" is the configuration of the
# first benchmark (Megatron's host-syncing multi-tensor fallbacks, no sequence parallelism).
PERF_VARIANTS = {
    "old": ({"MEGATRON_TRAINER_FOREACH_OPS": "0"}, []),
    "foreach": ({}, []),
    "sp": ({}, ["--sequence-parallel"]),
    "sp_conn8": ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, ["--sequence-parallel"]),
    "conn8": ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, []),
    "graph": ({}, ["--cuda-graph-impl", "full_iteration"]),
    "graph_sp": ({}, ["--cuda-graph-impl", "full_iteration", "--sequence-parallel"]),
}


def variant_for(name: str, tp: int) -> tuple[dict, list[str]]:
    """A PERF_VARIANTS entry for a layout (sequence parallelism only where TP > 1)."""
    env, extra = PERF_VARIANTS[name]
    extra = [a for a in extra if tp > 1 or a != "--sequence-parallel"]
    return dict(env), extra if "--sequence-parallel" in extra else extra + [NO_SP]


def scenario_perf(ctx) -> dict:
    """Iteration time of ours at TP=N under several variants and the peer, same model, same call.

    No checkpoints; 26 iterations, median of 4-20; variants in --perf-profile are profiled over
    iteration 22 (traces and operator tables in the logs archive). Losses of the first iterations are
    compared across variants: they compute the same thing, so they must agree within bf16 noise.
    """
    gpus = ctx["gpus"]
    tp = ctx.get("perf_tp") or gpus
    dp = gpus // tp
    model = ctx.get("bench_model", "gpt1b")
    m = MODELS[model]
    mb = m["mbs"]
    out: dict = {"layout": f"TP{tp} DP{dp}", "model": model, "peer": run_peer(f"perf_peer_tp{tp}", gpus, model, tp),
                 "megatron_lm": mlm_second_peer(f"perf_mlm_tp{tp}", gpus, model, tp, mb * dp)}
    failures: list[str] = []
    first_losses = {}
    for name in ctx.get("perf_variants") or list(PERF_VARIANTS):
        env, extra = variant_for(name, tp)
        if name in (ctx.get("perf_profile") or ()):
            env["MEGATRON_TRAINER_PROFILE"] = f"22:22:{LOGS / ('profile_' + name)}"
        args = trainer_args(model, tp=tp, mbs=mb, gbs=mb * dp, iters=26, lr="3e-4", warmup=4, extra=extra)
        run = Run(f"perf_{name}", gpus, args, env=env)
        rc = run.wait(300)
        run.close()
        ms = run.iteration_ms()
        steady = [ms[i] for i in sorted(ms) if 4 <= i <= 20]
        res = {"rc": rc, "env": env, "extra": extra}
        if steady:
            median = statistics.median(steady)
            res.update({"median_iter_ms": median, **ours_throughput(model, dp, gpus, median, out["peer"]),
                        "ours_speedup_vs_megatron_lm": ratio_vs_mlm(median, out["megatron_lm"])})
        peaks = [float(x.group(5)) for x in ITER_RE.finditer(run.text())]
        res["peak_mem_gib_logging_rank"] = max(peaks) if peaks else None
        losses = run.losses()
        first_losses[name] = [losses.get(i) for i in range(1, 6)]
        res["losses_1_5"] = first_losses[name]
        check(rc == 0 and bool(steady), f"{name}: rc={rc}", failures)
        out[name] = res
    check("not_run" in out["megatron_lm"] or "iter_ms" in out["megatron_lm"],
          f"Megatron-LM did not run: {out['megatron_lm'].get('error', '')[-200:]}", failures)
    ref = first_losses.get("old") or next(iter(first_losses.values()), None)
    for name, got in first_losses.items():
        ok = ref is not None and None not in got and None not in ref and \
            all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(got, ref, strict=True))
        check(ok, f"{name}: losses 1-5 {got} differ from {ref}", failures)
    out["ok"], out["failures"] = not failures, failures
    ctx["perf"] = out
    return out


# Memory calibration: (name, gpus, model, tp, pp, mbs, gbs, attn, recompute, dist_opt)
MEMORY_CONFIGS = [
    ("m01_1g_flash_mbs4", 1, "gpt1b", 1, 1, 4, 4, "flash", None, True),
    ("m02_1g_unfused_mbs4", 1, "gpt1b", 1, 1, 4, 4, "unfused", None, True),
    ("m03_1g_full_recompute", 1, "gpt1b", 1, 1, 4, 4, "flash", "full", True),
    ("m04_1g_mbs1_nodistopt", 1, "gpt1b", 1, 1, 1, 1, "flash", None, False),
    ("m05_1g_s4k_unfused_mbs4", 1, "mem_s4k", 1, 1, 4, 4, "unfused", None, True),
    ("m06_1g_s4k_unfused_selective", 1, "mem_s4k", 1, 1, 4, 4, "unfused", "selective", True),
    ("m07_1g_s4k_flash_mbs8", 1, "mem_s4k", 1, 1, 8, 8, "flash", None, True),
    ("m08_2g_tp2_flash", 2, "gpt1b", 2, 1, 4, 4, "flash", None, True),
    ("m09_2g_pp2_mbs2_gbs16", 2, "gpt1b", 1, 2, 2, 16, "flash", None, True),
    ("m10_2g_dp2_distopt", 2, "gpt1b", 1, 1, 4, 8, "flash", None, True),
    ("m11_2g_dp2_nodistopt", 2, "gpt1b", 1, 1, 4, 8, "flash", None, False),
    ("m12_2g_tp2_s4k_unfused_selective", 2, "mem_s4k", 2, 1, 4, 4, "unfused", "selective", True),
]


def memory_run(cfg, gpus_visible: str) -> dict:
    name, gpus, model, tp, pp, mbs, gbs, attn, recompute, dist_opt = cfg
    extra = []
    if recompute == "full":
        extra = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif recompute == "selective":
        extra = ["--recompute-granularity", "selective"]
    args = trainer_args(model, tp=tp, pp=pp, mbs=mbs, gbs=gbs, iters=4, attn=attn, lr="3e-4", warmup=1,
                        dist_opt=dist_opt, extra=extra)
    run = Run(f"memory_{name}", gpus, args, gpus=gpus_visible)
    rc = run.wait(300)
    run.close()
    s = run.summary() or {}
    oom = "OutOfMemoryError" in run.text()
    m = MODELS[model]
    record = {"name": name, "rc": rc, "oom": oom, "gpus": gpus,
              "model": {"num_layers": m["layers"], "hidden_size": m["hidden"], "num_attention_heads": m["heads"],
                        "ffn_hidden_size": m["ffn"], "seq_length": m["seq"], "vocab_size": m["vocab"],
                        "normalization": "LayerNorm", "activation": "gelu", "position_embedding": "learned_absolute",
                        "untie_embeddings": True, "add_bias_linear": True},
              "parallel": {"tensor": tp, "pipeline": pp, "data": gpus // (tp * pp), "context": 1,
                           "sequence_parallel": False},
              "training": {"micro_batch_size": mbs, "global_batch_size": gbs,
                           "num_microbatches": gbs // (mbs * (gpus // (tp * pp))), "precision": "bf16",
                           "recompute": recompute or "none", "attention_backend": attn,
                           "transformer_impl": "local (no Transformer Engine)", "distributed_optimizer": dist_opt,
                           "optimizer": "adam (torch AdamW fallback, fp32 main params + 2 fp32 states)",
                           "grad_reduce_in_fp32": True},
              "iterations": s.get("iterations_run"),
              "memory_per_rank": s.get("memory_per_rank"),
              "max_peak_allocated_gib": s.get("max_peak_allocated_gib"),
              "max_peak_reserved_gib": max((r["peak_reserved_gib"] for r in s.get("memory_per_rank") or []),
                                           default=None)}
    return record


def scenario_memory(ctx) -> dict:
    gpus = ctx["gpus"]
    todo = [c for c in MEMORY_CONFIGS if c[1] <= gpus and c[0] in ctx["memory_names"]]
    results = []
    # Single-GPU configurations run side by side, one per GPU; larger ones alone.
    singles = [c for c in todo if c[1] == 1]
    multis = [c for c in todo if c[1] > 1]
    while singles:
        if time.monotonic() > DEADLINE[0] - 60:
            results += [{"name": c[0], "skipped": "time"} for c in singles]
            break
        batch, singles = singles[:gpus], singles[gpus:]
        threads, outs = [], [None] * len(batch)

        visible = os.environ.get("CUDA_VISIBLE_DEVICES", all_gpus(gpus)).split(",")

        def work(i, c, outs=outs, visible=visible):
            outs[i] = memory_run(c, visible[i])

        for i, c in enumerate(batch):
            t = threading.Thread(target=work, args=(i, c))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        results += outs
        ctx["memory_records"] = results
        flush_outputs(ctx["out_dir"], ctx.get("results", {}), ctx)
    for c in multis:
        if time.monotonic() > DEADLINE[0] - 60:
            results.append({"name": c[0], "skipped": "time"})
            continue
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", all_gpus(gpus)).split(",")
        results.append(memory_run(c, ",".join(visible[:c[1]])))
        ctx["memory_records"] = results
        flush_outputs(ctx["out_dir"], ctx.get("results", {}), ctx)
    ctx["memory_records"] = results
    ok = all(r.get("rc") == 0 or r.get("oom") for r in results if "skipped" not in r)
    return {"ok": ok, "records": [{k: r.get(k) for k in ("name", "rc", "oom", "max_peak_allocated_gib",
                                                          "max_peak_reserved_gib")} for r in results]}


# detcost's runs: name -> (flags, environment)
DETCOST_VARIANTS = {"default": ([], {}), "deterministic": (["--deterministic-mode"], {}),
                    "deterministic_math": (["--deterministic-mode"], MATH_DETERMINISTIC_ENV)}


def scenario_detcost(ctx) -> dict:
    """issue 17: what --deterministic-mode costs: the benchmark model at TP=N, default vs deterministic (the flash
    kernel's deterministic backward) vs deterministic with SDPA's math attention, 12 iterations each, median
    iteration time of 4-12, same call."""
    gpus = ctx["gpus"]
    model, tp = ctx.get("bench_model", "gpt1b"), gpus
    mb = MODELS[model]["mbs"]
    cost: dict = {"model": model, "layout": f"TP{tp}"}
    for variant, (extra, env) in DETCOST_VARIANTS.items():
        run = Run(f"detcost_{variant}", gpus, trainer_args(model, tp=tp, mbs=mb, gbs=mb, iters=12, lr="3e-4",
                                                           warmup=2, extra=extra),
                  env={**env, **({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {})})
        rc = run.wait(300)
        run.close()
        ms = run.iteration_ms()
        steady = [ms[i] for i in sorted(ms) if 4 <= i <= 12]
        text, losses = run.text(), run.losses()  # the log read once each
        attention = re.search(r"attention=(SDPA \([^)]*\)|[^,]+)", text)
        cost[variant] = {"rc": rc, "median_iter_ms": statistics.median(steady) if steady else None,
                         "losses_1_3": [losses.get(i) for i in (1, 2, 3)],
                         "attention": attention.group(1) if attention else None, "sdpa_kernel": sdpa_kernel(text)}
    n = cost["default"]["median_iter_ms"]
    for variant, key in (("deterministic", "slowdown"), ("deterministic_math", "slowdown_math")):
        d = cost[variant]["median_iter_ms"]
        cost[key] = round(d / n, 3) if d and n else None
    cost["ok"] = cost["slowdown"] is not None and cost["slowdown_math"] is not None
    return cost


def scenario_objbench(ctx) -> dict:
    """issue 33: one model, async saves every 10 iterations (4 saves in 40 iterations, keep 1), to local
    disk and to the object store on loopback (the server writes to the same disk): blocked time per
    save, seconds from the save's start to its publication, checkpoint bytes / that time."""
    if not STORE:
        return {"ok": False, "error": "needs --object-store"}
    gpus, model = ctx["gpus"], ctx.get("objbench_model", "gpt1b")
    mbs = MODELS[model]["mbs"]
    out: dict = {"model": model, "layout": f"TP{gpus}"}
    failures: list[str] = []
    for target in ("local", "s3"):
        local = str(WORK / "ckpt" / f"objbench_{target}")
        shutil.rmtree(local, ignore_errors=True)
        save = local if target == "local" else f"s3://{STORE_BUCKET}/objbench_{target}"
        args = trainer_args(model, tp=gpus, mbs=mbs, gbs=mbs, iters=40, save=save, save_interval=10,
                            lr="3e-4")
        run = Run(f"objbench_{target}", gpus, args, env={"MEGATRON_CHECKPOINT_KEEP": "1"})
        rc = run.wait(400)
        run.close()
        summary = run.summary() or {}
        saves = summary.get("checkpoint_saves", [])
        if target == "local":
            size = sum(f.stat().st_size for f in (Path(local) / "iter_0000040").rglob("*") if f.is_file())
        else:
            size = store_bytes(f"objbench_{target}/iter_0000040/")
        periodic = [x for x in saves if x.get("async")]
        totals = [x["total_s"] for x in periodic if x.get("total_s")]
        out[target] = {"rc": rc, "checkpoint_bytes": size, "saves": saves,
                       "median_blocked_s": statistics.median([x["blocked_s"] for x in periodic]) if periodic else None,
                       "median_publish_s": statistics.median(totals) if totals else None,
                       "bytes_per_s": round(size / statistics.median(totals)) if totals and size else None,
                       "state": ckpt_state(save)}
        shutil.rmtree(local, ignore_errors=True)  # disk: the store's copy lands on the same disk next
        check(rc == 0, f"{target}: rc={rc}", failures)
        check(len(totals) >= 3, f"{target}: {len(totals)} async saves published", failures)
    out.update(ok=not failures, failures=failures)
    return out


NCCL_PROTOS = ("", "Simple", "LL128", "LL")  # "": NCCL's own choice
COLLECTIVES_RE = re.compile(r"^COLLECTIVES (\{.*\})$", re.M)
NCCL_CHOICE_RE = re.compile(r"NCCL INFO .*(?:\bAlgo\b|\bproto|P2P|NVLS|NVL|via |Ring|Tree|Channel 00).*", re.I)


def scenario_collectives(ctx) -> dict:
    """issue 29: the TP=2 collectives of Llama-3-8B (32 MiB of bf16 per micro-batch) alone, with NCCL's
    own protocol choice and with each protocol forced (NCCL_PROTO); NCCL's log of its choice is kept."""
    gpus = min(ctx["gpus"], 2)
    out: dict = {"ranks": gpus}
    failures: list[str] = []
    for proto in NCCL_PROTOS:
        env = {"NCCL_PROTO": proto} if proto else {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING"}
        name = f"collectives_{proto or 'default'}"
        run = Run(name, gpus, [], env=env, gpus=all_gpus(gpus), module=False,
                  script=str(REPO / "e2e" / "gpu" / "collectives.py"))
        rc = run.wait(120)
        run.close()
        text = run.text()
        m = COLLECTIVES_RE.search(text)
        out[proto or "default"] = json.loads(m.group(1)) if m else {"rc": rc}
        check(m is not None, f"{name}: rc={rc}, no result line", failures)
        if not proto:
            out["nccl_log"] = [line.strip()[:240] for line in NCCL_CHOICE_RE.findall(text)][:40]
    out.update(ok=not failures, failures=failures)
    return out


ROPE_RE = re.compile(r"^ROPE (\{.*\})$", re.M)
ROPE_SHAPES = ("llama8b-tp2", "llama3b-q", "llama3b-kv")


def scenario_rope(ctx) -> dict:
    """issue 29: Megatron's unfused RoPE on one GPU, eager against torch.compile (MEGATRON_TRAINER_COMPILE_ROPE=1)
    and against torch.compile with Inductor's emulate_precision_casts (=exact, the trainer's default): the
    elements of the output and of the input's gradient that differ from eager, and forward + backward time,
    for Llama-3-8B's query heads on one of two TP ranks and the 3B's query and key heads without TP
    (bench/rope_numerics.py). The first shape's figures stay at the top level (earlier calls' layout)."""
    run = Run("rope", 1, ["--device", "cuda", "--shape", *ROPE_SHAPES], gpus=all_gpus(1), module=False,
              script=str(REPO / "bench" / "rope_numerics.py"))
    rc = run.wait(240)
    run.close()
    found = [json.loads(m.group(1)) for m in ROPE_RE.finditer(run.text())]
    out: dict = dict(found[0]) if found else {"rc": rc}
    out["shapes"] = {r["name"]: r for r in found}
    failures: list[str] = []
    check(len(found) == len(ROPE_SHAPES), f"rope: rc={rc}, {len(found)} of {len(ROPE_SHAPES)} result lines", failures)
    for r in found:
        exact = r.get("exact", {})
        check(exact.get("output_elements_differing") == 0 and exact.get("grad_elements_differing") == 0,
              f"rope {r['name']}: the exact compiled RoPE differs from eager: {exact}", failures)
    out.update(ok=not failures, failures=failures)
    return out


def dd_write(path: Path, gib: int, direct: bool) -> dict:
    """Sequential write of `gib` GiB of zeros with dd, O_DIRECT or buffered and flushed (conv=fdatasync)."""
    flag = ["oflag=direct"] if direct else ["conv=fdatasync"]
    t0 = time.monotonic()
    p = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={gib * 16}", *flag],
                       capture_output=True, text=True, timeout=bounded(180))
    seconds = time.monotonic() - t0
    path.unlink(missing_ok=True)
    return {"rc": p.returncode, "gib": gib, "seconds": round(seconds, 2),
            "gb_per_s": round(gib * 2**30 / seconds / 1e9, 3) if p.returncode == 0 else None,
            "dd": (p.stderr.strip().splitlines() or [""])[-1]}


def scenario_disk(ctx) -> dict:
    """issue 49: the checkpoint disk's sequential write speed (the physical limit a save's write is measured
    against), with dd in the directory the checkpoints go to, O_DIRECT and buffered + fdatasync."""
    target = WORK / "ckpt"
    target.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(target)
    df = subprocess.run(["df", "-hT", str(target)], capture_output=True, text=True).stdout
    out = {"free_gib": round(usage.free / 2**30, 1), "total_gib": round(usage.total / 2**30, 1), "df": df.strip(),
           "direct": dd_write(target / "dd.direct", 8, True), "buffered": dd_write(target / "dd.buffered", 8, False)}
    out["ok"] = out["direct"]["rc"] == 0 and out["buffered"]["rc"] == 0
    return out


# name -> Scenario(the function, its line in --list, rough seconds per layout); suite.py registers them.
SCENARIOS = {
    "bench": Scenario(scenario_bench, "GPT 1.35B vs mcore_peer.py and Megatron-LM: tokens/s/GPU, MFU, memory, async "
                      "saves, kill -9 during a save", 230),
    "perf": Scenario(scenario_perf, "ours at TP=N under PERF_VARIANTS and the peers: iteration time, MFU ratio; the "
                     "first losses agree", 360),
    "memory": Scenario(scenario_memory, "peak memory of MEMORY_CONFIGS (calibration data for the memory estimator)",
                       60),
    "detcost": Scenario(scenario_detcost, "the speed cost of --deterministic-mode on the benchmark model at TP=N", 60),
    "objbench": Scenario(scenario_objbench, "async saves to local disk and to the object store (--object-store): "
                         "blocked time, time to publish, bytes/s", 200),
    "collectives": Scenario(scenario_collectives, "Llama-3-8B's TP=2 collectives alone: NCCL's protocol choice and "
                            "each NCCL_PROTO forced", 90),
    "rope": Scenario(scenario_rope, "Megatron's unfused RoPE, eager vs torch.compile: differing elements and time",
                     60),
    "disk": Scenario(scenario_disk, "dd write speed (O_DIRECT, buffered + fdatasync) where the checkpoints go"),
}
