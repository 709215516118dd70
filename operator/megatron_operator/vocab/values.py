"""The spec's shared values, each an expression (CEL and Python at once): the layout and the effective model.

``self`` is ``spec`` after API-server defaulting (every field with a default is present). The core rules
(``rules.py``) and every block's rules read these; ``Rule.cel_condition`` binds the model values once.
"""

from __future__ import annotations

from typing import Any

from ..expr import Expr, Field, Has, Lit, cond, lit, lookup
from ..presets import MODEL_PRESETS


def f(path: str) -> Field:
    return Field(path)


def has(path: str) -> Expr:
    return Has(Field(path))


def opt(path: str, default: Any) -> Expr:
    """The field's value, or ``default`` when it is absent."""
    return cond(has(path), f(path), default)


tp = f("parallelism.tensor")
pp = f("parallelism.pipeline")
cp = f("parallelism.context")
ep = f("parallelism.expert")
etp = opt("parallelism.expertTensor", tp)  # Megatron: expert_tensor_parallel_size defaults to TP
nodes = f("numNodes")
# gpusPerNode 0 is a CPU job (blocks/cpu.py): its pods run spec.cpu.processesPerNode trainer processes (default 1),
# which every layout rule counts as it counts the GPUs of a GPU job.
on_cpu = f("gpusPerNode").eq(0)
# (cpu.processesPerNode has a default: present whenever spec.cpu is)
gpn = cond(on_cpu, cond(has("cpu"), f("cpu.processesPerNode"), 1), f("gpusPerNode"))  # trainer processes per pod
world = nodes * gpn
model_parallel = tp * pp * cp
dp = world // model_parallel
precision = f("training.precision")
# Unset, transformerImpl is the fastest path this project has measured where it can run the job: Megatron-Core's
# local spec (2.12x Megatron-LM on TE, and 1.92x our TE path, for a 3.8B Llama on one H200:
# docs/benchmarks/megatron-lm.md#2026-12-01-te-path); Transformer Engine where only it runs the job (fp8, context
# parallelism), except on CPUs (blocks/cpu.py refuses those there).
impl = opt("training.transformerImpl",
           cond(((cp > 1) | precision.eq("fp8")) & ~on_cpu, lit("transformer_engine"), lit("local")))
uses_te = impl.eq("transformer_engine")
# Default: on with TP > 1 and Transformer Engine. Unset, it renders --sequence-parallel-auto and the
# trainer, which knows whether its image has TE, keeps it on the TE path only: the local path supports
# it (its own torch norm; Megatron's WrappedTorchNorm refuses it) but measured slower there (Llama-3-8B
# TP=2, docs/benchmarks/megatron-lm.md#2026-11-26-second-session-sp-rope), so it stays opt-in on the local path.
sequence_parallel = opt("parallelism.sequenceParallel", (tp > 1) & uses_te)
mbs = f("training.microBatchSize")


def model_value(name: str, derived: Any) -> Expr:
    """An effective model field: explicit value, else the preset's, else the derived default."""
    explicit = f"model.{name}"
    by_preset = {p: v[name] for p, v in MODEL_PRESETS.items() if name in v}
    fallback = lit(derived)
    if by_preset:
        preset = f("model.preset")
        in_table = has("model.preset")
        if len(by_preset) < len(MODEL_PRESETS):
            in_table = in_table & _in(preset, list(by_preset))
        fallback = cond(in_table, lookup(by_preset, preset), fallback)
    return cond(has(explicit), f(explicit), fallback)


def _in(e: Expr, values: list[str]) -> Expr:
    out: Expr = Lit(False)
    for v in values:
        out = out | e.eq(v)
    return out


