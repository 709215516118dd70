"""torch_dist checkpoints through Megatron-Core `dist_checkpointing`: save (sync or async), resume, retention.

- Model, optimizer (with the reshardable sharding metadata Megatron-LM passes), RNG, scheduler,
  iteration and consumed samples in one sharded state dict.
- Async: `dist_checkpointing.save(..., async_sharded_save=True)` returns a request that a persistent
  writer process runs; its finalize functions run on every rank once every rank's writer is done:
  Megatron's (global `.metadata`, then `metadata.json`), then ours (tracker by temp + rename,
  then retention). A checkpoint is therefore complete before the tracker names it.
- Resume picks the newest complete checkpoint (ckpt_layout.find_resume_checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from . import ckpt_layout
from .config import TrainerConfig
from .distributed import DistEnv, any_rank, ignore_sigterm
from .exitcodes import ExitCode, Fatal

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass
class SaveRecord:
    iteration: int
    path: Path
    started: float
    blocked_s: float
    asynchronous: bool


@dataclass
class LoadResult:
    iteration: int
    consumed_samples: int
    path: Path
    reason: str
    seconds: float
    resharded: bool = False


@dataclass
class CheckpointStats:
    saves: list[dict] = field(default_factory=list)
    last_published: int | None = None


def _noop() -> None:
    """The async writer's first request, run in the writer process: import what a save needs there."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async
    import megatron.core.dist_checkpointing.strategies.torch
    import megatron.core.optimizer  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401


def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state before a checkpoint is loaded into it.

    torch.optim.AdamW (the optimizer without TE/apex) creates `step`, `exp_avg` and `exp_avg_sq` at
    its first step, but Megatron builds the optimizer's sharded state dict from the existing state
    (DistributedOptimizer.state_dict asserts one common `step`; the fp16 optimizer's init_state_fn
    only adds `exp_avg`). One step on zero gradients creates the full state; the load overwrites it.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        params = [p for g in inner.param_groups for p in g["params"] if p.numel() > 0]
        if all("step" in inner.state.get(p, {}) for p in params):
            continue
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)


def _async_strategy(requested: str) -> str:
    if requested != "auto":
        return requested
    import importlib.util

    return "nvrx" if importlib.util.find_spec("nvidia_resiliency_ext") is not None else "mcore"


