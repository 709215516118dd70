"""CPU checks of the torch/Megatron-Core pieces. Skipped where torch or megatron-core is absent
(CI installs neither); run them with a venv that has both, e.g. `.venv-gpu`."""

from __future__ import annotations

import json
import math
import types

import pytest
from conftest import require

torch = require("torch")
require("megatron.core")


class _TP1:
    class tp:
        @staticmethod
        def size():
            return 1


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2)])
def test_sdpa_attention_matches_reference(heads, groups):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_trainer.attention import make_sdpa_attention

    cfg = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads, num_query_groups=groups)
    mod = make_sdpa_attention("auto")(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                      attention_type="self", attention_dropout=0.0, pg_collection=_TP1())
    s, b, d = 12, 3, 16
    q = torch.randn(s, b, heads, d, dtype=torch.float64)
    k, v = (torch.randn(s, b, groups, d, dtype=torch.float64) for _ in range(2))
    kk, vv = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    scores = torch.einsum("sbnd,tbnd->bnst", q, kk) / math.sqrt(d)
    ref = torch.einsum("bnst,tbnd->sbnd", scores.masked_fill(mask, float("-inf")).softmax(-1), vv).reshape(s, b, -1)
    assert torch.allclose(mod(q, k, v, None, attn_mask_type=AttnMaskType.causal), ref, atol=1e-12)
    # an explicit Megatron mask (True = masked out) gives the same
    assert torch.allclose(mod(q, k, v, mask.view(1, 1, s, s), attn_mask_type=AttnMaskType.causal), ref, atol=1e-12)


