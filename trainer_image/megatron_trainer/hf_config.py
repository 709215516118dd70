"""Hugging Face `config.json` of a dense Llama-family model <-> this trainer's flags (pure: no torch).

Architectures: Llama 2/3/3.1/3.2 (`rope_type` default or `llama3`), Mistral, Qwen2/2.5 (QKV bias),
Qwen3 (QK norm). Every field that changes the math is either mapped to a flag or refused by name;
a field this module does not know is refused too (it may change the math). Both config layouts are
read: transformers 5 (`rope_parameters`, `dtype`) and 4.x (top-level `rope_theta`/`rope_scaling`,
`torch_dtype`).

- `parse_config(d, seq_length)` -> HfModel, or HfConfigError listing every problem;
- `mismatches(cfg, hf)` -> one message per flag that disagrees with config.json (both values named);
- `export_config(cfg, source, dtype)` -> the config.json an export writes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import TrainerConfig

#: config.json files are small; a larger one is refused before it is parsed.
MAX_CONFIG_BYTES = 1 << 20

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
# Megatron-Core 0.19 implements Llama 3.1-style RoPE scaling with these fixed
# (models/common/embeddings/rotary_pos_embedding.py, RotaryEmbedding._apply_scaling).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Fields that describe the file or generation, not the network's math.
INFO_ONLY = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
             "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "max_window_layers", "_name_or_path",
             "output_attentions", "output_hidden_states", "return_dict"}
MAPPED = {"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
          "vocab_size", "max_position_embeddings", "rms_norm_eps", "head_dim", "tie_word_embeddings", "hidden_act",
          "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias", "pretraining_tp",
          "attention_dropout", "sliding_window", "use_sliding_window", "layer_types", "partial_rotary_factor"}


class HfConfigError(ValueError):
    """config.json cannot be represented by this trainer; `problems` lists why, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class HfModel:
    """The architecture a config.json describes, in this trainer's terms."""

    family: str  # llama | mistral | qwen2 | qwen3
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
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, else None
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    attention_dropout: float
    dtype: str | None

    @property
    def explicit_head_dim(self) -> bool:
        return self.hidden_size % self.num_heads != 0 or self.head_dim != self.hidden_size // self.num_heads


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # JSON readers disagree on which one wins; the operator's hf-config refuses it too
            raise ValueError(f"key {key[:64]!r} is given twice")
        out[key] = value
    return out


def load_config(directory: str | Path) -> dict[str, Any]:
    """config.json of an HF directory as a dict; HfConfigError for a missing, huge or invalid file."""
    path = Path(directory) / "config.json"
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise HfConfigError([f"{path}: {size} bytes, more than the {MAX_CONFIG_BYTES} a config.json may have"])
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_refuse_duplicates)
    except FileNotFoundError:
        raise HfConfigError([f"{path}: missing (a Hugging Face model directory has a config.json)"]) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise HfConfigError([f"{path}: cannot be read as JSON: {e}"]) from None
    if not isinstance(data, dict):
        raise HfConfigError([f"{path}: not a JSON object"])
    return data


def _int(d: dict, key: str, problems: list[str], default: int | None = None, minimum: int = 1) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        problems.append(f"config.json {key}: expected an integer >= {minimum}, got {v!r}")
        return minimum
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


def _float(d: dict, key: str, problems: list[str], default: float | None = None) -> float:
    v = d.get(key, default)
    if _number(v) is None:
        problems.append(f"config.json {key}: expected a number, got {v!r}")
        return 0.0
    return float(v)


def _rope(d: dict, problems: list[str]) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from either config layout."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        problems.append(f"config.json rope_parameters: expected an object, got {params!r}")
        params = None
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        problems.append(f"config.json rope_scaling: expected an object or null, got {scaling!r}")
        scaling = None
    merged: dict[str, Any] = {}
    if scaling:
        merged.update(scaling)
    if params:
        merged.update(params)
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    if _number(theta) is None or theta <= 0:
        problems.append(f"config.json rope_theta: expected a positive number, got {theta!r}")
        theta = 10000.0
    elif float(theta) != int(theta):
        problems.append(f"config.json rope_theta: {theta} is not a whole number (--rotary-base takes an integer)")
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        problems.append(f"config.json rope scaling type {kind!r}: not supported (only default and llama3 RoPE; "
                        "Megatron-Core implements no linear, dynamic, yarn or longrope scaling here)")
        return float(theta), None
    for key, want in LLAMA3_FIXED.items():
        got = merged.get(key)
        if got != want:
            problems.append(f"config.json rope scaling {key}: {got!r}, but Megatron-Core's llama3 RoPE scaling "
                            f"is fixed at {want:g}")
    factor = merged.get("factor")
    if _number(factor) is None or factor < 1:
        problems.append(f"config.json rope scaling factor: expected a number >= 1, got {factor!r}")
        return float(theta), None
    return float(theta), float(factor)


