"""PinnedPool's drivers against FakeRuntime: every failure, cancellation and exit path."""

from __future__ import annotations

import _thread
import ctypes
import gc
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

import pinpool
from pinpool import layouts
from pinpool._host import HostMapping
from pinpool._pin import guard_state
from pinpool.testing import FakeRuntime

from .. import preloaded
from ..conftest import cancel_at_first, each_driver, lifecycle_of, pin_and_run

MiB = 1 << 20
GiB = 1 << 30

pytestmark = pytest.mark.anyio


class CtrlC:
    """Ctrl-C for the main thread from inside the fake's calls: ``at`` holds ``(op, n)`` pairs,
    and the n-th ``op`` call (1-based) interrupts the main thread with ``send`` (a real SIGINT by
    default) before it runs. The call then waits until the main thread has taken the interrupt,
    so it lands in that call's step however loaded the machine is: a timer's fixed delay did not
    (under parallel workers a late one fired after the pool was done, outside pytest.raises, and
    ended the whole run). ``taken`` counts the interrupts the main thread's handler took; one that
    lands in pinpool's own code is deferred by it (``pinpool._pin.sigint``) and counts as landed then."""

    def __init__(self, fake: FakeRuntime, at: set[tuple[str, int]], send: Callable[[], None] | None = None) -> None:
        main = threading.main_thread().ident
        assert main is not None
        self.fake, self.at, self.taken = fake, at, 0
        self.send = send or (lambda: signal.pthread_kill(main, signal.SIGINT))
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()
        self._landed = threading.Event()

    def _handler(self, signum: int, frame: object) -> None:
        self.taken += 1
        self._landed.set()
        raise KeyboardInterrupt

    def _before_call(self, op: str, ptr: int, nbytes: int) -> None:
        with self._lock:
            n = self._calls[op] = self._calls.get(op, 0) + 1
        if (op, n) in self.at:
            self._landed.clear()
            deferred = guard_state()[1]
            self.send()
            if threading.current_thread() is not threading.main_thread():
                deadline = time.monotonic() + 30
                while not self._landed.wait(0.001) and guard_state()[1] <= deferred:
                    assert time.monotonic() < deadline, f"the main thread did not take the Ctrl-C sent from {op} #{n}"

    def __enter__(self) -> CtrlC:
        self._old = signal.signal(signal.SIGINT, self._handler)
        self.fake.before_call = self._before_call
        return self

    def __exit__(self, *exc: object) -> None:
        self.fake.before_call = None
        signal.signal(signal.SIGINT, self._old)


def assert_rolled_back(fake: FakeRuntime, failed_calls: set[int] = frozenset(), *, in_order: bool = False) -> None:  # type: ignore[assignment]
    """Nothing registered; every successful register base unregistered exactly once.

    ``in_order``: and in reverse offset order (true with one unpin worker; several claim in
    that order but their calls overlap).
    """
    assert fake.registered == {}
    succeeded = [ptr for i, (ptr, _n) in enumerate(fake.register_calls, 1) if i not in failed_calls]
    assert sorted(fake.unregister_calls) == sorted(succeeded)
    assert len(set(fake.unregister_calls)) == len(fake.unregister_calls)
    if in_order:
        assert fake.unregister_calls == sorted(fake.unregister_calls, reverse=True)


def test_dir_of_the_package_is_its_public_names() -> None:
    assert dir(pinpool) == sorted(pinpool.__all__)


