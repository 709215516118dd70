"""`python -m megatron_trainer.launch`: the pod's launcher, one worker process per GPU.

    python -m megatron_trainer.launch --nnodes=2 --nproc-per-node=8 --node-rank=$(NODE_RANK)
        --master-addr=<pod 0's DNS name> --master-port=29500 --grace-period-s=590
        -m megatron_trainer <Megatron-LM flags...>

It replaces torchrun in the rendered command for one reason: torchrun (torch 2.11) SIGKILLs its
workers 30 s after forwarding SIGTERM, whatever the pod's terminationGracePeriodSeconds says, so a
checkpoint that takes longer never completes. This launcher:

- sets the static-rendezvous environment of each worker (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; rank = node rank x nproc + local rank,
  as torchrun numbers them) and starts one worker per GPU, each in its own process group;
- on SIGTERM or SIGINT forwards SIGTERM to every worker's process group (as torchrun does: the
  trainer's helper processes ignore it) and waits up to ``--grace-period-s`` for them to exit, then
  SIGKILLs what is left; the workers read the budget from MEGATRON_SHUTDOWN_GRACE_S;
- when a worker fails, stops the others (SIGTERM, then SIGKILL after a few seconds: a gang with a
  dead rank only hangs in NCCL) and exits with the first failed worker's code (128 + N for a
  worker killed by signal N);
- leaves no orphans: each worker's whole process group is SIGKILLed before the launcher exits, and
  each worker gets SIGKILL from the kernel should the launcher itself die (PR_SET_PDEATHSIG);
- waits, bounded, for the rendezvous host to resolve before it starts any worker: pod 0's name in the
  JobSet's headless Service exists once that pod has an address, which can be minutes after this pod
  started (an image pull, a slow node). It waits as long as torch.distributed would (the trainer's
  --distributed-timeout-minutes, else 10 minutes), saying so every 30 s, and then exits 1 (retried: DNS
  trouble can pass) with the reason as the pod's termination message, instead of each worker failing
  with a generic rendezvous error at its own time.

No torch import: it starts in well under a second and its logic is tested on CPUs
(tests/trainer/test_launch.py).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

PROG = "megatron_trainer.launch"
#: Seconds the other workers get to exit after one failed, before SIGKILL.
FAILURE_GRACE_S = 5.0
#: Environment variable that tells the workers their shutdown budget (seconds from SIGTERM to SIGKILL).
GRACE_ENV = "MEGATRON_SHUTDOWN_GRACE_S"
#: Exit code when workers had to be SIGKILLed at the end of the grace period (128 + SIGKILL).
KILLED_AT_DEADLINE = 128 + signal.SIGKILL
POLL_S = 0.1
#: torch.distributed's default timeout for the world group (init_process_group), and so for the rendezvous.
DEFAULT_RENDEZVOUS_TIMEOUT_S = 600.0
#: Seconds between "still waiting" lines while the rendezvous host does not resolve.
RESOLVE_LOG_EVERY_S = 30.0
#: Exit code when the rendezvous host never resolved (ERROR: retried, as a lost peer is).
UNRESOLVED_EXIT = 1


@dataclass(frozen=True)
class LaunchConfig:
    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    grace_period_s: float
    module: str
    args: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class LaunchError(ValueError):
    """A bad launcher command line (exit code 2, a message and no traceback)."""


def _positive(name: str, minimum: int = 1):
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {raw!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value
    return parse


def _grace(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grace-period-s must be a number, got {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--grace-period-s must be > 0, got {raw}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}", allow_abbrev=False,
        usage=f"python -m {PROG} [launcher options] -m MODULE [worker args...]",
        description="Start one worker per GPU with a static rendezvous; forward SIGTERM and wait up to the "
                    "grace period (docs/trainer-contract.md).")
    p.add_argument("--nnodes", type=_positive("--nnodes"), default=1)
    p.add_argument("--nproc-per-node", type=_positive("--nproc-per-node"), default=1)
    p.add_argument("--node-rank", type=_positive("--node-rank", 0), default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=_positive("--master-port"), default=29500)
    p.add_argument("--grace-period-s", type=_grace, default=30.0,
                   help="seconds between the forwarded SIGTERM and SIGKILL (default 30, torchrun's)")
    return p


def parse_launch_args(argv: Sequence[str]) -> LaunchConfig:
    """Launcher options, then ``-m MODULE``, then the worker's own arguments (passed on untouched).

    Raises LaunchError (the message says what is wrong) or SystemExit from argparse (exit 2)."""
    argv = list(argv)
    if "-m" not in argv:
        raise LaunchError("missing '-m MODULE' (e.g. -m megatron_trainer) after the launcher options")
    i = argv.index("-m")
    if i + 1 >= len(argv):
        raise LaunchError("'-m' needs a module name")
    ns = _parser().parse_args(argv[:i])
    if ns.node_rank >= ns.nnodes:
        raise LaunchError(f"--node-rank={ns.node_rank} must be < --nnodes={ns.nnodes}")
    return LaunchConfig(ns.nnodes, ns.nproc_per_node, ns.node_rank, ns.master_addr, ns.master_port,
                        ns.grace_period_s, argv[i + 1], argv[i + 2:])


def rendezvous_timeout_s(worker_args: Sequence[str]) -> float:
    """How long the workers' rendezvous may take: the trainer's --distributed-timeout-minutes, else torch's
    default. A malformed value is the trainer's to refuse (exit 2 at its start): the default here."""
    args = list(worker_args)
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--distributed-timeout-minutes=") else \
            args[i + 1] if arg == "--distributed-timeout-minutes" and i + 1 < len(args) else None
        if value is not None:
            try:
                minutes = float(value)
            except ValueError:
                return DEFAULT_RENDEZVOUS_TIMEOUT_S
            return minutes * 60 if minutes > 0 else DEFAULT_RENDEZVOUS_TIMEOUT_S
    return DEFAULT_RENDEZVOUS_TIMEOUT_S


