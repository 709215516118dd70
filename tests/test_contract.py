"""The operator/trainer contract (docs/trainer-contract.md): every example's rendered command line is
accepted by the trainer's own parser, and the parsed values are the spec's. The two packages never
import each other; this test is where they meet."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from megatron_operator.render import launch_command, megatron_args, render, replicated_job_plan
from megatron_operator.rules import RENDERED_FLAGS, derived_layout, resolved_model
from megatron_operator.settings import Settings
from megatron_operator.validation import parse_job
from megatron_trainer.config import parse_args, resolve_sequence_parallel, runtime_from_env, world_layout
from megatron_trainer.launch import parse_launch_args, worker_env

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))
EXTRA_CASES = {
    # flags the examples do not exercise
    "vpp-moe-etp": {"numNodes": 2, "gpusPerNode": 8,
                    "parallelism": {"tensor": 2, "pipeline": 2, "virtualPipeline": 2, "expert": 4, "expertTensor": 1},
                    "model": {"preset": "llama3-8b", "numExperts": 8, "moeRouterTopk": 2, "moeFfnHiddenSize": 1792,
                              "moeRouterPreSoftmax": True, "moeRouterLoadBalancingType": "seq_aux_loss",
                              "moeAuxLossCoeff": 0.001, "moeZLossCoeff": 1e-05, "moeRouterDtype": "fp32",
                              "moeTokenDispatcherType": "alltoall"},
                    "training": {"trainIters": 10, "microBatchSize": 1, "globalBatchSize": 16, "precision": "fp16",
                                 "distributedOptimizer": False, "recompute": "full",
                                 "extraArgs": ["--overlap-grad-reduce", "--num-workers", "4"]},
                    "checkpoint": {"pvc": "c", "async": False, "keep": 0}, "logging": {"tensorboard": True}},
    "moe-shared-sigmoid-capacity": {"numNodes": 1, "gpusPerNode": 8,
                                    "parallelism": {"tensor": 2, "expert": 2, "expertTensor": 1},
                                    "model": {"preset": "llama3-8b", "numExperts": 8, "moeRouterTopk": 1,
                                              "moeSharedExpertIntermediateSize": 2048, "moeSharedExpertGate": True,
                                              "moeRouterScoreFunction": "sigmoid", "moeRouterEnableExpertBias": True,
                                              "moeRouterBiasUpdateRate": 0.01, "moeExpertCapacityFactor": 1.5,
                                              "moeTokenDropPolicy": "position", "moePadExpertInputToCapacity": True,
                                              "moeTokenDispatcherType": "alltoall"},
                                    "training": {"trainIters": 10, "transformerImpl": "local"}},
    # DeepSeek-V3-shaped (issue 61): MLA with YaRN, a dense first layer, group-limited sigmoid routing, a shared expert
    "deepseek-v3-mla-groups": {"numNodes": 1, "gpusPerNode": 8, "parallelism": {"tensor": 2, "pipeline": 2, "expert": 2},
                               "model": {"numLayers": 4, "hiddenSize": 512, "numAttentionHeads": 8, "seqLength": 1024,
                                         "vocabSize": 32000, "activation": "swiglu", "normalization": "RMSNorm",
                                         "positionEmbedding": "rope", "addBiasLinear": False, "qkLayernorm": True,
                                         "numExperts": 16, "moeRouterTopk": 4, "moeFfnHiddenSize": 256,
                                         "moeLayerFreq": [0, 1, 1, 1], "moeRouterNumGroups": 4,
                                         "moeRouterGroupTopk": 2, "moeRouterTopkScalingFactor": 2.5,
                                         "moeRouterScoreFunction": "sigmoid", "moeRouterEnableExpertBias": True,
                                         "moeSharedExpertIntermediateSize": 256, "multiLatentAttention": True,
                                         "qLoraRank": 128, "kvLoraRank": 64, "qkHeadDim": 32, "qkPosEmbHeadDim": 16,
                                         "vHeadDim": 32, "ropeType": "yarn", "rotaryScalingFactor": 40.0,
                                         "originalMaxPositionEmbeddings": 256, "betaFast": 32.0, "betaSlow": 1.0,
                                         "mscale": 1.0, "mscaleAllDim": 1.0},
                               "training": {"trainIters": 10, "transformerImpl": "local"}},
    # GLM-4.5-shaped: partial RoPE and QKV bias beside the same MoE block
    "glm45-partial-rope": {"numNodes": 1, "gpusPerNode": 8, "parallelism": {"expert": 4},
                           "model": {"numLayers": 4, "hiddenSize": 512, "numAttentionHeads": 8, "numQueryGroups": 2,
                                     "seqLength": 1024, "vocabSize": 32000, "activation": "swiglu",
                                     "normalization": "RMSNorm", "positionEmbedding": "rope", "addBiasLinear": False,
                                     "addQkvBias": True, "rotaryPercent": 0.5, "numExperts": 8,
                                     "moeLayerFreq": [0, 1, 1, 1], "moeRouterNumGroups": 1, "moeRouterGroupTopk": 1,
                                     "moeRouterScoreFunction": "sigmoid", "moeRouterEnableExpertBias": True},
                           "training": {"trainIters": 10, "transformerImpl": "local"}},
    "mla-rope": {"numNodes": 1, "gpusPerNode": 8,
                 "model": {"numLayers": 4, "hiddenSize": 512, "numAttentionHeads": 8, "seqLength": 1024,
                           "vocabSize": 32000, "positionEmbedding": "rope", "multiLatentAttention": True,
                           "ropeType": "rope"},
                 "training": {"trainIters": 10}},
    "null-tokenizer-fp8": {"numNodes": 1, "gpusPerNode": 8, "parallelism": {"tensor": 8},
                           "model": {"preset": "gpt-7.5b"},
                           "training": {"trainIters": 10, "precision": "fp8", "attentionBackend": "unfused"},
                           "data": {"pvc": "d", "paths": [{"prefix": "x/y"}], "tokenizer": {"type": "Null"}}},
    "llama-family-fields": {"numNodes": 1, "gpusPerNode": 8, "parallelism": {"tensor": 2, "sequenceParallel": True},
                            "model": {"numLayers": 4, "hiddenSize": 1000, "numAttentionHeads": 8,
                                      "numQueryGroups": 2, "kvChannels": 128, "ffnHiddenSize": 2048,
                                      "seqLength": 1024, "vocabSize": 32000, "activation": "swiglu",
                                      "normalization": "RMSNorm", "positionEmbedding": "rope",
                                      "rotaryBase": 1000000, "normEpsilon": 1e-6, "qkLayernorm": True,
                                      "addQkvBias": True, "addBiasLinear": False, "ropeScalingFactor": 32},
                            "training": {"trainIters": 10, "transformerImpl": "local"},
                            "init": {"huggingFace": {"pvc": "models", "path": "qwen/qwen3-tiny"}},
                            "export": {"huggingFace": {"pvc": "models", "path": "exports/qwen3-tiny-ft"}},
                            "checkpoint": {"pvc": "c"}},
    "sft-prompt-completion-padded": {"numNodes": 1, "gpusPerNode": 8, "model": {"preset": "llama3-8b"},
                                     "training": {"trainIters": 10},
                                     "data": {"pvc": "d", "format": "promptCompletion",
                                              "tokenizer": {"path": "tok"},
                                              "sft": {"train": "pc/train.jsonl", "packing": False,
                                                      "overflow": "drop", "invalidLines": "skip"}}},
    "wandb-online": {"numNodes": 1, "gpusPerNode": 8, "model": {"preset": "gpt-1.7b"}, "training": {"trainIters": 10},
                     "checkpoint": {"pvc": "c"},
                     "logging": {"wandb": {"project": "llm runs", "entity": "team-a", "name": "run 3",
                                           "apiKeySecret": {"name": "wandb"}}}},
    # a CPU job with several processes a pod: TP inside each pod, PP over the pods, checkpoints saved synchronously
    "cpu-two-processes-pp2": {"numNodes": 2, "gpusPerNode": 0, "cpu": {"processesPerNode": 2},
                              "parallelism": {"tensor": 2, "pipeline": 2},
                              "model": {"numLayers": 4, "hiddenSize": 64, "numAttentionHeads": 4, "seqLength": 32,
                                        "vocabSize": 128},
                              "training": {"trainIters": 10, "globalBatchSize": 2},
                              "checkpoint": {"pvc": "c"}, "resources": {"cpu": 2, "memory": "4Gi"}},
    "sft-chat-template": {"numNodes": 1, "gpusPerNode": 8, "model": {"preset": "llama3-8b"},
                          "training": {"trainIters": 10},
                          "data": {"pvc": "d", "format": "chat", "tokenizer": {"path": "tok"},
                                   "sft": {"train": "c/train.jsonl", "chatTemplate": "templates/chatml.jinja"}}},
}


def _jobs():
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        doc["metadata"]["namespace"] = "ns"
        yield pytest.param(parse_job(doc), id=path.stem)
    for name, spec in EXTRA_CASES.items():
        yield pytest.param(parse_job({"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                                      "metadata": {"name": name, "namespace": "ns"}, "spec": spec}), id=name)


def jobs():
    return list(_jobs())


def procs_per_pod(job) -> int:
    """A pod's trainer processes: one per GPU, or a CPU job's spec.cpu.processesPerNode (default 1)."""
    spec = job.spec
    return spec.gpus_per_node or (spec.cpu.processes_per_node if spec.cpu else 1)


def trainer_argv(job):
    """What `python -m megatron_trainer.launch ... -m megatron_trainer` hands the trainer: everything
    after the module name."""
    cmd = launch_command(job, Settings(), replicated_job_plan(job.spec)[0][0])
    return cmd[cmd.index("megatron_trainer") + 1:]


@pytest.mark.parametrize("job", jobs())
def test_launcher_parses_the_rendered_command_and_numbers_ranks_like_megatron(job):
    """The launcher's own parser takes the rendered command (with $(NODE_RANK) resolved as the kubelet
    does) and gives every pod's workers the world the trainer expects; its grace period is the pod's
    less a margin."""
    js = render(job, Settings())[-1]
    pods = [(rj["replicas"], rj["template"]["spec"]["template"]["spec"]) for rj in js["spec"]["replicatedJobs"]]
    ranks, node_rank = [], 0
    for replicas, pod in pods:
        cmd = pod["containers"][0]["command"]
        assert cmd[:3] == ["python", "-m", "megatron_trainer.launch"]
        for _ in range(replicas):
            lc = parse_launch_args([a.replace("$(NODE_RANK)", str(node_rank)) for a in cmd[3:]])
            assert lc.module == "megatron_trainer" and lc.args == megatron_args(job)
            assert (lc.nnodes, lc.nproc_per_node, lc.node_rank) == (job.spec.num_nodes, procs_per_pod(job),
                                                                    node_rank)
            assert 0 < lc.grace_period_s < pod["terminationGracePeriodSeconds"]
            ranks += [int(worker_env(lc, i, {})["RANK"]) for i in range(lc.nproc_per_node)]
            node_rank += 1
    assert ranks == list(range(job.spec.num_nodes * procs_per_pod(job)))


@pytest.mark.parametrize("job", jobs())
def test_trainer_parses_the_rendered_command_line(job):
    argv = trainer_argv(job)
    assert argv == megatron_args(job)
    cfg = parse_args(argv)
    spec, wire = job.spec, job.spec.wire()
    model, layout = resolved_model(wire), derived_layout(wire)
    p, m, t = cfg.parallel, cfg.model, cfg.training
    assert (p.tensor, p.pipeline, p.context, p.expert) == (layout["tensor"], layout["pipeline"], layout["context"],
                                                          layout["expert"])
    assert p.virtual_pipeline == spec.parallelism.virtual_pipeline
    assert p.expert_tensor == spec.parallelism.expert_tensor
    # explicit: as given; left to its default (on at TP > 1 with TE), the trainer decides from its image
    # (and turns it on for MoE at TP > 1 whatever was asked: megatron-core's MoE layer trains only with it)
    explicit = spec.parallelism.sequence_parallel is True
    assert (p.sequence_parallel, p.sequence_parallel_auto) == (explicit, layout["sequenceParallel"] and not explicit)
    moe_tp = bool(m.num_experts) and p.tensor > 1
    for have_te, want in ((True, (layout["sequenceParallel"] and not cfg.data.sft_packing) or moe_tp),
                          (False, explicit or moe_tp)):
        assert resolve_sequence_parallel(cfg, have_te)[0].parallel.sequence_parallel == (want or explicit)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (model["numLayers"], model["hiddenSize"],
                                                                    model["numAttentionHeads"])
    assert m.effective_num_query_groups == model["numQueryGroups"]
    assert m.effective_ffn_hidden_size == model["ffnHiddenSize"]
    assert (m.seq_length, m.max_position_embeddings, m.vocab_size) == (model["seqLength"],
                                                                       model["maxPositionEmbeddings"],
                                                                       model["vocabSize"])
    assert m.swiglu == (model["activation"] == "swiglu")
    assert m.normalization == model["normalization"]
    assert m.position_embedding_type == model["positionEmbedding"]
    assert (m.num_experts or 0) == (model["numExperts"] or 0)
    if m.num_experts:  # the MoE block (issue 50): each field reaches its trainer flag; unset, the same default
        sm = spec.model
        assert (m.moe_router_topk, m.effective_moe_ffn_hidden_size, m.moe_router_pre_softmax) == (
            model["moeRouterTopk"], model["moeFfnHiddenSize"], model["moeRouterPreSoftmax"])
        assert (m.moe_router_load_balancing_type, m.moe_token_dispatcher_type) == (
            model["moeRouterLoadBalancingType"], model["moeTokenDispatcherType"])
        assert m.moe_aux_loss_coeff == (sm.moe_aux_loss_coeff or 0.0)
        assert (m.moe_z_loss_coeff, m.moe_router_dtype) == (sm.moe_z_loss_coeff, sm.moe_router_dtype)
        assert m.moe_shared_expert_intermediate_size == sm.moe_shared_expert_intermediate_size
        assert m.moe_shared_expert_gate == model["moeSharedExpertGate"]
        assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == (
            model["moeRouterScoreFunction"], model["moeRouterEnableExpertBias"])
        assert m.moe_router_bias_update_rate == (sm.moe_router_bias_update_rate or 1e-3)
        assert (m.moe_expert_capacity_factor, m.moe_token_drop_policy, m.moe_pad_expert_input_to_capacity) == (
            sm.moe_expert_capacity_factor, sm.moe_token_drop_policy or "probs", model["moePadExpertInputToCapacity"])
    if m.num_experts:  # issue 61: dense layers among the MoE ones, group-limited routing
        sm = spec.model
        assert m.moe_layer_pattern == (sm.moe_layer_freq or [1] * m.num_layers)
        assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (
            sm.moe_router_num_groups, sm.moe_router_group_topk, sm.moe_router_topk_scaling_factor)
    assert m.multi_latent_attention == model["multiLatentAttention"]
    if m.multi_latent_attention:  # each MLA field reaches its flag; unset, the same default (Megatron-LM's)
        assert (m.q_lora_rank or 0, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim,
                m.effective_rope_type) == (model["qLoraRank"], model["kvLoraRank"], model["qkHeadDim"],
                                           model["qkPosEmbHeadDim"], model["vHeadDim"], model["ropeType"])
        sm = spec.model
        for name in ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                     "mscale_all_dim"):
            if getattr(sm, name) is not None:
                assert getattr(m, name) == getattr(sm, name), name
    assert m.rotary_percent == (spec.model.rotary_percent or 1.0)
    assert m.untie_embeddings_and_output_weights == model["untieEmbeddings"]
    assert m.add_bias_linear == model["addBiasLinear"]
    assert m.norm_epsilon == model["normEpsilon"]
    assert m.head_dim == model["kvChannels"]
    assert (m.qk_layernorm, m.add_qkv_bias) == (model["qkLayernorm"], model["addQkvBias"])
    assert m.use_rope_scaling == bool(model["ropeScalingFactor"])
    if m.use_rope_scaling:
        assert m.rope_scaling_factor == model["ropeScalingFactor"]
    if model["positionEmbedding"] == "rope":
        assert m.rotary_base == model["rotaryBase"]
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (spec.training.micro_batch_size,
                                                                       layout["globalBatchSize"],
                                                                       spec.training.train_iters)
    assert t.lr == spec.training.lr
    # unset: local, the fastest measured path, or Transformer Engine where only it runs the job (fp8, CP), never
    # on CPUs (docs/trainer.md, "Model paths")
    on_cpu = spec.gpus_per_node == 0
    needs_te = (spec.training.precision == "fp8" or spec.parallelism.context > 1) and not on_cpu
    assert t.transformer_impl == (spec.training.transformer_impl or ("transformer_engine" if needs_te else "local"))
    assert t.device == ("cpu" if on_cpu else "cuda")
    assert t.attention_backend == spec.training.attention_backend
    assert t.use_distributed_optimizer == spec.training.distributed_optimizer
    assert t.bf16 == (spec.training.precision in ("bf16", "fp8")) and t.fp16 == (spec.training.precision == "fp16")
    assert (t.fp8_format is not None) == (spec.training.precision == "fp8")
    assert t.seed == spec.training.seed
    assert cfg.logging.tensorboard_dir == (f"/checkpoints/{spec.checkpoint.path or job.metadata.name}/tensorboard"
                                           if spec.logging.tensorboard else None)
    if spec.checkpoint:
        store = spec.checkpoint.object_store
        where = (f"s3://{store.bucket}/{store.prefix or job.metadata.name}" if store
                 else f"/checkpoints/{spec.checkpoint.path or job.metadata.name}")
        assert cfg.checkpoint.save == cfg.checkpoint.load == where
        assert cfg.checkpoint.object_store_endpoint == (store.endpoint if store else None)
        assert cfg.checkpoint.object_store_region == (store.region if store else None)
        assert cfg.checkpoint.save_interval == spec.checkpoint.interval
        assert cfg.checkpoint.async_save == (spec.checkpoint.async_ and spec.gpus_per_node > 0)  # CPUs: synchronous
    else:
        assert cfg.checkpoint.save is None
    assert cfg.checkpoint.hf_init == (f"/hf-init/{spec.init.hugging_face.path}" if spec.init else None)
    assert cfg.checkpoint.hf_export == (f"/hf-export/{spec.export.hugging_face.path}" if spec.export else None)
    assert not cfg.checkpoint.hf_export_only
    if spec.data.mock:
        assert cfg.data.mock_data
    elif spec.data.sft is not None:
        sft = spec.data.sft
        assert cfg.data.data_format == {"chat": "chat", "promptCompletion": "prompt-completion"}[spec.data.format]
        assert cfg.data.sft_train_path == f"/data/{sft.train}" and not cfg.data.data_path
        assert cfg.data.sft_valid_path == (f"/data/{sft.valid}" if sft.valid else None)
        assert cfg.training.eval_iters == (sft.eval_iters if sft.valid else 0)
        assert cfg.training.eval_interval == sft.eval_interval
        assert (cfg.data.sft_packing, cfg.data.sft_overflow) == (sft.packing, sft.overflow)
        assert cfg.data.sft_invalid_lines == sft.invalid_lines
        assert cfg.data.chat_template == (f"/data/{sft.chat_template}" if sft.chat_template else None)
        assert cfg.data.tokenizer_model == (f"/data/{spec.data.tokenizer.path}" if spec.data.tokenizer
                                            else f"/hf-init/{spec.init.hugging_face.path}")
    else:
        prefixes, weights = cfg.data.blend
        assert prefixes == [f"/data/{d.prefix}" for d in spec.data.paths]
        assert weights == [d.weight for d in spec.data.paths]
    # the world the trainer will see agrees with the operator's derived layout
    world = spec.num_nodes * procs_per_pod(job)
    wl = world_layout(cfg, world)
    assert (wl.data_parallel, wl.global_batch_size, wl.num_microbatches) == (
        layout["data"], layout["globalBatchSize"], layout["numMicrobatches"])


@pytest.mark.parametrize("job", jobs())
def test_trainer_reads_the_rendered_environment(job):
    js = render(job, Settings())[-1]
    env = {}
    for e in js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
    env["NODE_RANK"] = "0"  # from the downward API in a pod
    env["MEGATRON_JOB_NAMESPACE"] = "ns"
    rt = runtime_from_env(env)
    assert rt.job_name == job.metadata.name and rt.job_namespace == "ns"
    assert rt.checkpoint_keep == (job.spec.checkpoint.keep if job.spec.checkpoint else 0)
    assert rt.metrics_port == Settings().trainer_metrics_port
    assert rt.progress_interval_s == Settings().progress_interval_s


def test_extra_args_reach_the_trainer_and_unknown_ones_are_refused_clearly(capsys):
    job = parse_job({"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                     "metadata": {"name": "x", "namespace": "ns"}, "spec": EXTRA_CASES["vpp-moe-etp"]})
    cfg = parse_args(trainer_argv(job))
    assert cfg.training.overlap_grad_reduce is True
    # Megatron-LM flags the project trainer does not implement fail at start-up with exit code 2 and the
    # flag's name (a Megatron-LM image would accept them): never silently ignored.
    with pytest.raises(SystemExit) as exc:
        parse_args(trainer_argv(job) + ["--record-memory-history"])
    assert exc.value.code == 2
    assert "--record-memory-history" in capsys.readouterr().err
    # The common logging flags of Megatron-LM launch scripts are accepted (trainer-contract.md, extraArgs).
    assert parse_args(trainer_argv(job) + ["--log-throughput", "--manual-gc"]).training.manual_gc


def test_hf_export_only_is_the_trainer_command_for_a_rendered_export_job():
    """`python -m megatron_trainer <the job's flags> --hf-export-only` (docs/trainer-contract.md) parses:
    the rendered job gives the trainer --load and --hf-export, which the command needs."""
    job = parse_job({"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                     "metadata": {"name": "x", "namespace": "ns"}, "spec": EXTRA_CASES["llama-family-fields"]})
    cfg = parse_args(trainer_argv(job) + ["--hf-export-only"])
    assert cfg.checkpoint.hf_export_only and cfg.checkpoint.load and cfg.checkpoint.hf_export


def test_rendered_flags_list_is_what_the_renderer_emits():
    """rules.RENDERED_FLAGS (which extraArgs may not repeat) is exactly the set of flags rendered
    over the examples and the contract cases, extraArgs aside."""
    rendered = set()
    for param in jobs():
        job = param.values[0]
        extra = set(job.spec.training.extra_args or [])
        rendered |= {a[2:] for a in megatron_args(job) if a.startswith("--") and a not in extra}
    assert rendered == set(RENDERED_FLAGS)


def test_operator_renders_the_trainers_non_retriable_exit_codes():
    """failures.NON_RETRIABLE_EXIT_CODES (rendered into podFailurePolicy) is the trainer's table."""
    from megatron_operator.failures import NON_RETRIABLE_EXIT_CODES
    from megatron_trainer.exitcodes import NON_RETRIABLE

    assert sorted(NON_RETRIABLE_EXIT_CODES) == sorted(int(c) for c in NON_RETRIABLE)


