"""The Hugging Face converter's torch-free parts, in CI: config.json mapping and refusals, bounded and
checked safetensors reading, the per-TP-rank plans (QKV/GQA interleaving, SwiGLU halves, vocab
padding) round-tripped on random tensors against an independent construction of Megatron's layout,
and the source check (`validate_source`) on real files. The logits against transformers run in
tests/trainer/test_hf_torch.py and the GPU suite (torch needed)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import without
from megatron_trainer.config import parse_args
from megatron_trainer.exitcodes import ExitCode, Fatal
from megatron_trainer.hf_config import (
    HfConfigError,
    export_config,
    generation_config,
    mismatches,
    parse_config,
)
from megatron_trainer.hf_mapping import exported_by, hf_tensor_shapes, megatron_names, param_plan
from megatron_trainer.hf_source import MARKER, PARTIAL_MARKER, prepare_export_dir, validate_source
from megatron_trainer.safetensors_io import (
    MAX_HEADER_BYTES,
    PlannedTensor,
    SafetensorsCheckpoint,
    SafetensorsError,
    StreamingWriter,
    plan_shards,
    read_header,
    read_rows_into,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
CONFIGS = sorted(p.stem for p in FIXTURES.glob("*.json"))


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


# ------------------------------------------------------------------------------------ config.json
@pytest.mark.parametrize("name", CONFIGS)
def test_every_fixture_parses(name):
    m = parse_config(fixture(name), seq_length=128)
    assert m.num_layers >= 4 and m.vocab_size > 0 and m.head_dim > 0


def test_mapping_of_the_published_layouts():
    llama = parse_config(fixture("llama31-8b-published"), 8192)
    assert (llama.family, llama.num_layers, llama.hidden_size, llama.num_heads, llama.num_kv_heads) == \
        ("llama", 32, 4096, 32, 8)
    assert (llama.ffn_hidden_size, llama.vocab_size, llama.rope_theta, llama.rope_scaling_factor) == \
        (14336, 128256, 500000.0, 8.0)
    assert (llama.norm_epsilon, llama.tied, llama.qkv_bias, llama.qk_norm, llama.head_dim) == (1e-5, False, False,
                                                                                                False, 128)
    qwen = parse_config(fixture("qwen25-05b-published"), 4096)
    assert (qwen.family, qwen.tied, qwen.qkv_bias, qwen.num_kv_heads, qwen.head_dim) == ("qwen2", True, True, 2, 64)
    q3 = parse_config(fixture("tiny-qwen3"), 128)
    assert q3.qk_norm and q3.head_dim == 32 and q3.explicit_head_dim


def _mutated(name: str, **changes) -> dict:
    d = fixture(name)
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("config, message", [
    (_mutated("tiny-llama3", architectures=["GPT2LMHeadModel"]), "is not supported"),
    (_mutated("tiny-llama3", model_type="qwen2"), "does not match architecture"),
    (_mutated("tiny-llama3", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope scaling type 'yarn'"),
    (_mutated("tiny-llama3", rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
     "rope scaling type 'linear'"),
    (_mutated("tiny-llama3", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                              "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}), "low_freq_factor"),
    (_mutated("tiny-llama3", rope_parameters={"rope_type": "default", "rope_theta": 10000.5}), "not a whole number"),
    (_mutated("tiny-llama3", attention_bias=True), "attention_bias"),
    (_mutated("tiny-llama3", mlp_bias=True), "mlp_bias"),
    (_mutated("tiny-llama3", pretraining_tp=2), "pretraining_tp"),
    (_mutated("tiny-llama3", hidden_act="gelu"), "hidden_act"),
    (_mutated("tiny-llama3", partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_mutated("tiny-llama3", num_local_experts=8, num_experts_per_tok=2), "mixture-of-experts"),
    (_mutated("tiny-llama3", quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (_mutated("tiny-llama3", auto_map={"AutoModel": "x.Y"}), "custom code"),
    (_mutated("tiny-llama3", some_new_knob=3), "field some_new_knob is not known to the converter"),
    (_mutated("tiny-mistral", sliding_window=64), "sliding_window: 64 tokens is shorter than the sequence (128)"),
    (_mutated("tiny-qwen2", use_sliding_window=True, sliding_window=100), "shorter than the sequence"),
    (_mutated("tiny-qwen2", layer_types=["full_attention"] * 3 + ["chunked_attention"]), "chunked_attention"),
    (_mutated("tiny-llama3", num_key_value_heads=3), "does not divide"),
    (_mutated("tiny-llama3", hidden_size="64"), "hidden_size: expected an integer"),
    (_mutated("tiny-llama3", tie_word_embeddings="yes"), "tie_word_embeddings"),
])
def test_refusals_name_the_field(config, message):
    with pytest.raises(HfConfigError) as e:
        parse_config(config, seq_length=128)
    assert message in str(e.value)


def test_mapping_of_the_moe_fixtures():
    q = parse_config(fixture("tiny-qwen3-moe"), 128)
    assert (q.family, q.moe, q.num_experts, q.moe_topk, q.moe_ffn_hidden_size, q.moe_pre_softmax, q.qk_norm) == \
        ("qwen3_moe", True, 8, 2, 32, True, True)
    assert q.ffn_hidden_size == 96 and q.router_aux_loss_coef == 0.001  # the dense size; a training suggestion
    # the published Qwen3-MoE files spell it num_experts (transformers 5 writes num_local_experts), norm on
    published = _mutated("tiny-qwen3-moe", num_local_experts=None, num_experts=128, norm_topk_prob=True,
                         num_experts_per_tok=8)
    assert (lambda m: (m.num_experts, m.moe_topk, m.moe_pre_softmax))(parse_config(published, 128)) == (128, 8, False)
    x = parse_config(fixture("tiny-mixtral"), 128)
    assert (x.family, x.num_experts, x.moe_topk, x.moe_ffn_hidden_size, x.moe_pre_softmax, x.qk_norm) == \
        ("mixtral", 4, 2, 96, False, False)
    assert not parse_config(fixture("tiny-qwen3"), 128).moe
    # Qwen2-MoE: Qwen3-MoE's router plus one gated shared expert, QKV bias, no QK norm; 4.x files have no qkv_bias
    q2 = parse_config(fixture("tiny-qwen2-moe"), 128)
    assert (q2.family, q2.num_experts, q2.moe_topk, q2.moe_ffn_hidden_size, q2.moe_pre_softmax, q2.qk_norm,
            q2.qkv_bias, q2.shared_expert_ffn_hidden_size) == ("qwen2_moe", 8, 2, 32, True, False, True, 48)
    assert parse_config(_mutated("tiny-qwen2-moe", qkv_bias=None), 128).qkv_bias
    assert not parse_config(_mutated("tiny-qwen2-moe", qkv_bias=False), 128).qkv_bias
    assert q.shared_expert_ffn_hidden_size == 0 and x.shared_expert_ffn_hidden_size == 0


@pytest.mark.parametrize("config, message", [
    (_mutated("tiny-qwen3-moe", num_experts=16), "num_local_experts 8 and num_experts 16 disagree"),
    (_mutated("tiny-qwen3-moe", num_experts_per_tok=9), "num_experts_per_tok 9 is more than the 8 experts"),
    (_mutated("tiny-qwen3-moe", num_experts_per_tok=1, norm_topk_prob=True), "num_experts_per_tok 1 with renormalised"),
    (_mutated("tiny-qwen3-moe", norm_topk_prob="yes"), "norm_topk_prob: expected true or false"),
    (_mutated("tiny-qwen3-moe", moe_intermediate_size=None), "moe_intermediate_size: expected an integer"),
    (_mutated("tiny-mixtral", router_jitter_noise=0.01), "router_jitter_noise: 0.01; router input jitter"),
    (_mutated("tiny-qwen2-moe", shared_expert_intermediate_size=0), "shared_expert_intermediate_size: expected an "
                                                                    "integer >= 1, got 0"),
    (_mutated("tiny-qwen2-moe", shared_expert_intermediate_size=None), "shared_expert_intermediate_size: expected"),
    (_mutated("tiny-qwen2-moe", qkv_bias="yes"), "qkv_bias: expected true or false, got 'yes'"),
    (_mutated("tiny-qwen3-moe", shared_expert_intermediate_size=64), "shared_expert_intermediate_size: "
                                                                     "mixture-of-experts field not one of this "
                                                                     "architecture's"),
    (_mutated("tiny-mixtral", qkv_bias=True), "field qkv_bias is not known to the converter"),
    (_mutated("tiny-mixtral", sliding_window=64), "sliding_window: 64 tokens is shorter than the sequence (128)"),
    (_mutated("tiny-qwen3-moe", architectures=["DeepseekV2ForCausalLM"]), "multi-head latent attention (MLA)"),
    (_mutated("tiny-qwen3-moe", architectures=["GptOssForCausalLM"]), "attention sinks"),
    (_mutated("tiny-qwen3-moe", shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
])
def test_moe_refusals_name_the_field(config, message):
    with pytest.raises(HfConfigError) as e:
        parse_config(config, seq_length=128)
    assert message in str(e.value)


@pytest.mark.parametrize("config, what", [
    (_mutated("tiny-qwen3-moe", mlp_only_layers=[0, 2]), "dense MLP layers among the MoE layers"),
    (_mutated("tiny-qwen3-moe", decoder_sparse_step=2), "dense MLP layers among the MoE layers"),
    (_mutated("tiny-qwen2-moe", mlp_only_layers=[1]), "dense MLP layers among the MoE layers"),
])
def test_what_the_converter_does_not_map_yet_is_refused_at_import(config, what):
    """issue 61: megatron_contract parses dense-layer Qwen3-MoE, DeepSeek-V3 and GLM-4.5 files (hf-config maps them);
    the trainer's weight converter refuses them by name until hf_mapping maps their weights."""
    from megatron_trainer.hf_config import not_converted
    from megatron_trainer.hf_source import parse_for

    hf = parse_config(config, seq_length=128)
    assert any(what in line for line in not_converted(hf))
    with pytest.raises(Fatal) as e:
        parse_for(parse_args(_argv_for("tiny-qwen3-moe")), config)
    assert "does not map" in str(e.value)


