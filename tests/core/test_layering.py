"""The layering the package is built on: import-linter's contracts (``[tool.importlinter]`` in
pyproject.toml, run by ``./dev lint``) hold, and they would catch a breach; no module is over
600 lines; tests reach private code through the folders' faces, which lend no underscored name."""

from __future__ import annotations

import ast
import importlib
import re
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
    of pinpool/ (but the package's own __init__) is one of the layers."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in config if c["type"] == "layers"]
    named = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    tops = {f"pinpool.{p.stem}" for p in PACKAGE.iterdir() if (p.suffix == ".py" or p.is_dir()) and p.name[0] != "."}
    tops -= {"pinpool.__init__", "pinpool.__pycache__"}
    assert tops - named == set(), "modules in no layer of pyproject.toml's layers contract"
    assert named - tops == set(), "layers that name no module"


def test_no_module_is_over_600_lines() -> None:
    large = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().count("\n")
        if lines > MAX_LINES:
            large[str(path.relative_to(ROOT))] = lines
    assert not large, f"over {MAX_LINES} lines: {large}"


# -- tests import from the folders' faces ------------------------------------------------------------------

TESTS = ROOT / "tests"
# The one seam: tests fake the host's system calls by patching this module object (pinpool/_host/__init__.py
# and docs/architecture.md say so). The whole-host facts are faked at pinpool._probe.probe_host, a top-level file.
SEAM = "pinpool._host.libc"


def _in_a_folder(module: str) -> bool:
    """``pinpool.<folder>.<file>`` (a file, or a folder, inside one of pinpool's folders)."""
    parts = module.split(".")
    return (
        len(parts) >= 3
        and parts[0] == "pinpool"
        and (PACKAGE / parts[1]).is_dir()
        and ((PACKAGE.joinpath(*parts[1:-1]) / f"{parts[-1]}.py").exists() or PACKAGE.joinpath(*parts[1:]).is_dir())
    )


def files_a_test_imports(path: Path) -> set[str]:
    """The files inside pinpool's folders that a test module imports or names in a string (a patch target)."""
    text = path.read_text()
    found = set(re.findall(r"""["'](pinpool(?:\.\w+){2,})["']""", text))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if _in_a_folder(name) and name != SEAM}


def test_tests_import_from_the_faces_and_patch_through_the_seam() -> None:
    reached = {}
    for path in sorted(set(TESTS.rglob("*.py")) - {Path(__file__)}):  # this file names them as data
        key = str(path.relative_to(ROOT))
        if extra := files_a_test_imports(path):
            reached[key] = sorted(extra)
    assert not reached, f"import these names from the folder (its __init__ lends them), not from a file: {reached}"


def test_the_faces_lend_no_underscored_name_and_every_name_they_lend_exists() -> None:
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        face = importlib.import_module(f"pinpool.{init.parent.name}")
        lent = set(getattr(face, "__all__", ()))
        for call in ast.walk(ast.parse(init.read_text())):
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "lazy_exports":
                lent |= {n for names in ast.literal_eval(call.args[1]).values() for n in names.split()}
        assert not [n for n in lent if n.startswith("_")], f"{init.parent.name} lends underscored names"
        for name in lent:
            assert getattr(face, name) is not None, (init.parent.name, name)