def _sdpa_node(t):
    """The SDPA node behind the attention module's output (which is a view of it)."""
    todo, seen = [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "ScaledDotProduct" in type(node).__name__:
            return node
        todo.extend(n for n, _ in node.next_functions)
    raise AssertionError("no SDPA node in the graph")


def test_the_logged_sdpa_kernel_is_the_first_eligible_of_the_priority_list(caplog):
    """attention.first_eligible walks the backend list in its priority order, as torch's select_sdp_backend does;
    torch's own checks reject the fused kernels for CPU tensors; a CPU forward logs nothing and leaves the
    once-per-class flag unset (the kernel line is for CUDA forwards, checked on the GPU by the suite)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_trainer.attention import (
        SDPA_BACKENDS,
        cuda_eligibility,
        first_eligible,
        make_sdpa_attention,
    )
    from torch.nn.attention import SDPBackend

    flashdet = SDPA_BACKENDS["flashdet"]
    assert first_eligible(flashdet, lambda b: True) == "FLASH_ATTENTION"
    assert first_eligible(flashdet, lambda b: b != SDPBackend.FLASH_ATTENTION) == "EFFICIENT_ATTENTION"
    assert first_eligible(flashdet, lambda b: b == SDPBackend.MATH) == "MATH"
    assert first_eligible(SDPA_BACKENDS["flash"], lambda b: b == SDPBackend.MATH) == "none"  # math not in the list
    q = torch.randn(1, 2, 8, 16)
    eligible = cuda_eligibility(torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, True, False))
    assert [eligible(b) for b in flashdet] == [False, False, True]
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    cls = make_sdpa_attention("flashdet")
    module = cls(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                 attention_dropout=0.0, pg_collection=_TP1())
    with caplog.at_level("INFO", logger="megatron_trainer.attention"):
        module(*(torch.randn(8, 1, 4, 16) for _ in range(3)), None, attn_mask_type=AttnMaskType.causal)
    assert not cls.kernel_logged and "SDPA kernel" not in caplog.text


def test_flashdet_attention_runs_its_backward_under_strict_determinism_and_restores_the_setting():
    """MEGATRON_TRAINER_DETERMINISTIC_ATTENTION=flash: the fused kernel's backward must see
    use_deterministic_algorithms(True, warn_only=False) (torch reads it when the backward runs), and the run's
    own warn-only setting must be back for every later node. The gradients are those of the math backend."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_trainer.attention import SDPA_BACKENDS, make_sdpa_attention

    heads, groups, s, b, d = 4, 2, 12, 2, 16
    cfg = TransformerConfig(num_layers=1, hidden_size=16 * heads, num_attention_heads=heads, num_query_groups=groups)

    def build(backend):
        return make_sdpa_attention(backend)(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self", attention_dropout=0.0, pg_collection=_TP1())

    strict, math_mod = build("flashdet"), build("math")
    assert strict.strict and not math_mod.strict and strict.backends == SDPA_BACKENDS["flashdet"]
    torch.manual_seed(0)
    inputs = [torch.randn(s, b, n, d) for n in (heads, groups, groups)]
    upstream = torch.randn(s, b, heads * d)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)  # what --deterministic-mode sets for the run
    try:
        seen: dict[str, tuple[bool, bool]] = {}

        def flags():
            return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()

        def record(name):
            def hook(*_):
                seen[name] = flags()  # returns None: the gradients stay as they are
            return hook

        q, k, v = (t.clone().requires_grad_(True) for t in inputs)
        out = strict(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        _sdpa_node(out).register_prehook(record("sdpa backward"))  # registered after ours: runs after it
        q.register_hook(record("after it"))
        out.backward(upstream)
        assert seen == {"sdpa backward": (True, False), "after it": (True, True)}
        assert flags() == (True, True)

        q2, k2, v2 = (t.clone().requires_grad_(True) for t in inputs)
        ref = math_mod(q2, k2, v2, None, attn_mask_type=AttnMaskType.causal)
        ref.backward(upstream)
        assert torch.allclose(out, ref, atol=1e-5)
        for got, want in ((q, q2), (k, k2), (v, v2)):
            assert torch.allclose(got.grad, want.grad, atol=1e-5)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_mode_picks_the_math_or_the_flashdet_attention(mock_argv):
    from megatron_trainer import model as M
    from megatron_trainer.attention import SDPA_BACKENDS
    from megatron_trainer.config import parse_args

    cfg = parse_args(mock_argv + ["--deterministic-mode"])
    path = M.choose_path(cfg, have_te=False)
    assert [M.deterministic_attention(cfg, path, r) for r in ("math", "flash")] == ["math", "flash"]
    unfused = parse_args(mock_argv + ["--deterministic-mode", "--attention-backend", "unfused"])
    assert M.deterministic_attention(unfused, M.choose_path(unfused, have_te=False), "flash") == ""
    assert M.deterministic_attention(cfg, M.ModelPath("transformer_engine", "TE"), "math") == ""
    assert M.deterministic_attention(parse_args(mock_argv), path, "flash") == ""  # no --deterministic-mode
    for mode, backend in (("math", "math"), ("flash", "flashdet")):
        path.deterministic_attention = mode
        core = M.layer_spec(cfg, path).submodules.self_attention.submodules.core_attention
        assert core.backends == SDPA_BACKENDS[backend] and core.strict == (mode == "flash"), mode
    for mode, text in (("flash", "SDPA (flash>efficient>math, deterministic backward: --deterministic-mode)"),
                       ("math", "SDPA (math: --deterministic-mode, MEGATRON_TRAINER_DETERMINISTIC_ATTENTION=math)")):
        fresh = M.choose_path(cfg, have_te=False)
        assert M.apply_deterministic_attention(cfg, fresh, mode, was_set=True) is None
        assert (fresh.deterministic_attention, fresh.attention) == (mode, text)
    plain = parse_args(mock_argv)
    path = M.choose_path(plain, have_te=False)
    before = path.attention
    assert M.apply_deterministic_attention(plain, path, "flash", was_set=False) is None  # the default: no log line
    assert (path.deterministic_attention, path.attention) == ("", before)
    note = M.apply_deterministic_attention(plain, path, "math", was_set=True)
    assert note.startswith("MEGATRON_TRAINER_DETERMINISTIC_ATTENTION=math ignored") and path.attention == before
    path.deterministic_attention = "flash"  # only read under --deterministic-mode
    core = M.layer_spec(plain, path).submodules.self_attention.submodules.core_attention
    assert core.backends == SDPA_BACKENDS[plain.training.attention_backend] and not core.strict


def _distopt_with_one_param(step_before_load: int):
    """A stand-in DistributedOptimizer (the real class's methods bound to a namespace) over one
    parameter, its torch AdamW state materialized as the trainer does before a load."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron_trainer.checkpoint import _materialize_optimizer_state

    opt = types.SimpleNamespace()
    main = torch.nn.Parameter(torch.zeros(4))
    opt.optimizer = torch.optim.AdamW([main], lr=0.0)
    _materialize_optimizer_state(opt)
    opt.optimizer.state[main]["step"].fill_(step_before_load)
    opt.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False, fp16=False)
    opt.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    opt.grad_scaler = None
    model_param = object()
    opt.model_param_group_index_map = {model_param: (0, 0)}
    opt.gbuf_ranges = [{torch.float32: [{"param_map": {model_param: {}}}]}]
    opt.per_bucket_numel_unpadded = [4]
    for name in ("_set_main_param_and_optimizer_states", "_get_main_param_and_optimizer_states", "state_dict",
                 "load_state_dict", "load_parameter_state_from_dp_reshardable"):
        setattr(opt, name, types.MethodType(getattr(DistributedOptimizer, name), opt))
    return opt, main, model_param


def _dp_reshardable_checkpoint(opt, model_param, saved_step: float) -> dict:
    """What dist_checkpointing.load hands back for `opt`: built the way
    DistributedOptimizer.sharded_state_dict(is_loading=True) builds it (load_state_dict of its own
    state first, then the per-parameter tensors, `step` among them as a non-persistent object that
    load returns as it was), the persistent tensors filled with the checkpoint's values."""
    opt.load_state_dict(opt.state_dict())
    tensors = opt._get_main_param_and_optimizer_states(model_param)
    loaded = {"param": torch.full((4,), 1.0), "exp_avg": torch.full((4,), 2.0),
              "exp_avg_sq": torch.full((4,), 3.0), "step": tensors["step"], "padding": False}
    groups = [{k: v for k, v in g.items() if k != "params"} | {"step": saved_step}
              for g in opt.optimizer.state_dict()["param_groups"]]
    return {"optimizer": {"param_groups": groups},
            "param_state": {0: {torch.float32: [[loaded]]}, "per_bucket_numel_unpadded": [4]},
            "param_state_sharding_type": "dp_reshardable"}


def test_distopt_resume_keeps_the_checkpoint_adam_step():
    """Megatron-Core 0.19.2's dp_reshardable load without TE/apex puts the pre-load step (1) over the
    checkpoint's (20): reproduced through the real DistributedOptimizer.load_state_dict, then fixed."""
    from megatron_trainer.compat import (
        adam_steps,
        patch_distopt_state_load_for_torch_adam,
        unshare_adam_steps,
    )

    opt, main, model_param = _distopt_with_one_param(step_before_load=1)
    with torch.no_grad():
        opt.load_state_dict(_dp_reshardable_checkpoint(opt, model_param, saved_step=20.0))
    assert opt.optimizer.state[main]["step"].item() == 1.0  # the upstream bug: the checkpoint said 20

    opt, main, model_param = _distopt_with_one_param(step_before_load=1)
    assert patch_distopt_state_load_for_torch_adam(opt) == 1
    with torch.no_grad():
        opt.load_state_dict(_dp_reshardable_checkpoint(opt, model_param, saved_step=20.0))
    unshare_adam_steps(opt)
    state = opt.optimizer.state[main]
    assert state["step"].item() == 20.0 and adam_steps(opt) == {20.0}
    assert main.tolist() == [1.0] * 4 and state["exp_avg"].tolist() == [2.0] * 4 and state["exp_avg_sq"].tolist() == [3.0] * 4


def test_fully_reshardable_step_workaround():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron_trainer.compat import patch_distopt_state_load_for_torch_adam

    opt = types.SimpleNamespace()
    main = torch.nn.Parameter(torch.zeros(4))
    opt.optimizer = torch.optim.AdamW([main], lr=0.0)
    main.grad = torch.zeros(4)
    opt.optimizer.step()
    opt.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    model_param = object()
    opt.model_param_group_index_map = {model_param: (0, 0)}
    opt._set_main_param_and_optimizer_states = types.MethodType(
        DistributedOptimizer._set_main_param_and_optimizer_states, opt)
    src = {"param": torch.ones(4), "exp_avg": torch.full((4,), 2.0), "exp_avg_sq": torch.full((4,), 3.0)}
    with torch.no_grad(), pytest.raises(KeyError, match="step"):
        opt._set_main_param_and_optimizer_states(model_param, src)  # the upstream bug
    assert patch_distopt_state_load_for_torch_adam(opt) == 1
    with torch.no_grad():
        opt._set_main_param_and_optimizer_states(model_param, src)
    state = opt.optimizer.state[main]
    assert main.tolist() == [1.0] * 4 and state["exp_avg"].tolist() == [2.0] * 4 and state["exp_avg_sq"].tolist() == [3.0] * 4
    assert state["step"].item() == 1.0


def test_materialize_optimizer_state():
    from megatron_trainer.checkpoint import _materialize_optimizer_state

    p = torch.nn.Parameter(torch.ones(3))
    wrapper = types.SimpleNamespace(optimizer=torch.optim.AdamW([p], lr=0.0))
    _materialize_optimizer_state(wrapper)
    assert sorted(wrapper.optimizer.state[p]) == ["exp_avg", "exp_avg_sq", "step"] and p.grad is None


def test_preprocessed_data_through_megatron_datasets(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron_trainer.config import parse_args
    from megatron_trainer.data import build_dataset
    from megatron_trainer.preprocess import main as preprocess_main
    from megatron_trainer.tokenizer import LocalTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [f"document {i} about the quick brown fox number {i * 7} " * (1 + i % 5) for i in range(300)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert preprocess_main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "c"),
                            "--tokenizer-model", str(tmp_path / "tok"), "--append-eod"]) == 0
    prefix = str(tmp_path / "c_text_document")
    ds = IndexedDataset(prefix)
    lt = LocalTokenizer(tmp_path / "tok")
    assert len(ds) == 300 and int(ds[5][-1]) == lt.eod and lt.detokenize(list(ds[5][:-1])) == texts[5]
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                      "--train-iters", "10", "--micro-batch-size", "2", "--data-path", "0.3", prefix, "0.7", prefix,
                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok"),
                      "--data-cache-path", str(tmp_path / "cache")])
    train = build_dataset(cfg, None, lt, 40, str(tmp_path / "cache"))
    sample = train[0]
    assert len(train) >= 40 and sample["tokens"].shape == (32,) and sample["labels"].shape == (32,)


