"""The bug issue 35 starts from, reproduced with the real engines: one buffer registered by hand as two halves,
a transfer that straddles the halves' boundary is refused (Mooncake: rc -1, "not within any registered
buffer"; NIXL: nixlNotFoundError), and the same bytes cut at the boundary into two pieces arrive whole."""

from __future__ import annotations

from .conftest import Buffer, KiB, MiB, MooncakeEngine, NixlAgent, needs_mooncake, needs_nixl

SIZE, SPAN = 8 * MiB, 128 * KiB
HALF = SIZE // 2
START = HALF - SPAN // 2  # the read's first byte: half of it in each registration


@needs_mooncake
def test_mooncake_a_read_across_two_registrations_fails_and_its_pieces_succeed(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    server, reader = mooncake_pair
    buf = Buffer(SIZE)
    buf.fill(seed=21)
    assert server.engine.register_memory(buf.address, HALF) == 0
    assert server.engine.register_memory(buf.address + HALF, HALF) == 0
    try:
        local = reader_buffer.address
        assert reader.read(server.segment, local, buf.address + START, SPAN) == -1
        assert reader_buffer[:SPAN] == bytes(SPAN)  # nothing arrived
        # inside one half, the same engine pair moves bytes: the refusal is the straddle's alone
        assert reader.read(server.segment, local, buf.address + START, SPAN // 2) == 0
        assert reader.read(server.segment, local + SPAN // 2, buf.address + HALF, SPAN // 2) == 0
        assert reader_buffer[:SPAN] == buf[START : START + SPAN]
    finally:
        assert server.engine.unregister_memory(buf.address) == 0
        assert server.engine.unregister_memory(buf.address + HALF) == 0


@needs_nixl
def test_nixl_a_read_across_two_registrations_fails_and_its_pieces_succeed(
    nixl_pair: tuple[NixlAgent, NixlAgent], nixl_reader_buffer: Buffer
) -> None:
    server, reader = nixl_pair
    buf = Buffer(SIZE)
    buf.fill(seed=22)
    halves = [server.agent.register_memory([(buf.address + at, HALF, 0, "")], "DRAM") for at in (0, HALF)]
    try:
        peer = reader.learn(server.agent.get_agent_metadata(), server.name)
        local = nixl_reader_buffer.address
        assert reader.transfer("READ", peer, local, buf.address + START, SPAN) == "nixlNotFoundError"
        assert nixl_reader_buffer[:SPAN] == bytes(SPAN)
        # one request of two descriptors, cut at the boundary
        pieces = [(local, buf.address + START, SPAN // 2), (local + SPAN // 2, buf.address + HALF, SPAN // 2)]
        assert reader.transfers("READ", peer, pieces) == "DONE"
        assert nixl_reader_buffer[:SPAN] == buf[START : START + SPAN]
    finally:
        for handle in halves:
            server.agent.deregister_memory(handle)
