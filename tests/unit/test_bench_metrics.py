"""bench/operator_latency.py reads the operator's own /metrics: its label parser against the operator's real
exposition (megatron_operator.metrics), not hand-written lines."""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_operator.metrics import Metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import operator_latency as B


def test_labels_of_the_operators_counters():
    m = Metrics()
    m.api_request("POST", "jobsets", 201)
    m.watch_events.labels(resource="pods").inc(3)
    text = m.exposition()[0].decode()
    requests = [B.prometheus_labels(line) for line in text.splitlines()
                if line.startswith("megatron_operator_api_requests_total{")]
    events = [(B.prometheus_labels(line), line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("megatron_operator_watch_events_total{")]
    assert requests == [{"verb": "POST", "resource": "jobsets", "code": "201"}]
    assert events == [({"resource": "pods"}, "3.0")]
