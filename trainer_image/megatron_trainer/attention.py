"""Core attention on torch's scaled_dot_product_attention: the TE-less fast path.

Megatron's local spec only has `DotProductAttention`, which materialises the [b*np, s, s] score
matrix (baddbmm -> softmax -> bmm). This module has the same constructor and forward contract
(`megatron.core.transformer.attention.CoreAttentionBuilder/Interface`) and calls SDPA, whose flash
and cuDNN kernels never build the score matrix. It is plugged into the local layer spec as
`self_attention.submodules.core_attention`, so Megatron's selective recompute still wraps it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch.nn.attention import SDPBackend, sdpa_kernel

# --attention-backend -> SDPA kernels in priority order (None: torch's own choice). cuDNN's fused
# flash attention comes first: on an H200 with torch 2.11 it ran causal fwd+bwd at b=4, 16 heads,
# s=2048, d=128 in 0.86 ms against 1.27 ms for torch's FlashAttention-2 kernel (2.34 ms
# memory-efficient, 8.8 ms unfused); docs/benchmarks/trainer-gpu.md#2026-11-21-gpt-vs-peer. Both keep the
# s x s matrix out of memory.
SDPA_BACKENDS = {
    "flash": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],  # --deterministic-mode: matmul, softmax, matmul (no fused kernel)
    # --deterministic-mode with MEGATRON_TRAINER_DETERMINISTIC_ATTENTION=flash: no cuDNN (torch has no deterministic
    # cuDNN attention backward), each backward under strict deterministic algorithms (strict_backward; the fused
    # kernels are one autograd node each: if SDPA falls back to math, only its last op is held strict, and math is
    # deterministic anyway)
    "flashdet": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "auto": None,
}
# backend lists whose backward must run under strict (not warn-only) deterministic algorithms
STRICT_BACKWARD = frozenset({"flashdet"})

log = logging.getLogger(__name__)


def first_eligible(backends: Sequence[SDPBackend], eligible: Callable[[SDPBackend], bool]) -> str:
    """The kernel SDPA runs under sdpa_kernel(backends, set_priority=True): the first of `backends` that
    `eligible` accepts (torch's select_sdp_backend walks the priority order the same way); "none" if none does."""
    for backend in backends:
        if eligible(backend):
            return backend.name
    return "none"


def cuda_eligibility(params) -> Callable[[SDPBackend], bool]:
    """torch's own checks of one call's shapes, dtypes and device against each fused kernel (math takes any)."""
    checks = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.can_use_flash_attention,
              SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.can_use_efficient_attention,
              SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.can_use_cudnn_attention}
    return lambda backend: backend not in checks or bool(checks[backend](params, False))


def strict_backward(out: torch.Tensor) -> None:
    """Run the backward of the node that made `out` under `torch.use_deterministic_algorithms(True,
    warn_only=False)`, then restore the setting it found.

    torch reads the setting when the backward runs, not when the forward does: with it strict, the flash
    kernel's backward takes its deterministic algorithm and the memory-efficient one a single key split
    (aten/src/ATen/native/transformers/cuda/attention_backward.cu); with it warn-only, as
    `--deterministic-mode` sets it for the whole run (so that an op without a deterministic kernel is named
    instead of ending the run), both only warn and stay non-deterministic. The hooks hold the strict setting
    to this one node's backward."""
    node = out.grad_fn
    if node is None:
        return
    found: list[tuple[bool, bool]] = []

    def before(grad_outputs):
        found.append((torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled()))
        torch.use_deterministic_algorithms(True, warn_only=False)

    def after(grad_inputs, grad_outputs):
        enabled, warn_only = found.pop()
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)

    node.register_prehook(before)
    node.register_hook(after)


class SDPAAttention(MegatronModule):
    """Causal (or masked) attention over [s, b, heads, head_dim] tensors via SDPA; output [s, b, np*hn]."""

    backends: list[SDPBackend] | None = SDPA_BACKENDS["flash"]
    strict: bool = False  # the backward under strict deterministic algorithms (strict_backward)
    kernel_logged: bool = False  # set on the class at its first CUDA forward: the kernel is logged once

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAAttention does not support context parallelism (needs Transformer Engine)")
        tp = pg_collection.tp.size() if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_world_size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp if config.num_query_groups >= tp else 1
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAAttention: packed sequences and attention bias need Transformer Engine")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d] as strided views: SDPA's flash/cuDNN kernels take the strides.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        is_causal = False
        sdpa_mask = None
        if attention_mask is not None and mask_type != AttnMaskType.causal:
            sdpa_mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
        elif attention_mask is not None:
            sdpa_mask = ~attention_mask  # an explicit mask (e.g. reset across documents) wins
        else:
            is_causal = mask_type == AttnMaskType.causal and sq > 1
        dropout = self.dropout_p if self.training else 0.0
        enable_gqa = q.shape[1] != k.shape[1]
        if self.backends is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout,
                                                 is_causal=is_causal, scale=self.softmax_scale, enable_gqa=enable_gqa)
        else:
            with sdpa_kernel(self.backends, set_priority=True):
                if not self.kernel_logged and q.is_cuda and not torch.cuda.is_current_stream_capturing():
                    type(self).kernel_logged = True
                    params = torch.backends.cuda.SDPAParams(q, k, v, sdpa_mask, dropout, is_causal, enable_gqa)
                    log.info("SDPA kernel (first forward, layer %d): %s", self.layer_number,
                             first_eligible(self.backends, cuda_eligibility(params)))
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout,
                                                     is_causal=is_causal, scale=self.softmax_scale,
                                                     enable_gqa=enable_gqa)
        if self.strict and out.requires_grad:
            strict_backward(out)
        # [b, n, s, d] -> [s, b, n*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters


def make_sdpa_attention(backend: str) -> type[SDPAAttention]:
    """A subclass pinned to one backend list (the spec takes a class, not an instance)."""
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}")
    return type(f"SDPAAttention_{backend}", (SDPAAttention,),
                {"backends": SDPA_BACKENDS[backend], "strict": backend in STRICT_BACKWARD})
