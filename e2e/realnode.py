"""Helpers for the e2e tests that run pods on the real node (e2e/cluster/node.py): bring it up for a test module,
load an image into its containerd, give it statically provisioned local PersistentVolumes, find a container's
host process, read a pod's container log from the CRI log files.

The real node needs root (containerd, runc, mounts, a bridge); node.py installs its Debian packages when they are
missing, and `build.sh kubelet coredns` builds what it runs on first use.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e" / "cluster"))
import node as real_node  # noqa: E402

BUILD_TIMEOUT_S = 1800


@contextlib.contextmanager
def node_up() -> Iterator[dict[str, Any]]:
    """The real node for a test module: built if needed, a node left by an interrupted run removed, then up;
    down afterwards. Fails the module (never skips) when it cannot come up."""
    if os.geteuid() != 0:
        pytest.fail("the real node needs root (containerd, runc, mounts, a bridge)", pytrace=False)
    proc = subprocess.run(["bash", str(ROOT / "e2e" / "cluster" / "build.sh"), "kubelet", "coredns"],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"build.sh kubelet coredns failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    real_node.down()
    try:
        state = real_node.up()
    except real_node.cluster.ClusterError as e:
        real_node.down()
        pytest.fail(f"the real node did not come up:\n{e}", pytrace=False)
    try:
        yield state
    finally:
        real_node.down()


def local_volume(core, name: str, root: Path, storage_class: str, node_name: str, owner: int | None = 1000,
                 size: str = "1Gi", claim: tuple[str, str] | None = None) -> str:
    """A `local` PersistentVolume on `root` of the real node, as an admin provisions one statically. `claim`
    (namespace, name) reserves it for that claim (claimRef), as an admin does for a volume that already holds the
    claim's data: without it, two alike volumes bind to two claims in either order. The claim stays unbound until
    the job's pod is placed (WaitForFirstConsumer): the scheduler's VolumeBinding and the PV controller bind it."""
    root.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chown(root, owner, owner)
    root.chmod(0o755)
    reserved = {"claimRef": {"namespace": claim[0], "name": claim[1]}} if claim else {}
    core.create_persistent_volume({"metadata": {"name": name}, "spec": {**reserved,
        "capacity": {"storage": size}, "accessModes": ["ReadWriteMany"], "storageClassName": storage_class,
        "persistentVolumeReclaimPolicy": "Retain", "local": {"path": str(root)},
        "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [node_name]}]}]}}}})
    return name


def local_storage_class(storage, name: str) -> str:
    """A StorageClass for statically provisioned local volumes (no provisioner; bound when a pod is placed)."""
    storage.create_storage_class({"metadata": {"name": name}, "provisioner": "kubernetes.io/no-provisioner",
                                  "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Retain"})
    return name


def claim(core, namespace: str, name: str, storage_class: str, size: str = "1Gi") -> None:
    core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": name}, "spec": {
        "accessModes": ["ReadWriteMany"], "storageClassName": storage_class,
        "resources": {"requests": {"storage": size}}}})


def container_pid(pod) -> int:
    """The host pid of the pod's first container's main process (its PID 1), from containerd's task list."""
    cid = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    out = real_node.ctr("tasks", "list").stdout.decode().splitlines()
    for line in out[1:]:
        fields = line.split()
        if fields and fields[0] == cid:
            return int(fields[1])
    raise AssertionError(f"container {cid} of pod {pod.metadata.name} not in containerd's tasks:\n" + "\n".join(out))


def pod_log(namespace: str, pod: str, container: str = "trainer") -> str:
    """Every attempt's CRI log of a container (the API server cannot reach this kubelet's log endpoint by name)."""
    files = sorted((real_node.node_dir() / "pod-logs").glob(f"{namespace}_{pod}_*/{container}/*.log"))
    return "".join(f.read_text(errors="replace") for f in files)


def all_pod_logs(namespace: str) -> str:
    files = sorted((real_node.node_dir() / "pod-logs").glob(f"{namespace}_*/*/*.log"))
    return "".join(f"===== {f.relative_to(real_node.node_dir())}\n{f.read_text(errors='replace')}" for f in files)


class LogKeeper:
    """Every container log of a namespace's pods, kept after the pods are gone: the kubelet deletes a pod's CRI log
    files with the pod (a gang restart deletes them all), so each read adds what the files hold now to what was
    read before."""

    def __init__(self, namespace: str):
        self.namespace = namespace
        self.seen: dict[str, str] = {}

    def read(self) -> str:
        for f in sorted((real_node.node_dir() / "pod-logs").glob(f"{self.namespace}_*/*/*.log")):
            text = f.read_text(errors="replace")
            key = str(f.relative_to(real_node.node_dir()))
            if len(text) >= len(self.seen.get(key, "")):
                self.seen[key] = text
        return "".join(f"===== {k}\n{v}" for k, v in self.seen.items())


def image_in_podman(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], capture_output=True, check=False).returncode == 0


def dns_state() -> dict[str, Any]:
    return json.loads((real_node.node_dir() / "node.json").read_text()).get("dns", {})