@each_driver
async def test_pins_every_chunk_and_unpins_on_exit(fake: FakeRuntime, mode: str) -> None:
    pool = pinpool.PinnedPool(
        size=64 * MiB, chunk_bytes=8 * MiB, runtime=fake, register_workers=3, unpin_workers=1, name="t"
    )
    seen: dict[str, object] = {}

    def body(p: pinpool.PinnedPool) -> None:
        seen["registered"] = dict(fake.registered)
        seen["base"] = p.data_ptr
        seen["pinned"] = p.pinned_bytes
        assert p.tensor.shape == (64 * MiB,)
        assert p.tensor.data_ptr() == p.data_ptr

    await pin_and_run(pool, mode, body)
    base = seen["base"]
    assert isinstance(base, int)
    assert seen["registered"] == {base + c.offset: c.nbytes for c in pool.plan.chunks}
    assert seen["pinned"] == 64 * MiB
    assert len(pool.plan.chunks) == 8 and pool.plan.chunk_bytes == 8 * MiB and pool.plan.register_workers == 3
    assert_rolled_back(fake, in_order=True)
    assert pool.pinned_bytes == 0


async def test_reference_plan_900_900_700_mib(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(granularity_bytes=300 * MiB), size=2500 * MiB, chunk_bytes=GiB, runtime=fake
    )
    assert [c.nbytes for c in pool.plan.chunks] == [900 * MiB, 900 * MiB, 700 * MiB]
    assert all(c.offset % (300 * MiB) == 0 for c in pool.plan.chunks)
    assert pool.plan.granularity == 300 * MiB and pool.plan.chunk_bytes == 900 * MiB
    async with pool:
        assert sorted(fake.registered.values()) == [700 * MiB, 900 * MiB, 900 * MiB]
    assert fake.registered == {}


def test_teardown_order_and_second_exit_is_a_no_op(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=2 * GiB + 17, chunk_bytes=GiB, runtime=fake, register_workers=1)
    with pool as p:
        base = p.data_ptr
    assert fake.unregister_calls == [base + 2 * GiB, base + GiB, base]
    pool.__exit__(None, None, None)  # a closed pool is left alone (as close() twice is)
    pool.close()
    assert fake.unregister_calls == [base + 2 * GiB, base + GiB, base]


def test_second_registration_fails_reference_vector() -> None:
    fake = FakeRuntime(fail_register_on=2)
    # The reference does not retry; pinpool would retry a code-2 failure as halves (test_retry.py).
    pool = pinpool.PinnedPool(size=2 * GiB, chunk_bytes=GiB, runtime=fake, register_workers=1, max_retries=0)
    with pytest.raises(pinpool.PinError) as info, pool:
        pytest.fail("body must not run")
    error = info.value
    assert "offset=1073741824" in str(error)
    assert error.offset == GiB and error.nbytes == GiB and error.code == 2
    assert error.reason == "cudaErrorMemoryAllocation" and error.phase == "register"
    assert error.leaked == ()
    assert isinstance(error.__cause__, pinpool.RuntimeCallError)
    first_base = fake.register_calls[0][0]
    assert fake.unregister_calls == [first_base]
    assert fake.registered == {}


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("fail_at", range(1, 9))
@each_driver
async def test_rollback_at_every_chunk_index(mode: str, fail_at: int, workers: int) -> None:
    fake = FakeRuntime(fail_register_on=fail_at, register_delay=0.001)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=workers, max_retries=0)
    with pytest.raises(pinpool.PinError) as info:
        await pin_and_run(pool, mode, lambda p: pytest.fail("body must not run after a failure"))
    base = min(ptr for ptr, _ in fake.register_calls)  # chunk 0 is always claimed first
    failed_ptr = fake.register_calls[fail_at - 1][0]
    assert info.value.offset == failed_ptr - base
    assert [f.chunk.offset for f in info.value.failures] == [failed_ptr - base]
    assert_rolled_back(fake, {fail_at})
    if workers == 1:
        assert len(fake.register_calls) == fail_at  # stopped handing out chunks at the failure
    with pytest.raises(pinpool.PoolStateError):
        _ = pool.tensor


