"""Transfer registrars' metrics (issue 35, item 6): per-registrar gauges, histograms and failures,
labelled (pool, runtime, registrar), driven through the Observer's transfer events on a real
``CollectorRegistry``. The gauges follow live registrations and go with the last open pool of their
labels, except while a failed unregister may have left a registration live."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry, generate_latest

import pinpool
from pinpool._errors import RuntimeCallError
from pinpool._observe import Observer
from pinpool._plan import Chunk
from pinpool.metrics import REGISTER_BUCKETS, metrics_for
from pinpool.testing import FakeRegistrar, FakeRuntime

MiB = 1 << 20
PIN_STARTED: dict[str, Any] = {
    "nbytes": 8 * MiB, "chunks": 8, "chunk_bytes": MiB, "granularity": None, "order": "populate_first",
    "register_workers": 1, "populate_workers": 1,
}  # fmt: skip
REASONS = frozenset({"ENOMEM", "EINVAL", "RuntimeError"})  # the documented names a pool passes (a few of them)
UNPINNED: dict[str, Any] = {"nbytes": 8 * MiB, "seconds": 0.01, "pinned": True, "failures": 0, "leaked_bytes": 0}


def opened(registry: CollectorRegistry | None, pool: str = "kv", logger: Any = None) -> Observer:
    obs = Observer(
        pool=pool, runtime="fake", layout="raw", registry=registry, reasons=REASONS,
        logger=logger or structlog.wrap_logger(structlog.testing.CapturingLogger()),
    )  # fmt: skip
    obs.pin_started(**PIN_STARTED)
    return obs


def run(index: int, chunks: int = 2) -> Chunk:  # a registration: a run of whole 1 MiB chunks
    return Chunk(offset=index * chunks * MiB, nbytes=chunks * MiB)


def failure(op: str, reason: str, code: int = -1) -> RuntimeCallError:
    return RuntimeCallError(op=op, code=code, reason=reason, message=f"{op} failed", ptr=0, nbytes=2 * MiB)


def value(registry: CollectorRegistry, name: str, pool: str = "kv", registrar: str = "mooncake", **labels: str) -> Any:
    return registry.get_sample_value(name, {"pool": pool, "runtime": "fake", "registrar": registrar, **labels})


def transfer_gauges(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    """Every transfer gauge sample: (name, pool, registrar) -> value."""
    return {
        (s.name, s.labels["pool"], s.labels["registrar"]): s.value
        for family in registry.collect()
        if family.type == "gauge" and family.name.startswith("pinpool_transfer_")
        for s in family.samples
    }


def test_gauges_follow_live_registrations_per_registrar_and_go_with_the_pool() -> None:
    registry = CollectorRegistry()
    obs = opened(registry)
    for index in range(3):
        obs.transfer_registered("mooncake", run(index), 0.003)
    obs.transfer_registered("nixl", Chunk(offset=0, nbytes=6 * MiB), 0.5)  # few, large registrations
    assert transfer_gauges(registry) == {
        ("pinpool_transfer_registrations", "kv", "mooncake"): 3,
        ("pinpool_transfer_registered_bytes", "kv", "mooncake"): 6 * MiB,
        ("pinpool_transfer_registrations", "kv", "nixl"): 1,
        ("pinpool_transfer_registered_bytes", "kv", "nixl"): 6 * MiB,
    }
    assert value(registry, "pinpool_transfer_register_seconds_count") == 3
    assert value(registry, "pinpool_transfer_register_seconds_bucket", le="0.004") == 3  # REGISTER_BUCKETS
    assert value(registry, "pinpool_transfer_register_seconds_bucket", registrar="nixl", le="0.256") == 0
    assert value(registry, "pinpool_transfer_register_seconds_bucket", registrar="nixl", le="0.512") == 1
    obs.transfer_unregistered("mooncake", run(1), 0.001)
    assert value(registry, "pinpool_transfer_registrations") == 2
    assert value(registry, "pinpool_transfer_registered_bytes") == 4 * MiB
    for index in (2, 0):  # teardown, in reverse
        obs.transfer_unregistered("mooncake", run(index), 0.001)
    obs.transfer_unregistered("nixl", Chunk(offset=0, nbytes=6 * MiB), 0.01)
    assert value(registry, "pinpool_transfer_registrations") == 0
    assert value(registry, "pinpool_transfer_registered_bytes", registrar="nixl") == 0
    assert value(registry, "pinpool_transfer_unregister_seconds_count") == 3
    obs.unpinned(**UNPINNED)
    assert transfer_gauges(registry) == {}  # gone with the last open pool of (kv, fake)
    # Histograms and counters are cumulative: they stay.
    assert value(registry, "pinpool_transfer_register_seconds_count") == 3
    assert value(registry, "pinpool_transfer_unregister_seconds_count", registrar="nixl") == 1


def test_buckets_are_the_registration_buckets() -> None:
    registry = CollectorRegistry()
    opened(registry).transfer_registered("mooncake", run(0), 0.001)
    les = [
        s.labels["le"] for family in registry.collect() if family.name == "pinpool_transfer_register_seconds"
        for s in family.samples if s.name.endswith("_bucket")
    ]  # fmt: skip
    assert les == [*(str(b) for b in REGISTER_BUCKETS), "+Inf"]


def test_an_unregister_of_a_run_never_counted_moves_no_gauge() -> None:
    """A register that raised something other than RuntimeCallError "may have registered": pinpool
    unregisters it, and that unregister (or its "not registered" answer) must not count below zero."""
    registry = CollectorRegistry()
    obs = opened(registry)
    obs.transfer_registered("mooncake", run(0), 0.001)
    obs.transfer_failed("mooncake", "register", run(1), failure("register", "RuntimeError"), 0.001)
    obs.transfer_unregistered("mooncake", run(1), 0.001)  # the "maybe registered" run, undone
    assert value(registry, "pinpool_transfer_registrations") == 1
    assert value(registry, "pinpool_transfer_registered_bytes") == 2 * MiB
    assert value(registry, "pinpool_transfer_unregister_seconds_count") == 1  # the call itself is observed
    obs.transfer_unregistered("mooncake", run(0), 0.001)
    obs.transfer_unregistered("mooncake", run(0), 0.001)  # once only, even if reported twice
    assert value(registry, "pinpool_transfer_registrations") == 0
    assert value(registry, "pinpool_transfer_registered_bytes") == 0


def test_failures_by_op_with_bounded_reasons() -> None:
    registry = CollectorRegistry()
    obs = opened(registry)
    obs.transfer_failed("mooncake", "register", run(0), failure("register", "ENOMEM", 12), 0.001)
    obs.transfer_failed("mooncake", "register", run(1), failure("register", "ENOMEM", 12), 0.001)
    for code in range(50):  # an engine answering codes no table names adds one series, not 50
        obs.transfer_failed("nixl", "register", run(0), failure("register", f"nixl_status_{code}", code), 0.001)
    obs.transfer_failed("nixl", "unregister", run(0), failure("unregister", "RuntimeError"), 0.001)
    found = {
        (s.labels["registrar"], s.labels["op"], s.labels["reason"]): s.value
        for family in registry.collect() if family.name == "pinpool_transfer_failures"
        for s in family.samples if s.name == "pinpool_transfer_failures_total"
    }  # fmt: skip
    assert found == {
        ("mooncake", "register", "ENOMEM"): 2,
        ("nixl", "register", "other"): 50,
        ("nixl", "unregister", "RuntimeError"): 1,
    }
    # A failed call is not a registration: no gauge, no duration.
    assert transfer_gauges(registry) == {}
    assert value(registry, "pinpool_transfer_register_seconds_count") is None


def test_a_failed_unregister_keeps_the_registrars_gauges_past_the_close() -> None:
    """Like pinpool_pinned_bytes after a failed unregistration: the engine may still hold the memory."""
    registry = CollectorRegistry()
    obs = opened(registry, pool="leaky")
    obs.transfer_registered("mooncake", run(0), 0.001)
    obs.transfer_registered("mooncake", run(1), 0.001)
    obs.transfer_registered("nixl", run(0), 0.001)
    obs.transfer_unregistered("mooncake", run(1), 0.001)
    obs.transfer_failed("mooncake", "unregister", run(0), failure("unregister", "EINVAL", 22), 0.001)
    obs.transfer_unregistered("nixl", run(0), 0.001)
    assert obs.transfer_leaked() == ("mooncake",)
    obs.unpinned(**UNPINNED)
    assert transfer_gauges(registry) == {
        ("pinpool_transfer_registrations", "leaky", "mooncake"): 1,
        ("pinpool_transfer_registered_bytes", "leaky", "mooncake"): 2 * MiB,
    }
    # A later pool of that name adds to the kept series and leaves the leaked figure behind it.
    again = opened(registry, pool="leaky")
    again.transfer_registered("mooncake", run(3), 0.001)
    assert value(registry, "pinpool_transfer_registered_bytes", pool="leaky") == 4 * MiB
    again.transfer_unregistered("mooncake", run(3), 0.001)
    again.unpinned(**UNPINNED)
    assert value(registry, "pinpool_transfer_registered_bytes", pool="leaky") == 2 * MiB


def test_two_open_pools_of_one_name_share_the_series_until_both_close() -> None:
    registry = CollectorRegistry()
    first, second = opened(registry), opened(registry)
    first.transfer_registered("mooncake", run(0), 0.001)
    second.transfer_registered("mooncake", run(0), 0.001)  # the same offsets in another pool: its own book
    first.transfer_unregistered("mooncake", run(0), 0.001)
    first.unpinned(**UNPINNED)
    assert value(registry, "pinpool_transfer_registrations") == 1  # second still holds the series
    second.transfer_unregistered("mooncake", run(0), 0.001)
    second.unpinned(**UNPINNED)
    assert transfer_gauges(registry) == {}


def test_events_outside_an_open_pool_move_no_gauge() -> None:
    """Before pin_started and after unpinned a pool holds no series: a late event must not recreate one."""
    registry = CollectorRegistry()
    obs = opened(registry)
    obs.unpinned(**UNPINNED)
    obs.transfer_registered("mooncake", run(0), 0.001)
    obs.transfer_unregistered("mooncake", run(0), 0.001)
    assert transfer_gauges(registry) == {}
    assert value(registry, "pinpool_transfer_register_seconds_count") == 1


def test_multiprocess_mode_keeps_the_series_at_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    registry = CollectorRegistry()
    obs = opened(registry)
    obs.transfer_registered("mooncake", run(0), 0.001)
    obs.transfer_unregistered("mooncake", run(0), 0.001)
    obs.unpinned(**UNPINNED)
    assert value(registry, "pinpool_transfer_registrations") == 0


class Recorder:
    """A bound logger that keeps what it is given: (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.bound: dict[str, Any] = {}

    def bind(self, **fields: Any) -> Recorder:
        self.bound = fields
        return self

    def _log(self, level: str, event: str, fields: dict[str, Any]) -> None:
        self.events.append((level, event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self._log("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log("warning", event, fields)


def test_events_carry_the_registrar_and_no_registry_is_fine() -> None:
    logger = Recorder()
    obs = opened(None, logger=logger)
    obs.transfer_registered("mooncake", run(1), 0.0012345678)
    obs.transfer_failed("mooncake", "unregister", run(1), failure("unregister", "EINVAL", 22), 0.002)
    obs.transfer_unregistered("mooncake", run(1), 0.001)
    events = [(level, event) for level, event, _ in logger.events]
    assert events[1:] == [("debug", "transfer.registered"), ("warning", "transfer.failed"),
                          ("debug", "transfer.unregistered")]  # fmt: skip
    assert logger.events[1][2] == {
        "registrar": "mooncake", "offset": 2 * MiB, "nbytes": 2 * MiB, "seconds": 0.001235,
    }  # fmt: skip
    assert logger.events[2][2] == {
        "registrar": "mooncake", "op": "unregister", "offset": 2 * MiB, "nbytes": 2 * MiB, "seconds": 0.002,
        "code": 22, "reason": "EINVAL", "error": "unregister failed",
    }  # fmt: skip
    assert logger.bound == {"pool": "kv", "runtime": "fake", "layout": "raw"}
    assert obs.metric_errors == obs.log_errors == 0


def test_the_exposition_is_valid_and_has_no_offset_label() -> None:
    registry = CollectorRegistry()
    obs = opened(registry)
    obs.transfer_registered("mooncake", run(0), 0.001)
    obs.transfer_failed("mooncake", "register", run(1), failure("register", "ENOMEM", 12), 0.001)
    text = generate_latest(registry).decode()
    lines = [line for line in text.splitlines() if line.startswith("pinpool_transfer_")]
    assert lines and all("offset" not in line and "ptr" not in line for line in lines)
    assert 'pinpool_transfer_registrations{pool="kv",registrar="mooncake",runtime="fake"} 1.0' in text


# -- through real pools: the core's workers report to these families ------------------------------------------


def pool(registry: CollectorRegistry, *registrars: FakeRegistrar, name: str = "kv", **kw: Any) -> pinpool.PinnedPool:
    return pinpool.PinnedPool(
        size=8 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(), name=name, registry=registry, registrars=registrars,
        **kw,
    )  # fmt: skip


def test_a_pool_with_two_registrars_reports_each() -> None:
    registry = CollectorRegistry()
    mooncake, nixl = FakeRegistrar("mooncake"), FakeRegistrar("nixl", preferred_bytes=4 * MiB)
    with pool(registry, mooncake, nixl) as p:
        planned = {plan.name: plan.registrations for plan in p.plan.transfers}
        assert len(planned["mooncake"]) == 8 and len(planned["nixl"]) == 2  # one per chunk; few, large
        for engine in ("mooncake", "nixl"):
            assert value(registry, "pinpool_transfer_registrations", registrar=engine) == len(planned[engine])
            assert value(registry, "pinpool_transfer_registered_bytes", registrar=engine) == p.nbytes
            assert value(registry, "pinpool_transfer_register_seconds_count", registrar=engine) == len(planned[engine])
    assert transfer_gauges(registry) == {}
    assert value(registry, "pinpool_transfer_unregister_seconds_count", registrar="mooncake") == 8
    assert value(registry, "pinpool_transfer_unregister_seconds_count", registrar="nixl") == 2
    assert mooncake.registered == nixl.registered == {}


def test_a_refused_registration_rolls_back_and_is_counted() -> None:
    registry = CollectorRegistry()
    with pytest.raises(pinpool.PinError), pool(registry, FakeRegistrar("mooncake", fail_register_on=3)):
        pytest.fail("the body must not run")
    # "Injected" is the stand-in's own name for its failure, not a documented one: "other".
    assert value(registry, "pinpool_transfer_failures_total", op="register", reason="other") == 1
    assert transfer_gauges(registry) == {}
    assert registry.get_sample_value("pinpool_rollbacks_total", {"pool": "kv", "runtime": "fake",
                                                                 "cause": "failure"}) == 1  # fmt: skip


def test_a_register_that_raised_is_undone_without_moving_the_gauges_below_zero() -> None:
    registry = CollectorRegistry()
    engine = FakeRegistrar("mooncake", raise_on_register=2)
    with pytest.raises(pinpool.PinError), pool(registry, engine, register_workers=1):
        pytest.fail("the body must not run")
    assert engine.registered == {}  # pinpool undid the registration the raising call made
    assert value(registry, "pinpool_transfer_failures_total", op="register", reason="RuntimeError") == 1
    assert transfer_gauges(registry) == {}


def test_a_failed_unregistration_leaves_the_registrars_series() -> None:
    registry = CollectorRegistry()
    engine = FakeRegistrar("mooncake", fail_unregister_on=1)
    with pytest.raises(pinpool.UnpinError), pool(registry, engine, name="leaky"):
        pass
    assert value(registry, "pinpool_transfer_failures_total", pool="leaky", op="unregister", reason="other") == 1
    held = sum(engine.registered.values())
    assert held == MiB  # the engine still holds that registration: so say the gauges
    assert transfer_gauges(registry) == {
        ("pinpool_transfer_registrations", "leaky", "mooncake"): 1,
        ("pinpool_transfer_registered_bytes", "leaky", "mooncake"): held,
    }
    for base, nbytes in engine.registered.items():  # released by hand: the fake's books are not the test's
        engine.unregister(base, nbytes, None)


def test_docs_metrics_md_documents_every_family() -> None:
    """docs/metrics.md is the contract: each family has its entry (a heading) and its row in the summary."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text(encoding="utf-8")
    registry = CollectorRegistry()
    metrics_for(registry)
    missing: list[str] = []
    for family in registry.collect():
        exposed = family.name + ("_total" if family.type == "counter" else "")
        if f"\n#### `{exposed}`\n" not in doc:
            missing.append(f"{exposed}: no '#### `{exposed}`' entry")
        if f"\n| `{exposed}" not in doc:
            missing.append(f"{exposed}: no row in the summary table")
    assert missing == []
    assert sum(1 for f in registry.collect() if f.name.startswith("pinpool_transfer_")) == 5
