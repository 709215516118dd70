"""SFT data for the training loop: datasets over sft.SFTSamples, the packed-attention mask, and RoPE
positions that restart per packed sample.

Tokenization runs once: with --data-cache-path (shared, or a single node) global rank 0 tokenizes and
writes the documents to the cache, and every later start (and every other rank) reads them back; without
a cache every rank tokenizes (deterministic, so all ranks agree).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import sft
from .config import TrainerConfig
from .distributed import DistEnv
from .exitcodes import ExitCode, Fatal

log = logging.getLogger(__name__)


class SFTDataset(torch.utils.data.Dataset):
    """Global sample index -> tensors. Epochs repeat the samples, each in a fresh order from (seed, epoch)."""

    def __init__(self, samples: sft.SFTSamples, length: int, seed: int, shuffle: bool = True):
        self.samples, self.length = samples, length
        self.order = sft.EpochShuffle(len(samples), seed, shuffle)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(v) for k, v in self.samples.sample(self.order(index)).items()}


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] document ids -> [b, 1, s, s] bool, True where attention is NOT allowed (Megatron's
    convention): a token sees earlier tokens of its own document only."""
    s = segment_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).triu(1)
    other_doc = segment_ids[:, None, :, None] != segment_ids[:, None, None, :]
    return other_doc | causal


