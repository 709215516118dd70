"""Issue 50's MoE scenarios (e2e/gpu/moe.py): Megatron-LM's own argument parser and checks (parse_args and
validate_args of pretrain_gpt.py, core_v0.19.0) accept the command line the scenario gives it, for every shape and
layout, and read the MoE flags as ours' trainer does. Needs torch, megatron-core and Megatron-LM's source: in
.run/mlm (git-ignored, never committed) or MEGATRON_LM_DIR; skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

require("torch")  # the child process below runs Megatron-LM's parser in this interpreter

ROOT = Path(__file__).resolve().parents[2]
MLM_DIR = Path(os.environ.get("MEGATRON_LM_DIR") or ROOT / ".run" / "mlm")
sys.path.insert(0, str(ROOT / "e2e" / "gpu"))

pytestmark = pytest.mark.skipif(not (MLM_DIR / "pretrain_gpt.py").is_file(),
                                reason="Megatron-LM's source not present (.run/mlm or MEGATRON_LM_DIR)")

# In a child process: Megatron-LM's parser on the scenario's argv; its TP > 1 check asks the GPU's architecture,
# answered as Hopper's here (the CPU has none).
CHECK = """
import json, os, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import moe
shape, layout = sys.argv[3], sys.argv[4]
os.environ.update(WORLD_SIZE=str(moe.MOE_LAYOUTS[layout][0]), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
import megatron.training.arguments as A
A.get_device_arch_version = lambda: 9
sys.argv = ["pretrain_gpt.py", *moe.mlm_args(moe.shape_for(shape), layout, 15, 5)]
args = A.parse_args()
A.validate_args(args, {})
keys = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_token_dispatcher_type", "moe_router_dtype",
        "moe_aux_loss_coeff", "moe_grouped_gemm", "moe_router_load_balancing_type", "normalization", "qk_layernorm",
        "kv_channels", "num_query_groups", "expert_model_parallel_size", "tensor_model_parallel_size",
        "data_parallel_size", "sequence_parallel", "transformer_impl", "swiglu", "add_bias_linear",
        "position_embedding_type", "rotary_base", "untie_embeddings_and_output_weights", "apply_rope_fusion",
        "global_batch_size", "micro_batch_size", "num_layers", "seq_length", "use_distributed_optimizer")
print("ARGS " + json.dumps({k: getattr(args, k) for k in keys}, default=str))
"""


@pytest.mark.parametrize("shape, layout", [("qwen3", "ep2"), ("mixtral", "ep2"), ("mixtral", "tp2ep2"),
                                           ("qwen3", "ep4")])
def test_megatron_lm_accepts_the_scenarios_command_line(shape, layout):
    import moe as M

    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # Megatron-LM's tree stays as it is
    p = subprocess.run([sys.executable, "-c", CHECK, str(ROOT / "e2e" / "gpu"), str(MLM_DIR), shape, layout],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(p.stdout.split("ARGS ", 1)[1].splitlines()[0])
    m = M.shape_for(shape)
    gpus, tp, ep = M.MOE_LAYOUTS[layout]
    aux = got["moe_aux_loss_coeff"]
    assert (aux[0] if isinstance(aux, list) else aux) == m["aux_loss"]
    assert {k: got[k] for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "kv_channels",
                                "num_query_groups", "num_layers", "seq_length", "global_batch_size")} == \
        {"num_experts": m["experts"], "moe_router_topk": m["topk"], "moe_ffn_hidden_size": m["moe_ffn"],
         "kv_channels": m["head_dim"], "num_query_groups": m["groups"], "num_layers": m["layers"],
         "seq_length": m["seq"], "global_batch_size": m["gbs"]}
    assert (got["moe_token_dispatcher_type"], got["moe_router_dtype"], got["moe_router_load_balancing_type"]) == \
        ("alltoall", "fp32", "aux_loss")
    assert (got["normalization"], got["qk_layernorm"], got["swiglu"], got["add_bias_linear"]) == \
        ("RMSNorm", m["qk_norm"], True, False)
    assert (got["position_embedding_type"], got["rotary_base"], got["apply_rope_fusion"]) == ("rope", 1000000, False)
    assert (got["transformer_impl"], got["moe_grouped_gemm"], got["untie_embeddings_and_output_weights"]) == \
        ("local", False, True)
    assert (got["tensor_model_parallel_size"], got["expert_model_parallel_size"], got["data_parallel_size"],
            got["sequence_parallel"]) == (tp, ep, gpus // tp, tp > 1)
