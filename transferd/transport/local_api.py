"""The engine-facing socket of each daemon (see :mod:`transferd.protocol.engine_api` for the
requests, replies and their checks)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import zmq

from ..errors import TransferdError
from .loop_socket import LoopSocket, configure, ipc_path, prepare_ipc, restrict_ipc

log = logging.getLogger(__name__)

MAX_LOCAL_REQUEST_BYTES = 64 * 1024 * 1024
MAX_BATCH = 65536


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