# 0 marks "neither given nor in the preset"; the model-complete rule reports it.
layers = model_value("numLayers", 0)
hidden = model_value("hiddenSize", 0)
heads = model_value("numAttentionHeads", 0)
seq = model_value("seqLength", 0)
vocab = model_value("vocabSize", 0)
groups = model_value("numQueryGroups", heads)
activation = model_value("activation", "gelu")
# Megatron-LM's default FFN size: 4h, or int(8h/3 / 64) * 64 = (h / 24) * 64 with SwiGLU.
ffn = model_value("ffnHiddenSize", cond(activation.eq("swiglu"), (hidden // 24) * 64, hidden * 4))
max_positions = model_value("maxPositionEmbeddings", seq)
experts = model_value("numExperts", 0)
topk = model_value("moeRouterTopk", 2)
# The rest of the MoE block, with megatron-core's defaults (TransformerConfig): each expert's MLP as wide as the
# dense one, top-k of the logits then softmax, the per-micro-batch aux loss, the all-gather dispatcher.
moe_ffn = model_value("moeFfnHiddenSize", ffn)
moe_pre_softmax = model_value("moeRouterPreSoftmax", False)
moe_balancing = model_value("moeRouterLoadBalancingType", "aux_loss")
moe_dispatcher = model_value("moeTokenDispatcherType", "allgather")
# no shared experts (0), softmax scores, no expert bias, no capacity (0: none dropped; memory.py), no padding
moe_shared_ffn = model_value("moeSharedExpertIntermediateSize", 0)
moe_shared_gate = model_value("moeSharedExpertGate", False)
moe_score_function = model_value("moeRouterScoreFunction", "softmax")
moe_expert_bias = model_value("moeRouterEnableExpertBias", False)
moe_capacity_factor = model_value("moeExpertCapacityFactor", 0)
moe_pad_to_capacity = model_value("moePadExpertInputToCapacity", False)
# group-limited routing (0: none), the routed experts' scale (0: 1, not rendered), MoE layers (absent: every layer)
moe_router_num_groups = model_value("moeRouterNumGroups", 0)
moe_router_group_topk = model_value("moeRouterGroupTopk", 0)
moe_layer_freq = f("model.moeLayerFreq")
# multi-head latent attention, with Megatron-LM's defaults (arguments.py; MLATransformerConfig for rope_type)
mla = model_value("multiLatentAttention", False)
q_lora_rank = model_value("qLoraRank", 0)  # 0: no query compression
kv_lora_rank = model_value("kvLoraRank", 32)
qk_head_dim = model_value("qkHeadDim", 128)
qk_pos_emb_head_dim = model_value("qkPosEmbHeadDim", 64)
v_head_dim = model_value("vHeadDim", 128)
rope_type = model_value("ropeType", "yarn")
normalization = model_value("normalization", "LayerNorm")
position_embedding = model_value("positionEmbedding", "learned_absolute")
rotary_base = model_value("rotaryBase", 10000)
untie_embeddings = model_value("untieEmbeddings", False)
add_bias_linear = model_value("addBiasLinear", True)
# Megatron's defaults (TransformerConfig): layernorm_epsilon 1e-5, kv_channels hidden / heads (0 marks an
# incomplete model), no QK norm, no QKV bias; 0 marks "no RoPE scaling".
norm_epsilon = model_value("normEpsilon", 1e-5)
kv_channels = model_value("kvChannels", cond(heads > 0, hidden // heads, 0))
qk_layernorm = model_value("qkLayernorm", False)
add_qkv_bias = model_value("addQkvBias", False)
rope_scaling_factor = model_value("ropeScalingFactor", 0)

MODEL_VALUES: dict[str, Expr] = {
    "numLayers": layers, "hiddenSize": hidden, "numAttentionHeads": heads, "numQueryGroups": groups,
    "ffnHiddenSize": ffn, "seqLength": seq, "maxPositionEmbeddings": max_positions, "vocabSize": vocab,
    "numExperts": experts, "moeRouterTopk": topk, "moeFfnHiddenSize": moe_ffn, "moeRouterPreSoftmax": moe_pre_softmax,
    "moeRouterLoadBalancingType": moe_balancing, "moeTokenDispatcherType": moe_dispatcher,
    "moeSharedExpertIntermediateSize": moe_shared_ffn, "moeSharedExpertGate": moe_shared_gate,
    "moeRouterScoreFunction": moe_score_function,
    "moeRouterEnableExpertBias": moe_expert_bias, "moeExpertCapacityFactor": moe_capacity_factor,
    "moePadExpertInputToCapacity": moe_pad_to_capacity,
    "moeRouterNumGroups": moe_router_num_groups, "moeRouterGroupTopk": moe_router_group_topk,
    "multiLatentAttention": mla, "qLoraRank": q_lora_rank, "kvLoraRank": kv_lora_rank, "qkHeadDim": qk_head_dim,
    "qkPosEmbHeadDim": qk_pos_emb_head_dim, "vHeadDim": v_head_dim, "ropeType": rope_type,
    "activation": activation, "normalization": normalization,
    "positionEmbedding": position_embedding, "rotaryBase": rotary_base, "untieEmbeddings": untie_embeddings,
    "addBiasLinear": add_bias_linear, "normEpsilon": norm_epsilon, "kvChannels": kv_channels,
    "qkLayernorm": qk_layernorm, "addQkvBias": add_qkv_bias, "ropeScalingFactor": rope_scaling_factor,
}

model_complete = (layers > 0) & (hidden > 0) & (heads > 0) & (seq > 0) & (vocab > 0)
layout_ok = (world % model_parallel).eq(0)
gbs = opt("training.globalBatchSize", mbs * dp)
microbatches = gbs // (mbs * dp)
