"""Model FLOPs, throughput and MFU arithmetic. Pure.

Two formulas, both for a dense GPT:
- `megatron_flops_per_iteration`: Megatron-LM 0.19's `num_floating_point_operations`
  (megatron/training/training.py, num_floating_point_operations) for dense MHA/GQA, (Swi)GLU and causal attention (the s^2
  term halved). This is what the trainer reports as TFLOP/s and MFU.
- `classic_flops_per_iteration`: 72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)) (Narayanan et al. 2021), the
  formula of ../shared/bench/mcore_peer.py: benchmarks against the peer use it for both sides.
"""

from __future__ import annotations

# Dense bf16 peak of an H100/H200 SXM (datasheet), as in the peer benchmark.
PEAK_BF16_FLOPS = 989e12


def classic_flops_per_iteration(global_batch: int, seq_length: int, num_layers: int, hidden_size: int,
                                vocab_size: int) -> float:
    """72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)): fwd+bwd of a GPT with 4h MLP, full s^2 attention."""
    b, s, layers, h, v = global_batch, seq_length, num_layers, hidden_size, vocab_size
    return 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))


def megatron_flops_per_iteration(global_batch: int, seq_length: int, num_layers: int, hidden_size: int,
                                 num_attention_heads: int, num_query_groups: int, ffn_hidden_size: int,
                                 padded_vocab_size: int, swiglu: bool = False, kv_channels: int | None = None,
                                 moe_topk: int = 1) -> float:
    """Megatron-LM 0.19 dense formula: per token 6*[L*(f*h*ffn + 2h*q + 2h*k) + h*V] + 6*L*q*s."""
    kv = kv_channels or hidden_size // num_attention_heads
    q = kv * num_attention_heads
    k = kv * num_query_groups
    f = 3 if swiglu else 2
    tokens = global_batch * seq_length
    dense = 6.0 * (num_layers * (f * hidden_size * ffn_hidden_size * moe_topk + 2 * hidden_size * q
                                 + 2 * hidden_size * k) + hidden_size * padded_vocab_size)
    attention = 6.0 * num_layers * q * seq_length  # causal: the 12*q*s of full attention, halved
    return tokens * (dense + attention)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's vocab padding: up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def throughput(flops_per_iteration: float, tokens_per_iteration: int, iteration_s: float, world_size: int,
               peak_flops: float = PEAK_BF16_FLOPS) -> dict[str, float]:
    """tokens/s (job), tokens/s/GPU, TFLOP/s/GPU and MFU for one iteration time."""
    if iteration_s <= 0 or world_size <= 0:
        raise ValueError("iteration time and world size must be > 0")
    flops_per_gpu_s = flops_per_iteration / iteration_s / world_size
    return {
        "tokens_per_s": tokens_per_iteration / iteration_s,
        "tokens_per_s_per_gpu": tokens_per_iteration / iteration_s / world_size,
        "tflops_per_gpu": flops_per_gpu_s / 1e12,
        "mfu": flops_per_gpu_s / peak_flops,
    }
