"""The trainer's configuration: Megatron-LM flag names in, typed dataclasses out.

Pure module (no torch): the contract test feeds every rendered example's command line to
`parse_args` and CI runs without torch. The parser is generated from the dataclass fields, so a flag,
its type, default and help live in one place (the field's metadata).

Public surface:
- `parse_args(argv: list[str]) -> TrainerConfig`: argparse-style; exits with code 2 and a clear
  message on an unknown flag or an invalid combination.
- `runtime_from_env(env) -> RuntimeConfig`: the environment the operator renders.
- `world_layout(cfg, world_size) -> WorldLayout`: the checks that need the world size (DP, micro-batches).
- `ignored_flags(cfg) -> list[str]`: Megatron-LM flags given that this trainer accepts but does not use.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def flag(*names: str, help: str, **argparse_kwargs: Any) -> dict[str, Any]:
    """Field metadata: the Megatron-LM flag name(s) and argparse options of one config field."""
    return {"flags": names, "help": help, **argparse_kwargs}


#: --object-store-endpoint: scheme, host and a port 1-65535 (no leading zero), nothing else: no path, no user info
#: (no credential in the URL), no character multi-storage-client would expand ("${VAR}" in its configuration).
#: The operator's spec.checkpoint.objectStore.endpoint pattern is the same (tests/test_contract_refusals.py).
OBJECT_STORE_ENDPOINT = (r"https?://[A-Za-z0-9.-]+(:([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|"
                         r"655[0-2][0-9]|6553[0-5]))?/?")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over GPUs (Megatron-Core `initialize_model_parallel`)."""

    tensor: int = field(default=1, metadata=flag("--tensor-model-parallel-size", type=int,
                                                 help="Tensor-parallel size (TP): ranks sharing one layer's weights."))
    pipeline: int = field(default=1, metadata=flag("--pipeline-model-parallel-size", type=int,
                                                   help="Pipeline-parallel size (PP): stages the layers are split into."))
    virtual_pipeline: int | None = field(
        default=None, metadata=flag("--num-virtual-stages-per-pipeline-rank", type=int,
                                    help="Virtual pipeline stages per pipeline rank (interleaved schedule)."))
    context: int = field(default=1, metadata=flag("--context-parallel-size", type=int,
                                                  help="Context-parallel size (CP): the sequence split over ranks."))
    expert: int = field(default=1, metadata=flag("--expert-model-parallel-size", type=int,
                                                 help="Expert-parallel size (EP) for MoE layers."))
    expert_tensor: int | None = field(
        default=None, metadata=flag("--expert-tensor-parallel-size", type=int,
                                    help="Tensor-parallel size inside the experts (default: TP)."))
    sequence_parallel: bool = field(default=False, metadata=flag(
        "--sequence-parallel", action="store_true",
        help="Shard layer-norm/dropout activations along the sequence over the TP group."))
    sequence_parallel_auto: bool = field(default=False, metadata=flag(
        "--sequence-parallel-auto", action="store_true",
        help="Sequence parallelism where it pays (the operator's default at TP > 1): on when the run uses "
             "Transformer Engine, off on the local path, where it measured slower "
             "(docs/benchmarks/megatron-lm.md#2026-11-26-second-session-sp-rope). "
             "--sequence-parallel turns it on regardless."))

    def megatron_sizes(self) -> dict[str, int | None]:
        """The sizes under the keyword names `initialize_model_parallel` and `TransformerConfig` share."""
        return {"tensor_model_parallel_size": self.tensor, "pipeline_model_parallel_size": self.pipeline,
                "virtual_pipeline_model_parallel_size": self.virtual_pipeline,
                "context_parallel_size": self.context, "expert_model_parallel_size": self.expert,
                "expert_tensor_parallel_size": self.expert_tensor}


@dataclass(frozen=True)
class ModelConfig:
    """GPT architecture (Megatron-Core `TransformerConfig` + `GPTModel`)."""

    num_layers: int = field(default=0, metadata=flag("--num-layers", type=int, required=True,
                                                     help="Number of transformer layers."))
    hidden_size: int = field(default=0, metadata=flag("--hidden-size", type=int, required=True,
                                                      help="Hidden (model) dimension."))
    num_attention_heads: int = field(default=0, metadata=flag("--num-attention-heads", type=int, required=True,
                                                              help="Number of attention (query) heads."))
    group_query_attention: bool = field(default=False, metadata=flag(
        "--group-query-attention", action="store_true", help="Use grouped-query attention."))
    num_query_groups: int | None = field(default=None, metadata=flag(
        "--num-query-groups", type=int, help="Key/value head groups with --group-query-attention."))
    ffn_hidden_size: int | None = field(default=None, metadata=flag(
        "--ffn-hidden-size", type=int, help="MLP hidden size (default 4 x hidden)."))
    seq_length: int = field(default=0, metadata=flag("--seq-length", type=int, required=True,
                                                     help="Training sequence length in tokens."))
    max_position_embeddings: int | None = field(default=None, metadata=flag(
        "--max-position-embeddings", type=int, help="Positions the model supports (>= seq length)."))
    vocab_size: int | None = field(default=None, metadata=flag(
        "--vocab-size", type=int, help="Vocabulary size before padding (NullTokenizer / mock data)."))
    make_vocab_size_divisible_by: int = field(default=128, metadata=flag(
        "--make-vocab-size-divisible-by", type=int,
        help="Pad the vocabulary to a multiple of this times TP."))
    num_experts: int | None = field(default=None, metadata=flag(
        "--num-experts", type=int, help="Experts per MoE layer (MoE models only)."))
    moe_router_topk: int = field(default=2, metadata=flag(
        "--moe-router-topk", type=int, help="Experts each token is routed to."))
    moe_ffn_hidden_size: int | None = field(default=None, metadata=flag(
        "--moe-ffn-hidden-size", type=int, help="Hidden size of each expert's MLP (default --ffn-hidden-size)."))
    moe_router_pre_softmax: bool = field(default=False, metadata=flag(
        "--moe-router-pre-softmax", action="store_true",
        help="Softmax over all experts, then top-k, the k probabilities not renormalised (Hugging Face "
             "norm_topk_prob false); default: top-k of the logits, softmax over the k."))
    moe_router_load_balancing_type: str = field(default="aux_loss", metadata=flag(
        "--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none"),
        help="Load-balancing loss: per micro-batch (aux_loss), per sequence, per global batch, or none."))
    moe_aux_loss_coeff: float = field(default=0.0, metadata=flag(
        "--moe-aux-loss-coeff", type=float, help="Coefficient of the load-balancing loss (0: not computed)."))
    moe_z_loss_coeff: float | None = field(default=None, metadata=flag(
        "--moe-z-loss-coeff", type=float, help="Coefficient of the router z-loss (ST-MoE; default: none)."))
    moe_router_dtype: str | None = field(default=None, metadata=flag(
        "--moe-router-dtype", choices=("fp32", "fp64"),
        help="Precision of the router's logits and probabilities (default: the model's)."))
    moe_token_dispatcher_type: str = field(default="allgather", metadata=flag(
        "--moe-token-dispatcher-type", choices=("allgather", "alltoall"),
        help="How tokens reach their experts' ranks: all-gather over the expert group, or all-to-all."))
    moe_shared_expert_intermediate_size: int | None = field(default=None, metadata=flag(
        "--moe-shared-expert-intermediate-size", type=int,
        help="Hidden size of the shared experts' MLP, which every token passes (shared experts x each one's size; "
             "default: none)."))
    moe_shared_expert_gate: bool = field(default=False, metadata=flag(
        "--moe-shared-expert-gate", action="store_true",
        help="Scale the shared experts' output by sigmoid of a learned gate of the token (Qwen2-MoE; needs "
             "--moe-shared-expert-intermediate-size)."))
    moe_router_score_function: str = field(default="softmax", metadata=flag(
        "--moe-router-score-function", choices=("softmax", "sigmoid"),
        help="Router scores: softmax (default) or sigmoid (DeepSeek-V3; the k chosen scores renormalised)."))
    moe_router_enable_expert_bias: bool = field(default=False, metadata=flag(
        "--moe-router-enable-expert-bias", action="store_true",
        help="Aux-loss-free load balancing: a per-expert bias added to the scores for choosing the experts, "
             "updated after each step from the tokens each expert got (needs sigmoid scores)."))
    moe_router_force_load_balancing: bool = field(default=False, metadata=flag(
        "--moe-router-force-load-balancing", action="store_true",
        help="BENCHMARKS ONLY: route every token to experts drawn at random, evenly, ignoring the router's scores "
             "(megatron-core's moe_router_force_load_balancing; the model learns nothing useful). For figures set "
             "beside NVIDIA's 'forced balance' tables; the operator never renders it."))
    moe_router_bias_update_rate: float = field(default=1e-3, metadata=flag(
        "--moe-router-bias-update-rate", type=float,
        help="Step of the expert bias' update per global batch (default 1e-3, DeepSeek-V3's)."))
    moe_expert_capacity_factor: float | None = field(default=None, metadata=flag(
        "--moe-expert-capacity-factor", type=float,
        help="Each expert takes at most this factor x its even share of the tokens; the rest are dropped "
             "(default: none dropped)."))
    moe_token_drop_policy: str = field(default="probs", metadata=flag(
        "--moe-token-drop-policy", choices=("probs", "position"),
        help="Which tokens an expert over capacity drops: those of lowest probability (default) or the last."))
    moe_pad_expert_input_to_capacity: bool = field(default=False, metadata=flag(
        "--moe-pad-expert-input-to-capacity", action="store_true",
        help="Pad every expert's tokens up to its capacity (fixed shapes; needs --moe-expert-capacity-factor)."))
    moe_layer_freq: str = field(default="1", metadata=flag(
        "--moe-layer-freq", type=str,
        help="Which layers are MoE layers: N (every N-th layer, from the first) or a list of 0/1 per layer, e.g. "
             "[0,1,1,1] (0: a dense MLP of --ffn-hidden-size; DeepSeek-V3's first_k_dense_replace)."))
    moe_router_num_groups: int | None = field(default=None, metadata=flag(
        "--moe-router-num-groups", type=int,
        help="Group-limited routing: the experts in this many equal groups (DeepSeek-V3 n_group; needs "
             "--moe-router-group-topk)."))
    moe_router_group_topk: int | None = field(default=None, metadata=flag(
        "--moe-router-group-topk", type=int,
        help="Group-limited routing: each token picks its experts from this many groups (DeepSeek-V3 topk_group)."))
    moe_router_topk_scaling_factor: float | None = field(default=None, metadata=flag(
        "--moe-router-topk-scaling-factor", type=float,
        help="Scale of the routed experts' probabilities (DeepSeek-V3 routed_scaling_factor; default 1)."))
    multi_latent_attention: bool = field(default=False, metadata=flag(
        "--multi-latent-attention", action="store_true",
        help="Multi-head latent attention (MLA, DeepSeek-V2/V3): queries and keys/values through low-rank latents."))
    q_lora_rank: int | None = field(default=None, metadata=flag(
        "--q-lora-rank", type=int, help="MLA: rank of the query latent (default: no query compression)."))
    kv_lora_rank: int = field(default=32, metadata=flag(
        "--kv-lora-rank", type=int, help="MLA: rank of the key/value latent (Megatron-LM's default 32)."))
    qk_head_dim: int = field(default=128, metadata=flag(
        "--qk-head-dim", type=int, help="MLA: per-head query/key dimension without RoPE (qk_nope_head_dim)."))
    qk_pos_emb_head_dim: int = field(default=64, metadata=flag(
        "--qk-pos-emb-head-dim", type=int, help="MLA: per-head query/key dimension with RoPE (qk_rope_head_dim)."))
    v_head_dim: int = field(default=128, metadata=flag(
        "--v-head-dim", type=int, help="MLA: per-head value dimension."))
    rope_type: str | None = field(default=None, metadata=flag(
        "--rope-type", choices=("rope", "yarn"),
        help="MLA's rotary embedding: rope, or yarn (Megatron-LM's default for MLA)."))
    rotary_scaling_factor: float = field(default=1.0, metadata=flag(
        "--rotary-scaling-factor", type=float, help="YaRN: the context extension factor (rope_scaling factor)."))
    original_max_position_embeddings: int = field(default=4096, metadata=flag(
        "--original-max-position-embeddings", type=int, help="YaRN: the context the model was trained at."))
    beta_fast: float = field(default=32.0, metadata=flag("--beta-fast", type=float, help="YaRN: beta_fast."))
    beta_slow: float = field(default=1.0, metadata=flag("--beta-slow", type=float, help="YaRN: beta_slow."))
    mscale: float = field(default=1.0, metadata=flag("--mscale", type=float, help="YaRN: mscale."))
    mscale_all_dim: float = field(default=0.0, metadata=flag(
        "--mscale-all-dim", type=float, help="YaRN: mscale_all_dim (0: the softmax scale is not changed)."))
    rotary_percent: float = field(default=1.0, metadata=flag(
        "--rotary-percent", type=float,
        help="Share of each head's dimensions that RoPE rotates (Hugging Face partial_rotary_factor; GLM-4.5: 0.5)."))
    swiglu: bool = field(default=False, metadata=flag(
        "--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU) instead of GeLU."))
    normalization: str = field(default="LayerNorm", metadata=flag(
        "--normalization", choices=("LayerNorm", "RMSNorm"), help="Normalization layer."))
    position_embedding_type: str = field(default="learned_absolute", metadata=flag(
        "--position-embedding-type", choices=("learned_absolute", "rope", "none"),
        help="Position embedding."))
    rotary_base: int = field(default=10000, metadata=flag("--rotary-base", type=int,
                                                          help="RoPE base (with --position-embedding-type rope)."))
    untie_embeddings_and_output_weights: bool = field(default=False, metadata=flag(
        "--untie-embeddings-and-output-weights", action="store_true",
        help="Separate input embedding and output layer weights."))
    add_bias_linear: bool = field(default=True, metadata=flag(
        "--disable-bias-linear", action="store_false", help="No biases in the linear layers."))
    init_method_std: float = field(default=0.02, metadata=flag(
        "--init-method-std", type=float, help="Std of the normal weight initialisation."))
    norm_epsilon: float = field(default=1e-5, metadata=flag(
        "--norm-epsilon", type=float, help="Epsilon of the LayerNorm/RMSNorm layers (Hugging Face rms_norm_eps)."))
    kv_channels: int | None = field(default=None, metadata=flag(
        "--kv-channels", type=int,
        help="Attention head dimension (default hidden / heads; Qwen3 and Mistral-Nemo set it apart)."))
    qk_layernorm: bool = field(default=False, metadata=flag(
        "--qk-layernorm", action="store_true", help="Normalise queries and keys per head (Qwen3)."))
    add_qkv_bias: bool = field(default=False, metadata=flag(
        "--add-qkv-bias", action="store_true",
        help="Biases on the query/key/value projection only (Qwen2), also with --disable-bias-linear."))
    use_rope_scaling: bool = field(default=False, metadata=flag(
        "--use-rope-scaling", action="store_true",
        help="Llama 3.1-style RoPE frequency scaling (low/high frequency factors 1 and 4, original context 8192)."))
    rope_scaling_factor: float = field(default=8.0, metadata=flag(
        "--rope-scaling-factor", type=float, help="Factor of --use-rope-scaling (Llama 3.1: 8, Llama 3.2: 32)."))
    hidden_dropout: float = field(default=0.0, metadata=flag(
        "--hidden-dropout", type=float, help="Dropout after attention/MLP (0 for LLM pretraining)."))
    attention_dropout: float = field(default=0.0, metadata=flag(
        "--attention-dropout", type=float, help="Dropout on attention probabilities."))

    @property
    def effective_num_query_groups(self) -> int:
        return self.num_query_groups if self.group_query_attention and self.num_query_groups else \
            self.num_attention_heads

    @property
    def effective_ffn_hidden_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def effective_moe_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.effective_ffn_hidden_size

    @property
    def moe_layer_pattern(self) -> list[int]:
        """--moe-layer-freq as one 0/1 per layer (1: a MoE layer); ValueError for a malformed value."""
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    @property
    def effective_rope_type(self) -> str:
        """MLA's rotary embedding: --rope-type, else yarn (Megatron-LM: "MLA takes yarn by default")."""
        return self.rope_type or "yarn"


