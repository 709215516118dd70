"""The distributed optimizer's state in model space, saved and loaded where it lies: no gather, no copy.

Megatron-Core 0.19's `fully_reshardable` format (the one that lets a job resume under another TP/PP/DP)
stores, for every model parameter, its fp32 main copy and Adam moments as tensors of the parameter's
shape, under `optimizer.state.{param,exp_avg,exp_avg_sq}.<the parameter's checkpoint key>`. Megatron
builds them in the training process on every save (`get_parameter_state_dp_zero`): pageable copies of
the whole state to the CPU, an all-gather over data parallel, and copies again; 84-85 s of a blocked
loop per save for a 7B model on 4 x H100 (docs/benchmarks.md, issue 49).

The same checkpoint can be written without any of that. Each data-parallel rank holds a contiguous
range of every parameter it owns part of (flattened, row-major). A contiguous range of a row-major
tensor is a union of at most 2 x ndim - 1 boxes, and a box is what a ShardedTensor with an irregular
grid (`axis_fragmentations=None`, as Megatron's own `dp_reshardable` pieces use) describes. So each
rank saves its own pieces as views of its optimizer state, with the parameter's key and global shape:
the checkpoint holds the same tensors as Megatron's, in more chunks. The async writer copies the views
device -> host as it does for any other state, which is all the loop waits for.

Loading goes the same way: this run's pieces, under its own layout, are views of its optimizer state,
and torch.distributed.checkpoint reads into them whatever saved chunks overlap, under any TP/PP/DP.
Checkpoints from Megatron's own `fully_reshardable` save (one chunk per parameter) load the same way.

A parameter saved through a ShardedTensorFactory (SwiGLU's fused fc1 is split into its two halves)
is mapped by running the factory's own build function on a tensor of flat indices: each piece it
returns says which contiguous range of the local tensor lands where in the checkpoint. Anything this
module cannot map (a factory whose pieces are not contiguous row blocks, an optimizer whose state is
not plain tensors per parameter) makes `supported` return the reason, and the caller uses Megatron's
own path for that save, never a wrong checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from math import prod

SKIPPED_STATE = ("step",)  # torch AdamW's step is a 0-dim tensor; Megatron keeps it in param_groups


def range_to_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offset, size) whose union, in row-major order, is the flat range [start, end) of `shape`:
    at most 2 x ndim - 1 of them, each contiguous in memory, in flat order."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = prod(shape[1:])

    def in_row(row: int, a: int, b: int) -> list:
        return [((row,) + off, (1,) + size) for off, size in range_to_boxes(tuple(shape[1:]), a, b)]

    first, last = start // inner, (end - 1) // inner
    if first == last:
        return in_row(first, start - first * inner, end - first * inner)
    boxes, whole_from, whole_to = [], first, last + 1
    if start % inner:
        boxes += in_row(first, start - first * inner, inner)
        whole_from = first + 1
    if end % inner:
        whole_to = last
    if whole_to > whole_from:
        boxes.append(((whole_from,) + (0,) * (len(shape) - 1), (whole_to - whole_from,) + tuple(shape[1:])))
    if end % inner:
        boxes += in_row(last, 0, end - last * inner)
    return boxes


@dataclass(frozen=True)
class Chunk:
    """Where a contiguous range [start, end) of a parameter's local (this TP rank's) flattened tensor lands in
    the checkpoint: a row-major tensor of `local_shape` at `global_offset` of the key's global tensor."""

    start: int
    end: int
    template: object  # the model's ShardedTensor for this chunk (key, global shape, offsets, replica id)