async def test_several_failures_are_all_reported() -> None:
    fake = FakeRuntime(fail_register_on={1, 2}, register_delay=0.05)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=2, max_retries=0)
    with pytest.raises(pinpool.PinError) as info:
        async with pool:
            pytest.fail("body must not run")
    assert len(info.value.failures) == 2
    assert info.value.offset == 0  # the lowest failed offset
    assert "2 calls failed, in 2 chunk(s)" in str(info.value)
    assert_rolled_back(fake, {1, 2})


async def test_rollback_that_cannot_unregister_reports_leaked() -> None:
    fake = FakeRuntime(fail_register_on=3, fail_unregister_on=1)
    # One unpin worker: with two, both chunks are unregistered at once and which call is the
    # first (the failing one) is a race between them.
    pool = pinpool.PinnedPool(
        size=4 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1, unpin_workers=1, max_retries=0
    )
    with pytest.raises(pinpool.PinError) as info:
        async with pool:
            pytest.fail("body must not run")
    # rollback goes in reverse: chunk 1 (offset 1 MiB) first, and that one fails
    assert info.value.leaked == (pinpool.Chunk(MiB, MiB),)
    assert "may still be pinned" in str(info.value)
    assert len(fake.registered) == 1


@each_driver
async def test_unregister_failure_at_exit_raises_unpin_error(mode: str) -> None:
    fake = FakeRuntime(fail_unregister_on=2)
    # one unpin worker: unpinning goes in reverse, so the second call is chunk 2's
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1, unpin_workers=1)
    with pytest.raises(pinpool.UnpinError) as info:
        await pin_and_run(pool, mode)
    assert info.value.leaked == (pinpool.Chunk(2 * MiB, MiB),)
    assert [f.phase for f in info.value.failures] == ["unregister"]
    assert len(fake.unregister_calls) == 4  # the failure did not stop the others
    assert len(fake.registered) == 1


@each_driver
async def test_body_exception_propagates_unchanged_with_unpin_failure_as_note(mode: str) -> None:
    fake = FakeRuntime(fail_unregister_on=1)
    pool = pinpool.PinnedPool(size=2 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1)
    boom = LookupError("body failed")

    def body(p: pinpool.PinnedPool) -> None:
        raise boom

    with pytest.raises(LookupError) as info:
        await pin_and_run(pool, mode, body)
    assert info.value is boom
    assert any("failed to unregister" in note for note in getattr(boom, "__notes__", []))


@each_driver
async def test_body_exception_unpins_everything(fake: FakeRuntime, mode: str) -> None:
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake)
    boom = KeyError("x")

    def body(p: pinpool.PinnedPool) -> None:
        raise boom

    with pytest.raises(KeyError) as info:
        await pin_and_run(pool, mode, body)
    assert info.value is boom and not getattr(boom, "__notes__", None)
    assert_rolled_back(fake)


async def test_cancelled_before_entry_pins_nothing_and_never_enters(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=2)
    with anyio.CancelScope() as scope:
        scope.cancel()
        async with pool:
            pytest.fail("a cancelled async with must not enter its body")
    assert scope.cancelled_caught
    assert_rolled_back(fake)


async def test_cancellation_while_workers_run_stops_early_and_rolls_back() -> None:
    # Cancelled once the first registration is done, not 0.1 s in: a loaded host had made none by then (0 < 0).
    scope = anyio.CancelScope()
    fake = FakeRuntime(register_delay=0.01, after_call=cancel_at_first("register", scope))
    pool = pinpool.PinnedPool(size=200 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=2)
    with scope:
        async with pool:
            pytest.fail("body must not run")
    assert scope.cancelled_caught
    assert 0 < len(fake.register_calls) < 100  # stopped after the in-flight chunks
    assert_rolled_back(fake)
    with pytest.raises(pinpool.PoolStateError):
        _ = pool.tensor


