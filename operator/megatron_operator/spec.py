"""The MegatronJob API (megatron-operator.io/v1alpha1): pydantic models, the single source of truth.

The same models generate the CRD schema (``crd.py``); the cross-field rules in ``rules.py`` are
enforced here (``MegatronJobSpec`` validator) and emitted as CEL into the CRD, so a layout that
Megatron would refuse at start-up is refused at ``kubectl apply`` with the same message.

A block of the spec that reaches several stages (spec.pod, spec.logging.wandb, spec.checkpoint.objectStore,
spec.init and spec.export) has its models in its own module under ``blocks/``; the fields here take them.

The conventions every model follows (camelCase wire names, no nulls, unknown fields refused) are
``vocab/api.py``'s ``ApiModel``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from . import blocks, rules
from .names import (  # noqa: F401  (API_VERSION, GROUP, KIND, PLURAL, VERSION: re-exported, the API's identity)
    API_VERSION,
    GROUP,
    KIND,
    MAX_NAME_LENGTH,
    PLURAL,
    RFC1035_LABEL,
    VERSION,
)
from .presets import GPU_MEMORY_GIB, MODEL_PRESETS
from .vocab.api import ApiModel, EnvVar, Quantity
from .vocab.patterns import (
    DNS_LABEL,
    LABEL_VALUE,
    MAX_SAFE_INT,
    REL_PATH,
    RESOURCE_NAME,
)

# --------------------------------------------------------------------------------------------
# spec.parallelism
# --------------------------------------------------------------------------------------------


class Parallelism(ApiModel):
    """How the model is split over GPUs. Data parallelism is derived:
    DP = numNodes x gpusPerNode / (tensor x pipeline x context)."""

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel size (Megatron --tensor-model-parallel-size).")
    pipeline: int = Field(1, ge=1, le=128, description="Pipeline-parallel size (--pipeline-model-parallel-size).")
    context: int = Field(1, ge=1, le=64, description="Context-parallel size (--context-parallel-size): the sequence "
                         "is split over this many GPUs. Needs Transformer Engine.")
    expert: int = Field(1, ge=1, le=1024, description="Expert-parallel size (--expert-model-parallel-size) for "
                        "mixture-of-experts models.")
    expert_tensor: int | None = Field(None, ge=1, le=64, description="Tensor-parallel size inside experts "
                                      "(--expert-tensor-parallel-size). Megatron's default: the tensor size.")
    virtual_pipeline: int | None = Field(None, ge=2, le=64, description="Virtual pipeline stages per pipeline "
                                         "rank (interleaved schedule, --num-virtual-stages-per-pipeline-rank). "
                                         "Omit for the plain 1F1B schedule. Needs pipeline > 1.")
    sequence_parallel: bool | None = Field(None, description="Megatron sequence parallelism (--sequence-parallel). "
                                           "Default: on when tensor > 1 and the trainer runs on Transformer "
                                           "Engine (decided by the trainer, which knows its image); off on the "
                                           "local path (no TE), where it is supported but slower. true forces it.")


# --------------------------------------------------------------------------------------------
# spec.model
# --------------------------------------------------------------------------------------------

PresetName = Literal[
    "gpt-1.7b", "gpt-3.6b", "gpt-7.5b", "gpt-18.4b", "gpt-39.1b", "gpt-76.1b", "gpt-145.6b", "gpt-310.1b",
    "llama3-8b", "llama3-70b",
]
assert set(PresetName.__args__) == set(MODEL_PRESETS)  # type: ignore[attr-defined]


class ModelSpec(ApiModel):
    """The GPT model: a preset, explicit sizes, or a preset with explicit overrides."""

    preset: PresetName | None = Field(None, description="A named size; explicit fields below override it. "
                                      "gpt-* follow the Megatron-LM paper table; llama3-* are Llama-3-style.")
    num_layers: int | None = Field(None, ge=1, le=1024, description="Transformer layers (--num-layers).")
    hidden_size: int | None = Field(None, ge=8, le=131072, description="Hidden size (--hidden-size).")
    num_attention_heads: int | None = Field(None, ge=1, le=1024, description="Attention heads "
                                            "(--num-attention-heads).")
    num_query_groups: int | None = Field(None, ge=1, le=1024, description="Key/value groups for grouped-query "
                                         "attention (--num-query-groups). Default: one per head (plain MHA).")
    ffn_hidden_size: int | None = Field(None, ge=8, le=1048576, description="MLP hidden size (--ffn-hidden-size). "
                                        "Default: 4 x hiddenSize.")
    seq_length: int | None = Field(None, ge=16, le=1048576, description="Training sequence length (--seq-length).")
    max_position_embeddings: int | None = Field(None, ge=16, le=1048576, description="Position-embedding table "
                                                "size (--max-position-embeddings). Default: seqLength.")
    vocab_size: int | None = Field(None, ge=2, le=4194304, description="Vocabulary size before padding "
                                   "(--vocab-size); Megatron pads it to a multiple of 128 x tensor.")
    num_experts: int | None = Field(None, ge=1, le=4096, description="Experts per MoE layer (--num-experts); omit "
                                    "for a dense model.")
    moe_router_topk: int | None = Field(None, ge=1, le=64, description="Experts each token is routed to "
                                        "(--moe-router-topk). Default 2; only with numExperts.")
    # The rest of the mixture-of-experts block: flat beside numExperts and moeRouterTopk (the spelling jobs
    # already use), each named after its Megatron flag, each only with numExperts (moe-fields-need-experts).
    moe_ffn_hidden_size: int | None = Field(None, ge=1, le=1048576, description="Hidden size of each expert's "
                                            "MLP (--moe-ffn-hidden-size; Hugging Face moe_intermediate_size). "
                                            "Default ffnHiddenSize; only with numExperts.")
    moe_router_pre_softmax: bool | None = Field(None, description="Router: softmax over all experts, then the "
                                                "top-k, their probabilities not renormalised (--moe-router-pre-"
                                                "softmax; Hugging Face norm_topk_prob false). Default false: top-k "
                                                "of the logits, softmax over the k. Needed at moeRouterTopk 1.")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] | None = Field(
        None, description="Load-balancing loss (--moe-router-load-balancing-type): over each micro-batch "
        "(aux_loss), each sequence, the global batch, or none. Default aux_loss; its weight is moeAuxLossCoeff.")
    moe_aux_loss_coeff: float | None = Field(None, ge=0, le=100, description="Weight of the load-balancing loss "
                                             "(--moe-aux-loss-coeff; Hugging Face router_aux_loss_coef). Default 0 "
                                             "(not computed).")
    moe_z_loss_coeff: float | None = Field(None, ge=0, le=100, description="Weight of the router z-loss "
                                           "(--moe-z-loss-coeff; ST-MoE). Default: none.")
    moe_router_dtype: Literal["fp32", "fp64"] | None = Field(None, description="Precision of the router's logits "
                                                             "and probabilities (--moe-router-dtype). Default: the "
                                                             "model's.")
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] | None = Field(
        None, description="How tokens reach their experts' ranks (--moe-token-dispatcher-type): all-gather over "
        "the expert group, or all-to-all (less traffic at large expert parallel sizes). Default allgather.")
    moe_shared_expert_intermediate_size: int | None = Field(
        None, ge=1, le=1048576, description="Hidden size of the shared experts' MLP, which every token passes beside "
        "its routed experts (--moe-shared-expert-intermediate-size; shared experts x each one's size; split over "
        "spec.parallelism.tensor). Default: no shared experts.")
    moe_shared_expert_gate: bool | None = Field(
        None, description="Scale the shared experts' output by sigmoid of a learned gate (1 x hidden) of the token "
        "(--moe-shared-expert-gate; Qwen2-MoE). Needs moeSharedExpertIntermediateSize. Default false.")
    moe_router_score_function: Literal["softmax", "sigmoid"] | None = Field(
        None, description="Router scores (--moe-router-score-function): softmax, or sigmoid with the k chosen scores "
        "renormalised (DeepSeek-V3). Default softmax.")
    moe_router_enable_expert_bias: bool | None = Field(
        None, description="Aux-loss-free load balancing (--moe-router-enable-expert-bias): a per-expert bias added "
        "to the scores that choose the experts, raised for experts given fewer tokens than the mean after each step. "
        "Needs moeRouterScoreFunction sigmoid. Default false.")
    moe_router_bias_update_rate: float | None = Field(
        None, ge=0, le=1, description="Step of the expert bias per global batch (--moe-router-bias-update-rate). "
        "Default 0.001; only with moeRouterEnableExpertBias.")
    moe_expert_capacity_factor: float | None = Field(
        None, gt=0, le=1024, description="Token dropping (--moe-expert-capacity-factor): each expert takes at most "
        "this factor x its even share of a micro-batch's tokens, the rest are dropped. Default: none dropped.")
    moe_token_drop_policy: Literal["probs", "position"] | None = Field(
        None, description="Which tokens an expert over capacity drops (--moe-token-drop-policy): those of lowest "
        "probability, or the last ones. Default probs; only with moeExpertCapacityFactor.")
    moe_pad_expert_input_to_capacity: bool | None = Field(
        None, description="Pad each expert's tokens up to its capacity (--moe-pad-expert-input-to-capacity): fixed "
        "shapes, more work. Needs moeExpertCapacityFactor. Default false.")
    moe_layer_freq: list[Annotated[int, Field(ge=0, le=1)]] | None = Field(
        None, min_length=1, max_length=1024, description="Which layers are MoE layers, one entry per layer "
        "(--moe-layer-freq as a list): 1 a MoE layer, 0 a dense MLP of ffnHiddenSize (DeepSeek-V3's and GLM-4.5's "
        "first_k_dense_replace dense layers first; Qwen3-MoE's mlp_only_layers). numLayers entries. Default: every "
        "layer MoE.")
    moe_router_num_groups: int | None = Field(
        None, ge=1, le=4096, description="Group-limited routing (--moe-router-num-groups; DeepSeek-V3 n_group): the "
        "experts in this many equal groups, each token choosing its experts from moeRouterGroupTopk groups. "
        "Needs moeRouterGroupTopk. Default: no groups.")
    moe_router_group_topk: int | None = Field(
        None, ge=1, le=4096, description="Groups each token picks its experts from (--moe-router-group-topk; "
        "DeepSeek-V3 topk_group). Needs moeRouterNumGroups.")
    moe_router_topk_scaling_factor: float | None = Field(
        None, gt=0, le=1024, description="Scale of the routed experts' probabilities (--moe-router-topk-scaling-"
        "factor; DeepSeek-V3 routed_scaling_factor). Default 1.")
    multi_latent_attention: bool | None = Field(
        None, description="Multi-head latent attention (--multi-latent-attention; DeepSeek-V2/V3, Kimi-K2): queries "
        "and keys/values through low-rank latents, each head's query/key a part without RoPE (qkHeadDim) and one "
        "with it (qkPosEmbHeadDim). Needs positionEmbedding rope. Default false.")
    q_lora_rank: int | None = Field(None, ge=1, le=65536, description="MLA: rank of the query latent (--q-lora-rank; "
                                    "Hugging Face q_lora_rank). Default: no query compression.")
    kv_lora_rank: int | None = Field(None, ge=1, le=65536, description="MLA: rank of the key/value latent "
                                     "(--kv-lora-rank). Default 32 (Megatron-LM's).")
    qk_head_dim: int | None = Field(None, ge=1, le=16384, description="MLA: per-head query/key dimension without "
                                    "RoPE (--qk-head-dim; Hugging Face qk_nope_head_dim). Default 128.")
    qk_pos_emb_head_dim: int | None = Field(None, ge=2, le=16384, description="MLA: per-head query/key dimension "
                                            "with RoPE (--qk-pos-emb-head-dim; Hugging Face qk_rope_head_dim), even. "
                                            "Default 64.")
    v_head_dim: int | None = Field(None, ge=1, le=16384, description="MLA: per-head value dimension (--v-head-dim). "
                                   "Default 128.")
    rope_type: Literal["rope", "yarn"] | None = Field(
        None, description="MLA's rotary embedding (--rope-type): rope, or YaRN with rotaryScalingFactor and the "
        "fields below. Default yarn (Megatron-LM's for MLA; at factor 1 it is plain RoPE).")
    rotary_scaling_factor: float | None = Field(None, ge=1, le=1024, description="YaRN: the context extension factor "
                                                "(--rotary-scaling-factor; Hugging Face rope_scaling factor). "
                                                "Default 1.")
    original_max_position_embeddings: int | None = Field(
        None, ge=16, le=1048576, description="YaRN: the context the model was first trained at "
        "(--original-max-position-embeddings). Default 4096.")
    beta_fast: float | None = Field(None, gt=0, le=1024, description="YaRN beta_fast (--beta-fast). Default 32.")
    beta_slow: float | None = Field(None, gt=0, le=1024, description="YaRN beta_slow (--beta-slow). Default 1.")
    mscale: float | None = Field(None, ge=0, le=1024, description="YaRN mscale (--mscale). Default 1.")
    mscale_all_dim: float | None = Field(None, ge=0, le=1024, description="YaRN mscale_all_dim (--mscale-all-dim; 0: "
                                         "the attention's softmax scale unchanged). Default 0.")
    rotary_percent: float | None = Field(None, gt=0, le=1, description="Share of each head's dimensions that RoPE "
                                         "rotates (--rotary-percent; Hugging Face partial_rotary_factor; GLM-4.5: "
                                         "0.5). Default 1. Not with multiLatentAttention.")
    activation: Literal["gelu", "swiglu"] | None = Field(None, description="MLP activation. Default gelu "
                                                         "(swiglu renders --swiglu).")
    normalization: Literal["LayerNorm", "RMSNorm"] | None = Field(None, description="Normalization "
                                                                  "(--normalization). Default LayerNorm.")
    position_embedding: Literal["learned_absolute", "rope"] | None = Field(
        None, description="Position embedding (--position-embedding-type). Default learned_absolute.")
    rotary_base: int | None = Field(None, ge=1, le=100000000, description="RoPE base (--rotary-base). "
                                    "Default 10000.")
    untie_embeddings: bool | None = Field(None, description="Separate input embedding and output layer "
                                          "(--untie-embeddings-and-output-weights). Default false.")
    add_bias_linear: bool | None = Field(None, description="Biases in linear layers; false renders "
                                         "--disable-bias-linear. Default true.")
    norm_epsilon: float | None = Field(None, gt=0, lt=1, description="Epsilon of the RMSNorm/LayerNorm layers "
                                       "(--norm-epsilon; Hugging Face rms_norm_eps). Default 1e-5.")
    kv_channels: int | None = Field(None, ge=1, le=16384, description="Attention head dimension (--kv-channels; "
                                    "Hugging Face head_dim). Default hiddenSize / numAttentionHeads; set it for "
                                    "models whose heads are sized apart (Qwen3, Mistral-Nemo).")
    qk_layernorm: bool | None = Field(None, description="Normalise queries and keys per head (--qk-layernorm; "
                                      "Qwen3). Default false.")
    add_qkv_bias: bool | None = Field(None, description="Biases on the query/key/value projection only "
                                      "(--add-qkv-bias; Qwen2), also with addBiasLinear false. Default false.")
    rope_scaling_factor: float | None = Field(
        None, ge=1, le=1024, description="Llama 3.1-style RoPE frequency scaling with this factor (--use-rope-scaling "
        "--rope-scaling-factor; Llama 3.1: 8, Llama 3.2: 32). Low/high frequency factors 1 and 4 and the original "
        "context 8192 are fixed (the only kind Megatron-Core 0.19 implements). Needs positionEmbedding rope. "
        "Omit for no scaling.")
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after attention and MLP "
                                  "(--hidden-dropout). 0 for LLM pretraining (Megatron-LM's own default is 0.1).")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on attention probabilities "
                                     "(--attention-dropout).")


# --------------------------------------------------------------------------------------------
# spec.training
# --------------------------------------------------------------------------------------------


class LrSchedule(ApiModel):
    """Learning-rate schedule (Megatron's OptimizerParamScheduler)."""

    style: Literal["cosine", "linear", "constant", "WSD"] = Field("cosine", description="Decay style "
                                                                 "(--lr-decay-style).")
    warmup_iters: int = Field(0, ge=0, le=100000000, description="Linear warm-up iterations (--lr-warmup-iters).")
    decay_iters: int | None = Field(None, ge=1, le=100000000, description="Iterations over which the rate decays "
                                    "(--lr-decay-iters). Default: trainIters.")


class TrainingSpec(ApiModel):
    """Optimisation and numerics."""

    micro_batch_size: int = Field(1, ge=1, le=4096, description="Sequences per GPU per forward pass "
                                  "(--micro-batch-size).")
    global_batch_size: int | None = Field(None, ge=1, le=16777216, description="Sequences per optimizer step "
                                          "(--global-batch-size); a multiple of microBatchSize x data parallel. "
                                          "Default: microBatchSize x data parallel.")
    train_iters: int = Field(..., ge=1, le=1000000000, description="Optimizer steps to run (--train-iters).")
    lr: float = Field(3.0e-4, gt=0, le=10, description="Peak learning rate (--lr).")
    min_lr: float | None = Field(None, ge=0, le=10, description="Final learning rate (--min-lr). Default lr / 10.")
    lr_schedule: LrSchedule = Field(default_factory=LrSchedule, description="Warm-up and decay.")
    weight_decay: float = Field(0.1, ge=0, le=10, description="AdamW weight decay (--weight-decay).")
    clip_grad: float = Field(1.0, ge=0, le=1000, description="Gradient-norm clip (--clip-grad); 0 disables.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1 (--adam-beta1).")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="Adam beta2 (--adam-beta2).")
    precision: Literal["bf16", "fp16", "fp8"] = Field("bf16", description="Numerics: bf16, fp16, or fp8 (bf16 with "
                                                      "Transformer Engine fp8 GEMMs, hybrid format).")
    distributed_optimizer: bool = Field(True, description="Shard optimizer state over data-parallel ranks "
                                        "(--use-distributed-optimizer).")
    recompute: Literal["none", "selective", "full"] = Field("none", description="Activation recomputation: "
                                                            "selective recomputes attention, full every layer.")
    transformer_impl: Literal["transformer_engine", "local"] | None = Field(
        None, description="Layer implementation (--transformer-impl). Default: local (Megatron-Core's TE-free "
        "spec, this trainer's fastest measured path), or transformer_engine where only it runs the job (precision "
        "fp8, context > 1). local has no fp8 and no context parallelism; transformer_engine needs an image with "
        "Transformer Engine and CUDA (docs/trainer.md, \"Model paths\").")
    attention_backend: Literal["flash", "unfused"] = Field(
        "flash", description="Attention kernel (--attention-backend). flash: fused flash/cuDNN attention; "
        "unfused: materialises the s x s score matrix (Megatron's local attention with transformerImpl local).")
    cuda_graph: Literal["auto", "none", "fullIteration"] = Field(
        "auto", description="CUDA graphs (--cuda-graph-impl). auto: the trainer captures each step's forward "
        "and backward as one graph (full iteration) where that is verified - the TE-less path, pipeline 1, a "
        "dense model, pretraining data, no --overlap-param-gather - and runs eagerly elsewhere, logging why. "
        "none: always eager. fullIteration: always the graph (pipeline 1, dense models).")
    seed: int = Field(1234, ge=0, le=2147483647, description="Random seed (--seed).")
    log_interval: int = Field(10, ge=1, le=1000000, description="Iterations between log lines (--log-interval).")
    extra_args: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list, max_length=64, description="Extra Megatron-LM flags passed through verbatim. "
        "Flags the operator sets from this spec are refused.")


