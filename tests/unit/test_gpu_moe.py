"""Issue 50's MoE scenarios (e2e/gpu/moe.py) without a GPU: the MFU-by-active-parameters arithmetic against hand
computed figures and the published active-parameter counts, both command lines (ours parsed by the trainer's own
config, Megatron-LM's carrying the same model and MoE flags), the peer script run against a stand-in torchrun,
and the result's parsing and table."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "gpu"))
import moe as M
from megatron_trainer import config as C
from megatron_trainer import flops

ROOT = Path(__file__).resolve().parents[2]

# The published models, whole: Mixtral-8x7B (32 layers, vocabulary 32000) and Qwen3-30B-A3B (48 layers, 151936).
MIXTRAL_8X7B = dict(M.MOE_MODELS["mixtral"], layers=32)
QWEN3_30B_A3B = dict(M.MOE_MODELS["qwen3"], layers=48)


def test_mixtral_8x7b_active_parameters_by_hand():
    # h = 4096, q = 32 x 128 = 4096, k = 8 x 128 = 1024, E = 8, top-2, F = 14336, V = 32000
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096  # 25,165,824 + 16,777,216
    experts = 2 * 3 * 4096 * 14336  # 352,321,536
    router = 4096 * 8
    got = M.moe_active_params(MIXTRAL_8X7B)
    assert (got["attention_per_layer"], got["experts_per_layer"], got["router_per_layer"]) == (41_943_040, experts,
                                                                                              router)
    assert got["per_layer"] == attention + experts + router == 394_297_344
    assert got["total"] == 32 * 394_297_344 + 2 * 4096 * 32000 == 12_879_659_008
    assert abs(got["total"] / 12.9e9 - 1) < 0.01  # Mistral's "12.9B active parameters"


def test_qwen3_30b_a3b_active_parameters_by_hand():
    # h = 2048, q = 32 x 128 = 4096, k = 4 x 128 = 512, E = 128, top-8, F = 768, V = 151936, untied
    got = M.moe_active_params(QWEN3_30B_A3B)
    assert got["attention_per_layer"] == 2048 * (4096 + 1024) + 4096 * 2048 == 18_874_368
    assert got["experts_per_layer"] == 8 * 3 * 2048 * 768 == 37_748_736
    assert got["router_per_layer"] == 2048 * 128 == 262_144
    assert got["total"] == 48 * 56_885_248 + 2 * 2048 * 151936 == 3_352_821_760
    assert abs(got["total"] / 3.3e9 - 1) < 0.02  # Qwen's "3.3B activated"


def test_mfu_by_active_parameters_for_the_cut_mixtral_by_hand():
    m = M.shape_for("mixtral")  # 4 layers, 32 x 4096 tokens an iteration
    # 6 x (4 x 394,297,344 + 4096 x 32000) + 6 x 4 x 4096 x 4096 (the causal attention)
    per_token = 6 * 1_708_261_376 + 402_653_184
    assert M.moe_flops_per_token(m, M.padded_vocab(m, 1)) == per_token == 10_652_221_440
    got = M.moe_throughput(m, tp=1, gbs=32, iter_ms=2000.0, gpus=2)
    # 131,072 tokens in 2 s on 2 GPUs: 32,768 tokens/s/GPU x 10.65 GFLOP = 349.1 TFLOP/s = 35.29 % of 989
    assert got == {"tokens_per_s_per_gpu": 32768, "tflops_per_gpu": 349.1, "mfu_pct_active_params": 35.29}


@pytest.mark.parametrize("shape", sorted(M.MOE_MODELS))
def test_the_flops_are_megatron_lms_formula_plus_the_router(shape):
    """megatron_trainer.flops' Megatron-LM formula (routed experts as ffn x top-k) and the router's 6 h E a layer."""
    m, vocab = M.shape_for(shape), M.padded_vocab(M.shape_for(shape), 1)
    tokens = m["gbs"] * m["seq"]
    megatron = flops.megatron_flops_per_iteration(m["gbs"], m["seq"], m["layers"], m["hidden"], m["heads"],
                                                  m["groups"], m["moe_ffn"], vocab, swiglu=True,
                                                  kv_channels=m["head_dim"], moe_topk=m["topk"])
    router = 6 * m["layers"] * m["hidden"] * m["experts"]
    assert M.moe_flops_per_token(m, vocab) * tokens == pytest.approx(megatron + router * tokens, rel=1e-12)


def test_padded_vocab_is_megatrons():
    assert M.padded_vocab(M.MOE_MODELS["qwen3"], 1) == 151936  # 1187 x 128
    assert M.padded_vocab(M.MOE_MODELS["qwen3"], 2) == 152064 == flops.padded_vocab_size(151936, 128, 2)


@pytest.mark.parametrize("layout", sorted(M.MOE_LAYOUTS))
@pytest.mark.parametrize("shape", sorted(M.MOE_MODELS))
def test_the_trainer_accepts_ours_command_line(shape, layout):
    m = M.shape_for(shape)
    gpus, tp, ep = M.MOE_LAYOUTS[layout]
    cfg = C.parse_args(M.ours_args(m, layout, iters=15, warmup=5))
    got = cfg.model
    assert (got.num_experts, got.moe_router_topk, got.effective_moe_ffn_hidden_size, got.num_layers) == \
        (m["experts"], m["topk"], m["moe_ffn"], m["layers"])
    assert (got.normalization, got.position_embedding_type, got.swiglu, got.add_bias_linear) == \
        ("RMSNorm", "rope", True, False)  # the later flags win over model_args' dense defaults
    assert (got.head_dim, got.effective_num_query_groups, got.qk_layernorm) == (128, m["groups"], m["qk_norm"])
    assert (got.moe_token_dispatcher_type, got.moe_router_load_balancing_type, got.moe_aux_loss_coeff) == \
        ("alltoall", "aux_loss", m["aux_loss"])
    assert (cfg.parallel.tensor, cfg.parallel.expert) == (tp, ep)
    layout_of = C.world_layout(cfg, gpus)
    assert (layout_of.data_parallel, layout_of.num_microbatches) == (gpus // tp, m["gbs"] // (gpus // tp))


def flag_values(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    key = None
    for a in argv:
        if a.startswith("--"):
            key = a
            out[key] = []  # a repeated flag: the last one, as argparse takes it
        elif key is not None:
            out[key].append(a)
    return out


@pytest.mark.parametrize("layout", sorted(M.MOE_LAYOUTS))
@pytest.mark.parametrize("shape", sorted(M.MOE_MODELS))
def test_megatron_lm_gets_the_same_model_moe_flags_layout_and_schedule(shape, layout):
    m = M.shape_for(shape)
    _, tp, ep = M.MOE_LAYOUTS[layout]
    ours = flag_values(M.ours_args(m, layout, 15, 5))
    mlm = flag_values(M.mlm_args(m, layout, 15, 5))
    same = [f for f in ours if f.startswith(("--num-", "--moe-", "--hidden", "--ffn", "--seq-length", "--vocab", "--kv-",
                                             "--norm", "--position", "--rotary", "--swiglu", "--group", "--qk",
                                             "--disable-bias", "--untie", "--micro", "--global", "--train-iters",
                                             "--lr", "--min-lr", "--weight-decay", "--clip", "--adam", "--seed",
                                             "--bf16", "--tensor-model", "--expert-model", "--use-distributed"))]
    assert len(same) > 35
    assert {f: mlm.get(f) for f in same} == {f: ours[f] for f in same}
    assert mlm["--transformer-impl"] == ["local"] and "--moe-grouped-gemm" not in mlm
    assert ("--sequence-parallel" in mlm) == (tp > 1)
    assert mlm["--expert-model-parallel-size"] == [str(ep)] and mlm["--log-memory-interval"] == ["15"]


def test_dry_run_prints_both_command_lines_without_torch():
    code = ("import runpy, sys\nsys.modules['torch'] = None\n"
            "sys.argv = ['moe.py', '--dry-run', '--shape', 'mixtral', '--layout', 'tp2ep2']\n"
            f"sys.path.insert(0, {str(ROOT / 'e2e' / 'gpu')!r})\n"
            f"runpy.run_path({str(ROOT / 'e2e' / 'gpu' / 'moe.py')!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["ours"][:4] == ["torchrun", "--nproc-per-node=4", "-m", "megatron_trainer"]
    assert got["megatron_lm"][:3] == ["GPUS=4", "bash", "bench/mlm_moe_peer.sh"]
    assert got["ours_sequential_env"] == {"MEGATRON_TRAINER_MOE_EXPERTS": "sequential"}


def test_the_peer_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(M.PEER)], capture_output=True).returncode == 0


FAKE_PRETRAIN = '''import sys
print("args:", " ".join(sys.argv[1:]))
for i, (ms, loss) in enumerate([(900.0, 11.9), (450.5, 11.85), (400.25, 11.7)], 1):
    print(f" [2026-11-28 10:00:00] iteration        {i}/       3 | consumed samples: {32 * i} | "
          f"elapsed time per iteration (ms): {ms} | learning rate: 1.0E-04 | global batch size:    32 | "
          f"lm loss: {loss:.6E} | load_balancing_loss: 1.0E+00 | loss scale: 1.0 |")
    if i in (1, 3):
        print(f"[Rank 0] (after {i} iterations) memory (MB) | allocated: 1000.0 | max allocated: {2048.0 * i} |")
'''


def test_the_peer_script_reports_every_iteration_from_the_log(tmp_path):
    """bench/mlm_moe_peer.sh against a stand-in Megatron-LM tree and torchrun: the helpers copied out of the wheel,
    the arguments passed through, each iteration's time and loss and the memory reports in its RESULT line."""
    mlm = tmp_path / "mlm"
    (mlm / "megatron" / "core" / "datasets").mkdir(parents=True)
    (mlm / "pretrain_gpt.py").write_text(FAKE_PRETRAIN)
    wheel = tmp_path / "megatron_core-0.19.2-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so", b"\x7fELF")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun = bin_dir / "torchrun"  # drops its own options, runs the script
    torchrun.write_text(f'#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift 2; done\nexec {sys.executable} "$@"\n')
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "mlm.log"
    env = dict(os.environ, MLM_DIR=str(mlm), WHL=str(wheel), GPUS="2", LOG=str(log),
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    p = subprocess.run(["bash", str(M.PEER), "--num-experts", "8"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (mlm / "megatron" / "core" / "datasets" / "helpers_cpp.cpython-312-x86_64-linux-gnu.so").read_bytes() == \
        b"\x7fELF"
    got = json.loads(p.stdout.split("MLM_MOE RESULT ", 1)[1].splitlines()[0])
    assert got == {"rc": 0, "iter_ms": {"1": 900.0, "2": 450.5, "3": 400.25},
                   "losses": {"1": 11.9, "2": 11.85, "3": 11.7}, "max_allocated_mb": [2048.0, 6144.0],
                   "log": str(log)}
    assert "args: --num-experts 8" in log.read_text()


def test_timed_window_leaves_the_warm_up_out():
    got = M.timed_window({1: 5000.0, 2: 900.0, 3: 110.0, 4: 100.0, 5: 90.0}, warmup=2)
    assert got == {"iter_ms": 100.0, "iter_ms_mean": 100.0, "timed_iterations": [3, 4, 5]}
    assert M.timed_window({1: 5000.0}, warmup=2) == {"iter_ms": None, "timed_iterations": []}


def test_router_figures_from_the_trainers_gauges():
    text = "\n".join([
        "# HELP megatron_trainer_moe_expert_token_share MoE: share ...",
        'megatron_trainer_moe_expert_token_share{expert="0"} 0.3',
        'megatron_trainer_moe_expert_token_share{expert="1"} 0.2',
        'megatron_trainer_moe_expert_token_share{expert="2"} 0.25',
        'megatron_trainer_moe_expert_token_share{expert="3"} 0.25',
        "megatron_trainer_moe_expert_load_max_over_mean 1.2",
        "megatron_trainer_moe_idle_experts 0.0",
        "megatron_trainer_iteration 15.0"])
    got = M.router_figures(text)
    assert got["moe_expert_token_share"] == [0.3, 0.2, 0.25, 0.25]
    assert (got["share_min"], got["share_max"], got["share_uniform"]) == (0.2, 0.3, 0.25)
    assert (got["moe_expert_load_max_over_mean"], got["moe_idle_experts"], got["iteration"]) == (1.2, 0.0, 15.0)
    assert got["moe_load_balancing_loss"] is None
    assert M.router_figures("") == {"moe_expert_load_max_over_mean": None, "moe_idle_experts": None,
                                    "moe_load_balancing_loss": None, "iteration": None}


def test_the_comparison_against_the_target_and_its_table(tmp_path):
    m = M.shape_for("qwen3")
    out = {"shape": "qwen3", "layout": "ep2", "gpus": 2, "tp": 1, "ep": 2, "dp": 2, "model": m, "global_batch": 32,
           "iterations": 15, "warmup_iterations": 5, "active_params": M.moe_active_params(m),
           "mfu_formula": "f",
           "ours": {"iter_ms": 1000.0, "losses_1_3": [12.0, 11.9, 11.8], "tokens_per_s_per_gpu": 1,
                    "mfu_pct_active_params": 9.0, "peak_alloc_gib_per_rank": [60.0, 61.0], "router": {}},
           "megatron_lm": {"iter_ms": 2500.0, "losses_1_3": [12.001, 11.95, 11.8], "tokens_per_s_per_gpu": 1,
                           "mfu_pct_active_params": 3.6, "peak_alloc_gib": 80.0},
           "ours_sequential": {"skipped": "deadline (needs ~300 s)"}}
    M.compare(out, "qwen3")
    assert out["ours_speedup_vs_megatron_lm"] == 2.5 and out["target"] == {"speedup_vs_megatron_lm": 2.0, "met": True}
    assert out["ours_losses_1_3_abs_diff_vs_megatron_lm"] == [0.001, 0.05, 0.0]
    assert "ours_sequential_speedup_vs_megatron_lm" not in out and "grouped_speedup_vs_sequential" not in out
    M.write_outputs(tmp_path, out)
    md = (tmp_path / "moe_qwen3_ep2.md").read_text()
    assert "| ours (grouped GEMM experts) | 1000.0 |" in md and "| 2.5 |" in md
    assert "| ours, SequentialMLP experts | deadline (needs ~300 s) |" in md
    assert json.loads((tmp_path / "moe_qwen3_ep2.json").read_text())["target"]["met"] is True


def test_the_suites_table_has_a_line_per_program():
    import harness as H

    result = {"ok": True, "layout": "ep2", "ours": {"iter_ms": 1000.0, "mfu_pct_active_params": 9.0},
              "megatron_lm": {"not_run": "--moe-skip-mlm"}, "ours_speedup_vs_megatron_lm": None,
              "target": {"speedup_vs_megatron_lm": 2.0, "met": None}}
    lines = H.render_table({"device": ["H200"], "gpus": 2, "moe_qwen3": result}).splitlines()
    moe_lines = [line for line in lines if line.startswith("  MOE")]
    assert len(moe_lines) == 4
    assert "ours" in moe_lines[0] and "1000.0 ms MFU 9.0%" in moe_lines[0]
    assert moe_lines[1].rstrip().endswith("--moe-skip-mlm")


@pytest.mark.parametrize("layout", sorted(M.RESUME_LAYOUTS))
@pytest.mark.parametrize("variant", sorted(M.RESUME_VARIANTS))
def test_the_trainer_accepts_every_resume_command_line(variant, layout):
    gpus, tp, ep = M.RESUME_LAYOUTS[layout]
    cfg = C.parse_args(M.resume_args(variant, tp, ep, gpus // tp, "/ckpt/x"))
    m = cfg.model
    assert (cfg.parallel.tensor, cfg.parallel.expert, m.num_experts, m.moe_router_topk) == (tp, ep, 8, 2)
    assert cfg.training.deterministic_mode and m.moe_token_dispatcher_type == "alltoall"
    assert (cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.training.train_iters) == ("/ckpt/x", 10, 40)
    layout_of = C.world_layout(cfg, gpus)
    assert layout_of.num_microbatches == 2  # the global batch is two micro-batches a data-parallel rank
    if variant == "softmax_aux_loss":
        assert (m.moe_router_score_function, m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == \
            ("softmax", "aux_loss", 1e-2)
        assert not m.moe_router_enable_expert_bias
    else:  # the aux loss's flags are out, not left to be ignored beside the expert bias
        assert (m.moe_router_score_function, m.moe_router_enable_expert_bias, m.moe_router_bias_update_rate) == \
            ("sigmoid", True, 0.001)
        assert (m.moe_router_load_balancing_type, m.moe_shared_expert_intermediate_size) == ("none", 1024)
        assert (m.moe_expert_capacity_factor, m.moe_token_drop_policy) == (1.5, "probs")
        assert "--moe-aux-loss-coeff" not in M.resume_args(variant, tp, ep, gpus // tp, "/ckpt/x")


def test_megatron_lm_is_not_run_for_moe_at_tp_above_one_and_the_reason_names_both_checks(monkeypatch):
    # found on 4 x H200: Megatron-LM's local spec refuses sequence parallelism, which MoE at TP > 1 needs
    assert "torch_norm.py" in M.MLM_NO_MOE_AT_TP and "moe_layer.py" in M.MLM_NO_MOE_AT_TP
    calls = []
    monkeypatch.setattr(M, "run_ours", lambda name, *a, **k: calls.append(name) or {
        "iter_ms": 1000.0, "losses_1_3": [1.0, 1.0, 1.0], "router": {}})
    monkeypatch.setattr(M, "run_mlm", lambda *a, **k: pytest.fail("Megatron-LM must not be launched at TP > 1"))
    ctx = {"moe_layout": "tp2ep2", "gpus": 4, "moe_iters": 15, "moe_warmup": 5, "moe_sequential": "off"}
    out = M.moe_compare(ctx, "mixtral")
    assert calls == ["moe_mixtral_tp2ep2_ours"]
    assert out["megatron_lm"] == {"not_run": M.MLM_NO_MOE_AT_TP} and out["ok"] and out["target"]["met"] is None
