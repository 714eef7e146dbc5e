"""transferd.stream.StreamReader on a real socket pair: a payload larger than one read lands byte
for byte in the views its handler names, each read asking for at most RECV_CHUNK bytes (reads of
a whole 1 MiB payload were 15-25 % slower on loopback: docs/PERFORMANCE.md item 15)."""

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


def test_a_large_payload_is_read_in_chunks_into_the_named_views() -> None:
    payload = os.urandom(3 * RECV_CHUNK * 5 + 7)  # across both views, not a multiple of a read
    split = len(payload) // 3 + 1

    async def main() -> tuple[bytes, list[int], list[bytes]]:
        a, b = socket.socketpair()
        a.setblocking(False)
        dst = bytearray(len(payload))
        handler = Handler([memoryview(dst)[:split], memoryview(dst)[split:]])
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

    got, asked, headers = asyncio.run(main())
    assert headers == [b"hdr"]
    assert got == payload
    assert max(asked) <= RECV_CHUNK
    assert asked.count(RECV_CHUNK) >= len(payload) // RECV_CHUNK // 2  # the payload went in full-size reads
