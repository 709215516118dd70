"""Argument parsing: every contract flag is accepted, unknown flags and bad combinations exit 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import without
from megatron_trainer.config import (
    build_parser,
    ignored_flags,
    parse_args,
    parse_blend,
    resolve_cuda_graph,
    resolve_sequence_parallel,
    runtime_from_env,
    world_layout,
)

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "trainer-contract.md"


def test_full_command_line_maps_to_config(full_argv):
    cfg = parse_args(full_argv)
    p, m, t, d, c = cfg.parallel, cfg.model, cfg.training, cfg.data, cfg.checkpoint
    assert (p.tensor, p.pipeline, p.virtual_pipeline, p.context, p.expert, p.expert_tensor) == (2, 2, 2, 1, 2, 1)
    assert p.sequence_parallel
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.effective_num_query_groups) == (8, 1024, 16, 4)
    assert (m.ffn_hidden_size, m.seq_length, m.max_position_embeddings, m.vocab_size) == (2816, 4096, 4096, 32000)
    assert (m.num_experts, m.moe_router_topk, m.swiglu, m.normalization) == (4, 2, True, "RMSNorm")
    assert (m.position_embedding_type, m.rotary_base) == ("rope", 500000)
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert (t.transformer_impl, t.attention_backend, t.precision, t.fp8_format) == ("transformer_engine", "flash",
                                                                                   "bf16", "hybrid")
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters) == (1, 64, 5000)
    assert (t.lr, t.min_lr, t.lr_decay_style, t.lr_warmup_iters, t.lr_decay_iters) == (3e-4, 3e-5, "cosine", 100, 5000)
    assert (t.weight_decay, t.clip_grad, t.adam_beta1, t.adam_beta2) == (0.1, 1.0, 0.9, 0.95)
    assert t.use_distributed_optimizer
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == ("full", "uniform", 1)
    assert (t.seed, t.log_interval, t.eval_iters) == (42, 10, 0)
    assert d.blend == (["/data/a_text_document", "/data/b_text_document"], [0.3, 0.7])
    assert (d.split, d.tokenizer_type, d.tokenizer_model) == ("969,30,1", "HuggingFaceTokenizer", "/data/tokenizer")
    assert d.data_cache_path == "/checkpoints/run/data-cache" and not d.mock_data
    assert (c.save, c.load, c.save_interval, c.ckpt_format) == ("/checkpoints/run", "/checkpoints/run", 500, "torch_dist")
    assert c.async_save and c.use_persistent_ckpt_worker and c.exit_signal_handler


def test_mock_command_line_defaults(mock_argv):
    cfg = parse_args(mock_argv)
    assert cfg.data.mock_data and cfg.data.blend == ([], [])
    assert cfg.model.effective_num_query_groups == 4 and cfg.model.add_bias_linear
    assert cfg.checkpoint.save is None and not cfg.checkpoint.async_save


def _contract_flags() -> set[str]:
    flags = set()
    for line in CONTRACT.read_text().splitlines():
        if line.startswith("|") and "`--" in line:
            flags.update(re.findall(r"(--[a-z0-9][a-z0-9-]*)", line.split("|")[2]))
    return flags


def test_parser_knows_every_flag_of_the_contract_table():
    flags = _contract_flags()
    assert len(flags) > 50, "contract table not found or changed shape"
    known = set(build_parser()._option_string_actions)
    assert flags - known == set()


@pytest.mark.parametrize("extra", [["--no-such-flag"], ["--num-layer", "2"], ["--tensor-model-parallel", "2"]])
def test_unknown_or_abbreviated_flag_exits_2(mock_argv, extra, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(mock_argv + extra)
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (lambda a: without(a, "--tensor-model-parallel-size") + ["--tensor-model-parallel-size", "3"], "divisible by --tensor"),
    (lambda a: without(a, "--num-attention-heads") + ["--num-attention-heads", "6"], "divisible by --num-attention-heads"),
    (lambda a: a + ["--fp16"], "mutually exclusive"),
    (lambda a: without(a, "--mock-data"), "exactly one of --mock-data and --data-path"),
    (lambda a: a + ["--data-path", "/data/x"], "exactly one of --mock-data and --data-path"),
    (lambda a: a + ["--recompute-method", "uniform"], "needs --recompute-granularity full"),
    (lambda a: a + ["--recompute-granularity", "full"], "needs --recompute-method"),
    (lambda a: a + ["--async-save", "--save", "/c"], "--use-persistent-ckpt-worker"),
    (lambda a: a + ["--save-interval", "5"], "needs --save"),
    (lambda a: without(a, "--eval-iters") + ["--eval-iters", "5"], "without it, it must be 0"),
    (lambda a: without(a, "--max-position-embeddings") + ["--max-position-embeddings", "64"], ">= --seq-length"),
    (lambda a: a + ["--pipeline-model-parallel-size", "3"], "divisible by --pipeline"),
    (lambda a: a + ["--num-virtual-stages-per-pipeline-rank", "2"], "needs --pipeline-model-parallel-size > 1"),
    (lambda a: a + ["--sequence-parallel"], "needs --tensor-model-parallel-size > 1"),
    (lambda a: a + ["--expert-model-parallel-size", "2"], "needs --num-experts"),
    (lambda a: without(a, "--tokenizer-type") + ["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-model"),
    (lambda a: without(a, "--min-lr") + ["--min-lr", "1"], "--min-lr <= --lr"),
    (lambda a: a + ["--overlap-param-gather"], "--use-distributed-optimizer"),
    (lambda a: a + ["--cuda-graph-impl", "local"], "use --cuda-graph-impl full_iteration or none"),
    (lambda a: a + ["--cuda-graph-impl", "full_iteration", "--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size 1 only"),
    (lambda a: a + ["--cuda-graph-impl", "full_iteration", "--num-experts", "2"], "does not support MoE"),
    (lambda a: a + ["--manual-gc-interval", "10"], "--manual-gc-interval needs --manual-gc"),
    (lambda a: a + ["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be >= 1"),
    (lambda a: a + ["--timing-log-level", "5"], "invalid choice"),
    (lambda a: a + ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "0"], "must be >= 1"),
    (lambda a: a + ["--cuda-graph-warmup-steps", "0"], "must be >= 1"),
    (lambda a: a + ["--cuda-graph-impl", "full_iteration", "--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--overlap-param-gather"], "drop --overlap-param-gather"),
    (lambda a: a + ["--norm-epsilon", "0"], "--norm-epsilon must be in (0, 1)"),
    (lambda a: a + ["--use-rope-scaling"], "needs --position-embedding-type rope"),
    (lambda a: a + ["--kv-channels", "0"], "--kv-channels must be >= 1"),
    (lambda a: a + ["--hf-export-only", "--hf-export", "/out"], "--hf-export-only needs --load"),
    (lambda a: a + ["--hf-init", "relative/dir"], "--hf-init must be an absolute directory path"),
    (lambda a: a + ["--hf-export", "/ckpt/../etc"], "without '..' components"),
    (lambda a: a + ["--hf-init", "/m/x", "--hf-export", "/m/x/"], "never overwrites its source"),
    (lambda a: a + ["--save", "s3://ckpt-bucket/run", "--load", "/ckpt/run"], "both be s3:// or both"),
    (lambda a: a + ["--save", "s3://B/run"], "is not an s3://BUCKET/PREFIX URL"),
    (lambda a: a + ["--save", "s3://ckpt-bucket/a/../b"], "'.' or '..' part"),
    (lambda a: a + ["--save", "/ckpt/run", "--object-store-endpoint", "http://h:9000"],
     "need an s3://BUCKET/PREFIX --save, --load or --hf-export"),
    (lambda a: a + ["--save", "s3://ckpt-bucket/r", "--object-store-endpoint", "http://key:secret@h:9000"],
     "no path, no user info"),
    (lambda a: a + ["--save", "s3://ckpt-bucket/r", "--load", "s3://ckpt-bucket/r", "--hf-export",
                    "s3://ckpt-bucket/r/hf"], "overlaps the checkpoint location s3://ckpt-bucket/r"),
    (lambda a: a + ["--hf-export", "s3://B/hf"], "is not an s3://BUCKET/PREFIX URL"),
    (lambda a: a + ["--num-experts", "4", "--moe-router-topk", "1"], "--moe-router-topk 1 needs --moe-router-pre-softmax"),
    (lambda a: a + ["--num-experts", "4", "--moe-z-loss-coeff", "-1"], "--moe-z-loss-coeff must be >= 0"),
    (lambda a: a + ["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
     "MoE with linear biases needs an expert tensor-parallel size of 1, got 2"),
    (lambda a: a + ["--num-experts", "4", "--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff must be >= 0"),
    (lambda a: a + ["--num-experts", "4", "--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be >= 1"),
    (lambda a: without(a, "--tensor-model-parallel-size") + ["--tensor-model-parallel-size", "2", "--num-experts", "4",
                                                             "--sequence-parallel", "--moe-ffn-hidden-size", "33"],
     "experts' hidden size (33) must be divisible by the expert tensor-parallel size (2)"),
    (lambda a: a + ["--num-experts", "4", "--moe-shared-expert-intermediate-size", "0"],
     "--moe-shared-expert-intermediate-size must be >= 1, got 0"),
    (lambda a: without(a, "--tensor-model-parallel-size") + ["--tensor-model-parallel-size", "2", "--num-experts", "4",
                                                             "--disable-bias-linear", "--sequence-parallel",
                                                             "--moe-shared-expert-intermediate-size", "33"],
     "--moe-shared-expert-intermediate-size (33) must be divisible by --tensor-model-parallel-size (2)"),
    (lambda a: a + ["--num-experts", "4", "--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (lambda a: a + ["--num-experts", "4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                    "--moe-router-bias-update-rate", "-0.001"], "--moe-router-bias-update-rate must be >= 0, got -0.001"),
    (lambda a: a + ["--num-experts", "4", "--moe-expert-capacity-factor", "-1"],
     "--moe-expert-capacity-factor must be > 0, got -1.0"),
    (lambda a: a + ["--num-experts", "4", "--moe-shared-expert-gate"],
     "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
    (lambda a: a + ["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    # --device cpu: what CPUs cannot run (the operator's cpu-* admission rules refuse the same)
    (lambda a: a + ["--device", "cpu", "--transformer-impl", "transformer_engine"],
     "Transformer Engine runs on CUDA only; use --transformer-impl local"),
    (lambda a: without(a, "--bf16") + ["--device", "cpu", "--transformer-impl", "local", "--fp16"],
     "--device cpu: --fp16 cannot run on CPUs"),
    (lambda a: a + ["--device", "cpu", "--transformer-impl", "local", "--cuda-graph-impl", "full_iteration"],
     "--device cpu: --cuda-graph-impl full_iteration cannot run on CPUs"),
    (lambda a: a + ["--device", "cpu", "--transformer-impl", "local", "--async-save", "--use-persistent-ckpt-worker",
                    "--save", "/c"], "--device cpu: --async-save cannot run on CPUs"),
    (lambda a: a + ["--device", "gpu"], "invalid choice: 'gpu'"),
])
def test_invalid_combinations_exit_2_with_a_fix(mock_argv, change, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(change(mock_argv))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_wrong_type_exits_2(mock_argv):
    with pytest.raises(SystemExit) as exc:
        parse_args(without(mock_argv, "--num-layers") + ["--num-layers", "two"])
    assert exc.value.code == 2


def test_blend_forms():
    assert parse_blend(["/d/a"]) == (["/d/a"], [1.0])
    assert parse_blend(["1", "/d/a", "3", "/d/b"]) == (["/d/a", "/d/b"], [1.0, 3.0])
    for bad in (["1", "/d/a", "2"], ["x", "/d/a"], ["0", "/d/a"]):
        with pytest.raises(ValueError):
            parse_blend(bad)


def test_runtime_from_env():
    rt = runtime_from_env({"MEGATRON_JOB_NAME": "j", "MEGATRON_JOB_NAMESPACE": "ns", "MEGATRON_RESTART_ATTEMPT": "3",
                           "MEGATRON_PROGRESS_INTERVAL_S": "0", "MEGATRON_METRICS_PORT": "9500",
                           "MEGATRON_CHECKPOINT_KEEP": "2", "MEGATRON_DATA_CACHE_SHARED": "true"})
    assert (rt.job_name, rt.job_namespace, rt.restart_attempt, rt.progress_interval_s) == ("j", "ns", 3, 0.0)
    assert (rt.metrics_port, rt.checkpoint_keep, rt.data_cache_shared) == (9500, 2, True)
    defaults = runtime_from_env({})
    assert (defaults.progress_interval_s, defaults.metrics_port, defaults.checkpoint_keep) == (30.0, 9400, 0)
    assert (defaults.shutdown_grace_s, defaults.foreach_ops, defaults.profile) == (30.0, True, None)
    knobs = runtime_from_env({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90", "MEGATRON_TRAINER_FOREACH_OPS": "0",
                              "MEGATRON_TRAINER_PROFILE": "5:6:/tmp/p"})
    assert (knobs.shutdown_grace_s, knobs.foreach_ops, knobs.profile) == (90.0, False, "5:6:/tmp/p")
    with pytest.raises(ValueError, match="MEGATRON_CHECKPOINT_KEEP"):
        runtime_from_env({"MEGATRON_CHECKPOINT_KEEP": "two"})
    assert defaults.tp_overlap_chunks == 1  # opt-in
    assert runtime_from_env({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "4"}).tp_overlap_chunks == 4
    with pytest.raises(ValueError, match="MEGATRON_TRAINER_TP_OVERLAP_CHUNKS"):
        runtime_from_env({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "two"})
    assert defaults.tp_overlap_sm_carveout == 0
    assert runtime_from_env({"MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "16"}).tp_overlap_sm_carveout == 16
    with pytest.raises(ValueError, match="MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT must be >= 0"):
        runtime_from_env({"MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "-8"})


def test_rope_modes():
    assert (runtime_from_env({}).compile_rope, runtime_from_env({}).rope_exact) == (True, True)
    for raw, want in (("0", (False, False)), ("1", (True, False)), ("exact", (True, True)), (" Exact ", (True, True)),
                      ("", (True, True))):
        rt = runtime_from_env({"MEGATRON_TRAINER_COMPILE_ROPE": raw})
        assert (rt.compile_rope, rt.rope_exact) == want, raw
    with pytest.raises(ValueError, match=r"MEGATRON_TRAINER_COMPILE_ROPE='yes': expected one of 0, 1, exact"):
        runtime_from_env({"MEGATRON_TRAINER_COMPILE_ROPE": "yes"})


def test_moe_flags_map_to_the_config(mock_argv):
    m = parse_args(mock_argv + ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
                                "--moe-router-pre-softmax", "--moe-router-load-balancing-type", "seq_aux_loss",
                                "--moe-aux-loss-coeff", "0.001", "--moe-z-loss-coeff", "0.0001",
                                "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall"]).model
    assert (m.num_experts, m.moe_router_topk, m.effective_moe_ffn_hidden_size, m.moe_router_pre_softmax) == \
        (8, 2, 64, True)
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == ("seq_aux_loss", 1e-3, 1e-4)
    assert (m.moe_router_dtype, m.moe_token_dispatcher_type) == ("fp32", "alltoall")
    # defaults are Megatron-LM's; the experts' size falls back to --ffn-hidden-size
    d = parse_args(mock_argv + ["--num-experts", "4", "--moe-router-pre-softmax", "--moe-router-topk", "1"]).model
    assert (d.effective_moe_ffn_hidden_size, d.moe_router_load_balancing_type, d.moe_aux_loss_coeff) == \
        (256, "aux_loss", 0.0)
    assert (d.moe_z_loss_coeff, d.moe_router_dtype, d.moe_token_dispatcher_type) == (None, None, "allgather")


def test_router_flags_of_a_dense_model_are_named_as_unused(mock_argv):
    cfg = parse_args(mock_argv + ["--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall",
                                  "--moe-router-topk", "4"])
    assert ignored_flags(cfg) == ["--moe-aux-loss-coeff", "--moe-token-dispatcher-type"]
    assert ignored_flags(parse_args(mock_argv + ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01"])) == []


def test_shared_experts_sigmoid_bias_and_capacity_flags_map_to_the_config(mock_argv):
    m = parse_args(mock_argv + ["--num-experts", "8", "--moe-shared-expert-intermediate-size", "512",
                                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                "--moe-router-bias-update-rate", "0.01", "--moe-expert-capacity-factor", "1.25",
                                "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity",
                                "--moe-router-topk", "1", "--disable-bias-linear"]).model  # top-1 needs no
    # pre-softmax with sigmoid scores; shared experts no biases (SharedExpertMLP asserts add_bias_linear False)
    assert (m.moe_shared_expert_intermediate_size, m.moe_router_score_function, m.moe_router_enable_expert_bias,
            m.moe_router_bias_update_rate) == (512, "sigmoid", True, 0.01)
    assert (m.moe_expert_capacity_factor, m.moe_token_drop_policy, m.moe_pad_expert_input_to_capacity) == \
        (1.25, "position", True)
    with pytest.raises(SystemExit):  # shared experts with linear biases: megatron-core asserts at model build
        parse_args(mock_argv + ["--num-experts", "8", "--moe-shared-expert-intermediate-size", "512"])
    d = parse_args(mock_argv + ["--num-experts", "4"]).model  # Megatron-LM's defaults
    assert (d.moe_shared_expert_intermediate_size, d.moe_router_score_function, d.moe_router_enable_expert_bias,
            d.moe_router_bias_update_rate) == (None, "softmax", False, 1e-3)
    assert (d.moe_expert_capacity_factor, d.moe_token_drop_policy, d.moe_pad_expert_input_to_capacity) == \
        (None, "probs", False)


def test_router_flags_that_act_only_beside_another_are_named_as_unused(mock_argv):
    moe = mock_argv + ["--num-experts", "4"]
    cfg = parse_args(moe + ["--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax",
                            "--moe-router-bias-update-rate", "0.01", "--moe-token-drop-policy", "position"])
    assert ignored_flags(cfg) == ["--moe-router-pre-softmax", "--moe-router-bias-update-rate",
                                  "--moe-token-drop-policy"]
    assert ignored_flags(parse_args(moe + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                           "--moe-router-bias-update-rate", "0.01", "--moe-expert-capacity-factor",
                                           "1", "--moe-token-drop-policy", "position"])) == []


def test_moe_experts_knobs():
    rt = runtime_from_env({})
    assert (rt.moe_experts, rt.moe_group_align) == ("grouped", 0)
    rt = runtime_from_env({"MEGATRON_TRAINER_MOE_EXPERTS": " Sequential ", "MEGATRON_TRAINER_MOE_GROUP_ALIGN": "1"})
    assert (rt.moe_experts, rt.moe_group_align) == ("sequential", 1)
    with pytest.raises(ValueError, match=r"MEGATRON_TRAINER_MOE_EXPERTS='loop': expected one of grouped, sequential"):
        runtime_from_env({"MEGATRON_TRAINER_MOE_EXPERTS": "loop"})
    with pytest.raises(ValueError, match="MEGATRON_TRAINER_MOE_GROUP_ALIGN must be >= 0"):
        runtime_from_env({"MEGATRON_TRAINER_MOE_GROUP_ALIGN": "-8"})


def test_deterministic_attention_modes():
    assert runtime_from_env({}).deterministic_attention == "flash"
    assert not runtime_from_env({}).deterministic_attention_set
    for raw, want in (("math", "math"), ("flash", "flash"), (" Math ", "math"), ("", "flash")):
        rt = runtime_from_env({"MEGATRON_TRAINER_DETERMINISTIC_ATTENTION": raw})
        assert (rt.deterministic_attention, rt.deterministic_attention_set) == (want, bool(raw)), raw
    with pytest.raises(ValueError, match=r"MEGATRON_TRAINER_DETERMINISTIC_ATTENTION='cudnn': expected one of flash, math"):
        runtime_from_env({"MEGATRON_TRAINER_DETERMINISTIC_ATTENTION": "cudnn"})


def test_shutdown_grace_from_the_launcher_else_torchrun():
    assert runtime_from_env({}).shutdown_grace_s == 30.0  # torchrun's fixed SIGKILL delay (torch 2.11)
    assert runtime_from_env({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}).shutdown_grace_s == 45.0
    assert runtime_from_env({"MEGATRON_SHUTDOWN_GRACE_S": "590.0",
                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}).shutdown_grace_s == 590.0
    with pytest.raises(ValueError, match="MEGATRON_SHUTDOWN_GRACE_S"):
        runtime_from_env({"MEGATRON_SHUTDOWN_GRACE_S": "-1"})


def test_world_layout(mock_argv):
    cfg = parse_args(without(mock_argv, "--tensor-model-parallel-size", "--global-batch-size")
                     + ["--tensor-model-parallel-size", "2", "--global-batch-size", "16"])
    wl = world_layout(cfg, 8)
    assert (wl.data_parallel, wl.global_batch_size, wl.num_microbatches) == (4, 16, 2)
    with pytest.raises(ValueError, match="not divisible by TP x PP x CP"):
        world_layout(cfg, 3)
    with pytest.raises(ValueError, match="micro batch x DP"):
        world_layout(cfg, 12)  # DP 6: 16 % 12 != 0


def test_pure_modules_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; import megatron_trainer.config, megatron_trainer.ckpt_layout, megatron_trainer.progress, "
            "megatron_trainer.preprocess, megatron_trainer.flops, megatron_trainer.sampler, megatron_trainer.metrics, "
            "megatron_trainer.hf_config, megatron_trainer.hf_mapping, megatron_trainer.hf_source, "
            "megatron_trainer.safetensors_io, megatron_trainer.cpu, megatron_contract.hf_config; "
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": f"{root / 'trainer_image'}:{root / 'contract'}"})
    assert out.stdout.strip() == "False"


def test_device_cpu_is_local_bf16_without_cuda_graphs(mock_argv):
    cfg = parse_args(mock_argv + ["--device", "cpu"])  # MOCK_ARGV has --transformer-impl local
    assert (cfg.training.device, cfg.training.transformer_impl, cfg.training.precision) == ("cpu", "local", "bf16")
    resolved, why = resolve_cuda_graph(cfg, have_te=True)
    assert resolved.training.cuda_graph_impl == "none" and "CPUs have no CUDA graphs" in why
    assert parse_args(mock_argv).training.device == "cuda"


def test_cuda_graph_flags(mock_argv):
    cfg = parse_args(mock_argv + ["--cuda-graph-impl", "full_iteration", "--cuda-graph-warmup-steps", "2"])
    assert (cfg.training.cuda_graph_impl, cfg.training.cuda_graph_warmup_steps) == ("full_iteration", 2)
    assert parse_args(mock_argv).training.cuda_graph_impl == "auto"


SFT_ARGV = ["--data-format", "chat", "--sft-train-path", "/d/train.jsonl", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", "/d/tok"]


@pytest.mark.parametrize("extra,have_te,impl,reason", [
    ([], False, "full_iteration", "TE-less path"),
    ([], True, "full_iteration", "TE-less path"),  # --transformer-impl local
    (["--transformer-impl", "transformer_engine"], False, "full_iteration", "TE-less path"),  # falls back
    (["--transformer-impl", "transformer_engine"], True, "none", "Transformer Engine path"),
    (["--pipeline-model-parallel-size", "2"], False, "none", "PP > 1"),
    (["--num-experts", "2"], False, "none", "MoE"),
    (["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], False, "none",
     "--overlap-param-gather"),
    (["--use-distributed-optimizer", "--overlap-grad-reduce"], False, "full_iteration", "TE-less path"),
    (["--hf-export-only", "--load", "/c", "--hf-export", "/e"], False, "none", "export-only"),
    (["--cuda-graph-warmup-steps", "50"], False, "none", "ends before the graph"),
    (["--cuda-graph-impl", "none"], False, "none", "as asked"),
    (["--cuda-graph-impl", "full_iteration"], True, "full_iteration", "as asked"),
])
def test_cuda_graph_auto(mock_argv, extra, have_te, impl, reason):
    """`auto` (the default) is the full-iteration graph only where it is verified; the reason is logged."""
    base = without(mock_argv, "--transformer-impl") if "--transformer-impl" in extra else mock_argv
    cfg, why = resolve_cuda_graph(parse_args(base + extra), have_te)
    assert cfg.training.cuda_graph_impl == impl
    assert reason in why


@pytest.mark.parametrize("extra,have_te,on,reason", [
    (["--sequence-parallel-auto"], False, False, "local path"),  # TE asked for, not importable: falls back
    (["--sequence-parallel-auto"], True, True, "Transformer Engine path"),
    (["--sequence-parallel-auto", "--sft-packing"], True, False, "local path"),  # packed SFT stays local
    (["--sequence-parallel-auto", "--sequence-parallel"], False, True, None),  # forced on
    (["--sequence-parallel"], False, True, None),
    ([], True, False, None),
    # megatron-core's MoE layer refuses to train at TP > 1 without it, on either path, asked for or not
    (["--sequence-parallel-auto", "--num-experts", "4", "--disable-bias-linear"], False, True, "MoE at TP > 1"),
    (["--num-experts", "4", "--disable-bias-linear"], True, True, "on although the command line did not ask for it"),
])
def test_sequence_parallel_auto(mock_argv, extra, have_te, on, reason):
    """`--sequence-parallel-auto` (the operator's default at TP > 1): on where the run takes the TE path,
    off on the local path; --sequence-parallel forces it; the reason is logged."""
    argv = without(mock_argv, "--transformer-impl") + ["--transformer-impl", "transformer_engine"]
    argv[argv.index("--tensor-model-parallel-size") + 1] = "2"
    if "--sft-packing" in extra:
        argv = without([a for a in argv if a != "--mock-data"], "--tokenizer-type") + SFT_ARGV
    cfg, why = resolve_sequence_parallel(parse_args(argv + extra), have_te)
    assert (cfg.parallel.sequence_parallel, cfg.parallel.sequence_parallel_auto) == (on, False)
    assert why is None if reason is None else reason in why


def test_sequence_parallel_auto_at_tp1_is_off(mock_argv):
    cfg, why = resolve_sequence_parallel(parse_args(mock_argv + ["--sequence-parallel-auto"]), True)
    assert (cfg.parallel.sequence_parallel, why) == (False, "TP = 1")


def test_cuda_graph_auto_not_for_sft(mock_argv):
    argv = [a for a in mock_argv if a != "--mock-data"]
    argv = without(argv, "--tokenizer-type") + SFT_ARGV
    cfg, why = resolve_cuda_graph(parse_args(argv), False)
    assert (cfg.training.cuda_graph_impl, "SFT" in why) == ("none", True)


# Megatron-LM flags users pass in spec.training.extraArgs (docs/trainer-contract.md, "extraArgs"): the
# logging ones are accepted and named at start-up; --manual-gc, the timeout and the fusion switches act.
COMPAT_ARGV = ["--manual-gc", "--manual-gc-interval", "100", "--distributed-timeout-minutes", "30",
               "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-progress",
               "--timing-log-level", "2", "--timing-log-option", "all",
               "--tensorboard-dir", "/checkpoints/tb", "--tensorboard-log-interval", "1",
               "--tensorboard-queue-size", "5", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
               "--log-validation-ppl-to-tensorboard", "--wandb-project", "p", "--wandb-exp-name", "e",
               "--wandb-entity", "t", "--wandb-save-dir", "/tmp/w", "--use-mcore-models",
               "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion",
               "--no-persist-layer-norm", "--eval-interval", "1000"]


def test_common_megatron_lm_flags_are_accepted(mock_argv):
    from megatron_trainer.config import ignored_flags

    cfg = parse_args(mock_argv + COMPAT_ARGV)
    t = cfg.training
    assert t.manual_gc and t.manual_gc_interval == 100 and t.distributed_timeout_minutes == 30
    assert t.no_masked_softmax_fusion and t.no_rope_fusion and t.no_gradient_accumulation_fusion
    assert cfg.logging.tensorboard_dir == "/checkpoints/tb" and cfg.logging.wandb_project == "p"
    ignored = ignored_flags(cfg)
    assert "--wandb-project" not in ignored and "--eval-interval" in ignored  # W&B acts (wandb_log.py) and "--timing-log-level" in ignored
    # TensorBoard acts (tensorboard.py): its flags are not "ignored", nor the timer/memory switches it honours
    assert [f for f in ignored if "tensorboard" in f] == ["--log-validation-ppl-to-tensorboard"]
    without_dir = ignored_flags(parse_args(mock_argv + ["--log-timers-to-tensorboard"]))
    assert without_dir == ["--log-timers-to-tensorboard"]  # nothing is written without --tensorboard-dir
    assert "--manual-gc" not in ignored and "--no-rope-fusion" not in ignored  # these act
    assert ignored_flags(parse_args(mock_argv)) == []


def test_every_accepted_compat_flag_is_documented():
    """docs/trainer-contract.md lists the extraArgs the trainer accepts; the list and the parser agree."""
    text = CONTRACT.read_text()
    section = text[text.index("## extraArgs"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    documented = set(re.findall(r"`(--[a-z0-9-]+)", "\n".join(rows)))
    given = {a for a in COMPAT_ARGV if a.startswith("--")}
    assert given <= documented, given - documented
    known = set(build_parser()._option_string_actions)
    assert documented - known == set()


def test_llama_family_flags(mock_argv):
    cfg = parse_args(without(mock_argv, "--position-embedding-type") + [
        "--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--kv-channels", "128", "--qk-layernorm",
        "--add-qkv-bias", "--use-rope-scaling", "--rope-scaling-factor", "32", "--hf-init", "/hf/in",
        "--hf-export", "/hf/out"])
    m, c = cfg.model, cfg.checkpoint
    assert (m.norm_epsilon, m.kv_channels, m.head_dim, m.qk_layernorm, m.add_qkv_bias) == (1e-6, 128, 128, True, True)
    assert (m.use_rope_scaling, m.rope_scaling_factor) == (True, 32.0)
    assert (c.hf_init, c.hf_export, c.hf_export_only) == ("/hf/in", "/hf/out", False)
    # --kv-channels lifts the hidden % heads rule (Qwen3: hidden 1024, 16 heads of 128)
    argv = without(without(mock_argv, "--hidden-size"), "--num-attention-heads")
    assert parse_args(argv + ["--hidden-size", "1000", "--num-attention-heads", "16", "--kv-channels", "64"]).model.head_dim == 64


def test_object_store_flags(mock_argv):
    cfg = parse_args(mock_argv + ["--save", "s3://ckpt-bucket/runs/a", "--load", "s3://ckpt-bucket/runs/a",
                                  "--object-store-endpoint", "http://127.0.0.1:7070",
                                  "--object-store-region", "us-east-1"])
    c = cfg.checkpoint
    assert (c.save, c.object_store_endpoint, c.object_store_region) == (
        "s3://ckpt-bucket/runs/a", "http://127.0.0.1:7070", "us-east-1")
    # an export-only run reads its checkpoint from the store (Checkpointer.load) and writes a directory
    cfg = parse_args(mock_argv + ["--load", "s3://ckpt-bucket/runs/a", "--hf-export-only", "--hf-export", "/out"])
    assert cfg.checkpoint.load == "s3://ckpt-bucket/runs/a" and cfg.checkpoint.hf_export == "/out"


def test_fp8_recipe_is_megatron_lms_flag_and_is_named_unused_without_fp8(mock_argv):
    """--fp8-recipe (Megatron-LM's flag; delayed by default, tensorwise = TE's current scaling) reaches
    TransformerConfig.fp8_recipe (model.transformer_config); without --fp8-format nothing reads it."""
    te = [a if a != "local" else "transformer_engine" for a in mock_argv]
    assert parse_args(te + ["--fp8-format", "hybrid"]).training.fp8_recipe == "delayed"
    current = parse_args(te + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    assert (current.training.fp8_format, current.training.fp8_recipe) == ("hybrid", "tensorwise")
    assert ignored_flags(current) == []
    assert ignored_flags(parse_args(te + ["--fp8-recipe", "tensorwise"])) == ["--fp8-recipe"]
    with pytest.raises(SystemExit):
        parse_args(te + ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"])  # Blackwell only: not offered
