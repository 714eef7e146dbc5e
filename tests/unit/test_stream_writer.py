"""transferd.transport.data_stream.StreamWriter on a real loopback TCP connection: a record with
no payload (a ``done``) that follows another in the same turn of the loop is kept and handed to
the kernel with the others at the turn's end, in one call; the first goes at once (a lone room's
``done`` is not held); a record with a payload takes the kept ones with it, ahead of it; a close
hands over what was kept. Rooms waiting for a busy stream are woken one at a time, in order, and
one that stops or is cancelled passes its turn on. The bytes that arrive are the records, in the
order written."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

from transferd.protocol.stream import HELLO_BYTES, prefix
from transferd.transport.data_stream import SEND_BUFFER, StreamServer, StreamWriter, Target
from transferd.transport.planes.sending import SENT_STREAM, ConnPipes, RoomTx, SendEnv
from transferd.transport.planes.stream import StreamSender

from .turns_helpers import cancel_first_as_woken, counting_waits

KEY = b"k" * 16


class CountingSocket:
    """The writer's socket, noting the buffers of each ``sendmsg``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls: list[bytes] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def sendmsg(self, bufs: list[Any]) -> int:
        n = self.sock.sendmsg(bufs)
        self.calls.append(b"".join(bytes(b) for b in bufs)[:n])
        return n

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def close(self) -> None:
        self.sock.close()


def small(i: int) -> list[bytes]:
    header = b"done%d" % i
    return [prefix(len(header), 0), header]


def read_all(conn: socket.socket, n: int) -> bytes:
    conn.settimeout(10)
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            break
        out += part
    return out


async def connected(send_buffer: int = SEND_BUFFER) -> tuple[StreamWriter, CountingSocket, socket.socket, list[str]]:
    srv = socket.create_server(("127.0.0.1", 0))
    lost: list[str] = []
    writer = StreamWriter("test", lost.append, send_buffer)
    await writer.connect("127.0.0.1", srv.getsockname()[1], KEY, 5)
    conn, _ = srv.accept()
    srv.close()
    assert read_all(conn, HELLO_BYTES).endswith(KEY)
    counted = CountingSocket(writer.sock)  # type: ignore[arg-type]
    writer.sock = counted  # type: ignore[assignment]
    return writer, counted, conn, lost


def test_small_records_of_one_turn_go_in_one_call_after_the_first() -> None:
    async def main() -> None:
        writer, counted, conn, lost = await connected()
        records = [small(i) for i in range(5)]
        assert writer.try_write(records[0], small=True)
        assert len(counted.calls) == 1  # the first at once
        for r in records[1:]:
            assert writer.try_write(r, small=True)
        assert len(counted.calls) == 1  # the others kept for the turn's end
        assert writer.records == 5
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        want = b"".join(b"".join(r) for r in records)
        assert counted.calls == [b"".join(records[0]), b"".join(b"".join(r) for r in records[1:])]
        assert read_all(conn, len(want)) == want
        # a later turn: its first small record goes at once again
        assert writer.try_write(small(9), small=True)
        assert len(counted.calls) == 3
        writer.close()
        conn.close()
        assert lost == []

    asyncio.run(main())


def test_a_record_with_a_payload_takes_the_kept_ones_ahead_of_it() -> None:
    async def main() -> None:
        writer, counted, conn, _ = await connected()
        payload = bytes(range(256)) * 1024
        header = b"data"
        big = [prefix(len(header), len(payload)), header, memoryview(payload)]
        a, b = small(0), small(1)
        assert writer.try_write(a, small=True)
        assert writer.try_write(b, small=True)
        assert writer.try_write(big)
        assert len(counted.calls) == 2  # b went with the payload's record, in front of it
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        want = b"".join(a) + b"".join(b) + prefix(len(header), len(payload)) + header + payload
        got = await asyncio.to_thread(read_all, conn, len(want))
        assert got == want
        await writer.writable()
        assert len(counted.calls) >= 2 and counted.calls[1].startswith(b"".join(b))
        writer.close()
        conn.close()

    asyncio.run(main())


