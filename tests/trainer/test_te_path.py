"""The Transformer Engine path's start-up decisions (megatron_trainer/te_path.py, issue 59): which TE attention
kernel serves --attention-backend on a machine with these kernels, and the one-line refusal where none does. Pure:
TE is not installable on a CPU, so the machine is a TeKernels (what te_path.probe reads from TE's own
get_attention_backend on the GPU)."""

from __future__ import annotations

import pytest
from conftest import MOCK_ARGV, without
from megatron_trainer.config import parse_args
from megatron_trainer.exitcodes import NON_RETRIABLE, ExitCode, Refusal, classify, fatal_message
from megatron_trainer.te_path import TeKernels, attention_backend, attention_params, plan

# The machine: TE 2.20.2 from PyPI on an H200, cuDNN there, flash-attn not installed.
CUDNN_ONLY = TeKernels(flash=False, fused=True, unfused=True, fused_first=True,
                       note="TE 2.20.2, sm90, cuDNN 9.19.0, flash-attn not installed, bfloat16")
FLASH_ONLY = TeKernels(flash=True, fused=False, unfused=True)
BOTH_HOPPER = TeKernels(flash=True, fused=True, unfused=True, fused_first=True)
BOTH_AMPERE = TeKernels(flash=True, fused=True, unfused=True, fused_first=False)
UNFUSED_ONLY = TeKernels(flash=False, fused=False, unfused=True, note="fp32")
UNKNOWN = TeKernels(note="attention probe failed: ImportError: x")
TE_ARGV = without(MOCK_ARGV, "--transformer-impl") + ["--transformer-impl", "transformer_engine"]


def test_the_crd_default_flash_runs_on_cudnn_where_flash_attn_is_missing():
    """The issue's second crash: `attentionBackend: flash` (the CRD default, "fused flash/cuDNN attention") asked
    TE for flash-attn only (Megatron-Core's AttnBackend.flash), which is not installed; TE's cuDNN kernel is."""
    backend, text = attention_backend("flash", CUDNN_ONLY, {})
    assert backend == "fused" and text == "TE's fused attention (cuDNN) for --attention-backend flash"


@pytest.mark.parametrize("kernels, backend", [(FLASH_ONLY, "flash"), (BOTH_HOPPER, "fused"), (BOTH_AMPERE, "flash")])
def test_flash_takes_whichever_fused_kernel_serves_in_tes_own_order(kernels, backend):
    assert attention_backend("flash", kernels, {})[0] == backend


def test_no_fused_kernel_for_flash_is_refused_in_one_line_that_is_not_retried():
    with pytest.raises(Refusal) as exc:
        attention_backend("flash", UNFUSED_ONLY, {})
    err = exc.value
    assert err.code == ExitCode.BAD_ARGUMENTS and err.code in NON_RETRIABLE
    assert classify(err, first_iteration_done=False) == ExitCode.BAD_ARGUMENTS
    text = str(err)
    assert "\n" not in text and text.startswith("--attention-backend flash on the Transformer Engine path: ")
    assert "flash-attn: not available, cuDNN fused attention: not available" in text and "(fp32)" in text
    assert "--attention-backend unfused" in text and "--transformer-impl local" in text  # what to change
    message = fatal_message(err, err.code, 0, "building the model")
    assert message.count("\n") == 0, message  # a refusal: no frames follow its line
    assert message.startswith("rank 0: exit 2 (bad command line or environment; not retried) during building the model")


@pytest.mark.parametrize("requested, kernels, backend", [
    ("fused", CUDNN_ONLY, "fused"), ("unfused", UNFUSED_ONLY, "unfused"), ("auto", UNFUSED_ONLY, "auto"),
    ("auto", CUDNN_ONLY, "auto")])
def test_fused_unfused_and_auto_keep_their_megatron_meaning(requested, kernels, backend):
    assert attention_backend(requested, kernels, {})[0] == backend


@pytest.mark.parametrize("requested, kernels, says", [
    ("fused", FLASH_ONLY, "TE's fused attention (cuDNN) does not serve this model here"),
    ("unfused", TeKernels(flash=True, fused=True, unfused=False), "TE's unfused attention"),
    ("auto", TeKernels(flash=False, fused=False, unfused=False), "no TE attention kernel serves"),
    ("local", CUDNN_ONLY, "only supported with --spec local")])
def test_a_request_no_kernel_serves_is_refused(requested, kernels, says):
    with pytest.raises(Refusal, match="--attention-backend") as exc:
        attention_backend(requested, kernels, {})
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_an_unverified_probe_trusts_the_request_and_says_so():
    backend, text = attention_backend("flash", UNKNOWN, {})
    assert backend == "fused" and "not verified at start-up" in text
    assert attention_backend("flash", TeKernels(flash=None, fused=False, unfused=True), {})[0] == "flash"


def test_the_environment_turns_kernels_off_and_conflicts_are_refused_before_megatron_asserts():
    """NVTE_*_ATTN=0 keeps a kernel off (Megatron-Core would assert against turning it on); a variable set to
    the other value than Megatron-Core sets for the chosen kernel is refused, naming it."""
    assert attention_backend("flash", BOTH_HOPPER, {"NVTE_FUSED_ATTN": "0"})[0] == "flash"
    with pytest.raises(Refusal, match="cuDNN fused attention: not available"):
        attention_backend("flash", CUDNN_ONLY, {"NVTE_FUSED_ATTN": "0"})
    with pytest.raises(Refusal, match="NVTE_UNFUSED_ATTN=1") as exc:
        attention_backend("flash", CUDNN_ONLY, {"NVTE_UNFUSED_ATTN": "1"})
    assert "_set_attention_backend" in str(exc.value)
    assert attention_backend("fused", CUDNN_ONLY, {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0"})[0] == "fused"


def test_plan_keeps_rope_fusion_only_where_this_te_has_it():
    cfg = parse_args(TE_ARGV + ["--position-embedding-type", "rope"])
    assert plan(cfg, CUDNN_ONLY, {}).rope_fusion and plan(cfg, CUDNN_ONLY, {}).notes == ()
    old = plan(cfg, TeKernels(flash=False, fused=True, unfused=True, rope_fusion=False), {})
    assert not old.rope_fusion and old.notes and "RoPE fusion off" in old.notes[0]
    assert (old.attention_backend, old.attention) == ("fused", "TE's fused attention (cuDNN) for --attention-backend flash")


def test_the_probe_asks_te_about_the_ranks_own_attention_call():
    """TE's verdict is for one rank's call: heads and KV groups per TP rank, the sequence per CP rank."""
    argv = without(TE_ARGV, "--tensor-model-parallel-size", "--num-attention-heads", "--seq-length",
                   "--max-position-embeddings", "--hidden-size")
    cfg = parse_args(argv + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                             "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
                             "--hidden-size", "512", "--seq-length", "256", "--max-position-embeddings", "256"])
    got = attention_params(cfg, "bf16")
    assert (got["num_heads"], got["num_gqa_groups"], got["head_dim_qk"], got["max_seqlen_q"]) == (4, 2, 64, 128)
    assert got["attn_mask_type"] == "causal" and got["context_parallel"] and got["qkv_layout"] == "sbhd_sbhd_sbhd"
