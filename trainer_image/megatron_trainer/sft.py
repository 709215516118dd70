"""Supervised fine-tuning data: chat or prompt/completion JSONL -> token ids, loss masks, packed samples.

Pure (numpy + tokenizers + jinja2, no torch), so the rules are tested in CI. Used by the trainer
(sft_data.py).

- Chat records: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``,
  rendered with the tokenizer's own chat template (tokenizer_config.json's ``chat_template`` or
  ``chat_template.jinja``) in a sandboxed Jinja environment, as transformers renders it, in a worker
  process bounded in time, memory and output (chat_template.py).
- Prompt/completion records: ``{"prompt": "...", "completion": "..."}``: BOS (when the tokenizer has
  one) + prompt + completion + EOS, the prompt and the completion tokenized separately.
- The loss mask is 1 on the tokens of each assistant response (every assistant turn of a
  multi-turn conversation) including the end-of-turn text the template writes after it, and 0
  elsewhere. A response's span is what rendering the conversation up to that turn adds to the
  rendering of the turns before it with the generation prompt, with trailing whitespace removed
  (the newline after ``<|im_end|>``); a token belongs to it when its first character does.
- Bad input follows one policy (``invalid_lines``): ``error`` stops at the first bad line with its
  file and line number; ``skip`` counts it by reason and logs the first ones with line numbers. A line
  the tokenizer cannot encode (a lone surrogate) or the template raises an error on is a bad line; a
  failure of the template itself (time, memory, output size, a crash) stops at once.
- Over-long samples follow ``overflow``: ``truncate`` keeps the first seq_length + 1 tokens (a sample
  left with no answer token is dropped and counted), ``drop`` drops and counts it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .chat_template import MAX_TEMPLATE_BYTES, TemplateFailure, TemplateWorker
from .exitcodes import ExitCode, Fatal
from .tokenizer import _token_content, library_error, load_tokenizer_json, read_tokenizer_config

log = logging.getLogger(__name__)

FORMATS = ("chat", "prompt-completion")
ROLES = ("system", "user", "assistant")
#: A JSONL line longer than this is refused before it is parsed (a line is one conversation).
MAX_LINE_BYTES = 4 * 2**20
MAX_MESSAGES = 1024
#: Lines parsed before their batch is rendered and tokenized: at most 1024, and at most this many characters.
_BATCH_CHARS = 32 << 20
#: Line numbers logged per reason under invalid_lines=skip (all are counted).
_LOGGED_PER_REASON = 5
#: Format version of the token cache (bump when the tokenization or the packing changes).
CACHE_VERSION = 1


class SFTDataError(ValueError):
    """Bad SFT input: the message names the file and line (or the template)."""


# ------------------------------------------------------------------------------------ templates
def _read_template(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise SFTDataError(f"chat template {path}: larger than {MAX_TEMPLATE_BYTES} bytes")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SFTDataError(f"chat template {path}: not UTF-8 (byte {e.start})") from None
    except OSError as e:
        raise SFTDataError(f"chat template {path}: cannot be read: {e.strerror or e}") from None


def load_chat_template(tokenizer_dir: str | Path, override: str | Path | None = None) -> tuple[str, str]:
    """(source, where it is) of the chat template: ``override`` (a file), else chat_template.jinja, else
    tokenizer_config.json's ``chat_template``."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise SFTDataError(f"chat template {path} not found")
        return _read_template(path), str(path)
    directory = Path(tokenizer_dir)
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_template(jinja_file), str(jinja_file)
    template = read_tokenizer_config(directory).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = [t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"]
        template = named[0] if named else None
    if not isinstance(template, str) or not template.strip():
        raise SFTDataError(f"{directory}: the tokenizer has no chat template (no chat_template.jinja and no "
                           "chat_template in tokenizer_config.json); chat data needs one")
    return template, f"{directory / 'tokenizer_config.json'} chat_template"


def special_tokens(tokenizer_dir: str | Path) -> dict[str, str | None]:
    config = read_tokenizer_config(tokenizer_dir)
    return {name: _token_content(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}


# ------------------------------------------------------------------------------------- records
def _lines(path: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, error) for each non-blank line; a line over MAX_LINE_BYTES is read past, not kept."""
    with open(path, "rb") as f:
        line_no = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            line_no += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line in bounded reads
                    raw = f.readline(MAX_LINE_BYTES + 1)
                yield line_no, None, f"line longer than {MAX_LINE_BYTES} bytes"
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield line_no, None, "not UTF-8"
                continue
            if text.strip():
                yield line_no, text, None


def _check_unicode(text: str, what: str) -> None:
    """JSON's \\uD800-\\uDFFF escapes can make a string with a lone surrogate, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SFTDataError(f"{what} is not valid Unicode (an unpaired surrogate {text[e.start]!r} at character "
                           f"{e.start})") from None


def parse_chat(record: object) -> list[dict]:
    """The messages of a chat record, checked; raises SFTDataError with the reason."""
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise SFTDataError('no "messages" list')
    messages = record["messages"]
    if not messages:
        raise SFTDataError('"messages" is empty')
    if len(messages) > MAX_MESSAGES:
        raise SFTDataError(f"more than {MAX_MESSAGES} messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SFTDataError(f"message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise SFTDataError(f"message {i}: unknown role {str(role)[:40]!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise SFTDataError(f"message {i}: content is not a string")
        _check_unicode(content, f"message {i}: content")
        if role == "assistant" and not content.strip():
            raise SFTDataError(f"message {i}: empty assistant turn")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise SFTDataError("no assistant turn (nothing to learn)")
    return out


def parse_prompt_completion(record: object) -> tuple[str, str]:
    if not isinstance(record, dict):
        raise SFTDataError("not a JSON object")
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str):
        raise SFTDataError('no string "prompt"')
    if not isinstance(completion, str):
        raise SFTDataError('no string "completion"')
    _check_unicode(prompt, '"prompt"')
    _check_unicode(completion, '"completion"')
    if not completion.strip():
        raise SFTDataError('empty "completion"')
    return prompt, completion


# --------------------------------------------------------------------------------- tokenization
@dataclass
class SFTStats:
    """What happened to the input lines (reported in the trainer's log and in status.progress.data)."""

    lines: int = 0
    used: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    skipped_lines: dict[str, list[int]] = field(default_factory=dict)  # reason -> first line numbers
    tokens: int = 0
    loss_tokens: int = 0

    def skip(self, reason: str, line_no: int) -> None:
        self.skipped[reason] += 1
        seen = self.skipped_lines.setdefault(reason, [])
        if len(seen) < _LOGGED_PER_REASON:
            seen.append(line_no)

    def as_dict(self) -> dict:
        return {"lines": self.lines, "used": self.used, "truncated": self.truncated,
                "dropped_too_long": self.dropped_too_long, "skipped": sum(self.skipped.values()),
                "skipped_by_reason": dict(self.skipped), "skipped_lines": self.skipped_lines,
                "tokens": self.tokens, "loss_tokens": self.loss_tokens}


@dataclass
class SFTDocuments:
    """Tokenized samples, concatenated: document d is tokens[offsets[d]:offsets[d + 1]]."""

    tokens: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8, 1 where the token is a training target
    offsets: np.ndarray  # int64, len = documents + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True)
class SFTOptions:
    fmt: str  # "chat" | "prompt-completion"
    seq_length: int
    overflow: str = "truncate"  # "truncate" | "drop"
    invalid_lines: str = "error"  # "error" | "skip"
    chat_template: str | None = None  # a template file overriding the tokenizer's

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown SFT format {self.fmt!r} (expected one of {', '.join(FORMATS)})")
        if self.overflow not in ("truncate", "drop"):
            raise ValueError(f"unknown overflow policy {self.overflow!r} (truncate or drop)")
        if self.invalid_lines not in ("error", "skip"):
            raise ValueError(f"unknown invalid-lines policy {self.invalid_lines!r} (error or skip)")
        if self.seq_length < 2:
            raise ValueError("seq_length must be at least 2")


class SFTTokenizer:
    """Turns records into (token ids, loss mask) with a tokenizer directory's tokenizer.json and template.

    The chat template runs in a worker process (chat_template.TemplateWorker), started here and stopped by
    ``close()`` (or when this object is collected)."""

    def __init__(self, tokenizer_dir: str | Path, options: SFTOptions):
        self.options = options
        self.directory = Path(tokenizer_dir)
        self._tok = load_tokenizer_json(self.directory)
        specials = special_tokens(self.directory)
        self.eos_text = specials["eos_token"]
        self.eos_id = self._tok.token_to_id(self.eos_text) if self.eos_text else None
        if self.eos_id is None:
            raise SFTDataError(f"{self.directory}: tokenizer_config.json names no eos_token in the vocabulary; "
                               "SFT needs one to end each answer")
        bos = specials["bos_token"]
        bos_id = self._tok.token_to_id(bos) if bos else None
        self.bos_id = bos_id if bos_id is not None and bos_id != self.eos_id else None
        self.template: TemplateWorker | None = None
        self.template_source = None
        if options.fmt == "chat":
            self.template_source, where = load_chat_template(self.directory, options.chat_template)
            try:
                self.template = TemplateWorker(self.template_source, where,
                                               {k: v for k, v in specials.items() if v is not None})
            except TemplateFailure as e:
                raise SFTDataError(str(e)) from None

    def close(self) -> None:
        if self.template is not None:
            self.template.close()

    # -- one record -> (text, [(span_start, span_end)]) or (ids, mask)
    def chat_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of the assistant responses; SFTDataError."""
        assert self.template is not None
        (result,) = self.template.spans([messages])
        if isinstance(result, TemplateFailure):
            raise SFTDataError(str(result))
        return result

    def _encode(self, texts: list[str]) -> list:
        """An Encoding per text, or for a text the tokenizer cannot encode, the reason (a string): one bad
        text is one bad line, never a failed batch."""
        try:
            return self._tok.encode_batch(texts, add_special_tokens=False)
        except BaseException as e:  # pyo3 panics too: tokenizer.library_error
            if not library_error(e):
                raise
        out = []
        for text in texts:
            try:
                out.append(self._tok.encode(text, add_special_tokens=False))
            except BaseException as e:
                if not library_error(e):
                    raise
                out.append(f"the tokenizer cannot encode it: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        return out

    def encode_chat(self, texts_and_spans: Sequence[tuple[str, list[tuple[int, int]]]]) -> list[tuple[list[int], list[int]] | str]:
        """(ids, loss mask) per rendered conversation, or why the tokenizer could not encode it."""
        out: list = []
        for enc, (_, spans) in zip(self._encode([t for t, _ in texts_and_spans]), texts_and_spans, strict=True):
            if isinstance(enc, str):
                out.append(enc)
                continue
            mask = [0] * len(enc.ids)
            j = 0
            for k, (s, _e) in enumerate(enc.offsets):
                while j < len(spans) and s >= spans[j][1]:
                    j += 1
                if j < len(spans) and spans[j][0] <= s < spans[j][1]:
                    mask[k] = 1
            out.append((list(enc.ids), mask))
        return out

    def encode_prompt_completion(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]] | str]:
        """(ids, loss mask) per pair, or why the tokenizer could not encode it."""
        prompts = self._encode([p for p, _ in pairs])
        completions = self._encode([c for _, c in pairs])
        out: list = []
        bos = [self.bos_id] if self.bos_id is not None else []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, str) or isinstance(c, str):
                out.append(p if isinstance(p, str) else c)
                continue
            ids = bos + list(p.ids) + list(c.ids) + [self.eos_id]
            mask = [0] * (len(bos) + len(p.ids)) + [1] * (len(c.ids) + 1)
            out.append((ids, mask))
        return out

    # -- a file
    def tokenize_file(self, path: str, stats: SFTStats | None = None, batch: int = 1024) -> tuple[SFTDocuments, SFTStats]:
        """The documents of one JSONL file. Lines are parsed in batches (at most ``batch`` lines and
        _BATCH_CHARS characters); the template worker renders a batch while the one before is tokenized,
        and each batch's outcome is then taken line by line, in file order: the first bad line is the one
        reported. Bad lines follow ``invalid_lines``; a failure of the chat template itself (time, memory,
        output, a worker that died: TemplateFailure.fatal) stops at once whatever it says, as does a file
        with no usable line. SFTDataError names the file and line."""
        stats = stats or SFTStats()
        ids_all: list[np.ndarray] = []
        mask_all: list[np.ndarray] = []
        chat = self.options.fmt == "chat"
        limit = self.options.seq_length + 1

        def bad(line_no: int, reason: str, detail: str) -> None:
            if self.options.invalid_lines == "error":
                raise SFTDataError(f"{path}:{line_no}: {detail} (invalid lines stop the job; set "
                                   "invalidLines: skip to count and skip them)")
            stats.skip(reason, line_no)

        def start(lines: list[tuple[int, object]]) -> None:
            if chat:
                self.template.submit_spans([item for _, item in lines if not isinstance(item, _BadLine)])

        def finish(lines: list[tuple[int, object]]) -> None:
            good = [(line_no, item) for line_no, item in lines if not isinstance(item, _BadLine)]
            if chat:  # line -> (text, spans) or TemplateFailure; a fatal one ends the batch
                outcome = dict(zip((n for n, _ in good), self.template.collect_spans(len(good)), strict=False))
            else:
                outcome = dict(good)
            ready = [(n, o) for n, o in outcome.items() if not isinstance(o, TemplateFailure)]
            encode = self.encode_chat if chat else self.encode_prompt_completion
            encoded = dict(zip((n for n, _ in ready), encode([o for _, o in ready]), strict=True))
            for line_no, item in lines:
                if isinstance(item, _BadLine):
                    bad(line_no, item.reason, item.detail)
                    continue
                result = outcome[line_no]
                if isinstance(result, TemplateFailure):
                    if result.fatal:
                        raise SFTDataError(f"{path}:{line_no}: {result} (a failure of the template itself stops "
                                           "the job whatever invalidLines says)")
                    bad(line_no, _reason_key(str(result)), str(result))
                    continue
                self._add(line_no, encoded[line_no], limit, stats, bad, ids_all, mask_all)

        in_flight: list[tuple[int, object]] | None = None
        pending: list[tuple[int, object]] = []  # (line number, parsed item or _BadLine)
        pending_chars = 0
        try:
            for line_no, text, error in _lines(path):
                stats.lines += 1
                pending.append((line_no, _parse_line(text, error, chat)))
                pending_chars += len(text or "")
                if len(pending) >= batch or pending_chars >= _BATCH_CHARS:
                    start(pending)
                    if in_flight is not None:
                        finish(in_flight)
                    in_flight, pending, pending_chars = pending, [], 0
            start(pending)
            for lines in (in_flight, pending):
                if lines is not None:
                    finish(lines)
        finally:
            if chat:  # stopped at a bad line with a batch still rendering: its answers are not the next file's
                self.template.drain()
        if not ids_all:
            raise SFTDataError(f"{path}: no usable sample ({describe(stats.as_dict())})")
        offsets = np.zeros(len(ids_all) + 1, dtype=np.int64)
        np.cumsum([len(a) for a in ids_all], out=offsets[1:])
        docs = SFTDocuments(np.concatenate(ids_all), np.concatenate(mask_all), offsets)
        return docs, stats

    def _add(self, line_no: int, result, limit: int, stats: SFTStats, bad, ids_all: list, mask_all: list) -> None:
        """One encoded line: kept (truncated to ``limit`` tokens or dropped when longer), or a bad line."""
        if isinstance(result, str):
            bad(line_no, "the tokenizer cannot encode it", result)
            return
        ids, mask = result
        if len(ids) > limit:
            if self.options.overflow == "drop":
                stats.dropped_too_long += 1
                return
            ids, mask = ids[:limit], mask[:limit]
            if not any(mask[1:]):
                stats.dropped_too_long += 1
                return
            stats.truncated += 1
        if not any(mask[1:]):  # the first token is never a target (nothing predicts it)
            bad(line_no, "no answer token", "no answer token to train on")
            return
        ids_all.append(np.asarray(ids, dtype=np.int32))
        mask_all.append(np.asarray(mask, dtype=np.uint8))
        stats.used += 1
        stats.tokens += len(ids)
        stats.loss_tokens += int(sum(mask[1:]))


@dataclass(frozen=True)
class _BadLine:
    reason: str  # the key it is counted under
    detail: str  # the message


def _parse_line(text: str | None, error: str | None, chat: bool) -> object:
    """A JSONL line -> the parsed record (chat messages, or (prompt, completion)), or a _BadLine."""
    if error:
        return _BadLine(error.split(" (")[0], error)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return _BadLine("not JSON", f"not JSON ({e.msg} at column {e.colno})")
    except RecursionError:
        return _BadLine("not JSON", "JSON nested too deeply")
    try:
        return parse_chat(record) if chat else parse_prompt_completion(record)
    except SFTDataError as e:
        return _BadLine(_reason_key(str(e)), str(e))


@contextlib.contextmanager
def bad_input_is_fatal() -> Iterator[None]:
    """Bad SFT input (the data, the tokenizer's files, the chat template) -> Fatal(BAD_DATA): exit 3, not
    retried. What sft_data.load_sft_data wraps the tokenization in."""
    try:
        yield
    except SFTDataError as e:
        raise Fatal(ExitCode.BAD_DATA, str(e)) from None
    except (OSError, ValueError) as e:  # a file that cannot be read; TokenizerFileError, JsonFileError
        raise Fatal(ExitCode.BAD_DATA, f"SFT data: {type(e).__name__}: {e}") from None


def _reason_key(message: str) -> str:
    """A short, stable key for counting: 'message 3: unknown role ...' -> 'unknown role'."""
    text = message.split(": ", 1)[1] if message.startswith("message ") and ": " in message else message
    for key in ("unknown role", "empty assistant turn", "content is not a string", "not valid Unicode",
                "no assistant turn", "does not render this conversation", "not prefix-stable",
                "renders the assistant turn as nothing"):
        if key in text:
            return key
    return text.split(" (")[0][:60]


def describe(stats: dict) -> str:
    """One log line from SFTStats.as_dict(): counts, and the first line numbers of each kind of skip."""
    by_reason = f" {stats['skipped_by_reason']}" if stats["skipped_by_reason"] else ""
    text = (f"{stats['lines']} lines, {stats['used']} used, {stats['skipped']} skipped{by_reason}, "
            f"{stats['truncated']} truncated, {stats['dropped_too_long']} dropped as too long")
    if stats["skipped_lines"]:
        text += "; first skipped lines: " + "; ".join(f"{r}: {', '.join(map(str, n))}"
                                                      for r, n in stats["skipped_lines"].items())
    return text


# ----------------------------------------------------------------------------------------- packing
def pack(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing of documents (input lengths, i.e. tokens - 1) into bins of
    ``capacity`` tokens. Deterministic: ties go to the lower document id and the older bin."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda d: (-int(lengths[d]), d))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    for d in order:
        need = int(lengths[d])
        if need > capacity:
            raise ValueError(f"document {d} has {need} tokens, more than the sequence length {capacity}")
        i = bisect.bisect_left(free, (need, -1))
        if i < len(free):
            remaining, b = free.pop(i)
            bins[b].append(d)
            remaining -= need
        else:
            b = len(bins)
            bins.append([d])
            remaining = capacity - need
        if remaining > 0:
            bisect.insort(free, (remaining, b))
    return bins


@dataclass
class SFTSamples:
    """Training samples: documents and, per sample, the documents it holds (one, unless packed)."""

    docs: SFTDocuments
    sample_offsets: np.ndarray  # int64, len = samples + 1, into sample_docs
    sample_docs: np.ndarray  # int64
    seq_length: int
    pad_id: int
    packed: bool

    def __len__(self) -> int:
        return len(self.sample_offsets) - 1

    @classmethod
    def build(cls, docs: SFTDocuments, seq_length: int, pad_id: int, packed: bool) -> SFTSamples:
        inputs = docs.lengths() - 1  # a document of n tokens gives n - 1 (input, label) pairs
        groups = pack(inputs, seq_length) if packed else [[d] for d in range(len(docs))]
        offsets = np.zeros(len(groups) + 1, dtype=np.int64)
        np.cumsum([len(g) for g in groups], out=offsets[1:])
        flat = np.fromiter((d for g in groups for d in g), dtype=np.int64, count=int(offsets[-1]))
        return cls(docs, offsets, flat, seq_length, pad_id, packed)

    def efficiency(self) -> float:
        """Trained-on positions / all positions: 1 - padding waste."""
        real = int((self.docs.lengths() - 1).sum())
        return real / (len(self) * self.seq_length) if len(self) else 0.0

    def sample(self, index: int) -> dict[str, np.ndarray]:
        """tokens, labels, loss_mask, position_ids and (packed) segment_ids, each [seq_length]."""
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        position_ids = np.zeros(s, dtype=np.int64)
        segment_ids = np.zeros(s, dtype=np.int64)  # 0 = padding; documents are 1, 2, ...
        at = 0
        for k, d in enumerate(self.sample_docs[self.sample_offsets[index]:self.sample_offsets[index + 1]], 1):
            lo, hi = self.docs.offsets[d], self.docs.offsets[d + 1]
            n = int(hi - lo) - 1
            tokens[at:at + n] = self.docs.tokens[lo:hi - 1]
            labels[at:at + n] = self.docs.tokens[lo + 1:hi]
            loss_mask[at:at + n] = self.docs.loss_mask[lo + 1:hi]
            position_ids[at:at + n] = np.arange(n)
            segment_ids[at:at + n] = k
            at += n
        position_ids[at:] = np.arange(s - at)  # padding: positions of its own (never a target)
        out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.packed:
            out["segment_ids"] = segment_ids
        return out


class EpochShuffle:
    """Global sample index -> sample: each epoch is a fresh permutation from (seed, epoch), computed once per
    epoch; without ``shuffle``, file order."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = num_samples, seed, shuffle
        self._epoch, self._perm = -1, None

    def __call__(self, index: int) -> int:
        epoch, i = divmod(index, self.n)
        if not self.shuffle:
            return i
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return int(self._perm[i])


# ------------------------------------------------------------------------------------------- cache
def cache_key(path: str, tokenizer: SFTTokenizer) -> str:
    """Changes when the file, the tokenizer, the template or any option that shapes the tokens does."""
    h = hashlib.sha256()
    st = Path(path).stat()
    h.update(json.dumps([CACHE_VERSION, str(Path(path).resolve()), st.st_size, st.st_mtime_ns,
                         tokenizer.options.fmt, tokenizer.options.seq_length, tokenizer.options.overflow,
                         tokenizer.options.invalid_lines]).encode())
    h.update((tokenizer.directory / "tokenizer.json").read_bytes())
    h.update((tokenizer.template_source or "").encode())
    return h.hexdigest()[:24]


def save_documents(path: str | Path, docs: SFTDocuments, stats: SFTStats, key: str) -> None:
    """Atomically (write then rename), so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez(tmp, tokens=docs.tokens, loss_mask=docs.loss_mask, offsets=docs.offsets,
             meta=np.frombuffer(json.dumps({"key": key, "stats": stats.as_dict()}).encode(), dtype=np.uint8))
    tmp.replace(path)


def load_documents(path: str | Path, key: str | None) -> tuple[SFTDocuments, dict] | None:
    """The cached documents, or None when absent or made from other input (``key`` differs)."""
    path = Path(path)
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if key is not None and meta.get("key") != key:
            return None
        return SFTDocuments(z["tokens"], z["loss_mask"], z["offsets"]), meta["stats"]
