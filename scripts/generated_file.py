"""The command line every generator in scripts/ shares: write the generated file, or with --check
exit 1 when the committed one differs (the tests run --check, so a stale file fails CI)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(description: str, target: Path, render: Callable[[], str], script: str,
         argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not target.exists() or target.read_text() != text:
            print(f"{target.relative_to(ROOT)} is stale: run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    print(f"wrote {target.relative_to(ROOT)}")
    return 0
