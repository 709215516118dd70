import sys
from pathlib import Path

# Test helpers (factory, spec table, CEL evaluator) live beside the unit tests.
sys.path.insert(0, str(Path(__file__).parent / "unit"))
