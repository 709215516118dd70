"""GPU scenarios of issue 50: mixture-of-experts training, ours against Megatron-LM's own pretrain_gpt.py (local
spec: its experts are SequentialMLP) with the same model, MoE flags, layout, global batch, schedule and seed, in
the same device call. Registered in suite.py.

  moe_qwen3    issue 50: a Qwen3-30B-A3B-shaped model (128 experts of ffn 768, top-8, GQA 32/4 heads of 128,
               QK norm, vocabulary 151936), its 48 layers cut to 8 so that it fits 2 x H200 at EP2
               (--moe-layout ep2; on 4 GPUs ep4 or tp2ep2); target: ours >= 2x Megatron-LM
  moe_mixtral  issue 50: a Mixtral-8x7B-shaped model (8 experts of ffn 14336, top-2, GQA 32/8), its 32 layers
               cut to 4 (--moe-layout ep2; on 4 GPUs tp2ep2, issue 50's layout, or ep4); target: >= 1.3x.
               At TP > 1 Megatron-LM is not run: without Transformer Engine or Apex it cannot train MoE there
               (MLM_NO_MOE_AT_TP says why); ours runs alone
  moe_levers   issue 60: the Qwen3-30B-A3B shape (8 layers, global batch 16; --moe-layers, --moe-gbs) at
               --moe-layout ep1 on one GPU, ours only, one run per lever (LEVERS, --moe-levers picks): the
               baseline, Megatron's fused cross entropy, micro-batch 2 and 4, and the benchmark-only forced balance
               (--moe-router-force-load-balancing); moe_levers_<layout>.json after every run
  moe_resume   issue 50: a small MoE model (MOE_SMALL) with --deterministic-mode, per router variant
               (RESUME_VARIANTS: softmax + aux loss; sigmoid + expert bias + shared expert + capacity factor) at
               EP2 (on 4 GPUs also TP2 x EP2 and EP4; --moe-only picks layouts and variants): kill -9 at 25, restart, the
               later losses bit-identical to an uninterrupted run's

Each scenario runs, one after the other: ours (the trainer, its default grouped-GEMM experts), Megatron-LM
(bench/mlm_moe_peer.sh, its source at core_v0.19.0 carried in .run/mlm), and, where the deadline leaves time
(--moe-sequential auto) or when asked (on), ours with Megatron-Core's SequentialMLP
(MEGATRON_TRAINER_MOE_EXPERTS=sequential): the same experts Megatron-LM runs, so that the speed-up splits into
what the grouped GEMMs win and what the rest of the loop wins. Every run trains --moe-iters iterations (default
15); iteration times are from each program's own log line, the first --moe-warmup (default 5) left out. Results:
iteration time (median and mean of the timed window), tokens/s/GPU, MFU by active parameters (`moe_flops_per_token`),
peak memory per GPU, losses 1-3 of both programs and their difference, ours / Megatron-LM, and ours' router figures
at the end (the trainer's Prometheus gauges, scraped while it runs). Also written as moe_<shape>_<layout>.json and
.md under the suite's --out.

Without a GPU, the two command lines of a scenario (nothing runs):

    python3 e2e/gpu/moe.py --dry-run --shape qwen3 --layout ep2

On the device (2 GPUs, one layout per call):

    bash e2e/gpu/run_on_device.sh --gpus 2 --only moe_qwen3 --moe-layout ep2 --stop-on-failure none --deadline-s 540
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from harness import (
    DEADLINE,
    DP_OVERLAP,
    ITER_RE,
    LOGS,
    REPO,
    RESUMED_RE,
    STARTUP_RE,
    WORK,
    Run,
    Scenario,
    all_gpus,
    bounded,
    check,
    ckpt_state,
    free_port,
    mlm_losses_per_iteration,
    model_args,
    summary_losses,
    trainer_args,
    trainer_summaries,
)

# The shapes (harness.model_args keys, plus the MoE ones). Layers cut from the published models' (Qwen3-30B-A3B:
# 48, Mixtral-8x7B: 32) so that both programs fit 2 x H200 at EP2 with the distributed optimizer. The experts'
# optimizer state is not sharded at EP = world size (expert data-parallel size 1): 18 bytes per expert parameter
# (bf16 weight, fp32 gradient, fp32 master and two Adam moments). Per GPU at EP2: Qwen3 ~5.7 GB a layer (64 experts
# of 3 x 2048 x 768) + 7.5 GB of embeddings -> ~53 GB at 8 layers; Mixtral ~13 GB a layer (4 experts of
# 3 x 4096 x 14336) -> ~56 GB at 4 layers; Megatron-LM's unfused attention keeps the s x s scores (32 heads x
# 4096^2 x 2 bytes = 1 GiB a layer, a few times over) on top. Estimates, not measured.
MOE_MODELS = {
    "qwen3": dict(layers=8, hidden=2048, heads=32, groups=4, head_dim=128, ffn=6144, experts=128, moe_ffn=768, topk=8,
                  shared_ffn=0, qk_norm=True, seq=4096, vocab=151936, rotary_base=1000000, norm_eps="1e-06",
                  aux_loss=1e-3, mbs=1, gbs=32, arch="moe", published_layers=48),
    "mixtral": dict(layers=4, hidden=4096, heads=32, groups=8, head_dim=128, ffn=14336, experts=8, moe_ffn=14336,
                    topk=2, shared_ffn=0, qk_norm=False, seq=4096, vocab=32000, rotary_base=1000000, norm_eps="1e-05",
                    aux_loss=0.02, mbs=1, gbs=32, arch="moe", published_layers=32),
}
# (GPUs, TP, EP); DP = GPUs / TP, the experts' data-parallel size GPUs / (TP x EP).
MOE_LAYOUTS = {"ep1": (1, 1, 1), "ep2": (2, 1, 2), "tp2ep2": (4, 2, 2), "ep4": (4, 1, 4)}
# issue 50's speed targets, ours over Megatron-LM
TARGETS = {"qwen3": 2.0, "mixtral": 1.3}
PEER = REPO / "bench" / "mlm_moe_peer.sh"
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 (megatron_trainer.flops.PEAK_BF16_FLOPS)
SEQUENTIAL_ENV = {"MEGATRON_TRAINER_MOE_EXPERTS": "sequential"}
# Why Megatron-LM is not run at TP > 1 (found on 4 x H200, 2026-11-28: --moe-layout tp2ep2 exited 1 on every rank).
MLM_NO_MOE_AT_TP = ("Megatron-LM without Transformer Engine or Apex cannot train MoE at TP > 1: MoELayer raises in "
                    "training at TP > 1 without --sequence-parallel (megatron/core/transformer/moe/moe_layer.py), and "
                    "the local spec's torch norm asserts 'sequence parallel not supported by torch LayerNorm' "
                    "(megatron/core/transformer/torch_norm.py)")


# ----------------------------------------------------------------------------------------------- FLOPs and MFU
def padded_vocab(m: dict, tp: int) -> int:
    """Megatron's padding (128 x TP); NullTokenizer's vocabulary is --vocab-size itself."""
    multiple = 128 * tp
    return -(-m["vocab"] // multiple) * multiple


def moe_active_params(m: dict, vocab: int | None = None) -> dict:
    """Parameters one token passes through, by part (norm weights and biases left out: none are matmuls).

    Per layer, with q = heads x head_dim, k = groups x head_dim, f = 3 (SwiGLU: gate, up, down):
      attention = h(q + 2k) + qh             (QKV and output projections)
      router    = h E                        (E experts)
      experts   = top_k f h F                (the k experts a token is routed to, each of hidden size F)
      shared    = f h F_shared               (shared experts, 0 for Qwen3 and Mixtral)
    and once: output = h V (the logits; V the padded vocabulary), embedding = h V (a lookup, no matmul).
    `matmul` = L x per-layer + output, what the FLOPs count; `total` adds the embedding (the published "active
    parameters": Mixtral-8x7B ~12.9B, Qwen3-30B-A3B ~3.3B)."""
    h, d = m["hidden"], m["head_dim"]
    q, k = m["heads"] * d, m["groups"] * d
    vocab = vocab or m["vocab"]
    part = {"attention": h * (q + 2 * k) + q * h, "router": h * m["experts"], "experts": m["topk"] * 3 * h * m["moe_ffn"],
            "shared_experts": 3 * h * m.get("shared_ffn", 0)}
    per_layer = sum(part.values())
    matmul = m["layers"] * per_layer + h * vocab
    return {**{f"{name}_per_layer": n for name, n in part.items()}, "per_layer": per_layer, "layers": m["layers"],
            "output": h * vocab, "embedding": h * vocab, "matmul": matmul, "total": matmul + h * vocab}


def moe_flops_per_token(m: dict, vocab: int | None = None) -> float:
    """Model FLOPs per token of one training iteration (forward and backward, no recomputation):

        6 x N_matmul + 6 x L x q x s

    N_matmul: moe_active_params' `matmul` (each weight: 2 FLOPs per multiply-add, 3 GEMMs: forward, data and
    weight gradient); 6 L q s: the core attention, QK^T and softmax(QK^T)V at 2 x 2 q s FLOPs each way, halved
    for the causal mask, times 3. This is Megatron-LM 0.19's num_floating_point_operations
    (megatron/training/training.py: routed experts `moe_ffn_hidden_size x moe_router_topk`, shared experts, the
    causal s^2 term halved) plus the router's h x E, which Megatron-LM leaves out (0.3 % at Qwen3's shape)."""
    q = m["heads"] * m["head_dim"]
    return 6.0 * moe_active_params(m, vocab)["matmul"] + 6.0 * m["layers"] * q * m["seq"]


def moe_throughput(m: dict, tp: int, gbs: int, iter_ms: float, gpus: int) -> dict:
    """tokens/s/GPU, TFLOP/s/GPU and MFU by active parameters (moe_flops_per_token over 989 TFLOP/s a GPU)."""
    tokens = gbs * m["seq"]
    per_gpu_s = tokens / (iter_ms / 1000) / gpus
    flops = moe_flops_per_token(m, padded_vocab(m, tp)) * per_gpu_s
    return {"tokens_per_s_per_gpu": round(per_gpu_s), "tflops_per_gpu": round(flops / 1e12, 1),
            "mfu_pct_active_params": round(100 * flops / PEAK_BF16_FLOPS, 2)}


# ------------------------------------------------------------------------------------------------ command lines
def moe_flags(m: dict) -> list[str]:
    """Architecture and MoE flags, the same for ours and Megatron-LM's pretrain_gpt.py (both take the last of a
    repeated flag, so these override model_args' dense defaults: LayerNorm, learned positions)."""
    return ["--normalization", "RMSNorm", "--norm-epsilon", m["norm_eps"], "--position-embedding-type", "rope",
            "--rotary-base", str(m["rotary_base"]), "--swiglu", "--group-query-attention", "--num-query-groups",
            str(m["groups"]), "--kv-channels", str(m["head_dim"]), "--disable-bias-linear",
            *(["--qk-layernorm"] if m["qk_norm"] else []),
            "--num-experts", str(m["experts"]), "--moe-router-topk", str(m["topk"]),
            "--moe-ffn-hidden-size", str(m["moe_ffn"]), "--moe-router-load-balancing-type", "aux_loss",
            "--moe-aux-loss-coeff", f"{m['aux_loss']:g}", "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-dtype", "fp32"]


def shape_for(name: str, layers: int | None = None, gbs: int | None = None) -> dict:
    """A MOE_MODELS shape, its layer count or global batch changed where asked."""
    return dict(MOE_MODELS[name], **({"layers": layers} if layers else {}), **({"gbs": gbs} if gbs else {}))


def ours_args(m: dict, layout: str, iters: int, warmup: int) -> list[str]:
    """Ours' command line, as the operator renders it (harness.trainer_args) with the shape's MoE flags."""
    _, tp, ep = MOE_LAYOUTS[layout]
    return trainer_args(m, tp=tp, ep=ep, mbs=m["mbs"], gbs=m["gbs"], iters=iters, lr="3e-4", warmup=warmup,
                        extra=moe_flags(m))


def mlm_args(m: dict, layout: str, iters: int, warmup: int) -> list[str]:
    """Megatron-LM's command line: the same shape, MoE flags, layout, batch, schedule and seed; its local spec and
    the flags ../shared/bench/mlm_peer.sh gives it without Transformer Engine (no gradient-accumulation fusion, no
    masked-softmax fusion, no persistent layer norm; no RoPE fusion, as harness.run_mlm_peer adds for Llama), its
    DP overlap flags where DP > 1 as in mlm_peer.sh, sequence parallelism where TP > 1 (Megatron-LM refuses MoE at
    TP > 1 without it; ours turns it on itself), and a memory report at the last iteration."""
    gpus, tp, ep = MOE_LAYOUTS[layout]
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "1",
            "--expert-model-parallel-size", str(ep), *model_args(m), *moe_flags(m),
            "--micro-batch-size", str(m["mbs"]), "--global-batch-size", str(m["gbs"]),
            "--train-iters", str(iters), "--lr-decay-iters", str(iters), "--lr", "3e-4", "--min-lr", "3e-05",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(warmup), "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--seed", "1234",
            "--log-interval", "1", "--log-memory-interval", str(iters), "--eval-iters", "0",
            "--eval-interval", "100000", "--use-distributed-optimizer", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
            "--no-persist-layer-norm", "--no-rope-fusion"]
    if gpus // tp > 1:
        args += DP_OVERLAP
    if tp > 1:
        args.append("--sequence-parallel")
    return args


