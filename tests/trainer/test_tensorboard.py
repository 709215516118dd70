"""TensorBoard scalars: Megatron-LM's names and x axes (megatron/training/training.py, training_log)."""

from __future__ import annotations

from megatron_trainer.tensorboard import StepFigures, scalars

MEM = {"reserved_bytes.all.current": 4e9, "allocated_bytes.all.current": 3e9, "allocated_bytes.all.peak": 3.5e9,
       "allocation.all.current": 120}


def step(iteration, grad_norm=1.5, lr=3e-4):
    return StepFigures(iteration, global_batch_size=16, world_size=2, learning_rate=lr, grad_norm=grad_norm,
                       seconds_per_iteration=0.25, tflops_per_gpu=180.0, memory=MEM)


def test_every_megatron_lm_scalar_at_the_log_iteration():
    out = scalars([(9, 5.0), (10, 4.5)], step(10), interval=1)
    tags = {t for t, _, _ in out}
    assert tags == {"lm loss", "lm loss vs samples", "learning-rate", "learning-rate vs samples", "batch-size",
                    "batch-size vs samples", "world-size", "world-size vs samples", "grad-norm",
                    "grad-norm vs samples", "iteration-time", "throughput", "mem-reserved-bytes",
                    "mem-allocated-bytes", "mem-max-allocated-bytes", "mem-allocated-count"}
    by = {(t, x): v for t, v, x in out}
    assert by[("lm loss", 9)] == 5.0 and by[("lm loss", 10)] == 4.5  # every iteration of the window
    assert by[("lm loss vs samples", 160)] == 4.5 and by[("batch-size", 10)] == 16
    assert by[("learning-rate", 10)] == 3e-4 and by[("grad-norm vs samples", 160)] == 1.5
    assert by[("iteration-time", 10)] == 0.25 and by[("throughput", 10)] == 180.0
    assert by[("mem-max-allocated-bytes", 10)] == 3.5e9 and by[("world-size", 10)] == 2


def test_interval_and_missing_values():
    out = scalars([(3, 6.0), (4, 5.5), (5, 5.2)], step(5, grad_norm=None, lr=None), interval=2)
    assert [(t, x) for t, _, x in out] == [("lm loss", 4), ("lm loss vs samples", 64)]  # 5 is off the interval
    out = scalars([(6, 5.0)], step(6, grad_norm=None, lr=None), interval=2)
    tags = {t for t, _, _ in out}
    assert "grad-norm" not in tags and "learning-rate" not in tags and "throughput" in tags


def test_preflight_refuses_an_image_without_the_tensorboard_package(monkeypatch):
    """A job with logging.tensorboard on an image without the package exits 2 (not retried) before it starts,
    instead of exit 1 (retried: a crash loop) at its first log line."""
    import importlib.util

    import pytest
    from megatron_trainer import tensorboard
    from megatron_trainer.exitcodes import NON_RETRIABLE, ExitCode, Fatal

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(Fatal) as exc:
        tensorboard.preflight("/checkpoints/run/tensorboard")
    assert exc.value.code == ExitCode.BAD_ARGUMENTS and exc.value.code in NON_RETRIABLE
    assert "needs the tensorboard package" in str(exc.value)
    tensorboard.preflight(None)  # no --tensorboard-dir: nothing to check