async def test_cancellation_landing_as_the_last_chunk_finishes_never_enters_body() -> None:
    scope = anyio.CancelScope()
    token = anyio.lowlevel.current_token()  # pinpool's workers are plain threads
    chunks = 4

    class CancelOnLast(FakeRuntime):
        def register(self, ptr: int, nbytes: int) -> None:
            super().register(ptr, nbytes)
            if len(self.register_calls) == chunks:
                anyio.from_thread.run_sync(scope.cancel, token=token)

    fake = CancelOnLast()
    pool = pinpool.PinnedPool(size=chunks * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1)
    with scope:
        async with pool:
            pytest.fail("every chunk registered, but the caller was cancelled: body must not run")
    assert scope.cancelled_caught
    assert len(fake.register_calls) == chunks
    assert_rolled_back(fake)


async def test_cancellation_at_random_moments_leaves_nothing_registered() -> None:
    rng = random.Random(1234)
    for _ in range(25):
        fake = FakeRuntime(register_delay=rng.choice([0.0, 0.0005, 0.002]))
        pool = pinpool.PinnedPool(size=24 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=rng.choice([1, 2, 4]))
        entered_while_cancelled = []
        async with anyio.create_task_group() as tg:
            scope = anyio.CancelScope()

            async def cancel_later(scope: anyio.CancelScope = scope) -> None:
                await anyio.sleep(rng.uniform(0, 0.03))
                scope.cancel()

            tg.start_soon(cancel_later)
            with scope:
                async with pool:
                    entered_while_cancelled.append(scope.cancel_called)
                    await anyio.sleep(0.05)
        assert entered_while_cancelled in ([], [False])
        assert_rolled_back(fake)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_asyncio_task_cancel() -> None:
    import asyncio

    fake = FakeRuntime(register_delay=0.01)
    pool = pinpool.PinnedPool(size=100 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=2)

    async def use() -> None:
        async with pool:
            pytest.fail("body must not run")

    task = asyncio.ensure_future(use())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(fake.register_calls) < 100
    assert_rolled_back(fake)


async def test_cancellation_inside_body_unpins_and_propagates() -> None:
    fake = FakeRuntime(unregister_delay=0.01)
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake)
    with anyio.CancelScope() as scope:
        async with pool:
            scope.cancel()  # inside the body, whatever pinning took (a 50 ms deadline could land during it)
            await anyio.sleep(10)
    assert scope.cancelled_caught
    assert_rolled_back(fake)  # teardown ran to the end although it awaited under cancellation


@pytest.mark.parametrize("how", ["SIGINT", "interrupt_main"])
def test_keyboard_interrupt_in_sync_twin_rolls_back(how: str) -> None:
    fake = FakeRuntime(register_delay=0.01)
    pool = pinpool.PinnedPool(size=100 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=2)
    with CtrlC(fake, {("register", 5)}, None if how == "SIGINT" else _thread.interrupt_main) as ctrl_c:
        with pytest.raises(KeyboardInterrupt), pool:
            pytest.fail("body must not run")
    assert ctrl_c.taken == 1
    assert 0 < len(fake.register_calls) < 100
    assert_rolled_back(fake)


async def test_workers_are_bounded_and_long_lived() -> None:
    idents: set[int] = set()

    class Recording(FakeRuntime):
        def register(self, ptr: int, nbytes: int) -> None:
            idents.add(threading.get_ident())
            super().register(ptr, nbytes)

    fake = Recording(register_delay=0.02)
    pool = pinpool.PinnedPool(size=16 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=4)
    async with pool:
        pass
    assert 2 <= fake.max_concurrent_registers <= 4
    assert len(idents) <= 4


async def test_many_chunks_one_thread_hop_per_worker(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=2000 * 4096, chunk_bytes=4096, runtime=fake, register_workers=2)
    started = time.perf_counter()
    async with pool:
        assert len(fake.registered) == 2000
    # Not a benchmark: a thread hop per chunk (~250 us each) would take far longer than this.
    assert time.perf_counter() - started < 10
    assert_rolled_back(fake)