# ------------------------------------------------------------------------------------------------- the runs
def timed_window(iter_ms: dict[int, float], warmup: int) -> dict:
    """Median and mean of the iterations after `warmup`, and which ones they were."""
    steady = [iter_ms[i] for i in sorted(iter_ms) if i > warmup]
    if not steady:
        return {"iter_ms": None, "timed_iterations": []}
    return {"iter_ms": round(statistics.median(steady), 1), "iter_ms_mean": round(statistics.mean(steady), 1),
            "timed_iterations": [i for i in sorted(iter_ms) if i > warmup]}


def router_figures(metrics_text: str) -> dict:
    """The trainer's MoE gauges (metrics.py) from a Prometheus scrape: each expert's share of the routed tokens
    (over the layers), the busiest expert over the mean, idle (layer, expert) pairs, the load-balancing loss."""
    share = {int(e): float(v) for e, v in
             re.findall(r'^megatron_trainer_moe_expert_token_share\{expert="(\d+)"\} ([0-9.eE+-]+)$', metrics_text, re.M)}
    out: dict = {}
    for name in ("moe_expert_load_max_over_mean", "moe_idle_experts", "moe_load_balancing_loss", "iteration"):
        found = re.search(rf"^megatron_trainer_{name} ([0-9.eE+-]+)$", metrics_text, re.M)
        out[name] = float(found.group(1)) if found else None
    if share:
        values = [share[e] for e in sorted(share)]
        out.update(moe_expert_token_share=[round(v, 5) for v in values], share_min=round(min(values), 5),
                   share_max=round(max(values), 5), share_uniform=round(1 / len(values), 5))
    return out


