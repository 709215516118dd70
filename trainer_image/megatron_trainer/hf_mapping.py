"""Which rows and columns of which Hugging Face tensors make each tensor-parallel shard of each
Megatron-Core parameter (pure: no torch). Import and export both execute these plans.

Megatron-Core GPTModel names (global layer index L), local spec [Transformer Engine spec]:

    embedding.word_embeddings.weight                 <- model.embed_tokens.weight       (vocab rows)
    decoder.layers.L.input_layernorm.weight          <- model.layers.L.input_layernorm.weight
      [decoder.layers.L.self_attention.linear_qkv.layer_norm_weight]
    decoder.layers.L.self_attention.linear_qkv.weight/.bias <- q_proj, k_proj, v_proj  (interleaved)
    decoder.layers.L.self_attention.q_layernorm.weight / k_layernorm.weight <- self_attn.q_norm / k_norm
    decoder.layers.L.self_attention.linear_proj.weight  <- self_attn.o_proj.weight      (input columns)
    decoder.layers.L.pre_mlp_layernorm.weight        <- post_attention_layernorm.weight
      [decoder.layers.L.mlp.linear_fc1.layer_norm_weight]
    decoder.layers.L.mlp.linear_fc1.weight           <- gate_proj ; up_proj            (per-rank halves)
    decoder.layers.L.mlp.linear_fc2.weight           <- mlp.down_proj.weight           (input columns)
    decoder.final_layernorm.weight                   <- model.norm.weight
    output_layer.weight                              <- lm_head.weight (embed_tokens when tied)

Mixture of experts (Qwen3-MoE and Qwen2-MoE `mlp.`, Mixtral `block_sparse_moe.`; global expert index E,
SequentialMLP's names, which moe.GroupedMLP's 3-D weights are presented as by hf_torch.global_params):

    decoder.layers.L.mlp.router.weight               <- mlp.gate.weight / block_sparse_moe.gate.weight
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc1.weight <- experts.E.gate_proj ; up_proj  (w1 ; w3)
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc2.weight <- experts.E.down_proj            (w2)

Qwen2-MoE's gated shared expert (Megatron's SharedExpertMLP: a dense MLP split over TP like the dense layers',
times sigmoid(gate_weight . x); the gate is whole on every rank):

    decoder.layers.L.mlp.shared_experts.linear_fc1.weight <- mlp.shared_expert.gate_proj ; up_proj (per-rank halves)
    decoder.layers.L.mlp.shared_experts.linear_fc2.weight <- mlp.shared_expert.down_proj   (input columns)
    decoder.layers.L.mlp.shared_experts.gate_weight       <- mlp.shared_expert_gate.weight (1 x hidden)

An expert's fc1/fc2 are split over the expert tensor-parallel ranks (ETP, which may differ from TP): the caller
passes that size and rank for them (`is_expert`).

The QKV layout is Megatron's (attention.py, get_query_key_value_tensors): the full output dimension
is, per query group g, [q heads of g (heads/groups x d) | k_g (d) | v_g (d)], and TP rank r holds the
contiguous r-th 1/TP of it (also when TP > groups, where a rank holds part of one group). SwiGLU's
linear_fc1 on rank r is [gate rows of r ; up rows of r] (Megatron's glu chunks the output in two).
RoPE needs no permutation: Megatron's non-interleaved rotary is HF's rotate_half. Vocabulary rows
past the HF vocabulary (Megatron's padding to a multiple of 128 x TP) are zero on import and dropped
on export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .hf_config import HfModel


@dataclass(frozen=True)
class Piece:
    """Rows (axis 0) or columns (axis 1) `dst` of the Megatron shard are `src` of HF tensor `hf`."""

    hf: str
    axis: int
    dst: tuple[int, int]
    src: tuple[int, int]


@dataclass(frozen=True)
class ParamPlan:
    name: str  # Megatron name, global layer index
    shape: tuple[int, ...]  # this rank's shard
    pieces: tuple[Piece, ...]  # what is not covered is zero (vocabulary padding)


#: HF names of the MoE block per family: (prefix under the layer, gate name, up name, down name).
MOE_NAMES = {"qwen3_moe": ("mlp.", "gate_proj", "up_proj", "down_proj"),
             "qwen2_moe": ("mlp.", "gate_proj", "up_proj", "down_proj"),
             "mixtral": ("block_sparse_moe.", "w1", "w3", "w2")}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def is_expert(name: str) -> bool:
    """A Megatron name of an expert's weight (split over the expert tensor-parallel ranks)."""
    return ".mlp.experts.local_experts." in name


def _expert_hf(m: HfModel, L: int, e: int, which: str) -> str:
    prefix, gate, up, down = MOE_NAMES[m.family]
    return f"model.layers.{L}.{prefix}experts.{e}.{dict(gate=gate, up=up, down=down)[which]}.weight"


