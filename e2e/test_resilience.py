"""The operator against a control plane that goes away: an API server (and etcd) restart, and a
cluster without the JobSet CRD. Each test leaves the cluster as it found it and proves so (a job runs
end to end afterwards), so these tests may run in any order among the others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mjob import ROOT, run_for, small_job

pytestmark = pytest.mark.e2e
JOBSET_CRD = "jobsets.jobset.x-k8s.io"


def restart_api_server(cluster, down_s: float = 8) -> None:
    """Stop kube-apiserver (SIGTERM) for ``down_s`` seconds, then start it again with the same command
    line; kwokctl's pid file is updated so that `cluster.py down` still stops it."""
    pid_file = cluster.run_dir / "kwok" / "clusters" / "e2e" / "pids" / "kube-apiserver.pid"
    pid = int(pid_file.read_text().strip())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    os.kill(pid, signal.SIGTERM)

    def alive() -> bool:  # an exited process may linger as a zombie until PID 1 reaps it
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def wait_dead(timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not alive()

    # Like a kubelet: SIGTERM, then SIGKILL after a grace period (its graceful shutdown can outlast
    # open watches by a minute).
    if not wait_dead(20):
        os.kill(pid, signal.SIGKILL)
        assert wait_dead(20), "kube-apiserver did not stop"
    time.sleep(down_s)
    log = open(cluster.run_dir / "kwok" / "clusters" / "e2e" / "logs" / "kube-apiserver.log", "ab")
    proc = subprocess.Popen([a.decode() for a in argv], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    pid_file.write_text(str(proc.pid))
    cluster.wait_for(lambda: cluster.kubectl("get", "--raw=/readyz", check=False).returncode == 0, 120,
                     "the API server ready again")


def test_operator_survives_an_api_server_restart(cluster, operator, jobs):
    jobs.create(small_job("before", podMetadata=run_for(20)))
    jobs.wait_phase("before", "Running")
    restart_api_server(cluster)
    assert operator.proc.poll() is None, "the operator exited while the API server was down"
    # the job from before the restart is still followed to the end, and a new one is handled end to end
    jobs.create(small_job("after", podMetadata=run_for(3)))
    jobs.wait_phase("after", "Succeeded", timeout=180)
    jobs.wait_phase("before", "Succeeded", timeout=180)
    assert operator.healthy()


def test_operator_refuses_to_start_without_the_jobset_crd(cluster, operator, jobs, tmp_path):
    saved = json.loads(cluster.kubectl("get", "crd", JOBSET_CRD, "-o", "json").stdout)
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        saved["metadata"].pop(key, None)
    saved.pop("status", None)
    cluster.kubectl("delete", "crd", JOBSET_CRD, "--wait=true", timeout=120)
    try:
        cluster.wait_for(lambda: cluster.kubectl("get", "--raw=/apis/jobset.x-k8s.io/v1alpha2",
                                                 check=False).returncode != 0,
                         60, "jobset.x-k8s.io/v1alpha2 no longer served")
        # the running operator's JobSet watch ends with a 404: it exits with the reason (a
        # Deployment restarts it) instead of running on half-blind
        cluster.wait_for(lambda: operator.proc.poll() is not None, 90,
                         "the running operator to exit when the JobSet API goes away")
        assert operator.proc.returncode == 1
        assert "jobset.x-k8s.io" in operator.log_path.read_text().rsplit("===== operator start", 1)[-1]
        proc = subprocess.run([sys.executable, "-m", "megatron_operator", "run", "--kubeconfig",
                               str(cluster.kubeconfig), "--metrics-port", "0"],
                              env={**cluster.env(), "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}"},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        assert "missing the JobSet CRD (sigs.k8s.io/jobset)" in proc.stderr
        assert "install JobSet" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        f = tmp_path / "jobset-crd.json"
        f.write_text(json.dumps(saved))
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f), timeout=120)

        def served() -> bool:
            return cluster.kubectl("get", "--raw=/apis/jobset.x-k8s.io/v1alpha2", check=False).returncode == 0

        cluster.wait_for(served, 60, "the JobSet CRD served again")
    # the cluster is whole again: the operator, restarted as its Deployment would, and the JobSet
    # controller carry on
    operator.start()
    jobs.create(small_job("crd-back", podMetadata=run_for(2)))
    jobs.wait_phase("crd-back", "Succeeded", timeout=180)
    assert operator.healthy()