def test_operator_blames_the_node_for_the_trainers_gpu_fault_code():
    """failures.NODE_FAULT_EXIT_CODES (status.avoidedNodes) is the trainer's GPU_FAULT, and it is retried."""
    from megatron_operator.failures import NODE_FAULT_EXIT_CODES, NON_RETRIABLE_EXIT_CODES
    from megatron_trainer.exitcodes import ExitCode

    assert sorted(NODE_FAULT_EXIT_CODES) == [int(ExitCode.GPU_FAULT)]
    assert not set(NODE_FAULT_EXIT_CODES) & set(NON_RETRIABLE_EXIT_CODES)


def test_the_operators_flag_table_is_the_trainers_parser():
    """extraArgs are checked at admission against operator/megatron_operator/trainer_flags.py; it must
    be exactly the trainer's parser (regenerate: python scripts/gen-trainer-flags.py)."""
    import subprocess
    import sys

    root = Path(__file__).parents[1]
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gen-trainer-flags.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_flag_admission_accepts_is_accepted_by_the_trainer():
    from megatron_operator.trainer_flags import SWITCH_FLAGS, VALUE_FLAGS
    from megatron_trainer.config import build_parser

    actions = build_parser()._option_string_actions
    for name in SWITCH_FLAGS:
        assert actions[f"--{name}"].nargs == 0, name
    for name in VALUE_FLAGS:
        assert actions[f"--{name}"].nargs != 0, name
    assert "--help" not in SWITCH_FLAGS + VALUE_FLAGS


