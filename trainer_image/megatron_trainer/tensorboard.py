"""TensorBoard event files under --tensorboard-dir, with Megatron-LM's scalar names.

The names and x axes are Megatron-LM's (`megatron/training/training.py`, `training_log`, core_v0.19.0),
so dashboards and comparisons made for Megatron-LM runs read these files unchanged: `lm loss`,
`learning-rate`, `batch-size`, `grad-norm`, `world-size` (each also `... vs samples`),
`iteration-time` (seconds), `throughput` (TFLOP/s/GPU), `mem-reserved-bytes`, `mem-allocated-bytes`,
`mem-max-allocated-bytes`, `mem-allocated-count`. Megatron-LM writes the memory and timing scalars only
with --log-memory-to-tensorboard / --log-timers-to-tensorboard; this trainer always writes them. Like
Megatron-LM, the last rank (it holds the loss) writes, every --tensorboard-log-interval iterations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepFigures:
    """What the trainer knows when it writes a log line (the window's last iteration)."""

    iteration: int
    global_batch_size: int
    world_size: int
    learning_rate: float | None
    grad_norm: float | None
    seconds_per_iteration: float
    tflops_per_gpu: float
    memory: Mapping[str, float]  # torch.cuda.memory_stats() keys


MEMORY_SCALARS = (("mem-reserved-bytes", "reserved_bytes.all.current"),
                  ("mem-allocated-bytes", "allocated_bytes.all.current"),
                  ("mem-max-allocated-bytes", "allocated_bytes.all.peak"),
                  ("mem-allocated-count", "allocation.all.current"))


def scalars(losses: Sequence[tuple[int, float]], step: StepFigures, interval: int) -> list[tuple[str, float, int]]:
    """(tag, value, x) for one log window: `lm loss` of each of its iterations on the interval, the
    other scalars at the window's last iteration if that is on the interval."""
    out: list[tuple[str, float, int]] = []
    gbs = step.global_batch_size
    for it, loss in losses:
        if it % interval == 0:
            out += [("lm loss", loss, it), ("lm loss vs samples", loss, it * gbs)]
    it = step.iteration
    if it % interval:
        return out
    samples = it * gbs
    if step.learning_rate is not None:
        out += [("learning-rate", step.learning_rate, it), ("learning-rate vs samples", step.learning_rate, samples)]
    out += [("batch-size", gbs, it), ("batch-size vs samples", gbs, samples),
            ("world-size", step.world_size, it), ("world-size vs samples", step.world_size, samples)]
    if step.grad_norm is not None:
        out += [("grad-norm", step.grad_norm, it), ("grad-norm vs samples", step.grad_norm, samples)]
    out += [("iteration-time", step.seconds_per_iteration, it), ("throughput", step.tflops_per_gpu, it)]
    out += [(tag, float(step.memory[key]), it) for tag, key in MEMORY_SCALARS if key in step.memory]
    return out


def preflight(tensorboard_dir: str | None) -> None:
    """Before anything starts: --tensorboard-dir needs the tensorboard package (torch.utils.tensorboard's
    SummaryWriter imports it). Missing, it is a Fatal BAD_ARGUMENTS (not retried: the same image fails again)."""
    import importlib.util

    from .exitcodes import ExitCode, Fatal

    if tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise Fatal(ExitCode.BAD_ARGUMENTS, "--tensorboard-dir needs the tensorboard package, which this trainer "
                    "image lacks (pip install tensorboard, or set spec.logging.tensorboard: false)")


class TensorBoardWriter:
    """torch.utils.tensorboard's SummaryWriter on the writing rank."""

    def __init__(self, log_dir: str, interval: int = 1, queue_size: int = 1000):
        preflight(log_dir)
        from torch.utils.tensorboard import SummaryWriter
        if interval < 1:
            raise ValueError(f"--tensorboard-log-interval must be >= 1, got {interval}")
        self.interval = interval
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def write(self, losses: Sequence[tuple[int, float]], step: StepFigures) -> None:
        for tag, value, x in scalars(losses, step, self.interval):
            self.writer.add_scalar(tag, value, x)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
