"""The Hugging Face import/export run for real: Megatron-Core's GPTModel (built by the trainer's own
functions) on CPUs with gloo, against transformers' fp32 logits, and the export bit-identical to the
source (tests/trainer/hf_cpu_check.py). Skipped where torch, megatron-core or transformers is missing
(CI installs none of them); run it with a venv that has them:

    .venv-torch/bin/python -m pytest tests/trainer/test_hf_torch.py -q

The GPU suite runs the same check on 2 x H200 in fp32 and bf16 (e2e/gpu/hf.py,
docs/benchmarks/hf.md#2026-11-24-hf-import-export).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import require

require("torch")
require("megatron.core")
require("transformers")

sys.path.insert(0, str(Path(__file__).parent))
import hf_cpu_check as hc  # noqa: E402

FP32_TOL = 1e-4


@pytest.mark.parametrize("archs, tp, pp", [
    (["tiny-llama3", "tiny-qwen3"], 1, 1),
    (["tiny-qwen2", "tiny-mistral"], 2, 1),  # QKV bias, tied, vocab 1001 padded; GQA with TP = groups
    (["tiny-llama32-tied"], 1, 2),  # tied embeddings across pipeline stages
    (["tiny-llama3"], 4, 1),  # TP > KV groups: a rank holds part of one group
])
def test_logits_match_transformers_and_export_is_bit_identical(tmp_path, archs, tp, pp):
    for r in hc.run(archs, tp, pp, ("fp32",), "cpu", tmp_path):
        assert "error" not in r, r.get("error")
        assert r["max_abs_diff"] <= FP32_TOL, r
        assert r["argmax_equal"] == 1.0, r
        rt = r["roundtrip"]
        assert not rt["not_identical"] and not rt["extra"] and rt["config_equal"], rt
        assert rt["tensors"] == rt["exported"]


@pytest.mark.parametrize("tp, ep, experts", [
    (1, 1, "grouped"),
    (1, 2, "sequential"),  # Megatron's SequentialMLP reads and writes the same names
    (2, 1, "grouped"),     # experts split over TP (sequence parallel, as MoE at TP > 1 must be)
    (2, 2, "grouped"),     # four ranks: EP 2 x TP 2
])
def test_moe_logits_match_transformers_and_export_is_bit_identical(tmp_path, tp, ep, experts):
    """Qwen3-MoE (8 experts, top-2, QK norm, norm_topk_prob false: Megatron's pre-softmax router), Qwen2-MoE (the
    same router, QKV bias, and a shared expert scaled by sigmoid(its gate): Megatron's moe_shared_expert_gate) and
    Mixtral (4 experts, top-2 renormalised), routers and the shared expert's gate scaled so they decide something
    (hf_cpu_check.make_model): fp32 logits against transformers', argmax equal, and the export (each EP rank writes
    its own experts' shards) bit-identical to the source. Flipping the router's pre-softmax moves the logits by
    0.015-0.02, so 1e-4 can fail."""
    for r in hc.run(["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"], tp, 1, ("fp32",), "cpu", tmp_path, ep=ep, experts=experts,
                    compile_fusions=False):
        assert "error" not in r, r.get("error")
        assert r["experts"] == ("GroupedMLP" if experts == "grouped" else "SequentialMLP"), r
        assert r["max_abs_diff"] <= FP32_TOL and r["logit_scale"] > 0.1, r
        assert r["argmax_equal"] == 1.0, r
        rt = r["roundtrip"]
        assert not rt["not_identical"] and not rt["extra"] and rt["config_equal"], rt
        assert rt["tensors"] == rt["exported"]
        assert [e["shards"] for e in r["export"]] == [ep] * (tp * ep)  # one writer per EP rank (small model)


def test_diagnose_compares_every_block_with_transformers_in_forward_order(tmp_path):
    """hf_cpu_check's --diagnose (what the GPU suite's te_hf_logits runs on the Transformer Engine spec, issue 59):
    each layer's attention block, MLP block (a MoE layer's too) and output, the embedding and the final norm against
    transformers' same module in the same forward; on the local spec in fp32 all within the logits' tolerance, the
    embedding exactly (the same rows)."""
    for r in hc.run(["tiny-llama3", "tiny-mixtral"], 1, 1, ("fp32",), "cpu", tmp_path, diagnose=True):
        assert "error" not in r, r.get("error")
        n = json.loads((hc.FIXTURES / f"{r['arch']}.json").read_text())["num_hidden_layers"]
        names = [m["module"] for m in r["modules"]]
        assert names[0] == "embedding" and names[-1] == "final_norm", names
        assert names[1:-1] == [f"layer{i}.{w}" for i in range(n) for w in ("attention", "mlp", "output")], names
        assert all("max_abs_diff" in m for m in r["modules"]), r["modules"]  # shapes agree everywhere
        assert r["modules"][0]["max_abs_diff"] == 0.0
        assert all(m["max_abs_diff"] <= FP32_TOL for m in r["modules"]), r["modules"]
        assert "ops" not in r  # TE's operators: --impl te only