HF_FIXTURES = sorted((Path(__file__).parent / "fixtures" / "hf").glob("*.json"))
#: Mixture-of-experts fixtures: hf-config maps them to spec.model's MoE fields, the trainer imports them (--num-experts
#: and the --moe-* flags).
MOE_FIXTURES = {"tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"}
DENSE_FIXTURES = [p for p in HF_FIXTURES if p.stem not in MOE_FIXTURES]
MOE_FIXTURE_PATHS = [p for p in HF_FIXTURES if p.stem in MOE_FIXTURES]


def _hf_job(config_path: Path, capsys) -> tuple[dict, object]:
    """config.json -> `megatron-operator hf-config` output -> a MegatronJob around it."""
    import json

    from megatron_operator.cli import main

    assert main(["hf-config", str(config_path)]) == 0
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    hf = json.loads(config_path.read_text())
    groups = model["numQueryGroups"]
    job = parse_job({"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                     "metadata": {"name": "hf", "namespace": "ns"},
                     "spec": {"numNodes": 1, "gpusPerNode": 8, "parallelism": {"tensor": min(groups, 2)},
                              "model": model, "training": {"trainIters": 10, "transformerImpl": "local"},
                              "init": {"huggingFace": {"pvc": "models", "path": config_path.stem}},
                              "export": {"huggingFace": {"pvc": "models", "path": f"exports/{config_path.stem}"}},
                              "checkpoint": {"pvc": "ckpt"}}})
    return hf, job


