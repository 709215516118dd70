"""How far torch.compile's RoPE is from Megatron-Core's eager one, bit for bit, and how fast each is (issue 29).

Runs megatron.core's unfused `_apply_rotary_pos_emb_bshd` (RoPE base 500000, bf16 input, seed 0) three ways:
eager, compiled plainly (`MEGATRON_TRAINER_COMPILE_ROPE=1`), and compiled with Inductor's
`emulate_precision_casts` (`=exact`, the trainer's default). For each compiled way it counts the elements of the output,
and of the input's gradient (backward of a random upstream gradient), that differ from eager; on CUDA it
also times forward + backward (median of 50 calls after 10). Prints one line `ROPE {json}` per shape.

    <torch venv>/bin/python bench/rope_numerics.py                      # CPU, [256, 1, 4, 128]
    python bench/rope_numerics.py --device cuda --shape llama8b-tp2 llama3b-q llama3b-kv   # the suite's `rope`

The CPU needs the torch venv (`make torch-tests` builds one) and a C++ compiler for Inductor's CPU backend.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from megatron.core.models.common.embeddings import rope_utils

# [sequence, micro batch, heads, head dim]; llama8b-tp2: Llama-3-8B's query heads on one of two TP ranks;
# llama3b-q / -kv: the 3B's 24 query heads and 8 key heads without TP (its DP=2 and PP=2 runs)
SHAPES = {"small": (256, 1, 4, 128), "llama8b-tp2": (4096, 1, 16, 128), "llama3b-q": (4096, 1, 24, 128),
          "llama3b-kv": (4096, 1, 8, 128)}
MODES = {"compiled": {}, "exact": {"emulate_precision_casts": True}}


def rope_inputs(shape: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    s, d = shape[0], shape[-1]
    t = torch.randn(*shape, dtype=torch.bfloat16, device=device)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    upstream = torch.randn(*shape, dtype=torch.bfloat16, device=device)
    return t, freqs, upstream


def forward_backward(fn, t: torch.Tensor, freqs: torch.Tensor, upstream: torch.Tensor):
    x = t.detach().requires_grad_(True)
    out = fn(x, freqs)
    out.backward(upstream)
    return out.detach(), x.grad


def time_ms(fn, t, freqs, upstream, device: str) -> float | None:
    if device != "cuda":
        return None
    for _ in range(10):
        forward_backward(fn, t, freqs, upstream)
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward_backward(fn, t, freqs, upstream)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


def measure(device: str, shape: tuple[int, ...]) -> dict:
    rope = rope_utils._apply_rotary_pos_emb_bshd
    t, freqs, upstream = rope_inputs(shape, device)
    ref_out, ref_grad = forward_backward(rope, t, freqs, upstream)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "shape": list(shape), "elements": ref_out.numel(),
              "eager": {"fwd_bwd_ms": time_ms(rope, t, freqs, upstream, device)}}
    for name, options in MODES.items():
        torch._dynamo.reset()
        fn = torch.compile(rope, dynamic=False, options=options or None)
        out, grad = forward_backward(fn, t, freqs, upstream)
        result[name] = {"output_elements_differing": int((out != ref_out).sum()),
                        "grad_elements_differing": int((grad != ref_grad).sum()),
                        "output_max_abs_diff": float((out.float() - ref_out.float()).abs().max()),
                        "fwd_bwd_ms": time_ms(fn, t, freqs, upstream, device)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["small"])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    for name in args.shape:
        print("ROPE " + json.dumps({"name": name, **measure(args.device, SHAPES[name])}), flush=True)


if __name__ == "__main__":
    main()
