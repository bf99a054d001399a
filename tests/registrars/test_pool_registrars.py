"""A pool with transfer registrars: every registrar holds the pool's registrations while it is open, a page is
usable once every one holds it, a failure in any of them rolls back all of them, and teardown undoes every
registrar's registrations before the runtime unpins a byte. Real drivers and threads, FakeRegistrar's books."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch

import pinpool
from pinpool import PinError, PoolState, PoolStateError, UnpinError
from pinpool.testing import FakeRegistrar, FakeRuntime, assert_released, locked_bytes

from .. import preloaded
from ..conftest import cancel_at_first, each_driver, needs_mlock, pin_and_run

MiB = 1 << 20


class Clock:
    """One order of every call of the runtime and the registrars: which came first."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    def hook(self, who: str) -> Callable[[str, int, int], None]:
        def seen(op: str, ptr: int, nbytes: int) -> None:
            with self._lock:
                self.events.append((who, op, ptr))

        return seen


def pool_with(fake: FakeRuntime, *registrars: FakeRegistrar, **options: object) -> pinpool.PinnedPool:
    options = {"size": 32 * MiB, "chunk_bytes": 2 * MiB, "populate": False, **options}
    return pinpool.PinnedPool(runtime=fake, registry=None, registrars=list(registrars), **options)  # type: ignore[arg-type]


def held_by_nobody(fake: FakeRuntime, *registrars: FakeRegistrar) -> None:
    assert fake.registered == {}
    for registrar in registrars:
        assert registrar.registered == {}, registrar.name


@pytest.mark.anyio
@each_driver
async def test_every_registrar_holds_the_plan_while_open_and_lets_go_before_the_runtime(
    fake: FakeRuntime, mode: str
) -> None:
    clock = Clock()
    registering = threading.Event()
    overlapped: list[bool] = []

    def runtime_call(op: str, ptr: int, nbytes: int) -> None:
        clock.hook("runtime")(op, ptr, nbytes)
        if op == "register" and len(fake.register_calls) == 16:  # the last chunk pins once an engine registers
            overlapped.append(registering.wait(10))

    def engine_call(op: str, ptr: int, nbytes: int) -> None:
        clock.hook("one")(op, ptr, nbytes)
        registering.set()

    fake.before_call = runtime_call
    one = FakeRegistrar("one", preferred_bytes=8 * MiB, before_call=engine_call)
    two = FakeRegistrar("two", max_bytes=4 * MiB, before_call=clock.hook("two"))
    pool = pool_with(fake, one, two, size=34 * MiB)

    def body(pool: pinpool.PinnedPool) -> None:
        base = pool.data_ptr
        for registrar, plan in zip((one, two), pool.plan.transfers, strict=True):
            assert registrar.registered == {base + r.offset: r.nbytes for r in plan.registrations}
            live = pool.transfer_registrations(registrar)
            assert [(r.offset, r.nbytes) for r in live] == [(r.offset, r.nbytes) for r in plan.registrations]
            assert all(r.handle[:2] == ("fake-handle", registrar.name) for r in live)  # type: ignore[index]
        assert [r.nbytes for r in pool.plan.transfers[0].registrations] == [8 * MiB] * 4 + [2 * MiB]
        assert pool.pinned_pages == pool.num_pages and pool.state is PoolState.READY

    await pin_and_run(pool, mode, body)
    held_by_nobody(fake, one, two)
    assert_released(pool, fake)
    undo = [i for i, event in enumerate(clock.events) if event[1] == "unregister"]
    runtime_undo = [i for i in undo if clock.events[i][0] == "runtime"]
    registrar_undo = [i for i in undo if clock.events[i][0] != "runtime"]
    assert registrar_undo and runtime_undo and max(registrar_undo) < min(runtime_undo)
    assert overlapped == [True]  # an engine registered chunks while the last one was being pinned