# --------------------------------------------------------------------------------------------
# spec.data / spec.checkpoint
# --------------------------------------------------------------------------------------------


class DataPath(ApiModel):
    """One dataset of a blend: a Megatron .bin/.idx prefix and its weight."""

    prefix: str = Field(..., min_length=1, max_length=512, pattern=REL_PATH, description="Path of the "
                        ".bin/.idx pair inside the data PVC, without the extension.")
    weight: float = Field(1.0, gt=0, le=1000000, description="Relative sampling weight in the blend.")


class Tokenizer(ApiModel):
    """A tokenizer that is read from the data PVC (never downloaded at run time)."""

    type: Literal["HuggingFace", "Null"] = Field("HuggingFace", description="HuggingFace: a local tokenizer "
                                                 "directory (tokenizer.json); Null: token ids are used as is.")
    path: str | None = Field(None, max_length=512, pattern=REL_PATH, description="Tokenizer directory inside "
                             "the data PVC (HuggingFace only).")


class SFTData(ApiModel):
    """Fine-tuning data (spec.data.format chat or promptCompletion): JSONL files in the data PVC; the loss
    is taken on the answers only (docs/sft.md)."""

    train: str = Field(..., min_length=1, max_length=512, pattern=REL_PATH, description="Training JSONL in "
                       "the data PVC. chat: {\"messages\": [{\"role\": \"system\"|\"user\"|\"assistant\", "
                       "\"content\": \"...\"}]} per line; promptCompletion: {\"prompt\": ..., "
                       "\"completion\": ...}.")
    valid: str | None = Field(None, max_length=512, pattern=REL_PATH, description="Validation JSONL in the data "
                              "PVC: its loss (answer tokens) goes to the log and status.progress.validationLoss.")
    packing: bool = Field(True, description="Pack several samples into each sequence, attention kept inside "
                          "each sample and positions restarting per sample (on the local path: Transformer "
                          "Engine's attention ignores the mask, so a packed job runs without it); false: one "
                          "sample per sequence, padded.")
    overflow: Literal["truncate", "drop"] = Field("truncate", description="A sample longer than seqLength + 1 "
                                                  "tokens: keep its beginning (dropped if no answer token is "
                                                  "left), or drop it. Counted in status.progress.data.")
    invalid_lines: Literal["error", "skip"] = Field("error", description="A malformed line (bad JSON, unknown "
                                                    "role, empty answer, a template error): fail the job with "
                                                    "its line number, or count and skip it.")
    chat_template: str | None = Field(None, max_length=512, pattern=REL_PATH, description="A Jinja chat "
                                      "template file in the data PVC instead of the tokenizer's own (chat only).")
    eval_interval: int | None = Field(None, ge=1, le=100000000, description="Iterations between validation "
                                      "losses (default: at the end only).")
    eval_iters: int = Field(4, ge=1, le=100000, description="Global batches of the validation set per "
                            "evaluation.")


