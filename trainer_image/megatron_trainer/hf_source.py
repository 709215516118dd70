"""The Hugging Face directory a job starts from, checked before anything runs (pure: no torch).

`validate_source(directory, cfg)` reads config.json, compares it with the trainer's flags, reads and
checks every safetensors header (sizes against the file: a truncated shard is caught here), and
checks that the checkpoint holds exactly the tensors the architecture needs, with their shapes and a
float dtype, and a tokenizer. Every problem is a `Fatal` with a non-retriable exit code, raised
before the trainer writes anything (main.py calls this before the attempt log and the model).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import TrainerConfig
from .exitcodes import ExitCode, Fatal
from .hf_config import HfConfigError, HfModel, load_config, mismatches, not_converted, parse_config
from .hf_mapping import IGNORED_HF, hf_tensor_shapes
from .safetensors_io import FLOAT_DTYPES, SafetensorsCheckpoint, SafetensorsError

#: Tokenizer files copied into an export (whichever the source has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
#: In a finished export (iteration, shards); an export is complete only once it has this.
MARKER = ".megatron-export.json"
#: In an export's temporary directory while it is written.
PARTIAL_MARKER = ".megatron-export-partial"
#: One of these makes a directory a tokenizer.
TOKENIZER_REQUIRED = ("tokenizer.json", "tokenizer.model")


@dataclass
class HfSource:
    directory: Path
    config: dict[str, Any]
    model: HfModel
    checkpoint: SafetensorsCheckpoint


def parse_for(cfg: TrainerConfig, config: dict[str, Any]) -> HfModel:
    """config.json against the flags: the model, or Fatal(BAD_ARGUMENTS) naming every difference."""
    try:
        model = parse_config(config, cfg.model.seq_length)
    except HfConfigError as e:
        raise Fatal(ExitCode.BAD_ARGUMENTS, "the Hugging Face model cannot be imported: " + "; ".join(e.problems)) \
            from None
    unmapped = not_converted(model)
    if unmapped:
        raise Fatal(ExitCode.BAD_ARGUMENTS, "the Hugging Face model cannot be imported: " + "; ".join(unmapped))
    diff = mismatches(cfg, model)
    if diff:
        raise Fatal(ExitCode.BAD_ARGUMENTS, "spec.model does not match the Hugging Face config.json "
                    "(`megatron-operator hf-config config.json` prints the matching spec.model): " + "; ".join(diff))
    return model


def validate_source(directory: str | Path, cfg: TrainerConfig) -> HfSource:
    directory = Path(directory)
    if not directory.is_dir():
        raise Fatal(ExitCode.BAD_CHECKPOINT, f"--hf-init {directory}: not a directory")
    try:
        config = load_config(directory)
    except HfConfigError as e:
        raise Fatal(ExitCode.BAD_CHECKPOINT, f"--hf-init: {e}") from None
    model = parse_for(cfg, config)
    if not any((directory / name).is_file() for name in TOKENIZER_REQUIRED):
        raise Fatal(ExitCode.BAD_CHECKPOINT, f"--hf-init {directory}: no tokenizer ({' or '.join(TOKENIZER_REQUIRED)})"
                    "; an export copies it, and the model is useless without it")
    try:
        ckpt = SafetensorsCheckpoint(directory)
    except SafetensorsError as e:
        raise Fatal(ExitCode.BAD_CHECKPOINT, f"--hf-init {directory}: {e}") from None
    expected = hf_tensor_shapes(model)
    present = {n for n in ckpt.tensors if not IGNORED_HF.match(n)}
    if model.tied:
        present.discard("lm_head.weight")  # transformers ties it to the embedding on load, and so do we
    missing = [n for n in expected if n not in present]
    extra = sorted(present - expected.keys())
    problems = []
    if missing:
        problems.append(f"missing tensor(s) {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more"
                                                                          if len(missing) > 3 else ""))
    if extra:
        problems.append(f"tensor(s) the architecture has no place for: {', '.join(extra[:3])}"
                        + (f" and {len(extra) - 3} more" if len(extra) > 3 else ""))
    for name, shape in expected.items():
        info = ckpt.tensors.get(name)
        if info is None:
            continue
        if info.shape != shape:
            problems.append(f"{name} has shape {list(info.shape)}, config.json implies {list(shape)}")
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"{name} is {info.dtype}; weights must be F32, BF16 or F16")
    if problems:
        raise Fatal(ExitCode.BAD_CHECKPOINT, f"--hf-init {directory}: " + "; ".join(problems[:8])
                    + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))
    return HfSource(directory, config, model, ckpt)


def copy_tokenizer(source: Path | None, target: Path) -> list[str]:
    """Copy the tokenizer files `source` has into `target`; the names copied."""
    copied = []
    if source is None:
        return copied
    for name in TOKENIZER_FILES:
        path = source / name
        if path.is_file() and not path.is_symlink():
            shutil.copyfile(path, target / name)
            copied.append(name)
    return copied


def prepare_export_dir(final: Path, iteration: int) -> tuple[str, str]:
    """Rank 0, before an export: ('go', the temporary directory to write) | ('skip', why: this
    iteration is already exported there) | ('fail', message). An export never overwrites a directory:
    an existing target is refused unless it is this job's export of the same iteration. Temporary
    directories an earlier attempt left (`.<name>.partial-*` holding our marker) are removed."""
    if os.path.lexists(final):  # a dangling symlink is an existing entry too: never renamed over
        marker = final / MARKER
        try:
            done = json.loads(marker.read_text()) if marker.is_file() else None
        except (OSError, ValueError):
            done = None
        if isinstance(done, dict) and done.get("iteration") == iteration:
            return "skip", f"{final} already holds the export of iteration {iteration}"
        what = f"an export of iteration {done.get('iteration')}" if isinstance(done, dict) else \
            "a directory this trainer did not create"
        return "fail", (f"--hf-export {final} already exists ({what}); an export never overwrites a directory "
                        "(choose another spec.export path, or delete it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.partial-*"):
        # only what an earlier attempt of this export left
        if not stale.is_symlink() and (stale / PARTIAL_MARKER).is_file():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.partial-{iteration}"
    tmp.mkdir()
    (tmp / PARTIAL_MARKER).write_text(json.dumps({"iteration": iteration}))
    return "go", str(tmp)
