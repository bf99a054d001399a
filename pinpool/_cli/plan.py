"""``pinpool plan``: the plan of a pool with pin's options, and whether this host could pin it;
nothing is allocated or pinned (the report itself is pinpool/_cli/report.py's)."""

from __future__ import annotations

import argparse
import json

from .._errors import ConfigError
from .._plan.declared import option
from .options import plan_runtime, pool_options
from .progress import EXIT_OK, while_loading
from .report import plan_report, plan_text


def run_plan(args: argparse.Namespace) -> int:
    with while_loading("loading torch to plan the pool"):
        kwargs = pool_options(args, "plan")
        if args.rows < 0:
            raise ConfigError(f"--rows {args.rows}: give a number of chunk table rows >= 0")
        from .. import _probe
        from .._node.config import NodePacing
        from .._plan.options import PoolOptions
        from .._plan.plan import plan_pool
        from .._plan.preflight import check_host
        from ..runtimes._registry import pinning_capabilities

        # The same options as pin, checked the same way; pacing is validated, not joined.
        options = PoolOptions.create(**{name: value for name, value in kwargs.items() if option(name).create})
        pacing = NodePacing.from_options(**{name: value for name, value in kwargs.items()
                                            if name.startswith("node_")})  # fmt: skip
        runtime, caps, available = plan_runtime(args.runtime)
        host = _probe.probe_host()
        plan = plan_pool(options, host, caps)
    report = plan_report(plan, pool=options.name, layout=options.layout.name, size=options.size, runtime=runtime,
                         available=available, rows=args.rows)  # fmt: skip
    report["pinning"] = {
        "background": options.background,
        "max_call_seconds": options.max_call_seconds,
        "pin_nice": options.pin_nice,
        "per_buffer": options.per_buffer,
        "min_chunk_bytes": options.min_chunk_bytes,
        "max_retries": options.max_retries,
        "retry_codes": sorted(caps.retryable_codes if options.retry_codes is None else options.retry_codes),
        "budget_yields_to": options.budget_yields_to,
        "node_pacing": None
        if pacing is None
        else {"slots": pacing.slots, "budget_bytes": pacing.budget_bytes, "dir": pacing.directory,
              "wait": pacing.wait},
    }  # fmt: skip
    # The plan holds for any host; whether pinning it here would pass the pool's memory and
    # memlock pre-flight is a separate answer, reported rather than raised.
    try:
        charged = None if args.runtime == "fake" else pinning_capabilities(args.runtime, host)
        check_host(options, host, charged)
        report["preflight_error"] = None
    except ConfigError as exc:
        report["preflight_error"] = str(exc)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(plan_text(report)))
    return EXIT_OK
