"""The README and the docs against a real run: set-up commands, the tour's outputs, nothing referred outside.

The tour and the examples of docs/views.md run against `anonproxy up` started
from this checkout (scripts/live_docs.py, which also rewrites them:
`python3 scripts/live_docs.py refresh`).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _live_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("live_docs", ROOT / "scripts" / "live_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


live_docs = _live_docs()


def test_the_two_setup_commands_are_the_quickstart_and_ci_runs_the_second() -> None:
    first, second = live_docs.setup_commands()
    assert first.split()[0] == "./quickstart" and second == "./quickstart test"
    script = ROOT / "quickstart"
    assert script.stat().st_mode & 0o111, "quickstart must be executable"
    assert subprocess.run(["sh", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    # Everything goes into the clone's virtual environment: no system-wide pip install.
    assert "--break-system-packages" not in text
    assert 'exec "$venv/bin/python" -m anonproxy up "$@"' in text
    assert 'exec "$venv/bin/python" -m pytest "$@"' in text
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == second, "the last step of .ci/run must be the README's test command"
    assert ".ci/readme" in ci, ".ci/run must try the README's first command on a clean clone"


def test_the_readme_tour_matches_a_real_run() -> None:
    examples = live_docs.parse(ROOT / "README.md")
    kinds = [example.kind for example in examples]
    assert kinds[0] == "up" and kinds.count("noisy") == 2 and len(examples) >= 4
    differences = live_docs.run_file(ROOT / "README.md")
    assert not differences, "stale README output; `python3 scripts/live_docs.py refresh` rewrites it:\n\n" + \
        "\n\n".join(map(str, differences))


def test_the_examples_of_docs_views_match_a_real_run() -> None:
    assert live_docs.parse(ROOT / "docs" / "views.md")
    differences = live_docs.run_file(ROOT / "docs" / "views.md")
    assert not differences, "\n\n".join(map(str, differences))


@pytest.mark.parametrize(
    ("shown", "actual", "kind", "same"),
    [
        (["a", " 30162"], ["a", " 30162"], "exact", True),
        (["a", " 30162"], ["a", " 30163"], "exact", False),  # a changed number is stale
        (["a"], ["a", "b"], "exact", False),  # so is a new line
        (["  elapsed  7.74 s"], ["  elapsed  1.60 s"], "exact", True),  # elapsed time is not compared
        ([" 10th | 829 | 37.33"], [" 10th |  831 | 38.1"], "noisy", True),  # noise: shape and words only
        ([" Bachelors | 829"], [" Masters | 829"], "noisy", False),
        (["head", "..."], ["head", "x", "y"], "exact", True),
        (["head", "...", "end"], ["head", "x", "end"], "exact", True),
        (["head", "...", "end"], ["head", "x", "other"], "exact", False),
    ],
)
def test_outputs_are_compared_line_by_line(shown: list[str], actual: list[str], kind: str, same: bool) -> None:
    assert live_docs.matches(shown, actual, kind) is same


def test_no_file_refers_to_documents_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"DESIGN\.md|REFERENCE\.md|DESIGN principle|REFERENCE §|\.\./shared|/work/shared|seed 00\d")
    offenders = [
        f"{name}:{number}"
        for name in files
        if name.endswith((".md", ".py", ".sql", ".yaml", ".toml", ".html", ".sh")) and (ROOT / name).is_file()
        for number, line in enumerate((ROOT / name).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if outside.search(line) and name != "tests/test_readme.py"
    ]
    assert offenders == []