def test_a_sliding_window_at_least_the_sequence_is_accepted():
    assert parse_config(_mutated("tiny-mistral", sliding_window=128), 128).family == "mistral"


def _argv_for(name: str, **over) -> list[str]:
    """The flags hf_cpu_check would pass (= what hf-config + render give) for a fixture."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_cpu_check import trainer_argv

    return trainer_argv(_mutated(name, **over), 1, 1, "bf16")


@pytest.mark.parametrize("name", [c for c in CONFIGS if c.startswith("tiny-")])
def test_flags_from_the_config_match_it(name):
    cfg = parse_args(_argv_for(name))
    assert mismatches(cfg, parse_config(fixture(name), cfg.model.seq_length)) == []


def test_a_moe_mismatch_names_both_values():
    argv = without(_argv_for("tiny-qwen3-moe"), "--num-experts", "--moe-router-pre-softmax") + ["--num-experts", "4"]
    problems = mismatches(parse_args(argv), parse_config(fixture("tiny-qwen3-moe"), 24))
    assert "--num-experts 4 does not match config.json the number of experts 8" in problems
    assert "--moe-router-pre-softmax False does not match config.json norm_topk_prob (negated) True" in problems
    argv = without(_argv_for("tiny-mixtral"), "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                   "--expert-model-parallel-size")
    assert "--num-experts None does not match config.json the number of experts 4" in \
        mismatches(parse_args(argv), parse_config(fixture("tiny-mixtral"), 24))
    dense = mismatches(parse_args(_argv_for("tiny-llama3") + ["--num-experts", "4"]),
                       parse_config(fixture("tiny-llama3"), 24))
    assert "--num-experts 4: the Hugging Face model is dense" in dense


def test_shared_experts_and_sigmoid_routing_are_not_qwen3_moe_or_mixtral():
    """Neither architecture has shared experts or sigmoid scores (so no expert bias either): refused by name, for an
    import and an export alike (both compare the flags with config.json); capacity dropping changes no weight."""
    argv = _argv_for("tiny-qwen3-moe") + ["--moe-shared-expert-intermediate-size", "64", "--moe-router-score-function",
                                         "sigmoid", "--moe-router-enable-expert-bias", "--moe-expert-capacity-factor",
                                         "1.0"]
    problems = mismatches(parse_args(argv), parse_config(fixture("tiny-qwen3-moe"), 24))
    assert [p.split(" does not match")[0] for p in problems] == ["--moe-shared-expert-intermediate-size 64",
                                                                 "--moe-router-score-function sigmoid"], problems
    assert "config.json architecture Qwen3MoeForCausalLM (shared experts) None" in problems[0]


def test_qwen2_moe_needs_its_gated_shared_expert():
    """Qwen2-MoE's flags (hf_cpu_check.trainer_argv: the shared expert's size and its gate) match its config.json;
    without the gate, or with another size, the import is refused naming both values."""
    argv = _argv_for("tiny-qwen2-moe")
    m = parse_config(fixture("tiny-qwen2-moe"), 24)
    assert "--moe-shared-expert-gate" in argv and mismatches(parse_args(argv), m) == []
    ungated = [a for a in argv if a != "--moe-shared-expert-gate"]
    assert mismatches(parse_args(ungated), m) == [
        "--moe-shared-expert-gate False does not match config.json architecture Qwen2MoeForCausalLM (shared expert "
        "gate) True"]
    i = argv.index("--moe-shared-expert-intermediate-size")
    wider = argv[:i + 1] + ["64"] + argv[i + 2:]
    assert mismatches(parse_args(wider), m) == [
        "--moe-shared-expert-intermediate-size 64 does not match config.json shared_expert_intermediate_size 48"]


def test_a_mismatch_names_both_values():
    argv = without(_argv_for("tiny-llama3"), "--hidden-size", "--norm-epsilon") + ["--hidden-size", "128",
                                                                                   "--norm-epsilon", "1e-5"]
    problems = mismatches(parse_args(argv), parse_config(fixture("tiny-llama3"), 24))
    assert "--hidden-size 128 does not match config.json hidden_size 64" in problems
    assert any("--norm-epsilon 1e-05 does not match config.json rms_norm_eps 1e-06" in p for p in problems)
    argv = without(_argv_for("tiny-llama3"), "--use-rope-scaling", "--rope-scaling-factor")
    assert any("rope scaling llama3 factor 8" in p for p in
               mismatches(parse_args(argv), parse_config(fixture("tiny-llama3"), 24)))


@pytest.mark.parametrize("name", [c for c in CONFIGS if c.startswith("tiny-")])
def test_config_written_from_the_flags_describes_the_same_model(name):
    """An export of a model not imported from HF writes config.json from the flags alone."""
    cfg = parse_args(_argv_for(name))
    a, b = parse_config(export_config(cfg, None, "bfloat16"), 24), parse_config(fixture(name), 24)
    fields = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
              "head_dim", "norm_epsilon", "rope_theta", "rope_scaling_factor", "tied", "qkv_bias", "qk_norm",
              "num_experts", "moe_topk", "moe_ffn_hidden_size", "moe_pre_softmax", "shared_expert_ffn_hidden_size")
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    # Mistral without a sliding window is Llama's math: written as LlamaForCausalLM
    assert a.family == (b.family if b.family != "mistral" else "llama") and a.dtype == "bfloat16"


@pytest.mark.parametrize("content", ['{"do_sample": true, "temperature": 0.6}', "{", "[1]", "[" * 100000 + "]" * 100000],
                         ids=["valid", "truncated", "not-an-object", "deep"])
def test_generation_config_is_the_sources_else_the_token_ids(tmp_path, content):
    """An export copies the source's generation_config.json; one that cannot be read (a deeply nested one
    raised RecursionError out of the export) gives way to config.json's token ids."""
    (tmp_path / "generation_config.json").write_text(content)
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    expected = {"do_sample": True, "temperature": 0.6} if content.startswith('{"') else {"bos_token_id": 1,
                                                                                          "eos_token_id": 2}
    assert generation_config(tmp_path, ids) == expected
    assert generation_config(None, ids) == {"bos_token_id": 1, "eos_token_id": 2}


