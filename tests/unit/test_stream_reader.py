"""transferd.transport.data_stream.StreamReader on a real socket pair: a payload lands byte for byte in the views
its handler names, each read asking for at most about RECV_CHUNK bytes (reads of a whole 1 MiB
payload were 15-25 % slower on loopback: docs/history/PERFORMANCE-LOG.md item 15), many small views (the
rows of a batch) are filled several at a time by one scattering read, and, for any views, any
splitting of the sender's writes and any point where a payload's owner goes away (hypothesis),
nothing is written after that point and the stream stays in step."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import socket
import threading

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transferd.protocol.stream import HELLO_MAGIC, KEY_BYTES, PREFIX
from transferd.transport.data_stream import (
    MULTI_RECV_CHUNK,
    READ_AHEAD,
    RECV_CHUNK,
    STEPS_PER_CALL,
    StreamReader,
    Target,
)


class CountingSocket:
    """The reader's end of the pair, noting how many bytes each ``recv_into`` asked for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.asked: list[int] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_into(self, view: memoryview) -> int:
        self.asked.append(len(view))
        return self.sock.recv_into(view)

    def recvmsg_into(self, bufs: list[memoryview]) -> tuple[int, list[object], int, object]:
        self.asked.append(sum(len(b) for b in bufs))
        return self.sock.recvmsg_into(bufs)

    def close(self) -> None:
        self.sock.close()


class Handler:
    def __init__(self, dst: list[memoryview]) -> None:
        self.dst = dst
        self.headers: list[bytes] = []
        self.done = asyncio.get_running_loop().create_future()
        self.closed: list[str] = []

    def stream_hello(self, reader: StreamReader, hello: bytes) -> bool:
        return hello == HELLO_MAGIC + b"k" * KEY_BYTES

    def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
        self.headers.append(header)
        assert payload_len == sum(len(v) for v in self.dst)
        return Target(self.dst, lambda: self.done.set_result(None))

    def stream_closed(self, reader: StreamReader, reason: str) -> None:
        self.closed.append(reason)


def _receive(payload: bytes, cuts: list[int]) -> tuple[bytes, list[int], list[bytes]]:
    """Send one record with ``payload`` and read it into views cut at ``cuts``."""

    async def main() -> tuple[bytes, list[int], list[bytes]]:
        a, b = socket.socketpair()
        a.setblocking(False)
        dst = bytearray(len(payload))
        edges = [0, *cuts, len(payload)]
        handler = Handler([memoryview(dst)[x:y] for x, y in itertools.pairwise(edges)])
        counted = CountingSocket(a)
        reader = StreamReader(counted, "test", handler, max_payload=len(payload), scratch=memoryview(bytearray(64)))
        header = b"hdr"
        writer = threading.Thread(target=b.sendall, args=(HELLO_MAGIC + b"k" * KEY_BYTES + PREFIX.pack(
            len(header), len(payload)) + header + payload,))
        writer.start()
        await asyncio.wait_for(handler.done, 30)
        await asyncio.to_thread(writer.join)
        reader.close()
        b.close()
        return bytes(dst), counted.asked, handler.headers

    return asyncio.run(main())


