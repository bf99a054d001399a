"""A registration the real engine refuses rolls back the whole pool: every other registration with that engine
(and with a second engine), the runtime's pinning; what the engine held before is untouched."""

from __future__ import annotations

import pytest
import torch

import pinpool
from pinpool.registrars import MooncakeRegistrar, NixlRegistrar

from ..conftest import needs_mlock
from .conftest import Buffer, KiB, MiB, MooncakeEngine, NixlAgent, bytes_at, needs_mooncake, needs_nixl

pytestmark = needs_mlock


@needs_mooncake
@needs_nixl
def test_a_refused_registration_rolls_back_every_registrar(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer, nixl_pair: tuple[NixlAgent, NixlAgent]
) -> None:
    """A tensor whose middle the Mooncake engine already holds (someone registered it by hand): pin() with
    both engines fails on Mooncake's ERR_ADDRESS_OVERLAPPED, and afterwards neither engine holds any of the
    tensor's registrations, while the hand-made one still serves its peer."""
    server, reader = mooncake_pair
    engine, agent = server.engine, nixl_pair[0].agent
    mooncake = MooncakeRegistrar(engine, protocol="tcp")
    nixl = NixlRegistrar(agent)
    tensor = torch.full((8 * MiB,), 7, dtype=torch.uint8)
    base = tensor.data_ptr()
    theirs = base + 5 * MiB + 64 * KiB  # inside the pool's sixth registration, not at its start
    assert engine.register_memory(theirs, 64 * KiB) == 0
    try:
        pool = pinpool.pin(tensor, runtime="mlock", chunk_bytes=MiB, registrars=[nixl, mooncake], registry=None)
        with pytest.raises(pinpool.PinError) as info:
            with pool:
                pytest.fail("entered a pool whose registration failed")
        error = info.value
        refused = [f for f in error.failures if f.registrar == "mooncake"]
        assert [(f.phase, f.error.code) for f in refused] == [("register", -7)], error.failures
        assert refused[0].chunk.offset <= theirs - base < refused[0].chunk.offset + refused[0].chunk.nbytes
        assert "ERR_ADDRESS_OVERLAPPED" in str(error) and not error.leaked
        assert pool.state is pinpool.PoolState.CLOSED
        plans = {plan.name: plan for plan in pool.plan.transfers}
        # Mooncake holds none of the pool's registrations (each base: not registered) ...
        for run in plans["mooncake"].registrations:
            assert engine.unregister_memory(base + run.offset) == -3, run
        # ... nor does NIXL (each one's descriptor: not found) ...
        for run in plans["nixl"].registrations:
            descs = agent.get_reg_descs([(base + run.offset, run.nbytes, 0, "")], "DRAM")
            with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
                agent.deregister_memory(descs)
        # ... and what the engine held before the pool still serves.
        assert reader.read(server.segment, reader_buffer.address, theirs, 64 * KiB) == 0
        assert reader_buffer[: 64 * KiB] == bytes_at(theirs, 64 * KiB) == bytes([7]) * 64 * KiB
    finally:
        assert engine.unregister_memory(theirs) == 0
    # Those were the addresses to ask about (an address never registered answers -3 too): once the hand-made
    # registration is gone, the same tensor pins, with registrations exactly there.
    with pinpool.pin(tensor, runtime="mlock", chunk_bytes=MiB, registrars=[nixl, mooncake], registry=None) as again:
        for name, registrar in (("mooncake", mooncake), ("nixl", nixl)):
            held = [(r.address, r.nbytes) for r in again.transfer_registrations(registrar)]
            assert held == [(base + run.offset, run.nbytes) for run in plans[name].registrations]
