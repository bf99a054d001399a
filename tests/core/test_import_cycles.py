"""No import circle in pinpool, counting the imports only annotations need (``TYPE_CHECKING``): a
reader (and a code-walking tool) follows those too. The layers contract (test_layering) checks run-time
imports only."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pinpool

PACKAGE = Path(pinpool.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The pinpool modules ``path`` imports anywhere in it (function bodies and TYPE_CHECKING blocks too)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # ``from pkg import module`` depends on that module; ``from pkg import name``, on pkg.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found - {module_name(path)}


def test_no_import_cycle_counting_annotation_imports() -> None:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imported(path, set(paths)) for name, path in paths.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
