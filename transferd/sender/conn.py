"""The sender's receiver connections, as the shell holds them: the DEALER sockets, the data
plane chosen at registration, the data stream's set-up, and control messages out. What the
registration decides (states, epochs, when to register, when to give a receiver up, the stream
back-off) is :class:`~transferd.protocol.sender_core.SenderCore`'s; this module carries it out."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import zmq

from ..config import SenderConfig
from ..daemon.accounting import Accounting
from ..errors import TransferdError
from ..protocol.messages import Control, decode_header, encode
from ..protocol.sender_core import SenderCore
from ..transport import zerocopy
from ..transport.curve import watch_handshakes
from ..transport.data_stream import StreamWriter, stream_host
from ..transport.loop_socket import LoopSocket, configure
from ..transport.planes import ConnPipes, SendEnv, SenderPlane, sender_plane
from ..types import AutoOff, PlaneName

log = logging.getLogger(__name__)

STREAM_CONNECT_TIMEOUT_S = 5.0


@dataclass(slots=True, eq=False)
class Conn:
    id: int  # the core's id for it: its index in ``Connections.conns``
    endpoint: str
    pipes: ConnPipes
    plane: SenderPlane


class Connections:
    """Every configured receiver, one DEALER socket each. ``act`` runs the core's queued actions
    after each event this class feeds it."""

    def __init__(self, name: str, scfg: SenderConfig, core: SenderCore, acct: Accounting, env: SendEnv,
                 spawn: Callable[[Awaitable[Any], str], Any], act: Callable[[], None]) -> None:
        self.name = name
        self.scfg = scfg
        self.core = core
        self.acct = acct
        self.env = env
        self.spawn = spawn
        self.act = act
        self.conns: list[Conn] = []

    def open(self, zctx: zmq.Context[Any], ctx: Any, ident: bytes, keys: tuple[bytes, bytes, bytes] | None) -> None:
        """Connect to every receiver and register with each."""
        for ep in self.scfg.receivers:
            sock = zctx.socket(zmq.DEALER)
            configure(sock, hwm=self.scfg.send_hwm)
            sock.setsockopt(zmq.IDENTITY, ident)
            if keys is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
                self.spawn(watch_handshakes(sock, ctx, self._handshake_failed), f"handshakes {ep}")
            sock.connect(ep)
            cid = len(self.conns)
            link = LoopSocket(sock, functools.partial(self._on_message, cid), f"{self.name} → {ep}")
            rows = zerocopy.PoolSender(sock) if self.scfg.zero_copy == "direct" and zerocopy.available() else None
            pipes = ConnPipes(f"{self.name} → {ep}", link, rows)
            self.conns.append(Conn(cid, ep, pipes, sender_plane(PlaneName.ZMQ, self.env, pipes)))
            capable = self.scfg.data_stream == AutoOff.AUTO and stream_host(ep) is not None
            self.core.add_conn(cid, ep, stream_capable=capable, now=time.monotonic())
            self.act()

    def close(self) -> None:
        for c in self.conns:
            self.drop_stream(c.id)
            c.pipes.link.close(linger=500)

    def _handshake_failed(self, kind: str, what: str) -> None:
        self.acct.refused[kind] += 1
        log.error("%s: a receiver refused this sender at the security handshake (%s): check "
                  "sender.curve_secret_key / curve_server_key and the receiver's allow-list", self.name, what)

    # -- control messages ------------------------------------------------------------------------
    def send_ctrl(self, cid: int, msg: Control) -> None:
        """Small control message, never blocking the loop (dropped and counted if the pipe is full)."""
        conn = self.conns[cid]
        try:
            if conn.pipes.link.try_send([encode(msg)]):
                return
            why = "the pipe is full"
        except zmq.ZMQError as exc:
            why = str(exc)
        self.acct.dropped[f"ctrl_{type(msg).__name__.lower()}"] += 1
        log.debug("%s: %s to %s not sent: %s", self.name, type(msg).__name__, conn.endpoint, why)

    def send_reliable(self, cid: int, msg: Control) -> None:
        """A control message that must not be dropped: behind the data, waiting while the pipe
        is full (backpressure)."""
        link = self.conns[cid].pipes.link
        frames = [encode(msg)]
        if not link.try_send(frames):
            self.spawn(link.send(frames), f"send {type(msg).__name__}")

    # -- network input ---------------------------------------------------------------------------
    def _on_message(self, cid: int, frames: list[bytes]) -> None:
        try:
            self._on_frames(cid, frames)
        except Exception:
            log.exception("%s: error while handling a message from %s", self.name, self.conns[cid].endpoint)
            self.acct.refused["internal_error"] += 1

    def _on_frames(self, cid: int, frames: list[bytes]) -> None:
        now = time.monotonic()
        self.core.heard(cid, now)
        if len(frames) != 1:
            self.acct.refused["malformed"] += 1
            log.warning("%s: message with %d frames from %s refused", self.name, len(frames), self.conns[cid].endpoint)
            return
        try:
            msg = decode_header(frames[0])
        except TransferdError as exc:
            self.acct.refused[exc.code] += 1
            log.warning("%s: refused message from %s: %s", self.name, self.conns[cid].endpoint, exc)
            return
        self.core.received(cid, msg, now)
        self.act()

    # -- data planes and streams -----------------------------------------------------------------
    def use_plane(self, cid: int, plane: PlaneName, stream_port: int, stream_key: bytes) -> None:
        """The connection registered anew: its old stream closes, its rows take ``plane``."""
        conn = self.conns[cid]
        self.drop_stream(cid)
        conn.plane.close()
        conn.plane = sender_plane(plane, self.env, conn.pipes)
        if plane is PlaneName.STREAM:
            host = stream_host(conn.endpoint)
            assert host is not None
            writer = conn.pipes.stream = StreamWriter(conn.pipes.name, lambda why: None,
                                                      self.scfg.stream_send_buffer_bytes)
            writer.on_lost = functools.partial(self._stream_lost, cid, writer)
            self.spawn(self._connect_stream(conn, writer, host, stream_port, stream_key), f"stream {conn.endpoint}")

    def drop_stream(self, cid: int) -> None:
        """Close the connection's data stream (its messages take the ZeroMQ socket)."""
        pipes = self.conns[cid].pipes
        writer, pipes.stream = pipes.stream, None
        if writer is not None:
            writer.close()

    async def _connect_stream(self, conn: Conn, writer: StreamWriter, host: str, port: int, key: bytes) -> None:
        try:
            await writer.connect(host, port, key, STREAM_CONNECT_TIMEOUT_S)
        except TransferdError as exc:
            if conn.pipes.stream is writer:  # nothing went on it yet: the data takes the ZeroMQ socket
                writer.fallback = True
                conn.pipes.stream = None
                self.acct.dropped["stream_connect_failed"] += 1
                log.warning("%s: %s; data to receiver %s goes over its ZeroMQ socket instead (open the port, "
                            "fix receiver.stream_port, or set sender.data_stream = \"off\")", self.name, exc,
                            self.core.conns[conn.id].receiver)
            writer.close()

    def _stream_lost(self, cid: int, writer: StreamWriter, reason: str) -> None:
        pipes = self.conns[cid].pipes
        if pipes.stream is writer:
            pipes.stream = None
            self.core.stream_lost(cid, carried=writer.records != 0, reason=reason, now=time.monotonic())
            self.act()