def hf_tensor_shapes(m: HfModel) -> dict[str, tuple[int, ...]]:
    """Every tensor the HF checkpoint holds for this architecture, with its shape, in export order."""
    h, d, q, kv = m.hidden_size, m.head_dim, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab_size, h)}
    for L in range(m.num_layers):
        p = f"model.layers.{L}."
        out[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[p + f"self_attn.{proj}.weight"] = (rows, h)
            if m.qkv_bias:
                out[p + f"self_attn.{proj}.bias"] = (rows,)
        if m.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if m.moe:
            out[p + MOE_NAMES[m.family][0] + "gate.weight"] = (m.num_experts, h)
            f = m.moe_ffn_hidden_size
            for e in range(m.num_experts):
                for which, shape in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
                    out[_expert_hf(m, L, e, which)] = shape
            s = m.shared_expert_ffn_hidden_size
            if s:
                out[p + "mlp.shared_expert.gate_proj.weight"] = (s, h)
                out[p + "mlp.shared_expert.up_proj.weight"] = (s, h)
                out[p + "mlp.shared_expert.down_proj.weight"] = (h, s)
                out[p + "mlp.shared_expert_gate.weight"] = (1, h)
            continue
        out[p + "mlp.gate_proj.weight"] = (m.ffn_hidden_size, h)
        out[p + "mlp.up_proj.weight"] = (m.ffn_hidden_size, h)
        out[p + "mlp.down_proj.weight"] = (h, m.ffn_hidden_size)
    out["model.norm.weight"] = (h,)
    if not m.tied:
        out["lm_head.weight"] = (m.vocab_size, h)
    return out


#: HF buffers some checkpoints carry that hold no weights (RoPE frequencies are recomputed).
IGNORED_HF = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _split(total: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if total % tp:
        raise ValueError(f"{what} ({total}) is not divisible by tensor parallel size {tp}")
    n = total // tp
    return rank * n, (rank + 1) * n


def _qkv_pieces(m: HfModel, L: int, suffix: str, start: int, end: int) -> list[Piece]:
    """Rows [start, end) of the full interleaved QKV output -> pieces of q/k/v_proj."""
    d, per_group = m.head_dim, m.num_heads // m.num_kv_heads
    block = (per_group + 2) * d
    pieces = []
    for g in range(m.num_kv_heads):
        base = g * block
        for proj, off, rows, src0 in (("q_proj", 0, per_group * d, g * per_group * d),
                                      ("k_proj", per_group * d, d, g * d),
                                      ("v_proj", per_group * d + d, d, g * d)):
            a, b = max(start, base + off), min(end, base + off + rows)
            if a < b:
                pieces.append(Piece(f"model.layers.{L}.self_attn.{proj}.{suffix}", 0, (a - start, b - start),
                                    (src0 + a - base - off, src0 + b - base - off)))
    return pieces


def param_plan(name: str, m: HfModel, tp: int, rank: int, padded_vocab: int) -> ParamPlan:
    """The plan of one Megatron parameter (global layer and expert index in `name`) on TP rank `rank` (for an
    expert's weight: the expert tensor-parallel size and rank). ValueError for a parameter this converter does
    not know."""
    h, q, ffn = m.hidden_size, m.num_heads * m.head_dim, m.ffn_hidden_size

    def whole(hf: str, shape: tuple[int, ...]) -> ParamPlan:
        return ParamPlan(name, shape, (Piece(hf, 0, (0, shape[0]), (0, shape[0])),))

    def vocab_rows(hf: str) -> ParamPlan:
        a, b = _split(padded_vocab, tp, rank, "padded vocabulary")
        hi = min(b, m.vocab_size)
        pieces = (Piece(hf, 0, (0, hi - a), (a, hi)),) if a < hi else ()
        return ParamPlan(name, (b - a, h), pieces)

    if name == "embedding.word_embeddings.weight":
        return vocab_rows("model.embed_tokens.weight")
    if name == "output_layer.weight":
        return vocab_rows("model.embed_tokens.weight" if m.tied else "lm_head.weight")
    if name == "decoder.final_layernorm.weight":
        return whole("model.norm.weight", (h,))
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"no Hugging Face tensor for Megatron parameter {name}")
    L, rest = int(match.group(1)), match.group(2)
    p = f"model.layers.{L}."
    if rest in ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"):
        return whole(p + "input_layernorm.weight", (h,))
    if rest in ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        return whole(p + "post_attention_layernorm.weight", (h,))
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        suffix = rest.rsplit(".", 1)[1]
        if suffix == "bias" and not m.qkv_bias:
            raise ValueError(f"{name}: the Hugging Face model has no QKV bias")
        total = q + 2 * m.num_kv_heads * m.head_dim
        a, b = _split(total, tp, rank, "QKV output size")
        shape = (b - a, h) if suffix == "weight" else (b - a,)
        return ParamPlan(name, shape, tuple(_qkv_pieces(m, L, suffix, a, b)))
    if rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight") and m.qk_norm:
        return whole(p + f"self_attn.{rest.split('.')[1][0]}_norm.weight", (m.head_dim,))
    if rest == "self_attention.linear_proj.weight":
        a, b = _split(q, tp, rank, "attention output columns")
        return ParamPlan(name, (h, b - a), (Piece(p + "self_attn.o_proj.weight", 1, (0, b - a), (a, b)),))
    if m.moe and rest == "mlp.router.weight":
        return whole(p + MOE_NAMES[m.family][0] + "gate.weight", (m.num_experts, h))
    expert = _EXPERT.match(rest) if m.moe else None
    if expert is not None:
        e, fc = int(expert.group(1)), expert.group(2)
        if e >= m.num_experts:
            raise ValueError(f"{name}: expert {e} of {m.num_experts}")
        a, b = _split(m.moe_ffn_hidden_size, tp, rank, "the experts' hidden size")
        n = b - a
        if fc == "linear_fc1":
            return ParamPlan(name, (2 * n, h), (Piece(_expert_hf(m, L, e, "gate"), 0, (0, n), (a, b)),
                                                Piece(_expert_hf(m, L, e, "up"), 0, (n, 2 * n), (a, b))))
        return ParamPlan(name, (h, n), (Piece(_expert_hf(m, L, e, "down"), 1, (0, n), (a, b)),))
    mlp, width, what = "mlp.", ffn, "--ffn-hidden-size"  # a dense layer's MLP, or the MoE layer's shared expert
    if m.moe:
        if not m.shared_expert_ffn_hidden_size or not rest.startswith("mlp.shared_experts."):
            raise ValueError(f"no Hugging Face tensor for Megatron parameter {name} (a MoE layer)")
        if rest == "mlp.shared_experts.gate_weight":
            return whole(p + "mlp.shared_expert_gate.weight", (1, h))
        rest = "mlp." + rest[len("mlp.shared_experts."):]
        mlp, width, what = "mlp.shared_expert.", m.shared_expert_ffn_hidden_size, "the shared expert's hidden size"
    if rest == "mlp.linear_fc1.weight":
        a, b = _split(width, tp, rank, what)
        n = b - a
        return ParamPlan(name, (2 * n, h), (Piece(p + mlp + "gate_proj.weight", 0, (0, n), (a, b)),
                                            Piece(p + mlp + "up_proj.weight", 0, (n, 2 * n), (a, b))))
    if rest == "mlp.linear_fc2.weight":
        a, b = _split(width, tp, rank, what)
        return ParamPlan(name, (h, b - a), (Piece(p + mlp + "down_proj.weight", 1, (0, b - a), (a, b)),))
    raise ValueError(f"no Hugging Face tensor for Megatron parameter {name}")


def megatron_names(m: HfModel, te_norms: bool = False) -> list[str]:
    """Every Megatron parameter of the whole model (global layer indices), in export order."""
    names = ["embedding.word_embeddings.weight"]
    for L in range(m.num_layers):
        p = f"decoder.layers.{L}."
        names.append(p + ("self_attention.linear_qkv.layer_norm_weight" if te_norms else "input_layernorm.weight"))
        names.append(p + "self_attention.linear_qkv.weight")
        if m.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if m.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names.append(p + "self_attention.linear_proj.weight")
        if m.moe:  # the TE spec fuses no norm into a MoE layer
            names += [p + "pre_mlp_layernorm.weight", p + "mlp.router.weight"]
            for e in range(m.num_experts):
                names += [p + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                          p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"]
            if m.shared_expert_ffn_hidden_size:
                names += [p + "mlp.shared_experts.linear_fc1.weight", p + "mlp.shared_experts.linear_fc2.weight",
                          p + "mlp.shared_experts.gate_weight"]
            continue
        names.append(p + ("mlp.linear_fc1.layer_norm_weight" if te_norms else "pre_mlp_layernorm.weight"))
        names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not m.tied:
        names.append("output_layer.weight")
    return names


def exported_by(name: str, m: HfModel) -> list[str]:
    """The HF tensors a Megatron parameter completes on export, in order (the tied output layer's
    embedding is the first stage's, so it exports nothing)."""
    if name == "output_layer.weight" and m.tied:
        return []
    seen: list[str] = []
    for piece in param_plan(name, m, 1, 0, m.vocab_size).pieces:  # TP=1, no padding: every HF row once
        if piece.hf not in seen:
            seen.append(piece.hf)
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):  # q, k, v in that order
        order = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
        seen.sort(key=lambda n: order[n.split(".")[-2]])
    return seen
