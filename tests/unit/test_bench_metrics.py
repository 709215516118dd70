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


def test_watch_floor_indexes_by_job_as_the_operator_does():
    """bench/watch_floor.py keys its indexes as the operator's index functions do (handlers.py): a job and its
    JobSet by their name, a pod by its job-name label; metadata without managedFields."""
    import watch_floor as W
    from megatron_operator.names import LABEL_JOB_NAME, MANAGED_SELECTOR
    from megatron_operator.status import PodView

    meta = {"name": "j-0", "namespace": "ns", "managedFields": [{"manager": "x"}], "labels": {LABEL_JOB_NAME: "j"}}
    key, entry = W.index_entry("megatronjobs", {"metadata": meta, "spec": {"a": 1}, "status": {"phase": "Running"}})
    assert key == ("ns", "j-0") and "managedFields" not in entry["metadata"] and entry["status"]["phase"] == "Running"
    key, entry = W.index_entry("jobsets", {"metadata": meta, "status": {}})
    assert key == ("ns", "j-0") and "managedFields" not in entry["metadata"]
    key, view = W.index_entry("pods", {"metadata": meta, "status": {"phase": "Pending"}})
    assert key == ("ns", "j") and isinstance(view, PodView)
    assert W.WATCHES["pods"][1] == W.WATCHES["jobsets"][1] == MANAGED_SELECTOR and W.WATCHES["megatronjobs"][1] is None


def test_request_ledger_reports_cpu_per_watch_event_for_the_operator_and_the_watch_floor():
    """bench/request_ledger.py: the operator's settled CPU over the watch events its handlers received, and the
    watch floor's over the events it received, per burst; a run without --watch-floor gets dashes."""
    import request_ledger as L

    ours = {"system": "ours", "jobs": 100, "controller_cpu_s": 2.8, "controller_cpu_settled_s": 3.2,
            "operator_watch_events": {"megatronjobs": 200, "jobsets": 300, "pods": 300},
            "watch_floor": {"cpu_settled_s": 0.44, "events_settled": {"megatronjobs": 200, "jobsets": 300, "pods": 300}}}
    plain = {**{k: v for k, v in ours.items() if k != "watch_floor"}, "jobs": 500}
    lines = L.watch_cost_lines([{"results": [ours, {"system": "peer", "jobs": 100}]}, {"results": [plain]}])
    assert lines[2] == "| 100 | 8.0 | 4.00 | 8.0 | 0.55 |"
    assert lines[3] == "| 500 | 1.6 | 4.00 | - | - |"
    assert L.watch_cost_lines([{"results": [{"system": "peer", "jobs": 100}]}]) == []
