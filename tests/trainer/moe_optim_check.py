"""A MoE model's checkpoint through the trainer's Checkpointer with the distributed optimizer (the optimizer state
saved and loaded in place, optim_state.py), written with one experts module and read with the other. gloo ranks
on the CPU (optim_state_check's CUDA stubs), a 2-layer MoE model at EP 2 (4 experts, SwiGLU). Each rank dumps its
weights and Adam state under SequentialMLP's names with global expert indices (GroupedMLP's 3-D tensors cut per
expert), so test_moe_torch.py compares runs of either module. Run by that test:

    python -m torch.distributed.run --nproc-per-node=2 moe_optim_check.py EXPERTS(grouped|sequential) \
        ACTIONS(save|load|load,save) CKPT_IN CKPT_OUT OUT_DIR
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "contract"), str(Path(__file__).resolve().parent)]

EXPERTS, EP = 4, 2


def argv(world: int, ckpt_in: str, ckpt_out: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "250", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--transformer-impl", "local", "--micro-batch-size", "1", "--global-batch-size", str(world),
            "--train-iters", "10", "--lr", "1e-3", "--bf16", "--use-distributed-optimizer", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--save", ckpt_out, "--load", ckpt_in, "--ckpt-format",
            "torch_dist", "--seed", "3", "--num-experts", str(EXPERTS), "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "16", "--expert-model-parallel-size", str(EP)]


def dump(model, optimizer) -> dict:
    """{"weights": name -> tensor, "opt": name.state[.range] -> tensor}: experts by global index (their expert
    data-parallel size is 1 here, so each rank holds a whole expert's state), other parameters by their range."""
    from megatron.core import parallel_state as ps
    from megatron_trainer import optim_state
    from megatron_trainer.hf_torch import global_params

    params = dict(global_params(model))
    out: dict = {"weights": {n: p.detach().float().clone() for n, p in params.items()}, "opt": {}}
    first = ps.get_expert_model_parallel_rank() * (EXPERTS // EP)
    for opt in optim_state._distributed_optimizers(optimizer):
        for _, param, range_map in optim_state._iter_params(opt):
            if range_map is None:
                continue
            span = (range_map["param"].start, range_map["param"].end)
            states = {k: v for k, v in opt._get_main_param_and_optimizer_states(param).items()
                      if k != "step" and v.dim() == 1}
            for name, p in params.items():
                view = p._base is not None  # a GroupedMLP expert: a view of the 3-D parameter
                if (p._base if view else p) is not param:
                    continue
                for key, state in states.items():
                    if "local_experts" not in name:
                        out["opt"][f"{name}.{key}.{span}"] = state.detach().clone()
                        continue
                    assert span == (0, param.numel()), (name, span)
                    local = int(re.search(r"local_experts\.(\d+)\.", name).group(1)) - first
                    out["opt"][f"{name}.{key}"] = (state.view(param.shape)[local] if view else state).detach().reshape(
                        -1).clone()
    return out


def main() -> None:
    experts, actions, ckpt_in, ckpt_out, out_dir = sys.argv[1:6]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch
    from optim_state_check import fill, stub_cuda

    stub_cuda(torch)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    cpu_group = torch.distributed.new_group(backend="gloo")
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_trainer.checkpoint import Checkpointer, _materialize_optimizer_state
    from megatron_trainer.compat import patch_distopt_state_load_for_torch_adam
    from megatron_trainer.config import parse_args, world_layout
    from megatron_trainer.distributed import DistEnv
    from megatron_trainer.model import build_model, choose_path, moe_experts_path, transformer_config

    cfg = parse_args(argv(world, ckpt_in, ckpt_out))
    parallel_state.initialize_model_parallel(**cfg.parallel.megatron_sizes())
    env = DistEnv(rank, rank, world, world_layout(cfg, world), cpu_group)
    path = choose_path(cfg, have_te=False)
    moe_experts_path(cfg, path, experts, 0)
    tconfig = transformer_config(cfg, path)
    tconfig.use_cpu_initialization = True
    torch.manual_seed(0 if actions == "save" else 5)  # a loading run starts from other weights
    model, _ = build_model(cfg, tconfig, path, 250)
    t = cfg.training
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, bf16=True, params_dtype=tconfig.params_dtype, use_distributed_optimizer=True),
        model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=t.lr, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
    patch_distopt_state_load_for_torch_adam(optimizer)  # as the trainer does (loop.py)
    _materialize_optimizer_state(optimizer)
    ckpt = Checkpointer(cfg, env, model, optimizer, scheduler, keep=0, optim_in_place=True)
    assert ckpt.optim_in_place
    for action in actions.split(","):
        if action == "load":
            loaded = ckpt.load()
            assert loaded is not None and loaded.iteration == 1, loaded
            torch.save(dump(model, optimizer), os.path.join(out_dir, f"loaded_rank{rank}.pt"))
        else:
            if actions == "save":
                fill(optimizer, torch)
            ckpt.save(1, world, blocking=True)
            torch.save(dump(model, optimizer), os.path.join(out_dir, f"saved_rank{rank}.pt"))
    ckpt.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
