"""Weights & Biases offline mode for real (issue 53): two gloo ranks on CPUs run the trainer's own logging
(Trainer.log_iterations, _wandb_writer; wandb_cpu_check.py) with --wandb-mode offline and a key file, and the run
is read back from wandb's own record file (the .wandb datastore: LevelDB-log framing of wandb_internal.proto
Records): every loss the trainer printed is in the run's history at its iteration, the key is in no file of the
run and in no environment, and a restart continues under the same run id. Needs torch and wandb."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

from conftest import MOCK_ARGV, require

require("torch")
wandb = require("wandb")

KEY = "local-" + "0123456789abcdef" * 2 + "5eb2c0ffee"
CHECK = Path(__file__).parent / "wandb_cpu_check.py"


def _records(path: Path):
    """wandb_internal_pb2.Record of a .wandb file: a 7-byte header (':W&B', magic, version), then LevelDB log
    blocks of 32 KiB whose chunks (7-byte header: crc32c, length, type full/first/middle/last) make the records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # the block's zero padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def _history(path: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for r in _records(path):
        if r.WhichOneof("record_type") == "history":
            row = out.setdefault(r.history.step.num, {})
            row.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return out


def _run(tmp_path: Path, first: int, last: int, out: Path) -> str:
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "key").write_text(KEY + "\n")
    argv = [*MOCK_ARGV, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
            "--wandb-project", "megatron tests", "--wandb-exp-name", "wandb-check", "--wandb-mode", "offline",
            "--wandb-save-dir", str(tmp_path / "ckpt" / "wandb"), "--wandb-api-key-file", str(tmp_path / "key")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(TMPDIR=str(tmp_path), TORCHDYNAMO_DISABLE="1", HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={port}", str(CHECK), str(first), str(last), str(out), *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert KEY not in proc.stdout + proc.stderr and KEY not in " ".join(argv)
    return proc.stdout


def test_an_offline_run_holds_the_printed_losses_and_no_key(tmp_path):
    stdout = _run(tmp_path, 0, 5, tmp_path / "first")
    printed = {int(it): float(loss) for it, loss in
               re.findall(r"iteration +(\d+)/ +\d+ \|.*? lm loss: ([0-9.E+-]+) \|", stdout)}
    assert sorted(printed) == [1, 2, 3, 4, 5]
    ranks = [json.loads((tmp_path / "first" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["run_id"] is None and ranks[0]["losses"] == {}  # only the last rank has a run
    run_id = ranks[1]["run_id"]
    assert re.fullmatch(r"[a-z0-9]{12}", run_id)
    assert not any(r["env_has_key"] or r["children_env_has_key"] for r in ranks)
    (run_dir,) = (tmp_path / "ckpt" / "wandb" / "wandb").glob(f"offline-run-*-{run_id}")
    history = _history(run_dir / f"run-{run_id}.wandb")
    assert sorted(history) == [1, 2, 3, 4, 5]
    for it, loss in printed.items():
        assert abs(history[it]["lm loss"] - loss) <= 1e-6 * abs(loss), (it, history[it]["lm loss"], loss)
        assert history[it]["lm loss"] == ranks[1]["losses"][str(it)]  # the exact value, not only its print
        assert history[it]["learning-rate"] == 0.05 and history[it]["batch-size"] == 4
        assert history[it]["grad-norm"] > 0
    config = {}
    for r in _records(run_dir / f"run-{run_id}.wandb"):
        if r.WhichOneof("record_type") == "run":
            assert r.run.project == "megatron tests" and r.run.display_name == "wandb-check"
            config = {u.key: json.loads(u.value_json) for u in r.run.config.update}
    assert config["logging.wandb_api_key_file"] == str(tmp_path / "key")  # the path, never the key
    assert config["training.train_iters"] == 10
    # the key file's content in no file the run wrote (nor anywhere under the checkpoint directory)
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert len(files) > 3
    assert not [p for p in files if KEY.encode() in p.read_bytes()]
    assert not (tmp_path / "home" / ".netrc").exists()

    # a restart that resumes at iteration 5 continues under the same run id (kept beside the checkpoints)
    _run(tmp_path, 5, 7, tmp_path / "second")
    assert (tmp_path / "ckpt" / "wandb-run-id").read_text().strip() == run_id
    assert json.loads((tmp_path / "second" / "rank1.json").read_text())["run_id"] == run_id
    second = [d for d in (tmp_path / "ckpt" / "wandb" / "wandb").glob(f"offline-run-*-{run_id}") if d != run_dir]
    assert len(second) == 1 and sorted(_history(second[0] / f"run-{run_id}.wandb")) == [6, 7]
