"""gloo ranks on the CPU build the trainer's model and distributed optimizer (a tiny Llama: SwiGLU's fused fc1 is
a ShardedTensorFactory, GQA, RMSNorm), give the optimizer known state, and save or load it through the trainer's
Checkpointer, with the optimizer state in place (optim_state.py) or Megatron's own fully reshardable gather.
Each rank dumps its optimizer state (fp32 main params and Adam moments, by parameter name, this rank's range) so
test_optim_state_torch.py can compare runs under different layouts. Run by that test:

    python optim_state_check.py WORLD TP PP MODE(ours|megatron) ACTION(save|load) CKPT_DIR OUT_DIR [SHARDING]

SHARDING (save only): fully_reshardable (default) or dp_reshardable.
"""

from __future__ import annotations

import json
import os
import sys

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ = 4, 64, 4, 2, 96, 250, 16


def argv(tp: int, pp: int, gbs: int, ckpt: str, sharding: str) -> list[str]:
    out = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
           "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
           "--group-query-attention", "--num-query-groups", str(GROUPS), "--ffn-hidden-size", str(FFN),
           "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
           "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--transformer-impl", "local", "--micro-batch-size", "1",
           "--global-batch-size", str(gbs), "--train-iters", "10", "--lr", "1e-3", "--bf16",
           "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--save", ckpt, "--load", ckpt, "--ckpt-format", "torch_dist", "--seed", "3"]
    if sharding == "dp_reshardable":
        out.append("--dist-ckpt-optim-dp-reshardable")
    return out


def stub_cuda(torch) -> None:
    """The CUDA calls model building, the optimizer and dist_checkpointing make, on the CPU: the trainer's own
    `--device cpu` shims (megatron_trainer/cpu.py), torch.compile left on as these checks have always run."""
    from megatron_trainer.cpu import use_cpu

    use_cpu(torch, eager=False)


def dump(optimizer) -> dict:
    from megatron_trainer import optim_state

    out = {}
    for opt in optim_state._distributed_optimizers(optimizer):
        for _, param, range_map in optim_state._iter_params(opt):
            if range_map is None:
                continue
            name = opt._param_name(param)
            states = opt._get_main_param_and_optimizer_states(param)
            out[name] = {"range": [range_map["param"].start, range_map["param"].end],
                         **{k: v.detach().clone() for k, v in states.items() if k != "step" and v.dim() == 1}}
    return out


def fill(optimizer, torch) -> None:
    """Known values: per parameter (its local name, pipeline stage and, where TP shards it, tensor-parallel rank)
    and state key, a seeded draw over its whole local flat tensor, of which this rank keeps its range: the DP
    ranks of one parameter agree, TP replicas agree, no two distinct tensors are alike."""
    from megatron.core import parallel_state
    from megatron_trainer import optim_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()

    for opt in optim_state._distributed_optimizers(optimizer):
        for _, param, range_map in optim_state._iter_params(opt):
            if range_map is None:
                continue
            name = opt._param_name(param)
            start, end = range_map["param"].start, range_map["param"].end
            for key, state in opt._get_main_param_and_optimizer_states(param).items():
                if key == "step" or state.dim() != 1:
                    continue
                ident = f"{name}.{key}.pp{pp_rank}" + (f".tp{tp_rank}" if getattr(param, "tensor_model_parallel",
                                                                                   False) else "")
                seed = sum(ord(c) * (i + 1) for i, c in enumerate(ident)) % (2**31)
                g = torch.Generator().manual_seed(seed)
                full = torch.randn(param.numel(), generator=g, dtype=torch.float32)
                state.copy_(full[start:end].abs() if key == "exp_avg_sq" else full[start:end])


def main() -> None:
    world, tp, pp = (int(x) for x in sys.argv[1:4])
    mode, action, ckpt, out_dir = sys.argv[4:8]
    sharding = sys.argv[8] if len(sys.argv) > 8 else "fully_reshardable"
    rank = int(os.environ["RANK"])
    import torch

    stub_cuda(torch)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    cpu_group = torch.distributed.new_group(backend="gloo")
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_trainer.checkpoint import Checkpointer, _materialize_optimizer_state
    from megatron_trainer.config import parse_args, world_layout
    from megatron_trainer.distributed import DistEnv
    from megatron_trainer.model import build_model, choose_path, transformer_config

    dp = world // (tp * pp)
    cfg = parse_args(argv(tp, pp, dp, ckpt, sharding))
    parallel_state.initialize_model_parallel(**cfg.parallel.megatron_sizes())
    env = DistEnv(rank, rank, world, world_layout(cfg, world), cpu_group)
    path = choose_path(cfg, have_te=False)
    tconfig = transformer_config(cfg, path)
    tconfig.use_cpu_initialization = True
    torch.manual_seed(0)
    model, _ = build_model(cfg, tconfig, path, VOCAB)
    t = cfg.training
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, bf16=True, params_dtype=tconfig.params_dtype, use_distributed_optimizer=True),
        model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=t.lr, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
    from megatron_trainer.compat import patch_distopt_state_load_for_torch_adam

    patch_distopt_state_load_for_torch_adam(optimizer)  # as the trainer does (loop.py)
    _materialize_optimizer_state(optimizer)
    ckpt_obj = Checkpointer(cfg, env, model, optimizer, scheduler, keep=0, optim_in_place=(mode == "ours"))
    result = {"rank": rank, "in_place": ckpt_obj.optim_in_place, "sharding": ckpt_obj.sharding_type}
    if action == "save":
        fill(optimizer, torch)
        ckpt_obj.save(1, dp, blocking=True)
    else:
        loaded = ckpt_obj.load()
        result.update(iteration=loaded.iteration if loaded else None, resharded=loaded.resharded if loaded else None)
    torch.save(dump(optimizer), os.path.join(out_dir, f"state_rank{rank}.pt"))
    with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    ckpt_obj.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
