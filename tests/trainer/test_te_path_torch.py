"""The Transformer Engine path's three crashes of issue 59, each held on CPUs with torch and Megatron-Core (TE itself
is not installable here: its kernels are a te_path.TeKernels, what te_path.probe reads from TE on the GPU):

1. the TE path's config without apex: Megatron-Core's own ColumnParallelLinear (GPTModel's output layer, on the TE
   spec too) refused gradient_accumulation_fusion, which the trainer turned on for TE whatever the extension;
2. a missing flash-attn (tests/trainer/test_te_path.py, pure);
3. a tensor grad_norm: Trainer.log_iterations formatted it with ':.3f' (TypeError).
And the refusal's one line: main prints it with no traceback, exit 2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MOCK_ARGV, require, without

torch = require("torch")
require("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
TE_ARGV = without(MOCK_ARGV, "--transformer-impl", "--position-embedding-type") + [
    "--transformer-impl", "transformer_engine", "--position-embedding-type", "rope"]


def _child(tmp_path: Path, body: str, gloo: bool = True, timeout: float = 180) -> tuple[dict, subprocess.CompletedProcess]:
    """`body` in a child process (CPU; with `gloo`, one gloo rank and Megatron's parallel state at TP = PP = 1); the
    JSON of its last output line, and the process."""
    setup = f"""
import os, sys, json, socket, torch
sys.path[:0] = [{str(ROOT / "trainer_image")!r}, {str(ROOT / "contract")!r}, {str(ROOT / "tests" / "trainer")!r}]
"""
    if gloo:
        setup += """
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1)
"""
    script = tmp_path / "child.py"
    script.write_text(setup + body)
    proc = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)
    lines = proc.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}), proc


def test_the_te_paths_config_without_apex_builds_megatron_cores_output_layer(tmp_path):
    """Crash 1. Without apex, weight-gradient accumulation is fused where the trainer's torch stand-in runs (CUDA)
    and off elsewhere, on the TE path as on the local one: GPTModel's output layer, Megatron-Core's
    ColumnParallelLinear on both specs, builds either way. The rule before the fix (the fusion on for TE whatever
    the extension) makes it raise Megatron-Core's error, and is now refused at start-up in one line instead."""
    got, proc = _child(tmp_path, f"""
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import layers
from megatron_trainer import model as M
from megatron_trainer.compat import TorchWgradAccumulation, patch_wgrad_accumulation_fusion
from megatron_trainer.config import parse_args
from megatron_trainer.exitcodes import Refusal
from megatron_trainer.te_path import TeKernels

cfg = parse_args({TE_ARGV!r})
path = M.choose_path(cfg, True)
M.plan_te_path(cfg, path, TeKernels(flash=False, fused=True, unfused=True, rope_fusion=False), {{}})
out = {{"apex": bool(layers._grad_accum_fusion_available), "wgrad": patch_wgrad_accumulation_fusion()}}
path.wgrad_fusion = out["wgrad"]  # what the Trainer does on both paths (loop.py)

def output_layer(tc):  # gpt_model.py: the output layer, on the TE spec too
    tc.use_cpu_initialization = True
    return tensor_parallel.ColumnParallelLinear(64, 1024, config=tc, init_method=tc.init_method, bias=False,
                                                skip_bias_add=False, gather_output=False)

tc = M.transformer_config(cfg, path)
out["fused"] = tc.gradient_accumulation_fusion
out["built"] = type(output_layer(tc)).__name__
M.refuse_missing_fusion_kernels(M.fusion_flags(cfg, path))  # nothing missing: no refusal
before = M.transformer_config(cfg, path)
before.gradient_accumulation_fusion = True  # the rule before the fix: on for TE unconditionally
try:
    output_layer(before)
    out["before"] = "built"
except RuntimeError as e:
    out["before"] = str(e)[:200]
try:
    M.refuse_missing_fusion_kernels({{**M.fusion_flags(cfg, path), "gradient_accumulation_fusion": True}})
except Refusal as e:
    out["refusal"] = [int(e.code), str(e)]
# a CUDA machine: the stand-in installed into Megatron's layers, as patch_wgrad_accumulation_fusion does there
layers.fused_weight_gradient_mlp_cuda, layers._grad_accum_fusion_available = TorchWgradAccumulation, True
path.wgrad_fusion = "torch"
tc = M.transformer_config(cfg, path)
out["torch"] = [tc.gradient_accumulation_fusion, output_layer(tc).gradient_accumulation_fusion]
out["describe"] = path.describe()
print(json.dumps(out))
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert got["apex"] is False and got["wgrad"] == "off: no CUDA device"
    assert got["fused"] is False and got["built"] == "ColumnParallelLinear"
    assert got["before"].startswith("ColumnParallelLinear was called with gradient_accumulation_fusion set to True "
                                    "but the custom CUDA extension fused_weight_gradient_mlp_cuda")
    code, text = got["refusal"]
    assert code == 2 and "\n" not in text and "--no-gradient-accumulation-fusion" in text
    assert got["torch"] == [True, True]
    assert got["describe"] == ("transformer_impl=transformer_engine, attention=TE's fused attention (cuDNN) for "
                               "--attention-backend flash, wgrad accumulation fusion=torch, RoPE unfused (no fused "
                               "RoPE in this Transformer Engine)")


def test_the_te_paths_transformer_config_takes_the_planned_kernel_and_refuses_an_unplanned_path():
    from megatron.core.transformer.enums import AttnBackend
    from megatron_trainer import model as M
    from megatron_trainer.config import parse_args
    from megatron_trainer.exitcodes import Refusal
    from megatron_trainer.te_path import TeKernels

    cfg = parse_args(TE_ARGV)
    path = M.choose_path(cfg, True)
    with pytest.raises(ValueError, match="plan_te_path"):
        M.transformer_config(cfg, path)
    M.plan_te_path(cfg, path, TeKernels(flash=True, fused=False, unfused=True, rope_fusion=True), {})
    assert M.fusion_flags(cfg, path)["apply_rope_fusion"] is True
    # here Megatron-Core finds no fused RoPE (no TE): TransformerConfig would raise, the start-up check refuses first
    with pytest.raises(Refusal, match="--no-rope-fusion"):
        M.refuse_missing_fusion_kernels(M.fusion_flags(cfg, path))
    path.te = dataclasses.replace(path.te, rope_fusion=False)
    tc = M.transformer_config(cfg, path)
    assert (tc.attention_backend, tc.apply_rope_fusion) == (AttnBackend.flash, False)
    fp8 = parse_args(TE_ARGV + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    path = M.choose_path(fp8, True)
    M.plan_te_path(fp8, path, TeKernels(flash=False, fused=True, unfused=True, rope_fusion=False), {})
    tc = M.transformer_config(fp8, path)
    assert (tc.fp8, tc.fp8_recipe) == ("hybrid", "tensorwise")  # megatron's Fp8Recipe is a str enum


def test_log_iterations_takes_a_tensor_grad_norm_and_logs_only_host_numbers(tmp_path):
    """Crash 3. Megatron-Core's clip_grads returns the norm as a 1-element CUDA tensor where TE's multi-tensor
    kernels are importable (get_grad_norm_fp32: total_norm.pow(1 / norm_type)); the log line formatted it with
    ':.3f' and raised TypeError. Trainer.log_iterations reads it once: the line, TensorBoard, W&B and the metrics
    get host numbers only (checked for every value each of them receives)."""
    got, proc = _child(tmp_path, f"""
import contextlib, io, types
from megatron_trainer.config import parse_args
from megatron_trainer.loop import Trainer, TrainState

cfg = parse_args({MOCK_ARGV!r})
norm = torch.zeros(1, dtype=torch.float) + 0.5  # clip_grads' torch.zeros(1) accumulator, as TE's path returns it
out = {{}}
try:
    f"{{norm:.3f}}"
except TypeError as e:
    out["raw_format"] = str(e)
received = []

def record(where, value):
    received.append([where, type(value).__name__])

class Stub:  # the attributes Trainer.log_iterations reads; its methods are the Trainer's own
    log_iterations, _log_wandb = Trainer.log_iterations, Trainer._log_wandb

    def _write_progress(self):
        pass

me = Stub()
me.cfg, me.is_logging_rank, me.router_monitor = cfg, True, None
me.env = types.SimpleNamespace(cpu_group=torch.distributed.group.WORLD, world_size=1,
                               layout=types.SimpleNamespace(global_batch_size=4))
me.state = TrainState(iteration=2)
me.flops_per_iteration, me.tokens_per_iteration = 1e9, 512
me.metrics = types.SimpleNamespace(set=lambda name, value, **k: record("metrics." + name, value))
me.tensorboard = types.SimpleNamespace(write=lambda losses, step: [record("tensorboard." + k, v)
                                                                   for k, v in vars(step).items() if k != "memory"])
me.wandb = types.SimpleNamespace(log=lambda scalars, step: [record("wandb." + k, v) for k, v in scalars.items()])
me.optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.05)
line = io.StringIO()
with contextlib.redirect_stdout(line):
    me.log_iterations([(1, torch.tensor(2.5)), (2, torch.tensor(2.25))], 0.01, norm)
