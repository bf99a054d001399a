"""The layering the package is built on: import-linter's contracts (``[tool.importlinter]`` in
pyproject.toml, run by ``./dev lint``) hold, and they would catch a breach; no module is over
~600 lines unless its docstring says why it is one concept."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pinpool"
MAX_LINES = 600

pytest.importorskip("importlinter")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
        cwd=root, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


def test_the_contracts_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "breach", "contract"),
    [
        ("_errors.py", "from . import _units", "errors import nothing of pinpool's"),
        ("_plan.py", "from . import _host", "planning imports no runtime and no host probe"),
        ("_ledger.py", "from . import _engine", "the pure core imports no engine"),
        ("_lifecycle.py", "from . import _drivers", "the lifecycle imports no driver"),
        ("_pipeline.py", "from . import _lifecycle", "the pinning stack, top to bottom"),
    ],
)
def test_a_breach_is_caught(tmp_path: Path, module: str, breach: str, contract: str) -> None:
    copy = tmp_path / "pinpool"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / module, "a") as f:
        f.write(f"\n{breach}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"{contract}" in result.stdout and "BROKEN" in result.stdout, result.stdout


def test_every_module_is_small_or_says_why_it_is_one_concept() -> None:
    large = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines > MAX_LINES and "One concept:" not in path.read_text().split('"""')[1]:
            large[str(path.relative_to(ROOT))] = lines
    assert not large, f"over {MAX_LINES} lines with no 'One concept:' in the docstring: {large}"
