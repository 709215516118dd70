"""Each rank's log per restart attempt on the checkpoint volume (attemptlog.py), in a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_trainer.attemptlog import log_path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import logging, sys
from megatron_trainer import attemptlog
path = attemptlog.start(sys.argv[1] or None, int(sys.argv[2]), int(sys.argv[3]))
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
print("iteration 1 | lm loss: 2.5")
logging.getLogger("t").info("a log line")
print("a warning", file=sys.stderr)
raise SystemExit(0 if path else 3)
"""


def run(save: str, attempt: int, rank: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, save, str(attempt), str(rank)], capture_output=True,
                          text=True, timeout=60, env={"PYTHONPATH": f"{ROOT / 'trainer_image'}:{ROOT / 'contract'}", "HOSTNAME": "pod-0"})


def test_each_attempt_and_rank_gets_its_own_file_and_the_container_log_is_unchanged(tmp_path):
    for attempt in (0, 1):
        proc = run(str(tmp_path), attempt, 7)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "iteration 1 | lm loss: 2.5\nINFO a log line\n" and proc.stderr == "a warning\n"
    first, second = log_path(str(tmp_path), 0, 7), log_path(str(tmp_path), 1, 7)
    assert first == tmp_path / "logs" / "attempt-0" / "rank-00007.log"
    text = second.read_text()
    assert text.startswith("===== restart attempt 1, rank 7, pod pod-0, started ")
    assert text.endswith("iteration 1 | lm loss: 2.5\nINFO a log line\na warning\n")
    assert first.read_text().count("=====") == 2


def test_without_save_or_with_an_unwritable_volume_training_goes_on(tmp_path):
    assert run("", 0, 0).returncode == 3  # no --save: no copy, nothing printed about it
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    proc = run(str(blocked), 0, 0)
    assert proc.returncode == 3 and "not keeping a log copy" in proc.stderr
    assert "iteration 1" in proc.stdout
