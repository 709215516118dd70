"""The trainer's exit codes (docs/trainer-contract.md, "Exit codes") and its termination message."""

from __future__ import annotations

import threading

import pytest
from megatron_trainer.exitcodes import (
    MAX_MESSAGE_BYTES,
    NON_RETRIABLE,
    ExitCode,
    Fatal,
    classify,
    data_errors_are_fatal,
    fatal_message,
    write_termination_message,
)


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError (classified by name: the module never imports torch)."""


@pytest.mark.parametrize("exc, first_iteration_done, code", [
    (Fatal(ExitCode.BAD_DATA, "x"), False, ExitCode.BAD_DATA),
    (Fatal(ExitCode.BAD_CHECKPOINT, "x"), True, ExitCode.BAD_CHECKPOINT),
    (OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False, ExitCode.OOM_AT_STARTUP),
    (OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True, ExitCode.ERROR),  # fragmentation: retry
    (RuntimeError("NCCL error: unhandled system error"), False, ExitCode.ERROR),
    (SystemExit(2), False, ExitCode.BAD_ARGUMENTS),
    (SystemExit(77), False, ExitCode.ERROR),
    (KeyError("x"), True, ExitCode.ERROR),
    # the hardware: the node is blamed (CUDA's, NCCL's and NVML's own wording)
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), True, ExitCode.GPU_FAULT),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.27.3\n"
                  "Last error:\nCuda failure 'uncorrectable NVLink error was detected during the execution'"),
     True, ExitCode.GPU_FAULT),
    (RuntimeError("NVML_ERROR_GPU_IS_LOST"), False, ExitCode.GPU_FAULT),
    # software faults follow the job, not the node
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True, ExitCode.ERROR),
    (RuntimeError("CUDA error: device-side assert triggered"), True, ExitCode.ERROR),
])
def test_classify(exc, first_iteration_done, code):
    assert classify(exc, first_iteration_done) == code


def test_a_gpu_fault_is_found_through_the_exceptions_causes():
    try:
        try:
            raise RuntimeError("CUDA error: GPU is lost")
        except RuntimeError as inner:
            raise ValueError("loss is NaN") from inner
    except ValueError as outer:
        assert classify(outer, True) == ExitCode.GPU_FAULT


def test_non_retriable_codes_are_the_documented_ones():
    assert [int(c) for c in NON_RETRIABLE] == [2, 3, 4, 5, 7, 8]
    assert ExitCode.ERROR not in NON_RETRIABLE


@pytest.mark.parametrize("error", [FileNotFoundError("/data/x.idx"), ValueError("/data/x.idx: bad header"),
                                   PermissionError("/data")])
def test_data_errors_become_bad_data(error):
    with pytest.raises(Fatal) as exc, data_errors_are_fatal("--data-path"):
        raise error
    assert exc.value.code == ExitCode.BAD_DATA and str(exc.value).startswith("--data-path: ")


def test_other_errors_pass_through_data_guard():
    with pytest.raises(ConnectionError), data_errors_are_fatal("--data-path"):
        raise ConnectionError("storage went away")  # a storage hiccup is retried, not a data error


def test_fatal_message_names_rank_code_stage_and_error():
    try:
        raise Fatal(ExitCode.BAD_DATA, "--data-path: FileNotFoundError: /data/a.idx")
    except Fatal as e:
        text = fatal_message(e, e.code, 3, "building the data index")
    first = text.splitlines()[0]
    assert first == ("rank 3: exit 3 (bad training data; not retried) during building the data index: "
                     "Fatal: --data-path: FileNotFoundError: /data/a.idx")
    assert "test_exitcodes.py" in text  # the innermost frames follow
    long = fatal_message(RuntimeError("x" * 10000), ExitCode.ERROR, 0, "training")
    assert len(long.encode()) <= MAX_MESSAGE_BYTES + 4 and "retried" in long


def test_first_writer_wins(tmp_path):
    path = tmp_path / "termination-log"
    path.touch()  # the kubelet creates it empty
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(write_termination_message(f"rank {i}", str(path))))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1
    assert path.read_text() in {f"rank {i}" for i in range(8)}


def test_unwritable_termination_log_is_no_crash(tmp_path):
    assert write_termination_message("x", str(tmp_path / "missing-dir" / "log")) is False


def test_a_stop_on_sigterm_before_the_end_fails_the_pod():
    """exit 143 after the checkpoint on SIGTERM, unless that was the last iteration: exit 0 would make Kubernetes
    count the pod Succeeded (a drained gang would end the JobSet Succeeded half-trained)."""
    from megatron_trainer.exitcodes import NON_RETRIABLE
    from megatron_trainer.main import STOPPED_BY_SIGTERM, stopped_exit_code

    assert STOPPED_BY_SIGTERM == 143 and STOPPED_BY_SIGTERM not in NON_RETRIABLE  # retried: the gang restarts
    assert stopped_exit_code("signal", 17, 40) == 143
    assert stopped_exit_code("signal", 40, 40) == 0  # nothing left to train
    assert stopped_exit_code("done", 40, 40) == 0
    assert stopped_exit_code("exit-duration", 17, 40) == 0  # the command line asked for it
    assert stopped_exit_code("export-only", 0, 40) == 0