def test_zero_copy_tensor_is_the_pool_memory(fake: FakeRuntime) -> None:
    with pinpool.PinnedPool(size=3 * 4096, runtime=fake) as pool:
        pool.tensor[5] = 42
        assert ctypes.c_uint8.from_address(pool.data_ptr + 5).value == 42
        ctypes.c_uint8.from_address(pool.data_ptr + 4097).value = 7
        assert int(pool.tensor[4097]) == 7


async def test_state_errors(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=MiB, runtime=fake)
    with pytest.raises(pinpool.PoolStateError, match="enter it first"):
        _ = pool.tensor
    with pytest.raises(pinpool.PoolStateError, match="only after it was entered"):
        await pool.__aexit__(None, None, None)
    async with pool:
        with pytest.raises(pinpool.PoolStateError, match="entered once"):
            await pool.__aenter__()
        with pytest.raises(pinpool.PoolStateError, match="entered once"):
            pool.__enter__()
        assert len(fake.registered) == 1
    with pytest.raises(pinpool.PoolStateError, match="create a new pool"):
        _ = pool.tensor
    with pytest.raises(pinpool.PoolStateError, match="entered once"):
        async with pool:
            pass
    await pool.__aexit__(None, None, None)  # exiting a closed pool again is a no-op
    assert fake.registered == {} and len(fake.register_calls) == 1


def test_tensor_kept_past_exit_stays_valid_memory(fake: FakeRuntime) -> None:
    with pinpool.PinnedPool(size=8 * MiB, runtime=fake) as pool:
        kept = pool.tensor[MiB : 2 * MiB]
        kept.fill_(3)
        memory = lifecycle_of(pool).memory
        assert isinstance(memory, HostMapping)
        unmap = memory._finalizer  # alive until the mapping is unmapped
        del memory
    del pool
    gc.collect()
    assert unmap.alive
    assert int(kept.sum()) == 3 * MiB  # still readable
    kept.fill_(4)  # and writable
    del kept
    gc.collect()
    assert not unmap.alive


def test_populate_and_huge_pages_options(fake: FakeRuntime) -> None:
    with pinpool.PinnedPool(size=8 * MiB, chunk_bytes=2 * MiB, runtime=fake, populate=True, huge_pages=True) as pool:
        assert pool.data_ptr % (2 * MiB) == 0
        assert len(fake.registered) == 4
    assert fake.registered == {}


def test_unclosed_pool_is_unpinned_by_finalizer_with_warning(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, name="forgotten")
    pool.__enter__()
    assert len(fake.registered) == 4
    with pytest.warns(pinpool.UnclosedPoolWarning, match="forgotten"):
        del pool
        gc.collect()
    assert_rolled_back(fake)


def test_pool_alive_at_interpreter_exit_is_unpinned() -> None:
    script = """
import pinpool
from pinpool.testing import FakeRuntime

class Loud(FakeRuntime):
    def unregister(self, ptr):
        super().unregister(ptr)
        print("unregistered", len(self.registered), flush=True)

pool = pinpool.PinnedPool(size=2 << 20, chunk_bytes=1 << 20, runtime=Loud(), register_workers=1, unpin_workers=1)
pool.__enter__()
print("entered", flush=True)
"""
    result = preloaded.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["entered", "unregistered", "1", "unregistered", "0"]
    assert "UnclosedPoolWarning" in result.stderr


