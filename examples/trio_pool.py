"""The same pool under trio: pinning runs on worker threads while trio keeps scheduling.

    python examples/trio_pool.py                                  # 1 GiB, the best runtime here
    python examples/trio_pool.py --size 256MiB --runtime mlock

pinpool's async driver is built on anyio, so ``async with PinnedPool(...)`` is the same code
under trio and asyncio. This example starts a heartbeat task next to the pinning to show the
event loop is never blocked, and puts a deadline on pinning with ``trio.move_on_after``: if it
fires while the pool pins, pinpool rolls back what it registered and the body never runs.
Needs ``pip install trio``.
"""

from __future__ import annotations

import argparse

import trio

import pinpool

MiB = 1 << 20


def vm_locked_bytes() -> int:
    """What the kernel says this process has locked (VmLck): mlock shows here, CUDA pinning does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


async def heartbeat(beats: list[float]) -> None:
    """Tick every 5 ms: proof that trio keeps running other tasks while the pool pins."""
    while True:
        beats.append(trio.current_time())
        await trio.sleep(0.005)


async def main(size: str, runtime: str, deadline_s: float) -> None:
    before = vm_locked_bytes()
    pool = pinpool.PinnedPool(size=size, runtime=runtime, chunk_bytes="64MiB", name="trio-pool")
    beats: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat, beats)
        with trio.move_on_after(deadline_s) as deadline:  # give up cleanly on a host that pins too slowly
            async with pool:
                beats_while_pinning = len(beats)
                pinned = vm_locked_bytes()
                print(
                    f"pinned: {pool.pinned_bytes} bytes ({pool.pinned_bytes / MiB:.0f} MiB) in {len(pool.plan.chunks)} "
                    f"chunk(s) with runtime {pool.runtime.name!r} in {pool.stats.pin_seconds:.3f} s"
                )
                print(f"trio:   {beats_while_pinning} heartbeat(s) ran while the pool was pinning")
                pool.tensor[::4096] = 1  # one byte per OS page
                # The body is ordinary trio code: heavy work on the pool goes to a thread as usual.
                touched = await trio.to_thread.run_sync(lambda: int(pool.tensor[::4096].sum()))
                print(f"wrote:  {touched} bytes, one per OS page, summed on a trio worker thread")
        nursery.cancel_scope.cancel()  # stop the heartbeat
    after = vm_locked_bytes()
    if deadline.cancelled_caught:
        print(f"deadline: pinning took longer than {deadline_s} s; everything was rolled back")
        print(f"VmLck:  before={before} after={after} (bytes)")
        return
    print(f"unpinned in {pool.stats.unpin_seconds:.3f} s; pool.pinned_bytes is now {pool.pinned_bytes}")
    print(f"VmLck:  before={before} pinned={pinned} after={after} (bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Pin a pool under trio.")
    parser.add_argument("--size", default="1GiB", help="pool size, e.g. 256MiB or 64GiB (default: 1GiB)")
    parser.add_argument("--runtime", default="auto", help="auto, cuda, rocm or mlock (default: auto)")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds pinning may take (default: 120)")
    args = parser.parse_args()
    trio.run(main, args.size, args.runtime, args.deadline)
