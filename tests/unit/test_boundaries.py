"""Import boundaries (import-linter contracts in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is not installed (pip install -e '.[test]')"
    r = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'trainer_image'}:{ROOT / 'contract'}",
                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 5 kept, 0 broken" in r.stdout
