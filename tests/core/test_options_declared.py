"""The pool options are declared once (pinpool/_plan/declared.py), and every spelling follows it:
PinnedPool's and pin()'s signatures, PoolOptions.create, PinnedPool's docstring, the command
line's flags, and docs/options.md's table. A new option, a renamed one or a changed default
fails here until every spelling agrees."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

import pinpool
from pinpool import _cli
from pinpool._plan import DEFAULT_REGISTRY, OPTIONS, Option, PoolOptions, pool_options
from pinpool._pool import PinArguments, PoolArguments, PoolRequest, pool_request
from pinpool.testing import FakeRuntime

from ..conftest import lifecycle_of

ROOT = Path(__file__).resolve().parents[2]
P = inspect.Parameter
MiB, GiB = 1 << 20, 1 << 30


def python_default(value: object) -> object:
    return REGISTRY if value is DEFAULT_REGISTRY else value


def keyword_parameters(function: Any, skip: int) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(function).parameters.values())[skip:]
    assert all(p.kind is P.KEYWORD_ONLY for p in parameters), [p for p in parameters if p.kind is not P.KEYWORD_ONLY]
    return parameters


def test_pinned_pool_signature_is_the_declaration() -> None:
    parameters = keyword_parameters(pinpool.PinnedPool.__init__, skip=1)  # self
    assert [p.name for p in parameters] == [o.name for o in pool_options()]
    for p, o in zip(parameters, pool_options(), strict=True):
        assert p.default is python_default(o.default) or p.default == o.default, o.name
        assert p.annotation == o.type, o.name  # the annotation text (from __future__ import annotations)


def test_pin_signature_is_the_declaration() -> None:
    tensor, *_ = inspect.signature(pinpool.pin).parameters.values()
    assert tensor.name == "tensor" and tensor.kind is P.POSITIONAL_OR_KEYWORD and tensor.default is P.empty
    parameters = keyword_parameters(pinpool.pin, skip=1)
    declared = [o for o in OPTIONS if o.pin]  # in pin()'s signature's order
    assert [p.name for p in parameters] == [o.name for o in declared]
    for p, o in zip(parameters, declared, strict=True):
        assert p.default is python_default(o.default_for_pin) or p.default == o.default_for_pin, o.name
        assert p.annotation == o.type, o.name


def test_pin_takes_every_pool_option_the_tensor_does_not_decide() -> None:
    """What pin() leaves out, each with its reason; the rest it takes with PinnedPool's default."""
    left_out = {o.name: o.no_pin for o in OPTIONS if o.pool and not o.pin}
    assert set(left_out) == {
        "layout", "size", "num_pages", "memory", "huge_pages", "numa_node", "reserve", "grow_step", "elastic",
        "on_give_up", "pressure",
    }  # fmt: skip
    assert all(left_out.values())
    same_default = {o.name for o in OPTIONS if o.pool and o.pin and o.default_for_pin == o.default}
    assert {o.name for o in OPTIONS if o.pool and o.pin} - same_default == {"name"}  # "tensor"
    assert inspect.signature(pinpool.pin).parameters["max_call_seconds"].default == "auto"  # as PinnedPool's


@pytest.mark.parametrize(("typed", "takes"), [(PoolArguments, "pool"), (PinArguments, "pin")])
def test_the_typed_keywords_are_the_declaration(typed: type, takes: str) -> None:
    """What IDEs and mypy see of ``**options``: every declared option the entry takes, its type the declared one."""
    declared = {o.name: o.type for o in OPTIONS if getattr(o, takes)}
    annotations = {name: getattr(t, "__forward_arg__", t) for name, t in typed.__annotations__.items()}
    assert annotations == declared
    assert typed.__optional_keys__ == frozenset(declared)  # every keyword has its default


def test_an_unknown_keyword_is_a_type_error_naming_it(fake: FakeRuntime) -> None:
    with pytest.raises(TypeError, match=r"^PinnedPool\(\) got an unexpected keyword argument 'chunk_size'$"):
        pinpool.PinnedPool(size="1MiB", runtime=fake, chunk_size="1MiB")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^pin\(\) got an unexpected keyword argument 'size'$"):
        pinpool.pin(torch.zeros(4, 1024), runtime=fake, size="1MiB")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^PoolOptions.create\(\) got an unexpected keyword argument 'memory'$"):
        PoolOptions.create(size=4096, memory=None)


