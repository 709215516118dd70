"""Issue 50's GPU scenarios' inputs on the CPU (they run only on GPUs): sft_moe's tiny Qwen3-MoE, made with
transformers `from_config`, and its command line agree as the trainer checks them at --hf-init; the moe_resume
variants and hf_moe_logits' all-to-all command lines build megatron-core's TransformerConfig (its own checks of the
router, expert-bias, shared-expert and capacity settings) on the trainer's local path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import require

require("torch")
require("transformers")
require("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "e2e" / "gpu"))

import hf_cpu_check as hc  # noqa: E402
import moe as M  # noqa: E402
import sft as S  # noqa: E402
from megatron_trainer.config import parse_args  # noqa: E402
from megatron_trainer.hf_config import mismatches, parse_config  # noqa: E402
from megatron_trainer.model import choose_path, transformer_config  # noqa: E402


def test_sft_moe_model_and_command_line_agree(tmp_path):
    config = S._make_qwen3_moe(tmp_path / "src", hidden=256, layers=4, heads=4, kv=2, experts=8, topk=2,
                               moe_ffn=256, vocab=64, max_pos=128)
    assert config["model_type"] == "qwen3_moe" and config["norm_topk_prob"] is True
    argv = S._argv(config, 128, 400, 2, ["--hf-init", str(tmp_path / "src"), "--micro-batch-size", "8",
                                         "--global-batch-size", "32", "--moe-aux-loss-coeff", "0.001",
                                         *S._sft_flags(tmp_path / "src", tmp_path / "t.jsonl", None, True)], ep=2)
    cfg = parse_args(argv)
    assert (cfg.parallel.tensor, cfg.parallel.expert, cfg.model.moe_token_dispatcher_type) == (1, 2, "alltoall")
    assert not cfg.model.moe_router_pre_softmax  # norm_topk_prob true: top-k, then the softmax over the k
    assert mismatches(cfg, parse_config(config, 128)) == []
    assert json.loads((tmp_path / "src" / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize("variant", sorted(M.RESUME_VARIANTS))
def test_moe_resume_variants_build_megatron_cores_config(variant):
    cfg = parse_args(M.resume_args(variant, 1, 2, 2, "/tmp/unused"))
    tconfig = transformer_config(cfg, choose_path(cfg, have_te=False))
    assert (tconfig.num_moe_experts, tconfig.moe_router_topk, tconfig.expert_model_parallel_size) == (8, 2, 2)
    assert tconfig.moe_token_dispatcher_type == "alltoall"
    if variant == "sigmoid_expert_bias":
        assert (tconfig.moe_router_score_function, tconfig.moe_router_enable_expert_bias) == ("sigmoid", True)
        assert (tconfig.moe_expert_capacity_factor, tconfig.moe_shared_expert_intermediate_size) == (1.5, 1024)
        assert tconfig.moe_router_load_balancing_type == "none"


@pytest.mark.parametrize("arch", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_hf_moe_logits_asks_for_the_all_to_all_dispatcher(arch, tmp_path):
    config = hc.make_model(arch, tmp_path)
    for tp, ep in ((1, 2), (2, 2), (1, 4)):
        cfg = parse_args(hc.trainer_argv(config, tp, 1, "bf16", ep=ep, dispatcher="alltoall"))
        assert (cfg.parallel.tensor, cfg.parallel.expert, cfg.model.moe_token_dispatcher_type) == (tp, ep, "alltoall")
        assert cfg.parallel.sequence_parallel == (tp > 1)
        assert mismatches(cfg, parse_config(config, hc.SEQ)) == []
    assert "--moe-token-dispatcher-type" not in hc.trainer_argv(config, 1, 1, "fp32", ep=2)  # Megatron's default
