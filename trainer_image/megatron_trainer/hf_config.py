"""Hugging Face `config.json` of a Llama-family model (dense, or Qwen3-MoE / Qwen2-MoE / Mixtral) <-> this trainer's flags
(pure: no torch).

The file is read and parsed by `megatron_contract.hf_config`, the one reader the operator's
`megatron-operator hf-config` uses too (the architectures, layouts and refusals are described
there). This module holds the trainer's side:

- `load_config(directory)` -> the config.json of a Hugging Face directory, or HfConfigError naming the file;
- `mismatches(cfg, hf)` -> one message per flag that disagrees with config.json (both values named);
- `export_config(cfg, source, dtype)` -> the config.json an export writes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from megatron_contract.hf_config import (
    ARCHITECTURES,
    LLAMA3_FIXED,
    MAX_CONFIG_BYTES,
    HfConfigError,
    HfModel,
    parse_config,
)
from megatron_contract.hf_config import load_config as read_config_file

from .config import TrainerConfig

__all__ = ["HF_DTYPES", "HfConfigError", "HfModel", "export_config", "generation_config", "load_config",
           "mismatches", "not_converted", "parse_config"]


def load_config(directory: str | Path) -> dict[str, Any]:
    """config.json of a Hugging Face directory as a dict; HfConfigError (one line, naming the file) for a
    missing, unreadable, large or invalid one."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise HfConfigError([f"{path}: missing (a Hugging Face model directory has a config.json)"])
    try:
        return read_config_file(path)
    except HfConfigError as e:
        raise HfConfigError([f"{path}: {problem}" for problem in e.problems]) from None


def not_converted(hf: HfModel) -> list[str]:
    """What of the model config.json describes this trainer's weight converter (hf_mapping) does not read or write
    yet, one line each: megatron_contract parses DeepSeek-V3, GLM-4.5 and dense-layer Qwen3-MoE files (the operator's
    hf-config maps them to spec.model), the converter maps their weights only once hf_mapping has them (issue 61)."""
    out = []
    if hf.mla:
        out.append(f"{hf.architecture}'s multi-head latent attention (q_a_proj, kv_a_proj_with_mqa, ...)")
    if hf.moe_layer_pattern:
        out.append("dense MLP layers among the MoE layers (first_k_dense_replace, mlp_only_layers or "
                   "decoder_sparse_step)")
    if hf.moe_score_function != "softmax" or hf.moe_expert_bias:
        out.append(f"{hf.architecture}'s sigmoid router and its expert bias (e_score_correction_bias)")
    if hf.shared_expert_ffn_hidden_size and not hf.shared_expert_gate:
        out.append(f"{hf.architecture}'s ungated shared experts")
    if hf.rotary_percent != 1.0:
        out.append("partial RoPE (partial_rotary_factor)")
    return [f"the trainer's Hugging Face converter does not map {what} yet" for what in out]


