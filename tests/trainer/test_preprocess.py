"""JSONL -> Megatron .bin/.idx without torch, checked byte for byte against the format."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from megatron_trainer.indexed import INDEX_HEADER, IndexedDatasetWriter, optimal_dtype, read_indexed_dataset
from megatron_trainer.preprocess import main as preprocess_main
from megatron_trainer.tokenizer import LocalTokenizer, NullTokenizer, build_tokenizer

TEXTS = [f"doc {i}: the quick brown fox jumps over the lazy dog {i * 13}" * (1 + i % 3) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"]))
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return path


def test_writer_layout_is_megatrons(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    docs = [[5, 6, 7], [8], [9, 10]]
    for d in docs:
        w.add_document(d)
    w.finalize()
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == INDEX_HEADER
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == 8  # DType.uint16
    assert struct.unpack("<QQ", raw[18:34]) == (3, 4)  # sequences, len(document_indices) incl. leading 0
    lengths = np.frombuffer(raw[34:46], dtype=np.int32)
    pointers = np.frombuffer(raw[46:70], dtype=np.int64)
    doc_idx = np.frombuffer(raw[70:102], dtype=np.int64)
    assert lengths.tolist() == [3, 1, 2] and pointers.tolist() == [0, 6, 8] and doc_idx.tolist() == [0, 1, 2, 3]
    assert len(raw) == 102
    assert np.fromfile(tmp_path / "d.bin", dtype=np.uint16).tolist() == [5, 6, 7, 8, 9, 10]
    view = read_indexed_dataset(tmp_path / "d")
    assert [view.sequence(i).tolist() for i in range(3)] == docs


def test_dtype_choice_and_range_check(tmp_path):
    assert optimal_dtype(32000) is np.uint16 and optimal_dtype(128256) is np.int32 and optimal_dtype(None) is np.int32
    w = IndexedDatasetWriter(tmp_path / "x", np.uint16)
    with pytest.raises(ValueError):
        w.add_document([70000])


def test_preprocess_jsonl(tmp_path, tokenizer_dir):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)) + "\n")
    rc = preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "corpus"),
                          "--tokenizer-model", str(tokenizer_dir), "--append-eod"])
    assert rc == 0
    tok = LocalTokenizer(tokenizer_dir)
    view = read_indexed_dataset(tmp_path / "corpus_text_document")
    assert view.dtype is np.uint16 and len(view.sequence_lengths) == len(TEXTS)
    for i in (0, 17, 39):
        ids = view.sequence(i).tolist()
        assert ids[-1] == tok.eod == tok._tok.token_to_id("<|endoftext|>")
        assert tok.detokenize(ids[:-1]) == TEXTS[i]
    assert view.document_indices.tolist() == list(range(len(TEXTS) + 1))


def test_preprocess_reports_bad_input(tmp_path, tokenizer_dir, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    assert preprocess_main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                            "--tokenizer-model", str(tokenizer_dir)]) == 1
    assert "bad.jsonl:2: no string field 'text'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        preprocess_main(["--input", str(src)])
    assert exc.value.code == 2


def test_tokenizers(tokenizer_dir, tmp_path):
    null = build_tokenizer("NullTokenizer", None, 1000)
    assert isinstance(null, NullTokenizer) and (null.vocab_size, null.eod, null.pad) == (1000, 999, -1)
    hf = build_tokenizer("HuggingFaceTokenizer", str(tokenizer_dir), None)
    assert hf.vocab_size == hf._tok.get_vocab_size(with_added_tokens=True) > 100 and hf.pad == -1
    with pytest.raises(FileNotFoundError, match="local directory"):
        LocalTokenizer(tmp_path / "gpt2")
