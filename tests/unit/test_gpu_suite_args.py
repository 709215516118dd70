"""The GPU suite measures and checks "the command line the operator renders by default" with its own
builder (e2e/gpu/harness.py, trainer_args), so that the suite needs no cluster. Here that builder is
compared with the operator's real rendering: every flag that changes what runs (layout, kernels,
fusions, CUDA graph, sequence parallelism, optimizer) must be the same; only the run's own choices
(learning-rate schedule, length, logging, sequence length) may differ."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from factory import make_job
from megatron_operator.render import megatron_args
from megatron_operator.validation import parse_job

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "gpu"))
import correctness as C
import harness as H
import mlm_compare as MC
import performance as PF

# the run's own choices: what the suite sets per scenario, not what the operator decides
RUN_CHOICES = {"--lr", "--min-lr", "--lr-warmup-iters", "--log-interval", "--seq-length", "--max-position-embeddings",
               "--train-iters", "--lr-decay-iters", "--eval-iters", "--seed"}
# values the operator renders explicitly and the trainer defaults to (config.py): same run either way
TRAINER_DEFAULTS = {"--hidden-dropout": ["0.0"], "--attention-dropout": ["0.0"], "--cuda-graph-impl": ["auto"],
                    "--norm-epsilon": ["1e-05"]}


def flags(argv: list[str]) -> dict[str, list[str]]:
    out, key = {}, None
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = []
        elif key is not None:
            out[key].append(a)
    return out


@pytest.mark.parametrize("tp, pp, gpus", [(2, 1, 2), (1, 2, 2), (1, 1, 2)])
def test_suite_command_line_is_the_operators_default_rendering(tp, pp, gpus):
    job = parse_job(make_job(numNodes=1, gpusPerNode=gpus, parallelism={"tensor": tp, "pipeline": pp},
                             model={"preset": "llama3-8b"},
                             training={"microBatchSize": 1, "globalBatchSize": 8, "trainIters": 26}))
    rendered = flags(megatron_args(job))
    ours = flags(H.trainer_args("llama8b", tp=tp, pp=pp, mbs=1, gbs=8, iters=26))
    for name, value in TRAINER_DEFAULTS.items():
        for side in (rendered, ours):
            if side.get(name) == value:
                del side[name]
    differ = {k: (rendered.get(k), ours.get(k)) for k in set(rendered) | set(ours)
              if k not in RUN_CHOICES and rendered.get(k) != ours.get(k)}
    assert differ == {}
    # the default is the local path: no sequence parallelism unless asked (the operator's default: values.impl)
    assert "--sequence-parallel-auto" not in ours and "--sequence-parallel" not in ours
    assert ours.get("--transformer-impl") == ["local"]


def test_no_sp_marker_leaves_sequence_parallelism_out_and_never_reaches_the_trainer():
    argv = H.trainer_args("llama8b", tp=2, mbs=1, gbs=8, extra=[H.NO_SP])
    assert not [a for a in argv if a.startswith("--sequence-parallel")] and H.NO_SP not in argv
    argv = H.trainer_args("llama8b", tp=2, mbs=1, gbs=8, extra=["--sequence-parallel"])
    assert [a for a in argv if a.startswith("--sequence-parallel")] == ["--sequence-parallel"]
    env, extra = PF.variant_for("foreach", 2)  # the perf scenario's variants keep their meaning
    assert not [a for a in H.trainer_args("gpt1b", tp=2, extra=extra) if a.startswith("--sequence-parallel")]
    env, extra = PF.variant_for("sp", 2)
    assert H.trainer_args("gpt1b", tp=2, extra=extra).count("--sequence-parallel") == 1


def test_profile_breakdown_counts_exposed_communication(tmp_path):
    """The threeway profile's breakdown: NCCL time that no compute kernel runs beside is "exposed";
    compute busy is the union of the other kernels (streams overlap)."""
    import gzip
    import json

    events = [  # microseconds: two GEMMs on two streams overlap; an all-gather half under the second GEMM
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "nvjet_gemm", "ts": 50, "dur": 100},
        {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 100, "dur": 100},
        {"cat": "kernel", "name": "ncclDevKernel_ReduceScatter", "ts": 300, "dur": 40},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
    ]
    with gzip.open(tmp_path / "rank0.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = MC.profile_breakdown(tmp_path)["rank0"]
    assert got["compute_busy_ms"] == 0.15 and got["nccl_exposed_ms"] == 0.09
    assert (got["gpu_span_ms"], got["gpu_busy_ms"]) == (0.34, 0.24)
    assert MC.covered(0, 10, MC.merged([(2, 4), (3, 6), (8, 20)])) == 6


def test_profile_categories_keep_compiled_kernels_out_of_copies():
    """torch.compile's kernel names list the ops they fuse ("cat", "_to_copy"): they are "compiled", not
    copies; a real copy stays a copy."""
    cat = {name: MC.kernel_category(name) for name in ("triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split_0",
                        "triton_poi_fused__to_copy_add_cat_cos_mul_neg_sin_split_0",
                        "void at::native::CatArrayBatchedCopy_vectorized", "Memcpy HtoD (Pinned -> Device)")}
    assert list(cat.values()) == ["compiled", "compiled", "copy", "copy"]


def test_megatron_lm_iteration_2_line_is_read_as_iteration_2_alone():
    """Megatron-LM's line for iteration 2 is the mean of iterations 1 and 2 (its training_log does not reset
    after the first line). Call 17 of 2026-11-26 (docs/benchmarks/megatron-lm.md#2026-11-26-iteration-2-log-line):
    Megatron-LM logged 12.5837, 12.58955; ours with Megatron-LM's forward logged 12.5837, 12.5954 for the same
    two iterations."""
    logged = [12.5837, 12.58955, 7.225383, 6.792102, 1.967173]
    assert H.mlm_losses_per_iteration(logged) == [12.5837, 12.5954, 7.225383, 6.792102, 1.967173]
    assert logged[1] == 12.58955  # the logged list is left as it was
    assert H.mlm_losses_per_iteration([12.5]) == [12.5] and H.mlm_losses_per_iteration([]) == []


@pytest.mark.parametrize("name", sorted(MC.THREEWAY_VARIANTS))
def test_every_threeway_variant_is_a_command_line_and_environment_the_trainer_accepts(name):
    """A variant is only a measurement if the trainer runs it as named: its flags parse with the trainer's own
    parser (argparse keeps the last of a repeated flag, so mbs2's --micro-batch-size wins) and its environment
    with the trainer's own reader."""
    from megatron_trainer.config import parse_args, runtime_from_env

    env, extra = MC.THREEWAY_VARIANTS[name]
    cfg = parse_args(H.trainer_args("llama8b", tp=2, mbs=1, gbs=8, iters=26, extra=extra))
    runtime = runtime_from_env(env)
    if name == "mbs2":
        assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (2, 8)
    if name == "ropeexact":
        assert runtime.compile_rope and runtime.rope_exact
    if name == "ropefast":
        assert runtime.compile_rope and not runtime.rope_exact
    if name in ("norope", "mlmfwd", "mlmlike"):
        assert not runtime.compile_rope


def test_megatron_lm_variants_of_both_loops_are_variants_of_ours_too():
    """A Megatron-LM variant that changes the run's shape (mbs2) is compared with ours' variant of the same name."""
    assert "mbs2" in MC.MLM_VARIANTS and MC.MLM_VARIANTS["mbs2"] == MC.THREEWAY_VARIANTS["mbs2"][1]


def test_compare_with_mlm_reproduces_the_recorded_figures_of_call_20():
    """mlm_compare.compare_with_mlm, on call 20's recorded runs (bench/results/llama_gpu_runs_2026-11-26.json), gives the
    speed-ups and loss differences the suite recorded then; a run without figures sets nothing."""
    import json

    results = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" /
                          "llama_gpu_runs_2026-11-26.json").read_text())
    tp2 = next(c for c in results["calls"] if c["call"] == 20)["results"]["threeway"]["tp2"]
    out: dict = {}
    MC.compare_with_mlm(out, tp2["ours_mbs2"], tp2["megatron_lm_mbs2"], "speedup", "losses")
    assert out == {"speedup": tp2["ours_mbs2_speedup_vs_megatron_lm_mbs2"],
                   "losses": tp2["ours_mbs2_losses_1_5_max_abs_diff_vs_megatron_lm_mbs2"]}
    MC.compare_with_mlm(out := {}, tp2["ours"], tp2["megatron_lm"], "speedup", "losses")
    assert out == {"speedup": tp2["ours_speedup_vs_megatron_lm"], "losses": tp2["losses_1_5_max_abs_diff_vs_megatron_lm"]}
    MC.compare_with_mlm(out := {}, {"rc": 1}, tp2["megatron_lm"], "speedup", "losses")
    assert out == {}


