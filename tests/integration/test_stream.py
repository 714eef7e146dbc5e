"""A real sender process against a fake receiver written from docs/PROTOCOL.md §2.1: the records
it writes on a data stream (hello, prefix, header, payload rows) are checked byte for byte
against its pool; a stream that cannot be connected leaves the data on ZeroMQ; a stream the
receiver closes makes the sender give the receiver up and register again."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from transferd.pool import Pool
from transferd.protocol.messages import PROTOCOL_VERSION, Assign, Bundle, Ping, Registered, Status
from transferd.protocol.room import RoomState

from .harness import Cluster, fill_random, write_guard

KEY = bytes(range(100, 116))
ROOM, TOK = 5, 0xABCDEF
SRC_PAGES, DST_PAGES = [4, 5, 9], (10, 11, 13)
STATE_SRC, STATE_DST, AUX_SRC, AUX_DST = 3, 1, 6, 2


class FakeReceiver:
    """A ROUTER that answers by hand; every message it gets is kept, pings aside."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.ep = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.got: list[tuple[bytes, list[bytes]]] = []

    def next(self, what: str, timeout: float = 15.0) -> tuple[bytes, Any, list[bytes]]:
        """The next message whose decoded header is a ``what`` map (or a data array for
        ``"data"``), with its identity and payload frames."""
        end = time.monotonic() + timeout
        while True:
            for i, (ident, frames) in enumerate(self.got):
                head = msgpack.unpackb(frames[0], raw=False)
                if (what == "data" and isinstance(head, list)) or (isinstance(head, dict) and head.get("t") == what):
                    del self.got[i]
                    return ident, head, frames[1:]
            left = end - time.monotonic()
            assert left > 0, f"no {what!r} within {timeout}s (got {self.got!r:.300})"
            if self.sock.poll(int(min(left, 0.2) * 1000) + 1):
                ident, *frames = self.sock.recv_multipart()
                self.got.append((ident, frames))

    def send(self, ident: bytes, msg: Any) -> None:
        self.sock.send_multipart([ident, msgpack.packb(msg.header(), use_bin_type=True)])

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def fake() -> Iterator[FakeReceiver]:
    f = FakeReceiver()
    yield f
    f.close()


def _start(cluster: Cluster, fake: FakeReceiver) -> tuple[Any, Pool, bytes, dict[str, Any]]:
    pcs, pools = cluster.group("fs", 1, [fake.ep], wait=False)
    fill_random(pools[0], 21)
    write_guard(pools[0], AUX_SRC, ROOM)
    ident, reg, _ = fake.next("register")
    assert reg["stream"] is True and reg["group"] == "fs", reg  # a tcp:// receiver: it asks for a stream
    return pcs[0], pools[0], ident, reg


def _room(fake: FakeReceiver, ident: bytes, pc: Any, pool: Pool) -> None:
    comps = pool.layout.state_components
    fake.send(ident, Assign(TOK, ROOM, len(DST_PAGES), 0, DST_PAGES, {c: (STATE_DST,) for c in comps}, AUX_DST))
    pc.submit(ROOM, 0, SRC_PAGES, last=True, state={c: [STATE_SRC] for c in comps}, aux_slot=AUX_SRC)


def _want(pool: Pool, kind: int, buffer: int, pos: int, count: int) -> bytes:
    rows = pool.rows[buffer]
    if kind == 0:
        return rows[SRC_PAGES[pos:pos + count]].tobytes()
    return rows[[STATE_SRC if kind == 1 else AUX_SRC] * count].tobytes()


def _entries(head: list[Any]) -> tuple[list[Any], dict[str, Any] | None]:
    """A data (1), data-batch (4) or data-done (5) header's entries, and the done a data-done
    carries (as the done message's fields)."""
    assert head[0] in (1, 4, 5) and head[1] == TOK, head
    if head[0] == 5:
        return head[4], {"tok": head[1], "rank": head[2], "bytes": head[3]}
    return ([head[2:6]] if head[0] == 1 else head[2]), None


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        assert chunk, f"stream ended after {len(out)} of {n} bytes"
        out += chunk
    return out


def _planned(pool: Pool) -> tuple[int, int, int]:
    L = pool.layout
    kv = len(SRC_PAGES) * sum(L.buffers[b].row_bytes for b in L.indices("kv"))
    return kv, sum(L.buffers[b].row_bytes for b in L.indices("state")), L.aux_row_bytes


def test_a_sender_writes_the_documented_records_on_its_stream(cluster: Cluster, fake: FakeReceiver) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(15)
    try:
        pc, pool, ident, _ = _start(cluster, fake)
        fake.send(ident, Registered(True, "", "fake", 77, stream_port=listener.getsockname()[1], stream_key=KEY))
        conn, _ = listener.accept()
        conn.settimeout(15)
        assert _recv_exactly(conn, 24) == b"TDSTREAM" + KEY  # the hello
        _room(fake, ident, pc, pool)
        seen: dict[tuple[int, int], bytes] = {}
        done = None
        while done is None:  # records until the done: u32 header length, u64 payload length, header, payload
            hlen, plen = struct.unpack("<IQ", _recv_exactly(conn, 12))
            head = msgpack.unpackb(_recv_exactly(conn, hlen), raw=False)
            payload = _recv_exactly(conn, plen)
            # the rank's last rows carry its done (a data-done record): no done record of its own
            assert isinstance(head, list), head
            entries, done = _entries(head)
            o = 0
            for kind, buffer, pos, count in (e[:4] for e in entries):
                want = _want(pool, kind, buffer, pos, count)
                assert payload[o:o + len(want)] == want, (kind, buffer, pos, count)
                for p in range(pos, pos + count):
                    assert (buffer, p) not in seen, f"buffer {buffer} position {p} twice"
                    seen[(buffer, p)] = b""
                o += len(want)
            assert o == plen, (head, plen)
        assert (done["tok"], done["rank"], tuple(done["bytes"])) == (TOK, 0, _planned(pool))
        L = pool.layout
        assert set(seen) == ({(b, p) for b in L.indices("kv") for p in range(len(SRC_PAGES))}
                             | {(b, 0) for b in L.indices("state")} | {(L.aux_index, 0)})
        assert pc.stats()["stream_bytes"] == sum(_planned(pool))
        with pytest.raises(AssertionError, match="no 'data'"):
            fake.next("data", timeout=0.3)  # nothing of it on ZeroMQ
        fake.send(ident, Status(TOK, ROOM, "success"))
        assert pc.wait(ROOM, 10).state is RoomState.SUCCESS
        # the receiver closes the stream: the sender gives it up and registers again (epoch 1)
        conn.close()
        _, reg, _ = fake.next("register")
        assert reg["epoch"] == 1, reg
    finally:
        listener.close()


