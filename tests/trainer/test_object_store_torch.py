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


def _scratch(tmp_path) -> str:
    """TMPDIR for the ranks. A rank that is SIGKILLed (the kill test) or ends with os._exit (the HF harness's
    error path) cannot remove its MSC configuration file: it stays in the test's directory, not in /tmp
    (6 files per run before)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return str(tmp_path / "tmp")


def _env(server, tmp_path) -> dict:
    return {**os.environ, "AWS_SHARED_CREDENTIALS_FILE": str(server.credentials_file(tmp_path / "credentials")),
            "AWS_CONFIG_FILE": str(tmp_path / "no-config"), "TMPDIR": _scratch(tmp_path),
            "PYTHONPATH": os.pathsep.join([str(REPO / "trainer_image"), str(REPO / "contract"), str(HERE)])}


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


# ---------------------------------------------------------------- Hugging Face export to the store
def _download(server, bucket: str, prefix: str, dest: Path) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                      aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key)
    dest.mkdir(parents=True)
    names = []
    for key in _keys(server, bucket, prefix):
        name = key[len(prefix):]
        s3.download_file(bucket, key, str(dest / name))
        names.append(name)
    return names


def _hf_env(server, tmp_path, monkeypatch, secret_key: str | None = None) -> None:
    """The credentials as the operator projects them (a file named by path); the spawned ranks inherit it."""
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE",
                       str(server.credentials_file(tmp_path / "credentials", secret_key=secret_key)))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("TMPDIR", _scratch(tmp_path))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)


def _tiny_llama_source(server, tmp_path, monkeypatch, bucket: str):
    """hf_cpu_check and a tiny Llama made with transformers (random weights) in tmp_path/src; the store's
    environment set and `bucket` made."""
    require("transformers")
    sys.path.insert(0, str(HERE))
    import hf_cpu_check as hc

    _hf_env(server, tmp_path, monkeypatch)
    server.make_bucket(bucket)
    src = tmp_path / "src"
    src.mkdir()
    hc.make_model("tiny-llama3", src)
    return hc, src


def test_hf_export_to_the_store_loads_in_transformers_like_the_local_export(server, tmp_path, monkeypatch):
    """A tiny Llama made with transformers (random weights), imported into Megatron-Core at PP=2 and
    exported twice by the same ranks: to a local directory and to s3:// (several shards per stage, each
    stage uploading its own). The downloaded export is byte-identical to the local one and to the source,
    and transformers gives the source's logits from it."""
    import torch

    hc, src = _tiny_llama_source(server, tmp_path, monkeypatch, "hf-torch")
    local = tmp_path / "local-export"
    jobs = [(str(src), str(local), "fp32"), (str(src), "s3://hf-torch/exports/tiny", "fp32")]
    results = hc.run_jobs(jobs, 1, 2, "cpu", tmp_path, max_shard_bytes=200_000, endpoint=server.endpoint)
    for r in results:
        assert "error" not in r, r["error"]
    assert results[1]["export"][0]["shards"] >= 4  # both stages wrote several shards
    names = _download(server, "hf-torch", "exports/tiny/", tmp_path / "from-store")
    store = tmp_path / "from-store"
    # the completion marker is there and the partial one gone; the same files as the local export
    assert ".megatron-export.json" in names and ".megatron-export-partial" not in names
    assert sorted(names) == sorted(p.name for p in local.iterdir())
    for name in names:
        if name != ".megatron-export.json":
            assert (store / name).read_bytes() == (local / name).read_bytes(), name
    rt = hc.compare_export(src, store)
    assert not rt["not_identical"] and not rt["extra"] and rt["config_equal"] and rt["tensors"] == rt["exported"]
    torch.manual_seed(3)
    tokens = torch.randint(0, 1000, (2, 16))
    assert torch.equal(hc.hf_logits(store, tokens), hc.hf_logits(src, tokens))


def test_hf_export_to_the_store_refusals_exit_codes_and_no_secret(server, tmp_path, monkeypatch):
    """Through the ranks' export: a prefix holding someone else's keys -> exit 2 on every rank, nothing
    written there; a wrong secret key -> exit 7 (not retried) with the S3 code, the secret in no message."""
    hc, src = _tiny_llama_source(server, tmp_path, monkeypatch, "hf-refuse")
    import boto3

    boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", aws_access_key_id=server.access_key,
                 aws_secret_access_key=server.secret_key).put_object(Bucket="hf-refuse", Key="taken/README.md",
                                                                     Body=b"someone else's")
    (tmp_path / "a").mkdir()
    (taken,) = hc.run_jobs([(str(src), "s3://hf-refuse/taken", "fp32")], 1, 2, "cpu", tmp_path / "a",
                           endpoint=server.endpoint)
    assert taken["exit_codes"] == [2, 2], taken
    assert "already holds 1 object(s) this trainer did not write" in taken["fatal_messages"][0]
    assert _keys(server, "hf-refuse", "taken/") == ["taken/README.md"]

    wrong = "W" * 8 + server.secret_key[8:]
    _hf_env(server, tmp_path, monkeypatch, secret_key=wrong)
    (tmp_path / "b").mkdir()
    (refused,) = hc.run_jobs([(str(src), "s3://hf-refuse/exports/x", "fp32")], 1, 2, "cpu", tmp_path / "b",
                             endpoint=server.endpoint)
    assert refused["exit_codes"] == [7, 7], refused
    for message in refused["fatal_messages"]:
        assert "exit 7" in message and "not retried" in message and "SignatureDoesNotMatch" in message
        assert wrong not in message and server.secret_key not in message
    assert wrong not in refused["error"]
    assert _keys(server, "hf-refuse", "exports/") == []
