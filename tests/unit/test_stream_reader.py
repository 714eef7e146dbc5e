"""transferd.stream.StreamReader on a real socket pair: a payload lands byte for byte in the views
its handler names, each read asking for at most about RECV_CHUNK bytes (reads of a whole 1 MiB
payload were 15-25 % slower on loopback: docs/PERFORMANCE.md item 15), and many small views (the
rows of a batch) are filled several at a time by one scattering read."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

from transferd.stream import HELLO_MAGIC, KEY_BYTES, PREFIX, RECV_CHUNK, StreamReader, Target


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
        handler = Handler([memoryview(dst)[x:y] for x, y in zip(edges, edges[1:])])
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