@pytest.mark.anyio
@each_driver
@pytest.mark.parametrize("failing", ["one", "two"])
@pytest.mark.parametrize("call", [1, 3, 8])
@pytest.mark.parametrize("how", ["typed", "untyped"])
async def test_a_failure_in_any_registrar_rolls_back_every_registration_of_every_registrar(
    fake: FakeRuntime, mode: str, failing: str, call: int, how: str
) -> None:
    fault = {"fail_register_on": call} if how == "typed" else {"raise_on_register": call}
    one = FakeRegistrar("one", **(fault if failing == "one" else {}))  # type: ignore[arg-type]
    two = FakeRegistrar("two", **(fault if failing == "two" else {}))  # type: ignore[arg-type]
    pool = pool_with(fake, one, two)
    with pytest.raises(PinError) as info:
        await pin_and_run(pool, mode)
    held_by_nobody(fake, one, two)
    assert_released(pool, fake)
    assert f"{failing} register" in str(info.value) and "rolled back" in str(info.value)
    failure = next(f for f in info.value.failures if f.registrar == failing)
    assert failure.phase == "register" and failure.call == f"{failing} register"
    assert info.value.leaked == ()


@pytest.mark.anyio
@each_driver
async def test_a_registrar_that_cannot_let_go_keeps_the_memory_and_says_so(fake: FakeRuntime, mode: str) -> None:
    stuck = FakeRegistrar("stuck", fail_unregister_on=2)
    pool = pool_with(fake, stuck)
    with pytest.raises(UnpinError) as info:
        await pin_and_run(pool, mode)
    assert "stuck: offset=" in str(info.value) and "memory is kept mapped" in str(info.value)
    (leaked,) = info.value.leaked
    assert leaked in pool.plan.transfers[0].registrations
    assert fake.registered == {}  # the runtime let go; only the engine may still hold that range
    assert len(stuck.registered) == 1 and pool.state is PoolState.CLOSED
    for base in list(stuck.registered):
        stuck.unregister(base, stuck.registered[base], None)


@pytest.mark.anyio
async def test_an_unregister_that_finds_nothing_registered_is_not_a_failure(fake: FakeRuntime) -> None:
    """A registrar answering "not registered" (its declared code) to an undo: nothing was held, nothing leaked."""
    engine = FakeRegistrar("gone")
    pool = pool_with(fake, engine)
    async with pool:
        for base, nbytes in list(engine.registered.items())[:2]:
            engine.unregister(base, nbytes, None)  # released behind pinpool's back
    held_by_nobody(fake, engine)
    assert_released(pool, fake)


@pytest.mark.anyio
async def test_cancellation_at_a_registrars_first_call_rolls_everything_back(fake: FakeRuntime) -> None:
    with anyio.CancelScope() as scope:
        engine = FakeRegistrar("slow", register_delay=0.01, before_call=cancel_at_first("register", scope))
        pool = pool_with(fake, engine)
        async with pool:
            pytest.fail("the body ran though pinning was cancelled")
    assert scope.cancelled_caught
    held_by_nobody(fake, engine)
    assert_released(pool, fake)