def test_the_request_hands_each_option_to_its_home(fake: FakeRuntime, tmp_path: Path) -> None:
    given = {"size": "1MiB", "runtime": fake, "node_slots": 2, "node_dir": str(tmp_path), "registry": None, "name": "r"}
    request = pool_request("PinnedPool", given)
    assert request.options.size == MiB and request.options.name == "r" and request.runtime is fake
    assert request.pacing is not None and request.pacing.slots == 2 and request.registry is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.runtime = "auto"  # type: ignore[misc]
    # The request's own fields are the options whose home it is, besides what the other homes made.
    own = {f.name for f in dataclasses.fields(PoolRequest)} - {"options", "pacing", "source"}
    assert own == {o.name for o in OPTIONS if o.home == "request"}


def test_pool_options_create_takes_the_declared_options_with_their_defaults() -> None:
    parameters = keyword_parameters(PoolOptions.create, skip=0)  # a bound classmethod: no cls
    created = [o for o in OPTIONS if o.create]
    assert [p.name for p in parameters] == [o.name for o in created]
    for p, o in zip(parameters, created, strict=True):
        assert p.default == o.default, o.name


def docstring_options() -> list[str]:
    """The keys of PinnedPool's docstring ``Options:`` block (``  a, b: text`` lines)."""
    doc = inspect.getdoc(pinpool.PinnedPool) or ""
    block = doc.split("\nOptions:\n", 1)[1]
    keys: list[str] = []
    for line in block.splitlines():
        if line and not line.startswith(" "):
            break  # the block ends at the next unindented line
        match = re.match(r"^  ([a-z_][a-z_, ]*):", line)
        if match:
            keys.extend(k.strip() for k in match[1].split(","))
    return keys


def test_the_docstring_lists_every_option_once() -> None:
    keys = docstring_options()
    assert len(keys) == len(set(keys)), keys
    assert sorted(keys) == sorted(o.name for o in pool_options())


def test_every_option_has_help_and_a_flag_or_a_reason() -> None:
    for o in OPTIONS:
        assert o.help and "\n" not in o.help and not o.help.endswith("."), o.name
        assert (o.flag is None) == bool(o.no_flag), o.name
    python_only = {o.name for o in OPTIONS if o.flag is None}
    assert python_only == {
        "granularity_bytes", "ranges", "memory", "registry", "logger", "on_progress", "registrars", "elastic",
        "on_give_up", "pressure",
    }  # fmt: skip


# -- the command line -----------------------------------------------------------------------------------------


def subparser(command: str) -> argparse.ArgumentParser:
    parser = _cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = action.choices[command]
    assert isinstance(sub, argparse.ArgumentParser)
    return sub


def group_flags(parser: argparse.ArgumentParser, title: str) -> set[str]:
    group = next(g for g in parser._action_groups if g.title == title)
    return {s for a in group._group_actions for s in a.option_strings}


def declared_flags(command: str) -> set[str]:
    flags: set[str] = set()
    for o in OPTIONS:
        if o.flag is None or command not in o.flag.commands or o.flag.kind == "layout":
            continue
        flags.add(o.flag.flag)
        if o.flag.kind == "bool":
            flags.add(f"--no-{o.flag.flag[2:]}")
    return flags


@pytest.mark.parametrize("command", ["pin", "plan", "doctor"])
def test_the_pool_flags_are_the_declared_ones(command: str) -> None:
    parser = subparser(command)
    assert group_flags(parser, "pool") == declared_flags(command)
    has_layout = any(o.flag is not None and o.flag.kind == "layout" and command in o.flag.commands for o in OPTIONS)
    assert ("--layout" in {s for a in parser._actions for s in a.option_strings}) == has_layout