def test_a_large_payload_is_read_in_chunks_into_the_named_views() -> None:
    payload = os.urandom(3 * RECV_CHUNK * 5 + 7)  # across both views, not a multiple of a read
    got, asked, headers = _receive(payload, [len(payload) // 3 + 1])
    assert headers == [b"hdr"]
    assert got == payload
    assert max(asked) <= RECV_CHUNK
    assert asked.count(RECV_CHUNK) >= len(payload) // RECV_CHUNK // 2  # the payload went in full-size reads


def test_small_views_are_filled_several_per_read() -> None:
    sizes = [3000] * 200 + [RECV_CHUNK * 3 + 11] + [5] * 7 + [70000] * 3  # rows of a batch, odd sizes
    payload = os.urandom(sum(sizes))
    cuts = [sum(sizes[:i]) for i in range(1, len(sizes))]
    got, asked, _ = _receive(payload, cuts)
    assert got == payload
    assert max(asked) <= RECV_CHUNK
    # far fewer reads than views: 200 rows of 3000 bytes take ~10 reads of a chunk, not 200
    payload_reads = len(asked) - 3  # the hello, the prefix and the header come first
    assert payload_reads < len(sizes) // 3, (payload_reads, asked[:20])


def test_streams_in_a_payload_at_once_read_larger_chunks_and_the_count_returns_to_zero() -> None:
    """Two streams of one server inside a payload at once (a CP group's ranks): the reads grow to
    MULTI_RECV_CHUNK, the bytes land exactly, and the count of streams inside a payload is back
    to zero once one payload is done and the other stream closed in mid-payload."""
    payload = os.urandom(3 * MULTI_RECV_CHUNK + 5)
    hello = HELLO_MAGIC + b"k" * KEY_BYTES

    async def main() -> tuple[bytes, list[int], list[int], list[str]]:
        busy = [0]
        a1, b1 = socket.socketpair()
        a2, b2 = socket.socketpair()
        for s in (a1, a2):
            s.setblocking(False)
        h1 = Handler([memoryview(bytearray(len(payload)))])
        dst = bytearray(len(payload))
        h2 = Handler([memoryview(dst)])
        r1 = StreamReader(CountingSocket(a1), "one", h1, len(payload), memoryview(bytearray(64)), busy=busy)
        c2 = CountingSocket(a2)
        r2 = StreamReader(c2, "two", h2, len(payload), memoryview(bytearray(64)), busy=busy)
        b1.sendall(hello + PREFIX.pack(3, len(payload)) + b"hdr" + payload[:1000])  # stays in mid-payload
        async def first_in_payload() -> None:
            while busy[0] < 1:
                await asyncio.sleep(0.005)
        await asyncio.wait_for(first_in_payload(), 30)
        seen = [busy[0]]
        writer = threading.Thread(target=b2.sendall, args=(hello + PREFIX.pack(3, len(payload)) + b"hdr" + payload,))
        writer.start()
        await asyncio.wait_for(h2.done, 30)
        await asyncio.to_thread(writer.join)
        seen.append(busy[0])  # r2's payload is done: r1 alone is inside one
        r1.close()
        seen.append(busy[0])
        r2.close()
        b1.close()
        b2.close()
        return bytes(dst), c2.asked, seen, h1.closed

    got, asked, seen, closed = asyncio.run(main())
    assert got == payload
    assert max(asked) <= MULTI_RECV_CHUNK
    assert any(n > RECV_CHUNK for n in asked), asked[:20]  # the second stream read in larger chunks
    assert seen == [1, 1, 0]
    assert closed == [""]


def test_the_stream_ending_inside_a_large_view_is_named_and_what_came_is_in_place() -> None:
    """The sender stops in the middle of a view many reads long (the reads' own loop): the
    stream closes "in mid-message", every byte that came is in place and counted, none after."""
    payload = os.urandom(6 * RECV_CHUNK)
    sent = 2 * RECV_CHUNK + 12345

    async def main() -> tuple[bytes, list[str], int]:
        a, b = socket.socketpair()
        a.setblocking(False)
        dst = bytearray(len(payload))
        handler = Handler([memoryview(dst)])
        reader = StreamReader(a, "test", handler, max_payload=len(payload), scratch=memoryview(bytearray(64)),
                              budget=3)
        start = HELLO_MAGIC + b"k" * KEY_BYTES + PREFIX.pack(3, len(payload)) + b"hdr"
        b.sendall(start + payload[:sent])
        b.close()
        while not handler.closed:
            await asyncio.sleep(0.005)
        return bytes(dst), handler.closed, reader.rx_bytes - len(start)

    got, closed, counted = asyncio.run(main())
    assert len(closed) == 1 and "closed in mid-message" in closed[0], closed
    assert got[:sent] == payload[:sent] and not any(got[sent:])
    assert counted == sent


def _flood(n: int, pause_after: int | None = None) -> tuple[list[bytes], list[int], int, list[str]]:
    """``n`` records without a payload (a batch's ``done`` records) written at once; returns the
    headers the handler saw, the reads' sizes, how many turns a ticking task got meanwhile and
    the close reasons. ``pause_after``: the reader pauses for 50 ms after that many records."""

    async def main() -> tuple[list[bytes], list[int], int, list[str]]:
        a, b = socket.socketpair()
        a.setblocking(False)
        seen: list[bytes] = []
        closed: list[str] = []
        all_in = asyncio.get_running_loop().create_future()

        class Dones:
            def stream_hello(self, reader: StreamReader, hello: bytes) -> bool:
                return True

            def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
                assert payload_len == 0
                seen.append(header)
                if len(seen) == pause_after:
                    reader.pause(0.05)
                if len(seen) == n:
                    all_in.set_result(None)
                return Target([])

            def stream_closed(self, reader: StreamReader, reason: str) -> None:
                closed.append(reason)

        counted = CountingSocket(a)
        reader = StreamReader(counted, "flood", Dones(), max_payload=1 << 20, scratch=memoryview(bytearray(64)))
        ticks = [0]

        async def tick() -> None:
            while not all_in.done():
                ticks[0] += 1
                await asyncio.sleep(0)
        ticker = asyncio.ensure_future(tick())
        data = HELLO_MAGIC + b"k" * KEY_BYTES + b"".join(PREFIX.pack(4, 0) + b"d%03d" % (i % 1000) for i in range(n))
        writer = threading.Thread(target=b.sendall, args=(data,))  # in one call: as fast as the socket takes it
        writer.start()
        await asyncio.wait_for(all_in, 30)
        await ticker
        await asyncio.to_thread(writer.join)
        reader.close()
        b.close()
        return seen, counted.asked, ticks[0], closed

    return asyncio.run(main())


def test_records_behind_a_header_come_in_the_same_read_in_order() -> None:
    """A batch's ``done`` records (12 bytes each here) written back to back are taken from one
    read ahead of READ_AHEAD bytes each, not two reads a record, every one in order."""
    n = 3000
    seen, asked, _, closed = _flood(n)
    assert seen == [b"d%03d" % (i % 1000) for i in range(n)]
    assert max(asked) <= READ_AHEAD
    assert len(asked) <= n * 12 // READ_AHEAD + 4 + n // (STEPS_PER_CALL // 2), (len(asked), asked[:10])
    assert closed == [""]


def test_a_flood_of_tiny_records_leaves_the_loop_turns() -> None:
    """Records read ahead are taken without a read, so the read budget alone does not bound a
    callback: STEPS_PER_CALL does. 20,000 records written at once let another task run at least
    once every STEPS_PER_CALL steps (two a record here), not once in the whole flood."""
    n = 20_000
    seen, _, ticks, _ = _flood(n)
    assert len(seen) == n
    assert ticks >= n * 2 // STEPS_PER_CALL // 2, ticks


def test_records_read_ahead_before_a_pause_are_taken_after_it() -> None:
    """A pause (a slow decode side) may start with records already read ahead and nothing more
    coming on the socket: they are acted on once it ends, in order."""
    n = 50
    seen, _, _, _ = _flood(n, pause_after=7)
    assert seen == [b"d%03d" % i for i in range(n)]


# -- property: any views, any chunking of the sender's writes, any abort point --------------------


_SIZE = st.one_of(st.sampled_from([1, 7, RECV_CHUNK - 1, RECV_CHUNK, RECV_CHUNK + 1, 3 * RECV_CHUNK + 5]),
                  st.integers(1, 200_000))
_RECORD = st.tuples(st.lists(_SIZE, min_size=1, max_size=40).filter(lambda s: sum(s) <= 1 << 20),
                    st.one_of(st.none(), st.integers(0, 20)))  # the views; after how many alive() calls it ends


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(_RECORD, min_size=1, max_size=4),
       writes=st.lists(st.sampled_from([1, 5, 100, 4096, RECV_CHUNK, 300_000]), min_size=1, max_size=8)
       .filter(lambda w: max(w) >= 4096),
       budget=st.sampled_from([1, 3, 64]), scratch=st.sampled_from([64, 4096, 256 << 10]),
       seed=st.integers(0, 2**32 - 1))
def test_any_views_any_writes_any_abort_point(records: list[tuple[list[int], int | None]], writes: list[int],
                                              budget: int, scratch: int, seed: int) -> None:
    """Every payload lands byte for byte in its views, or, once its owner says it is gone
    (``alive()`` False), nothing more of it is written and ``done`` never runs; either way the
    next record is read in step and the stream ends at a record boundary."""
    rng = random.Random(seed)
    payloads = [rng.randbytes(sum(sizes)) for sizes, _ in records]
    outcome: list[dict[str, object]] = []

    async def main() -> str:
        a, b = socket.socketpair()
        a.setblocking(False)
        ended = asyncio.get_running_loop().create_future()

        class Many:
            def stream_hello(self, reader: StreamReader, hello: bytes) -> bool:
                return True

            def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
                sizes, kill_after = records[len(outcome)]
                dst = bytearray(payload_len)
                edges = [0]
                for size in sizes:
                    edges.append(edges[-1] + size)
                got: dict[str, object] = {"dst": dst, "calls": 0, "frozen": None, "done": False}
                outcome.append(got)

                def alive() -> bool:
                    got["calls"] = int(got["calls"]) + 1  # type: ignore[call-overload]
                    if kill_after is not None and int(got["calls"]) > kill_after:  # type: ignore[call-overload]
                        got["frozen"] = bytes(dst)
                        return False
                    return True

                def done() -> None:
                    got["done"] = True
                return Target([memoryview(dst)[x:y] for x, y in itertools.pairwise(edges)], done, alive)

            def stream_closed(self, reader: StreamReader, reason: str) -> None:
                if not ended.done():
                    ended.set_result(reason)

        StreamReader(a, "prop", Many(), max_payload=1 << 21, scratch=memoryview(bytearray(scratch)), budget=budget)
        data = HELLO_MAGIC + b"k" * KEY_BYTES + b"".join(PREFIX.pack(1, len(p)) + b"h" + p for p in payloads)

        def send() -> None:
            o, i = 0, 0
            while o < len(data):
                n = writes[i % len(writes)] if o < 1 << 16 else max(writes)  # odd splits early, then fast
                b.sendall(data[o:o + n])
                o, i = o + n, i + 1
            b.shutdown(socket.SHUT_WR)
        writer = threading.Thread(target=send)
        writer.start()
        reason = await asyncio.wait_for(ended, 60)
        await asyncio.to_thread(writer.join)
        b.close()
        return reason

    reason = asyncio.run(main())
    assert "mid-message" not in reason, reason  # in step to the end
    assert len(outcome) == len(records)
    for got, payload in zip(outcome, payloads):
        dst = bytes(got["dst"])  # type: ignore[arg-type]
        if got["frozen"] is None:
            assert got["done"] and dst == payload
        else:
            assert not got["done"] and dst == got["frozen"]  # nothing written once it was gone
            w = next((i for i, (x, y) in enumerate(zip(dst, payload)) if x != y), len(dst))
            assert not any(dst[w:])  # what landed before is the payload's start, in view order
