"""The GPU suite's kubelet stand-in (e2e/gpu/pods.py), on the operator's real rendering: every pod of
the JobSet in node-rank order with its own GPUs, fieldRefs and $(VAR) resolved as the kubelet does,
anything else refused (so the GPU test can never run a command the kubelet would not)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from factory import make_job
from megatron_operator.render import render
from megatron_operator.settings import Settings
from megatron_operator.validation import parse_job

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "gpu"))
import pods as P


def jobset(**overrides):
    return render(parse_job(make_job(**overrides)), Settings())[-1]


@pytest.mark.parametrize("text, env, expected", [
    ("--node-rank=$(NODE_RANK)", {"NODE_RANK": "3"}, "--node-rank=3"),
    ("$(UNDEFINED) stays", {}, "$(UNDEFINED) stays"),
    ("$$(NODE_RANK) is escaped", {"NODE_RANK": "3"}, "$(NODE_RANK) is escaped"),
    ("$(A)$(B)", {"A": "x", "B": "y"}, "xy"),
])
def test_kubernetes_variable_expansion(text, env, expected):
    assert P.expand(text, env) == expected


def test_pods_in_node_rank_order_with_their_own_gpus_and_resolved_env():
    js = jobset(numNodes=2, gpusPerNode=1, parallelism={"tensor": 2},
                training={"microBatchSize": 4, "globalBatchSize": 16, "trainIters": 10})
    pods = P.pods_of(js, restart_attempt=1, gpus_available=2)
    assert [p.gpus for p in pods] == [[0], [1]]
    assert [p.env()["NODE_RANK"] for p in pods] == ["0", "1"]
    assert pods[1].env()["MEGATRON_RESTART_ATTEMPT"] == "1" and pods[1].env()["HOME"] == "/tmp"
    cmd = pods[1].command()
    assert cmd[:3] == ["python", "-m", "megatron_trainer.launch"] and "--node-rank=1" in cmd
    assert P.master_address(js) == f"{js['metadata']['name']}-tp0-0-0.{js['metadata']['name']}"
    assert pods[0].user() == (1000, 1000)
    assert pods[0].process_env({"PATH": "/bin"})["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(P.PodError, match="needs more than 1 GPUs"):
        P.pods_of(js, 0, 1)


def test_what_the_harness_cannot_resolve_is_refused():
    js = jobset(env=[{"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
    pod = P.pods_of(js, 0, 64)[0]
    with pytest.raises(P.PodError, match="SECRET"):
        pod.env()