def test_pin_and_plan_take_every_option_that_is_not_python_only() -> None:
    on_the_command_line = {o.name for o in OPTIONS if o.flag is not None}
    assert {o.name for o in OPTIONS} - on_the_command_line == {o.name for o in OPTIONS if o.no_flag}
    assert declared_flags("pin") == declared_flags("plan")
    assert declared_flags("doctor") == {"--size"}
    # 23, then reserve and grow_step; 11 before: size, layout, runtime, chunk_bytes, populate, 3 workers, ...
    assert len(on_the_command_line) == 25


EVERY_FLAG = [
    "--num-pages", "4194304", "--runtime", "fake", "--chunk-bytes", "1MiB", "--max-chunk-bytes", "2MiB",
    "--no-populate",
    "--populate-workers", "2", "--register-workers", "2", "--unpin-workers", "2", "--name", "every",
    "--min-chunk-bytes", "1MiB", "--max-retries", "3", "--retry-codes", "1, 2,719", "--max-call-seconds", "auto",
    "--background", "--pin-nice", "3",
    "--node-slots", "2", "--node-budget", "0.5", "--node-wait", "--layout", "raw", "--granularity", "64KiB",
]  # fmt: skip


def test_every_flag_reaches_pinned_pool(fake: FakeRuntime, tmp_path: Path) -> None:
    args = _cli.build_parser().parse_args(["pin", *EVERY_FLAG, "--node-dir", str(tmp_path)])
    kwargs = _cli.pool_options(args, "pin")
    expected = {
        "num_pages", "runtime", "chunk_bytes", "max_chunk_bytes", "populate", "populate_workers", "register_workers",
        "unpin_workers", "name", "min_chunk_bytes", "max_retries", "retry_codes", "max_call_seconds", "background",
        "pin_nice", "node_slots", "node_budget", "node_dir", "node_wait", "layout",
    }  # fmt: skip
    assert set(kwargs) == expected  # no --size: --num-pages asks for the pool by page count
    assert kwargs["chunk_bytes"] == MiB and kwargs["max_chunk_bytes"] == 2 * MiB and kwargs["min_chunk_bytes"] == MiB
    assert kwargs["max_call_seconds"] == "auto" and kwargs["pin_nice"] == 3 and kwargs["background"] is True
    assert kwargs["retry_codes"] == (1, 2, 719)
    assert kwargs["populate"] is False and kwargs["node_wait"] is True and kwargs["node_budget"] == "0.5"
    kwargs["runtime"] = fake
    pool = pinpool.PinnedPool(**kwargs, registry=None)
    assert pool.name == "every" and pool.num_pages == 4 * MiB and pool.plan.granularity == 64 << 10
    options = lifecycle_of(pool).options
    assert options.max_call_seconds == 0.05 and options.pin_nice == 3 and options.background
    assert options.budget_yields_to == "chunk_bytes" and options.retry_codes == {1, 2, 719}


