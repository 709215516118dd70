"""``make_job(**overrides)``: a valid MegatronJob manifest with targeted changes.

Keys are field paths with ``__`` for nesting (``parallelism__tensor=4``); the value ``DELETE``
removes a field. The base job: 2 nodes x 8 GPUs, TP=2 x PP=2 (DP=4), an 8-layer GPT, micro batch
2, global batch 32.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

DELETE = object()

BASE: dict[str, Any] = {
    "apiVersion": "megatron-operator.io/v1alpha1",
    "kind": "MegatronJob",
    "metadata": {"name": "job", "namespace": "team-a"},
    "spec": {
        "numNodes": 2,
        "gpusPerNode": 8,
        "parallelism": {"tensor": 2, "pipeline": 2},
        "model": {"numLayers": 8, "hiddenSize": 1024, "numAttentionHeads": 16, "seqLength": 2048,
                  "vocabSize": 32000},
        "training": {"microBatchSize": 2, "globalBatchSize": 32, "trainIters": 100},
        "data": {"mock": True},
    },
}


def make_job(base: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    job = copy.deepcopy(base or BASE)
    for key, value in overrides.items():
        parts = key.split("__")
        root = job if parts[0] in ("metadata", "apiVersion", "kind") else job["spec"]
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = copy.deepcopy(value)
    return job


def wait_until(cond: Callable[[], Any], timeout_s: float = 10.0) -> None:
    """For tests of the operator's threads: poll ``cond`` until true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
