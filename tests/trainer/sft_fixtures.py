"""A tiny local tokenizer (built with `tokenizers`) with a ChatML chat template, for the SFT tests and the
GPU fine-tune scenario. Word-level: every word, digit and punctuation mark is one token, so the expected
loss mask can be written down by hand."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Llama-3 style: BOS once, header tokens, no newline after the end-of-turn token, system prompt optional.
LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<pad>"]
WORDS = ["system", "user", "assistant", "you", "are", "helpful", "reverse", "the", "digits", "of", "what", "is",
         "hello", "hi", "there", "how", "fine", "thanks", "again", "please", "answer", "question", "a", "b", "c",
         ".", ",", "?", ":", "!"] + [str(d) for d in range(10)]


def make_tokenizer(directory: str | Path, template: str | None = CHATML, eos: str = "<|im_end|>",
                   bos: str | None = None, pad: str | None = "<pad>", template_file: bool = False) -> Path:
    """tokenizer.json + tokenizer_config.json in ``directory`` (the chat template inline, or in
    chat_template.jinja as transformers 5 writes it)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(True),
                                                 pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": eos, "bos_token": bos, "pad_token": pad, "model_max_length": 4096,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None and not template_file:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None and template_file:
        (directory / "chat_template.jinja").write_text(template)
    return directory


def write_jsonl(path: str | Path, records: list) -> Path:
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def reversal_conversations(n: int, seed: int, digits: tuple[int, int] = (3, 6)) -> list[dict]:
    """The learnable rule of the GPU fine-tune: the answer is the user's digits reversed."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(*digits)
        number = " ".join(str(rng.randint(0, 9)) for _ in range(k))
        out.append({"messages": [{"role": "system", "content": "reverse the digits"},
                                 {"role": "user", "content": number},
                                 {"role": "assistant", "content": " ".join(reversed(number.split()))}]})
    return out


def chat_corpus(n: int, seed: int, lo: int, hi: int) -> list[dict]:
    """Conversations of 1-3 turns with answers of lo..hi words, a spread like real chat data (benchmarks)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": "you are helpful"}]
        for _t in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))})
        out.append({"messages": turns})
    return out
