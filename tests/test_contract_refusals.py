"""The operator/trainer contract for refusals, both ways. Every spec the operator refuses for a
Megatron start-up rule (tests/unit/spec_table.py) is refused by the trainer too, when its rendered
command line reaches it anyway (an operator older than the trainer, a hand-written command). And every
refusal of the trainer at start-up that depends only on the spec has an admission twin (issue 52):
TRAINER_REFUSALS names each one with its twin, and generated specs that admission accepts all start.
The two rule sets are written separately (rules.py compiles to CEL; the trainer mirrors Megatron-LM's
validate_args); this is what links them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import re2
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from megatron_operator import rules
from megatron_operator.render import megatron_args
from megatron_operator.validation import SpecError, parse_job
from megatron_trainer.config import parse_args, runtime_from_env, world_layout

sys.path.insert(0, str(Path(__file__).parent / "unit"))
from spec_table import CASES, LLAMA_TINY_MLA, LLAMA_TINY_MOE

# Rules about Kubernetes objects or the spec's own shape, not about what Megatron accepts: the
# rendered command line cannot violate them, or they are outside the trainer's view.
OPERATOR_ONLY = {
    "tensor-placement": "a tensor-parallel group on one host is a pod placement rule",
    "extra-args-not-managed": "extraArgs that repeat a rendered flag: argparse takes the last one",
    "env-not-reserved": "pod environment",
    "pod-labels-not-reserved": "pod labels",
    "pod-affinity-selects-own-pods": "pod placement (kube-scheduler's rule for required pod affinity)",
    "data-exactly-one": "the spec's data section shape (rendered as one of --mock-data and --data-path)",
    "topk-within-experts": "without experts the router's top-k is not rendered",
    "moe-fields-need-experts": "without experts the MoE flags are not rendered (the trainer would note them as "
                               "ignored, config.ignored_flags)",
    "moe-tensor-needs-sequence-parallel": "the trainer turns sequence parallelism on itself for MoE at TP > 1 "
                                          "(resolve_sequence_parallel); admission refuses the explicit false that "
                                          "would be ignored",
    "moe-aux-loss-needs-balancing": "megatron-core ignores the weight of a loss it does not compute; admission "
                                    "refuses the setting that would do nothing",
    "moe-bias-rate-needs-expert-bias": "megatron-core reads the rate only with the expert bias on; admission refuses "
                                       "the setting that would do nothing (the trainer names it as unused)",
    "moe-pre-softmax-needs-softmax": "sigmoid scores take no pre-softmax; admission refuses the setting that would do "
                                     "nothing (the trainer names it as unused)",
    "moe-drop-policy-needs-capacity-factor": "without a capacity no token is dropped; admission refuses the setting "
                                             "that would do nothing (the trainer names it as unused)",
    "mla-fields-need-mla": "without multiLatentAttention the MLA flags are not rendered (the trainer would note them "
                           "as ignored, config.ignored_flags)",
    "mla-yarn-fields-need-yarn": "MLA reads YaRN's fields only with ropeType yarn; admission refuses the settings that "
                                 "would do nothing",
    "rotary-percent-needs-rope": "without RoPE megatron-core reads no rotary percent; admission refuses the setting "
                                 "that would do nothing",
    "cpu-block-needs-zero-gpus": "the spec's shape (a GPU job renders nothing of spec.cpu)",
    "cpu-no-efa": "pod resources (no EFA device on a CPU job's pods)",
    "cpu-no-gpu-type": "the GPU type feeds the memory fit and MFU only (nothing reaches the trainer's command line)",
    "data-paths-with-pvc": "the spec's data section shape (nothing to render)",
    "data-tokenizer-with-pvc": "the spec's data section shape (nothing to render)",
    "tokenizer-path": "the spec's data section shape (nothing to render)",
    "model-complete": "an incomplete model cannot be rendered",
    "tensorboard-needs-checkpoint": "where the event files go (nothing to render without a checkpoint PVC)",
    "extra-args-known": "the trainer refuses unknown and abbreviated flags too, but --help makes argparse exit 0",
    "extended-resources-not-reserved": "pod resources",
    "pod-label-keys": "pod labels",
    "pod-annotation-keys": "pod annotations",
    "node-selector-keys": "pod placement",
    "toleration-combination": "pod tolerations",
    "toleration-key-or-exists": "pod tolerations",
    "toleration-seconds-noexecute": "pod tolerations",
    "toleration-keys": "pod tolerations",
    "env-value-or-value-from": "pod environment",
    "env-one-source": "pod environment",
    "env-names-unique": "pod environment",
    "tensor-groups-fit-one-jobset": "the size of the JobSet object",
    "hf-init-llama-family": "the trainer refuses it at start-up, against the checkpoint's config.json",
    "hf-export-llama-family": "not a command-line rule: the trainer's converter meets the model only when it exports",
    "data-sft-with-format": "the spec's data section shape (format without sft renders nothing to read)",
    "data-sft-needs-pvc": "the data volume: the command line cannot show whether /data is mounted",
    "data-sft-tokenizer": "the spec's data section shape (no tokenizer directory to render)",
    "data-sft-eval-interval": "evalInterval is rendered only with a validation file",
    "hf-export-outside-init": "the two PVCs are mounted apart (/hf-init, /hf-export): the trainer cannot see "
                              "that two paths are one directory of one volume",
    "hf-export-one-location": "the spec's export section shape (one location is rendered)",
    "hf-export-object-store-needs-checkpoint-store": "the bucket comes from spec.checkpoint.objectStore: without "
                                                     "it the spec names none to render",
    "checkpoint-one-location": "the spec's checkpoint section shape (one location is rendered)",
    "checkpoint-path-with-pvc": "the spec's checkpoint section shape (path is not rendered for objectStore)",
    "tensorboard-needs-checkpoint-pvc": "where the event files go (nothing to render without a checkpoint PVC)",
    "object-store-identity-annotations": "the job's ServiceAccount",
    "object-store-one-identity": "the pod's credentials (a Secret volume, or the ServiceAccount)",
    "env-no-literal-credentials": "pod environment",
    "env-no-url-credentials": "pod environment",
    "env-endpoint-url": "pod environment",
    # spec.pod (issue 53): the pod's volumes, mounts, init containers and placement, nothing on the command line
    "pod-volume-one-source": "pod volumes",
    "pod-volume-names-unique": "pod volumes",
    "pod-volume-names-not-reserved": "pod volumes",
    "pod-mounts-known-volume": "pod volume mounts",
    "pod-mounts-not-reserved": "pod volume mounts",
    "pod-mount-paths-unique": "pod volume mounts",
    "pod-init-container-names": "pod init containers",
    "pod-init-container-mounts-known-volume": "pod init containers",
    "pod-init-container-env": "pod init containers",
    "pod-selector-requirements": "pod placement",
    "pod-init-container-gpu-env": "pod init containers",
    "pod-init-container-mounts-not-device-list": "pod init containers",
    "pod-host-path-type": "pod volumes",
    "pod-host-path-not-system": "pod volumes",
    "pod-init-container-mount-paths-unique": "pod init containers",
    "pod-spread-unique": "pod placement",
    "pod-spread-min-domains": "pod placement",
    "pod-spread-match-label-keys": "pod placement",
    # spec.logging.wandb (issue 53): the key's Secret and where the run's files go are the pod's volumes
    "wandb-online-needs-key": "the key file is a pod volume; the trainer checks it at start-up (exit 2), not its "
                              "command line",
    "wandb-offline-needs-volume": "whether the save directory outlives the pod is the pod's volumes",
    "wandb-save-dir-on-volume": "whether the save directory outlives the pod is the pod's volumes",
    "env-no-literal-wandb-key": "pod environment",
}


# Single cases of a rule the trainer shares, where admission is stricter on purpose.
STRICTER_CASES = {
    "bad-extra-args-twice": "a value flag given twice in extraArgs: the trainer takes the last value; admission "
                            "refuses the repeat, so that it checks the one value argparse reads",
}


def _refused_megatron_cases():
    for case_id, manifest, rule in CASES:
        if rule is None:
            continue
        why = OPERATOR_ONLY.get(rule) or STRICTER_CASES.get(case_id)
        marks = [pytest.mark.skip(reason=why)] if why else []
        yield pytest.param(manifest, rule, id=case_id, marks=marks)


@pytest.mark.parametrize("manifest, rule", list(_refused_megatron_cases()))
def test_the_trainer_refuses_what_the_operator_refuses(manifest, rule, monkeypatch, capsys):
    with pytest.raises(SpecError) as operator_refused:
        parse_job(manifest)
    assert rule in {p.rule for p in operator_refused.value.problems}
    monkeypatch.setattr(rules, "evaluate_spec_rules", lambda spec: [])  # render it anyway
    monkeypatch.setattr(rules, "evaluate_object_rules", lambda job: [])
    job = parse_job(manifest)
    argv = megatron_args(job)
    world = job.spec.num_nodes * job.spec.processes_per_node
    with pytest.raises((SystemExit, ValueError)) as refused:
        world_layout(parse_args(argv), world)
        runtime_from_env({e.name: e.value for e in job.spec.env if e.value is not None})
    if refused.type is SystemExit:
        assert refused.value.code == 2 and "error:" in capsys.readouterr().err



# ------------------------------------------------------------------ object-store endpoint (issue 52)
ENDPOINTS = [
    "https://s3.example.com", "http://127.0.0.1:9000", "https://h:1", "https://h:65535", "https://h:65536",
    "https://h:0", "https://h:0443", "https://h:99999", "https://h:", "https://KEY:SECRET@h", "https://h/path",
    "https://h/", "https://h?x=y", "ftp://h", "https://${AWS_SECRET_ACCESS_KEY}.example.com", "https://h:443\n",
    "https://[::1]:9000", "https://h h", "https://h:-1", "https://h:\uff11\uff12", "https://h.:80",
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_endpoint_field_and_the_trainer_flag_agree(endpoint, capsys):
    """spec.checkpoint.objectStore.endpoint (its schema pattern, as the API server runs it) and
    --object-store-endpoint (the trainer's check) accept and refuse the same endpoints."""
    from megatron_operator.names import S3_ENDPOINT

    manifest = next(m for case_id, m, _ in CASES if case_id == "object-store")
    argv = megatron_args(parse_job(manifest))
    argv[argv.index("--object-store-endpoint") + 1] = endpoint
    try:
        parse_args(argv)
        trainer_accepts = True
    except SystemExit:
        trainer_accepts = False
        assert "--object-store-endpoint" in capsys.readouterr().err
    assert (re2.search(S3_ENDPOINT, endpoint) is not None) == trainer_accepts


# ------------------------------------------------------- every refusal of the trainer has an admission twin
# The other direction (issue 52): each ValueError the trainer raises at start-up from its command line or its
# environment (config.validate's checks, world_layout, runtime_from_env, objstore.parse_s3_url) is named here
# by its message (placeholders as {}), with what keeps every admitted spec away from it:
# - ("rule", case): a spec_table case that admission refuses; rendered anyway, the trainer refuses it with
#   this message;
# - ("schema", manifest, field): the value that would reach it is refused by the CRD schema at ``field``;
# - ("rendered", flags, why): only flags the operator renders (extraArgs may not set them) can reach it, and the
#   rendering never does (why); test_every_admitted_spec_starts below throws generated specs at it;
# - ("reserved", variable): an environment variable spec.env may not set (env-not-reserved).
# test_every_refusal_of_the_trainer_is_listed fails when a refusal is added without its twin.
def _m(**overrides):
    from factory import make_job

    return make_job(**overrides)


TRAINER_REFUSALS: dict[str, tuple] = {
    "--data-path needs 'WEIGHT PREFIX' pairs or a single PREFIX, got {}":
        ("rendered", ["data-path"], "rendered as WEIGHT PREFIX pairs"),
    "--data-path: weight {} must be > 0":
        ("schema", _m(data={"pvc": "c", "paths": [{"prefix": "a", "weight": 0}], "tokenizer": {"type": "Null"}}),
         "spec.data.paths[0].weight"),
    "--data-path: {} is not a weight (expected 'WEIGHT PREFIX' pairs)":
        ("rendered", ["data-path"], "weights are rendered from numbers"),
    "--num-attention-heads ({}) must be divisible by --tensor-model-parallel-size ({})": ("rule", "bad-heads-vs-tensor"),
    "--hidden-size ({}) must be divisible by --num-attention-heads ({}), or give --kv-channels":
        ("rule", "bad-hidden-vs-heads"),
    "--kv-channels must be >= 1, got {}": ("schema", _m(model__kvChannels=0), "spec.model.kvChannels"),
    "--norm-epsilon must be in (0, 1), got {}": ("schema", _m(model__normEpsilon=0), "spec.model.normEpsilon"),
    "--use-rope-scaling needs --position-embedding-type rope": ("rule", "bad-rope-scaling-without-rope"),
    "--rope-scaling-factor must be >= 1, got {}":
        ("schema", _m(model__positionEmbedding="rope", model__ropeScalingFactor=0.5), "spec.model.ropeScalingFactor"),
    "--num-query-groups needs --group-query-attention":
        ("rendered", ["num-query-groups", "group-query-attention"], "rendered together"),
    "--num-attention-heads ({}) must be a multiple of --num-query-groups ({})": ("rule", "bad-heads-vs-groups"),
    "--num-query-groups ({}) and --tensor-model-parallel-size ({}) must divide one another":
        ("rule", "bad-groups-vs-tensor"),
    "--num-layers ({}) must be divisible by --pipeline-model-parallel-size ({})": ("rule", "bad-layers-vs-pipeline"),
    "--sequence-parallel needs --tensor-model-parallel-size > 1": ("rule", "bad-sp-without-tensor"),
    "--seq-length ({}) must be divisible by 2 x --context-parallel-size": ("rule", "bad-context-vs-sequence"),
    "--max-position-embeddings ({}) must be >= --seq-length ({})": ("rule", "bad-positions"),
    "{} must be >= 1, got {}": ("schema", _m(model__numLayers=0), "spec.model.numLayers"),
    "--num-virtual-stages-per-pipeline-rank needs --pipeline-model-parallel-size > 1":
        ("rule", "bad-virtual-without-pipeline"),
    "layers per pipeline stage ({}) must be divisible by --num-virtual-stages-per-pipeline-rank ({})":
        ("rule", "bad-layers-vs-virtual"),
    "--num-experts ({}) must be divisible by --expert-model-parallel-size ({})": ("rule", "bad-experts-vs-expert"),
    "--moe-router-topk must be between 1 and --num-experts": ("rule", "bad-topk-above-experts"),
    "--expert-model-parallel-size > 1 needs --num-experts": ("rule", "bad-expert-without-experts"),
    # _validate_moe (issue 50: the MoE block of spec.model)
    "--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over the one chosen logit would give the router "
    "no gradient)": ("rule", "bad-moe-topk1"),
    "--moe-ffn-hidden-size must be >= 1, got {}":
        ("schema", _m(model__numExperts=4, model__addBiasLinear=False, model__moeFfnHiddenSize=0),
         "spec.model.moeFfnHiddenSize"),
    "the experts' hidden size ({}) must be divisible by the expert tensor-parallel size ({})":
        ("rule", "bad-moe-ffn-vs-etp"),
    "MoE with linear biases needs an expert tensor-parallel size of 1, got {}; give --disable-bias-linear or "
    "--expert-tensor-parallel-size 1": ("rule", "bad-moe-bias-etp"),
    # --moe-aux-loss-coeff and --moe-z-loss-coeff: one message, both fields bounded the same way in the schema
    # (test_moe_loss_weights_are_bounded_by_the_schema checks the other)
    "{} must be >= 0 (a loss weight), got {}":
        ("schema", _m(model__numExperts=4, model__addBiasLinear=False, model__moeAuxLossCoeff=-0.01),
         "spec.model.moeAuxLossCoeff"),
    "--moe-shared-expert-intermediate-size must be >= 1, got {}":
        ("schema", _m(model__numExperts=4, model__addBiasLinear=False, model__moeSharedExpertIntermediateSize=0),
         "spec.model.moeSharedExpertIntermediateSize"),
    "--moe-shared-expert-intermediate-size ({}) must be divisible by --tensor-model-parallel-size ({})":
        ("rule", "bad-moe-shared-vs-tensor"),
    "--moe-shared-expert-intermediate-size needs --disable-bias-linear (megatron-core's shared experts have no "
    "linear biases)": ("rule", "bad-moe-shared-experts-with-bias"),
    "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid": ("rule", "bad-moe-bias-softmax"),
    "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (there is no shared expert to gate)":
        ("rule", "bad-moe-gate-without-shared"),
    "--moe-router-bias-update-rate must be >= 0, got {}":
        ("schema", _m(model__numExperts=4, model__addBiasLinear=False, model__moeRouterScoreFunction="sigmoid",
                      model__moeRouterEnableExpertBias=True, model__moeRouterBiasUpdateRate=-0.001),
         "spec.model.moeRouterBiasUpdateRate"),
    "--moe-expert-capacity-factor must be > 0, got {}":
        ("schema", _m(model__numExperts=4, model__addBiasLinear=False, model__moeExpertCapacityFactor=0.0),
         "spec.model.moeExpertCapacityFactor"),
    "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor": ("rule", "bad-moe-pad-without-capacity"),
    # the DeepSeek-V3 / GLM-4.5 fields (issue 61): dense layers, group-limited routing, multi-head latent attention
    "--moe-layer-freq {} makes no layer a MoE layer; drop --num-experts for a dense model":
        ("rule", "bad-moe-layer-freq-no-moe"),
    "--moe-layer-freq {}: expected an integer >= 1 or a list of 0/1 such as [0,1,1]":
        ("schema", _m(model={**LLAMA_TINY_MOE, "moeLayerFreq": [0, 2, 1, 1, 1, 1, 1, 1]}), "spec.model.moeLayerFreq[1]"),
    "--moe-layer-freq has {} entries but --num-layers is {}: one per layer": ("rule", "bad-moe-layer-freq-length"),
    "--moe-router-topk-scaling-factor must be > 0, got {}":
        ("schema", _m(model={**LLAMA_TINY_MOE, "moeRouterTopkScalingFactor": 0.0}),
         "spec.model.moeRouterTopkScalingFactor"),
    "--moe-router-num-groups and --moe-router-group-topk go together (group-limited routing)":
        ("rule", "bad-moe-groups-alone"),
    "--moe-router-num-groups and --moe-router-group-topk must be >= 1":
        ("schema", _m(model={**LLAMA_TINY_MOE, "moeRouterNumGroups": 0, "moeRouterGroupTopk": 1}),
         "spec.model.moeRouterNumGroups"),
    "--num-experts ({}) must be divisible by --moe-router-num-groups ({})": ("rule", "bad-moe-groups-vs-experts"),
    "--moe-router-group-topk ({}) must be at most --moe-router-num-groups ({})": ("rule", "bad-moe-group-topk-vs-groups"),
    "--moe-router-topk ({}) must be at least --moe-router-group-topk ({})": ("rule", "bad-moe-topk-below-group-topk"),
    "--moe-router-topk // --moe-router-group-topk ({}) must be at most the experts in a group ({})":
        ("rule", "bad-moe-topk-above-groups"),
    "multi-head latent attention: {} must be >= 1, got {}": ("schema", _m(model={**LLAMA_TINY_MLA, "kvLoraRank": 0}), "spec.model.kvLoraRank"),
    "--qk-pos-emb-head-dim ({}) must be even (RoPE rotates pairs)": ("rule", "bad-mla-odd-pos-emb"),
    "--multi-latent-attention needs --position-embedding-type rope": ("rule", "bad-mla-learned-positions"),
    "--multi-latent-attention has no query groups; drop --group-query-attention": ("rule", "bad-mla-query-groups"),
    "--use-rope-scaling does not apply to --multi-latent-attention; use --rope-type yarn --rotary-scaling-factor":
        ("rule", "bad-mla-llama3-scaling"),
    "--rotary-percent does not apply to --multi-latent-attention (--qk-pos-emb-head-dim is the rotated part)":
        ("rule", "bad-mla-rotary-percent"),
    "--multi-latent-attention with --context-parallel-size > 1 is not wired in this trainer":
        ("rule", "bad-mla-context"),
    "--rotary-scaling-factor must be >= 1, got {}":
        ("schema", _m(model={**LLAMA_TINY_MLA, "rotaryScalingFactor": 0.5}), "spec.model.rotaryScalingFactor"),
    "--rotary-percent must be in (0, 1], got {}":
        ("schema", _m(model={**LLAMA_TINY_MLA, "multiLatentAttention": False, "rotaryPercent": 1.5}),
         "spec.model.rotaryPercent"),
    "--bf16 and --fp16 are mutually exclusive": ("rendered", ["bf16", "fp16"], "precision renders one of them"),
    "--fp8-format needs --bf16 (or --fp16)": ("rendered", ["fp8-format", "bf16"], "precision fp8 renders both"),
    "--fp8-format needs --transformer-impl transformer_engine (the local implementation has no FP8 kernels)":
        ("rule", "bad-local-fp8"),
    "--context-parallel-size > 1 needs --transformer-impl transformer_engine": ("rule", "bad-local-cp"),
    # --device cpu's refusals (config.CPU_REFUSALS): one template, the cpu-* rules of blocks/cpu.py its twins
    # (cpu-local-impl, cpu-no-fp8, cpu-no-fp16, cpu-no-cuda-graph; --async-save is never rendered for a CPU job)
    "--device cpu: {} cannot run on CPUs ({})": ("rule", "bad-cpu-fp8"),
    "--context-parallel-size > 1 needs a fused attention backend (flash, fused or auto), not --attention-backend {}":
        ("rule", "bad-cp-unfused"),
    "--overlap-param-gather needs --use-distributed-optimizer":
        ("rule", "bad-extra-args-overlap-no-distributed-optimizer"),
    "--overlap-param-gather needs --overlap-grad-reduce": ("rule", "bad-extra-args-overlap-param-gather"),
    "--recompute-method needs --recompute-granularity full":
        ("rendered", ["recompute-method", "recompute-granularity"], "recompute: full renders both"),
    "--recompute-granularity full needs --recompute-method and --recompute-num-layers":
        ("rendered", ["recompute-granularity", "recompute-method", "recompute-num-layers"], "rendered together"),
    "--cuda-graph-impl {} (per-layer graphs) is not implemented by this trainer; use --cuda-graph-impl "
    "full_iteration or none": ("rendered", ["cuda-graph-impl"], "cudaGraph renders auto, none or full_iteration"),
    "--cuda-graph-warmup-steps must be >= 1 (the graph is captured after eager steps)":
        ("rule", "bad-extra-args-warmup-steps"),
    "--manual-gc-interval must be >= 0": ("rule", "bad-extra-args-manual-gc-negative"),
    "--manual-gc-interval needs --manual-gc": ("rule", "bad-extra-args-manual-gc-interval"),
    "--distributed-timeout-minutes must be >= 1": ("rule", "bad-extra-args-timeout"),
    "--eval-iters evaluates SFT data (--sft-valid-path); without it, it must be 0":
        ("rendered", ["eval-iters", "sft-valid-path"], "eval-iters is rendered above 0 only with a validation file"),
    "--eval-interval must be >= 1":
        ("schema", _m(data={"pvc": "d", "format": "chat", "tokenizer": {"path": "t"},
                            "sft": {"train": "a", "valid": "v", "evalInterval": 0}}), "spec.data.sft.evalInterval"),
    "need 0 <= --min-lr <= --lr and --lr-warmup-iters >= 0": ("rule", "bad-min-lr"),
    "--lr-warmup-iters ({}) must be below --lr-decay-iters ({})": ("rule", "bad-warmup"),
    "--global-batch-size ({}) must be a multiple of --micro-batch-size ({})": ("rule", "bad-global-batch-odd"),
    "--cuda-graph-impl full_iteration is implemented for --pipeline-model-parallel-size 1 only; drop it or use PP=1":
        ("rule", "bad-cuda-graph-pp2"),
    "--cuda-graph-impl full_iteration does not support MoE (--num-experts): expert routing sizes change every step; "
    "drop one of them": ("rule", "bad-cuda-graph-moe"),
    "--cuda-graph-impl full_iteration with --overlap-param-gather is not supported: the parameter all-gather starts "
    "after the optimizer, outside the graph, and is waited for inside it; drop --overlap-param-gather "
    "(--overlap-grad-reduce is fine)": ("rule", "bad-extra-args-overlap-cuda-graph"),
    "give exactly one of --mock-data and --data-path":
        ("rendered", ["mock-data", "data-path"], "data renders mock or paths (data-exactly-one refuses neither or both)"),
    "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a local directory)":
        ("rendered", ["tokenizer-type", "tokenizer-model"], "a HuggingFace tokenizer renders its path (tokenizer-path)"),
    "--tokenizer-type NullTokenizer needs --vocab-size": ("rendered", ["vocab-size"], "always rendered"),
    "{} needs --data-format chat or prompt-completion":
        ("rendered", ["sft-train-path", "sft-valid-path", "sft-packing", "chat-template"], "rendered with a format"),
    "--split {}: expected comma-separated weights with train > 0": ("rule", "bad-data-split-no-train"),
    "--data-format {} reads --sft-train-path; --mock-data and --data-path are for pretraining":
        ("rendered", ["mock-data", "data-path"], "fine-tuning renders neither"),
    "--data-format {} needs --sft-train-path (a JSONL file)":
        ("rendered", ["sft-train-path"], "spec.data.sft.train is required"),
    "--data-format {} needs --tokenizer-type HuggingFaceTokenizer and --tokenizer-model DIR (its tokenizer.json and "
    "chat template)": ("rendered", ["tokenizer-type", "tokenizer-model"],
                       "fine-tuning always renders HuggingFaceTokenizer and its directory (data-sft-tokenizer)"),
    "--chat-template applies to --data-format chat only": ("rule", "bad-sft-template-not-chat"),
    "--reset-attention-mask, --reset-position-ids and --eod-mask-loss are pretraining flags; SFT masks the loss to "
    "the answers and --sft-packing keeps samples apart": ("rule", "bad-extra-args-sft-reset"),
    "--sft-packing runs on the local path (Transformer Engine's attention ignores the document mask), which has no "
    "FP8: use --no-sft-packing for FP8": ("rule", "bad-sft-packing-fp8"),
    "SFT data with --context-parallel-size > 1 needs Transformer Engine's packed (THD) attention, which this trainer "
    "does not use": ("rule", "bad-sft-context-parallel"),
    "--sft-valid-path needs --eval-iters >= 1 (global batches per evaluation)":
        ("schema", _m(data={"pvc": "d", "format": "chat", "tokenizer": {"path": "t"},
                            "sft": {"train": "a", "valid": "v", "evalIters": 0}}), "spec.data.sft.evalIters"),
    "--dist-ckpt-workers must be >= 1": ("rule", "bad-extra-args-ckpt-workers"),
    "--save-interval must be >= 1": ("schema", _m(checkpoint={"pvc": "c", "interval": 0}), "spec.checkpoint.interval"),
    "--save-interval needs --save DIR": ("rendered", ["save-interval", "save"], "rendered with a checkpoint"),
    "--async-save needs --save DIR": ("rendered", ["async-save", "save"], "rendered with a checkpoint"),
    "--async-save needs --use-persistent-ckpt-worker":
        ("rendered", ["async-save", "use-persistent-ckpt-worker"], "rendered together"),
    "--exit-on-missing-checkpoint needs --load DIR": ("rule", "bad-extra-args-exit-on-missing"),
    "--dist-ckpt-optim-fully-reshardable and --dist-ckpt-optim-dp-reshardable contradict each other: give one":
        ("rule", "bad-extra-args-two-optimizer-layouts"),
    "--object-store-endpoint {}: expected http(s)://HOST[:PORT] (a port 1-65535; no path, no user info)":
        ("schema", _m(checkpoint={"objectStore": {"bucket": "ckpt-bucket", "endpoint": "https://h:65536"}}),
         "spec.checkpoint.objectStore.endpoint"),
    "--hf-export-only needs --load DIR (the checkpoint) and --hf-export DIR (where to write)":
        ("rendered", ["hf-export-only"], "a trainer command, never rendered (extra-args-not-managed)"),
    "--hf-export must not be the --hf-init directory (an export never overwrites its source)":
        ("rendered", ["hf-init", "hf-export"], "mounted at /hf-init and /hf-export: never one path"),
    "--save and --load must both be s3:// or both be directories":
        ("rendered", ["save", "load"], "both from the one checkpoint location"),
    "--object-store-endpoint/--object-store-region need an s3://BUCKET/PREFIX --save, --load or --hf-export":
        ("rendered", ["object-store-endpoint", "object-store-region"], "rendered from checkpoint.objectStore only"),
    "{} must be an absolute directory path without '..' components, got {}":
        ("rendered", ["hf-init", "hf-export"], "rendered under /hf-init and /hf-export from schema-checked paths"),
    "--hf-export {} overlaps the checkpoint location {}: export to a prefix apart from the checkpoints, e.g. "
    "s3://BUCKET/exports/NAME": ("rule", "bad-hf-export-default-prefix"),
    "{}={}: expected one of {}": ("reserved", "MEGATRON_TRAINER_COMPILE_ROPE"),
    "{} must be >= 0, got {}": ("rule", "bad-env-shutdown-timeout-negative"),
    "{}={} is not a {}": ("rule", "bad-env-shutdown-timeout"),
    "world size {} is not divisible by TP x PP x CP = {}": ("rule", "bad-world"),
    "world size {} is not divisible by ETP x EP x PP = {}": ("rule", "bad-expert-grid"),
    "--global-batch-size ({}) must be divisible by micro batch x DP ({} x {})": ("rule", "bad-global-batch"),
    "with --num-virtual-stages-per-pipeline-rank, the micro-batches per step ({}) must be a multiple of "
    "--pipeline-model-parallel-size ({})": ("rule", "bad-virtual-microbatches"),
    "{} is not an s3://BUCKET/PREFIX URL (bucket: 3-63 of a-z 0-9 . -)":
        ("schema", _m(checkpoint={"objectStore": {"bucket": "Bucket"}}), "spec.checkpoint.objectStore.bucket"),
    "{}: the prefix has an empty, '.' or '..' part":
        ("schema", _m(checkpoint={"objectStore": {"bucket": "ckpt-bucket", "prefix": "../x"}}),
         "spec.checkpoint.objectStore.prefix"),
    "--wandb-project {}: at most 128 characters, none of / \\ # ? % : (Weights & Biases' limits)":
        ("schema", _m(logging={"wandb": {"project": "a/b", "mode": "offline"}}, checkpoint={"pvc": "c"}),
         "spec.logging.wandb.project"),
}
#: Where the trainer refuses at start-up from its command line and environment alone.
REFUSING_FUNCTIONS = {"config.py": {"_validate_device", "_validate_parallel_and_model", "_validate_moe",
                                    "_validate_router_groups", "_validate_mla", "moe_layer_pattern", "_validate_training",
                                    "_validate_data", "_validate_sft", "_validate_checkpoint",
                                    "_check_export_apart_from_checkpoints", "_validate_logging", "parse_blend",
                                    "world_layout", "runtime_from_env", "_choice", "num"},
                      "objstore.py": {"parse_s3_url"}}


def _refusal_templates() -> set[str]:
    """The message of every `raise ValueError(...)` in REFUSING_FUNCTIONS, f-string fields as {}."""
    import ast

    out = set()
    for name, functions in REFUSING_FUNCTIONS.items():
        tree = ast.parse((Path(__file__).parents[1] / "trainer_image" / "megatron_trainer" / name).read_text())
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name in functions):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                        getattr(node.exc.func, "id", "") == "ValueError" and node.exc.args:
                    arg = node.exc.args[0]
                    out.add(arg.value if isinstance(arg, ast.Constant) else
                            "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in arg.values))
    return out


def trainer_start(job) -> str | None:
    """What the trainer refuses at start-up from the spec alone (the rendered command line: parse_args,
    world_layout; the environment: runtime_from_env), or None when it starts."""
    import contextlib
    import io

    from megatron_trainer.config import runtime_from_env

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = parse_args(megatron_args(job))
        world_layout(cfg, job.spec.num_nodes * job.spec.processes_per_node)
        runtime_from_env({e.name: e.value for e in job.spec.env if e.value is not None})
    except SystemExit:
        return err.getvalue().rsplit(" error: ", 1)[-1].strip()
    except ValueError as e:
        return str(e)
    return None


def _matches(template: str, message: str) -> bool:
    import re

    return re.match(".*?".join(re.escape(part) for part in template.split("{}")) + "$", message, re.S) is not None


def test_every_refusal_of_the_trainer_is_listed():
    import ast

    config = ast.parse((Path(__file__).parents[1] / "trainer_image" / "megatron_trainer" / "config.py").read_text())
    validators = {fn.name for fn in ast.walk(config) if isinstance(fn, ast.FunctionDef) and fn.name.startswith("_validate")}
    assert validators <= REFUSING_FUNCTIONS["config.py"], "a validation function the scan does not read"
    found = _refusal_templates()
    assert len(found) > 60  # the scan sees the validation functions
    assert sorted(found - TRAINER_REFUSALS.keys()) == [], "a refusal of the trainer without an admission twin"
    assert sorted(TRAINER_REFUSALS.keys() - found) == [], "listed, but the trainer no longer says it"


def test_moe_loss_weights_are_bounded_by_the_schema():
    """The trainer's one loss-weight refusal covers two flags; the listed twin is the aux loss', this is the
    z-loss' (and the MoE refusals are where the scan looks)."""
    assert "_validate_moe" in REFUSING_FUNCTIONS["config.py"]
    with pytest.raises(SpecError) as refused:
        parse_job(_m(model__numExperts=4, model__addBiasLinear=False, model__moeZLossCoeff=-1.0))
    assert [p.field for p in refused.value.problems] == ["spec.model.moeZLossCoeff"]


@pytest.mark.parametrize("template", sorted(TRAINER_REFUSALS))
def test_each_refusal_of_the_trainer_has_an_admission_twin(template, monkeypatch):
    kind, *how = TRAINER_REFUSALS[template]
    if kind == "rule":
        (case_id,) = how
        manifest, rule = next((m, r) for c, m, r in CASES if c == case_id)
        with pytest.raises(SpecError) as refused:
            parse_job(manifest)
        assert [p.rule for p in refused.value.problems] == [rule]
        monkeypatch.setattr(rules, "evaluate_spec_rules", lambda spec: [])  # render it anyway
        monkeypatch.setattr(rules, "evaluate_object_rules", lambda job: [])
        message = trainer_start(parse_job(manifest))
        assert message is not None and _matches(template, message), message
    elif kind == "schema":
        manifest, field = how
        with pytest.raises(SpecError) as refused:
            parse_job(manifest)
        assert [p.field for p in refused.value.problems] == [field]
    elif kind == "rendered":
        flags, _why = how
        assert set(flags) <= set(rules.MANAGED_FLAGS), "extraArgs could set these"
    else:
        assert kind == "reserved" and re2.search(rules.RESERVED_ENV_RE, how[0])



# ---------------------------------------------------------------------- generated specs (issue 52)
EXTRA_VALUES = ["0", "1", "-1", "5", "+2", "-.5", "1e-8", "-1e-8", "x", "", "nvrx", "minmax", "cosine", "2", "007"]


@st.composite
def jobs(draw):
    """Specs around the rules the trainer shares: layouts, model shapes, numerics, data kinds, checkpoints,
    Hugging Face import/export, the trainer's environment, and extraArgs from the trainer's own flag table."""
    from factory import make_job
    from megatron_operator.trainer_flags import SWITCH_FLAGS

    one = st.sampled_from

    def mostly(common, *rare):  # the common value 3 times in 4
        return draw(one([common] * 3 * len(rare) + list(rare))) if rare else common

    par = {"tensor": draw(one([1, 2, 4])), "pipeline": draw(one([1, 2])), "context": mostly(1, 2),
           "expert": mostly(1, 2)}
    if draw(st.integers(0, 4)) == 0:
        par["virtualPipeline"] = 2
    if draw(st.integers(0, 3)) == 0:
        par["sequenceParallel"] = draw(st.booleans())
    model = {"numLayers": draw(one([4, 8])), "hiddenSize": draw(one([512, 1024])),
             "numAttentionHeads": draw(one([8, 16])), "seqLength": draw(one([512, 2048])), "vocabSize": 32000}
    if draw(st.booleans()):
        model.update(activation="swiglu", normalization="RMSNorm", positionEmbedding="rope", addBiasLinear=False)
    for key, values in (("numExperts", [2, 4]), ("numQueryGroups", [2, 4]), ("maxPositionEmbeddings", [2048, 512]),
                        ("ropeScalingFactor", [8]), ("kvChannels", [64])):
        if (key == "numExperts" and par["expert"] > 1) or draw(st.integers(0, 7)) == 0:
            model[key] = draw(one(values))
    if "numExperts" in model or draw(st.integers(0, 15)) == 0:  # the MoE block (issue 50), now and then without experts
        if draw(st.integers(0, 3)) == 0:
            par["expertTensor"] = draw(one([1, 2]))
        for key, values in (("moeRouterTopk", [1, 2]), ("moeFfnHiddenSize", [256, 1025]),
                            ("moeRouterPreSoftmax", [True, False]), ("addBiasLinear", [False]),
                            ("moeRouterLoadBalancingType", ["aux_loss", "none"]), ("moeAuxLossCoeff", [0.0, 0.01]),
                            ("moeZLossCoeff", [0.001]), ("moeTokenDispatcherType", ["alltoall"]),
                            ("moeRouterDtype", ["fp32"]), ("moeSharedExpertIntermediateSize", [512, 33]),
                            ("moeRouterScoreFunction", ["sigmoid", "softmax"]), ("moeRouterEnableExpertBias", [True]),
                            ("moeRouterBiasUpdateRate", [0.01]), ("moeExpertCapacityFactor", [1.0, 1.5]),
                            ("moeTokenDropPolicy", ["position"]), ("moePadExpertInputToCapacity", [True, False])):
            if draw(st.integers(0, 2)) == 0:
                model[key] = draw(one(values))
    training = {"microBatchSize": draw(one([1, 2])), "trainIters": draw(one([5, 100])),
                "precision": mostly("bf16", "fp16", "fp8"),
                "attentionBackend": mostly("flash", "unfused"), "cudaGraph": mostly("auto", "none", "fullIteration"),
                "recompute": draw(one(["none", "selective", "full"])), "distributedOptimizer": mostly(True, False)}
    impl = mostly("transformer_engine", "local", None)  # unset: local, TE where only it runs (values.impl)
    if impl is not None:
        training["transformerImpl"] = impl
    if draw(st.booleans()) or "virtualPipeline" in par:
        training["globalBatchSize"] = mostly(64, 8, 16, 33)
    if draw(st.integers(0, 4)) == 0:
        training["lrSchedule"] = {"warmupIters": draw(one([0, 10, 50])), "decayIters": draw(one([20, 100]))}
    if draw(st.integers(0, 4)) == 0:
        training["minLr"] = draw(one([0.0, 1e-5, 1.0]))
    if draw(st.integers(0, 2)) == 0:
        extra = []
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                extra.append("--" + draw(one(sorted(set(SWITCH_FLAGS) - set(rules.MANAGED_FLAGS)))))
            else:
                flag, value = draw(one(rules.EXTRA_VALUE_FLAGS)), draw(one(EXTRA_VALUES))
                extra += [f"--{flag}={value}"] if draw(st.booleans()) else [f"--{flag}"] + ([value] if value else [])
        training["extraArgs"] = extra
    o = {"numNodes": draw(one([1, 2, 4])), "gpusPerNode": mostly(8, 1, 2, 4, 0), "parallelism": par,
         "model": model, "training": training}
    if o["gpusPerNode"] == 0 and draw(st.booleans()):  # a CPU job (blocks/cpu.py), now and then several processes
        o["cpu"] = {"processesPerNode": draw(one([1, 2, 4]))}
    kind = draw(one(["mock", "sft", "sft", "pretraining"]))
    if kind == "sft":
        sft = {"train": "a.jsonl", "packing": draw(st.booleans())}
        for key, value in (("valid", "v.jsonl"), ("evalInterval", 10), ("chatTemplate", "t.jinja")):
            if draw(st.booleans()):
                sft[key] = value
        fmt = draw(one(["chat", "promptCompletion"]))
        o["data"] = {"pvc": "d", "format": fmt, "tokenizer": {"path": "tok"}, "sft": sft}
    elif kind == "pretraining":
        o["data"] = {"pvc": "d", "paths": [{"prefix": "a"}], "split": draw(one(["969,30,1", "0,1,1", "1"])),
                     "tokenizer": draw(one([{"type": "HuggingFace", "path": "t"}, {"type": "Null"}]))}
    store = draw(one([None, "pvc", "objectStore"]))
    if store == "pvc":
        o["checkpoint"] = {"pvc": "c", "async": draw(st.booleans()), "interval": draw(one([1, 50]))}
    elif store == "objectStore":
        o["checkpoint"] = {"objectStore": {"bucket": "ckpt-bucket"}}
        if draw(st.booleans()):
            o["checkpoint"]["objectStore"]["prefix"] = draw(one(["a", "job"]))
    if draw(st.integers(0, 4)) == 0:
        o["init"] = {"huggingFace": {"pvc": "m", "path": draw(one(["x", "y"]))}}
    if draw(st.integers(0, 4)) == 0:
        o["export"] = {"huggingFace": {"objectStore": True, "path": draw(one(["job", "job/hf", "exp", "a"]))}
                       if store == "objectStore" and draw(st.booleans()) else {"pvc": "m", "path": draw(one(["x", "z"]))}}
    if draw(st.integers(0, 5)) == 0:
        o["env"] = [{"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": draw(one(["30", "-1", "soon", "1.5"]))}]
    return make_job(**o)


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(job=jobs())
def test_every_admitted_spec_starts(job):
    """What admission accepts, the trainer starts with (the rendered command line and environment)."""
    try:
        parsed = parse_job(job)
    except SpecError:
        event("refused at admission")
        return
    event("admitted")
    assert trainer_start(parsed) is None, job["spec"]
