"""The decode-side receiver: registers sender agents, assigns rooms, writes arriving rows into
the decode pool, and decides each room's outcome.

Everything runs on one event loop; a data frame is checked against the room's plan
(:class:`~transferd.protocol.room.CoverageTracker`) *before* a byte is written, and once a room is
terminal no further byte of it is written (the abort barrier holds because abort, release and
frame handling are serialised on that loop).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from .. import __version__
from ..config import Config
from ..daemon.accounting import Accounting
from ..daemon.base import AgentBase
from ..errors import ConfigError, ProtocolError, RoomExists, TransferdError, UnknownRoom, VersionMismatch
from ..layout import KINDS, PoolLayout, layout_difference
from ..pool import Pool, host_boot_id
from ..pool.rows import copy_rows
from ..protocol.checksum import checksum_function
from ..protocol.engine_api import ints as _ints
from ..protocol.engine_api import nonempty_str as _str
from ..protocol.engine_api import slot_map
from ..protocol.engine_api import u64 as _u64
from ..protocol.messages import (
    PROTOCOL_VERSION,
    Assign,
    Data,
    DataBatch,
    DataRef,
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
from ..protocol.policy import RankPlan, group_plans
from ..protocol.room import CoverageTracker, Refused, RoomRequest, RoomState, RoomStatus, advance, runs
from ..protocol.stream import KEY_BYTES, hello_key
from ..transport.curve import is_wildcard, load_keypair, watch_handshakes
from ..transport.data_stream import StreamReader, StreamServer, Target, stream_host
from ..transport.local_api import LocalApiServer
from ..transport.loop_socket import LoopSocket, configure
from ..types import NAME_RE, SplitMode

log = logging.getLogger(__name__)

AUX_GUARD = np.dtype("<u8")
DIRECT_MIN_BYTES = 64 << 10  # stream payloads this large are read straight into the rows; smaller ones via a buffer


@dataclass(slots=True)
class Peer:
    ident: bytes
    group: str
    rank: int
    incarnation: int
    pid: int
    host: str
    registered_at: float
    last_seen: float
    epoch: int = 0
    checksum: Callable[[Any], int] | None = None
    src_pool: Pool | None = None  # the same-host path: this sender's pool, read by the receiver
    stream_key: bytes = b""  # the data stream offered at registration (its hello carries this key)
    stream: StreamReader | None = None

    def close(self) -> None:
        if self.src_pool is not None:
            self.src_pool.close()
            self.src_pool = None
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close("the peer's registration ended")


@dataclass(slots=True)
class Group:
    name: str
    cp_size: int
    split: SplitMode
    dedup: bool = True
    ranks: dict[int, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeRoom:
    req: RoomRequest
    tok: int
    created: float
    status: RoomStatus = field(default_factory=lambda: RoomStatus(RoomState.BOOTSTRAPPING))
    tracker: CoverageTracker | None = None
    assigned: dict[int, bytes] = field(default_factory=dict)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    finished: float = 0.0
    last_progress: float = 0.0
    received: int = 0
    streaming: dict[int, int] = field(default_factory=dict)  # rank -> payloads being read into the rows now

    @property
    def key(self) -> tuple[str, int]:
        return (self.req.group, self.req.room)


def _settle_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Receiver(AgentBase):
    def __init__(self, cfg: Config, *, pool: Pool | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.rcfg = cfg.receiver
        self.name = f"receiver {self.rcfg.name}"
        self.layout: PoolLayout = pool.layout if pool is not None else cfg.receiver_layout()
        self.pool = pool
        self._own_pool = False
        self.incarnation = random.getrandbits(63)
        self.acct = Accounting()
        self.peers: dict[bytes, Peer] = {}
        self.groups: dict[str, Group] = {}
        self.rooms: dict[tuple[str, int], DecodeRoom] = {}
        self.by_tok: dict[int, DecodeRoom] = {}
        self._next_tok = random.getrandbits(62) | 1
        self.data_endpoint = ""
        self.engine_endpoint = ""
        self._nudged: dict[bytes, float] = {}
        self._plans: dict[tuple[int, SplitMode, int, int, bool], list[RankPlan]] = {}
        self._row_bytes = [b.row_bytes for b in self.layout.buffers]
        self._kind_of = [b.kind for b in self.layout.buffers]
        self.streams: StreamServer | None = None
        self._stream_keys: dict[bytes, bytes] = {}  # offered stream key -> peer identity
        self.metrics_bind = self.rcfg.metrics_bind
        self.drain_timeout_s = self.rcfg.drain_timeout_s

    # -- lifecycle -----------------------------------------------------------------------
    async def _start(self) -> None:
        assert self.ctx is not None
        if self.pool is None:
            name = self.cfg.receiver_pool_name()
            if self.rcfg.create_pool:
                self.pool = Pool.create(name, self.layout, exist_ok=True)
                self._own_pool = True  # created or re-attached after a restart: this daemon owns it
            else:
                self.pool = Pool.attach(name)
                diff = layout_difference(self.pool.layout, self.layout, "pool", "config")
                if diff:
                    raise TransferdError(f"pool {name!r} does not match the configuration: {diff}")
                self.layout = self.pool.layout
        assert self.zctx is not None
        self.router = self.zctx.socket(zmq.ROUTER)
        configure(self.router)
        self._setup_curve()
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, self.rcfg.max_frame_bytes)  # bigger: peer disconnected
        self.router.setsockopt(zmq.SNDHWM, self.rcfg.send_hwm)
        self.router.setsockopt(zmq.RCVHWM, self.rcfg.recv_hwm)  # bounds bytes in flight per sender
        self.router.bind(self.rcfg.bind)
        self.data_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._slow_s = self.cfg.faults.slow_receiver_ms / 1000.0
        self.link = LoopSocket(self.router, self._on_message, self.name, copy=False)
        host = stream_host(self.data_endpoint)
        if self.rcfg.data_stream == "auto" and host is not None and not self.rcfg.curve_secret_key:
            self.streams = StreamServer(host, self.rcfg.stream_port, self, self.rcfg.max_frame_bytes)
        self.api = LocalApiServer(self.zctx, self.cfg.receiver_engine_socket(), {
            "expect": self._api_expect, "poll": self._api_poll, "wait": self._api_wait,
            "abort": self._api_abort, "release": self._api_release, "stats": lambda r: self.stats(),
            "status": lambda r: self.status(), "ping": lambda r: {"name": self.rcfg.name, "pid": os.getpid()},
        }, self.name, self.acct.refused)
        self.engine_endpoint = self.api.bound
        self.spawn(self.api.run(), "engine-api")
        self.spawn(self._tick_loop(), "tick")
        assert self.ready is not None
        self.ready.set()
        log.info("%s: data on %s%s, engine API on %s, pool %s (%s)", self.name, self.data_endpoint,
                 f" and data streams on port {self.streams.port}" if self.streams else "",
                 self.engine_endpoint, self.pool.name, self.layout.fingerprint())

    def _setup_curve(self) -> None:
        """CURVE encryption and an allow-list of sender keys (pyzmq's zmq.auth), when configured."""
        r = self.rcfg
        if not r.curve_secret_key:
            if is_wildcard(r.bind):
                log.warning("%s: *** binding %s on every interface WITHOUT encryption or authentication: "
                            "any host that can reach this port can register and write into the decode pool. "
                            "Set receiver.curve_secret_key and receiver.curve_allow_dir (transferd keygen). ***",
                            self.name, r.bind)
            return
        from zmq.auth.asyncio import AsyncioAuthenticator

        public, secret = load_keypair(r.curve_secret_key, "receiver.curve_secret_key")
        if not os.path.isdir(r.curve_allow_dir):
            raise ConfigError(f"receiver.curve_allow_dir {r.curve_allow_dir!r} is not a directory")
        assert self.ctx is not None
        self.auth = AsyncioAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=r.curve_allow_dir)
        self.router.curve_secretkey = secret
        self.router.curve_publickey = public
        self.router.curve_server = True
        self.spawn(watch_handshakes(self.router, self.ctx, self._handshake_failed), "handshakes")
        log.info("%s: CURVE on; senders allowed from the public keys in %s", self.name, r.curve_allow_dir)

    def _handshake_failed(self, kind: str, what: str) -> None:
        self._refuse(kind, f"a sender was refused at the security handshake: {what}")

    async def _close(self) -> None:
        for room in list(self.rooms.values()):
            self._finish(room, RoomStatus(RoomState.FAILED, "shutdown", f"shutting down: receiver {self.rcfg.name} "
                                                                        "stopped before the room ended"))
        await asyncio.sleep(0.05)  # let the engines' pending waits and the senders' statuses go out
        for peer in self.peers.values():
            peer.close()
        if self.streams is not None:
            self.streams.close()
        if hasattr(self, "api"):
            self.api.close()
        if hasattr(self, "link"):
            self.link.close(linger=500)
        elif hasattr(self, "router"):
            self.router.close(linger=500)
        if getattr(self, "auth", None) is not None:
            self.auth.stop()
        if self.pool is not None:
            if self._own_pool:
                self.pool.unlink()
            self.pool.close()

    # -- sending -------------------------------------------------------------------------
    def _send(self, ident: bytes, msg: Any) -> None:
        """A control message to a peer, never blocking the loop: dropped and counted when the
        peer's pipe is full or the peer is gone."""
        try:
            if self.link.try_send([ident, encode(msg)]):
                return
            err = zmq.strerror(zmq.EAGAIN)
        except zmq.ZMQError as exc:
            err = zmq.strerror(exc.errno or 0)
        self.acct.dropped[f"send_{err.replace(' ', '_').lower()}"] += 1
        log.warning("%s: could not send %s to %r: %s", self.name, type(msg).__name__, ident, err)

    # -- network input -------------------------------------------------------------------
    def _on_message(self, frames: list[zmq.Frame]) -> None:
        frames_before = self.acct.frames
        try:
            self._on_frames(frames)
        except Exception:  # a bug must not take the receiver down with every room
            log.exception("%s: error while handling a message", self.name)
            self.acct.refused["internal_error"] += 1
        if self._slow_s and self.acct.frames != frames_before:
            self.link.pause(self._slow_s)  # fault injection: a slow decode side

    def _refuse(self, code: str, why: str, ident: bytes = b"") -> None:
        self.acct.refused[code] += 1
        log.warning("%s: refused (%s) from %r: %s", self.name, code, ident, why)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        ident = frames[0].bytes
        if len(frames) < 2:
            self._refuse("malformed", "message without a header frame", ident)
            return
        try:
            msg = decode_header(frames[1].buffer)
        except TransferdError as exc:
            self._refuse(exc.code, str(exc), ident)
            if isinstance(exc, VersionMismatch) and exc.msg_type == "register":
                self._send(ident, Registered(False, str(exc), self.rcfg.name, self.incarnation))
            return
        peer = self.peers.get(ident)
        if peer is not None:
            peer.last_seen = time.monotonic()
        if isinstance(msg, DataBatch):
            if len(frames) != 2 + len(msg.entries):
                self._refuse("malformed", f"data-batch of {len(msg.entries)} entries with {len(frames) - 2} payload "
                                          "frames", ident)
                return
            if peer is None:
                self._refuse("unregistered", "data from an unregistered peer", ident)
                self._nudge(ident)
                return
            for entry, frame in zip(msg.entries, frames[2:]):
                self._on_data(peer, entry, frame.buffer)  # each exactly as a data message
            return
        if isinstance(msg, (Data, DataRef, DataRefs)):
            want = 2 if isinstance(msg, DataRef) else 3
            if len(frames) != want:
                what = {Data: "data", DataRef: "data-ref", DataRefs: "data-refs"}[type(msg)]
                self._refuse("malformed", f"{what} message with {len(frames) - 2} payload frames, not {want - 2}",
                             ident)
                return
            if peer is None:
                self._refuse("unregistered", "data from an unregistered peer", ident)
                self._nudge(ident)
                return
            self._on_data(peer, msg, frames[2].buffer if want == 3 else None)
            return
        if len(frames) != 2:
            self._refuse("malformed", f"{type(msg).__name__} with {len(frames) - 1} frames, not 1", ident)
            return
        if isinstance(msg, Register):
            self._on_register(ident, msg)
        elif peer is None:
            self._refuse("unregistered", f"{type(msg).__name__} from an unregistered peer", ident)
            self._nudge(ident)
        elif isinstance(msg, Ping):
            self._send(ident, Pong(msg.seq))
        elif isinstance(msg, Pong):
            pass  # last_seen is already updated
        elif isinstance(msg, Done):
            self._on_done(peer, msg)
        elif isinstance(msg, Fail):
            self._on_fail(peer, msg)
        else:
            self._refuse("unexpected_type", f"{type(msg).__name__} is not sent to a receiver", ident)

    def _nudge(self, ident: bytes) -> None:
        """Tell an unknown peer (e.g. one registered with this receiver's previous incarnation) to
        register again; at most once a second per identity."""
        now = time.monotonic()
        if now - self._nudged.get(ident, 0.0) < 1.0:
            return
        if len(self._nudged) > 4096:
            self._nudged.clear()
        self._nudged[ident] = now
        self._send(ident, Registered(False, "unknown peer: register first", self.rcfg.name, self.incarnation,
                                     retry=True))

    def _on_register(self, ident: bytes, msg: Register) -> None:
        def refuse(reason: str, code: str) -> None:
            self._refuse(code, f"registration of {msg.group} rank {msg.rank}: {reason}", ident)
            self._send(ident, Registered(False, reason, self.rcfg.name, self.incarnation))

        try:
            split = SplitMode.parse(msg.split, ProtocolError)
            checksum = checksum_function(msg.checksum)
        except TransferdError as exc:
            refuse(str(exc), "bad_settings")
            return
        if not NAME_RE.match(msg.group):
            refuse(f"group name {msg.group[:80]!r} must be 1-64 letters, digits, '_', '.', '-'", "bad_settings")
            return
        if msg.rank >= msg.cp_size:
            refuse(f"rank {msg.rank} is outside cp_size {msg.cp_size}", "bad_rank")
            return
        try:
            theirs = PoolLayout.from_wire(msg.layout)
        except TransferdError as exc:
            refuse(f"unreadable layout: {exc}", "layout")
            return
        if theirs.fingerprint() != msg.fingerprint:
            refuse("layout fingerprint does not match the layout sent with it", "layout")
            return
        diff = layout_difference(theirs, self.layout)
        if diff:
            refuse(f"incompatible layout: {diff}", "layout")
            return
        biggest = max(msg.max_message_bytes, *(b.row_bytes for b in theirs.buffers))
        if biggest > self.rcfg.max_frame_bytes:
            refuse(f"messages of up to {biggest} bytes exceed this receiver's max_frame_bytes "
                   f"{self.rcfg.max_frame_bytes}", "frame_limit")
            return
        group = self.groups.get(msg.group)
        if group is not None and (group.cp_size != msg.cp_size or group.split is not split
                                  or group.dedup != msg.dedup):
            refuse(f"group {msg.group} is registered with cp_size {group.cp_size} split {group.split.value} "
                   f"dedup {'on' if group.dedup else 'off'}; rank {msg.rank} says cp_size {msg.cp_size} split "
                   f"{split.value} dedup {'on' if msg.dedup else 'off'}", "inconsistent_group")
            return
        if group is None:
            group = self.groups[msg.group] = Group(msg.group, msg.cp_size, split, msg.dedup)
        old_ident = group.ranks.get(msg.rank)
        now = time.monotonic()
        known = self.peers.get(ident)
        if known is not None and (known.group, known.rank) != (msg.group, msg.rank):
            # the same identity now claims another place: it has left its old one
            self._peer_lost(known, f"prefill {known.group} rank {known.rank} registered again as {msg.group} "
                                   f"rank {msg.rank}", heartbeat=False)
            known = None
            if self.groups.get(msg.group) is not group:  # that was the group's last rank: it went with it
                group = self.groups[msg.group] = Group(msg.group, msg.cp_size, split, msg.dedup)
        if known is not None and msg.epoch <= known.epoch:
            # a repeated register (several queued while this receiver was away): the registration
            # goes on as it is — its path, its stream or unused key, its rooms; nothing new offered
            known.last_seen = now
            self._send(ident, Registered(True, "", self.rcfg.name, self.incarnation, shm=known.src_pool is not None))
            self._assign_waiting(group, msg.rank)
            return
        src_pool = self._same_host_pool(msg)
        if known is not None:  # a higher epoch: the sender gave this receiver up and came back
            self._close_peer(known)
            reason = f"prefill {msg.group} rank {msg.rank} lost its connection to this receiver and registered again"
            log.warning("%s: %s", self.name, reason)
            self._fail_rooms_assigned_to(msg.group, msg.rank, ident, "peer_lost", reason)
        if old_ident is not None and old_ident != ident:
            old = self.peers.pop(old_ident, None)
            if old is not None:
                self._close_peer(old)
            reason = (f"prefill {msg.group} rank {msg.rank} restarted (incarnation "
                      f"{old.incarnation if old else '?'} -> {msg.incarnation})")
            log.warning("%s: %s", self.name, reason)
            self._fail_rooms_assigned_to(msg.group, msg.rank, old_ident, "peer_restarted", reason)
        group.ranks[msg.rank] = ident
        peer = self.peers[ident] = Peer(ident, msg.group, msg.rank, msg.incarnation, msg.pid, msg.host, now, now,
                                        msg.epoch, checksum, src_pool)
        port = 0
        if msg.stream and self.streams is not None and src_pool is None:
            peer.stream_key, port = os.urandom(KEY_BYTES), self.streams.port
            self._stream_keys[peer.stream_key] = ident
        self._send(ident, Registered(True, "", self.rcfg.name, self.incarnation, shm=src_pool is not None,
                                     stream_port=port, stream_key=peer.stream_key if port else b""))
        log.info("%s: registered %s rank %d/%d (%s, incarnation %x, pid %d on %s, %s)", self.name, msg.group,
                 msg.rank, msg.cp_size, split.value, msg.incarnation, msg.pid, msg.host,
                 f"same-host path via pool {msg.pool}" if src_pool is not None else
                 f"data stream on port {port}" if port else "data over the socket")
        self._assign_waiting(group, msg.rank)

    def _close_peer(self, peer: Peer) -> None:
        """A registration ends: its stream key, if never used, goes with it (every peer that
        leaves passes here, so no offered key outlives its peer), then its pool and stream."""
        self._stream_keys.pop(peer.stream_key, None)
        peer.close()

    def _assign_waiting(self, group: Group, rank: int) -> None:
        """Assign this rank every live room of the group it has no assignment for yet."""
        for room in self._rooms_of(group.name):
            if not room.status.state.terminal and room.assigned.get(rank) is None:
                self._assign(room, group, rank)

    def _same_host_pool(self, msg: Register) -> Pool | None:
        """Attach the sender's pool when it offers one, runs on this kernel and the pool is
        reachable here with a compatible layout; otherwise the data comes over the socket."""
        if not msg.pool or self.rcfg.same_host == "off" or not msg.boot_id or msg.boot_id != host_boot_id():
            return None
        try:
            pool = Pool.attach(msg.pool)
        except TransferdError as exc:
            log.info("%s: %s rank %d offers pool %r, not reachable here (%s): data over the socket",
                     self.name, msg.group, msg.rank, msg.pool, exc)
            return None
        if pool.pool_id != msg.pool_id or layout_difference(pool.layout, self.layout) is not None:
            log.info("%s: %s rank %d offers pool %r, but the pool found here under that name is another one: "
                     "data over the socket", self.name, msg.group, msg.rank, msg.pool)
            pool.close()
            return None
        return pool

    def _rooms_of(self, group: str) -> list[DecodeRoom]:
        return [r for r in self.rooms.values() if r.req.group == group]

    def _data_room(self, peer: Peer, msg: Data | DataRef | DataRefs) -> DecodeRoom | None:
        """The live room a data message is for, if this peer may write it and the buffer is of
        the kind the message says (checks that need no payload byte)."""
        room = self.by_tok.get(msg.tok)
        if room is None:
            self._refuse("unknown_room", f"data for unknown transfer token {msg.tok:x}", peer.ident)
            return None
        if room.status.state.terminal:
            self.acct.dropped["room_not_live"] += 1  # late frames after abort/failure: never written
            return None
        if room.assigned.get(peer.rank) != peer.ident or room.req.group != peer.group:
            self._refuse("wrong_peer", f"{peer.group} rank {peer.rank} sent data for room {room.key} "
                                       "it was not assigned", peer.ident)
            return None
        if msg.buffer >= len(self._row_bytes) or KINDS[msg.kind] != self._kind_of[msg.buffer]:
            self._reject_frame(room, peer, "unexpected", f"data kind {msg.kind} for buffer {msg.buffer} "
                                                         "does not match the layout")
            return None
        return room

    def _claim(self, room: DecodeRoom, peer: Peer, msg: Data | DataRef | DataRefs) -> tuple[int, Any] | None:
        """The destination rows of a data message (first row and None for one run, else the
        rows), marked received in the room's coverage; None (the room failed) when the plan
        refuses them."""
        assert room.tracker is not None
        try:
            return room.tracker.accept(peer.rank, msg.kind, msg.buffer, msg.pos, msg.count)
        except Refused as exc:
            self._reject_frame(room, peer, exc.code, exc.reason)
            return None

    def _landed(self, room: DecodeRoom, msg: Data | DataRef | DataRefs, nbytes: int, *, shm: bool = False,
                stream: bool = False) -> None:
        """Rows of a room are in place: count them (by the path they came), and end the room if
        that completes it."""
        self.acct.add(self._kind_of[msg.buffer], nbytes)
        room.received += nbytes
        if shm:
            self.acct.shm_bytes += nbytes
        if stream:
            self.acct.stream_bytes += nbytes
        room.last_progress = time.monotonic()
        if room.status.state is not RoomState.TRANSFERRING:
            room.status = advance(room.status, RoomStatus(RoomState.TRANSFERRING))
        assert room.tracker is not None
        if room.tracker.complete:
            self._finish(room, RoomStatus(RoomState.SUCCESS))

    def _on_data(self, peer: Peer, msg: Data | DataRef | DataRefs, payload: memoryview | None, *,
                 stream: bool = False) -> None:
        room = self._data_room(peer, msg)
        if room is None:
            return
        assert self.pool is not None
        row_bytes = self._row_bytes[msg.buffer]
        nbytes = msg.count * row_bytes
        src_rows: np.ndarray | None = None  # data-refs: the sender's rows, one per position
        src_pool: np.ndarray | None = None
        if isinstance(msg, (DataRef, DataRefs)):
            src_pool = peer.src_pool.rows[msg.buffer] if peer.src_pool is not None else None
            if src_pool is None:
                self._reject_frame(room, peer, "no_shm", f"data-ref rows of buffer {msg.buffer} but no same-host "
                                                         "path was agreed")
                return
            if isinstance(msg, DataRefs):
                assert payload is not None
                if len(payload) != msg.count * 8:
                    self._reject_frame(room, peer, "length_mismatch", f"data-refs list of {len(payload)} bytes for "
                                                                      f"{msg.count} rows (8 bytes each)")
                    return
                src_rows = np.frombuffer(payload, dtype="<i8")
                lo, hi = int(src_rows.min()), int(src_rows.max()) + 1
            else:
                lo, hi = msg.src_row, msg.src_row + msg.count
            if lo < 0 or hi > src_pool.shape[0]:
                self._reject_frame(room, peer, "index_out_of_range",
                                   f"data-ref rows [{lo}, {hi}) of buffer {msg.buffer} outside the sender's "
                                   f"{src_pool.shape[0]} rows")
                return
            if isinstance(msg, DataRef):
                payload = src_pool[msg.src_row:msg.src_row + msg.count].reshape(-1).data
        else:
            assert payload is not None
            if len(payload) != nbytes:
                self._reject_frame(room, peer, "length_mismatch",
                                   f"payload of {len(payload)} bytes for {msg.count} rows of {row_bytes} bytes")
                return
            if peer.checksum is not None:
                if msg.checksum is None:
                    self._reject_frame(room, peer, "checksum", "data frame without the checksum its sender announced")
                    return
                if peer.checksum(payload) != msg.checksum:
                    self._reject_frame(room, peer, "checksum", f"payload checksum mismatch in buffer {msg.buffer} "
                                                               f"rows [{msg.pos}, {msg.pos + msg.count})")
                    return
        if msg.kind == 2:
            row = src_pool[int(src_rows[0])].data if src_rows is not None and src_pool is not None else payload
            guard = int(np.frombuffer(row, dtype=AUX_GUARD, count=1)[0])  # type: ignore[arg-type]
            if guard != room.req.room:
                self._reject_frame(room, peer, "aux_guard", f"aux row carries room id {guard}, "
                                                            f"expected {room.req.room}")
                return
        claimed = self._claim(room, peer, msg)
        if claimed is None:
            return
        first, rows = claimed
        dst_pool = self.pool.rows[msg.buffer]
        if src_rows is not None:
            assert src_pool is not None
            copy_rows(dst_pool, np.arange(first, first + msg.count) if rows is None else rows, src_pool, src_rows)
        else:
            src = np.frombuffer(payload, dtype=np.uint8).reshape(msg.count, row_bytes)  # type: ignore[arg-type]
            if rows is None:
                dst_pool[first:first + msg.count] = src
            else:
                dst_pool[rows] = src
        self._landed(room, msg, nbytes, shm=src_pool is not None, stream=stream)

    # -- data streams (stream.py) --------------------------------------------------------
    def stream_hello(self, reader: StreamReader, hello: bytes) -> bool:
        key = hello_key(hello)
        if key is None:
            self._refuse("stream_hello", f"data stream from {reader.addr} began {hello[:8]!r}, not a hello")
            return False
        ident = self._stream_keys.pop(key, None)
        peer = self.peers.get(ident) if ident is not None else None
        if peer is None or peer.stream_key != key or peer.stream is not None:
            self._refuse("stream_key", f"data stream from {reader.addr} with a key no registered peer holds")
            return False
        peer.stream, reader.peer = reader, peer
        log.info("%s: %s rank %d sends its data on a stream from %s", self.name, peer.group, peer.rank, reader.addr)
        return True

    def stream_closed(self, reader: StreamReader, reason: str) -> None:
        peer: Peer | None = reader.peer
        if peer is not None and peer.stream is reader and self.peers.get(peer.ident) is peer:
            peer.stream = None  # a broken stream is a lost connection: its rooms cannot complete
            self._peer_lost(peer, f"prefill {peer.group} rank {peer.rank} (pid {peer.pid} on {peer.host}): {reason}",
                            heartbeat=False)
        elif reason and peer is None:
            log.info("%s: %s", self.name, reason)

    def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
        """A record's header has arrived: check it and say where its payload goes (an empty
        target drops the payload)."""
        try:
            return self._stream_record(reader, header, payload_len)
        except Exception:  # a bug must not take the receiver down with every room; rows may have
            # been claimed without their bytes: the stream ends, so that rank's rooms fail
            log.exception("%s: error while handling a data stream record", self.name)
            self.acct.refused["internal_error"] += 1
            reader.close(f"data stream from {reader.addr}: internal error")
            return Target([])

    def _stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
        peer: Peer | None = reader.peer
        drop = Target([])
        if peer is None or self.peers.get(peer.ident) is not peer:
            return drop
        peer.last_seen = time.monotonic()
        try:
            msg = decode_header(header)
        except TransferdError as exc:
            self._refuse(exc.code, f"data stream: {exc}", peer.ident)
            return drop
        if isinstance(msg, Done):
            if payload_len:
                self._refuse("malformed", f"done record with a {payload_len}-byte payload", peer.ident)
            else:
                self._on_done(peer, msg)
            return drop
        if not isinstance(msg, (Data, DataBatch)):
            self._refuse("unexpected_type", f"{type(msg).__name__} on a data stream (data, data-batch and done "
                                            "only)", peer.ident)
            return drop
        entries = msg.entries if isinstance(msg, DataBatch) else (msg,)
        sizes = [e.count * self._row_bytes[e.buffer] if e.buffer < len(self._row_bytes) else -1 for e in entries]
        if min(sizes) < 0 or sum(sizes) != payload_len:
            room = self._data_room(peer, entries[0])  # refuses an unknown room or buffer by itself
            if room is not None:
                self._reject_frame(room, peer, "length_mismatch", f"data stream record of {payload_len} payload "
                                                                  f"bytes for rows of {sum(sizes)} bytes")
            return drop
        if peer.checksum is None and payload_len >= DIRECT_MIN_BYTES and all(e.kind != 2 for e in entries):
            return self._stream_direct(peer, entries, sizes)
        buf = reader.buffer(payload_len)  # this stream's own: records of several streams interleave

        def deliver() -> None:  # then exactly as the same message from the ZeroMQ socket
            o = 0
            for entry, size in zip(entries, sizes):
                self._on_data(peer, entry, buf[o:o + size], stream=True)
                o += size
            self._after_data(reader)
        return Target([buf[:payload_len]], deliver)

    def _stream_direct(self, peer: Peer, entries: tuple[Data, ...], sizes: list[int]) -> Target:
        """A large payload (one data entry, or a batch of them) is read straight into its
        destination rows: every check first, the rows of every entry claimed in the tracker,
        then the bytes; if the room ends while they arrive, the rest is dropped (the stream
        reader asks before each read). An entry refused (the room failed, or the entry dropped)
        drops the whole payload; the entries after it are counted as the ZeroMQ path counts them."""
        assert self.pool is not None
        views: list[memoryview] = []
        room: DecodeRoom | None = None
        for i, msg in enumerate(entries):
            room = self._data_room(peer, msg)
            claimed = self._claim(room, peer, msg) if room is not None else None
            if claimed is None:
                for rest in entries[i + 1:]:
                    self._data_room(peer, rest)
                return Target([])
            first, rows = claimed
            dst = self.pool.rows[msg.buffer]
            if rows is None:
                views.append(dst[first:first + msg.count].reshape(-1).data)
            else:
                views += [dst[int(rows[a]):int(rows[a]) + b - a].reshape(-1).data for a, b in runs(rows, rows)]
        assert room is not None
        live = room
        reader, rank = peer.stream, peer.rank
        live.streaming[rank] = live.streaming.get(rank, 0) + 1

        def landed() -> None:
            live.streaming[rank] -= 1
            for msg, nbytes in zip(entries, sizes):  # no room completes before its rank's done
                self._landed(live, msg, nbytes, stream=True)
            self._after_data(reader)

        def alive() -> bool:
            if live.status.state.terminal:
                live.streaming[rank] -= 1  # asked no more: the rest is dropped
                return False
            return True
        return Target(views, landed, alive)

    def _after_data(self, reader: StreamReader | None) -> None:
        if self._slow_s and reader is not None:
            reader.pause(self._slow_s)  # fault injection: a slow decode side

    def _reject_frame(self, room: DecodeRoom, peer: Peer, code: str, reason: str) -> None:
        self._refuse(code, f"room {room.key}: {reason}", peer.ident)
        self._finish(room, RoomStatus(RoomState.FAILED, code, f"{peer.group} rank {peer.rank}: {reason}"))

    def _on_done(self, peer: Peer, msg: Done) -> None:
        room = self.by_tok.get(msg.tok)
        if room is None or room.status.state.terminal:
            self.acct.dropped["done_not_live"] += 1
            return
        if room.assigned.get(peer.rank) != peer.ident or msg.rank != peer.rank:
            self._refuse("wrong_peer", f"done for room {room.key} from a peer not assigned to it", peer.ident)
            return
        assert room.tracker is not None
        room.last_progress = time.monotonic()
        if room.streaming.get(peer.rank):  # only a done sent past its stream can overtake its rows
            self._finish(room, RoomStatus(RoomState.FAILED, "incomplete", f"{peer.group} rank {peer.rank} reported "
                                                                          "done while rows of the room were still "
                                                                          "arriving on its data stream"))
            return
        problem = room.tracker.rank_done(peer.rank)
        if problem:
            self._finish(room, RoomStatus(RoomState.FAILED, "incomplete", f"{peer.group} {problem}"))
        elif room.tracker.complete:
            self._finish(room, RoomStatus(RoomState.SUCCESS))

    def _on_fail(self, peer: Peer, msg: Fail) -> None:
        room = self.by_tok.get(msg.tok)
        if room is None or room.assigned.get(peer.rank) != peer.ident:
            self.acct.dropped["fail_not_live"] += 1
            return
        self._finish(room, RoomStatus(RoomState.FAILED, msg.code or "prefill_failed",
                                      f"prefill {peer.group} rank {peer.rank}: {msg.reason}"))

    # -- room management -----------------------------------------------------------------
    def _assign(self, room: DecodeRoom, group: Group, rank: int) -> None:
        ident = group.ranks[rank]
        req = room.req
        room.assigned[rank] = ident
        # the assignment leaves first: the tracker is built while it travels (no data can be
        # handled before this callback returns to the loop)
        self._send(ident, Assign(room.tok, req.room, len(req.dst_pages), req.prefix, req.dst_pages,
                                 req.state, req.aux_slot))
        if room.tracker is None:
            key = (group.cp_size, group.split, len(room.req.dst_pages), room.req.prefix, group.dedup)
            plans = self._plans.get(key)
            if plans is None:  # plans depend only on these five values: most rooms reuse one
                if len(self._plans) > 4096:
                    self._plans.clear()
                plans = self._plans[key] = group_plans(self.layout, *key)
            room.tracker = CoverageTracker(self.layout, group.cp_size, group.split, room.req, plans)
        if len(room.assigned) == group.cp_size:
            room.status = advance(room.status, RoomStatus(RoomState.WAITING))
            room.last_progress = time.monotonic()

    def _finish(self, room: DecodeRoom, status: RoomStatus) -> None:
        new = advance(room.status, status)
        if new is room.status:
            return
        room.status = new
        room.finished = time.monotonic()
        self.acct.rooms[new.state.value] += 1
        self.metrics.observe(new.state.value, room.finished - room.created)
        if new.state is RoomState.FAILED:
            self.acct.failures[new.code] += 1
            log.warning("%s: room %s/%d failed (%s): %s", self.name, room.req.group, room.req.room, new.code, new.reason)
        else:
            log.debug("%s: room %s/%d succeeded in %.3fs", self.name, room.req.group, room.req.room,
                      room.finished - room.created)
        for fut in room.waiters:
            if not fut.done():
                fut.set_result(None)
        room.waiters.clear()
        # the senders hear of it right after the waiting engines' answers have gone out (their
        # tasks were woken first): the engine's latency does not include these sends
        told = Status(room.tok, room.req.room, new.state.value, new.code, new.reason)
        assert self.loop is not None
        self.loop.call_soon(self._tell_senders, list(room.assigned.values()), told)

    def _tell_senders(self, idents: list[bytes], status: Status) -> None:
        for ident in idents:
            if ident in self.peers:
                self._send(ident, status)

    async def _tick_loop(self) -> None:
        """Heartbeats and the room clocks. Three separate clocks: a sender silent for
        ``interval × misses`` is lost (liveness); a room whose group has not registered every rank
        within ``bootstrap_timeout_s`` fails (queueing for the prefill side); a transferring room
        with no frame for ``stall_timeout_s`` fails (progress; every frame resets it)."""
        interval = self.rcfg.heartbeat_interval_s
        deadline = interval * self.rcfg.heartbeat_misses
        seq = 0
        while True:
            await asyncio.sleep(interval / 2)
            now = time.monotonic()
            seq += 1
            for peer in list(self.peers.values()):
                if now - peer.last_seen > deadline:
                    self._peer_lost(peer, f"prefill {peer.group} rank {peer.rank} (pid {peer.pid} on {peer.host}) "
                                          f"missed heartbeats for {now - peer.last_seen:.1f}s")
                elif seq % 2 == 0:
                    self._send(peer.ident, Ping(seq))
            for room in list(self.rooms.values()):
                st = room.status.state
                if st.terminal:
                    continue
                if room.tracker is None or len(room.assigned) < room.tracker.cp_size:
                    if now - room.created > self.rcfg.bootstrap_timeout_s:
                        have = sorted(room.assigned)
                        self._finish(room, RoomStatus(RoomState.FAILED, "bootstrap_timeout",
                                                      f"prefill group {room.req.group} did not register all ranks "
                                                      f"within {self.rcfg.bootstrap_timeout_s:g}s (assigned: {have})"))
                elif st is RoomState.WAITING and now - room.last_progress > self.rcfg.waiting_timeout_s:
                    self._finish(room, RoomStatus(RoomState.FAILED, "waiting_timeout",
                                                  f"prefill group {room.req.group} sent nothing for the room within "
                                                  f"{self.rcfg.waiting_timeout_s:g}s of its assignment"))
                elif st is RoomState.TRANSFERRING and now - room.last_progress > self.rcfg.stall_timeout_s:
                    waiting = [r for r in range(room.tracker.cp_size) if r not in room.tracker.done]
                    self._finish(room, RoomStatus(RoomState.FAILED, "stalled",
                                                  f"no data for {now - room.last_progress:.1f}s; ranks not done: "
                                                  f"{waiting}"))

    def _peer_lost(self, peer: Peer, reason: str, *, heartbeat: bool = True) -> None:
        log.warning("%s: %s", self.name, reason)
        if heartbeat:
            self.acct.heartbeat_misses[f"{peer.group}/r{peer.rank}"] += 1
        self.peers.pop(peer.ident, None)
        self._close_peer(peer)
        group = self.groups.get(peer.group)
        if group is not None and group.ranks.get(peer.rank) == peer.ident:
            del group.ranks[peer.rank]
            if not group.ranks:  # a group that comes back may have other settings (cp_size, split)
                del self.groups[peer.group]
                for room in self._rooms_of(peer.group):
                    if not room.assigned:
                        room.tracker = None
        self._fail_rooms_assigned_to(peer.group, peer.rank, peer.ident, "peer_lost", reason)

    def _fail_rooms_assigned_to(self, group: str, rank: int, ident: bytes, code: str, reason: str) -> None:
        """End every room of ``group`` whose ``rank`` was assigned to the peer ``ident``."""
        for room in self._rooms_of(group):
            if room.assigned.get(rank) == ident:
                self._finish(room, RoomStatus(RoomState.FAILED, code, reason))

    # -- engine API (runs on the loop) ---------------------------------------------------
    def expect(self, req: RoomRequest) -> RoomStatus:
        self.refuse_if_draining()
        req.validate(self.layout)
        old = self.rooms.get((req.group, req.room))
        if old is not None:
            raise RoomExists(f"room {req.group}/{req.room} is still held ({old.status.state.value}); release it first")
        tok = self._next_tok
        self._next_tok = (self._next_tok + 1) & ((1 << 64) - 1) or 1
        room = DecodeRoom(req, tok, time.monotonic())
        self.rooms[room.key] = room
        self.by_tok[tok] = room
        group = self.groups.get(req.group)
        if group is not None:
            for rank in sorted(group.ranks):
                self._assign(room, group, rank)
        return room.status

    def _room(self, req: dict[str, Any]) -> DecodeRoom:
        key = (_str(req["group"], "group"), _u64(req["room"], "room"))
        room = self.rooms.get(key)
        if room is None:
            raise UnknownRoom(f"room {key[0]}/{key[1]} is not held by receiver {self.rcfg.name}")
        return room

    def abort(self, group: str, room_id: int, reason: str = "") -> RoomStatus:
        room = self._room({"group": group, "room": room_id})
        self._finish(room, RoomStatus(RoomState.FAILED, "aborted", reason or "aborted by the decode engine"))
        return room.status

    def release(self, group: str, room_id: int) -> RoomStatus:
        room = self._room({"group": group, "room": room_id})
        self._finish(room, RoomStatus(RoomState.FAILED, "aborted", "released by the decode engine before completion"))
        del self.rooms[room.key]
        self.by_tok.pop(room.tok, None)
        return room.status

    async def wait(self, group: str, room_id: int, timeout_s: float) -> RoomStatus:
        room = self._room({"group": group, "room": room_id})
        if not room.status.state.terminal:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            room.waiters.append(fut)
            # a timer rather than asyncio.wait_for: the room's end wakes this task directly (one
            # loop step, not three), and the answer leaves before anything else the end causes
            timer = loop.call_later(timeout_s, _settle_none, fut)
            try:
                await fut
            finally:
                timer.cancel()
                if fut in room.waiters:
                    room.waiters.remove(fut)
        return room.status

    def _api_expect(self, r: dict[str, Any]) -> dict[str, str]:
        req = RoomRequest(
            room=_u64(r["room"], "room"), group=_str(r["group"], "group"),
            dst_pages=_ints(r["dst_pages"], "dst_pages"), prefix=_u64(r.get("prefix_pages", 0), "prefix_pages"),
            state=slot_map(r.get("state"), "state"),
            aux_slot=_u64(r["aux_slot"], "aux_slot"),
        )
        return self.expect(req).to_wire()

    def _api_poll(self, r: dict[str, Any]) -> dict[str, str]:
        return self._room(r).status.to_wire()

    async def _api_wait(self, r: dict[str, Any]) -> dict[str, str]:
        room = self._room(r)
        return (await self.wait(room.req.group, room.req.room, float(r.get("timeout_s", 60.0)))).to_wire()

    def _api_abort(self, r: dict[str, Any]) -> dict[str, str]:
        room = self._room(r)
        return self.abort(room.req.group, room.req.room, str(r.get("reason", ""))).to_wire()

    def _api_release(self, r: dict[str, Any]) -> dict[str, str]:
        room = self._room(r)
        return self.release(room.req.group, room.req.room).to_wire()

    # -- introspection -------------------------------------------------------------------
    def live_rooms(self) -> int:
        return sum(1 for r in list(self.rooms.values()) if not r.status.state.terminal)

    def status_line(self) -> str:
        groups = ", ".join(f"{g.name} {len(g.ranks)}/{g.cp_size}" for g in list(self.groups.values())) or "no groups"
        return (f"receiver {self.rcfg.name}: {self.live_rooms()} rooms in flight; {groups}; "
                f"{sum(self.acct.bytes.values()) / 1e9:.3f} GB received")

    def metric_snapshot(self) -> dict[str, Any]:
        rooms = list(self.rooms.values())
        live: dict[str, int] = {}
        in_flight = 0
        for r in rooms:
            st = r.status.state
            if st.terminal:
                continue
            live[st.value] = live.get(st.value, 0) + 1
            if st is RoomState.TRANSFERRING and r.tracker is not None:
                in_flight += max(0, sum(r.tracker.expected_bytes.values()) - r.received)
        out = self.acct.snapshot()
        out.update(role="receiver", live=live, in_flight=in_flight,
                   registered={g.name: len(g.ranks) for g in list(self.groups.values())},
                   info={"role": "receiver", "name": self.rcfg.name, "version": __version__,
                         "protocol": str(PROTOCOL_VERSION)})
        return out

    def stats(self) -> dict[str, Any]:
        out = self.acct.snapshot()
        out.update(role="receiver", name=self.rcfg.name, pid=os.getpid(), incarnation=self.incarnation,
                   data_endpoint=self.data_endpoint, engine_endpoint=self.engine_endpoint,
                   metrics_port=self.metrics.port, uptime_s=round(time.time() - self.t_start, 3),
                   draining=self.draining)
        return out

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        by_state: dict[str, int] = {}
        for room in self.rooms.values():
            by_state[room.status.state.value] = by_state.get(room.status.state.value, 0) + 1
        return {
            "role": "receiver", "name": self.rcfg.name, "host": socket.gethostname(), "pid": os.getpid(),
            "data_endpoint": self.data_endpoint, "layout_fingerprint": self.layout.fingerprint(),
            "groups": {
                g.name: {"cp_size": g.cp_size, "split": g.split.value, "dedup": g.dedup, "ranks": {
                    str(rank): {"incarnation": self.peers[i].incarnation, "pid": self.peers[i].pid,
                                "host": self.peers[i].host, "last_seen_s": round(now - self.peers[i].last_seen, 3)}
                    for rank, i in sorted(g.ranks.items()) if i in self.peers}}
                for g in self.groups.values()
            },
            "rooms": by_state,
            "stats": self.stats(),
        }

