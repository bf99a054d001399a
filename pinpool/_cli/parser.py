"""The command line's argparse parser: the commands, their flags and their help (torch-free)."""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Sequence
from typing import Any

from .doctor import run_doctor
from .options import add_pool_options
from .pin import METRICS_PORT, run_pin
from .plan import run_plan
from .progress import EXIT_CODES

DESCRIPTION = "Plan, check and pin page-locked host-memory pools (KV-cache offload) for LLM inference servers."


class _VersionAction(argparse.Action):  # --version, reading the version only when asked
    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:  # fmt: skip
        from .. import __version__

        print(f"pinpool {__version__}")
        parser.exit()


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=30)


def _wrap(text: str) -> str:
    # Raw descriptions keep the exit-code table's layout, so prose is wrapped here.
    return textwrap.fill(text, width=79)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pinpool", description=_wrap(DESCRIPTION), epilog=EXIT_CODES,
                                     formatter_class=_formatter)  # fmt: skip
    parser.add_argument("--version", action=_VersionAction, help="print pinpool's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,doctor,pin}")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        """A command: its help, the pool options every command takes, and --json."""
        sub = commands.add_parser(
            name, help=help, description=_wrap(description), epilog=EXIT_CODES, formatter_class=_formatter
        )
        add_pool_options(sub, name)
        sub.add_argument("--json", action="store_true", help="print one JSON object instead of text")
        return sub

    plan = command(
        "plan", "show what a pool would be (buffers, chunks, workers); allocates and pins nothing",
        "Plan a pool with pin's options: buffers, pages, chunks, workers, spans and the chunk table. Nothing is "
        "allocated or pinned (a pool larger than this host can be planned too); it says whether this host can pin it.",
    )  # fmt: skip
    plan.add_argument("--rows", type=int, default=5, metavar="N", help="chunk table rows shown at each end (default 5)")
    plan.add_argument(
        "--registrar", action="append", default=[], metavar="NAME[:max=SIZE,preferred=SIZE,pte=N,serial,pins]",
        help="plan the calls of a transfer registrar with these limits too (repeatable; see pinpool.registrars): "
        "max= its largest registration, preferred= join chunks up to this, pte= its page-table budget, serial: "
        "one call at a time, pins: it pins pages itself (ibv_reg_mr)",
    )  # fmt: skip
    plan.set_defaults(run=run_plan)

    doctor = command(
        "doctor", "check this host for pinning: limits, memory, huge pages, kernel, NUMA, GPU, transfer engines, "
        "environment",
        "Check this host for pinning a pool, each check ok / warn / fail / skip with a one-line fix. Exits 1 when "
        "a check fails (warnings do not).",
    )  # fmt: skip
    doctor.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=True,
                        help="ask torch and the driver about GPUs (default: yes, when torch sees one)")  # fmt: skip
    doctor.add_argument("--engines", action=argparse.BooleanOptionalAction, default=True,
                        help="check the transfer engines (Mooncake, NIXL: each imported in a child process) and "
                        "the RDMA devices with what registering over them needs (default: yes)")  # fmt: skip
    doctor.add_argument("--remove-stale", action="store_true",
                        help="first remove the regions that creators which died left half-made (this user's "
                        "temporary files in /dev/shm and hugetlbfs mounts) and this user's orphaned regions that "
                        "were not kept (creator gone, no process maps them); each is listed")  # fmt: skip
    doctor.add_argument("--region-dir", action="append", metavar="DIR", dest="region_dirs",
                        help="look for shared regions only under DIR, repeatable (default: every tmpfs and "
                        "hugetlbfs mount)")  # fmt: skip
    doctor.set_defaults(run=run_doctor)

    pin = command(
        "pin", "pin a pool with progress, report how and how fast, unpin it",
        "Pin a pool with progress on stderr (a bar on a terminal, else a line every 2 s), report to stdout how it was "
        "pinned, how fast and each registration call's latency, then unpin it; --hold (and --metrics-port) between.",
    )  # fmt: skip
    pin.add_argument("--hold", metavar="SECONDS|forever",
                     help="keep the pool pinned this long after pinning; Ctrl-C or SIGTERM ends the hold, the pool "
                     "is unpinned and pinpool exits 0 (the report says which signal ended it)")  # fmt: skip
    pin.add_argument("--metrics-port", type=int, metavar="PORT",
                     help=f"serve the pool's Prometheus metrics on this port while pinning and holding "
                     f"({METRICS_PORT} is pinpool's usual; 0 picks a free one)")  # fmt: skip
    pin.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR", help="address to serve metrics on "
                     "(default 127.0.0.1, this machine only; 0.0.0.0 for all)")  # fmt: skip
    pin.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                     help="auto (default): a bar on a terminal, a plain line every 2 s otherwise")  # fmt: skip
    pin.set_defaults(run=run_pin)
    return parser


def value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option, in any subcommand, that takes exactly one value."""
    found: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= value_options(sub)
        elif action.option_strings and action.nargs is None:
            found.update(action.option_strings)
    return found


def glue_negative_values(argv: list[str], options: set[str]) -> list[str]:
    """``--size -5GiB`` as ``--size=-5GiB``: argparse would take ``-5GiB`` for an option and answer
    "expected one argument"; glued, the value reaches pinpool's own check, which says what is wrong."""
    glued: list[str] = []
    for token in argv:
        if glued and glued[-1] in options and re.match(r"-[0-9.]", token):
            glued[-1] = f"{glued[-1]}={token}"
        else:
            glued.append(token)
    return glued
