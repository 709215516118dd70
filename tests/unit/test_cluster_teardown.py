"""e2e/cluster/cluster.py's `down` on a run dir that an interrupted run left behind.

A CI run failed because the run before it was killed while the real node (e2e/cluster/node.py) was up:
containerd's overlay snapshots and the kubelet's volumes stayed mounted under the run dir, and `up`
(which cleans a stale run dir first) stopped with EBUSY, failing all 355 cluster tests. These tests
make that state with real mounts and processes (root only) and check `down` clears it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_cluster():
    spec = importlib.util.spec_from_file_location("cluster_under_test", ROOT / "e2e" / "cluster" / "cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


cluster = load_cluster()


def mount_tmpfs(point: Path) -> None:
    point.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {proc.stderr.strip()}")


def wait_for_exec(pid: int, argv0: str, timeout_s: float = 10) -> None:
    """Wait until the child has exec'd: between fork and exec its command line is still pytest's."""
    deadline = time.monotonic() + timeout_s
    while cluster.argv(pid)[:1] != [argv0]:
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} never exec'd {argv0}: {cluster.argv(pid)!r}")
        time.sleep(0.01)


@pytest.fixture
def run_root(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounts need root")
    root = tmp_path / "run dir"  # a space: mountinfo escapes it as \040
    root.mkdir()
    yield root
    for point in cluster.mounts_under(tmp_path):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def test_mounts_under_lists_nested_mounts_deepest_first_and_not_the_root_itself(run_root: Path) -> None:
    outer = run_root / "node" / "containerd" / "state" / "task 1" / "rootfs"
    inner = outer / "dev" / "shm"
    mount_tmpfs(outer)
    mount_tmpfs(inner)
    beside = run_root.parent / (run_root.name + "-other")  # shares the prefix, is not below the run dir
    mount_tmpfs(beside)
    found = cluster.mounts_under(run_root)
    assert found == [str(inner), str(outer)]
    assert cluster.mounts_under(outer) == [str(inner)]


def test_down_clears_a_run_dir_left_mounted_by_a_killed_real_node(run_root: Path) -> None:
    p = cluster.RunPaths(run_root)
    node = run_root / "node"
    rootfs = node / "containerd" / "state" / "io.containerd.runtime.v2.task" / "k8s.io" / "abc" / "rootfs"
    volume = node / "kubelet" / "root" / "pods" / "uid" / "volumes" / "kube-api-access"
    mount_tmpfs(rootfs)
    (rootfs / "file").write_text("x")
    mount_tmpfs(volume)
    # a stale containerd, still running, and a pid that was reused by something else since
    stale = subprocess.Popen(["bash", "-c", "exec -a containerd sleep 600"], start_new_session=True)
    unrelated = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        # A red CI run read the command line before the exec (still pytest's) and rightly left the pid alone.
        wait_for_exec(stale.pid, "containerd")
        wait_for_exec(unrelated.pid, "sleep")
        (node / "node.json").write_text(json.dumps(
            {"node": "real-node-0", "containerd_pid": stale.pid, "kubelet_pid": unrelated.pid}))
        p.logs.mkdir(parents=True)
        (p.logs / "kubelet.log").write_text("kept for post-mortems")

        cluster.down(p)

        assert cluster.mounts_under(run_root) == []
        assert sorted(c.name for c in run_root.iterdir()) == ["logs"], "down removes everything but logs/"
        assert (p.logs / "kubelet.log").read_text() == "kept for post-mortems"
        deadline = time.monotonic() + 10
        while stale.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stale.poll() is not None, "the stale containerd was left running"
        assert unrelated.poll() is None, "a pid whose command line is not the node's was stopped"
    finally:
        for proc in (stale, unrelated):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
