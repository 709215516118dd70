"""`--device cpu`: the trainer on CPUs (gloo), for smoke runs of a job before it takes GPUs.

Megatron-Core 0.19.2 has no CPU device: model building, DDP, the distributed optimizer and
dist_checkpointing call `torch.cuda.current_device()`, `torch.cuda.synchronize()`, `Tensor.cuda()`
and the CUDA RNG directly, and the optimizer accepts only parameters whose `type()` is a
`torch.cuda.*Tensor` (optimizer/__init__.py, `_get_param_groups_and_buffers`). `use_cpu()` points those
calls at the CPU, once, before any of that runs. What it changes, and why each is safe on a CPU-only
process:

- `torch.cuda.is_available()` is False, `current_device()` is "cpu", `set_device`/`synchronize` do
  nothing: every allocation Megatron places "on the current device" lands on the CPU.
- `Tensor.cuda()`/`Module.cuda()` return the CPU tensor; `Tensor.to("cuda")` and factories given
  `device="cuda"` stay on the CPU.
- `Tensor.type()` without arguments names the CUDA type of the same dtype (the optimizer's check only).
- The CUDA RNG calls use the CPU generator (`get_rng_state`) or do nothing (`set_rng_state`,
  `manual_seed`): Megatron's tensor-parallel RNG tracker then draws dropout from the CPU generator.
  Runs are repeatable; they are not bit-identical to a GPU run.
- torch.compile is off (`torch._dynamo.config.disable`): Megatron-Core compiles its fused kernels
  (`jit_fuser`: SwiGLU, bias-dropout-add, the router) at their first call, and Inductor on a CPU
  builds C++ with the host compiler, which a trainer image need not have; measured here, compiling
  took 37 of the first iteration's 38 s for a 2-layer model. Eager kernels compute the same values.
- `memory_allocated()` / `max_memory_allocated()` report this process's resident and peak resident
  host memory, so the trainer's memory lines and summary say what the job needs on a CPU node.

What CPUs cannot run is refused before this module is used (config.validate_device, and the operator's
admission rules for `gpusPerNode: 0`): Transformer Engine, fp8, fp16, CUDA graphs, context parallelism.
The torch tests run the trainer's own code through this module (tests/trainer/*_check.py).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

_installed = False


def _to_cpu(value):
    return "cpu" if "cuda" in str(value) else value


def _resident_bytes() -> int:
    """This process's resident set size (bytes), from /proc/self/statm."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


class _CpuEvent:
    """torch.cuda.Event on a CPU: already complete when recorded (CPU work is synchronous)."""

    def __init__(self, *args, **kwargs):
        self.recorded_at: float | None = None

    def record(self, *args, **kwargs) -> None:
        import time

        self.recorded_at = time.perf_counter()

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _CpuEvent) -> float:
        return ((end.recorded_at or 0.0) - (self.recorded_at or 0.0)) * 1000.0


def use_cpu(torch, eager: bool = True) -> None:
    """Point Megatron-Core's CUDA calls at the CPU (idempotent; see the module docstring). `eager=False` keeps
    torch.compile on (the torch tests that compare compiled fusions on a CPU with a compiler)."""
    global _installed
    if _installed:
        return
    _installed = True
    if eager:
        import torch._dynamo

        torch._dynamo.config.disable = True
    cuda = torch.cuda
    cuda.is_available = lambda: False
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.get_rng_state = cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda *a, **k: None
    cuda.manual_seed = lambda *a, **k: None
    cuda.manual_seed_all = lambda *a, **k: None
    cuda.memory_allocated = lambda *a, **k: _resident_bytes()
    cuda.max_memory_allocated = lambda *a, **k: _peak_resident_bytes()
    cuda.memory_reserved = lambda *a, **k: _resident_bytes()
    cuda.max_memory_reserved = lambda *a, **k: _peak_resident_bytes()
    cuda.memory_stats = lambda *a, **k: {}
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    # Streams and events: torch.cpu's device-agnostic stand-ins (work on a CPU is ordered already).
    cuda.current_stream = cuda.default_stream = lambda *a, **k: torch.cpu.current_stream()
    class Stream(torch.cpu.Stream):  # a class, not a factory: libraries annotate with `torch.cuda.Stream | None`
        def __init__(self, *args, **kwargs):
            super().__init__()

    cuda.Stream = Stream
    cuda.stream = lambda *a, **k: torch.cpu.stream(torch.cpu.current_stream())
    cuda.Event = _CpuEvent
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    def on_cpu(factory):
        def make(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _to_cpu(kwargs["device"])
            return factory(*args, **kwargs)
        return make

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like",
                 "full_like", "rand", "randn", "randint", "as_tensor"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    kind = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: kind(self, *a, **k) if a or k else \
        kind(self).replace("torch.", "torch.cuda.", 1)
    to = torch.Tensor.to
    torch.Tensor.to = lambda self, *a, **k: to(self, *[_to_cpu(x) for x in a],
                                                  **{n: (_to_cpu(v) if n == "device" else v) for n, v in k.items()})
    # The tensor-parallel RNG tracker reads and sets the CUDA generator through its own helpers
    # (tensor_parallel/random.py), which index torch.cuda.default_generators (empty without a GPU).
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda *a, **k: None


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU limit of this container (its cgroup's CFS quota / period: a pod's resources.limits.cpu),
    or None without one."""
    candidates = [(root / "cpu.max", None), (root / "cpu" / "cpu.cfs_quota_us", root / "cpu" / "cpu.cfs_period_us"),
                  (root / "cpu,cpuacct" / "cpu.cfs_quota_us", root / "cpu,cpuacct" / "cpu.cfs_period_us")]
    for quota_file, period_file in candidates:
        try:
            if period_file is None:
                quota, period = quota_file.read_text().split()[:2]
            else:
                quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            return max(float(quota) / float(period), 0.0) or None
        except (ValueError, ZeroDivisionError):
            return None
    return None


def threads_per_process(local_world: int, env: dict[str, str] | None = None) -> int:
    """Intra-op threads of each of the pod's `local_world` processes: OMP_NUM_THREADS when set, else the
    container's CPUs (its limit, or the CPUs it may run on) shared out, at least 1."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    cpus = cgroup_cpus() or len(os.sched_getaffinity(0))
    return max(1, int(cpus // max(1, local_world)))
