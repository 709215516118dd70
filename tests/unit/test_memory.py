"""The memory estimate: hand-checked arithmetic, directions that must hold, the CLI, and (in
test_memory_calibration.py) agreement with peak memory measured on GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from factory import DELETE, make_job
from megatron_operator.memory import GIB, RESERVED_OVERHEAD_GIB, estimate, fit_report, padded_vocab
from megatron_operator.validation import parse_job

ROOT = Path(__file__).parents[2]


def est(**over):
    base = dict(numNodes=1, gpusPerNode=8, parallelism={"tensor": 1},
                model={"numLayers": 24, "hiddenSize": 2048, "numAttentionHeads": 16, "seqLength": 2048,
                       "vocabSize": 32768},
                training={"microBatchSize": 4, "globalBatchSize": 32, "trainIters": 10,
                          "transformerImpl": "local"})
    base.update(over)
    return estimate(parse_job(make_job(**base)))


def test_padded_vocab():
    assert padded_vocab(50257, 1) == 50304
    assert padded_vocab(50257, 8) == 51200
    assert padded_vocab(32768, 2) == 32768


def test_static_memory_by_hand():
    # GPT 1.35B-class on 8 GPUs, DP=8, distributed optimizer: 2 + 4 bytes per parameter + 12/8
    e = est()
    h, L, V = 2048, 24, 32768
    layer = (4 * h * h + 4 * h) + (8 * h * h + 5 * h) + 2 * 2 * h  # attention, MLP (with biases), 2 LayerNorms
    params = L * layer + V * h + 2048 * h + 2 * h  # + embedding, learned positions, final norm (tied output)
    assert e.details["paramsPerGpu"] == pytest.approx(params, rel=1e-9)
    assert e.weights == pytest.approx(2 * params)
    assert e.gradients == pytest.approx(4 * params)
    assert e.optimizer == pytest.approx(12 * params / 8)


def test_directions():
    base = est().total
    assert est(parallelism={"tensor": 2}).total < base
    assert est(training={"microBatchSize": 8, "globalBatchSize": 64, "trainIters": 10,
                         "transformerImpl": "local"}).total > base
    no_dist = est(training={"microBatchSize": 4, "globalBatchSize": 32, "trainIters": 10,
                            "transformerImpl": "local", "distributedOptimizer": False})
    assert no_dist.optimizer == pytest.approx(est().optimizer * 8)
    for backend in ("flash", "unfused"):
        acts = {r: est(training={"microBatchSize": 4, "globalBatchSize": 32, "trainIters": 10, "recompute": r,
                                 "transformerImpl": "local", "attentionBackend": backend}).activations
                for r in ("none", "selective", "full")}
        assert acts["full"] < acts["selective"] <= acts["none"]
        # selective recompute only pays off where the attention core keeps s x s scores
        assert (acts["selective"] < acts["none"]) == (backend == "unfused")
    unfused = est(training={"microBatchSize": 4, "globalBatchSize": 32, "trainIters": 10,
                            "transformerImpl": "local", "attentionBackend": "unfused"})
    assert unfused.activations > est().activations


def test_unfused_score_term_is_quadratic_in_sequence():
    def delta(seq):
        kw = dict(model={"numLayers": 24, "hiddenSize": 2048, "numAttentionHeads": 16, "seqLength": seq,
                         "vocabSize": 32768})
        t = {"microBatchSize": 1, "globalBatchSize": 8, "trainIters": 10, "transformerImpl": "local"}
        return (est(training={**t, "attentionBackend": "unfused"}, **kw).activations
                - est(training=t, **kw).activations)

    assert delta(4096) / delta(2048) == pytest.approx(4.0, rel=0.05)


def test_pipeline_first_stage_holds_in_flight_microbatches():
    e = est(parallelism={"pipeline": 4}, training={"microBatchSize": 1, "globalBatchSize": 16, "trainIters": 10,
                                                   "transformerImpl": "local"})
    assert e.details["inFlight"] in (4, 1)


def test_fit_report_and_json():
    job = parse_job(make_job(numNodes=1, gpusPerNode=1, parallelism={"tensor": 1, "pipeline": 1},
                             model={"preset": "gpt-18.4b"}, training={"trainIters": 1, "microBatchSize": 1},
                             resources={"gpuType": "H100-80GB"}))
    rep = fit_report(job)
    assert rep.fits is False and rep.per_gpu_gib > 200
    js = rep.as_json()
    assert set(js) >= {"perGpuGiB", "breakdown", "fits"} and js["fits"] is False
    assert set(js["breakdown"]) == {"weights", "gradients", "optimizer", "activations", "other"}
    assert fit_report(parse_job(make_job(resources={"memoryFit": "Ignore"}))) is None


def test_estimate_cli_json_and_exit_code(tmp_path):
    env = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "megatron_operator", "estimate", "-o", "json",
                        str(ROOT / "examples" / "llama3-70b-checkpoint.yaml")], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fits"] is True and out["capacityGiB"] == pytest.approx(140.4)
    big = make_job(numNodes=1, gpusPerNode=1, parallelism={"tensor": 1, "pipeline": 1},
                   model={"preset": "gpt-18.4b"}, training={"trainIters": 1, "microBatchSize": 1},
                   resources={"gpuType": "H100-80GB"})
    import yaml
    f = tmp_path / "big.yaml"
    f.write_text(yaml.safe_dump(big))
    r = subprocess.run([sys.executable, "-m", "megatron_operator", "estimate", str(f)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 1 and "does NOT fit" in r.stdout
    r = subprocess.run([sys.executable, "-m", "megatron_operator", "validate", str(f)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 0 and "warning: predicted peak" in r.stderr  # Warn is the default
    big["spec"]["resources"]["memoryFit"] = "Reject"
    f.write_text(yaml.safe_dump(big))
    r = subprocess.run([sys.executable, "-m", "megatron_operator", "validate", str(f)], capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 1 and "error: predicted peak" in r.stderr


def test_total_is_sum_of_breakdown():
    e = est()
    assert e.total == pytest.approx(e.weights + e.gradients + e.optimizer + e.activations + e.other)
    assert e.total / GIB < 80


def test_moe_example_states_what_estimate_predicts():
    """examples/moe-expert-parallel.yaml quotes estimate's figures for 4 and 2 nodes; they must match."""
    import re

    import yaml
    from megatron_operator.validation import parse_job

    path = Path(__file__).parents[2] / "examples" / "moe-expert-parallel.yaml"
    text = path.read_text()
    quoted = [(float(a), float(b)) for a, b in re.findall(r"(\d+\.\d) of (\d+\.\d) GiB", text)]
    doc = yaml.safe_load(text)
    predicted = []
    for nodes in (4, 2):
        doc["spec"]["numNodes"] = nodes
        r = fit_report(parse_job(doc), always=True)
        predicted.append((round(r.per_gpu_gib + RESERVED_OVERHEAD_GIB, 1), r.capacity_gib))
    assert quoted == predicted


