"""`megatron-operator hf-config`: a Hugging Face config.json -> spec.model, and the check of a job against it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from factory import make_job
from megatron_operator.hf_config import MAX_CONFIG_BYTES, HfConfigError, load_config, parse_config, spec_model
from test_cli import cli, write

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
# mixture-of-experts fixtures (tests/trainer/test_hf_pure.py for the trainer's side): tested apart below
MOE_FIXTURES = {"tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"}
CONFIGS = sorted(p for p in FIXTURES.glob("*.json") if p.stem not in MOE_FIXTURES)

LLAMA_TINY_COMMON = {"numLayers": 4, "hiddenSize": 64, "numAttentionHeads": 4, "numQueryGroups": 2,
                     "ffnHiddenSize": 96, "seqLength": 256, "maxPositionEmbeddings": 256, "vocabSize": 1001,
                     "activation": "swiglu", "normalization": "RMSNorm", "normEpsilon": 1e-6,
                     "positionEmbedding": "rope"}
EXPECTED = {
    "llama31-8b-published": {"numLayers": 32, "hiddenSize": 4096, "numAttentionHeads": 32, "numQueryGroups": 8,
                             "ffnHiddenSize": 14336, "seqLength": 4096, "maxPositionEmbeddings": 131072,
                             "vocabSize": 128256, "activation": "swiglu", "normalization": "RMSNorm",
                             "normEpsilon": 1e-5, "positionEmbedding": "rope", "rotaryBase": 500000,
                             "ropeScalingFactor": 8.0, "untieEmbeddings": True, "addBiasLinear": False},
    "qwen25-05b-published": {"numLayers": 24, "hiddenSize": 896, "numAttentionHeads": 14, "numQueryGroups": 2,
                             "ffnHiddenSize": 4864, "seqLength": 4096, "maxPositionEmbeddings": 32768,
                             "vocabSize": 151936, "activation": "swiglu", "normalization": "RMSNorm",
                             "normEpsilon": 1e-6, "positionEmbedding": "rope", "rotaryBase": 1000000,
                             "addQkvBias": True, "untieEmbeddings": False, "addBiasLinear": False},
    "tiny-llama3": {**LLAMA_TINY_COMMON, "rotaryBase": 500000, "ropeScalingFactor": 8.0, "untieEmbeddings": True,
                    "addBiasLinear": False},
    "tiny-llama32-tied": {**LLAMA_TINY_COMMON, "rotaryBase": 10000, "ropeScalingFactor": 32.0,
                          "untieEmbeddings": False, "addBiasLinear": False},
    "tiny-mistral": {**LLAMA_TINY_COMMON, "rotaryBase": 10000, "untieEmbeddings": True, "addBiasLinear": False},
    "tiny-qwen2": {**LLAMA_TINY_COMMON, "rotaryBase": 1000000, "addQkvBias": True, "untieEmbeddings": False,
                   "addBiasLinear": False},
    "tiny-qwen3": {**LLAMA_TINY_COMMON, "rotaryBase": 10000, "kvChannels": 32, "qkLayernorm": True,
                   "untieEmbeddings": True, "addBiasLinear": False},
}


def config(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_every_fixture_has_an_expected_block():
    assert {p.stem for p in CONFIGS} == set(EXPECTED)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_fixture_to_spec_model(path):
    assert spec_model(parse_config(load_config(path))) == EXPECTED[path.stem]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_cli_prints_a_block_that_pastes_into_a_valid_job(path, tmp_path):
    r = cli("hf-config", str(path))
    assert r.returncode == 0, r.stderr
    block = yaml.safe_load(r.stdout)
    assert block == {"model": EXPECTED[path.stem]}
    job = make_job(numNodes=1, gpusPerNode=2, parallelism={"tensor": 2}, model=block["model"],
                   training={"trainIters": 10})
    manifest = write(tmp_path, "job.yaml", [job])
    assert cli("validate", manifest).returncode == 0
    r = cli("hf-config", str(path), "--check", manifest)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{manifest}: job: spec.model matches {path}"


def test_seq_length_option_and_its_bounds():
    r = cli("hf-config", str(FIXTURES / "llama31-8b-published.json"), "--seq-length", "8192")
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["model"]["seqLength"] == 8192
    r = cli("hf-config", str(FIXTURES / "tiny-llama3.json"), "--seq-length", "512")
    assert r.returncode == 1
    assert "--seq-length 512 is longer than config.json max_position_embeddings 256" in r.stderr
    assert cli("hf-config", str(FIXTURES / "tiny-llama3.json"), "--seq-length", "x").returncode == 2


def test_check_names_both_values_for_each_mismatch(tmp_path):
    model = {"preset": "llama3-8b", "hiddenSize": 2048, "numLayers": 16}
    manifest = write(tmp_path, "job.yaml", [make_job(model=model, training={"trainIters": 10})])
    r = cli("hf-config", str(FIXTURES / "llama31-8b-published.json"), "--check", manifest)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines == [
        f"{manifest}: spec.model.numLayers: 16 does not match config.json num_hidden_layers 32",
        f"{manifest}: spec.model.hiddenSize: 2048 does not match config.json hidden_size 4096",
        f"{manifest}: spec.model.kvChannels: 64 does not match config.json head_dim 128",
        f"{manifest}: spec.model.ropeScalingFactor: not set does not match config.json rope scaling llama3 factor 8",
    ]


def test_check_a_gpt_job_against_qwen3_lists_every_difference(tmp_path):
    manifest = write(tmp_path, "job.yaml", [make_job()])
    r = cli("hf-config", str(FIXTURES / "tiny-qwen3.json"), "--check", manifest)
    assert r.returncode == 1
    fields = [line.split(": ")[1] for line in r.stderr.strip().splitlines()]
    assert fields == ["spec.model.numLayers", "spec.model.hiddenSize", "spec.model.numAttentionHeads",
                      "spec.model.numQueryGroups", "spec.model.ffnHiddenSize", "spec.model.vocabSize",
                      "spec.model.kvChannels", "spec.model.normEpsilon", "spec.model.untieEmbeddings",
                      "spec.model.qkLayernorm", "spec.model.activation", "spec.model.normalization",
                      "spec.model.positionEmbedding", "spec.model.addBiasLinear"]


def test_check_refuses_an_invalid_manifest(tmp_path):
    manifest = write(tmp_path, "job.yaml", [make_job(model__hiddenSize=1000)])
    r = cli("hf-config", str(FIXTURES / "tiny-llama3.json"), "--check", manifest)
    assert r.returncode == 1 and "spec.model.hiddenSize: 1000 is not divisible" in r.stderr


def _set(path: str, value):
    def mutate(d):
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        node[last] = value
    return mutate


def _drop(key: str):
    return lambda d: d.pop(key)


# (id, base fixture, mutation, a fragment of the refusal)
REFUSALS = [
    ("arch-gpt2", "tiny-llama3", _set("architectures", ["GPT2LMHeadModel"]), "'GPT2LMHeadModel'] is not supported"),
    ("arch-two", "tiny-llama3", _set("architectures", ["LlamaForCausalLM", "X"]), "is not supported"),
    ("arch-missing", "tiny-llama3", _drop("architectures"), "config.json architectures: None is not supported"),
    ("model-type-mismatch", "tiny-llama3", _set("model_type", "qwen2"),
     "model_type: 'qwen2' does not match architecture LlamaForCausalLM"),
    ("hidden-act-gelu", "tiny-llama3", _set("hidden_act", "gelu"), "hidden_act: 'gelu'; only silu"),
    ("layers-string", "tiny-llama3", _set("num_hidden_layers", "4"), "num_hidden_layers: expected an integer >= 1, got '4'"),
    ("layers-float", "tiny-llama3", _set("num_hidden_layers", 4.0), "num_hidden_layers: expected an integer"),
    ("layers-bool", "tiny-llama3", _set("num_hidden_layers", True), "num_hidden_layers: expected an integer"),
    ("hidden-missing", "tiny-llama3", _drop("hidden_size"), "hidden_size: expected an integer >= 1, got None"),
    ("kv-heads-not-dividing", "tiny-llama3", _set("num_key_value_heads", 3), "num_key_value_heads 3 does not divide"),
    ("eps-string", "tiny-llama3", _set("rms_norm_eps", "1e-6"), "rms_norm_eps: expected a number"),
    ("rope-theta-fraction", "tiny-mistral", _set("rope_parameters.rope_theta", 10000.5), "is not a whole number"),
    ("rope-theta-4x-fraction", "qwen25-05b-published", _set("rope_theta", 1e6 + 0.25), "is not a whole number"),
    ("rope-linear", "tiny-mistral", _set("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope scaling type 'linear'"),
    ("rope-dynamic", "tiny-mistral", _set("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}),
     "rope scaling type 'dynamic'"),
    ("rope-yarn-4x", "qwen25-05b-published", _set("rope_scaling", {"type": "yarn", "factor": 4.0}),
     "rope scaling type 'yarn'"),
    ("rope-longrope", "tiny-mistral", _set("rope_parameters", {"rope_type": "longrope"}), "rope scaling type 'longrope'"),
    ("llama3-low-freq", "tiny-llama3", _set("rope_parameters.low_freq_factor", 2.0),
     "rope scaling low_freq_factor: 2.0, but Megatron-Core's llama3 RoPE scaling is fixed at 1"),
    ("llama3-high-freq-4x", "llama31-8b-published", _set("rope_scaling.high_freq_factor", 8.0),
     "high_freq_factor: 8.0, but"),
    ("llama3-original-context", "tiny-llama3", _set("rope_parameters.original_max_position_embeddings", 4096),
     "original_max_position_embeddings: 4096, but"),
    ("llama3-factor-below-one", "tiny-llama3", _set("rope_parameters.factor", 0.5), "factor: expected a number >= 1"),
    ("rope-parameters-not-object", "tiny-llama3", _set("rope_parameters", "llama3"), "rope_parameters: expected an object"),
    ("attention-bias-llama", "tiny-llama3", _set("attention_bias", True), "attention_bias: True"),
    ("attention-bias-qwen3", "tiny-qwen3", _set("attention_bias", True), "attention_bias: True"),
    ("mlp-bias", "tiny-llama3", _set("mlp_bias", True), "mlp_bias: True; MLP biases: the converter cannot"),
    ("pretraining-tp", "tiny-llama3", _set("pretraining_tp", 2), "pretraining_tp: 2; the converter cannot"),
    ("partial-rotary", "tiny-llama3", _set("partial_rotary_factor", 0.5), "partial_rotary_factor: 0.5; the converter"),
    ("moe-num-local-experts", "tiny-mistral", _set("num_local_experts", 8), "num_local_experts: mixture-of-experts"),
    ("moe-num-experts", "tiny-qwen3", _set("num_experts", 8), "num_experts: mixture-of-experts"),
    ("moe-intermediate", "tiny-qwen3", _set("moe_intermediate_size", 64), "moe_intermediate_size: mixture-of-experts"),
    ("moe-router", "tiny-qwen3", _set("router_aux_loss_coef", 0.01), "router_aux_loss_coef: mixture-of-experts"),
    ("quantized", "tiny-llama3", _set("quantization_config", {"quant_method": "fp8"}), "quantization_config: quantized"),
    ("custom-code", "tiny-llama3", _set("auto_map", {"AutoModel": "x.Model"}), "auto_map: the model needs custom code"),
    ("mistral-window", "tiny-mistral", _set("sliding_window", 128),
     "sliding_window: 128 tokens is shorter than the sequence (256)"),
    ("qwen2-window-on", "tiny-qwen2", lambda d: d.update(use_sliding_window=True, sliding_window=64),
     "sliding_window: 64 tokens is shorter"),
    ("qwen3-sliding-layer", "tiny-qwen3",
     lambda d: d.update(sliding_window=32, layer_types=["full_attention"] * 3 + ["sliding_attention"]),
     "sliding_window: 32 tokens is shorter"),
    ("sliding-layer-no-window", "tiny-qwen3", _set("layer_types", ["sliding_attention"] * 4),
     "sliding_attention layers without a sliding_window"),
    ("layer-type-unknown", "tiny-qwen3", _set("layer_types", ["full_attention"] * 3 + ["chunked_attention"]),
     "layer_types: 'chunked_attention': the converter cannot represent"),
    ("layer-types-short", "tiny-qwen2", _set("layer_types", ["full_attention"]), "expected a list of 4 entries"),
    ("unknown-key", "tiny-llama3", _set("logit_scale", 0.5),
     "config.json field logit_scale is not known to the converter; it may change the model's math; remove it only "
     "if you know it does not"),
    ("unknown-key-4x", "qwen25-05b-published", _set("use_mrope", False), "field use_mrope is not known"),
    ("tie-not-bool", "tiny-llama3", _set("tie_word_embeddings", "false"), "tie_word_embeddings: expected true or false"),
    ("dropout-string", "tiny-llama3", _set("attention_dropout", "0"), "attention_dropout: expected a number"),
    ("head-dim-zero", "tiny-qwen3", _set("head_dim", 0), "head_dim: expected an integer >= 1, got 0"),
    ("hidden-not-divisible", "tiny-mistral", lambda d: (d.pop("head_dim"), d.update(hidden_size=66)),
     "hidden_size 66 is not divisible by num_attention_heads 4 and head_dim is not given"),
]


@pytest.mark.parametrize("case_id,base,mutate,fragment", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusals_name_the_field(case_id, base, mutate, fragment):
    d = copy.deepcopy(config(base))
    mutate(d)
    with pytest.raises(HfConfigError) as exc:
        parse_config(d)
    assert any(fragment in p for p in exc.value.problems), exc.value.problems


MOE_EXPECTED = {
    "tiny-qwen3-moe": {"numExperts": 8, "moeRouterTopk": 2, "moeFfnHiddenSize": 32, "moeRouterPreSoftmax": True,
                       "moeAuxLossCoeff": 0.001, "ffnHiddenSize": 96, "qkLayernorm": True, "kvChannels": 32},
    "tiny-mixtral": {"numExperts": 4, "moeRouterTopk": 2, "moeFfnHiddenSize": 96, "moeAuxLossCoeff": 0.001,
                     "ffnHiddenSize": 96},
    # Qwen2-MoE: Qwen3-MoE's router, one gated shared expert, QKV bias, no QK norm
    "tiny-qwen2-moe": {"numExperts": 8, "moeRouterTopk": 2, "moeFfnHiddenSize": 32, "moeRouterPreSoftmax": True,
                       "moeSharedExpertIntermediateSize": 48, "moeSharedExpertGate": True, "addQkvBias": True,
                       "qkLayernorm": None, "moeAuxLossCoeff": 0.001, "ffnHiddenSize": 96},
}


@pytest.mark.parametrize("name", sorted(MOE_FIXTURES))
def test_moe_configs_map_to_the_moe_fields(name, tmp_path):
    """Qwen3-MoE, Qwen2-MoE and Mixtral (issue 50): hf-config prints their experts, router and experts' hidden size, a block
    admission takes (at tensor 2: the experts split over 2 expert-tensor ranks, no biases), and --check finds
    nothing to tell apart."""
    r = cli("hf-config", str(FIXTURES / f"{name}.json"))
    assert r.returncode == 0, r.stderr
    model = yaml.safe_load(r.stdout)["model"]
    assert {k: model.get(k) for k in MOE_EXPECTED[name]} == MOE_EXPECTED[name]
    if name == "tiny-mixtral":  # renormalised top-k: Megatron's default
        assert "moeRouterPreSoftmax" not in model
    if name != "tiny-qwen2-moe":  # no shared experts
        assert "moeSharedExpertIntermediateSize" not in model and "moeSharedExpertGate" not in model
    job = make_job(numNodes=1, parallelism={"tensor": 2, "expert": 2}, model=model,
                   training={"trainIters": 10, "microBatchSize": 1})
    assert cli("validate", write(tmp_path, "job.yaml", [job])).returncode == 0
    r = cli("hf-config", str(FIXTURES / f"{name}.json"), "--check", write(tmp_path, "job.yaml", [job]))
    assert r.returncode == 0, r.stdout + r.stderr


# A 4.x-layout Qwen2-MoE config.json (top-level rope_theta, torch_dtype, no qkv_bias or mlp_only_layers) of
# Qwen1.5-MoE-A2.7B's shape: the defaults of transformers' Qwen2MoeConfig, which are that model's.
QWEN2_MOE_4X = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
    "router_aux_loss_coef": 0.001}


def test_a_4x_layout_qwen2_moe_file_maps_and_its_job_is_admitted(tmp_path):
    """The 4.x layout reads as transformers 5 does (QKV bias when qkv_bias is absent); the printed block is
    admitted at expert 4 (60 experts), and at expert 8 admission names the experts' divisibility."""
    r = cli("hf-config", write(tmp_path, "config.json", json.dumps(QWEN2_MOE_4X)), "--seq-length", "8192")
    assert r.returncode == 0, r.stderr
    model = yaml.safe_load(r.stdout)["model"]
    assert {k: model.get(k) for k in ("numExperts", "moeRouterTopk", "moeFfnHiddenSize", "moeRouterPreSoftmax",
                                      "moeSharedExpertIntermediateSize", "moeSharedExpertGate", "addQkvBias",
                                      "qkLayernorm", "numQueryGroups", "rotaryBase")} == {
        "numExperts": 60, "moeRouterTopk": 4, "moeFfnHiddenSize": 1408, "moeRouterPreSoftmax": True,
        "moeSharedExpertIntermediateSize": 5632, "moeSharedExpertGate": True, "addQkvBias": True,
        "qkLayernorm": None, "numQueryGroups": 16, "rotaryBase": 1000000}
    training = {"trainIters": 10, "microBatchSize": 1}
    job = make_job(numNodes=1, gpusPerNode=8, parallelism={"tensor": 2, "expert": 4}, model=model, training=training)
    assert cli("validate", write(tmp_path, "job.yaml", [job])).returncode == 0
    r = cli("hf-config", str(tmp_path / "config.json"), "--check", str(tmp_path / "job.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    job8 = make_job(numNodes=1, gpusPerNode=8, parallelism={"expert": 8}, model=model, training=training)
    r = cli("validate", write(tmp_path, "job8.yaml", [job8]))
    assert r.returncode == 1 and ("spec.model.numExperts: 60 experts are not divisible by spec.parallelism.expert 8"
                                  in r.stdout + r.stderr), r.stdout + r.stderr


@pytest.mark.parametrize("name, field, value, fragment", [
    ("tiny-qwen3-moe", "numExperts", 16, "spec.model.numExperts: 16 does not match config.json the number of "
                                         "experts 8"),
    ("tiny-qwen3-moe", "moeRouterPreSoftmax", False, "spec.model.moeRouterPreSoftmax: false does not match "
                                                     "config.json norm_topk_prob (negated) true"),
    ("tiny-qwen3-moe", "moeFfnHiddenSize", 64, "spec.model.moeFfnHiddenSize: 64 does not match config.json "
                                               "moe_intermediate_size 32"),
    ("tiny-mixtral", "moeRouterTopk", 1, "spec.model.moeRouterTopk: 1 does not match config.json num_experts_per_tok 2"),
    ("tiny-qwen2-moe", "moeSharedExpertIntermediateSize", 64, "spec.model.moeSharedExpertIntermediateSize: 64 does "
                                                              "not match config.json shared_expert_intermediate_size 48"),
    ("tiny-qwen2-moe", "moeSharedExpertGate", False, "spec.model.moeSharedExpertGate: false does not match config.json "
                                                     "architecture Qwen2MoeForCausalLM (shared expert gate) true"),
    ("tiny-qwen3-moe", "moeSharedExpertIntermediateSize", 64, "spec.model.moeSharedExpertIntermediateSize: 64 does "
                                                              "not match config.json architecture Qwen3MoeForCausalLM "
                                                              "(shared experts) not set"),
    ("tiny-mixtral", "moeRouterScoreFunction", "sigmoid", "spec.model.moeRouterScoreFunction: sigmoid does not match "
                                                          "config.json architecture MixtralForCausalLM (router scores) "
                                                          "softmax"),
])
def test_check_names_a_moe_field_that_differs(name, field, value, fragment, tmp_path):
    model = yaml.safe_load(cli("hf-config", str(FIXTURES / f"{name}.json")).stdout)["model"]
    model[field] = value
    if field == "moeRouterTopk":
        model["moeRouterPreSoftmax"] = True  # top-1 needs it (admission)
    job = make_job(numNodes=1, parallelism={"tensor": 2}, model=model, training={"trainIters": 10})
    r = cli("hf-config", str(FIXTURES / f"{name}.json"), "--check", write(tmp_path, "job.yaml", [job]))
    assert r.returncode == 1 and fragment in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("arch, fragment", [
    ("DeepseekV2ForCausalLM", "multi-head latent attention (MLA)"),
    ("GptOssForCausalLM", "attention sinks"),
])
def test_architectures_refused_with_the_reason(arch, fragment):
    d = config("tiny-llama3")
    d["architectures"] = [arch]
    with pytest.raises(HfConfigError) as exc:
        parse_config(d)
    assert f"{arch} is not supported: the converter cannot represent" in str(exc.value) and fragment in str(exc.value)


def test_refusal_through_the_cli_is_one_line_per_problem_and_exit_1(tmp_path):
    d = config("tiny-llama3")
    d.update(mlp_bias=True, logit_scale=1.0)
    r = cli("hf-config", write(tmp_path, "config.json", json.dumps(d)))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 2 and r.stdout == ""


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(sliding_window=4096, use_sliding_window=False),  # qwen2: window off
    lambda d: d.update(use_sliding_window=True, sliding_window=256),  # window as long as the sequence
    lambda d: d.update(_name_or_path="x", output_attentions=False, output_hidden_states=False, return_dict=True,
                       torch_dtype="bfloat16", max_window_layers=21, transformers_version="4.99"),
    lambda d: d.update(rope_scaling=None),
    lambda d: d.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000}),
], ids=["window-off", "window-covers-sequence", "info-only", "rope-scaling-null", "int-theta"])
def test_what_does_not_change_the_math_is_accepted(mutate):
    d = copy.deepcopy(config("tiny-qwen2"))
    mutate(d)
    assert spec_model(parse_config(d)) == EXPECTED["tiny-qwen2"]


