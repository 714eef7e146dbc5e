"""The ZeroMQ plane's sending side holds each data message back until the room's next one is
ready, so that a rank-room's last rows and its ``done`` leave as one data-done message
(PROTOCOL.md §4, version 7): on a real DEALER into a ROUTER, with rows out of a real pool, the
messages that arrive are checked field by field and byte for byte. A chunk's end sends what is
held; a room that stopped sends nothing it held; a rank with no rows sends its done alone."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import zmq

from transferd.daemon.accounting import Accounting
from transferd.protocol.messages import DATA_BATCH_TAG, DATA_DONE_TAG, DATA_TAG, Done
from transferd.transport.loop_socket import LoopSocket, configure
from transferd.transport.planes.sending import ConnPipes, RoomTx, SendEnv
from transferd.transport.planes.zmq import ZmqSender
from transferd.types import Kind

_ports = itertools.count()
CAP = 4096
ROW_BYTES = (1024, 256)
SRC = np.array([0, 1, 2, 3, 7])  # pool rows of positions 0..4: a run of four, then one apart
DST = np.array([10, 11, 12, 13, 20])


class Link:
    """A LoopSocket DEALER into a ROUTER that keeps every message it gets."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        addr = f"inproc://data-done-{next(_ports)}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(addr)
        dealer = self.ctx.socket(zmq.DEALER)
        configure(dealer, hwm=1000)
        dealer.connect(addr)
        self.link = LoopSocket(dealer, lambda frames: None, "test")

    def got(self) -> list[tuple[Any, list[bytes]]]:
        out = []
        while self.router.poll(200):
            _, head, *payload = self.router.recv_multipart()
            out.append((msgpack.unpackb(head, raw=False), payload))
        return out

    def close(self) -> None:
        self.link.close()
        self.router.close(linger=0)
        self.ctx.term()


def plane(link: LoopSocket) -> tuple[ZmqSender, list[np.ndarray]]:
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 256, (8, rb), dtype=np.uint8) for rb in ROW_BYTES]
    layout = SimpleNamespace(buffers=[SimpleNamespace(row_bytes=rb) for rb in ROW_BYTES])
    env = SendEnv(layout, rows, Accounting(), CAP, CAP)  # type: ignore[arg-type]
    return ZmqSender(env, ConnPipes("test", link)), rows


def run(scenario: Any) -> list[tuple[Any, list[bytes]]]:
    async def main() -> list[tuple[Any, list[bytes]]]:
        link = Link()
        try:
            zp, rows = plane(link.link)
            room = SimpleNamespace(stopped=False, handed=False, sent=0)
            await scenario(zp, RoomTx(room, 77), room, rows)
            return link.got()
        finally:
            link.close()
    return asyncio.run(main())


def want(rows: list[np.ndarray], buffer: int, pos: int, count: int) -> bytes:
    return bytes(rows[buffer][SRC[pos:pos + count]].tobytes())


def test_the_rooms_last_rows_and_its_done_leave_as_one_data_done() -> None:
    seen: dict[str, Any] = {}

    async def scenario(zp: ZmqSender, tx: RoomTx, room: Any, rows: list[np.ndarray]) -> None:
        seen["rows"] = rows
        await zp.send_rows(tx, Kind.KV, (0, 1), SRC, DST, 0)
        await zp.send_done(tx, Done(77, 3, 1, 2, 3))
        assert tx.batch == [] and tx.held == []
        seen["sent"] = room.sent

    got = run(scenario)
    rows = seen["rows"]
    # the four consecutive rows of buffer 0 (a whole message), then the small pieces' batch with the done
    assert [h for h, _ in got] == [
        [DATA_TAG, 77, 0, 0, 0, 4],
        [DATA_DONE_TAG, 77, 3, [1, 2, 3], [[0, 0, 4, 1], [0, 1, 0, 4], [0, 1, 4, 1]]],
    ], got
    assert got[0][1] == [want(rows, 0, 0, 4)]
    assert got[1][1] == [want(rows, 0, 4, 1), want(rows, 1, 0, 4), want(rows, 1, 4, 1)]
    assert seen["sent"] == 5 * 1024 + 5 * 256  # every row counted once


def test_a_chunks_end_sends_what_is_held() -> None:
    async def scenario(zp: ZmqSender, tx: RoomTx, room: Any, rows: list[np.ndarray]) -> None:
        await zp.send_rows(tx, Kind.KV, (0, 1), SRC, DST, 0)
        assert tx.held and tx.batch  # the whole message held back, the small pieces in the batch
        await zp.end_chunk(tx)  # not the last chunk: the next may come much later
        assert tx.batch == [] and tx.held == []

    got = run(scenario)
    assert [h[0] for h, _ in got] == [DATA_TAG, DATA_BATCH_TAG] and got[1][0][2] == [[0, 0, 4, 1], [0, 1, 0, 4],
                                                                                     [0, 1, 4, 1]]


def test_a_room_that_stopped_sends_nothing_it_held() -> None:
    async def scenario(zp: ZmqSender, tx: RoomTx, room: Any, rows: list[np.ndarray]) -> None:
        await zp.send_rows(tx, Kind.KV, (0, 1), SRC, DST, 0)
        room.stopped = True  # aborted: nothing of it leaves after its fail
        await zp.send_done(tx, Done(77, 0, 0, 0, 0))
        zp.discard(tx)
        assert tx.batch == [] and tx.held == [] and room.sent == 0

    assert run(scenario) == []


def test_a_rank_without_rows_sends_its_done_alone() -> None:
    async def scenario(zp: ZmqSender, tx: RoomTx, room: Any, rows: list[np.ndarray]) -> None:
        await zp.send_done(tx, Done(77, 2, 0, 0, 0))
        assert room.handed

    got = run(scenario)
    assert len(got) == 1 and got[0][1] == [], got
    head = got[0][0]
    assert head["t"] == "done" and (head["tok"], head["rank"], head["bytes"]) == (77, 2, [0, 0, 0]), head
