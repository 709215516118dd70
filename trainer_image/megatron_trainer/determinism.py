"""`--deterministic-mode`: bit-identical runs (Megatron-LM's megatron/training/determinism.py, core_v0.19.0).

What it implies here, before NCCL, cuBLAS or any kernel runs:
- the environment: NCCL_ALGO=Ring (a set value must be Ring, CollnetDirect, CollnetChain or ^NVLS: Tree's
  reduction order is not fixed), CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8),
  NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (Transformer Engine); a value set otherwise is refused;
- torch.use_deterministic_algorithms(True) (warn_only: an op without a deterministic kernel is named
  in the log instead of ending the run; the bit-identical resume test is what proves the result);
- Megatron-Core's TransformerConfig.deterministic_mode (embedding lookups without atomics);
- attention without fused kernels on the local path: SDPA's math backend (matmul, softmax, matmul).
It costs speed (docs/trainer.md); it is opt-in.
"""

from __future__ import annotations

from collections.abc import MutableMapping

ENV_DEFAULTS = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
NCCL_ALGO_TOKENS = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})
ENV_ACCEPTED = {"CUBLAS_WORKSPACE_CONFIG": frozenset({":4096:8", ":16:8"}),
                "NVTE_ALLOW_NONDETERMINISTIC_ALGO": frozenset({"0"})}


def apply_env(env: MutableMapping[str, str]) -> list[str]:
    """Refuse (ValueError) a non-deterministic setting; fill in the defaults. Returns what it set."""
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [t.strip() for t in algo.split(",") if t.strip()]
        if not tokens or not all(t in NCCL_ALGO_TOKENS for t in tokens):
            raise ValueError(f"--deterministic-mode: NCCL_ALGO={algo!r} is not deterministic; "
                             f"use one of {sorted(NCCL_ALGO_TOKENS)} or leave it unset (Ring)")
    for name, accepted in ENV_ACCEPTED.items():
        if env.get(name) is not None and env[name] not in accepted:
            raise ValueError(f"--deterministic-mode: {name}={env[name]!r} is not deterministic; "
                             f"use one of {sorted(accepted)} or leave it unset")
    set_now = [f"{k}={v}" for k, v in ENV_DEFAULTS.items() if k not in env]
    for k, v in ENV_DEFAULTS.items():
        env.setdefault(k, v)
    return set_now


def enable(env: MutableMapping[str, str]) -> list[str]:
    """The environment, then torch's deterministic algorithms (before the first CUDA kernel)."""
    set_now = apply_env(env)
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    return set_now
