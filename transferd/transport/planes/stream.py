"""The data-stream plane: the ZeroMQ plane's data, data-batch, data-done and done messages as records on
a plain TCP connection to the receiver (docs/PROTOCOL.md §2.1; the wire is
:mod:`transferd.protocol.stream`, the socket :class:`~transferd.transport.data_stream.StreamWriter`).

Sender side (:class:`StreamSender`): the batching is the ZeroMQ plane's; each message becomes
one record, ``prefix | header | payload`` handed to the kernel at once, the payload straight out
of the pool. The connection's stream is read at every message (``ConnPipes.stream``): until it
connects the data waits; when it never connected (``fallback``), or once the shell dropped it,
the messages take the ZeroMQ socket as before.

Receiver side (:class:`StreamReceiver`): each record's header is decoded and checked as the
same message from the ZeroMQ socket; a payload of at least ``DIRECT_MIN_BYTES`` (no checksum) is
read straight into its claimed destination rows (an aux row among them into the stream's buffer,
written once its guard is checked), a smaller one into the stream's buffer and then written as
a ZeroMQ payload would be.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ...errors import FailureCode, TransferdError
from ...protocol.messages import Data, DataBatch, DataDone, Done, decode_header
from ...protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
from ...protocol.room import runs
from ...protocol.stream import prefix
from ...types import Kind, PlaneName
from ..data_stream import StreamReader, Target
from .receiving import PayloadReceiver
from .sending import SENT_STREAM, ConnPipes, RoomTx, SendEnv
from .zmq import ZmqSender


class StreamSender(ZmqSender):
    """The ZeroMQ plane's batching with a larger cap, ``sender.stream_record_bytes``: a
    record's cost is per record (the receiver's Python for its header, checks and claims; the
    sender's for building it), not per byte, so several messages' worth of rows go in one. If
    the stream is lost, those messages take the ZeroMQ socket as they are (the registration's
    ``max_msg`` announced the larger cap)."""

    name = PlaneName.STREAM

    def __init__(self, env: SendEnv, pipes: ConnPipes) -> None:
        super().__init__(env, pipes)
        self.cap = env.stream_record_bytes or env.max_message_bytes

    async def _emit(self, tx: RoomTx, header: bytes, payload: Sequence[Any] = (), nbytes: int = 0, *,
                    rows: bool = False) -> int:
        """As :meth:`ZmqSender._emit`, on the data stream while the connection has one:
        ``SENT_STREAM`` when the stream took the message; the ZeroMQ socket once it has none."""
        room, pipes = tx.room, self.pipes
        while (writer := pipes.stream) is not None:  # one record, payload straight out of the pool
            if writer.try_write([prefix(len(header), nbytes), header, *payload], small=not payload):
                await self._turn()
                return SENT_STREAM
            try:
                await writer.writable()
            except TransferdError:
                if writer.fallback and not room.stopped:
                    continue  # it never connected: the ZeroMQ socket takes the data instead
                raise
            if room.stopped:
                writer.pass_on()
                return 0
        return await super()._emit(tx, header, payload, nbytes, rows=rows)

    def close(self) -> None:
        writer, self.pipes.stream = self.pipes.stream, None
        if writer is not None:
            writer.close()


class RowSink(Protocol):
    """What the stream plane's receiving side needs of the receiver's data path."""

    core: ReceiverCore

    def rows(self, buffer: int) -> np.ndarray: ...

    def data(self, peer: Peer, plane: Any, msg: Data, payload: Any, now: float) -> None: ...

    def done(self, peer: Peer, msg: Done, now: float) -> None: ...

    def landed(self, room: DecodeRoom, how: PlaneName, buffer: int, nbytes: int, now: float) -> None: ...

    def refuse(self, code: str, reason: str, ident: bytes = b"") -> None: ...

    def flush(self) -> None: ...

    def after_data(self, reader: StreamReader) -> None: ...


DIRECT_MIN_BYTES = 64 << 10  # stream payloads this large are read straight into the rows; smaller ones via a buffer


class StreamReceiver(PayloadReceiver):
    """Records of one peer's data stream (:class:`~transferd.transport.data_stream.StreamReader`
    reads them; this says where each payload goes)."""

    name = PlaneName.STREAM

    def record(self, sink: RowSink, reader: StreamReader, peer: Peer, header: bytes, payload_len: int,
               now: float) -> Target:
        """A record's header has arrived: check it and say where its payload goes (an empty
        target drops the payload)."""
        drop = Target([])
        try:
            msg = decode_header(header)
        except TransferdError as exc:
            sink.refuse(exc.code, f"data stream: {exc}", peer.ident)
            return drop
        if isinstance(msg, Done):
            if payload_len:
                sink.refuse("malformed", f"done record with a {payload_len}-byte payload", peer.ident)
            else:
                sink.done(peer, msg, now)  # as every done: the data path's one way in
            return drop
        if not isinstance(msg, (Data, DataBatch, DataDone)):
            sink.refuse("unexpected_type", f"{type(msg).__name__} on a data stream (data, data-batch, data-done "
                                           "and done only)", peer.ident)
            return drop
        if isinstance(msg, DataDone):  # its entries, then the done: after them, or when they are dropped
            done = msg.done
            target = self._rows(sink, reader, peer, msg.entries, payload_len, now, done)
            if not target.views:
                sink.done(peer, done, now)
            return target
        return self._rows(sink, reader, peer, msg.entries if isinstance(msg, DataBatch) else (msg,), payload_len,
                          now)

    def _rows(self, sink: RowSink, reader: StreamReader, peer: Peer, entries: tuple[Data, ...], payload_len: int,
              now: float, done: Done | None = None) -> Target:
        """Where the payload of these entries goes (``done``, when not None, once they landed)."""
        drop = Target([])
        core = sink.core
        n_buffers = len(self._row_bytes)
        sizes = [e.count * self._row_bytes[e.buffer] if e.buffer < n_buffers else -1 for e in entries]
        if min(sizes) < 0 or sum(sizes) != payload_len:
            room = core.data_room(peer, entries[0], now)  # refuses an unknown room or buffer by itself
            if room is not None:
                core.reject(room, peer, FailureCode.LENGTH_MISMATCH, f"data stream record of {payload_len} payload "
                                                                     f"bytes for rows of {sum(sizes)} bytes", now)
            return drop
        if peer.checksum is None and payload_len >= DIRECT_MIN_BYTES:
            return self._direct(sink, reader, peer, entries, sizes, now, done)
        buf = reader.buffer(payload_len)  # this stream's own: records of several streams interleave

        def deliver() -> None:  # then exactly as the same message from the ZeroMQ socket
            at, o = time.monotonic(), 0
            for entry, size in zip(entries, sizes):
                sink.data(peer, self, entry, buf[o:o + size], at)
                o += size
            if done is not None:
                sink.done(peer, done, at)
            sink.flush()
            sink.after_data(reader)
        return Target([buf[:payload_len]], deliver)

    def _direct(self, sink: RowSink, reader: StreamReader, peer: Peer, entries: tuple[Data, ...], sizes: list[int],
                now: float, done: Done | None) -> Target:
        """A large payload (one data entry, or a batch of them) is read straight into its
        destination rows: every check first, the rows of every entry claimed, then the bytes; if
        the room ends while they arrive, the rest is dropped (the reader asks at every wake-up).
        An entry refused (the room failed, or the entry dropped) drops the whole payload; the
        entries after it are counted as the ZeroMQ path counts them. An aux row (its guard is
        checked before it is written) is read into the stream's buffer beside them and then
        written as from the ZeroMQ socket, after the rows before it have landed."""
        core = sink.core
        views: list[memoryview] = []
        room: DecodeRoom | None = None
        aux: list[tuple[Data, memoryview]] = []
        flat: dict[int, tuple[memoryview, int]] = {}  # buffer -> its bytes, row size (a batch has up to 1024 entries)
        nbytes: dict[int, int] = {}  # buffer -> bytes of the record's entries: counted per buffer when they land
        aux_bytes = sum(size for e, size in zip(entries, sizes) if e.kind == Kind.AUX)
        staging = reader.buffer(aux_bytes) if aux_bytes else None
        for i, msg in enumerate(entries):
            room = core.data_room(peer, msg, now)
            if room is not None and msg.kind == Kind.AUX:
                assert staging is not None
                view, staging = staging[:sizes[i]], staging[sizes[i]:]
                aux.append((msg, view))
                views.append(view)
                continue
            claimed = core.claim(room, peer, msg, now) if room is not None else None
            if claimed is None:
                for rest in entries[i + 1:]:
                    core.data_room(peer, rest, now)
                return Target([])
            first, rows = claimed
            b = msg.buffer
            if b not in flat:
                dst = sink.rows(b)
                flat[b] = (dst.reshape(-1).data, dst.shape[1])
            mem, rb = flat[b]
            if rows is None:
                views.append(mem[first * rb:(first + msg.count) * rb])
            else:
                views += [mem[int(rows[a]) * rb:(int(rows[a]) + e - a) * rb] for a, e in runs(rows, rows)]
            nbytes[b] = nbytes.get(b, 0) + sizes[i]
        assert room is not None
        live, rank = room, peer.rank
        core.stream_read(live, rank, +1, now)

        def landed() -> None:
            core.stream_read(live, rank, -1)
            at = time.monotonic()
            for b, n in nbytes.items():  # no room completes before its rank's done
                sink.landed(live, PlaneName.STREAM, b, n, at)
            for msg, view in aux:
                sink.data(peer, self, msg, view, at)
            if done is not None:
                sink.done(peer, done, at)
            sink.flush()
            sink.after_data(reader)

        def alive() -> bool:
            if live.status.state.terminal:
                core.stream_read(live, rank, -1)  # asked no more: the rest is dropped
                if done is not None:
                    sink.done(peer, done, time.monotonic())  # as the done after the dropped rows
                    sink.flush()
                return False
            return True
        return Target(views, landed, alive)
