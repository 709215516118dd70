"""Megatron's IndexedDataset (.bin/.idx) format, written and read with numpy alone (no torch).

The layout follows megatron/core/datasets/indexed_dataset.py (0.19) byte for byte:

.idx:  b"MMIDIDX\\x00\\x00"            9-byte header
       <Q 1                              version
       <B dtype code                     DType enum: 1 uint8 .. 4 int32, 5 int64, 8 uint16
       <Q sequence_count
       <Q document_count                 len(document_indices), leading 0 included
       int32[sequence_count]             tokens per sequence
       int64[sequence_count]             byte offset of each sequence in .bin
       int64[document_count]             sequence index where each document ends (starts with 0)
.bin:  the token ids of every sequence, concatenated, in the dtype above

As in Megatron's `tools/preprocess_data.py` without sentence splitting, every document is one sequence.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6,
               np.float32: 7, np.uint16: 8}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> type:
    """`DType.optimal_dtype`: uint16 below 65500 tokens, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin` and writes `<prefix>.idx` on `finalize()`."""

    def __init__(self, prefix: str | Path, dtype: type = np.int32):
        if dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported dtype {dtype}")
        self.prefix = str(prefix)
        self.dtype = dtype
        self._bin = open(self.prefix + ".bin", "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, token_ids: Iterable[int]) -> None:
        array = np.asarray(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids)
        info = np.iinfo(self.dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise ValueError(f"token id out of range for {np.dtype(self.dtype).name}")
        self._bin.write(array.astype(self.dtype).tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self) -> None:
        self._bin.close()
        itemsize = np.dtype(self.dtype).itemsize
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1] * itemsize)
        with open(self.prefix + ".idx", "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))


class IndexedDatasetView(NamedTuple):
    dtype: type
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray
    tokens: np.ndarray

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // np.dtype(self.dtype).itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]


def read_indexed_dataset(prefix: str | Path) -> IndexedDatasetView:
    """Read `<prefix>.idx/.bin` back (a check for tests and for `preprocess --verify`)."""
    prefix = str(prefix)
    with open(prefix + ".idx", "rb") as f:
        if f.read(9) != INDEX_HEADER:
            raise ValueError(f"{prefix}.idx: bad header")
        (version,) = struct.unpack("<Q", f.read(8))
        if version != 1:
            raise ValueError(f"{prefix}.idx: version {version}")
        (code,) = struct.unpack("<B", f.read(1))
        (num_seqs,) = struct.unpack("<Q", f.read(8))
        (num_docs,) = struct.unpack("<Q", f.read(8))
        lengths = np.frombuffer(f.read(4 * num_seqs), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * num_seqs), dtype=np.int64)
        docs = np.frombuffer(f.read(8 * num_docs), dtype=np.int64)
        if f.read(1):
            raise ValueError(f"{prefix}.idx: trailing bytes")
    dtype = CODE_DTYPES[code]
    tokens = np.fromfile(prefix + ".bin", dtype=dtype)
    return IndexedDatasetView(dtype, lengths, pointers, docs, tokens)