def wait_for_host(host: str, timeout_s: float, resolve: Callable[[str], object] | None = None,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                  log: Callable[[str], None] = lambda msg: None, stopped: Callable[[], bool] = lambda: False
                  ) -> str | None:
    """Wait until `host` resolves; None when it did (or the wait was stopped), else why it never did."""
    resolve = resolve or (lambda h: socket.getaddrinfo(h, None))
    start = clock()
    last_log = start
    delay = 0.2
    while True:
        try:
            resolve(host)
            return None
        except OSError as e:
            error = e
        now = clock()
        if stopped():
            return None
        if now - start >= timeout_s:
            return (f"the rendezvous host {host} did not resolve within {timeout_s:g} s ({error}): the job's pod 0 "
                    "has no address in the JobSet's headless Service yet (not started, or stuck), or the cluster's "
                    "DNS does not answer for it")
        if now - last_log >= RESOLVE_LOG_EVERY_S:
            log(f"waiting for the rendezvous host {host} to resolve ({now - start:.0f} s of {timeout_s:g}): {error}")
            last_log = now
        sleep(min(delay, max(0.0, timeout_s - (now - start))))
        delay = min(delay * 2, 2.0)


def worker_env(cfg: LaunchConfig, local_rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """The static-rendezvous environment of one worker (torchrun's variable names and rank order)."""
    env = dict(base)
    env.update({
        "RANK": str(cfg.node_rank * cfg.nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "GROUP_RANK": str(cfg.node_rank),
        "NODE_RANK": str(cfg.node_rank),
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(cfg.master_port),
        GRACE_ENV: repr(cfg.grace_period_s),
    })
    if cfg.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several workers per node
    return env


def exit_code(returncode: int) -> int:
    """A worker's return code as a shell would report it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs the worker if the launcher dies (Linux); no-op elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Launcher:
    """Runs the workers and applies the signal, timeout and exit-code rules.

    `spawn(local_rank, env)` returns a started process with `pid`, `poll()` and `wait()` (a
    subprocess.Popen in production); `killpg` and `clock` are injectable for tests."""

    def __init__(self, cfg: LaunchConfig, spawn: Callable[[int, dict[str, str]], subprocess.Popen] | None = None,
                 killpg: Callable[[int, int], None] = os.killpg, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None, base_env: Mapping[str, str] | None = None):
        self.cfg = cfg
        self._spawn = spawn or self._popen
        self._killpg = killpg
        self._clock = clock
        self._log = log or (lambda msg: print(f"{PROG}: {msg}", file=sys.stderr, flush=True))
        self._base_env = os.environ if base_env is None else base_env
        self.procs: list = []
        self.returncodes: dict[int, int] = {}
        self.first_failure: tuple[int, int] | None = None  # (local rank, exit code)
        self.stop_requested_at: float | None = None
        self.kill_at: float | None = None
        self.killed_at_deadline = False
        self._signalled: set[int] = set()

    # -------------------------------------------------------------------- processes
    def _popen(self, local_rank: int, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", self.cfg.module, *self.cfg.args], env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)

    def start(self) -> None:
        for local_rank in range(self.cfg.nproc_per_node):
            self.procs.append(self._spawn(local_rank, worker_env(self.cfg, local_rank, self._base_env)))
        self._log(f"started {len(self.procs)} worker(s): ranks "
                  f"{self.cfg.node_rank * self.cfg.nproc_per_node}..{(self.cfg.node_rank + 1) * self.cfg.nproc_per_node - 1}"
                  f" of {self.cfg.world_size}, master {self.cfg.master_addr}:{self.cfg.master_port}, "
                  f"grace period {self.cfg.grace_period_s:g} s")

    def _signal_group(self, local_rank: int, sig: int) -> None:
        try:
            self._killpg(self.procs[local_rank].pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone

    def alive(self) -> list[int]:
        return [i for i in range(len(self.procs)) if i not in self.returncodes]

    # -------------------------------------------------------------------- events
    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """SIGTERM/SIGINT to the launcher: SIGTERM every worker's group once, SIGKILL after the grace period."""
        if self.stop_requested_at is not None:
            return
        now = self._clock()
        self.stop_requested_at = now
        if self.kill_at is None or now + self.cfg.grace_period_s < self.kill_at:
            self.kill_at = now + self.cfg.grace_period_s
        self._log(f"{signal.Signals(signum).name} received: forwarding SIGTERM to {len(self.alive())} worker(s), "
                  f"SIGKILL in {self.cfg.grace_period_s:g} s if they have not exited")
        self._terminate_alive()

    def _terminate_alive(self) -> None:
        for i in self.alive():
            if i not in self._signalled:
                self._signalled.add(i)
                self._signal_group(i, signal.SIGTERM)

    def _on_exit(self, local_rank: int, returncode: int) -> None:
        self.returncodes[local_rank] = returncode
        code = exit_code(returncode)
        rank = self.cfg.node_rank * self.cfg.nproc_per_node + local_rank
        # Its group may still hold helpers (async writer, data-loader workers): end them now.
        self._signal_group(local_rank, signal.SIGKILL)
        if code != 0 and self.first_failure is None and not self.killed_at_deadline:
            self.first_failure = (local_rank, code)
            self._log(f"worker rank {rank} failed with exit code {code}: stopping the other workers")
            deadline = self._clock() + FAILURE_GRACE_S
            self.kill_at = deadline if self.kill_at is None else min(self.kill_at, deadline)
            self._terminate_alive()
        elif code != 0:
            self._log(f"worker rank {rank} exited with code {code}")

    def step(self) -> bool:
        """One poll: collect exits, enforce the deadline. True while any worker is alive."""
        for i in self.alive():
            rc = self.procs[i].poll()
            if rc is not None:
                self._on_exit(i, rc)
        alive = self.alive()
        if alive and self.kill_at is not None and self._clock() >= self.kill_at and not self.killed_at_deadline:
            self.killed_at_deadline = True
            self._log(f"grace period over: SIGKILL to {len(alive)} worker(s) still running")
            for i in alive:
                self._signal_group(i, signal.SIGKILL)
        return bool(alive)

    def result(self) -> int:
        """The launcher's exit code: the first failed worker's, else 137 if the deadline killed any, else 0."""
        if self.first_failure is not None:
            return self.first_failure[1]
        if self.killed_at_deadline:
            return KILLED_AT_DEADLINE
        return 0

    def run(self, sleep: Callable[[float], None] = time.sleep) -> int:
        self.start()
        try:
            while self.step():
                sleep(POLL_S)
        finally:
            for i in range(len(self.procs)):  # no orphans, whatever happened
                self._signal_group(i, signal.SIGKILL)
            for i in self.alive():
                try:
                    self.returncodes[i] = self.procs[i].wait(10)
                except subprocess.TimeoutExpired:
                    self._log(f"worker local rank {i} (pid {self.procs[i].pid}) did not exit after SIGKILL")
        code = self.result()
        self._log(f"exit {code}")
        return code


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_launch_args(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    launcher = Launcher(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: launcher.request_stop(signum))
    log = launcher._log
    unresolved = wait_for_host(cfg.master_addr, rendezvous_timeout_s(cfg.args), log=log,
                               stopped=lambda: launcher.stop_requested_at is not None)
    if launcher.stop_requested_at is not None:
        log(f"exit {128 + signal.SIGTERM} (stopped before any worker started)")
        return 128 + signal.SIGTERM
    if unresolved:
        from .exitcodes import write_termination_message

        log(f"error: {unresolved}")
        write_termination_message(f"{PROG}: exit {UNRESOLVED_EXIT} (retried): {unresolved}")
        return UNRESOLVED_EXIT
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
