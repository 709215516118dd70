"""SFT data rules without torch (CI): loss masks written down token by token, bad input, packing, the cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import MOCK_ARGV, without
from megatron_trainer import sft
from megatron_trainer.config import parse_args
from sft_fixtures import CHATML, LLAMA3_LIKE, make_tokenizer, write_jsonl


def tokens_and_mask(tok_dir: Path, record: dict, fmt: str = "chat", seq: int = 256) -> list[tuple[str, int]]:
    from tokenizers import Tokenizer

    t = sft.SFTTokenizer(tok_dir, sft.SFTOptions(fmt, seq))
    if fmt == "chat":
        (ids, mask), = t.encode_chat([t.chat_spans(sft.parse_chat(record))])
    else:
        (ids, mask), = t.encode_prompt_completion([sft.parse_prompt_completion(record)])
    vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return [(vocab.id_to_token(i), m) for i, m in zip(ids, mask, strict=True)]


def answer_tokens(pairs: list[tuple[str, int]]) -> list[str]:
    return [t for t, m in pairs if m]


@pytest.fixture
def chatml(tmp_path) -> Path:
    return make_tokenizer(tmp_path / "chatml", CHATML, eos="<|im_end|>")


@pytest.fixture
def llama3(tmp_path) -> Path:
    return make_tokenizer(tmp_path / "llama3", LLAMA3_LIKE, eos="<|eot_id|>", bos="<|begin_of_text|>",
                          template_file=True)


# --------------------------------------------------------------------------------------- loss masks
def test_single_turn_mask_is_the_answer_and_its_end_token(chatml):
    pairs = tokens_and_mask(chatml, {"messages": [{"role": "user", "content": "hello"},
                                                  {"role": "assistant", "content": "hi there"}]})
    assert pairs == [("<|im_start|>", 0), ("user", 0), ("hello", 0), ("<|im_end|>", 0),
                     ("<|im_start|>", 0), ("assistant", 0), ("hi", 1), ("there", 1), ("<|im_end|>", 1)]


def test_multi_turn_with_system_prompt_trains_every_assistant_turn(chatml):
    pairs = tokens_and_mask(chatml, {"messages": [
        {"role": "system", "content": "you are helpful"}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "how are you ?"},
        {"role": "assistant", "content": "fine , thanks !"}]})
    assert answer_tokens(pairs) == ["hi", "<|im_end|>", "fine", ",", "thanks", "!", "<|im_end|>"]
    # nothing of the system prompt, the user turns or the role headers
    assert all(m == 0 for t, m in pairs if t in ("system", "you", "helpful", "hello", "how", "?", "<|im_start|>",
                                                 "assistant", "user"))
    assert sum(m for _, m in pairs) == 7


def test_llama3_like_template_from_chat_template_jinja(llama3):
    pairs = tokens_and_mask(llama3, {"messages": [{"role": "system", "content": "you are helpful"},
                                                  {"role": "user", "content": "what is 1 2"},
                                                  {"role": "assistant", "content": "2 1"}]})
    assert pairs[0] == ("<|begin_of_text|>", 0)
    assert answer_tokens(pairs) == ["2", "1", "<|eot_id|>"]
    assert pairs[-3:] == [("2", 1), ("1", 1), ("<|eot_id|>", 1)]


def test_prompt_completion_mask(llama3, chatml):
    pairs = tokens_and_mask(llama3, {"prompt": "what is a", "completion": "b c"}, fmt="prompt-completion")
    assert pairs == [("<|begin_of_text|>", 0), ("what", 0), ("is", 0), ("a", 0), ("b", 1), ("c", 1),
                     ("<|eot_id|>", 1)]
    pairs = tokens_and_mask(chatml, {"prompt": "hello", "completion": "hi"}, fmt="prompt-completion")
    assert pairs == [("hello", 0), ("hi", 1), ("<|im_end|>", 1)]  # no BOS in this tokenizer


# ----------------------------------------------------------------------------------------- bad input
BAD_LINES = [
    ('{"messages": [{"role": "user", "content": "hello"}, ', "not JSON"),
    ({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "hi"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "  "}]},
     "empty assistant turn"),
    ({"messages": [{"role": "user", "content": "hello"}]}, "no assistant turn"),
    ({"messages": [{"role": "user", "content": ["a", "b"]}, {"role": "assistant", "content": "hi"}]},
     "content is not a string"),
    ({"text": "pretraining"}, 'no "messages" list'),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_bad_line_stops_with_file_and_line_number(chatml, tmp_path, line, reason):
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, line])
    t = sft.SFTTokenizer(chatml, sft.SFTOptions("chat", 64))
    with pytest.raises(sft.SFTDataError) as e:
        t.tokenize_file(str(path))
    assert f"{path}:3: " in str(e.value) and reason in str(e.value) and "invalidLines: skip" in str(e.value)


def test_skip_policy_counts_each_reason_with_line_numbers(chatml, tmp_path):
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    lines = [good] + [line for line, _ in BAD_LINES] + ["", good]
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    t = sft.SFTTokenizer(chatml, sft.SFTOptions("chat", 64, invalid_lines="skip"))
    docs, stats = t.tokenize_file(str(path))
    d = stats.as_dict()
    assert len(docs) == 2 and d["used"] == 2 and d["skipped"] == len(BAD_LINES)
    assert d["lines"] == 2 + len(BAD_LINES)  # the blank line is not counted
    assert d["skipped_lines"]["not JSON"] == [2] and d["skipped_lines"]["unknown role"] == [3]
    assert "first skipped lines: not JSON: 2" in sft.describe(stats.as_dict())


def test_template_that_does_not_render_is_a_clear_error(tmp_path):
    bad = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system prompt is required') }}{% endif %}"
    tok = make_tokenizer(tmp_path / "t", bad)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hello"},
                                                            {"role": "assistant", "content": "hi"}]}])
    with pytest.raises(sft.SFTDataError, match=r"d.jsonl:1: the chat template \(.*/t/tokenizer_config.json "
                                               r"chat_template, line 1\) does not render this conversation: "
                                               r"a system prompt is required"):
        sft.SFTTokenizer(tok, sft.SFTOptions("chat", 64)).tokenize_file(str(path))
    with pytest.raises(sft.SFTDataError, match="does not compile"):
        sft.SFTTokenizer(make_tokenizer(tmp_path / "u", "{% for m in messages %}"), sft.SFTOptions("chat", 64))
    with pytest.raises(sft.SFTDataError, match="no chat template"):
        sft.SFTTokenizer(make_tokenizer(tmp_path / "v", None), sft.SFTOptions("chat", 64))


def test_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # renders only the last assistant turn's content in full: earlier turns change once later ones come
    tpl = ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' and not loop.last %}a"
           "{% else %}{{ m['content'] }}{% endif %}<|im_end|>{% endfor %}"
           "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = make_tokenizer(tmp_path / "t", tpl)
    conv = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                         {"role": "user", "content": "how"}, {"role": "assistant", "content": "fine"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [conv])
    with pytest.raises(sft.SFTDataError, match="not prefix-stable"):
        sft.SFTTokenizer(tok, sft.SFTOptions("chat", 64)).tokenize_file(str(path))


def test_overlong_line_is_refused_without_being_read_whole(chatml, tmp_path, monkeypatch):
    monkeypatch.setattr(sft, "MAX_LINE_BYTES", 200)
    good = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    huge = {"messages": [{"role": "user", "content": "hello " * 100}, {"role": "assistant", "content": "hi"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, huge, good])
    with pytest.raises(sft.SFTDataError, match=r":2: line longer than 200 bytes"):
        sft.SFTTokenizer(chatml, sft.SFTOptions("chat", 64)).tokenize_file(str(path))
    docs, stats = sft.SFTTokenizer(chatml, sft.SFTOptions("chat", 64, invalid_lines="skip")).tokenize_file(str(path))
    assert len(docs) == 2 and stats.skipped_lines == {"line longer than 200 bytes": [2]}


def test_long_conversations_are_truncated_or_dropped_and_counted(chatml, tmp_path):
    short = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    long_answer = {"messages": [{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": " ".join(["1"] * 30)}]}
    long_prompt = {"messages": [{"role": "user", "content": " ".join(["hello"] * 30)},
                                {"role": "assistant", "content": "hi"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [short, long_answer, long_prompt])
    docs, st = sft.SFTTokenizer(chatml, sft.SFTOptions("chat", 16)).tokenize_file(str(path))
    # long_answer keeps its first 17 tokens (with answer tokens); long_prompt has no answer left: dropped
    assert (st.used, st.truncated, st.dropped_too_long) == (2, 1, 1)
    assert docs.lengths().tolist() == [8, 17]
    docs, st = sft.SFTTokenizer(chatml, sft.SFTOptions("chat", 16, overflow="drop")).tokenize_file(str(path))
    assert (st.used, st.truncated, st.dropped_too_long) == (1, 0, 2)
    path = write_jsonl(tmp_path / "e.jsonl", [long_prompt])
    with pytest.raises(sft.SFTDataError, match="no usable sample.*1 dropped as too long"):
        sft.SFTTokenizer(chatml, sft.SFTOptions("chat", 16)).tokenize_file(str(path))


# ------------------------------------------------------------------------------------------ packing
def test_pack_keeps_every_document_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=500)
    bins = sft.pack(lengths, 64)
    flat = sorted(d for b in bins for d in b)
    assert flat == list(range(500))
    assert all(sum(int(lengths[d]) for d in b) <= 64 for b in bins)
    assert bins == sft.pack(lengths, 64)  # deterministic
    assert lengths.sum() / (len(bins) * 64) > 0.95  # best-fit decreasing wastes little
    with pytest.raises(ValueError, match="more than the sequence length"):
        sft.pack(np.array([65]), 64)


def test_packed_sample_shifts_labels_restarts_positions_and_separates_documents():
    docs = sft.SFTDocuments(tokens=np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int32),
                            loss_mask=np.array([0, 1, 1, 0, 0, 1, 1], dtype=np.uint8),
                            offsets=np.array([0, 3, 7]))
    packed = sft.SFTSamples.build(docs, seq_length=8, pad_id=0, packed=True)
    assert len(packed) == 1
    s = packed.sample(0)
    # best-fit decreasing: the longer document (4 tokens -> 3 inputs) first
    assert s["tokens"].tolist() == [4, 5, 6, 1, 2, 0, 0, 0]
    assert s["labels"].tolist() == [5, 6, 7, 2, 3, 0, 0, 0]
    assert s["loss_mask"].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    assert s["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert s["segment_ids"].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert packed.efficiency() == 5 / 8
    padded = sft.SFTSamples.build(docs, seq_length=8, pad_id=9, packed=False)
    assert len(padded) == 2 and "segment_ids" not in padded.sample(0)
    assert padded.sample(0)["tokens"].tolist() == [1, 2, 9, 9, 9, 9, 9, 9]
    assert padded.efficiency() == 5 / 16


def test_epochs_are_permutations_and_resumable():
    order = sft.EpochShuffle(10, seed=3)
    first, second = [order(i) for i in range(10)], [order(i) for i in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert [sft.EpochShuffle(10, seed=3)(i) for i in range(15, 20)] == second[5:]  # a fresh process agrees
    assert [sft.EpochShuffle(10, 3, shuffle=False)(i) for i in range(12)] == list(range(10)) + [0, 1]


def test_cache_round_trip_and_key(chatml, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hello", "completion": "hi"}] * 3)
    t = sft.SFTTokenizer(chatml, sft.SFTOptions("prompt-completion", 16))
    docs, stats = t.tokenize_file(str(path))
    key = sft.cache_key(str(path), t)
    sft.save_documents(tmp_path / "c.npz", docs, stats, key)
    back, st = sft.load_documents(tmp_path / "c.npz", key)
    assert np.array_equal(back.tokens, docs.tokens) and np.array_equal(back.loss_mask, docs.loss_mask)
    assert np.array_equal(back.offsets, docs.offsets) and st == json.loads(json.dumps(stats.as_dict()))
    other = sft.SFTTokenizer(chatml, sft.SFTOptions("prompt-completion", 32))
    assert sft.cache_key(str(path), other) != key
    assert sft.load_documents(tmp_path / "c.npz", sft.cache_key(str(path), other)) is None


# ------------------------------------------------------------------------------------------- flags
SFT_ARGV = without(MOCK_ARGV, "--mock-data", "--tokenizer-type") + [
    "--data-format", "chat", "--sft-train-path", "/data/train.jsonl", "--tokenizer-type", "HuggingFaceTokenizer",
    "--tokenizer-model", "/data/tok"]


def test_sft_flags_parse():
    cfg = parse_args(SFT_ARGV + ["--sft-packing", "--sft-valid-path", "/data/v.jsonl", "--eval-iters", "2",
                                 "--eval-interval", "5"])
    assert cfg.data.sft and cfg.data.sft_packing and cfg.training.eval_iters == 2


@pytest.mark.parametrize("extra, message", [
    (["--mock-data"], "--mock-data and --data-path are for pretraining"),
    (["--sft-valid-path", "/data/v.jsonl"], "--sft-valid-path needs --eval-iters >= 1"),
    (["--reset-attention-mask"], "pretraining flags"),
    (["--context-parallel-size", "2", "--transformer-impl", "transformer_engine", "--seq-length", "128"],
     "SFT data with --context-parallel-size > 1"),
])
def test_sft_flag_combinations_refused(capsys, extra, message):
    argv = without(SFT_ARGV, "--eval-iters", "--context-parallel-size") + ["--eval-iters", "0"] + extra
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_pretraining_refuses_sft_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(MOCK_ARGV + ["--sft-packing"])
    assert "--sft-packing needs --data-format chat or prompt-completion" in capsys.readouterr().err