def run_ours(name: str, m: dict, layout: str, iters: int, warmup: int, env: dict | None = None) -> dict:
    """One run of ours: its per-iteration times and losses, throughput, memory, router figures."""
    return run_ours_args(name, m, layout, ours_args(m, layout, iters, warmup), warmup, env)


def run_ours_args(name: str, m: dict, layout: str, args: list[str], warmup: int, env: dict | None = None) -> dict:
    """run_ours with its command line given."""
    gpus, tp, _ = MOE_LAYOUTS[layout]
    port = free_port()
    run_env = {"MEGATRON_METRICS_PORT": str(port), **({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {}),
               **(env or {})}
    run = Run(name, gpus, args, env=run_env, gpus=all_gpus(gpus))
    scraped: dict = {}

    def scrape() -> None:  # the gauges live only while the trainer does: keep the last scrape
        while run.proc.poll() is None:
            try:
                scraped["text"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
            except Exception:
                pass
            time.sleep(1.0)

    threading.Thread(target=scrape, daemon=True).start()
    rc = run.wait(bounded(480))
    wall = time.monotonic() - run.started
    run.close()
    text = run.text()
    logged = {int(x.group(1)): (float(x.group(2)), float(x.group(3)), float(x.group(5))) for x in ITER_RE.finditer(text)}
    res: dict = {"rc": rc, "env": env or {}, "iterations_logged": len(logged),
                 **timed_window({i: v[0] for i, v in logged.items()}, warmup),
                 "iter_ms_each": {i: v[0] for i, v in sorted(logged.items())},
                 "losses_1_3": [logged[i][1] if i in logged else None for i in (1, 2, 3)],
                 "loss_last": logged[max(logged)][1] if logged else None,
                 "peak_alloc_gib_logging_rank": max((v[2] for v in logged.values()), default=None)}
    summary = (trainer_summaries(text) or [None])[-1] or {}
    res["peak_alloc_gib_per_rank"] = [round(r["peak_allocated_gib"], 2) for r in summary.get("memory_per_rank", [])]
    startup = STARTUP_RE.search(text)
    res["startup_to_first_iteration_s"] = float(startup.group(1)) if startup else None
    experts = re.search(r"MoE experts=([^,\n]*(?:\([^)\n]*\))?)", text)  # model.ModelPath.describe
    res["experts"] = experts.group(1).strip() if experts else None
    res["router"] = router_figures(scraped.get("text", ""))
    moe_lines = re.findall(r"MoE iteration\s+(\d+) \|(.*)", text)
    res["router_log_last"] = moe_lines[-1][1].strip()[:300] if moe_lines else None
    if rc != 0:
        res["out_of_memory"] = "out of memory" in text.lower()
        res["error"] = text[-1500:]
    res["wall_s"] = round(wall, 1)
    return res


def run_mlm(name: str, m: dict, layout: str, iters: int, warmup: int) -> dict:
    """Megatron-LM's pretrain_gpt.py through bench/mlm_moe_peer.sh; its process group is killed at the deadline."""
    gpus, _, _ = MOE_LAYOUTS[layout]
    wheel = sorted((REPO / ".whl").glob("megatron_core-*.whl"))
    log = LOGS / f"{name}.log"
    LOGS.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MLM_DIR=str(REPO / ".run" / "mlm"), WHL=str(wheel[0]) if wheel else "", GPUS=str(gpus),
               PORT=str(free_port()), LOG=str(log), CUDA_VISIBLE_DEVICES=all_gpus(gpus))
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(PEER), *mlm_args(m, layout, iters, warmup)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=bounded(480))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers are in the script's session
        out, rc = proc.communicate()[0], -999
    found = re.search(r"MLM_MOE RESULT (\{.*\})", out or "")
    if not found:  # cut before the script printed: read what the log holds
        return {"rc": rc, "error": (out or "")[-1500:], "wall_s": round(time.monotonic() - t0, 1)}
    got = json.loads(found.group(1))
    ms = {int(i): v for i, v in got["iter_ms"].items()}
    losses = mlm_losses_per_iteration([got["losses"][str(i)] for i in (1, 2, 3) if str(i) in got["losses"]])
    res = {"rc": rc, "iterations_logged": len(ms), **timed_window(ms, warmup), "iter_ms_each": ms,
           "losses_1_3": losses, "losses_1_3_as_logged": [got["losses"].get(str(i)) for i in (1, 2, 3)],
           "loss_last": got["losses"][str(max(ms))] if ms and str(max(ms)) in got["losses"] else None,
           "peak_alloc_gib": round(max(got["max_allocated_mb"]) / 1024, 2) if got["max_allocated_mb"] else None,
           "wall_s": round(time.monotonic() - t0, 1)}
    if rc != 0:
        text = log.read_text(errors="replace") if log.is_file() else out
        res["out_of_memory"] = "out of memory" in text.lower()
        res["error"] = text[-1500:]
    return res


