#!/usr/bin/env python3
"""Build bench/results/memory_calibration.json from GPU-suite outputs (issue 7's calibration data).

    python3 bench/trainer_memory_calibration.py --device "NVIDIA H200" --date 2026-11-21 \
        DIR_OR_TARBALL... > bench/results/memory_calibration.json

Every run that printed a TRAINER_SUMMARY (memory scenario, layout runs) becomes one record. The
configuration is re-derived from the run's own command line (first log line) with the trainer's
parser, so the record states exactly what ran. Runs killed on purpose (benchmark) only have the
logging rank's peak from its iteration lines; they are kept, marked `partial`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contract"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))

from megatron_trainer.config import parse_args, world_layout
from megatron_trainer.flops import padded_vocab_size

PEAK_RE = re.compile(r"mem GiB \(alloc/peak\): ([0-9.]+)/([0-9.]+)")


def logs_in(path: Path):
    if path.is_file() and path.name.endswith(".tar.gz"):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".log") and member.isfile():
                    yield member.name, tar.extractfile(member).read().decode(errors="replace")
    elif path.is_dir():
        for f in sorted(path.rglob("*.log")):
            yield str(f), f.read_text(errors="replace")


def record(name: str, text: str, device: str, date: str, source: str) -> dict | None:
    first = text.splitlines()[0] if text else ""
    if "-m megatron_trainer" not in first or " preprocess " in first:
        return None
    nproc = int(re.search(r"--nproc-per-node=(\d+)", first).group(1))
    argv = first.split("-m megatron_trainer", 1)[1].split()
    cfg = parse_args(argv)
    wl = world_layout(cfg, nproc)
    m, p, t = cfg.model, cfg.parallel, cfg.training
    summary = None
    for line in text.splitlines():
        if line.startswith("TRAINER_SUMMARY "):
            summary = json.loads(line[len("TRAINER_SUMMARY "):])
    vocab = m.vocab_size if cfg.data.tokenizer_type == "NullTokenizer" else None
    out = {
        "name": Path(name).stem, "source": source, "device": device, "date": date, "gpus": nproc,
        "model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
                  "num_query_groups": m.effective_num_query_groups, "ffn_hidden_size": m.effective_ffn_hidden_size,
                  "seq_length": m.seq_length, "vocab_size": vocab,
                  "padded_vocab_size": padded_vocab_size(vocab, m.make_vocab_size_divisible_by, p.tensor) if vocab else None,
                  "normalization": m.normalization, "activation": "swiglu" if m.swiglu else "gelu",
                  "position_embedding": m.position_embedding_type,
                  "untie_embeddings": m.untie_embeddings_and_output_weights, "add_bias_linear": m.add_bias_linear},
        "parallel": {"tensor": p.tensor, "pipeline": p.pipeline, "virtual_pipeline": p.virtual_pipeline,
                     "data": wl.data_parallel, "context": p.context, "expert": p.expert,
                     "sequence_parallel": p.sequence_parallel},
        "training": {"micro_batch_size": t.micro_batch_size, "global_batch_size": wl.global_batch_size,
                     "num_microbatches": wl.num_microbatches, "precision": t.precision,
                     "recompute": t.recompute_granularity or "none", "recompute_method": t.recompute_method,
                     "recompute_num_layers": t.recompute_num_layers, "attention_backend": t.attention_backend,
                     "transformer_impl": "local (Transformer Engine not installed)",
                     "distributed_optimizer": t.use_distributed_optimizer,
                     "overlap_grad_reduce": t.overlap_grad_reduce, "overlap_param_gather": t.overlap_param_gather,
                     "optimizer": "adam (torch.optim.AdamW fallback: fp32 main params, exp_avg, exp_avg_sq)",
                     "grad_reduce_in_fp32": True},
        "data": "mock" if cfg.data.mock_data else "real .bin/.idx (HF tokenizer; vocab from the tokenizer)",
        "checkpointing": bool(cfg.checkpoint.save),
    }
    if summary:
        ranks = summary["memory_per_rank"]
        out.update({"partial": False, "iterations": summary["iterations_run"], "memory_per_rank_gib": ranks,
                    "max_peak_allocated_gib": max(r["peak_allocated_gib"] for r in ranks),
                    "max_peak_reserved_gib": max(r["peak_reserved_gib"] for r in ranks)})
    else:
        peaks = [float(x.group(2)) for x in PEAK_RE.finditer(text)]
        if not peaks:
            return None
        out.update({"partial": True, "iterations": len(peaks),
                    "note": "run killed on purpose (benchmark); peak of the logging (last) rank only",
                    "logging_rank_peak_allocated_gib": max(peaks)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--device", required=True)
    ap.add_argument("--date", required=True)
    args = ap.parse_args()
    records, seen = [], set()
    for raw in args.inputs:
        source, _, path = raw.partition("=")
        path = path or source
        for name, text in logs_in(Path(path)):
            stem = Path(name).stem
            if not stem.startswith(("memory_", "ref_", "bench_ours_")) or stem.endswith("_restart"):
                continue  # kill/SIGTERM runs repeat a reference configuration
            rec = record(name, text, args.device, args.date, source)
            if rec is None:
                continue
            key = json.dumps([rec["gpus"], rec["model"], rec["parallel"], rec["training"]], sort_keys=True)
            if key in seen:  # measured again: keep the later full record, never trade a full one for a partial
                if rec["partial"] and any(r["_key"] == key and not r["partial"] for r in records):
                    continue
                records = [r for r in records if r["_key"] != key]
            seen.add(key)
            rec["_key"] = key
            records.append(rec)
    for r in records:
        del r["_key"]
    json.dump({"description": "Measured GPU memory of the megatron_trainer (issue 7 calibration); "
                              "torch.cuda.max_memory_allocated/max_memory_reserved per rank after the run, "
                              "memory_allocated after model build / optimizer build / first step.",
               "records": records}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
