#!/usr/bin/env python3
"""One rank of the `collectives` scenario (issue 29): the tensor-parallel collectives of Llama-3-8B at
TP=2 (micro-batch 1, sequence 4096, hidden 4096, bf16), timed alone with CUDA events.

    torchrun --nproc-per-node 2 e2e/gpu/collectives.py

NCCL picks its algorithm and protocol per call from its own model of the links; the suite runs this
once with NCCL's choice and once per forced NCCL_PROTO, so the difference is a measured fact. Rank 0
prints one line: COLLECTIVES {json}.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

SEQ, HIDDEN = 4096, 4096  # one micro-batch's activations: [s, b=1, h]
WARMUP, TIMED = 10, 50


def cuda_median_ms(fn, warmup: int = WARMUP, timed: int = TIMED) -> float:
    """Median milliseconds of one call of `fn` on the GPU (CUDA events) over `timed` calls, after
    `warmup`; the suite's attention benchmark uses it too."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n = dist.get_world_size()
    full = torch.randn(SEQ * HIDDEN, device="cuda", dtype=torch.bfloat16)
    shard = torch.empty(SEQ * HIDDEN // n, device="cuda", dtype=torch.bfloat16)
    gathered = torch.empty_like(full)
    nbytes = full.numel() * full.element_size()
    ms = {
        "all_reduce": cuda_median_ms(lambda: dist.all_reduce(full)),
        "all_gather": cuda_median_ms(lambda: dist.all_gather_into_tensor(gathered, shard)),
        "reduce_scatter": cuda_median_ms(lambda: dist.reduce_scatter_tensor(shard, full)),
    }
    # nccl-tests' bus bandwidth: all-reduce moves 2(n-1)/n of the buffer per rank, the others (n-1)/n.
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    if dist.get_rank() == 0:
        print("COLLECTIVES " + json.dumps({
            "ranks": n, "bytes": nbytes, "nccl_proto": os.environ.get("NCCL_PROTO", "(NCCL's choice)"),
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
            "median_ms": {k: round(v, 4) for k, v in ms.items()},
            "bus_gb_s": {k: round(nbytes * factor[k] / (v / 1e3) / 1e9, 1) for k, v in ms.items()},
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
