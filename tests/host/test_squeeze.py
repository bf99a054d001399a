"""Issue 36 item 4, the fixed half: in a real memory cgroup with a limit, a server holding a fixed
mlocked pool and a neighbour allocating memory in steps; the squeeze OOM-kills the server, the
largest unmovable thing in the cgroup (tests/host/cgroup_squeeze.py is the harness)."""

from __future__ import annotations

import signal

from ..conftest import needs_mlock
from .cgroup_squeeze import FIXED_SERVER, MiB, memory_cgroup, squeeze, start

pytestmark = needs_mlock
POOL = 128 * MiB
HEADROOM = 64 * MiB  # what the cgroup allows beyond the running server


def test_a_fixed_pool_is_oom_killed_when_a_neighbour_grows_in_its_cgroup() -> None:
    with memory_cgroup() as group, start(group, FIXED_SERVER, str(POOL)) as server:
        ready = server.wait_for("ready")
        assert ready is not None, server.stderr()
        assert ready["pinned"] == POOL and ready["locked"] >= POOL
        limit = group.usage() + HEADROOM
        group.set_limit(limit)
        # The neighbour wants twice the room left: only the pinned pool could make it, and it cannot move.
        out = squeeze(group, server, total=2 * HEADROOM)
    assert out.server_code == -signal.SIGKILL  # the server, largest in the cgroup, is killed first
    # Then either the neighbour gets its memory, or, faulting again before the dead server's pinned pages
    # are freed, it is killed too (most runs here: 6 of 8).
    assert (out.oom_kills, out.neighbour_code) in {(1, None), (2, -signal.SIGKILL)}, out
    assert (out.neighbour_bytes == 2 * HEADROOM) is (out.neighbour_code is None), out
    assert limit - HEADROOM < out.peak_usage <= limit  # it was squeezed to the limit, never past it