#: ModelConfig fields read only with --multi-latent-attention.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


def moe_layer_pattern(freq: str, num_layers: int) -> list[int]:
    """Megatron-LM's --moe-layer-freq (an int N: layer i is MoE when i % N == 0; or a list of 0/1, one per layer)
    as the list (gpt_layer_specs.get_gpt_decoder_block_spec). Parsed as JSON, never evaluated (Megatron-LM evals
    the string: "([0]*3+[1]*29)" is refused here; write the list)."""
    import json

    text = freq.strip()
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"--moe-layer-freq {freq!r}: expected an integer >= 1 or a list of 0/1 such as [0,1,1]") from None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return [1 if i % value == 0 else 0 for i in range(num_layers)]
    if not isinstance(value, list) or not all(v in (0, 1) and not isinstance(v, bool) for v in value):
        raise ValueError(f"--moe-layer-freq {freq!r}: expected an integer >= 1 or a list of 0/1 such as [0,1,1]")
    if len(value) != num_layers:  # gpt_layer_specs.get_gpt_decoder_block_spec asserts it
        raise ValueError(f"--moe-layer-freq has {len(value)} entries but --num-layers is {num_layers}: one per layer")
    return value


@dataclass(frozen=True)
class TrainingConfig:
    """Optimisation, precision, schedule and kernels."""

    transformer_impl: str = field(default="transformer_engine", metadata=flag(
        "--transformer-impl", choices=("transformer_engine", "local"),
        help="Layer implementation; falls back to 'local' when Transformer Engine is not importable."))
    device: str = field(default="cuda", metadata=flag(
        "--device", choices=("cuda", "cpu"),
        help="Where the ranks run: cuda (one GPU per process, NCCL) or cpu (gloo; Megatron's local spec, bf16; "
             "for smoke runs of a job before it takes GPUs: megatron_trainer/cpu.py says what differs)."))
    attention_backend: str = field(default="flash", metadata=flag(
        "--attention-backend", choices=("flash", "fused", "unfused", "local", "auto"),
        help="Attention kernel. Local path: 'flash'/'fused'/'auto' = torch SDPA (flash/cuDNN), "
             "'unfused'/'local' = Megatron's DotProductAttention (materialises s x s)."))
    micro_batch_size: int = field(default=1, metadata=flag("--micro-batch-size", type=int,
                                                           help="Sequences per micro-batch per GPU."))
    global_batch_size: int | None = field(default=None, metadata=flag(
        "--global-batch-size", type=int, help="Sequences per optimizer step (default micro x DP)."))
    train_iters: int = field(default=0, metadata=flag("--train-iters", type=int, required=True,
                                                      help="Optimizer steps to train for."))
    lr: float = field(default=1e-4, metadata=flag("--lr", type=float, help="Peak learning rate."))
    min_lr: float = field(default=0.0, metadata=flag("--min-lr", type=float, help="Final learning rate."))
    lr_decay_style: str = field(default="linear", metadata=flag(
        "--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
        help="Learning-rate decay after warm-up."))
    lr_warmup_iters: int = field(default=0, metadata=flag("--lr-warmup-iters", type=int,
                                                          help="Linear warm-up steps."))
    lr_decay_iters: int | None = field(default=None, metadata=flag(
        "--lr-decay-iters", type=int, help="Steps over which the LR decays (default: train iters)."))
    lr_wsd_decay_style: str = field(default="exponential", metadata=flag(
        "--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
        help="Decay shape of the WSD schedule's final phase."))
    lr_wsd_decay_iters: int | None = field(default=None, metadata=flag(
        "--lr-wsd-decay-iters", type=int, help="Length of the WSD decay phase (default 10%% of decay iters)."))
    weight_decay: float = field(default=0.01, metadata=flag("--weight-decay", type=float,
                                                            help="Decoupled weight decay."))
    clip_grad: float = field(default=1.0, metadata=flag("--clip-grad", type=float,
                                                        help="Global gradient-norm clip (0 disables)."))
    adam_beta1: float = field(default=0.9, metadata=flag("--adam-beta1", type=float, help="Adam beta1."))
    adam_beta2: float = field(default=0.999, metadata=flag("--adam-beta2", type=float, help="Adam beta2."))
    adam_eps: float = field(default=1e-8, metadata=flag("--adam-eps", type=float, help="Adam epsilon."))
    bf16: bool = field(default=False, metadata=flag("--bf16", action="store_true", help="bf16 mixed precision."))
    fp16: bool = field(default=False, metadata=flag("--fp16", action="store_true", help="fp16 mixed precision."))
    fp8_format: str | None = field(default=None, metadata=flag(
        "--fp8-format", choices=("e4m3", "hybrid"), help="FP8 GEMMs (Transformer Engine only)."))
    fp8_recipe: str = field(default="delayed", metadata=flag(
        "--fp8-recipe", choices=("delayed", "tensorwise"),
        help="FP8 scaling with --fp8-format (Megatron-LM's flag and default): 'delayed' scales each tensor by the "
             "amax of earlier steps, 'tensorwise' by its own current amax (TE's current scaling)."))
    use_distributed_optimizer: bool = field(default=False, metadata=flag(
        "--use-distributed-optimizer", action="store_true",
        help="Shard fp32 main params and Adam states over data-parallel ranks (ZeRO-1)."))
    overlap_grad_reduce: bool = field(default=False, metadata=flag(
        "--overlap-grad-reduce", action="store_true", help="Overlap the DP gradient reduce with backward."))
    overlap_param_gather: bool = field(default=False, metadata=flag(
        "--overlap-param-gather", action="store_true",
        help="Overlap the distributed optimizer's param all-gather with forward."))
    cuda_graph_impl: str = field(default="auto", metadata=flag(
        "--cuda-graph-impl", choices=("auto", "none", "local", "transformer_engine", "full_iteration"),
        help="CUDA graphs. 'full_iteration' captures forward+backward of a whole step once and replays it "
             "(optimizer outside the graph): removes the per-kernel launch cost of the host. This trainer "
             "implements 'none' and 'full_iteration' (PP=1, dense models). 'auto' (the default) is "
             "full_iteration where it has been verified (the TE-less path, PP=1, dense, pretraining, no "
             "--overlap-param-gather) and none elsewhere; the log says which and why."))
    cuda_graph_warmup_steps: int = field(default=3, metadata=flag(
        "--cuda-graph-warmup-steps", type=int, help="Eager steps before the CUDA graph is captured."))
    no_bias_activation_fusion: bool = field(default=False, metadata=flag(
        "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", action="store_true",
        help="Do not fuse bias + GeLU/SwiGLU (torch.compile'd kernels)."))
    no_bias_dropout_fusion: bool = field(default=False, metadata=flag(
        "--no-bias-dropout-fusion", action="store_true", help="Do not fuse bias + dropout + residual add."))
    no_masked_softmax_fusion: bool = field(default=False, metadata=flag(
        "--no-masked-softmax-fusion", action="store_true",
        help="Do not fuse scale + mask + softmax (Transformer Engine path; the local path never fuses it)."))
    no_rope_fusion: bool = field(default=False, metadata=flag(
        "--no-rope-fusion", action="store_true",
        help="Do not fuse rotary embeddings (Transformer Engine path; the local path never fuses them)."))
    no_gradient_accumulation_fusion: bool = field(default=False, metadata=flag(
        "--no-gradient-accumulation-fusion", action="store_true",
        help="Do not fuse weight-gradient accumulation into the GEMM (both paths; the local path fuses it "
             "with torch.addmm into the fp32 main_grad where CUDA supports it)."))
    no_persist_layer_norm: bool = field(default=True, metadata=flag(
        "--no-persist-layer-norm", action="store_true",
        help="Accepted: this trainer never uses apex's persistent layer norm."))
    deterministic_mode: bool = field(default=False, metadata=flag(
        "--deterministic-mode", action="store_true",
        help="Bit-identical runs: NCCL_ALGO=Ring, CUBLAS_WORKSPACE_CONFIG, torch deterministic algorithms, no "
             "fused attention kernels (megatron_trainer/determinism.py). Slower; opt-in."))
    manual_gc: bool = field(default=False, metadata=flag(
        "--manual-gc", action="store_true",
        help="Disable Python's automatic garbage collector (its pauses desynchronise ranks); collect "
             "every --manual-gc-interval iterations instead."))
    manual_gc_interval: int = field(default=0, metadata=flag(
        "--manual-gc-interval", type=int,
        help="Iterations between gc.collect() with --manual-gc (0: only at start-up)."))
    distributed_timeout_minutes: int | None = field(default=None, metadata=flag(
        "--distributed-timeout-minutes", type=int,
        help="Timeout of collective operations in every process group, minutes (default: torch's 10 for "
             "the world group, Megatron-Core's 30 for the parallel groups)."))
    eval_interval: int | None = field(default=None, metadata=flag(
        "--eval-interval", type=int, help="Iterations between validation-loss evaluations (SFT with "
                                          "--sft-valid-path; default: at the end only). Ignored otherwise."))
    recompute_granularity: str | None = field(default=None, metadata=flag(
        "--recompute-granularity", choices=("full", "selective"),
        help="Activation recomputation: 'selective' = core attention, 'full' = whole layers."))
    recompute_method: str | None = field(default=None, metadata=flag(
        "--recompute-method", choices=("uniform", "block"), help="How full recompute picks layers."))
    recompute_num_layers: int | None = field(default=None, metadata=flag(
        "--recompute-num-layers", type=int, help="Layers per recompute group (full recompute)."))
    seed: int = field(default=1234, metadata=flag("--seed", type=int, help="Random seed."))
    log_interval: int = field(default=100, metadata=flag("--log-interval", type=int,
                                                         help="Iterations between log lines."))
    eval_iters: int = field(default=0, metadata=flag(
        "--eval-iters", type=int, help="Global batches of the validation set per evaluation (SFT with "
                                       "--sft-valid-path: >= 1; otherwise there is no evaluation: 0)."))
    exit_interval: int | None = field(default=None, metadata=flag(
        "--exit-interval", type=int, help="Save (if --save) and exit when iteration %% N == 0."))
    exit_duration_in_mins: float | None = field(default=None, metadata=flag(
        "--exit-duration-in-mins", type=float, help="Save (if --save) and exit after this many minutes."))

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass(frozen=True)
class DataConfig:
    """Training data: mock or Megatron .bin/.idx blends."""

    mock_data: bool = field(default=False, metadata=flag("--mock-data", action="store_true",
                                                         help="Synthetic data (Megatron's MockGPTDataset)."))
    data_path: tuple[str, ...] = field(default=(), metadata=flag(
        "--data-path", nargs="*", help="Blend: 'W1 PREFIX1 W2 PREFIX2 ...' or one PREFIX (.bin/.idx)."))
    split: str = field(default="969,30,1", metadata=flag("--split", help="Train/valid/test split weights."))
    tokenizer_type: str = field(default="NullTokenizer", metadata=flag(
        "--tokenizer-type", choices=("HuggingFaceTokenizer", "NullTokenizer"),
        help="Tokenizer: a local Hugging Face tokenizer directory, or none (token ids = text)."))
    tokenizer_model: str | None = field(default=None, metadata=flag(
        "--tokenizer-model", help="Local directory holding tokenizer.json (never a hub name)."))
    data_cache_path: str | None = field(default=None, metadata=flag(
        "--data-cache-path", help="Writable (shared) directory for the dataset index cache."))
    num_workers: int = field(default=2, metadata=flag("--num-workers", type=int,
                                                      help="DataLoader worker processes."))
    eod_mask_loss: bool = field(default=False, metadata=flag(
        "--eod-mask-loss", action="store_true", help="No loss on end-of-document tokens."))
    reset_position_ids: bool = field(default=False, metadata=flag(
        "--reset-position-ids", action="store_true", help="Restart position ids after each EOD."))
    reset_attention_mask: bool = field(default=False, metadata=flag(
        "--reset-attention-mask", action="store_true", help="Block attention across documents."))
    data_format: str = field(default="pretraining", metadata=flag(
        "--data-format", choices=("pretraining", "chat", "prompt-completion"),
        help="pretraining: --mock-data or --data-path; chat or prompt-completion: JSONL for supervised "
             "fine-tuning (--sft-train-path), loss on the answers only."))
    sft_train_path: str | None = field(default=None, metadata=flag(
        "--sft-train-path", help="SFT training JSONL (chat: {\"messages\": [...]}; prompt-completion: "
             "{\"prompt\", \"completion\"})."))
    sft_valid_path: str | None = field(default=None, metadata=flag(
        "--sft-valid-path", help="SFT validation JSONL: its loss is logged every --eval-interval iterations "
                                 "and at the end."))
    sft_packing: bool = field(default=False, metadata=flag(
        "--sft-packing", action=argparse.BooleanOptionalAction,
        help="Pack several samples into one sequence (attention kept inside each sample, positions "
             "restarting per sample); otherwise one sample per sequence, padded."))
    sft_overflow: str = field(default="truncate", metadata=flag(
        "--sft-overflow", choices=("truncate", "drop"),
        help="A sample longer than --seq-length + 1 tokens: keep its beginning (one left with no answer "
             "token is dropped), or drop it. Both are counted."))
    sft_invalid_lines: str = field(default="error", metadata=flag(
        "--sft-invalid-lines", choices=("error", "skip"),
        help="A malformed line (bad JSON, unknown role, empty answer, a template error): stop with its "
             "line number, or count and skip it."))
    chat_template: str | None = field(default=None, metadata=flag(
        "--chat-template", help="A Jinja chat-template file to use instead of the tokenizer's own."))
    @property
    def sft(self) -> bool:
        return self.data_format != "pretraining"

    @property
    def blend(self) -> tuple[list[str], list[float]]:
        """The prefixes and weights of --data-path (Megatron's `get_blend_from_list`)."""
        return parse_blend(self.data_path)