def scenario_moe_qwen3(ctx) -> dict:
    return moe_compare(ctx, "qwen3")


def scenario_moe_mixtral(ctx) -> dict:
    return moe_compare(ctx, "mixtral")


def moe_compare(ctx, shape: str) -> dict:
    """Ours, Megatron-LM and (--moe-sequential) ours with SequentialMLP on one shape and layout; see the docstring."""
    layout = ctx.get("moe_layout") or "ep2"
    iters, warmup = ctx.get("moe_iters") or 15, ctx.get("moe_warmup") or 5
    if layout not in MOE_LAYOUTS:
        return {"ok": False, "error": f"unknown --moe-layout {layout}; known: {sorted(MOE_LAYOUTS)}"}
    gpus, tp, ep = MOE_LAYOUTS[layout]
    if gpus > ctx["gpus"]:
        return {"ok": False, "error": f"--moe-layout {layout} needs {gpus} GPUs, the suite has {ctx['gpus']}"}
    if warmup >= iters:
        return {"ok": False, "error": f"--moe-warmup {warmup} leaves no timed iteration of {iters}"}
    m = shape_for(shape, ctx.get("moe_layers"), ctx.get("moe_gbs"))
    active = moe_active_params(m, padded_vocab(m, tp))
    out: dict = {"shape": shape, "layout": layout, "gpus": gpus, "tp": tp, "ep": ep, "dp": gpus // tp,
                 "expert_dp": gpus // (tp * ep), "model": {k: v for k, v in m.items() if k != "arch"},
                 "global_batch": m["gbs"], "tokens_per_iteration": m["gbs"] * m["seq"], "iterations": iters,
                 "warmup_iterations": warmup, "active_params": active,
                 "flops_per_token": moe_flops_per_token(m, padded_vocab(m, tp)),
                 "mfu_formula": "6 x active matmul params per token + 6 x L x heads x head_dim x seq, over 989 TFLOP/s "
                                "a GPU (e2e/gpu/moe.py, moe_flops_per_token)"}
    out["ours"] = run_ours(f"moe_{shape}_{layout}_ours", m, layout, iters, warmup)
    if ctx.get("moe_skip_mlm"):
        out["megatron_lm"] = {"not_run": "--moe-skip-mlm"}
    elif tp > 1:
        out["megatron_lm"] = {"not_run": MLM_NO_MOE_AT_TP}
    elif not (REPO / ".run" / "mlm" / "pretrain_gpt.py").is_file():
        out["megatron_lm"] = {"not_run": "Megatron-LM's source (.run/mlm) not carried"}
    elif time.monotonic() + 120 > DEADLINE[0]:
        out["megatron_lm"] = {"skipped": "deadline"}
    else:
        out["megatron_lm"] = run_mlm(f"moe_{shape}_{layout}_mlm", m, layout, iters, warmup)
    mode = ctx.get("moe_sequential") or "auto"
    mlm_ms = out["megatron_lm"].get("iter_ms")
    # auto: only if the run fits before the deadline, guessed from Megatron-LM's iteration (the same experts)
    need = 90 + iters * (mlm_ms or 10000) / 1000
    if mode == "off":
        out["ours_sequential"] = {"not_run": "--moe-sequential off"}
    elif time.monotonic() + (need if mode == "auto" else 60) > DEADLINE[0]:
        out["ours_sequential"] = {"skipped": f"deadline (needs ~{need:.0f} s)"}
    else:
        out["ours_sequential"] = run_ours(f"moe_{shape}_{layout}_ours_sequential", m, layout, iters, warmup,
                                          SEQUENTIAL_ENV)
    for key in ("ours", "megatron_lm", "ours_sequential"):
        if out[key].get("iter_ms"):
            out[key].update(moe_throughput(m, tp, m["gbs"], out[key]["iter_ms"], gpus))
    compare(out, shape)
    failures: list[str] = []
    check(bool(out["ours"].get("iter_ms")), f"ours rc={out['ours'].get('rc')}", failures)
    check(bool(mlm_ms) or "not_run" in out["megatron_lm"], "Megatron-LM did not run", failures)
    out["ok"], out["failures"] = not failures, failures
    write_outputs(ctx.get("out_dir"), out)
    return out


