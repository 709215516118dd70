"""Training data: Megatron-Core GPT datasets (mock or .bin/.idx blends) behind a resumable sampler."""

from __future__ import annotations

import logging
import os

import torch

from .config import TrainerConfig
from .distributed import DistEnv, ignore_sigterm_in_worker
from .sampler import PretrainingSampler
from .tokenizer import build_tokenizer

log = logging.getLogger(__name__)

# Extra samples beyond train_iters x global batch (Megatron-LM over-provisions the same way).
_SAMPLE_SURPLUS = 1.005


def total_samples(train_iters: int, global_batch_size: int) -> int:
    """Samples the run may draw: train_iters x global batch, with Megatron-LM's surplus, plus one batch."""
    return int(train_iters * global_batch_size * _SAMPLE_SURPLUS) + global_batch_size


def dataset_cache_path(cfg: TrainerConfig, shared: bool, num_nodes: int) -> str | None:
    """Megatron builds the index cache on global rank 0 and other ranks read it after a barrier
    (gpt_dataset.py, _build_document_sample_shuffle_indices), so a cache that other nodes cannot see breaks them: then each rank
    computes the (deterministic) indices in memory instead."""
    path = cfg.data.data_cache_path
    if not path or cfg.data.mock_data:
        return None
    if num_nodes > 1 and not shared:
        log.warning("data cache %s is not shared (MEGATRON_DATA_CACHE_SHARED!=true) and the job has %d nodes: "
                    "indices are computed on every rank, not cached", path, num_nodes)
        return None
    os.makedirs(path, exist_ok=True)
    return path


def build_dataset(cfg: TrainerConfig, env: DistEnv, tokenizer, num_samples: int, cache_path: str | None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    d = cfg.data
    blend = None if d.mock_data else d.blend
    dcfg = GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        blend=(blend[0], blend[1]) if blend else None,
        split=None if d.mock_data else d.split,
        path_to_cache=cache_path,
        tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=d.reset_attention_mask,  # causal kernels need no [s, s] mask otherwise
        mid_level_dataset_surplus=0.005,
    )
    if dcfg.split_matrix:
        # Only the train split is used (no evaluation). Keep its book-ends exactly as --split puts
        # them, but do not build valid/test: an empty split with a sample count makes
        # GPTDataset._get_num_epochs loop forever, and it is wasted work anyway.
        dcfg.split_matrix = [dcfg.split_matrix[0], None, None]
    cls = MockGPTDataset if d.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, 0, 0], lambda: True, dcfg).build()
    return train


class BatchIterator:
    """Micro-batches for this rank, resumable from `consumed_samples` (one per model chunk for VPP)."""

    def __init__(self, dataset, consumed_samples: int, total_samples: int, cfg: TrainerConfig, env: DistEnv):
        from megatron.core import parallel_state

        sampler = PretrainingSampler(total_samples=min(total_samples, len(dataset)),
                                     consumed_samples=consumed_samples,
                                     micro_batch_size=cfg.training.micro_batch_size,
                                     data_parallel_rank=parallel_state.get_data_parallel_rank(),
                                     data_parallel_size=parallel_state.get_data_parallel_world_size())
        workers = cfg.data.num_workers
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=workers, pin_memory=True,
            persistent_workers=workers > 0, worker_init_fn=ignore_sigterm_in_worker if workers else None)
        self._it = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return next(self._it)

    def close(self) -> None:
        """Stop the worker processes now (they ignore SIGTERM, so they must be told)."""
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._it = None


def build_data(cfg: TrainerConfig, env: DistEnv, consumed_samples: int, num_nodes: int, cache_shared: bool):
    """(tokenizer, list of per-chunk iterators or None for middle pipeline stages)."""
    from megatron.core import parallel_state

    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model, cfg.model.vocab_size)
    total = total_samples(cfg.training.train_iters, env.layout.global_batch_size)
    cache = dataset_cache_path(cfg, cache_shared, num_nodes)
    dataset = build_dataset(cfg, env, tokenizer, total, cache)  # collective: every rank
    num_chunks = cfg.parallel.virtual_pipeline or 1
    iterators = []
    for vp in range(num_chunks):
        vp_stage = vp if cfg.parallel.virtual_pipeline else None
        needs_data = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) or \
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        iterators.append(BatchIterator(dataset, consumed_samples, total, cfg, env) if needs_data else None)
    return tokenizer, iterators
