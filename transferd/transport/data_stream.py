"""The data stream's sockets: the sender's :class:`StreamWriter`, the receiver's
:class:`StreamReader` and :class:`StreamServer`. The wire (hello, record prefix, limits) is
:mod:`transferd.protocol.stream`; nothing here knows rooms: the receiver says, for each header,
where its payload goes (:class:`Target`)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import StreamError
from ..protocol.stream import HELLO_BYTES, HELLO_TIMEOUT_S, PREFIX, hello, prefix_problem
from .accept import Acceptor
from .turns import wake_first

log = logging.getLogger(__name__)

MAX_PENDING_HELLOS = 64  # connections without a hello yet; beyond it the oldest is closed
IOV_CHUNK = 512  # buffers per sendmsg call (IOV_MAX is 1024 on Linux)
# the sender's SO_SNDBUF (sender.stream_send_buffer_bytes): against 4 MiB, 512 KiB moved 1 MiB rows
# 0.68 -> 0.82-0.95 x a raw TCP socket and CP8 0.59-0.68 -> 0.76-0.85 x eight on loopback, and the
# receiver's copy of the same bytes got cheaper (CP8 0.31 -> 0.22 CPU s/GB): fewer bytes in flight
# are still in the CPU's caches when read (docs/PERFORMANCE.md, issue 14's eighth round)
SEND_BUFFER = 512 << 10
RECEIVE_BUFFER = 4 << 20  # the receiver's SO_RCVBUF (receiver.stream_receive_buffer_bytes)
# the most one recv_into asks for: a read holds the socket's lock while it copies, and the peer's
# segments wait in the backlog meanwhile; reads of 64 KiB moved 1 MiB records 1.15-1.25x faster
# than whole-payload reads on loopback (32 KiB: the same, 16 KiB: slower; docs/history/PERFORMANCE-LOG.md item 15)
RECV_CHUNK = 64 << 10
MAX_SCATTER = 64  # views one read may fill (IOV_MAX is 1024)
# the most one read asks for while two or more streams of one server are inside a payload (a CP
# group's ranks into one receiver): fewer, larger reads mean fewer window updates and fewer
# wake-ups of the senders; CP8 bulk moved 1.25-1.34x faster at 512 KiB than at 64 KiB (docs/PERFORMANCE.md)
MULTI_RECV_CHUNK = 512 << 10
# a hello, a record's prefix or header is read into a buffer of this size, and with it what follows:
# the records behind it (a sender's `done`s of a batch of rooms: one read, not two a record) and
# the start of a payload, copied from there into its views (docs/PERFORMANCE.md, eighth round)
READ_AHEAD = 16 << 10
# the most views filled up (steps) one readable callback acts on: records read ahead are taken
# without a read, so the read budget alone would let a peer's flood of tiny records hold the loop
# for ~100,000 of them; past this, the rest waits for the next turn of the loop (other streams go first)
STEPS_PER_CALL = 128  # a record is two or three steps: its prefix, its header, its payload
SCRATCH_BYTES = 256 << 10  # payload bytes read only to be dropped go through this (one per server)


def stream_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` ZeroMQ endpoint (brackets of IPv6 removed); None for
    other transports (no stream over ipc://)."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[6:].rpartition(":")[0].rpartition(";")[2]  # ZeroMQ's "tcp://source;host:port"
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return "0.0.0.0" if host == "*" else host


def tune_socket(sock: socket.socket, sndbuf: int = 0, rcvbuf: int = 0) -> None:
    """Non-blocking, no Nagle; ``sndbuf``/``rcvbuf`` > 0 set that socket buffer (the kernel doubles
    it, and caps it at net.core.wmem_max/rmem_max); 0 leaves it to the kernel's autotuning."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt, size in ((socket.SO_SNDBUF, sndbuf), (socket.SO_RCVBUF, rcvbuf)):
        if size > 0:
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
            except OSError:
                pass  # refused by the kernel: its default is fine