def test_reruns_give_ours_spread_against_itself_on_call_24():
    """Call 24 ran the default twice (`again`) and the unfused attention twice (`unfused`, `unfusedagain`):
    the default moved by 2.84e-3 (iteration 4), the unfused runs not at all."""
    import json

    results = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" /
                          "llama_gpu_runs_2026-11-26.json").read_text())
    dp2 = next(c for c in results["calls"] if c["call"] == 24)["results"]["threeway"]["dp2"]
    runs = {k: v for k, v in dp2.items() if k.startswith("ours") and isinstance(v, dict)}
    out = dict(runs)
    MC.compare_reruns(out, {"again", "unfused", "unfusedagain"})
    assert out["ours_again_losses_1_5_max_abs_diff_vs_ours"] == 0.00284
    assert out["ours_unfusedagain_losses_1_5_max_abs_diff_vs_ours_unfused"] == 0.0
    assert 0.99 < out["ours_again_speed_vs_ours"] < 1.01
    assert set(out) - set(runs) == {"ours_again_losses_1_5_max_abs_diff_vs_ours", "ours_again_speed_vs_ours",
                                    "ours_unfusedagain_losses_1_5_max_abs_diff_vs_ours_unfused",
                                    "ours_unfusedagain_speed_vs_ours_unfused"}  # unfused is not a rerun