def test_checkpoint_size_of_the_7b_gpt_is_what_it_wrote_on_the_gpus():
    """The GPU suite's gpt7b (32 x 4096, FFN 16384, seq 2048, vocabulary 32768, LayerNorm, learned positions,
    untied, biases) wrote 94.06 GB per save on 4 x H100 (docs/benchmarks/scale.md#2026-11-27-first-4-gpu-calls)."""
    from megatron_operator.memory import checkpoint_bytes, model_parameters

    job = parse_job(make_job(model={"numLayers": 32, "hiddenSize": 4096, "numAttentionHeads": 32,
                                    "ffnHiddenSize": 16384, "seqLength": 2048, "vocabSize": 32768,
                                    "untieEmbeddings": True, "positionEmbedding": "learned_absolute",
                                    "normalization": "LayerNorm", "addBiasLinear": True},
                             parallelism={"tensor": 2, "pipeline": 2}, numNodes=1, gpusPerNode=4,
                             training={"trainIters": 1, "microBatchSize": 1, "globalBatchSize": 16}))
    assert abs(model_parameters(job) - 6.72e9) / 6.72e9 < 0.005
    assert abs(checkpoint_bytes(job) - 94.06e9) / 94.06e9 < 0.005


# ------------------------------------------- mixture of experts (issue 50; measured: test_memory_moe_calibration.py)
MOE_MODEL = {"numLayers": 4, "hiddenSize": 1024, "numAttentionHeads": 16, "seqLength": 2048, "vocabSize": 32768,
             "activation": "swiglu", "normalization": "RMSNorm", "positionEmbedding": "rope", "addBiasLinear": False,
             "numExperts": 8, "moeRouterTopk": 2, "moeFfnHiddenSize": 512}


