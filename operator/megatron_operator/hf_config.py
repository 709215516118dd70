"""A Hugging Face ``config.json`` <-> ``spec.model`` (pure): what ``megatron-operator hf-config`` prints
and checks.

The file is read and parsed by ``megatron_contract.hf_config``, the one reader the trainer's
``--hf-init`` check uses too; this module maps the model it describes to spec.model and compares a
job's resolved spec.model with it. ``tests/test_contract.py`` holds the two sides together: a
config.json's spec.model, rendered and parsed by the trainer, is the model the config describes.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_contract.hf_config import MAX_CONFIG_BYTES, HfConfigError, HfModel, load_config, parse_config

__all__ = ["MAX_CONFIG_BYTES", "HfConfigError", "HfModel", "load_config", "mismatches", "parse_config", "spec_model"]


def _moe_block(hf: HfModel) -> dict[str, Any]:
    """The MoE fields of spec.model for Qwen3-MoE, Qwen2-MoE and Mixtral: the experts, the router's top-k and the
    experts' hidden size always (Qwen3-MoE's differs from its intermediate_size), pre-softmax where the file does
    not renormalise the top-k (Qwen norm_topk_prob false), Qwen2-MoE's gated shared expert, and the file's
    load-balancing coefficient as the starting point (a training setting: the job may change it)."""
    out: dict[str, Any] = {"numExperts": hf.num_experts, "moeRouterTopk": hf.moe_topk,
                           "moeFfnHiddenSize": hf.moe_ffn_hidden_size}
    if hf.moe_pre_softmax:
        out["moeRouterPreSoftmax"] = True
    if hf.shared_expert_ffn_hidden_size:
        out["moeSharedExpertIntermediateSize"] = hf.shared_expert_ffn_hidden_size
        out["moeSharedExpertGate"] = True
    if hf.router_aux_loss_coef:
        out["moeAuxLossCoeff"] = hf.router_aux_loss_coef
    return out


def spec_model(hf: HfModel) -> dict[str, Any]:
    """spec.model (wire names) for the model, with only what differs from the defaults left to them; the MoE
    fields for Qwen3-MoE, Qwen2-MoE and Mixtral. (What the converter cannot map, DeepSeek's MLA, gpt-oss's
    attention sinks, parse_config refuses by name.)"""
    out: dict[str, Any] = {
        "numLayers": hf.num_layers, "hiddenSize": hf.hidden_size, "numAttentionHeads": hf.num_heads,
        "numQueryGroups": hf.num_kv_heads, "ffnHiddenSize": hf.ffn_hidden_size, "seqLength": hf.seq_length,
        "maxPositionEmbeddings": hf.max_position_embeddings, "vocabSize": hf.vocab_size,
        "activation": "swiglu", "normalization": "RMSNorm", "normEpsilon": hf.norm_epsilon,
        "positionEmbedding": "rope", "rotaryBase": hf.rope_theta,
    }
    if hf.rope_scaling_factor is not None:
        out["ropeScalingFactor"] = hf.rope_scaling_factor
    if hf.explicit_head_dim:
        out["kvChannels"] = hf.head_dim
    if hf.qk_norm:
        out["qkLayernorm"] = True
    if hf.qkv_bias:
        out["addQkvBias"] = True
    out["untieEmbeddings"] = not hf.tied
    out["addBiasLinear"] = False
    if hf.attention_dropout:
        out["attentionDropout"] = hf.attention_dropout
    if hf.moe:
        out.update(_moe_block(hf))
    return out


def mismatches(model: dict[str, Any], hf: HfModel) -> list[str]:
    """The resolved spec.model (rules.resolved_model) against config.json: one line per field that
    differs, naming both values. The same fields the trainer compares before an import."""
    out: list[str] = []

    def differ(field: str, mine: Any, theirs_field: str, theirs: Any) -> None:
        if mine != theirs:
            out.append(f"spec.model.{field}: {_yamlish(mine)} does not match config.json {theirs_field} "
                       f"{_yamlish(theirs)}")

    differ("numLayers", model["numLayers"], "num_hidden_layers", hf.num_layers)
    differ("hiddenSize", model["hiddenSize"], "hidden_size", hf.hidden_size)
    differ("numAttentionHeads", model["numAttentionHeads"], "num_attention_heads", hf.num_heads)
    differ("numQueryGroups", model["numQueryGroups"], "num_key_value_heads", hf.num_kv_heads)
    differ("ffnHiddenSize", model["ffnHiddenSize"], "intermediate_size", hf.ffn_hidden_size)
    differ("vocabSize", model["vocabSize"], "vocab_size", hf.vocab_size)
    differ("kvChannels", model["kvChannels"], "head_dim", hf.head_dim)
    if not math.isclose(model["normEpsilon"], hf.norm_epsilon, rel_tol=1e-9):
        differ("normEpsilon", model["normEpsilon"], "rms_norm_eps", hf.norm_epsilon)
    differ("rotaryBase", model["rotaryBase"], "rope_theta", hf.rope_theta)
    mine_scaling = model["ropeScalingFactor"] or None
    if mine_scaling != hf.rope_scaling_factor:
        theirs = f"llama3 factor {hf.rope_scaling_factor:g}" if hf.rope_scaling_factor else "none"
        out.append(f"spec.model.ropeScalingFactor: {_yamlish(mine_scaling) if mine_scaling else 'not set'} does "
                   f"not match config.json rope scaling {theirs}")
    differ("untieEmbeddings", model["untieEmbeddings"], "tie_word_embeddings (negated)", not hf.tied)
    differ("qkLayernorm", model["qkLayernorm"], f"architecture {hf.architecture} (QK norm)", hf.qk_norm)
    differ("addQkvBias", model["addQkvBias"], f"architecture {hf.architecture} (QKV bias)", hf.qkv_bias)
    differ("activation", model["activation"], "hidden_act silu (SwiGLU)", "swiglu")
    differ("normalization", model["normalization"], "normalization of the architecture", "RMSNorm")
    differ("positionEmbedding", model["positionEmbedding"], "position embedding of the architecture", "rope")
    differ("addBiasLinear", model["addBiasLinear"], "linear biases of the architecture", False)
    if hf.moe:  # the fields megatron_trainer.hf_config.mismatches compares before an import
        differ("numExperts", model["numExperts"], "the number of experts", hf.num_experts)
        differ("moeRouterTopk", model["moeRouterTopk"], "num_experts_per_tok", hf.moe_topk)
        qwen = hf.family in ("qwen3_moe", "qwen2_moe")
        differ("moeFfnHiddenSize", model["moeFfnHiddenSize"],
               "moe_intermediate_size" if qwen else "intermediate_size", hf.moe_ffn_hidden_size)
        differ("moeRouterPreSoftmax", model["moeRouterPreSoftmax"],
               "norm_topk_prob (negated)" if qwen else f"architecture {hf.architecture}", hf.moe_pre_softmax)
        differ("moeSharedExpertIntermediateSize", model["moeSharedExpertIntermediateSize"] or None,
               "shared_expert_intermediate_size" if hf.shared_expert_ffn_hidden_size
               else f"architecture {hf.architecture} (shared experts)", hf.shared_expert_ffn_hidden_size or None)
        differ("moeSharedExpertGate", model["moeSharedExpertGate"],
               f"architecture {hf.architecture} (shared expert gate)", bool(hf.shared_expert_ffn_hidden_size))
        differ("moeRouterScoreFunction", model["moeRouterScoreFunction"],
               f"architecture {hf.architecture} (router scores)", "softmax")
    elif model["numExperts"]:
        out.append(f"spec.model.numExperts: {model['numExperts']} does not match config.json: the model is dense")
    return out


def _yamlish(v: Any) -> str:
    if v is None:
        return "not set"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)