class DataSpec(ApiModel):
    """Training data: ``mock: true``, or a PVC with Megatron .bin/.idx datasets (pretraining) or fine-tuning
    JSONL (format chat or promptCompletion, with sft). Exactly one."""

    mock: bool | None = Field(None, description="Synthetic tokens (no dataset needed).")
    pvc: str | None = Field(None, max_length=253, pattern=DNS_LABEL, description="PersistentVolumeClaim holding "
                            "the datasets, mounted read-only at /data.")
    paths: list[DataPath] | None = Field(None, min_length=1, max_length=64, description="Datasets to blend.")
    split: str = Field("969,30,1", max_length=64, pattern=r"^[0-9]+(\.[0-9]+)?(,[0-9]+(\.[0-9]+)?){0,2}$",
                       description="train,valid,test proportions (--split).")
    tokenizer: Tokenizer | None = Field(None, description="Tokenizer for real data. For fine-tuning data it "
                                        "may be left out when spec.init.huggingFace is set: its directory's "
                                        "tokenizer (and chat template) is used.")
    format: Literal["pretraining", "chat", "promptCompletion"] = Field(
        "pretraining", description="pretraining: mock or .bin/.idx paths; chat or promptCompletion: supervised "
        "fine-tuning from spec.data.sft.")
    sft: SFTData | None = Field(None, description="The fine-tuning files (format chat or promptCompletion).")


