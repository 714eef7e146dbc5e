"""The receiver's inputs: messages from the ZeroMQ socket and records from data streams, each
taken to the core for its verdict, and the rows the core accepts written into the decode pool
through the peer's data plane."""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from ..errors import TransferdError, VersionMismatch
from ..protocol.messages import (
    MAX_INBOUND_HEADER_BYTES,
    Data,
    DataBatch,
    DataDone,
    DataRef,
    DataRefs,
    Done,
    Fail,
    Ping,
    Pong,
    Register,
    decode_header,
)
from ..protocol.receiver_core import DecodeRoom, Peer
from ..protocol.stream import hello_key
from ..transport.data_stream import StreamReader, Target
from ..transport.planes import ReceiverPlane, StreamReceiver, ZmqReceiver
from ..types import Kind, PlaneName

if TYPE_CHECKING:
    from .agent import Receiver

log = logging.getLogger(__name__)



class DataPath:
    """Dispatch of what peers send, and the one path every data message's rows take:
    the core's checks, the plane's checks, the claim, the write, "landed"."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.core = rx.core
        self.acct = rx.acct
        row_bytes = rx.layout.buffer_row_bytes
        self.zmq = ZmqReceiver(row_bytes)
        self.stream = StreamReceiver(row_bytes)
        self._kind_of = [b.kind for b in rx.layout.buffers]

    # -- the ZeroMQ socket ---------------------------------------------------------------------
    def on_message(self, frames: list[zmq.Frame]) -> None:
        rx = self.rx
        frames_before = self.acct.frames
        try:
            self._on_frames(frames)
        except Exception:  # a bug must not take the receiver down with every room
            log.exception("%s: error while handling a message", rx.name)
            self.acct.refused["internal_error"] += 1
        if self.core.actions:
            rx.act()
        if rx.slow_s and self.acct.frames != frames_before:
            rx.link.pause(rx.slow_s)  # fault injection: a slow decode side

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        core = self.core
        ident = frames[0].bytes
        if len(frames) < 2:
            self.rx.refuse("malformed", "message without a header frame", ident)
            return
        try:
            msg = decode_header(frames[1].buffer, MAX_INBOUND_HEADER_BYTES)  # refused on its size alone
        except TransferdError as exc:
            register = isinstance(exc, VersionMismatch) and exc.msg_type == "register"
            core.undecodable(ident, exc.code, str(exc), register=register, now=time.monotonic())
            return
        now = time.monotonic()
        peer = core.seen(ident, now)
        if isinstance(msg, (DataBatch, DataDone)):
            if len(frames) != 2 + len(msg.entries):
                what = "data-batch" if isinstance(msg, DataBatch) else "data-done"
                self.rx.refuse("malformed", f"{what} of {len(msg.entries)} entries with {len(frames) - 2} "
                                            "payload frames", ident)
                return
            if peer is None:
                core.unregistered(ident, "data", now)
                return
            for entry, frame in zip(msg.entries, frames[2:]):
                self.data(peer, self.zmq, entry, frame.buffer, now)  # each exactly as a data message
            if isinstance(msg, DataDone):
                self.done(peer, msg.done, now)  # then exactly as the done message
            return
        if isinstance(msg, (Data, DataRef, DataRefs)):
            want = 2 if isinstance(msg, DataRef) else 3
            if len(frames) != want:
                what = {Data: "data", DataRef: "data-ref", DataRefs: "data-refs"}[type(msg)]
                self.rx.refuse("malformed", f"{what} message with {len(frames) - 2} payload frames, not {want - 2}",
                               ident)
                return
            if peer is None:
                core.unregistered(ident, "data", now)
                return
            payload = frames[2].buffer if want == 3 else None
            if isinstance(msg, Data):
                self.data(peer, self.zmq, msg, payload, now)
            else:
                self.refs(peer, msg, payload, now)
            return
        if len(frames) != 2:
            self.rx.refuse("malformed", f"{type(msg).__name__} with {len(frames) - 1} frames, not 1", ident)
            return
        if isinstance(msg, Register):
            self.rx.register(ident, msg, now)
        elif peer is None:
            core.unregistered(ident, type(msg).__name__, now)
        elif isinstance(msg, Ping):
            self.rx.send(ident, Pong(msg.seq))
        elif isinstance(msg, Pong):
            pass  # last_seen is already updated
        elif isinstance(msg, Done):
            self.done(peer, msg, now)
        elif isinstance(msg, Fail):
            core.fail(peer, msg, now)
        else:
            self.rx.refuse("unexpected_type", f"{type(msg).__name__} is not sent to a receiver", ident)

    def done(self, peer: Peer, msg: Done, now: float) -> None:
        """A rank's ``done`` (alone, or after the entries of a data-done message)."""
        if self.rx.reads_busy(msg.tok):
            # its rows are still being read: the core hears of it once they settled
            self.rx.after_room_reads(msg.tok, partial(self._late_done, peer, msg))
        else:
            self.core.done(peer, msg, now)

    def _late_done(self, peer: Peer, msg: Done) -> None:
        """A ``done`` that waited for its room's reads to settle."""
        self.core.done(peer, msg, time.monotonic())
        self.flush()

    # -- one data message ----------------------------------------------------------------------
    def refs(self, peer: Peer, msg: DataRef | DataRefs, payload: Any, now: float) -> None:
        room = self.core.data_room(peer, msg, now)
        if room is None:
            return
        plane = self.rx.plane_of(peer)
        if plane is None or plane.name not in (PlaneName.SAME_HOST, PlaneName.MOONCAKE, PlaneName.NIXL):
            self.core.reject(room, peer, "no_shm", f"data-ref rows of buffer {msg.buffer} but neither the "
                                                   "same-host path nor Mooncake TE was agreed", now)
            return
        self._rows(room, peer, plane, msg, payload, now)

    def data(self, peer: Peer, plane: ReceiverPlane, msg: Any, payload: Any, now: float) -> None:
        room = self.core.data_room(peer, msg, now)
        if room is not None:
            self._rows(room, peer, plane, msg, payload, now)

    def _rows(self, room: DecodeRoom, peer: Peer, plane: ReceiverPlane, msg: Any, payload: Any, now: float) -> None:
        core = self.core
        src = plane.source(core, room, peer, msg, payload, now)
        if src is None:
            return
        if msg.kind == Kind.AUX and not core.aux_ok(room, peer, plane.first_row(msg, src), now):
            return
        claimed = core.claim(room, peer, msg, now)
        if claimed is None:
            return
        first, rows = claimed
        assert self.rx.pool is not None
        if plane.write(msg, self.rx.pool.rows[msg.buffer], first, rows, src):
            self.landed(room, plane.name, msg.buffer, msg.count * core.row_bytes(msg.buffer), now)

    def landed(self, room: DecodeRoom, how: PlaneName, buffer: int, nbytes: int, now: float) -> None:
        """Rows of a room are in place: counted by the path they came, then the core's progress."""
        self.acct.add(self._kind_of[buffer], nbytes)
        if how is PlaneName.SAME_HOST:
            self.acct.shm_bytes += nbytes
        elif how is PlaneName.STREAM:
            self.acct.stream_bytes += nbytes
        elif how is PlaneName.MOONCAKE:
            self.acct.mooncake_bytes += nbytes
        elif how is PlaneName.NIXL:
            self.acct.nixl_bytes += nbytes
        self.core.landed(room, nbytes, now)

    # -- data streams (transport/data_stream.py calls these) ----------------------------------
    def stream_hello(self, reader: StreamReader, hello: bytes) -> bool:
        key = hello_key(hello)
        if key is None:
            self.rx.refuse("stream_hello", f"data stream from {reader.addr} began {hello[:8]!r}, not a hello")
            return False
        peer = self.core.stream_opened(key, reader.addr)
        if self.core.actions:
            self.rx.act()
        if peer is None:
            return False
        reader.peer = peer
        self.rx.streams_of[id(peer)] = (peer, reader)
        return True

    def stream_closed(self, reader: StreamReader, reason: str) -> None:
        peer: Peer | None = reader.peer
        if peer is not None:
            entry = self.rx.streams_of.get(id(peer))
            if entry is not None and entry[1] is reader:
                del self.rx.streams_of[id(peer)]
                self.core.stream_closed(peer, reason, time.monotonic())
                if self.core.actions:
                    self.rx.act()
        elif reason:
            log.info("%s: %s", self.rx.name, reason)

    def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
        """A record's header has arrived on a peer's stream: the stream plane says where its
        payload goes (an empty target drops it)."""
        peer: Peer | None = reader.peer
        if peer is None or self.core.peers.get(peer.ident) is not peer:
            return Target([])
        try:
            now = time.monotonic()
            peer.last_seen = now
            return self.stream.record(self, reader, peer, header, payload_len, now)
        except Exception:  # a bug must not take the receiver down with every room; rows may have
            # been claimed without their bytes: the stream ends, so that rank's rooms fail
            log.exception("%s: error while handling a data stream record", self.rx.name)
            self.acct.refused["internal_error"] += 1
            reader.close(f"data stream from {reader.addr}: internal error")
            return Target([])
        finally:
            self.flush()

    # -- what the stream plane asks of the data path (RowSink) --------------------------------
    def rows(self, buffer: int) -> np.ndarray:
        assert self.rx.pool is not None
        return self.rx.pool.rows[buffer]

    def refuse(self, code: str, reason: str, ident: bytes = b"") -> None:
        self.rx.refuse(code, reason, ident)

    def flush(self) -> None:
        """Carry out what the core decided meanwhile."""
        if self.core.actions:
            self.rx.act()

    def after_data(self, reader: StreamReader) -> None:
        if self.rx.slow_s:
            reader.pause(self.rx.slow_s)  # fault injection: a slow decode side