def test_foreach_multi_tensor_ops_match_the_definitions():
    from megatron_trainer.compat import _foreach_l2_norm, _foreach_scale

    tensors = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2).to(torch.bfloat16), torch.zeros(0)]
    norm, per_tensor = _foreach_l2_norm(2048, None, [tensors], False)
    expected = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in tensors]))
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.allclose(norm[0], expected, rtol=1e-6)
    grads = [torch.randn(4), torch.randn(3, 3)]
    before = [g.clone() for g in grads]
    _foreach_scale(2048, None, [grads, grads], 0.25)  # in place (gradient clipping)
    assert all(torch.equal(g, b * 0.25) for g, b in zip(grads, before, strict=True))
    dst = [torch.empty(4), torch.empty(3, 3)]
    _foreach_scale(2048, None, [before, dst], 2.0)  # this -> that (optimizer copies)
    assert all(torch.equal(d, b * 2.0) for d, b in zip(dst, before, strict=True))


def test_multi_tensor_fallbacks_are_patched_once():
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core import utils
    from megatron_trainer.compat import _foreach_l2_norm, patch_multi_tensor_fallbacks

    if clip_grads.l2_norm_impl not in (utils.local_multi_tensor_l2_norm, _foreach_l2_norm):
        pytest.skip("apex or Transformer Engine provides the multi-tensor kernels here")
    patch_multi_tensor_fallbacks()
    assert clip_grads.l2_norm_impl is _foreach_l2_norm
    assert patch_multi_tensor_fallbacks() == []  # nothing left to patch


@pytest.mark.parametrize("normalization, cls", [("LayerNorm", "LayerNorm"), ("RMSNorm", "RMSNorm")])
@pytest.mark.parametrize("sp", [False, True])
def test_local_norm_marks_sequence_parallel_weights(normalization, cls, sp):
    from megatron_trainer.norm import TorchNorm

    config = types.SimpleNamespace(normalization=normalization, sequence_parallel=sp,
                                   layernorm_zero_centered_gamma=False, persist_layer_norm=False,
                                   memory_efficient_layer_norm=False)
    norm = TorchNorm(config, 32, eps=1e-6)
    assert type(norm).__name__ == cls and norm.eps == 1e-6
    assert [p.sequence_parallel for p in norm.parameters()] == [sp] * len(list(norm.parameters()))
    config.layernorm_zero_centered_gamma = True
    with pytest.raises(ValueError, match="zero_centered_gamma"):
        TorchNorm(config, 32)


