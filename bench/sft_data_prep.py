"""How long SFT data takes before the first iteration: tokenizing a chat JSONL on the fly (the chat template
rendered per turn, loss masks, packing) against reading back the tokens the first start cached
(--data-cache-path) or `preprocess --format chat` wrote. Pure CPU; the figures:
docs/benchmarks/sft.md#2026-11-24-sft.

    .venv/bin/python bench/sft_data_prep.py --conversations 100000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "contract"), str(ROOT / "tests" / "trainer")]

from megatron_trainer import sft  # noqa: E402
from sft_fixtures import CHATML, chat_corpus, make_tokenizer, write_jsonl  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=100000)
    ap.add_argument("--seq-length", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok = make_tokenizer(d / "tok", CHATML)
        path = write_jsonl(d / "chat.jsonl", chat_corpus(args.conversations, 1, 20, 300))
        t = sft.SFTTokenizer(tok, sft.SFTOptions("chat", args.seq_length))
        t0 = time.perf_counter()
        docs, stats = t.tokenize_file(str(path))
        tokenize_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        samples = sft.SFTSamples.build(docs, args.seq_length, 0, packed=True)
        pack_s = time.perf_counter() - t0
        key = sft.cache_key(str(path), t)
        t0 = time.perf_counter()
        sft.save_documents(d / "cache.npz", docs, stats, key)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        back, _ = sft.load_documents(d / "cache.npz", sft.cache_key(str(path), t))
        load_s = time.perf_counter() - t0
        assert len(back) == len(docs)
        out = {"conversations": args.conversations, "file_mb": round(path.stat().st_size / 1e6, 1),
               "tokens": int(len(docs.tokens)), "samples_packed": len(samples),
               "packing_efficiency": round(samples.efficiency(), 4),
               "tokenize_s": round(tokenize_s, 2), "pack_s": round(pack_s, 2), "cache_write_s": round(save_s, 2),
               "cache_read_s": round(load_s, 3)}
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
