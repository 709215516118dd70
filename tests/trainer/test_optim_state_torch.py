"""The optimizer state saved and loaded in place (optim_state.py) against Megatron-Core's own fully reshardable
save and load, through the trainer's Checkpointer, on gloo ranks on the CPU (optim_state_check.py): a tiny
Llama (SwiGLU's ShardedTensorFactory, GQA, layers stacked along a prepended axis) saved at DP=2 and at
TP=2 x PP=2, loaded under other layouts (TP, PP, DP and a vocabulary padded differently at TP=4). Every load
of either program's checkpoint by either program must give the bit-identical optimizer state that Megatron's
own save and load give. Needs torch and megatron-core: `make torch-tests`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require

torch = require("torch")
require("megatron.core")

HERE = Path(__file__).parent
REPO = HERE.parents[1]
CHECK = HERE / "optim_state_check.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp: Path, world: int, tp: int, pp: int, mode: str, action: str, ckpt: Path, name: str,
        sharding: str = "fully_reshardable", expect_rc: int = 0) -> Path:
    out = tmp / name
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO / "trainer_image"), TMPDIR=str(tmp))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                           f"--master-port={_port()}", str(CHECK), str(world), str(tp), str(pp), mode, action,
                           str(ckpt), str(out), sharding], env=env, capture_output=True, text=True, timeout=600)
    if expect_rc == 0:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    else:
        assert proc.returncode != 0
        (out / "log.txt").write_text(proc.stdout + proc.stderr)
    return out


def states(out: Path) -> dict:
    return {p.name: torch.load(p) for p in sorted(out.glob("state_rank*.pt"))}


def results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("result_rank*.json"))]


def assert_same(a: Path, b: Path) -> int:
    """Every rank's optimizer state of run `b` is bit-identical to run `a`'s; returns the tensors compared."""
    sa, sb = states(a), states(b)
    assert sa.keys() == sb.keys() and sa
    n = 0
    for rank in sa:
        assert sa[rank].keys() == sb[rank].keys()
        for name, entry in sa[rank].items():
            assert entry["range"] == sb[rank][name]["range"], (rank, name)
            for key, value in entry.items():
                if key != "range":
                    assert torch.equal(value, sb[rank][name][key]), (rank, name, key)
                    n += 1
    return n


def differs(a: Path, b: Path) -> bool:
    sa, sb = states(a), states(b)
    return any(not torch.equal(v, sb[r][n][k]) for r in sa for n, e in sa[r].items() for k, v in e.items()
               if k != "range")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same known optimizer state saved by both programs, at DP=2 (world 2) and at TP=2 x PP=2 (world 4)."""
    tmp = tmp_path_factory.mktemp("optim")
    out = {}
    for layout, (world, tp, pp) in {"dp2": (2, 1, 1), "tp2pp2": (4, 2, 2)}.items():
        for mode in ("ours", "megatron"):
            ckpt = tmp / f"ckpt_{layout}_{mode}"
            run_dir = run(tmp, world, tp, pp, mode, "save", ckpt, f"save_{layout}_{mode}")
            assert {r["in_place"] for r in results(run_dir)} == {mode == "ours"}
            out[layout, mode] = (ckpt, run_dir)
    return tmp, out


def test_both_saves_hold_the_state_the_ranks_had(saved):
    tmp, s = saved
    for layout in ("dp2", "tp2pp2"):
        assert assert_same(s[layout, "megatron"][1], s[layout, "ours"][1]) > 0
    # the in-place pieces of the DP=2 save: every element of every state tensor written once, read back exactly
    back = run(tmp, 2, 1, 1, "ours", "load", s["dp2", "ours"][0], "load_dp2_same_layout")
    assert assert_same(s["dp2", "ours"][1], back) > 0
    assert all(r["iteration"] == 1 and r["resharded"] is False for r in results(back))


@pytest.mark.parametrize("source, world, tp, pp, name", [
    ("dp2", 2, 2, 1, "tp2"),          # DP -> TP: SwiGLU's halves and the TP-split rows move between ranks
    ("tp2pp2", 4, 4, 1, "tp4"),       # TP2 x PP2 -> TP4: the vocabulary is padded to 512 instead of 256
    ("tp2pp2", 4, 1, 2, "pp2dp2"),    # -> PP2 x DP2: layers stay, the DP ranges are new
])
def test_a_resharded_load_gives_what_megatron_gives(saved, source, world, tp, pp, name):
    tmp, s = saved
    reference = run(tmp, world, tp, pp, "megatron", "load", s[source, "megatron"][0], f"{name}_megatron_megatron")
    fresh = run(tmp, world, tp, pp, "ours", "load", tmp / f"empty_{name}", f"{name}_fresh")
    assert differs(reference, fresh), "the load changed nothing: the comparison could not fail"
    for ckpt_from, loader in (("ours", "ours"), ("ours", "megatron"), ("megatron", "ours")):
        got = run(tmp, world, tp, pp, loader, "load", s[source, ckpt_from][0], f"{name}_{ckpt_from}_{loader}")
        assert assert_same(reference, got) > 0, (ckpt_from, loader)
        assert all(r["resharded"] for r in results(got))


def test_a_dp_reshardable_save_still_loads_and_refuses_another_layout(saved):
    tmp, s = saved
    ckpt = tmp / "ckpt_dp2_dp_reshardable"
    before = run(tmp, 2, 1, 1, "ours", "save", ckpt, "save_dp2_dp_reshardable", sharding="dp_reshardable")
    assert {r["sharding"] for r in results(before)} == {"dp_reshardable"}
    back = run(tmp, 2, 1, 1, "ours", "load", ckpt, "load_dp2_dp_reshardable")
    assert assert_same(before, back) > 0
    refused = run(tmp, 2, 2, 1, "ours", "load", ckpt, "load_tp2_dp_reshardable", expect_rc=1)
    assert "dp_reshardable optimizer" in (refused / "log.txt").read_text()
