#!/usr/bin/env python3
"""Write tests/fixtures/hf/<name>.json: config.json files of tiny models made with transformers
(`AutoConfig.for_model` + `save_pretrained` of a `from_config` model; random weights, nothing
downloaded). Needs torch and transformers (e.g. .venv-torch); the files are committed so that CI,
which has neither, tests the config mapping on what transformers itself writes.

    .venv-torch/bin/python scripts/gen-hf-fixtures.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1001, max_position_embeddings=256)
# name -> (model_type, overrides): the architectures of the HF issue, tiny
TINY = {
    "tiny-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "tiny-llama32-tied": ("llama", {"rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}, "tie_word_embeddings": True}),
    "tiny-mistral": ("mistral", {"sliding_window": None}),
    "tiny-qwen2": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    "tiny-qwen3": ("qwen3", {"head_dim": 32}),
    # MoE: Qwen3-MoE with norm_topk_prob false (transformers' default: Megatron's pre-softmax router), Mixtral
    # (top-k renormalised: Megatron's default router)
    "tiny-qwen3-moe": ("qwen3_moe", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": False}),
    # Qwen2-MoE: Qwen3-MoE's router (norm_topk_prob false) plus one gated shared expert, QKV bias, no QK norm
    "tiny-qwen2-moe": ("qwen2_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
    "tiny-mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
}


def main() -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    OUT.mkdir(parents=True, exist_ok=True)
    for name, (model_type, extra) in TINY.items():
        cfg = AutoConfig.for_model(model_type, **SMALL, **extra)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            written = json.loads((Path(d) / "config.json").read_text())
        (OUT / f"{name}.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
        print(f"wrote {OUT / name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
