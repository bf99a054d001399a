"""Every program in examples/ runs as a user would run it, and says what it pinned.

The scripts run in a subprocess with a small pool and ``--runtime mlock``, so the pinning is
real and the kernel's own count (VmLck, which each example prints from /proc/self/status)
shows it: up by the pool's bytes while pinned, back to where it was after.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from .. import preloaded
from ..conftest import needs_mlock

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MiB = 1 << 20
PAGE = 4096
SIZE = 128 * MiB


def run_example(name: str, *args: str, timeout: float = 120.0) -> str:
    """Run ``examples/<name>`` with the test's size and mlock; return its output, failing on a non-zero exit."""
    command = [sys.executable, str(EXAMPLES / name), "--size", f"{SIZE // MiB}MiB", "--runtime", "mlock", *args]
    done = preloaded.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def vmlck(output: str) -> dict[str, int]:
    match = re.search(r"^VmLck:\s+before=(\d+)(?: pinned=(\d+))? after=(\d+) \(bytes\)$", output, re.MULTILINE)
    assert match is not None, output
    before, pinned, after = match.groups()
    return {"before": int(before), "pinned": int(pinned or 0), "after": int(after)}


def pinned_bytes(output: str) -> list[int]:
    return [int(n) for n in re.findall(r"^pinned: (\d+) bytes", output, re.MULTILINE)]


@needs_mlock
def test_quickstart_pins_writes_and_unpins() -> None:
    out = run_example("quickstart.py")
    assert pinned_bytes(out) == [SIZE]
    assert "with runtime 'mlock'" in out
    assert f"wrote:  {SIZE} bytes through pool.tensor" in out
    # 256 MiB chunks on 2 MiB copy pages: one chunk of the whole 128 MiB pool
    assert re.findall(r"^  chunk at \+(\d+) MiB, (\d+) MiB$", out, re.MULTILINE) == [("0", "128")]
    assert "pool.pinned_bytes is now 0" in out
    locked = vmlck(out)
    assert locked["pinned"] - locked["before"] == SIZE  # page-aligned pool: exactly its bytes
    assert locked["after"] == locked["before"]


