"""Admission rules: what Megatron checks at start-up, checked when the MegatronJob is applied.

Each rule is written once in the ``expr`` language and used twice: evaluated in Python by the
pydantic models (operator and CLI) and emitted as a CEL rule on ``spec`` in the CRD (API server,
so ``kubectl apply`` and Argo CD show the message). Messages name the field path, the numbers and a
fix. Upstream references are to megatron-core 0.19.2 (``megatron/core/...``) and Megatron-LM's
``megatron/training/arguments.py`` (ARGS).

``self`` is ``spec`` after API-server defaulting (every field with a default is present).

Here: the core's rules (parallelism, model, training, data, env, resources, pod metadata), written in the shared
values of ``vocab/values.py``. A spec block with a room of its own (``blocks/``) brings its rules; they are
collected after the core's, in the CRD's order.
"""

from __future__ import annotations

from typing import Any

from . import blocks
from .expr import (
    All,
    At,
    Attr,
    Expr,
    Field,
    Filter,
    Has,
    In,
    Index,
    LastIndexOf,
    Matches,
    Missing,
    Size,
    Var,
    cond,
    fmt,
    lit,
)
from .names import (
    MAX_NAME_LENGTH,
    RFC1035_LABEL,
)
from .trainer_flags import SWITCH_FLAGS, VALUE_FLAGS, VALUE_TYPES
from .vocab.patterns import GPU_DEVICE_ENV, QUALIFIED_NAME_RE
from .vocab.rule import (
    Problem,
    Rule,
    all_of,
    any_of,
    multiple_hint,
    qualified_keys_rule,
)
from .vocab.values import (
    MODEL_VALUES,
    add_bias_linear,
    cp,
    dp,
    ep,
    etp,
    experts,
    f,
    gbs,
    gpn,
    groups,
    has,
    heads,
    hidden,
    impl,
    layers,
    layout_ok,
    max_positions,
    mbs,
    microbatches,
    mla,
    model_complete,
    model_parallel,
    moe_balancing,
    moe_expert_bias,
    moe_ffn,
    moe_layer_freq,
    moe_pad_to_capacity,
    moe_pre_softmax,
    moe_router_group_topk,
    moe_router_num_groups,
    moe_score_function,
    moe_shared_ffn,
    moe_shared_gate,
    nodes,
    on_cpu,
    opt,
    position_embedding,
    pp,
    precision,
    rope_type,
    seq,
    sequence_parallel,
    topk,
    tp,
    uses_te,
    vocab,
    world,
)

#: spec.model's MoE fields besides numExperts and moeRouterTopk (which has its own rule, topk-within-experts).
MOE_FIELDS = ("moeFfnHiddenSize", "moeRouterPreSoftmax", "moeRouterLoadBalancingType", "moeAuxLossCoeff",
              "moeZLossCoeff", "moeRouterDtype", "moeTokenDispatcherType", "moeSharedExpertIntermediateSize",
              "moeSharedExpertGate", "moeRouterScoreFunction", "moeRouterEnableExpertBias", "moeRouterBiasUpdateRate",
              "moeExpertCapacityFactor", "moeTokenDropPolicy", "moePadExpertInputToCapacity", "moeLayerFreq",
              "moeRouterNumGroups", "moeRouterGroupTopk", "moeRouterTopkScalingFactor")
#: spec.model's multi-head latent attention fields besides multiLatentAttention (read only with it).
MLA_FIELDS = ("qLoraRank", "kvLoraRank", "qkHeadDim", "qkPosEmbHeadDim", "vHeadDim", "ropeType", "rotaryScalingFactor",
              "originalMaxPositionEmbeddings", "betaFast", "betaSlow", "mscale", "mscaleAllDim")
#: YaRN's fields (MLA's rotary embedding with ropeType yarn; ropeType rope reads none of them).
YARN_FIELDS = ("rotaryScalingFactor", "originalMaxPositionEmbeddings", "betaFast", "betaSlow", "mscale", "mscaleAllDim")

# Flags the operator renders from the spec (tests/test_contract.py checks this list against the
# rendering of every example and contract case); extraArgs must not contradict them.
RENDERED_FLAGS: tuple[str, ...] = (
    "tensor-model-parallel-size", "pipeline-model-parallel-size", "num-virtual-stages-per-pipeline-rank",
    "context-parallel-size", "expert-model-parallel-size", "expert-tensor-parallel-size", "sequence-parallel",
    "sequence-parallel-auto",
    "num-layers", "hidden-size", "num-attention-heads", "group-query-attention", "num-query-groups",
    "ffn-hidden-size", "seq-length", "max-position-embeddings", "vocab-size", "num-experts",
    "moe-router-topk", "moe-ffn-hidden-size", "moe-router-pre-softmax", "moe-router-load-balancing-type",
    "moe-aux-loss-coeff", "moe-z-loss-coeff", "moe-router-dtype", "moe-token-dispatcher-type",
    "moe-shared-expert-intermediate-size", "moe-shared-expert-gate", "moe-router-score-function",
    "moe-router-enable-expert-bias",
    "moe-router-bias-update-rate", "moe-expert-capacity-factor", "moe-token-drop-policy",
    "moe-pad-expert-input-to-capacity", "moe-layer-freq", "moe-router-num-groups", "moe-router-group-topk",
    "moe-router-topk-scaling-factor", "multi-latent-attention", "q-lora-rank", "kv-lora-rank", "qk-head-dim",
    "qk-pos-emb-head-dim", "v-head-dim", "rope-type", "rotary-scaling-factor", "original-max-position-embeddings",
    "beta-fast", "beta-slow", "mscale", "mscale-all-dim", "rotary-percent", "swiglu", "normalization", "position-embedding-type", "rotary-base",
    "untie-embeddings-and-output-weights", "disable-bias-linear", "norm-epsilon", "kv-channels", "qk-layernorm",
    "add-qkv-bias", "use-rope-scaling", "rope-scaling-factor", "hidden-dropout", "attention-dropout",
    "transformer-impl", "device", "attention-backend", "cuda-graph-impl",
    "micro-batch-size", "global-batch-size", "train-iters", "lr", "min-lr", "lr-decay-style",
    "lr-warmup-iters", "lr-decay-iters", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "bf16",
    "fp16", "fp8-format", "use-distributed-optimizer", "recompute-granularity", "recompute-method",
    "recompute-num-layers", "seed", "log-interval", "eval-iters", "mock-data", "data-path", "split",
    "tokenizer-type", "tokenizer-model", "data-cache-path", "save", "load", "save-interval", "ckpt-format",
    "async-save", "use-persistent-ckpt-worker", "exit-signal-handler", "tensorboard-dir", "hf-init", "hf-export",
    "data-format", "sft-train-path", "sft-valid-path", "sft-packing", "no-sft-packing", "sft-overflow",
    "sft-invalid-lines", "chat-template", "eval-interval", "object-store-endpoint", "object-store-region",
    "wandb-project", "wandb-entity", "wandb-exp-name", "wandb-save-dir", "wandb-mode", "wandb-api-key-file",
)
# Other spellings of rendered values (Megatron-LM's older VPP flags) and what the launcher sets.
ALIAS_FLAGS: tuple[str, ...] = (
    "num-layers-per-virtual-pipeline-stage", "virtual-pipeline-model-parallel-size", "world-size", "rank",
    "local-rank",
)
# Trainer commands that are not a training job's flags: --hf-export-only exports a finished job's
# checkpoint (`python -m megatron_trainer <job flags> --hf-export-only`); in extraArgs it would turn the
# job into an export that never trains.
COMMAND_FLAGS: tuple[str, ...] = ("hf-export-only",)
MANAGED_FLAGS: tuple[str, ...] = RENDERED_FLAGS + ALIAS_FLAGS + COMMAND_FLAGS
MANAGED_FLAG_RE = r"^--(" + "|".join(fl.replace(".", r"\.") for fl in MANAGED_FLAGS) + r")(=.*)?$"
# The trainer's own flag table (trainer_flags.py, generated from its parser): an extraArgs item that
# starts with "-" must be one of them, spelled out (the trainer refuses abbreviations; --help is not
# in the table: it would exit 0 and the job would be Succeeded without training). Items that do not
# start with "-", or are negative numbers, are values.
KNOWN_FLAG_RE = (r"^--(" + "|".join(VALUE_FLAGS) + r")(=.*)?$|^--(" + "|".join(SWITCH_FLAGS) + r")$|^[^-]|^-[0-9.]|"
                 r"[\s\x00-\x1f\x7f]")  # (whitespace: extra-args-one-token reports it)

