"""A save that fails on a full volume, as the async writer reports it (torch.distributed.checkpoint's
CheckpointException, a BaseException, wrapping "Worker failure: ..."; seen on 4 x H100, issue 49): exit 8 with the
volume named and the failed save removed; any other save failure an ordinary, retried error. Needs torch."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from conftest import require

require("torch")
require("megatron.core")

from megatron_trainer.checkpoint import Checkpointer  # noqa: E402
from megatron_trainer.exitcodes import ExitCode, Fatal  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402


def _checkpointer(root, needed: int):
    return SimpleNamespace(save_dir=root, checkpoint_bytes=needed, env=SimpleNamespace(is_rank0=True),
                           stats=SimpleNamespace(last_published=10), keep=2)


def test_a_write_failure_on_a_full_volume_is_exit_8(tmp_path):
    failed = tmp_path / "iter_0000020"
    failed.mkdir()
    (failed / "__0_0.distcp").write_bytes(b"part of a shard")
    me = _checkpointer(tmp_path, 2 * shutil.disk_usage(tmp_path).free)
    worker = RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'RuntimeError'>")
    with pytest.raises(Fatal) as caught, Checkpointer._volume_full_is_fatal(me, 20, failed):
        raise CheckpointException("write", {0: (worker, [])})
    message = str(caught.value)
    assert caught.value.code == ExitCode.CHECKPOINT_VOLUME_FULL and "\n" not in message
    assert message.startswith(f"the checkpoint volume at {tmp_path} is full: a save needs about ")
    assert "saving iteration 20 failed, the newest complete checkpoint (iteration 10) is intact" in message
    assert not failed.exists()


def test_another_write_failure_is_an_ordinary_error(tmp_path):
    me = _checkpointer(tmp_path, 1024)
    with pytest.raises(RuntimeError, match="^checkpoint save failed: "), \
            Checkpointer._volume_full_is_fatal(me, 20, tmp_path / "iter_0000020"):
        raise CheckpointException("write", {0: (RuntimeError("connection reset"), [])})


def test_the_interval_warning_says_how_long_the_loop_waited_and_what_interval_works():
    from megatron_trainer.checkpoint import interval_warning

    text = interval_warning(10, 20, 78.6, 62.0, 1.56)
    assert text == ("saves every 10 iterations (~16 s) come faster than one is written (the save of iteration 20 took "
                    "79 s): the loop waited 62.0 s for it. A save interval of at least 61 iterations avoids it.")
    assert "(~0.07 s)" in interval_warning(10, 10, 12.0, 6.0, 0.007)
    assert "avoids" not in interval_warning(10, 10, 12.0, 6.0, None)