@needs_mlock
def test_sync_init_pins_in_init_and_unpins_in_close() -> None:
    out = run_example("sync_init.py")
    page_bytes = 2 * 16 * 4 * 4 * 64 * 2  # K and V of 16 tokens, 4 layers, 4 heads of 64 bf16
    assert pinned_bytes(out) == [SIZE // page_bytes * page_bytes]
    assert f"layout: mha/page_first, {SIZE // page_bytes} pages of {page_bytes} bytes" in out
    assert f"wrote:  page {SIZE // page_bytes - 1}: K and V" in out
    assert "closed: pool.pinned_bytes is now 0" in out
    locked = vmlck(out)
    assert locked["pinned"] - locked["before"] == SIZE
    assert locked["after"] == locked["before"]


@needs_mlock
def test_trio_pool_pins_while_trio_keeps_running() -> None:
    out = run_example("trio_pool.py")
    assert pinned_bytes(out) == [SIZE]
    assert re.search(r"^pinned: \d+ bytes \(128 MiB\) in 2 chunk\(s\) with runtime 'mlock'", out, re.MULTILINE)
    assert re.search(r"^trio:   \d+ heartbeat\(s\) ran while the pool was pinning$", out, re.MULTILINE)
    assert f"wrote:  {SIZE // PAGE} bytes, one per OS page" in out
    locked = vmlck(out)
    assert locked["pinned"] - locked["before"] == SIZE
    assert locked["after"] == locked["before"]


@needs_mlock
def test_trio_pool_deadline_rolls_back() -> None:
    out = run_example("trio_pool.py", "--deadline", "0.001")
    assert "deadline: pinning took longer than 0.001 s; everything was rolled back" in out
    assert pinned_bytes(out) == []  # the body never ran
    locked = vmlck(out)
    assert locked["after"] == locked["before"]


@needs_mlock
def test_pin_existing_tensor_pins_and_leaves_the_tensor() -> None:
    out = run_example("pin_existing_tensor.py")
    empty = re.search(
        r"^torch.empty: pinned (\d+) bytes in (\d+) chunk\(s\) with runtime 'mlock'; the tensor starts (\d+) B into "
        r"an OS page; granularity None; VmLck \+(\d+) bytes$",
        out,
        re.MULTILINE,
    )
    assert empty is not None, out
    nbytes, chunks, offset, locked = map(int, empty.groups())
    assert nbytes == SIZE and chunks >= 4
    # every page the tensor touches is locked: one more than its size in pages when it is unaligned
    assert locked == SIZE + (PAGE if offset else 0)
    assert "torch.empty: unpinned, tensor kept; VmLck back to +0 bytes" in out
    kv = re.search(
        r"^page-aligned kv: pinned (\d+) bytes in (\d+) chunk\(s\) with runtime 'mlock'; the tensor starts 0 B into "
        r"an OS page; granularity 65536; VmLck \+(\d+) bytes$",
        out,
        re.MULTILINE,
    )
    assert kv is not None, out
    assert [int(g) for g in kv.groups()] == [SIZE, 4, SIZE]
    assert "page-aligned kv: unpinned, tensor kept; VmLck back to +0 bytes" in out
    locked_total = vmlck(out)
    assert locked_total["after"] == locked_total["before"]


def test_the_fake_runtime_test_module_passes() -> None:
    """examples/test_with_fake_runtime.py, run as its README says, with the plugin loaded explicitly."""
    command = [
        sys.executable, "-m", "pytest", "-p", "pinpool.pytest_plugin", "-p", "no:cacheprovider", "-q",
        str(EXAMPLES / "test_with_fake_runtime.py"),
    ]  # fmt: skip
    done = preloaded.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|error)", done.stdout)}
    assert counts.get("failed", 0) == counts.get("error", 0) == 0, done.stdout
    assert counts.get("passed", 0) + counts.get("skipped", 0) == 9, done.stdout  # the gpu test skips without CUDA
    assert counts.get("passed", 0) >= 8, done.stdout


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("test_")))
def test_every_example_is_tested(name: str) -> None:
    """A new example needs a test here: the ones above, or examples another change tests itself."""
    tested_here = {"quickstart.py", "sync_init.py", "trio_pool.py", "pin_existing_tensor.py"}
    tested_elsewhere = {"kv_offload_server.py", "kv_transfer.py"}  # tests/tools/test_kv_server*.py
    assert name in tested_here | tested_elsewhere, f"examples/{name} is run by no test"


def _imported_packages(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from pinpool import _libc
    return found


# What the examples may import beyond the standard library: pinpool's own dependencies and,
# for the server, the packages examples/README.md tells its readers to install (all in the test extra but
# the transfer engines, which --transfer-engine alone loads).
EXAMPLE_PACKAGES = {"pinpool", "torch", "anyio", "structlog", "prometheus_client", "pytest", "trio", "starlette",
                    "uvicorn", "hypercorn", "mooncake", "nixl_cu12"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_examples_use_only_the_public_api_and_what_their_readme_installs(name: str) -> None:
    """A reader copies an example into their project: no ``pinpool._private`` module (it may change
    under them), no package the example's instructions do not install (numpy is not one)."""
    imported = _imported_packages(EXAMPLES / name)
    private = sorted(m for m in imported if re.match(r"pinpool(\.\w+)*\._(?!_)", m))
    assert not private, f"examples/{name} imports pinpool's private modules: {private}"
    siblings = {p.stem for p in EXAMPLES.glob("*.py")}  # test_with_fake_runtime.py imports sync_init.py
    third_party = {m.split(".")[0] for m in imported} - set(sys.stdlib_module_names) - siblings
    assert third_party <= EXAMPLE_PACKAGES, f"examples/{name} needs {sorted(third_party - EXAMPLE_PACKAGES)}"
    assert ".numpy()" not in (EXAMPLES / name).read_text(encoding="utf-8")  # numpy, without importing it


def test_the_example_server_does_not_take_mkdocs_serves_port() -> None:
    """``mkdocs serve`` (the docs, from a checkout) listens on 8000; the example server must not clash with it."""
    source = (EXAMPLES / "kv_offload_server.py").read_text(encoding="utf-8")
    port = int(re.search(r"^DEFAULT_PORT = (\d+)", source, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert port != 8000 and "default=DEFAULT_PORT" in source
    assert "dev_addr" not in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")  # so mkdocs serve keeps 8000
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    assert "kv_offload_server.py" in readme and f"127.0.0.1:{port}" in readme
