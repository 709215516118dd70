"""status.progress: the apply-patch body, the request, and a real PATCH to a local HTTP server."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from megatron_trainer.progress import (
    Cadence,
    Progress,
    ProgressWriter,
    build_patch,
    build_request,
    in_cluster_api_server,
)

NOW = datetime(2026, 11, 21, 10, 0, 0, tzinfo=UTC)
SNAP = Progress(iteration=1200, train_iters=5000, loss=2.3141234567, tokens_per_second=123456.04,
                tflops_per_gpu=410.234, mfu=0.41477, last_checkpoint_iteration=1000)


def test_patch_body_matches_the_contract():
    assert build_patch("llama", "team-a", SNAP, NOW) == {
        "apiVersion": "megatron-operator.io/v1alpha1",
        "kind": "MegatronJob",
        "metadata": {"name": "llama", "namespace": "team-a"},
        "status": {"progress": {
            "iteration": 1200, "trainIters": 5000, "loss": 2.314123, "tokensPerSecond": 123456.0,
            "tflopsPerGpu": 410.23, "mfu": 0.4148, "lastCheckpointIteration": 1000,
            "updateTime": "2026-11-21T10:00:00Z"}},
    }


def test_unknown_and_non_finite_figures_are_left_out():
    body = build_patch("j", "ns", Progress(iteration=3, train_iters=10, loss=float("nan"), mfu=float("inf")), NOW)
    assert body["status"]["progress"] == {"iteration": 3, "trainIters": 10, "updateTime": "2026-11-21T10:00:00Z"}


def test_request_is_a_server_side_apply_of_the_status_subresource():
    req = build_request("https://10.0.0.1:443/", "tok", "my job", "ns", SNAP, NOW)
    assert req.get_method() == "PATCH"
    assert req.full_url == ("https://10.0.0.1:443/apis/megatron-operator.io/v1alpha1/namespaces/ns/megatronjobs/"
                            "my%20job/status?fieldManager=megatron-trainer&force=true")
    assert req.get_header("Content-type") == "application/apply-patch+yaml"
    assert req.get_header("Authorization") == "Bearer tok"
    assert json.loads(req.data) == build_patch("my job", "ns", SNAP, NOW)


def test_in_cluster_api_server():
    assert in_cluster_api_server({}) is None
    assert in_cluster_api_server({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}) == \
        "https://10.96.0.1:443"
    assert in_cluster_api_server({"KUBERNETES_SERVICE_HOST": "fd00::1"}) == "https://[fd00::1]:443"


class _Recorder(BaseHTTPRequestHandler):
    requests: list = []
    status = 200

    def do_PATCH(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(body)})
        self.send_response(type(self).status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    handler = type("Handler", (_Recorder,), {"requests": [], "status": 200})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, handler
    srv.shutdown()
    srv.server_close()


def test_writer_patches_a_local_server(server, tmp_path):
    srv, handler = server
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    writer = ProgressWriter(f"http://127.0.0.1:{srv.server_port}", "job-1", "ns-1", token_path=str(token))
    assert writer.write_now(SNAP) is True
    (req,) = handler.requests
    assert req["path"] == "/apis/megatron-operator.io/v1alpha1/namespaces/ns-1/megatronjobs/job-1/status" \
                          "?fieldManager=megatron-trainer&force=true"
    assert req["headers"]["Authorization"] == "Bearer s3cret"
    assert req["headers"]["Content-Type"] == "application/apply-patch+yaml"
    assert req["body"]["status"]["progress"]["iteration"] == 1200
    token.write_text("rotated")  # projected tokens rotate: read on every write
    writer.submit(SNAP)
    writer.close()
    assert handler.requests[-1]["headers"]["Authorization"] == "Bearer rotated"
    assert writer.writes_ok == 2


def test_failed_writes_are_logged_never_raised(server, caplog):
    srv, handler = server
    handler.status = 403
    writer = ProgressWriter(f"http://127.0.0.1:{srv.server_port}", "j", "ns")
    assert writer.write_now(SNAP) is False
    unreachable = ProgressWriter("http://127.0.0.1:9", "j", "ns", timeout_s=1)
    assert unreachable.write_now(SNAP) is False
    assert writer.writes_failed == 1 and unreachable.writes_failed == 1
    assert "HTTP 403" in caplog.text


def test_cadence():
    now = [100.0]
    c = Cadence(30, clock=lambda: now[0])
    assert c.due() and not c.due()
    now[0] += 29.9
    assert not c.due()
    now[0] += 0.2
    assert c.due()
    assert not Cadence(0).due()


def test_start_up_stage_without_an_iteration():
    """Before the checkpoint is loaded the iteration is unknown: it is left out, the stage says why."""
    body = build_patch("j", "ns", Progress(iteration=None, train_iters=10, stage="loading checkpoint 500"), NOW)
    assert body["status"]["progress"] == {"trainIters": 10, "stage": "loading checkpoint 500",
                                          "updateTime": "2026-11-21T10:00:00Z"}
    long = build_patch("j", "ns", Progress(iteration=1, train_iters=10, stage="x" * 999), NOW)
    assert len(long["status"]["progress"]["stage"]) == 256  # the CRD's maxLength


def test_lifecycle_reports_each_stage():
    from megatron_trainer.exitcodes import Lifecycle

    seen = []
    life = Lifecycle(on_stage=seen.append)
    for stage in ("initialising", "loading checkpoint 500", "training"):
        life.enter(stage)
    assert seen == ["initialising", "loading checkpoint 500", "training"] and life.stage == "training"


def test_goodput_and_save_figures_reach_status_progress():
    figures = {"ratio": 0.9, "wallSeconds": 100.0, "productiveSeconds": 90.0, "attempts": 2}
    body = build_patch("j", "ns", Progress(iteration=3, train_iters=10, goodput=figures, save_warning="w" * 2000,
                                           last_save_blocked_seconds=1.23456, last_save_seconds=float("nan")), NOW)
    progress = body["status"]["progress"]
    assert progress["goodput"] == figures and len(progress["saveWarning"]) == 1024
    assert progress["lastSaveBlockedSeconds"] == 1.235 and "lastSaveSeconds" not in progress