class CheckpointSpec(ApiModel):
    """Distributed (torch_dist) checkpoints on a PVC or in object storage; resume after any restart is automatic."""

    pvc: str | None = Field(None, max_length=253, pattern=DNS_LABEL, description="PersistentVolumeClaim for "
                            "checkpoints (ReadWriteMany: every pod writes its shards), mounted at /checkpoints. "
                            "Exactly one of pvc and objectStore.")
    object_store: blocks.object_store.ObjectStoreSpec | None = Field(None, description="An S3-compatible bucket instead of a PVC "
                                                 "(docs/object-storage.md). Exactly one of pvc and objectStore.")
    path: str | None = Field(None, max_length=512, pattern=REL_PATH, description="Directory inside the PVC. "
                             "Default: the MegatronJob's name. (With objectStore: objectStore.prefix.)")
    interval: int = Field(1000, ge=1, le=100000000, description="Iterations between checkpoints "
                          "(--save-interval).")
    async_: bool = Field(True, alias="async", description="Write shards in the background while training "
                         "continues (--async-save). CPU jobs (gpusPerNode: 0) always save synchronously: the "
                         "background writer needs CUDA.")
    keep: int = Field(3, ge=0, le=10000, description="Complete checkpoints to keep; older complete ones are "
                      "deleted (the newest is never deleted). 0 keeps all.")


