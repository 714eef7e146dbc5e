"""ZeroMQ plumbing shared by the agents: sockets, endpoints, the local engine API server."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
import os
import stat
from pathlib import Path
from typing import Any, Awaitable, Callable, cast

import msgpack
import zmq
import zmq.asyncio

from .errors import TransferdError

log = logging.getLogger(__name__)

LOCAL_API_VERSION = 1
MAX_LOCAL_REQUEST_BYTES = 64 * 1024 * 1024
MAX_BATCH = 65536


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def prepare_ipc(endpoint: str) -> None:
    """Create the directory of an ``ipc://`` endpoint, private to this user (0700)."""
    path = ipc_path(endpoint)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        path.unlink()  # a stale socket from a previous run; binding would otherwise fail or hijack


def restrict_ipc(endpoint: str) -> None:
    """Make an ``ipc://`` socket file readable and writable by its owner only (0600)."""
    path = ipc_path(endpoint)
    if path is not None and path.exists():
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


def configure(sock: zmq.Socket[Any], *, hwm: int = 0) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if hwm:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)


class LoopSocket:
    """A ZeroMQ socket driven by the event loop straight from its file descriptor.

    pyzmq's asyncio sockets make a Future per message, look the running loop up (a ``getpid()``
    system call on Python 3.11) and touch the poller for every send: most of a sender's CPU at
    1 MiB messages. Here the messages that arrived are drained in a loop and handed to
    ``on_message`` (at most ``budget`` per loop iteration, so timers and the engine API keep
    their turn); ``try_send`` sends at once and ``writable`` waits only while the high-water mark
    holds a message back.

    ZeroMQ's descriptor is edge-triggered and any operation on the socket may consume its signal:
    after every send the socket's events are looked at again on the next loop iteration
    (``kick``), and the reader never goes back to sleep before ``EVENTS`` says there is nothing
    left to read.
    """

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[Any]], None], name: str, *,
                 copy: bool = True, budget: int = 64) -> None:
        self.sock = sock
        self.on_message = on_message
        self.name = name
        self.copy = copy
        self.budget = budget
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._writers: list[asyncio.Future[None]] = []
        self._scheduled = False
        self._paused: asyncio.TimerHandle | None = None
        self.loop.add_reader(self._fd, self._on_ready)
        self.kick()

    def kick(self) -> None:
        """Look at the socket's events again on the next loop iteration: after every operation on
        the socket (this class's sends, and any made outside it)."""
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self.loop.call_soon(self._on_ready)

    def _on_ready(self) -> None:
        self._scheduled = False
        sock = self.sock
        n = 0
        while not self.closed:
            events = cast(int, sock.getsockopt(zmq.EVENTS))
            if events & zmq.POLLOUT and self._writers:
                writers, self._writers = self._writers, []
                for w in writers:
                    if not w.done():
                        w.set_result(None)
            if not events & zmq.POLLIN or self._paused is not None:
                return
            if n >= self.budget:
                self.kick()  # more to read: after the other callbacks of this iteration
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=self.copy)
            except zmq.Again:
                return
            n += 1
            try:
                self.on_message(frames)
            except Exception:  # the handler's bug must not stop the socket for every peer
                log.exception("%s: error while handling a message", self.name)

    def pause(self, seconds: float) -> None:
        """Read nothing for ``seconds`` (fault injection: a slow decode side)."""
        if self._paused is None and not self.closed:
            self._paused = self.loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self._paused = None
        self.kick()

    def try_send(self, frames: list[Any], *, copy: bool = True) -> bool:
        """Send at once; False (nothing sent) when the high-water mark holds the message back.
        Other ZeroMQ errors (an unknown peer on a ROUTER) are raised."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            return True
        except zmq.Again:
            return False
        finally:
            self.kick()

    async def writable(self) -> None:
        """Wait until the socket may take a message again (or is closed)."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, f"{self.name}: socket closed")
        fut: asyncio.Future[None] = self.loop.create_future()
        self._writers.append(fut)
        self.kick()
        await fut

    async def send(self, frames: list[Any], *, copy: bool = True) -> None:
        """Send, waiting while the high-water mark holds the message back (backpressure)."""
        while not self.try_send(frames, copy=copy):
            await self.writable()

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        if self._paused is not None:
            self._paused.cancel()
        self.loop.remove_reader(self._fd)
        for w in self._writers:
            if not w.done():
                w.set_exception(zmq.ZMQError(zmq.ENOTSOCK, f"{self.name}: socket closed"))
        self._writers.clear()
        self.sock.close(linger=linger)


