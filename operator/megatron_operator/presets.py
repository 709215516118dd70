"""Model presets and GPU sizes (pure data).

GPT sizes: the table of Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM" (heads / hidden / layers; sequence 2048, vocabulary 51200, GeLU,
LayerNorm, learned absolute positions, tied embeddings). Llama-style sizes: Llama 3 8B and 70B
(GQA with 8 query groups, SwiGLU, RMSNorm with epsilon 1e-5, RoPE base 500000, untied embeddings, no
linear bias; Llama 3.1's RoPE scaling is spec.model.ropeScalingFactor: 8, not part of the preset).

A preset gives only what defines the architecture; values it leaves out are derived the same way
as for explicit models (query groups = heads, FFN = 4 x hidden, max positions = sequence length).
Explicit ``spec.model`` fields override a preset.
"""

from __future__ import annotations

from typing import Any

_GPT_COMMON: dict[str, Any] = {
    "seqLength": 2048,
    "vocabSize": 51200,
    "activation": "gelu",
    "normalization": "LayerNorm",
    "positionEmbedding": "learned_absolute",
}


def _gpt(heads: int, hidden: int, layers: int) -> dict[str, Any]:
    return {"numAttentionHeads": heads, "hiddenSize": hidden, "numLayers": layers, **_GPT_COMMON}


_LLAMA_COMMON: dict[str, Any] = {
    "numQueryGroups": 8,
    "seqLength": 8192,
    "vocabSize": 128256,
    "activation": "swiglu",
    "normalization": "RMSNorm",
    "normEpsilon": 1e-5,
    "positionEmbedding": "rope",
    "rotaryBase": 500000,
    "untieEmbeddings": True,
    "addBiasLinear": False,
}

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt-1.7b": _gpt(24, 2304, 24),
    "gpt-3.6b": _gpt(32, 3072, 30),
    "gpt-7.5b": _gpt(32, 4096, 36),
    "gpt-18.4b": _gpt(48, 6144, 40),
    "gpt-39.1b": _gpt(64, 8192, 48),
    "gpt-76.1b": _gpt(80, 10240, 60),
    "gpt-145.6b": _gpt(96, 12288, 80),
    "gpt-310.1b": _gpt(128, 16384, 96),
    "llama3-8b": {"numLayers": 32, "hiddenSize": 4096, "numAttentionHeads": 32, "ffnHiddenSize": 14336,
                  **_LLAMA_COMMON},
    "llama3-70b": {"numLayers": 80, "hiddenSize": 8192, "numAttentionHeads": 64, "ffnHiddenSize": 28672,
                   **_LLAMA_COMMON},
}

# Total device memory as nvidia-smi reports it (MiB / 1024), for `resources.gpuType`.
GPU_MEMORY_GIB: dict[str, float] = {
    "A100-40GB": 40.0,
    "A100-80GB": 80.0,
    "H100-80GB": 79.6,   # 81559 MiB (read on the lent H100, 2026-11-13)
    "H100-94GB": 93.6,
    "H200": 140.4,       # 143771 MiB (read on the lent H200, 2026-10-27)
    "B200": 179.1,
    "L40S": 45.0,
}

# Dense bf16 peak (TFLOP/s) used for MFU, per GPU type.
GPU_PEAK_BF16_TFLOPS: dict[str, float] = {
    "A100-40GB": 312.0,
    "A100-80GB": 312.0,
    "H100-80GB": 989.0,
    "H100-94GB": 989.0,
    "H200": 989.0,
    "B200": 2250.0,
    "L40S": 362.0,
}
