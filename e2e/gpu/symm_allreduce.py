#!/usr/bin/env python3
"""One rank of the `symmar` scenario (issue 29): the forward all-reduce of a row-parallel layer of
Llama-3-8B at TP=2 (32 MiB of bf16), through NCCL and through torch's symmetric-memory all-reduces,
each timed alone and inside a CUDA graph, and each checked against NCCL's result.

    SYMM_BACKEND=CUDA torchrun --nproc-per-node 2 e2e/gpu/symm_allreduce.py

The question it answers: the 81-104 ms of exposed forward all-reduce per step (docs/benchmarks/megatron-lm.md#2026-11-26-third-session-nccl-overlap)
run at about half of NVLink's bandwidth through NCCL's ring; does a direct peer-to-peer all-reduce
over symmetric memory (no NVLink multicast: the device's rule) take less? Rank 0 prints one line:
SYMMAR {json}. A method that fails is reported with its error, not raised.

Run once (call 38, 2 x H200, torch 2.11.0+cu130, NCCL 2.28.9; docs/benchmarks/megatron-lm.md#2026-11-27-tenth-session-symm-allreduce): with either
allocation backend the processes printed their line and then did not exit (the final barrier or the
process group's teardown after symmetric memory was used; not investigated), so run it under
`timeout`. The figures: the two-shot kernel is about 0.03 ms faster than NCCL's all-reduce inside a
CUDA graph, about 15 ms of a 1600 ms step at 512 calls, so it was not taken into the trainer.
"""

from __future__ import annotations

import json
import os
import traceback

import torch
import torch.distributed as dist
from collectives import HIDDEN, SEQ, cuda_median_ms

GRAPH_CALLS = 8  # all-reduces captured back to back in one graph, each of a different input


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    import torch.distributed._symmetric_memory as symm_mem

    backend = os.environ.get("SYMM_BACKEND", "")
    result: dict = {"ranks": dist.get_world_size(), "torch": torch.__version__,
                    "nccl_version": ".".join(map(str, torch.cuda.nccl.version())), "backend": backend or "default"}
    try:
        if backend:
            symm_mem.set_backend(backend)
        result["backend_in_use"] = symm_mem.get_backend(torch.device("cuda", local))
    except Exception as e:
        result["backend_error"] = f"{type(e).__name__}: {e}"[:300]
    group = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        try:
            symm_mem.enable_symm_mem_for_group(group)
        except Exception as e:
            result["enable_error"] = f"{type(e).__name__}: {e}"[:300]
    numel = SEQ * HIDDEN
    gen = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
    inputs = [torch.randn(numel, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(GRAPH_CALLS)]
    expected = []
    for x in inputs:
        y = x.clone()
        dist.all_reduce(y)
        expected.append(y)
    torch.cuda.synchronize()
    plain = inputs[0].clone()
    times: dict[str, float] = {"nccl": cuda_median_ms(lambda: dist.all_reduce(plain))}
    errors: dict[str, str] = {}
    equal: dict[str, bool] = {}
    graph_ms: dict[str, float] = {}

    buf = None
    try:
        buf = symm_mem.empty(numel, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, group)
    except Exception as e:
        errors["rendezvous"] = f"{type(e).__name__}: {e}"[:300]
        buf = None
    out = torch.empty(numel, device="cuda", dtype=torch.bfloat16)

    def nccl_on_symm(i: int):
        buf.copy_(inputs[i])
        dist.all_reduce(buf)
        out.copy_(buf)
        return out

    def two_shot(i: int):
        buf.copy_(inputs[i])
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
        out.copy_(buf)
        return out

    def one_shot(i: int):
        buf.copy_(inputs[i])
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, out)
        return out

    def copies_only(i: int):  # what the copies in and out cost on their own
        buf.copy_(inputs[i])
        out.copy_(buf)
        return out

    methods = {"copies_only": copies_only, "nccl_on_symm": nccl_on_symm, "two_shot": two_shot,
               "one_shot": one_shot} if buf is not None else {}
    for name, fn in methods.items():
        try:
            times[name] = cuda_median_ms(lambda fn=fn: fn(0))
            if name != "copies_only":
                ok = True
                for i in range(GRAPH_CALLS):
                    ok = ok and torch.equal(fn(i), expected[i])
                equal[name] = ok
            # Inside a CUDA graph: GRAPH_CALLS calls of different inputs, one buffer reused.
            outs = [torch.empty_like(out) for _ in range(GRAPH_CALLS)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in range(GRAPH_CALLS):  # warm-up outside the capture
                    outs[i].copy_(fn(i))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(GRAPH_CALLS):
                    outs[i].copy_(fn(i))
            for o in outs:
                o.zero_()
            graph.replay()
            torch.cuda.synchronize()
            if name != "copies_only":
                equal[name + "_graph"] = all(torch.equal(outs[i], expected[i]) for i in range(GRAPH_CALLS))
            graph_ms[name] = cuda_median_ms(graph.replay, warmup=3, timed=20) / GRAPH_CALLS
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"[:400] + " | " + traceback.format_exc().splitlines()[-3][:200]
    # NCCL in a graph, for the same comparison.
    try:
        outs = [x.clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for o in outs:
                dist.all_reduce(o)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for o in outs:
                dist.all_reduce(o)
        graph_ms["nccl"] = cuda_median_ms(graph.replay, warmup=3, timed=20) / GRAPH_CALLS
    except Exception as e:
        errors["nccl_graph"] = f"{type(e).__name__}: {e}"[:400]
    nbytes = numel * 2
    if dist.get_rank() == 0:
        result.update(bytes=nbytes, median_ms={k: round(v, 4) for k, v in times.items()},
                      graph_ms_per_call={k: round(v, 4) for k, v in graph_ms.items()},
                      equal_to_nccl=equal, errors=errors)
        print("SYMMAR " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
