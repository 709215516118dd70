"""Entry point: parse, set up, train, exit (0 after a completed run or a checkpoint on SIGTERM)."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence

from . import attemptlog
from .config import parse_args, runtime_from_env
from .exitcodes import ExitCode, Lifecycle, classify, fatal_message, write_termination_message


def setup_logging(rank: int, world_size: int) -> None:
    verbose = rank in (0, world_size - 1)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("megatron_trainer").setLevel(logging.INFO if verbose else logging.WARNING)


def main(argv: Sequence[str]) -> int:
    cfg = parse_args(argv)  # exits 2 on a bad command line (its message ends the log: FallbackToLogsOnError)
    try:
        runtime = runtime_from_env(os.environ)
    except ValueError as e:
        print(f"megatron_trainer: {e}", file=sys.stderr)
        return int(ExitCode.BAD_ARGUMENTS)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    attemptlog.start(cfg.checkpoint.save, runtime.restart_attempt, rank)  # before logging picks its stream
    setup_logging(rank, world)

    from .distributed import destroy_distributed, reap_children
    from .loop import Trainer, dump_summary

    trainer = None
    lifecycle = Lifecycle()
    try:
        trainer = Trainer(cfg, runtime, lifecycle)
        reason = trainer.train()
        summary = trainer.summary()
        if trainer.env.is_rank0 or trainer.is_logging_rank:
            summary["stop_reason"] = reason
            dump_summary(summary)
        trainer.close()
        destroy_distributed()
    except Exception as exc:
        # One exit code per kind of failure (exitcodes.py): the operator fails the job at once for
        # the ones a restart cannot fix. The first failing worker's message goes to the termination log.
        if trainer is not None:
            trainer.close(abort=True)
        code = classify(exc, lifecycle.first_iteration_done)
        traceback.print_exc()
        message = fatal_message(exc, code, rank, lifecycle.stage)
        print(f"megatron_trainer: {message.splitlines()[0]}", file=sys.stderr, flush=True)
        write_termination_message(message)
        return int(code)
    except BaseException:
        if trainer is not None:
            trainer.close(abort=True)
        raise
    finally:
        reap_children()
    if rank == 0:
        print(f"megatron_trainer: exit 0 ({reason})", flush=True)
    return 0