@pytest.mark.parametrize("content,fragment", [
    ("{", "invalid JSON: line 1, column 2"),
    ("[1, 2]", "not a JSON object (got list)"),
    ('"text"', "not a JSON object (got str)"),
    ('{"a": 1, "a": 2}', "key 'a' is given twice"),
    ("[" * 100000 + "]" * 100000, "invalid JSON"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (" " * MAX_CONFIG_BYTES + "{}", f"larger than {MAX_CONFIG_BYTES} bytes"),
], ids=["truncated", "list", "string", "duplicate-key", "deep", "binary", "too-large"])
def test_bad_files_are_one_line_and_exit_1(tmp_path, content, fragment):
    p = tmp_path / "config.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = cli("hf-config", str(p))
    assert r.returncode == 1, r.stdout
    assert r.stderr.strip() == r.stderr.strip().splitlines()[0] and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"{p}: ") and fragment in r.stderr


def test_missing_file_and_directory(tmp_path):
    for path in (tmp_path / "nope.json", tmp_path):
        r = cli("hf-config", str(path))
        assert r.returncode == 1 and r.stderr.startswith(f"{path}: cannot read") and "Traceback" not in r.stderr


def test_missing_manifest_for_check():
    r = cli("hf-config", str(FIXTURES / "tiny-llama3.json"), "--check", "/nonexistent/job.yaml")
    assert r.returncode == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("key,value,field", [("vocab_size", 10**7, "vocabSize"), ("rms_norm_eps", 1, "normEpsilon"),
                                             ("attention_dropout", 1.5, "attentionDropout"),
                                             ("rope_parameters", {**config("tiny-llama3")["rope_parameters"],
                                                                  "factor": 2048.0}, "ropeScalingFactor")])