# ------------------------------------------------------------------------------------ safetensors
def write_file(path: Path, tensors: dict[str, np.ndarray]) -> None:
    planned = [PlannedTensor(k, {"float32": "F32", "float16": "F16"}[str(v.dtype)], v.shape) for k, v in
               tensors.items()]
    w = StreamingWriter(path, planned)
    for k, v in tensors.items():
        w.write(k, np.ascontiguousarray(v))
    w.close()


def test_streaming_writer_is_read_back_by_the_safetensors_library(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16)}
    write_file(tmp_path / "x.safetensors", tensors)
    back = safetensors_numpy.load_file(str(tmp_path / "x.safetensors"))
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())


def test_rows_are_read_into_the_callers_buffer(tmp_path):
    a = np.arange(40, dtype=np.float32).reshape(10, 4)
    write_file(tmp_path / "x.safetensors", {"a": a})
    info = read_header(tmp_path / "x.safetensors")["a"]
    out = np.empty((3, 4), dtype=np.float32)
    read_rows_into(info, 2, 5, memoryview(out).cast("B"))
    assert np.array_equal(out, a[2:5])


def test_a_header_claiming_any_size_is_refused_before_allocation(tmp_path):
    p = tmp_path / "bomb.safetensors"
    p.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(SafetensorsError, match="header claims"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES - 1) + b"{}")
    with pytest.raises(SafetensorsError, match="truncated"):
        read_header(p)


