"""Process groups from torchrun's environment, Megatron-Core parallel state, and preemption signals."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import time
from dataclasses import dataclass

import torch

from .config import TrainerConfig, WorldLayout, world_layout

log = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    layout: WorldLayout
    cpu_group: torch.distributed.ProcessGroup  # gloo, whole world: flags that must not touch CUDA streams

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: TrainerConfig) -> DistEnv:
    """torch.distributed (NCCL; gloo with --device cpu) from the launcher's env, then `initialize_model_parallel`
    by keyword."""
    from megatron.core import parallel_state

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    layout = world_layout(cfg, world_size)  # ValueError says which size does not divide
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if cfg.parallel.tensor > 1 or cfg.parallel.context > 1:
        # Megatron-LM asserts this on Hopper (arguments.py, validate_args): kernel order for comm/compute overlap.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    if cfg.training.deterministic_mode:  # before NCCL, cuBLAS and the first kernel read their settings
        from .determinism import enable

        set_now = enable(os.environ)
        log.info("deterministic mode: %s, torch deterministic algorithms on", ", ".join(set_now) or "env as given")
    on_cpu = cfg.training.device == "cpu"
    if not on_cpu:
        torch.cuda.set_device(local_rank)
    if cfg.training.cuda_graph_impl == "full_iteration":
        # Run everything on the stream the graph is captured on. Megatron's DDP keeps each
        # parameter's AccumulateGrad node from its construction; a node made on the legacy default
        # stream breaks the capture on torch builds without set_override_stale_capture_stream
        # (seen with torch 2.11: cudaErrorStreamCaptureImplicit in backward).
        from megatron.core.full_cuda_graph import get_shared_capture_stream

        torch.cuda.set_stream(get_shared_capture_stream())
    minutes = cfg.training.distributed_timeout_minutes
    timeout = {} if minutes is None else {"timeout": datetime.timedelta(minutes=minutes)}
    if on_cpu:  # gloo for everything: Megatron-Core's groups follow the world group's backend
        torch.distributed.init_process_group(backend="gloo", rank=rank, world_size=world_size, **timeout)
    else:
        torch.distributed.init_process_group(backend="nccl", rank=rank, world_size=world_size,
                                             device_id=torch.device("cuda", local_rank), **timeout)
    cpu_group = torch.distributed.new_group(backend="gloo", **timeout)
    parallel_state.initialize_model_parallel(
        **cfg.parallel.megatron_sizes(), **({} if minutes is None else {"distributed_timeout_minutes": minutes}))
    set_random_seed(cfg.training.seed, graph_safe=cfg.training.cuda_graph_impl != "none")
    return DistEnv(rank, local_rank, world_size, layout, cpu_group)


def set_random_seed(seed: int, graph_safe: bool = False) -> None:
    """Megatron-LM's `_set_random_seed`: every generator, offset per pipeline stage.

    The CPU generators matter: some weights are initialised on the CPU (e.g. the learned position
    embedding, a torch.nn.Embedding), so without this two runs of one command start apart.
    """
    import random

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # graph_safe: the tracker's states become torch.Generators a CUDA graph can register and replay.
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graph_safe, force_reset_rng=graph_safe)


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


class StopSignal:
    """Records SIGTERM (and SIGINT) so the loop can stop at a step boundary on every rank.

    torchrun's agent forwards SIGTERM to each worker's process group (os.killpg) and sends SIGKILL
    after its shutdown timeout (torch/distributed/elastic/multiprocessing/api.py: 30 s by default,
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT / --shutdown-timeout where the torch version has them).
    """

    def __init__(self):
        self.received: int | None = None
        self.received_at: float | None = None
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
            # Only async-signal-safe work here; the loop logs it.

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def any_rank(flag: bool, env: DistEnv) -> bool:
    """True on every rank if `flag` is true on any rank (gloo all-reduce: no CUDA sync)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=env.cpu_group)
    return bool(t.item())


class ignore_sigterm:
    """Context: child processes started inside inherit SIG_IGN for SIGTERM (it survives exec).

    torchrun signals the whole process group, so without this the async checkpoint writer and
    DataLoader workers would die before the final checkpoint is written.
    """

    def __enter__(self):
        self._old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._old)
        return False


def ignore_sigterm_in_worker(_worker_id: int) -> None:
    """DataLoader worker_init_fn: torch installs a SIGTERM handler in workers; replace it with SIG_IGN."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def reap_children(timeout_s: float = 5.0) -> None:
    """End helper processes still alive at exit (DataLoader workers, the results Manager, the writer).

    They ignore SIGTERM (see `ignore_sigterm`), so multiprocessing's atexit handler, which sends
    SIGTERM to daemonic children and then joins them without a timeout, would wait forever.
    """
    import multiprocessing
    import sys

    async_utils = sys.modules.get("megatron.core.dist_checkpointing.strategies.async_utils")
    if async_utils is not None and async_utils.AsyncCallsQueue._persistent_caller is not None:
        # Its __del__ would otherwise put 'DONE' and join a queue nobody serves any more.
        async_utils.AsyncCallsQueue._persistent_caller.close(abort=True)
        async_utils.AsyncCallsQueue._persistent_caller = None
    # torch's DataLoader SIGCHLD handler would turn the kill of a worker into an exception.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()
    for child in multiprocessing.active_children():
        child.join(timeout_s)


def start_compile_workers() -> None:
    """Start torch.compile's (Inductor's) compile worker pool now, with SIGTERM ignored.

    Inductor starts its pool lazily, at the first compile, outside `ignore_sigterm`. The SIGTERM that
    torchrun or the launcher sends to the rank's process group then kills those workers, and a compile
    that comes after it (the fused SwiGLU/GeLU kernels in eval mode at a validation step) waits for
    them forever: seen on an H100 as a pod that ignored SIGTERM until its grace period ran out."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:  # pragma: no cover - torch without Inductor
        return
    with ignore_sigterm():
        AsyncCompile.warm_pool()
