#!/usr/bin/env python3
"""Render docs/options.md's options table from pinpool._plan.declared.OPTIONS, the one declaration.

    python docs/_ext/options_table.py           rewrite the table in docs/options.md
    python docs/_ext/options_table.py --check   exit 1 if the page's table differs from what this writes

The table between the two markers is generated, never edited by hand: tests/core/test_options_declared.py
runs the check (so ./dev test and CI do), and the page cannot drift from the code. Standard
library and pinpool._plan.declared only (no torch).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "options.md"
BEGIN = "<!-- options table: generated from pinpool/_plan/declared.py by docs/_ext/options_table.py; do not edit -->"
END = "<!-- end of the options table -->"

sys.path.insert(0, str(ROOT))
from pinpool._plan.declared import OPTIONS, Flag, Option  # noqa: E402


def _code(text: str) -> str:
    return f"`{text}`"


def _flag_cell(flag: Flag) -> str:
    if flag.kind == "layout":
        spelled = "`--layout FAMILY` with its dimensions, or `--layout-file PATH`"
    elif flag.kind == "bool":
        spelled = f"`{flag.flag}` / `--no-{flag.flag[2:]}`"
    elif flag.kind == "switch":
        spelled = _code(flag.flag)
    elif flag.kind == "runtime":
        spelled = _code(f"{flag.flag} NAME")
    elif flag.kind == "huge_pages":
        spelled = _code(f"{flag.flag} [thp|hugetlb|hugetlb:2MiB|hugetlb:1GiB|off]")
    else:
        spelled = _code(f"{flag.flag} {flag.metavar}")
    extra = (
        [] if flag.commands == ("pin", "plan") else [f"also `{c}`" for c in flag.commands if c not in ("pin", "plan")]
    )
    if flag.default is not None:
        extra.append(f"default `{flag.default}`")
    return spelled + (f" ({'; '.join(extra)})" if extra else "")


def _pin_cell(option: Option) -> str:
    if not option.pool:
        return "only `pin()`"
    if not option.pin:
        return f"no: {option.no_pin}"
    if option.default_for_pin != option.default:
        return f"yes, default {_code(option.shown(option.default_for_pin))}"
    return "yes"


def render() -> str:
    """The table, markers included."""
    lines = [
        BEGIN,
        "",
        "| option | type | default | `pin()` | command line | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for option in OPTIONS:
        command_line = _flag_cell(option.flag) if option.flag is not None else f"none ({option.no_flag})"
        cells = [
            _code(option.name),
            _code(option.type),
            _code(option.shown()),
            _pin_cell(option),
            command_line,
            option.help + ".",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", END]
    return "\n".join(lines)


def rewritten(text: str) -> str:
    """``text`` (the page) with its table replaced by :func:`render`'s."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f"{PAGE}: needs exactly one table between\n  {BEGIN}\nand\n  {END}")
    head, rest = text.split(BEGIN)
    _old, tail = rest.split(END)
    return head + render() + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if docs/options.md's table is not what this writes"
    )
    args = parser.parse_args(argv)
    text = PAGE.read_text(encoding="utf-8")
    wanted = rewritten(text)
    if args.check:
        if wanted == text:
            return 0
        diff = difflib.unified_diff(text.splitlines(), wanted.splitlines(), "docs/options.md", "generated", lineterm="")
        print("\n".join(diff), file=sys.stderr)
        print("docs/options.md's table differs from pinpool/_plan/declared.py: run python docs/_ext/options_table.py",
              file=sys.stderr)  # fmt: skip
        return 1
    PAGE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