@dataclass(frozen=True)
class CheckpointConfig:
    """Distributed checkpoints (torch_dist), async save, resume and preemption."""

    save: str | None = field(default=None, metadata=flag(
        "--save", help="Checkpoint directory to save to, or s3://BUCKET/PREFIX (object storage through "
        "multi-storage-client; credentials from boto3's chain, never a flag)."))
    load: str | None = field(default=None, metadata=flag(
        "--load", help="Checkpoint directory (or s3://BUCKET/PREFIX) to resume from."))
    object_store_endpoint: str | None = field(default=None, metadata=flag(
        "--object-store-endpoint", help="S3 endpoint URL for s3:// checkpoints and --hf-export (default: AWS's for "
        "the region)."))
    object_store_region: str | None = field(default=None, metadata=flag(
        "--object-store-region", help="S3 region for s3:// checkpoints and --hf-export."))
    save_interval: int | None = field(default=None, metadata=flag(
        "--save-interval", type=int, help="Iterations between checkpoints."))
    ckpt_format: str = field(default="torch_dist", metadata=flag(
        "--ckpt-format", choices=("torch_dist",), help="Checkpoint format (torch_dist only)."))
    async_save: bool = field(default=False, metadata=flag(
        "--async-save", action="store_true", help="Write checkpoints in the background."))
    use_persistent_ckpt_worker: bool = field(default=False, metadata=flag(
        "--use-persistent-ckpt-worker", action="store_true",
        help="One long-lived writer process for async saves (required with --async-save)."))
    async_strategy: str = field(default="auto", metadata=flag(
        "--async-strategy", choices=("auto", "nvrx", "mcore"),
        help="Async writer: nvidia-resiliency-ext or Megatron-Core's; 'auto' = nvrx when importable."))
    ckpt_assume_constant_structure: bool = field(default=True, metadata=flag(
        "--ckpt-assume-constant-structure", action=argparse.BooleanOptionalAction,
        help="Reuse the save plan across checkpoints (Megatron-LM's flag; on by default here, "
             "--no-ckpt-assume-constant-structure turns it off)."))
    dist_ckpt_workers: int = field(default=1, metadata=flag(
        "--dist-ckpt-workers", type=int, help="Writer threads (and files) per rank for torch_dist saves."))
    dist_ckpt_optim_fully_reshardable: bool = field(default=False, metadata=flag(
        "--dist-ckpt-optim-fully-reshardable", action="store_true",
        help="Accepted (Megatron-LM's flag): the distributed optimizer is saved fully reshardable by default "
             "here, written where it lies (optim_state.py), so a job can resume under another TP/PP/DP."))
    dist_ckpt_optim_dp_reshardable: bool = field(default=False, metadata=flag(
        "--dist-ckpt-optim-dp-reshardable", action="store_true",
        help="Save the distributed optimizer in Megatron's bucket layout instead (dp_reshardable, Megatron-LM's "
             "default): a resume may change DP only."))
    no_load_optim: bool = field(default=False, metadata=flag(
        "--no-load-optim", action="store_true", help="Resume weights only, fresh optimizer state."))
    no_load_rng: bool = field(default=False, metadata=flag(
        "--no-load-rng", action="store_true", help="Do not restore RNG states on resume."))
    exit_on_missing_checkpoint: bool = field(default=False, metadata=flag(
        "--exit-on-missing-checkpoint", action="store_true",
        help="Fail instead of starting from scratch when --load holds no complete checkpoint."))
    hf_init: str | None = field(default=None, metadata=flag(
        "--hf-init", help="A Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer) to take the "
        "weights from when --load holds no checkpoint: a fresh optimizer at iteration 0. Resumes never read it."))
    hf_export: str | None = field(default=None, metadata=flag(
        "--hf-export", help="Write the model as a Hugging Face checkpoint (safetensors, config.json, tokenizer) to "
        "this directory when training finishes (created through a temporary directory and a rename), or to "
        "s3://BUCKET/PREFIX (through --object-store-endpoint/--object-store-region; the index and a marker last)."))
    hf_export_only: bool = field(default=False, metadata=flag(
        "--hf-export-only", action="store_true",
        help="Export the newest complete checkpoint under --load to --hf-export and exit (no training; any "
             "TP/PP layout)."))
    exit_signal_handler: bool = field(default=False, metadata=flag(
        "--exit-signal-handler", action="store_true",
        help="On SIGTERM: all ranks agree, save a checkpoint, exit 0."))