def parameter_chunks(sharded) -> list[Chunk] | str:
    """The chunks of one model parameter's checkpoint entry (a ShardedTensor or ShardedTensorFactory), or why
    they cannot be mapped."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(sharded, ShardedTensor):
        if sharded.flattened_range is not None:
            return f"{sharded.key}: flattened_range"
        return [Chunk(0, sharded.data.numel(), sharded)]
    if not isinstance(sharded, ShardedTensorFactory):
        return f"{getattr(sharded, 'key', sharded)}: {type(sharded).__name__}"
    numel = sharded.data.numel()
    index = torch.arange(numel, dtype=torch.int64).view(sharded.data.shape)
    built = sharded.build_fn(sharded.key, index, sharded.replica_id, None)
    pieces = built if isinstance(built, list) else list(built.values()) if isinstance(built, dict) else [built]
    chunks = []
    for piece in pieces:
        if not isinstance(piece, ShardedTensor) or piece.flattened_range is not None or piece.data.numel() == 0:
            return f"{sharded.key}: factory piece {type(piece).__name__}"
        flat = piece.data.reshape(-1)
        first = int(flat[0])
        if not torch.equal(flat, torch.arange(first, first + flat.numel(), dtype=torch.int64)):
            return f"{sharded.key}: factory piece is not a contiguous range of the local tensor"
        chunks.append(Chunk(first, first + flat.numel(), piece))
    chunks.sort(key=lambda c: c.start)
    covered = 0
    for c in chunks:
        if c.start != covered:
            return f"{sharded.key}: factory pieces do not cover the tensor once"
        covered = c.end
    if covered != numel:
        return f"{sharded.key}: factory pieces do not cover the tensor once"
    return chunks


def _pieces(chunk: Chunk, key: str, state, start: int, end: int, replica_id, state_offset: int) -> list:
    """ShardedTensors for the part [start, end) of the local flat tensor that falls in `chunk`; `state` is the
    1-D state tensor holding the local flat range that begins at `state_offset`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    lo, hi = max(start, chunk.start), min(end, chunk.end)
    if lo >= hi:
        return []
    t = chunk.template
    out = []
    for offset, size in range_to_boxes(tuple(t.local_shape), lo - chunk.start, hi - chunk.start):
        flat_start = sum(o * prod(t.local_shape[i + 1:]) for i, o in enumerate(offset)) + chunk.start
        # The template's prepended axes (a layer's index in the stacked decoder) become leading axes of size 1:
        # Megatron-Core writes an irregular piece with its local shape as the chunk's shape (checkpointable.py),
        # which must have the global tensor's number of axes.
        prepend = t.prepend_axis_num
        shape = (1,) * prepend + tuple(size)
        data = state[flat_start - state_offset:flat_start - state_offset + prod(size)].view(shape)
        global_offset = tuple(t.global_offset[:prepend]) + tuple(
            g + o for g, o in zip(t.global_offset[prepend:], offset, strict=True))
        out.append(ShardedTensor(key, data, data.dtype, shape, tuple(t.global_shape), global_offset,
                                 axis_fragmentations=None, replica_id=replica_id, prepend_axis_num=0,
                                 allow_shape_mismatch=t.allow_shape_mismatch))
    return out


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    found = [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]
    return found


def supported(optimizer) -> str | None:
    """None where this module can build the model-space state of `optimizer`, else the reason."""
    dist = _distributed_optimizers(optimizer)
    if not dist or len(dist) != len(getattr(optimizer, "chained_optimizers", [optimizer])):
        return "not a distributed optimizer"
    for o in dist:
        if o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return "precision-aware optimizer"
        if getattr(o.ddp_config, "use_megatron_fsdp", False):
            return "Megatron FSDP"
    return None


def _iter_params(opt) -> Iterator[tuple[int, object, object]]:
    """(param_idx, model param, its range map on this DP rank or None) in the order of Megatron's
    `sharded_param_state_fully_reshardable` / `load_parameter_state_from_fully_reshardable`."""
    from collections import ChainMap

    param_idx = -1
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for buckets in gbuf_range_maps.values():
            local = ChainMap(*(b["param_map"] for b in buckets))
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                param_idx += 1
                yield param_idx, model_param, local.get(model_param)


