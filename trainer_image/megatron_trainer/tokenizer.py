"""A local Hugging Face `tokenizers` tokenizer (tokenizer.json in a directory; never a hub download).

Pure module (tokenizers + stdlib, no torch, no transformers). The same class serves preprocessing
(which appends `eod` to every document) and the trainer's `GPTDatasetConfig` (which reads
`vocab_size`, `eod`, `pad` and `unique_identifiers`), so both agree on the end-of-document id.
"""

from __future__ import annotations

import json
from pathlib import Path

# Tried in order when tokenizer_config.json names no eos_token.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def _token_content(value: object) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class LocalTokenizer:
    """Wraps `tokenizers.Tokenizer` with the attributes Megatron-Core's datasets use."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: --tokenizer-model must be a local directory "
                                    "holding tokenizer.json (hub names are not downloaded)")
        self._tok = Tokenizer.from_file(str(path))
        config = {}
        config_path = self.directory / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        self.eod = self._special_id(_token_content(config.get("eos_token")), _EOD_CANDIDATES, "end-of-document")
        pad = _token_content(config.get("pad_token"))
        self.pad = self._tok.token_to_id(pad) if pad and self._tok.token_to_id(pad) is not None else -1
        self.unique_identifiers = {"class": type(self).__name__, "directory": str(self.directory),
                                   "vocab_size": self.vocab_size, "eod": self.eod}

    def _special_id(self, named: str | None, candidates: tuple[str, ...], what: str) -> int:
        for token in ((named,) if named else ()) + candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(f"{self.directory}: no {what} token (set eos_token in tokenizer_config.json "
                         f"or add one of {candidates})")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class NullTokenizer:
    """No tokenizer (`--tokenizer-type NullTokenizer`): ids are given; eod = vocab_size - 1.

    Matches megatron.core.tokenizers' null-text library.
    """

    pad = -1

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": self.vocab_size}

    @property
    def eos(self) -> int:
        return self.eod


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None):
    """The tokenizer named by --tokenizer-type (HuggingFaceTokenizer = a local tokenizer.json dir)."""
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise ValueError("NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model DIR")
        return LocalTokenizer(tokenizer_model)
    raise ValueError(f"unsupported --tokenizer-type {tokenizer_type}")