def test_close_from_another_thread_while_registering_undoes_everything(fake: FakeRuntime) -> None:
    started, pool_box = threading.Event(), []

    def slow(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and not started.is_set():
            started.set()
            threading.Thread(target=lambda: pool_box[0].close(raise_errors=False)).start()

    engine = FakeRegistrar("slow", register_delay=0.02, before_call=slow)
    pool = pool_with(fake, engine)
    pool_box.append(pool)
    with pytest.raises(PoolStateError):
        pool.open()
    held_by_nobody(fake, engine)
    assert_released(pool, fake)


@pytest.mark.anyio
async def test_a_background_page_is_usable_only_once_every_registrar_holds_it(fake: FakeRuntime) -> None:
    """Sampled at every call: the pages below pinned_pages are held by both engines. The slow engine's third
    and later registrations wait until the body has used the first pages, so it runs while the pool pins."""
    violations: list[tuple[str, int]] = []
    body_ran = threading.Event()
    holder: list[pinpool.PinnedPool] = []
    fast = FakeRegistrar("fast")
    slow = FakeRegistrar("slow", preferred_bytes=8 * MiB)

    def check(op: str, ptr: int, nbytes: int) -> None:
        pool = holder[0]
        pages = pool.pinned_pages
        for engine in (fast, slow):
            held = sum(n for base, n in engine.registered.items() if base < pool.data_ptr + pages)
            if held < pages:  # Raw: a page is a byte
                violations.append((engine.name, pages))

    def gate(op: str, ptr: int, nbytes: int) -> None:
        check(op, ptr, nbytes)
        if op == "register" and len(slow.register_calls) >= 2:
            body_ran.wait(10)

    fake.before_call = fast.before_call = check
    slow.before_call = gate
    pool = pool_with(fake, fast, slow, size=64 * MiB, background=True)
    holder.append(pool)
    async with pool:
        first = await pool.wait_ready(min_bytes=8 * MiB)
        assert pool.state is PoolState.PINNING and 8 * MiB <= first < pool.num_pages
        pieces = pool.transfer_pieces(slow, pages=range(0, first))
        assert sum(p.nbytes for p in pieces) == first
        assert all(p.registration.offset <= p.offset and p.end <= p.registration.end for p in pieces)
        with pytest.raises(PoolStateError, match="not registered with 'slow' now"):
            pool.transfer_pieces(slow, pages=range(0, pool.num_pages))
        body_ran.set()
        await pool.wait_ready()
    assert violations == []
    held_by_nobody(fake, fast, slow)
    assert_released(pool, fake)


def test_a_serial_registrar_gets_one_call_at_a_time(fake: FakeRuntime) -> None:
    serial = FakeRegistrar("serial", parallel=False, register_delay=0.002)
    parallel = FakeRegistrar("parallel", register_delay=0.002)
    with pool_with(fake, serial, parallel, register_workers=4):
        pass
    assert serial.max_concurrent == 1 and len(serial.register_calls) == 16
    held_by_nobody(fake, serial, parallel)


def test_pin_and_shared_pools_take_registrars_and_a_second_pool_over_registered_memory_is_refused(
    fake: FakeRuntime,
) -> None:
    engine = FakeRegistrar("engine")
    tensor = torch.zeros(8 * MiB, dtype=torch.uint8)
    with pinpool.pin(tensor, runtime=fake, registry=None, registrars=[engine], chunk_bytes=MiB) as pinned:
        assert sum(engine.registered.values()) == 8 * MiB
        assert min(engine.registered) == tensor.data_ptr()
        with pytest.raises(pinpool.AlreadyPinnedError):
            pinpool.pin(tensor[MiB:], runtime=fake, registry=None, registrars=[FakeRegistrar("other")]).open()
        (piece,) = pinned.transfer_pieces(engine, offset=MiB, nbytes=4096)
        assert piece.address == tensor.data_ptr() + MiB and piece.registration.nbytes == MiB
    held_by_nobody(fake, engine)
    memory = pinpool.SharedMemory(None)  # a memfd
    shared = pinpool.PinnedPool(memory=memory, size=8 * MiB, runtime=fake, registry=None, registrars=[engine])
    with shared:
        assert sum(engine.registered.values()) == 8 * MiB
    held_by_nobody(fake, engine)


def test_transfer_pieces_of_a_closed_or_new_pool_and_a_stranger_are_refused(fake: FakeRuntime) -> None:
    engine = FakeRegistrar("engine")
    pool = pool_with(fake, engine)
    with pytest.raises(PoolStateError, match="only available while the pool is open"):
        pool.transfer_pieces(engine, pages=range(0, 1))
    assert pool.transfer_registrations("engine") == ()
    with pool:
        with pytest.raises(pinpool.ConfigError, match="is not one of pool 'default''s registrars"):
            pool.transfer_pieces(FakeRegistrar("stranger"), pages=range(0, 1))
        with pytest.raises(pinpool.ConfigError, match="range"):
            pool.transfer_pieces(engine, pages=range(0, pool.num_pages + 1))
        with pytest.raises(pinpool.ConfigError, match="give pages="):
            pool.transfer_pieces(engine)
        with pytest.raises(pinpool.ConfigError, match="outside pool"):
            pool.transfer_pieces(engine, offset=pool.nbytes, nbytes=1)
        assert pool.registrars == (engine,)
    with pytest.raises(PoolStateError):
        pool.transfer_pieces("engine", offset=0, nbytes=1)


def test_a_forked_child_leaves_the_parents_registrations_alone(fake: FakeRuntime) -> None:
    engine = FakeRegistrar("engine")
    with pool_with(fake, engine) as pool:
        pid = os.fork()
        if pid == 0:  # the child: exit its copy of the pool, then report what it undid
            calls = len(engine.unregister_calls)
            pool.close()
            os._exit(0 if len(engine.unregister_calls) == calls and pool.transfer_registrations(engine) == () else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert len(engine.registered) == 16
    held_by_nobody(fake, engine)


@needs_mlock
def test_mlock_pool_with_a_failing_registrar_leaves_nothing_locked(vmlck_baseline: int) -> None:
    engine = FakeRegistrar("engine", fail_register_on=5)
    pool = pinpool.PinnedPool(size=32 * MiB, chunk_bytes=2 * MiB, runtime="mlock", registry=None, registrars=[engine])
    with pytest.raises(PinError, match="engine register"):
        pool.open()
    assert engine.registered == {} and locked_bytes() == vmlck_baseline
    with pinpool.PinnedPool(size=32 * MiB, runtime="mlock", registry=None, registrars=[engine]) as pool:
        assert locked_bytes() >= vmlck_baseline + 32 * MiB and sum(engine.registered.values()) == 32 * MiB
    assert engine.registered == {} and locked_bytes() == vmlck_baseline


def test_a_serial_registrar_is_undone_one_call_at_a_time_too(fake: FakeRuntime) -> None:
    serial = FakeRegistrar("serial", parallel=False, unregister_delay=0.002)
    with pool_with(fake, serial, unpin_workers=4):
        serial.max_concurrent = 0
    assert serial.max_concurrent == 1 and len(serial.unregister_calls) == 16
    held_by_nobody(fake, serial)


def test_an_unregister_that_returns_a_status_is_not_trusted(fake: FakeRuntime) -> None:
    """A registrar whose unregister returns a status code (as Mooncake's raw call does) broke the protocol:
    pinpool cannot tell it let go, so the range is reported leaked and the memory kept, never assumed free."""

    class ReturnsStatus(FakeRegistrar):
        def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
            super().unregister(ptr, nbytes, handle)
            return 0  # type: ignore[return-value]

    engine = ReturnsStatus("status", preferred_bytes=32 * MiB)
    with pytest.raises(UnpinError) as info:
        with pool_with(fake, engine):
            pass
    (failure,) = info.value.failures
    assert failure.call == "status unregister" and failure.error.reason == "UnexpectedReturn"
    assert "returned 0" in failure.error.message and engine.registered == {} and fake.registered == {}


def test_a_finalizer_never_waits_on_a_wedged_engine_call() -> None:
    """The finalizer resumes a teardown that raised while an unpin worker is stuck in an engine's unregister: it
    books what is left leaked and returns (it waited on the engine's undo until the call came back), and the
    runtime unpins nothing the engine may still hold."""
    script = Path(__file__).with_name("wedged_finalizer.py")
    done = preloaded.run([sys.executable, str(script), "registrar"], capture_output=True, text=True, timeout=60)
    assert "finalizer returned" in done.stdout and "STILL BLOCKED" not in done.stdout, done.stdout + done.stderr
    assert "runtime holds 8, engine holds 8" in done.stdout, done.stdout


def test_pages_of_a_pin_with_ranges_or_a_strided_view_skip_its_holes(fake: FakeRuntime) -> None:
    rows, slot = 8, MiB
    region = torch.zeros(rows, 4 * slot, dtype=torch.uint8)
    engine = FakeRegistrar("engine")
    ranges = [(row * 4 * slot + slot, slot) for row in range(rows)]
    with pinpool.pin(region, ranges=ranges, runtime=fake, registry=None, registrars=[engine]) as pinned:
        pieces = pinned.transfer_pieces(engine, pages=range(0, 2))
        assert [(p.address - region.data_ptr(), p.nbytes) for p in pieces] == [(slot, slot), (5 * slot, slot)]
    view = region[:, slot : 2 * slot]
    with pinpool.pin(view, runtime=fake, registry=None, registrars=[engine]) as pinned:
        pieces = pinned.transfer_pieces(engine, pages=range(2, 4))
        assert [(p.address - region.data_ptr(), p.nbytes) for p in pieces] == [(9 * slot, slot), (13 * slot, slot)]
    held_by_nobody(fake, engine)
