"""Hugging Face weights into a Megatron-Core model, and out of one (torch side of the converter).

Import: each rank reads only its own TP/PP slice, straight from the safetensors shards
(safetensors_io.read_rows_into: positional reads of the rows it needs, a bounded chunk at a time
for column slices), and copies it into its parameters. No TP=1 copy, no conversion job, no process
that holds the whole model.

Export: per parameter, the TP shards are gathered on the stage's TP rank 0 (data-parallel replica 0
only), turned into the HF tensors by the same plans, and streamed into safetensors shards (at most
`max_shard_bytes`, never mixing pipeline stages) that each stage writes itself, inside a temporary
directory that is renamed to the target only when everything is written: a crash mid-export never
leaves a directory that looks complete. No rank holds more than one full parameter at a time.
The target may also be an object-store prefix (hf_export.StoreExport): the same shards, staged one
at a time on local disk and uploaded, the index and a completion marker last.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .checkpoint import unwrap
from .config import TrainerConfig
from .exitcodes import ExitCode, Fatal
from .hf_config import HF_DTYPES, HfModel, export_config, generation_config, mismatches, parse_config
from .hf_export import export_target
from .hf_mapping import ParamPlan, exported_by, hf_tensor_shapes, is_expert, megatron_names, param_plan
from .hf_source import HfSource, copy_tokenizer
from .safetensors_io import (
    INDEX_NAME,
    PlannedTensor,
    StreamingWriter,
    TensorInfo,
    plan_shards,
    read_rows_into,
    shard_name,
)

log = logging.getLogger(__name__)

#: The largest read buffer for a column slice (rows are read this much at a time).
CHUNK_BYTES = 64 << 20
#: Hugging Face's default shard size limit (5 GB).
MAX_SHARD_BYTES = 5 * 10**9
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
CODES = {v: k for k, v in TORCH_DTYPES.items()}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$")
_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(weight|bias)([12])$")


def _global_layer(name: str, global_index: dict[int, int]) -> str:
    match = _LAYER.match(name)
    return f"decoder.layers.{global_index[int(match.group(1))]}.{match.group(2)}" if match else name


def global_params(model: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name with the GLOBAL layer and expert indices, parameter) for every parameter of this rank's
    chunks. Experts are named as SequentialMLP names them (`mlp.experts.local_experts.{expert}.linear_fc1.weight`,
    the expert index global over EP); moe.GroupedMLP's 3-D weights are given as one view per expert under those
    names (an import writes through the view, an export reads it)."""
    for chunk in model:
        gpt = unwrap(chunk)
        layers = gpt.decoder.layers if getattr(gpt, "decoder", None) is not None else []
        global_index = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
        # each MoE layer's first expert on this rank (its EP rank's share)
        first_expert = {_global_layer(name, global_index) + ".": module.ep_group.rank() * module.num_local_experts
                        for name, module in gpt.named_modules() if name.endswith(".mlp.experts")}
        for name, param in gpt.named_parameters():
            name = _global_layer(name, global_index)
            if local := _LOCAL_EXPERT.match(name):
                first = first_expert[local.group(1)]
                yield f"{local.group(1)}local_experts.{first + int(local.group(2))}.{local.group(3)}", param
            elif grouped := _GROUPED.match(name):
                first = first_expert[grouped.group(1)]
                fc = f"linear_fc{grouped.group(3)}.{grouped.group(2)}"
                for i in range(param.shape[0]):
                    yield f"{grouped.group(1)}local_experts.{first + i}.{fc}", param[i]
            else:
                yield name, param


