"""Deterministic pretraining sampler that resumes from `consumed_samples`. Pure.

Same order as Megatron-LM's `MegatronPretrainingSampler` (megatron/training/datasets/data_samplers.py):
sample ids run consecutively from `consumed_samples`; each group of micro_batch x DP ids is split
into DP contiguous slices, one per data-parallel rank. The checkpoint stores only the integer
`consumed_samples`, so a resumed run sees exactly the samples the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator


class PretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: {total_samples}")
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError("micro batch size and data-parallel size must be > 0")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data-parallel rank {data_parallel_rank} not in [0, {data_parallel_size})")
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed samples {consumed_samples} >= total samples {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.data_parallel_size
        start = self.data_parallel_rank * self.micro_batch_size
        for base in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(base + start, base + start + self.micro_batch_size))
