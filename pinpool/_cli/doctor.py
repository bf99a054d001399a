"""``pinpool doctor``: the command's wiring around pinpool/_cli/checks.py, which owns the checks,
their facts and their rendering."""

from __future__ import annotations

import argparse
import json

from .options import pool_options
from .status import while_loading


def run_doctor(args: argparse.Namespace) -> int:
    size = pool_options(args, "doctor").get("size")
    with while_loading("reading this host" + (" (loading torch to ask about GPUs)" if args.cuda else "")):
        from . import checks as _doctor

        checks = _doctor.run_checks(_doctor.read_facts(cuda=args.cuda), size)
    if args.json:
        from .. import __version__

        print(json.dumps(_doctor.to_json(checks, size, __version__)))
    else:
        print(_doctor.render_text(checks, size))
    return _doctor.exit_code(checks)