def unwrap(chunk):
    """GPTModel inside DDP and Float16Module. Megatron-LM saves and loads the unwrapped model
    (checkpointing.py `unwrap_model`): the wrappers' generic sharded_state_dict would add `module.`."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def _warm_pinned_memory(sizes: list[int]) -> None:
    """Runs in the async writer: allocate and free pinned buffers of the checkpoint's tensor sizes,
    so the writer's caching host allocator already holds them when the first save copies
    device -> host (pinning tens of GB at the first save took seconds of loop time)."""
    import torch

    buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes if n > 0]
    del buffers


def _location(path: str, c) -> Path | str:
    """A local directory (Path) or, for s3://BUCKET/PREFIX, the msc:// URL Megatron-Core writes through
    (objstore.configure enables Megatron-Core's MSC feature and writes the profile)."""
    if path.startswith("s3://"):
        from .objstore import configure

        return configure(path, c.object_store_endpoint, c.object_store_region)
    return Path(path)


class Checkpointer:
    """Saves and loads the training state; every public method is collective (all ranks)."""

    def __init__(self, cfg: TrainerConfig, env: DistEnv, model: list, optimizer, scheduler, keep: int,
                 fused_adam: bool = False, optim_in_place: bool = True):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
            FullyParallelSaveStrategyWrapper,
        )
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistLoadShardedStrategy,
            TorchDistSaveShardedStrategy,
        )

        self.cfg, self.env = cfg, env
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.fused_adam = fused_adam  # compat.use_fused_adamw again after a load (its groups come from the file)
        self.keep = keep
        c = cfg.checkpoint
        self.save_dir = _location(c.save, c) if c.save else None
        self.load_dir = _location(c.load, c) if c.load else None
        if env.is_rank0:
            # Fail at start-up, classified (objstore.classify: no bucket, bad credentials), not at the first save.
            for loc in {d for d in (self.save_dir, self.load_dir) if isinstance(d, str)}:
                from .objstore import MscStore

                MscStore(loc).ensure_root()
            if c.hf_export and c.hf_export.startswith("s3://"):
                # The export's bucket answers and its prefix is free now, not after the training run.
                from .hf_export import StoreExport

                problem = StoreExport(c.hf_export, c.object_store_endpoint, c.object_store_region).check_at_start()
                if problem:
                    raise Fatal(ExitCode.BAD_ARGUMENTS, problem)
        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.sharding_type = None
        self.optim_in_place = False  # the fully reshardable optimizer state saved and loaded where it lies
        if cfg.training.use_distributed_optimizer:
            self.sharding_type = "dp_reshardable" if c.dist_ckpt_optim_dp_reshardable else "fully_reshardable"
            if self.sharding_type == "fully_reshardable" and optim_in_place:
                from . import optim_state

                reason = optim_state.supported(optimizer)
                if reason is None:
                    optim_state.use_model_space(optimizer)
                    self.optim_in_place = True
                elif env.is_rank0:
                    log.warning("checkpoint: the optimizer state is gathered Megatron's way on every save (%s): "
                                "saves block the loop longer", reason)
        self.save_strategy = FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=c.ckpt_assume_constant_structure,
                                         thread_count=c.dist_ckpt_workers),
            self.dp_cp_group, do_cache_distribution=c.ckpt_assume_constant_structure)
        self.load_strategy_factory = lambda: FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy(), self.dp_cp_group)
        self.async_strategy = _async_strategy(c.async_strategy) if c.async_save else None
        self.async_queue = None
        self.in_flight: SaveRecord | None = None
        self.stats = CheckpointStats()
        self._num_saves = 0
        self._warmed = False
        self.checkpoint_bytes: int | None = None  # all ranks' bytes of one checkpoint, after the first step
        self.space_warning: str | None = None
        self.interval_warning: str | None = None  # saves come faster than they are written (maybe_save)
        self.on_published = None  # callback(iteration, total_seconds)
        self.on_loading = None  # callback(iteration): a resume is about to load that checkpoint

    # ------------------------------------------------------------------ setup / teardown
    def start_workers(self) -> None:
        """Start the checkpoint helper processes now, with SIGTERM ignored.

        torchrun signals each worker's whole process group (os.killpg), so every child of a rank
        gets the SIGTERM too. Children started here inherit SIG_IGN (it survives exec), so the final
        checkpoint after a SIGTERM can still use them: the persistent async writer, and the
        multiprocessing Manager that carries write results (dist_checkpointing's
        `get_write_results_queue`, created lazily at the first save otherwise, also for sync saves).
        """
        if self.save_dir is None:
            return
        from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue

        with ignore_sigterm():
            get_write_results_queue()
            if not self.async_strategy:
                return
            if self.async_strategy == "nvrx":
                from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
                from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
                    get_write_results_queue as nvrx_results_queue,
                )

                nvrx_results_queue()
            else:
                from megatron.core.dist_checkpointing.strategies.async_utils import (
                    AsyncCallsQueue,
                    AsyncRequest,
                )
            self.async_queue = AsyncCallsQueue(persistent=True)
            AsyncCallsQueue.warmup_persistent_caller(self.env.rank)
        # The spawned writer needs seconds to import torch/Megatron and set up CUDA. A no-op request
        # lets that happen during the first iterations (finalized by the loop's non-blocking
        # finalize) instead of inside the first save, where it would count as blocked time.
        self.async_queue.schedule_async_request(AsyncRequest(_noop, (), []))

    def close(self, abort: bool = False) -> None:
        if self.async_queue is not None:
            if not abort:
                self.finalize(blocking=True)
            self.async_queue.close(abort=abort)
            self.async_queue = None

    def after_first_step(self) -> None:
        """Collective. Once the optimizer has state (after the first step): the size of a checkpoint (all
        ranks), a warning where the volume cannot hold `keep` of them and the one being written, and, for
        async saves, the byte sizes of this rank's tensors sent to the writer to pin ahead of the first
        save (no device work, no waiting: the writer does it in the background)."""
        if self.save_dir is None or self._warmed:
            return
        if self.sharding_type == "fully_reshardable" and not self.optim_in_place:
            self._warmed = True  # Megatron's gather builds the state on every call: not twice per save
            return
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

        sd = self._sharded_state_dict(False, self.sharding_type, with_optimizer=True, with_rng=False)
        tensors = [v for v in nested_values(sd) if isinstance(v, ShardedTensor) and v.data is not None]
        sizes = [v.data.numel() * v.data.element_size() for v in tensors]
        mine = torch.tensor([sum(n for n, v in zip(sizes, tensors, strict=True) if is_main_replica(v.replica_id))],
                            dtype=torch.float64)
        torch.distributed.all_reduce(mine, group=self.env.cpu_group)
        self.checkpoint_bytes = int(mine.item())
        self._warmed = True
        if self.env.is_rank0:
            log.info("checkpoint: %.1f GiB per save (all ranks)", self.checkpoint_bytes / 2**30)
            warning = ckpt_layout.space_warning(self.save_dir, self.checkpoint_bytes, self.keep)
            if warning:
                log.warning("checkpoint: %s", warning)
                self.space_warning = warning
        if self.async_queue is None:
            return
        if self.async_strategy == "nvrx":
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        else:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
        self.async_queue.schedule_async_request(AsyncRequest(_warm_pinned_memory, (sizes,), []))
        log.info("checkpoint: writer pins %.1f GiB for %d tensors in the background", sum(sizes) / 2**30, len(sizes))

    @contextlib.contextmanager
    def _volume_full_is_fatal(self, iteration: int | None, path: Path | str | None) -> Iterator[None]:
        """A save that fails because the local volume is full becomes exit CHECKPOINT_VOLUME_FULL (not retried:
        a restart would fill it again) with one line naming the volume, the bytes needed and free; the
        failed save's directory is removed (it was never complete, so the resume point stays the newest
        complete checkpoint)."""
        try:
            yield
        except Fatal:
            raise
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            problem = ckpt_layout.volume_full_problem(self.save_dir, self.checkpoint_bytes, exc)
            if problem is None:
                if isinstance(exc, Exception):
                    raise
                # an ordinary error (exit 1, retried, its message in the termination log), not an escape past
                # the trainer's error handling with a bare traceback
                raise RuntimeError(f"checkpoint save failed: {exc}") from exc
            if self.env.is_rank0 and isinstance(path, Path):
                shutil.rmtree(path, ignore_errors=True)
            last = self.stats.last_published
            raise Fatal(ExitCode.CHECKPOINT_VOLUME_FULL,
                        f"{problem}; saving iteration {iteration if iteration is not None else '?'} failed, the newest "
                        f"complete checkpoint ({'iteration ' + str(last) if last is not None else 'none'}) is intact. "
                        f"Make the volume larger or keep fewer checkpoints (keep={self.keep or 'all'})") from exc

    # ------------------------------------------------------------------ state dict
    def _metadata(self, sharding_type: str | None) -> dict:
        meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": self.dp_cp_group}
        if sharding_type:
            meta["distrib_optim_sharding_type"] = sharding_type
        return meta

    def _rng_state(self):
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        state = {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state(),
            "rng_tracker_states": tracker_states_as_tensors(tensor_parallel.get_cuda_rng_tracker().get_states()),
        }
        pp, tp = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
        return ShardedObject("rng_state", [state], (pp, tp),
                             (parallel_state.get_pipeline_model_parallel_rank(),
                              parallel_state.get_tensor_model_parallel_rank()),
                             replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))

    def _layout(self) -> dict:
        p = self.cfg.parallel
        return {"tensor": p.tensor, "pipeline": p.pipeline, "virtual_pipeline": p.virtual_pipeline or 0,
                "context": p.context, "expert": p.expert, "world_size": self.env.world_size}

    def _sharded_state_dict(self, is_loading: bool, sharding_type: str | None, with_optimizer: bool,
                            with_rng: bool) -> dict:
        meta = self._metadata(sharding_type)
        sd: dict = {}
        if len(self.model) == 1:
            sd["model"] = unwrap(self.model[0]).sharded_state_dict(metadata=meta)
        else:
            for i, chunk in enumerate(self.model):
                sd[f"model{i}"] = unwrap(chunk).sharded_state_dict(metadata=meta)
        if with_optimizer:
            sd["optimizer"] = self.optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=meta)
        if with_rng:
            sd["rng_state"] = self._rng_state()
        return sd

    @staticmethod
    def _clean_metadata(meta: dict) -> dict:
        return {k: v for k, v in meta.items() if k != "dp_cp_group"}

    # ------------------------------------------------------------------ save
    def save(self, iteration: int, consumed_samples: int, blocking: bool = False) -> SaveRecord:
        """Checkpoint `iteration`. Async unless disabled or `blocking`; returns the time the loop was held."""
        from megatron.core import dist_checkpointing

        assert self.save_dir is not None
        t0 = time.monotonic()
        # One save in flight at a time: wait for the previous one (counts as blocked time).
        self.finalize(blocking=True)
        waited = time.monotonic() - t0
        asynchronous = self.async_queue is not None and not blocking
        if self.env.is_rank0:
            if isinstance(self.save_dir, Path):
                self.save_dir.mkdir(parents=True, exist_ok=True)
            ckpt_layout.prepare_save_dir(self.save_dir, iteration)
        torch.distributed.barrier()
        path = ckpt_layout.checkpoint_path(self.save_dir, iteration)
        # With overlap_param_gather the bf16 params are gathered lazily in the next forward:
        # force the gather so the saved weights are the updated ones (Megatron-LM does the same).
        overlap_pg = self.cfg.training.overlap_param_gather
        if overlap_pg:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
        try:
            sd = self._sharded_state_dict(False, self.sharding_type, with_optimizer=True, with_rng=True)
            if self.optim_in_place and self._num_saves == 0:
                sd = self._verify_in_place_state(sd)
            sd.update(iteration=iteration, consumed_samples=consumed_samples,
                      scheduler=self.scheduler.state_dict(), format_version=FORMAT_VERSION,
                      parallel_layout=self._layout())
            with self._volume_full_is_fatal(iteration, path):
                request = dist_checkpointing.save(
                    sd, str(path), self.save_strategy,
                    validate_access_integrity=self._num_saves == 0,
                    async_sharded_save=asynchronous,
                    async_strategy=self.async_strategy or "mcore",
                    content_metadata=self._clean_metadata(self._metadata(self.sharding_type)))
            self._num_saves += 1
            if asynchronous:
                request.add_finalize_fn(partial(self._publish, iteration, path, t0))
                self.async_queue.schedule_async_request(request)
        finally:
            if overlap_pg:
                for chunk in self.model:
                    chunk.enable_forward_pre_hook()
        blocked = time.monotonic() - t0
        record = SaveRecord(iteration, path, t0, blocked, asynchronous)
        if asynchronous:
            self.in_flight = record
        else:
            self._publish(iteration, path, t0)
        self.stats.saves.append({"iteration": iteration, "blocked_s": round(blocked, 4),
                                 "waited_for_previous_s": round(waited, 4), "async": asynchronous})
        log.info("checkpoint: %s save of iteration %d %s (loop blocked %.3f s, of which %.3f s waiting for the "
                 "previous save)", "async" if asynchronous else "sync", iteration,
                 "scheduled" if asynchronous else f"written to {path}", blocked, waited)
        return record

    def _verify_in_place_state(self, sd: dict) -> dict:
        """Collective, at the first save: the in-place optimizer pieces of all ranks must write every element of
        every optimizer-state tensor exactly once. If they do not, the job goes on with Megatron's own (slower)
        fully reshardable save rather than write a checkpoint that cannot be loaded."""
        from . import optim_state

        per_rank = [None] * self.env.world_size
        torch.distributed.all_gather_object(per_rank, optim_state.coverage(sd), group=self.env.cpu_group)
        problems = optim_state.coverage_problems(per_rank)
        if not problems:
            return sd
        if self.env.is_rank0:
            log.error("checkpoint: the in-place optimizer state does not cover every element (%s); saving it "
                      "Megatron's way from now on", "; ".join(problems))
        optim_state.restore(optim_state._distributed_optimizers(self.optimizer))
        self.optim_in_place = False
        return self._sharded_state_dict(False, self.sharding_type, with_optimizer=True, with_rng=True)

    def _publish(self, iteration: int, path: Path, started: float) -> None:
        """Runs on every rank after every rank finished writing (and after metadata.json)."""
        if self.env.is_rank0:
            if not ckpt_layout.is_complete(path):
                # Never raise here: the other ranks are in the same finalize; a lone exception would hang them.
                log.error("checkpoint: %s is not complete after its save: tracker NOT updated", path)
                return
            try:
                ckpt_layout.write_tracker(self.save_dir, iteration)
                if self.keep:
                    entries = ckpt_layout.list_checkpoints(self.save_dir)
                    for entry in ckpt_layout.select_for_deletion(entries, self.keep, protect={iteration}):
                        log.info("checkpoint: retention (keep=%d) deletes %s", self.keep, entry.path)
                        ckpt_layout.delete_checkpoint(entry)
            except Exception as exc:
                # The checkpoint itself is complete (metadata.json): a resume finds it as the newest
                # complete one even without the tracker. An object store's error says nothing secret.
                log.error("checkpoint: publishing iteration %d failed after the save completed (%s: %s); "
                          "a resume still finds it as the newest complete checkpoint", iteration,
                          type(exc).__name__, exc)
        total = time.monotonic() - started
        self.stats.last_published = iteration
        if self.in_flight is not None and self.in_flight.iteration == iteration:
            self.in_flight = None
        for s in self.stats.saves:
            if s["iteration"] == iteration:
                s["total_s"] = round(total, 3)
        log.info("checkpoint: iteration %d published (%.2f s after the save started)", iteration, total)
        if self.on_published:
            self.on_published(iteration, total)

    def maybe_save(self, iteration: int, consumed_samples: int,
                   seconds_per_iteration: float | None = None) -> SaveRecord | None:
        """The periodic save, every --save-interval iterations (async where enabled); None if not due. When the
        loop had to wait for the previous save, says so (log, `interval_warning`) with an interval that works."""
        interval = self.cfg.checkpoint.save_interval
        if self.save_dir is None or not interval or iteration % interval:
            return None
        record = self.save(iteration, consumed_samples)
        waited = self.stats.saves[-1]["waited_for_previous_s"] if self.stats.saves else 0.0
        previous = self.stats.saves[-2] if len(self.stats.saves) > 1 else None
        if waited > 1.0 and previous is not None and previous.get("total_s"):
            self.interval_warning = interval_warning(interval, previous["iteration"], previous["total_s"], waited,
                                                     seconds_per_iteration)
            if self.env.is_rank0:
                log.warning("checkpoint: %s", self.interval_warning)
        return record

    def save_final(self, iteration: int, consumed_samples: int, signal_age_s: float | None = None,
                   grace_s: float = 30.0) -> None:
        """The last save of this process, then every save finished.

        When training ends or stops on its own, `iteration` is saved unless it already is. After a
        signal (`signal_age_s` seconds ago) a new save is made only if it can end within the
        launcher's `grace_s` before SIGKILL (all ranks decide together); otherwise the newest
        complete checkpoint stays the resume point.
        """
        self.finalize(blocking=True)
        if self.save_dir is None or self.stats.last_published == iteration:
            return
        if signal_age_s is not None:
            durations = [s["total_s"] for s in self.stats.saves if s.get("total_s")]
            last = durations[-1] if durations else None
            if any_rank(not ckpt_layout.final_save_fits(signal_age_s, last, grace_s), self.env):
                if self.env.is_rank0:
                    log.warning("no time for a new checkpoint before SIGKILL (%.0f s grace, last save took %s s): "
                                "resume point stays iteration %s", grace_s, last if last is not None else "?",
                                self.stats.last_published)
                return
        self.save(iteration, consumed_samples, blocking=True)

    def finalize(self, blocking: bool = False) -> None:
        """Collective: finish async saves whose writers are done on every rank (all of them if blocking)."""
        if self.async_queue is not None and self.async_queue.get_num_unfinalized_calls():
            flight = self.in_flight
            with self._volume_full_is_fatal(flight.iteration if flight else None, flight.path if flight else None):
                self.async_queue.maybe_finalize_async_calls(blocking=blocking)

    # ------------------------------------------------------------------ load
    def load(self) -> LoadResult | None:
        """Resume from the newest complete checkpoint under --load (None: start from scratch)."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        if self.load_dir is None:
            return None
        t0 = time.monotonic()
        choice = [None]
        if self.env.is_rank0:
            if self.save_dir is not None and self.save_dir == self.load_dir:
                for entry in ckpt_layout.remove_incomplete(self.save_dir):
                    log.info("checkpoint: removed %s, a save cut short (never complete)", entry.path)
            choice[0] = ckpt_layout.find_resume_checkpoint(self.load_dir)
        torch.distributed.broadcast_object_list(choice, src=0, group=self.env.cpu_group)
        chosen = choice[0]
        if chosen is None:
            if self.cfg.checkpoint.exit_on_missing_checkpoint:
                raise Fatal(ExitCode.BAD_CHECKPOINT, f"no complete checkpoint under {self.load_dir} "
                            "(--exit-on-missing-checkpoint)")
            log.info("checkpoint: no complete checkpoint under %s: starting from scratch", self.load_dir)
            return None
        path = chosen.path
        if self.on_loading:
            self.on_loading(chosen.iteration)
        common = dist_checkpointing.load_common_state_dict(str(path))
        content = dist_checkpointing.load_content_metadata(str(path)) or {}
        saved_layout = common.get("parallel_layout", {})
        mine = self._layout()
        same_model_grid = all(saved_layout.get(k) == mine[k] for k in ("tensor", "pipeline", "virtual_pipeline",
                                                                         "context", "expert"))
        saved_sharding = content.get("distrib_optim_sharding_type")
        load_optim = not self.cfg.checkpoint.no_load_optim
        if load_optim and self.sharding_type and saved_sharding is None:
            raise Fatal(ExitCode.BAD_CHECKPOINT,
                        f"{path} holds no distributed-optimizer state layout; resume with --no-load-optim")
        if load_optim and not same_model_grid and saved_sharding == "dp_reshardable":
            raise Fatal(
                ExitCode.BAD_CHECKPOINT,
                f"{path} was saved under TP/PP/VPP/CP/EP {saved_layout} with a dp_reshardable optimizer "
                f"(--dist-ckpt-optim-dp-reshardable, or a trainer before fully reshardable saves became the "
                f"default); this run uses {mine}. Resume under the saved layout and save again without "
                "--dist-ckpt-optim-dp-reshardable, or resume with --no-load-optim")
        load_rng = same_model_grid and not self.cfg.checkpoint.no_load_rng
        sharding = saved_sharding if (load_optim and self.sharding_type) else self.sharding_type
        if load_optim:
            _materialize_optimizer_state(self.optimizer)
        sd = self._sharded_state_dict(True, sharding, with_optimizer=load_optim, with_rng=load_rng)
        state = dist_checkpointing.load(sd, str(path), self.load_strategy_factory(),
                                        strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        if len(self.model) == 1:
            unwrap(self.model[0]).load_state_dict(state["model"], strict=True)
        else:
            for i, chunk in enumerate(self.model):
                unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
        if load_optim:
            self.optimizer.load_state_dict(state["optimizer"])
            from .compat import adam_steps, unshare_adam_steps

            if unshare_adam_steps(self.optimizer):
                log.info("checkpoint: optimizer step counters unshared (Megatron-Core 0.19 shares one; compat.py)")
            if self.fused_adam:
                from .compat import use_fused_adamw

                use_fused_adamw(self.optimizer)
            steps = adam_steps(self.optimizer)
            if steps:
                log.info("checkpoint: optimizer resumes at AdamW step %s", ", ".join(f"{x:g}" for x in sorted(steps)))
        else:
            self.optimizer.reload_model_params()  # fp32 main params from the loaded weights
        self.scheduler.load_state_dict(state["scheduler"])
        if load_rng:
            from megatron.core import tensor_parallel

            rng = state["rng_state"][0]
            random.setstate(rng["random_rng_state"])
            np.random.set_state(rng["np_rng_state"])
            torch.set_rng_state(rng["torch_rng_state"])
            torch.cuda.set_rng_state(rng["cuda_rng_state"])
            restore_tracker_states(tensor_parallel.get_cuda_rng_tracker(), rng["rng_tracker_states"])
        torch.distributed.barrier()
        seconds = time.monotonic() - t0
        self.stats.last_published = int(common["iteration"])
        result = LoadResult(int(common["iteration"]), int(common["consumed_samples"]), path, chosen.reason,
                            seconds, resharded=not same_model_grid or saved_layout.get("world_size") != mine["world_size"])
        log.info("checkpoint: resumed from %s (iteration %d, %s, layout %s -> %s) in %.2f s", path,
                 result.iteration, chosen.reason, saved_layout, mine, seconds)
        return result


def interval_warning(interval: int, previous_iteration: int, write_s: float, waited_s: float,
                     seconds_per_iteration: float | None) -> str:
    """The loop waited for the previous save: how long, why, and the save interval (in iterations) that would
    let a save finish before the next one is due (its write time and 20 % more)."""
    seconds = interval * seconds_per_iteration if seconds_per_iteration else None
    every = "" if seconds is None else f" (~{seconds:.0f} s)" if seconds >= 10 else f" (~{seconds:.2g} s)"
    text = (f"saves every {interval} iterations{every} come faster than one is written (the save of iteration "
            f"{previous_iteration} took {write_s:.0f} s): the loop waited {waited_s:.1f} s for it.")
    if seconds_per_iteration:
        text += f" A save interval of at least {math.ceil(1.2 * write_s / seconds_per_iteration)} iterations avoids it."
    return text


def tracker_states_as_tensors(states: dict) -> dict:
    """The RNG tracker's states as state tensors. With CUDA graphs the tracker holds graph-safe
    `torch.Generator`s instead; saving their state tensors keeps one checkpoint format for both."""
    return {name: (state.get_state() if isinstance(state, torch.Generator) else state) for name, state in states.items()}


def restore_tracker_states(tracker, saved: dict) -> None:
    """Load saved state tensors (see above) into the tracker, whichever form the tracker holds."""
    current = tracker.get_states()
    if any(isinstance(state, torch.Generator) for state in current.values()):
        for name, state in saved.items():
            if isinstance(current.get(name), torch.Generator):
                current[name].set_state(state)
    else:
        tracker.set_states(dict(saved))