def test_local_path_allows_sequence_parallel_and_uses_the_local_norm(mock_argv):
    from megatron_trainer import model as M
    from megatron_trainer.config import parse_args

    i = mock_argv.index("--tensor-model-parallel-size")
    cfg = parse_args(mock_argv[:i + 1] + ["2"] + mock_argv[i + 2:] + ["--sequence-parallel"])
    path = M.choose_path(cfg, have_te=False)
    assert path.transformer_impl == "local"
    spec = M.layer_spec(cfg, path)
    from megatron_trainer.norm import TorchNorm

    assert spec.submodules.input_layernorm is TorchNorm and spec.submodules.pre_mlp_layernorm is TorchNorm
    # CP > 1: the local implementation is refused at parse time (exit 2, argparse style), and a
    # Transformer-Engine command line on an image without TE is refused when the path is chosen.
    with pytest.raises(SystemExit) as parse_exit:
        parse_args(mock_argv[:i + 1] + ["2"] + mock_argv[i + 2:] + ["--context-parallel-size", "2",
                                                                  "--transformer-impl", "local"])
    assert parse_exit.value.code == 2
    cp = parse_args(mock_argv[:i + 1] + ["2"] + mock_argv[i + 2:] + ["--context-parallel-size", "2",
                                                                   "--transformer-impl", "transformer_engine"])
    from megatron_trainer.exitcodes import ExitCode, Fatal

    with pytest.raises(Fatal, match="context-parallel") as exc:
        M.choose_path(cp, have_te=False)
    assert exc.value.code == ExitCode.BAD_ARGUMENTS


def _in_gloo_child(tmp_path, body: str, timeout: float = 180) -> dict:
    """Run `body` in a child process (CPU, one gloo rank, Megatron's parallel state at TP = PP = 1, the trainer
    importable) and return the JSON of its last output line."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "child.py"
    script.write_text(f"""
import os, sys, json, socket, torch
sys.path[:0] = [{str(Path(__file__).resolve().parents[2] / "trainer_image")!r}, {str(Path(__file__).resolve().parents[2] / "contract")!r}]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel(1, 1)
""" + body)
    proc = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_local_gpt_model_uses_the_local_norm_everywhere(mock_argv, tmp_path):
    """A GPTModel built from the local block spec (CPU, one gloo rank, in a child process)."""
    got = _in_gloo_child(tmp_path, f"""
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron_trainer import model as M
from megatron_trainer.config import parse_args
cfg = parse_args({mock_argv!r})
path = M.choose_path(cfg, False)
tc = M.transformer_config(cfg, path)
tc.use_cpu_initialization = True
m = GPTModel(config=tc, transformer_layer_spec=M.block_spec(M.layer_spec(cfg, path), tc, path, None),
             vocab_size=1024, max_sequence_length=128)
norms = [n for n, p in m.named_parameters() if "norm" in n]
path.tp_overlap_chunks = 2  # tp_overlap's layers in the spec (TP = 1 here: they run Megatron's forward)
m2 = GPTModel(config=tc, transformer_layer_spec=M.block_spec(M.layer_spec(cfg, path), tc, path, None),
              vocab_size=1024, max_sequence_length=128)
layer = m2.decoder.layers[0]
print(json.dumps({{"layers": len(m.decoder.layers), "final": type(m.decoder.final_layernorm).__name__,
                  "marked": all(hasattr(p, "sequence_parallel") for n, p in m.named_parameters() if "norm" in n),
                  "norms": len(norms), "same_names": [n for n, _ in m.named_parameters()] == [n for n, _ in m2.named_parameters()],
                  "rows": [type(layer.self_attention.linear_proj).__name__, type(layer.mlp.linear_fc2).__name__]}}))
