"""Shared helpers for the trainer's CPU tests (no torch, no GPU)."""

from __future__ import annotations

import importlib
import os

import pytest

# A command line as the operator renders it (docs/trainer-contract.md), with every optional flag on.
FULL_ARGV = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--num-virtual-stages-per-pipeline-rank", "2", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel",
    "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
    "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "2816",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "32000",
    "--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--rotary-base", "500000",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--transformer-impl", "transformer_engine", "--attention-backend", "flash",
    "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters", "5000",
    "--lr", "0.0003", "--min-lr", "3e-05", "--lr-decay-style", "cosine", "--lr-warmup-iters", "100",
    "--lr-decay-iters", "5000", "--weight-decay", "0.1", "--clip-grad", "1.0",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--fp8-format", "hybrid",
    "--use-distributed-optimizer",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--seed", "42", "--log-interval", "10", "--eval-iters", "0",
    "--data-path", "0.3", "/data/a_text_document", "0.7", "/data/b_text_document", "--split", "969,30,1",
    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/data/tokenizer",
    "--data-cache-path", "/checkpoints/run/data-cache",
    "--save", "/checkpoints/run", "--load", "/checkpoints/run", "--save-interval", "500",
    "--ckpt-format", "torch_dist", "--async-save", "--use-persistent-ckpt-worker", "--exit-signal-handler",
]

# Minimal mock-data command line (what the operator renders for the smallest example).
MOCK_ARGV = [
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
    "--expert-model-parallel-size", "1", "--num-layers", "2", "--hidden-size", "64",
    "--num-attention-heads", "4", "--ffn-hidden-size", "256", "--seq-length", "128",
    "--max-position-embeddings", "128", "--vocab-size", "1024", "--normalization", "LayerNorm",
    "--position-embedding-type", "learned_absolute", "--transformer-impl", "local", "--attention-backend", "flash",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10", "--lr", "1e-3", "--min-lr", "1e-4",
    "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--lr-decay-iters", "10", "--weight-decay", "0.0",
    "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--seed", "1",
    "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
]


def without(argv: list[str], *flags: str) -> list[str]:
    """argv with each of `flags` and its values removed."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        out.append(argv[i])
        i += 1
    return out


@pytest.fixture
def full_argv() -> list[str]:
    return list(FULL_ARGV)


@pytest.fixture
def mock_argv() -> list[str]:
    return list(MOCK_ARGV)


def require(module: str):
    """pytest.importorskip, except under `make torch-tests` (MEGATRON_TORCH_TESTS=1), where a missing
    module is an error: CI must not pass by skipping the tests that run torch."""
    if os.environ.get("MEGATRON_TORCH_TESTS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)
