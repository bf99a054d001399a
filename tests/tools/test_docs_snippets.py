"""Every Python block in the docs runs, or is marked as something that cannot, and is checked as far as it can be.

Every ```python block of every Markdown file under docs/ (new pages included, by glob) and of
README.md is one of these kinds, chosen by an HTML comment on the last non-blank line before
its fence (invisible once rendered; indent it like the fence inside a list item):

- no marker: **runs**, as a script in a fresh process (``__name__ == "__main__"``). Top-level
  ``await`` / ``async with`` are allowed, as in ``python -m asyncio``: such a block runs in an
  event loop (``anyio.run``). A top-level expression whose comment starts with a Python
  literal is checked against it: ``len(pool.plan.chunks)  # 1029; the last chunk ...`` fails the
  test unless ``len(pool.plan.chunks) == 1029``. The block must leave VmLck as it found it and
  emit no warning. Use small sizes: these run with the default runtime (mlock on a host
  without a GPU), so they need CAP_IPC_LOCK or a memlock limit above their size.
- ``<!-- continue -->``: runs after the blocks before it in the same file, in their namespace
  (for a worked example split by prose).
- ``<!-- pytest -->``: a test module; it is run with pytest, warnings as errors.
- ``<!-- fragment -->`` or ``<!-- fragment: why -->``: not run (a server's lifespan, a GPU
  device, names defined elsewhere). It must compile (top-level ``await`` allowed), every
  ``pinpool`` / ``layouts`` attribute it names must exist, and calls to pinpool's callables
  may only pass keyword arguments those accept.
- ``<!-- signature -->``: lines like ``layouts.MHA(layout, ..., *, k_only=False)``; each must
  match ``inspect.signature`` of the object it names: parameter names, kinds and defaults.

Runnable blocks are forked from one process that has already imported pinpool and torch, so
each costs a fork, not an interpreter start. Test ids are ``file:line`` of the opening fence.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import gc
import importlib
import inspect
import json
import os
import re
import select
import signal
import subprocess
import sys
import tokenize
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import needs_mlock

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("run", "continue", "pytest", "fragment", "signature")
MARKER = re.compile(r"^\s*<!--\s*([A-Za-z][\w-]*)\s*(?::\s*(.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")

# Blocks in files this suite may not edit that cannot run as written, treated as fragments
# until their file marks them: (file, text that identifies the block) -> why.
UNMARKED_FRAGMENTS: dict[tuple[str, str], str] = {}
BLOCK_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence, 1-based
    source: str
    kind: str
    reason: str = ""
    chain: tuple[Block, ...] = ()  # for "continue": the blocks it runs after, in order

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def padded(self) -> str:
        """The source, preceded by blank lines so its line numbers are the file's."""
        return "\n" * self.line + self.source