def test_block_outside_the_specs_bounds_is_refused(tmp_path, key, value, field):
    d = config("tiny-llama3")
    d[key] = value
    r = cli("hf-config", write(tmp_path, "config.json", json.dumps(d)))
    assert r.returncode == 1 and f"spec.model.{field}" in r.stderr and "Traceback" not in r.stderr


def test_the_finetune_example_matches_the_published_llama31_config():
    example = Path(__file__).parents[2] / "examples" / "llama3-8b-finetune.yaml"
    r = cli("hf-config", str(FIXTURES / "llama31-8b-published.json"), "--check", str(example))
    assert r.returncode == 0, r.stderr


# Qwen3-30B-A3B's config.json as published (transformers 4.51 layout).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_the_qwen3_moe_example_is_what_hf_config_prints_for_qwen3_30b_a3b(tmp_path):
    example = Path(__file__).parents[2] / "examples" / "qwen3-moe-30b-a3b.yaml"
    config = write(tmp_path, "config.json", json.dumps(QWEN3_30B_A3B))
    r = cli("hf-config", config, "--check", str(example))
    assert r.returncode == 0, r.stdout + r.stderr
    printed = yaml.safe_load(cli("hf-config", config).stdout)["model"]
    # the dispatcher is the layout's choice (expert parallel 8), not the file's
    assert yaml.safe_load(example.read_text())["spec"]["model"] == {**printed, "moeTokenDispatcherType": "alltoall"}