@dataclass(frozen=True)
class LoggingConfig:
    """Megatron-LM logging flags. --tensorboard-dir (rendered from spec.logging.tensorboard) and its
    interval and queue size act (megatron_trainer/tensorboard.py), and the --wandb-* flags
    (spec.logging.wandb; megatron_trainer/wandb_log.py); the others are accepted so that
    existing launch scripts run, and each one given is named once at start-up (`ignored_flags`)."""

    log_throughput: bool = field(default=False, metadata=flag(
        "--log-throughput", action="store_true", help="Accepted: throughput is always in the log line."))
    log_params_norm: bool = field(default=False, metadata=flag(
        "--log-params-norm", action="store_true", help="Accepted, not logged."))
    log_num_zeros_in_grad: bool = field(default=False, metadata=flag(
        "--log-num-zeros-in-grad", action="store_true", help="Accepted, not logged."))
    log_progress: bool = field(default=False, metadata=flag(
        "--log-progress", action="store_true", help="Accepted: progress goes to status.progress."))
    timing_log_level: int = field(default=0, metadata=flag(
        "--timing-log-level", type=int, choices=(0, 1, 2), help="Accepted, no timers are logged."))
    timing_log_option: str = field(default="minmax", metadata=flag(
        "--timing-log-option", choices=("max", "minmax", "all"), help="Accepted, no timers are logged."))
    tensorboard_dir: str | None = field(default=None, metadata=flag(
        "--tensorboard-dir", help="Write TensorBoard event files here (Megatron-LM's scalar names), from the last "
        "rank."))
    tensorboard_log_interval: int = field(default=1, metadata=flag(
        "--tensorboard-log-interval", type=int, help="Iterations between TensorBoard scalars."))
    tensorboard_queue_size: int = field(default=1000, metadata=flag(
        "--tensorboard-queue-size", type=int, help="Events the TensorBoard writer queues before a flush."))
    log_timers_to_tensorboard: bool = field(default=False, metadata=flag(
        "--log-timers-to-tensorboard", action="store_true",
        help="Accepted: iteration-time and throughput are always written with --tensorboard-dir."))
    log_memory_to_tensorboard: bool = field(default=False, metadata=flag(
        "--log-memory-to-tensorboard", action="store_true",
        help="Accepted: the mem-* scalars are always written with --tensorboard-dir."))
    log_validation_ppl_to_tensorboard: bool = field(default=False, metadata=flag(
        "--log-validation-ppl-to-tensorboard", action="store_true",
        help="Accepted, no validation runs."))
    wandb_project: str = field(default="", metadata=flag(
        "--wandb-project", help="Log the training scalars to this Weights & Biases project, from the last rank "
        "(megatron_trainer/wandb_log.py)."))
    wandb_exp_name: str = field(default="", metadata=flag(
        "--wandb-exp-name", help="The W&B run's name."))
    wandb_entity: str = field(default="", metadata=flag(
        "--wandb-entity", help="The W&B user or team (default: the key's)."))
    wandb_save_dir: str = field(default="", metadata=flag(
        "--wandb-save-dir", help="Directory for the run's files (default: <--save>/wandb)."))
    wandb_mode: str = field(default="online", metadata=flag(
        "--wandb-mode", choices=("online", "offline"),
        help="online: sent as it trains; offline: files only, for `wandb sync` later."))
    wandb_api_key_file: str | None = field(default=None, metadata=flag(
        "--wandb-api-key-file", help="A file holding the W&B API key (a Secret volume), read in-process; the key "
        "is never an argument or an environment value."))
    use_mcore_models: bool = field(default=False, metadata=flag(
        "--use-mcore-models", action="store_true", help="Accepted: Megatron-Core models are the only ones."))


@dataclass(frozen=True)
class TrainerConfig:
    """Everything the command line says. Environment knobs live in `RuntimeConfig`."""

    parallel: ParallelConfig
    model: ModelConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig = LoggingConfig()


