"""The pod launcher (`python -m megatron_trainer.launch`): command line, worker environment, and the
signal, timeout and exit-code rules - first against fake processes and a fake clock, then with real
processes (SIGTERM forwarded to every worker, SIGKILL at the end of the grace period, no orphans)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from megatron_trainer import launch as L

TRAINER_IMAGE = Path(L.__file__).resolve().parents[1]


def cfg(nproc=2, nnodes=1, node_rank=0, grace=30.0):
    return L.LaunchConfig(nnodes, nproc, node_rank, "m.example", 29500, grace, "megatron_trainer", ["--x"])


# ---- command line -----------------------------------------------------------------------------------

def test_parse_rendered_command_line():
    c = L.parse_launch_args(["--nnodes=2", "--nproc-per-node=8", "--node-rank=1", "--master-addr=j-worker-0-0.j",
                             "--master-port=29500", "--grace-period-s=590", "-m", "megatron_trainer",
                             "--tensor-model-parallel-size", "2", "-m", "not-a-launcher-flag"])
    assert (c.nnodes, c.nproc_per_node, c.node_rank, c.master_addr, c.master_port) == (2, 8, 1, "j-worker-0-0.j",
                                                                                       29500)
    assert c.grace_period_s == 590.0 and c.module == "megatron_trainer"
    assert c.args == ["--tensor-model-parallel-size", "2", "-m", "not-a-launcher-flag"]  # untouched
    assert c.world_size == 16


@pytest.mark.parametrize("argv, message", [
    (["--nnodes=2"], "missing '-m MODULE'"),
    (["--nnodes=2", "-m"], "'-m' needs a module name"),
    (["--nnodes=2", "--node-rank=2", "-m", "x"], "--node-rank=2 must be < --nnodes=2"),
])
def test_bad_command_lines_are_launch_errors(argv, message):
    with pytest.raises(L.LaunchError, match=message):
        L.parse_launch_args(argv)


@pytest.mark.parametrize("flag, message", [
    ("--nproc-per-node=0", "--nproc-per-node must be >= 1, got 0"),
    ("--node-rank=$(NODE_RANK)", "--node-rank must be an integer, got '$(NODE_RANK)'"),
    ("--grace-period-s=0", "--grace-period-s must be > 0"),
    ("--grace-period-s=soon", "--grace-period-s must be a number"),
    ("--max-restarts=0", "unrecognized arguments: --max-restarts=0"),
])
def test_bad_values_exit_2_with_a_message(flag, message, capsys):
    with pytest.raises(SystemExit) as e:
        L.parse_launch_args([flag, "-m", "megatron_trainer"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_main_reports_launch_errors_without_traceback(capsys):
    assert L.main(["--nnodes=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron_trainer.launch: error: missing '-m MODULE'") and "Traceback" not in err


def test_worker_env_static_rendezvous():
    c = cfg(nproc=4, nnodes=3, node_rank=2, grace=590)
    env = L.worker_env(c, 3, {"PATH": "/bin", "OMP_NUM_THREADS": "8"})
    assert env["RANK"] == "11" and env["LOCAL_RANK"] == "3" and env["WORLD_SIZE"] == "12"  # node-major, as torchrun
    assert env["LOCAL_WORLD_SIZE"] == "4" and env["GROUP_RANK"] == env["NODE_RANK"] == "2"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("m.example", "29500")
    assert float(env[L.GRACE_ENV]) == 590.0
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "8"  # inherited; a user's setting wins
    assert L.worker_env(cfg(nproc=2), 0, {})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in L.worker_env(cfg(nproc=1), 0, {})


@pytest.mark.parametrize("rc, code", [(0, 0), (1, 1), (2, 2), (-9, 137), (-15, 143), (-6, 134)])
def test_exit_code_of_a_signalled_worker(rc, code):
    assert L.exit_code(rc) == code


# ---- rules, against fake processes and a fake clock -----------------------------------------------------

class FakeProc:
    def __init__(self, pid):
        self.pid, self.rc = pid, None

    def poll(self):
        return self.rc

    def wait(self, timeout=None):
        return self.rc if self.rc is not None else 0


class Harness:
    def __init__(self, nproc=3, grace=30.0):
        self.now = 100.0
        self.signals: list[tuple[int, int]] = []
        self.procs: list[FakeProc] = []
        self.logs: list[str] = []
        self.envs: list[dict] = []
        self.launcher = L.Launcher(cfg(nproc=nproc, grace=grace), spawn=self.spawn, killpg=self.killpg,
                                   clock=lambda: self.now, log=self.logs.append, base_env={})
        self.launcher.start()

    def spawn(self, local_rank, env):
        self.envs.append(env)
        self.procs.append(FakeProc(1000 + local_rank))
        return self.procs[-1]

    def killpg(self, pgid, sig):
        self.signals.append((pgid, sig))

    def sent(self, sig):
        return sorted(p for p, s in self.signals if s == sig)


def test_every_worker_started_with_its_rank():
    h = Harness(nproc=3)
    assert [e["LOCAL_RANK"] for e in h.envs] == ["0", "1", "2"]
    assert h.launcher.step() is True and h.signals == []


def test_all_exit_0_launcher_exits_0_and_reaps_each_group():
    h = Harness(nproc=2)
    for p in h.procs:
        p.rc = 0
    assert h.launcher.step() is False
    assert h.launcher.result() == 0
    assert h.sent(signal.SIGKILL) == [1000, 1001]  # leftovers in each worker's group
    assert h.sent(signal.SIGTERM) == []


def test_sigterm_is_forwarded_once_to_every_worker_group_and_waits_for_the_grace_period():
    h = Harness(nproc=3, grace=30)
    h.launcher.request_stop(signal.SIGTERM)
    h.launcher.request_stop(signal.SIGTERM)  # a second SIGTERM changes nothing
    assert h.sent(signal.SIGTERM) == [1000, 1001, 1002]
    h.now += 29.9
    assert h.launcher.step() is True and h.sent(signal.SIGKILL) == []  # still inside the grace period
    for p in h.procs:  # the workers checkpoint and exit 0 in time
        p.rc = 0
    assert h.launcher.step() is False and h.launcher.result() == 0


def test_workers_still_running_at_the_end_of_the_grace_period_are_killed_and_the_launcher_exits_137():
    h = Harness(nproc=2, grace=30)
    h.launcher.request_stop(signal.SIGINT)
    h.procs[0].rc = 0
    h.launcher.step()
    h.now += 30.0
    h.launcher.step()
    assert (1001, signal.SIGKILL) in h.signals
    h.procs[1].rc = -signal.SIGKILL
    assert h.launcher.step() is False
    assert h.launcher.result() == L.KILLED_AT_DEADLINE == 137
    assert any("grace period over" in m for m in h.logs)


def test_first_failed_worker_code_wins_and_the_others_are_stopped():
    h = Harness(nproc=3)
    h.procs[1].rc = 3
    h.launcher.step()
    assert h.launcher.first_failure == (1, 3)
    assert h.sent(signal.SIGTERM) == [1000, 1002]  # the others, told to stop
    h.procs[2].rc = 1  # fails later (e.g. an NCCL error): not the first failure
    h.now += L.FAILURE_GRACE_S - 0.1
    h.launcher.step()
    assert h.sent(signal.SIGKILL) == [1001, 1002]  # only the exited workers' groups so far
    h.now += 0.2
    h.launcher.step()
    assert (1000, signal.SIGKILL) in h.signals  # worker 0 hung in NCCL: killed after FAILURE_GRACE_S
    h.procs[0].rc = -signal.SIGKILL
    assert h.launcher.step() is False
    assert h.launcher.result() == 3


def test_a_failure_during_shutdown_keeps_the_earlier_deadline_and_its_code():
    h = Harness(nproc=2, grace=600)
    h.launcher.request_stop()
    h.now += 1
    h.procs[0].rc = -signal.SIGSEGV
    h.launcher.step()
    assert h.launcher.kill_at == pytest.approx(h.now + L.FAILURE_GRACE_S)  # no 600 s wait on a broken gang
    assert h.launcher.result() == 128 + signal.SIGSEGV


# ---- real processes -------------------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    mode, out = sys.argv[1], sys.argv[2]
    rank = os.environ["RANK"]
    # a helper in the worker's process group that ignores SIGTERM, like the async checkpoint writer
    helper = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(os.path.join(out, f"pids.{rank}"), "w") as f:
        f.write(f"{os.getpid()} {helper.pid} {os.environ['MEGATRON_SHUTDOWN_GRACE_S']}")
    def on_term(signum, frame):
        open(os.path.join(out, f"sigterm.{rank}"), "w").close()
        if mode in ("save", "fail"):
            time.sleep(0.5)  # a short 'final checkpoint'
            sys.exit(0)
        # mode 'hang': ignore it, like a save that takes longer than the grace period
    signal.signal(signal.SIGTERM, on_term)
    if mode == "fail" and rank == "1":
        time.sleep(0.3)
        sys.exit(7)
    while True:
        time.sleep(0.05)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not a running process
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _start(tmp_path, mode, nproc=2, grace=5.0):
    (tmp_path / "fake_worker.py").write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(TRAINER_IMAGE)]))
    proc = subprocess.Popen([sys.executable, "-m", "megatron_trainer.launch", f"--nproc-per-node={nproc}",
                             "--master-port=29999", f"--grace-period-s={grace}", "-m", "fake_worker", mode,
                             str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("pids.*"))) < nproc:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.05)
    pids = [tuple(f.read_text().split()) for f in sorted(tmp_path.glob("pids.*"))]
    return proc, pids


def _finish(proc, timeout=30):
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return rc, proc.stderr.read()


@pytest.mark.parametrize("mode, expect_rc", [("save", 0), ("hang", 137)])
def test_real_sigterm_forwarded_grace_honoured_no_orphans(tmp_path, mode, expect_rc):
    proc, pids = _start(tmp_path, mode, grace=2.0)
    assert all(float(g) == 2.0 for _, _, g in pids)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc, err = _finish(proc)
    waited = time.monotonic() - t0
    assert rc == expect_rc, err
    assert sorted(p.name for p in tmp_path.glob("sigterm.*")) == ["sigterm.0", "sigterm.1"]  # every worker
    if mode == "hang":
        assert 2.0 <= waited < 8, waited  # SIGKILL at the end of the grace period, not before
        assert "grace period over" in err
    for worker, helper, _ in pids:
        assert not _alive(int(worker)) and not _alive(int(helper)), (worker, helper)


def test_real_first_failure_exit_code_and_no_orphans(tmp_path):
    proc, pids = _start(tmp_path, "fail", grace=60.0)
    rc, err = _finish(proc)
    assert rc == 7, err
    assert "worker rank 1 failed with exit code 7" in err
    for worker, helper, _ in pids:
        assert not _alive(int(worker)) and not _alive(int(helper))


# --- the rendezvous host: resolved, bounded, before any worker starts -------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_rendezvous_timeout_is_the_trainers_distributed_timeout():
    from megatron_trainer.launch import DEFAULT_RENDEZVOUS_TIMEOUT_S, rendezvous_timeout_s

    assert rendezvous_timeout_s(["--num-layers", "2"]) == DEFAULT_RENDEZVOUS_TIMEOUT_S == 600
    assert rendezvous_timeout_s(["--distributed-timeout-minutes", "2"]) == 120
    assert rendezvous_timeout_s(["--distributed-timeout-minutes=3"]) == 180
    assert rendezvous_timeout_s(["--distributed-timeout-minutes", "x"]) == 600  # the trainer refuses it (exit 2)


def test_wait_for_host_returns_once_the_name_resolves():
    from megatron_trainer.launch import wait_for_host

    clock, tries = FakeClock(), []

    def resolve(host):
        tries.append(host)
        if len(tries) < 4:
            raise socket.gaierror(-2, "Name or service not known")

    assert wait_for_host("job-w-0-0.job", 600, resolve, clock, clock.sleep) is None
    assert tries == ["job-w-0-0.job"] * 4 and clock.t < 5


def test_wait_for_host_gives_up_at_the_timeout_saying_why_and_logs_while_waiting():
    from megatron_trainer.launch import wait_for_host

    clock, lines = FakeClock(), []

    def resolve(host):
        raise socket.gaierror(-2, "Name or service not known")

    why = wait_for_host("job-w-0-0.job", 120, resolve, clock, clock.sleep, log=lines.append)
    assert why.startswith("the rendezvous host job-w-0-0.job did not resolve within 120 s ([Errno -2] Name or "
                          "service not known)") and "headless Service" in why
    assert 120 <= clock.t < 125
    assert 3 <= len(lines) <= 4 and all("waiting for the rendezvous host job-w-0-0.job" in x for x in lines)


def test_wait_for_host_stops_on_sigterm():
    from megatron_trainer.launch import wait_for_host

    clock = FakeClock()

    def resolve(host):
        raise socket.gaierror(-2, "Name or service not known")

    assert wait_for_host("h", 600, resolve, clock, clock.sleep, stopped=lambda: clock.t > 10) is None
    assert clock.t < 15


def test_an_unresolvable_master_exits_1_with_the_reason_as_termination_message(tmp_path):
    """The launcher's main(): a master in the reserved .invalid domain (RFC 6761: it never resolves) and a short
    timeout: exit 1, the reason in the termination message, no worker started."""
    code = textwrap.dedent("""
        import functools, sys
        import megatron_trainer.exitcodes as E
        import megatron_trainer.launch as L
        L.rendezvous_timeout_s = lambda args: 1.5
        E.write_termination_message = functools.partial(E.write_termination_message, path=sys.argv[1])
        sys.exit(L.main(["--master-addr=no-such-pod.invalid", "-m", "json.tool"]))
    """)
    term = tmp_path / "termination-log"
    proc = subprocess.run([sys.executable, "-c", code, str(term)], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(TRAINER_IMAGE), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr
    assert "exit 1 (retried): the rendezvous host no-such-pod.invalid did not resolve within 1.5 s" in term.read_text()
    assert "worker(s)" not in proc.stderr, proc.stderr  # no worker was started ("started N worker(s): ...")