@pytest.mark.parametrize("config_path", DENSE_FIXTURES, ids=[p.stem for p in DENSE_FIXTURES])
def test_hf_config_output_reaches_the_trainer_as_the_config_json_model(config_path, capsys):
    """For every fixture: hf-config's spec.model, rendered, parses in the trainer into the model that
    config.json describes (read here straight from the JSON, not through the operator's mapping)."""
    hf, job = _hf_job(config_path, capsys)
    m = parse_args(trainer_argv(job)).model
    heads = hf["num_attention_heads"]
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    scaled = rope.get("rope_type", rope.get("type", "default")) == "llama3"
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (hf["num_hidden_layers"], hf["hidden_size"], heads)
    assert m.effective_num_query_groups == hf.get("num_key_value_heads", heads)
    assert m.effective_ffn_hidden_size == hf["intermediate_size"]
    assert m.vocab_size == hf["vocab_size"]
    assert m.norm_epsilon == hf["rms_norm_eps"]
    assert m.head_dim == (hf.get("head_dim") or hf["hidden_size"] // heads)
    assert m.qk_layernorm == (hf["model_type"] == "qwen3")
    assert m.add_qkv_bias == (hf["model_type"] == "qwen2")
    assert m.rotary_base == rope.get("rope_theta", hf.get("rope_theta"))
    assert m.use_rope_scaling == scaled
    if scaled:
        assert m.rope_scaling_factor == rope["factor"]
    assert m.untie_embeddings_and_output_weights == (not hf.get("tie_word_embeddings", False))
    assert (m.swiglu, m.normalization, m.position_embedding_type, m.add_bias_linear) == (True, "RMSNorm", "rope",
                                                                                         False)
    assert (m.num_experts or 0) == 0


@pytest.mark.parametrize("config_path", MOE_FIXTURE_PATHS, ids=[p.stem for p in MOE_FIXTURE_PATHS])
def test_hf_config_output_reaches_the_trainer_as_the_moe_of_config_json(config_path, capsys):
    """Qwen3-MoE, Qwen2-MoE and Mixtral (issue 50): hf-config's spec.model, rendered, parses in the trainer into the experts,
    router and experts' hidden size that config.json describes (read here straight from the JSON), and the trainer
    finds nothing to tell apart from the file."""
    from megatron_trainer import hf_config as trainer_hf

    hf, job = _hf_job(config_path, capsys)
    cfg = parse_args(trainer_argv(job))
    m = cfg.model
    qwen = hf["model_type"] in ("qwen3_moe", "qwen2_moe")
    assert m.num_experts == hf.get("num_experts", hf.get("num_local_experts"))
    assert m.moe_router_topk == hf["num_experts_per_tok"]
    assert m.effective_moe_ffn_hidden_size == hf["moe_intermediate_size" if qwen else "intermediate_size"]
    assert m.moe_router_pre_softmax == (qwen and not hf["norm_topk_prob"])
    assert m.moe_aux_loss_coeff == hf["router_aux_loss_coef"]
    assert m.qk_layernorm == (hf["model_type"] == "qwen3_moe")
    # Qwen2-MoE: its shared expert, gated, and QKV bias; the others have neither shared experts nor a gate
    assert m.moe_shared_expert_intermediate_size == hf.get("shared_expert_intermediate_size")
    assert m.moe_shared_expert_gate == ("shared_expert_intermediate_size" in hf)
    assert m.add_qkv_bias == (hf["model_type"] == "qwen2_moe" and hf["qkv_bias"])
    assert trainer_hf.mismatches(cfg, trainer_hf.parse_config(hf, m.seq_length)) == []


def _trainer_config_for(config: dict):
    """The trainer's parsed flags for the job built from hf-config's spec.model of ``config``."""
    from megatron_operator import hf_config as operator_hf

    model = operator_hf.spec_model(operator_hf.parse_config(config))
    job = parse_job({"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                     "metadata": {"name": "hf", "namespace": "ns"},
                     "spec": {"numNodes": 1, "gpusPerNode": 8, "parallelism": {"tensor": 2}, "model": model,
                              "training": {"trainIters": 10, "transformerImpl": "local"}}})
    return parse_args(trainer_argv(job))


def _entry_points(text: str, directory: Path, cfg, hf_config=None) -> tuple[int, list[str], int, str]:
    """A config.json holding ``text`` in ``directory`` through both entry points: (``megatron-operator
    hf-config``'s exit code and stderr lines, the exit code and message of the trainer's --hf-init
    check). The trainer's check always ends in Fatal here: the directory has no tokenizer and no
    weights. ``hf_config``: the CLI's parsed ``hf-config`` arguments (parsed once for many files)."""
    import argparse
    import contextlib
    import io

    from megatron_operator.cli import build_parser
    from megatron_trainer.exitcodes import Fatal
    from megatron_trainer.hf_source import validate_source

    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(text)
    args = argparse.Namespace(**{**vars(hf_config or build_parser().parse_args(["hf-config", "-"])),
                                 "config": str(directory / "config.json")})
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = args.func(args)
    with pytest.raises(Fatal) as fatal:
        validate_source(directory, cfg)
    return rc, err.getvalue().splitlines(), int(fatal.value.code), str(fatal.value)


def test_operator_and_trainer_read_config_json_with_the_one_parser():
    """One reader, megatron_contract.hf_config (a leaf both packages import, import-linter holds it):
    the operator's and the trainer's names for it are it, not copies that can drift again."""
    from megatron_contract import hf_config as contract
    from megatron_operator import hf_config as operator_hf
    from megatron_trainer import hf_config as trainer_hf

    for name in ("parse_config", "HfConfigError", "HfModel"):
        assert getattr(operator_hf, name) is getattr(trainer_hf, name) is getattr(contract, name), name
    assert operator_hf.load_config is contract.load_config  # the trainer's takes the directory: tested below


def _agreement_cases():
    import copy
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "unit"))
    from test_hf_config import REFUSALS

    fixtures = {p.stem: json.loads(p.read_text()) for p in HF_FIXTURES}
    for stem, config in fixtures.items():
        yield pytest.param(config, None, id=stem)
    for case_id, base, mutate, _ in REFUSALS:
        config = copy.deepcopy(fixtures[base])
        mutate(config)
        yield pytest.param(config, fixtures[base], id=f"refused-{case_id}")