def model_space_param_state(opt, model_sharded_state_dict, is_loading: bool = False,
                            metadata: dict | None = None) -> dict:
    """Drop-in for `DistributedOptimizer.sharded_param_state_fully_reshardable`, saving and loading: per
    parameter index, per state key, the list of this rank's pieces (views of its optimizer state).

    Raises ValueError where a parameter cannot be mapped (see `parameter_chunks`)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    by_param = {}
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    for sh in nested_values(sharded):
        by_param[sh.data] = sh
    prefix = "optimizer.state"
    out: dict = {}
    for param_idx, model_param, range_map in _iter_params(opt):
        if range_map is None:
            continue
        sh = by_param.get(model_param)
        if sh is None:
            raise ValueError(f"parameter {opt._param_name(model_param)} is not in the model's state dict")
        chunks = parameter_chunks(sh)
        if isinstance(chunks, str):
            raise ValueError(chunks)
        replica_id = sh.replica_id
        if not (isinstance(replica_id, tuple) and len(replica_id) == 3):
            raise ValueError(f"{sh.key}: replica id {replica_id!r} is not (PP, TP, DP)")
        replica_id = (*replica_id[:2], opt.distributed_optimizer_instance_id)
        start, end = range_map["param"].start, range_map["param"].end
        tensors = opt._get_main_param_and_optimizer_states(model_param)
        entry = {}
        for state_key, state in tensors.items():
            if state_key in SKIPPED_STATE or state.dim() != 1:
                continue
            if state.numel() != end - start:
                raise ValueError(f"{sh.key}: {state_key} holds {state.numel()} elements for the range "
                                 f"[{start}, {end})")
            key = f"{prefix}.{state_key}.{{}}"
            entry[state_key] = [p for c in chunks
                                for p in _pieces(c, key.format(c.template.key), state, start, end, replica_id, start)]
        out[param_idx] = entry
    if is_loading:  # the views the load fills (load_in_place copies where a strategy returned other tensors)
        opt._model_space_views = {i: {k: [p.data for p in ps] for k, ps in e.items()} for i, e in out.items()}
    return out


def load_in_place(opt, state_dict) -> None:
    """Drop-in for `DistributedOptimizer.load_parameter_state_from_fully_reshardable` after a load of
    `model_space_param_state(..., is_loading=True)`: the pieces were views of the optimizer state, which the
    load filled; a piece that came back as another tensor is copied into its view."""
    views = getattr(opt, "_model_space_views", None)
    if views is None:
        raise RuntimeError("model-space optimizer state loaded without its sharded state dict")
    for param_idx, entry in views.items():
        for state_key, targets in entry.items():
            loaded = state_dict[param_idx][state_key]
            if len(loaded) != len(targets):
                raise RuntimeError(f"optimizer state {state_key} of parameter {param_idx}: {len(loaded)} pieces "
                                   f"loaded for {len(targets)}")
            for got, target in zip(loaded, targets, strict=True):
                if got.data_ptr() != target.data_ptr():
                    target.copy_(got)
    del opt._model_space_views


def use_model_space(optimizer) -> list:
    """Route `optimizer`'s fully_reshardable save and load through this module; returns the patched
    DistributedOptimizers (`restore` undoes it)."""
    import types

    patched = []
    for opt in _distributed_optimizers(optimizer):
        opt._megatron_fully_reshardable = (opt.sharded_param_state_fully_reshardable,
                                           opt.load_parameter_state_from_fully_reshardable)
        opt.sharded_param_state_fully_reshardable = types.MethodType(model_space_param_state, opt)
        opt.load_parameter_state_from_fully_reshardable = types.MethodType(load_in_place, opt)
        patched.append(opt)
    return patched


def restore(patched: list) -> None:
    for opt in patched:
        opt.sharded_param_state_fully_reshardable, opt.load_parameter_state_from_fully_reshardable = \
            opt._megatron_fully_reshardable
        del opt._megatron_fully_reshardable


def coverage(state_dict) -> dict[str, list[int]]:
    """Per model-space optimizer-state key in `state_dict`: [elements this rank writes (main replicas), the key's
    global elements]. Summed over all ranks, the two must agree: every element written exactly once."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    out: dict[str, list[int]] = {}
    for v in nested_values(state_dict):
        if isinstance(v, ShardedTensor) and v.key.startswith("optimizer.state.") and v.axis_fragmentations is None:
            entry = out.setdefault(v.key, [0, prod(v.global_shape)])
            if is_main_replica(v.replica_id):
                entry[0] += prod(v.local_shape)
    return out


def coverage_problems(per_rank: list[dict[str, list[int]]], limit: int = 5) -> list[str]:
    """Keys whose pieces, over all ranks' `coverage`, do not add up to the global tensor (at most `limit`)."""
    written: dict[str, int] = {}
    total: dict[str, int] = {}
    for rank in per_rank:
        for key, (mine, numel) in rank.items():
            written[key] = written.get(key, 0) + mine
            total[key] = numel
    bad = [f"{k}: {written[k]} of {total[k]} elements" for k in sorted(total) if written[k] != total[k]]
    return bad[:limit]


def describe(piece_state: dict) -> dict:
    """Counts for the log: parameters, pieces and bytes of this rank's model-space state."""
    pieces = [p for entry in piece_state.values() for ps in entry.values() for p in ps]
    return {"parameters": len(piece_state), "pieces": len(pieces),
            "bytes": sum(p.data.numel() * p.data.element_size() for p in pieces)}


