"""``pinpool plan``: the plan of a pool with pin's options and whether this host could pin it (maps nothing)."""

from __future__ import annotations

import argparse
import json

from .._errors import ConfigError
from .._types import RegistrarLimits
from .._units import parse_size
from .options import plan_runtime, pool_options
from .progress import EXIT_OK, while_loading
from .report import plan_report, plan_text


def registrar_spec(spec: str) -> tuple[str, RegistrarLimits]:
    """``--registrar NAME[:max=SIZE,preferred=SIZE,pte=N,serial,pins]`` as a name and its limits."""
    name, _, given = spec.partition(":")
    fix = "give --registrar NAME[:max=SIZE,preferred=SIZE,pte=N,serial,pins], e.g. mooncake:max=64GiB,pins"
    if not name:
        raise ConfigError(f"--registrar {spec!r} has no name: {fix}")
    limits: dict[str, object] = {}
    keys = {"max": "max_bytes", "preferred": "preferred_bytes", "pte": "page_table_entries"}
    for item in filter(None, given.split(",")):
        key, _, value = item.partition("=")
        if item == "serial":
            limits["parallel"] = False
        elif item == "pins":
            limits["pins_pages"] = True
        elif key in keys and value:
            limits[keys[key]] = int(value) if key == "pte" and value.isdigit() else parse_size(value, what=key)
        else:
            raise ConfigError(f"--registrar {spec!r}: {item!r} is not a limit; {fix}")
    from ..registrars import limits_of

    class Limits:  # only its limits are planned: no engine is called
        def register(self, ptr: int, nbytes: int) -> object: ...

        def unregister(self, ptr: int, nbytes: int, handle: object) -> None: ...

    stand_in = Limits()
    stand_in.name, stand_in.limits = name, RegistrarLimits(**limits)  # type: ignore[attr-defined,arg-type]
    return name, limits_of(stand_in)


def run_plan(args: argparse.Namespace) -> int:
    with while_loading("loading torch to plan the pool"):
        kwargs = pool_options(args, "plan")
        if args.rows < 0:
            raise ConfigError(f"--rows {args.rows}: give a number of chunk table rows >= 0")
        from .. import _probe
        from .._plan.plan import plan_pool
        from .._plan.preflight import check_engine_pins, check_pinning, place
        from .._plan.reservation import pool_reservation
        from .._pool.request import pool_request
        from ..runtimes._registry import pinning_capabilities

        # The same request as pin's, checked the same way; pacing is validated, not joined.
        request = pool_request("PinnedPool", kwargs)
        options, pacing = request.options, request.pacing
        runtime, caps, available = plan_runtime(args.runtime)
        host = _probe.probe_host()
        whole = options if options.reserve is None else options.reservation()  # elastic: the reservation
        placement = place(whole, host)
        transfers = [registrar_spec(spec) for spec in args.registrar]
        plan = plan_pool(whole, host, caps, placement=placement, transfers=transfers)
        reservation = None if options.reserve is None else pool_reservation(options, plan)
    report = plan_report(plan, pool=options.name, layout=options.layout.name, size=options.size, runtime=runtime,
                         available=available, rows=args.rows)  # fmt: skip
    as_given = ("background", "max_call_seconds", "pin_nice", "per_buffer", "min_chunk_bytes", "max_retries")
    report["pinning"] = {
        **{name: getattr(options, name) for name in as_given},
        "retry_codes": sorted(caps.retryable_codes if options.retry_codes is None else options.retry_codes),
        "budget_yields_to": options.budget_yields_to,
        "node_pacing": None if pacing is None else {
            "slots": pacing.slots, "budget_bytes": pacing.budget_bytes, "dir": pacing.directory, "wait": pacing.wait,
        },
    }  # fmt: skip
    report["reservation"] = None if reservation is None else {
        "reserved_pages": reservation.num_pages, "reserved_bytes": reservation.nbytes,
        "floor_pages": reservation.floor_pages, "step_pages": reservation.step_pages,
        "quantum_pages": reservation.quantum,
        "segments": [
            {"index": s.index, "pages": [s.pages.start, s.pages.stop], "nbytes": s.nbytes, "chunks": len(s.chunks),
             "floor": s.floor}
            for s in reservation.segments
        ],
    }  # fmt: skip
    # The plan holds for any host; whether this host would pass its pre-flight is reported, not raised.
    try:
        charged = None if args.runtime == "fake" else pinning_capabilities(args.runtime, host)
        buffers, mapped = [spec.nbytes for spec in placement.specs], placement.mapping_bytes
        if reservation is not None:  # entry pins the floor; the rest is only reserved
            floor = reservation.segments[0]
            buffers, mapped = [end - start for start, end in floor.slices], floor.nbytes
        check_pinning(options, host, charged, mapping_bytes=mapped, buffer_bytes=buffers)
        check_engine_pins([(t.name, t.limits.pins_pages) for t in plan.transfers], plan.nbytes, host)
        report["preflight_error"] = None
    except ConfigError as exc:
        report["preflight_error"] = str(exc)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(plan_text(report)))
    return EXIT_OK
