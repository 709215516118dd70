"""Entry point: parse, set up, train, exit (0 after a completed run or a checkpoint on SIGTERM)."""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence

from . import attemptlog
from .config import parse_args, resolve_cuda_graph, resolve_sequence_parallel, runtime_from_env
from .exitcodes import ExitCode, Fatal, Lifecycle, Refusal, classify, fatal_message, write_termination_message


def setup_logging(rank: int, world_size: int) -> None:
    verbose = rank in (0, world_size - 1)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank}] %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    logging.getLogger("megatron_trainer").setLevel(logging.INFO if verbose else logging.WARNING)


def hf_start(cfg):
    """The checked --hf-init source when this start imports it (no complete checkpoint under --load),
    else None: a resume never reads the Hugging Face directory. Fatal on bad input."""
    if not cfg.checkpoint.hf_init or cfg.checkpoint.hf_export_only:  # an export reads only its config and tokenizer
        return None
    from .ckpt_layout import find_resume_checkpoint
    from .hf_source import validate_source

    load = cfg.checkpoint.load
    if load and load.startswith("s3://"):
        from .objstore import configure

        load = configure(load, cfg.checkpoint.object_store_endpoint, cfg.checkpoint.object_store_region)
    if load and find_resume_checkpoint(load) is not None:
        return None
    return validate_source(cfg.checkpoint.hf_init, cfg)


def main(argv: Sequence[str]) -> int:
    cfg = parse_args(argv)  # exits 2 on a bad command line (its message ends the log: FallbackToLogsOnError)
    try:
        runtime = runtime_from_env(os.environ)
    except ValueError as e:
        print(f"megatron_trainer: {e}", file=sys.stderr)
        return int(ExitCode.BAD_ARGUMENTS)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.training.device == "cpu":  # before anything of Megatron-Core runs (cpu.py says what it changes)
        import torch

        from .cpu import threads_per_process, use_cpu

        use_cpu(torch)
        torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    from .model import te_available

    have_te = te_available()
    cfg, sp_reason = resolve_sequence_parallel(cfg, have_te)
    cfg, graph_reason = resolve_cuda_graph(cfg, have_te)  # before CUDA and the process group start
    if cfg.checkpoint.hf_export_only:  # weights only, from any layout; no data
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
            cfg.checkpoint, no_load_optim=True, no_load_rng=True))
    try:
        from . import wandb_log

        wandb_log.preflight(cfg, os.environ)  # wandb importable, the key file readable: before any GPU is used
        from .tensorboard import preflight

        preflight(cfg.logging.tensorboard_dir)
        hf_source = hf_start(cfg)  # before anything is written: bad input leaves the checkpoint directory as it was
    except Fatal as exc:
        message = f"rank {rank}: exit {int(exc.code)} (not retried) during start-up: {exc}"
        print(f"megatron_trainer: {message}", file=sys.stderr, flush=True)
        write_termination_message(message)
        return int(exc.code)
    attemptlog.start(cfg.checkpoint.save, runtime.restart_attempt, rank)  # before logging picks its stream
    setup_logging(rank, world)
    # `kill -USR1 <trainer pid>` (kubectl exec) prints every thread's stack to the log: a hung rank explains itself.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if rank == 0:
        logging.getLogger("megatron_trainer").info("CUDA graph: %s (%s)", cfg.training.cuda_graph_impl, graph_reason)
        if sp_reason:
            logging.getLogger("megatron_trainer").info("sequence parallelism: %s (%s)",
                                                       "on" if cfg.parallel.sequence_parallel else "off", sp_reason)

    from .distributed import destroy_distributed, reap_children
    from .loop import Trainer, dump_summary

    trainer = None
    lifecycle = Lifecycle()
    try:
        trainer = Trainer(cfg, runtime, lifecycle, hf_source=hf_source)
        reason = "export-only" if cfg.checkpoint.hf_export_only else trainer.train()
        if cfg.checkpoint.hf_export and reason in ("done", "export-only"):
            trainer.export_hf()
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
        if not isinstance(exc, Refusal):  # a refusal's one line says it all (exitcodes.Refusal)
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
    code = stopped_exit_code(reason, trainer.state.iteration, cfg.training.train_iters)
    if rank == 0:
        print(f"megatron_trainer: exit {code} ({reason})", flush=True)
    return code


#: A stop on SIGTERM before the last iteration, after its checkpoint: 128 + SIGTERM, as a process the signal ended.
STOPPED_BY_SIGTERM = 128 + signal.SIGTERM


def stopped_exit_code(reason: str, iteration: int, train_iters: int) -> int:
    """0 for a finished run (or a stop the command line asked for: --exit-interval, --exit-duration-in-mins);
    143 for a run SIGTERM stopped before --train-iters, after its checkpoint. Exit 0 there would make Kubernetes
    count the pod Succeeded: its Job completes, and a JobSet whose pods were all SIGTERMed (a drain, a deleted
    pod's gang) ends Succeeded half-trained. 143 fails the pod instead, and the gang restarts from the checkpoint
    just written (an eviction's DisruptionTarget does not count against maxRestarts)."""
    return STOPPED_BY_SIGTERM if reason == "signal" and iteration < train_iters else 0
