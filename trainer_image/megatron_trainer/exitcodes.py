"""The trainer's exit codes and its fatal-error message (pure: no torch).

A restart of the whole gang costs minutes of every GPU of the job; for some failures it can never
help. Those exit with a code of their own, which the operator renders into the pods' Job
``podFailurePolicy`` (``onExitCodes`` -> ``FailJob``) and a JobSet failure-policy rule
(``FailJobSet``): the job fails at once, with the reason in its status. Every other failure exits 1
(or 128 + N when killed by signal N) and is retried. docs/trainer-contract.md, "Exit codes".

The first fatal error of a pod is written to its termination log (``/dev/termination-log``,
``terminationMessagePath``), which the kubelet copies into the container's terminated state: the
operator shows it in ``status.lastFailure`` and an Event. When nothing was written there, the
kubelet falls back to the log's last lines (``terminationMessagePolicy: FallbackToLogsOnError``).
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

#: Where the kubelet reads the container's termination message (the pod's default path).
TERMINATION_LOG = "/dev/termination-log"
#: The kubelet keeps at most 4096 bytes of a termination message; leave room for the others' lines.
MAX_MESSAGE_BYTES = 3800


class ExitCode(enum.IntEnum):
    OK = 0
    #: Anything not classified below (NCCL errors, a lost peer, storage hiccups, ...): retried.
    ERROR = 1
    #: The command line or the environment is wrong (argparse's code): a restart runs the same one.
    BAD_ARGUMENTS = 2
    #: Training data, tokenizer or chat template missing or malformed (--data-path prefixes, .idx,
    #: --tokenizer-model's files, a fine-tuning line, a chat template that fails: sft.bad_input_is_fatal).
    BAD_DATA = 3
    #: CUDA out of memory before the first iteration finished: the same layout runs out again.
    OOM_AT_STARTUP = 4
    #: The checkpoint cannot be resumed by this job (--exit-on-missing-checkpoint with none there, a
    #: layout the saved optimizer state cannot be loaded into).
    BAD_CHECKPOINT = 5
    #: The GPU itself failed (uncorrectable ECC or NVLink error, GPU lost or off the bus): retried, and
    #: the operator keeps the job's later attempts off this node (status.avoidedNodes).
    GPU_FAULT = 6
    #: The object store refuses the checkpoint location: no such bucket, unknown access key, wrong
    #: secret key, access denied (objstore.NON_RETRIABLE_CODES). Throttling, timeouts and 5xx answers
    #: are ERROR (retried).
    OBJECT_STORE_REFUSED = 7
    #: The checkpoint volume is full: a save could not be written. The newest complete checkpoint is
    #: intact; a restart would resume from it and fill the volume again at its next save.
    CHECKPOINT_VOLUME_FULL = 8


#: Codes that fail the job at once (the operator renders the same list; tests/test_contract.py).
NON_RETRIABLE = (ExitCode.BAD_ARGUMENTS, ExitCode.BAD_DATA, ExitCode.OOM_AT_STARTUP, ExitCode.BAD_CHECKPOINT,
                 ExitCode.OBJECT_STORE_REFUSED, ExitCode.CHECKPOINT_VOLUME_FULL)


class Fatal(Exception):
    """An error with a known exit code; the message says what to change."""

    def __init__(self, code: ExitCode, message: str):
        super().__init__(message)
        self.code = code


class Refusal(Fatal):
    """A start-up decision that refuses the job as asked (a kernel or extension this machine lacks, a flag the
    chosen path cannot serve): its one line says what to change, so no traceback follows it in the log or in
    the termination message (main.py)."""


@dataclass
class Lifecycle:
    """How far the worker got: the stage a fatal error is reported in (and status.progress.stage shows),
    and whether an OOM is at start-up."""

    stage: str = "start-up"
    first_iteration_done: bool = False
    on_stage: Callable[[str], None] | None = None  # rank 0: writes the stage to status.progress
    marks: list[tuple[str, float]] = field(default_factory=list)  # (stage, time.monotonic() it began)

    def enter(self, stage: str) -> None:
        self.stage = stage
        self.marks.append((stage, time.monotonic()))
        if self.on_stage is not None:
            self.on_stage(stage)

    def breakdown(self, started: float, until: float) -> list[tuple[str, float]]:
        """Seconds per start-up stage from `started` (the process's start, monotonic) to `until`: the time
        before the first stage is the interpreter and imports; a stage entered twice is summed."""
        out: dict[str, float] = {}
        edges = [("interpreter and imports", started)] + [m for m in self.marks if m[1] <= until]
        for (stage, t0), (_, t1) in zip(edges, edges[1:] + [("", until)], strict=True):
            out[stage] = out.get(stage, 0.0) + max(0.0, t1 - t0)
        return list(out.items())


#: Errors that mean the data or tokenizer files are missing or malformed (not a storage hiccup).
DATA_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, ValueError)


@contextlib.contextmanager
def data_errors_are_fatal(flag: str) -> Iterator[None]:
    """Turn a missing or malformed file under ``flag`` into exit code BAD_DATA."""
    try:
        yield
    except DATA_ERRORS as exc:
        raise Fatal(ExitCode.BAD_DATA, f"{flag}: {type(exc).__name__}: {exc}") from exc


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError), without importing torch."""
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


#: What CUDA, NCCL and NVML say when the hardware failed (cudaErrorECCUncorrectable,
#: cudaErrorNvlinkUncorrectable, NVML_ERROR_GPU_IS_LOST, Xid 79 "fallen off the bus"). Software
#: faults (illegal memory access, device-side asserts) are not here: they follow the job, not the node.
GPU_FAULT_MARKERS = ("uncorrectable ecc error", "uncorrectable nvlink error", "gpu is lost", "fallen off the bus",
                     "nvml_error_gpu_is_lost")


def is_gpu_fault(exc: BaseException) -> bool:
    """A CUDA/NCCL/NVML error that blames the GPU hardware (checked through the exception's causes)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur).lower()
        if any(m in text for m in GPU_FAULT_MARKERS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def object_store_refused(exc: BaseException) -> bool:
    """An S3 answer (botocore ClientError, or objstore.ObjectStoreError) in the exception's chain
    whose error code says retrying cannot help (no bucket, bad credentials, access denied)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ == "ObjectStoreError":
            return not getattr(cur, "retriable", True)
        if type(cur).__name__ == "ClientError" and isinstance(getattr(cur, "response", None), dict):
            from .objstore import NON_RETRIABLE_CODES

            code = (cur.response.get("Error") or {}).get("Code", "")
            return code in NON_RETRIABLE_CODES and code not in ("403", "404")
        cur = cur.__cause__ or cur.__context__
    return False


def classify(exc: BaseException, first_iteration_done: bool) -> ExitCode:
    """The exit code for an exception that ends a worker."""
    if isinstance(exc, Fatal):
        return exc.code
    if object_store_refused(exc):
        return ExitCode.OBJECT_STORE_REFUSED
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return ExitCode(code) if code in ExitCode.__members__.values() else ExitCode.ERROR
    if is_gpu_fault(exc):
        return ExitCode.GPU_FAULT
    if is_out_of_memory(exc) and not first_iteration_done:
        return ExitCode.OOM_AT_STARTUP
    return ExitCode.ERROR


def fatal_message(exc: BaseException, code: ExitCode, rank: int, stage: str) -> str:
    """One short paragraph: who, which code and why, the error, and the innermost frames (none for a Refusal:
    its one line is the whole message)."""
    what = {ExitCode.BAD_ARGUMENTS: "bad command line or environment", ExitCode.BAD_DATA: "bad training data",
            ExitCode.OOM_AT_STARTUP: "CUDA out of memory before the first iteration",
            ExitCode.BAD_CHECKPOINT: "checkpoint cannot be resumed",
            ExitCode.GPU_FAULT: "GPU hardware fault on this node",
            ExitCode.OBJECT_STORE_REFUSED: "the object store refuses the checkpoint location",
            ExitCode.ERROR: "error"}.get(code, "error")
    retry = "not retried" if code in NON_RETRIABLE else "retried"
    head = f"rank {rank}: exit {int(code)} ({what}; {retry}) during {stage}: {type(exc).__name__}: {exc}"
    frames = traceback.format_tb(exc.__traceback__)[-3:] if exc.__traceback__ and not isinstance(exc, Refusal) else []
    text = head + ("\n" + "".join(frames).rstrip() if frames else "")
    data = text.encode()
    return text if len(data) <= MAX_MESSAGE_BYTES else data[:MAX_MESSAGE_BYTES].decode(errors="ignore") + " ..."


def write_termination_message(text: str, path: str = TERMINATION_LOG) -> bool:
    """Write ``text`` unless another worker of the pod wrote first (the first failure is the cause).
    Returns whether it was written; never raises (a missing or read-only file is no reason to crash)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_size > 0:
            return False
        os.write(fd, text.encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