def compare(out: dict, shape: str) -> None:
    """Ours / Megatron-LM (its iteration time over ours'), against issue 50's target; the losses' differences."""
    mlm = out["megatron_lm"]
    for key in ("ours", "ours_sequential"):
        ours = out.get(key, {})
        if ours.get("iter_ms") and mlm.get("iter_ms"):
            out[f"{key}_speedup_vs_megatron_lm"] = round(mlm["iter_ms"] / ours["iter_ms"], 3)
        a, b = ours.get("losses_1_3") or [], mlm.get("losses_1_3") or []
        if len(a) == 3 == len(b) and None not in a and None not in b:
            out[f"{key}_losses_1_3_abs_diff_vs_megatron_lm"] = [round(abs(x - y), 5) for x, y in zip(a, b, strict=True)]
    if out["ours"].get("iter_ms") and out.get("ours_sequential", {}).get("iter_ms"):
        out["grouped_speedup_vs_sequential"] = round(out["ours_sequential"]["iter_ms"] / out["ours"]["iter_ms"], 3)
    speedup = out.get("ours_speedup_vs_megatron_lm")
    out["target"] = {"speedup_vs_megatron_lm": TARGETS[shape],
                     "met": None if speedup is None else speedup >= TARGETS[shape]}


def table(out: dict) -> str:
    """The scenario's result as a markdown table (one row per program)."""
    m = out["model"]
    head = (f"### {out['shape']} shape, {m['layers']} layers, {out['layout']} ({out['gpus']} GPUs: TP{out['tp']} "
            f"EP{out['ep']} DP{out['dp']}), global batch {out['global_batch']} x {m['seq']}, "
            f"{out['iterations']} iterations, the first {out['warmup_iterations']} not timed\n\n"
            f"Active parameters per token {out['active_params']['total'] / 1e9:.3f} B "
            f"({out['active_params']['matmul'] / 1e9:.3f} B in matmuls); {out['mfu_formula']}.\n\n"
            "| run | iteration ms (median) | tokens/s/GPU | MFU (active params) | peak GiB | losses 1-3 | "
            "ours / Megatron-LM |\n|---|---|---|---|---|---|---|\n")
    rows = []
    for key, label in (("ours", "ours (grouped GEMM experts)"), ("megatron_lm", "Megatron-LM pretrain_gpt.py (local)"),
                       ("ours_sequential", "ours, SequentialMLP experts")):
        r = out.get(key, {})
        if not r.get("iter_ms"):
            why = r.get("not_run") or r.get("skipped") or (f"rc={r.get('rc')}" + (", out of memory"
                                                                                   if r.get("out_of_memory") else ""))
            rows.append(f"| {label} | {why} | | | | | |")
            continue
        peak = r.get("peak_alloc_gib_per_rank") or r.get("peak_alloc_gib")
        ratio = out.get(f"{key}_speedup_vs_megatron_lm", "")
        rows.append(f"| {label} | {r['iter_ms']} | {r['tokens_per_s_per_gpu']} | {r['mfu_pct_active_params']} % | "
                    f"{peak} | {r.get('losses_1_3')} | {ratio} |")
    router = out["ours"].get("router", {})
    tail = (f"\n\nTarget >= {out['target']['speedup_vs_megatron_lm']}x: met={out['target']['met']}. "
            f"Ours' router at the end: busiest expert / mean {router.get('moe_expert_load_max_over_mean')}, "
            f"token share min/max {router.get('share_min')}/{router.get('share_max')} "
            f"(uniform {router.get('share_uniform')}), idle (layer, expert) pairs {router.get('moe_idle_experts')}.\n")
    return head + "\n".join(rows) + tail