# ------------------------------------------------------------------------------------------ import
def _read(info: TensorInfo, axis: int, start: int, end: int) -> torch.Tensor:
    """Rows (axis 0) or columns (axis 1) [start, end) of a tensor, on the CPU, in its own dtype."""
    dtype = TORCH_DTYPES[info.dtype]
    if axis == 0:
        out = torch.empty((end - start, *info.shape[1:]), dtype=dtype)
        read_rows_into(info, start, end, memoryview(out.view(-1).view(torch.uint8).numpy()))
        return out
    rows, cols = info.shape
    out = torch.empty((rows, end - start), dtype=dtype)
    step = max(1, CHUNK_BYTES // info.row_bytes)
    buf = torch.empty((min(step, rows), cols), dtype=dtype)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        read_rows_into(info, r0, r0 + n, memoryview(buf[:n].view(-1).view(torch.uint8).numpy()))
        out[r0:r0 + n].copy_(buf[:n, start:end])
    return out


def _expert_tp() -> tuple[int, int]:
    """This rank's expert tensor-parallel size and rank (experts' weights are split over them, not over TP)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()


def import_weights(model: list, source: HfSource, tp: int, tp_rank: int, padded_vocab: int) -> dict:
    """Fill this rank's parameters from the HF checkpoint; figures for the log."""
    t0 = time.monotonic()
    m = source.model
    plans: list[tuple[ParamPlan, torch.Tensor]] = []
    problems = []
    etp, etp_rank = _expert_tp() if m.moe else (tp, tp_rank)
    for name, param in global_params(model):
        try:
            plan = param_plan(name, m, *((etp, etp_rank) if is_expert(name) else (tp, tp_rank)), padded_vocab)
        except ValueError as e:
            problems.append(str(e))
            continue
        if tuple(param.shape) != plan.shape:
            problems.append(f"{name}: this rank's shard is {list(param.shape)}, the plan expects {list(plan.shape)}")
        plans.append((plan, param))
    if problems:  # the flags were checked against config.json: this is a converter bug, said plainly
        raise Fatal(ExitCode.BAD_ARGUMENTS, "Hugging Face import: " + "; ".join(problems[:5]))
    read_bytes = 0
    with torch.no_grad():
        for plan, param in plans:
            covered = sum((p.dst[1] - p.dst[0]) for p in plan.pieces if p.axis == 0)
            if covered < plan.shape[0] and all(p.axis == 0 for p in plan.pieces):
                param.data.zero_()  # vocabulary padding rows
            for piece in plan.pieces:
                info = source.checkpoint.info(piece.hf)
                src = _read(info, piece.axis, *piece.src)
                read_bytes += src.numel() * src.element_size()
                param.data.narrow(piece.axis, piece.dst[0], piece.dst[1] - piece.dst[0]).copy_(src)
                del src
    return {"tensors": len(plans), "bytes_read": read_bytes, "seconds": time.monotonic() - t0}


# ------------------------------------------------------------------------------------------ export
def hf_model_for_export(cfg: TrainerConfig) -> tuple[HfModel, dict | None]:
    """The architecture to export and the source config.json (from --hf-init), if any."""
    from .hf_config import load_config, not_converted

    source = None
    if cfg.checkpoint.hf_init:
        try:
            source = load_config(cfg.checkpoint.hf_init)
        except ValueError as e:
            log.warning("hf export: the --hf-init config.json cannot be read (%s): writing one from the flags", e)
    config = source if source is not None else export_config(cfg, None, "float32")
    hf = parse_config(config, cfg.model.seq_length)
    unmapped = not_converted(hf)
    if unmapped:
        raise Fatal(ExitCode.BAD_ARGUMENTS, "the model cannot be exported to Hugging Face: " + "; ".join(unmapped))
    return hf, source


def export_weights(model: list, cfg: TrainerConfig, env, iteration: int, padded_vocab: int,
                   max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Collective on every rank: write the model as a Hugging Face checkpoint to --hf-export (a directory
    or s3://BUCKET/PREFIX; hf_export.py: never overwritten, complete only once everything is there)."""
    target = export_target(cfg.checkpoint)
    try:
        return _export(model, cfg, env, iteration, padded_vocab, max_shard_bytes, target)
    finally:
        target.close()


def _export(model: list, cfg: TrainerConfig, env, iteration: int, padded_vocab: int, max_shard_bytes: int,
            target) -> dict:
    from megatron.core import parallel_state as ps

    from .objstore import ObjectStoreError

    t0 = time.monotonic()
    decision: list = [None]
    if env.is_rank0:
        try:
            decision[0] = target.prepare(iteration)
        except ObjectStoreError as e:  # told to every rank, each exits with its code (7 or 1)
            decision[0] = ("store-error", str(e), e.retriable, e.code)
    torch.distributed.broadcast_object_list(decision, src=0, group=env.cpu_group)
    verdict, detail = decision[0][:2]
    if verdict == "store-error":
        raise ObjectStoreError(detail, *decision[0][2:])
    if verdict == "fail":
        raise Fatal(ExitCode.BAD_ARGUMENTS, detail)
    if verdict == "skip":
        if env.is_rank0:
            log.info("hf export: %s", detail)
        return {"skipped": detail}
    target.begin(detail)

    m, source_config = hf_model_for_export(cfg)
    diff = mismatches(cfg, m)
    if diff:  # a model no Hugging Face architecture here describes (flags without --hf-init)
        raise Fatal(ExitCode.BAD_ARGUMENTS, f"hf export: the model cannot be written as {m.architecture}: "
                    + "; ".join(diff))
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    # experts: split over the expert TP ranks, spread over EP, replicated over the expert data-parallel ranks
    etp, etp_rank = _expert_tp() if m.moe else (tp, tp_rank)
    ep_rank = ps.get_expert_model_parallel_rank() if m.moe else 0
    edp_rank = ps.get_expert_data_parallel_rank() if m.moe else dp_rank
    local = dict(global_params(model))
    dtype = next(iter(local.values())).dtype
    code = CODES[dtype]

    def writer_of(name: str) -> tuple[int, int]:
        """Who writes a parameter's tensors: the first rank of its pipeline stage, or for an expert the first
        expert-TP, expert-DP rank of its EP rank (which is that first rank for EP rank 0)."""
        return (pp_rank, ep_rank) if is_expert(name) else (pp_rank, 0)

    def holds_the_copy(name: str) -> bool:  # the data-parallel replica that is gathered and written
        return edp_rank == 0 if is_expert(name) else dp_rank == 0

    # Which rank writes each Megatron parameter (every rank learns every rank's names).
    mine = [(n, writer_of(n)) for n in sorted(local) if holds_the_copy(n)]
    everyone = [None] * env.world_size
    torch.distributed.all_gather_object(everyone, mine, group=env.cpu_group)
    writer: dict[str, tuple[int, int]] = {}
    for entries in everyone:
        for n, w in entries:
            writer.setdefault(n, tuple(w))
    te_norms = any(n.endswith("layer_norm_weight") for n in writer)
    every = megatron_names(m, te_norms)
    missing = [n for n in every if n not in writer and not (n == "output_layer.weight" and m.tied)]
    if missing:
        raise Fatal(ExitCode.BAD_ARGUMENTS, f"hf export: the model has no {missing[0]} (architecture mismatch)")
    # each writer's tensors together (a shard never mixes writers), in Megatron's order within
    order = sorted((n for n in every if n in writer), key=lambda n: writer[n])
    shapes = hf_tensor_shapes(m)
    planned = [(PlannedTensor(hf, code, shapes[hf]), writer[n]) for n in order for hf in exported_by(n, m)]
    shards = plan_shards(planned, max_shard_bytes)
    names = [shard_name(i, len(shards)) for i in range(len(shards))]
    weight_map = {t.name: names[i] for i, (_, ts) in enumerate(shards) for t in ts}
    total = sum(t.nbytes for t, _ in planned)

    written = 0
    keys = {(pp_rank, 0)} if dp_rank == 0 and tp_rank == 0 else set()
    if m.moe and edp_rank == 0 and etp_rank == 0:
        keys.add((pp_rank, ep_rank))
    shard_iter = iter([(names[i], ts) for i, (w, ts) in enumerate(shards) if w in keys])
    writer_file: StreamingWriter | None = None
    pending: list[PlannedTensor] = []
    for name in order:
        if name not in local or not exported_by(name, m) or not holds_the_copy(name):
            continue
        size, rank, group = (etp, etp_rank, ps.get_expert_tensor_parallel_group) if is_expert(name) else \
            (tp, tp_rank, ps.get_tensor_model_parallel_group)
        param = local[name].detach().contiguous()
        if size > 1:
            gathered = [torch.empty_like(param) for _ in range(size)] if rank == 0 else None
            torch.distributed.gather(param, gathered, dst=torch.distributed.get_global_rank(group(), 0), group=group())
        else:
            gathered = [param]
        if rank != 0:
            continue
        outputs = {hf: torch.empty(shapes[hf], dtype=dtype) for hf in exported_by(name, m)}
        for r, shard in enumerate(gathered):
            shard_cpu = shard.cpu()
            for piece in param_plan(name, m, size, r, padded_vocab).pieces:
                if piece.hf in outputs:
                    outputs[piece.hf].narrow(piece.axis, piece.src[0], piece.src[1] - piece.src[0]).copy_(
                        shard_cpu.narrow(piece.axis, piece.dst[0], piece.dst[1] - piece.dst[0]))
        del gathered
        for hf, tensor in outputs.items():
            if not pending:
                fname, planned_here = next(shard_iter)
                pending = list(planned_here)
                writer_file = StreamingWriter(target.shard_path(fname), planned_here, {"format": "pt"})
            writer_file.write(hf, tensor.contiguous().view(-1).view(torch.uint8).numpy())
            written += tensor.numel() * tensor.element_size()
            pending.pop(0)
            if not pending:
                writer_file.close()
                target.shard_written(fname, writer_file.path)
                writer_file = None
    if writer_file is not None:
        writer_file.close()
    torch.distributed.barrier(group=env.cpu_group)

    if env.is_rank0:
        tmp = target.dir  # the small files are written here, then published
        config = export_config(cfg, source_config, {v: k for k, v in HF_DTYPES.items()}[code])
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        src_dir = Path(cfg.checkpoint.hf_init) if cfg.checkpoint.hf_init else \
            (Path(cfg.data.tokenizer_model) if cfg.data.tokenizer_model else None)
        gen = generation_config(Path(cfg.checkpoint.hf_init) if cfg.checkpoint.hf_init else None, config)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
        tokenizer = copy_tokenizer(src_dir, tmp)
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2, sort_keys=True) + "\n")
        # The index last: without it transformers loads nothing.
        target.publish(["config.json", "generation_config.json", *tokenizer, INDEX_NAME],
                       {"iteration": iteration, "shards": names, "dtype": code})
        log.info("hf export: iteration %d -> %s: %d tensors, %.2f GB in %d shard(s), tokenizer files %s, %.1f s",
                 iteration, target, len(planned), total / 1e9, len(names), tokenizer or "none", time.monotonic() - t0)
    torch.distributed.barrier(group=env.cpu_group)
    return {"seconds": time.monotonic() - t0, "bytes": total, "shards": len(names), "written_here": written}
