"""The NIXL plane (UCX on loopback): its engine and reader in this process, then a receiver with
``data_plane = "nixl"`` fed by fake senders that register their pools with agents of their own
(the hostile suite's fakes): byte-exact refs, the range check before any read, NIXL's refusal of
memory the sender never registered as ``transport_error``, the abort barrier, and metadata NIXL
refuses leaving the registration on today's plane. The suites marked ``planes`` run over NIXL
too (conftest.py)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from transferd.layout import layout_difference
from transferd.pool import Pool
from transferd.protocol.room import RoomState
from transferd.transport.planes.nixl import NixlEngine
from transferd.transport.planes.reads import Job, Reader

from .harness import Cluster, fill_random
from .test_hostile import (
    AUX,
    FAKE_LAYOUT,
    KV,
    REAL_GROUP,
    Env,
    Fake,
    _data_refs,
    _kv0,
    assert_refused_once,
    assert_serves,
    open_room,
    register_header,
)

ROW = 16 << 10
ROWS = 4096
_names = itertools.count()


def _engine(tag: str) -> NixlEngine:
    return NixlEngine(f"test-{tag}-{next(_names)}")


class CountingEngine(NixlEngine):
    """A real agent that also records the requests it was given (entries, and how many ran at once)."""

    def __init__(self) -> None:
        super().__init__(f"test-reader-{next(_names)}")
        self.count_lock = threading.Lock()
        self.running = 0
        self.most_running = 0
        self.batches: list[int] = []

    def read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        with self.count_lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.batches.append(len(lens))
        try:
            return super().read(session, local, remote, lens)
        finally:
            with self.count_lock:
                self.running -= 1


@pytest.fixture
def engines(plane_nixl: str) -> Iterator[tuple[NixlEngine, CountingEngine, np.ndarray, np.ndarray]]:
    src_engine, dst_engine = _engine("src"), CountingEngine()
    src = np.random.default_rng(12).integers(0, 256, (ROWS, ROW), dtype=np.uint8)
    dst = np.zeros_like(src)
    src_engine.register([src])
    dst_engine.register([dst])
    assert dst_engine.add_peer(src_engine.session, src_engine.metadata()) is None
    try:
        yield src_engine, dst_engine, src, dst
    finally:
        dst_engine.close()
        src_engine.close()


def _entries(src: np.ndarray, dst: np.ndarray, rows: range) -> tuple[list[int], list[int], list[int]]:
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    return [d + r * ROW for r in rows], [s + r * ROW for r in rows], [ROW] * len(rows)


def test_4096_reads_go_through_the_reader_byte_exact_in_bounded_requests(engines: Any) -> None:
    src_engine, dst_engine, src, dst = engines
    reader = Reader(dst_engine, batch_entries=512, in_flight=2, staging_row_bytes=64)
    outcomes: list[int | None] = []

    async def run() -> None:
        for start in range(0, ROWS, 256):  # 16 jobs of 256 rows, as 16 data-refs messages would be
            loc, rem, ln = _entries(src, dst, range(start, start + 256))
            reader.submit(Job(1, src_engine.session, loc, rem, ln, lambda: True,
                               lambda rc, row: outcomes.append(rc)))
        await reader.settled(1)

    asyncio.run(run())
    reader.executor.shutdown(wait=True)
    assert outcomes == [0] * 16
    assert np.array_equal(dst, src)  # byte-exact
    assert max(dst_engine.batches) <= 512 and sum(dst_engine.batches) == ROWS
    assert dst_engine.most_running <= 2 and reader.failed == 0


def test_reads_of_a_room_that_ended_are_never_started(engines: Any) -> None:
    src_engine, dst_engine, src, dst = engines
    reader = Reader(dst_engine, batch_entries=64, in_flight=1, staging_row_bytes=64)
    ended = threading.Event()
    outcomes: list[int | None] = []

    async def run() -> None:
        for start in range(0, 1024, 64):
            loc, rem, ln = _entries(src, dst, range(start, start + 64))
            reader.submit(Job(7, src_engine.session, loc, rem, ln, lambda: not ended.is_set(),
                               lambda rc, row: outcomes.append(rc)))
        ended.set()  # the room ends: the first request is already running, the rest wait
        await reader.settled(7)
        assert not reader.busy(7)

    asyncio.run(run())
    reader.executor.shutdown(wait=True)
    assert outcomes[0] == 0 and outcomes[1:] == [None] * 15  # one read ran; fifteen were dropped unread
    assert np.array_equal(dst[:64], src[:64]) and not dst[64:1024].any()
    assert dst_engine.batches == [64]


def test_memory_the_peer_never_registered_is_refused_in_nixls_words(engines: Any) -> None:
    src_engine, dst_engine, src, dst = engines
    loc, rem, ln = _entries(src, dst, range(ROWS - 1, ROWS + 1))  # the last row and one past the end
    rc = dst_engine.read(src_engine.session, loc, rem, ln)
    assert rc < 0 and "NIXL_ERR_NOT_FOUND" in dst_engine.describe(rc), dst_engine.describe(rc)
    assert not dst[ROWS - 1].any()
    rc = dst_engine.read("nobody", loc[:1], rem[:1], ln[:1])
    assert rc < 0 and "is not loaded" in dst_engine.describe(rc)


def test_metadata_is_loaded_once_per_agent_name(engines: Any) -> None:
    src_engine, dst_engine, _, _ = engines
    md = src_engine.metadata()
    other = _engine("other")
    try:
        assert dst_engine.add_peer(src_engine.session, md) is None  # a second user of the same agent
        assert "already loaded here with other metadata" in (dst_engine.add_peer(src_engine.session,
                                                                                 other.metadata()) or "")
        assert "not 'someone'" in (dst_engine.add_peer("someone", other.metadata()) or "")  # the name inside rules
        assert "NIXL_ERR_MISMATCH" in (dst_engine.add_peer("x", b"\x00" * 64) or "")
        assert "this receiver's own" in (dst_engine.add_peer(dst_engine.session, dst_engine.metadata()) or "")
        dst_engine.drop_peer(src_engine.session)  # one of two users left: it stays loaded
        loc, rem, ln = _entries(*engines[2:], range(1))
        assert dst_engine.read(src_engine.session, loc, rem, ln) == 0
        dst_engine.drop_peer(src_engine.session)  # the last: unloaded
        rc = dst_engine.read(src_engine.session, loc, rem, ln)
        assert rc < 0 and "is not loaded" in dst_engine.describe(rc)
        assert dst_engine.add_peer(src_engine.session, md) is None  # and can come back
    finally:
        other.close()


# -- through a receiver ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    from .conftest import NIXL

    if not NIXL:
        pytest.skip("NIXL is not installed (pip install -e '.[nixl]')")  # plane_nixl fails it under CI
    c = Cluster(Path(tmp_path_factory.mktemp("nixl")))
    e: Env | None = None
    try:
        ep, dc, dpool = c.receiver(kv_pages=256, state_slots=64, aux_slots=64, data_plane="nixl")
        assert layout_difference(FAKE_LAYOUT, dpool.layout) is None
        pcs, spools = c.group(REAL_GROUP, 2, [ep], state_slots=64, aux_slots=64)  # today's plane beside it
        for i, p in enumerate(spools):
            fill_random(p, 10 + i)
        e = Env(c, ep, dc, dpool, pcs, spools, c.procs[0])
        yield e
    finally:
        if e is not None:
            for f in e.fakes:
                f.close()
        codes = c.close()
        for engine in e.engines if e is not None else ():
            engine.close()
    bad = {k: v for k, v in codes.items() if v != 0}
    assert not bad, f"daemons did not exit cleanly on SIGTERM: {bad}\n{c.logs()}"


@pytest.fixture
def guard(env: Env, plane_nixl: str) -> Iterator[Env]:
    fill_random(env.dpool, next(env.ids))
    yield env
    for f in env.fakes:
        f.close()
    env.fakes.clear()
    assert_serves(env)


def _nixl_fake(env: Env, *, offset: int = 0, md: bytes | None = None) -> tuple[Fake, str, Pool, NixlEngine]:
    """A fake sender whose pool is registered with an agent of its own and offered to NIXL reads
    (``offset``: addresses off by that much; ``md``: other metadata than the agent's)."""
    name = f"{env.cluster.tag}-fakenixl-{next(env.ids)}"
    spool = Pool.create(name, FAKE_LAYOUT)
    env.cluster.pools.append(spool)
    fill_random(spool, 5)
    group = f"fakenixl-{next(env.ids)}"
    engine = _engine("fake")
    env.engines.append(engine)
    addrs = [a + offset for a in engine.register(spool.rows)]
    fake = env.fake("nixl")
    fake.ctrl(register_header(group, 0, 1) | {"te_session": engine.session, "te_addrs": addrs,
                                              "nixl_md": engine.metadata() if md is None else md})
    reply = fake.next("registered")
    assert reply["ok"] is True and reply["shm"] is False and reply["te"] is (md is None), reply
    return fake, group, spool, engine


def test_scattered_refs_complete_a_room_byte_exact_and_bad_rows_fail_one(guard: Env) -> None:
    env = guard
    fake, group, spool, _ = _nixl_fake(env)
    r = open_room(env, fake, group)
    L = r.layout
    n = len(r.dst)
    src = [11, 4, 5, 9, 2, 7, 8, 1][:n]  # runs of one and two rows, both directions
    for b in L.indices("kv"):
        _data_refs(fake, r.tok, KV, b, 0, src[:n // 2])
        _data_refs(fake, r.tok, KV, b, n // 2, src[n // 2:])
        r.want[b][r.dst] = spool.rows[b][src]
    for b in L.indices("state"):
        _data_refs(fake, r.tok, 1, b, 0, [3])
        r.want[b][r.slots[L.buffers[b].component][0]] = spool.rows[b][3]
    a = L.aux_index
    spool.rows[a][6, :8] = np.frombuffer(np.uint64(r.room).astype("<u8").tobytes(), np.uint8)
    _data_refs(fake, r.tok, AUX, a, 0, [6])
    r.want[a][r.aux] = spool.rows[a][6]
    r.done()
    st = r.wait()
    assert st.state is RoomState.SUCCESS, st
    r.check_pool()
    env.dc.release(r.room, group)
    assert env.dc.stats()["nixl_bytes"] > 0
    # rows past the end of the sender's buffer: refused before any read, nothing written
    r = open_room(env, fake, group)
    before, logs = env.refused(), env.log_lines("index_out_of_range")
    _data_refs(fake, r.tok, KV, _kv0(r), 0, [3, FAKE_LAYOUT.kv_rows])
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "index_out_of_range", st
    assert_refused_once(env, before, logs, "index_out_of_range")
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_read_nixl_refuses_fails_the_room_with_transport_error(guard: Env) -> None:
    """Addresses outside what the sender registered: NIXL refuses the request; the room fails
    naming the peer, its agent and NIXL's error; nothing is written; the receiver goes on."""
    env = guard
    fake, group, _, engine = _nixl_fake(env, offset=1 << 40)
    r = open_room(env, fake, group)
    _data_refs(fake, r.tok, KV, _kv0(r), 0, list(range(r.n)))
    r.done()
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "transport_error", st
    assert "NIXL read of" in st.reason and engine.session in st.reason and "NIXL_ERR_NOT_FOUND" in st.reason, st
    assert f"{group} rank 0" in st.reason, st.reason
    r.check_pool()
    env.dc.release(r.room, group)


def test_abort_of_a_nixl_room_returns_after_its_reads_settled(guard: Env) -> None:
    env = guard
    fake, group, _, _ = _nixl_fake(env)
    r = open_room(env, fake, group, n=40)
    dropped = env.dc.stats()["dropped"].get("room_not_live", 0)
    for b in r.layout.indices("kv"):
        _data_refs(fake, r.tok, KV, b, 0, list(range(40)))
    env.dc.abort(r.room, group, "engine gave up")
    after = [rows.copy() for rows in env.dpool.rows]
    for b in r.layout.indices("kv"):  # later refs of the room: dropped, never read
        _data_refs(fake, r.tok, KV, b, 0, list(range(40)))
    env.until(lambda: env.dc.stats()["dropped"].get("room_not_live", 0) >= dropped + len(r.layout.indices("kv")),
              "the late refs to be dropped")
    assert env.dc.poll(r.room, group).code == "aborted"
    assert all(np.array_equal(a, b) for a, b in zip(after, env.dpool.rows)), "bytes written after abort returned"
    env.dc.release(r.room, group)


def test_metadata_nixl_refuses_leaves_the_registration_on_todays_plane(guard: Env) -> None:
    env = guard
    before = env.proc.log.read_text(errors="replace").count("offers NIXL reads, but")
    _nixl_fake(env, md=b"\x00" * 512)  # asserts te is False: accepted without NIXL
    env.until(lambda: env.proc.log.read_text(errors="replace").count("offers NIXL reads, but") > before,
              "the warning to be logged")
    assert "NIXL_ERR_MISMATCH" in env.proc.log.read_text(errors="replace")
