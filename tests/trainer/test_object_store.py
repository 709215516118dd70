"""Checkpoint layout on a real S3 server (versitygw on loopback) through multi-storage-client:
tracker last, resume from the newest complete checkpoint, retention, classified errors, and no
credential in any message. No torch: the torch_dist save/load through the same path is
test_object_store_torch.py (two gloo ranks, where torch and megatron-core are installed)."""

from __future__ import annotations

import itertools
import json
import os

import pytest

pytest.importorskip("multistorageclient")

import s3server
from megatron_trainer import ckpt_layout, objstore

_profiles = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    binary = s3server.versitygw_binary()
    if binary is None:
        pytest.fail("versitygw not found: build the pinned one with `.venv/bin/python e2e/cluster/cluster.py build "
                    "versitygw`, or set VERSITYGW=/path/to/versitygw", pytrace=False)
    srv = s3server.start(tmp_path_factory.mktemp("s3"), binary)
    yield srv
    srv.stop()


@pytest.fixture
def creds(server, tmp_path, monkeypatch):
    """The credentials as the operator projects them: a shared-credentials file, named by path only."""
    path = server.credentials_file(tmp_path / "credentials")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    return path


def _root(server, bucket: str, prefix: str = "runs/job-a") -> str:
    """A fresh MSC profile (clients are cached per profile) for s3://bucket/prefix on the server."""
    return objstore.configure(f"s3://{bucket}/{prefix}", server.endpoint, "us-east-1",
                              profile=f"ckpt{next(_profiles)}")


def _fake_shards(root: str, iteration: int, complete: bool) -> str:
    """The keys a torch_dist save leaves: shards and .metadata, then (last) metadata.json."""
    store = objstore.MscStore(root)
    name = ckpt_layout.checkpoint_name(iteration)
    store.write_text(f"{name}/__0_0.distcp", "shard0")
    store.write_text(f"{name}/__1_0.distcp", "shard1")
    store.write_text(f"{name}/.metadata", "global")
    if complete:
        store.write_text(f"{name}/metadata.json", json.dumps({"sharded_backend": "torch_dist",
                                                              "sharded_backend_version": 1}))
    return ckpt_layout.checkpoint_path(root, iteration)


def test_tracker_resume_and_interrupted_save(server, creds):
    server.make_bucket("ckpt-resume")
    root = _root(server, "ckpt-resume")
    assert ckpt_layout.find_resume_checkpoint(root) is None
    assert ckpt_layout.read_tracker(root) is None
    for it in (10, 20):
        path = _fake_shards(root, it, complete=True)
        assert ckpt_layout.is_complete(path)
        ckpt_layout.write_tracker(root, it)
    assert ckpt_layout.read_tracker(root) == 20
    # A save killed midway (shards written, metadata.json not yet): never taken as complete.
    partial = _fake_shards(root, 30, complete=False)
    assert not ckpt_layout.is_complete(partial)
    choice = ckpt_layout.find_resume_checkpoint(root)
    assert (choice.iteration, choice.reason) == (20, "tracker")
    assert choice.path == f"{root}/iter_0000020"
    assert [(e.iteration, e.complete) for e in ckpt_layout.list_checkpoints(root)] == [
        (10, True), (20, True), (30, False)]
    # The next attempt at 30 first clears the leftover keys; nothing of the partial save survives.
    ckpt_layout.prepare_save_dir(root, 30)
    assert [e.iteration for e in ckpt_layout.list_checkpoints(root)] == [10, 20]


def test_complete_newer_than_tracker_is_preferred(server, creds):
    server.make_bucket("ckpt-newer")
    root = _root(server, "ckpt-newer")
    _fake_shards(root, 5, complete=True)
    ckpt_layout.write_tracker(root, 5)
    _fake_shards(root, 6, complete=True)  # died between metadata.json and the tracker
    choice = ckpt_layout.find_resume_checkpoint(root)
    assert choice.iteration == 6 and "newer than the tracker" in choice.reason