def restart_rope_positions(model_chunks: list) -> int:
    """Make RoPE follow the batch's position_ids (restarting per packed sample), as it does for learned
    positions. Megatron's RotaryEmbedding computes angles for 0..s-1 whatever position_ids say (only THD
    packing, which needs Transformer Engine, restarts them). Returns how many models were changed."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    changed = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if not isinstance(module, GPTModel) or module.position_embedding_type != "rope":
                continue
            rotary = module.rotary_pos_emb
            original = rotary.forward  # lru-cached per (max_seq_len, offset, ...): angles for 0..S-1
            state = {"position_ids": None}

            def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None, _orig=original, _state=state):
                emb = _orig(max_seq_len, offset, packed_seq, cp_group)  # [S, 1, 1, d]
                pos = _state["position_ids"]
                if pos is None:
                    return emb
                return emb[:, 0, 0, :][pos.t()].unsqueeze(2)  # [s, b, 1, d]

            def remember(_module, args, kwargs, _state=state):
                pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
                _state["position_ids"] = pos.to(torch.long) if pos is not None else None

            rotary.forward = forward
            module.register_forward_pre_hook(remember, with_kwargs=True)
            changed += 1
    return changed


@dataclass
class SFTData:
    train: sft.SFTSamples
    train_stats: dict
    valid: sft.SFTSamples | None
    valid_stats: dict | None
    seconds: float
    from_cache: bool

    def status(self) -> dict:
        """The figures for status.progress.data (the CRD's DataProgress)."""
        st = self.train_stats
        return {"lines": st["lines"], "used": st["used"], "skipped": st["skipped"], "truncated": st["truncated"],
                "droppedTooLong": st["dropped_too_long"], "samples": len(self.train),
                "packingEfficiency": round(self.train.efficiency(), 4), "lossTokens": st["loss_tokens"]}


def _options(cfg: TrainerConfig) -> sft.SFTOptions:
    d = cfg.data
    return sft.SFTOptions(d.data_format, cfg.model.seq_length, d.sft_overflow, d.sft_invalid_lines, d.chat_template)


def _documents(path: str, tokenizer: sft.SFTTokenizer, cache_dir: str | None, env: DistEnv, writer: bool):
    """(documents, stats, from_cache): tokenized here, or read from the cache the writer rank left."""
    key = sft.cache_key(path, tokenizer)
    cache_file = Path(cache_dir) / f"sft-{Path(path).stem[:64]}-{key}.npz" if cache_dir else None
    if cache_file is not None:
        cached = sft.load_documents(cache_file, key)
        if cached is not None:
            return cached[0], cached[1], True
    docs, stats = tokenizer.tokenize_file(path)
    if cache_file is not None and writer:
        sft.save_documents(cache_file, docs, stats, key)
    return docs, stats.as_dict(), False


def load_sft_data(cfg: TrainerConfig, env: DistEnv, vocab_size: int, pad_id: int, cache_dir: str | None) -> SFTData:
    """Tokenize (or read back) the train and validation files; Fatal(BAD_DATA) with the line on bad input."""
    d = cfg.data
    t0 = time.monotonic()
    files = [("--sft-train-path", d.sft_train_path)] + ([("--sft-valid-path", d.sft_valid_path)]
                                                        if d.sft_valid_path else [])
    for flag_name, path in files:
        if not os.path.isfile(path):
            raise Fatal(ExitCode.BAD_DATA, f"{flag_name} {path}: no such file")
    results = []
    with sft.bad_input_is_fatal():
        tokenizer = sft.SFTTokenizer(d.tokenizer_model, _options(cfg))
        try:
            for _flag_name, path in files:
                # The cache writer goes first so that the other ranks read its file instead of tokenizing again.
                if cache_dir is not None and env.world_size > 1:
                    if env.is_rank0:
                        results.append(_documents(path, tokenizer, cache_dir, env, True))
                    torch.distributed.barrier(group=env.cpu_group)
                    if not env.is_rank0:
                        results.append(_documents(path, tokenizer, cache_dir, env, False))
                else:
                    results.append(_documents(path, tokenizer, cache_dir, env, True))
        finally:
            tokenizer.close()  # the chat template's worker process
    (train_docs, train_stats, cached), *rest = results
    top = int(train_docs.tokens.max())
    if top >= vocab_size:
        raise Fatal(ExitCode.BAD_DATA, f"token id {top} in {d.sft_train_path} is outside the model's vocabulary "
                    f"of {vocab_size}")
    train = sft.SFTSamples.build(train_docs, cfg.model.seq_length, pad_id, d.sft_packing)
    valid = valid_stats = None
    if rest:
        valid_docs, valid_stats, _ = rest[0]
        valid = sft.SFTSamples.build(valid_docs, cfg.model.seq_length, pad_id, d.sft_packing)
    data = SFTData(train, train_stats, valid, valid_stats, time.monotonic() - t0, cached)
    if env.is_rank0:
        log.info("sft data (%s%s): %s; %d samples of %d tokens (%s, %.1f%% of positions are real tokens), "
                 "%d answer tokens; %.1f s", d.data_format, ", from the cache" if cached else "",
                 sft.describe(train_stats), len(train), cfg.model.seq_length, "packed" if d.sft_packing else "padded",
                 100 * train.efficiency(), train_stats["loss_tokens"], data.seconds)
        if valid is not None:
            log.info("sft validation data: %d lines, %d samples", valid_stats["lines"], len(valid))
    return data



def _per_chunk(cfg: TrainerConfig, make) -> list:
    """make() for each model chunk that reads data, None for the others. Packed samples are read on every
    pipeline stage: each stage's attention needs the document mask, and its RoPE the restarted positions."""
    from megatron.core import parallel_state

    out = []
    for vp in range(cfg.parallel.virtual_pipeline or 1):
        vp_stage = vp if cfg.parallel.virtual_pipeline else None
        needs = cfg.data.sft_packing or \
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) or \
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        out.append(make() if needs else None)
    return out


def build_sft_iterators(cfg: TrainerConfig, env: DistEnv, data: SFTData, consumed_samples: int, total: int):
    """Training iterators, resumable from consumed_samples like pretraining's."""
    from .data import BatchIterator

    dataset = SFTDataset(data.train, total, cfg.training.seed)
    return _per_chunk(cfg, lambda: BatchIterator(dataset, consumed_samples, total, cfg, env))


def build_eval_iterators(cfg: TrainerConfig, env: DistEnv, data: SFTData, global_batch_size: int):
    """Fresh iterators over the first --eval-iters global batches of the validation set (in file order,
    wrapping around when it is smaller), the same for every evaluation."""
    import dataclasses

    from .data import BatchIterator

    total = cfg.training.eval_iters * global_batch_size
    dataset = SFTDataset(data.valid, total, cfg.training.seed, shuffle=False)
    eval_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_workers=0))
    return _per_chunk(cfg, lambda: BatchIterator(dataset, 0, total, eval_cfg, env))
