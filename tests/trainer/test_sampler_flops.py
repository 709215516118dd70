"""Resumable sample order and FLOPs/MFU arithmetic."""

from __future__ import annotations

import pytest
from megatron_trainer import flops
from megatron_trainer.sampler import PretrainingSampler


def test_sampler_order_matches_megatron_pretraining_sampler():
    # Megatron-LM: consecutive ids from consumed_samples; each micro x DP group split per DP rank.
    rank0 = list(PretrainingSampler(20, 0, 2, 0, 2))
    rank1 = list(PretrainingSampler(20, 0, 2, 1, 2))
    assert rank0[:3] == [[0, 1], [4, 5], [8, 9]]
    assert rank1[:3] == [[2, 3], [6, 7], [10, 11]]
    assert len(rank0) == len(PretrainingSampler(20, 0, 2, 0, 2)) == 5


def test_resumed_sampler_continues_the_same_sequence():
    full = list(PretrainingSampler(64, 0, 4, 1, 2))
    for consumed_steps in range(1, 7):
        resumed = list(PretrainingSampler(64, consumed_steps * 8, 4, 1, 2))
        assert resumed == full[consumed_steps:]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError):
        PretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError):
        PretrainingSampler(10, 0, 1, 2, 2)


def test_classic_formula_is_the_peers():
    b, s, layers, h, v = 4, 2048, 24, 2048, 32768
    peer = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))  # mcore_peer.py
    assert flops.classic_flops_per_iteration(b, s, layers, h, v) == pytest.approx(peer, rel=1e-12)


def test_megatron_formula_for_a_standard_gpt():
    # MHA, 4h GeLU MLP: per token 72*L*h^2 + 6*h*V + 6*L*h*s (causal attention halved)
    b, s, layers, h, heads, v = 2, 1024, 4, 512, 8, 1280
    expected = b * s * (72 * layers * h * h + 6 * h * v + 6 * layers * h * s)
    got = flops.megatron_flops_per_iteration(b, s, layers, h, heads, heads, 4 * h, v)
    assert got == pytest.approx(expected, rel=1e-12)
    # The classic formula counts full s^2 attention and the unpadded vocab: exactly 6*B*s^2*L*h more.
    classic = flops.classic_flops_per_iteration(b, s, layers, h, v)
    assert classic - got == pytest.approx(6 * b * s * s * layers * h, rel=1e-9)


def test_megatron_formula_gqa_swiglu():
    b, s, layers, h, heads, groups, ffn, v = 1, 4096, 32, 4096, 32, 8, 14336, 128256
    kv = h // heads
    per_token = 6 * (layers * (3 * h * ffn + 2 * h * h + 2 * h * kv * groups) + h * v) + 6 * layers * h * s
    assert flops.megatron_flops_per_iteration(b, s, layers, h, heads, groups, ffn, v, swiglu=True) == \
        pytest.approx(b * s * per_token, rel=1e-12)


def test_padding_and_throughput():
    assert flops.padded_vocab_size(32000, 128, 1) == 32000
    assert flops.padded_vocab_size(32001, 128, 2) == 32256
    tp = flops.throughput(flops_per_iteration=989e12 * 8 * 0.5, tokens_per_iteration=8192, iteration_s=1.0,
                          world_size=8)
    assert tp["mfu"] == pytest.approx(0.5)
    assert tp["tokens_per_s"] == 8192 and tp["tokens_per_s_per_gpu"] == 1024
    with pytest.raises(ValueError):
        flops.throughput(1.0, 1, 0.0, 1)
