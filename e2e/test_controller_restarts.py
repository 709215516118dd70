"""Controllers of the control plane restarted under running jobs: the JobSet controller killed in the
middle of a gang restart, and etcd restarted while jobs run. No job is lost or duplicated and each
ends correctly. Each component comes back with the same command line and ports, and the jobs that
follow prove it (so these tests may run in any order among the others)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from k8s import POD_FAIL_LABEL
from mjob import Jobs, run_for, small_job

pytestmark = pytest.mark.e2e


def _alive(pid: int) -> bool:  # an exited process may linger as a zombie until PID 1 reaps it
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_and_restart(cluster, pid: int, log_name: str, sig: int = signal.SIGKILL, down_s: float = 3) -> int:
    """Kill one component (by pid) and start it again with the same command line, working directory and
    ports; returns the new pid."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    cwd = os.readlink(f"/proc/{pid}/cwd")
    os.kill(pid, sig)
    cluster.wait_for(lambda: not _alive(pid), 30, f"pid {pid} ({log_name}) gone")
    time.sleep(down_s)  # the outage itself: the component is down for this long
    with open(cluster.run_dir / "logs" / f"{log_name}.log", "ab") as log:
        proc = subprocess.Popen([a.decode() for a in argv], cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc.pid


def restart_jobset_controller(cluster) -> None:
    state_file = cluster.run_dir / "cluster.json"
    state = json.loads(state_file.read_text())
    new_pid = kill_and_restart(cluster, state["jobset_pid"], "jobset")
    # `cluster.py down` and `status` find it by these
    state["jobset_pid"] = new_pid
    state_file.write_text(json.dumps(state, indent=2))
    (cluster.run_dir / "jobset" / "jobset.pid").write_text(str(new_pid))

    def ready() -> bool:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{state['jobset_health_port']}/readyz", timeout=2) as r:
            return r.status == 200

    cluster.wait_for(ready, 60, "the JobSet controller ready again")


def restart_etcd(cluster) -> None:
    pid_file = cluster.run_dir / "kwok" / "clusters" / "e2e" / "pids" / "etcd.pid"
    new_pid = kill_and_restart(cluster, int(pid_file.read_text().strip()), "etcd-restarted", signal.SIGTERM)
    pid_file.write_text(str(new_pid))
    cluster.wait_for(lambda: cluster.kubectl("get", "--raw=/readyz", check=False).returncode == 0, 120,
                     "the API server ready again (etcd back)")


def exactly_one_jobset_each(jobs: Jobs, names: list[str]) -> None:
    sets = jobs.jobsets()
    assert sorted(js["metadata"]["name"] for js in sets) == sorted(names)
    for js in sets:
        (ref,) = js["metadata"]["ownerReferences"]
        assert ref["kind"] == "MegatronJob" and ref["name"] == js["metadata"]["name"]


def test_jobset_controller_killed_in_the_middle_of_a_gang_restart(cluster, operator, jobs):
    jobs.create(small_job("mid-restart", podMetadata=run_for(20), restart={"maxRestarts": 1}))
    pods = cluster.wait_for(lambda: [p for p in jobs.pods("mid-restart") if p.status.phase == "Running"]
                            if len(jobs.pods("mid-restart")) == 2 else None, 60, "2 running pods", namespace=jobs.ns)
    jobs.core.patch_namespaced_pod(pods[0].metadata.name, jobs.ns, {"metadata": {"labels": {POD_FAIL_LABEL: "true"}}})
    # kill the controller as soon as the failure is there (the gang restart is JobSet's to do)
    cluster.wait_for(lambda: any(p.status.phase == "Failed" for p in jobs.pods("mid-restart")), 30,
                     "the pod failed", namespace=jobs.ns)
    restart_jobset_controller(cluster)
    done = jobs.wait_phase("mid-restart", "Succeeded", timeout=180)
    # one restart, counted once: a duplicated restart would have exhausted maxRestarts=1
    assert done["restarts"] == 1, done
    js = jobs.jobset("mid-restart")
    assert js["status"]["restarts"] == 1 and js["status"].get("restartsCountTowardsMax") == 1
    attempts = {p.metadata.labels.get("jobset.sigs.k8s.io/restart-attempt") for p in jobs.pods("mid-restart")
                if p.status.phase == "Succeeded"}
    assert attempts == {"1"}, attempts
    exactly_one_jobset_each(jobs, ["mid-restart"])


def test_etcd_restarted_while_jobs_run(cluster, operator, jobs):
    names = ["etcd-a", "etcd-b"]
    for name in names:
        jobs.create(small_job(name, podMetadata=run_for(20)))
    for name in names:
        jobs.wait_phase(name, "Running")
    restart_etcd(cluster)
    for name in names:
        done = jobs.wait_phase(name, "Succeeded", timeout=180)
        assert done["restarts"] == 0, done
    exactly_one_jobset_each(jobs, names)
    # no extra pods either: one gang of 2 per job
    for name in names:
        assert len([p for p in jobs.pods(name) if p.status.phase == "Succeeded"]) == 2
