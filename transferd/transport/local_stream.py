"""The engine API on a Unix stream socket (``unix://PATH``): the same msgpack requests and
replies as the ZeroMQ endpoint, each framed by its length (docs/PROTOCOL.md §17).

Why a second transport: a ZeroMQ request crosses four threads (the client's, its ZeroMQ I/O
thread, the daemon's I/O thread, the daemon's loop) and each crossing is a wake-up; on a small
virtual machine a wake-up of an idle core costs 15-20 µs, and one request's round trip took
130-200 µs against 11-30 µs on a Unix socket read by the loop itself (docs/PERFORMANCE.md).
The framing is a u32 big-endian length, then that many bytes of one message; nothing else.

:class:`UnixFront` is the daemon's end: a listening socket on the event loop, one
:class:`UnixConn` per engine connection, each request handed to ``on_request(conn, body)`` and
each reply written back with :meth:`UnixConn.send`. A connection is closed (and the request
dropped, logged and counted) when a frame is longer than ``max_request``, or when its client
leaves ``MAX_PENDING_REPLY_BYTES`` of replies unread; while a connection holds requests not yet
served it is not read (the client's sends block: backpressure, not memory)."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from .accept import Acceptor
from .loop_socket import prepare_socket_path, restrict_socket_path

log = logging.getLogger(__name__)

FRAME = struct.Struct(">I")  # each message's length, then the message
UNIX_SCHEME = "unix://"
MAX_CONNECTIONS = 1024  # engine connections at once; more are closed as they come
MAX_PENDING_REPLY_BYTES = 256 << 20  # replies a client has not read; past it the connection is closed
READ_BYTES = 256 << 10  # the most one read takes
BUDGET = 64  # requests served per loop callback of one connection


def unix_path(endpoint: str) -> Path | None:
    """The socket path of a ``unix://PATH`` endpoint, else None."""
    return Path(endpoint[len(UNIX_SCHEME):]) if endpoint.startswith(UNIX_SCHEME) and len(endpoint) > 7 else None


class UnixConn:
    """One engine connection: frames in, replies out (never blocking the loop)."""

    __slots__ = ("buf", "closed", "fd", "front", "out", "out_bytes", "reading", "sock")

    def __init__(self, front: UnixFront, sock: socket.socket) -> None:
        self.front = front
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = bytearray()
        self.out: list[memoryview] = []
        self.out_bytes = 0
        self.closed = False
        self.reading = True

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.close(f"read failed: {exc}")
            return
        if not data:
            self.close("")
            return
        self.buf += data
        self._serve()

    def _serve(self) -> None:
        """Hand on the whole frames in the buffer, at most ``BUDGET`` now; while more wait, the
        connection is not read, and the rest are served on the next loop iteration."""
        buf, front = self.buf, self.front
        n = o = 0
        more = False  # frames left for the next loop turn
        while not self.closed and len(buf) - o >= FRAME.size:
            (size,) = FRAME.unpack_from(buf, o)
            if size > front.max_request:
                front.refused["engine_too_large"] += 1
                self.close(f"a request of {size} bytes, over the limit of {front.max_request}")
                return
            end = o + FRAME.size + size
            if len(buf) < end:
                break
            if n == BUDGET:
                self._pause()
                more = True
                front.loop.call_soon(self._serve)
                break
            body = bytes(buf[o + FRAME.size:end])
            o = end
            n += 1
            try:
                front.on_request(self, body)
            except Exception:  # a handler's bug must not stop the socket
                log.exception("%s: error while handling an engine request", front.name)
        if self.closed:
            return
        del buf[:o]
        if not more:
            self._resume()

    def _pause(self) -> None:
        if self.reading:
            self.reading = False
            self.front.loop.remove_reader(self.fd)

    def _resume(self) -> None:
        if not self.reading and not self.closed:
            self.reading = True
            self.front.loop.add_reader(self.fd, self._on_readable)

    def send(self, body: bytes) -> None:
        """Write one reply; what the socket does not take now goes when it is writable. A
        closed connection drops it (its client has gone)."""
        if self.closed:
            log.debug("%s: reply to a closed engine connection dropped", self.front.name)
            return
        head = FRAME.pack(len(body))
        if self.out:
            self.out += [memoryview(head), memoryview(body)]
            self.out_bytes += len(head) + len(body)
        else:
            try:
                n = self.sock.sendmsg([head, body])
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self.close(f"write failed: {exc}")
                return
            if n == len(head) + len(body):
                return
            rest = memoryview(head + body)[n:]
            self.out = [rest]
            self.out_bytes = rest.nbytes
            self.front.loop.add_writer(self.fd, self._on_writable)
        if self.out_bytes > MAX_PENDING_REPLY_BYTES:
            self.front.refused["engine_unread_replies"] += 1
            self.close(f"{self.out_bytes} bytes of replies not read by the engine")

    def _on_writable(self) -> None:
        while self.out and not self.closed:
            try:
                n = self.sock.sendmsg(self.out[:64])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"write failed: {exc}")
                return
            self.out_bytes -= n
            while n:
                v = self.out[0]
                if n >= v.nbytes:
                    n -= v.nbytes
                    self.out.pop(0)
                else:
                    self.out[0] = v[n:]
                    n = 0
        if not self.out and not self.closed:
            self.front.loop.remove_writer(self.fd)

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        loop = self.front.loop
        if self.reading:
            loop.remove_reader(self.fd)
        if self.out:
            loop.remove_writer(self.fd)
        self.out.clear()
        self.buf.clear()
        self.sock.close()
        self.front.conns.discard(self)
        if why:
            log.warning("%s: engine connection closed: %s", self.front.name, why)


class UnixFront:
    """The listening end of a ``unix://`` engine endpoint: its directory created private
    (0700), a stale socket file removed, the socket file 0600 once bound (as for ``ipc://``)."""

    loop: asyncio.AbstractEventLoop  # set by start()

    def __init__(self, path: Path, on_request: Callable[[UnixConn, bytes], None], name: str, max_request: int,
                 refused: Counter[str]) -> None:
        self.path = path
        self.on_request = on_request
        self.name = name
        self.max_request = max_request
        self.refused = refused
        self.conns: set[UnixConn] = set()
        self.acceptor: Acceptor | None = None
        prepare_socket_path(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(str(path))
        except OSError as exc:
            self.sock.close()
            raise ConfigError(f"engine socket unix://{path}: cannot bind: {exc}") from None
        restrict_socket_path(path)
        self.sock.listen(128)
        self.sock.setblocking(False)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.acceptor = Acceptor(loop, self.sock, self._on_conn, f"{self.name} engine API", 64)

    def _on_conn(self, sock: socket.socket, _addr: object) -> None:
        if len(self.conns) >= MAX_CONNECTIONS:
            self.refused["engine_too_many_connections"] += 1
            log.warning("%s: engine connection closed: %d connections already", self.name, len(self.conns))
            sock.close()
            return
        sock.setblocking(False)
        conn = UnixConn(self, sock)
        self.conns.add(conn)
        self.loop.add_reader(conn.fd, conn._on_readable)

    def close(self) -> None:
        if self.acceptor is not None:
            self.acceptor.close()
        for conn in list(self.conns):
            conn.close("")
        self.sock.close()
        self.path.unlink(missing_ok=True)