@dataclass(frozen=True)
class RuntimeConfig:
    """The environment the operator renders (docs/trainer-contract.md, "Environment")."""

    job_name: str | None = None
    """MEGATRON_JOB_NAME: the MegatronJob whose status.progress is written."""
    job_namespace: str | None = None
    """MEGATRON_JOB_NAMESPACE."""
    restart_attempt: int = 0
    """MEGATRON_RESTART_ATTEMPT: gang restarts so far (JobSet restart-attempt label)."""
    progress_interval_s: float = 30.0
    """MEGATRON_PROGRESS_INTERVAL_S: seconds between status.progress writes (0 disables)."""
    metrics_port: int = 9400
    """MEGATRON_METRICS_PORT: Prometheus port of global rank 0 (0 disables)."""
    checkpoint_keep: int = 0
    """MEGATRON_CHECKPOINT_KEEP: complete checkpoints to keep (0 = all)."""
    shutdown_grace_s: float = 30.0
    """MEGATRON_SHUTDOWN_GRACE_S (set by `megatron_trainer.launch`): seconds from SIGTERM to the
    launcher's SIGKILL; a save after SIGTERM must end within it. Under torchrun:
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else torchrun's 30 s."""
    data_cache_shared: bool = False
    """MEGATRON_DATA_CACHE_SHARED: the --data-cache-path is on storage every pod sees."""
    # diagnostics knobs for benchmarks (docs/trainer.md, "Diagnostics"); not rendered by the operator
    foreach_ops: bool = True
    """MEGATRON_TRAINER_FOREACH_OPS: 0 keeps Megatron's multi-tensor fallbacks (for A/B runs)."""
    fused_adam: bool = True
    """MEGATRON_TRAINER_FUSED_ADAM: 0 keeps torch AdamW's foreach kernels instead of its fused one (A/B runs)."""
    rope_mode: str = "exact"
    """MEGATRON_TRAINER_COMPILE_ROPE (ROPE_MODES): exact (the default) compiles Megatron's unfused RoPE with
    Inductor's emulate_precision_casts, which rounds each intermediate to bf16 where eager does (bit-identical to
    the eager RoPE on H200; compat.compile_unfused_rope); 1 compiles without it (fp32 intermediates, rounded once;
    for A/B runs); 0 keeps it eager."""
    @property
    def compile_rope(self) -> bool:
        return self.rope_mode != "0"

    @property
    def rope_exact(self) -> bool:
        return self.rope_mode == "exact"

    deterministic_attention: str = "flash"
    """MEGATRON_TRAINER_DETERMINISTIC_ATTENTION (DETERMINISTIC_ATTENTION_MODES), read with --deterministic-mode on the
    local path's SDPA attention: flash (the default) runs SDPA's flash kernel (then memory-efficient, then math) with
    torch's deterministic backward (attention.strict_backward); math runs SDPA's math backend. On 2 x H200 flash
    cost 1.21-1.25x the default step against math's 2.86-3.90x, with bit-identical resumes (docs/trainer.md)."""
    deterministic_attention_set: bool = False
    """Whether MEGATRON_TRAINER_DETERMINISTIC_ATTENTION was set (non-empty): only then is it worth a log line where
    it does not apply."""
    compile_norm: bool = False
    """MEGATRON_TRAINER_COMPILE_NORM: 1 runs the local path's RMSNorm through torch.compile (opt-in, for A/B runs)."""
    tp_overlap_chunks: int = 1
    """MEGATRON_TRAINER_TP_OVERLAP_CHUNKS=N (N > 1): a row-parallel layer's forward GEMM in N pieces whose
    all-reduces overlap the next piece (local path, TP > 1, no sequence parallelism; tp_overlap.py).
    Opt-in, for A/B runs: it measured no gain on the 8B at TP=2
    (docs/benchmarks/megatron-lm.md#2026-11-26-third-session-nccl-overlap)."""
    tp_overlap_sm_carveout: int = 0
    """MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT=N: with the overlap above, the GEMM pieces that run beside an
    all-reduce leave N SMs free for NCCL (cuBLASLt's SM count target; tp_overlap.py). For A/B runs."""
    ce_fusion: bool = False
    """MEGATRON_TRAINER_CE_FUSION: 1 uses Megatron's native fused vocab-parallel cross entropy (opt-in, bf16)."""
    profile: str | None = None
    """MEGATRON_TRAINER_PROFILE=FIRST:LAST:DIR: a torch.profiler trace of those iterations."""
    moe_experts: str = "grouped"
    """MEGATRON_TRAINER_MOE_EXPERTS (MOE_EXPERTS_IMPLS), MoE models on the local path: grouped (the default) runs each
    layer's experts on two grouped GEMMs (moe.GroupedMLP); sequential runs Megatron-Core's SequentialMLP, one GEMM pair
    per expert. Both write the same checkpoints (either loads the other's)."""
    moe_group_align: int = 0
    """MEGATRON_TRAINER_MOE_GROUP_ALIGN=N: pad each expert's tokens to a multiple of N rows for the grouped GEMM
    (0, the default: moe.default_align, which pads none: measured exact and faster on an H200; 8: 16 bytes' worth
    of bf16 rows, for a kernel that needs aligned groups). moe.py says why."""
    optim_in_place: bool = True
    """MEGATRON_TRAINER_OPTIM_IN_PLACE: 0 builds the fully reshardable optimizer state Megatron's way (a gather
    of the whole state through host memory on every save) instead of in place (optim_state.py); for A/B runs."""


_SECTIONS: tuple[tuple[str, type], ...] = (
    ("parallel", ParallelConfig),
    ("model", ModelConfig),
    ("training", TrainingConfig),
    ("data", DataConfig),
    ("checkpoint", CheckpointConfig),
    ("logging", LoggingConfig),
)


def build_parser(prog: str = "python -m megatron_trainer") -> argparse.ArgumentParser:
    """The argparse parser, generated from the dataclass fields' metadata."""
    # Megatron-LM's spelling: no prefix abbreviations (an unknown or shortened flag is an error).
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                     description="Megatron-Core GPT pretraining (Megatron-LM flag names).")
    for section, cls in _SECTIONS:
        group = parser.add_argument_group(section, (cls.__doc__ or "").strip())
        for f in dataclasses.fields(cls):
            meta = dict(f.metadata)
            names = meta.pop("flags")
            meta["dest"] = f"{section}.{f.name}"
            if meta.get("action") is None and "choices" not in meta:
                meta.setdefault("metavar", f.name.upper())
            meta.setdefault("default", f.default if f.default is not dataclasses.MISSING else None)
            group.add_argument(*names, **meta)
    return parser


def parse_blend(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """'W1 P1 W2 P2 ...' or 'P1' -> (prefixes, weights). Raises ValueError on a malformed list."""
    items = list(data_path)
    if not items:
        return [], []
    if len(items) == 1:
        return [items[0]], [1.0]
    if len(items) % 2:
        raise ValueError(f"--data-path needs 'WEIGHT PREFIX' pairs or a single PREFIX, got {items}")
    prefixes, weights = [], []
    for w, p in zip(items[0::2], items[1::2], strict=True):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"--data-path: {w!r} is not a weight (expected 'WEIGHT PREFIX' pairs)") from None
        if weight <= 0:
            raise ValueError(f"--data-path: weight {w} must be > 0")
        prefixes.append(p)
        weights.append(weight)
    return prefixes, weights


def validate(cfg: TrainerConfig) -> None:
    """Checks that need no world size. Raises ValueError saying what to change.

    Mirrors Megatron-LM's `validate_args` (megatron/training/arguments.py) where it applies; the
    operator's admission rules (megatron_operator/rules.py) refuse the same specs earlier, and
    tests/test_contract_refusals.py holds the two together.
    """
    # --device first: a CPU run is told what CPUs cannot run before what else the flags lack
    for check in (_validate_device, _validate_parallel_and_model, _validate_training, _validate_data,
                  _validate_checkpoint, _validate_logging):
        check(cfg)


def takes_te_path(cfg: TrainerConfig, have_te: bool) -> bool:
    """The run builds its model on Transformer Engine: asked for and importable, and not packed SFT (whose
    attention mask TE's attention would ignore; model.choose_path keeps it on the local path)."""
    return cfg.training.transformer_impl == "transformer_engine" and have_te and not cfg.data.sft_packing


def resolve_sequence_parallel(cfg: TrainerConfig, have_te: bool) -> tuple[TrainerConfig, str | None]:
    """`--sequence-parallel-auto` made concrete: on where the run takes the Transformer Engine path at
    TP > 1 (TE's norms and its TP communication overlap; Megatron's guidance), off on the local path:
    there it costs about 45 ms of a 1.7 s Llama-3-8B step at TP=2 on 2 x H200 (sequence-parallel
    all-gathers and reduce-scatters take longer than the all-reduces they replace, and nothing overlaps
    them without TE), for 2 GiB less memory. Returns the config (sequence_parallel set, auto cleared)
    and the reason for the start-up log; None when nothing was left to decide.

    A MoE model at TP > 1 gets it whatever was asked: megatron-core's MoE layer refuses to train without it
    (moe_layer.py, MoELayer.forward), so a run without it could not start."""
    p = cfg.parallel
    if cfg.model.num_experts and p.tensor > 1 and not p.sequence_parallel:
        why = "MoE at TP > 1: megatron-core's MoE layer trains only with it (moe_layer.py)"
        if not p.sequence_parallel_auto:
            why += "; on although the command line did not ask for it"
        return dataclasses.replace(cfg, parallel=dataclasses.replace(p, sequence_parallel=True,
                                                                     sequence_parallel_auto=False)), why
    if not p.sequence_parallel_auto or p.sequence_parallel:
        return dataclasses.replace(cfg, parallel=dataclasses.replace(p, sequence_parallel_auto=False)), None
    if p.tensor == 1:
        on, why = False, "TP = 1"
    elif takes_te_path(cfg, have_te):
        on, why = True, "Transformer Engine path, TP > 1"
    else:
        on, why = False, "local path (no Transformer Engine): measured slower there; --sequence-parallel forces it"
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, sequence_parallel=on,
                                                                 sequence_parallel_auto=False)), why


def resolve_cuda_graph(cfg: TrainerConfig, have_te: bool) -> tuple[TrainerConfig, str]:
    """`--cuda-graph-impl auto` made concrete: full_iteration where the full-iteration graph has been
    verified (docs/trainer.md, "CUDA graphs"), none elsewhere. Returns the config (unchanged unless it
    said auto) and the reason, for the start-up log; an explicit choice is returned as given."""
    t = cfg.training
    if t.cuda_graph_impl != "auto":
        return cfg, "as asked"
    why_not = [why for cond, why in (
        (t.device == "cpu", "CPUs have no CUDA graphs"),
        (cfg.checkpoint.hf_export_only, "an export-only run trains nothing"),
        (cfg.parallel.pipeline > 1, "pipeline parallelism (PP > 1) is not captured"),
        (cfg.model.num_experts is not None, "MoE routing sizes change every step"),
        (t.overlap_param_gather, "--overlap-param-gather waits inside the graph for a gather started outside it"),
        (t.fp8_format is not None, "FP8 runs on Transformer Engine, where the graph is not verified"),
        (takes_te_path(cfg, have_te), "the Transformer Engine path is not verified under the graph"),
        (cfg.data.sft, "fine-tuning data (SFT) is not verified under the graph"),
        (t.train_iters <= t.cuda_graph_warmup_steps, "the run ends before the graph would be captured"),
    ) if cond]
    impl = "none" if why_not else "full_iteration"
    reason = "; ".join(why_not) if why_not else "TE-less path, PP=1, dense, pretraining"
    return dataclasses.replace(cfg, training=dataclasses.replace(t, cuda_graph_impl=impl)), reason


