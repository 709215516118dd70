"""Two gloo ranks save and load a sharded state dict through `msc://` to a real S3 server (versitygw on
loopback): bit-exact reload, a save killed before it was finalized leaves the previous checkpoint as
newest-complete, retention keeps N. Needs torch, megatron-core and multi-storage-client[boto3] in one
venv: `make torch-tests` (part of `make test`, CI) installs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require

require("torch")
require("megatron.core")
require("multistorageclient")

import s3server  # noqa: E402

HERE = Path(__file__).parent
REPO = HERE.parents[1]
CHECK = HERE / "objstore_torch_check.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    binary = s3server.versitygw_binary()
    if binary is None:
        pytest.fail("versitygw not found: `.venv/bin/python e2e/cluster/cluster.py build versitygw`", pytrace=False)
    srv = s3server.start(tmp_path_factory.mktemp("s3"), binary)
    yield srv
    srv.stop()


def _env(server, tmp_path) -> dict:
    return {**os.environ, "AWS_SHARED_CREDENTIALS_FILE": str(server.credentials_file(tmp_path / "credentials")),
            "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
            "PYTHONPATH": os.pathsep.join([str(REPO / "trainer_image"), str(HERE)])}


def _run(scenario: str, url: str, server, tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / scenario
    proc = subprocess.run([sys.executable, str(CHECK), scenario, url, server.endpoint, str(out), *extra],
                          env=_env(server, tmp_path), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


def _keys(server, bucket: str, prefix: str) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                      aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_two_ranks_save_kill_resume_retention(server, tmp_path):
    server.make_bucket("ckpt-torch")
    url = "s3://ckpt-torch/runs/job-1"
    # Iterations 1 and 2 sync, 3 async (tracker by the finalize fn); keep=2.
    saved = _run("save", url, server, tmp_path)
    assert saved[0]["tracker"] == 3
    assert saved[0]["checkpoints"] == [[2, True], [3, True]]  # retention deleted iteration 1
    keys = _keys(server, "ckpt-torch", "runs/job-1/")
    assert "runs/job-1/latest_checkpointed_iteration.txt" in keys
    assert not [k for k in keys if k.startswith("runs/job-1/iter_0000001/")]
    assert {k.rsplit("/", 1)[1] for k in keys if k.startswith("runs/job-1/iter_0000003/")} >= {
        ".metadata", "metadata.json", "__0_0.distcp", "__1_0.distcp"}
    assert not list(tmp_path.glob("msc*")) and not list(tmp_path.glob("s3*"))  # nothing went to local disk

    # An async save of iteration 4, SIGKILLed (every rank and its writer) once its shards are on the
    # server but before it was finalized (metadata.json, then the tracker).
    out = tmp_path / "hang"
    proc = subprocess.Popen([sys.executable, str(CHECK), "hang-in-save", url, server.endpoint, str(out), "4"],
                            env=_env(server, tmp_path), cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    shards: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None:
        shards = [k for k in _keys(server, "ckpt-torch", "runs/job-1/iter_0000004/") if k.endswith(".distcp")]
        if len(shards) == 2:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    log = proc.communicate(timeout=30)[0]
    assert len(shards) == 2, log[-3000:]
    assert "runs/job-1/iter_0000004/metadata.json" not in _keys(server, "ckpt-torch", "runs/job-1/iter_0000004/")

    loaded = _run("load", url, server, tmp_path)
    assert loaded[0]["checkpoints"] == [[2, True], [3, True], [4, False]]
    for rank in loaded:
        assert rank["resume"] == [3, "tracker"]
        assert rank["iteration"] == 3
        assert rank["weight_bit_exact"] and rank["bias_bit_exact"]
