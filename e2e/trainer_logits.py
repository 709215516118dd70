#!/usr/bin/env python3
"""The oracle of the real-pods e2e test (e2e/test_real_training.py), run on the host with the torch test venv:

    .venv-torch/bin/python e2e/trainer_logits.py make-model DIR          # a tiny Llama + tokenizer (from_config)
    .venv-torch/bin/python e2e/trainer_logits.py compare CKPT_DIR EXPORT_DIR

`make-model` writes the job's Hugging Face start: transformers' `from_config` + `save_pretrained` (random
weights, nothing downloaded) and a word-level tokenizer, as the HF CPU tests make theirs.

`compare` builds Megatron-Core's model with the trainer's own functions (one gloo rank on the CPU), loads the
weights of the newest complete checkpoint the job's pods wrote (through the trainer's Checkpointer, resharded
from the job's layout to TP 1), and computes fp32 logits on a fixed batch; transformers loads the export the
pods wrote (`from_pretrained`, fp32) and computes its logits on the same batch. Prints one JSON line: the max
absolute difference, the argmax agreement and what was read.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "contract"), str(ROOT / "tests" / "trainer")]


def make_model(directory: Path) -> None:
    import hf_cpu_check

    directory.mkdir(parents=True, exist_ok=True)
    config = hf_cpu_check.make_model("tiny-llama3", directory, "float32")
    print(json.dumps({"config": config}))


def compare(ckpt: Path, export: Path) -> None:
    import hf_cpu_check
    import torch
    from megatron_trainer.cpu import use_cpu

    # transformers' logits first: under the trainer's CPU shims (cpu.use_cpu wraps torch.tensor and other
    # factories) transformers' own forward gave different, run-to-run varying logits (6e-3 off on a tiny Llama),
    # while Megatron-Core's were bit-identical with and without them.
    config = json.loads((export / "config.json").read_text())
    torch.manual_seed(7)
    tokens = torch.randint(0, config["vocab_size"], (hf_cpu_check.BATCH, hf_cpu_check.SEQ))
    theirs = hf_cpu_check.hf_logits(export, tokens, "float32", "cpu")
    use_cpu(torch)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29777"))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    cpu_group = torch.distributed.new_group(backend="gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_trainer.checkpoint import Checkpointer
    from megatron_trainer.config import parse_args, world_layout
    from megatron_trainer.distributed import DistEnv
    from megatron_trainer.model import build_model, choose_path, transformer_config

    argv = hf_cpu_check.trainer_argv(config, 1, 1, "fp32") + [
        "--load", str(ckpt), "--ckpt-format", "torch_dist", "--no-load-optim", "--no-load-rng", "--device", "cpu",
        "--use-distributed-optimizer"]
    cfg = parse_args(argv)
    ps.initialize_model_parallel()
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    env = DistEnv(0, 0, 1, world_layout(cfg, 1), cpu_group)
    path = choose_path(cfg, have_te=False)
    tconfig = transformer_config(cfg, path)
    model, _ = build_model(cfg, tconfig, path, cfg.model.vocab_size)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=0.0, params_dtype=tconfig.params_dtype,
                                                       use_distributed_optimizer=True), model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-4, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=1, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1, wd_incr_style="constant")
    checkpointer = Checkpointer(cfg, env, model, optimizer, scheduler, keep=0)
    loaded = checkpointer.load()
    if loaded is None:
        raise SystemExit(f"no complete checkpoint under {ckpt}")
    for chunk in model:
        chunk.eval()
    ours = hf_cpu_check.megatron_logits(model, tokens, config["vocab_size"], "cpu")
    print(json.dumps({"iteration": loaded.iteration, "max_abs_diff": float((ours - theirs).abs().max()),
                      "logit_scale": float(theirs.abs().max()),
                      "argmax_equal": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
                      "export_files": sorted(p.name for p in export.iterdir())}))
    checkpointer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["make-model"]:
        make_model(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["compare"]:
        compare(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        raise SystemExit(__doc__)