def test_a_close_hands_over_what_the_turn_kept() -> None:
    async def main() -> None:
        writer, counted, conn, _ = await connected()
        records = [small(i) for i in range(3)]
        for r in records:
            assert writer.try_write(r, small=True)
        writer.close()
        assert not writer.try_write(small(7), small=True)
        await asyncio.sleep(0)
        want = b"".join(b"".join(r) for r in records)
        assert read_all(conn, len(want) + 1) == want  # then EOF: nothing after the close
        conn.close()

    asyncio.run(main())


def test_the_send_buffer_is_the_configured_one_or_the_kernels() -> None:
    """``send_buffer`` sets SO_SNDBUF (Linux reports twice the value asked, within wmem_max);
    0 leaves the socket as the kernel made it (its autotuning)."""
    wmem_max = int(open("/proc/sys/net/core/wmem_max").read())

    async def sndbuf(send_buffer: int) -> int:
        srv = socket.create_server(("127.0.0.1", 0))
        writer = StreamWriter("test", lambda why: None, send_buffer)
        await writer.connect("127.0.0.1", srv.getsockname()[1], KEY, 5)
        conn, _ = srv.accept()
        assert writer.sock is not None
        got = writer.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        writer.close()
        conn.close()
        srv.close()
        return got

    async def main() -> None:
        srv = socket.create_server(("127.0.0.1", 0))
        plain = socket.create_connection(srv.getsockname())
        kernels = plain.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # a socket as the kernel makes it
        plain.close()
        srv.close()
        assert await sndbuf(256 << 10) == 2 * min(256 << 10, wmem_max)
        assert await sndbuf(96 << 10) == 2 * min(96 << 10, wmem_max)
        assert await sndbuf(0) == kernels != 2 * (256 << 10)

    asyncio.run(main())


def test_the_receive_buffer_of_each_accepted_stream_is_the_servers() -> None:
    rmem_max = int(open("/proc/sys/net/core/rmem_max").read())

    class Quiet:
        def stream_hello(self, reader: Any, hello: bytes) -> bool:
            return True

        def stream_record(self, reader: Any, header: bytes, payload_len: int) -> Target:
            return Target([])

        def stream_closed(self, reader: Any, reason: str) -> None:
            pass

    async def rcvbuf(receive_buffer: int) -> int:
        server = StreamServer("127.0.0.1", 0, Quiet(), 1 << 20, receive_buffer)
        client = socket.create_connection(("127.0.0.1", server.port))
        while not server.readers:
            await asyncio.sleep(0.001)
        reader = next(iter(server.readers))
        got = reader.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        client.close()
        server.close()
        return got

    async def main() -> None:
        assert await rcvbuf(512 << 10) == 2 * min(512 << 10, rmem_max)
        assert await rcvbuf(0) != 2 * (512 << 10)

    asyncio.run(main())


# -- rooms waiting for the stream: one is woken at a time -------------------------------------

def stream_plane(writer: StreamWriter) -> StreamSender:
    """The stream plane of a connection whose only way out is ``writer`` (no pool: its records
    are built here and handed to ``_emit`` as the plane's batching would)."""
    env = SendEnv(SimpleNamespace(buffers=()), (), None, 1 << 20, 1 << 20)  # type: ignore[arg-type]
    return StreamSender(env, ConnPipes("test", None, stream=writer))  # type: ignore[arg-type]


def payload_record(i: int, nbytes: int = 96 << 10) -> tuple[bytes, bytes]:
    header = b"room%03d" % i
    return header, bytes([i % 251]) * nbytes


def waiting_rooms(writer: StreamWriter, n: int) -> tuple[list[Any], list[tuple[bytes, bytes]], list[asyncio.Task[int]]]:
    """``n`` rooms each sending one record through the stream plane, started as tasks."""
    plane = stream_plane(writer)
    rooms = [SimpleNamespace(stopped=False) for _ in range(n)]
    records = [payload_record(i) for i in range(n)]
    tasks = [asyncio.create_task(plane._emit(RoomTx(room, i), h, [memoryview(p)], len(p)))  # type: ignore[arg-type]
             for i, (room, (h, p)) in enumerate(zip(rooms, records))]
    return rooms, records, tasks


