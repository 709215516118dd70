"""TensorBoard event files for real: the trainer's writer on torch.utils.tensorboard, read back by tensorboard's
own reader (the package the trainer image carries). `make torch-tests` runs it (.venv-torch has both)."""

from __future__ import annotations

from test_tensorboard import step


def test_event_files_read_back_with_tensorboard(tmp_path):
    """The writer's event files, read by tensorboard's own reader (the package the trainer image carries)."""
    from conftest import require

    require("torch")
    event_accumulator = require("tensorboard.backend.event_processing.event_accumulator")
    from megatron_trainer.tensorboard import TensorBoardWriter

    writer = TensorBoardWriter(str(tmp_path), interval=1)
    writer.write([(9, 5.0), (10, 4.5)], step(10))
    writer.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(9, 5.0), (10, 4.5)]
    assert [e.value for e in acc.Scalars("throughput")] == [180.0]
