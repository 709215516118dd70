"""safetensors files read and written with bounded memory (pure: stdlib only).

Format (huggingface/safetensors): an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data;
offsets are relative to the end of the header.

Reading never trusts the header: its length is bounded before anything is allocated, and every
tensor's offsets must match its dtype and shape and lie inside the file (a truncated shard is refused
before any byte is loaded). Data is read with ``os.pread`` into caller-owned buffers, a range of
rows at a time, so a rank holds only its own slice, never a whole file or a memory map of one.

Writing streams: the header is written from the planned (name, dtype, shape) list first, then each
tensor's bytes in order, so a shard never has to be in memory at once.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

#: The safetensors library's own limit on the header (100 MB).
MAX_HEADER_BYTES = 100_000_000
#: model.safetensors.index.json of a 405B model is ~100 kB; anything past this is not an index.
MAX_INDEX_BYTES = 64 << 20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsError(ValueError):
    """A file or index that is not a valid (or complete) safetensors checkpoint."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0."""
        n = self.itemsize
        for d in self.shape[1:]:
            n *= d
        return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of one file, checked against the file's size; SafetensorsError otherwise."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path.name}: {size} bytes, too short for a safetensors file (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise SafetensorsError(f"{path.name}: header claims {n} bytes, more than the {MAX_HEADER_BYTES} "
                                       "allowed (not a safetensors file, or corrupt)")
            if 8 + n > size:
                raise SafetensorsError(f"{path.name}: header claims {n} bytes but the file has {size} "
                                       "(truncated)")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path.name}: cannot be read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsError(f"{path.name}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path.name}: header is not a JSON object")
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{path.name}: entry {name[:200]!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise SafetensorsError(f"{path.name}: {name[:200]}: unknown dtype {str(dtype)[:40]!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise SafetensorsError(f"{path.name}: {name[:200]}: bad shape {str(shape)[:80]}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise SafetensorsError(f"{path.name}: {name[:200]}: bad data_offsets {str(offsets)[:80]}")
        numel = 1
        for d in shape:
            numel *= d
        begin, end = offsets
        if not 0 <= begin <= end or end - begin != numel * DTYPE_BYTES[dtype]:
            raise SafetensorsError(f"{path.name}: {name[:200]}: data_offsets {offsets} do not hold a "
                                   f"{dtype} tensor of shape {shape}")
        if data_start + end > size:
            raise SafetensorsError(f"{path.name}: {name[:200]} ends at byte {data_start + end} but the file has "
                                   f"{size} (truncated)")
        out[name] = TensorInfo(path, dtype, tuple(shape), data_start + begin, data_start + end)
    return out


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face model directory: `model.safetensors.index.json` + shards, or a
    single `model.safetensors`. Every shard's header is read and checked at construction."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = {}
        index = self.directory / INDEX_NAME
        if index.is_file():
            files = self._files_from_index(index)
        elif (self.directory / SINGLE_NAME).is_file():
            files = {SINGLE_NAME: None}
        else:
            raise SafetensorsError(f"{self.directory}: neither {INDEX_NAME} nor {SINGLE_NAME} "
                                   "(only safetensors checkpoints are read; no .bin/.pt)")
        root = self.directory.resolve()
        for name, expected in sorted(files.items()):
            path = self.directory / name
            if not path.is_file():
                raise SafetensorsError(f"{INDEX_NAME} names {name}, which is not in {self.directory}")
            if root not in path.resolve().parents:  # a symlink out of the model directory (and its mount)
                raise SafetensorsError(f"{name} is a link to {path.resolve()}, outside {self.directory}")
            header = read_header(path)
            if expected is not None:
                missing = sorted(expected - header.keys())
                if missing:
                    raise SafetensorsError(f"{INDEX_NAME} puts {missing[0]!r} (and {len(missing) - 1} more) in "
                                           f"{name}, which does not hold it" if len(missing) > 1 else
                                           f"{INDEX_NAME} puts {missing[0]!r} in {name}, which does not hold it")
            for tname, info in header.items():
                if tname in self.tensors:
                    raise SafetensorsError(f"tensor {tname!r} is in both {self.tensors[tname].file.name} and {name}")
                self.tensors[tname] = info

    def _files_from_index(self, index: Path) -> dict[str, set[str]]:
        try:
            if index.stat().st_size > MAX_INDEX_BYTES:
                raise SafetensorsError(f"{INDEX_NAME}: larger than {MAX_INDEX_BYTES} bytes")
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise SafetensorsError(f"{INDEX_NAME}: cannot be read as JSON: {e}") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SafetensorsError(f"{INDEX_NAME}: no weight_map")
        files: dict[str, set[str]] = {}
        for tname, fname in weight_map.items():
            if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname in ("", ".", "..") \
                    or not fname.endswith(".safetensors"):
                raise SafetensorsError(f"{INDEX_NAME}: {tname[:200]!r} maps to {str(fname)[:200]!r}, not a "
                                       ".safetensors file in the model directory")
            files.setdefault(fname, set()).add(tname)
        return files

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]


def read_rows_into(info: TensorInfo, row_start: int, row_end: int, buffer: memoryview) -> None:
    """Copy rows [row_start, row_end) of a tensor (dim 0) into `buffer` (exactly that many bytes)."""
    offset = info.begin + row_start * info.row_bytes
    length = (row_end - row_start) * info.row_bytes
    if len(buffer) != length:
        raise ValueError(f"buffer of {len(buffer)} bytes for {length}")
    with open(info.file, "rb", buffering=0) as f:
        fd = f.fileno()
        done = 0
        while done < length:
            n = os.preadv(fd, [buffer[done:]], offset + done)
            if n <= 0:
                raise SafetensorsError(f"{info.file.name}: unexpected end of file at byte {offset + done} "
                                       "(truncated while reading?)")
            done += n


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


class StreamingWriter:
    """Writes one safetensors file: the header for `tensors` up front, then `write(name, bytes-like)`
    in the same order. `close()` checks that every tensor was written and fsyncs."""

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None):
        self.path = path
        self.tensors = tensors
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        pos = 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
        self._f = open(path, "xb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, data) -> None:
        expected = self.tensors[self._next]
        if name != expected.name:
            raise ValueError(f"{self.path.name}: wrote {name}, expected {expected.name}")
        view = memoryview(data).cast("B")
        if len(view) != expected.nbytes:
            raise ValueError(f"{self.path.name}: {name} has {len(view)} bytes, planned {expected.nbytes}")
        self._f.write(view)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.tensors):
            self._f.close()
            raise ValueError(f"{self.path.name}: {len(self.tensors) - self._next} planned tensors not written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def plan_shards(tensors: list[tuple[PlannedTensor, int]], max_bytes: int) -> list[tuple[int, list[PlannedTensor]]]:
    """Tensors (each with the pipeline stage that owns it, in order) -> shards of at most `max_bytes`
    (a larger tensor gets a shard of its own) that never mix stages: [(stage, tensors)]."""
    shards: list[tuple[int, list[PlannedTensor]]] = []
    size = 0
    for t, stage in tensors:
        if not shards or shards[-1][0] != stage or (size + t.nbytes > max_bytes and shards[-1][1]):
            shards.append((stage, []))
            size = 0
        shards[-1][1].append(t)
        size += t.nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"
