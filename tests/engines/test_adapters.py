"""MooncakeRegistrar and NixlRegistrar against the real engines, two in this process on 127.0.0.1: what they
register a peer reads and writes byte for byte, what they unregister it no longer can, and their error
answers are the engines' own (not-registered codes, refused registrations)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import pinpool
from pinpool.registrars import MooncakeRegistrar, NixlRegistrar, RegistrarLimits, TransferRegistrar, limits_of

from .conftest import (
    Buffer,
    MiB,
    MooncakeEngine,
    NixlAgent,
    bytes_at,
    needs_mooncake,
    needs_nixl,
    nixl_agent,
    pattern,
)

# -- Mooncake ------------------------------------------------------------------------------------------------


@needs_mooncake
def test_mooncake_registers_what_a_peer_reads_and_writes(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    server, reader = mooncake_pair
    registrar = MooncakeRegistrar(server.engine, protocol="tcp")
    assert isinstance(registrar, TransferRegistrar) and limits_of(registrar) is registrar.limits
    buf = Buffer(8 * MiB)
    buf.fill(seed=1)
    assert registrar.register(buf.address, buf.nbytes) is None
    try:
        assert reader.read(server.segment, reader_buffer.address, buf.address + 3 * MiB, 2 * MiB) == 0
        assert reader_buffer[: 2 * MiB] == buf[3 * MiB : 5 * MiB]
        written = pattern(MiB, seed=9)
        reader_buffer.map[: len(written)] = written
        assert reader.write(server.segment, reader_buffer.address, buf.address + 7 * MiB, MiB) == 0
        assert buf[7 * MiB :] == written
    finally:
        registrar.unregister(buf.address, buf.nbytes, None)
    # Unregistered: the serving engine refuses the peer (its rc, not a crash or stale bytes).
    assert reader.read(server.segment, reader_buffer.address, buf.address, 4096) == -1


@needs_mooncake
def test_mooncake_not_registered_code_is_the_engines_answer(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine],
) -> None:
    registrar = MooncakeRegistrar(mooncake_pair[0].engine, protocol="tcp")
    buf = Buffer(MiB)
    with pytest.raises(pinpool.RuntimeCallError) as info:
        registrar.unregister(buf.address, buf.nbytes, None)
    error = info.value
    assert (error.op, error.reason) == ("unregister", "MooncakeError")
    assert error.code in registrar.limits.not_registered_codes == frozenset({-3})
    assert "ERR_ADDRESS_NOT_REGISTERED" in str(error)
    # and after a real registration, a second unregister answers the same
    registrar.register(buf.address, buf.nbytes)
    registrar.unregister(buf.address, buf.nbytes, None)
    with pytest.raises(pinpool.RuntimeCallError) as again:
        registrar.unregister(buf.address, buf.nbytes, None)
    assert again.value.code == -3


@needs_mooncake
def test_mooncake_refused_registrations_raise_with_the_engines_code(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    server, reader = mooncake_pair
    registrar = MooncakeRegistrar(server.engine, protocol="tcp")
    buf = Buffer(4 * MiB)
    buf.fill(seed=2)
    with pytest.raises(pinpool.RuntimeCallError) as empty:
        registrar.register(buf.address, 0)
    assert (empty.value.op, empty.value.code, empty.value.reason) == ("register", -1, "MooncakeError")
    assert "ERR_INVALID_ARGUMENT" in empty.value.message
    registrar.register(buf.address, 2 * MiB)
    try:
        # Overlapping a registration the engine holds (one made by hand, another pool's): refused, and the
        # existing registration still serves.
        with pytest.raises(pinpool.RuntimeCallError) as overlap:
            registrar.register(buf.address + MiB, 2 * MiB)
        assert overlap.value.code == -7 and "ERR_ADDRESS_OVERLAPPED" in overlap.value.message
        assert "unregister the other one first" in overlap.value.message
        assert reader.read(server.segment, reader_buffer.address, buf.address, 2 * MiB) == 0
        assert reader_buffer[: 2 * MiB] == buf[: 2 * MiB]
        # the refused range's far end was not registered either
        assert reader.read(server.segment, reader_buffer.address, buf.address + 2 * MiB, 4096) == -1
    finally:
        registrar.unregister(buf.address, 2 * MiB, None)


@needs_mooncake
def test_mooncake_registers_from_many_threads(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    """limits.parallel is True: pinpool's workers call it at once, and every range lands."""
    server, reader = mooncake_pair
    registrar = MooncakeRegistrar(server.engine, protocol="tcp")
    assert registrar.limits.parallel
    buf = Buffer(16 * MiB)
    buf.fill(seed=3)
    pieces = [(buf.address + i * MiB, MiB) for i in range(16)]
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(mine: list[tuple[int, int]]) -> None:
        start.wait()
        try:
            for ptr, nbytes in mine:
                registrar.register(ptr, nbytes)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(pieces[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not errors
        for ptr, nbytes in pieces:
            assert reader.read(server.segment, reader_buffer.address, ptr, nbytes) == 0
            assert reader_buffer[:nbytes] == bytes_at(ptr, nbytes)
    finally:
        for ptr, nbytes in pieces:
            registrar.unregister(ptr, nbytes, None)


@needs_mooncake
def test_mooncake_declares_what_its_transport_does(mooncake_pair: tuple[MooncakeEngine, MooncakeEngine]) -> None:
    engine = mooncake_pair[0].engine
    tcp = MooncakeRegistrar(engine, protocol="tcp", max_bytes=64 * MiB, preferred_bytes=32 * MiB)
    assert tcp.limits == RegistrarLimits(
        max_bytes=64 * MiB, preferred_bytes=32 * MiB, pins_pages=False, faults_pages=False,
        not_registered_codes=frozenset({-3}), parallel=True,
    )  # fmt: skip
    rdma = MooncakeRegistrar(engine, protocol="rdma", name="mc-rdma", page_table_entries=22_000_000)
    assert rdma.limits.pins_pages and rdma.limits.faults_pages and rdma.limits.page_table_entries == 22_000_000
    assert rdma.name == "mc-rdma" and "mc-rdma" in repr(rdma)
    assert MooncakeRegistrar(engine, protocol="nvmeof", pins_pages=False).limits.pins_pages is False
    with pytest.raises(pinpool.ConfigError, match=r"protocol='nvmeof'.*give pins_pages=True"):
        MooncakeRegistrar(engine, protocol="nvmeof")
    with pytest.raises(pinpool.ConfigError, match=r"pins_pages='yes'"):
        MooncakeRegistrar(engine, protocol="tcp", pins_pages="yes")  # type: ignore[arg-type]
    with pytest.raises(pinpool.ConfigError, match=r"has no register_memory\(\).*TransferEngine"):
        MooncakeRegistrar(object(), protocol="tcp")
    with pytest.raises(pinpool.ConfigError, match="preferred_bytes"):
        limits_of(MooncakeRegistrar(engine, protocol="tcp", max_bytes=MiB, preferred_bytes=2 * MiB))


class _Answers:
    """Not an engine: answers register_memory with whatever it is given. Only here, for the answers
    Mooncake's source never returns (a positive or non-int rc), which no real engine can be made to give."""

    def __init__(self, answer: object) -> None:
        self.answer = answer

    def register_memory(self, ptr: int, nbytes: int) -> object:
        return self.answer

    def unregister_memory(self, ptr: int) -> object:
        return self.answer


@pytest.mark.parametrize("answer", [1, "0", None, True])
def test_mooncake_an_undocumented_answer_is_not_taken_for_nothing_done(answer: object) -> None:
    registrar = MooncakeRegistrar(_Answers(answer), protocol="tcp")
    with pytest.raises(RuntimeError) as info:
        registrar.register(0x1000, 4096)
    # not a RuntimeCallError: pinpool must assume it may have registered, and undo it
    assert not isinstance(info.value, pinpool.RuntimeCallError)
    assert "neither 0 nor a negative Mooncake error code" in str(info.value)
    with pytest.raises(pinpool.RuntimeCallError, match=r"unregister_memory returned|Mooncake code 1"):
        registrar.unregister(0x1000, 4096, None)


def test_the_face_loads_no_engine() -> None:
    """`import pinpool.registrars` (and naming the adapters) loads neither engine: no libibverbs, no torch
    from NIXL, for a server that uses neither."""
    code = (
        "import sys, pinpool.registrars as r; r.MooncakeRegistrar; r.NixlRegistrar; "
        "from pinpool.registrars import *; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mooncake', 'nixl_cu12', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert pinpool.registrars.MooncakeRegistrar.__module__ == "pinpool.registrars"  # type: ignore[attr-defined]


# -- NIXL ----------------------------------------------------------------------------------------------------


@needs_nixl
def test_nixl_registers_what_a_peer_reads_and_writes(
    nixl_pair: tuple[NixlAgent, NixlAgent], nixl_reader_buffer: Buffer
) -> None:
    server, reader = nixl_pair
    registrar = NixlRegistrar(server.agent)
    assert isinstance(registrar, TransferRegistrar) and limits_of(registrar) is registrar.limits
    buf = Buffer(8 * MiB)
    buf.fill(seed=4)
    handle = registrar.register(buf.address, buf.nbytes)
    assert handle is not None
    try:
        peer = reader.learn(server.agent.get_agent_metadata(), server.name)
        assert reader.transfer("READ", peer, nixl_reader_buffer.address, buf.address + 5 * MiB, 3 * MiB) == "DONE"
        assert nixl_reader_buffer[: 3 * MiB] == buf[5 * MiB :]
        written = pattern(MiB, seed=10)
        nixl_reader_buffer.map[: len(written)] = written
        assert reader.transfer("WRITE", peer, nixl_reader_buffer.address, buf.address, MiB) == "DONE"
        assert buf[:MiB] == written
    finally:
        registrar.unregister(buf.address, buf.nbytes, handle)
    # Unregistered: a peer that learns the agent's metadata now cannot address those bytes.
    peer = reader.learn(server.agent.get_agent_metadata(), server.name)
    assert reader.transfer("READ", peer, nixl_reader_buffer.address, buf.address, 4096) == "nixlNotFoundError"


@needs_nixl
def test_nixl_not_registered_code_is_the_agents_answer(nixl_pair: tuple[NixlAgent, NixlAgent]) -> None:
    registrar = NixlRegistrar(nixl_pair[0].agent)
    buf = Buffer(MiB)
    with pytest.raises(pinpool.RuntimeCallError) as info:
        registrar.unregister(buf.address, buf.nbytes, None)
    error = info.value
    assert (error.op, error.code, error.reason) == ("unregister", -4, "nixlNotFoundError")
    assert error.code in registrar.limits.not_registered_codes
    # No handle (a register pinpool undoes after it raised): the descriptor rebuilt from (ptr, nbytes) finds it.
    registrar.register(buf.address, buf.nbytes)
    registrar.unregister(buf.address, buf.nbytes, None)
    with pytest.raises(pinpool.RuntimeCallError) as again:
        registrar.unregister(buf.address, buf.nbytes, None)
    assert again.value.code == -4


@needs_nixl
@pytest.mark.parametrize(("ptr", "mem_type"), [(0, "DRAM"), (None, "VRAM")], ids=["null-pointer", "host-as-vram"])
def test_nixl_refused_registrations_raise_with_the_agents_code(
    nixl_pair: tuple[NixlAgent, NixlAgent], ptr: int | None, mem_type: str
) -> None:
    """UCX refuses a NULL address (ucp_mem_map: invalid parameter) and host memory declared VRAM (no CUDA
    in this UCX): NIXL answers NIXL_ERR_BACKEND, after every backend let go, so nothing was registered.
    (The VRAM refusal runs on an agent of its own: NIXL 1.5.1 keeps an empty VRAM section after it, and
    peers then fail to load that agent's metadata, NIXL_ERR_NOT_FOUND.)"""
    agent = nixl_pair[0].agent if mem_type == "DRAM" else nixl_agent("vram").agent
    registrar = NixlRegistrar(agent, mem_type=mem_type)
    buf = Buffer(MiB)
    address = buf.address if ptr is None else ptr
    with pytest.raises(pinpool.RuntimeCallError) as info:
        registrar.register(address, buf.nbytes)
    assert (info.value.op, info.value.code, info.value.reason) == ("register", -3, "nixlBackendError")
    assert "every backend refused" in info.value.message
    with pytest.raises(pinpool.RuntimeCallError) as nothing:  # and the agent holds nothing there
        registrar.unregister(address, buf.nbytes, None)
    assert nothing.value.code == -4


@needs_nixl
def test_nixl_declares_its_limits_and_checks_its_arguments(nixl_pair: tuple[NixlAgent, NixlAgent]) -> None:
    agent = nixl_pair[0].agent
    registrar = NixlRegistrar(agent, name="nixl-ucx", backends=["UCX"], max_bytes=64 * MiB, pins_pages=True)
    assert registrar.limits == RegistrarLimits(
        max_bytes=64 * MiB, pins_pages=True, faults_pages=True, not_registered_codes=frozenset({-4}), parallel=False
    )
    assert "nixl-ucx" in repr(registrar) and agent.name in repr(registrar)
    with pytest.raises(pinpool.ConfigError, match=r"mem_type='HBM'.*'DRAM'"):
        NixlRegistrar(agent, mem_type="HBM")
    with pytest.raises(pinpool.ConfigError, match=r"no backend \['GDS'\]"):
        NixlRegistrar(agent, backends=["GDS"])
    with pytest.raises(pinpool.ConfigError, match="list of backend names"):
        NixlRegistrar(agent, backends="UCX")
    with pytest.raises(pinpool.ConfigError, match="dev_id=-1"):
        NixlRegistrar(agent, dev_id=-1)
    with pytest.raises(pinpool.ConfigError, match=r"has no register_memory\(\).*nixl_agent"):
        NixlRegistrar(object())


@needs_nixl
def test_nixl_registers_from_many_threads(nixl_pair: tuple[NixlAgent, NixlAgent], nixl_reader_buffer: Buffer) -> None:
    """The agent has no lock of its own (sync mode NONE without a listen thread): the adapter's keeps
    concurrent calls from pinpool's workers safe, and every range lands."""
    server, reader = nixl_pair
    registrar = NixlRegistrar(server.agent)
    buf = Buffer(16 * MiB)
    buf.fill(seed=5)
    pieces = [(buf.address + i * MiB, MiB) for i in range(16)]
    handles: dict[int, object] = {}
    start = threading.Barrier(8)

    def work(mine: list[tuple[int, int]]) -> None:
        start.wait()
        for ptr, nbytes in mine:
            handles[ptr] = registrar.register(ptr, nbytes)

    threads = [threading.Thread(target=work, args=(pieces[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert sorted(handles) == [ptr for ptr, _ in pieces]
        peer = reader.learn(server.agent.get_agent_metadata(), server.name)
        for ptr, nbytes in pieces:
            assert reader.transfer("READ", peer, nixl_reader_buffer.address, ptr, nbytes) == "DONE"
            assert nixl_reader_buffer[:nbytes] == bytes_at(ptr, nbytes)
    finally:
        for ptr, nbytes in pieces:
            if ptr in handles:
                registrar.unregister(ptr, nbytes, handles[ptr])


def test_an_engine_that_cannot_load_skips_with_the_import_error() -> None:
    """Where an engine cannot load (no libibverbs.so.1, not installed), its tests skip and say why, in the
    loader's words; shown by hiding both engines from a fresh interpreter."""
    code = (
        "import sys; sys.modules['mooncake.engine'] = None; sys.modules['nixl_cu12._api'] = None\n"
        "from tests.engines import conftest as c\n"
        "for mark in (c.needs_mooncake, c.needs_nixl): print(mark.kwargs['reason'], mark.args)"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.splitlines() == [
        "mooncake.engine cannot load here: import of mooncake.engine halted; None in sys.modules (True,)",
        "nixl_cu12._api cannot load here: import of nixl_cu12._api halted; None in sys.modules (True,)",
    ]
