"""``mypy --strict`` finds no error in the modules pyproject.toml lists (issue 18).

The list is ``[tool.mypy] files`` in pyproject.toml, and only there: a module joins it once it is clean. mypy also
checks, with the same rules, every anonproxy module the listed ones import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_listed_modules_pass_mypy_strict() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file", "pyproject.toml"],
                            cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