def _validate_parallel_and_model(cfg: TrainerConfig) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.training
    for name, value in (("--tensor-model-parallel-size", p.tensor), ("--pipeline-model-parallel-size", p.pipeline),
                        ("--context-parallel-size", p.context), ("--expert-model-parallel-size", p.expert),
                        ("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                        ("--micro-batch-size", t.micro_batch_size), ("--train-iters", t.train_iters),
                        ("--log-interval", t.log_interval)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if m.num_attention_heads % p.tensor:
        raise ValueError(f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                         f"--tensor-model-parallel-size ({p.tensor})")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ValueError(f"--hidden-size ({m.hidden_size}) must be divisible by --num-attention-heads "
                         f"({m.num_attention_heads}), or give --kv-channels")
    if m.kv_channels is not None and m.kv_channels < 1:
        raise ValueError(f"--kv-channels must be >= 1, got {m.kv_channels}")
    if not 0 < m.norm_epsilon < 1:
        raise ValueError(f"--norm-epsilon must be in (0, 1), got {m.norm_epsilon}")
    if not 0 < m.rotary_percent <= 1:
        raise ValueError(f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
    if m.use_rope_scaling and m.position_embedding_type != "rope":
        raise ValueError("--use-rope-scaling needs --position-embedding-type rope")
    if m.use_rope_scaling and not m.rope_scaling_factor >= 1:
        raise ValueError(f"--rope-scaling-factor must be >= 1, got {m.rope_scaling_factor}")
    if m.num_query_groups is not None and not m.group_query_attention:
        raise ValueError("--num-query-groups needs --group-query-attention")
    groups = m.effective_num_query_groups
    if m.num_attention_heads % groups:
        raise ValueError(f"--num-attention-heads ({m.num_attention_heads}) must be a multiple of "
                         f"--num-query-groups ({groups})")
    if groups % p.tensor and p.tensor % groups:
        raise ValueError(f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({p.tensor}) "
                         "must divide one another")
    if m.num_layers % p.pipeline:
        raise ValueError(f"--num-layers ({m.num_layers}) must be divisible by "
                         f"--pipeline-model-parallel-size ({p.pipeline})")
    if p.virtual_pipeline is not None:
        if p.pipeline < 2:
            raise ValueError("--num-virtual-stages-per-pipeline-rank needs --pipeline-model-parallel-size > 1")
        if (m.num_layers // p.pipeline) % p.virtual_pipeline:
            raise ValueError(f"layers per pipeline stage ({m.num_layers // p.pipeline}) must be divisible by "
                             f"--num-virtual-stages-per-pipeline-rank ({p.virtual_pipeline})")
    if p.sequence_parallel and p.tensor == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if p.context > 1 and m.seq_length % (2 * p.context):
        raise ValueError(f"--seq-length ({m.seq_length}) must be divisible by 2 x --context-parallel-size")
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        raise ValueError(f"--max-position-embeddings ({m.max_position_embeddings}) must be >= "
                         f"--seq-length ({m.seq_length})")
    if m.num_experts is not None:
        if m.num_experts % p.expert:
            raise ValueError(f"--num-experts ({m.num_experts}) must be divisible by "
                             f"--expert-model-parallel-size ({p.expert})")
        if not 1 <= m.moe_router_topk <= m.num_experts:
            raise ValueError("--moe-router-topk must be between 1 and --num-experts")
        _validate_moe(cfg)
    elif p.expert > 1:
        raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
    _validate_mla(cfg)


def _validate_moe(cfg: TrainerConfig) -> None:
    """The router's flags (megatron-core's TransformerConfig and the experts' linear layers would fail on these)."""
    p, m = cfg.parallel, cfg.model
    if m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax:
        # transformer_config.py: a softmax over one logit has a zero gradient
        raise ValueError("--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over the one chosen logit "
                         "would give the router no gradient)")
    expert_tp = p.expert_tensor or p.tensor
    if m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size < 1:
        raise ValueError(f"--moe-ffn-hidden-size must be >= 1, got {m.moe_ffn_hidden_size}")
    if m.effective_moe_ffn_hidden_size % expert_tp:  # each expert's MLP is split over the expert TP ranks
        raise ValueError(f"the experts' hidden size ({m.effective_moe_ffn_hidden_size}) must be divisible by the "
                         f"expert tensor-parallel size ({expert_tp})")
    if m.add_bias_linear and expert_tp > 1:  # transformer_config.py asserts it: "Bias in Moe is only supported when ETP==1"
        raise ValueError(f"MoE with linear biases needs an expert tensor-parallel size of 1, got {expert_tp}; give "
                         "--disable-bias-linear or --expert-tensor-parallel-size 1")
    for name, value in (("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-z-loss-coeff", m.moe_z_loss_coeff)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be >= 0 (a loss weight), got {value}")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared < 1:  # transformer_config.py raises on <= 0
        raise ValueError(f"--moe-shared-expert-intermediate-size must be >= 1, got {shared}")
    if shared is not None and shared % p.tensor:  # a dense MLP split over the TP ranks (shared_experts.py: MLP)
        raise ValueError(f"--moe-shared-expert-intermediate-size ({shared}) must be divisible by "
                         f"--tensor-model-parallel-size ({p.tensor})")
    if shared is not None and m.add_bias_linear:  # shared_experts.py: SharedExpertMLP asserts add_bias_linear False
        raise ValueError("--moe-shared-expert-intermediate-size needs --disable-bias-linear (megatron-core's shared "
                         "experts have no linear biases)")
    if m.moe_shared_expert_gate and shared is None:  # moe_layer.py builds no shared experts, so no gate
        raise ValueError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (there is no shared "
                         "expert to gate)")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":  # transformer_config.py
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if not m.moe_router_bias_update_rate >= 0:  # a negative step would move the bias away from balance
        raise ValueError(f"--moe-router-bias-update-rate must be >= 0, got {m.moe_router_bias_update_rate}")
    capacity = m.moe_expert_capacity_factor
    if capacity is not None and not capacity > 0:  # megatron-core silently drops a negative factor (no capacity)
        raise ValueError(f"--moe-expert-capacity-factor must be > 0, got {capacity}")
    if m.moe_pad_expert_input_to_capacity and capacity is None:  # transformer_config.py
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    pattern = m.moe_layer_pattern  # ValueError for a malformed one, or one not of --num-layers entries
    if 1 not in pattern:
        raise ValueError(f"--moe-layer-freq {m.moe_layer_freq} makes no layer a MoE layer; drop --num-experts for a "
                         "dense model")
    if m.moe_router_num_groups is not None or m.moe_router_group_topk is not None:
        _validate_router_groups(m)
    factor = m.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        raise ValueError(f"--moe-router-topk-scaling-factor must be > 0, got {factor}")


def _validate_router_groups(m: ModelConfig) -> None:
    """Group-limited routing: transformer_config.py (TransformerConfig.__post_init__) and moe_utils.py
    (group_limited_topk, which sums each group's top topk // group_topk scores and then picks topk experts among
    the chosen groups' experts)."""
    groups, group_topk, experts, topk = m.moe_router_num_groups, m.moe_router_group_topk, m.num_experts, m.moe_router_topk
    if groups is None or group_topk is None:  # group_topk alone: transformer_config.py raises; groups alone: ignored
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing)")
    if groups < 1 or group_topk < 1:
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk must be >= 1")
    assert experts is not None
    if experts % groups:
        raise ValueError(f"--num-experts ({experts}) must be divisible by --moe-router-num-groups ({groups})")
    if group_topk > groups:
        raise ValueError(f"--moe-router-group-topk ({group_topk}) must be at most --moe-router-num-groups ({groups})")
    if topk < group_topk:  # topk // group_topk scores per group: none
        raise ValueError(f"--moe-router-topk ({topk}) must be at least --moe-router-group-topk ({group_topk})")
    if topk // group_topk > experts // groups:
        raise ValueError(f"--moe-router-topk // --moe-router-group-topk ({topk // group_topk}) must be at most the "
                         f"experts in a group ({experts // groups})")


def _validate_mla(cfg: TrainerConfig) -> None:
    """Multi-head latent attention (megatron-core's MLASelfAttention, multi_latent_attention.py; MLATransformerConfig
    in transformer_config.py)."""
    m = cfg.model
    if not m.multi_latent_attention:
        return
    for name, value in (("--kv-lora-rank", m.kv_lora_rank), ("--qk-head-dim", m.qk_head_dim),
                        ("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim), ("--v-head-dim", m.v_head_dim),
                        ("--q-lora-rank", m.q_lora_rank if m.q_lora_rank is not None else 1)):
        if value < 1:
            raise ValueError(f"multi-head latent attention: {name} must be >= 1, got {value}")
    if m.qk_pos_emb_head_dim % 2:  # RoPE rotates pairs of dimensions
        raise ValueError(f"--qk-pos-emb-head-dim ({m.qk_pos_emb_head_dim}) must be even (RoPE rotates pairs)")
    if m.position_embedding_type != "rope":  # MLA applies its own rotary embedding; learned positions would add to it
        raise ValueError("--multi-latent-attention needs --position-embedding-type rope")
    if m.group_query_attention:  # MLA has one key/value per head from the latent: no query groups
        raise ValueError("--multi-latent-attention has no query groups; drop --group-query-attention")
    if m.use_rope_scaling:  # MLA's rotary embedding takes YaRN (--rope-type yarn), not Llama 3.1's scaling
        raise ValueError("--use-rope-scaling does not apply to --multi-latent-attention; use --rope-type yarn "
                         "--rotary-scaling-factor")
    if m.rotary_percent != 1.0:  # MLA's rotary covers --qk-pos-emb-head-dim whole
        raise ValueError("--rotary-percent does not apply to --multi-latent-attention (--qk-pos-emb-head-dim is the "
                         "rotated part)")
    if cfg.parallel.context > 1:
        raise ValueError("--multi-latent-attention with --context-parallel-size > 1 is not wired in this trainer")
    if m.effective_rope_type == "yarn" and not m.rotary_scaling_factor >= 1:
        raise ValueError(f"--rotary-scaling-factor must be >= 1, got {m.rotary_scaling_factor}")


def _validate_training(cfg: TrainerConfig) -> None:
    p, m, t = cfg.parallel, cfg.model, cfg.training
    if t.bf16 and t.fp16:
        raise ValueError("--bf16 and --fp16 are mutually exclusive")
    if t.fp8_format and not (t.bf16 or t.fp16):
        raise ValueError("--fp8-format needs --bf16 (or --fp16)")
    if t.transformer_impl == "local" and t.fp8_format:
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine (the local implementation has "
                         "no FP8 kernels)")
    if t.transformer_impl == "local" and p.context > 1:
        # Megatron-Core's DotProductAttention.__init__ asserts CP == 1
        raise ValueError("--context-parallel-size > 1 needs --transformer-impl transformer_engine")
    if p.context > 1 and t.attention_backend in ("unfused", "local"):
        raise ValueError(f"--context-parallel-size > 1 needs a fused attention backend (flash, fused or auto), "
                         f"not --attention-backend {t.attention_backend}")
    if t.use_distributed_optimizer is False and t.overlap_param_gather:
        raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
    if t.overlap_param_gather and not t.overlap_grad_reduce:
        raise ValueError("--overlap-param-gather needs --overlap-grad-reduce")
    if t.recompute_method is not None and t.recompute_granularity != "full":
        raise ValueError("--recompute-method needs --recompute-granularity full")
    if t.recompute_granularity == "full" and (t.recompute_method is None or not t.recompute_num_layers):
        raise ValueError("--recompute-granularity full needs --recompute-method and --recompute-num-layers")
    if t.cuda_graph_impl in ("local", "transformer_engine"):
        raise ValueError(f"--cuda-graph-impl {t.cuda_graph_impl} (per-layer graphs) is not implemented by this "
                         "trainer; use --cuda-graph-impl full_iteration or none")
    if t.cuda_graph_impl == "full_iteration":
        if p.pipeline > 1:
            raise ValueError("--cuda-graph-impl full_iteration is implemented for --pipeline-model-parallel-size 1 "
                             "only; drop it or use PP=1")
        if m.num_experts is not None:
            raise ValueError("--cuda-graph-impl full_iteration does not support MoE (--num-experts): expert "
                             "routing sizes change every step; drop one of them")
        if t.overlap_param_gather:
            raise ValueError("--cuda-graph-impl full_iteration with --overlap-param-gather is not supported: the "
                             "parameter all-gather starts after the optimizer, outside the graph, and is waited "
                             "for inside it; drop --overlap-param-gather (--overlap-grad-reduce is fine)")
    if t.cuda_graph_impl in ("full_iteration", "auto") and t.cuda_graph_warmup_steps < 1:
        raise ValueError("--cuda-graph-warmup-steps must be >= 1 (the graph is captured after eager steps)")
    if t.manual_gc_interval < 0:
        raise ValueError("--manual-gc-interval must be >= 0")
    if t.manual_gc_interval and not t.manual_gc:
        raise ValueError("--manual-gc-interval needs --manual-gc")
    if t.distributed_timeout_minutes is not None and t.distributed_timeout_minutes < 1:
        raise ValueError("--distributed-timeout-minutes must be >= 1")
    if t.eval_iters < 0 or (t.eval_iters and not cfg.data.sft_valid_path):
        raise ValueError("--eval-iters evaluates SFT data (--sft-valid-path); without it, it must be 0")
    if t.eval_interval is not None and t.eval_interval < 1:
        raise ValueError("--eval-interval must be >= 1")
    if t.lr_warmup_iters < 0 or t.lr < 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise ValueError("need 0 <= --min-lr <= --lr and --lr-warmup-iters >= 0")
    decay = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_warmup_iters >= decay:  # OptimizerParamScheduler asserts warmup < decay steps
        raise ValueError(f"--lr-warmup-iters ({t.lr_warmup_iters}) must be below --lr-decay-iters ({decay})")
    if t.global_batch_size is not None and t.global_batch_size % t.micro_batch_size:
        raise ValueError(f"--global-batch-size ({t.global_batch_size}) must be a multiple of "
                         f"--micro-batch-size ({t.micro_batch_size})")


#: What `--device cpu` refuses, and why (the operator's admission twins: rules `cpu-*`, for gpusPerNode 0).
CPU_REFUSALS = (
    ("--transformer-impl transformer_engine", "Transformer Engine runs on CUDA only; use --transformer-impl local"),
    ("--fp8-format", "FP8 GEMMs are Transformer Engine's, on CUDA only"),
    ("--fp16", "fp16 mixed precision is not verified on CPUs; use --bf16"),
    ("--cuda-graph-impl full_iteration", "CUDA graphs need CUDA; use --cuda-graph-impl none (auto is none on CPUs)"),
    ("--async-save", "the background writer pins host memory for its device-to-host copies, which needs CUDA; "
                     "CPU runs save synchronously"),
)


def _validate_device(cfg: TrainerConfig) -> None:
    t = cfg.training
    if t.device != "cpu":
        return
    given = {"--transformer-impl transformer_engine": t.transformer_impl == "transformer_engine",
             "--fp8-format": t.fp8_format is not None, "--fp16": t.fp16,
             "--cuda-graph-impl full_iteration": t.cuda_graph_impl == "full_iteration",
             "--async-save": cfg.checkpoint.async_save}
    refused = [(flag_text, why) for flag_text, why in CPU_REFUSALS if given[flag_text]]
    if refused:
        flag_text, why = refused[0]
        raise ValueError(f"--device cpu: {flag_text} cannot run on CPUs ({why})")


def _validate_data(cfg: TrainerConfig) -> None:
    d, m = cfg.data, cfg.model
    if d.sft:
        _validate_sft(cfg)
        return
    for name, value in (("--sft-train-path", d.sft_train_path), ("--sft-valid-path", d.sft_valid_path),
                        ("--sft-packing", d.sft_packing), ("--chat-template", d.chat_template)):
        if value:
            raise ValueError(f"{name} needs --data-format chat or prompt-completion")
    if d.mock_data == bool(d.data_path):
        raise ValueError("give exactly one of --mock-data and --data-path")
    parse_blend(d.data_path)
    if d.tokenizer_type == "HuggingFaceTokenizer" and not d.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a local directory)")
    if d.tokenizer_type == "NullTokenizer" and not m.vocab_size:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    split = d.split.replace("/", ",").split(",")
    try:
        if not split or any(float(x) < 0 for x in split) or not float(split[0]) > 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"--split {d.split!r}: expected comma-separated weights with train > 0") from None


def _validate_sft(cfg: TrainerConfig) -> None:
    d, p = cfg.data, cfg.parallel
    if d.mock_data or d.data_path:
        raise ValueError(f"--data-format {d.data_format} reads --sft-train-path; --mock-data and --data-path "
                         "are for pretraining")
    if not d.sft_train_path:
        raise ValueError(f"--data-format {d.data_format} needs --sft-train-path (a JSONL file)")
    if d.tokenizer_type != "HuggingFaceTokenizer" or not d.tokenizer_model:
        raise ValueError(f"--data-format {d.data_format} needs --tokenizer-type HuggingFaceTokenizer and "
                         "--tokenizer-model DIR (its tokenizer.json and chat template)")
    if d.chat_template and d.data_format != "chat":
        raise ValueError("--chat-template applies to --data-format chat only")
    if d.reset_attention_mask or d.reset_position_ids or d.eod_mask_loss:
        raise ValueError("--reset-attention-mask, --reset-position-ids and --eod-mask-loss are pretraining "
                         "flags; SFT masks the loss to the answers and --sft-packing keeps samples apart")
    if d.sft_packing and cfg.training.fp8_format:
        raise ValueError("--sft-packing runs on the local path (Transformer Engine's attention ignores the "
                         "document mask), which has no FP8: use --no-sft-packing for FP8")
    if p.context > 1:
        raise ValueError("SFT data with --context-parallel-size > 1 needs Transformer Engine's packed "
                         "(THD) attention, which this trainer does not use")
    if d.sft_valid_path and cfg.training.eval_iters < 1:
        raise ValueError("--sft-valid-path needs --eval-iters >= 1 (global batches per evaluation)")


def _validate_checkpoint(cfg: TrainerConfig) -> None:
    c = cfg.checkpoint
    if c.dist_ckpt_optim_fully_reshardable and c.dist_ckpt_optim_dp_reshardable:
        raise ValueError("--dist-ckpt-optim-fully-reshardable and --dist-ckpt-optim-dp-reshardable contradict "
                         "each other: give one")
    if c.dist_ckpt_workers < 1:
        raise ValueError("--dist-ckpt-workers must be >= 1")
    if c.save_interval is not None and c.save_interval < 1:
        raise ValueError("--save-interval must be >= 1")
    if c.save_interval and not c.save:
        raise ValueError("--save-interval needs --save DIR")
    if c.async_save and not c.save:
        raise ValueError("--async-save needs --save DIR")
    if c.async_save and not c.use_persistent_ckpt_worker:
        # Megatron-LM silently drops async without it (arguments.py, validate_args); we refuse instead.
        raise ValueError("--async-save needs --use-persistent-ckpt-worker")
    if c.exit_on_missing_checkpoint and not c.load:
        raise ValueError("--exit-on-missing-checkpoint needs --load DIR")
    remote = [p for p in (c.save, c.load, c.hf_export) if p and p.startswith("s3://")]
    if remote:
        from .objstore import parse_s3_url

        for p in remote:
            parse_s3_url(p)  # ValueError: exit 2
        if c.save and c.load and (c.save in remote) != (c.load in remote):
            raise ValueError("--save and --load must both be s3:// or both be directories")
        if c.hf_export in remote:
            _check_export_apart_from_checkpoints(c.hf_export, [p for p in (c.save, c.load) if p in remote])
    elif c.object_store_endpoint or c.object_store_region:
        raise ValueError("--object-store-endpoint/--object-store-region need an s3://BUCKET/PREFIX --save, --load "
                         "or --hf-export")
    if c.object_store_endpoint and not re.fullmatch(OBJECT_STORE_ENDPOINT, c.object_store_endpoint):
        raise ValueError(f"--object-store-endpoint {c.object_store_endpoint!r}: expected http(s)://HOST[:PORT] "
                         "(a port 1-65535; no path, no user info)")
    if c.hf_export_only and not (c.hf_export and c.load):
        raise ValueError("--hf-export-only needs --load DIR (the checkpoint) and --hf-export DIR (where to write)")
    local_export = c.hf_export if c.hf_export is not None and not c.hf_export.startswith("s3://") else None
    for name, path in (("--hf-init", c.hf_init), ("--hf-export", local_export)):
        if path is not None and (not path.startswith("/") or ".." in path.split("/") or path.rstrip("/") == ""):
            raise ValueError(f"{name} must be an absolute directory path without '..' components, got {path!r}")
    if c.hf_init and c.hf_export and c.hf_init.rstrip("/") == c.hf_export.rstrip("/"):
        raise ValueError("--hf-export must not be the --hf-init directory (an export never overwrites its source)")


# Weights & Biases' limits on a project name (spec.logging.wandb.project has the same pattern).
WANDB_PROJECT = r"[^/\\#?%:\x00-\x1f\x7f]{1,128}"


def _validate_logging(cfg: TrainerConfig) -> None:
    lg = cfg.logging
    if lg.wandb_project and not re.fullmatch(WANDB_PROJECT, lg.wandb_project):
        raise ValueError(f"--wandb-project {lg.wandb_project!r}: at most 128 characters, none of / \\ # ? % : "
                         "(Weights & Biases' limits)")


def _check_export_apart_from_checkpoints(export: str, checkpoints: list[str]) -> None:
    """An export under the checkpoint prefix (or around it) would mix its files with the checkpoints'
    keys, and its never-overwrite check would refuse the prefix the checkpoints fill."""
    from .objstore import parse_s3_url

    e = parse_s3_url(export)
    for url in checkpoints:
        ckpt = parse_s3_url(url)
        if ckpt.bucket != e.bucket:
            continue
        if e.prefix == ckpt.prefix or not e.prefix or not ckpt.prefix or e.prefix.startswith(ckpt.prefix + "/") \
                or ckpt.prefix.startswith(e.prefix + "/"):
            raise ValueError(f"--hf-export {export} overlaps the checkpoint location {url}: export to a prefix apart "
                             "from the checkpoints, e.g. s3://BUCKET/exports/NAME")


def ignored_flags(cfg: TrainerConfig) -> list[str]:
    """The accepted-but-unused flags the command line set (off their defaults), for one start-up note."""
    out = []
    acting = {"tensorboard_dir", "tensorboard_log_interval", "tensorboard_queue_size", "wandb_project",
              "wandb_exp_name", "wandb_entity", "wandb_save_dir", "wandb_mode", "wandb_api_key_file"}
    if cfg.logging.tensorboard_dir:
        acting |= {"log_timers_to_tensorboard", "log_memory_to_tensorboard"}  # written anyway
    for section, cls in (("logging", LoggingConfig),):
        values = getattr(cfg, section)
        for f in dataclasses.fields(cls):
            if f.name not in acting and getattr(values, f.name) != f.default:
                out.append(f.metadata["flags"][0])
    if cfg.training.eval_interval is not None and not cfg.data.sft_valid_path:
        out.append("--eval-interval")
    if cfg.training.fp8_recipe != "delayed" and cfg.training.fp8_format is None:  # read only with FP8 GEMMs
        out.append("--fp8-recipe")
    if not cfg.model.multi_latent_attention:  # MLA's flags without MLA
        out += [f.metadata["flags"][0] for f in dataclasses.fields(ModelConfig) if f.name in MLA_FIELDS
                and getattr(cfg.model, f.name) != f.default]
    if not cfg.model.num_experts:  # the router's flags of a dense model
        out += [f.metadata["flags"][0] for f in dataclasses.fields(ModelConfig)
                if f.name.startswith("moe_") and f.name != "moe_router_topk" and getattr(cfg.model, f.name) != f.default]
    else:  # router flags that only act beside another one (megatron-core reads them only then)
        m = cfg.model
        out += [flag for flag, unused in (
            ("--moe-router-pre-softmax", m.moe_router_pre_softmax and m.moe_router_score_function != "softmax"),
            ("--moe-router-bias-update-rate", m.moe_router_bias_update_rate != 1e-3 and not m.moe_router_enable_expert_bias),
            ("--moe-token-drop-policy", m.moe_token_drop_policy != "probs" and m.moe_expert_capacity_factor is None),
        ) if unused]
    return out


def parse_args(argv: Sequence[str]) -> TrainerConfig:
    """Parse the rendered command line. Exits with code 2 (argparse style) on any error."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    values = vars(ns)
    sections = {}
    for section, cls in _SECTIONS:
        kwargs = {f.name: values[f"{section}.{f.name}"] for f in dataclasses.fields(cls)}
        if section == "data":
            kwargs["data_path"] = tuple(kwargs["data_path"] or ())
        sections[section] = cls(**kwargs)
    cfg = TrainerConfig(**sections)
    try:
        validate(cfg)
    except ValueError as e:
        parser.error(str(e))
    return cfg


def _env_bool(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


# MEGATRON_TRAINER_COMPILE_ROPE: 0 (eager), 1 (compiled, intermediates in fp32) or exact (compiled, eager's
# rounding; the default)
ROPE_MODES = ("0", "1", "exact")
# MEGATRON_TRAINER_DETERMINISTIC_ATTENTION: flash (the default) or math (RuntimeConfig.deterministic_attention)
DETERMINISTIC_ATTENTION_MODES = ("flash", "math")
# MEGATRON_TRAINER_MOE_EXPERTS: grouped (the default) or sequential (RuntimeConfig.moe_experts)
MOE_EXPERTS_IMPLS = ("grouped", "sequential")


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    """An environment variable that names one of `choices` (any case, spaces around it; unset or empty: `default`);
    ValueError otherwise."""
    raw = env.get(name, "").strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def runtime_from_env(env: Mapping[str, str]) -> RuntimeConfig:
    """The trainer's environment knobs. Raises ValueError on a malformed number."""

    def num(name: str, default: float, cast: type) -> Any:
        raw = env.get(name, "").strip()
        if not raw:
            return cast(default)
        try:
            value = cast(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a {cast.__name__}") from None
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {raw}")
        return value

    return RuntimeConfig(
        job_name=env.get("MEGATRON_JOB_NAME") or None,
        job_namespace=env.get("MEGATRON_JOB_NAMESPACE") or None,
        restart_attempt=num("MEGATRON_RESTART_ATTEMPT", 0, int),
        progress_interval_s=num("MEGATRON_PROGRESS_INTERVAL_S", 30.0, float),
        metrics_port=num("MEGATRON_METRICS_PORT", 9400, int),
        checkpoint_keep=num("MEGATRON_CHECKPOINT_KEEP", 0, int),
        shutdown_grace_s=num("MEGATRON_SHUTDOWN_GRACE_S", num("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30.0, float), float),
        data_cache_shared=_env_bool(env.get("MEGATRON_DATA_CACHE_SHARED")),
        foreach_ops=env.get("MEGATRON_TRAINER_FOREACH_OPS", "1").strip() != "0",
        fused_adam=env.get("MEGATRON_TRAINER_FUSED_ADAM", "1").strip() != "0",
        rope_mode=_choice(env, "MEGATRON_TRAINER_COMPILE_ROPE", ROPE_MODES, "exact"),
        deterministic_attention=_choice(env, "MEGATRON_TRAINER_DETERMINISTIC_ATTENTION", DETERMINISTIC_ATTENTION_MODES,
                                        "flash"),
        deterministic_attention_set=bool(env.get("MEGATRON_TRAINER_DETERMINISTIC_ATTENTION", "").strip()),
        compile_norm=env.get("MEGATRON_TRAINER_COMPILE_NORM", "0").strip() == "1",
        ce_fusion=env.get("MEGATRON_TRAINER_CE_FUSION", "0").strip() == "1",
        optim_in_place=env.get("MEGATRON_TRAINER_OPTIM_IN_PLACE", "1").strip() != "0",
        tp_overlap_chunks=num("MEGATRON_TRAINER_TP_OVERLAP_CHUNKS", 1, int),
        tp_overlap_sm_carveout=num("MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT", 0, int),
        profile=env.get("MEGATRON_TRAINER_PROFILE") or None,
        moe_experts=_choice(env, "MEGATRON_TRAINER_MOE_EXPERTS", MOE_EXPERTS_IMPLS, "grouped"),
        moe_group_align=num("MEGATRON_TRAINER_MOE_GROUP_ALIGN", 0, int),
    )


@dataclass(frozen=True)
class WorldLayout:
    """Sizes derived from the config and the world size."""

    world_size: int
    data_parallel: int
    global_batch_size: int
    num_microbatches: int


def world_layout(cfg: TrainerConfig, world_size: int) -> WorldLayout:
    """DP size and micro-batches per step; ValueError if the layout does not divide the world."""
    p, t = cfg.parallel, cfg.training
    model_parallel = p.tensor * p.pipeline * p.context
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by TP x PP x CP = {model_parallel}")
    dp = world_size // model_parallel
    expert_grid = (p.expert_tensor or p.tensor) * p.expert * p.pipeline
    if world_size % expert_grid:
        raise ValueError(f"world size {world_size} is not divisible by ETP x EP x PP = {expert_grid}")
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size ({gbs}) must be divisible by micro batch x DP "
                         f"({t.micro_batch_size} x {dp})")
    microbatches = gbs // (t.micro_batch_size * dp)
    if p.virtual_pipeline is not None and microbatches % p.pipeline:
        # the interleaved schedule runs micro-batches in groups of PP
        # (schedules.forward_backward_pipelining_with_interleaving)
        raise ValueError(f"with --num-virtual-stages-per-pipeline-rank, the micro-batches per step ({microbatches}) "
                         f"must be a multiple of --pipeline-model-parallel-size ({p.pipeline})")
    return WorldLayout(world_size=world_size, data_parallel=dp, global_batch_size=gbs, num_microbatches=microbatches)