# What each extraArgs value flag takes, as the trainer's parser converts it (trainer_flags.VALUE_TYPES), with
# the bounds the trainer checks at start-up on top (config.validate, tensorboard.TensorBoardWriter): each as
# (what "--flag=VALUE" may say, what a separate "--flag", "VALUE" may say: argparse takes an item that starts
# with "-" for a value only when it looks like a negative number, ^-\d+$|^-\d*\.\d+$).
_NEG = r"-[0-9]+|-[0-9]*\.[0-9]+"
_FLOAT = r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"
VALUE_BOUNDS = {"cuda-graph-warmup-steps": 1, "distributed-timeout-minutes": 1, "dist-ckpt-workers": 1,
                "tensorboard-log-interval": 1, "manual-gc-interval": 0}


def _value_patterns(flag: str) -> tuple[str, str]:
    kind = VALUE_TYPES[flag]
    if flag in VALUE_BOUNDS:
        n = r"\+?[0-9]+" if VALUE_BOUNDS[flag] == 0 else r"\+?0*[1-9][0-9]*"
        return n, n
    if isinstance(kind, tuple):
        one_of = "|".join(c.replace(".", r"\.") for c in kind)
        return one_of, one_of
    if kind == "int":
        return r"[-+]?[0-9]+", r"\+?[0-9]+|-[0-9]+"
    if kind == "float":
        return rf"[-+]?{_FLOAT}", rf"\+?{_FLOAT}|{_NEG}"
    return r".*", rf"|[^-].*|{_NEG}"


# The value flags extraArgs may set (the others are rendered from the spec: extra-args-not-managed).
EXTRA_VALUE_FLAGS = tuple(fl for fl in VALUE_FLAGS if fl not in MANAGED_FLAGS)
EXTRA_VALUE_EQ_RE = "^--(" + "|".join(EXTRA_VALUE_FLAGS) + ")="
EXTRA_VALUE_EQ_OK_RE = "^--(" + "|".join(f"{fl}=({_value_patterns(fl)[0]})" for fl in EXTRA_VALUE_FLAGS) + ")$"


def _describe_extra_values() -> str:
    groups: dict[str, list[str]] = {}
    for fl in EXTRA_VALUE_FLAGS:
        kind = VALUE_TYPES[fl]
        what = (f"an integer >= {VALUE_BOUNDS[fl]}" if fl in VALUE_BOUNDS else
                f"one of {', '.join(kind)}" if isinstance(kind, tuple) else
                {"int": "an integer", "float": "a number"}.get(kind, "text"))
        groups.setdefault(what, []).append(f"--{fl}")
    return "; ".join(f"{what}: {', '.join(flags)}" for what, flags in groups.items())


# Environment the operator sets in the trainer container; spec.env may not override it.
# The device plugin decides which GPUs a container sees: NVIDIA_VISIBLE_DEVICES=all (the CUDA images'
# default, if set by the user) would show a pod every GPU of its node (GPU_DEVICE_ENV: every variable of the NVIDIA
# container runtime's that chooses devices or driver capabilities; spec.pod's containers are refused them too). torchrun sets its own
# rendezvous variables (PET_* are its flags as environment, TORCHELASTIC_* its agent's state).
RESERVED_ENV: tuple[str, ...] = (
    "NODE_RANK", "CUDA_DEVICE_MAX_CONNECTIONS", "HOME", "PYTHONUNBUFFERED", "FI_PROVIDER",
    "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
    "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "ROLE_NAME", *GPU_DEVICE_ENV,
    # object storage (objstore.py): the credentials file the operator mounts, the MSC config the trainer writes
    "AWS_SHARED_CREDENTIALS_FILE", "MSC_CONFIG",
)
RESERVED_ENV_RE = r"^(MEGATRON_.*|PET_.*|TORCHELASTIC_.*|" + "|".join(RESERVED_ENV) + r")$"
# Resources the spec sets through its own fields (GPUs, EFA, cpu, memory), and the kubernetes.io
# namespace (unprefixed names such as ephemeral-storage and hugepages-2Mi are in it): an entry in
# extendedResources would override them (nvidia.com/gpu: 0 with NVIDIA_VISIBLE_DEVICES=all).
RESERVED_RESOURCE_RE = (r"^([^/]*|([^/]*\.)?kubernetes\.io/.*|nvidia\.com/(gpu|mig-).*|amd\.com/gpu|"
                        r"vpc\.amazonaws\.com/efa)$")
# Pod label keys the operator and JobSet set themselves.
# Also the Job controller's own (job-name, controller-uid: a pod carrying them joins another Job's
# selector) and Kueue's; case variants too (the API server compares keys exactly, people do not).
RESERVED_LABEL_RE = (r"(?i)^(megatron-operator\.io/|jobset\.sigs\.k8s\.io/|app\.kubernetes\.io/|"
                     r"batch\.kubernetes\.io/|kueue\.x-k8s\.io/|job-name$|controller-uid$)")
# One replicated job per tensor-parallel group when a group spans pods (render.replicated_job_plan):
# each costs about 4.3 kB of the JobSet, and etcd stores at most 1.5 MiB per object.
MAX_TP_GROUP_JOBS = 256


# --------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------


extra_args = f("training.extraArgs")


def _given(flag: str) -> Expr:
    return Size(Filter(extra_args, "x", Var("x").eq(flag))) > 0


def _separate_value_ok(flag: str) -> Expr:
    """``--flag`` given at most once as its own item, and then followed by a value of its type (argparse takes
    the last; every "--flag=VALUE" is checked apart)."""
    last = LastIndexOf(extra_args, lit(f"--{flag}"))
    once = Size(Filter(extra_args, "x", Var("x").eq(f"--{flag}"))) <= 1
    return once & ((last < 0) | ((last + 1 < Size(extra_args))
                                 & Matches(At(extra_args, last + 1), f"^({_value_patterns(flag)[1]})$")))


_gc_last = LastIndexOf(extra_args, lit("--manual-gc-interval"))
_manual_gc_interval_set = (
    (Size(Filter(extra_args, "x", Matches(Var("x"), r"^--manual-gc-interval=\+?0*[1-9][0-9]*$"))) > 0)
    | ((_gc_last >= 0) & (_gc_last + 1 < Size(extra_args))
       & Matches(At(extra_args, _gc_last + 1), r"^\+?0*[1-9][0-9]*$")))