def test_retention_keeps_n(server, creds):
    server.make_bucket("ckpt-keep")
    root = _root(server, "ckpt-keep", prefix="deep/er/prefix")
    other = _root(server, "ckpt-keep", prefix="deep/er/prefix-other")  # a sibling prefix is not ours
    _fake_shards(other, 1, complete=True)
    for it in (1, 2, 3, 4, 5):
        _fake_shards(root, it, complete=True)
    _fake_shards(root, 6, complete=False)  # a save in flight is never deleted
    ckpt_layout.write_tracker(root, 5)
    entries = ckpt_layout.list_checkpoints(root)
    for entry in ckpt_layout.select_for_deletion(entries, keep=2, protect={5}):
        ckpt_layout.delete_checkpoint(entry)
    assert [(e.iteration, e.complete) for e in ckpt_layout.list_checkpoints(root)] == [(4, True), (5, True),
                                                                                       (6, False)]
    assert [e.iteration for e in ckpt_layout.list_checkpoints(other)] == [1]
    # Every key of a deleted checkpoint is gone, not only its metadata.json.
    store = objstore.MscStore(root)
    assert store.list_dirs() == ["iter_0000004", "iter_0000005", "iter_0000006",
                                 "latest_checkpointed_iteration.txt"]


def test_wrong_secret_key_is_not_retriable_and_names_no_secret(server, tmp_path, monkeypatch):
    server.make_bucket("ckpt-creds")
    wrong = "WRONG" + server.secret_key[5:]
    path = server.credentials_file(tmp_path / "bad", secret_key=wrong)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    store = objstore.MscStore(_root(server, "ckpt-creds"))
    with pytest.raises(objstore.ObjectStoreError) as err:
        store.ensure_root()
    assert err.value.retriable is False
    assert err.value.code == "SignatureDoesNotMatch"
    assert "not retriable" in str(err.value) and "secret key is wrong" in str(err.value)
    for secret in (wrong, server.secret_key):
        assert secret not in str(err.value)


def test_unknown_access_key_is_not_retriable(server, tmp_path, monkeypatch):
    server.make_bucket("ckpt-creds2")
    path = server.credentials_file(tmp_path / "bad", access_key="NOSUCHKEY123")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    store = objstore.MscStore(_root(server, "ckpt-creds2"))
    # AWS answers InvalidAccessKeyId (403); versitygw XAdminUserNotFound (404), which MSC turns into
    # FileNotFoundError: neither may read as "no tracker yet".
    for attempt in (lambda: store.write_text("latest_checkpointed_iteration.txt", "1\n"),
                    lambda: store.read_text("latest_checkpointed_iteration.txt")):
        with pytest.raises(objstore.ObjectStoreError) as err:
            attempt()
        assert err.value.retriable is False
        assert err.value.code in ("InvalidAccessKeyId", "XAdminUserNotFound")
        assert "access key is unknown" in str(err.value)
        assert server.secret_key not in str(err.value)


def test_missing_bucket_is_not_retriable(server, creds):
    store = objstore.MscStore(_root(server, "no-such-bucket"))
    with pytest.raises(objstore.ObjectStoreError) as err:
        store.ensure_root()
    assert (err.value.retriable, err.value.code) == (False, "NoSuchBucket")
    assert "bucket does not exist" in str(err.value) and "not retriable" in str(err.value)