def write_outputs(out_dir, out: dict) -> None:
    """moe_<shape>_<layout>.json and .md under the suite's --out (nothing where there is none)."""
    if not out_dir:
        return
    stem = Path(out_dir) / f"moe_{out['shape']}_{out['layout']}"
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))
    stem.with_suffix(".md").write_text(table(out))


# ------------------------------------------------------------------------------------------- levers (issue 60)
# One shape and layout, ours only, one variant per lever, in one call so the figures compare: the baseline, then
# each lever alone. "forced_balance" is the benchmark-only --moe-router-force-load-balancing (every token to
# experts drawn evenly at random, the router's choice ignored), labelled as such, for figures set beside NVIDIA's
# forced-balance tables; the others keep natural routing. mbs: the global batch stays, so the experts' fp32
# main_grad accumulation (the profile's aten::add_, once per micro-batch over every local expert's weights) runs
# gbs / mbs times an iteration.
LEVERS = {
    "baseline": ({}, [], {}),
    "ce_fusion": ({}, [], {"MEGATRON_TRAINER_CE_FUSION": "1"}),
    "mbs2": ({"mbs": 2}, [], {}),
    "mbs4": ({"mbs": 4}, [], {}),
    "forced_balance": ({}, ["--moe-router-force-load-balancing"], {}),
}


def scenario_moe_levers(ctx) -> dict:
    """Issue 60's levers on the Qwen3-30B-A3B shape (--moe-layers, default 8; --moe-gbs, default 16) at
    --moe-layout (default ep1): ours per LEVERS variant, iteration time, tokens/s/GPU, MFU, peak memory, router
    figures. Results are written after every variant (a cut call keeps what ran)."""
    layout = ctx.get("moe_layout") or "ep1"
    iters, warmup = ctx.get("moe_iters") or 8, ctx.get("moe_warmup") or 3
    gpus, tp, ep = MOE_LAYOUTS[layout]
    if gpus > ctx["gpus"]:
        return {"ok": False, "error": f"--moe-layout {layout} needs {gpus} GPUs, the suite has {ctx['gpus']}"}
    base = shape_for("qwen3", ctx.get("moe_layers") or 8, ctx.get("moe_gbs") or 16)
    out: dict = {"shape": "qwen3", "layout": layout, "gpus": gpus, "tp": tp, "ep": ep, "model": dict(base),
                 "iterations": iters, "warmup_iterations": warmup,
                 "active_params": moe_active_params(base, padded_vocab(base, tp)),
                 "flops_per_token": moe_flops_per_token(base, padded_vocab(base, tp)), "variants": {}}
    out["model"].pop("arch", None)
    order = [v for v in (ctx.get("moe_levers") or ",".join(LEVERS)).split(",") if v]
    unknown = [v for v in order if v not in LEVERS]
    if unknown:
        return {"ok": False, "error": f"unknown lever(s) {unknown}; known: {sorted(LEVERS)}"}
    for name in order:
        change, flags, env = LEVERS[name]
        if time.monotonic() + 75 > DEADLINE[0]:
            out["variants"][name] = {"skipped": "deadline"}
            continue
        m = dict(base, **change)
        args = [*ours_args(m, layout, iters, warmup), *flags]
        res = run_ours_args(f"moe_levers_{name}", m, layout, args, warmup, env)
        if res.get("iter_ms"):
            res.update(moe_throughput(m, tp, m["gbs"], res["iter_ms"], gpus))
        res.update(mbs=m["mbs"], gbs=m["gbs"], flags=flags, routing="forced balance (benchmark only)"
                   if "--moe-router-force-load-balancing" in flags else "natural")
        out["variants"][name] = res
        if ctx.get("out_dir"):
            (Path(ctx["out_dir"]) / f"moe_levers_{layout}.json").write_text(json.dumps(out, indent=1, default=str))
    base_ms = out["variants"].get("baseline", {}).get("iter_ms")
    for res in out["variants"].values():
        if base_ms and res.get("iter_ms"):
            res["speedup_vs_baseline"] = round(base_ms / res["iter_ms"], 3)
    out["ok"] = bool(base_ms)
    if ctx.get("out_dir"):
        (Path(ctx["out_dir"]) / f"moe_levers_{layout}.json").write_text(json.dumps(out, indent=1, default=str))
    return out