def test_rooms_waiting_for_the_stream_are_woken_one_at_a_time_in_order() -> None:
    """Sixteen rooms' records behind a small send buffer: each room waits for the stream at
    most once (when the stream drains, the first waiter alone is woken, not all of them to
    find it taken again), and the records arrive whole, in the order the rooms came."""
    async def main() -> None:
        writer, _, conn, lost = await connected(send_buffer=16 << 10)
        plane = stream_plane(writer)
        waits = counting_waits(writer)
        rooms = [SimpleNamespace(stopped=False) for _ in range(16)]
        records = [payload_record(i) for i in range(16)]
        want = b"".join(prefix(len(h), len(p)) + h + p for h, p in records)
        reading = asyncio.create_task(asyncio.to_thread(read_all, conn, len(want)))
        sent = await asyncio.wait_for(asyncio.gather(*(
            plane._emit(RoomTx(room, i), h, [memoryview(p)], len(p))  # type: ignore[arg-type]
            for i, (room, (h, p)) in enumerate(zip(rooms, records)))), 10)
        assert sent == [SENT_STREAM] * 16
        assert await reading == want
        assert 1 <= waits[0] <= 15  # the first room never waits; every other at most once
        writer.close()
        conn.close()
        assert lost == []

    asyncio.run(main())


def test_a_woken_room_that_stopped_passes_the_turn_on() -> None:
    """Rooms wait behind a full stream; one of them stops meanwhile (cancelled, say). Woken,
    it writes nothing and hands the turn to the next waiter: no room is left waiting on an idle
    stream, and the stopped room's record never goes out."""
    async def main() -> None:
        writer, _, conn, lost = await connected(send_buffer=16 << 10)
        rooms, records, tasks = waiting_rooms(writer, 6)
        await asyncio.sleep(0)
        assert writer.pending and len(writer._waiters) == 5  # room 0 writing, 1-5 waiting
        rooms[1].stopped = True  # the first in line
        rooms[3].stopped = True
        want = b"".join(prefix(len(h), len(p)) + h + p for i, (h, p) in enumerate(records) if i not in (1, 3))
        reading = asyncio.create_task(asyncio.to_thread(read_all, conn, len(want) + 1))
        sent = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert sent == [SENT_STREAM, 0, SENT_STREAM, 0, SENT_STREAM, SENT_STREAM]
        await writer.writable()  # the last record handed over whole
        writer.close()  # EOF: nothing after the four records
        assert await reading == want
        conn.close()
        assert lost == []

    asyncio.run(main())


def test_a_room_cancelled_as_it_is_woken_passes_the_turn_on() -> None:
    """The send loop of a room is cancelled (its agent stopping a task) just as its turn came:
    the waiter after it is woken in its place, and every other record arrives."""
    async def main() -> None:
        writer, _, conn, lost = await connected(send_buffer=16 << 10)
        rooms, records, tasks = waiting_rooms(writer, 4)
        await asyncio.sleep(0)
        assert len(writer._waiters) == 3
        cancel_first_as_woken(writer, tasks[1])  # room 1, first in line (room 0 is writing)
        tasks[2].cancel()  # and room 2 while it waits
        want = b"".join(prefix(len(h), len(p)) + h + p for i, (h, p) in enumerate(records) if i in (0, 3))
        reading = asyncio.create_task(asyncio.to_thread(read_all, conn, len(want) + 1))
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert done[0] == SENT_STREAM and done[3] == SENT_STREAM
        assert isinstance(done[1], asyncio.CancelledError) and isinstance(done[2], asyncio.CancelledError)
        await writer.writable()
        writer.close()
        assert await reading == want
        conn.close()
        assert lost == []

    asyncio.run(main())