def test_truncated_shard_and_bad_offsets(tmp_path):
    p = tmp_path / "x.safetensors"
    write_file(p, {"a": np.ones((64, 64), np.float32)})
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    with pytest.raises(SafetensorsError, match="truncated"):
        read_header(p)
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(SafetensorsError, match="do not hold"):
        read_header(p)


def test_index_naming_absent_or_escaping_files(tmp_path):
    write_file(tmp_path / "model-00001-of-00001.safetensors", {"a": np.ones(2, np.float32)})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors",
                                                "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(SafetensorsError, match="not in"):
        SafetensorsCheckpoint(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "../../etc/passwd.safetensors"}}))
    with pytest.raises(SafetensorsError, match="not a .safetensors file in the model directory"):
        SafetensorsCheckpoint(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors",
                                                "zz": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(SafetensorsError, match="which does not hold it"):
        SafetensorsCheckpoint(tmp_path)


def test_shards_respect_the_size_and_never_mix_stages():
    t = [(PlannedTensor(f"t{i}", "F32", (10,)), stage) for i, stage in enumerate([0, 0, 0, 1, 1])]
    shards = plan_shards(t, max_bytes=80)
    assert [(s, [x.name for x in ts]) for s, ts in shards] == [(0, ["t0", "t1"]), (0, ["t2"]), (1, ["t3", "t4"])]


# ------------------------------------------------------------------------------------ plans
def random_hf(m, rng) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(shape).astype(np.float32) for k, shape in hf_tensor_shapes(m).items()}