class LoggingSpec(ApiModel):
    """What the trainer writes besides its log lines."""

    tensorboard: bool = Field(False, description="Write TensorBoard event files (Megatron-LM's scalar names: "
                              "lm loss, learning-rate, grad-norm, throughput, ...) to <checkpoint dir>/tensorboard "
                              "on the checkpoint PVC (--tensorboard-dir); needs spec.checkpoint.")
    wandb: blocks.wandb.WandbSpec | None = Field(None, description="Log the training scalars to Weights & Biases "
                                    "(docs/experiment-tracking.md).")


# --------------------------------------------------------------------------------------------
# spec.resources / restart / env
# --------------------------------------------------------------------------------------------


class Toleration(ApiModel):
    """A pod toleration (core/v1 Toleration)."""

    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63, pattern=LABEL_VALUE)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0, le=MAX_SAFE_INT, description="Seconds the pod "
                                           "stays bound after a NoExecute taint appears (at most 2^53-1).")


GpuType = Literal["A100-40GB", "A100-80GB", "H100-80GB", "H100-94GB", "H200", "B200", "L40S"]
assert set(GpuType.__args__) == set(GPU_MEMORY_GIB)  # type: ignore[attr-defined]


class Resources(ApiModel):
    """What each pod (one per node) asks for."""

    gpu_type: GpuType | None = Field(None, description="GPU model; gives the memory size for the fit check "
                                     "and the peak FLOP/s for MFU.")
    gpu_memory_gib: float | None = Field(None, alias="gpuMemoryGiB", gt=0, le=4096, description="GPU memory "
                                         "in GiB for the fit check (overrides gpuType).")
    memory_fit: Literal["Warn", "Reject", "Ignore"] = Field(
        "Warn", description="When the predicted peak GPU memory exceeds the GPU: Warn sets condition "
        "MemoryFit=False; Reject also refuses the job (InvalidSpec, no pods); Ignore skips the check.")
    efa_per_node: int = Field(0, ge=0, le=64, description="AWS EFA devices per pod (vpc.amazonaws.com/efa); "
                              "NCCL is configured for EFA when > 0.")
    cpu: Quantity | None = Field(None, description="CPU request and limit per pod.")
    memory: Quantity | None = Field(None, description="Memory request and limit per pod.")
    shm_size: Quantity | None = Field(None, description="Size of the memory-backed /dev/shm (NCCL, data "
                                      "loaders, async checkpoints). Default from the operator (8Gi per GPU, "
                                      "at least 16Gi; on a CPU job 1Gi per process).")
    node_selector: dict[Annotated[str, Field(max_length=316)], Annotated[str, Field(max_length=63,
                                                                                   pattern=LABEL_VALUE)]] = Field(
        default_factory=dict, max_length=32, description="Node labels the pods require.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Extra tolerations "
                                          "(the nvidia.com/gpu taint is always tolerated).")
    extended_resources: dict[Annotated[str, Field(max_length=253, pattern=RESOURCE_NAME)],
                             Annotated[int, Field(ge=0, le=1000000)]] = Field(
        default_factory=dict, max_length=16, description="Other extended resources per pod, e.g. RDMA devices "
        "(rdma/hca_shared_devices_a: 1).")