def moe_est(parallelism=None, **model):
    return est(parallelism=parallelism or {"tensor": 1, "expert": 4}, model={**MOE_MODEL, **model},
               training={"microBatchSize": 1, "globalBatchSize": 8, "trainIters": 10, "transformerImpl": "local"})


def test_moe_parameters_and_their_sharding_by_hand():
    """8 GPUs, EP=4: each GPU holds 2 of the 8 experts of each layer; the router (8 x 1024 per layer) is dense,
    replicated; the experts' optimizer state shards over expert data parallel 8 / (1 x 4 x 1) = 2, the rest over 8."""
    e = moe_est()
    h, L, V, E, f = 1024, 4, 32768, 8, 512
    dense = L * (4 * h * h + 2 * h + h * E) + V * h + 2 * h  # attention, 2 RMSNorms, router; embedding; final norm
    experts = L * E * 3 * h * f / 4
    assert e.details["expertParamsPerGpu"] == pytest.approx(experts)
    assert e.details["paramsPerGpu"] == pytest.approx(dense + experts)
    assert e.details["expertDataParallel"] == 2
    assert e.weights == pytest.approx(2 * (dense + experts))
    assert e.gradients == pytest.approx(4 * (dense + experts))
    assert e.optimizer == pytest.approx(12 * dense / 8 + 12 * experts / 2)


def test_moe_expert_tensor_parallel_splits_the_experts_and_narrows_expert_data_parallel():
    etp1 = moe_est({"tensor": 2, "expert": 2, "expertTensor": 1})
    etp2 = moe_est({"tensor": 2, "expert": 2, "expertTensor": 2})
    assert etp1.details["expertParamsPerGpu"] == pytest.approx(2 * etp2.details["expertParamsPerGpu"])
    assert (etp1.details["expertDataParallel"], etp2.details["expertDataParallel"]) == (4, 2)


def test_moe_activations_by_hand():
    """One MoE layer at TP=1, EP=4, all-gather: kept = 2 bytes x rows x (h + 3 f) + 8 bytes x tokens x experts,
    with rows = tokens x topk (even routing); transient = 2 bytes x h x (tokens x EP + rows)."""
    from megatron_operator.memory import _moe_layer_bytes

    tokens, h, f, E, k = 2048, 1024, 512, 8, 2
    kept, transient = _moe_layer_bytes(tokens, h, f, E, k, ep=4, etp=1, swiglu=True, dispatcher="allgather",
                                       act_bytes=2)
    assert kept == 2 * tokens * k * (h + 3 * f) + 8 * tokens * E
    assert transient == 2 * h * (tokens * 4 + tokens * k)
    _, alltoall = _moe_layer_bytes(tokens, h, f, E, k, ep=4, etp=1, swiglu=True, dispatcher="alltoall", act_bytes=2)
    assert alltoall == 2 * h * 2 * tokens * k
    # each top-k copy is a row through the experts: doubling k adds one more set of rows
    kept4, _ = _moe_layer_bytes(tokens, h, f, E, 4, ep=4, etp=1, swiglu=True, dispatcher="alltoall", act_bytes=2)
    assert kept4 - kept == 2 * tokens * 2 * (h + 3 * f)


