"""SFT packing run for real: Megatron-Core's GPTModel (built by the trainer's own functions, fp32, on the
CPU with gloo) gives every document the same loss packed with others as run alone, within 1e-5.

Needs torch and megatron-core: `make trainer-torch-tests` (what CI runs) installs them in .venv-torch.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from conftest import require

torch = require("torch")
require("megatron.core")

sys.path.insert(0, str(Path(__file__).parent))
from sft_fixtures import make_tokenizer, write_jsonl  # noqa: E402

SEQ = 64
TOL = 1e-5


def _argv(tokenizer_dir: str, train: str, position: str, attention: str) -> list[str]:
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
            "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--vocab-size", "64", "--swiglu", "--normalization", "RMSNorm",
            "--position-embedding-type", position, "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--transformer-impl", "local", "--attention-backend", attention, "--micro-batch-size", "1",
            "--train-iters", "1", "--data-format", "chat", "--sft-train-path", train, "--sft-packing",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir, "--seed", "7"]
    if position == "rope":
        argv += ["--rotary-base", "10000"]
    return argv


@pytest.fixture(scope="module")
def gloo():
    """One gloo rank, Megatron's parallel state at TP = PP = 1, the CPU shims Megatron-Core needs."""
    from megatron.core import parallel_state as ps

    saved = torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    torch.cuda.current_device, torch.Tensor.cuda = saved


def _conversations() -> list[dict]:
    words = ["hello", "hi", "there", "how", "fine", "thanks", "again", "please", "what", "is", "a", "b", "c"]
    out = []
    for i in range(9):  # documents of different lengths, several fit one 64-token sequence
        user = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 4))
        answer = " ".join(str((i * 7 + k) % 10) for k in range(2 + (i * 3) % 5))
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "you are helpful"}] + turns + \
                    [{"role": "user", "content": "again"}, {"role": "assistant", "content": "fine thanks"}]
        out.append({"messages": turns})
    return out


def _doc_losses(model, samples, packed_attention_mask) -> dict[int, float]:
    """Mean loss over each document's answer tokens, keyed by document id. Alone (unpacked) the model gets
    no mask, as in training (causal kernels)."""
    out = {}
    with torch.no_grad():
        for i in range(len(samples)):
            sample = {k: torch.from_numpy(v).unsqueeze(0) for k, v in samples.sample(i).items()}
            mask = packed_attention_mask(sample["segment_ids"]) if "segment_ids" in sample else None
            losses = model(sample["tokens"], sample["position_ids"], mask, labels=sample["labels"]).float()
            seg = sample.get("segment_ids", (sample["loss_mask"] >= 0).long())
            docs = samples.sample_docs[samples.sample_offsets[i]:samples.sample_offsets[i + 1]]
            for k, d in enumerate(docs, 1):
                m = sample["loss_mask"] * (seg == k)
                out[int(d)] = float((losses * m).sum() / m.sum())
    return out


# SDPA (the TE-less path); Megatron's unfused attention needs CUDA's RNG tracker even in eval, so it is
# left to the GPU suite.
@pytest.mark.parametrize("position, attention", [("rope", "auto"), ("learned_absolute", "auto")])
def test_packed_documents_lose_exactly_what_they_lose_alone(gloo, tmp_path, position, attention):
    from megatron_trainer import sft
    from megatron_trainer.config import parse_args
    from megatron_trainer.model import build_model, choose_path, transformer_config
    from megatron_trainer.sft_data import packed_attention_mask, restart_rope_positions

    tok = make_tokenizer(tmp_path / "tok")
    train = write_jsonl(tmp_path / "train.jsonl", _conversations())
    cfg = parse_args(_argv(str(tok), str(train), position, attention))
    path = choose_path(cfg, have_te=False)
    tconfig = transformer_config(cfg, path)
    tconfig.use_cpu_initialization = True
    torch.manual_seed(0)
    model, _ = build_model(cfg, tconfig, path, cfg.model.vocab_size, ddp=False)
    model = model[0].eval()
    assert restart_rope_positions([model]) == (1 if position == "rope" else 0)

    docs, _ = sft.SFTTokenizer(tok, sft.SFTOptions("chat", SEQ)).tokenize_file(str(train))
    alone = sft.SFTSamples.build(docs, SEQ, pad_id=0, packed=False)
    packed = sft.SFTSamples.build(docs, SEQ, pad_id=0, packed=True)
    assert len(packed) < len(alone) and max(np_len(packed, i) for i in range(len(packed))) > 1
    a = _doc_losses(model, alone, packed_attention_mask)
    p = _doc_losses(model, packed, packed_attention_mask)
    assert a.keys() == p.keys() == set(range(len(docs)))
    worst = max(abs(a[d] - p[d]) for d in a)
    assert worst <= TOL, {d: (a[d], p[d]) for d in a}
    # the check can fail: without the document mask, packed documents see each other
    leaky = {}
    with torch.no_grad():
        for i in range(len(packed)):
            s = {k: torch.from_numpy(v).unsqueeze(0) for k, v in packed.sample(i).items()}
            if int(s["segment_ids"].max()) < 2:
                continue
            losses = model(s["tokens"], s["position_ids"], None, labels=s["labels"]).float()
            m = s["loss_mask"] * (s["segment_ids"] == 2)
            d = int(packed.sample_docs[packed.sample_offsets[i] + 1])
            leaky[d] = float((losses * m).sum() / m.sum())
    assert leaky and max(abs(leaky[d] - a[d]) for d in leaky) > 100 * TOL


def np_len(samples, i: int) -> int:
    return int(samples.sample_offsets[i + 1] - samples.sample_offsets[i])
