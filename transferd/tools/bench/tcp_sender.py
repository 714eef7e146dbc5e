"""One of the eight raw TCP senders of the CP8 block (the limit beside eight sender daemons):
``python tcp_sender.py HOST:PORT POOL_FILE OFFSET LENGTH`` maps ``LENGTH`` bytes of the pool file
at ``OFFSET`` read-only, connects, and on each command from the bench — ``<QQQ`` offset, bytes,
message size — ``sendall``s those bytes of the mapping in messages of that size; a zero-byte
command or the bench closing the connection ends it.

Run as a script, not imported: the standard library only, so that eight of them start in
milliseconds (importing :mod:`transferd` costs ~0.5 CPU s a process on a 2-core host)."""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys

CMD = struct.Struct("<QQQ")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return b""
        buf += part
    return buf


def main(argv: list[str]) -> int:
    addr, path, offset, length = argv[0], argv[1], int(argv[2]), int(argv[3])
    host, _, port = addr.rpartition(":")
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, offset + length, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    src = memoryview(mm)[offset:offset + length]
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            cmd = _recv_exact(sock, CMD.size)
            if not cmd:
                return 0
            off, nbytes, size = CMD.unpack(cmd)
            if not nbytes:
                return 0
            for o in range(off, off + nbytes, size):
                sock.sendall(src[o:o + size])
    finally:
        sock.close()
        src.release()
        mm.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
