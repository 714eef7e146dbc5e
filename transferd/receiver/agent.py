"""The decode-side receiver: a shell around :class:`~transferd.protocol.receiver_core.ReceiverCore`.

It owns the sockets (the ZeroMQ ROUTER, the data-stream server, the engine API), the decode
pool and the peers' data planes, a timer that feeds the core ``tick(now)``, and the metrics and
logs; every decision is the core's. Everything runs on one event loop: abort, release and the
handling of a data message are serialised on it, which is what makes abort a barrier (once a
room is terminal, no further byte of it is written).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import zmq

from .. import __version__
from ..config import Config
from ..daemon.accounting import Accounting
from ..daemon.base import AgentBase
from ..daemon.malloc import trim_freed_heap
from ..daemon.ratelog import RefusalLog
from ..errors import ConfigError, TransferdError
from ..layout import PoolLayout, layout_difference
from ..pool import Pool, host_boot_id
from ..protocol.messages import BUNDLE_BYTES, MAX_BUNDLE_MSGS, PROTOCOL_VERSION, Bundle, Register, Status, encode
from ..protocol.receiver_core import (
    Drop,
    Finished,
    Note,
    Peer,
    PeerClosed,
    ReceiverCore,
    Refuse,
    Send,
    Settings,
)
from ..protocol.room import RoomRequest, RoomState, RoomStatus
from ..protocol.stream import KEY_BYTES
from ..transport.curve import DISCONNECTED, is_wildcard, load_keypair, watch_handshakes
from ..transport.data_stream import StreamReader, StreamServer, stream_host
from ..transport.local_api import LocalApiServer
from ..transport.loop_socket import LoopSocket, configure
from ..transport.planes import (
    MooncakeEngine,
    MooncakeReceiver,
    NixlEngine,
    NixlReceiver,
    Reader,
    ReceiverPlane,
    SameHostEngine,
    SameHostReceiver,
    local_hostname,
)
from ..types import AutoOff, DataPlane
from . import api
from .data import DataPath

# queued control messages to one sender go out in a bundle once this many wait (issue 14's
# seventh round: 16 kept cp 1's batched rate, where one bundle for a whole batch lost it)
BUNDLE_PART = 16
log = logging.getLogger(__name__)
TRIM_IDLE_EVERY_S = 10.0  # with no room held, give freed heap back at most this often


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
        self.refusals = RefusalLog(log, self.name)
        self.send_fails = RefusalLog(log, self.name, head="could not send to {peer} ({code})")
        self.data_endpoint = ""
        self.engine_endpoint = ""
        self.streams: StreamServer | None = None
        self.slow_s = cfg.faults.slow_receiver_ms / 1000.0  # fault injection: a slow decode side
        self.planes: dict[int, tuple[Peer, ReceiverPlane]] = {}  # id(peer) -> its same-host or Mooncake plane
        self.reader: Reader | None = None  # Mooncake TE or NIXL reads (receiver.data_plane = "mooncake"/"nixl")
        self.shm_reader: Reader | None = None  # same-host reads of large messages, on threads
        self.streams_of: dict[int, tuple[Peer, StreamReader]] = {}  # id(peer) -> its open data stream
        self._trimmed = 0.0  # when the freed heap was last given back (idle ticks only)
        self.heap_trims = 0
        self._outbox: dict[bytes, list[tuple[Any, bytes]]] = {}  # peer -> control messages of this loop iteration
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}  # room token -> engines waiting for its end
        self.metrics_bind = self.rcfg.metrics_bind
        self.drain_timeout_s = self.rcfg.drain_timeout_s
        self.core = self._new_core(0)
        self.data = DataPath(self)

    def _new_core(self, stream_port: int) -> ReceiverCore:
        r = self.rcfg
        return ReceiverCore(Settings(
            name=r.name, incarnation=self.incarnation, max_frame_bytes=r.max_frame_bytes,
            heartbeat_interval_s=r.heartbeat_interval_s, heartbeat_misses=r.heartbeat_misses,
            bootstrap_timeout_s=r.bootstrap_timeout_s, waiting_timeout_s=r.waiting_timeout_s,
            stall_timeout_s=r.stall_timeout_s, same_host=r.same_host != AutoOff.OFF, boot_id=host_boot_id(),
            stream_port=stream_port, mooncake=self.reader is not None and r.data_plane is DataPlane.MOONCAKE,
            nixl=self.reader is not None and r.data_plane is DataPlane.NIXL, admit=r.admitted()), self.layout,
            random.getrandbits(62) | 1)

    # -- lifecycle -----------------------------------------------------------------------
    async def _start(self) -> None:
        assert self.ctx is not None and self.zctx is not None
        if self.pool is None:
            self.pool, self._own_pool = Pool.open(self.cfg.receiver_pool_name(), self.layout,
                                                  create=self.rcfg.create_pool)
            self.layout = self.pool.layout
        self.router = self.zctx.socket(zmq.ROUTER)
        configure(self.router)
        self._setup_curve()
        self.spawn(watch_handshakes(self.router, self.ctx, self._socket_event,
                                    handshakes=bool(self.rcfg.curve_secret_key), disconnects=True), "socket monitor")
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, self.rcfg.max_frame_bytes)  # bigger: peer disconnected
        self.router.setsockopt(zmq.SNDHWM, self.rcfg.send_hwm)
        self.router.setsockopt(zmq.RCVHWM, self.rcfg.recv_hwm)  # bounds bytes in flight per sender
        self.router.bind(self.rcfg.bind)
        self.data_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.rcfg.same_host != AutoOff.OFF:
            threads = self.rcfg.same_host_read_threads
            self.shm_reader = Reader(SameHostEngine(), 1 << 16, 4 * threads, 0, threads=threads,
                                     batch_bytes=SameHostReceiver.JOB_BYTES, thread_name="same-host-read")
        if self.rcfg.data_plane is DataPlane.MOONCAKE:
            self._start_mooncake()
        elif self.rcfg.data_plane is DataPlane.NIXL:
            self._start_nixl()
        host = stream_host(self.data_endpoint)
        if self.rcfg.data_stream == AutoOff.AUTO and host is not None and not self.rcfg.curve_secret_key:
            self.streams = StreamServer(host, self.rcfg.stream_port, self.data, self.rcfg.max_frame_bytes,
                                        self.rcfg.stream_receive_buffer_bytes)
        self.core = self._new_core(self.streams.port if self.streams else 0)  # now that the port is known
        self.data = DataPath(self)
        if self.streams is not None:
            self.streams.handler = self.data
        self.link = LoopSocket(self.router, self.data.on_message, self.name, copy=False)
        self.api = LocalApiServer(self.zctx, self.cfg.receiver_engine_socket(), api.handlers(self), self.name,
                                  self.acct.refused)
        self.engine_endpoint = self.api.bound
        self.spawn(self.api.run(), "engine-api")
        self.spawn(self._tick_loop(), "tick")
        assert self.ready is not None
        self.ready.set()
        log.info("%s: data on %s%s, engine API on %s, pool %s (%s)", self.name, self.data_endpoint,
                 f" and data streams on port {self.streams.port}" if self.streams else "",
                 self.engine_endpoint, self.pool.name, self.layout.fingerprint())

    def _start_mooncake(self) -> None:
        """This receiver's Transfer Engine, the decode pool registered with it, and its reader."""
        r = self.rcfg
        assert self.pool is not None
        engine = MooncakeEngine(local_hostname(r.mooncake_hostname, self.data_endpoint), r.mooncake_protocol,
                                r.mooncake_device)
        engine.register(self.pool.rows)
        self.reader = Reader(engine, r.mooncake_batch_entries, r.mooncake_reads_in_flight,
                             self.layout.aux_row_bytes)
        log.info("%s: Mooncake TE (%s) at %s reads the rows of senders that offer it", self.name,
                 r.mooncake_protocol, engine.session)

    def _start_nixl(self) -> None:
        """This receiver's NIXL agent (UCX), the decode pool registered with it, and its reader."""
        r = self.rcfg
        assert self.pool is not None
        engine = NixlEngine(f"transferd-{r.name}-{self.incarnation:016x}", ucx_devices=r.nixl_ucx_devices,
                            ucx_modules=r.nixl_ucx_modules, read_timeout_s=r.nixl_read_timeout_s)
        engine.register(self.pool.rows)
        self.reader = Reader(engine, r.nixl_batch_entries, r.nixl_reads_in_flight,
                             self.layout.aux_row_bytes)
        log.info("%s: NIXL agent %s (UCX) reads the rows of senders that offer it", self.name, engine.session)

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
        log.info("%s: CURVE on; senders allowed from the public keys in %s", self.name, r.curve_allow_dir)

    def _socket_event(self, kind: str, what: str) -> None:
        """The ROUTER's monitor: a failed security handshake is a refusal; a lost connection is
        counted (``dropped[connection_lost]``) and logged (the first few, then every 100th): a
        sender that stopped or died, or a frame over ``max_frame_bytes`` that ZeroMQ dropped with
        its connection (the only trace such a frame leaves; the sender reconnects)."""
        if kind != DISCONNECTED:
            self.refuse(kind, f"a sender was refused at the security handshake: {what}")
            return
        self.acct.dropped["connection_lost"] += 1
        n = self.acct.dropped["connection_lost"]
        if n <= 5 or n % 100 == 0:
            log.warning("%s: %s (%d so far): a sender stopped or died, or sent a frame over receiver.max_frame_bytes "
                        "(%d bytes), which ZeroMQ drops with its connection", self.name, what, n,
                        self.rcfg.max_frame_bytes)

    async def _close(self) -> None:
        self.core.shutdown(time.monotonic())
        self.act()
        await asyncio.sleep(0.05)  # let the engines' pending waits and the senders' statuses go out
        for _, plane in list(self.planes.values()):
            plane.close()
        self.planes.clear()
        for rd in self.readers():  # their reads in flight write into the pool: they end first
            rd.drop_queued()
            await asyncio.get_running_loop().run_in_executor(None, rd.close)
        self.reader = self.shm_reader = None
        for _, reader in list(self.streams_of.values()):
            reader.peer = None
            reader.close("the receiver stopped")
        self.streams_of.clear()
        if self.streams is not None:
            self.streams.close()
        if hasattr(self, "api"):
            self.api.close()
        if hasattr(self, "link"):
            self.flush_sends()
            self.link.close(linger=500)
        elif hasattr(self, "router"):
            self.router.close(linger=500)
        if getattr(self, "auth", None) is not None:
            self.auth.stop()
        if self.pool is not None:
            if self._own_pool:
                self.pool.unlink()
            self.pool.close()

    # -- carrying out the core's actions -------------------------------------------------
    def send(self, ident: bytes, msg: Any) -> None:
        """A control message to a peer, never blocking the loop. The first to a peer in a loop
        iteration goes at once (a lone room's assign is not held behind the engine's answer);
        those after it go together, in bundles (PROTOCOL §3.1): every ``BUNDLE_PART`` of them
        (the sender starts on a long batch's first rooms while the rest are assigned) and what
        is left at the iteration's end."""
        frame = encode(msg)
        box = self._outbox.get(ident)
        if box is None or self.loop is None:
            if self.loop is not None:  # (not running yet: each goes at once, nothing queued)
                if not self._outbox:
                    self.loop.call_soon(self.flush_sends)
                self._outbox[ident] = []
            self._send_frame(ident, frame, [msg])
            return
        box.append((msg, frame))
        if len(box) >= BUNDLE_PART:
            self._outbox[ident] = []
            self._send_box(ident, box)

    def flush_sends(self) -> None:
        """Send what :meth:`send` queued, in order, each peer's in as few messages as the bundle's
        limits allow; a message that cannot go (the peer's pipe is full, the peer is gone) is
        dropped and counted, every entry of a bundle one by one."""
        outbox, self._outbox = self._outbox, {}
        for ident, box in outbox.items():
            self._send_box(ident, box)

    def _send_box(self, ident: bytes, box: list[tuple[Any, bytes]]) -> None:
        """Queued messages to one peer, in order: one alone as itself, more in bundles of at
        most ``MAX_BUNDLE_MSGS`` entries and ``BUNDLE_BYTES`` bytes (a larger message alone)."""
        i = 0
        while i < len(box):
            j, size = i + 1, len(box[i][1])
            while j < len(box) and j - i < MAX_BUNDLE_MSGS and size + len(box[j][1]) <= BUNDLE_BYTES:
                size += len(box[j][1])
                j += 1
            part = box[i:j]
            frame = part[0][1] if j == i + 1 else encode(Bundle(tuple(m for m, _ in part), tuple(f for _, f in part)))
            self._send_frame(ident, frame, [m for m, _ in part])
            i = j

    def _send_frame(self, ident: bytes, frame: bytes, msgs: list[Any]) -> None:
        try:
            if self.link.try_send([ident, frame]):
                return
            err = zmq.strerror(zmq.EAGAIN)
        except zmq.ZMQError as exc:
            err = zmq.strerror(exc.errno or 0)
        code = f"send_{err.replace(' ', '_').lower()}"
        for msg in msgs:
            self.acct.dropped[code] += 1  # every one counted; its log line rate-limited like refusals
            self.send_fails.refused(code, repr(ident), f"{type(msg).__name__} not sent: {err}", time.monotonic())

    def refuse(self, code: str, why: str, ident: bytes = b"") -> None:
        self.acct.refused[code] += 1  # every refusal is counted; its log line is rate-limited
        self.refusals.refused(code, repr(ident), why, time.monotonic())

    def act(self) -> None:
        """Carry out what the core decided, in order."""
        for a in self.core.drain():
            if type(a) is Send:
                self.send(a.ident, a.msg)
            elif type(a) is Refuse:
                self.refuse(a.code, a.reason, a.ident)
            elif type(a) is Drop:
                self.acct.dropped[a.key] += 1
            elif type(a) is Finished:
                self._finished(a)
            elif type(a) is PeerClosed:
                self._peer_gone(a)
            elif type(a) is Note:
                log.log(logging.WARNING if a.level == "warning" else logging.INFO, "%s: %s", self.name, a.text)

    def _finished(self, a: Finished) -> None:
        room, new = a.room, a.status
        self.acct.rooms[new.state.value] += 1
        self.metrics.observe(new.state.value, room.finished - room.created)
        if new.state is RoomState.FAILED:
            self.acct.failures[new.code] += 1
            log.warning("%s: room %s/%d failed (%s): %s", self.name, room.req.group, room.req.room, new.code, new.reason)
        else:
            log.debug("%s: room %s/%d succeeded in %.3fs", self.name, room.req.group, room.req.room,
                      room.finished - room.created)
        # the engines hear once its reads settled (now, when none is queued or running); the
        # senders right after the waiting engines' answers have gone out (their tasks were woken
        # first): the engine's latency does not include these sends, and once a sender has its
        # status no byte of the room is read out of its pool
        self.after_room_reads(room.tok, partial(self._wake, room.tok))
        told = Status(room.tok, room.req.room, new.state.value, new.code, new.reason)
        self.after_room_reads(room.tok, partial(self._tell_senders_soon, list(room.assigned.values()), told))

    def _wake(self, tok: int) -> None:
        for fut in self._waiters.pop(tok, ()):
            if not fut.done():
                fut.set_result(None)

    def room_tok(self, group: str, room_id: int) -> int:
        """The room's transfer token (-1: no such room)."""
        room = self.core.rooms.get((group, room_id))
        return room.tok if room is not None else -1

    def readers(self) -> list[Reader]:
        """The readers whose threads write into the decode pool: same-host, Mooncake TE or NIXL."""
        return [r for r in (self.shm_reader, self.reader) if r is not None]

    def reads_busy(self, tok: int) -> bool:
        """Whether any read of the room is queued or running."""
        return any(r.busy(tok) for r in self.readers())

    def after_room_reads(self, tok: int, fn: Callable[[], None]) -> None:
        """``fn()`` once every read of the room has settled (now, when none is queued or running)."""
        for r in self.readers():
            if r.busy(tok):
                r.after(tok, partial(self.after_room_reads, tok, fn))
                return
        fn()

    async def room_reads_settled(self, tok: int) -> None:
        while self.reads_busy(tok):
            for r in self.readers():
                await r.settled(tok)

    def after_reads(self, tok: int, status: RoomStatus) -> RoomStatus | Awaitable[RoomStatus]:
        """``status`` once the room's reads in flight have settled (abort and release are
        barriers: after the answer, no byte of the room is written)."""
        if not self.reads_busy(tok):
            return status

        async def settled() -> RoomStatus:
            await self.room_reads_settled(tok)
            return status
        return settled()

    def _tell_senders_soon(self, idents: list[bytes], status: Status) -> None:
        assert self.loop is not None
        self.loop.call_soon(self._tell_senders, idents, status)

    def _tell_senders(self, idents: list[bytes], status: Status) -> None:
        for ident in idents:
            if ident in self.core.peers:
                self.send(ident, status)

    def _peer_gone(self, a: PeerClosed) -> None:
        """A registration ended: its plane and its stream go with it."""
        peer = a.peer
        if a.reason:
            log.warning("%s: %s", self.name, a.reason)
        if a.heartbeat:
            self.acct.heartbeat_misses[f"{peer.group}/r{peer.rank}"] += 1
        held = self.planes.pop(id(peer), None)
        if held is not None:
            held[1].close()
        stream = self.streams_of.pop(id(peer), None)
        if stream is not None:
            stream[1].close("the peer's registration ended")

    def plane_of(self, peer: Peer) -> ReceiverPlane | None:
        held = self.planes.get(id(peer))
        return held[1] if held is not None and held[0] is peer else None

    # -- registration --------------------------------------------------------------------
    def register(self, ident: bytes, msg: Register, now: float) -> None:
        adm = self.core.register(ident, msg, now)
        if adm is None:
            return
        te = adm.te and self.reader is not None
        engine = self.reader.engine if te and self.reader is not None else None
        if isinstance(engine, NixlEngine):  # its agent's metadata, loaded once per agent name
            why = engine.add_peer(msg.te_session, msg.nixl_md)
            if why is not None:  # the registration goes on, on today's data plane
                log.warning("%s: %s rank %d offers NIXL reads, but %s: today's data plane", self.name, msg.group,
                            msg.rank, why)
                te = False
        pool = self._same_host_pool(adm.same_host_pool, msg) if adm.same_host_pool and not te else None
        peer = self.core.admit(adm, now, same_host=pool is not None, stream_key=os.urandom(KEY_BYTES), te=te)
        if pool is not None:
            assert self.shm_reader is not None  # a pool is only attached when same_host is not "off"
            self.planes[id(peer)] = (peer, SameHostReceiver(pool, self.shm_reader, self.data))
        elif te:
            assert self.reader is not None
            theirs = PoolLayout.from_wire(msg.layout).buffers  # it parsed in the core's checks; rows may differ
            kind = NixlReceiver if isinstance(self.reader.engine, NixlEngine) else MooncakeReceiver
            self.planes[id(peer)] = (peer, kind(self.reader, self.data, msg.te_session, msg.te_addrs,
                                                [b.row_bytes for b in theirs], [b.rows for b in theirs], peer.label))

    def _same_host_pool(self, name: str, msg: Register) -> Pool | None:
        """The sender's pool, when it is reachable here and is the one it offered; otherwise the
        data comes over the socket."""
        try:
            pool = Pool.attach(name)
        except TransferdError as exc:
            log.info("%s: %s rank %d offers pool %r, not reachable here (%s): data over the socket",
                     self.name, msg.group, msg.rank, name, exc)
            return None
        if pool.pool_id != msg.pool_id or layout_difference(pool.layout, self.layout) is not None:
            log.info("%s: %s rank %d offers pool %r, but the pool found here under that name is another one: "
                     "data over the socket", self.name, msg.group, msg.rank, name)
            pool.close()
            return None
        return pool

    async def _tick_loop(self) -> None:
        """Feeds the core's clocks (heartbeats, bootstrap, waiting and stall) every half
        heartbeat interval."""
        while True:
            await asyncio.sleep(self.rcfg.heartbeat_interval_s / 2)
            now = time.monotonic()
            self._watch_streams(now)
            self.core.tick(now)
            self.act()
            self.refusals.flush(now)
            self.send_fails.flush(now)
            if now - self._trimmed >= TRIM_IDLE_EVERY_S and not self.core.rooms:
                self._trimmed = now  # idle: the freed heap goes back (bursts of garbage connections)
                trim_freed_heap()
                self.heap_trims += 1

    def _watch_streams(self, now: float) -> None:
        """Bytes arriving on a peer's data stream are progress of its connection, even inside
        a record (the core's stall clock counts them); a stream stopped inside a record for
        ``stall_timeout_s`` is closed once the core failed the rooms it held up."""
        for peer, reader in list(self.streams_of.values()):
            if reader.rx_bytes != reader.rx_seen:
                reader.rx_seen = reader.rx_bytes
                peer.last_data = max(peer.last_data, now)
            elif self.core.stream_idle(peer, now - peer.last_data, reader.in_record(), now):
                self.act()
                reader.close(f"data stream from {reader.addr} stalled inside a record")

    # -- engine API (runs on the loop) ---------------------------------------------------
    def expect(self, req: RoomRequest) -> RoomStatus:
        self.refuse_if_draining()
        try:
            return self.core.expect(req, time.monotonic())
        finally:
            self.act()

    def poll(self, group: str, room_id: int) -> RoomStatus:
        return self.core.room(group, room_id).status

    def abort(self, group: str, room_id: int, reason: str = "") -> RoomStatus | Awaitable[RoomStatus]:
        """The room's status; while engine reads of it are in flight, an awaitable of it that
        resolves once they settled (abort is a barrier: after the answer, nothing of the room
        is written)."""
        tok = self.room_tok(group, room_id)
        try:
            return self.after_reads(tok, self.core.abort(group, room_id, reason, time.monotonic()))
        finally:
            self.act()

    def release(self, group: str, room_id: int) -> RoomStatus | Awaitable[RoomStatus]:
        """As :meth:`abort`: the answer comes once the room's engine reads settled."""
        tok = self.room_tok(group, room_id)
        try:
            return self.after_reads(tok, self.core.release(group, room_id, time.monotonic()))
        finally:
            self.act()

    async def wait(self, group: str, room_id: int, timeout_s: float) -> RoomStatus:
        room = self.core.room(group, room_id)
        if not room.status.state.terminal:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            waiters = self._waiters.setdefault(room.tok, [])
            waiters.append(fut)
            # a timer rather than asyncio.wait_for: the room's end wakes this task directly (one
            # loop step, not three), and the answer leaves before anything else the end causes
            timer = loop.call_later(timeout_s, _settle_none, fut)
            try:
                await fut
            finally:
                timer.cancel()
                left = self._waiters.get(room.tok)
                if left is not None and fut in left:
                    left.remove(fut)
                    if not left:
                        del self._waiters[room.tok]
        elif self.reads_busy(room.tok):
            await self.room_reads_settled(room.tok)  # it ended with reads in flight: after them
        return room.status

    def ping_info(self) -> dict[str, Any]:
        return {"name": self.rcfg.name, "pid": os.getpid()}

    # -- introspection -------------------------------------------------------------------
    def live_rooms(self) -> int:
        return self.core.live_rooms()

    def status_line(self) -> str:
        groups = ", ".join(f"{g.name} {len(g.ranks)}/{g.cp_size}" for g in list(self.core.groups.values())) or "no groups"
        return (f"receiver {self.rcfg.name}: {self.live_rooms()} rooms in flight; {groups}; "
                f"{sum(self.acct.bytes.values()) / 1e9:.3f} GB received")

    def metric_snapshot(self) -> dict[str, Any]:
        rooms = list(self.core.rooms.values())
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
                   registered={g.name: len(g.ranks) for g in list(self.core.groups.values())},
                   info={"role": "receiver", "name": self.rcfg.name, "version": __version__,
                         "protocol": str(PROTOCOL_VERSION)})
        return out

    def stats(self) -> dict[str, Any]:
        out = self.acct.snapshot()
        out.update(role="receiver", name=self.rcfg.name, pid=os.getpid(), incarnation=self.incarnation,
                   data_endpoint=self.data_endpoint, engine_endpoint=self.engine_endpoint,
                   metrics_port=self.metrics.port, uptime_s=round(time.time() - self.t_start, 3),
                   draining=self.draining, heap_trims=self.heap_trims, room_seconds=self.metrics.durations.totals())
        shm = self.shm_reader
        if shm is not None:  # the same-host plane's jobs read on its threads, and the call they use
            engine = shm.engine
            assert isinstance(engine, SameHostEngine)
            sealed = sum(1 for _, plane in self.planes.values()
                         if isinstance(plane, SameHostReceiver) and plane.file.sealed)
            out["same_host_reads"] = {"batches": shm.reads, "failed": shm.failed,
                                      "copy": "process_vm_readv" if engine.vm else "pread",
                                      "sealed_pools": sealed}  # peers' pools copied out of a mapping
        return out

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        by_state: dict[str, int] = {}
        for room in self.core.rooms.values():
            by_state[room.status.state.value] = by_state.get(room.status.state.value, 0) + 1
        return {
            "role": "receiver", "name": self.rcfg.name, "host": socket.gethostname(), "pid": os.getpid(),
            "data_endpoint": self.data_endpoint, "layout_fingerprint": self.layout.fingerprint(),
            "groups": {
                g.name: {"cp_size": g.cp_size, "split": g.split.value, "dedup": g.dedup, "ranks": {
                    str(rank): {"incarnation": self.core.peers[i].incarnation, "pid": self.core.peers[i].pid,
                                "host": self.core.peers[i].host, "last_seen_s": round(now - self.core.peers[i].last_seen, 3)}
                    for rank, i in sorted(g.ranks.items()) if i in self.core.peers}}
                for g in self.core.groups.values()
            },
            "rooms": by_state,
            "stats": self.stats(),
        }

