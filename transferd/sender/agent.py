"""The prefill-side sender agent of one CP rank.

It registers with every configured receiver, learns each room's destinations from the receiver
that expects it (``assign``), and streams what the shared policy says this rank sends: its KV
slice (coalesced runs, zero-copy out of the pool, ≤ ``max_message_bytes`` per message), the
replicated state only if the de-dup leaves it to this rank, the aux row on rank 0, then ``done``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import random
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from .. import __version__
from ..config import Config
from ..daemon.accounting import Accounting
from ..daemon.base import AgentBase
from ..errors import BadRequest, IndexOutOfRange, TransferdError, UnknownRoom
from ..layout import KINDS, PoolLayout, layout_difference
from ..pool import Pool, host_boot_id
from ..protocol.checksum import checksum_function
from ..protocol.engine_api import ints, slot_map, u64
from ..protocol.messages import (
    MAX_BATCH_ENTRIES,
    PROTOCOL_VERSION,
    Assign,
    Data,
    DataBatch,
    DataRefs,
    Done,
    Fail,
    Ping,
    Pong,
    Register,
    Registered,
    Status,
    decode_header,
    encode,
)
from ..protocol.policy import RankPlan, rank_plan
from ..protocol.room import RoomState, RoomStatus, advance, runs
from ..protocol.stream import prefix
from ..transport import zerocopy
from ..transport.curve import load_keypair, load_public_key, watch_handshakes
from ..transport.data_stream import StreamWriter, stream_host
from ..transport.local_api import LocalApiServer
from ..transport.loop_socket import LoopSocket, configure
from ..types import SplitMode

log = logging.getLogger(__name__)

TERMINAL_RETENTION = 100_000
SENT_ZMQ, SENT_STREAM = 1, 2  # how _emit sent a message (0: not at all)
STREAM_FAILURES, STREAM_BACKOFF_S = 3, 300.0  # streams lost unused in a row; then ZeroMQ for this long


@dataclass(slots=True)
class Conn:
    endpoint: str
    sock: zmq.Socket[Any]
    link: LoopSocket
    rows: zerocopy.PoolSender | None = None  # zero-copy rows without pyzmq's reference keeping (zerocopy.py)
    state: str = "registering"  # registering | registered | refused
    receiver: str = ""
    receiver_inc: int = 0
    reason: str = ""
    last_heard: float = 0.0
    last_register: float = 0.0
    epoch: int = 0
    shm: bool = False  # the receiver reads our pool directly (same host)
    stream: StreamWriter | None = None  # data, data-batch and done go on this plain TCP stream (stream.py)
    stream_failures: int = 0  # streams lost in a row before carrying a record
    no_stream_until: float = 0.0  # after too many of those: do not ask for one before this time


@dataclass(slots=True)
class Chunk:
    start: int
    src: np.ndarray
    last: bool
    state: dict[str, np.ndarray]
    aux_slot: int | None

    @property
    def end(self) -> int:
        return self.start + len(self.src)


@dataclass(slots=True)
class SendRoom:
    room: int
    created: float = field(default_factory=time.monotonic)
    status: RoomStatus = field(default_factory=lambda: RoomStatus(RoomState.BOOTSTRAPPING))
    conn: Conn | None = None
    assign: Assign | None = None
    plan: RankPlan | None = None
    dst: np.ndarray | None = None
    chunks: collections.deque[Chunk] = field(default_factory=collections.deque)
    next_start: int = 0
    last_submitted: bool = False
    sending: bool = False
    planned: tuple[int, int, int] = (0, 0, 0)  # kv, state, aux bytes this rank sends (known once assigned)
    sent: int = 0
    handed: bool = False  # something of this room was handed to ZeroMQ (frames may still read the pool)
    ending: RoomStatus | None = None  # failed here while frames may be in flight: waits for the receiver
    ending_since: float = 0.0
    batch: list[tuple[Data, np.ndarray, bool]] = field(default_factory=list)  # small entries not yet sent
    batch_bytes: int = 0

    @property
    def stopped(self) -> bool:
        """Send nothing more for this room."""
        return self.status.state.terminal or self.ending is not None
    waiters: list[asyncio.Future[None]] = field(default_factory=list)


class SenderAgent(AgentBase):
    def __init__(self, cfg: Config, *, pool: Pool | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        s = cfg.sender
        self.scfg = s
        self.group, self.rank, self.cp_size = s.group, s.cp_rank, s.cp_size
        self.split = SplitMode.parse(s.split)
        self.name = f"sender {s.group}/r{s.cp_rank}"
        self.layout: PoolLayout = pool.layout if pool is not None else cfg.sender_layout()
        self.pool = pool
        self._own_pool = False
        self.incarnation = random.getrandbits(63)
        self.acct = Accounting()
        self.conns: list[Conn] = []
        self.rooms: dict[int, SendRoom] = {}  # live rooms
        self.ended: collections.OrderedDict[int, SendRoom] = collections.OrderedDict()  # the last terminal ones
        self.checksum = checksum_function(s.checksum)
        self.faults = cfg.faults
        self._faults_on = cfg.faults.active  # checked per data message: computed once
        self._fault_rng = random.Random(cfg.faults.seed * 1000 + s.cp_rank)
        self.engine_endpoint = ""
        self._kv0 = self.layout.indices("kv")[0] if self.layout.indices("kv") else None
        self.metrics_bind = s.metrics_bind
        self.metrics_port_offset = s.cp_rank
        self.drain_timeout_s = s.drain_timeout_s
        self._burst = 0  # messages sent since the data path last gave the loop a turn
        self._plans: dict[tuple[int, int], RankPlan] = {}

    # -- lifecycle -----------------------------------------------------------------------
    async def _start(self) -> None:
        assert self.ctx is not None
        if self.pool is None:
            name = self.cfg.sender_pool_name()
            if self.scfg.create_pool:
                self.pool = Pool.create(name, self.layout, exist_ok=True)
                self._own_pool = True  # created or re-attached after a restart: this daemon owns it
            else:
                self.pool = Pool.attach(name)
                diff = layout_difference(self.pool.layout, self.layout, "pool", "config")
                if diff:
                    raise TransferdError(f"pool {name!r} does not match the configuration: {diff}")
                self.layout = self.pool.layout
        ident = f"{self.group}/{self.rank}/{self.incarnation:016x}".encode()
        keys = None
        if self.scfg.curve_secret_key:
            keys = (*load_keypair(self.scfg.curve_secret_key, "sender.curve_secret_key"),
                    load_public_key(self.scfg.curve_server_key, "sender.curve_server_key"))
        assert self.zctx is not None
        for ep in self.scfg.receivers:
            sock = self.zctx.socket(zmq.DEALER)
            configure(sock, hwm=self.scfg.send_hwm)
            sock.setsockopt(zmq.IDENTITY, ident)
            if keys is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
                self.spawn(watch_handshakes(sock, self.ctx, self._handshake_failed), f"handshakes {ep}")
            sock.connect(ep)
            conn = Conn(ep, sock, None)  # type: ignore[arg-type]  # the link needs the conn for its handler
            conn.link = LoopSocket(sock, functools.partial(self._on_message, conn), f"{self.name} → {ep}")
            if self.scfg.zero_copy == "direct" and zerocopy.available():
                conn.rows = zerocopy.PoolSender(sock)
            self.conns.append(conn)
            self._register(conn)
        self.api = LocalApiServer(self.zctx, self.cfg.sender_engine_socket(), {
            "submit": self._api_submit, "poll": self._api_poll, "wait": self._api_wait,
            "abort": self._api_abort, "stats": lambda r: self.stats(), "status": lambda r: self.status(),
            "ping": lambda r: {"name": self.name, "pid": os.getpid()},
        }, self.name, self.acct.refused)
        self.engine_endpoint = self.api.bound
        self.spawn(self.api.run(), "engine-api")
        self.spawn(self._tick_loop(), "tick")
        self.spawn(self._ready_when_registered(), "ready")
        log.info("%s: cp %d/%d split %s, receivers %s, engine API on %s, pool %s", self.name, self.rank,
                 self.cp_size, self.split.value, ", ".join(self.scfg.receivers), self.engine_endpoint,
                 self.pool.name)

    async def _ready_when_registered(self, limit_s: float = 10.0) -> None:
        """Ready once registered with every receiver — or after ``limit_s`` with a receiver
        missing (a receiver that is down must not keep the prefill side from starting)."""
        assert self.ready is not None
        deadline = time.monotonic() + limit_s
        while any(c.state != "registered" for c in self.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.ready.set()

    async def _close(self) -> None:
        for room in list(self.rooms.values()):
            self._end_now(room, "shutdown", f"shutting down: sender {self.group}/r{self.rank} stopped before the "
                                            "room ended")
        await asyncio.sleep(0.05)  # let the engines' pending waits and the fail messages go out
        if hasattr(self, "api"):
            self.api.close()
        for c in self.conns:
            self._drop_stream(c)
            c.link.close(linger=500)
        if self.pool is not None and self._own_pool:
            self.pool.unlink()  # the name goes now; the mapping stays until the context is gone

    def _after_context(self) -> None:
        if self.pool is not None:
            self.pool.close()  # no I/O thread can still be sending rows out of it

    def _handshake_failed(self, kind: str, what: str) -> None:
        self.acct.refused[kind] += 1
        log.error("%s: a receiver refused this sender at the security handshake (%s): check "
                  "sender.curve_secret_key / curve_server_key and the receiver's allow-list", self.name, what)

    def _register(self, conn: Conn) -> None:
        conn.last_register = time.monotonic()
        self._send_ctrl(conn, Register(self.group, self.rank, self.cp_size, self.split.value,
                                       self.layout.fingerprint(), self.layout.to_wire(), self.incarnation,
                                       os.getpid(), socket.gethostname(), conn.epoch, self.scfg.checksum,
                                       host_boot_id(), self.pool.name if self.scfg.same_host == "auto" and self.pool
                                       else "", self.pool.pool_id if self.pool else 0, self.scfg.max_message_bytes,
                                       self.scfg.dedup, self.scfg.data_stream == "auto"
                                       and stream_host(conn.endpoint) is not None
                                       and time.monotonic() >= conn.no_stream_until))

    def _send_ctrl(self, conn: Conn, msg: Any) -> None:
        """Small control message, never blocking the loop (dropped and counted if the pipe is full)."""
        try:
            if conn.link.try_send([encode(msg)]):
                return
            why = "the pipe is full"
        except zmq.ZMQError as exc:
            why = str(exc)
        self.acct.dropped[f"ctrl_{type(msg).__name__.lower()}"] += 1
        log.debug("%s: %s to %s not sent: %s", self.name, type(msg).__name__, conn.endpoint, why)

    # -- network input -------------------------------------------------------------------
    def _on_message(self, conn: Conn, frames: list[bytes]) -> None:
        try:
            self._on_frames(conn, frames)
        except Exception:
            log.exception("%s: error while handling a message from %s", self.name, conn.endpoint)
            self.acct.refused["internal_error"] += 1

    def _on_frames(self, conn: Conn, frames: list[bytes]) -> None:
        conn.last_heard = time.monotonic()
        if len(frames) != 1:
            self.acct.refused["malformed"] += 1
            log.warning("%s: message with %d frames from %s refused", self.name, len(frames), conn.endpoint)
            return
        try:
            msg = decode_header(frames[0])
        except TransferdError as exc:
            self.acct.refused[exc.code] += 1
            log.warning("%s: refused message from %s: %s", self.name, conn.endpoint, exc)
            return
        if isinstance(msg, Registered):
            self._on_registered(conn, msg)
        elif isinstance(msg, Ping):
            self._send_ctrl(conn, Pong(msg.seq))
        elif isinstance(msg, Pong):
            pass
        elif conn.state != "registered":
            self.acct.refused["not_registered"] += 1
        elif isinstance(msg, Assign):
            self._on_assign(conn, msg)
        elif isinstance(msg, Status):
            self._on_status(conn, msg)
        else:
            self.acct.refused["unexpected_type"] += 1
            log.warning("%s: %s is not sent to a sender; refused", self.name, type(msg).__name__)

    def _on_registered(self, conn: Conn, msg: Registered) -> None:
        if msg.ok:
            again = conn.state == "registered" and conn.receiver_inc == msg.incarnation
            if conn.state == "registered" and not again:
                self._conn_lost(conn, f"receiver {conn.receiver} restarted")
            conn.state, conn.receiver, conn.receiver_inc, conn.reason = "registered", msg.receiver, msg.incarnation, ""
            if again:
                return  # the answer to a repeated register: the connection, its path and stream go on
            conn.shm = msg.shm
            self._drop_stream(conn)
            host = stream_host(conn.endpoint)
            if msg.stream_port and host is not None and not msg.shm and self.scfg.data_stream == "auto":
                writer = conn.stream = StreamWriter(f"{self.name} → {conn.endpoint}", lambda why: None)
                writer.on_lost = functools.partial(self._stream_lost, conn, writer)
                self.spawn(self._connect_stream(conn, writer, host, msg.stream_port, msg.stream_key),
                           f"stream {conn.endpoint}")
            log.info("%s: registered with receiver %s at %s (%s)", self.name, msg.receiver, conn.endpoint,
                     "same-host path: the receiver reads this pool" if msg.shm else
                     f"data stream to port {msg.stream_port}" if conn.stream else "data over the socket")
        elif msg.retry:
            if conn.state == "registered":
                self._conn_lost(conn, f"receiver {msg.receiver} at {conn.endpoint} no longer knows this sender "
                                      "(it restarted, or gave this sender up after a pause or a cut link)")
            conn.state = "registering"
            self._register(conn)
        else:
            conn.state, conn.receiver, conn.reason = "refused", msg.receiver, msg.reason
            self.acct.refused["registration_refused"] += 1
            log.error("%s: receiver %s at %s refused registration: %s", self.name, msg.receiver, conn.endpoint,
                      msg.reason)

    def _on_assign(self, conn: Conn, msg: Assign) -> None:
        room = self.rooms.get(msg.room)
        ended = self.ended.get(msg.room)
        if room is None and ended is not None:
            if ended.assign is not None and ended.assign.tok == msg.tok:
                return  # a repeated assignment of a room that is over
            # aborted before any receiver expected it, or an id still remembered from an ended room
            self._send_reliable(conn, Fail(msg.tok, ended.status.code or "aborted",
                                           f"room {msg.room} already ended on the prefill side: {ended.status.reason}"))
            return
        if room is not None and room.assign is not None:
            if room.assign.tok == msg.tok:
                return
            self.acct.refused["duplicate_assign"] += 1
            reason = (f"room {msg.room} of {self.group} is already assigned by receiver "
                      f"{room.conn.receiver if room.conn else '?'}")
            log.warning("%s: %s; refusing the assignment from %s", self.name, reason, conn.receiver)
            self._send_ctrl(conn, Fail(msg.tok, "room_exists", reason))
            return
        if room is None:
            room = self._new_room(msg.room)
        missing = [c for c in msg.state if c not in self.layout.state_components]
        if missing:
            self._fail_assigned(room, conn, msg, "bad_assign", f"assignment names unknown state component {missing[0]!r}")
            return
        room.conn, room.assign = conn, msg
        plan = self._plans.get((msg.n_pages, msg.prefix))
        if plan is None:  # a plan depends only on the room's length and prefix here: most rooms reuse one
            if len(self._plans) > 4096:
                self._plans.clear()
            plan = self._plans[(msg.n_pages, msg.prefix)] = rank_plan(
                self.layout, self.cp_size, self.rank, self.split, msg.n_pages, msg.prefix, self.scfg.dedup)
        room.plan = plan
        rows = self.layout.buffers
        room.planned = (plan.kv_positions * sum(rows[b].row_bytes for b in plan.kv_buffers),
                        sum(len(msg.state.get(rows[b].component, ())) * rows[b].row_bytes for b in plan.state_buffers),
                        self.layout.aux_row_bytes if plan.aux else 0)
        room.dst = np.asarray(msg.dst_pages, dtype=np.int64)
        room.status = advance(room.status, RoomStatus(RoomState.WAITING))
        if room.last_submitted and room.next_start != msg.n_pages:
            self._fail(room, "length_mismatch", f"the engine submitted {room.next_start} pages, the decode side "
                                                f"expects {msg.n_pages}")
            return
        self._pump(room)

    def _fail_assigned(self, room: SendRoom, conn: Conn, msg: Assign, code: str, reason: str) -> None:
        room.conn, room.assign = conn, msg
        self._fail(room, code, reason)

    def _on_status(self, conn: Conn, msg: Status) -> None:
        room = self.rooms.get(msg.room)
        if room is None or room.assign is None or room.assign.tok != msg.tok:
            self.acct.dropped["status_unknown_room"] += 1
            return
        state = RoomState.SUCCESS if msg.state == "success" else RoomState.FAILED
        self._set_terminal(room, RoomStatus(state, msg.code, msg.reason))

    async def _connect_stream(self, conn: Conn, writer: StreamWriter, host: str, port: int, key: bytes) -> None:
        try:
            await writer.connect(host, port, key, 5.0)
        except TransferdError as exc:
            if conn.stream is writer:  # nothing went on it yet: the data takes the ZeroMQ socket
                writer.fallback = True
                conn.stream = None
                self.acct.dropped["stream_connect_failed"] += 1
                log.warning("%s: %s; data to receiver %s goes over its ZeroMQ socket instead (open the port, "
                            "fix receiver.stream_port, or set sender.data_stream = \"off\")", self.name, exc,
                            conn.receiver)
            writer.close()

    def _stream_lost(self, conn: Conn, writer: StreamWriter, reason: str) -> None:
        if conn.stream is writer:
            conn.stream = None
            # something at that port that is not the receiver would fail every room, over and over
            conn.stream_failures = conn.stream_failures + 1 if writer.records == 0 else 0
            if conn.stream_failures >= STREAM_FAILURES:
                conn.stream_failures, conn.no_stream_until = 0, time.monotonic() + STREAM_BACKOFF_S
                log.warning("%s: %d data streams to %s ended before carrying anything; not asking for one for "
                            "%gs (data over the ZeroMQ socket)", self.name, STREAM_FAILURES, conn.endpoint,
                            STREAM_BACKOFF_S)
            if conn.state == "registered":
                self._conn_lost(conn, f"receiver {conn.receiver} at {conn.endpoint}: {reason}")

    def _drop_stream(self, conn: Conn) -> None:
        writer, conn.stream = conn.stream, None
        if writer is not None:
            writer.close()

    def _conn_lost(self, conn: Conn, reason: str) -> None:
        """Give a receiver up: fail its rooms here, tell it (if it can still hear), register anew
        under a higher epoch so that it ends those rooms too."""
        log.warning("%s: %s", self.name, reason)
        self._drop_stream(conn)
        for room in list(self.rooms.values()):
            if room.conn is conn:
                self._end_now(room, "peer_lost", reason)
        conn.epoch += 1
        conn.state = "registering"
        self._register(conn)

    async def _tick_loop(self) -> None:
        """The receiver pings every connection; a receiver silent for ``interval × misses`` is
        lost. Rooms no receiver has expected within ``assign_timeout_s`` fail (the queueing
        clock, separate from the receiver's stall clock)."""
        interval = self.scfg.heartbeat_interval_s
        deadline = interval * self.scfg.heartbeat_misses
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            for conn in self.conns:
                if conn.state == "registered":
                    if now - conn.last_heard > deadline:
                        self.acct.heartbeat_misses[conn.receiver or conn.endpoint] += 1
                        self._conn_lost(conn, f"receiver {conn.receiver} at {conn.endpoint} missed heartbeats "
                                              f"for {now - conn.last_heard:.1f}s")
                elif conn.state == "registering" and now - conn.last_register > interval:
                    self._register(conn)
                elif conn.state == "refused" and now - conn.last_register > 10 * interval:
                    self._register(conn)  # the receiver's view of the group may have changed
            for room in list(self.rooms.values()):
                if room.ending is not None and now - room.ending_since > deadline:
                    self._set_terminal(room, room.ending)  # the receiver never answered: end it anyway
                elif room.assign is None and now - room.created > self.scfg.assign_timeout_s:
                    self._fail(room, "assign_timeout", f"no receiver expected room {room.room} within "
                                                       f"{self.scfg.assign_timeout_s:g}s")

    # -- rooms ---------------------------------------------------------------------------
    def _new_room(self, room_id: int) -> SendRoom:
        room = SendRoom(room_id)
        self.rooms[room_id] = room
        self.ended.pop(room_id, None)
        return room

    def _lookup(self, room_id: int) -> SendRoom | None:
        return self.rooms.get(room_id) or self.ended.get(room_id)

    def _set_terminal(self, room: SendRoom, status: RoomStatus) -> None:
        new = advance(room.status, status)
        if new is room.status:
            return
        room.status = new
        room.chunks.clear()
        room.batch.clear()  # entries not sent: nothing of an ended room leaves any more
        self.metrics.observe(new.state.value, time.monotonic() - room.created)
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]
            self.ended[room.room] = room
            while len(self.ended) > TERMINAL_RETENTION:
                self.ended.popitem(last=False)
        self.acct.rooms[new.state.value] += 1
        if new.state is RoomState.FAILED:
            self.acct.failures[new.code] += 1
            log.warning("%s: room %d failed (%s): %s", self.name, room.room, new.code, new.reason)
        for fut in room.waiters:
            if not fut.done():
                fut.set_result(None)
        room.waiters.clear()

    def _fail(self, room: SendRoom, code: str, reason: str, *, reliable: bool = True) -> None:
        """A prefill-side failure (an engine abort, a bad chunk): stop sending and tell the receiver
        at once. If frames of the room were already handed to ZeroMQ, they are sent zero-copy out
        of the pool and may still read it: the room then ends only when the receiver answers (its
        status follows our frames on the same connection), so an engine that waits for the end
        before reusing the pages never has them read afterwards. Otherwise it ends here at once."""
        if room.stopped:
            return
        status = RoomStatus(RoomState.FAILED, code, reason)
        connected = room.conn is not None and room.conn.state == "registered"
        if reliable and room.handed and connected:
            room.ending, room.ending_since = status, time.monotonic()
            room.chunks.clear()
            room.batch.clear()
        else:
            self._set_terminal(room, status)
        if room.conn is not None and room.assign is not None:
            msg = Fail(room.assign.tok, code, reason)
            if reliable:
                self._send_reliable(room.conn, msg)
            else:
                self._send_ctrl(room.conn, msg)

    def _end_now(self, room: SendRoom, code: str, reason: str) -> None:
        """End a room at once (its connection is gone, or the agent stops), ending or not."""
        if room.ending is not None:
            self._set_terminal(room, room.ending)
        else:
            self._fail(room, code, reason, reliable=False)

    def _send_reliable(self, conn: Conn, msg: Any) -> None:
        """A control message that must not be dropped: behind the data, waiting while the pipe
        is full (backpressure)."""
        frames = [encode(msg)]
        if not conn.link.try_send(frames):
            self.spawn(conn.link.send(frames), f"send {type(msg).__name__}")

    async def _emit(self, room: SendRoom, header: bytes, payload: Sequence[Any] = (), nbytes: int = 0, *,
                    rows: bool = False) -> int:
        """Send one message of a room — ``header``, then the ``payload`` buffers (``nbytes`` in
        all) — waiting while the pipe is full: ``SENT_ZMQ`` or ``SENT_STREAM`` (the data stream
        took it), or 0 (nothing sent) when the room stopped meanwhile — nothing of a stopped room
        leaves after its fail message. ``rows``: the payload is rows of the pool (ndarrays), which
        ZeroMQ gets with no reference kept (zerocopy.py); otherwise buffers pyzmq may hold."""
        assert room.conn is not None
        conn = room.conn
        link, zc = conn.link, conn.rows
        while True:
            writer = conn.stream
            if writer is not None:  # the data stream: one record, payload straight out of the pool
                if writer.try_write([prefix(len(header), nbytes), header, *payload]):
                    how = SENT_STREAM
                    break
                try:
                    await writer.writable()
                except TransferdError:
                    if writer.fallback and not room.stopped:
                        continue  # it never connected: the ZeroMQ socket takes the data instead
                    raise
                if room.stopped:
                    return 0
                continue
            if rows:
                assert zc is not None
                sent = zc.try_send(header, [(r.ctypes.data, r.nbytes) for r in payload])
                link.kick()
            else:
                sent = link.try_send([header, *payload], copy=False)
            if sent:
                how = SENT_ZMQ
                break
            await link.writable()
            if room.stopped:
                return 0
        self._burst += 1
        if self._burst >= 64:  # the pipe kept taking messages: give the loop a turn anyway
            self._burst = 0
            await asyncio.sleep(0)
        return how

    def _pump(self, room: SendRoom) -> None:
        if room.assign is not None and room.chunks and not room.sending and not room.stopped:
            room.sending = True
            self.spawn(self._send_room(room), f"room {room.room}")

    async def _send_room(self, room: SendRoom) -> None:
        try:
            while room.chunks and not room.stopped:
                chunk = room.chunks.popleft()
                problem = self._check_chunk(room, chunk)
                if problem:
                    self._fail(room, "bad_chunk", problem)
                    return
                room.status = advance(room.status, RoomStatus(RoomState.TRANSFERRING))
                await self._send_kv(room, chunk)
                if not chunk.last:
                    await self._flush(room)  # the next chunk may come much later
                if chunk.last and not room.stopped:
                    await self._send_last(room, chunk)
        except (zmq.ZMQError, TransferdError) as exc:
            self._fail(room, "send_error", f"{self.name} could not send: {exc}")
        finally:
            room.sending = False
        self._pump(room)

    def _check_chunk(self, room: SendRoom, chunk: Chunk) -> str | None:
        assert room.assign is not None
        a = room.assign
        if chunk.end > a.n_pages:
            return f"chunk [{chunk.start}, {chunk.end}) runs past the room's {a.n_pages} pages"
        if chunk.last:
            if chunk.end != a.n_pages:
                return f"last chunk ends at page {chunk.end}, the decode side expects {a.n_pages} pages"
            for comp in self.layout.state_components:
                want = len(a.state.get(comp, ()))
                have = len(chunk.state.get(comp, ()))
                if room.plan and any(self.layout.buffers[b].component == comp for b in room.plan.state_buffers) \
                        and have != want:
                    return f"state component {comp!r}: {have} source slots for {want} destination slots"
            if room.plan and room.plan.aux and chunk.aux_slot is None:
                return "the last chunk names no aux slot (rank 0 sends the aux row)"
        return None

    def _piece(self, room: SendRoom, kind: int, buffer: int, pos: int, count: int,
               src_row: int) -> tuple[Data, np.ndarray, bool] | None:
        """One data entry: its header fields and payload rows (a copy only for a corrupting
        fault); None when a fault drops it."""
        assert room.assign is not None and self.pool is not None
        payload = self.pool.rows[buffer][src_row:src_row + count]
        csum = self.checksum(payload) if self.checksum is not None else None
        copied = False
        if self._faults_on:
            x = self._fault_rng.random()
            if x < self.faults.drop_frames:
                self.acct.dropped["fault_drop_frame"] += 1
                return None
            if x < self.faults.drop_frames + self.faults.corrupt_frames:
                self.acct.dropped["fault_corrupt_frame"] += 1
                payload, copied = payload.copy(), True
                flat = payload.reshape(-1)
                flat[self._fault_rng.randrange(flat.size)] ^= 0xFF
        return Data(room.assign.tok, kind, buffer, pos, count, csum), payload, copied

    async def _send(self, room: SendRoom, kind: int, buffer: int, pos: int, count: int, src_row: int) -> None:
        """Rows of one run: a message of their own when they fill at least half a message,
        otherwise an entry of the room's batch (sent when full, at a chunk's end and before done)."""
        assert room.conn is not None and self.pool is not None
        room.handed = True
        nbytes = count * self.layout.buffers[buffer].row_bytes
        cap = self.scfg.max_message_bytes
        if 2 * nbytes > cap:
            piece = self._piece(room, kind, buffer, pos, count, src_row)
            if piece is not None:
                await self._emit_pieces(room, [piece])
            return
        if room.batch and (room.batch_bytes + nbytes > cap or len(room.batch) >= MAX_BATCH_ENTRIES):
            await self._flush(room)
            if room.stopped:
                return
        piece = self._piece(room, kind, buffer, pos, count, src_row)
        if piece is not None:
            room.batch.append(piece)
            room.batch_bytes += nbytes

    async def _flush(self, room: SendRoom) -> None:
        pieces, room.batch, room.batch_bytes = room.batch, [], 0
        if pieces and not room.stopped:
            await self._emit_pieces(room, pieces)

    async def _emit_pieces(self, room: SendRoom, pieces: list[tuple[Data, np.ndarray, bool]]) -> None:
        assert room.assign is not None
        entries = tuple(d for d, _, _ in pieces)
        header = encode(entries[0] if len(entries) == 1 else DataBatch(room.assign.tok, entries))
        # rows of the pool go out with no reference kept (zerocopy.py); a fault's corrupted copy
        # (and every payload where libzmq is not reachable) as pyzmq frames — memoryviews, not
        # ndarrays: pyzmq formats repr() of what it queues (~30 µs for an array)
        direct = room.conn is not None and room.conn.rows is not None and not any(c for _, _, c in pieces)
        nbytes = sum(p.nbytes for _, p, _ in pieces)
        if direct:  # the payload frames are the rows' addresses: no pyzmq frame objects to build
            sent = await self._emit(room, header, [p for _, p, _ in pieces], nbytes, rows=True)
        else:
            sent = await self._emit(room, header, [p.data for _, p, _ in pieces], nbytes)
        if not sent:
            return
        for d, payload, _ in pieces:
            self.acct.add(KINDS[d.kind], payload.nbytes)
        room.sent += nbytes
        if sent == SENT_STREAM:
            self.acct.stream_bytes += nbytes

    async def _send_refs(self, room: SendRoom, kind: int, buffer: int, pos: int, src_rows: np.ndarray) -> None:
        """Same host: name the rows, the receiver copies them out of this pool after its checks."""
        assert room.conn is not None and room.assign is not None
        room.handed = True
        if self.faults.drop_frames and self._fault_rng.random() < self.faults.drop_frames:
            self.acct.dropped["fault_drop_frame"] += 1
            return
        count = len(src_rows)
        rows = np.ascontiguousarray(src_rows, dtype="<i8").tobytes()
        if not await self._emit(room, encode(DataRefs(room.assign.tok, kind, buffer, pos, count)), [rows], len(rows)):
            return
        nbytes = count * self.layout.buffers[buffer].row_bytes
        self.acct.add(KINDS[kind], nbytes)
        self.acct.shm_bytes += nbytes
        room.sent += nbytes

    async def _send_runs(self, room: SendRoom, kind: int, buffers: tuple[int, ...], src: np.ndarray,
                         dst: np.ndarray, base: int) -> None:
        assert room.conn is not None
        if room.conn.shm:  # one message per buffer and up to shm_message_bytes, scattered rows or not
            for b in buffers:
                # the row list (8 bytes a row) also stays within max_message_bytes, which the
                # receiver checked against its frame limit at registration
                step = max(1, min(self.scfg.shm_message_bytes // self.layout.buffers[b].row_bytes,
                                  self.scfg.max_message_bytes // 8))
                for p in range(0, len(src), step):
                    if room.stopped:
                        return
                    await self._send_refs(room, kind, b, base + p, src[p:p + step])
            return
        pieces = runs(src, dst)
        cap = self.scfg.max_message_bytes
        for b in buffers:
            step = max(1, cap // self.layout.buffers[b].row_bytes)
            for a, e in pieces:
                for p in range(a, e, step):
                    if room.stopped:
                        return  # aborted or failed: stop sending this room at once
                    await self._send(room, kind, b, base + p, min(step, e - p), int(src[p]))

    async def _send_kv(self, room: SendRoom, chunk: Chunk) -> None:
        assert room.plan is not None and room.dst is not None
        lo, hi = room.plan.chunk_range(chunk.start, chunk.end)
        if lo >= hi or not room.plan.kv_buffers:
            return
        src = chunk.src[lo - chunk.start:hi - chunk.start]
        await self._send_runs(room, 0, room.plan.kv_buffers, src, room.dst[lo:hi], lo)

    async def _send_last(self, room: SendRoom, chunk: Chunk) -> None:
        assert room.plan is not None and room.assign is not None and room.conn is not None
        plan, a = room.plan, room.assign
        for comp in self.layout.state_components:
            bufs = tuple(b for b in plan.state_buffers if self.layout.buffers[b].component == comp)
            if bufs:
                dst = np.asarray(a.state.get(comp, ()), dtype=np.int64)
                await self._send_runs(room, 1, bufs, chunk.state.get(comp, np.empty(0, np.int64)), dst, 0)
        for b in plan.state_skipped:
            comp = self.layout.buffers[b].component
            self.acct.state_bytes_skipped += len(a.state.get(comp, ())) * self.layout.buffers[b].row_bytes
        if plan.aux and not room.stopped:
            assert chunk.aux_slot is not None
            if room.conn.shm:
                await self._send_refs(room, 2, self.layout.aux_index, 0, np.array([chunk.aux_slot]))
            else:
                await self._send(room, 2, self.layout.aux_index, 0, 1, chunk.aux_slot)
        await self._flush(room)
        if room.stopped:
            return
        room.handed = True
        await self._emit(room, encode(Done(a.tok, self.rank, *room.planned)))

    # -- engine API ----------------------------------------------------------------------
    def submit(self, room_id: int, start: int, src_pages: tuple[int, ...], *, last: bool = False,
               state: dict[str, tuple[int, ...]] | None = None, aux_slot: int | None = None) -> RoomStatus:
        """Queue one chunk of a room: source pages for positions ``[start, start + len)``; the last
        chunk also names the state slots and the aux slot. Every index is checked first."""
        assert self.pool is not None
        room = self.rooms.get(room_id)
        if room is None:
            self.refuse_if_draining()
        ended = self.ended.get(room_id)
        if room is None and ended is not None:
            raise BadRequest(f"room {room_id} already ended ({ended.status.state.value}: {ended.status.reason})")
        if room is not None and room.ending is not None:
            raise BadRequest(f"room {room_id} is ending ({room.ending.code}: {room.ending.reason})")
        if room is not None and room.last_submitted:
            raise BadRequest(f"room {room_id} already had its last chunk")
        expected = room.next_start if room is not None else 0
        if start != expected:
            raise BadRequest(f"room {room_id}: chunk starts at page position {start}, expected {expected} "
                             "(chunks are contiguous and start at 0)")
        src = np.asarray(src_pages, dtype=np.int64)
        if self._kv0 is not None:
            self.pool.check_rows(self._kv0, src, f"room {room_id} source page")
        elif len(src):
            raise IndexOutOfRange(f"room {room_id}: pool has no KV buffers but {len(src)} source pages were given")
        if len(np.unique(src)) != len(src):
            raise BadRequest(f"room {room_id}: a source page is listed twice in the chunk")
        st: dict[str, np.ndarray] = {}
        for comp, slots in (state or {}).items():
            if comp not in self.layout.state_components:
                raise BadRequest(f"room {room_id}: unknown state component {comp!r} "
                                 f"(pool has {list(self.layout.state_components)})")
            idx = self.layout.indices("state")
            b = next(i for i in idx if self.layout.buffers[i].component == comp)
            arr = np.asarray(slots, dtype=np.int64)
            self.pool.check_rows(b, arr, f"room {room_id} {comp} state slot")
            st[comp] = arr
        if (state or aux_slot is not None) and not last:
            raise BadRequest(f"room {room_id}: state and aux slots belong to the last chunk")
        if aux_slot is not None:
            self.pool.check_rows(self.layout.aux_index, [aux_slot], f"room {room_id} aux slot")
        if room is not None and room.assign is not None:
            n = room.assign.n_pages
            end = start + len(src)
            if end > n or (last and end != n):
                raise BadRequest(f"room {room_id}: chunk [{start}, {end}) does not fit the room's {n} pages"
                                 + (" (the last chunk must end at the last page)" if last else ""))
        if room is None:
            room = self._new_room(room_id)
        room.chunks.append(Chunk(start, src, last, st, aux_slot))
        room.next_start = start + len(src)
        room.last_submitted = last
        self._pump(room)
        return room.status

    def _get(self, room_id: int) -> SendRoom:
        room = self._lookup(room_id)
        if room is None:
            raise UnknownRoom(f"room {room_id} is not known to {self.name}")
        return room

    def abort(self, room_id: int, reason: str = "") -> RoomStatus:
        room = self._lookup(room_id) or self._new_room(room_id)
        self._fail(room, "aborted", reason or "aborted by the prefill engine")
        return room.status

    async def wait(self, room_id: int, timeout_s: float) -> RoomStatus:
        room = self._get(room_id)
        if not room.status.state.terminal:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            room.waiters.append(fut)
            try:
                await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                if fut in room.waiters:
                    room.waiters.remove(fut)
        return room.status

    def _api_submit(self, r: dict[str, Any]) -> dict[str, str]:
        aux = r.get("aux_slot")
        return self.submit(u64(r["room"], "room"), u64(r.get("start", 0), "start"), ints(r["src_pages"], "src_pages"),
                           last=bool(r.get("last", False)), state=slot_map(r.get("state"), "state"),
                           aux_slot=None if aux is None else u64(aux, "aux_slot")).to_wire()

    def _api_poll(self, r: dict[str, Any]) -> dict[str, str]:
        return self._get(u64(r["room"], "room")).status.to_wire()

    async def _api_wait(self, r: dict[str, Any]) -> dict[str, str]:
        return (await self.wait(u64(r["room"], "room"), float(r.get("timeout_s", 60.0)))).to_wire()

    def _api_abort(self, r: dict[str, Any]) -> dict[str, str]:
        return self.abort(u64(r["room"], "room"), str(r.get("reason", ""))).to_wire()

    # -- introspection -------------------------------------------------------------------
    def live_rooms(self) -> int:
        return len(self.rooms)

    def status_line(self) -> str:
        regs = sum(1 for c in self.conns if c.state == "registered")
        return (f"sender {self.group}/r{self.rank}: {len(self.rooms)} rooms in flight; registered with "
                f"{regs}/{len(self.conns)} receivers; {sum(self.acct.bytes.values()) / 1e9:.3f} GB sent")

    def metric_snapshot(self) -> dict[str, Any]:
        rooms = list(self.rooms.values())
        live: dict[str, int] = {}
        in_flight = 0
        for r in rooms:
            live[r.status.state.value] = live.get(r.status.state.value, 0) + 1
            if r.status.state is RoomState.TRANSFERRING:
                in_flight += max(0, sum(r.planned) - r.sent)
        out = self.acct.snapshot()
        out.update(role="sender", live=live, in_flight=in_flight,
                   registered={self.group: sum(1 for c in self.conns if c.state == "registered")},
                   info={"role": "sender", "group": self.group, "rank": str(self.rank), "cp_size": str(self.cp_size),
                         "version": __version__, "protocol": str(PROTOCOL_VERSION)})
        return out

    def stats(self) -> dict[str, Any]:
        out = self.acct.snapshot()
        out.update(role="sender", group=self.group, rank=self.rank, cp_size=self.cp_size, split=self.split.value,
                   pid=os.getpid(), incarnation=self.incarnation, engine_endpoint=self.engine_endpoint,
                   metrics_port=self.metrics.port, uptime_s=round(time.time() - self.t_start, 3),
                   draining=self.draining)
        return out

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        by_state: dict[str, int] = {}
        for room in (*self.rooms.values(), *self.ended.values()):
            by_state[room.status.state.value] = by_state.get(room.status.state.value, 0) + 1
        return {
            "role": "sender", "group": self.group, "rank": self.rank, "cp_size": self.cp_size,
            "split": self.split.value, "host": socket.gethostname(), "pid": os.getpid(),
            "incarnation": self.incarnation, "layout_fingerprint": self.layout.fingerprint(),
            "receivers": [{"endpoint": c.endpoint, "state": c.state, "receiver": c.receiver, "reason": c.reason,
                           "last_heard_s": round(now - c.last_heard, 3) if c.last_heard else None}
                          for c in self.conns],
            "rooms": by_state,
            "stats": self.stats(),
        }