class RestartSpec(ApiModel):
    """Gang restarts: any failed pod restarts the whole JobSet, which resumes from the checkpoint."""

    max_restarts: int | None = Field(None, ge=0, le=10000, description="Gang restarts before the job is Failed. "
                                     "Default from the operator (3).")
    on_stall: bool = Field(False, description="Restart the whole gang from the last checkpoint when the job is "
                           "Stalled (no new iteration for the operator's stall timeout, 30 minutes by default). "
                           "Counted in status.stallRestarts, not against maxRestarts.")


class PodMetadata(ApiModel):
    """Extra labels and annotations for the trainer pods (e.g. for sidecars or monitoring)."""

    labels: dict[Annotated[str, Field(max_length=316)], Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]] = Field(
        default_factory=dict, max_length=32, description="Pod labels; the operator's and JobSet's own keys "
        "(megatron-operator.io/*, jobset.sigs.k8s.io/*, app.kubernetes.io/*) are refused.")
    annotations: dict[Annotated[str, Field(max_length=316)], Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=dict, max_length=32, description="Pod annotations.")


class MegatronJobSpec(ApiModel):
    """Desired state of a MegatronJob: one Megatron-Core pretraining run."""

    image: str | None = Field(None, max_length=512, description="Trainer image. Default from the operator.")
    image_pull_secrets: list[Annotated[str, Field(max_length=253, pattern=DNS_LABEL)]] = Field(
        default_factory=list, max_length=8, description="Names of image pull secrets.")
    num_nodes: int = Field(..., ge=1, le=4096, description="Pods, one per node.")
    gpus_per_node: int = Field(..., ge=0, le=16, description="GPUs per pod (nvidia.com/gpu); one trainer "
                               "process per GPU. 0: a CPU job (spec.cpu: its processes per pod), to smoke-test a "
                               "job before it takes GPUs.")
    cpu: blocks.cpu.CpuSpec | None = Field(None, description="A CPU job's processes per pod (with gpusPerNode: 0; "
                                           "default 1 process). docs/getting-started.md, \"Smoke-test a job on "
                                           "CPUs\".")
    parallelism: Parallelism = Field(default_factory=Parallelism, description="TP/PP/CP/EP sizes.")
    model: ModelSpec = Field(..., description="The model.")
    training: TrainingSpec = Field(..., description="Optimisation and numerics.")
    data: DataSpec = Field(default_factory=lambda: DataSpec(mock=True), description="Training data "
                           "(default: mock data).")
    checkpoint: CheckpointSpec | None = Field(None, description="Checkpoints; without them a restart "
                                              "starts from iteration 0.")
    init: blocks.hf.InitSpec | None = Field(None, description="Start from existing weights (a Hugging Face checkpoint) "
                                  "instead of a random initialisation.")
    export: blocks.hf.ExportSpec | None = Field(None, description="Export the trained model (as a Hugging Face "
                                      "checkpoint) when training finishes.")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="TensorBoard event files.")
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources and placement.")
    restart: RestartSpec = Field(default_factory=RestartSpec, description="Restart policy.")
    suspend: bool = Field(False, description="Suspend the job: pods are deleted, the job keeps its "
                          "checkpoint; set back to false to resume.")
    queue_name: str | None = Field(None, max_length=63, pattern=DNS_LABEL, description="Kueue LocalQueue; the "
                                   "JobSet starts suspended and Kueue admits it.")
    workload_priority_class: str | None = Field(
        None, max_length=63, pattern=DNS_LABEL, description="Kueue WorkloadPriorityClass of the job (the JobSet "
        "label kueue.x-k8s.io/priority-class): Kueue admits and preempts by it.")
    priority_class_name: str | None = Field(None, max_length=253, pattern=DNS_LABEL,
                                            description="PriorityClass of the pods.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment for the "
                              "trainer container.")
    pod_metadata: PodMetadata = Field(default_factory=PodMetadata, description="Extra pod labels and "
                                      "annotations.")
    pod: blocks.pod.PodSpecAdditions | None = Field(None, description="Extra volumes and their mounts in the trainer, init "
                                         "containers and sidecars, affinity and topology spread for every "
                                         "trainer pod, within the cluster's guardrails.")
    termination_grace_period_seconds: int | None = Field(
        None, ge=30, le=86400, description="Seconds between SIGTERM and SIGKILL; the trainer saves a checkpoint "
        "in that window. Default from the operator (600).")
    active_deadline_seconds: int | None = Field(None, ge=1, le=31536000, description="Fail the job (reason "
                                                "DeadlineExceeded) when it has run longer than this.")

    @property
    def processes_per_node(self) -> int:
        """Trainer processes (ranks) per pod: one per GPU, or spec.cpu.processesPerNode on a CPU job."""
        return blocks.cpu.processes_per_node(self.gpus_per_node, self.cpu)

    @property
    def on_cpu(self) -> bool:
        return self.gpus_per_node == 0

    @model_validator(mode="after")
    def _check_rules(self) -> MegatronJobSpec:
        problems = rules.evaluate_spec_rules(self.wire())
        if problems:
            raise PydanticCustomError(
                "megatron_rules", "{summary}",
                {"summary": "; ".join(p.message for p in problems), "problems": [p.as_dict() for p in problems]},
            )
        return self