def test_unreachable_endpoint_is_retriable(tmp_path, monkeypatch, server):
    path = server.credentials_file(tmp_path / "c")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(path))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    # A port nothing listens on: the service is unreachable (a restart may find it back).
    root = objstore.configure("s3://bkt/p", f"http://127.0.0.1:{s3server._free_port()}", "us-east-1",
                              profile=f"ckpt{next(_profiles)}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(objstore.ObjectStoreError) as err:
        objstore.MscStore(root).ensure_root()
    assert err.value.retriable is True, str(err.value)


def test_exit_codes_of_store_errors(server, tmp_path, monkeypatch):
    """The trainer's exit code for what the server answers: refused -> 7 (not retried), also when the
    error comes raw out of MSC (as from inside Megatron-Core's writer); unreachable -> 1 (retried)."""
    import multistorageclient as msc
    from megatron_trainer.exitcodes import NON_RETRIABLE, ExitCode, classify

    server.make_bucket("ckpt-codes")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE",
                       str(server.credentials_file(tmp_path / "bad", secret_key="x" * 40)))
    root = _root(server, "ckpt-codes")
    for attempt in (lambda: objstore.MscStore(root).ensure_root(),
                    lambda: msc.write(f"{root}/iter_0000001/__0_0.distcp", b"shard")):
        with pytest.raises(Exception) as err:
            attempt()
        assert classify(err.value, first_iteration_done=True) == ExitCode.OBJECT_STORE_REFUSED, repr(err.value)
    assert ExitCode.OBJECT_STORE_REFUSED in NON_RETRIABLE
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(server.credentials_file(tmp_path / "good")))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    gone = objstore.configure("s3://ckpt-codes/p", f"http://127.0.0.1:{s3server._free_port()}", "us-east-1",
                              profile=f"ckpt{next(_profiles)}")
    with pytest.raises(objstore.ObjectStoreError) as err:
        objstore.MscStore(gone).ensure_root()
    assert classify(err.value, first_iteration_done=True) == ExitCode.ERROR


def test_no_credential_in_logs_config_or_termination_message(server, tmp_path, monkeypatch, caplog):
    """Issue 32: the secret key appears in no log line, in the MSC config the trainer writes, nor in the
    termination message (status.lastFailure is made from it), on success and on refusal."""
    import logging
    from pathlib import Path

    from megatron_trainer.exitcodes import classify, fatal_message

    server.make_bucket("ckpt-nolog")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    caplog.set_level(logging.DEBUG)
    wrong = "Z" * 12 + server.secret_key[12:]
    for secret in (server.secret_key, wrong):
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE",
                           str(server.credentials_file(tmp_path / f"c{len(caplog.records)}", secret_key=secret)))
        root = _root(server, "ckpt-nolog")
        config = Path(os.environ["MSC_CONFIG"]).read_text()
        message = ""
        try:
            ckpt_layout.write_tracker(root, 1)
            assert ckpt_layout.read_tracker(root) == 1
        except Exception as exc:  # the wrong key
            message = fatal_message(exc, classify(exc, False), 0, "start-up")
            assert "exit 7" in message
        assert (secret == wrong) == bool(message)
        for text in (config, message, caplog.text):
            assert server.secret_key not in text and wrong not in text


@pytest.mark.parametrize("code, status, retriable", [
    ("SlowDown", 503, True), ("ServiceUnavailable", 503, True), ("InternalError", 500, True),
    ("RequestTimeout", 400, True), ("AccessDenied", 403, False), ("NoSuchBucket", 404, False),
    ("ExpiredToken", 400, False),
])
def test_classification_of_s3_error_codes(code, status, retriable):
    """The table for answers versitygw cannot be made to give (throttling, 5xx): botocore's own
    ClientError as boto3 raises it, through the classifier and the trainer's exit code."""
    from botocore.exceptions import ClientError
    from megatron_trainer.exitcodes import ExitCode, classify

    exc = ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                      "PutObject")
    err = objstore.classify(exc, "msc://checkpoints/run")
    assert (err.retriable, err.code) == (retriable, code)
    try:
        raise err from exc
    except objstore.ObjectStoreError as raised:
        assert classify(raised, True) == (ExitCode.ERROR if retriable else ExitCode.OBJECT_STORE_REFUSED)
    assert classify(exc, True) == (ExitCode.ERROR if retriable else ExitCode.OBJECT_STORE_REFUSED)