# ------------------------------------------------------------------------------------ resume at EP > 1
# A small MoE model (8 experts of 512, top-2) for the resume scenario: fast enough for three 40-iteration runs
# per variant in one call. The variants are issue 50's router settings: Megatron's softmax top-k with the
# auxiliary loss, and sigmoid scores with the aux-loss-free expert bias (which changes after every step and lives
# in the checkpoint beside the router's weight), a shared expert and a capacity factor that drops tokens.
MOE_SMALL = dict(layers=4, hidden=512, heads=8, groups=4, head_dim=64, ffn=2048, experts=8, moe_ffn=512, topk=2,
                 shared_ffn=0, qk_norm=False, seq=512, vocab=8192, rotary_base=10000, norm_eps="1e-05",
                 aux_loss=1e-2, mbs=4, arch="moe")
RESUME_VARIANTS = {
    "softmax_aux_loss": [],
    "sigmoid_expert_bias": ["--moe-router-load-balancing-type", "none", "--moe-router-score-function", "sigmoid",
                            "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.001",
                            "--moe-shared-expert-intermediate-size", "1024", "--moe-expert-capacity-factor", "1.5",
                            "--moe-token-drop-policy", "probs"],
}
RESUME_LAYOUTS = {"ep2": (2, 1, 2), "tp2ep2": (4, 2, 2), "ep4": (4, 1, 4)}


def resume_args(variant: str, tp: int, ep: int, dp: int, save: str) -> list[str]:
    """The trainer's command line for one resume variant: 40 iterations, async saves every 10, deterministic."""
    flags = moe_flags(MOE_SMALL)
    if variant != "softmax_aux_loss":  # the aux loss's two flags out: the variant balances by the expert bias
        i = flags.index("--moe-router-load-balancing-type")
        del flags[i:i + 2]
        i = flags.index("--moe-aux-loss-coeff")
        del flags[i:i + 2]
    return trainer_args(MOE_SMALL, tp=tp, ep=ep, mbs=MOE_SMALL["mbs"], gbs=MOE_SMALL["mbs"] * dp * 2, iters=40,
                        save=save, save_interval=10, extra=[*flags, *RESUME_VARIANTS[variant], "--deterministic-mode"])


