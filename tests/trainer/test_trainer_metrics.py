"""The trainer's Prometheus gauges (megatron_trainer/metrics.py), served and scraped for real."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from megatron_trainer.metrics import _GAUGES, _LABELS, Metrics


def test_gauges_with_and_without_labels_are_served():
    pytest.importorskip("prometheus_client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    m = Metrics(port, enabled=True)
    assert m.port == port
    m.set("moe_idle_experts", 2)
    m.set("moe_expert_token_share", 0.25, expert="3")
    m.set("moe_expert_token_share", 0.75, expert="0")
    m.set("loss", None)  # not known yet: left unset
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "megatron_trainer_moe_idle_experts 2.0" in body
    assert 'megatron_trainer_moe_expert_token_share{expert="3"} 0.25' in body
    assert 'megatron_trainer_moe_expert_token_share{expert="0"} 0.75' in body
    assert set(_LABELS) <= set(_GAUGES)


def test_disabled_metrics_accept_every_call():
    m = Metrics(0, enabled=True)
    assert m.port is None
    m.set("moe_expert_token_share", 0.5, expert="1")
    m.set("iteration", 3)
