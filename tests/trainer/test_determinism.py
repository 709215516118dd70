"""--deterministic-mode's environment (megatron_trainer/determinism.py, as Megatron-LM's determinism.py)."""

from __future__ import annotations

import pytest
from megatron_trainer.config import parse_args
from megatron_trainer.determinism import apply_env


def test_defaults_filled_and_reported():
    env = {}
    assert apply_env(env) == ["NCCL_ALGO=Ring", "CUBLAS_WORKSPACE_CONFIG=:4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"]
    assert env == {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def test_deterministic_values_given_are_kept():
    env = {"NCCL_ALGO": "Ring,CollnetDirect", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert apply_env(env) == ["NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"]
    assert env["NCCL_ALGO"] == "Ring,CollnetDirect" and env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("env, message", [
    ({"NCCL_ALGO": "Tree"}, "NCCL_ALGO='Tree' is not deterministic"),
    ({"NCCL_ALGO": ","}, "NCCL_ALGO=','"),
    ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG=':0:0'"),
    ({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, "NVTE_ALLOW_NONDETERMINISTIC_ALGO='1'"),
])
def test_non_deterministic_settings_are_refused(env, message):
    with pytest.raises(ValueError, match=message):
        apply_env(env)


def test_flag(mock_argv):
    assert parse_args(mock_argv + ["--deterministic-mode"]).training.deterministic_mode
    assert not parse_args(mock_argv).training.deterministic_mode