""")
    assert got == {"layers": 2, "final": "LayerNorm", "marked": True, "norms": 2 * (2 * 2) + 2, "same_names": True,
                   "rows": ["OverlappedRowParallelLinear2", "OverlappedRowParallelLinear2"]}


def test_gpt_model_with_flashdet_attention_runs_every_attention_backward_strict(mock_argv, tmp_path):
    """--deterministic-mode with MEGATRON_TRAINER_DETERMINISTIC_ATTENTION=flash in a whole GPTModel (CPU, one gloo
    rank, in a child process): one forward and backward with the run's warn-only setting; every layer's attention
    is one fused SDPA node whose backward runs strict, and the warn-only setting is in force at the end. The loss
    and the gradients are the math attention's (the same weights, loaded into a second model)."""
    got = _in_gloo_child(tmp_path, f"""
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron_trainer import model as M
from megatron_trainer.config import parse_args
cfg = parse_args({mock_argv!r} + ["--deterministic-mode", "--attention-backend", "flash"])
from megatron_trainer import attention as A
torch.use_deterministic_algorithms(True, warn_only=True)
calls = []
def flags():
    return [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()]
real = A.strict_backward
def observed(out):  # after the trainer's hooks: sees what the attention kernel's backward sees
    real(out)
    out.grad_fn.register_prehook(lambda grads: calls.append(flags()) or None)
A.strict_backward = observed

def build(mode):
    path = M.choose_path(cfg, False)
    path.deterministic_attention = mode
    tc = M.transformer_config(cfg, path)
    tc.use_cpu_initialization = True
    tc.params_dtype = torch.float32
    tc.bf16 = False
    return GPTModel(config=tc, transformer_layer_spec=M.block_spec(M.layer_spec(cfg, path), tc, path, None),
                    vocab_size=1024, max_sequence_length=128)

torch.manual_seed(0)
flash, math = build("flash"), build("math")
math.load_state_dict(flash.state_dict())
tokens = torch.randint(0, 1024, (2, 64))
position = torch.arange(64).expand(2, 64)
out = {{}}
for name, m in (("flash", flash), ("math", math)):
    calls.clear()
    loss = m(tokens, position, None, labels=tokens).float().mean()
    if name == "flash":
        nodes, todo = set(), [loss.grad_fn]
        while todo:
            n = todo.pop()
            if n is not None and n not in nodes:
                nodes.add(n)
                todo.extend(x for x, _ in n.next_functions)
    loss.backward()
    out[name] = {{"loss": loss.item(), "calls": list(calls),
                 "grads": {{n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}}}}
same = all(torch.allclose(g, out["math"]["grads"][n], atol=1e-5) for n, g in out["flash"]["grads"].items())
print(json.dumps({{"flash_calls": out["flash"]["calls"], "math_calls": out["math"]["calls"],
                  "loss_diff": abs(out["flash"]["loss"] - out["math"]["loss"]), "grads_same": same,
                  "grads": len(out["flash"]["grads"]), "layers": len(flash.decoder.layers),
                  "sdpa_nodes": sum("ScaledDotProduct" in type(n).__name__ for n in nodes), "end": flags()}}))
""")
    # every layer's attention is one fused SDPA node, and its backward ran strict (warn_only False)
    assert got["layers"] == 2 and got["sdpa_nodes"] == 2
    assert got["flash_calls"] == [[True, False]] * 2 and got["math_calls"] == []
    assert got["end"] == [True, True]
    assert got["loss_diff"] < 1e-5 and got["grads_same"] and got["grads"] > 0


def test_rng_tracker_states_round_trip_between_tensor_and_generator_forms():
    from megatron_trainer.checkpoint import restore_tracker_states, tracker_states_as_tensors

    class Tracker:
        def __init__(self, states):
            self.states_ = states

        def get_states(self):
            return dict(self.states_)

        def set_states(self, states):
            self.states_ = states

    graph_safe = Tracker({"model-parallel-rng": torch.Generator().manual_seed(7)})
    saved = tracker_states_as_tensors(graph_safe.get_states())  # what a checkpoint holds
    assert isinstance(saved["model-parallel-rng"], torch.Tensor)
    expected = torch.rand(3, generator=graph_safe.states_["model-parallel-rng"])
    # into a graph-safe tracker (Generators kept, their state set) ...
    fresh = Tracker({"model-parallel-rng": torch.Generator().manual_seed(99)})
    generator = fresh.states_["model-parallel-rng"]
    restore_tracker_states(fresh, saved)
    assert fresh.states_["model-parallel-rng"] is generator
    assert torch.equal(torch.rand(3, generator=generator), expected)
    # ... and into a plain tracker (state tensors)
    plain = Tracker({})
    restore_tracker_states(plain, saved)
    assert torch.equal(plain.states_["model-parallel-rng"], saved["model-parallel-rng"])


def test_wgrad_accumulation_fusion_follows_the_path(mock_argv):
    """The local path fuses weight-gradient accumulation only where the trainer found a working
    implementation (compat.patch_wgrad_accumulation_fusion: "torch" or "apex"); --no-gradient-
    accumulation-fusion and a failed check keep it off. Without CUDA the check refuses, so the
    stand-in is never installed into Megatron's layers here."""
    from megatron.core.tensor_parallel import layers
    from megatron_trainer import model as M
    from megatron_trainer.compat import TorchWgradAccumulation, patch_wgrad_accumulation_fusion
    from megatron_trainer.config import parse_args

    cfg = parse_args(mock_argv)
    path = M.choose_path(cfg, have_te=False)
    assert path.transformer_impl == "local"
    assert M.transformer_config(cfg, path).gradient_accumulation_fusion is False  # not checked yet
    for found, fused in (("torch", True), ("apex", True), ("off: no CUDA device", False)):
        path.wgrad_fusion = found
        assert M.transformer_config(cfg, path).gradient_accumulation_fusion is fused, found
        assert f"wgrad accumulation fusion={found}" in path.describe()
    off = parse_args(mock_argv + ["--no-gradient-accumulation-fusion"])
    path.wgrad_fusion = "torch"
    assert M.transformer_config(off, path).gradient_accumulation_fusion is False
    if not torch.cuda.is_available():
        assert patch_wgrad_accumulation_fusion() == "off: no CUDA device"
        assert getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not TorchWgradAccumulation


def test_fused_adamw_switch_matches_foreach_and_moves_loaded_steps():
    """compat.use_fused_adamw: the same AdamW update as torch's foreach kernels (run here with torch's
    fused CPU kernel; the trainer switches only CUDA optimizers), `step` counters that a checkpoint
    load left as CPU float tensors of another dtype moved to the parameter's device as float32, and a
    second call changes nothing. CUDA-only by default: CPU parameters are left alone."""
    from megatron_trainer.compat import use_fused_adamw

    def make():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 32))
        return p, torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)

    class Wrapped:  # Megatron's optimizer wrapper: the torch optimizer as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    ref_p, ref = make()
    p, opt = make()
    assert use_fused_adamw(Wrapped(opt)) == 0 and opt.param_groups[0]["fused"] is not True  # CPU: untouched
    assert use_fused_adamw(Wrapped(opt), devices=("cpu",)) == 1
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    for step in range(5):
        g = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        ref_p.grad, p.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    assert torch.allclose(p, ref_p, rtol=1e-5, atol=1e-6)
    assert opt.state[p]["step"].dtype == torch.float32 and float(opt.state[p]["step"]) == 5.0
    # a loaded checkpoint: foreach groups and a float64 step, as torch's load keeps it for non-fused groups
    opt.param_groups[0].update(fused=None, foreach=None)
    opt.state[p]["step"] = torch.tensor(5.0, dtype=torch.float64)
    assert use_fused_adamw(Wrapped(opt), devices=("cpu",)) == 1
    assert opt.state[p]["step"].dtype == torch.float32 and float(opt.state[p]["step"]) == 5.0
    before = opt.state[p]["step"]
    assert use_fused_adamw(Wrapped(opt), devices=("cpu",)) == 1 and opt.state[p]["step"] is before


