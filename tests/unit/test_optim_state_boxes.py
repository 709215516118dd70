"""optim_state.range_to_boxes: a contiguous range of a row-major tensor as the boxes a ShardedTensor describes
(the in-place optimizer checkpoint's pieces; the torch tests check the checkpoints themselves)."""

from __future__ import annotations

import itertools
import random
from math import prod

from megatron_trainer.optim_state import range_to_boxes


def _flat_indices(shape, offset, size):
    strides = [prod(shape[i + 1:]) for i in range(len(shape))]
    return [sum((o + i) * s for o, i, s in zip(offset, idx, strides, strict=True))
            for idx in itertools.product(*(range(n) for n in size))]


def test_every_range_of_small_shapes_is_its_boxes_in_flat_order():
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = prod(shape)
        start = rng.randint(0, n)
        end = rng.randint(start, n)
        boxes = range_to_boxes(shape, start, end)
        flat = [i for off, size in boxes for i in _flat_indices(shape, off, size)]
        assert flat == list(range(start, end)), (shape, start, end, boxes)
        for off, size in boxes:  # each box is one contiguous run of memory
            idx = _flat_indices(shape, off, size)
            assert idx == list(range(idx[0], idx[0] + len(idx)))
        assert len(boxes) <= 2 * len(shape) - 1
        checked += bool(boxes)
    assert checked > 1000  # most draws are non-empty ranges


def test_whole_rows_are_one_box_and_an_empty_range_none():
    assert range_to_boxes((4, 3), 3, 9) == [((1, 0), (2, 3))]
    assert range_to_boxes((4, 3), 0, 12) == [((0, 0), (4, 3))]
    assert range_to_boxes((4, 3), 5, 5) == []
    assert range_to_boxes((4, 3), 2, 7) == [((0, 2), (1, 1)), ((1, 0), (1, 3)), ((2, 0), (1, 1))]