def mismatches(cfg: TrainerConfig, hf: HfModel) -> list[str]:
    """The trainer's flags that disagree with config.json, each naming both values."""
    m = cfg.model
    out: list[str] = []

    def differ(flag: str, mine: Any, field: str, theirs: Any) -> None:
        if mine != theirs:
            out.append(f"{flag} {mine} does not match config.json {field} {theirs}")

    differ("--num-layers", m.num_layers, "num_hidden_layers", hf.num_layers)
    differ("--hidden-size", m.hidden_size, "hidden_size", hf.hidden_size)
    differ("--num-attention-heads", m.num_attention_heads, "num_attention_heads", hf.num_heads)
    differ("--num-query-groups", m.effective_num_query_groups, "num_key_value_heads", hf.num_kv_heads)
    differ("--ffn-hidden-size", m.effective_ffn_hidden_size, "intermediate_size", hf.ffn_hidden_size)
    differ("--vocab-size", m.vocab_size, "vocab_size", hf.vocab_size)
    differ("--kv-channels (head dimension)", m.head_dim, "head_dim", hf.head_dim)
    if not math.isclose(m.norm_epsilon, hf.norm_epsilon, rel_tol=1e-9):
        out.append(f"--norm-epsilon {m.norm_epsilon:g} does not match config.json rms_norm_eps {hf.norm_epsilon:g}")
    differ("--rotary-base", m.rotary_base, "rope_theta", hf.rope_theta)
    mine_scaling = m.rope_scaling_factor if m.use_rope_scaling else None
    if mine_scaling != hf.rope_scaling_factor:
        theirs = f"llama3 factor {hf.rope_scaling_factor:g}" if hf.rope_scaling_factor else "none"
        out.append(f"--use-rope-scaling/--rope-scaling-factor {mine_scaling if mine_scaling is not None else 'off'} "
                   f"does not match config.json rope scaling {theirs}")
    differ("--untie-embeddings-and-output-weights", m.untie_embeddings_and_output_weights,
           "tie_word_embeddings (negated)", not hf.tied)
    differ("--qk-layernorm", m.qk_layernorm, f"architecture {hf.architecture} (QK norm)", hf.qk_norm)
    differ("--add-qkv-bias", m.add_qkv_bias, f"architecture {hf.architecture} (QKV bias)", hf.qkv_bias)
    differ("--swiglu", m.swiglu, "hidden_act silu (SwiGLU)", True)
    differ("--normalization", m.normalization, "normalization of the architecture", "RMSNorm")
    differ("--position-embedding-type", m.position_embedding_type, "position embedding of the architecture", "rope")
    differ("--disable-bias-linear (biases)", m.add_bias_linear, "linear biases of the architecture", False)
    if hf.moe:
        differ("--num-experts", m.num_experts, "the number of experts", hf.num_experts)
        differ("--moe-router-topk", m.moe_router_topk, "num_experts_per_tok", hf.moe_topk)
        qwen = hf.family in ("qwen3_moe", "qwen2_moe")
        differ("--moe-ffn-hidden-size (the experts' hidden size)", m.effective_moe_ffn_hidden_size,
               "moe_intermediate_size" if qwen else "intermediate_size", hf.moe_ffn_hidden_size)
        differ("--moe-router-pre-softmax", m.moe_router_pre_softmax,
               "norm_topk_prob (negated)" if qwen else f"architecture {hf.architecture}", hf.moe_pre_softmax)
        # Qwen2-MoE: one gated shared expert; Qwen3-MoE and Mixtral: none. All: softmax scores, no expert bias
        if hf.shared_expert_ffn_hidden_size:
            differ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size,
                   "shared_expert_intermediate_size", hf.shared_expert_ffn_hidden_size)
        else:
            differ("--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size,
                   f"architecture {hf.architecture} (shared experts)", None)
        differ("--moe-shared-expert-gate", m.moe_shared_expert_gate,
               f"architecture {hf.architecture} (shared expert gate)", bool(hf.shared_expert_ffn_hidden_size))
        differ("--moe-router-score-function", m.moe_router_score_function,
               f"architecture {hf.architecture} (router scores)", "softmax")
    elif m.num_experts:
        out.append(f"--num-experts {m.num_experts}: the Hugging Face model is dense")
    return out


#: Hugging Face dtype names <-> safetensors dtype codes.
HF_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def export_config(cfg: TrainerConfig, source: dict[str, Any] | None, dtype: str) -> dict[str, Any]:
    """config.json of an export: the source's (the model was imported from it) with the exported
    dtype, else one written from the flags (Llama, or Qwen2/Qwen3 when their features are on)."""
    if source is not None:
        out = dict(source)
        out["dtype"] = dtype
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype
        return out
    m = cfg.model
    if m.num_experts:
        family = "qwen2_moe" if m.moe_shared_expert_gate else \
            "qwen3_moe" if m.qk_layernorm or m.moe_router_pre_softmax else "mixtral"
    else:
        family = "qwen3" if m.qk_layernorm else "qwen2" if m.add_qkv_bias else "llama"
    arch = {v: k for k, v in ARCHITECTURES.items()}[family]
    out = {
        "architectures": [arch], "model_type": family, "hidden_act": "silu", "hidden_size": m.hidden_size,
        "intermediate_size": m.effective_ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.effective_num_query_groups,
        "head_dim": m.head_dim, "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings or m.seq_length, "rms_norm_eps": m.norm_epsilon,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_dropout": 0.0,
        "initializer_range": m.init_method_std, "dtype": dtype, "use_cache": True,
        "rope_parameters": {"rope_theta": float(m.rotary_base), "rope_type": "default"},
    }
    if m.use_rope_scaling:
        out["rope_parameters"] = {"rope_theta": float(m.rotary_base), "rope_type": "llama3",
                                  "factor": m.rope_scaling_factor, **LLAMA3_FIXED}
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    if family in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if family in ("qwen3_moe", "qwen2_moe"):
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                   moe_intermediate_size=m.effective_moe_ffn_hidden_size, norm_topk_prob=not m.moe_router_pre_softmax,
                   decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=m.moe_aux_loss_coeff)
    if family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, qkv_bias=m.add_qkv_bias)
    if family == "mixtral":
        out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                   intermediate_size=m.effective_moe_ffn_hidden_size, router_aux_loss_coef=m.moe_aux_loss_coeff,
                   router_jitter_noise=0.0)
    return out


def generation_config(source_dir: Path | None, config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the source's when there is one, else the token ids of config.json."""
    if source_dir is not None:
        path = source_dir / "generation_config.json"
        try:
            if path.stat().st_size <= MAX_CONFIG_BYTES:
                data = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(data, dict):
                    return data
        except (OSError, ValueError, RecursionError):  # unreadable, invalid or nested too deeply
            pass
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out
