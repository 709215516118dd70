"""Run the trainer's input readers as the trainer runs them: a separate process with a memory cap
(RLIMIT_AS) and a time limit, its exit code classified the way main.py classifies a worker's failure
(exitcodes.classify, fatal_message). Used by the adversarial tests of issue 52.

`python bounded.py KIND ARGS...` is the driver; `run(kind, *args)` runs it and returns (exit code, stderr,
seconds).
Kinds: `sft` (tokenize a JSONL file as load_sft_data does), `tokenizer` (build_tokenizer, as the trainer's
start does for --tokenizer-model), `hf-source` (--hf-init's check), `safetensors` (one file's header).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The address space of the driver process (Python, numpy, tokenizers and jinja2 map about 300 MiB).
MEMORY_LIMIT_BYTES = 1536 * 1024 * 1024
#: The whole run, Python start-up included; the chat template's own limit is sft.RENDER_TIMEOUT_S.
TIME_LIMIT_S = 60.0


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))


def run(kind: str, *args: str, timeout_s: float = TIME_LIMIT_S, env: dict[str, str] | None = None
        ) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of the driver; subprocess.TimeoutExpired fails the caller's test."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, kind, *args], capture_output=True, text=True, errors="replace",
                          timeout=timeout_s, preexec_fn=_limits, cwd=ROOT,
                          env={"PYTHONPATH": f"{ROOT / 'trainer_image'}:{ROOT / 'contract'}", "PATH": "/usr/bin:/bin",
                               **(env or {})})
    return proc.returncode, proc.stderr, time.monotonic() - start


def reason(stderr: str) -> str:
    """The driver's one-line reason; AssertionError when it spans lines (frames start with '  File ')."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("megatron_trainer: "))
    rest = lines[start + 1:]
    assert not rest or rest[0].startswith("  File "), lines[start:start + 3]
    return lines[start]


def _sft(tokenizer_dir: str, path: str, fmt: str, invalid_lines: str, template: str = "") -> None:
    from megatron_trainer import chat_template, sft

    # lower bounds for the tests (the trainer runs with the module's own): {"RENDER_TIMEOUT_S": 3, ...}
    for name, value in json.loads(os.environ.get("CHAT_TEMPLATE_LIMITS", "{}")).items():
        setattr(chat_template, name, value)
    with sft.bad_input_is_fatal():
        tokenizer = sft.SFTTokenizer(tokenizer_dir, sft.SFTOptions(fmt, 64, invalid_lines=invalid_lines,
                                                                   chat_template=template or None))
        docs, stats = tokenizer.tokenize_file(path)
    print(f"ok: {len(docs)} documents; {sft.describe(stats.as_dict())}", file=sys.stderr)


def _tokenizer(directory: str) -> None:
    from megatron_trainer.exitcodes import data_errors_are_fatal
    from megatron_trainer.tokenizer import build_tokenizer

    with data_errors_are_fatal("--tokenizer-model"):  # as loop.Trainer builds it
        tok = build_tokenizer("HuggingFaceTokenizer", directory, None)
    print(f"ok: {tok.vocab_size} tokens, eod {tok.eod}", file=sys.stderr)


def _safetensors(path: str) -> None:
    from megatron_trainer.exitcodes import ExitCode, Fatal
    from megatron_trainer.safetensors_io import SafetensorsError, read_header

    try:
        header = read_header(Path(path))
    except SafetensorsError as e:  # as hf_source.validate_source reports it
        raise Fatal(ExitCode.BAD_CHECKPOINT, f"--hf-init: {e}") from None
    print(f"ok: {len(header)} tensors", file=sys.stderr)


def main(argv: list[str]) -> int:
    from megatron_trainer.exitcodes import classify, fatal_message

    kind, args = argv[0], argv[1:]
    try:
        {"sft": _sft, "tokenizer": _tokenizer, "safetensors": _safetensors}[kind](*args)
    except Exception as exc:  # main.py's handler: one code per kind of failure, the first line on stderr
        code = classify(exc, first_iteration_done=False)
        # the reason, then the innermost frames (each starting '  File "'): callers check the reason is one line
        print(f"megatron_trainer: {fatal_message(exc, code, 0, 'start-up')}", file=sys.stderr, flush=True)
        return int(code)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main(sys.argv[1:]))

