"""LayerNorm / RMSNorm for the local (Transformer-Engine-less) path, with sequence parallelism.

Megatron-Core's `WrappedTorchNorm.__new__` refuses `sequence_parallel`, yet nothing in a
norm depends on it: under sequence parallelism each TP rank normalises its own slice of the sequence
with a replicated weight, and the weight's gradient is a partial sum that
`finalize_model_grads._allreduce_non_tensor_model_parallel_grads` all-reduces over the TP group for
every parameter marked `sequence_parallel` (what apex's FusedLayerNorm and TE's norms mark). This
builder is WrappedTorchNorm plus that mark, used for the layers' and the final norm.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """Builds torch.nn.LayerNorm or torch.nn.RMSNorm (Megatron's LayerNormBuilder signature)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str | None = None) -> torch.nn.Module:
        unsupported = [name for name in ("layernorm_zero_centered_gamma", "persist_layer_norm",
                                         "memory_efficient_layer_norm") if getattr(config, name, False)]
        if unsupported:
            raise ValueError(f"the local norm does not support {', '.join(unsupported)} (needs Transformer Engine)")
        kind = normalization or config.normalization
        if kind == "LayerNorm":
            module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif kind == "RMSNorm":
            module = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"the local norm supports LayerNorm and RMSNorm, not {kind!r}")
        for param in module.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return module
