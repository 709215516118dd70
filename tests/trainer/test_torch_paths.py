"""CPU checks of the torch/Megatron-Core pieces. Skipped where torch or megatron-core is absent
(CI installs neither); run them with a venv that has both, e.g. `.venv-gpu`."""

from __future__ import annotations

import json
import math
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")


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


def test_fully_reshardable_step_workaround():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron_trainer.compat import patch_fully_reshardable_load_with_torch_adam

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
    assert patch_fully_reshardable_load_with_torch_adam(opt) == 1
    with torch.no_grad():
        opt._set_main_param_and_optimizer_states(model_param, src)
    state = opt.optimizer.state[main]
    assert main.tolist() == [1.0] * 4 and state["exp_avg"].tolist() == [2.0] * 4 and state["exp_avg_sq"].tolist() == [3.0] * 4


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
