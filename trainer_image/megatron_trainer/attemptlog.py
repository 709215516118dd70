"""Each rank's log of each restart attempt, kept on the checkpoint volume (pure: no torch).

`kubectl logs` loses a pod's log when the gang is recreated, and follows at most 5 streams at once
by default. With ``--save DIR`` every worker also writes what it prints (stdout and stderr of the
Python process: the trainer's log lines, warnings, tracebacks) to
``DIR/logs/attempt-<MEGATRON_RESTART_ATTEMPT>/rank-<RANK>.log``. Output that bypasses Python
(NCCL's and CUDA's own C-level prints) stays in the container log only. Never fatal: a volume that
cannot be written only costs the copy.
"""

from __future__ import annotations

import io
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO


def log_path(save_dir: str, restart_attempt: int, rank: int) -> Path:
    return Path(save_dir) / "logs" / f"attempt-{restart_attempt}" / f"rank-{rank:05d}.log"


class Tee(io.TextIOBase):
    """Writes to the original stream and to the attempt's file."""

    def __init__(self, stream: TextIO, file: TextIO):
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        self.stream.write(text)
        try:
            self.file.write(text)
        except (OSError, ValueError):
            pass  # the volume went away: the container log still has it
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        try:
            self.file.flush()
        except (OSError, ValueError):
            pass

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    @property
    def buffer(self):  # bytes written here reach the container log only
        return self.stream.buffer


def start(save_dir: str | None, restart_attempt: int, rank: int) -> Path | None:
    """Tee this process's stdout and stderr into the attempt's log file; the path, or None."""
    if not save_dir or "://" in save_dir:  # object storage: no log copy (the pod log stays the record)
        return None
    path = log_path(save_dir, restart_attempt, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(path, "a", buffering=1, encoding="utf-8")
    except OSError as exc:
        print(f"megatron_trainer: not keeping a log copy at {path}: {exc}", file=sys.stderr)
        return None
    file.write(f"===== restart attempt {restart_attempt}, rank {rank}, pod {os.environ.get('HOSTNAME', '?')}, "
               f"started {datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ} =====\n")
    sys.stdout = Tee(sys.stdout, file)
    sys.stderr = Tee(sys.stderr, file)
    return path
