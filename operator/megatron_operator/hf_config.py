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

__all__ = ["MAX_CONFIG_BYTES", "HfConfigError", "HfModel", "load_config", "mismatches", "notes", "parse_config",
           "spec_model"]


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
        if hf.shared_expert_gate:
            out["moeSharedExpertGate"] = True
    if hf.router_aux_loss_coef:
        out["moeAuxLossCoeff"] = hf.router_aux_loss_coef
    if hf.moe_layer_pattern:
        out["moeLayerFreq"] = list(hf.moe_layer_pattern)
    if hf.moe_score_function != "softmax":
        out["moeRouterScoreFunction"] = hf.moe_score_function
    if hf.moe_expert_bias:
        # DeepSeek-V3 trains without a load-balancing loss (aux-loss-free balancing by the expert bias)
        out["moeRouterEnableExpertBias"] = True
        out["moeRouterLoadBalancingType"] = "none"
    if hf.moe_router_num_groups:
        out["moeRouterNumGroups"] = hf.moe_router_num_groups
        out["moeRouterGroupTopk"] = hf.moe_router_group_topk
    if hf.moe_router_topk_scaling_factor != 1.0:
        out["moeRouterTopkScalingFactor"] = hf.moe_router_topk_scaling_factor
    return out


def _mla_block(hf: HfModel) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention as spec.model's MLA fields (every dimension given, YaRN's
    parameters when the file scales RoPE, else plain RoPE)."""
    out: dict[str, Any] = {"multiLatentAttention": True, "kvLoraRank": hf.kv_lora_rank, "qkHeadDim": hf.qk_head_dim,
                           "qkPosEmbHeadDim": hf.qk_pos_emb_head_dim, "vHeadDim": hf.v_head_dim}
    if hf.q_lora_rank:
        out["qLoraRank"] = hf.q_lora_rank
    if hf.yarn is None:
        out["ropeType"] = "rope"
        return out
    out["ropeType"] = "yarn"
    names = {"rotary_scaling_factor": "rotaryScalingFactor", "original_max_position_embeddings":
             "originalMaxPositionEmbeddings", "beta_fast": "betaFast", "beta_slow": "betaSlow", "mscale": "mscale",
             "mscale_all_dim": "mscaleAllDim"}
    out.update({names[k]: v for k, v in hf.yarn})
    return out


def notes(hf: HfModel) -> list[str]:
    """What of the checkpoint the import leaves out on purpose (printed by hf-config, logged by the trainer)."""
    if hf.mtp_layers_dropped:
        return [f"config.json num_nextn_predict_layers {hf.mtp_layers_dropped}: the multi-token-prediction layer(s) "
                f"(model.layers.{hf.num_layers}.* and on) are not imported and not exported; training uses the "
                "main model's next-token loss only"]
    return []


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
    if hf.rotary_percent != 1.0:
        out["rotaryPercent"] = hf.rotary_percent
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
    if hf.mla:
        del out["numQueryGroups"]  # one key/value per head (mla-no-query-groups)
        out.update(_mla_block(hf))
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
    differ("multiLatentAttention", model["multiLatentAttention"], f"architecture {hf.architecture} (MLA)", hf.mla)
    differ("ffnHiddenSize", model["ffnHiddenSize"], "intermediate_size", hf.ffn_hidden_size)
    differ("vocabSize", model["vocabSize"], "vocab_size", hf.vocab_size)
    if hf.mla:
        for field, theirs_field, theirs in (
                ("qLoraRank", "q_lora_rank", hf.q_lora_rank), ("kvLoraRank", "kv_lora_rank", hf.kv_lora_rank),
                ("qkHeadDim", "qk_nope_head_dim", hf.qk_head_dim),
                ("qkPosEmbHeadDim", "qk_rope_head_dim", hf.qk_pos_emb_head_dim),
                ("vHeadDim", "v_head_dim", hf.v_head_dim),
                ("ropeType", "rope scaling type", "yarn" if hf.yarn else "rope")):
            differ(field, model[field], theirs_field, theirs)
        for key, theirs in hf.yarn or ():
            field = {"rotary_scaling_factor": "rotaryScalingFactor", "original_max_position_embeddings":
                     "originalMaxPositionEmbeddings", "beta_fast": "betaFast", "beta_slow": "betaSlow",
                     "mscale": "mscale", "mscale_all_dim": "mscaleAllDim"}[key]
            differ(field, model.get(field), f"rope scaling {key}", theirs)
    else:
        differ("kvChannels", model["kvChannels"], "head_dim", hf.head_dim)
    differ("rotaryPercent", model.get("rotaryPercent") or 1.0, "partial_rotary_factor", hf.rotary_percent)
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
               f"architecture {hf.architecture} (shared expert gate)", hf.shared_expert_gate)
        differ("moeRouterScoreFunction", model["moeRouterScoreFunction"],
               f"architecture {hf.architecture} (router scores)", hf.moe_score_function)
        differ("moeRouterEnableExpertBias", model["moeRouterEnableExpertBias"],
               f"architecture {hf.architecture} (expert bias)", hf.moe_expert_bias)
        differ("moeLayerFreq", model.get("moeLayerFreq") or [1] * hf.num_layers,
               "first_k_dense_replace / mlp_only_layers / decoder_sparse_step",
               list(hf.moe_layer_pattern) or [1] * hf.num_layers)
        differ("moeRouterNumGroups", model["moeRouterNumGroups"] or None, "n_group", hf.moe_router_num_groups or None)
        differ("moeRouterGroupTopk", model["moeRouterGroupTopk"] or None, "topk_group",
               hf.moe_router_group_topk or None)
        differ("moeRouterTopkScalingFactor", model.get("moeRouterTopkScalingFactor") or 1.0, "routed_scaling_factor",
               hf.moe_router_topk_scaling_factor)
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
