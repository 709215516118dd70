"""Issue 59's Transformer Engine scenarios (e2e/gpu/te.py) without a GPU: every command line they run parsed by the
trainer's own config (and the refusal te_paths expects made by the trainer's own decision), the model matching the
issue's figures, Megatron-LM's runs on both specs, the log parsing, the order of the runs and the suite's flags."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "gpu"))
import harness as H
import suite as S
import te as T
from megatron_trainer.config import parse_args
from megatron_trainer.exitcodes import ExitCode, Refusal, fatal_message
from megatron_trainer.te_path import TeKernels, plan

CUDNN_ONLY = TeKernels(flash=False, fused=True, unfused=True)  # the issue's H200: no flash-attn


def test_the_bench_model_is_the_issues_and_reproduces_its_figures():
    """llama_mha4b is issue 59's model: 3.8B parameters, and its ms/iteration give the issue's MFU (Megatron-LM 0.19's
    formula): ours local 794 ms 49.1 %, ours TE 1078 ms 36.2 %, Megatron-LM on TE 1157 ms 33.7 %."""
    m = H.MODELS["llama_mha4b"]
    per_layer = 4 * m["hidden"] ** 2 + 3 * m["hidden"] * m["ffn"]  # MHA: q, k, v, o all h x h; SwiGLU
    assert m["heads"] == m["groups"] == 24 and m["hidden"] // m["heads"] == 128
    assert round((m["layers"] * per_layer + 2 * m["hidden"] * m["vocab"]) / 1e9, 2) == 3.83
    assert T.gbs_of("llama_mha4b") == 8 and m["seq"] == 2048
    for ms, mfu in ((794, 49.1), (1078, 36.2), (1157.1, 33.7)):
        assert round(H.throughput_fields("llama_mha4b", 8, ms, 1)["mfu_pct_megatron"], 1) == mfu


def test_the_fp8_model_is_llama_3_8bs_layer_and_fits_one_h200():
    m = H.MODELS["llama8b_l16"]
    eight_b = H.MODELS["llama8b"]
    assert {k: m[k] for k in ("hidden", "heads", "groups", "ffn", "vocab", "seq")} == \
        {k: eight_b[k] for k in ("hidden", "heads", "groups", "ffn", "vocab", "seq")}
    h, q, k = m["hidden"], m["heads"] * 128, m["groups"] * 128
    params = m["layers"] * (h * (q + 2 * k) + q * h + 3 * h * m["ffn"]) + 2 * h * m["vocab"]
    assert 4.5e9 < params < 4.6e9 and params * 18 / 2**30 < 80  # weights, fp32 main copy, grads, Adam: < 80 GiB


@pytest.mark.parametrize("key", list(T.BENCH_OURS) + sorted(T.TE_VARIANTS))
def test_every_run_of_ours_in_te_bench_is_the_trainers_command_line(key):
    variant = T.BENCH_OURS.get(key) or T.TE_VARIANTS[key]
    cfg = parse_args(T.ours_argv("llama_mha4b", 26, variant.flags))
    m, t = cfg.model, cfg.training
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.effective_num_query_groups) == (32, 3072, 24, 24)
    assert (m.effective_ffn_hidden_size, m.seq_length, m.vocab_size, m.swiglu) == (8192, 2048, 32768, True)
    assert (t.global_batch_size, t.train_iters, t.precision, t.use_distributed_optimizer) == (8, 26, "bf16", True)
    local = "--transformer-impl" in variant.flags
    assert t.transformer_impl == ("local" if local else "transformer_engine")
    assert t.attention_backend == ("unfused" if key == "te_unfused" else "flash")  # the CRD's default
    assert t.micro_batch_size == (2 if key == "te_mbs2" else 1)
    assert variant.hide_te == (key == "local_without_te")


def test_te_bench_runs_megatron_lm_on_te_first_then_ours_on_both_paths():
    keys = [(k, program) for k, program, _ in T.bench_plan(("te_nofusion",))]
    assert keys == [("megatron_lm_te", "te"), ("ours_te", "ours"), ("ours_local", "ours"),
                    ("megatron_lm_local", "local"), ("ours_te_nofusion", "ours")]


def test_the_fp8_runs_differ_from_bf16_only_in_the_fp8_flags():
    runs = T.fp8_runs(T.FP8_RECIPES)
    assert list(runs) == ["bf16", "fp8_delayed", "fp8_tensorwise"]
    base = T.ours_argv("llama8b_l16", 20)
    for key, variant in runs.items():
        argv = T.ours_argv("llama8b_l16", 20, variant.flags)
        assert argv[:len(base)] == base
        t = parse_args(argv).training
        assert (t.fp8_format, t.fp8_recipe) == ((None, "delayed") if key == "bf16" else ("hybrid", key[4:]))
        assert (t.transformer_impl, t.micro_batch_size, t.global_batch_size) == ("transformer_engine", 1, 8)


def test_te_paths_expects_the_refusal_the_trainer_makes():
    """te_paths' refused run (--attention-backend local on TE) parses, and the trainer's own plan refuses it with the
    line REFUSAL_RE looks for in the log (main prints 'megatron_trainer: ' + fatal_message's line)."""
    cfg = parse_args(T.ours_argv("llama_small", 12, ("--attention-backend", "local")))
    with pytest.raises(Refusal) as exc:
        plan(cfg, CUDNN_ONLY, {})
    line = "megatron_trainer: " + fatal_message(exc.value, ExitCode.BAD_ARGUMENTS, 0, "building the model")
    assert "\n" not in line and T.REFUSAL_RE.match(line)
    for backend in ("flash", "unfused", "fused", "auto"):
        cfg = parse_args(T.ours_argv("llama_small", 12, ("--attention-backend", backend)))
        assert plan(cfg, CUDNN_ONLY, {}).attention_backend == ("fused" if backend == "flash" else backend)


def _fake_mlm(monkeypatch, tmp_path) -> list:
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"]))
        return subprocess.CompletedProcess(cmd, 0, "MLM RESULT iter_ms=1157.1 MFU=33.70% losses1_5=[10.0, 9.0, 8.5, "
                                                   "8.0, 7.5]\n", "")

    monkeypatch.setattr(H.subprocess, "run", run)
    monkeypatch.setattr(H, "WORK", tmp_path)
    monkeypatch.setattr(H, "LOGS", tmp_path / "logs")
    H.LOGS.mkdir()
    return calls


@pytest.mark.parametrize("impl", ["te", "local"])
def test_megatron_lm_runs_on_te_with_its_own_rope_fusion_and_locally_without(monkeypatch, tmp_path, impl):
    calls = _fake_mlm(monkeypatch, tmp_path)
    monkeypatch.delenv("TE_SITE", raising=False)
    got = H.run_mlm_peer(f"unit_{impl}", 1, "llama_mha4b", 1, 1, 8, "0", impl=impl)
    (cmd, env), = calls
    assert got["iter_ms"] == 1157.1 and got["losses_1_5"][1] == 8.0  # iteration 2's line is the mean of 1 and 2
    assert (env.get("MLM_IMPL"), env.get("TE_SITE")) == (("te", "/opt/te-site") if impl == "te" else (None, None))
    assert (env["LAYERS"], env["HIDDEN"], env["HEADS"], env["FFN"], env["SEQ"], env["VOCAB"], env["MBS"], env["GBS"]) \
        == ("32", "3072", "24", "8192", "2048", "32768", "1", "8")
    assert ("--no-rope-fusion" in cmd) == (impl == "local")
    assert cmd[cmd.index("--num-query-groups") + 1] == "24" and "--swiglu" in cmd


def test_the_local_path_without_te_leaves_only_tes_site_off_pythonpath():
    assert T.without_te("/opt/megatron-site:/opt/te-site:/repo/trainer_image", "/opt/te-site") == \
        "/opt/megatron-site:/repo/trainer_image"
    assert T.without_te("/opt/te-site/", "/opt/te-site") == ""


def _log(iters: int, path: str, base_ms: float = 1000.0) -> str:
    lines = [f"[2026-12-01 10:00:00,000 rank0] INFO megatron_trainer.loop: megatron_trainer: {path}"]
    for i in range(1, iters + 1):
        lines.append(f" [2026-12-01 10:00:{i:02d}] iteration {i:8d}/{iters:8d} | consumed samples: {8 * i:12d} | "
                     f"elapsed time per iteration (ms): {base_ms + i:.1f} | throughput per GPU (TFLOP/s/GPU): 300.0 | "
                     f"learning rate: 3.000000E-04 | global batch size:     8 | lm loss: {11 - i / 10:.6E} | "
                     f"grad norm: {2.5:.3f} | number of skipped iterations:   0 | mem GiB (alloc/peak): 50.00/{70 + i:.2f} |")
    lines.append("[2026-12-01 10:01:00,000 rank0] INFO megatron_trainer.loop: startup: process start -> first "
                 "iteration done: 42.5 s (interpreter and imports 10.0 s)")
    lines.append("TRAINER_SUMMARY " + json.dumps({"max_peak_allocated_gib": 96.0}))
    return "\n".join(lines) + "\n"


def test_a_run_of_ours_is_read_from_its_log():
    # the line ModelPath.describe() writes on the TE path (tests/trainer/test_te_path_torch.py pins it)
    path = ("transformer_impl=transformer_engine, attention=TE's fused attention (cuDNN) for --attention-backend flash, "
            "wgrad accumulation fusion=torch")
    got = T.parse_ours(_log(26, path), "llama_mha4b", 26)
    assert (got["path"], got["wgrad_fusion"]) == ("transformer_engine", "torch")
    assert got["attention"] == "TE's fused attention (cuDNN) for --attention-backend flash"
    assert got["iter_ms"] == 1012.0  # median of iterations 4..20
    assert got["losses_1_5"] == [10.9, 10.8, 10.7, 10.6, 10.5] and got["grad_norms"] == ["2.500"] * 26
    assert (got["peak_alloc_gib"], got["max_peak_allocated_gib"], got["startup_to_first_iteration_s"]) == (96.0, 96.0, 42.5)
    assert got["mfu_pct_megatron"] == H.throughput_fields("llama_mha4b", 8, 1012.0, 1)["mfu_pct_megatron"]
    local = T.parse_ours(_log(26, "transformer_impl=local, attention=SDPA (cudnn>flash>efficient), wgrad accumulation "
                                  "fusion=torch, MoE experts=x"), "llama_mha4b", 26)
    assert (local["path"], local["attention"], local["wgrad_fusion"]) == ("local", "SDPA (cudnn>flash>efficient)", "torch")


def test_speedups_and_the_first_module_that_parts():
    assert T.speedup({"iter_ms": 1157.1}, {"iter_ms": 794.0}) == 1.457
    assert T.speedup({"iter_ms": None}, {"iter_ms": 794.0}) is None
    modules = [{"module": "embedding", "max_abs_diff": 0.0, "scale": 1.0},
               {"module": "layer0.attention", "max_abs_diff": 5e-7, "scale": 1.0},
               {"module": "layer0.mlp", "max_abs_diff": 3e-5, "scale": 2.0}]
    assert T.first_module_over(modules) == "layer0.mlp"
    assert T.first_module_over(modules[:2]) is None


def test_the_hf_variants_and_the_te_command_line_of_hf_cpu_check():
    assert T.HF_VARIANTS["tf32override0"] == ((("NVIDIA_TF32_OVERRIDE", "0"),), None)
    assert T.HF_VARIANTS["torchtf32"][1] == "on" and T.HF_VARIANTS["asis"] == ((), None)
    config = json.loads((H.REPO / "tests" / "fixtures" / "hf" / "tiny-qwen3-moe.json").read_text())
    for precision in ("fp32", "bf16"):
        cfg = parse_args(T.hc.trainer_argv(config, 1, 1, precision, impl="te"))
        assert (cfg.training.transformer_impl, cfg.training.attention_backend) == ("transformer_engine", "auto")
        # auto on TE: its fused kernels for bf16, its unfused one for fp32, as TE decides for the dtype
        unfused_only = TeKernels(flash=False, fused=precision != "fp32", unfused=True)
        assert plan(cfg, unfused_only, {}).attention_backend == "auto"
    assert set(T.HF_ARCHS) <= {p.stem for p in (H.REPO / "tests" / "fixtures" / "hf").glob("*.json")}


def test_the_suite_passes_the_te_flags_and_refuses_unknown_names():
    ns = argparse.Namespace(te_backends="flash,unfused", te_model="llama_mha4b", te_iters=26, te_variants="te_mbs2",
                            te_hf_variants="asis", te_hf_archs="tiny-llama3", te_fp8_model="llama8b_l16",
                            te_fp8_iters=20, te_fp8_recipes="delayed,tensorwise")
    assert S.te_ctx(ns) == {"te_backends": ("flash", "unfused"), "te_model": "llama_mha4b", "te_iters": 26,
                            "te_variants": ("te_mbs2",), "te_hf_variants": ("asis",), "te_hf_archs": ("tiny-llama3",),
                            "te_fp8_model": "llama8b_l16", "te_fp8_iters": 20, "te_fp8_recipes": ("delayed", "tensorwise")}
    for flag in ("--te-variants", "--te-hf-variants", "--te-fp8-recipes", "--te-backends"):
        p = subprocess.run([sys.executable, str(Path(S.__file__)), "--out", "/tmp/x", flag, "nope"], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and f"{flag}: unknown ['nope']" in p.stderr, p.stderr


@pytest.mark.parametrize("name, seconds", [("te_paths", 150), ("te_bench", 480), ("te_hf_logits", 300), ("te_fp8", 420)])
def test_each_te_scenario_fits_one_device_call(name, seconds):
    """A device call runs at most 10 minutes; the suite's default deadline is 540 s: each scenario alone fits."""
    scenario = S.SCENARIOS[name]
    assert scenario.seconds == seconds and scenario.min_gpus == 1
    assert S.skip_reason(scenario, 1, 1, 540) is None


class _FakeRun:
    """Stands in for harness.Run: the trainer's log as its command line would make it (parse_args must accept the
    command line; the TE path unless --transformer-impl local; an exit-2 refusal line for --attention-backend local)."""

    seen: list = []

    def __init__(self, name, nproc, args, env=None, gpus=None, grace_period_s=None, **_):
        cfg = parse_args(args)
        _FakeRun.seen.append((name, args, env or {}, grace_period_s))
        self.started, t = 0.0, cfg.training
        if t.attention_backend == "local":
            self.rc, self._text = 2, ("[x rank0] INFO megatron_trainer.loop: starting\nmegatron_trainer: rank 0: exit 2 "
                                      "(bad command line or environment; not retried) during building the model: "
                                      "Refusal: --attention-backend local is ...\nmegatron_trainer.launch: exit 2\n")
            return
        path = "transformer_impl=local, attention=SDPA (cudnn>flash>efficient)" if t.transformer_impl == "local" else \
            f"transformer_impl=transformer_engine, attention=TE's {t.attention_backend}"
        ms = 900.0 if t.transformer_impl == "local" else 1000.0
        self.rc, self._text = 0, _log(t.train_iters, path + ", wgrad accumulation fusion=torch", ms)

    def wait(self, timeout):
        return self.rc

    def close(self):
        pass

    def text(self):
        return self._text


@pytest.fixture
def an_hour_left():
    """The suite's deadline an hour away (DEADLINE is changed in place, as suite.py does), restored after."""
    import time

    saved = H.DEADLINE[0]
    H.DEADLINE[0] = time.monotonic() + 3600
    yield
    H.DEADLINE[0] = saved


def test_each_scenario_runs_through_with_stand_ins_for_the_gpu(monkeypatch, an_hour_left):
    """The four scenarios end to end, TE's import check, the trainer, Megatron-LM and hf_cpu_check replaced by
    stand-ins: what each runs, in which order, and what it reports and checks."""
    monkeypatch.setattr(T, "te_problem", lambda: None)
    monkeypatch.setattr(T, "Run", _FakeRun)
    _FakeRun.seen = []
    mlm = []

    def fake_mlm(name, gpus, model, tp, pp, gbs, visible, iters=26, impl="local", **_):
        mlm.append((name, model, gbs, impl))
        return {"rc": 0, "iter_ms": 1157.1 if impl == "te" else 1648.9, "losses_1_5": [10.0] * 5}

    monkeypatch.setattr(T, "run_mlm_peer", fake_mlm)
    paths = T.scenario_te_paths({"te_backends": ("flash", "unfused")})
    assert paths["ok"], paths["failures"]
    assert [s[0] for s in _FakeRun.seen] == ["te_paths_flash", "te_paths_unfused", "te_paths_refused_local"]
    assert all(s[3] == 30 for s in _FakeRun.seen)  # through the pods' launcher
    assert paths["refused_local"]["rc"] == 2 and paths["refused_local"]["line"].startswith("megatron_trainer: rank 0")

    _FakeRun.seen = []
    bench = T.scenario_te_bench({"te_model": "llama_mha4b", "te_iters": 26, "te_variants": ("local_without_te",)})
    assert bench["ok"], bench["failures"]
    assert mlm == [("te_bench_megatron_lm_te", "llama_mha4b", 8, "te"), ("te_bench_megatron_lm_local", "llama_mha4b", 8,
                                                                         "local")]
    assert [s[0] for s in _FakeRun.seen] == ["te_bench_ours_te", "te_bench_ours_local", "te_bench_ours_local_without_te"]
    assert "/opt/te-site" not in _FakeRun.seen[2][2]["PYTHONPATH"]
    assert (bench["ours_te"]["iter_ms"], bench["ours_local"]["iter_ms"]) == (1012.0, 912.0)
    assert bench["speedups"]["ours_local_over_megatron_lm_te"] == round(1157.1 / 912.0, 3)
    assert bench["megatron_lm_te"]["mfu_pct_megatron"] == 33.72 and "text" not in bench["ours_te"]

    _FakeRun.seen = []
    fp8 = T.scenario_te_fp8({"te_fp8_model": "llama8b_l16", "te_fp8_iters": 20})
    assert fp8["ok"], fp8["failures"]
    assert [s[0] for s in _FakeRun.seen] == ["te_fp8_bf16", "te_fp8_fp8_delayed", "te_fp8_fp8_tensorwise"]
    assert fp8["fp8_delayed"]["max_abs_loss_diff_1_5"] == 0.0 and fp8["fp8_delayed"]["speedup_over_bf16"] == 1.0

    hf_calls = []

    def fake_hc_run(archs, tp, pp, precisions, device, work, impl, diagnose, tf32):
        hf_calls.append((tuple(archs), precisions, device, impl, diagnose, tf32, os.environ.get("NVIDIA_TF32_OVERRIDE")))
        fp32_diff = 1e-6 if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0" else 3e-4
        return [{"arch": a, "tp": 1, "pp": 1, "precision": p, "max_abs_diff": fp32_diff if p == "fp32" else 0.01,
                 "max_abs_diff_vs_fp32_hf": 0.01, "hf_bf16_vs_fp32": 0.01, "logit_scale": 1.0, "argmax_equal": 1.0,
                 "roundtrip": {"not_identical": [], "extra": [], "config_equal": True, "tensors": 3, "exported": 3},
                 **({"modules": [{"module": "layer0.attention", "max_abs_diff": fp32_diff, "scale": 1.0}]}
                    if p == "fp32" else {})} for a in archs for p in precisions]

    monkeypatch.setattr(T.hc, "run", fake_hc_run)
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    hf = T.scenario_te_hf_logits({})
    assert [c[-2:] for c in hf_calls] == [(None, None), (None, "0"), ("on", None)]
    assert all(c[1:5] == (("fp32", "bf16"), "cuda", "te", True) for c in hf_calls)
    assert "NVIDIA_TF32_OVERRIDE" not in os.environ  # restored
    # the verdict is TF32-off's (TE's fp32 GEMMs are TF32 by design); "asis" keeps its failures as information
    assert hf["ok"] and hf["failures"] == [] and hf["tf32override0"]["failures"] == []
    assert hf["asis"]["failures"] == [f"{a} tp1pp1 fp32: fp32 max |diff| 3.00e-04 > 0.0001" for a in T.HF_ARCHS]
    assert hf["asis"]["fp32_max_abs_diff"]["tiny-llama3"] == 3e-4
    assert hf["asis"]["results"][0]["first_module_over_1e-6"] == "layer0.attention"