def parse_config(d: dict[str, Any], seq_length: int | None = None) -> HfModel:
    """The model a config.json describes; HfConfigError naming every field that cannot be represented.

    ``seq_length``: the training sequence length, for the sliding-window check (a window at least
    as long as the sequence never masks anything)."""
    problems: list[str] = []
    archs = d.get("architectures")
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str) else None
    family = ARCHITECTURES.get(arch or "")
    if family is None:
        problems.append(f"config.json architectures: {archs!r} is not supported; this converter handles "
                        f"{', '.join(sorted(ARCHITECTURES))} (dense Llama-family models)")
        raise HfConfigError(problems)
    if d.get("model_type") != family:
        problems.append(f"config.json model_type: {d.get('model_type')!r} does not match architecture {arch} "
                        f"(expected {family!r})")
    for key in sorted(set(d) - INFO_ONLY - MAPPED):
        if "expert" in key or "moe" in key or key.startswith("router") or key == "num_local_experts":
            problems.append(f"config.json {key}: mixture-of-experts models are not supported by this converter")
        elif key == "quantization_config":
            problems.append("config.json quantization_config: quantized checkpoints are not supported; start "
                            "from the unquantized weights")
        elif key == "auto_map":
            problems.append("config.json auto_map: the model needs custom code (trust_remote_code); not supported")
        else:
            problems.append(f"config.json {key}: not a field this converter knows; it may change the model's "
                            "math, so the import refuses it (remove it only if you know it does not)")
    layers = _int(d, "num_hidden_layers", problems)
    hidden = _int(d, "hidden_size", problems)
    heads = _int(d, "num_attention_heads", problems)
    kv_heads = _int(d, "num_key_value_heads", problems, default=heads)
    ffn = _int(d, "intermediate_size", problems)
    vocab = _int(d, "vocab_size", problems)
    max_pos = _int(d, "max_position_embeddings", problems)
    head_dim = d.get("head_dim")
    if head_dim is None:
        head_dim = hidden // heads if heads else 0
        if heads and hidden % heads:
            problems.append(f"config.json hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                            "and head_dim is not given")
    else:
        head_dim = _int(d, "head_dim", problems)
    if heads % kv_heads:
        problems.append(f"config.json num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    eps = _float(d, "rms_norm_eps", problems, default=1e-6)
    theta, factor = _rope(d, problems)
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"config.json hidden_act: {d.get('hidden_act')!r}; only silu (SwiGLU) is supported")
    if d.get("attention_bias", False) is not False:
        problems.append(f"config.json attention_bias: {d.get('attention_bias')!r}; biases on every attention "
                        "projection (output included) cannot be represented (Megatron adds them to the MLP too)")
    if d.get("mlp_bias", False) is not False:
        problems.append(f"config.json mlp_bias: {d.get('mlp_bias')!r}; MLP biases are not supported")
    if d.get("pretraining_tp", 1) != 1 or isinstance(d.get("pretraining_tp"), bool):
        problems.append(f"config.json pretraining_tp: {d.get('pretraining_tp')!r}; only 1 is supported")
    if d.get("partial_rotary_factor", 1.0) != 1.0 or isinstance(d.get("partial_rotary_factor"), bool):
        problems.append(f"config.json partial_rotary_factor: {d.get('partial_rotary_factor')!r}; only 1.0 "
                        "(RoPE on the whole head) is supported")
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        problems.append(f"config.json tie_word_embeddings: expected true or false, got {tie!r}")
        tie = False
    dropout = _float(d, "attention_dropout", problems, default=0.0)
    layer_types = d.get("layer_types")
    sliding_layers = False
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            problems.append(f"config.json layer_types: expected a list of {layers} entries")
        else:
            unknown = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")}, key=str)
            if unknown:
                problems.append(f"config.json layer_types: {unknown} not supported (only full_attention)")
            sliding_layers = "sliding_attention" in layer_types
    window = d.get("sliding_window")
    applies = window is not None and (family == "mistral" or bool(d.get("use_sliding_window")) or sliding_layers)
    if applies:
        if isinstance(window, bool) or not isinstance(window, int):
            problems.append(f"config.json sliding_window: expected an integer or null, got {window!r}")
        elif seq_length is None or window < seq_length:
            problems.append(f"config.json sliding_window: {window} tokens is shorter than the sequence "
                            f"({seq_length if seq_length is not None else 'unknown'}); sliding-window attention "
                            "is not supported (train with a sequence of at most the window)")
    elif sliding_layers:
        problems.append("config.json layer_types: sliding_attention layers without a sliding_window")
    dtype = d.get("dtype", d.get("torch_dtype"))
    if problems:
        raise HfConfigError(problems)
    return HfModel(family=family, architecture=arch, num_layers=layers, hidden_size=hidden, num_heads=heads,
                   num_kv_heads=kv_heads, ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=max_pos,
                   head_dim=head_dim, norm_epsilon=eps, rope_theta=theta, rope_scaling_factor=factor, tied=tie,
                   qkv_bias=family == "qwen2", qk_norm=family == "qwen3", attention_dropout=dropout,
                   dtype=dtype if isinstance(dtype, str) else None)


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
    differ("--rotary-base", m.rotary_base, "rope_theta", int(hf.rope_theta))
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
    if m.num_experts:
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
    if family == "qwen3":
        out["attention_bias"] = False
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
        except (OSError, ValueError):
            pass
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out