out["line"] = line.getvalue()
out["received"] = received
print(json.dumps(out))
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert got["raw_format"] == "unsupported format string passed to Tensor.__format__"  # the bug, as it was
    lines = got["line"].splitlines()
    assert len(lines) == 2 and all(" grad norm: 0.500 |" in x for x in lines), got["line"]
    assert " lm loss: 2.250000E+00 |" in lines[1]
    tensors = [r for r in got["received"] if r[1] == "Tensor"]
    assert tensors == [], tensors
    assert ["tensorboard.grad_norm", "float"] in got["received"] and ["wandb.grad-norm", "float"] in got["received"]


def test_a_refusal_is_one_line_and_exit_2_from_main(tmp_path):
    """A start-up refusal (exitcodes.Refusal, raised while the Trainer is set up) ends the worker with exit 2 and one
    line on stderr, the same line in the termination log, and no traceback anywhere in its output."""
    got, proc = _child(tmp_path, f"""
from megatron_trainer import loop, main as M
from megatron_trainer.exitcodes import ExitCode, Refusal

class Refusing:
    def __init__(self, *a, **k):
        raise Refusal(ExitCode.BAD_ARGUMENTS, "--attention-backend flash on the Transformer Engine path: no kernel")

written = []
loop.Trainer = Refusing
M.write_termination_message = lambda text, path=None: written.append(text) or True
rc = M.main({MOCK_ARGV!r})
print(json.dumps({{"rc": rc, "written": written}}))
""", gloo=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert got["rc"] == 2
    expected = ("rank 0: exit 2 (bad command line or environment; not retried) during start-up: Refusal: "
                "--attention-backend flash on the Transformer Engine path: no kernel")
    assert got["written"] == [expected]
    assert [x for x in proc.stderr.splitlines() if x.strip()] == [f"megatron_trainer: {expected}"], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _fake_te(monkeypatch, available=(False, True, True), raises: Exception | None = None) -> list:
    """A stand-in for the parts of Transformer Engine te_path.probe reads (TE itself is not installable on a CPU):
    AttentionParams (a subset of TE 2.20's fields: the probe passes only the fields TE has), get_attention_backend,
    the GPU's compute capability, cuDNN's version, FlashAttentionUtils. Returns the calls it saw."""
    import dataclasses as dc
    import os
    import types

    calls = []

    @dc.dataclass
    class AttentionParams:
        qkv_dtype: object = None
        qkv_layout: str = "sbh3d"
        batch_size: int = 1
        num_heads: int = 16
        num_gqa_groups: int = 16
        max_seqlen_q: int = 128
        max_seqlen_kv: int = 128
        head_dim_qk: int = 64
        head_dim_v: int = 64
        attn_mask_type: str = "no_mask"
        window_size: object = None
        deterministic: bool = False
        is_training: bool = True

    def get_attention_backend(params):
        calls.append((params, {v: os.environ.get(v) for v in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")}))
        if raises is not None:
            raise raises
        return (False, None, available[1], 1, False, list(available))

    utils = types.SimpleNamespace(AttentionParams=AttentionParams, get_attention_backend=get_attention_backend,
                                  get_device_compute_capability=lambda: (9, 0), get_cudnn_version=lambda: (9, 19, 0),
                                  FlashAttentionUtils=types.SimpleNamespace(is_installed=False, version="0"))
    pkg = types.ModuleType("transformer_engine")
    pkg.__version__ = "2.20.2"
    modules = {"transformer_engine": pkg, "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
               "transformer_engine.pytorch.attention": types.ModuleType("transformer_engine.pytorch.attention"),
               "transformer_engine.pytorch.attention.dot_product_attention":
                   types.SimpleNamespace(utils=utils, __path__=[])}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.attention.dot_product_attention.utils", utils)
    return calls


def test_the_probe_asks_te_for_this_models_call_with_every_backend_enabled_and_restores_the_environment(monkeypatch):
    """te_path.probe with only the import faked: TE is asked about the rank's own call (heads and groups per TP rank,
    bf16, causal, sbhd q/k/v), with NVTE_*_ATTN=1 while it answers (its filters read them) and the user's values back
    after; TE's verdict becomes the TeKernels the plan decides on (the issue's machine: no flash-attn, cuDNN)."""
    from megatron_trainer.config import parse_args
    from megatron_trainer.te_path import plan, probe

    calls = _fake_te(monkeypatch)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")  # the user's, and none of the others (a GPTModel built earlier in
    monkeypatch.delenv("NVTE_FLASH_ATTN", raising=False)  # this process leaves Megatron-Core's values behind)
    monkeypatch.delenv("NVTE_UNFUSED_ATTN", raising=False)
    i = TE_ARGV.index("--tensor-model-parallel-size")
    cfg = parse_args(TE_ARGV[:i + 1] + ["2"] + TE_ARGV[i + 2:])
    kernels = probe(cfg)
    (params, env), = calls
    assert (params.num_heads, params.num_gqa_groups, params.head_dim_qk, params.qkv_dtype) == (2, 2, 16, torch.bfloat16)
    assert (params.attn_mask_type, params.qkv_layout, params.window_size, params.batch_size) == \
        ("causal", "sbhd_sbhd_sbhd", (-1, 0), 2)
    assert env == {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "1"}
    import os

    assert os.environ.get("NVTE_FLASH_ATTN") is None and os.environ["NVTE_FUSED_ATTN"] == "1"
    assert "NVTE_UNFUSED_ATTN" not in os.environ
    assert (kernels.flash, kernels.fused, kernels.unfused, kernels.fused_first) == (False, True, True, True)
    assert kernels.note == "TE 2.20.2, sm90, cuDNN 9.19.0, flash-attn not installed, bfloat16"
    assert plan(cfg, kernels, os.environ).attention_backend == "fused"


def test_a_probe_te_cannot_answer_leaves_the_verdict_unknown(monkeypatch):
    from megatron_trainer.config import parse_args
    from megatron_trainer.te_path import probe

    _fake_te(monkeypatch, raises=RuntimeError("cuDNN not loaded"))
    kernels = probe(parse_args(TE_ARGV))
    assert (kernels.flash, kernels.fused, kernels.unfused) == (None, None, None)
    assert kernels.note == "attention probe failed: RuntimeError: cuDNN not loaded"
