"""The safetensors library is the oracle for our header reader (issue 52): over generated and hand-made
headers, safetensors_io.read_header refuses every file `safetensors.safe_open` refuses, and accepts every
file it accepts, but one kind: a key given twice (a tensor's name, or a key of __metadata__), which the
library resolves by keeping the last and we refuse. The hand-made corpus then runs as the trainer runs it (a subprocess under a memory cap and
a time limit): each file exits 5 (the checkpoint cannot be used; not retried) with one line naming it."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import bounded
from conftest import require
from megatron_trainer.safetensors_io import DTYPE_BITS, MAX_HEADER_DEPTH, SafetensorsError, read_header

safetensors = require("safetensors")


def library_accepts(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), framework="numpy") as f:
            list(f.keys())
            f.metadata()
    except safetensors.SafetensorError:
        return False
    return True


def we_accept(path: Path) -> tuple[bool, str]:
    try:
        read_header(path)
    except SafetensorsError as e:
        return False, str(e)
    return True, ""


def file_bytes(header: str | bytes, data: bytes = b"", length_delta: int = 0) -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + data


def obj(pairs: list[tuple[str, str]]) -> str:
    """A JSON object from (key, JSON text) pairs, keys repeated as given."""
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


def entry(dtype: str, shape: list, offsets: list, extra: str = "") -> str:
    return "{" + f'"dtype":{json.dumps(dtype)},"shape":{json.dumps(shape)},"data_offsets":{json.dumps(offsets)}' \
        + extra + "}"


# ------------------------------------------------------------------------------------ generated headers
DTYPES = sorted(DTYPE_BITS) + ["f32", "F8", "", "Q4"]
NAMES = ["a", "b", "c", "model.layers.0.mlp.up_proj.weight", "", "__metadata__", "\u00e9", "\U0001f600"]
# JSON texts that Python reads and serde_json does not (or reads as another type)
ODD_NUMBERS = ["-0", "1e400", "NaN", "Infinity", "-1", "1.0", "18446744073709551616", "18446744073709551615",
               "true", "null", '"2"']


@st.composite
def headers(draw) -> tuple[bytes, bool]:
    """(file bytes, whether a key is repeated)."""
    n = draw(st.integers(0, 4))
    names = [draw(st.sampled_from(NAMES)) if draw(st.integers(0, 5)) == 0 else f"layer.{i}.weight" for i in range(n)]
    tensors = []
    pos = 0
    for name in names:
        dtype = draw(st.sampled_from(DTYPES)) if draw(st.integers(0, 29)) == 0 else \
            draw(st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "F4", "F6_E2M3", "F8_E4M3", "BOOL"]))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        bits = DTYPE_BITS.get(dtype, 8)
        numel = 1
        for d in shape:
            numel *= d
        size = numel * bits // 8
        offsets = [pos, pos + size]
        tensors.append([name, dtype, shape, offsets])
        pos += size
    shape_texts = {}
    # perturbations, each rare enough that most headers stay valid
    for t in tensors:
        kind = draw(st.integers(0, 40))
        if kind == 0:
            t[3] = [t[3][0] + draw(st.integers(-3, 3)), t[3][1] + draw(st.integers(-3, 3))]
        elif kind == 1:
            t[3] = [t[3][1], t[3][0]]
        elif kind == 2:
            t[2] = t[2] + [draw(st.integers(0, 3))]
        elif kind == 3:
            shape_texts[id(t)] = "[" + ",".join([draw(st.sampled_from(ODD_NUMBERS))] + [str(d) for d in t[2]]) + "]"
        elif kind == 4:
            t[2] = [2**32, 2**32, 0]
            t[3] = [t[3][0], t[3][0]]
    if tensors and draw(st.booleans()):
        draw(st.randoms()).shuffle(tensors)
    pairs = []
    for name, dtype, shape, offsets in tensors:
        extra = draw(st.sampled_from([""] * 30 + [',"x":1', ',"x":{"y":[1,2,{"z":null}]}', ',"x":1e400', ',"x":NaN',
                                      ',"x":"\\ud800"', ',"x":"\\ud83d\\ude00"', ',"dtype":"F32"',
                                      ',"x":' + "[" * (MAX_HEADER_DEPTH - 3) + "]" * (MAX_HEADER_DEPTH - 3),
                                      ',"x":' + "[" * (MAX_HEADER_DEPTH - 2) + "]" * (MAX_HEADER_DEPTH - 2)]))
        body = entry(dtype, shape, offsets, extra)
        if any(t[0] == name and id(t) in shape_texts for t in tensors):
            body = body.replace(json.dumps(shape), next(shape_texts[id(t)] for t in tensors if t[0] == name
                                                        and id(t) in shape_texts), 1)
        pairs.append((name, body))
    meta = draw(st.sampled_from([None] * 6 + ['{"format":"pt"}'] * 6 + ["null", "{}", '{"a":1}', '{"a":{"b":"c"}}',
                                                                      '"pt"', '{"a":"b","a":"c"}']))
    if meta is not None:
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", meta))
    if draw(st.integers(0, 19)) == 0:
        pairs.append(("__metadata__", '{"format":"pt"}'))
    text = obj(pairs)
    if draw(st.integers(0, 19)) == 0:
        text = draw(st.sampled_from([" ", "\n", "", "x", "\x00", "\ufeff", "[", "]", "}", "{"])) + text \
            + draw(st.sampled_from(["", " ", "  ", "x", "\x00", "}", "]", ",", "\t"]))
    raw = text.encode()
    if draw(st.integers(0, 39)) == 0:
        i = draw(st.integers(0, max(0, len(raw) - 1)))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
    data = b"\0" * max(0, pos + draw(st.sampled_from([0] * 12 + [1, -1, 8])))
    length_delta = draw(st.sampled_from([0] * 30 + [1, -1, 7, 10**6]))
    return file_bytes(raw, data, length_delta), has_repeated_key(raw)


def has_repeated_key(raw: bytes) -> bool:
    """A key given twice in some object of the header (where Python's json can read it)."""
    seen = []

    def pairs(items):
        keys = [k for k, _ in items]
        seen.append(len(set(keys)) < len(keys))
        return dict(items)

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return False
    return any(seen)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
@given(case=headers())
def test_the_reader_refuses_what_the_library_refuses(tmp_path, case):
    content, repeated = case
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    lib = library_accepts(path)
    ours, why = we_accept(path)
    event(f"library {'accepts' if lib else 'refuses'}, we {'accept' if ours else 'refuse'}")
    if lib:
        assert ours or (repeated and "given twice" in why), (why, content[:300])
    else:
        assert not ours, content[:300]


# ------------------------------------------------------------------------------------------ the corpus
T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
CORPUS: dict[str, tuple[bytes, str]] = {
    # name: (file, a piece of our message); each refused by the library too (checked below)
    "overlapping offsets": (file_bytes(json.dumps({"a": T, "b": T}), b"\0" * 8), "overlaps the tensor before it"),
    "a name twice, the last valid": (file_bytes(obj([("a", entry("F32", [2], [0, 4])), ("a", json.dumps(T))]),
                                                b"\0" * 8), "'a' is given twice"),
    "a gap before the first tensor": (file_bytes(json.dumps({"a": {**T, "shape": [1], "data_offsets": [4, 8]}}),
                                                 b"\0" * 8), "leaves a gap"),
    "bytes after the last tensor": (file_bytes(json.dumps({"a": T}), b"\0" * 9), "bytes no tensor holds"),
    "offsets past the file": (file_bytes(json.dumps({"a": T}), b"\0" * 4), "truncated"),
    "a lone surrogate in a name": (file_bytes('{"\\ud800":' + json.dumps(T) + "}", b"\0" * 8), "surrogate"),
    "NaN in metadata": (file_bytes('{"__metadata__":{"x":NaN}}'), "NaN is not JSON"),
    "metadata not strings": (file_bytes('{"__metadata__":{"x":1}}'), "__metadata__ is not an object of strings"),
    "negative zero offset": (file_bytes('{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}', b"\0" * 8),
                             "bad data_offsets"),
    "a shape past 64 bits": (file_bytes(json.dumps({"a": {**T, "shape": [2**64]}}), b"\0" * 8), "bad shape"),
    "a shape product past 64 bits": (file_bytes(json.dumps({"a": {**T, "shape": [2**32, 2**32, 0],
                                                                  "data_offsets": [0, 0]}})), "overflows 64 bits"),
    "half a byte of F4": (file_bytes(json.dumps({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}),
                                     b"\0"), "do not hold"),
    "nested past serde's limit": (file_bytes('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":'
                                             + "[" * 200 + "]" * 200 + "}}"), "nested deeper than 127"),
    "nested past Python's limit": (file_bytes("[" * 200_000 + "]" * 200_000), "not valid JSON"),
    "a number past a float": (file_bytes('{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":1e400}}'),
                              "out of range"),
    "a header that is a list": (file_bytes("[]"), "not a JSON object"),
    "an unknown dtype": (file_bytes(json.dumps({"a": {**T, "dtype": "f32"}}), b"\0" * 8), "unknown dtype"),
    "a header claiming 2**62 bytes": (struct.pack("<Q", 2**62) + b"{}", "header claims"),
    "seven bytes": (b"\0" * 7, "too short"),
    "not UTF-8": (file_bytes(b'{"\xff":1}'), "not valid JSON"),
    "trailing characters": (file_bytes("{} x"), "not valid JSON"),
    "a byte-order mark": (file_bytes("\ufeff{}"), "not valid JSON"),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_is_refused_by_both_readers(tmp_path, name):
    content, needle = CORPUS[name]
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    ours, why = we_accept(path)
    assert not ours and needle in why, why
    if name != "a name twice, the last valid":
        assert not library_accepts(path)
    else:
        assert library_accepts(path)  # the one kind we are stricter on (the module docstring)


def test_corpus_exits_5_with_one_line_under_the_trainers_limits(tmp_path):
    for name, (content, needle) in sorted(CORPUS.items()):
        path = tmp_path / "model.safetensors"
        path.write_bytes(content)
        code, stderr, took_s = bounded.run("safetensors", str(path), timeout_s=20)
        line = bounded.reason(stderr)
        assert code == 5, (name, code, stderr[-2000:])
        assert needle in line and "model.safetensors" in line and len(line) < 1000, (name, line)
        assert "Traceback" not in stderr, (name, stderr[-2000:])
