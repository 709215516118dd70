"""Kubernetes quantities as numbers (pure): what advice and the memory estimate read from spec.resources."""

from __future__ import annotations

import re

_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?")


def quantity_bytes(value: int | str) -> float | None:
    """A Kubernetes quantity as a number (bytes for memory); None if it is not one."""
    if isinstance(value, int):
        return float(value)
    m = _QUANTITY.fullmatch(value)
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""] if m else None