# ---------------------------------------------------------------- Hugging Face export to the store
def _export_target(server, url: str):
    from megatron_trainer.hf_export import StoreExport

    return StoreExport(url, server.endpoint, "us-east-1", profile=f"export{next(_profiles)}")


def _bucket_keys(server, bucket: str, prefix: str) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                      aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_hf_export_to_the_store_is_complete_only_at_the_end_and_never_overwrites(server, creds, tmp_path):
    from megatron_trainer.hf_source import MARKER, PARTIAL_MARKER

    server.make_bucket("hf-exp")
    target = _export_target(server, "s3://hf-exp/exports/ft")
    assert target.check_at_start() is None
    assert target.prepare(20) == ("go", "")
    target.begin("")
    shard = target.shard_path("model-00001-of-00001.safetensors")
    shard.write_bytes(b"\0" * 1000)
    target.shard_written(shard.name, shard)
    assert not shard.exists()  # the staging copy is gone once uploaded
    # Shards are there, nothing that makes it loadable or complete yet.
    assert _bucket_keys(server, "hf-exp", "exports/ft/") == [
        f"exports/ft/{PARTIAL_MARKER}", "exports/ft/model-00001-of-00001.safetensors"]
    for name in ("config.json", "model.safetensors.index.json"):
        (target.dir / name).write_text("{}")
    target.publish(["config.json", "model.safetensors.index.json"], {"iteration": 20})
    staging = target.dir
    target.close()
    assert not staging.exists()
    assert _bucket_keys(server, "hf-exp", "exports/ft/") == [
        f"exports/ft/{MARKER}", "exports/ft/config.json", "exports/ft/model-00001-of-00001.safetensors",
        "exports/ft/model.safetensors.index.json"]
    # A restart after the export: skipped; another iteration: refused, nothing touched.
    again = _export_target(server, "s3://hf-exp/exports/ft")
    assert again.check_at_start() is None
    assert again.prepare(20)[0] == "skip"
    verdict, message = again.prepare(30)
    assert verdict == "fail" and "already holds an export of iteration 20" in message
    assert len(_bucket_keys(server, "hf-exp", "exports/ft/")) == 4


def test_hf_export_to_the_store_restarts_an_interrupted_export_and_refuses_foreign_keys(server, creds):
    from megatron_trainer.hf_source import PARTIAL_MARKER
    from megatron_trainer.objstore import MscStore

    server.make_bucket("hf-exp2")
    first = _export_target(server, "s3://hf-exp2/exports/ft")
    assert first.prepare(5)[0] == "go"
    first.begin("")
    shard = first.shard_path("model-00001-of-00002.safetensors")
    shard.write_bytes(b"x" * 100)
    first.shard_written(shard.name, shard)
    first.close()  # the attempt dies here
    retry = _export_target(server, "s3://hf-exp2/exports/ft")
    assert retry.check_at_start() is None  # an interrupted export of ours is not "foreign"
    assert retry.prepare(5) == ("go", "")
    assert _bucket_keys(server, "hf-exp2", "exports/ft/") == [f"exports/ft/{PARTIAL_MARKER}"]

    # Keys this trainer did not write: refused at start-up and at export time, naming one of them.
    MscStore(_root(server, "hf-exp2", "models/base")).write_text("config.json", "{}")
    MscStore(_root(server, "hf-exp2", "models/base-2")).write_text("x", "y")  # a sibling prefix is not inside
    taken = _export_target(server, "s3://hf-exp2/models/base")
    message = taken.check_at_start()
    assert "already holds 1 object(s) this trainer did not write" in message and "'config.json'" in message
    assert taken.prepare(5) == ("fail", message)
    assert _bucket_keys(server, "hf-exp2", "models/base/") == ["models/base/config.json"]


