"""The layering the package is built on: import-linter's contracts (``[tool.importlinter]`` in
pyproject.toml, run by ``./dev lint``) hold, and they would catch a breach; no module is over
600 lines."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
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


LAYERS = "the layers, top to bottom"
PURE = "the pure modules make no system call"


@pytest.mark.parametrize(
    ("module", "breach", "contract"),
    [
        ("_errors.py", "from . import _units", LAYERS),
        ("_plan/plan.py", "from .._host import libc", PURE),
        ("_pin/ledger.py", "from . import engine", PURE),
        ("_pin/lifecycle.py", "from . import drivers", "the lifecycle imports no driver"),
        ("_pin/pipeline.py", "from .._pool import pool", LAYERS),
        ("_shared/format.py", "from .._node import config", LAYERS),
        ("_plan/a_new_module.py", "from .._pin import engine", LAYERS),  # a new file inherits its folder's layer
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


def test_every_module_is_in_a_layer() -> None:
    """A module outside every layer would be outside every rule: each top-level file or folder
    of pinpool/ (but the package's own __init__ and __main__) is one of the layers."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in config if c["type"] == "layers"]
    named = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    tops = {f"pinpool.{p.stem}" for p in PACKAGE.iterdir() if (p.suffix == ".py" or p.is_dir()) and p.name[0] != "."}
    tops -= {"pinpool.__init__", "pinpool.__main__", "pinpool.__pycache__"}
    assert tops - named == set(), "modules in no layer of pyproject.toml's layers contract"
    assert named - tops == set(), "layers that name no module"


def test_no_module_is_over_600_lines() -> None:
    large = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines > MAX_LINES:
            large[str(path.relative_to(ROOT))] = lines
    assert not large, f"over {MAX_LINES} lines: {large}"