def megatron_reference(m, hf: dict, name: str, tp: int, padded: int) -> list[np.ndarray]:
    """Megatron's TP shards of one parameter, built the way Megatron lays them out (independently of
    the plans): QKV as [q heads of a group | k | v] per group, split evenly over TP; SwiGLU fc1 as
    [gate_r ; up_r]; row-parallel weights split along the input; vocab padded with zeros."""
    d, per = m.head_dim, m.num_heads // m.num_kv_heads
    L = name.split(".")[2] if name.startswith("decoder.layers.") else None
    p = f"model.layers.{L}."
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        s = name.rsplit(".", 1)[1]
        q, k, v = (hf[p + f"self_attn.{x}_proj.{s}"] for x in "qkv")
        rest = q.shape[1:]
        full = np.concatenate([q.reshape(m.num_kv_heads, per * d, *rest), k.reshape(m.num_kv_heads, d, *rest),
                               v.reshape(m.num_kv_heads, d, *rest)], axis=1).reshape(-1, *rest)
        return np.split(full, tp, axis=0)
    moe = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"), "qwen2_moe": ("mlp", "gate_proj", "up_proj",
                                                                                   "down_proj"),
           "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}.get(m.family)
    if ".shared_experts." in name:  # Qwen2-MoE's shared expert: a dense MLP split over TP; its gate replicated
        if name.endswith("gate_weight"):
            return [hf[p + "mlp.shared_expert_gate.weight"]] * tp
        if name.endswith("linear_fc1.weight"):
            g, u = np.split(hf[p + "mlp.shared_expert.gate_proj.weight"], tp), \
                np.split(hf[p + "mlp.shared_expert.up_proj.weight"], tp)
            return [np.concatenate([a, b]) for a, b in zip(g, u, strict=True)]
        return np.split(hf[p + "mlp.shared_expert.down_proj.weight"], tp, axis=1)
    if name.endswith("mlp.router.weight"):
        return [hf[p + f"{moe[0]}.gate.weight"]] * tp  # replicated
    if ".local_experts." in name:  # experts.E.{gate ; up} split over (expert) TP like the dense MLP
        e = int(name.split(".")[6])
        w = {k: hf[p + f"{moe[0]}.experts.{e}.{n}.weight"] for k, n in zip(("gate", "up", "down"), moe[1:], strict=True)}
        if name.endswith("linear_fc1.weight"):
            return [np.concatenate([a, b]) for a, b in zip(np.split(w["gate"], tp), np.split(w["up"], tp), strict=True)]
        return np.split(w["down"], tp, axis=1)
    if name.endswith("linear_fc1.weight"):
        g, u = np.split(hf[p + "mlp.gate_proj.weight"], tp), np.split(hf[p + "mlp.up_proj.weight"], tp)
        return [np.concatenate([a, b]) for a, b in zip(g, u, strict=True)]
    if name.endswith("linear_proj.weight"):
        return np.split(hf[p + "self_attn.o_proj.weight"], tp, axis=1)
    if name.endswith("linear_fc2.weight"):
        return np.split(hf[p + "mlp.down_proj.weight"], tp, axis=1)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        src = hf["model.embed_tokens.weight" if name.startswith("embedding") or m.tied else "lm_head.weight"]
        full = np.zeros((padded, src.shape[1]), np.float32)
        full[:src.shape[0]] = src
        return np.split(full, tp)
    plan = param_plan(name, m, 1, 0, padded)  # replicated norms: the whole HF tensor on every rank
    return [hf[plan.pieces[0].hf]] * tp


