"""The pool options of ``plan``, ``doctor`` and ``pin`` as flags: pinpool._plan.declared's options,
added to a parser by their declared kind and read back as PinnedPool keyword arguments."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from .._plan.declared import OPTIONS, PER_BUFFER, Flag, Option
from ..runtimes import runtime_choices
from .layout import add_layout_group, layout_from_args
from .text import cli_size, codes_text, nice_text, seconds_text

if TYPE_CHECKING:
    from ..runtimes import Capabilities

HUGE_PAGES: dict[str, bool | str] = {
    "off": False, "thp": True, "hugetlb": "hugetlb", "hugetlb:2MiB": "hugetlb:2MiB", "hugetlb:1GiB": "hugetlb:1GiB",
}  # fmt: skip
CLI_RUNTIMES = tuple(dict.fromkeys((*runtime_choices(), "fake")))


def flags(command: str) -> list[tuple[Option, Flag]]:
    """The declared options ``command`` takes as flags, in the declaration's order."""
    return [(o, o.flag) for o in OPTIONS if o.flag is not None and command in o.flag.commands]


def _flag_value(flag: Flag, value: Any) -> Any:
    """The Python value of a flag's argparse value, by its declared kind (pinpool._plan.declared.KINDS)."""
    if flag.kind == "size":
        return cli_size(flag.flag, value)
    if flag.kind == "chunk":
        return PER_BUFFER if value.strip() == PER_BUFFER else cli_size(flag.flag, value)
    if flag.kind == "seconds":
        return seconds_text(flag.flag, value)
    if flag.kind == "codes":
        return codes_text(flag.flag, value)
    if flag.kind == "nice":
        return nice_text(flag.flag, value)
    if flag.kind == "huge_pages":
        return HUGE_PAGES[value]
    return value  # int (argparse's type=int), text, runtime (a name), bool, switch


def text_options(args: argparse.Namespace, command: str = "pin") -> dict[str, Any]:
    """:func:`pool_options` but the layout: what the command line gives as text, read without torch."""
    given: dict[str, Any] = {}
    for opt, flag in flags(command):
        if flag.kind == "layout":
            continue
        value = getattr(args, flag.dest)
        if value is None and command != "doctor" and flag.default is not None:
            if opt.name == "size" and getattr(args, "num_pages", None) is not None:
                continue  # --num-pages instead of a size
            value = flag.default
        if value is not None:
            given[opt.name] = _flag_value(flag, value)
    return given


def takes_layout(command: str) -> bool:
    return any(flag.kind == "layout" for _opt, flag in flags(command))


def pool_options(args: argparse.Namespace, command: str = "pin") -> dict[str, Any]:
    """PinnedPool keyword arguments from the command line, validated as far as text goes: every
    declared option given as a flag, and the command line's own defaults (``--size 4GiB`` unless
    ``--num-pages``, ``--name cli``); what is not given is left to the Python default. The
    layout last: it imports torch, so a typo elsewhere fails before that."""
    given = text_options(args, command)
    if takes_layout(command):
        given["layout"] = layout_from_args(args)
    return given


def runtime_arg(name: str) -> Any:
    """What ``runtime=`` gets: a registered name, or a FakeRuntime for ``--runtime fake``."""
    if name == "fake":
        from ..testing import FakeRuntime

        return FakeRuntime()
    return name


def plan_runtime(name: str) -> tuple[str, Capabilities, bool]:
    """(name, declared capabilities, available here) without building the runtime: a plan for a
    GPU host can be made anywhere, and no GPU driver is started for it."""
    from ..runtimes import auto_runtime_name, capabilities_of, runtime_info

    if name == "fake":
        from ..testing import FakeRuntime

        return name, FakeRuntime().capabilities, True
    resolved = auto_runtime_name() if name == "auto" else name
    info = runtime_info(resolved)
    # Registered factories are the runtime classes; their capabilities are class attributes.
    return resolved, capabilities_of(info.factory), info.available()  # type: ignore[arg-type]


def _flag_help(opt: Option, flag: Flag) -> str:
    """The declared one-line help, with what the command line adds (argparse formats ``%``)."""
    return f"{opt.help} {flag.note}".strip().replace("%", "%%")


def add_pool_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Every declared option ``command`` takes (pinpool._plan.declared), as a flag of its kind. Each
    defaults to None, "not given": :func:`pool_options` then leaves it to the Python default,
    or to the command line's own (``Flag.default``)."""
    pool = parser.add_argument_group("pool", "the options of PinnedPool(...) of the same names (docs/options.md)")
    layout_flag = False
    for opt, flag in flags(command):
        help_text = _flag_help(opt, flag)
        if flag.kind == "layout":
            layout_flag = True  # its own group, after this one
        elif flag.kind == "bool":
            pool.add_argument(flag.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif flag.kind == "switch":
            pool.add_argument(flag.flag, action="store_true", default=None, help=help_text)
        elif flag.kind == "runtime":
            pool.add_argument(flag.flag, default="auto", choices=CLI_RUNTIMES, help=help_text)
        elif flag.kind == "huge_pages":
            pool.add_argument(flag.flag, nargs="?", const="thp", default=None, choices=list(HUGE_PAGES),
                              help=help_text)  # fmt: skip
        else:
            pool.add_argument(flag.flag, type=int if flag.kind == "int" else str, metavar=flag.metavar,
                              help=help_text)  # fmt: skip
    if layout_flag:
        add_layout_group(parser)
