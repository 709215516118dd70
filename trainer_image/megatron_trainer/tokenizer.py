"""A local Hugging Face `tokenizers` tokenizer (tokenizer.json in a directory; never a hub download).

Pure module (tokenizers + stdlib, no torch, no transformers). The same class serves preprocessing
(which appends `eod` to every document) and the trainer's `GPTDatasetConfig` (which reads
`vocab_size`, `eod`, `pad` and `unique_identifiers`), so both agree on the end-of-document id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_contract.jsonfile import read_json

# Tried in order when tokenizer_config.json names no eos_token.
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
#: Gemma 3's tokenizer_config.json (its added tokens listed one by one) is 1.2 MB, its tokenizer.json 33 MB.
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20
MAX_TOKENIZER_JSON_BYTES = 256 << 20


class TokenizerFileError(ValueError):
    """A tokenizer file that is missing, too large or malformed; the message names it."""


def read_tokenizer_config(directory: str | Path) -> dict[str, Any]:
    """tokenizer_config.json of a tokenizer directory ({} when there is none), read within bounds."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    config = read_json(path, MAX_TOKENIZER_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise TokenizerFileError(f"{path}: not a JSON object")
    stack: list[Any] = [config]
    while stack:  # a lone surrogate ("\\ud800" is valid JSON) in a token or the template: no tokenizer encodes it
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and not _is_unicode(value):
            raise TokenizerFileError(f"{path}: the string {value[:60]!r} holds an unpaired surrogate (not Unicode)")
    return config


def _is_unicode(text: str) -> bool:
    """Encodable as UTF-8: no lone surrogate, which JSON's \\uD800-\\uDFFF escapes can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_tokenizer_json(directory: str | Path):
    """The `tokenizers.Tokenizer` of directory/tokenizer.json; FileNotFoundError when it is missing,
    TokenizerFileError naming it when it is too large or the library cannot read it."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --tokenizer-model must be a local directory "
                                "holding tokenizer.json (hub names are not downloaded)")
    if path.stat().st_size > MAX_TOKENIZER_JSON_BYTES:
        raise TokenizerFileError(f"{path}: larger than {MAX_TOKENIZER_JSON_BYTES} bytes")
    try:
        return Tokenizer.from_file(str(path))
    except BaseException as e:  # pyo3 panics too: library_error
        if not library_error(e):
            raise
        raise TokenizerFileError(f"{path}: the tokenizers library cannot read it: {' '.join(str(e).split())[:300]}") \
            from None


def library_error(exc: BaseException) -> bool:
    """An error of the tokenizers library: a plain Exception, or pyo3's PanicException (a Rust panic), which
    derives from BaseException so that a bare ``except Exception`` lets it through."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


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
        self.directory = Path(directory)
        self._tok = load_tokenizer_json(self.directory)
        config = read_tokenizer_config(self.directory)
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