@pytest.mark.parametrize("exact", [True, False])
def test_compiled_rope_matches_megatron_unfused_rope(exact):
    """compat.compile_unfused_rope: Megatron's unfused RoPE through torch.compile, with Inductor's
    emulate_precision_casts (the default) or without, gives the same values and gradients as the eager
    function, and a second call compiles nothing more. In fp32 on the CPU (whose Inductor backend ignores the
    option); bf16 bit-equality on a GPU is the suite's `rope` scenario."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron_trainer.compat import compile_unfused_rope

    eager = rope_utils._apply_rotary_pos_emb_bshd
    try:
        assert compile_unfused_rope(exact=exact) is True
        assert compile_unfused_rope(exact=exact) is False
        compiled = rope_utils._apply_rotary_pos_emb_bshd
        torch.manual_seed(0)
        freqs = torch.randn(16, 1, 1, 32)
        for heads in (4, 2):  # query and key/value heads (GQA): two shapes
            x = torch.randn(16, 2, heads, 32, requires_grad=True)
            y = x.detach().clone().requires_grad_(True)
            want, got = eager(x, freqs), compiled(y, freqs)
            assert torch.allclose(got, want, atol=1e-6)
            g = torch.randn_like(want)
            want.backward(g)
            got.backward(g)
            assert torch.allclose(y.grad, x.grad, atol=1e-6)
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = eager


def test_compiled_rms_norms_match_eager_and_keep_names():
    """compat.compile_rms_norms: every torch RMSNorm in the chunks runs through one compiled
    F.rms_norm with the same values and gradients (CPU inductor here; the GPU suite's `normcompile`
    variant measures it); parameter names and the state dict are unchanged, other modules are left
    alone, and a second call switches nothing."""
    from megatron_trainer.compat import compile_rms_norms

    torch.manual_seed(0)
    chunk = torch.nn.Sequential(torch.nn.RMSNorm(32, eps=1e-5), torch.nn.Linear(32, 32), torch.nn.RMSNorm(32, eps=1e-6),
                                torch.nn.LayerNorm(32))
    for norm in (chunk[0], chunk[2]):
        torch.nn.init.normal_(norm.weight)
    eager = [torch.nn.RMSNorm(32, eps=m.eps) for m in (chunk[0], chunk[2])]
    for e, m in zip(eager, (chunk[0], chunk[2]), strict=True):
        e.load_state_dict(m.state_dict())
    names = list(chunk.state_dict())
    assert compile_rms_norms([chunk]) == 2
    assert compile_rms_norms([chunk]) == 0
    assert list(chunk.state_dict()) == names and "forward" not in vars(chunk[3])
    for e, m in zip(eager, (chunk[0], chunk[2]), strict=True):
        x = torch.randn(8, 2, 32, requires_grad=True)
        y = x.detach().clone().requires_grad_(True)
        want, got = e(x), m(y)
        assert torch.allclose(got, want, atol=1e-5)
        g = torch.randn_like(want)
        want.backward(g)
        got.backward(g)
        assert torch.allclose(y.grad, x.grad, atol=1e-5)
        assert torch.allclose(m.weight.grad, e.weight.grad, atol=1e-4)


def test_native_fused_cross_entropy_matches_megatron_unfused(tmp_path):
    """MEGATRON_TRAINER_CE_FUSION=1 switches the loss to Megatron's native fused vocab-parallel cross
    entropy (bf16 only: its backward casts the logits' gradient to bf16). Same per-token loss and
    logits gradient as the unfused one, on bf16 logits (CPU, one gloo rank, in a child process)."""
    import subprocess
    import sys

    script = tmp_path / "ce.py"
    script.write_text("""
import os, socket, torch
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state, tensor_parallel
parallel_state.initialize_model_parallel(1, 1)
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
group = parallel_state.get_tensor_model_parallel_group()
torch.manual_seed(0)
logits = (3 * torch.randn(16, 2, 96)).to(torch.bfloat16)
target = torch.randint(0, 96, (16, 2))
a = logits.clone().requires_grad_(True)
b = logits.clone().requires_grad_(True)
want = tensor_parallel.vocab_parallel_cross_entropy(a, target, tp_group=group)
got = fused_vocab_parallel_cross_entropy(b, target, group)
g = torch.rand_like(want)
want.backward(g)
got.backward(g)
assert got.shape == want.shape, (got.shape, want.shape)
assert torch.allclose(got.float(), want.float(), atol=1e-4), (got - want).abs().max()
assert torch.allclose(b.grad.float(), a.grad.float(), atol=1e-2, rtol=1e-2), (b.grad.float() - a.grad.float()).abs().max()
print("ok")
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_overlapped_row_parallel_linear_matches_megatron_at_tp2(tmp_path):
    """tp_overlap.OverlappedRowParallelLinear against Megatron's RowParallelLinear at TP=2 (two gloo
    ranks on CPU, child processes): the same output, input gradient and weight gradient, with and
    without weight-gradient accumulation into main_grad, for 2 and 3 pieces. A sequence the pieces do
    not divide takes Megatron's forward; so does sequence parallelism (not run: Megatron's
    reduce-scatter needs CUDA)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "tp2.py"
    script.write_text(f"""
import os, sys, json, torch
sys.path[:0] = [{str(Path(__file__).resolve().parents[2] / "trainer_image")!r}, {str(Path(__file__).resolve().parents[2] / "contract")!r}]
rank = int(sys.argv[1])
torch.distributed.init_process_group("gloo", rank=rank, world_size=2, init_method="file://{tmp_path / 'rdzv'}")
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers
from megatron.core.transformer.transformer_config import TransformerConfig
parallel_state.initialize_model_parallel(2, 1)
from megatron_trainer.tp_overlap import overlapped_row_parallel_linear

class AccumulateIntoMainGrad:  # stands in for apex's fused_weight_gradient_mlp_cuda on CPU
    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t().matmul(total_input))
