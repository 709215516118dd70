"""A Hugging Face ``config.json`` of a Llama-family model -> the architecture it describes (pure).

The one reader of config.json: the operator's ``megatron-operator hf-config`` (spec.model from the
file, or a job checked against it) and the trainer's ``--hf-init`` check (the file against its
flags) both call ``load_config`` and ``parse_config`` here, so they accept and refuse the same files
with the same words. What each side compares the model with stays on its side
(``megatron_operator.hf_config``, ``megatron_trainer.hf_config``).

Architectures: Llama 2/3/3.1/3.2 (RoPE ``default`` or ``llama3``), Mistral, Qwen2/2.5 (QKV bias),
Qwen3 (QK norm), and the mixture-of-experts Qwen3-MoE (dense layers too: mlp_only_layers, decoder_sparse_step),
Qwen2-MoE (a gated shared expert), Mixtral, DeepSeek-V3 (multi-head latent attention with YaRN, dense first layers,
the sigmoid router with its expert bias, group-limited top-k and routed scale, shared experts; Kimi-K2 and Moonlight
ship as DeepseekV3ForCausalLM) and GLM-4.5 (the same MoE block, partial RoPE, QKV bias). DeepSeek-V3's and GLM-4.5's
multi-token-prediction layers (num_nextn_predict_layers) are not imported: HfModel.mtp_layers_dropped names them.
DeepSeek-V2 and gpt-oss are refused by name. Both layouts: transformers 5 (``rope_parameters``, ``dtype``) and 4.x (top-level
``rope_theta``/``rope_scaling``, ``torch_dtype``). Every field that changes the math is mapped or
refused by name; a field not known here is refused too (it may change the math). Any JSON value,
of any type or shape, is either accepted or refused with HfConfigError, one line per problem.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: config.json files are a few kB; a larger one is refused before it is parsed.
MAX_CONFIG_BYTES = 1 << 20
#: The sequence length when the caller gives none: the model's context, at most this.
DEFAULT_MAX_SEQ_LENGTH = 4096
#: Values echoed in a problem are cut to this many characters (a config.json value may be a long list).
MAX_ECHO = 80
#: Layer patterns (moe_layer_pattern) are built only up to this many layers: a file may say any number, and
#: spec.model.numLayers (at most 1024) refuses more anyway.
MAX_PATTERN_LAYERS = 1 << 16
#: Unknown fields named one by one; the rest are counted in one line.
MAX_UNKNOWN_NAMED = 10

DENSE_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                       "Qwen3ForCausalLM": "qwen3"}
#: Mixture-of-experts architectures.
MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                     "MixtralForCausalLM": "mixtral", "DeepseekV3ForCausalLM": "deepseek_v3",
                     "Glm4MoeForCausalLM": "glm4_moe"}
#: The DeepSeek-V3-style MoE block (sigmoid router with an expert bias, group-limited top-k, routed scale, shared
#: experts, dense first layers): DeepSeek-V3/R1, Kimi-K2, Moonlight (DeepseekV3ForCausalLM) and GLM-4.5 (Glm4Moe).
ROUTED_FAMILIES = ("deepseek_v3", "glm4_moe")
ARCHITECTURES = {**DENSE_ARCHITECTURES, **MOE_ARCHITECTURES}
#: Architectures refused with the reason (what in them the converter cannot represent).
REFUSED_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2's multi-head latent attention (MLA) and shared experts",
    "GptOssForCausalLM": "gpt-oss's attention sinks, router and expert biases and clamped SwiGLU",
}
# Megatron-Core 0.19 implements only Llama 3.1-style RoPE scaling, with these fixed
# (models/common/embeddings/rotary_pos_embedding.py, RotaryEmbedding._apply_scaling).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Fields that describe the file or generation, not the network's math.
INFO_ONLY = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "use_cache", "max_window_layers", "_name_or_path", "output_attentions",
    "output_hidden_states", "return_dict"})
# Fields read below (mapped, or accepted only with the values the converter can represent).
MAPPED = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "rms_norm_eps", "head_dim", "tie_word_embeddings", "hidden_act",
    "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias", "pretraining_tp",
    "attention_dropout", "sliding_window", "use_sliding_window", "layer_types", "partial_rotary_factor"})
# Fields read for the mixture-of-experts architectures only (in a dense family they are refused as MoE fields).
# router_aux_loss_coef and output_router_logits are training settings, not the network's math.
MOE_MAPPED = frozenset({
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_jitter_noise", "router_aux_loss_coef", "output_router_logits"})
#: Fields of one family only (elsewhere they are not known, so refused).
_ROUTED_MAPPED = frozenset({"n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group", "topk_group",
                            "first_k_dense_replace", "num_nextn_predict_layers"})
FAMILY_MAPPED = {"qwen2_moe": frozenset({"shared_expert_intermediate_size", "qkv_bias"}),
                 # transformers 4.x files (DeepSeek's own) carry topk_method, scoring_func, moe_layer_freq, ep_size,
                 # aux_loss_alpha and seq_aux too; qk_head_dim is derived (nope + rope)
                 "deepseek_v3": _ROUTED_MAPPED | frozenset({
                     "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "qk_head_dim", "rope_interleave", "topk_method", "scoring_func", "moe_layer_freq", "ep_size",
                     "aux_loss_alpha", "seq_aux"}),
                 "glm4_moe": _ROUTED_MAPPED | frozenset({"use_qk_norm"})}
#: YaRN's fields as config.json names them -> Megatron-Core's (MLA's YarnRotaryEmbedding), with transformers' defaults.
YARN_FIELDS = {"original_max_position_embeddings": ("original_max_position_embeddings", None),
               "beta_fast": ("beta_fast", 32.0), "beta_slow": ("beta_slow", 1.0), "mscale": ("mscale", 1.0),
               "mscale_all_dim": ("mscale_all_dim", 0.0)}


class HfConfigError(ValueError):
    """config.json cannot be represented; ``problems``: one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class HfModel:
    """The architecture a config.json describes."""

    family: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | qwen2_moe | mixtral | deepseek_v3 | glm4_moe
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int
    norm_epsilon: float
    rope_theta: int  # Megatron's --rotary-base (spec.model.rotaryBase) is an integer
    rope_scaling_factor: float | None  # llama3-style scaling, else None
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    attention_dropout: float
    seq_length: int  # the training sequence the sliding-window check used
    dtype: str | None  # the file's dtype (torch_dtype in 4.x), when it names one
    # mixture of experts (0 experts: dense)
    num_experts: int = 0
    moe_topk: int = 0  # num_experts_per_tok
    moe_ffn_hidden_size: int = 0  # each expert's MLP (Qwen3-MoE moe_intermediate_size, Mixtral intermediate_size)
    moe_pre_softmax: bool = False  # softmax over all experts, top-k not renormalised (Qwen3-MoE norm_topk_prob false)
    router_aux_loss_coef: float = 0.0  # the file's load-balancing coefficient (a training setting, a suggestion)
    # shared experts every token passes (0: none); Qwen2-MoE's output scaled by sigmoid(a learned gate)
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    # which layers are MoE (1) or dense (0), one per layer; () for every layer MoE
    moe_layer_pattern: tuple[int, ...] = ()
    # the DeepSeek-V3-style router: sigmoid scores with an expert bias (e_score_correction_bias), group-limited
    # top-k (0: no groups), the routed probabilities scaled (routed_scaling_factor; 1.0: not scaled)
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    moe_router_topk_scaling_factor: float = 1.0
    # multi-head latent attention (DeepSeek-V3; 0 q_lora_rank: queries not compressed)
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0  # qk_nope_head_dim
    qk_pos_emb_head_dim: int = 0  # qk_rope_head_dim
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek's rotary pairs (x0, x1), (x2, x3): the importer permutes the rope rows
    # YaRN (MLA only): factor and YARN_FIELDS' values; None: no scaling
    yarn: tuple[tuple[str, float], ...] | None = None
    rotary_percent: float = 1.0  # partial_rotary_factor (GLM-4.5: 0.5)
    # multi-token-prediction layers in the checkpoint that the import drops (num_nextn_predict_layers): named, never
    # silently lost; their tensors are model.layers.<num_layers + i>.*
    mtp_layers_dropped: int = 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def explicit_head_dim(self) -> bool:
        """Megatron's kv_channels default (hidden / heads) is not the head dimension (MLA has its own dimensions)."""
        return not self.mla and (self.hidden_size % self.num_heads != 0
                                 or self.head_dim != self.hidden_size // self.num_heads)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe and (not self.moe_layer_pattern or self.moe_layer_pattern[layer] == 1)


def _shorten(text: str, limit: int = MAX_ECHO) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _show(value: Any) -> str:
    """``value`` as one short line: repr escapes newlines and other unprintable characters."""
    return _shorten(repr(value))


def _key(key: str) -> str:
    """A field name as one short line: as written when printable, else its repr."""
    return _shorten(key if key.isprintable() else repr(key), 64)


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # JSON readers disagree on which one wins
            raise _DuplicateKey(f"key {_show(key)} is given twice")
        out[key] = value
    return out


def load_config(path: str | Path) -> dict[str, Any]:
    """The config.json at ``path`` as a dict; HfConfigError (one line) for an unreadable, large or invalid file."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise HfConfigError([f"cannot read: {exc.strerror or exc}"]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise HfConfigError([f"larger than {MAX_CONFIG_BYTES} bytes; a config.json is a few kB"])
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_refuse_duplicates)
    except UnicodeDecodeError:
        raise HfConfigError(["not UTF-8 text"]) from None
    except RecursionError:
        raise HfConfigError(["invalid JSON: nested too deeply"]) from None
    except json.JSONDecodeError as exc:
        raise HfConfigError([f"invalid JSON: line {exc.lineno}, column {exc.colno}: {exc.msg}"]) from None
    except _DuplicateKey as exc:
        raise HfConfigError([f"invalid JSON: {exc}"]) from None
    except ValueError:  # json.loads raises no other: an integer longer than Python converts to a number
        digits = sys.get_int_max_str_digits()
        raise HfConfigError([f"invalid JSON: a number of more than {digits} digits"]) from None
    if not isinstance(data, dict):
        raise HfConfigError([f"not a JSON object (got {type(data).__name__})"])
    return data


def _int(d: dict[str, Any], key: str, problems: list[str], default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        problems.append(f"config.json {key}: expected an integer >= 1, got {_show(v)}")
        return 1
    return v


def _number(v: Any) -> float | None:
    """``v`` as a finite float, else None: not a bool, not infinite or NaN, and not an integer too large for
    a float (JSON allows any number of digits)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _float(d: dict[str, Any], key: str, problems: list[str], default: float) -> float:
    v = d.get(key, default)
    if _number(v) is None:
        problems.append(f"config.json {key}: expected a number, got {_show(v)}")
        return default
    return float(v)


def _rope(d: dict[str, Any], problems: list[str], yarn: list[Any] | None = None) -> tuple[int, float | None]:
    """(rope_theta, llama3 scaling factor or None) from either layout; for MLA (``yarn`` a list) YaRN's parameters
    are appended to ``yarn`` instead (Megatron-Core's MLA takes YaRN, not Llama 3.1's scaling)."""
    params, scaling = d.get("rope_parameters"), d.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        problems.append(f"config.json rope_parameters: expected an object, got {_show(params)}")
        params = None
    if scaling is not None and not isinstance(scaling, dict):
        problems.append(f"config.json rope_scaling: expected an object or null, got {_show(scaling)}")
        scaling = None
    merged: dict[str, Any] = {**(scaling or {}), **(params or {})}
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    if _number(theta) is None or theta <= 0:
        problems.append(f"config.json rope_theta: expected a positive number, got {_show(theta)}")
        theta = 10000
    elif float(theta) != int(theta):
        problems.append(f"config.json rope_theta: {theta} is not a whole number (rotaryBase, Megatron's "
                        "--rotary-base, is an integer)")
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return int(theta), None
    if yarn is not None and kind == "yarn":
        factor = merged.get("factor")
        if _number(factor) is None or factor < 1:
            problems.append(f"config.json rope scaling factor: expected a number >= 1, got {_show(factor)}")
            return int(theta), None
        yarn.append(("rotary_scaling_factor", float(factor)))
        for key, (name, default) in YARN_FIELDS.items():
            value = merged.get(key, default)
            if value is None:  # transformers' default: max_position_embeddings / factor (never in DeepSeek's files)
                problems.append(f"config.json rope scaling {key}: missing (YaRN needs it)")
                continue
            if _number(value) is None or value < 0:
                problems.append(f"config.json rope scaling {key}: expected a number >= 0, got {_show(value)}")
                continue
            yarn.append((name, float(value) if key != "original_max_position_embeddings" else int(value)))
        extra = sorted(set(merged) - {"rope_theta", "rope_type", "type", "factor", "partial_rotary_factor",
                                      *YARN_FIELDS})
        for key in extra:
            if key == "truncate" and merged[key] is True:  # transformers' default, Megatron-Core's only behaviour
                continue
            if key == "attention_factor" and merged[key] is None:
                continue
            problems.append(f"config.json rope scaling {_key(key)}: {_show(merged[key])}; Megatron-Core's YaRN has no "
                            "such parameter: the converter cannot represent it")
        return int(theta), None
    if kind != "llama3":
        problems.append(f"config.json rope scaling type {_show(kind)}: the converter cannot represent it (only "
                        "default and llama3 RoPE; Megatron-Core implements no linear, dynamic, yarn or longrope "
                        "scaling)")
        return int(theta), None
    for key, want in LLAMA3_FIXED.items():
        got = merged.get(key)
        if isinstance(got, bool) or got != want:
            problems.append(f"config.json rope scaling {key}: {_show(got)}, but Megatron-Core's llama3 RoPE "
                            f"scaling is fixed at {want:g}; the converter cannot represent it")
    factor = merged.get("factor")
    if _number(factor) is None or factor < 1:
        problems.append(f"config.json rope scaling factor: expected a number >= 1, got {_show(factor)}")
        return int(theta), None
    return int(theta), float(factor)


def _unknown_key_problem(key: str, moe: bool) -> str:
    if "expert" in key or "moe" in key or key.startswith("router") or key == "num_local_experts":
        where = "not one of this architecture's" if moe else "in a dense architecture"
        return (f"config.json {_key(key)}: mixture-of-experts field {where}: the converter cannot represent it")
    if key == "quantization_config":
        return ("config.json quantization_config: quantized checkpoints: the converter cannot represent them; "
                "start from the unquantized weights")
    if key == "auto_map":
        return "config.json auto_map: the model needs custom code (trust_remote_code); the converter cannot represent it"
    return (f"config.json field {_key(key)} is not known to the converter; it may change the model's math; "
            "remove it only if you know it does not")


def _unknown_keys(d: dict[str, Any], family: str, moe: bool) -> list[str]:
    unknown = sorted(set(d) - INFO_ONLY - MAPPED - (MOE_MAPPED if moe else frozenset())
                     - FAMILY_MAPPED.get(family, frozenset()))
    problems = [_unknown_key_problem(k, moe) for k in unknown[:MAX_UNKNOWN_NAMED]]
    if len(unknown) > MAX_UNKNOWN_NAMED:
        problems.append(f"config.json: {len(unknown) - MAX_UNKNOWN_NAMED} more fields not known to the converter")
    return problems


def _layer_types(d: dict[str, Any], layers: int, problems: list[str]) -> bool:
    """Whether ``layer_types`` has sliding-attention layers; what it cannot represent goes to ``problems``."""
    layer_types = d.get("layer_types")
    if layer_types is None:
        return False
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        problems.append(f"config.json layer_types: expected a list of {_show(layers)} entries")
        return False
    # items may be any JSON value, lists and objects too: compared, never hashed
    unknown = sorted({_show(t) for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if unknown:
        problems.append(f"config.json layer_types: {', '.join(unknown[:5])}"
                        f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''}: the converter cannot "
                        "represent them (only full_attention, and sliding_attention with a window of at least "
                        "the sequence)")
    return "sliding_attention" in layer_types


def _moe(d: dict[str, Any], family: str, ffn: int, problems: list[str]) -> dict[str, Any]:
    """The HfModel fields of a Qwen3-MoE, Qwen2-MoE or Mixtral config.json; what the converter cannot represent
    goes to ``problems``. Qwen3-MoE: transformers 5 writes num_local_experts, the published files num_experts
    (either; both must agree). Every layer must be a MoE layer (Megatron's moe_layer_freq is not wired).
    Qwen2-MoE is Qwen3-MoE's block plus one shared expert (shared_expert_intermediate_size wide) whose output
    is scaled by sigmoid(shared_expert_gate(x)): Megatron's shared experts with moe_shared_expert_gate."""
    if family in ROUTED_FAMILIES:
        return _routed_moe(d, family, problems)
    qwen = family in ("qwen3_moe", "qwen2_moe")
    if qwen and "num_experts" in d:
        experts = _int(d, "num_experts", problems)
        if "num_local_experts" in d and d["num_local_experts"] != d["num_experts"]:
            problems.append(f"config.json num_local_experts {_show(d['num_local_experts'])} and num_experts "
                            f"{_show(d['num_experts'])} disagree")
    else:
        experts = _int(d, "num_local_experts", problems)
    topk = _int(d, "num_experts_per_tok", problems)
    if topk > experts:
        problems.append(f"config.json num_experts_per_tok {topk} is more than the {experts} experts")
    shared = 0
    if qwen:
        moe_ffn = _int(d, "moe_intermediate_size", problems)
        norm = d.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            problems.append(f"config.json norm_topk_prob: expected true or false, got {_show(norm)}")
            norm = False
        pattern = _qwen_moe_layers(d, problems)
        if family == "qwen2_moe":
            shared = _int(d, "shared_expert_intermediate_size", problems)
    else:  # mixtral: every expert is intermediate_size wide, the top-k always renormalised
        moe_ffn, norm = ffn, True
        jitter = d.get("router_jitter_noise", 0.0)
        if _number(jitter) is None or jitter != 0:
            problems.append(f"config.json router_jitter_noise: {_show(jitter)}; router input jitter: the converter "
                            "cannot represent it (Megatron's moe_input_jitter_eps also applies it in evaluation; "
                            "only 0)")
    if topk == 1 and norm:
        # every token's single weight is 1; Megatron's router needs pre-softmax at top-1 (transformer_config.py)
        problems.append("config.json num_experts_per_tok 1 with renormalised top-k probabilities: the converter "
                        "cannot represent it (Megatron's top-1 router weighs a token by its softmax probability)")
    coef = d.get("router_aux_loss_coef", 0.0)
    if _number(coef) is None or coef < 0:
        problems.append(f"config.json router_aux_loss_coef: expected a number >= 0, got {_show(coef)}")
        coef = 0.0
    return {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": moe_ffn, "moe_pre_softmax": not norm,
            "router_aux_loss_coef": float(coef), "shared_expert_ffn_hidden_size": shared,
            "shared_expert_gate": bool(shared), "moe_layer_pattern": pattern if qwen else ()}


def _qwen_moe_layers(d: dict[str, Any], problems: list[str]) -> tuple[int, ...]:
    """Qwen3-MoE / Qwen2-MoE's dense layers (transformers' Qwen3MoeDecoderLayer: layer i is MoE unless it is in
    mlp_only_layers, and only when (i + 1) % decoder_sparse_step == 0) as Megatron's moe_layer_freq list; () when
    every layer is MoE. Megatron's integer form (i % N == 0) counts from the other end, so a list is always given."""
    layers = d.get("num_hidden_layers")
    step, dense = d.get("decoder_sparse_step", 1), d.get("mlp_only_layers", [])
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        problems.append(f"config.json decoder_sparse_step: expected an integer >= 1, got {_show(step)}")
        return ()
    if dense is None:
        dense = []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        problems.append(f"config.json mlp_only_layers: expected a list of layer indices, got {_show(dense)}")
        return ()
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_PATTERN_LAYERS:
        return ()  # num_hidden_layers' own problem is reported (spec.model.numLayers bounds it)
    dense_set = set(dense)
    outside = sorted(i for i in dense_set if not 0 <= i < layers)
    if outside:
        problems.append(f"config.json mlp_only_layers: {_show(outside)} are not layers of the {layers}")
    pattern = tuple(0 if i in dense_set or (i + 1) % step else 1 for i in range(layers))
    if 1 not in pattern:
        problems.append("config.json decoder_sparse_step / mlp_only_layers: no layer is a MoE layer")
    return () if all(pattern) else pattern


def _routed_moe(d: dict[str, Any], family: str, problems: list[str]) -> dict[str, Any]:
    """The HfModel fields of DeepSeek-V3's MoE block (DeepseekV3MoE; GLM-4.5's Glm4MoeMoE is the same): sigmoid
    scores plus e_score_correction_bias choose the experts (Megatron: sigmoid with the expert bias), groups of
    experts ranked by their top-2 scores (n_group, topk_group: Megatron's group-limited routing), the chosen
    sigmoid scores renormalised (norm_topk_prob) and scaled (routed_scaling_factor), n_shared_experts ungated
    shared experts of moe_intermediate_size each, the first first_k_dense_replace layers dense."""
    experts = _int(d, "n_routed_experts", problems)
    topk = _int(d, "num_experts_per_tok", problems)
    if topk > experts:
        problems.append(f"config.json num_experts_per_tok {topk} is more than the {experts} experts")
    moe_ffn = _int(d, "moe_intermediate_size", problems)
    shared = _int(d, "n_shared_experts", problems, default=0) if d.get("n_shared_experts", 0) else 0
    groups = _int(d, "n_group", problems, default=1)
    group_topk = _int(d, "topk_group", problems, default=1)
    if experts % groups:
        problems.append(f"config.json n_group {groups} does not divide n_routed_experts {experts}")
    if group_topk > groups:
        problems.append(f"config.json topk_group {group_topk} is more than n_group {groups}")
    elif groups > group_topk and topk // group_topk != 2:
        # transformers ranks each group by the sum of its top-2 scores (DeepseekV3TopkRouter.get_topk_indices:
        # .topk(2)); Megatron-Core by its top num_experts_per_tok // topk_group (moe_utils.group_limited_topk)
        problems.append(f"config.json num_experts_per_tok {topk} / topk_group {group_topk}: transformers ranks a "
                        "group by its top-2 scores, Megatron-Core by its top num_experts_per_tok // topk_group "
                        f"({topk // group_topk}); the converter cannot represent it (only a quotient of 2, as in "
                        "DeepSeek-V3, or n_group = topk_group)")
    norm = d.get("norm_topk_prob", True)
    if norm is not True:
        # Megatron-Core's sigmoid router always renormalises the top-k (moe_utils.topk_routing_with_score_function)
        problems.append(f"config.json norm_topk_prob: {_show(norm)}; Megatron-Core renormalises the chosen sigmoid "
                        "scores: the converter cannot represent it (only true)")
    scale = d.get("routed_scaling_factor", 1.0)
    if _number(scale) is None or scale <= 0:
        problems.append(f"config.json routed_scaling_factor: expected a number > 0, got {_show(scale)}")
        scale = 1.0
    for key, want in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
        if key in d and (d[key] != want or isinstance(d[key], bool)):
            problems.append(f"config.json {key}: {_show(d[key])}; the converter represents only {want!r} "
                            "(DeepSeek-V3's: transformers' DeepseekV3 code implements no other)")
    layers = d.get("num_hidden_layers")
    first_dense = d.get("first_k_dense_replace", 0)
    pattern: tuple[int, ...] = ()
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        problems.append(f"config.json first_k_dense_replace: expected an integer >= 0, got {_show(first_dense)}")
    elif isinstance(layers, int) and not isinstance(layers, bool) and 1 <= layers <= MAX_PATTERN_LAYERS:
        if first_dense >= layers:
            problems.append(f"config.json first_k_dense_replace {first_dense}: no MoE layer among the {layers}")
        elif first_dense:
            pattern = tuple(0 if i < first_dense else 1 for i in range(layers))
    mtp = d.get("num_nextn_predict_layers", 0)
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        problems.append(f"config.json num_nextn_predict_layers: expected an integer >= 0, got {_show(mtp)}")
        mtp = 0
    for key in ("aux_loss_alpha",):  # a training setting (DeepSeek-V3 trains with its sequence-wise loss)
        if key in d and (_number(d[key]) is None or d[key] < 0):
            problems.append(f"config.json {key}: expected a number >= 0, got {_show(d[key])}")
    return {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": moe_ffn, "moe_pre_softmax": False,
            "router_aux_loss_coef": 0.0, "shared_expert_ffn_hidden_size": shared * moe_ffn,
            "shared_expert_gate": False, "moe_layer_pattern": pattern, "moe_score_function": "sigmoid",
            "moe_expert_bias": True, "moe_router_num_groups": groups if groups > 1 else 0,
            "moe_router_group_topk": group_topk if groups > 1 else 0, "moe_router_topk_scaling_factor": float(scale),
            "mtp_layers_dropped": mtp}


def _mla(d: dict[str, Any], heads: int, kv_heads: int, problems: list[str]) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention (DeepseekV3Attention) as Megatron's MLASelfAttention fields."""
    q_rank = d.get("q_lora_rank")
    q_rank = 0 if q_rank is None else _int(d, "q_lora_rank", problems)
    kv_rank = _int(d, "kv_lora_rank", problems)
    nope, rope, v = (_int(d, k, problems) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if rope % 2:
        problems.append(f"config.json qk_rope_head_dim {rope} is odd (RoPE rotates pairs)")
    if "qk_head_dim" in d and d["qk_head_dim"] != nope + rope:
        problems.append(f"config.json qk_head_dim {_show(d['qk_head_dim'])} is not qk_nope_head_dim + "
                        f"qk_rope_head_dim ({nope + rope})")
    if "head_dim" in d and d["head_dim"] != rope:  # transformers sets head_dim = qk_rope_head_dim
        problems.append(f"config.json head_dim {_show(d['head_dim'])}: expected qk_rope_head_dim ({rope})")
    if kv_heads != heads:
        problems.append(f"config.json num_key_value_heads {kv_heads}: multi-head latent attention has one key/value "
                        f"head per query head ({heads}); the converter cannot represent it")
    interleave = d.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        problems.append(f"config.json rope_interleave: expected true or false, got {_show(interleave)}")
        interleave = True
    return {"mla": True, "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_head_dim": nope,
            "qk_pos_emb_head_dim": rope, "v_head_dim": v, "rope_interleave": interleave}


def parse_config(d: dict[str, Any], seq_length: int | None = None) -> HfModel:
    """The model ``d`` describes; HfConfigError naming every field the converter cannot represent.

    ``seq_length``: the training sequence length (default: min(max_position_embeddings, 4096)); a
    sliding window at least that long never masks anything, a shorter one is refused."""
    problems: list[str] = []
    archs = d.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) else None
    family = ARCHITECTURES.get(arch or "")
    if arch in REFUSED_ARCHITECTURES:
        raise HfConfigError([f"config.json architectures: {arch} is not supported: the converter cannot represent "
                             f"{REFUSED_ARCHITECTURES[arch]}; it handles {', '.join(sorted(ARCHITECTURES))}"])
    if arch is None or family is None:
        raise HfConfigError([f"config.json architectures: {_show(archs)} is not supported; the converter handles "
                             f"{', '.join(sorted(ARCHITECTURES))} (Llama-family models, dense or MoE)"])
    if d.get("model_type") != family:
        problems.append(f"config.json model_type: {_show(d.get('model_type'))} does not match architecture {arch} "
                        f"(expected {family!r})")
    is_moe = family in MOE_ARCHITECTURES.values()
    problems += _unknown_keys(d, family, is_moe)
    layers = _int(d, "num_hidden_layers", problems)
    hidden = _int(d, "hidden_size", problems)
    heads = _int(d, "num_attention_heads", problems)
    kv_heads = _int(d, "num_key_value_heads", problems, default=heads)
    ffn = _int(d, "intermediate_size", problems)
    vocab = _int(d, "vocab_size", problems)
    max_pos = _int(d, "max_position_embeddings", problems)
    mla = family == "deepseek_v3"
    if mla:
        head_dim = d.get("qk_rope_head_dim") if isinstance(d.get("qk_rope_head_dim"), int) else 0
    elif d.get("head_dim") is None:
        head_dim = hidden // heads
        if hidden % heads:
            problems.append(f"config.json hidden_size {_show(hidden)} is not divisible by num_attention_heads "
                            f"{_show(heads)} and head_dim is not given")
    else:
        head_dim = _int(d, "head_dim", problems)
    if not mla and heads % kv_heads:
        problems.append(f"config.json num_key_value_heads {_show(kv_heads)} does not divide num_attention_heads "
                        f"{_show(heads)}")
    eps = _float(d, "rms_norm_eps", problems, default=1e-6)  # bounds: spec.model.normEpsilon's, in the CLI
    yarn: list[Any] | None = [] if mla else None
    theta, factor = _rope(d, problems, yarn)
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json hidden_act: {_show(d.get('hidden_act'))}; only silu (SwiGLU) is supported")
    glm = family == "glm4_moe"
    if glm:  # Glm4MoeAttention: attention_bias puts biases on q/k/v only (o_proj has none): Megatron's add_qkv_bias
        if not isinstance(d.get("attention_bias", False), bool):
            problems.append(f"config.json attention_bias: expected true or false, got {_show(d.get('attention_bias'))}")
    elif d.get("attention_bias", False) is not False:
        problems.append(f"config.json attention_bias: {_show(d.get('attention_bias'))}; biases on every attention "
                        "projection (output included): the converter cannot represent them")
    if d.get("mlp_bias", False) is not False:
        problems.append(f"config.json mlp_bias: {_show(d.get('mlp_bias'))}; MLP biases: the converter cannot "
                        "represent them")
    if d.get("pretraining_tp", 1) != 1 or isinstance(d.get("pretraining_tp"), bool):
        problems.append(f"config.json pretraining_tp: {_show(d.get('pretraining_tp'))}; the converter cannot "
                        "represent it (only 1)")
    rope_params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    partial = d.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
    if glm:  # Megatron's rotary_percent: RoPE on the first share of each head, as transformers' GLM-4.5
        if _number(partial) is None or not 0 < partial <= 1:
            problems.append(f"config.json partial_rotary_factor: expected a number in (0, 1], got {_show(partial)}")
            partial = 1.0
        elif "partial_rotary_factor" in rope_params and rope_params["partial_rotary_factor"] != partial:
            problems.append("config.json partial_rotary_factor and rope_parameters.partial_rotary_factor disagree")
    elif d.get("partial_rotary_factor", 1.0) != 1.0 or isinstance(d.get("partial_rotary_factor"), bool):
        problems.append(f"config.json partial_rotary_factor: {_show(d.get('partial_rotary_factor'))}; the "
                        "converter cannot represent it (only 1.0: RoPE on the whole head)")
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        problems.append(f"config.json tie_word_embeddings: expected true or false, got {_show(tie)}")
        tie = False
    dropout = _float(d, "attention_dropout", problems, default=0.0)
    seq = seq_length if seq_length is not None else min(max_pos, DEFAULT_MAX_SEQ_LENGTH)
    sliding_layers = _layer_types(d, layers, problems)
    window = d.get("sliding_window")
    if window is not None and (family in ("mistral", "mixtral") or bool(d.get("use_sliding_window"))
                               or sliding_layers):
        if isinstance(window, bool) or not isinstance(window, int):
            problems.append(f"config.json sliding_window: expected an integer or null, got {_show(window)}")
        elif window < seq:
            problems.append(f"config.json sliding_window: {_show(window)} tokens is shorter than the sequence ({seq}); "
                            "sliding-window attention: the converter cannot represent it (train with a sequence "
                            "of at most the window)")
    elif sliding_layers:
        problems.append("config.json layer_types: sliding_attention layers without a sliding_window")
    experts = _moe(d, family, ffn, problems) if is_moe else {}
    attention = _mla(d, heads, kv_heads, problems) if mla else {}
    if mla and yarn:
        attention["yarn"] = tuple(yarn)
    qk_norm = family in ("qwen3", "qwen3_moe") or mla  # MLA: q_a_layernorm / kv_a_layernorm on the latents
    if glm:
        qk_norm = d.get("use_qk_norm", False)
        if not isinstance(qk_norm, bool):
            problems.append(f"config.json use_qk_norm: expected true or false, got {_show(qk_norm)}")
            qk_norm = False
    qkv_bias = family == "qwen2" or (glm and d.get("attention_bias") is True)
    if family == "qwen2_moe":  # transformers 5 writes qkv_bias (default true); 4.x files have none (always biased)
        qkv_bias = d.get("qkv_bias", True)
        if not isinstance(qkv_bias, bool):
            problems.append(f"config.json qkv_bias: expected true or false, got {_show(qkv_bias)}")
    if problems:
        raise HfConfigError(problems)
    dtype = d.get("dtype", d.get("torch_dtype"))
    return HfModel(family=family, architecture=arch, num_layers=layers, hidden_size=hidden, num_heads=heads,
                   num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=max_pos,
                   head_dim=head_dim, norm_epsilon=eps, rope_theta=theta, rope_scaling_factor=factor, tied=tie,
                   qkv_bias=qkv_bias, qk_norm=qk_norm, attention_dropout=dropout,
                   seq_length=seq, dtype=dtype if isinstance(dtype, str) else None,
                   rotary_percent=float(partial) if glm else 1.0, **experts, **attention)
