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
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

#: The safetensors library's own limit on the header (100 MB).
MAX_HEADER_BYTES = 100_000_000
#: model.safetensors.index.json of a 405B model is ~100 kB; anything past this is not an index.
MAX_INDEX_BYTES = 64 << 20
#: Bits per element of every dtype the safetensors library knows (its ``Dtype::bitsize``): a file with any
#: of them is read; only the float ones can be loaded as weights (FLOAT_DTYPES, hf_source).
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
#: serde_json's recursion limit: the library refuses a header nested this deep.
MAX_HEADER_DEPTH = 128
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


class _StrictHeader(json.JSONDecoder):
    """JSON as the safetensors library (serde_json) reads a header: no NaN or Infinity, no number beyond a
    float's range, no key given twice (``_check_json_values`` does lone surrogates and depth); ``-0`` stays
    apart from ``0`` (serde reads it as a float, which no size or offset may be)."""

    def __init__(self):
        super().__init__(object_pairs_hook=self._pairs, parse_constant=self._constant, parse_int=self._int,
                         parse_float=self._float)

    @staticmethod
    def _pairs(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:  # readers disagree on which one wins
                raise SafetensorsError(f"{_show(key)} is given twice")
            out[key] = value
        return out

    @staticmethod
    def _constant(name: str):
        raise SafetensorsError(f"{name} is not JSON")

    @staticmethod
    def _float(text: str) -> float:
        value = float(text)
        if math.isinf(value):  # serde: "number out of range"
            raise SafetensorsError(f"{text[:40]} is out of range")
        return value

    @staticmethod
    def _int(text: str) -> int | float:
        value = int(text)
        return -0.0 if value == 0 and text.startswith("-") else value


def _show(name: str) -> str:
    return repr(name[:200]).encode("ascii", "backslashreplace").decode()


def _check_json_values(header: object) -> None:
    """What Python's json accepts and serde_json does not: a lone surrogate (an unpaired \\uD800-\\uDFFF
    escape) in a string, and nesting deeper than serde's recursion limit."""
    stack = [(header, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise SafetensorsError(f"{_show(value)} holds an unpaired surrogate escape (not Unicode)") from None
        elif isinstance(value, (dict, list)):
            if depth >= MAX_HEADER_DEPTH:
                raise SafetensorsError(f"nested deeper than {MAX_HEADER_DEPTH - 1} levels")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


def _u64(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of one file, checked as the safetensors library checks it (and against the file's
    size); SafetensorsError otherwise.

    The library's rules (safetensors ``Metadata::validate`` and ``read_metadata``): the header is a JSON
    object of tensor entries ``{"dtype", "shape", "data_offsets"}`` and an optional ``__metadata__`` of
    strings; each tensor's bytes are its shape times its dtype's size; sorted by offset, the tensors tile
    the data from byte 0 with no gap and no overlap, and the file ends where the last one does. Stricter
    than the library in one way: a name given twice is refused (the library keeps the last)."""
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
        header = _StrictHeader().decode(raw.decode("utf-8"))
        _check_json_values(header)
    except SafetensorsError as e:
        raise SafetensorsError(f"{path.name}: header is not valid JSON: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise SafetensorsError(f"{path.name}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path.name}: header is not a JSON object")
    data_start = 8 + n
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise SafetensorsError(f"{path.name}: __metadata__ is not an object of strings")
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise SafetensorsError(f"{path.name}: entry {_show(name)} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise SafetensorsError(f"{path.name}: {_show(name)}: unknown dtype {str(dtype)[:40]!r}")
        if not (isinstance(shape, list) and all(_u64(d) for d in shape)):
            raise SafetensorsError(f"{path.name}: {_show(name)}: bad shape {str(shape)[:80]}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_u64(o) for o in offsets)):
            raise SafetensorsError(f"{path.name}: {_show(name)}: bad data_offsets {str(offsets)[:80]}")
        nbits = 1
        for d in [*shape, DTYPE_BITS[dtype]]:  # in the library's order, each product within 64 bits
            nbits *= d
            if nbits >= 2**64:
                raise SafetensorsError(f"{path.name}: {_show(name)}: shape {str(shape)[:80]} overflows 64 bits")
        begin, end = offsets
        if nbits % 8 or not begin <= end or end - begin != nbits // 8:
            raise SafetensorsError(f"{path.name}: {_show(name)}: data_offsets {offsets} do not hold a "
                                   f"{dtype} tensor of shape {str(shape)[:80]}")
        if data_start + end > size:
            raise SafetensorsError(f"{path.name}: {_show(name)} ends at byte {data_start + end} but the file has "
                                   f"{size} (truncated)")
        out[name] = TensorInfo(path, dtype, tuple(shape), data_start + begin, data_start + end)
    covered = 0
    for name, info in sorted(out.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin - data_start != covered:
            what = "overlaps the tensor before it" if info.begin - data_start < covered else "leaves a gap before it"
            raise SafetensorsError(f"{path.name}: {_show(name)}: data_offsets "
                                   f"[{info.begin - data_start}, {info.end - data_start}] {what} (byte {covered})")
        covered = info.end - data_start
    if data_start + covered != size:
        raise SafetensorsError(f"{path.name}: the tensors end at byte {data_start + covered} but the file has "
                               f"{size} (bytes no tensor holds)")
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
