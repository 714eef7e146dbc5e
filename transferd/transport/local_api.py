"""The engine-facing socket of each daemon: framing and dispatch. The requests, replies, their
checks and the batch rules are :mod:`transferd.protocol.engine_api`; what each op does is the
role's handler table (``transferd.receiver.api.handlers``, ``transferd.sender.api.handlers``)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import zmq

from ..errors import TransferdError
from ..protocol.engine_api import (
    MAX_BATCH,
    RECEIVER_OPS,
    SENDER_OPS,
    Batch,
    BatchReply,
    Ok,
    Refusal,
    Reply,
    Request,
    UnknownOp,
    decode_request,
    encode_reply,
    packer,
)
from ..protocol.room import RoomStatus
from .local_stream import UnixConn, UnixFront, unix_path
from .loop_socket import LoopSocket, configure, ipc_path, prepare_ipc, restrict_ipc

log = logging.getLogger(__name__)

MAX_LOCAL_REQUEST_BYTES = 64 * 1024 * 1024

__all__ = ["MAX_BATCH", "MAX_LOCAL_REQUEST_BYTES", "Handler", "HandlerTable", "LocalApiServer"]

Handler = Callable[[Any], Any]
"""Runs one typed request (its exact :class:`Request` subclass): returns the result (a
:class:`~transferd.protocol.room.RoomStatus` or a msgpack-able value), or an awaitable of it."""

HandlerTable = Mapping[type[Request], Handler]
"""A daemon's ops: request class → handler. Its classes must be one role's (``RECEIVER_OPS`` or
``SENDER_OPS`` values); the ops it holds are the ops served, every other op is unknown."""


class LocalApiServer:
    """The engine-facing socket: a Unix stream socket on a private ``unix://`` path
    (:mod:`.local_stream`), or a ZeroMQ ROUTER on a private ``ipc://`` (or loopback tcp)
    endpoint; the same requests and replies on either.

    Each request is one msgpack frame, decoded and checked by :mod:`~transferd.protocol.engine_api`
    (its version included), then run by the handler of its type on the event loop; a handler may
    return an awaitable (for ``wait``), answered when it finishes. Every refusal is answered with a
    code and a message, and counted in ``refused["engine_<code>"]`` (``engine_unknown_op`` for an
    op this daemon does not serve).
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, handlers: HandlerTable,
                 name: str, refused: Counter[str] | None = None) -> None:
        self.endpoint = endpoint
        self.handlers = dict(handlers)
        if not any(set(self.handlers) <= set(ops.values()) for ops in (RECEIVER_OPS, SENDER_OPS)):
            names = sorted(f"{cls.__name__} ({cls.op})" for cls in self.handlers)
            raise ValueError(f"engine API handlers {names} are not one role's ops")
        self.ops: dict[str, type[Request]] = {cls.op: cls for cls in self.handlers}
        """The ops served, by name (what the decoder accepts)."""
        self.name = name
        self.refused: Counter[str] = refused if refused is not None else Counter()
        """Engine requests refused, by ``engine_<code>`` (shared with the agent's accounting)."""
        self.sock: zmq.Socket[Any] | None = None
        self.unix: UnixFront | None = None
        path = unix_path(endpoint)
        if path is not None:
            self.unix = UnixFront(path, self._on_request, name, MAX_LOCAL_REQUEST_BYTES, self.refused)
            self.bound = endpoint
        else:
            prepare_ipc(endpoint)
            self.sock = ctx.socket(zmq.ROUTER)
            configure(self.sock)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_LOCAL_REQUEST_BYTES)
            self.sock.bind(endpoint)
            restrict_ipc(endpoint)
            self.bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.link: LoopSocket | None = None
        self._pack = packer()  # replies are encoded on the loop's thread only

    async def run(self) -> None:
        """Serve until cancelled (requests are handled as they arrive, on the loop)."""
        loop = asyncio.get_running_loop()
        if self.unix is not None:
            self.unix.start(loop)
        else:
            assert self.sock is not None
            self.link = LoopSocket(self.sock, self._on_zmq_request, f"{self.name} engine API")
        await loop.create_future()

    def _on_zmq_request(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.refused["engine_malformed"] += 1
            log.warning("%s: engine request with %d frames refused", self.name, len(frames))
            return
        self._on_request(frames[0], frames[1])

    def _on_request(self, ident: bytes | UnixConn, body: bytes) -> None:
        """One request from a client: ``ident`` is its ZeroMQ identity or its Unix connection."""
        rid, req = decode_request(body, self.ops)
        if isinstance(req, TransferdError):
            if req.code in ("decode", "version"):
                log.warning("%s: engine request refused: %s", self.name, req)
            outcome: Reply | Awaitable[Reply] = self._refuse(req)
        else:
            outcome = self._run(req)
        if isinstance(outcome, (Ok, Refusal, BatchReply)):
            self._answer(ident, rid, outcome)
        else:  # an awaitable (wait, or a batch holding one): answered when it finishes
            self._spawn(self._finish(ident, rid, outcome))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _run(self, req: Request) -> Reply | Awaitable[Reply]:
        if type(req) is Batch:
            return self._batch(req)
        return self._dispatch(req)

    def _refuse(self, exc: TransferdError) -> Refusal:
        self.refused["engine_unknown_op" if isinstance(exc, UnknownOp) else f"engine_{exc.code}"] += 1
        return Refusal.of(exc)

    def _dispatch(self, req: Request) -> Ok | Refusal | Awaitable[Ok | Refusal]:
        """Run one request: its reply, or an awaitable of it. Never raises: a bug in one request
        must not take the daemon down."""
        try:
            result = self.handlers[type(req)](req)
        except Exception as exc:
            return self._error(req.op, exc)
        if type(result) is RoomStatus or type(result) is dict:  # the common results, without the ABC checks
            return Ok(result)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            return self._settle(req.op, result)
        return Ok(result)

    async def _settle(self, op: str, aw: Awaitable[Any]) -> Ok | Refusal:
        try:
            return Ok(await aw)
        except Exception as exc:
            return self._error(op, exc)

    def _error(self, op: str, exc: Exception) -> Refusal:
        if isinstance(exc, TransferdError):
            return self._refuse(exc)
        if isinstance(exc, (KeyError, TypeError, ValueError, OverflowError)):
            self.refused["engine_bad_request"] += 1
            return Refusal("bad_request", f"{op}: bad arguments: {type(exc).__name__}: {exc}")
        log.error("%s: engine request %r failed", self.name, op, exc_info=exc)
        return Refusal("internal", f"{op}: internal error: {type(exc).__name__}: {exc}")

    def _batch(self, batch: Batch) -> BatchReply | Awaitable[BatchReply]:
        """Every call in order, one reply holding a reply per call (a call that did not decode is
        refused alone; a batch of waits answers when the last one does)."""
        outcomes = [self._refuse(c) if isinstance(c, TransferdError) else self._dispatch(c) for c in batch.calls]
        done: list[Ok | Refusal] = [o for o in outcomes if isinstance(o, (Ok, Refusal))]
        if len(done) == len(outcomes):
            return BatchReply(tuple(done))

        async def gather() -> BatchReply:  # the waits run concurrently, each with its own timeout
            settled = iter(await asyncio.gather(*(o for o in outcomes if not isinstance(o, (Ok, Refusal)))))
            return BatchReply(tuple(o if isinstance(o, (Ok, Refusal)) else next(settled) for o in outcomes))

        return gather()

    async def _finish(self, ident: bytes | UnixConn, rid: Any, aw: Awaitable[Reply]) -> None:
        self._answer(ident, rid, await aw)

    def _answer(self, ident: bytes | UnixConn, rid: Any, reply: Reply) -> None:
        try:
            body = encode_reply(rid, reply, self._pack)
        except Exception as exc:  # a handler's result msgpack cannot carry: a bug, not a crash
            log.error("%s: engine reply could not be encoded", self.name, exc_info=exc)
            body = encode_reply(rid, Refusal("internal", f"internal error: reply not encodable: {exc}"), self._pack)
        self._reply(ident, body)

    def _reply(self, ident: bytes | UnixConn, body: bytes) -> None:
        """Answer at once; an engine whose pipe is full gets its answer when it reads again."""
        if type(ident) is UnixConn:
            ident.send(body)
            return
        assert type(ident) is bytes
        frames = [ident, body]
        assert self.link is not None
        try:
            if not self.link.try_send(frames):
                self._spawn(self._reply_later(frames))
        except zmq.ZMQError as exc:  # the engine went away
            log.debug("%s: reply to engine dropped: %s", self.name, exc)

    async def _reply_later(self, frames: list[bytes]) -> None:
        assert self.link is not None
        try:
            await self.link.send(frames)
        except zmq.ZMQError as exc:
            log.debug("%s: reply to engine dropped: %s", self.name, exc)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.unix is not None:
            self.unix.close()
        elif self.link is not None:
            self.link.close(linger=0)
        else:
            assert self.sock is not None
            self.sock.close(linger=0)
        path = ipc_path(self.endpoint)
        if path is not None:
            path.unlink(missing_ok=True)