layers.fused_weight_gradient_mlp_cuda = AccumulateIntoMainGrad

def config(fusion, sp=False):
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                             use_cpu_initialization=True, params_dtype=torch.float64,
                             gradient_accumulation_fusion=fusion, sequence_parallel=sp)

out = {{}}
for chunks in (2, 3):
    sp_mod = overlapped_row_parallel_linear(chunks)(16, 8, config=config(False, True), init_method=torch.nn.init.normal_,
                                                    bias=True, input_is_parallel=True, skip_bias_add=False)
    out[f"{{chunks}}/sp"] = sp_mod.overlaps(torch.zeros(12, 3, 8))
    for fusion in (False, True):
        for seq in (12, 13):
            results = []
            for cls in (layers.RowParallelLinear, overlapped_row_parallel_linear(chunks)):
                torch.manual_seed(0)
                mod = cls(16, 8, config=config(fusion), init_method=torch.nn.init.normal_, bias=True,
                          input_is_parallel=True, skip_bias_add=False)
                if fusion:
                    mod.weight.main_grad = torch.zeros_like(mod.weight, dtype=torch.float32)  # Megatron: fp32 only
                torch.manual_seed(1 + rank)  # each rank its own input shard
                x = torch.randn(seq, 3, 8, dtype=torch.float64, requires_grad=True)
                y, _ = mod(x)
                torch.manual_seed(7)
                y.backward(torch.randn(seq, 3, 8, dtype=torch.float64))
                wgrad = mod.weight.main_grad if fusion else mod.weight.grad
                results.append((y.detach(), x.grad, wgrad.clone(), getattr(mod, "overlaps", lambda _: None)(x)))
            (y0, gx0, gw0, _), (y1, gx1, gw1, used) = results
            out[f"{{chunks}}/{{fusion}}/{{seq}}"] = {{
                "overlapped": used, "out": torch.allclose(y0, y1, atol=1e-12),
                "dx": torch.allclose(gx0, gx1, atol=1e-12), "dw": torch.allclose(gw0, gw1, atol=1e-12),
                "dw_nonzero": bool(gw1.abs().sum() > 0)}}
