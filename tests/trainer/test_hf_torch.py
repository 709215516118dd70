"""The Hugging Face import/export run for real: Megatron-Core's GPTModel (built by the trainer's own
functions) on CPUs with gloo, against transformers' fp32 logits, and the export bit-identical to the
source (tests/trainer/hf_cpu_check.py). Skipped where torch, megatron-core or transformers is missing
(CI installs none of them); run it with a venv that has them:

    .venv-torch/bin/python -m pytest tests/trainer/test_hf_torch.py -q

The GPU suite runs the same check on 2 x H200 in fp32 and bf16 (e2e/gpu/hf.py,
docs/benchmarks/hf.md#2026-11-24-hf-import-export).
"""

from __future__ import annotations

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
