"""Node pacing wired into PinnedPool: slots while pinning, a byte budget while pinned, and every
interruption rule of the lifecycle while waiting. (The pacing module itself, with real
processes and SIGKILL, is tested in test_node_pacing.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry

from pinpool import NodeBusyError, PinnedPool, PoolState
from pinpool.testing import FakeRuntime

MiB = 1 << 20


def paced(tmp_path: Path, fake: FakeRuntime, **kw: object) -> PinnedPool:
    options: dict[str, object] = {
        "size": 8 * MiB, "chunk_bytes": MiB, "runtime": fake, "registry": None, "populate": False,
        "register_workers": 1, "node_dir": str(tmp_path / "node"),
    }  # fmt: skip
    options.update(kw)
    return PinnedPool(**options)  # type: ignore[arg-type]


def test_one_slot_serialises_pinning_and_frees_it_once_pinned(tmp_path: Path) -> None:
    first_fake, second_fake = FakeRuntime(register_delay=0.02), FakeRuntime()
    first = paced(tmp_path, first_fake, node_slots=1, name="a")
    second = paced(tmp_path, second_fake, node_slots=1, name="b")
    entered_second = threading.Event()
    with first:
        # first has pinned and let its slot go: second pins while first's body still runs
        thread = threading.Thread(target=lambda: (second.__enter__(), entered_second.set()))
        thread.start()
        assert entered_second.wait(5)
        thread.join()
        assert second.state is PoolState.READY
        second.__exit__(None, None, None)
    assert first_fake.registered == {} and second_fake.registered == {}


def test_a_second_pool_waits_for_the_slot_while_the_first_pins(tmp_path: Path) -> None:
    slow = FakeRuntime(register_delay=0.03)
    registry = CollectorRegistry()
    first = paced(tmp_path, slow, node_slots=1, name="slow", background=True)
    second = paced(tmp_path, FakeRuntime(), node_slots=1, name="waits", registry=registry)
    with first:
        first.wait_ready_sync(min_bytes=1, timeout=5)  # its conductor holds the slot now
        started = time.monotonic()
        with second:  # waits for first's slot: first pins 8 x 30 ms
            waited = time.monotonic() - started
            assert len(slow.register_calls) == 8  # first had finished pinning
        first.wait_ready_sync(timeout=5)
    assert waited > 0.1
    count = registry.get_sample_value(
        "pinpool_node_wait_seconds_count", {"pool": "waits", "runtime": "fake", "kind": "slot"}
    )
    assert count == 1
    assert slow.registered == {}


def test_fail_fast_raises_node_busy_with_nothing_pinned(fake: FakeRuntime, tmp_path: Path) -> None:
    first = paced(tmp_path, FakeRuntime(register_delay=0.05), node_slots=1, name="holder", background=True)
    with first:
        first.wait_ready_sync(min_bytes=1, timeout=5)
        busy = paced(tmp_path, fake, node_slots=1, node_wait=False, name="busy")
        with pytest.raises(NodeBusyError, match="slot") as raised:
            with busy:
                pass
        assert raised.value.kind == "slots"
        assert busy.state is PoolState.CLOSED and fake.register_calls == []


def test_the_budget_is_held_while_pinned_and_released_on_exit(tmp_path: Path) -> None:
    budget = 12 * MiB
    first = paced(tmp_path, FakeRuntime(), node_budget=budget, name="first")
    with first:
        over = paced(tmp_path, FakeRuntime(), node_budget=budget, node_wait=False, name="over")
        with pytest.raises(NodeBusyError, match="budget"):
            with over:
                pass
    again = paced(tmp_path, FakeRuntime(), node_budget=budget, node_wait=False, name="again")
    with again:  # first's share went with its exit
        assert again.state is PoolState.READY


def test_a_pool_larger_than_the_whole_budget_is_refused_in_the_constructor(fake: FakeRuntime, tmp_path: Path) -> None:
    from pinpool import ConfigError

    with pytest.raises(ConfigError):
        paced(tmp_path, fake, node_budget=4 * MiB)


@pytest.mark.anyio
async def test_cancelling_a_wait_for_admission_leaves_nothing_held(tmp_path: Path) -> None:
    holder_fake = FakeRuntime(register_delay=0.05)
    holder = paced(tmp_path, holder_fake, node_slots=1, name="holder", background=True)
    waiter_fake = FakeRuntime()
    async with holder:
        await holder.wait_ready(min_bytes=1)
        waiter = paced(tmp_path, waiter_fake, node_slots=1, name="waiter")
        with anyio.move_on_after(0.1) as scope:
            async with waiter:
                pytest.fail("admitted while the only slot was held")
        assert scope.cancelled_caught
        assert waiter.state is PoolState.CLOSED and waiter_fake.register_calls == []
        await holder.wait_ready()
    # The waiter holds no slot: a fail-fast pool is admitted at once now.
    with paced(tmp_path, FakeRuntime(), node_slots=1, node_wait=False, name="after"):
        pass


@pytest.mark.anyio
async def test_a_background_pool_waits_for_admission_behind_its_body(tmp_path: Path) -> None:
    holder = paced(tmp_path, FakeRuntime(register_delay=0.05), node_slots=1, name="holder", background=True)
    queued_fake = FakeRuntime()
    async with holder:
        await holder.wait_ready(min_bytes=1)
        queued = paced(tmp_path, queued_fake, node_slots=1, name="queued", background=True)
        async with queued:  # returns at once although it has no slot yet
            assert queued.state is PoolState.PINNING and queued.pinned_pages == 0
            await queued.wait_ready()  # admitted once holder has pinned
            assert queued_fake.registered
        assert queued_fake.registered == {}
        # Leaving while still waiting for admission: no error, nothing pinned.
        blocked = paced(tmp_path, FakeRuntime(register_delay=0.05), node_slots=1, name="blocker", background=True)
        async with blocked:
            await blocked.wait_ready(min_bytes=1)
            late_fake = FakeRuntime()
            late = paced(tmp_path, late_fake, node_slots=1, name="late", background=True)
            async with late:
                await anyio.sleep(0.02)
                assert late.state is PoolState.PINNING
            assert late.state is PoolState.CLOSED and late_fake.register_calls == []