def scenario_moe_resume(ctx) -> dict:
    """issue 50: resume at EP > 1, bit-exact. Per variant (RESUME_VARIANTS) at each layout the call holds (ep2 on 2
    GPUs; also tp2ep2 and ep4 on 4): an uninterrupted 40-iteration run with --deterministic-mode and async saves
    every 10; the same run killed (kill -9 of the last rank) at iteration 25; its restart must resume from the newest
    complete checkpoint with the optimizer's step, and every later loss must equal the uninterrupted run's bit for
    bit. With the expert bias, a bias not restored would route differently and show in the losses."""
    out: dict = {}
    failures: list[str] = []
    for layout, (gpus, tp, ep) in RESUME_LAYOUTS.items():
        if gpus > ctx["gpus"] or (ctx.get("moe_only") and layout not in ctx["moe_only"]):
            out[layout] = {"skipped": f"needs {gpus} GPUs" if gpus > ctx["gpus"] else "not in --moe-only"}
            continue
        only = ctx.get("moe_only") or set()
        for variant in [v for v in RESUME_VARIANTS if v in only] or list(RESUME_VARIANTS):
            tag = f"{layout}_{variant}"
            if time.monotonic() + 120 > DEADLINE[0]:
                out[tag] = {"skipped": "deadline"}
                failures.append(f"{tag}: skipped by the deadline")
                continue
            env = {"MEGATRON_CHECKPOINT_KEEP": "3", **({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {})}
            ref_save, kill_save = (str(WORK / "ckpt" / f"moe_{kind}_{tag}") for kind in ("ref", "kill"))
            for d in (ref_save, kill_save):
                shutil.rmtree(d, ignore_errors=True)
            r: dict = {"layout": f"TP{tp} EP{ep} DP{gpus // tp}", "variant": variant}
            out[tag] = r
            ref = Run(f"moe_resume_ref_{tag}", gpus, resume_args(variant, tp, ep, gpus // tp, ref_save), env=env)
            rc = ref.wait(300)
            ref.close()
            exact_ref = summary_losses(ref.log_path)
            experts = re.search(r"MoE experts=([^,\n]*)", ref.text())
            r.update(ref_rc=rc, ref_loss_first=exact_ref.get(1), ref_loss_last=exact_ref.get(40),
                     experts=experts.group(1).strip() if experts else None)
            check(rc == 0 and sorted(exact_ref) == list(range(1, 41)), f"{tag}: reference rc={rc}, "
                  f"{len(exact_ref)} losses", failures)
            killed_run = Run(f"moe_resume_kill_{tag}", gpus, resume_args(variant, tp, ep, gpus // tp, kill_save),
                             env=env)
            hit = killed_run.wait_for(re.compile(r"iteration\s+25/"), 240)
            killed = killed_run.kill_rank(gpus - 1)
            killed_run.wait(30)
            killed_run.kill_tree()
            killed_run.wait(60)
            killed_run.close()
            complete = [it for it, ok in ckpt_state(kill_save)["checkpoints"].items() if ok]
            expected = max(complete) if complete else None
            again = Run(f"moe_resume_restart_{tag}", gpus, resume_args(variant, tp, ep, gpus // tp, kill_save),
                        env=env)
            rc2 = again.wait(300)
            again.close()
            text = again.text()
            resumed = RESUMED_RE.search(text)
            exact = summary_losses(again.log_path)
            start = int(resumed.group(2)) if resumed else None
            later = sorted(i for i in exact if start is not None and i > start)
            differing = [(i, exact[i], exact_ref.get(i)) for i in later if exact[i] != exact_ref.get(i)]
            adam = re.search(r"optimizer resumes at AdamW step ([0-9.e+]+)", text)
            warned = sorted(set(re.findall(r"(\w+) does not have a deterministic implementation", text)))
            check(hit is not None and killed, f"{tag}: kill at 25 not done", failures)
            check(rc2 == 0 and start is not None and start == expected,
                  f"{tag}: restart rc={rc2}, resumed from {start}, newest complete {expected}", failures)
            check(expected is not None and later == list(range(expected + 1, 41)), f"{tag}: resumed iterations "
                  f"{later[:3]}..{later[-1:]}", failures)
            check(not differing, f"{tag}: not bit-identical: {differing[:3]}", failures)
            check(adam is not None and start is not None and float(adam.group(1)) == start,
                  f"{tag}: AdamW step after the load {adam.group(1) if adam else None}, resumed {start}", failures)
            r.update(resumed_from=start, newest_complete=expected, compared=[later[0], later[-1]] if later else None,
                     bit_identical=bool(later) and not differing, first_differences=differing[:3],
                     restart_rc=rc2, ops_without_deterministic_kernel=warned,
                     startup_on_resume_s=(float(m.group(1)) if (m := STARTUP_RE.search(text)) else None))
    out["ok"] = not failures and any("bit_identical" in v for v in out.values() if isinstance(v, dict))
    out["failures"] = failures
    return out


# name -> Scenario(the function, its line in --list, rough seconds per layout); suite.py registers them.
SCENARIOS = {
    "moe_qwen3": Scenario(scenario_moe_qwen3, "issue 50: Qwen3-30B-A3B shape (layers cut) per --moe-layout, ours / "
                          "Megatron-LM (/ ours with SequentialMLP): iteration time, MFU by active params, memory", 300),
    "moe_mixtral": Scenario(scenario_moe_mixtral, "issue 50: Mixtral-8x7B shape (layers cut) per --moe-layout, ours / "
                            "Megatron-LM (/ ours with SequentialMLP): iteration time, MFU by active params, memory", 150),
    "moe_levers": Scenario(scenario_moe_levers, "issue 60: Qwen3-30B-A3B shape (8 layers, gbs 16) at --moe-layout "
                           "(ep1), ours per lever (baseline, CE fusion, mbs 2/4, forced balance: benchmark only)", 330),
    "moe_resume": Scenario(scenario_moe_resume, "issue 50: a small MoE model at EP2 (4 GPUs: also TP2xEP2, EP4), "
                           "softmax + aux loss and sigmoid + expert bias + shared expert + capacity: kill -9, resume, "
                           "later losses bit-identical", 200, min_gpus=2),
}


def dry_run(shape: str, layout: str, iters: int = 15, warmup: int = 5, layers: int | None = None,
            gbs: int | None = None) -> dict:
    """What a scenario would run, without running it: both command lines and the FLOPs arithmetic."""
    m = shape_for(shape, layers, gbs)
    gpus, tp, _ = MOE_LAYOUTS[layout]
    return {"ours": ["torchrun", f"--nproc-per-node={gpus}", "-m", "megatron_trainer", *ours_args(m, layout, iters, warmup)],
            "megatron_lm": [f"GPUS={gpus}", "bash", "bench/mlm_moe_peer.sh", *mlm_args(m, layout, iters, warmup)],
            "ours_sequential_env": SEQUENTIAL_ENV, "active_params": moe_active_params(m, padded_vocab(m, tp)),
            "flops_per_token": moe_flops_per_token(m, padded_vocab(m, tp))}


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Print a MoE scenario's two command lines (nothing runs).")
    ap.add_argument("--dry-run", action="store_true", required=True)
    ap.add_argument("--shape", choices=sorted(MOE_MODELS), default="qwen3")
    ap.add_argument("--layout", choices=sorted(MOE_LAYOUTS), default="ep2")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--gbs", type=int, default=None)
    a = ap.parse_args()
    print(json.dumps(dry_run(a.shape, a.layout, a.iters, layers=a.layers, gbs=a.gbs), indent=1))
    sys.exit(0)
