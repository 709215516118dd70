"""GroupedMLP against SequentialMLP on one GPU: what the CPU tests cannot show (not run in CI; needs CUDA).

    python tests/trainer/moe_gpu_check.py [--shape qwen3-30b|mixtral] [--experts N] [--tokens T] [--iters K]

One process, Megatron's parallel state at TP = EP = 1 (the experts of one EP rank: --experts is the local count,
e.g. 32 for Qwen3-30B-A3B's 128 at EP 4). bf16 weights, tokens already sorted by expert with uneven counts,
some experts given none (the layout the dispatcher hands the experts).

1. Correctness on CUDA's grouped_mm: GroupedMLP with groups unpadded (MEGATRON_TRAINER_MOE_GROUP_ALIGN=1) and
   padded to 8 rows (the default before 2026-11-28) against its own per-expert loop and against SequentialMLP with the
   same weights: outputs and the gradients of tokens, probabilities and weights, as max abs diff over the
   reference's max. An expert with no token must get a zero weight gradient (PyTorch issue 172439 reports
   otherwise on B200). If the unpadded errors match the padded ones, the padding can go
   (MEGATRON_TRAINER_MOE_GROUP_ALIGN=1, or change moe.default_align).
2. Speed: median forward+backward time of the experts alone, SequentialMLP vs GroupedMLP (its loop and grouped_mm
   at both alignments), over
   --iters iterations after warm-up.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "contract")]

SHAPES = {"qwen3-30b": {"hidden": 2048, "ffn": 768, "topk": 8, "experts": 32},
          "mixtral": {"hidden": 4096, "ffn": 14336, "topk": 2, "experts": 4}}


def counts_for(experts: int, tokens: int, gen) -> list[int]:
    """Uneven tokens per expert summing to `tokens`, a quarter of the experts (at least one) given none."""
    import torch

    weights = torch.rand(experts, generator=gen) ** 3
    weights[torch.randperm(experts, generator=gen)[:max(1, experts // 4)]] = 0
    raw = (weights / weights.sum() * tokens).floor().long()
    raw[int(weights.argmax())] += tokens - int(raw.sum())
    return raw.tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b")
    ap.add_argument("--experts", type=int, help="local experts (default: the shape's)")
    ap.add_argument("--tokens", type=int, default=16384, help="routed tokens on this rank (tokens x top-k)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_trainer.moe import GroupedMLP

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    shape = SHAPES[args.shape]
    experts = args.experts or shape["experts"]
    cfg = TransformerConfig(num_layers=1, hidden_size=shape["hidden"], num_attention_heads=16,
                            num_moe_experts=experts, moe_router_topk=shape["topk"], moe_ffn_hidden_size=shape["ffn"],
                            ffn_hidden_size=shape["ffn"], gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, bias_activation_fusion=True, bf16=True,
                            params_dtype=torch.bfloat16)
    pgs = get_default_pg_collection()
    seq = SequentialMLP(experts, cfg, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                               linear_fc2=RowParallelLinear), pg_collection=pgs)
    grp = GroupedMLP(experts, cfg, pg_collection=pgs)
    with torch.no_grad():
        grp.weight1.copy_(torch.stack([e.linear_fc1.weight for e in seq.local_experts]))
        grp.weight2.copy_(torch.stack([e.linear_fc2.weight for e in seq.local_experts]))
    gen = torch.Generator().manual_seed(0)
    counts = counts_for(experts, args.tokens, gen)
    counts_t = torch.tensor(counts, device="cuda")
    x = torch.randn(args.tokens, shape["hidden"], generator=gen).to("cuda", torch.bfloat16)
    probs = torch.rand(args.tokens, generator=gen).cuda()
    grad = torch.randn(args.tokens, shape["hidden"], generator=gen).to("cuda", torch.bfloat16)

    def step(module, **kw):
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        out, _ = module(xx, counts_t, pp, **kw)
        out.backward(grad)
        return out.detach().float(), xx.grad.float(), pp.grad.float()

    def wgrads(module):
        if module is seq:
            return (torch.stack([e.linear_fc1.weight.grad for e in seq.local_experts]).float(),
                    torch.stack([e.linear_fc2.weight.grad for e in seq.local_experts]).float())
        return module.weight1.grad.float(), module.weight2.grad.float()

    def rel(a, b) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    seq.zero_grad(set_to_none=True)
    ref = step(seq)
    ref_w = wgrads(seq)
    loop_out = None
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
                    "local_experts": experts, "tokens": args.tokens, "idle_experts": counts.count(0),
                    "grouped_mm_problem": grp.problem(x)}
    for label, align, grouped in (("loop", 1, False), ("grouped_align1", 1, True), ("grouped_align8", 8, True)):
        grp.align = align
        grp.zero_grad(set_to_none=True)
        got = step(grp, grouped=grouped)
        w = wgrads(grp)
        idle = [i for i, n in enumerate(counts) if n == 0]
        result[label] = {
            "vs_sequential": {"out": rel(got[0], ref[0]), "dx": rel(got[1], ref[1]), "dprobs": rel(got[2], ref[2]),
                              "dw1": rel(w[0], ref_w[0]), "dw2": rel(w[1], ref_w[1])},
            "idle_experts_grad_zero": all(float(w[0][i].abs().max()) == 0 and float(w[1][i].abs().max()) == 0
                                          for i in idle)}
        if label == "loop":
            loop_out = got
        else:
            result[label]["vs_loop"] = {"out": rel(got[0], loop_out[0]), "dx": rel(got[1], loop_out[1])}

    def timed(module, **kw) -> float:
        for _ in range(3):
            step(module, **kw)
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(module, **kw)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    result["ms_fwd_bwd"] = {"sequential": timed(seq)}
    for label, align, grouped in (("loop", 1, False), ("grouped_align1", 1, True), ("grouped_align8", 8, True)):
        grp.align = align
        result["ms_fwd_bwd"][label] = timed(grp, grouped=grouped)
    print(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
