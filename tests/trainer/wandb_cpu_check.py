"""The trainer's W&B logging run for real on CPUs: two gloo ranks, the trainer's own Trainer.log_iterations and
_wandb_writer (the run on the last rank), a tiny torch model whose losses are logged, wandb in offline mode.

    python -m torch.distributed.run --nproc-per-node=2 tests/trainer/wandb_cpu_check.py FIRST LAST OUT ARGS...

Iterations FIRST+1..LAST are trained and logged (each one a log line); ARGS is the trainer's command line. Each rank
writes OUT/rank<r>.json: the losses it printed, the run id, and whether any key material was in its environment or
its wandb-core child's. tests/trainer/test_wandb_torch.py asserts on them and on the run's files.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "contract")]


def main(first: int, last: int, out: str, argv: list[str]) -> None:
    import types

    import psutil
    import torch
    from megatron_trainer.config import RuntimeConfig, parse_args
    from megatron_trainer.loop import Trainer, TrainState

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = parse_args(argv)

    class Stub:  # the attributes Trainer.log_iterations reads; its methods are the Trainer's own
        log_iterations, _log_wandb, _wandb_writer = Trainer.log_iterations, Trainer._log_wandb, Trainer._wandb_writer

        def _write_progress(self):
            pass

    me = Stub()
    me.cfg, me.is_logging_rank, me.router_monitor, me.tensorboard = cfg, rank == world - 1, None, None
    me.env = types.SimpleNamespace(cpu_group=torch.distributed.group.WORLD, world_size=world,
                                   layout=types.SimpleNamespace(global_batch_size=cfg.training.global_batch_size))
    me.state = TrainState(iteration=first)
    me.flops_per_iteration, me.tokens_per_iteration = 1e9, 512
    me.metrics = types.SimpleNamespace(set=lambda *a, **k: None)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    me.optimizer = opt
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    me.wandb = me._wandb_writer(cfg, RuntimeConfig(job_name="wandb-check"))
    key_file = cfg.logging.wandb_api_key_file
    key = Path(key_file).read_text().strip() if key_file else None
    children_env_has_key = False
    for it in range(first + 1, last + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        opt.step()
        me.state.iteration = it
        pending = [(it, loss.detach())] if me.is_logging_rank else []
        me.log_iterations(pending, 0.01, grad_norm)
    if key:
        for child in psutil.Process().children(recursive=True):
            try:
                children_env_has_key |= any(key in v for v in child.environ().values())
            except psutil.Error:
                pass
    run_id = me.wandb.run_id if me.wandb is not None else None
    if me.wandb is not None:
        me.wandb.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "losses": {str(k): v for k, v in me.state.losses.items()}, "run_id": run_id,
        "env_has_key": bool(key) and any(key in v for v in os.environ.values()),
        "children_env_has_key": children_env_has_key}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:])
