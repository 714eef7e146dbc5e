"""The raw TCP ends of the bench's limits, in processes of their own.

``python raw_tcp.py send HOST:PORT POOL_FILE OFFSET LENGTH``: one of the eight raw TCP senders of
the CP8 block (the limit beside eight sender daemons), or the sender of the raw pair. It maps
``LENGTH`` bytes of the pool file at ``OFFSET`` read-only, connects, and on each command that
arrives on that connection (``<QQQ`` offset, bytes, message size) ``sendall``s those bytes of the
mapping in messages of that size; a zero-byte command or the other end closing ends it.

``python raw_tcp.py receive BENCH_PORT POOL_FILE OFFSET LENGTH CHUNK``: the receiving end of the
raw pair. It maps ``LENGTH`` bytes of the pool file at ``OFFSET`` for writing, listens on a port
of its own for one sender, connects to the bench on ``BENCH_PORT`` and tells it that port
(``<H``), then ``b"r"`` once the sender has connected. On each command from the bench it passes
the command on to the sender and takes the bytes with ``recv_into`` straight into the mapping,
message after message, at most ``CHUNK`` a read (as the bench's own raw TCP limit reads), and
answers ``b"d"``. Both ends of the pair idle between measurements, as transferd's receiver and
sender daemons do, where the bench's raw TCP limit receives in the bench's own process, busy right
up to each measurement.

Run as a script, not imported: the standard library only, so that these start in milliseconds
(importing :mod:`transferd` costs ~0.5 CPU s a process on a 2-core host)."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys
from collections.abc import Iterator

CMD = struct.Struct("<QQQ")
PORT = struct.Struct("<H")


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return b""
        buf += part
    return buf


def _map(path: str, offset: int, length: int, writable: bool) -> tuple[mmap.mmap, memoryview]:
    """The pool file's bytes ``[offset, offset + length)``, shared: the mapping and a view of them."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, offset + length, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)
    return mm, memoryview(mm)[offset:offset + length]


def commands(sock: socket.socket, length: int) -> Iterator[tuple[int, int, int]]:
    """The commands arriving on ``sock`` (offset, bytes, message size), until the other end closes
    or sends a zero-byte one; one for bytes outside the ``length`` mapped raises ValueError."""
    while True:
        cmd = recv_exact(sock, CMD.size)
        if not cmd:
            return
        off, nbytes, size = CMD.unpack(cmd)
        if not nbytes:
            return
        if off + nbytes > length or not 0 < size <= nbytes:
            raise ValueError(f"raw_tcp: a command for {nbytes} bytes at {off} in messages of {size} "
                             f"(the mapping holds {length})")
        yield off, nbytes, size


def send(argv: list[str]) -> int:
    addr, path, offset, length = argv[0], argv[1], int(argv[2]), int(argv[3])
    host, _, port = addr.rpartition(":")
    mm, src = _map(path, offset, length, writable=False)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        for off, nbytes, size in commands(sock, length):
            for o in range(off, off + nbytes, size):
                sock.sendall(src[o:o + size])
        return 0
    finally:
        sock.close()
        src.release()
        mm.close()


def receive(argv: list[str]) -> int:
    bench_port, path, offset, length, chunk = (int(argv[0]), argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    mm, dst = _map(path, offset, length, writable=True)
    listen = socket.create_server(("127.0.0.1", 0))
    listen.settimeout(60)
    bench = socket.create_connection(("127.0.0.1", bench_port))
    bench.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bench.sendall(PORT.pack(listen.getsockname()[1]))
    data, _ = listen.accept()
    listen.close()
    data.settimeout(None)
    bench.sendall(b"r")
    recv_into = data.recv_into
    view = dst[:0]
    try:
        for off, nbytes, size in commands(bench, length):
            data.sendall(CMD.pack(off, nbytes, size))
            for o in range(off, off + nbytes, size):
                view, got = dst[o:min(o + size, off + nbytes)], 0
                while got < len(view):
                    k = recv_into(view[got:got + chunk])
                    if not k:
                        return 3  # the sender closed its connection
                    got += k
            bench.sendall(b"d")
        return 0
    finally:
        data.close()
        bench.close()
        view.release()  # the mapping closes only once no view of it is left
        dst.release()
        mm.close()


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 5 and argv[0] == "send":
            return send(argv[1:])
        if len(argv) == 6 and argv[0] == "receive":
            return receive(argv[1:])
    except ValueError as exc:  # a command outside the mapping: nothing sent or written for it
        print(exc, file=sys.stderr)
        return 2
    print("usage: raw_tcp.py send HOST:PORT POOL_FILE OFFSET LENGTH | "
          "receive BENCH_PORT POOL_FILE OFFSET LENGTH CHUNK", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