def test_moe_directions():
    base = moe_est()
    assert moe_est(moeRouterTopk=4).activations > base.activations
    assert moe_est(moeFfnHiddenSize=1024).weights > base.weights
    assert moe_est({"tensor": 1, "expert": 8}).weights < base.weights  # experts spread wider
    # at EP=4 the all-gather dispatcher holds the group's 4 x tokens, all-to-all 2 x the top-2 rows: same here;
    # at EP=8 all-gather holds more
    wide_ag = moe_est({"tensor": 1, "expert": 8})
    wide_a2a = moe_est({"tensor": 1, "expert": 8}, moeTokenDispatcherType="alltoall")
    assert wide_a2a.activations < wide_ag.activations


def test_moe_estimate_names_its_calibrated_and_uncalibrated_terms():
    from megatron_operator.memory import CALIBRATED_MOE_TERMS, UNCALIBRATED_MOE_TERMS

    assert moe_est().details["uncalibrated"] == list(UNCALIBRATED_MOE_TERMS)
    assert moe_est().details["calibrated"] == list(CALIBRATED_MOE_TERMS)
    assert "uncalibrated" not in est().details and "calibrated" not in est().details


def test_swiglu_experts_backward_transient_by_hand():
    """megatron-core's weighted_swiglu_back, per routed row and expert-FFN column, above what the forward kept: the
    gradient of both halves in the router's dtype (2 w), swiglu(y) again (2), the incoming gradient cast to the
    router's dtype (w; none when it already is) and the product (w). fp32 router: 8 + 2 + 4 + 4 = 18 bytes."""
    from megatron_operator.memory import _moe_layer_bytes, _swiglu_backward_bytes

    assert _swiglu_backward_bytes(act_bytes=2, probs_bytes=4) == 18
    assert _swiglu_backward_bytes(act_bytes=2, probs_bytes=2) == 8
    assert _swiglu_backward_bytes(act_bytes=2, probs_bytes=8) == 34
    # the layer's transient is the larger of the dispatcher's buffers and this: Mixtral's shape (h 4096, FFN 14336,
    # top-2, 4096 tokens) at EP 4: 18 x 8192 rows x 14336 against all-to-all's 2 x 2 x 8192 x 4096
    tokens, h, f, E, k = 4096, 4096, 14336, 8, 2
    _, t = _moe_layer_bytes(tokens, h, f, E, k, ep=4, etp=1, swiglu=True, dispatcher="alltoall", act_bytes=2,
                            probs_bytes=4)
    assert t == 18 * tokens * k * f
    # expert TP 2 halves each expert's FFN and doubles the rows (every token of the TP group): the same product
    _, t2 = _moe_layer_bytes(tokens / 2, h, f, E, k, ep=2, etp=2, swiglu=True, dispatcher="alltoall", act_bytes=2,
                             probs_bytes=4)
    assert t2 == t / 2
    # GeLU experts: the dispatcher's buffers only (their backward is not modelled)
    _, gelu = _moe_layer_bytes(tokens, h, f, E, k, ep=4, etp=1, swiglu=False, dispatcher="alltoall", act_bytes=2,
                               probs_bytes=4)
    assert gelu == 2 * h * 2 * tokens * k
    # through estimate: moeRouterDtype fp32 raises the transient of this small shape above the dispatcher's
    base = moe_est(moeTokenDispatcherType="alltoall")
    fp32 = moe_est(moeTokenDispatcherType="alltoall", moeRouterDtype="fp32")
    rows, f_small = 2048 * 2, 512
    assert fp32.activations - base.activations == pytest.approx(18 * rows * f_small - 2 * 1024 * 2 * rows)