# --------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------


class StatusModel(ApiModel):
    """Base of the status models: the operator builds them from wire strings (times), so lax."""

    model_config = ConfigDict(strict=False)


Phase = Literal["Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended"]


class Condition(StatusModel):
    """A metav1.Condition."""

    type: str = Field(..., max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(..., max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = Field(None, ge=0)


class StatusParallelism(StatusModel):
    """The layout as Megatron will see it."""

    data: int = Field(..., ge=1, description="Derived data-parallel size.")
    tensor: int = Field(..., ge=1)
    pipeline: int = Field(..., ge=1)
    context: int = Field(..., ge=1)
    expert: int = Field(..., ge=1)


class DataProgress(StatusModel):
    """What the trainer made of fine-tuning (SFT) data: counted, never silently lost."""

    lines: int | None = Field(None, ge=0, description="Non-blank lines of the training file.")
    used: int | None = Field(None, ge=0, description="Samples trained on.")
    skipped: int | None = Field(None, ge=0, description="Invalid lines skipped (spec.data.sft.invalidLines: skip).")
    truncated: int | None = Field(None, ge=0, description="Samples cut to the sequence length (overflow: truncate).")
    dropped_too_long: int | None = Field(None, ge=0, description="Samples dropped as longer than the sequence "
                                         "(overflow: drop, or no answer token left after truncation).")
    samples: int | None = Field(None, ge=0, description="Training sequences (after packing).")
    packing_efficiency: float | None = Field(None, ge=0, le=1, description="Real tokens / all positions (1 - "
                                             "padding waste).")
    loss_tokens: int | None = Field(None, ge=0, description="Answer tokens the loss is taken on (one pass).")


class Goodput(StatusModel):
    """Where the job's time went, over all its attempts (the trainer's goodput ledger; docs/operations.md,
    "Goodput"): from its first trainer process's start, less the time it was stopped cleanly (suspended,
    preempted), in seconds."""

    ratio: float | None = Field(None, ge=0, le=1, description="productiveSeconds / wallSeconds.")
    wall_seconds: float | None = Field(None, ge=0)
    productive_seconds: float | None = Field(None, ge=0, description="Training steps the job keeps.")
    startup_seconds: float | None = Field(None, ge=0, description="Process start -> first iteration, every attempt.")
    save_blocked_seconds: float | None = Field(None, ge=0, description="The loop held by checkpoint saves.")
    lost_seconds: float | None = Field(None, ge=0, description="Iterations redone after a failure.")
    restart_seconds: float | None = Field(None, ge=0, description="A failed attempt's last report -> the next "
                                          "attempt's start.")
    other_seconds: float | None = Field(None, ge=0)
    attempts: int | None = Field(None, ge=1)


class Progress(StatusModel):
    """Written by the trainer (field manager megatron-trainer); the operator only reads it."""

    iteration: int | None = Field(None, ge=0, description="Completed iterations.")
    train_iters: int | None = Field(None, ge=0)
    loss: float | None = Field(None, description="Last logged language-model loss.")
    tokens_per_second: float | None = Field(None, ge=0, description="Whole-job throughput.")
    tflops_per_gpu: float | None = Field(None, ge=0)
    mfu: float | None = Field(None, ge=0, description="Model FLOPs utilisation (fraction of peak).")
    last_checkpoint_iteration: int | None = Field(None, ge=0)
    validation_loss: float | None = Field(None, description="Last validation loss (SFT with a validation file).")
    data: DataProgress | None = None
    goodput: Goodput | None = None
    save_warning: str | None = Field(None, max_length=1024, description="Saves come faster than one is written "
                                     "(the loop waits: the interval that works), or the checkpoint volume cannot "
                                     "hold keep + 1 checkpoints.")
    last_save_blocked_seconds: float | None = Field(None, ge=0, description="The loop held by the last save.")
    last_save_seconds: float | None = Field(None, ge=0, description="The last published save, start to published.")
    stage: str | None = Field(None, max_length=256, description="What the trainer is doing: initialising, "
                              "building the model, building the optimizer, starting the checkpoint writer, "
                              "loading checkpoint N, building the data index, running the first iteration, "
                              "capturing the CUDA graph, training.")
    update_time: datetime | None = None


class MemoryEstimate(StatusModel):
    """Predicted peak GPU memory (``megatron-operator estimate``)."""

    per_gpu_gib: float = Field(..., alias="perGpuGiB", ge=0)
    capacity_gib: float | None = Field(None, alias="capacityGiB", ge=0)
    fits: bool | None = None


class LastFailure(StatusModel):
    """The latest trainer pod that failed; kept after the gang is recreated (docs/troubleshooting.md)."""

    pod: str = Field(..., max_length=253)
    node: str | None = Field(None, max_length=253)
    exit_code: int | None = Field(None, description="The trainer container's exit code (docs/trainer-contract.md, "
                                  "\"Exit codes\"; 128 + N: killed by signal N).")
    reason: str | None = Field(None, max_length=1024, description="The container's terminated reason: Error, "
                               "OOMKilled, ...")
    retriable: bool = Field(True, description="False: the exit code ends the job without a restart.")
    message: str | None = Field(None, max_length=4096, description="The trainer's fatal error, or the last lines "
                                "it printed (terminationMessagePolicy FallbackToLogsOnError).")
    time: datetime | None = None
    restart_attempt: int | None = Field(None, ge=0, description="The gang restart the pod belonged to.")
    disruption: str | None = Field(None, max_length=1024, description="The pod's DisruptionTarget condition "
                                   "(reason: message) when it was evicted, preempted or lost its node: such a "
                                   "restart does not count against restart.maxRestarts.")


#: status.avoidedNodes keeps the latest this many nodes.
MAX_AVOIDED_NODES = 16


class AvoidedNode(StatusModel):
    """A node a failure of this job was blamed on: later attempts are not scheduled there."""

    node: str = Field(..., max_length=253)
    reason: str = Field(..., max_length=1024, description="Why the node is blamed (exit code 6: a GPU fault the "
                        "trainer detected; an NCCL error naming a pod on this node as its peer; a NoExecute "
                        "taint eviction; the node deleted).")
    time: datetime | None = None


class MegatronJobStatus(StatusModel):
    """Observed state, derived from the JobSet and its pods."""

    phase: Phase | None = None
    reason: str | None = Field(None, max_length=1024)
    message: str | None = Field(None, max_length=32768)
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    observed_generation: int | None = Field(None, ge=0)
    parallelism: StatusParallelism | None = None
    world_size: int | None = Field(None, ge=1, description="GPUs in the job.")
    layout: str | None = Field(None, max_length=64, description="TP/PP/DP for kubectl get.")
    job_set_name: str | None = Field(None, max_length=63)
    restarts: int = Field(0, ge=0)
    disruptions: int = Field(0, ge=0, description="Gang restarts caused by evictions, preemptions or lost nodes "
                             "(JobSet's restarts not counted towards maxRestarts).")
    stall_restarts: int | None = Field(None, ge=0, description="Gang restarts the operator made because the job "
                                       "was Stalled (spec.restart.onStall).")
    progress: Progress | None = None
    last_progress_iteration: int | None = Field(None, ge=0, description="The iteration the operator last saw "
                                                "advance (for the Stalled condition).")
    last_progress_time: datetime | None = Field(None, description="When the operator saw it advance.")
    memory: MemoryEstimate | None = None
    last_failure: LastFailure | None = None
    avoided_nodes: list[AvoidedNode] | None = Field(
        None, max_length=MAX_AVOIDED_NODES, description="Nodes failures of this job were blamed on, latest last: "
        "the operator recreates the JobSet with a node affinity that excludes them (the job resumes from its "
        "last checkpoint).")
    start_time: datetime | None = None
    completion_time: datetime | None = None


class ObjectMeta(BaseModel):
    """The metadata a manifest may carry (validated for the CLI; the API server owns the rest)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1, max_length=MAX_NAME_LENGTH, pattern=RFC1035_LABEL)
    namespace: str | None = Field(None, max_length=63, pattern=DNS_LABEL)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: str | None = None
    generation: int | None = None


class MegatronJob(BaseModel):
    """A MegatronJob manifest."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["megatron-operator.io/v1alpha1"] = Field(..., alias="apiVersion")
    kind: Literal["MegatronJob"]
    metadata: ObjectMeta
    spec: MegatronJobSpec

    @model_validator(mode="after")
    def _check_object_rules(self) -> MegatronJob:
        from .rules import evaluate_object_rules

        problems = evaluate_object_rules({"metadata": {"name": self.metadata.name}, "spec": self.spec.wire()})
        if problems:
            raise PydanticCustomError(
                "megatron_rules", "{summary}",
                {"summary": "; ".join(p.message for p in problems), "problems": [p.as_dict() for p in problems]},
            )
        return self
    status: MegatronJobStatus | None = None