@pytest.mark.parametrize("config,refused_from", list(_agreement_cases()))
def test_operator_and_trainer_agree_on_config_json(config, refused_from, tmp_path):
    """The operator's hf-config and the trainer's --hf-init check accept and refuse the same config.json
    files: a refusal is exit 1 with one line per problem from the first, exit 2 with the same problems
    from the second. For an accepted file, the job built from the operator's spec.model has no mismatch
    in the trainer's eyes, and a changed field is one in both (each side compares with its own code)."""
    import json

    from megatron_operator import hf_config as operator_hf
    from megatron_trainer import hf_config as trainer_hf

    if refused_from is not None:
        with pytest.raises(operator_hf.HfConfigError) as refusal:
            operator_hf.parse_config(config)
        rc, lines, code, message = _entry_points(json.dumps(config), tmp_path, _trainer_config_for(refused_from))
        path = tmp_path / "config.json"
        assert (rc, lines) == (1, [f"{path}: {p}" for p in refusal.value.problems])
        assert (code, message) == (2, "the Hugging Face model cannot be imported: " + "; ".join(refusal.value.problems))
        return
    hf = operator_hf.parse_config(config)
    model = operator_hf.spec_model(hf)
    changes: list[dict] = [{}, {"hiddenSize": model["hiddenSize"] * 2, "numLayers": model["numLayers"] * 2}]
    if hf.moe:  # the MoE fields both sides compare (issue 50)
        changes.append({"numExperts": hf.num_experts * 2, "moeRouterTopk": 1, "moeRouterPreSoftmax": True,
                        "moeFfnHiddenSize": hf.moe_ffn_hidden_size * 2})
    for changed in changes:
        spec = {"numNodes": 1, "gpusPerNode": 8, "parallelism": {"tensor": 2}, "model": {**model, **changed},
                "training": {"trainIters": 10, "transformerImpl": "local"}}
        job = parse_job({"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                         "metadata": {"name": "hf", "namespace": "ns"}, "spec": spec})
        cfg = parse_args(trainer_argv(job))
        trainer_says = trainer_hf.mismatches(cfg, trainer_hf.parse_config(config, cfg.model.seq_length))
        operator_says = operator_hf.mismatches(resolved_model(job.spec.wire()),
                                               operator_hf.parse_config(config, cfg.model.seq_length))
        assert len(trainer_says) == len(operator_says), (trainer_says, operator_says)
        assert bool(operator_says) == bool(changed), operator_says


#: JSON values that a config.json field may hold by mistake: each type, the non-finite floats Python's
#: json module reads (``Infinity``, ``NaN``), an integer too large for a float, and the edges of 0 and 1.
ODD_VALUES = [None, True, False, "x", "1", [], [1], {}, {"a": 1}, 0, -1, 0.5, -0.0, 5e-324, 2.0 ** 63, 10 ** 30,
              10 ** 400, 1e308, float("inf"), float("-inf"), float("nan")]


def _nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


#: Structures where a scalar or a list of strings is expected (issue 52, class 4): lists and objects
#: inside lists (unhashable items), deep nesting (json reads about 1,500 levels), long lists, long
#: strings, strings a terminal would break or cannot print.
ODD_STRUCTURES = [[[]], [{}], [[1, 2], 3], [None], ["full_attention", ["sliding_attention"]],
                  {"a": [1, {"b": {}}]}, _nested(1000), list(range(20_000)), ["x"] * 10_000, "x" * 50_000,
                  {str(i): i for i in range(2_000)}, "line\nbreak", "\ud800", "\x1b[2J"]
#: Field names: a newline, a lone surrogate, an escape sequence, empty, long, and many of them.
ODD_KEYS = ["a\nb", "\ud800", "\x1b[31mred", "", "k" * 100_000]
#: Bounds on what a refusal prints: one line of at most this many characters per problem, at most
#: this many problems (each value is echoed shortened, unknown fields are counted after ten).
MAX_PROBLEM_CHARS = 400
MAX_PROBLEMS = 40
#: The fixtures whose cases also go through both entry points as files (the rest through the parser,
#: whose problems the entry points print verbatim): both layouts (transformers 5 with llama3 RoPE, 4.x
#: with top-level rope_theta and sliding-window fields) and an explicit head_dim.
ENTRY_POINT_FIXTURES = ("tiny-llama3", "qwen25-05b-published", "tiny-qwen3")


def _odd_cases(base: dict):
    """(case name, mutated config) for every field the parser reads, with odd values and structures."""
    from megatron_contract.hf_config import MAPPED

    keys = sorted(MAPPED | {"rope_parameters.rope_theta", "rope_parameters.factor", "rope_parameters.rope_type",
                            "rope_parameters.low_freq_factor", "rope_scaling.factor", "rope_scaling.rope_theta",
                            "rope_scaling.type"})
    for key in keys:
        *parents, leaf = key.split(".")
        holder = base
        for parent in parents:
            holder = holder.get(parent) if isinstance(holder, dict) else None
        if not isinstance(holder, dict):
            continue
        for value in ODD_VALUES + ODD_STRUCTURES:
            original = holder.get(leaf, ...)
            holder[leaf] = value
            yield f"{key}={value!r:.40}", base
            if original is ...:
                del holder[leaf]
            else:
                holder[leaf] = original
    layers = base["num_hidden_layers"]
    small = [v for v in ODD_VALUES + ODD_STRUCTURES if len(repr(v)) < 1000]
    for item in small:  # the right length: the items themselves are read
        yield f"layer_types=[{item!r:.30}] * {layers}", {**base, "layer_types": [item] * layers}
        yield f"architectures=[{item!r:.30}]", {**base, "architectures": [item]}
    for key in ODD_KEYS:
        yield f"field {key!r:.30}", {**base, key: 1}
    yield "20,000 unknown fields", {**base, **{f"unknown_{i}": i for i in range(20_000)}}


def _one_short_line_each(problems: list[str]) -> bool:
    return len(problems) <= MAX_PROBLEMS and all(p.isprintable() and len(p) <= MAX_PROBLEM_CHARS for p in problems)


def test_odd_values_and_structures_are_one_line_refusals_in_both_entry_points(tmp_path):
    """Every field the parser reads, in every fixture, set to each odd JSON value and structure, and
    odd field names: the parser accepts the file or refuses it with HfConfigError, each problem one
    short printable line, never another exception; ``megatron-operator hf-config`` and the trainer's
    --hf-init check both print exactly those problems (exit 1 from the first, 2 from the second). The
    trainer once crashed with OverflowError on ``"rope_theta": Infinity``, took ``pretraining_tp:
    true``, which the operator refused, and crashed with TypeError on lists inside ``layer_types``
    (two parsers then)."""
    import json
    import shutil

    from megatron_contract.hf_config import MAX_CONFIG_BYTES, HfConfigError, parse_config
    from megatron_operator.cli import build_parser

    findings, cases = [], 0
    hf_config = build_parser().parse_args(["hf-config", "-"])
    for fixture in HF_FIXTURES:
        base = json.loads(fixture.read_text())
        cfg = _trainer_config_for(base) if fixture.stem in ENTRY_POINT_FIXTURES else None
        for name, config in _odd_cases(base):
            cases += 1
            text = json.dumps(config)
            assert len(text) <= MAX_CONFIG_BYTES, f"{name}: the case itself is larger than a config.json may be"
            try:
                try:
                    parse_config(json.loads(text))
                    problems = None
                except HfConfigError as exc:
                    problems = exc.problems
                if fixture.stem not in ENTRY_POINT_FIXTURES:
                    if problems is not None and not _one_short_line_each(problems):
                        findings.append(f"{fixture.stem} {name}: parser {problems!s:.300}")
                    continue
                # a new file each time (overwriting or removing one costs ms on a disk mounted with
                # discard); only the large ones are removed
                directory = tmp_path / str(cases)
                path = directory / "config.json"
                rc, lines, code, message = _entry_points(text, directory, cfg, hf_config)
                if len(text) > 1 << 16:
                    shutil.rmtree(directory)
            except Exception as exc:  # the finding itself: reported with the case below
                findings.append(f"{fixture.stem} {name}: {type(exc).__name__}: {exc!s:.200}")
                continue
            if problems is None:  # accepted by the parser: spec.model's own bounds may still refuse it, and
                # the trainer compares the file with its flags (exit 2) or finds no weights (exit 5)
                ok = rc == 0 or (rc == 1 and lines and all(line.startswith(f"{path}: spec.model.") for line in lines))
                ok = ok and code in (2, 5) and "\n" not in message
            else:
                ok = (rc, lines) == (1, [f"{path}: {p}" for p in problems]) and code == 2
                ok = ok and message == "the Hugging Face model cannot be imported: " + "; ".join(problems)
                ok = ok and _one_short_line_each(problems)
            if not ok:
                findings.append(f"{fixture.stem} {name}: parser {problems!s:.300}; operator exit {rc} "
                                f"{lines!s:.300}; trainer exit {code} {message:.300}")
    assert cases > 2000
    assert not findings, "\n".join(findings[:40])


@pytest.mark.parametrize("content,fragment", [
    ("{", "invalid JSON: line 1, column 2"),
    ("[1, 2]", "not a JSON object (got list)"),
    ('{"a": 1, "a": 2}', "key 'a' is given twice"),
    ("[" * 100000 + "]" * 100000, "invalid JSON: nested too deeply"),
    ('{"hidden_size": ' + "1" * 5000 + "}", "invalid JSON: a number of more than 4300 digits"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (" " * (1 << 20) + "{}", "larger than 1048576 bytes"),
], ids=["truncated", "list", "duplicate-key", "deep", "long-integer", "binary", "too-large"])
def test_a_bad_file_is_one_line_from_both_entry_points(tmp_path, content, fragment):
    """The trainer's --hf-init check reads config.json as hf-config does: the same one-line reason,
    exit 5 (the files are bad) from the trainer, exit 1 from the CLI."""
    import contextlib
    import io
    import json

    from megatron_operator.cli import main
    from megatron_trainer.exitcodes import Fatal
    from megatron_trainer.hf_source import validate_source

    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["hf-config", str(path)]) == 1
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith(f"{path}: ") and fragment in err.getvalue()
    with pytest.raises(Fatal) as fatal:
        validate_source(tmp_path, _trainer_config_for(json.loads(HF_FIXTURES[0].read_text())))
    assert fatal.value.code == 5 and "\n" not in str(fatal.value)
    assert str(fatal.value).startswith(f"--hf-init: {path}: ") and fragment in str(fatal.value)


def test_operator_and_trainer_refuse_a_config_json_with_a_key_given_twice(tmp_path):
    from megatron_operator import hf_config as operator_hf
    from megatron_trainer import hf_config as trainer_hf

    text = HF_FIXTURES[0].read_text().replace("{", '{"hidden_size": 1, ', 1)  # read twice: which one wins?
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(operator_hf.HfConfigError, match="given twice"):
        operator_hf.load_config(tmp_path / "config.json")
    with pytest.raises(trainer_hf.HfConfigError, match="given twice"):
        trainer_hf.load_config(tmp_path)


def test_every_field_the_trainer_writes_to_status_progress_is_in_the_crd():
    """progress.build_patch (the trainer) against the operator's Progress model, which the CRD's structural
    schema is generated from: a field the schema lacks would be pruned by the API server, silently."""
    from datetime import UTC, datetime

    from megatron_operator.spec import Goodput, MegatronJobStatus, Progress
    from megatron_trainer.progress import Progress as TrainerProgress
    from megatron_trainer.progress import build_patch

    figures = {"ratio": 0.5, "wallSeconds": 10.0, "productiveSeconds": 5.0, "startupSeconds": 1.0,
               "saveBlockedSeconds": 1.0, "lostSeconds": 1.0, "restartSeconds": 1.0, "otherSeconds": 1.0,
               "attempts": 2}
    full = TrainerProgress(iteration=3, train_iters=10, loss=1.0, tokens_per_second=2.0, tflops_per_gpu=3.0,
                           mfu=0.4, last_checkpoint_iteration=2, stage="training", validation_loss=1.5,
                           data={"lines": 4, "used": 3}, goodput=figures, save_warning="w",
                           last_save_blocked_seconds=0.5, last_save_seconds=30.0)
    written = build_patch("j", "ns", full, datetime(2026, 11, 27, tzinfo=UTC))["status"]["progress"]
    known = {f.alias or n for n, f in Progress.model_fields.items()}
    assert set(written) <= known, set(written) - known
    assert set(figures) <= {f.alias or n for n, f in Goodput.model_fields.items()}
    parsed = MegatronJobStatus.model_validate({"progress": written}).model_dump(by_alias=True, exclude_none=True,
                                                                                mode="json")
    assert parsed["progress"]["goodput"] == figures and parsed["progress"]["saveWarning"] == "w"
