"""`python -m megatron_trainer preprocess`: JSONL -> Megatron .bin/.idx with a local tokenizer.

Flag names and output naming follow Megatron-LM's tools/preprocess_data.py:
`<output-prefix>_<json-key>_document.{bin,idx}`; the prefix without the extension is what
`--data-path` takes. Pure (numpy + tokenizers), so it runs in CI and in a small preprocessing Job.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .indexed import IndexedDatasetWriter, optimal_dtype
from .tokenizer import LocalTokenizer

_BATCH_LINES = 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_trainer preprocess", allow_abbrev=False,
                                description="Tokenize JSONL into Megatron's IndexedDataset (.bin/.idx).")
    p.add_argument("--input", required=True, nargs="+", help="JSONL file(s), one document per line.")
    p.add_argument("--output-prefix", required=True, help="Output prefix (directory must exist).")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="Keys of the text fields to index.")
    p.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", choices=("HuggingFaceTokenizer",),
                   help="Only local Hugging Face tokenizers (tokenizer.json) are supported.")
    p.add_argument("--tokenizer-model", required=True, help="Local directory holding tokenizer.json.")
    p.add_argument("--append-eod", action="store_true", help="Append the end-of-document token to each document.")
    p.add_argument("--workers", type=int, default=1, help="Accepted for compatibility; tokenizers batches in Rust.")
    p.add_argument("--log-interval", type=int, default=100000, help="Documents between progress lines.")
    return p


def _documents(paths: Sequence[str], key: str) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not JSON ({e.msg})") from None
                text = record.get(key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{line_no}: no string field {key!r}")
                yield text


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


class _Counter:
    def __init__(self, log_interval: int):
        self.documents = self.tokens = 0
        self.log_interval = log_interval
        self.started = time.monotonic()


def _write_batch(texts: list[str], tokenizer: LocalTokenizer, writer: IndexedDatasetWriter, append_eod: bool,
                 counter: _Counter) -> None:
    for ids in tokenizer.tokenize_batch(texts):
        if append_eod:
            ids.append(tokenizer.eod)
        if not ids:
            continue  # Megatron skips empty documents too
        writer.add_document(ids)
        counter.documents += 1
        counter.tokens += len(ids)
        if counter.log_interval and counter.documents % counter.log_interval == 0:
            rate = counter.documents / max(time.monotonic() - counter.started, 1e-9)
            print(f"preprocess: {counter.documents} documents ({rate:.0f} docs/s)", file=sys.stderr)


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_dir: str, json_keys: Sequence[str] = ("text",),
               append_eod: bool = False, log_interval: int = 100000) -> dict[str, dict[str, int]]:
    """Write one .bin/.idx per JSON key; returns {prefix: {"documents": n, "tokens": n}}."""
    tokenizer = LocalTokenizer(tokenizer_dir)
    dtype = optimal_dtype(tokenizer.vocab_size)
    summary: dict[str, dict[str, int]] = {}
    for key in json_keys:
        prefix = output_prefix_for(output_prefix, key)
        writer = IndexedDatasetWriter(prefix, dtype)
        counter = _Counter(log_interval)
        batch: list[str] = []
        for text in _documents(inputs, key):
            batch.append(text)
            if len(batch) >= _BATCH_LINES:
                _write_batch(batch, tokenizer, writer, append_eod, counter)
                batch = []
        _write_batch(batch, tokenizer, writer, append_eod, counter)
        writer.finalize()
        summary[prefix] = {"documents": counter.documents, "tokens": counter.tokens}
    return summary


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if not Path(args.output_prefix).parent.is_dir():
        print(f"preprocess: directory of {args.output_prefix} does not exist", file=sys.stderr)
        return 2
    try:
        summary = preprocess(args.input, args.output_prefix, args.tokenizer_model, args.json_keys,
                             args.append_eod, args.log_interval)
    except (ValueError, FileNotFoundError) as e:
        print(f"preprocess: {e}", file=sys.stderr)
        return 1
    for prefix, counts in summary.items():
        print(f"preprocess: wrote {prefix}.bin/.idx: {counts['documents']} documents, {counts['tokens']} tokens")
    return 0