def test_attention_width_and_rope_by_hand():
    """Q and the attention output are heads x kvChannels wide (Qwen3: 32 x 128 = 4096 on hidden 2048); RoPE keeps the
    rotated Q and K beside the QKV output: 2 bytes x s x b x (q + kv) / TP per layer."""
    L, s, b = 24, 2048, 4
    model = {"numLayers": L, "hiddenSize": 2048, "numAttentionHeads": 16, "seqLength": s, "vocabSize": 32768}
    t = {"microBatchSize": b, "globalBatchSize": 32, "trainIters": 10, "transformerImpl": "local"}
    plain = est(model=model, training=t)
    rope = est(model={**model, "positionEmbedding": "rope"}, training=t)
    assert rope.activations - plain.activations == pytest.approx(L * 2 * s * b * (2048 + 2048))
    gqa = {**model, "numQueryGroups": 4, "positionEmbedding": "rope"}
    gqa_tp2 = est(model=gqa, training=t, parallelism={"tensor": 2})
    gqa_tp2_plain = est(model={**gqa, "positionEmbedding": "learned_absolute"}, training=t, parallelism={"tensor": 2})
    assert gqa_tp2.activations - gqa_tp2_plain.activations == pytest.approx(L * 2 * s * b * (2048 + 512) / 2)
    # kvChannels 256 on 16 heads: Q and the attention output 4096 wide instead of 2048 (its weights too)
    wide = est(model={**model, "kvChannels": 256}, training=t)
    per_layer = wide.details["perLayerActivationBytes"] - plain.details["perLayerActivationBytes"]
    assert per_layer == pytest.approx(2 * s * b * ((4096 + 2 * 4096) - (2048 + 2 * 2048)) + 2 * s * b * 2048)


def test_moe_shared_experts_by_hand():
    """Shared experts (moeSharedExpertIntermediateSize 1024, SwiGLU) at TP=2: a dense MLP per layer split over TP,
    3 x h x 1024 / 2 weights a layer, with the dense part's optimizer sharding; activations gain the activation's
    input (two halves) and fc2's input of every token, 2 bytes x 3 x s x f / TP a layer."""
    h, L, fs, s = 1024, 4, 1024, 2048
    par = {"tensor": 2, "expert": 2, "expertTensor": 1}
    base, shared = moe_est(par), moe_est(par, moeSharedExpertIntermediateSize=fs)
    extra = L * 3 * h * fs / 2
    assert shared.details["paramsPerGpu"] - base.details["paramsPerGpu"] == pytest.approx(extra)
    assert shared.details["expertParamsPerGpu"] == base.details["expertParamsPerGpu"]
    assert shared.weights - base.weights == pytest.approx(2 * extra)
    assert shared.optimizer - base.optimizer == pytest.approx(12 * extra / 4)  # dense: data parallel 8 / 2
    per_layer = shared.details["perLayerActivationBytes"] - base.details["perLayerActivationBytes"]
    assert per_layer == pytest.approx(2 * 3 * s * fs / 2)
    # the whole model's count (checkpoint size) has them too
    from megatron_operator.memory import model_parameters

    job = parse_job(make_job(parallelism=par, model={**MOE_MODEL, "moeSharedExpertIntermediateSize": fs}))
    dense_job = parse_job(make_job(parallelism=par, model=MOE_MODEL))
    assert model_parameters(job) - model_parameters(dense_job) == L * 3 * h * fs


def test_moe_shared_expert_gate_by_hand():
    """Qwen2-MoE's gate on the shared experts: 1 x h weights per layer, whole on every TP rank; autograd keeps the
    ungated output (s x h, split over TP by sequence parallelism) and one score per token, 2 bytes each."""
    h, L, fs, s = 1024, 4, 1024, 2048
    par = {"tensor": 2, "expert": 2, "expertTensor": 1}
    shared = moe_est(par, moeSharedExpertIntermediateSize=fs)
    gated = moe_est(par, moeSharedExpertIntermediateSize=fs, moeSharedExpertGate=True)
    assert gated.details["paramsPerGpu"] - shared.details["paramsPerGpu"] == pytest.approx(L * h)
    per_layer = gated.details["perLayerActivationBytes"] - shared.details["perLayerActivationBytes"]
    assert per_layer == pytest.approx(2 * (s * h / 2 + s))
    job = parse_job(make_job(parallelism=par, model={**MOE_MODEL, "moeSharedExpertIntermediateSize": fs,
                                                     "moeSharedExpertGate": True}))
    ungated = parse_job(make_job(parallelism=par, model={**MOE_MODEL, "moeSharedExpertIntermediateSize": fs}))
    from megatron_operator.memory import model_parameters

    assert model_parameters(job) - model_parameters(ungated) == L * h