def test_forked_child_never_unregisters_parents_chunks(fake: FakeRuntime) -> None:
    with pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1) as pool:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: exit the pool as the parent would, report what it unregistered
            try:
                pool.__exit__(None, None, None)
                os.write(write_end, str(len(fake.unregister_calls)).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        child_unregistered = os.read(read_end, 64).decode()
        os.close(read_end)
        assert os.waitstatus_to_exitcode(status) == 0
        assert child_unregistered == "0"
        assert len(fake.registered) == 4  # the parent's registrations are untouched
    assert_rolled_back(fake)


async def test_pin_seconds_is_measured_even_when_cancelled() -> None:
    fake = FakeRuntime(register_delay=0.01)
    pool = pinpool.PinnedPool(size=50 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1)
    assert pool.stats.pin_seconds == 0.0
    with anyio.move_on_after(0.05):
        async with pool:
            pytest.fail("body must not run")
    assert 0.04 < pool.stats.pin_seconds < 5


def test_finalizer_unpins_even_when_warnings_are_errors(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=2 * MiB, chunk_bytes=MiB, runtime=fake)
    pool.__enter__()
    finalizer = pool._finalizer
    assert finalizer is not None
    with pytest.raises(pinpool.UnclosedPoolWarning):  # filterwarnings=error turns it into an exception
        finalizer()
    assert_rolled_back(fake)


def test_second_interrupt_during_rollback_does_not_skip_it() -> None:
    fake = FakeRuntime(register_delay=0.01, unregister_delay=0.01)
    # The first Ctrl-C lands mid-pinning, the next two in the rollback it starts (one unpin worker).
    pool = pinpool.PinnedPool(size=100 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=2, unpin_workers=1)
    with CtrlC(fake, {("register", 10), ("unregister", 1), ("unregister", 3)}) as ctrl_c:
        with pytest.raises(KeyboardInterrupt), pool:
            pytest.fail("body must not run")
    assert ctrl_c.taken == 1  # the rollback's two were deferred, then merged into the one raised
    assert_rolled_back(fake)
    assert pool.pinned_bytes == 0


def test_interrupt_during_teardown_finishes_teardown_then_propagates() -> None:
    fake = FakeRuntime(unregister_delay=0.02)
    pool = pinpool.PinnedPool(size=10 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1)
    with CtrlC(fake, {("unregister", 3)}) as ctrl_c, pytest.raises(KeyboardInterrupt):
        with pool:
            pass
    assert ctrl_c.taken == 1
    assert_rolled_back(fake)
    assert pool.state is pinpool.PoolState.CLOSED
    pool.__exit__(None, None, None)  # closed: a second exit is a no-op


def test_pinned_bytes_counts_leaked_chunks() -> None:
    fake = FakeRuntime(fail_unregister_on=1)
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1)
    with pytest.raises(pinpool.UnpinError), pool:
        assert pool.pinned_bytes == 4 * MiB
    assert pool.pinned_bytes == MiB  # the chunk whose unregister failed may still be pinned


@pytest.mark.parametrize("populate", [False, True])
def test_memory_is_unmapped_at_exit_when_no_view_is_kept(fake: FakeRuntime, populate: bool) -> None:
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, populate=populate)
    with pool:
        assert lifecycle_of(pool).memory is not None
        unmap = lifecycle_of(pool).memory._finalizer  # type: ignore[attr-defined]
    gc.collect()
    assert not unmap.alive  # the pool object is alive, but nothing of it holds the memory


def test_leaked_chunk_keeps_its_memory_mapped() -> None:
    fake = FakeRuntime(fail_unregister_on=1)
    pool = pinpool.PinnedPool(size=2 * MiB, chunk_bytes=MiB, runtime=fake, register_workers=1)
    with pytest.raises(pinpool.UnpinError), pool:
        assert lifecycle_of(pool).memory is not None
        unmap = lifecycle_of(pool).memory._finalizer  # type: ignore[attr-defined]
    del pool
    gc.collect()
    assert unmap.alive  # freeing memory that may still be registered would be undefined


def test_huge_pages_without_thp_is_a_config_error_in_the_constructor(
    fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinpool._host.libc, "transparent_huge_pages_mode", lambda: "never")
    with pytest.raises(pinpool.ConfigError, match=r"transparent huge pages.*never"):
        pinpool.PinnedPool(size=4 * MiB, runtime=fake, huge_pages=True)