def test_a_stream_that_cannot_connect_leaves_the_data_on_zeromq(cluster: Cluster, fake: FakeReceiver) -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    closed_port = probe.getsockname()[1]
    probe.close()  # nothing listens there now: the connect is refused
    pc, pool, ident, _ = _start(cluster, fake)
    fake.send(ident, Registered(True, "", "fake", 77, stream_port=closed_port, stream_key=KEY))
    cluster.until(lambda: pc.stats()["dropped"].get("stream_connect_failed") == 1, "the failed connect")
    _room(fake, ident, pc, pool)
    got, done = 0, None
    while done is None:  # the last data message carries the done (a data-done message)
        fake.send(ident, Ping(1))
        _, head, frames = fake.next("data")
        entries, done = _entries(head)
        assert len(frames) == len(entries), head
        for (kind, buffer, pos, count), frame in zip((e[:4] for e in entries), frames):
            assert frame == _want(pool, kind, buffer, pos, count)
            got += len(frame)
    assert got == sum(_planned(pool)) and tuple(done["bytes"]) == _planned(pool)
    assert pc.stats()["stream_bytes"] == 0
    log = cluster.proc("sender-fs-r0").log.read_text()
    assert f"data stream to 127.0.0.1:{closed_port}" in log and "goes over its ZeroMQ socket instead" in log
    fake.send(ident, Status(TOK, ROOM, "success"))
    assert pc.wait(ROOM, 10).state is RoomState.SUCCESS


def test_a_sender_stops_asking_for_streams_that_end_unused(cluster: Cluster, fake: FakeReceiver) -> None:
    """Something at the stream port that closes every connection would fail every room again and
    again: after three streams lost before carrying a record, the sender registers without asking
    for one (for five minutes) and its data stays on ZeroMQ."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(15)
    try:
        pc, pool, ident, reg = _start(cluster, fake)
        for epoch in range(3):
            assert reg["stream"] is True and reg["epoch"] == epoch, reg
            fake.send(ident, Registered(True, "", "fake", 77, stream_port=listener.getsockname()[1], stream_key=KEY))
            conn, _ = listener.accept()
            conn.close()  # at once: the sender loses the stream and registers again
            ident, reg, _ = fake.next("register")
        assert reg["stream"] is False and reg["epoch"] == 3, reg
        log = cluster.proc("sender-fs-r0").log.read_text()
        assert "3 data streams to" in log and "ended before carrying anything" in log
    finally:
        listener.close()


def test_a_sender_takes_a_bundle_entry_by_entry_and_refuses_a_bad_one_whole(cluster: Cluster,
                                                                          fake: FakeReceiver) -> None:
    """PROTOCOL §3.1: registered and assign in one bundle (no stream offered: the data takes
    ZeroMQ), every byte as planned; the status in a bundle with a ping (answered). A bundle with
    one undecodable entry is refused whole and counted; its good entries are not acted on."""
    pc, pool, ident, _ = _start(cluster, fake)
    comps = pool.layout.state_components
    pc.submit(ROOM, 0, SRC_PAGES, last=True, state={c: [STATE_SRC] for c in comps}, aux_slot=AUX_SRC)
    fake.send(ident, Bundle((Registered(True, "", "fake", 77),
                             Assign(TOK, ROOM, len(DST_PAGES), 0, DST_PAGES, {c: (STATE_DST,) for c in comps}, AUX_DST))))
    got, done = 0, None
    while done is None:
        _, head, frames = fake.next("data")
        entries, done = _entries(head)
        for (kind, buffer, pos, count), frame in zip((e[:4] for e in entries), frames):
            assert frame == _want(pool, kind, buffer, pos, count)
            got += len(frame)
    assert got == sum(_planned(pool)) and tuple(done["bytes"]) == _planned(pool)
    bad = msgpack.packb({"t": "bundle", "v": PROTOCOL_VERSION,
                         "msgs": [msgpack.packb(Status(TOK, ROOM, "failed", "x", "y").header()), b"\xc1"]})
    fake.sock.send_multipart([ident, bad])
    cluster.until(lambda: pc.stats()["refused"].get("decode") == 1, "the bad bundle's refusal")
    assert not pc.poll(ROOM).state.terminal  # its good first entry (a failure) was not taken either
    fake.send(ident, Bundle((Ping(5), Status(TOK, ROOM, "success"))))
    _, pong, _ = fake.next("pong")
    assert pong["seq"] == 5
    assert pc.wait(ROOM, 10).state is RoomState.SUCCESS