# -- the sending end ---------------------------------------------------------------------------

class StreamWriter:
    """A sender's end: ``try_write`` hands a record to the kernel at once (no copy in Python: the
    payload buffers are views of the pool) and keeps what the socket did not take; while
    anything is kept, further records wait (``writable``): the socket's buffer is the
    backpressure. When the kept bytes are gone, the first waiter alone is woken (the rest stay
    asleep until it has written: with a hundred rooms behind one stream, waking all of them to
    find it taken again was a hundred wake-ups a record); a woken waiter that will not write
    calls ``pass_on``. The ``done`` records of one loop turn after its first are kept until the
    turn's end (or the next record with a payload) and go together. A broken stream, or any byte from the receiver (it never writes; EOF means it
    closed the stream), calls ``on_lost`` once."""

    def __init__(self, name: str, on_lost: Callable[[str], None], send_buffer: int = SEND_BUFFER) -> None:
        self.name = name
        self.on_lost = on_lost
        self.send_buffer = send_buffer  # SO_SNDBUF (0: the kernel's autotuning)
        self.loop = asyncio.get_running_loop()
        self.sock: socket.socket | None = None
        self.pending: list[Any] = []
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.closed = False
        self.connected = False
        self.fallback = False  # the connect failed before any byte: its messages take ZeroMQ
        self.error = ""
        self.records = 0  # records handed to the kernel whole
        self._corked: list[Any] = []  # small records of this turn of the loop, not handed over yet
        self._cork: asyncio.Handle | None = None  # the turn's end, when they go

    async def connect(self, host: str, port: int, key: bytes, timeout_s: float) -> None:
        """Connect and send the hello; raises :class:`StreamError` naming the address."""
        deadline = self.loop.time() + timeout_s
        try:
            infos = await self.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            # IPv4 first, as ZeroMQ (its IPV6 option is off): a name with both kinds of address
            # must reach the receiver where its ZeroMQ socket did
            infos.sort(key=lambda info: info[0] != socket.AF_INET)
            for i, (family, _, _, _, addr) in enumerate(infos):
                sock = socket.socket(family, socket.SOCK_STREAM)
                tune_socket(sock, sndbuf=self.send_buffer)
                try:
                    await asyncio.wait_for(self.loop.sock_connect(sock, addr),
                                           max(0.001, deadline - self.loop.time()))
                    break
                except BaseException as exc:
                    sock.close()
                    if i == len(infos) - 1 or not isinstance(exc, OSError):
                        raise
        except (OSError, asyncio.TimeoutError) as exc:
            raise StreamError(f"data stream to {host}:{port}: {exc or 'connect timed out'}") from None
        if self.closed:
            sock.close()
            raise StreamError(f"{self.name}: data stream closed while connecting")
        self.sock = sock
        self.connected = True
        self.loop.add_reader(sock.fileno(), self._on_readable)
        if not self.try_write([hello(key)]):
            raise StreamError(f"data stream to {host}:{port}: {self.error}")
        self.records = 0  # the hello is not one

    def try_write(self, bufs: list[Any], *, small: bool = False) -> bool:
        """Hand one record to the kernel; False (nothing taken) while earlier bytes still wait,
        before the connection is up, or once the stream is lost. A ``small`` record (no payload:
        a ``done``) that follows another small one in the same turn of the loop is kept and goes
        with the others at the turn's end, in one call (the first goes at once: a lone room's
        latency is unchanged); a record with a payload takes the kept ones with it, in order."""
        if self.pending or not self.connected or self.closed:
            return False
        if small and self._cork is not None:
            self._corked.extend(bufs)
            self.records += 1
            return True
        if self._corked:
            bufs, self._corked = self._corked + bufs, []
        self.pending = bufs
        self._flush()
        if self.closed:
            return False
        self.records += 1
        if small and self._cork is None:
            self._cork = self.loop.call_soon(self._uncork)
        return True

    def _uncork(self) -> None:
        self._cork = None
        if self._corked and not self.closed:  # nothing else waits: records are kept only while none does
            self.pending, self._corked = self._corked, []
            self._flush()

    def _flush(self) -> None:
        sock = self.sock
        assert sock is not None
        pending = self.pending
        while pending:
            part = pending[:IOV_CHUNK]
            try:
                n = sock.sendmsg(part)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                self._lost(f"data stream broken: {exc}")
                return
            for i, b in enumerate(part):  # drop what went out, keep the rest of a partly sent buffer
                size = memoryview(b).nbytes
                if n < size:
                    if n:
                        part[i] = memoryview(b).cast("B")[n:]
                    pending = part[i:] + pending[len(part):]
                    self.pending = pending
                    self.loop.add_writer(sock.fileno(), self._on_writable)
                    return
                n -= size
            pending = pending[len(part):]
        self.pending = []
        self.loop.remove_writer(sock.fileno())
        self._wake_one()

    def _wake_one(self) -> None:
        wake_first(self._waiters)

    def pass_on(self) -> None:
        """A woken waiter that will not write after all (its room stopped; a cancelled one is
        handled in ``writable``): the next waiter gets the turn, so none is left waiting on an
        idle stream."""
        if not self.pending and self.connected and not self.closed:
            self._wake_one()

    def _on_writable(self) -> None:
        if not self.closed:
            self._flush()

    def _on_readable(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(64)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(f"data stream broken: {exc}")
            return
        self._lost("the receiver closed the data stream" if not data else
                   "the receiver wrote on the data stream (it never should)")

    async def writable(self) -> None:
        """Wait until a record may be written (raises once the stream is lost or closed)."""
        if self.closed:
            raise StreamError(f"{self.name}: {self.error or 'data stream closed'}")
        if not self.pending and self.connected:
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            self.pass_on()  # it may have been woken already: the turn must not end with it
            raise

    def _lost(self, reason: str) -> None:
        if self.closed:
            return
        self.error = reason
        self.close()
        self.on_lost(reason)

    def close(self) -> None:
        if self.closed:
            return
        if self._cork is not None:  # what this turn kept goes as far as the kernel takes it
            self._cork.cancel()
            self._uncork()
            if self.closed:
                return
        self.closed = True
        self.pending = []
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
            self.sock.close()
        for w in self._waiters:
            if not w.done():
                w.set_exception(StreamError(f"{self.name}: {self.error or 'data stream closed'}"))
        self._waiters.clear()


# -- the receiving end -------------------------------------------------------------------------

@dataclass(slots=True)
class Target:
    """Where a record's payload goes: ``views`` filled in order (together exactly the payload's
    length); ``alive`` is asked before the reads of each readable callback (False: the rest is
    read and dropped; nothing else runs on the loop between the reads of one callback);
    ``done`` runs once they are full (not when dropped)."""

    views: list[memoryview]
    done: Callable[[], None] | None = None
    alive: Callable[[], bool] | None = None


class StreamHandler(Protocol):
    def stream_hello(self, reader: StreamReader, hello: bytes) -> bool: ...
    def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target: ...
    def stream_closed(self, reader: StreamReader, reason: str) -> None: ...


class StreamReader:
    """A receiver's end of one stream: the hello, then records, read straight into the views the
    handler names. Framing errors (a header or payload larger than the limits) end the stream;
    everything the framing survives is the handler's to refuse."""

    def __init__(self, sock: socket.socket, addr: str, handler: StreamHandler, max_payload: int,
                 scratch: memoryview, budget: int = 64, busy: list[int] | None = None) -> None:
        self.sock = sock
        self._busy = busy if busy is not None else [0]  # streams of the server inside a payload
        self.addr = addr
        self.handler = handler
        self.max_payload = max_payload
        self.scratch = scratch
        self.budget = budget
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.peer: Any = None  # set by the handler at the hello
        self.accepted = time.monotonic()
        self._buffer = bytearray(0)
        self._small = bytearray(max(HELLO_BYTES, PREFIX.size))
        self._state = "hello"
        self._views: list[memoryview] = [memoryview(self._small)[:HELLO_BYTES]]
        self._ahead = memoryview(bytearray(READ_AHEAD))
        self._ahead_lo = self._ahead_hi = 0  # bytes read ahead, not taken yet: _ahead[lo:hi]
        self._again: asyncio.Handle | None = None  # a call for what was read ahead (the socket may stay quiet)
        self._vi = 0  # the view being filled (an index: a record may have thousands of views)
        self._got = 0  # bytes already in it
        self._target: Target | None = None
        self._paused: asyncio.TimerHandle | None = None
        self.rx_bytes = 0  # bytes read so far (the receiver's tick tells a stalled stream by it)
        self.rx_seen = 0  # rx_bytes at the receiver's last tick
        self._hello_timer: asyncio.TimerHandle | None = self.loop.call_later(HELLO_TIMEOUT_S, self._hello_late)
        self.loop.add_reader(sock.fileno(), self._on_readable)

    def buffer(self, n: int) -> memoryview:
        """This stream's own buffer of at least ``n`` bytes, for a payload the handler wants
        whole before it acts (records of other streams arrive meanwhile)."""
        if len(self._buffer) < n:
            self._buffer = bytearray(n)
        return memoryview(self._buffer)

    def _hello_late(self) -> None:
        self._hello_timer = None
        if self._state == "hello":
            self.close(f"no hello within {HELLO_TIMEOUT_S:g}s")

    def pause(self, seconds: float) -> None:
        """Read nothing for ``seconds`` (fault injection: a slow decode side)."""
        if self._paused is None and not self.closed:
            self.loop.remove_reader(self.sock.fileno())
            self._paused = self.loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._on_readable)
            self._call_again()  # what was read before the pause

    def _call_again(self) -> None:
        """Bytes read ahead wait and the socket may have none: call the reader at the loop's next turn."""
        if self._ahead_lo < self._ahead_hi and self._again is None and not self.closed:
            self._again = self.loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        if self._again is not None:
            self._again.cancel()
            self._again = None
        recv_into, recvmsg_into = self.sock.recv_into, self.sock.recvmsg_into
        # the payload's owner is asked once a call: nothing else runs on the loop until this
        # returns, and a new target comes from a handler that has just checked its room
        t = self._target
        if t is not None and t.alive is not None and not t.alive():
            self._drop_rest()
        ahead = self._ahead
        reads = steps = 0
        drained = False  # a read came back short: the socket was empty a moment ago
        while True:
            if self.closed or self._paused is not None:
                return  # a resumed stream is called again: what was read ahead waits for it
            views, vi, got = self._views, self._vi, self._got
            view = views[vi]
            left = len(view) - got
            lo, hi = self._ahead_lo, self._ahead_hi
            if lo < hi:  # bytes read ahead come first
                n = min(hi - lo, left)
                view[got:got + n] = ahead[lo:lo + n]
                self._ahead_lo = lo + n
            elif drained or reads >= self.budget:
                return  # the loop's readiness is level-triggered: it calls again while bytes wait
            else:
                ahead_read = self._state != "payload"
                # at each read: a record's header read in this call may have just entered its payload
                chunk = RECV_CHUNK if self._busy[0] <= 1 else MULTI_RECV_CHUNK
                if not ahead_read and left > chunk:
                    # inside a view larger than a read: chunk after chunk in a loop of its own, the
                    # general loop's bookkeeping once for all of them; its last chunk (which may
                    # fill the next views too) is the general loop's
                    start, end, k = got, len(view) - chunk, 0
                    try:
                        while True:
                            reads += 1
                            k = recv_into(view[got:got + chunk])
                            got += k
                            if k < chunk or got >= end or reads >= self.budget:
                                break
                    except BlockingIOError:
                        k = -1
                    except OSError as exc:
                        self.close(f"data stream from {self.addr} broken: {exc}")
                        return
                    self.rx_bytes += got - start
                    self._got = got
                    if not k:
                        self.close(f"data stream from {self.addr} closed in mid-message")
                        return
                    if k < 0:
                        return
                    drained = k < chunk
                    continue
                reads += 1
                try:
                    if ahead_read:  # a hello, a prefix or a header: take the records behind it too
                        asked, n = len(ahead), recv_into(ahead)
                    elif left >= chunk or vi + 1 == len(views):
                        slot = view[got:got + chunk]
                        asked, n = len(slot), recv_into(slot)
                    else:  # small views left (rows of a batch): one read fills as many as a chunk holds
                        bufs, room = [view[got:]], chunk - left
                        for v in views[vi + 1:vi + MAX_SCATTER]:
                            if room <= 0:
                                break
                            bufs.append(v[:room])
                            room -= len(v)
                        asked, n = chunk - max(room, 0), recvmsg_into(bufs)[0]
                except BlockingIOError:
                    return
                except OSError as exc:
                    self.close(f"data stream from {self.addr} broken: {exc}")
                    return
                if not n:
                    at_boundary = self._state == "prefix" and got == 0
                    self.close(f"data stream from {self.addr} closed" + ("" if at_boundary else " in mid-message"))
                    return
                self.rx_bytes += n
                drained = n < asked
                if ahead_read:
                    self._ahead_lo, self._ahead_hi = 0, n
                    continue  # taken from the buffer at the next turn
            if n < left:
                self._got = got + n
                continue
            n -= left  # the view is full; the rest of the read went into the next ones
            vi += 1
            while n and n >= len(views[vi]):
                n -= len(views[vi])
                vi += 1
            self._vi, self._got = vi, n
            if vi == len(views):
                try:
                    self._step()
                except Exception:  # a bug: end this stream, not the loop (nothing left to read into)
                    log.exception("data stream from %s: error while handling a record", self.addr)
                    self.close(f"data stream from {self.addr}: internal error")
                    return
                steps += 1
                if steps >= STEPS_PER_CALL:
                    self._call_again()
                    return

    def in_record(self) -> str:
        """Where in a record the stream is: "" between records (or before its hello), else a
        description such as "the payload of a record (40960 of 131072 bytes)"."""
        state = self._state
        if state == "hello" or (state == "prefix" and self._vi == 0 and self._got == 0):
            return ""
        done = sum(len(v) for v in self._views[:self._vi]) + self._got
        total = sum(len(v) for v in self._views)
        what = {"prefix": "a record's prefix", "header": "a record's header"}.get(state, "the payload of a record")
        return f"{what} ({done} of {total} bytes)"

    def _drop_rest(self) -> None:
        """The payload's owner is gone: read the rest of it into the scratch and drop it."""
        vi = self._vi
        left = len(self._views[vi]) - self._got + sum(len(v) for v in self._views[vi + 1:])
        self._expect(self._skip_views(left))
        assert self._target is not None
        self._target.done = self._target.alive = None

    def _skip_views(self, n: int) -> list[memoryview]:
        step = len(self.scratch)
        return [self.scratch[:min(step, n - i)] for i in range(0, n, step)]

    def _step(self) -> None:
        """The views are full: act on what they held and name the next ones."""
        state = self._state
        if state == "hello":
            if self._hello_timer is not None:
                self._hello_timer.cancel()
                self._hello_timer = None
            if not self.handler.stream_hello(self, bytes(self._small[:HELLO_BYTES])):
                self.close()
                return
            self._expect_prefix()
        elif state == "prefix":
            hlen, plen = PREFIX.unpack_from(self._small)
            problem = prefix_problem(hlen, plen, self.max_payload)
            if problem:
                self.close(f"data stream from {self.addr}: {problem}")
                return
            self._state, self._plen = "header", plen
            self._header = bytearray(hlen)
            self._expect([memoryview(self._header)])
        elif state == "header":
            target = self.handler.stream_record(self, bytes(self._header), self._plen)
            if self.closed:
                return
            if self._plen == 0:
                if target.done is not None:
                    target.done()
                self._expect_prefix()
                return
            self._state, self._target = "payload", target
            self._busy[0] += 1
            self._expect(list(target.views) if target.views else self._skip_views(self._plen))
            if not target.views:
                target.done = target.alive = None
        else:  # payload
            finished, self._target = self._target, None
            self._busy[0] -= 1
            self._expect_prefix()
            if finished is not None and finished.done is not None:
                finished.done()

    def _expect(self, views: list[memoryview]) -> None:
        """Read into these views next, from the first byte of the first."""
        self._views, self._vi, self._got = views, 0, 0

    def _expect_prefix(self) -> None:
        self._state = "prefix"
        self._expect([memoryview(self._small)[:PREFIX.size]])

    def close(self, reason: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        if self._state == "payload":  # counted in on entering it; a closed stream reads no more
            self._busy[0] -= 1
        for timer in (self._hello_timer, self._paused, self._again):
            if timer is not None:
                timer.cancel()
        if self._paused is None:
            self.loop.remove_reader(self.sock.fileno())
        self._paused = None
        self.sock.close()
        self._expect([])
        self._target = None
        self.handler.stream_closed(self, reason)


class StreamServer:
    """The receiver's listening socket for data streams."""

    def __init__(self, host: str, port: int, handler: StreamHandler, max_payload: int,
                 receive_buffer: int = RECEIVE_BUFFER) -> None:
        self.loop = asyncio.get_running_loop()
        self.handler = handler
        self.max_payload = max_payload
        self.receive_buffer = receive_buffer  # SO_RCVBUF of each accepted stream (0: autotuning)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            raise StreamError(f"data stream: cannot listen on {host}:{port}: {exc}") from None
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.readers: set[StreamReader] = set()
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))  # one loop: one reader reads at a time
        self._busy = [0]
        self.refused_unhelloed = 0
        self.acceptor = Acceptor(self.loop, self.sock, self._on_conn, "data stream", 16)

    def _on_conn(self, conn: socket.socket, addr: Any) -> None:
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        waiting = [r for r in self.readers if r.peer is None]
        if len(waiting) >= MAX_PENDING_HELLOS:
            # a flood of silent connections: a sender writes its hello as soon as it is
            # connected, so the one that has waited longest goes
            oldest = min(waiting, key=lambda r: r.accepted)
            self.refused_unhelloed += 1
            if self.refused_unhelloed in (1, 10, 100) or self.refused_unhelloed % 1000 == 0:
                log.warning("data stream: %d connections closed unheard (%d waiting for their hello at "
                            "once; the oldest goes, from %s)", self.refused_unhelloed, MAX_PENDING_HELLOS,
                            oldest.addr)
            oldest.close()
        tune_socket(conn, rcvbuf=self.receive_buffer)
        self.readers.add(StreamReader(conn, where, self, self.max_payload, self._scratch, busy=self._busy))

    # the server sits between the readers and the handler, to forget closed readers
    def stream_hello(self, reader: StreamReader, hello: bytes) -> bool:
        return self.handler.stream_hello(reader, hello)

    def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
        return self.handler.stream_record(reader, header, payload_len)

    def stream_closed(self, reader: StreamReader, reason: str) -> None:
        self.readers.discard(reader)
        self.handler.stream_closed(reader, reason)

    def close(self) -> None:
        self.acceptor.close()
        self.sock.close()
        for r in list(self.readers):
            r.close()