HANDSHAKE_FAILURES: dict[int, str] = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "auth",  # the ZAP handler refused the key
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake",  # e.g. a plain peer against a CURVE socket
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake",
}


async def watch_handshakes(sock: zmq.Socket[Any], ctx: zmq.asyncio.Context,
                           on_fail: Callable[[str, str], None]) -> None:
    """Report failed ZeroMQ security handshakes on ``sock`` (socket monitor events, read through
    an asyncio socket of ``ctx``, which shares ``sock``'s ZeroMQ context)."""
    from zmq.utils.monitor import parse_monitor_message

    addr = f"inproc://transferd-monitor-{id(sock):x}-{os.getpid()}"
    sock.monitor(addr, zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                 | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    mon = ctx.socket(zmq.PAIR)
    mon.connect(addr)
    try:
        while True:
            ev = parse_monitor_message(await mon.recv_multipart())
            kind = HANDSHAKE_FAILURES.get(int(ev["event"]), "handshake")
            on_fail(kind, f"{kind} failure on {ev['endpoint'].decode(errors='replace')} (code {ev['value']})")
    finally:
        if not sock.closed:
            sock.disable_monitor()
        mon.close(linger=0)


def load_keypair(path: str, what: str) -> tuple[bytes, bytes]:
    """A CURVE key pair written by ``transferd keygen`` (``NAME.key_secret``)."""
    import zmq.auth

    from .errors import ConfigError

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: cannot read CURVE key file {path}: {exc}") from None
    if not secret:
        raise ConfigError(f"{what}: {path} holds no secret key (use the .key_secret file from transferd keygen)")
    return public, secret


def load_public_key(path: str, what: str) -> bytes:
    import zmq.auth

    from .errors import ConfigError

    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: cannot read CURVE public key {path}: {exc}") from None
    return public


def is_wildcard(endpoint: str) -> bool:
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    return host in ("*", "0.0.0.0", "[::]", "::")


Handler = Callable[[dict[str, Any]], Any]


class LocalApiServer:
    """The engine-facing socket: a ROUTER on a private ``ipc://`` (or loopback tcp) endpoint.

    Requests are one msgpack map ``{"id": int, "op": str, ...}``; every reply is
    ``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "code", "error"}``. Handlers run on
    the event loop; a handler may return an awaitable (for ``wait``), answered when it finishes.
    """

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, handlers: dict[str, Handler], name: str,
                 refused: Counter[str] | None = None) -> None:
        self.endpoint = endpoint
        self.handlers = handlers
        self.name = name
        prepare_ipc(endpoint)
        self.sock = ctx.socket(zmq.ROUTER)
        configure(self.sock)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_LOCAL_REQUEST_BYTES)
        self.sock.bind(endpoint)
        restrict_ipc(endpoint)
        self.bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.refused: Counter[str] = refused if refused is not None else Counter()
        """Engine requests refused, by ``engine_<code>`` (shared with the agent's accounting)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self.link: LoopSocket | None = None

    async def run(self) -> None:
        """Serve until cancelled (requests are handled as they arrive, on the loop)."""
        self.link = LoopSocket(self.sock, self._on_request, f"{self.name} engine API")
        await asyncio.get_running_loop().create_future()

    def _on_request(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.refused["engine_malformed"] += 1
            log.warning("%s: engine request with %d frames refused", self.name, len(frames))
            return
        ident, body = frames
        try:
            req = msgpack.unpackb(body, raw=False)
            if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                raise TransferdError("request must be a map with a string 'op'")
        except Exception as exc:
            self.refused["engine_decode"] += 1
            log.warning("%s: malformed engine request refused: %s", self.name, exc)
            self._reply(ident, {"id": None, "ok": False, "code": "decode", "error": f"malformed request: {exc}"})
            return
        rid = req.get("id")
        if req["op"] == "batch":
            outcome = self._batch(req)
        else:
            outcome = self._dispatch(req)
        if isinstance(outcome, dict):
            self._reply(ident, {"id": rid, **outcome})
        else:  # an awaitable (wait, or a batch holding one): answered when it finishes
            self._spawn(self._finish(ident, rid, outcome))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _dispatch(self, req: dict[str, Any]) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """Run one request: a reply body (``ok`` and ``result``, or ``code`` and ``error``), or an
        awaitable of one. Never raises: a bug in one request must not take the daemon down."""
        op = req.get("op")
        handler = self.handlers.get(op) if isinstance(op, str) else None
        if handler is None or not isinstance(op, str):
            self.refused["engine_unknown_op"] += 1
            return {"ok": False, "code": "bad_request",
                    "error": f"unknown op {op!r}; known: batch, {', '.join(sorted(self.handlers))}"}
        try:
            result = handler(req)
        except Exception as exc:
            return self._error(op, exc)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            return self._settle(op, result)
        return {"ok": True, "result": result}

    async def _settle(self, op: str, aw: Awaitable[Any]) -> dict[str, Any]:
        try:
            return {"ok": True, "result": await aw}
        except Exception as exc:
            return self._error(op, exc)

    def _error(self, op: str, exc: Exception) -> dict[str, Any]:
        if isinstance(exc, TransferdError):
            self.refused[f"engine_{exc.code}"] += 1
            return {"ok": False, "code": exc.code, "error": str(exc)}
        if isinstance(exc, (KeyError, TypeError, ValueError, OverflowError)):
            self.refused["engine_bad_request"] += 1
            return {"ok": False, "code": "bad_request", "error": f"{op}: bad arguments: {type(exc).__name__}: {exc}"}
        log.error("%s: engine request %r failed", self.name, op, exc_info=exc)
        return {"ok": False, "code": "internal", "error": f"{op}: internal error: {type(exc).__name__}: {exc}"}

    def _batch(self, req: dict[str, Any]) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """``{"op": "batch", "calls": [request, …]}``: every call in order, one reply holding a
        list of per-call replies (a batch of waits answers when the last one does)."""
        calls = req.get("calls")
        if not isinstance(calls, list) or len(calls) > MAX_BATCH or not all(isinstance(c, dict) for c in calls):
            return {"ok": False, "code": "bad_request",
                    "error": f"batch: 'calls' must be a list of at most {MAX_BATCH} request maps"}
        outcomes = [self._dispatch(c) if c.get("op") != "batch" else
                    {"ok": False, "code": "bad_request", "error": "batches do not nest"} for c in calls]
        if all(isinstance(o, dict) for o in outcomes):
            return {"ok": True, "result": outcomes}

        async def gather() -> dict[str, Any]:  # the waits run concurrently, each with its own timeout
            settled = iter(await asyncio.gather(*(o for o in outcomes if not isinstance(o, dict))))
            return {"ok": True, "result": [o if isinstance(o, dict) else next(settled) for o in outcomes]}

        return gather()

    async def _finish(self, ident: bytes, rid: Any, aw: Awaitable[dict[str, Any]]) -> None:
        self._reply(ident, {"id": rid, **(await aw)})

    def _reply(self, ident: bytes, body: dict[str, Any]) -> None:
        """Answer at once; an engine whose pipe is full gets its answer when it reads again."""
        frames = [ident, msgpack.packb(body, use_bin_type=True)]
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
        if self.link is not None:
            self.link.close(linger=0)
        else:
            self.sock.close(linger=0)
        path = ipc_path(self.endpoint)
        if path is not None:
            path.unlink(missing_ok=True)