def doc_files() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def extract_blocks(path: Path, text: str | None = None) -> tuple[list[Block], list[str]]:
    """The file's python blocks with their kinds, and the problems found reading the markers."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    rel = path.relative_to(ROOT)
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = (opening["info"].split() or [""])[0].lower()
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence) and set(lines[end].strip()) == {fence[0]}):
            end += 1
        if language in ("python", "py"):
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
            kind, reason = "run", ""
            before = i - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            marker = MARKER.match(lines[before]) if before >= 0 else None
            if marker is not None:
                kind, reason = marker[1], marker[2] or ""
                if kind not in KINDS[1:]:
                    problems.append(f"{rel}:{i + 1}: unknown block marker <!-- {kind} -->; use one of {KINDS[1:]}")
                    kind = "fragment"
            source = "\n".join(body) + "\n"
            for (name, identifying), why in UNMARKED_FRAGMENTS.items():
                if kind == "run" and str(rel) == name and identifying in source:
                    kind, reason = "fragment", why
            chain: tuple[Block, ...] = ()
            if kind == "continue":
                previous = [b for b in blocks if b.kind in ("run", "continue")]
                if not previous:
                    problems.append(f"{rel}:{i + 1}: <!-- continue --> with no runnable block before it")
                    kind = "fragment"
                else:
                    chain = (*previous[-1].chain, previous[-1])
            blocks.append(Block(path, i + 1, source, kind, reason, chain))
        i = end + 1
    return blocks, problems


ALL_BLOCKS: list[Block] = []
MARKER_PROBLEMS: list[str] = []
for _path in doc_files():
    _blocks, _problems = extract_blocks(_path)
    ALL_BLOCKS.extend(_blocks)
    MARKER_PROBLEMS.extend(_problems)


def blocks_of(*kinds: str) -> list[Any]:
    return [pytest.param(b, id=b.id) for b in ALL_BLOCKS if b.kind in kinds]


def test_block_markers_are_known() -> None:
    assert not MARKER_PROBLEMS, "\n".join(MARKER_PROBLEMS)


def test_every_doc_is_scanned() -> None:
    counts: dict[str, dict[str, int]] = {}
    for b in ALL_BLOCKS:
        per_file = counts.setdefault(str(b.path.relative_to(ROOT)), {})
        per_file[b.kind] = per_file.get(b.kind, 0) + 1
    assert "README.md" in counts and any(name.startswith("docs/") for name in counts), counts
    assert sum(1 for b in ALL_BLOCKS if b.kind in ("run", "continue", "pytest")) >= 10, counts


# -- runnable blocks: executed in children forked from a preloaded process ------------------------


def _literal_after_hash(comment: str) -> str | None:
    """The Python literal a ``# 900`` / ``# [900, 700]; rest`` comment starts with, if it is one."""
    text = comment.lstrip("#").strip()
    candidates = [text, text.split("  ")[0], text.split(";")[0], text.split(" (")[0]]
    for candidate in candidates:
        candidate = candidate.strip()
        if not candidate:
            continue
        try:
            ast.literal_eval(candidate)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        return candidate
    return None


def checked_tree(block: Block) -> ast.Module:
    """The block's AST, with each top-level ``expr  # literal`` line turned into a check."""
    padded = block.padded()
    tree = ast.parse(padded, filename=str(block.path))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(iter(padded.splitlines(keepends=True)).__next__):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string
    body: list[ast.stmt] = []
    for statement in tree.body:
        comment = comments.get(statement.end_lineno or statement.lineno)
        expected = _literal_after_hash(comment) if comment else None
        if isinstance(statement, ast.Expr) and not isinstance(statement.value, ast.Constant) and expected:
            text = ast.get_source_segment(padded, statement.value) or ast.unparse(statement.value)
            where = f"{block.path.relative_to(ROOT)}:{statement.lineno}"
            check = ast.Expr(
                ast.Call(
                    func=ast.Name("__doc_check__", ast.Load()),
                    args=[
                        statement.value,
                        ast.parse(expected, mode="eval").body,
                        ast.Constant(where),
                        ast.Constant(text),
                    ],
                    keywords=[],
                )
            )
            body.append(ast.fix_missing_locations(ast.copy_location(check, statement)))
        else:
            body.append(statement)
    tree.body = body
    return tree


def _doc_check(actual: object, expected: object, where: str, text: str) -> None:
    if actual != expected:
        raise AssertionError(f"{where}: {text} is {actual!r}, but the doc says {expected!r}")


async def _await_code(code: types.CodeType, namespace: dict[str, Any]) -> None:
    await eval(code, namespace)