def apply(plan, hf: dict) -> np.ndarray:
    out = np.zeros(plan.shape, np.float32)
    for piece in plan.pieces:
        src = np.take(hf[piece.hf], range(*piece.src), axis=piece.axis)
        idx = [slice(None)] * out.ndim
        idx[piece.axis] = slice(*piece.dst)
        out[tuple(idx)] = src
    return out


@pytest.mark.parametrize("name, tp", [("tiny-llama3", 1), ("tiny-llama3", 2), ("tiny-llama3", 4),
                                      ("tiny-qwen2", 2), ("tiny-qwen3", 2), ("tiny-llama32-tied", 2),
                                      ("tiny-mistral", 4), ("tiny-qwen3-moe", 1), ("tiny-qwen3-moe", 2),
                                      ("tiny-qwen2-moe", 2), ("tiny-mixtral", 4)])
def test_plans_build_megatrons_layout_and_export_inverts_them(name, tp):
    """GQA with TP < groups, = groups and > groups (tiny models have 2 KV heads), QKV bias, QK norm,
    tied embeddings, a vocabulary (1001) that TP does not divide; MoE routers and every expert's weights (here
    split over TP: the expert TP the caller passes for them)."""
    m = parse_config(fixture(name), 24)
    rng = np.random.default_rng(tp)
    hf = random_hf(m, rng)
    padded = -(-m.vocab_size // (128 * tp)) * 128 * tp
    rebuilt = {k: np.full(v.shape, np.nan, np.float32) for k, v in hf.items()}
    for name_ in megatron_names(m) + (["output_layer.weight"] if m.tied else []):
        shards = []
        for r in range(tp):
            plan = param_plan(name_, m, tp, r, padded)
            shard = apply(plan, hf)
            shards.append(shard)
            assert np.array_equal(shard, megatron_reference(m, hf, name_, tp, padded)[r]), (name_, r)
        if name_ == "output_layer.weight" and m.tied:
            assert exported_by(name_, m) == []
            continue
        for r, shard in enumerate(shards):  # export: the same pieces, the other way
            for piece in param_plan(name_, m, tp, r, padded).pieces:
                dst = [slice(None)] * shard.ndim
                dst[piece.axis] = slice(*piece.src)
                src = [slice(None)] * shard.ndim
                src[piece.axis] = slice(*piece.dst)
                rebuilt[piece.hf][tuple(dst)] = shard[tuple(src)]
    assert all(np.array_equal(rebuilt[k], hf[k]) for k in hf), [k for k in hf if not np.array_equal(rebuilt[k], hf[k])]


def test_unknown_parameter_is_refused():
    m = parse_config(fixture("tiny-llama3"), 24)
    with pytest.raises(ValueError, match="no Hugging Face tensor"):
        param_plan("decoder.layers.0.mlp.router.weight", m, 1, 0, 1024)
    with pytest.raises(ValueError, match="has no QKV bias"):
        param_plan("decoder.layers.0.self_attention.linear_qkv.bias", m, 1, 0, 1024)


# ------------------------------------------------------------------------------------ the source check
def hf_dir(tmp_path: Path, name: str, tokenizer: bool = True, drop: str | None = None,
           reshape: str | None = None) -> Path:
    m = parse_config(fixture(name), 24)
    tensors = {k: np.zeros(v, np.float32) for k, v in hf_tensor_shapes(m).items() if k != drop}
    if reshape:
        tensors[reshape] = np.zeros((3,), np.float32)
    d = tmp_path / name
    d.mkdir()
    write_file(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(fixture(name)))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_source_check_of_a_moe_directory(tmp_path):
    cfg = parse_args(_argv_for("tiny-mixtral") + ["--hf-init", str(tmp_path / "tiny-mixtral")])
    src = validate_source(hf_dir(tmp_path, "tiny-mixtral"), cfg)
    assert src.model.num_experts == 4 and "model.layers.3.block_sparse_moe.experts.3.w2.weight" in src.checkpoint.tensors
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    (tmp_path / "again").mkdir()
    with pytest.raises(Fatal, match=f"missing tensor\\(s\\) {gone}"):
        validate_source(hf_dir(tmp_path / "again", "tiny-mixtral", drop=gone), cfg)


def test_source_check_accepts_a_complete_directory(tmp_path):
    d = hf_dir(tmp_path, "tiny-qwen3")
    src = validate_source(d, parse_args(_argv_for("tiny-qwen3")))
    assert src.model.qk_norm and len(src.checkpoint.tensors) == len(hf_tensor_shapes(src.model))


@pytest.mark.parametrize("kwargs, code, message", [
    ({"tokenizer": False}, ExitCode.BAD_CHECKPOINT, "no tokenizer"),
    ({"drop": "model.layers.2.mlp.up_proj.weight"}, ExitCode.BAD_CHECKPOINT, "missing tensor(s) model.layers.2"),
    ({"reshape": "model.norm.weight"}, ExitCode.BAD_CHECKPOINT, "model.norm.weight has shape [3]"),
])
def test_source_check_refuses_bad_files(tmp_path, kwargs, code, message):
    d = hf_dir(tmp_path, "tiny-llama3", **kwargs)
    with pytest.raises(Fatal) as e:
        validate_source(d, parse_args(_argv_for("tiny-llama3")))
    assert e.value.code == code and message in str(e.value)


def test_source_check_refuses_a_spec_that_does_not_match(tmp_path):
    d = hf_dir(tmp_path, "tiny-llama3")
    argv = without(_argv_for("tiny-llama3"), "--num-layers") + ["--num-layers", "8"]
    with pytest.raises(Fatal) as e:
        validate_source(d, parse_args(argv))
    assert e.value.code == ExitCode.BAD_ARGUMENTS and "--num-layers 8 does not match config.json " \
        "num_hidden_layers 4" in str(e.value)


def test_source_check_refuses_missing_config_and_extra_tensors(tmp_path):
    d = hf_dir(tmp_path, "tiny-llama3")
    (d / "config.json").unlink()
    with pytest.raises(Fatal, match="config.json: missing"):
        validate_source(d, parse_args(_argv_for("tiny-llama3")))
    d2 = hf_dir(tmp_path / "b", "tiny-llama3") if (tmp_path / "b").mkdir() is None else None
    m = parse_config(fixture("tiny-llama3"), 24)
    tensors = {k: np.zeros(v, np.float32) for k, v in hf_tensor_shapes(m).items()}
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
    (d2 / "model.safetensors").unlink()
    write_file(d2 / "model.safetensors", tensors)
    with pytest.raises(Fatal, match="no place for: model.layers.0.self_attn.q_proj.bias"):
        validate_source(d2, parse_args(_argv_for("tiny-llama3")))


# ------------------------------------------------------------------------------------ the export directory
def test_export_never_overwrites_a_directory_it_did_not_create(tmp_path):
    served = tmp_path / "models" / "served"
    served.mkdir(parents=True)
    (served / "config.json").write_text("{}")
    verdict, message = prepare_export_dir(served, 20)
    assert verdict == "fail" and "did not create" in message and (served / "config.json").read_text() == "{}"
    link = tmp_path / "models" / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    assert prepare_export_dir(link, 20)[0] == "fail"


def test_export_of_the_same_iteration_is_skipped_another_refused(tmp_path):
    done = tmp_path / "out"
    done.mkdir()
    (done / MARKER).write_text(json.dumps({"iteration": 20}))
    assert prepare_export_dir(done, 20)[0] == "skip"
    verdict, message = prepare_export_dir(done, 30)
    assert verdict == "fail" and "an export of iteration 20" in message


def test_export_starts_in_a_fresh_partial_directory_and_cleans_only_its_own(tmp_path):
    final = tmp_path / "exports" / "ft"
    ours = tmp_path / "exports" / ".ft.partial-10"
    ours.mkdir(parents=True)
    (ours / PARTIAL_MARKER).write_text("{}")
    (ours / "model-00001-of-00002.safetensors").write_bytes(b"half")
    foreign = tmp_path / "exports" / ".ft.partial-keep"
    foreign.mkdir()
    verdict, tmp = prepare_export_dir(final, 20)
    assert verdict == "go" and Path(tmp).name == ".ft.partial-20" and (Path(tmp) / PARTIAL_MARKER).is_file()
    assert not ours.exists() and foreign.exists() and not final.exists()


def test_a_shard_linked_out_of_the_model_directory_is_refused(tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    write_file(outside, {"a": np.ones(2, np.float32)})
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").symlink_to(outside)
    with pytest.raises(SafetensorsError, match="outside"):
        SafetensorsCheckpoint(d)
