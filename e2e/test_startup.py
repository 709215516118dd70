"""Start-up feedback on the real API server: the trainer's stage strings (written with the job's own
ServiceAccount token, as the trainer does) reach status.progress.stage and the Running message."""

from __future__ import annotations

import sys
from pathlib import Path

import kubernetes
import pytest
from mjob import run_for, small_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contract"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))
from megatron_trainer.progress import Progress, ProgressWriter

pytestmark = pytest.mark.e2e


def test_start_up_stage_is_shown_until_training(cluster, operator, jobs, tmp_path):
    jobs.create(small_job("warmup", podMetadata=run_for(120)))
    jobs.wait_phase("warmup", "Running")
    token = jobs.core.create_namespaced_service_account_token(
        "warmup-trainer", jobs.ns, {"spec": {"expirationSeconds": 600}}).status.token
    (tmp_path / "token").write_text(token)
    cfg = kubernetes.client.Configuration.get_default_copy()
    kubernetes.config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    writer = ProgressWriter(cfg.host, "warmup", jobs.ns, token_path=str(tmp_path / "token"), ca_path=cfg.ssl_ca_cert)

    # What rank 0 writes while it resumes: no iteration yet, the stage.
    assert writer.write_now(Progress(iteration=None, train_iters=1000, stage="loading checkpoint 500"))
    st = cluster.wait_for(lambda: (s := jobs.status("warmup")).get("message", "").endswith(
        "trainer: loading checkpoint 500") and s, 30, "the stage in the Running message", namespace=jobs.ns)
    assert st["phase"] == "Running" and st["progress"]["stage"] == "loading checkpoint 500"
    assert "iteration" not in st["progress"]
    print(f"status seen by the user: phase={st['phase']} message={st['message']!r} progress={st['progress']}")
    # Training: the iteration is back and the message no longer carries a stage.
    assert writer.write_now(Progress(iteration=501, train_iters=1000, loss=2.5, stage="training"))
    st = cluster.wait_for(lambda: (s := jobs.status("warmup")).get("message") == "2 pods running" and s, 30,
                          "the plain Running message", namespace=jobs.ns)
    assert st["progress"]["iteration"] == 501 and st["progress"]["stage"] == "training"