def _run_blocks(blocks: list[Block]) -> None:
    """In the child: run the blocks in one namespace, then check locked memory and warnings."""
    import anyio

    from pinpool.testing import locked_bytes

    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins, "__doc_check__": _doc_check}
    before = locked_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in blocks:
            sys.argv = [str(block.path)]
            code = compile(checked_tree(block), str(block.path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            if code.co_flags & inspect.CO_COROUTINE:
                anyio.run(_await_code, code, namespace)
            else:
                exec(code, namespace)
        namespace.clear()
        gc.collect()
    problems = [f"warning: {w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    after = locked_bytes()
    if after != before:
        problems.append(f"VmLck was {before} bytes before the block and is {after} after: it left memory locked")
    if problems:
        raise AssertionError("\n".join(problems))


def _run_pytest_block(block: Block, workdir: Path) -> int:
    import pytest as child_pytest

    # Warnings are errors in the test; plugins this process preloaded just cannot be assert-rewritten.
    ini = "[pytest]\nfilterwarnings =\n    error\n    ignore::pytest.PytestAssertRewriteWarning\n"
    (workdir / "pytest.ini").write_text(ini)
    test_file = workdir / f"test_{block.path.stem}_{block.line}.py"
    test_file.write_text(block.padded())
    # The plugin by name: a no-op where pinpool's entry point already loaded it.
    args = [str(test_file), "-q", "-p", "no:cacheprovider", "-p", "pinpool.pytest_plugin", "--strict-markers", "-ra"]
    return int(child_pytest.main([*args, "--rootdir", str(workdir), "-c", str(workdir / "pytest.ini")]))


def _child(request: dict[str, Any]) -> int:
    workdir = Path(request["workdir"])
    os.chdir(workdir)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdin = open(os.devnull)  # the child exits with os._exit
    blocks = [Block(Path(b["path"]), b["line"], b["source"], b["kind"]) for b in request["blocks"]]
    try:
        if blocks[-1].kind == "pytest":
            return _run_pytest_block(blocks[-1], workdir)
        _run_blocks(blocks)
        return 0
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1


def zygote_main() -> None:
    """Preload, then fork one child per request line (``{"blocks", "workdir", "output"}``) and report its status."""
    import anyio  # noqa: F401 - preloaded for the children
    import structlog  # noqa: F401
    import torch  # noqa: F401 - pinpool imports it lazily, on first use of a pool

    import pinpool

    pinpool.PinnedPool  # noqa: B018 - loads the pool's modules

    # The preloaded objects: a child's collections skip them, and so does its exit (which would
    # otherwise spend ~0.5 s collecting torch's module graph), and their pages stay shared.
    gc.freeze()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


class Zygote:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.process: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "import tests.tools.test_docs_snippets as t; t.zygote_main()"
        )
        with open(self.log, "a") as log:
            process = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True, cwd=ROOT,
            )  # fmt: skip
        self.process = process
        self._reply(60.0)  # ready
        return process

    def _reply(self, timeout: float) -> dict[str, Any]:
        process = self.process
        assert process is not None and process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if not line:
            self.close()
            log = self.log.read_text() if self.log.exists() else ""
            raise AssertionError(f"the block runner gave no answer within {timeout} s (killed)\n{log[-4000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def run(self, block: Block, workdir: Path) -> tuple[int, str]:
        process = self.process if self.process is not None and self.process.poll() is None else self._start()
        assert process.stdin is not None
        output = workdir / "output.txt"
        blocks = [
            {"path": str(b.path), "line": b.line, "source": b.source, "kind": b.kind} for b in (*block.chain, block)
        ]
        process.stdin.write(json.dumps({"blocks": blocks, "workdir": str(workdir), "output": str(output)}) + "\n")
        process.stdin.flush()
        status = int(self._reply(BLOCK_TIMEOUT_S)["status"])
        return status, output.read_text() if output.exists() else ""

    def close(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the runner and any child still running
        process.wait()
        process.stdin.close()
        process.stdout.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    runner = Zygote(tmp_path_factory.mktemp("doc-runner") / "runner.log")
    yield runner
    runner.close()


@needs_mlock
@pytest.mark.parametrize("block", blocks_of("run", "continue"))
def test_runnable_block_runs(block: Block, zygote: Zygote, tmp_path: Path) -> None:
    status, output = zygote.run(block, tmp_path)
    assert status == 0, f"{block.id} failed (exit {status}):\n{output}"


@pytest.mark.parametrize("block", blocks_of("pytest"))
def test_pytest_block_passes(block: Block, zygote: Zygote, tmp_path: Path) -> None:
    status, output = zygote.run(block, tmp_path)
    assert status == 0, f"{block.id}: pytest exited {status}:\n{output}"
    assert re.search(r"\d+ (passed|skipped)", output), output


# -- fragments and signatures: checked without running -------------------------------------------


def _resolve(root: object, attrs: list[str], dotted: str) -> object:
    obj = root
    for i, attr in enumerate(attrs):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif isinstance(obj, types.ModuleType):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{attr}")
            except ImportError:
                raise AttributeError(f"{'.'.join([dotted.split('.')[0], *attrs[: i + 1]])} does not exist") from None
        else:
            raise AttributeError(f"{'.'.join([dotted.split('.')[0], *attrs[: i + 1]])} does not exist")
    return obj


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _pinpool_names(tree: ast.Module) -> dict[str, object]:
    """Names bound to pinpool objects: by the block's own imports, else ``pinpool`` and ``layouts``."""
    import pinpool

    names: dict[str, object] = {"pinpool": pinpool, "layouts": pinpool.layouts}
    assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for name in assigned:
        names.pop(name, None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pinpool":
                    module = importlib.import_module(alias.name)
                    names[alias.asname or "pinpool"] = module if alias.asname else pinpool
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pinpool":
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                names[alias.asname or alias.name] = _resolve(module, [alias.name], f"{node.module}.{alias.name}")
    return names


def check_fragment(block: Block) -> list[str]:
    code = block.padded()
    tree = ast.parse(code, filename=str(block.path))
    compile(code, str(block.path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    problems: list[str] = []
    try:
        names = _pinpool_names(tree)
    except (ImportError, AttributeError) as exc:
        return [f"{block.path.relative_to(ROOT)}:{block.line}: {exc}"]
    outermost = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute | ast.Call) or id(node) in outermost:
            continue  # check each a.b.c chain once, from its outermost attribute
        target = node.func if isinstance(node, ast.Call) else node
        chain = _chain(target)
        if chain is None or chain[0] not in names:
            continue
        where = f"{block.path.relative_to(ROOT)}:{node.lineno}"
        try:
            obj = _resolve(names[chain[0]], chain[1:], ".".join(chain))
        except AttributeError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if isinstance(node, ast.Call) and callable(obj):
            problems.extend(f"{where}: {p}" for p in _keyword_problems(obj, node, ".".join(chain)))
    return problems


def _keyword_problems(obj: object, call: ast.Call, dotted: str) -> list[str]:
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    accepted = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [
        f"{dotted}() takes no keyword argument {kw.arg!r}"
        for kw in call.keywords
        if kw.arg is not None and kw.arg not in accepted
    ]


@pytest.mark.parametrize("block", blocks_of("fragment"))
def test_fragment_compiles_and_names_real_api(block: Block) -> None:
    problems = check_fragment(block)
    assert not problems, f"{block.id} ({block.reason or 'fragment'}):\n" + "\n".join(problems)


SIGNATURE_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\((?P<params>.*)\)\s*(?:#.*)?$")


def _documented_parameters(params: str) -> list[tuple[str, inspect._ParameterKind, object]]:
    """``a, b=1, *, c=None`` as (name, kind, default) triples, with ``inspect.Parameter.empty`` for none."""
    args = ast.parse(f"def _({params}): pass").body[0]
    assert isinstance(args, ast.FunctionDef)
    spec = args.args
    P = inspect.Parameter
    positional = [*spec.posonlyargs, *spec.args]
    defaults: list[object] = [P.empty] * (len(positional) - len(spec.defaults))
    defaults += [ast.literal_eval(d) for d in spec.defaults]
    out: list[tuple[str, inspect._ParameterKind, object]] = [
        (a.arg, P.POSITIONAL_ONLY if i < len(spec.posonlyargs) else P.POSITIONAL_OR_KEYWORD, d)
        for i, (a, d) in enumerate(zip(positional, defaults, strict=True))
    ]
    if spec.vararg is not None:
        out.append((spec.vararg.arg, P.VAR_POSITIONAL, P.empty))
    for a, d in zip(spec.kwonlyargs, spec.kw_defaults, strict=True):
        out.append((a.arg, P.KEYWORD_ONLY, P.empty if d is None else ast.literal_eval(d)))
    if spec.kwarg is not None:
        out.append((spec.kwarg.arg, P.VAR_KEYWORD, P.empty))
    return out


def check_signatures(block: Block) -> list[str]:
    import pinpool

    problems: list[str] = []
    roots: dict[str, object] = {"pinpool": pinpool, "layouts": pinpool.layouts}
    for offset, text in enumerate(block.source.splitlines(), start=block.line + 1):
        text = text.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{block.path.relative_to(ROOT)}:{offset}"
        match = SIGNATURE_LINE.match(text)
        if match is None or match["name"].split(".")[0] not in roots:
            problems.append(f"{where}: not a signature line `pinpool.name(params)` / `layouts.Name(params)`: {text}")
            continue
        chain = match["name"].split(".")
        try:
            obj = _resolve(roots[chain[0]], chain[1:], match["name"])
            documented = _documented_parameters(match["params"])
        except (AttributeError, SyntaxError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        actual = [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]  # type: ignore[arg-type]
        if documented != actual:
            problems.append(f"{where}: {match['name']} is documented as\n  {documented}\nbut is\n  {actual}")
    return problems


@pytest.mark.parametrize("block", blocks_of("signature"))
def test_signature_block_matches_the_code(block: Block) -> None:
    problems = check_signatures(block)
    assert not problems, "\n".join(problems)


# -- the checker itself ----------------------------------------------------------------------------


def test_comment_literals_are_read_conservatively() -> None:
    assert _literal_after_hash("# [900, 900, 700]") == "[900, 900, 700]"
    assert _literal_after_hash("# 17895697  (= 1 GiB // 60)") == "17895697"
    assert _literal_after_hash("# 1029; the last chunk is 16380 bytes") == "1029"
    assert _literal_after_hash("# 68719476736 (exactly 64 GiB)") == "68719476736"
    assert _literal_after_hash("# serve") is None
    assert _literal_after_hash("# 2 register calls fail") is None
    assert _literal_after_hash("# torch.uint8, shape (nbytes,)") is None


def test_markers_and_continuations_are_parsed() -> None:
    doc = ROOT / "docs" / "_selftest.md"  # never written: the text below is parsed as if it were there
    text = "\n".join(
        [
            "```python",
            "x = 1",
            "```",
            "<!-- continue -->",
            "```python",
            "x  # 1",
            "```",
            "",
            "1. a list item",
            "",
            "   <!-- fragment: needs a server -->",
            "   ```python",
            "   await serve(pool)",
            "   ```",
            "<!-- fragmnet -->",
            "```py",
            "pass",
            "```",
        ]
    )
    blocks, problems = extract_blocks(doc, text)
    assert [(b.line, b.kind) for b in blocks] == [(1, "run"), (5, "continue"), (12, "fragment"), (16, "fragment")]
    assert blocks[1].chain == (blocks[0],)
    assert blocks[2].source == "await serve(pool)\n" and blocks[2].reason == "needs a server"
    assert len(problems) == 1 and "unknown block marker <!-- fragmnet -->" in problems[0]
    assert check_fragment(dataclasses.replace(blocks[2], path=doc)) == []
    bad = dataclasses.replace(blocks[2], path=doc, source="pinpool.PinnedPool(size=1, chunk_size=2)\npinpool.nope\n")
    assert [p.split(": ", 1)[1] for p in check_fragment(bad)] == [
        "pinpool.PinnedPool() takes no keyword argument 'chunk_size'",
        "pinpool.nope does not exist",
    ]
    wrong = dataclasses.replace(blocks[2], path=doc, kind="signature", source="layouts.Raw(granularity_bytes=0)\n")
    assert check_signatures(wrong) and not check_signatures(
        dataclasses.replace(wrong, source="layouts.Raw(granularity_bytes=None)\n")
    )


def _synthetic(source: str, kind: str = "run") -> Block:
    return Block(ROOT / "docs" / "_selftest.md", 1, source, kind)


def test_runner_checks_values_top_level_await_locked_memory_and_warnings(zygote: Zygote, tmp_path: Path) -> None:
    status, output = zygote.run(_synthetic("import anyio\nawait anyio.sleep(0)\nx = [1, 2]\nx  # [1, 2]\n"), tmp_path)
    assert status == 0, output
    status, output = zygote.run(_synthetic("x = 3\nx + 1  # 5; wrong on purpose\n"), tmp_path)
    assert status == 1 and "docs/_selftest.md:3: x + 1 is 4, but the doc says 5" in output, output
    status, output = zygote.run(_synthetic("import warnings\nwarnings.warn('loud')\n"), tmp_path)
    assert status == 1 and "warning: UserWarning: loud" in output, output
    leaky = "import mmap, ctypes\nm = mmap.mmap(-1, 1 << 16)\nctypes.CDLL(None).mlockall(1)\n"
    status, output = zygote.run(_synthetic(leaky), tmp_path)
    assert status == 1 and "it left memory locked" in output, output


# -- the pages as the site shows them ---------------------------------------------------------------

LINKED_PAGES = sorted((ROOT / "docs").rglob("*.md"))
FILE_NAME_LINK = re.compile(r"\[`?([\w./-]+\.md)(?:#[^\]]*)?`?\]\(([\w./-]+\.md)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_pages_read_as_titles(page: Path) -> None:
    """``[Concepts](concepts.md)``, not ``[concepts.md](concepts.md)``: the site shows a link's text, and a
    file name reads as one ("concepts.md explains ...")."""
    found = [m.group(0) for m in FILE_NAME_LINK.finditer(page.read_text(encoding="utf-8"))]
    assert not found, f"{page.relative_to(ROOT)}: give these links the page's title: {found}"


def test_file_name_links_are_found() -> None:
    assert FILE_NAME_LINK.search("see [concepts.md](concepts.md#the-pipeline).")
    assert FILE_NAME_LINK.search("[`operations.md`](../operations.md)")
    assert not FILE_NAME_LINK.search("see [Concepts: The pipeline](concepts.md#the-pipeline).")


def test_reference_pages_show_their_title_once() -> None:
    """A page titled ``pinpool.layouts`` that renders the module must not render the module's own
    heading too (mkdocstrings' show_root_heading is on for the classes the other pages list)."""
    checked = 0
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        title = re.match(r"# `?([^`\n]+)`?\n", text)
        assert title is not None, page
        directive = re.search(rf"^::: {re.escape(title.group(1))}\n((?:    .*\n)*)", text, re.MULTILINE)
        if directive is None:
            continue  # a page of several objects under a title of its own (Pools, Exceptions)
        assert "show_root_heading: false" in directive.group(1), f"{page.name} shows {title.group(1)} twice"
        checked += 1
    assert checked >= 5


NO_INDEX_INSTALL = re.compile(r"pip install (?:-U |--upgrade )?pinpool(?:$|[\s`\[])", re.MULTILINE)


@pytest.mark.parametrize("path", ["README.md", "docs/quickstart.md", "docs/index.md"])
def test_install_instructions_do_not_promise_a_release(path: str) -> None:
    """No release is on a package index: ``pip install pinpool`` would fail (or fetch someone else's
    package). The pages install from a checkout or from the wheel .ci/run builds and checks."""
    text = (ROOT / path).read_text(encoding="utf-8")
    assert not NO_INDEX_INSTALL.findall(text), path
    assert "pip install -e ." in text or "pip install -e /path/to/pinpool" in text, path
    assert NO_INDEX_INSTALL.search("run `pip install pinpool` first") and NO_INDEX_INSTALL.search(
        "pip install pinpool[test]"
    )
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "-m build" in ci and "twine check" in ci and "--no-deps" in ci and "pinpool --help" in ci
