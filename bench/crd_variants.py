"""The CRD variants the benchmarks install or validate against (``--variants``, ``--crd``).

``shipped`` (crds/ in the working tree), ``no-cel`` (the same schema without any
``x-kubernetes-validations``), ``NAME=PATH`` of another CRD file, and ``NAME=git:REV``: the CRD of an
earlier commit, read with git show. Used by crd_write_cost.py, cel_validator_cost.py and
operator_latency.py; it imports none of them.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e"))

from mjob import CRD_FILE  # noqa: E402


def variant_crd(name: str, spec: str | None) -> dict:
    """The CRD of variant ``name``; ``spec``: the PATH or git:REV after ``NAME=`` (None for the two built in)."""
    shipped = yaml.safe_load(CRD_FILE.read_text())
    if name == "shipped":
        return shipped
    if name == "no-cel":
        out = copy.deepcopy(shipped)

        def strip(node: Any) -> None:
            if isinstance(node, dict):
                node.pop("x-kubernetes-validations", None)
                for v in node.values():
                    strip(v)
            elif isinstance(node, list):
                for v in node:
                    strip(v)
        strip(out["spec"]["versions"])
        return out
    if spec is None:
        raise SystemExit(f"variant {name!r}: give it as NAME=PATH of a CRD file or NAME=git:REV")
    if spec.startswith("git:"):
        rel = CRD_FILE.resolve().relative_to(ROOT)
        return yaml.safe_load(subprocess.run(["git", "-C", str(ROOT), "show", f"{spec[4:]}:{rel}"],
                                             capture_output=True, text=True, check=True).stdout)
    return yaml.safe_load(Path(spec).read_text())