print("RESULT " + json.dumps(out))
""")
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", str(script), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    for stdout, _ in outs:
        got = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
        assert got.pop("2/sp") is False and got.pop("3/sp") is False
        assert len(got) == 8
        for key, r in got.items():
            seq = key.split("/")[2]
            assert r["overlapped"] is (seq == "12"), (key, r)
            assert r["out"] and r["dx"] and r["dw"] and r["dw_nonzero"], (key, r)


def test_sm_carveout_sets_cublaslt_and_the_sm_target_and_restores_both():
    """tp_overlap.sm_carveout: inside, cuBLASLt is the preferred library and torch's SM carve-out is set
    (the carve-out applies to cuBLASLt GEMMs only); after, both are what they were, also after an error;
    0 changes nothing. The factory refuses a negative carve-out."""
    import torch
    from megatron_trainer.tp_overlap import overlapped_row_parallel_linear, sm_carveout

    before = (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental())
    with sm_carveout(0):
        assert (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()) == before
    with sm_carveout(16):
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert torch._C._get_sm_carveout_experimental() == 16
    assert (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()) == before
    with pytest.raises(RuntimeError, match="inside"), sm_carveout(8):
        raise RuntimeError("inside")
    assert (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()) == before
    cls = overlapped_row_parallel_linear(2, 16)
    assert (cls.chunks, cls.sm_carveout) == (2, 16)
    assert cls.__name__ == "OverlappedRowParallelLinear2c16"
    assert overlapped_row_parallel_linear(2).__name__ == "OverlappedRowParallelLinear2"  # as before the knob
    with pytest.raises(ValueError, match="carve-out must be >= 0"):
        overlapped_row_parallel_linear(2, -1)
    from megatron_trainer.tp_overlap import carveout_problem
    assert carveout_problem(16, 132) is None and carveout_problem(0, 132) is None and carveout_problem(200, None) is None
    assert "leaves no SM for the GEMMs: this GPU has 132" in carveout_problem(132, 132)


def test_tp_overlap_applies_on_the_local_path_at_tp_above_1_without_sp(mock_argv):
    """model.tp_overlap_chunks: the requested pieces on the local path at TP > 1, dense, no sequence
    parallelism; 1 elsewhere. The layer spec then swaps both row-parallel layers; the start-up line says so."""
    import functools

    from conftest import without
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron_trainer import model as M
    from megatron_trainer.config import parse_args
    from megatron_trainer.tp_overlap import OverlappedRowParallelLinear

    tp2 = without(mock_argv, "--tensor-model-parallel-size") + ["--tensor-model-parallel-size", "2"]
    cfg = parse_args(tp2)
    path = M.choose_path(cfg, have_te=False)
    assert M.tp_overlap_chunks(cfg, path, 2) == 2
    assert M.tp_overlap_chunks(cfg, path, 0) == 1
    assert M.tp_overlap_chunks(parse_args(mock_argv), path, 2) == 1  # TP = 1
    assert M.tp_overlap_chunks(parse_args(tp2 + ["--sequence-parallel"]), path, 2) == 1
    assert M.tp_overlap_chunks(cfg, M.ModelPath("transformer_engine", "TE"), 2) == 1
    spec = M.layer_spec(cfg, path)
    assert spec.submodules.self_attention.submodules.linear_proj is RowParallelLinear  # path says 1 piece
    path.tp_overlap_chunks = 2
    spec = M.layer_spec(cfg, path)
    mlp = spec.submodules.mlp
    fc2 = (mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules).linear_fc2
    for row in (spec.submodules.self_attention.submodules.linear_proj, fc2):
        assert issubclass(row, OverlappedRowParallelLinear) and row.chunks == 2
    assert "TP forward all-reduce overlapped in 2 pieces" in path.describe()


def test_stepdump_hook_records_the_first_steps_and_finds_a_changed_gradient(tmp_path):
    """e2e/gpu/stepdump_site/sitecustomize.py, loaded as the GPU suite loads it (first on PYTHONPATH, with
    STEPDUMP_DIR): a model named GPTModel found by its class name, `main_grad` taken over `.grad`, the
    group settings, the optimizer's parameters after each step, only the first STEPDUMP_STEPS steps.
    Two runs of the same program compare equal; one whose gradient of one tensor moves by 1 % at step 2
    is named there, and so is the parameter it updates; two model chunks are named in layer order (e2e/gpu/stepdump.compare)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "e2e" / "gpu"))
    import stepdump

    script = tmp_path / "steps.py"
    script.write_text('''
import sys, torch
class Layer(torch.nn.Module):
    def __init__(self, number):
        super().__init__()
        self.layer_number = number
class GPTModel(torch.nn.Module):
    def __init__(self, first_layer=1):
        super().__init__()
        self.embedding = torch.nn.Embedding(32, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList([Layer(first_layer)])
    def forward(self, x):
        return self.head(self.norm(self.embedding(x)))
if sys.argv[1] == "chunks":  # a second chunk (layers from 9), made first: the dump orders chunks by layer
    torch.manual_seed(5)
    late = GPTModel(9)
torch.manual_seed(0)
model = GPTModel()
import weakref
class Gone: pass
dead = weakref.proxy(Gone())  # gc lists dead weak proxies; isinstance() on one raises ReferenceError
opt = torch.optim.AdamW([{"params": [model.embedding.weight, model.head.weight], "weight_decay": 0.1},
                         {"params": list(model.norm.parameters()), "weight_decay": 0.0}], lr=1e-3, foreach=True)
nudge = sys.argv[1] == "nudge"
for step in range(1, 6):
    x = torch.randint(0, 32, (4, 16))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():  # Megatron's DDP keeps the gradient in main_grad; .grad is what the step reads
        p.main_grad = p.grad.clone()
    if nudge and step == 2:
        g = model.norm.weight.main_grad
        g[0] += 0.01 * g[0].abs() + 1e-6
        model.norm.weight.grad.copy_(g)
    opt.step()
''')
    dumps = {}
    for name, arg in (("a", "same"), ("b", "same"), ("c", "nudge"), ("d", "chunks")):
        out = tmp_path / name
        env = dict(os.environ, STEPDUMP_DIR=str(out), STEPDUMP_STEPS="3", RANK="0",
                   PYTHONPATH=os.pathsep.join([str(repo / "e2e" / "gpu" / "stepdump_site"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, str(script), arg], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        dumps[name] = json.loads((out / "rank0.json").read_text())
    steps = dumps["a"]["steps"]
    assert len(steps) == 3 and steps[0]["models"] == 1
    assert list(steps[0]["grads"]) == ["embedding.weight", "norm.weight", "norm.bias", "head.weight"]
    assert steps[0]["params_before"]["embedding.weight"]["numel"] == 256
    assert [g["weight_decay"] for g in steps[0]["groups"]] == [0.1, 0.0]
    assert [g["numel"] for g in steps[0]["groups"]] == [512, 16]
    assert [len(g) for g in steps[0]["main_params_after"]] == [2, 2]
    assert stepdump.compare(dumps["a"], dumps["b"])["first_difference"] is None
    r = stepdump.compare(dumps["c"], dumps["a"])
    assert r["first_difference"] == {"step": 2, "what": "grads"}
    assert [d["name"] for d in r["steps"][1]["grads"]["first"]] == ["norm.weight"]
    assert r["steps"][1]["updated"]["differ"] == 1 and r["steps"][1]["updated"]["first"][0]["name"] == "group 1 #0"
    # two chunks: named chunk0./chunk1. in layer order, whatever order they were made in
    chunks = dumps["d"]["steps"][0]
    assert chunks["models"] == 2
    assert chunks["params_before"]["chunk0.embedding.weight"] == steps[0]["params_before"]["embedding.weight"]
    assert chunks["params_before"]["chunk1.embedding.weight"] != steps[0]["params_before"]["embedding.weight"]
    # without STEPDUMP_DIR the hook is inert
    env = dict(os.environ, PYTHONPATH=str(repo / "e2e" / "gpu" / "stepdump_site"))
    env.pop("STEPDUMP_DIR", None)
    proc = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "False"
