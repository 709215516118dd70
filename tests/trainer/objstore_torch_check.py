"""Two gloo ranks save and load a sharded state dict through Megatron-Core's dist_checkpointing to an
s3:// location (multi-storage-client), with the trainer's layout code: sync and async saves, the
tracker written by the async finalize after metadata.json, retention of `keep`, resume from the
newest complete checkpoint. Run by test_object_store_torch.py (CPU, gloo):

    python objstore_torch_check.py SCENARIO s3://BUCKET/PREFIX ENDPOINT OUT_JSON
    SCENARIO: save (iterations 1, 2 sync, 3 async; keep=2) | load | hang-in-save ITER (an async save of
    ITER that is never finalized: the test SIGKILLs the ranks while its shards are being written)

Credentials come from AWS_SHARED_CREDENTIALS_FILE, as in the trainer's pod.
"""

from __future__ import annotations

import json
import os
import sys
import time

WORLD = 2
ROWS, COLS = 4, 8  # each rank owns ROWS rows of a (WORLD * ROWS, COLS) tensor


def expected(name: str, iteration: int, rank: int | None = None):
    import torch

    g = torch.Generator().manual_seed(1000 * iteration + len(name))
    full = torch.randn(WORLD * ROWS, COLS, generator=g, dtype=torch.float32)
    if name == "bias":
        return full[0]
    return full if rank is None else full[rank * ROWS:(rank + 1) * ROWS].clone()


def sharded_state_dict(iteration: int, rank: int, empty: bool = False):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    w = expected("weight", iteration, rank)
    b = expected("bias", iteration)
    if empty:
        w, b = torch.zeros_like(w), torch.zeros_like(b)
    return {
        "weight": ShardedTensor.from_rank_offsets("weight", w, (0, rank, WORLD)),
        "bias": ShardedTensor.from_rank_offsets("bias", b, replica_id=rank),  # replicated: one rank writes it
        "iteration": iteration,
    }


def worker(rank: int, port: int, scenario: str, url: str, endpoint: str, out: str, arg: int) -> None:
    import torch

    # CPU stand-ins for the CUDA calls dist_checkpointing makes (docs: save needs CUDA otherwise).
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron_trainer import ckpt_layout, objstore

    root = objstore.configure(url, endpoint, "us-east-1")
    result: dict = {"rank": rank, "root": root}

    def save(iteration: int, queue=None, keep: int = 2):
        path = ckpt_layout.checkpoint_path(root, iteration)
        if rank == 0:
            ckpt_layout.prepare_save_dir(root, iteration)
        torch.distributed.barrier()

        def publish():
            if rank == 0:
                assert ckpt_layout.is_complete(path), path
                ckpt_layout.write_tracker(root, iteration)
                entries = ckpt_layout.list_checkpoints(root)
                for entry in ckpt_layout.select_for_deletion(entries, keep, protect={iteration}):
                    ckpt_layout.delete_checkpoint(entry)

        t0 = time.monotonic()
        req = dist_checkpointing.save(sharded_state_dict(iteration, rank), path,
                                      TorchDistSaveShardedStrategy("torch_dist", 1),
                                      async_sharded_save=queue is not None, async_strategy="mcore")
        if queue is None:
            torch.distributed.barrier()
            publish()
        else:
            req.add_finalize_fn(publish)
            queue.schedule_async_request(req)
        return time.monotonic() - t0

    if scenario == "save":
        result["blocked_s"] = [save(1), save(2)]
        queue = AsyncCallsQueue(persistent=False)
        result["blocked_s"].append(save(3, queue))
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        torch.distributed.barrier()
        if rank == 0:
            result["tracker"] = ckpt_layout.read_tracker(root)
            result["checkpoints"] = [(e.iteration, e.complete) for e in ckpt_layout.list_checkpoints(root)]
    elif scenario == "hang-in-save":
        queue = AsyncCallsQueue(persistent=False)
        save(arg, queue)
        print(f"rank {rank}: async save of {arg} scheduled, never finalized", flush=True)
        time.sleep(600)  # the test kills us while the writer is at work
    elif scenario == "load":
        choice = ckpt_layout.find_resume_checkpoint(root)
        result["resume"] = [choice.iteration, choice.reason]
        sd = sharded_state_dict(choice.iteration, rank, empty=True)
        state = dist_checkpointing.load(sd, str(choice.path))
        result["iteration"] = state["iteration"]
        result["weight_bit_exact"] = bool(torch.equal(state["weight"], expected("weight", choice.iteration, rank)))
        result["bias_bit_exact"] = bool(torch.equal(state["bias"], expected("bias", choice.iteration)))
        if rank == 0:
            result["checkpoints"] = [(e.iteration, e.complete) for e in ckpt_layout.list_checkpoints(root)]
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def main(argv: list[str]) -> int:
    import socket

    import torch.multiprocessing as mp

    scenario, url, endpoint, out = argv[:4]
    arg = int(argv[4]) if len(argv) > 4 else 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, port, scenario, url, endpoint, out, arg)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