def test_hf_export_to_the_store_with_bad_credentials_exits_7_without_the_secret(server, tmp_path, monkeypatch,
                                                                               caplog):
    import logging

    from megatron_trainer.exitcodes import ExitCode, classify, fatal_message

    server.make_bucket("hf-exp3")
    caplog.set_level(logging.DEBUG)
    wrong = "Q" * 10 + server.secret_key[10:]
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(server.credentials_file(tmp_path / "bad", secret_key=wrong)))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    target = _export_target(server, "s3://hf-exp3/exports/ft")
    for attempt in (target.check_at_start, lambda: target.prepare(1)):
        with pytest.raises(objstore.ObjectStoreError) as err:
            attempt()
        assert classify(err.value, first_iteration_done=True) == ExitCode.OBJECT_STORE_REFUSED
        message = fatal_message(err.value, ExitCode.OBJECT_STORE_REFUSED, 0, "exporting to Hugging Face format")
        assert "exit 7" in message and "SignatureDoesNotMatch" in message and "hf-exp3" in str(err.value)
        for text in (message, caplog.text):
            assert wrong not in text and server.secret_key not in text
    assert _bucket_keys(server, "hf-exp3", "") == []


def test_hf_export_prefix_must_be_apart_from_the_checkpoints():
    from megatron_trainer.config import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    ok = parse_args([*base, "--save", "s3://bkt/runs/a", "--load", "s3://bkt/runs/a", "--hf-export", "s3://bkt/runs/a-hf"])
    assert ok.checkpoint.hf_export == "s3://bkt/runs/a-hf"
    # the export alone (checkpoints on a PVC) takes the object-store flags too
    assert parse_args([*base, "--hf-export", "s3://bkt/x", "--object-store-endpoint", "http://h:9000"])
    for export in ("s3://bkt/runs/a", "s3://bkt/runs/a/hf", "s3://bkt/runs", "s3://bkt"):
        with pytest.raises(SystemExit):
            parse_args([*base, "--save", "s3://bkt/runs/a", "--load", "s3://bkt/runs/a", "--hf-export", export])


def test_hf_export_to_an_unreachable_store_is_retriable(server, creds, monkeypatch):
    from megatron_trainer.exitcodes import ExitCode, classify
    from megatron_trainer.hf_export import StoreExport

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    target = StoreExport("s3://hf-gone/exports/ft", f"http://127.0.0.1:{s3server._free_port()}", "us-east-1",
                         profile=f"export{next(_profiles)}")
    with pytest.raises(objstore.ObjectStoreError) as err:
        target.prepare(1)
    assert err.value.retriable is True, str(err.value)
    assert classify(err.value, first_iteration_done=True) == ExitCode.ERROR  # a gang restart exports again


def test_one_configuration_file_per_process_rewritten_in_place(tmp_path, monkeypatch):
    """configure() keeps one MSC configuration file per process: a later profile is added to the same file
    (the path an async writer inherited stays valid), and no file is left behind per call."""
    monkeypatch.setattr(objstore.tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("MSC_CONFIG", raising=False)  # restored after the test, as are the module's globals
    monkeypatch.setattr(objstore, "_CONFIG_FILE", [])
    monkeypatch.setattr(objstore, "_PROFILES", {})
    registered = []
    monkeypatch.setattr(objstore.atexit, "register", lambda fn, *args: registered.append((fn, args)))
    objstore.configure("s3://one/p", "http://127.0.0.1:9", "us-east-1", profile="a")
    first = os.environ["MSC_CONFIG"]
    objstore.configure("s3://two/q", "http://127.0.0.1:9", "us-east-1", profile="b")
    assert os.environ["MSC_CONFIG"] == first
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(first)]
    profiles = json.loads(open(first).read())["profiles"]
    assert sorted(profiles) == ["a", "b"] and profiles["b"]["storage_provider"]["options"]["base_path"] == "two"
    [(fn, args)] = registered  # removed at exit, by the process that wrote it only
    fn(*args)
    assert list(tmp_path.iterdir()) == []
