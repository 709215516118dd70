"""JSON files a job's author supplies, read within bounds (pure: stdlib only).

The rules hf_config.load_config applies to config.json, for every other such file (the trainer's
tokenizer_config.json, ...): the size is capped before anything is parsed (at most ``max_bytes + 1`` bytes
are ever read, so a file that grows meanwhile is no way around it), the text must be UTF-8, and nesting
deep enough to exhaust the parser's recursion is an error, not a RecursionError. Every failure is one
JsonFileError (a ValueError: the trainer's data errors are exit code 3) naming the file.
(hf_config.load_config keeps its own copy of these steps, with config.json's messages; it can call this.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonFileError(ValueError):
    """A JSON file that is missing, too large or not JSON; the message names it."""


def read_json(path: str | Path, max_bytes: int, what: str = "") -> Any:
    """The parsed file; JsonFileError when it cannot be read, is larger than ``max_bytes`` or is not JSON."""
    path = Path(path)
    name = f"{path}{f' ({what})' if what else ''}"
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise JsonFileError(f"{name}: cannot be read: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise JsonFileError(f"{name}: larger than {max_bytes} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise JsonFileError(f"{name}: not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JsonFileError(f"{name}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise JsonFileError(f"{name}: not JSON (nested too deeply)") from None