def test_flags_left_off_get_the_python_defaults_and_the_command_lines_own() -> None:
    args = _cli.build_parser().parse_args(["plan"])
    kwargs = _cli.pool_options(args, "plan")
    assert kwargs.pop("layout").name == "raw"
    assert kwargs == {"size": 4 * GiB, "runtime": "auto", "name": "cli"}
    doctor = _cli.build_parser().parse_args(["doctor"])
    assert _cli.pool_options(doctor, "doctor") == {}  # doctor checks no size unless given one


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-call-seconds", "soon"], "--max-call-seconds soon: give a number of seconds"),
        (["--max-call-seconds", "-1"], "max_call_seconds=-1.0 must be a positive number of seconds"),
        (["--pin-nice", "low"], "--pin-nice low: give an integer from 0 to 19, or auto"),
        (["--pin-nice", "99"], "pin_nice=99"),
        (["--max-chunk-bytes", "1.5"], "--max-chunk-bytes 1.5 is not a whole number of bytes"),
        (["--chunk-bytes", "2MiB", "--max-chunk-bytes", "1MiB"], "is more than max_chunk_bytes=1048576"),
        (["--chunk-bytes", "buffer", "--max-call-seconds", "0.02"], "cannot be cut to fit a stall budget"),
        (["--chunk-bytes", "1MiB", "--max-call-seconds", "0.02"], "give max_chunk_bytes= instead of chunk_bytes="),
        (["--retry-codes", "1,two"], "--retry-codes 'two' is not an integer"),
        (["--retry-codes", "0"], "retry_codes=(0,) must be a collection of the runtime's error codes"),
        (["--node-slots", "0", "--node-dir", "/tmp"], "node_slots=0 is out of range"),
        (["--node-budget", "1.5", "--node-dir", "/tmp"], "a unitless decimal is a fraction of MemTotal"),
        (["--num-pages", "0"], "num_pages=0 must be a positive int"),
    ],
)
def test_bad_flags_exit_2_with_pinpools_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in ("plan", "pin"):
        assert _cli.main([command, "--runtime", "fake", *argv]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith("pinpool: ConfigError: ") and message in err, err


def test_plan_reports_how_the_pool_would_pin(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["plan", "--size", "1GiB", "--background", "--node-budget", "2GiB", "--node-dir", str(tmp_path)]
    assert _cli.main([*argv, "--json"]) == 0
    pinning = __import__("json").loads(capsys.readouterr().out)["pinning"]
    assert pinning["background"] is True and pinning["max_call_seconds"] == 0.05 and pinning["per_buffer"] is False
    assert pinning["node_pacing"] == {"slots": None, "budget_bytes": 2 * GiB, "dir": str(tmp_path), "wait": True}
    assert list(tmp_path.iterdir()) == []  # validated, not joined: plan touches no file
    assert _cli.main(argv) == 0
    assert "pinning:   in the background, stall budget 50 ms" in capsys.readouterr().out
    assert _cli.main(["plan", "--size", "1GiB", "--chunk-bytes", "buffer"]) == 0
    out = capsys.readouterr().out
    assert "one registration per buffer (never cut), stall budget none" in out and "chunks:    1 of <= 1 GiB" in out


def test_pin_in_the_background_waits_until_ready_then_reports(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["pin", "--runtime", "fake", "--size", "64MiB", "--chunk-bytes", "4MiB", "--background", "--json",
            "--progress", "lines"]  # fmt: skip
    assert _cli.main(argv) == 0
    captured = capsys.readouterr()
    report = __import__("json").loads(captured.out)
    assert report["chunks"] == 16 and report["bytes"] == 64 * MiB
    assert "pinning 100%" in captured.err


# -- docs/options.md ---------------------------------------------------------------------------------------------


def table_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("options_table", ROOT / "docs" / "_ext" / "options_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_table_is_generated_from_the_declaration() -> None:
    table = table_module()
    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert table.rewritten(page) == page, "docs/options.md is stale: run python docs/_ext/options_table.py"
    for o in OPTIONS:
        assert f"| `{o.name}` | `{o.type}` |" in page, o.name


def test_the_reference_shows_the_declared_keywords() -> None:
    """The API reference (griffe, which reads the source) shows what help() shows: every keyword, not **options."""
    griffe = pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location("griffe_rest", ROOT / "docs" / "_ext" / "griffe_rest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    extensions = griffe.load_extensions(module.RestDocstrings())
    package = griffe.load("pinpool", extensions=extensions, search_paths=[str(ROOT)])
    for path, declared in (("_pool.pool.PinnedPool.__init__", ["self", *(o.name for o in pool_options())]),
                           ("_pool.pin.pin", ["tensor", *(o.name for o in OPTIONS if o.pin)])):  # fmt: skip
        assert [p.name for p in package[path].parameters] == declared, path
    assert [k for k in docstring_options() if f"`{k}`:" in package["_pool.pool.PinnedPool"].docstring.value] == [
        o.name for o in pool_options()
    ]


def test_the_docs_link_the_options_page() -> None:
    assert "options.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(options.md)" in (ROOT / "docs" / "quickstart.md").read_text()


def test_an_option_missing_from_a_spelling_is_caught() -> None:
    """The checks above are not vacuous: a declaration with one more option fails them."""
    extra = Option("extra", "int", 0, "one more option", no_flag="Python-only", pin=False, no_pin="not for tensors")
    names = [o.name for o in (*OPTIONS, extra) if o.pool]
    assert names != [p.name for p in keyword_parameters(pinpool.PinnedPool.__init__, skip=1)]
