"""The memory estimate against peak memory measured on H200s (fixtures from bench/memory_fixture.py;
the runs are in docs/benchmarks/memory-estimator.md#2026-11-21-measured-data). The issue's bar: within +-15%
on every configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megatron_operator.memory import GIB, estimate
from megatron_operator.validation import parse_job

RECORDS = json.loads((Path(__file__).parent / "fixtures" / "memory_measured.json").read_text())


def job(spec):
    return parse_job({"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                      "metadata": {"name": "calib"}, "spec": spec})


def test_enough_varied_configurations():
    assert len(RECORDS) >= 8
    specs = [r["spec"] for r in RECORDS]
    assert {s["parallelism"]["tensor"] for s in specs} >= {1, 2}
    assert {s["parallelism"]["pipeline"] for s in specs} >= {1, 2}
    assert {s["gpusPerNode"] // (s["parallelism"]["tensor"] * s["parallelism"]["pipeline"]) for s in specs} >= {1, 2}
    assert {s["training"]["recompute"] for s in specs} == {"none", "selective", "full"}
    assert {s["training"]["attentionBackend"] for s in specs} == {"flash", "unfused"}
    assert len({s["training"]["microBatchSize"] for s in specs}) >= 3
    assert len({s["model"]["seqLength"] for s in specs}) >= 2


@pytest.mark.parametrize("record", RECORDS, ids=[r["name"] for r in RECORDS])
def test_estimate_within_15_percent_of_measured_peak(record):
    predicted = estimate(job(record["spec"])).total / GIB
    measured = record["measuredPeakAllocatedGiB"]
    assert abs(predicted - measured) / measured <= 0.15, f"predicted {predicted:.2f} GiB, measured {measured:.2f} GiB"