@pytest.mark.parametrize("model", sorted(H.MODELS))
@pytest.mark.parametrize("layout", [name for name, _, _ in C.layouts_for(2)])
def test_every_suite_model_is_a_command_line_the_trainer_accepts_at_every_2_gpu_layout(model, layout):
    """A scenario given --model runs the model at tp2, pp2 and dp2 with reference_run's batch: the trainer must
    take that command line (its parser and its checks of heads, query groups and batch against the layout),
    and a Llama model must reach the trainer with its architecture (RoPE, GQA, SwiGLU, RMSNorm)."""
    from megatron_trainer.config import parse_args, world_layout

    tp, pp = {name: (t, p) for name, t, p in C.layouts_for(2)}[layout]
    m = H.MODELS[model]
    dp = 2 // (tp * pp)
    cfg = parse_args(H.trainer_args(model, tp=tp, pp=pp, mbs=m["mbs"], gbs=m["mbs"] * dp * (2 * pp if pp > 1 else 1)))
    assert world_layout(cfg, 2).data_parallel == dp
    if m.get("arch") == "llama":
        mc = cfg.model
        assert (mc.position_embedding_type, mc.effective_num_query_groups, mc.swiglu, mc.normalization) == \
            ("rope", m["groups"], True, "RMSNorm")
    else:
        assert cfg.model.position_embedding_type == "learned_absolute"


@pytest.mark.parametrize("name", sorted(PF.DETCOST_VARIANTS))
def test_detcost_variants_are_command_lines_and_environments_the_trainer_accepts(name):
    from megatron_trainer.config import parse_args, runtime_from_env

    extra, env = PF.DETCOST_VARIANTS[name]
    cfg = parse_args(H.trainer_args("gpt1b", tp=2, mbs=4, gbs=4, iters=12, extra=extra))
    runtime = runtime_from_env(env)
    assert cfg.training.deterministic_mode == (name != "default")
    assert runtime.deterministic_attention == ("math" if name == "deterministic_math" else "flash")


def test_the_sdpa_kernel_line_is_read_from_a_trainer_log():
    log = "x\nINFO megatron_trainer.attention: SDPA kernel (first forward, layer 1): FLASH_ATTENTION\niteration 1/"
    assert H.sdpa_kernel(log) == "FLASH_ATTENTION"
    assert H.sdpa_kernel("attention=Megatron DotProductAttention (unfused, materialises s x s)") is None
