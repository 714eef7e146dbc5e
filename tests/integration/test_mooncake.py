"""The Mooncake plane's reader on two real Transfer Engines (TCP on loopback, in this process):
the batch that Mooncake's TCP transport rejects when called raw goes through transferd's reader
byte-exact, in bounded batches; reads of a room that ended are never started."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from transferd.transport.planes.mooncake import MooncakeEngine
from transferd.transport.planes.reads import Job, Reader

ROW = 16 << 10
ROWS = 4096


class CountingEngine(MooncakeEngine):
    """A real engine that also records the batches it was given (entries, and how many ran at once:
    from ``start`` until its ``wait`` returned, as the reader drives it, or through ``read``)."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1", "tcp", "")
        self.lock = threading.Lock()
        self.running = 0
        self.most_running = 0
        self.batches: list[int] = []

    def read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.batches.append(len(lens))
        try:
            return super().read(session, local, remote, lens)
        finally:
            with self.lock:
                self.running -= 1

    def start(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
            self.batches.append(len(lens))
        return super().start(session, local, remote, lens)

    def wait(self, bid: int) -> int:
        try:
            return super().wait(bid)
        finally:
            with self.lock:
                self.running -= 1


@pytest.fixture
def engines(plane_mooncake: str) -> Iterator[tuple[MooncakeEngine, CountingEngine, np.ndarray, np.ndarray]]:
    src_engine, dst_engine = MooncakeEngine("127.0.0.1", "tcp", ""), CountingEngine()
    src = np.random.default_rng(12).integers(0, 256, (ROWS, ROW), dtype=np.uint8)
    dst = np.zeros_like(src)
    src_engine.register([src])
    try:
        yield src_engine, dst_engine, src, dst
    finally:
        src_engine.close()
        dst_engine.close()


def _entries(src: np.ndarray, dst: np.ndarray, rows: range) -> tuple[list[int], list[int], list[int]]:
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    return [d + r * ROW for r in rows], [s + r * ROW for r in rows], [ROW] * len(rows)


def test_4096_reads_of_16_kib_rejected_raw_go_through_the_reader_in_bounded_batches(engines: Any) -> None:
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
    assert reader.pipelined and reader.waiter is not None  # Mooncake: one thread starts, one waits
    reader.waiter.shutdown(wait=True)
    assert outcomes == [0] * 16
    assert np.array_equal(dst, src)  # byte-exact
    assert max(dst_engine.batches) <= 512 and sum(dst_engine.batches) == ROWS  # jobs shared batches, bounded
    assert dst_engine.most_running <= 2 and reader.failed == 0
    # the same 4096 entries of one row each in one raw engine call: rejected (queue full). Last: the
    # engine goes on draining what it had queued of that batch, and rejects what comes meanwhile
    local, remote, lens = _entries(src, dst, range(ROWS))
    raw = MooncakeEngine.read(dst_engine, src_engine.session, local, remote, lens)
    assert raw != 0, "Mooncake's TCP transport took 4096 × 16 KiB in one batch: the premise changed"


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
        ended.set()  # the room ends: the first batch is already running, the rest wait
        assert reader.busy(7)
        await reader.settled(7)
        assert not reader.busy(7)

    asyncio.run(run())
    reader.executor.shutdown(wait=True)
    assert outcomes[0] == 0 and outcomes[1:] == [None] * 15  # one read ran; fifteen were dropped unread
    assert np.array_equal(dst[:64], src[:64]) and not dst[64:1024].any()
    assert dst_engine.batches == [64]
