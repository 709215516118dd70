#!/usr/bin/env python3
"""Turn bench/results/memory_calibration.json (measured on GPUs by bench/trainer_memory_calibration.py)
into tests/unit/fixtures/memory_measured.json: one MegatronJob spec and the measured peak per record,
for the calibration test of the memory estimate. Real-data runs did not record their vocabulary: it is inferred
from the measured parameter count (see infer_vocab)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spec_for(r: dict, vocab: int | None = None) -> dict:
    m, p, t = r["model"], r["parallel"], r["training"]
    return {
        "numNodes": 1, "gpusPerNode": r["gpus"],
        "parallelism": {"tensor": p["tensor"], "pipeline": p["pipeline"], "sequenceParallel": p["sequence_parallel"],
                        **({"virtualPipeline": p["virtual_pipeline"]} if p.get("virtual_pipeline") else {})},
        "model": {"numLayers": m["num_layers"], "hiddenSize": m["hidden_size"],
                  "numAttentionHeads": m["num_attention_heads"], "numQueryGroups": m["num_query_groups"],
                  "ffnHiddenSize": m["ffn_hidden_size"], "seqLength": m["seq_length"],
                  "vocabSize": vocab or m.get("vocab_size") or m.get("padded_vocab_size"),
                  "normalization": m["normalization"], "activation": m["activation"],
                  "positionEmbedding": m["position_embedding"], "untieEmbeddings": m["untie_embeddings"],
                  "addBiasLinear": m["add_bias_linear"]},
        "training": {"microBatchSize": t["micro_batch_size"], "globalBatchSize": t["global_batch_size"],
                     "trainIters": 10, "recompute": t["recompute"],
                     "attentionBackend": "unfused" if t["attention_backend"] in ("unfused", "local") else "flash",
                     # the GPU image had no Transformer Engine: the local path (and torch AdamW) ran
                     "transformerImpl": "local", "distributedOptimizer": t["distributed_optimizer"]},
    }


def infer_vocab(r: dict) -> int | None:
    """Real-data runs did not record their tokenizer's vocabulary: find the padded size that gives
    exactly the parameter count the run measured on its rank (single-GPU layouts only)."""
    import sys

    sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "contract")]
    from megatron_operator.memory import estimate
    from megatron_operator.validation import parse_job

    if r["parallel"]["tensor"] != 1 or r["parallel"]["pipeline"] != 1:
        return None
    params = r["memory_per_rank_gib"][0]["params_on_rank"]
    for vocab in range(128, 262145, 128):
        spec = spec_for(r, vocab)
        doc = {"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob", "metadata": {"name": "x"},
               "spec": spec}
        if estimate(parse_job(doc)).details["paramsPerGpu"] == params:
            return vocab
    return None


def main() -> None:
    records = json.loads((ROOT / "bench" / "results" / "memory_calibration.json").read_text())["records"]
    out = []
    for r in records:
        vocab = r["model"].get("vocab_size") or r["model"].get("padded_vocab_size") or infer_vocab(r)
        if not vocab:
            continue
        peak = r.get("max_peak_allocated_gib") or r.get("logging_rank_peak_allocated_gib")
        out.append({"name": r["name"], "device": r["device"], "date": r["date"], "source": r["source"],
                    "measuredPeakAllocatedGiB": round(peak, 3), "partial": bool(r.get("partial")),
                    "spec": spec_for(r, vocab)})
    target = ROOT / "tests" / "unit" / "fixtures" / "memory_measured.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(out)} records to {target.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