SPEC_RULES: list[Rule] = [
    Rule("model-complete", "model",
         model_complete,
         fmt("spec.model: missing", cond(layers > 0, "", " numLayers"), cond(hidden > 0, "", " hiddenSize"),
              cond(heads > 0, "", " numAttentionHeads"), cond(seq > 0, "", " seqLength"),
              cond(vocab > 0, "", " vocabSize"),
              "; set them, or choose spec.model.preset (e.g. gpt-7.5b or llama3-8b)")),
    # parallel_state.initialize_model_parallel; arguments.validate_args
    Rule("world-divisible", "numNodes",
         layout_ok,
         fmt(cond(on_cpu, "spec.numNodes x spec.cpu.processesPerNode: ", "spec.numNodes x spec.gpusPerNode: "),
             world.str(), cond(on_cpu, " processes", " GPUs"), " are not divisible by tensor x pipeline x "
              "context = ", tp.str(), " x ", pp.str(), " x ", cp.str(), " = ", model_parallel.str(),
              "; use a multiple of ", model_parallel.str(), cond(on_cpu, " processes", " GPUs"),
              multiple_hint(world, model_parallel), ", or smaller parallel sizes")),
    # parallel_state.initialize_model_parallel (expert grid; "MoE parallel folding")
    # (for a dense model this is implied by world-divisible, so it is only checked with experts)
    Rule("expert-grid", "parallelism.expert",
         (world % (etp * ep * pp)).eq(0), when=(ep > 1) | has("parallelism.expertTensor"),
         message=fmt("spec.parallelism.expert: expert x expertTensor x pipeline = ", ep.str(), " x ", etp.str(), " x ",
              pp.str(), " = ", (etp * ep * pp).str(), " does not divide the ", world.str(),
              " GPUs; choose expert and expertTensor so that their product divides GPUs / pipeline = ",
              (world // pp).str())),
    # ours: a tensor-parallel group must fit on one host (TP groups are consecutive ranks)
    Rule("tensor-placement", "parallelism.tensor",
         (gpn % tp).eq(0) | (tp % gpn).eq(0),
         fmt("spec.parallelism.tensor: ", tp.str(), cond(on_cpu, " must divide spec.cpu.processesPerNode ",
                                                          " must divide spec.gpusPerNode "), gpn.str(),
              " or be a multiple of it, so that each tensor-parallel group sits on whole nodes; use a tensor "
              "size such as ", cond((gpn % 2).eq(0), (gpn // 2).str(), gpn.str()), " or ", gpn.str())),
    # TransformerConfig.__post_init__
    Rule("heads-divisible-by-tensor", "model.numAttentionHeads",
         (heads % tp).eq(0), when=model_complete,
         message=fmt("spec.model.numAttentionHeads: ", heads.str(), " heads are not divisible by "
                      "spec.parallelism.tensor ", tp.str(), "; use a tensor size that divides ", heads.str())),
    # arguments.validate_args (kv_channels = hidden / heads, unless given)
    Rule("hidden-divisible-by-heads", "model.hiddenSize",
         (hidden % heads).eq(0), when=model_complete & ~has("model.kvChannels"),
         message=fmt("spec.model.hiddenSize: ", hidden.str(), " is not divisible by numAttentionHeads ",
                      heads.str(), "; use a multiple of ", heads.str(), multiple_hint(hidden, heads),
                      ", or give the head dimension as kvChannels")),
    # RotaryEmbedding(rope_scaling=...) is only built for rope (gpt_model.py); arguments.validate_args
    Rule("rope-scaling-needs-rope", "model.ropeScalingFactor",
         position_embedding.eq("rope"), when=has("model.ropeScalingFactor"),
         message=fmt("spec.model.ropeScalingFactor: RoPE scaling needs positionEmbedding rope (it is ",
                     position_embedding, "); set positionEmbedding: rope or omit ropeScalingFactor")),
    # attention.py (heads per query group)
    Rule("heads-divisible-by-groups", "model.numQueryGroups",
         (heads % groups).eq(0), when=model_complete,
         message=fmt("spec.model.numQueryGroups: ", groups.str(), " does not divide numAttentionHeads ",
                      heads.str(), "; use a divisor of ", heads.str())),
    # TransformerConfig.__post_init__
    Rule("groups-vs-tensor", "model.numQueryGroups",
         (groups % tp).eq(0) | (tp % groups).eq(0), when=model_complete,
         message=fmt("spec.model.numQueryGroups: ", groups.str(), " query groups must be a multiple or a "
                      "divisor of spec.parallelism.tensor ", tp.str(), "; change one of them")),
    # transformer_block.get_num_layers_to_build; arguments.validate_args
    Rule("layers-divisible-by-pipeline", "model.numLayers",
         (layers % pp).eq(0), when=model_complete,
         message=fmt("spec.model.numLayers: ", layers.str(), " layers do not split evenly over "
                      "spec.parallelism.pipeline ", pp.str(), " stages; use a pipeline size that divides ",
                      layers.str(), ", or a multiple of ", pp.str(), " layers", multiple_hint(layers, pp))),
    # parallel_state.initialize_model_parallel; arguments.validate_args (overlap-p2p on, Megatron-LM's default)
    Rule("virtual-needs-pipeline", "parallelism.virtualPipeline",
         pp > 1, when=has("parallelism.virtualPipeline"),
         message=fmt("spec.parallelism.virtualPipeline: the interleaved schedule needs "
                      "spec.parallelism.pipeline > 1 (it is ", pp.str(), "); omit virtualPipeline or raise "
                      "pipeline")),
    # transformer_block.get_num_layers_to_build; arguments.validate_args
    Rule("layers-divisible-by-virtual", "parallelism.virtualPipeline",
         ((layers // pp) % f("parallelism.virtualPipeline")).eq(0),
         when=has("parallelism.virtualPipeline") & model_complete & (pp > 1) & (layers % pp).eq(0),
         message=fmt("spec.parallelism.virtualPipeline: ", layers.str(), " layers / ", pp.str(),
                      " pipeline stages = ", (layers // pp).str(), " layers per stage are not divisible by ",
                      f("parallelism.virtualPipeline").str(), " virtual stages; use a divisor of ",
                      (layers // pp).str())),
    # ConstantNumMicroBatchesCalculator.__init__
    Rule("global-batch-divisible", "training.globalBatchSize",
         (gbs % (mbs * dp)).eq(0), when=layout_ok,
         message=fmt("spec.training.globalBatchSize: ", gbs.str(), " is not divisible by microBatchSize ",
                      mbs.str(), " x data parallel ", dp.str(), " = ", (mbs * dp).str(), "; use a multiple of ",
                      (mbs * dp).str(), multiple_hint(gbs, mbs * dp))),
    # schedules.forward_backward_pipelining_with_interleaving (microbatch_group_size_per_vp_stage = PP)
    Rule("virtual-microbatches", "training.globalBatchSize",
         (microbatches % pp).eq(0),
         when=has("parallelism.virtualPipeline") & layout_ok & (gbs % (mbs * dp)).eq(0),
         message=fmt("spec.training.globalBatchSize: the interleaved schedule needs the number of "
                      "micro-batches (", gbs.str(), " / (", mbs.str(), " x ", dp.str(), ") = ",
                      microbatches.str(), ") to be a multiple of spec.parallelism.pipeline ", pp.str(),
                      "; use a global batch size that is a multiple of ", (mbs * dp * pp).str(),
                      multiple_hint(gbs, mbs * dp * pp))),
    # arguments.validate_args (load-balanced causal split)
    Rule("context-divides-sequence", "model.seqLength",
         (seq % (cp * 2)).eq(0), when=(cp > 1) & model_complete,
         message=fmt("spec.model.seqLength: ", seq.str(), " is not divisible by 2 x spec.parallelism.context = ",
                      (cp * 2).str(), "; use a multiple of ", (cp * 2).str(), multiple_hint(seq, cp * 2))),
    # arguments.validate_args
    Rule("positions-cover-sequence", "model.maxPositionEmbeddings",
         max_positions >= seq, when=model_complete,
         message=fmt("spec.model.maxPositionEmbeddings: ", max_positions.str(), " is smaller than seqLength ",
                      seq.str(), "; set it to at least ", seq.str(), " (or omit it: it defaults to seqLength)")),
    # TransformerConfig.__post_init__; BaseMoELayer.__init__; arguments.validate_args
    Rule("experts-for-expert-parallel", "model.numExperts",
         experts > 0, when=ep > 1,
         message=fmt("spec.model.numExperts: spec.parallelism.expert is ", ep.str(), " but the model has no "
                      "experts; set numExperts (a multiple of ", ep.str(), ") or expert: 1")),
    Rule("experts-divisible", "model.numExperts",
         (experts % ep).eq(0), when=experts > 0,
         message=fmt("spec.model.numExperts: ", experts.str(), " experts are not divisible by "
                      "spec.parallelism.expert ", ep.str(), "; use a multiple of ", ep.str(),
                      multiple_hint(experts, ep))),
    Rule("topk-within-experts", "model.moeRouterTopk",
         (topk <= experts) & (experts > 0), when=has("model.moeRouterTopk"),
         message=fmt("spec.model.moeRouterTopk: ", topk.str(), " needs a mixture-of-experts model with at least ",
                      topk.str(), " experts (numExperts is ", experts.str(), ")")),
    # ours: the router's flags are rendered only for a MoE model (the trainer would only note them as ignored)
    Rule("moe-fields-need-experts", "model",
         experts > 0, when=any_of(has(f"model.{name}") for name in MOE_FIELDS),
         message=fmt("spec.model:", *[cond(has(f"model.{name}"), f" {name}", "") for name in MOE_FIELDS],
                     " apply to a mixture-of-experts model only; set numExperts or omit them")),
    # transformer_config.py (TransformerConfig.__post_init__: a softmax over one logit has a zero gradient)
    Rule("moe-topk-1-needs-pre-softmax", "model.moeRouterPreSoftmax",
         moe_pre_softmax, when=(experts > 0) & topk.eq(1) & moe_score_function.eq("softmax"),
         message=lit("spec.model.moeRouterPreSoftmax: moeRouterTopk 1 needs moeRouterPreSoftmax: true (a softmax "
                     "over the one chosen logit would give the router no gradient); set moeRouterPreSoftmax: true "
                     "or a moeRouterTopk above 1")),
    # experts' linear layers (each expert's MLP is split over the expert tensor-parallel ranks)
    Rule("moe-ffn-divisible-by-expert-tensor", "model.moeFfnHiddenSize",
         (moe_ffn % etp).eq(0), when=experts > 0,
         message=fmt("spec.model.moeFfnHiddenSize: the experts' hidden size ", moe_ffn.str(), " (default "
                     "ffnHiddenSize) is not divisible by the expert tensor-parallel size ", etp.str(),
                     " (spec.parallelism.expertTensor, default tensor); use a multiple of ", etp.str(),
                     multiple_hint(moe_ffn, etp), ", or a smaller expertTensor")),
    # transformer_config.py (TransformerConfig.__post_init__: "Bias in Moe is only supported when ETP==1")
    Rule("moe-bias-needs-expert-tensor-1", "model.addBiasLinear",
         etp.eq(1), when=(experts > 0) & add_bias_linear,
         message=fmt("spec.model.addBiasLinear: a mixture-of-experts model with linear biases needs an expert "
                     "tensor-parallel size of 1 (it is ", etp.str(), ": spec.parallelism.expertTensor, default "
                     "tensor); set addBiasLinear: false or spec.parallelism.expertTensor: 1")),
    # moe_layer.py (MoELayer.forward): the trainer turns sequence parallelism on for MoE at TP > 1, an explicit
    # false would be ignored
    Rule("moe-tensor-needs-sequence-parallel", "parallelism.sequenceParallel",
         f("parallelism.sequenceParallel"), when=(experts > 0) & (tp > 1) & has("parallelism.sequenceParallel"),
         message=fmt("spec.parallelism.sequenceParallel: a mixture-of-experts model at tensor ", tp.str(),
                     " trains only with sequence parallelism (megatron-core's MoE layer), which the trainer turns "
                     "on; omit sequenceParallel or set it true")),
    # router.py: with load balancing off the aux loss is not computed, its weight would be ignored
    Rule("moe-aux-loss-needs-balancing", "model.moeAuxLossCoeff",
         ~has("model.moeAuxLossCoeff"), when=moe_balancing.eq("none"),
         message=lit("spec.model.moeAuxLossCoeff: moeRouterLoadBalancingType none computes no load-balancing "
                     "loss, so its weight would be ignored; omit moeAuxLossCoeff or choose a load-balancing type")),
    # shared_experts.py: the shared experts are one dense MLP split over the tensor-parallel ranks
    Rule("moe-shared-expert-divisible-by-tensor", "model.moeSharedExpertIntermediateSize",
         (moe_shared_ffn % tp).eq(0), when=(experts > 0) & (moe_shared_ffn > 0),
         message=fmt("spec.model.moeSharedExpertIntermediateSize: ", moe_shared_ffn.str(), " is not divisible by "
                     "spec.parallelism.tensor ", tp.str(), "; use a multiple of ", tp.str(),
                     multiple_hint(moe_shared_ffn, tp))),
    # shared_experts.py (SharedExpertMLP.__init__): assert config.add_bias_linear == False, "bias is not supported in
    # the shared experts, please set '--disable-bias-linear' instead." (when the model is built)
    Rule("moe-shared-experts-no-bias", "model.addBiasLinear",
         ~add_bias_linear, when=(experts > 0) & (moe_shared_ffn > 0),
         message=lit("spec.model.addBiasLinear: megatron-core's shared experts have no linear biases "
                     "(SharedExpertMLP asserts add_bias_linear is false when the model is built), and addBiasLinear "
                     "is true (its default); set addBiasLinear: false, or drop moeSharedExpertIntermediateSize")),
    # moe_layer.py builds the shared experts (and so their gate) only with a shared size: the gate would be ignored
    Rule("moe-shared-gate-needs-shared-experts", "model.moeSharedExpertGate",
         moe_shared_ffn > 0, when=(experts > 0) & moe_shared_gate,
         message=lit("spec.model.moeSharedExpertGate: without moeSharedExpertIntermediateSize there is no shared "
                     "expert to gate; set moeSharedExpertIntermediateSize or omit moeSharedExpertGate")),
    # transformer_config.py (TransformerConfig.__post_init__: expert bias only with sigmoid or sqrtsoftplus scores)
    Rule("moe-expert-bias-needs-sigmoid", "model.moeRouterEnableExpertBias",
         moe_score_function.eq("sigmoid"), when=(experts > 0) & moe_expert_bias,
         message=lit("spec.model.moeRouterEnableExpertBias: the expert bias of aux-loss-free routing needs "
                     "moeRouterScoreFunction: sigmoid; set it, or omit moeRouterEnableExpertBias")),
    # router.py reads the rate only with the expert bias on: it would be ignored
    Rule("moe-bias-rate-needs-expert-bias", "model.moeRouterBiasUpdateRate",
         moe_expert_bias, when=(experts > 0) & has("model.moeRouterBiasUpdateRate"),
         message=lit("spec.model.moeRouterBiasUpdateRate: without moeRouterEnableExpertBias: true there is no expert "
                     "bias to update; set moeRouterEnableExpertBias: true or omit the rate")),
    # moe_utils.py (topk_routing_with_score_function): sigmoid scores take no pre-softmax; it would be ignored
    Rule("moe-pre-softmax-needs-softmax", "model.moeRouterPreSoftmax",
         ~moe_pre_softmax, when=(experts > 0) & moe_score_function.eq("sigmoid"),
         message=lit("spec.model.moeRouterPreSoftmax: moeRouterScoreFunction sigmoid has no softmax to apply first; "
                     "omit moeRouterPreSoftmax or use softmax scores")),
    # transformer_config.py (TransformerConfig.__post_init__: padding needs a capacity)
    Rule("moe-pad-needs-capacity-factor", "model.moePadExpertInputToCapacity",
         has("model.moeExpertCapacityFactor"), when=(experts > 0) & moe_pad_to_capacity,
         message=lit("spec.model.moePadExpertInputToCapacity: padding to capacity needs moeExpertCapacityFactor; "
                     "set it (e.g. 1.0) or omit moePadExpertInputToCapacity")),
    # router.py reads the drop policy only with a capacity: it would be ignored
    Rule("moe-drop-policy-needs-capacity-factor", "model.moeTokenDropPolicy",
         has("model.moeExpertCapacityFactor"), when=(experts > 0) & has("model.moeTokenDropPolicy"),
         message=lit("spec.model.moeTokenDropPolicy: without moeExpertCapacityFactor no token is dropped; set "
                     "moeExpertCapacityFactor or omit moeTokenDropPolicy")),
    # gpt_layer_specs.py (get_gpt_decoder_layer_specs asserts "Invalid length of moe_layer_pattern"): one entry per
    # layer of the whole model, not per pipeline stage (get_gpt_decoder_block_spec slices it by stage)
    Rule("moe-layer-freq-one-per-layer", "model.moeLayerFreq",
         Size(moe_layer_freq).eq(layers), when=(experts > 0) & has("model.moeLayerFreq") & model_complete,
         message=fmt("spec.model.moeLayerFreq: ", Size(moe_layer_freq).str(), " entries, but the model has ",
                     layers.str(), " layers (numLayers); give one 0 (dense) or 1 (MoE) per layer of the whole model, "
                     "not per pipeline stage")),
    # ours: a pattern without a MoE layer is a dense model whose experts, router and EP would never run
    Rule("moe-layer-freq-has-moe-layer", "model.moeLayerFreq",
         In(lit(1), moe_layer_freq), when=(experts > 0) & has("model.moeLayerFreq"),
         message=lit("spec.model.moeLayerFreq: no entry is 1, so no layer is a MoE layer; make at least one layer "
                     "MoE, or drop numExperts for a dense model")),
    # transformer_config.py (TransformerConfig.__post_init__: "When using group limited routing, moe_router_num_groups
    # must be specified"); ours the other way: groups without a group top-k route as if there were none
    Rule("moe-router-groups-together", "model.moeRouterGroupTopk",
         has("model.moeRouterNumGroups").eq(has("model.moeRouterGroupTopk")),
         when=(experts > 0) & (has("model.moeRouterNumGroups") | has("model.moeRouterGroupTopk")),
         message=lit("spec.model.moeRouterGroupTopk: group-limited routing needs both moeRouterNumGroups (the groups) "
                     "and moeRouterGroupTopk (the groups a token picks from); set both or neither")),
    # transformer_config.py (TransformerConfig.__post_init__: num_moe_experts % moe_router_num_groups == 0)
    Rule("moe-router-groups-divide-experts", "model.moeRouterNumGroups",
         (experts % moe_router_num_groups).eq(0), when=(experts > 0) & (moe_router_num_groups > 0),
         message=fmt("spec.model.moeRouterNumGroups: ", moe_router_num_groups.str(), " groups do not divide the ",
                     experts.str(), " experts (numExperts); use a divisor of ", experts.str(),
                     " (DeepSeek-V3: 8 groups of 32, often the expert-parallel size)")),
    # transformer_config.py (TransformerConfig.__post_init__: moe_router_group_topk <= moe_router_num_groups)
    Rule("moe-router-group-topk-within-groups", "model.moeRouterGroupTopk",
         moe_router_group_topk <= moe_router_num_groups,
         when=(experts > 0) & (moe_router_num_groups > 0) & (moe_router_group_topk > 0),
         message=fmt("spec.model.moeRouterGroupTopk: ", moe_router_group_topk.str(), " is more than the ",
                     moe_router_num_groups.str(), " groups (moeRouterNumGroups); use at most ",
                     moe_router_num_groups.str())),
    # moe_utils.py (group_limited_topk ranks each group by the sum of its top topk // group_topk scores, then picks
    # topk experts among the chosen groups): at least one score per group, and no more than a group holds
    Rule("moe-router-topk-fits-groups", "model.moeRouterTopk",
         (topk >= moe_router_group_topk) & (topk // moe_router_group_topk <= experts // moe_router_num_groups),
         when=(experts > 0) & (moe_router_num_groups > 0) & (moe_router_group_topk > 0)
         & (moe_router_group_topk <= moe_router_num_groups) & (experts % moe_router_num_groups).eq(0),
         message=fmt("spec.model.moeRouterTopk: ", topk.str(), " with moeRouterGroupTopk ",
                     moe_router_group_topk.str(), ": megatron-core ranks each group by its top moeRouterTopk / "
                     "moeRouterGroupTopk scores, so moeRouterTopk must be at least moeRouterGroupTopk and at most "
                     "moeRouterGroupTopk x the ", (experts // moe_router_num_groups).str(), " experts of a group")),
    # ours: MLA's fields are read only with multiLatentAttention (the trainer would only note them as ignored)
    Rule("mla-fields-need-mla", "model",
         mla, when=any_of(has(f"model.{name}") for name in MLA_FIELDS),
         message=fmt("spec.model:", *[cond(has(f"model.{name}"), f" {name}", "") for name in MLA_FIELDS],
                     " apply to multi-head latent attention only; set multiLatentAttention: true or omit them")),
    # multi_latent_attention.py builds its own rotary embedding (GPTModel builds none for MLA); learned absolute
    # positions would be added on top of it
    Rule("mla-needs-rope", "model.positionEmbedding",
         position_embedding.eq("rope"), when=mla,
         message=lit("spec.model.positionEmbedding: multi-head latent attention applies RoPE to its qkPosEmbHeadDim "
                     "part; set positionEmbedding: rope")),
    # multi_latent_attention.py: keys and values come per head from the latent; num_query_groups is not read
    Rule("mla-no-query-groups", "model.numQueryGroups",
         groups.eq(heads), when=mla & model_complete,
         message=fmt("spec.model.numQueryGroups: multi-head latent attention has one key and value per head (from "
                     "the latent), no query groups; omit numQueryGroups or set it to numAttentionHeads ",
                     heads.str())),
    # MLA's rotary embedding is rope or YaRN (multi_latent_attention.py); Llama 3.1's scaling is not read by it
    Rule("mla-no-llama3-rope-scaling", "model.ropeScalingFactor",
         ~has("model.ropeScalingFactor"), when=mla,
         message=lit("spec.model.ropeScalingFactor: multi-head latent attention scales RoPE with YaRN, not Llama "
                     "3.1's scaling; use ropeType yarn with rotaryScalingFactor, and omit ropeScalingFactor")),
    # the rotated part of an MLA head is qkPosEmbHeadDim whole (multi_latent_attention.py)
    Rule("mla-no-rotary-percent", "model.rotaryPercent",
         ~has("model.rotaryPercent"), when=mla,
         message=lit("spec.model.rotaryPercent: multi-head latent attention rotates its qkPosEmbHeadDim part whole; "
                     "omit rotaryPercent")),
    # RoPE rotates pairs of dimensions
    Rule("mla-pos-emb-head-dim-even", "model.qkPosEmbHeadDim",
         (f("model.qkPosEmbHeadDim") % 2).eq(0), when=mla & has("model.qkPosEmbHeadDim"),
         message=fmt("spec.model.qkPosEmbHeadDim: ", f("model.qkPosEmbHeadDim").str(), " is odd; RoPE rotates pairs "
                     "of dimensions: use an even size (DeepSeek-V3: 64)")),
    # ours: the trainer does not wire MLA with context parallelism
    Rule("mla-no-context-parallel", "parallelism.context",
         cp.eq(1), when=mla,
         message=fmt("spec.parallelism.context: ", cp.str(), " with multi-head latent attention is not wired in the "
                     "trainer; use context: 1")),
    # multi_latent_attention.py reads YaRN's fields only with rope_type yarn: they would be ignored
    Rule("mla-yarn-fields-need-yarn", "model.ropeType",
         rope_type.eq("yarn"), when=mla & any_of(has(f"model.{name}") for name in YARN_FIELDS),
         message=fmt("spec.model.ropeType: rope reads none of", *[cond(has(f"model.{name}"), f" {name}", "")
                                                                 for name in YARN_FIELDS],
                     "; set ropeType: yarn or omit them")),
    # rotary_pos_embedding.py: rotary_percent applies to GPTModel's RoPE only
    Rule("rotary-percent-needs-rope", "model.rotaryPercent",
         position_embedding.eq("rope"), when=has("model.rotaryPercent"),
         message=lit("spec.model.rotaryPercent: partial RoPE needs positionEmbedding: rope; set it or omit "
                     "rotaryPercent")),
    # ModelParallelConfig.__post_init__
    Rule("sequence-parallel-needs-tensor", "parallelism.sequenceParallel",
         tp > 1, when=sequence_parallel,
         message=lit("spec.parallelism.sequenceParallel: sequence parallelism needs spec.parallelism.tensor > 1; "
                     "set sequenceParallel: false or raise tensor")),
    # DotProductAttention.__init__ (local attention asserts CP == 1)
    Rule("local-no-context-parallel", "parallelism.context",
         cp.eq(1), when=~uses_te & ~on_cpu,  # a CPU job: cpu-no-context-parallel says why (blocks/cpu.py)
         message=fmt("spec.parallelism.context: ", cp.str(), " needs Transformer Engine attention; use "
                      "transformerImpl transformer_engine or context: 1")),
    Rule("local-no-fp8", "training.precision",
         precision.ne("fp8"), when=~uses_te & ~on_cpu,  # a CPU job: cpu-no-fp8
         message=lit("spec.training.precision: fp8 needs Transformer Engine; use transformerImpl "
                     "transformer_engine or precision bf16")),
    # Transformer Engine runs context parallelism only in its flash/fused attention backends.
    Rule("context-needs-flash", "training.attentionBackend",
         f("training.attentionBackend").eq("flash"), when=cp > 1,
         message=lit("spec.training.attentionBackend: context parallelism needs attentionBackend flash")),
    # The trainer's full-iteration CUDA graph (Megatron-Core's FullCudaGraphWrapper): one pipeline stage, no
    # per-step routing sizes.
    Rule("cuda-graph-full-iteration", "training.cudaGraph",
         (pp.eq(1)) & (experts.eq(0)), when=opt("training.cudaGraph", "auto").eq("fullIteration"),
         message=fmt("spec.training.cudaGraph: fullIteration needs pipeline 1 and a dense model (pipeline is ",
                     pp.str(), ", numExperts ", experts.str(), "); use cudaGraph auto, which runs such jobs "
                     "eagerly")),
    # OptimizerParamScheduler.__init__ asserts 0 <= min_lr <= max_lr (the trainer refuses it at start-up)
    Rule("min-lr-at-most-lr", "training.minLr",
         f("training.minLr") <= f("training.lr"), when=has("training.minLr"),
         # not echoed: the two are numbers with fractions, which rule messages do not format (expr.Str: ints only)
         message=lit("spec.training.minLr is larger than spec.training.lr; the rate decays from lr down to minLr: "
                     "set minLr <= lr (default lr / 10)")),
    # OptimizerParamScheduler: lr_warmup_steps < lr_decay_steps
    Rule("warmup-before-decay", "training.lrSchedule.warmupIters",
         f("training.lrSchedule.warmupIters") < opt("training.lrSchedule.decayIters", f("training.trainIters")),
         message=fmt("spec.training.lrSchedule.warmupIters: ", f("training.lrSchedule.warmupIters").str(),
                      " must be smaller than the decay iterations ",
                      opt("training.lrSchedule.decayIters", f("training.trainIters")).str(),
                      " (lrSchedule.decayIters, default trainIters)")),
    Rule("extra-args-not-managed", "training.extraArgs",
         All(f("training.extraArgs"), "a", ~Matches(Var("a"), MANAGED_FLAG_RE)),
         message=fmt("spec.training.extraArgs: ",
                      Index(Filter(f("training.extraArgs"), "a", Matches(Var("a"), MANAGED_FLAG_RE)), 0),
                      " is set by the operator from the spec (parallel sizes, model shape, batch, precision, "
                      "data, checkpoint); set the spec field instead")),
    # One token per list item: "--seed 5" would reach the trainer as one unknown flag, and "--save\n"
    # slips past the managed-flag pattern (RE2's "$" does not match before a newline).
    Rule("extra-args-one-token", "training.extraArgs",
         All(f("training.extraArgs"), "a", ~Matches(Var("a"), r"[\s\x00-\x1f\x7f]")),
         # not echoed: the API server drops a messageExpression result that contains a line break
         message=lit("spec.training.extraArgs: an item contains whitespace or a control character (space, tab, "
                     "line break); give each flag and each value as its own list item, e.g. [\"--seed\", \"5\"]")),
    Rule("extra-args-known", "training.extraArgs",
         All(f("training.extraArgs"), "a", Matches(Var("a"), KNOWN_FLAG_RE)),
         message=fmt("spec.training.extraArgs: ",
                     Index(Filter(f("training.extraArgs"), "a", ~Matches(Var("a"), KNOWN_FLAG_RE)), 0),
                     " is not a flag the trainer accepts (flags are spelled out in full: no abbreviations, no "
                     "--help; a switch takes no =value); docs/trainer-contract.md lists them")),
    # The trainer's parser and start-up checks on the values extraArgs pass through (each value flag once, with
    # one value of its type: argparse refuses "--num-workers two" and a flag without its value; config.validate
    # and the TensorBoard writer refuse the out-of-bounds ones, VALUE_BOUNDS).
    Rule("extra-args-values", "training.extraArgs",
         All(extra_args, "x", ~Matches(Var("x"), EXTRA_VALUE_EQ_RE) | Matches(Var("x"), EXTRA_VALUE_EQ_OK_RE))
         & all_of(_separate_value_ok(fl) for fl in EXTRA_VALUE_FLAGS),
         message=lit("spec.training.extraArgs: a value flag is given twice, without its value, or with a value the "
                     "trainer does not take (" + _describe_extra_values() + ")")),
    # config.validate: --overlap-param-gather needs --overlap-grad-reduce and the distributed optimizer, and the
    # full-iteration CUDA graph cannot wait inside the graph for a gather started outside it.
    Rule("extra-args-overlap-param-gather", "training.extraArgs",
         _given("--overlap-grad-reduce") & f("training.distributedOptimizer")
         & opt("training.cudaGraph", "auto").ne("fullIteration"),
         when=_given("--overlap-param-gather"),
         message=lit("spec.training.extraArgs: --overlap-param-gather needs --overlap-grad-reduce in extraArgs, "
                     "spec.training.distributedOptimizer: true and a cudaGraph other than fullIteration")),
    Rule("extra-args-manual-gc", "training.extraArgs",
         _given("--manual-gc"), when=_manual_gc_interval_set,
         message=lit("spec.training.extraArgs: a --manual-gc-interval other than 0 needs --manual-gc")),
    Rule("extra-args-pretraining-only", "training.extraArgs",
         ~(_given("--reset-attention-mask") | _given("--reset-position-ids") | _given("--eod-mask-loss")),
         when=has("data.sft"),
         message=lit("spec.training.extraArgs: --reset-attention-mask, --reset-position-ids and --eod-mask-loss are "
                     "pretraining flags; fine-tuning masks the loss to the answers, and packing keeps samples apart")),
    Rule("extra-args-one-optimizer-layout", "training.extraArgs",
         ~(_given("--dist-ckpt-optim-fully-reshardable") & _given("--dist-ckpt-optim-dp-reshardable")),
         message=lit("spec.training.extraArgs: --dist-ckpt-optim-fully-reshardable and --dist-ckpt-optim-dp-reshardable "
                     "contradict each other: give one")),
    Rule("extra-args-exit-on-missing-checkpoint", "training.extraArgs",
         has("checkpoint"), when=_given("--exit-on-missing-checkpoint"),
         message=lit("spec.training.extraArgs: --exit-on-missing-checkpoint needs spec.checkpoint (the checkpoint "
                     "it expects to load)")),
    Rule("env-not-reserved", "env",
         All(f("env"), "e", ~Matches(Field("name", "e"), RESERVED_ENV_RE)),
         message=fmt("spec.env: ",
                      Attr(Index(Filter(f("env"), "e", Matches(Field("name", "e"), RESERVED_ENV_RE)), 0), "name"),
                      " is set by the operator, torchrun or the GPU device plugin (rendezvous, progress reporting, NCCL, "
                      "which GPUs the pod sees); use another name")),
    # The trainer reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT as its shutdown grace (config.runtime_from_env) and
    # refuses a value that is not a number >= 0 at start-up (exit 2).
    Rule("env-shutdown-timeout", "env",
         All(f("env"), "e", ~(Field("name", "e").eq("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") & Has(Field("value", "e")))
             | Matches(Field("value", "e"), r"^[0-9]{1,9}(\.[0-9]{1,9})?$")),
         message=lit("spec.env: TORCH_ELASTIC_SHUTDOWN_TIMEOUT is the trainer's shutdown grace in seconds: a number "
                     ">= 0 such as 30")),
    Rule("extended-resources-not-reserved", "resources.extendedResources",
         All(f("resources.extendedResources"), "k", ~Matches(Var("k"), RESERVED_RESOURCE_RE)),
         message=fmt("spec.resources.extendedResources: ",
                      Index(Filter(f("resources.extendedResources"), "k", Matches(Var("k"), RESERVED_RESOURCE_RE)),
                            0),
                      " is not an extended resource this field may set: GPUs come from spec.gpusPerNode, EFA from "
                      "spec.resources.efaPerNode, cpu and memory from spec.resources.cpu and memory, and other "
                      "unprefixed or kubernetes.io names (ephemeral-storage, hugepages-*) are not allowed; use a "
                      "domain-prefixed device resource such as rdma/hca_shared_devices_a")),
    Rule("pod-labels-not-reserved", "podMetadata.labels",
         All(f("podMetadata.labels"), "k", ~Matches(Var("k"), RESERVED_LABEL_RE)),
         message=fmt("spec.podMetadata.labels: ",
                      Index(Filter(f("podMetadata.labels"), "k", Matches(Var("k"), RESERVED_LABEL_RE)), 0),
                      " is a label the operator or JobSet sets; use another key")),
    Rule("tensorboard-needs-checkpoint", "logging.tensorboard",
         has("checkpoint"), when=f("logging.tensorboard"),
         message=lit("spec.logging.tensorboard: event files are written under the checkpoint PVC; set "
                     "spec.checkpoint, or tensorboard: false")),
    qualified_keys_rule("pod-label-keys", "podMetadata.labels", "label key"),
    qualified_keys_rule("pod-annotation-keys", "podMetadata.annotations", "annotation key"),
    qualified_keys_rule("node-selector-keys", "resources.nodeSelector", "node label key"),
    Rule("toleration-combination", "resources.tolerations",
         All(f("resources.tolerations"), "t",
             cond(Has(Field("operator", "t")), Field("operator", "t").eq("Exists"), False).eq(False)
             | ~Has(Field("value", "t")) | Field("value", "t").eq("")),
         message=lit("spec.resources.tolerations: operator Exists takes no value; use operator Equal with the "
                     "value, or drop the value")),
    Rule("toleration-key-or-exists", "resources.tolerations",
         All(f("resources.tolerations"), "t",
             (Has(Field("key", "t")) & Field("key", "t").ne(""))
             | cond(Has(Field("operator", "t")), Field("operator", "t").eq("Exists"), False)),
         message=lit("spec.resources.tolerations: a toleration without a key must have operator Exists "
                     "(it then tolerates every taint)")),
    Rule("toleration-seconds-noexecute", "resources.tolerations",
         All(f("resources.tolerations"), "t",
             ~Has(Field("tolerationSeconds", "t"))
             | cond(Has(Field("effect", "t")), Field("effect", "t").eq("NoExecute"), False)),
         message=lit("spec.resources.tolerations: tolerationSeconds needs effect NoExecute (it says how long a "
                     "pod stays on a node after such a taint appears)")),
    Rule("toleration-keys", "resources.tolerations",
         All(f("resources.tolerations"), "t",
             ~Has(Field("key", "t")) | Field("key", "t").eq("") | Matches(Field("key", "t"), QUALIFIED_NAME_RE)),
         message=lit("spec.resources.tolerations: key is not a valid taint key; use [prefix/]name as for labels")),
    Rule("env-value-or-value-from", "env",
         All(f("env"), "e", ~(Has(Field("value", "e")) & Has(Field("valueFrom", "e")))),
         message=fmt("spec.env: ",
                     Attr(Index(Filter(f("env"), "e", Has(Field("value", "e")) & Has(Field("valueFrom", "e"))), 0),
                          "name"),
                     " has both value and valueFrom; give one")),
    Rule("env-one-source", "env",
         All(f("env"), "e", ~Has(Field("valueFrom", "e"))
             | Has(Field("valueFrom.secretKeyRef", "e")).ne(Has(Field("valueFrom.configMapKeyRef", "e")))),
         message=lit("spec.env: valueFrom needs exactly one source: secretKeyRef or configMapKeyRef")),
    Rule("env-names-unique", "env",
         All(f("env"), "e", Size(Filter(f("env"), "x", Field("name", "x").eq(Field("name", "e")))).eq(1)),
         message=fmt("spec.env: ",
                     Attr(Index(Filter(f("env"), "e",
                                       Size(Filter(f("env"), "x", Field("name", "x").eq(Field("name", "e")))) > 1),
                                0), "name"),
                     " is given more than once; keep one (the pod would silently use the last)")),
    Rule("tensor-groups-fit-one-jobset", "parallelism.tensor",
         nodes // (tp // gpn) <= MAX_TP_GROUP_JOBS, when=tp > gpn,
         message=fmt("spec.parallelism.tensor: ", tp.str(), " is larger than spec.gpusPerNode ", gpn.str(),
                     ", so each tensor-parallel group spans pods that are placed together by one replicated job "
                     "per group: ", (nodes // (tp // gpn)).str(), " groups exceed the ", lit(MAX_TP_GROUP_JOBS).str(),
                     " that fit in one JobSet object (etcd stores at most 1.5 MiB); use tensor <= gpusPerNode "
                     "(tensor parallelism inside a node, the usual layout) or fewer nodes")),
    Rule("data-exactly-one", "data",
         cond(has("data.mock"), f("data.mock"), False).ne(has("data.pvc")),
         message=lit("spec.data: give exactly one of mock: true or pvc (with paths)")),
    Rule("data-paths-with-pvc", "data.paths",
         has("data.paths").eq(has("data.pvc") & ~has("data.sft") & f("data.format").eq("pretraining")),
         message=lit("spec.data.paths: pretraining datasets are read from spec.data.pvc; give both pvc and paths "
                     "(fine-tuning: pvc and sft, no paths), or "
                     "neither (mock: true)")),
    Rule("data-sft-with-format", "data.sft",
         has("data.sft").eq(f("data.format").ne("pretraining")),
         message=fmt("spec.data.sft: format ", f("data.format"),
                     cond(has("data.sft"), " takes no sft (set format chat or promptCompletion)",
                          " needs sft: {train: <JSONL in the data PVC>}"))),
    Rule("data-sft-needs-pvc", "data.pvc",
         has("data.pvc"), when=has("data.sft"),
         message=lit("spec.data.pvc: fine-tuning files (spec.data.sft) are read from a PVC; mock data cannot be "
                     "fine-tuned on")),
    Rule("data-sft-tokenizer", "data.tokenizer",
         cond(has("data.tokenizer"), f("data.tokenizer.type").eq("HuggingFace"), has("init")),
         when=has("data.sft"),
         message=lit("spec.data.tokenizer: fine-tuning data needs a Hugging Face tokenizer (its chat template): "
                     "set tokenizer {type: HuggingFace, path}, or spec.init.huggingFace to use that model's")),
    Rule("data-sft-chat-template", "data.sft.chatTemplate",
         f("data.format").eq("chat"), when=has("data.sft") & has("data.sft.chatTemplate"),
         message=fmt("spec.data.sft.chatTemplate: a chat template applies to format chat, not ", f("data.format"))),
    # The trainer: packed SFT runs on the local path (Transformer Engine's attention would ignore the
    # document mask), which has no FP8 kernels; SFT samples are not split for context parallelism (that
    # needs Transformer Engine's packed THD attention, which the trainer does not use).
    Rule("data-sft-packing-no-fp8", "data.sft.packing",
         precision.ne("fp8"), when=has("data.sft") & f("data.sft.packing"),
         message=lit("spec.data.sft.packing: packed fine-tuning runs on the local attention path (Transformer "
                     "Engine's attention would ignore the document mask), which has no FP8; set packing: false "
                     "for precision fp8, or precision bf16")),
    Rule("data-sft-no-context-parallel", "parallelism.context",
         cp.eq(1), when=has("data.sft"),
         message=fmt("spec.parallelism.context: ", cp.str(), " with fine-tuning data (spec.data.sft) needs "
                     "Transformer Engine's packed (THD) attention, which the trainer does not use; set context: 1")),
    Rule("data-sft-eval-interval", "data.sft.evalInterval",
         has("data.sft.valid"), when=has("data.sft") & has("data.sft.evalInterval"),
         message=lit("spec.data.sft.evalInterval: evaluation reads spec.data.sft.valid; set it, or drop "
                     "evalInterval")),
    # The trainer: --split's first weight is the training set's (config._validate_data)
    Rule("data-split-train", "data.split",
         ~Matches(f("data.split"), r"^0+(\.0+)?(,|$)"),
         message=fmt("spec.data.split: ", f("data.split"), " gives the training set no weight; the first of "
                     "train,valid,test must be above 0, e.g. 969,30,1")),
    Rule("data-tokenizer-with-pvc", "data.tokenizer",
         has("data.tokenizer"), when=has("data.pvc") & ~has("data.sft") & f("data.format").eq("pretraining"),
         message=lit("spec.data.tokenizer: real data needs a tokenizer (type HuggingFace with path, or Null)")),
    Rule("tokenizer-path", "data.tokenizer.path",
         has("data.tokenizer.path").eq(f("data.tokenizer.type").eq("HuggingFace")),
         when=has("data.tokenizer"),
         message=lit("spec.data.tokenizer.path: a HuggingFace tokenizer needs path (a directory in the data PVC); "
                     "a Null tokenizer takes none")),
]


# --------------------------------------------------------------------------------------------
# The blocks' rules (blocks/: spec.init and spec.export, spec.checkpoint.objectStore, spec.pod, spec.logging.wandb)
# after the core's; the order of the list is the order of the CRD's rules
# --------------------------------------------------------------------------------------------

SPEC_RULES += [*blocks.hf.RULES, *blocks.object_store.RULES, *blocks.pod.RULES, *blocks.wandb.RULES,
               *blocks.cpu.RULES]

# Rules on the whole object (``self`` is the MegatronJob): where a rule needs metadata.name. Every field
# they read is immutable (metadata.name, spec.export, spec.checkpoint), so they are create-only rules
# (crd.create_only), as the spec rules are.
OBJECT_RULES: list[Rule] = [*blocks.object_store.OBJECT_RULES, *blocks.pod.OBJECT_RULES]

NAME_RULE = {
    "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches({RFC1035_LABEL!r})",
    "message": f"metadata.name: at most {MAX_NAME_LENGTH} characters, an RFC 1035 label (lower-case letters, "
               "digits and '-', starting with a letter, ending with a letter or digit; no '.') (the JobSet, its "
               "Jobs and the pod host "
               "names are built from it)",
}


# --------------------------------------------------------------------------------------------
# Python evaluation
# --------------------------------------------------------------------------------------------


def evaluate_spec_rules(spec: dict[str, Any]) -> list[Problem]:
    """Every violated rule for a spec in wire form (camelCase, defaults applied)."""
    env = {"self": spec}
    problems = []
    for rule in SPEC_RULES:
        try:
            ok = rule.condition().eval(env)
        except (Missing, ZeroDivisionError) as exc:  # a rule bug, never the user's
            raise RuntimeError(f"rule {rule.name} could not be evaluated: {exc}") from exc
        if not ok:
            problems.append(Problem("spec." + rule.field, str(rule.message.eval(env)), rule.name))
    return problems


def evaluate_object_rules(job: dict[str, Any]) -> list[Problem]:
    """Every violated OBJECT_RULES rule for a MegatronJob in wire form (metadata.name, spec with defaults)."""
    env = {"self": job}
    return [Problem(rule.field, str(rule.message.eval(env)), rule.name) for rule in OBJECT_RULES
            if not rule.condition().eval(env)]


def resolved_model(spec: dict[str, Any]) -> dict[str, Any]:
    """The effective model (preset + explicit fields + derived defaults), from the same expressions."""
    env = {"self": spec}
    return {name: e.eval(env) for name, e in MODEL_VALUES.items()}


def derived_layout(spec: dict[str, Any]) -> dict[str, Any]:
    env = {"self": spec}
    return {
        "world": world.eval(env),
        "processesPerNode": gpn.eval(env),
        "data": dp.eval(env),
        "tensor": tp.eval(env),
        "pipeline": pp.eval(env),
        "context": cp.eval(env),
        "expert": ep.eval(env),
        "expertTensor": etp.eval(env),
        "sequenceParallel": bool(sequence_parallel.eval(env)),
        "globalBatchSize": gbs.eval(env),
        "numMicrobatches": microbatches.eval(env),
        "transformerImpl": impl.eval(env),
    }


__all__ = [
    "SPEC_RULES", "OBJECT_RULES", "NAME_RULE", "MANAGED_FLAGS", "Problem", "Rule", "evaluate_spec_rules",
    "evaluate_object_rules", "resolved_model",
    "derived_layout",
]