def test_moe_capacity_factor_by_hand():
    """A capacity factor keeps each expert to that factor x its even share: 0.5 halves the routed rows (the rest
    dropped), 1.5 drops none under even routing, and with padding to capacity every expert gets exactly it (1.5 x
    the rows of even routing)."""
    from megatron_operator.memory import _moe_layer_bytes

    tokens, h, f, E, k = 2048, 1024, 512, 8, 2
    router = 8 * tokens * E

    def kept(**kw):
        return _moe_layer_bytes(tokens, h, f, E, k, ep=4, etp=1, swiglu=True, dispatcher="alltoall", act_bytes=2,
                                **kw)

    rows_bytes = kept()[0] - router  # 2 bytes x tokens x k x (h + 3 f)
    assert kept(capacity_factor=0.5)[0] - router == pytest.approx(0.5 * rows_bytes)
    assert kept(capacity_factor=1.5) == kept()
    assert kept(capacity_factor=1.5, pad_to_capacity=True)[0] - router == pytest.approx(1.5 * rows_bytes)
    assert kept(capacity_factor=1.5, pad_to_capacity=True)[1] == pytest.approx(1.5 * kept()[1])  # all-to-all rows
    # through estimate: spec.model's fields reach it
    base = moe_est()
    assert moe_est(moeExpertCapacityFactor=0.5).activations < base.activations
    assert moe_est(moeExpertCapacityFactor=1.5).activations == base.activations
    assert moe_est(moeExpertCapacityFactor=1.5, moePadExpertInputToCapacity=True).activations > base.activations


def test_a_cpu_job_is_estimated_in_host_memory_per_pod_against_its_memory():
    """Issue 64: `estimate` of a CPU job: each process's model state and activations plus its runtime, times the
    processes of a pod, against spec.resources.memory (its limit); no GPU, no CUDA overhead."""
    from megatron_operator.memory import CPU_PROCESS_BASE_GIB

    base = {"numNodes": 2, "gpusPerNode": 0, "cpu": {"processesPerNode": 2}, "parallelism": {"tensor": 2},
            "model": {"preset": "gpt-1.7b"}, "training": {"microBatchSize": 1, "globalBatchSize": 2, "trainIters": 10}}
    same_on_gpus = fit_report(parse_job(make_job(**{**base, "gpusPerNode": 2, "cpu": DELETE})), always=True)
    report = fit_report(parse_job(make_job(**base, resources={"memory": "64Gi"})), always=True)
    assert report.per_gpu_gib == same_on_gpus.per_gpu_gib  # the same state and activations a rank
    assert report.per_pod_gib == pytest.approx(2 * (report.per_gpu_gib + CPU_PROCESS_BASE_GIB))
    assert report.capacity_gib == 64 and report.fits is True
    assert "host memory per pod" in report.table() and "CUDA" not in report.table()
    small = fit_report(parse_job(make_job(**base, resources={"memory": "4Gi"})), always=True)
    assert small.fits is False and "does NOT fit in the pod's 4.0 GiB" in small.summary()
    unknown = fit_report(parse_job(make_job(**base)), always=True)
    assert unknown.fits is None and "set spec.resources.memory" in unknown.summary()
    assert unknown.as_json()["processesPerPod"] == 2 and "perGpuGiB" not in unknown.as_json()
