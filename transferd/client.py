"""The engine-side Python client: talks to a local transferd daemon over its private socket.

``PrefillClient`` (one per prefill CP rank, talking to that rank's sender agent) and
``DecodeClient`` (talking to the decode host's receiver). Both are synchronous and thread-safe;
errors raised in the daemon come back as the same :class:`~transferd.errors.TransferdError`
subclass with the daemon's message.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgpack
import numpy as np
import zmq

from .errors import ClientTimeout, TransferdError, error_from_code
from .protocol.room import RoomState, RoomStatus

__all__ = ["DecodeClient", "PrefillClient", "RoomState", "RoomStatus"]


Rows = Sequence[int] | np.ndarray
"""Page or slot indices: a list, a range or a numpy integer array."""


def _pages(v: Rows) -> list[int]:
    return [int(x) for x in (v.tolist() if hasattr(v, "tolist") else v)]


class _Client:
    def __init__(self, endpoint: str, *, timeout_s: float = 30.0, ctx: zmq.Context[Any] | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(self, op: str, reply_timeout_s: float | None = None, **args: Any) -> Any:
        """Send one request and wait for its reply; raises the daemon's error or ClientTimeout."""
        timeout = self.timeout_s if reply_timeout_s is None else reply_timeout_s
        with self._lock:
            rid = next(self._ids)
            self._sock.send(msgpack.packb({"id": rid, "op": op, **args}, use_bin_type=True))
            while True:
                if not self._sock.poll(int(timeout * 1000)):
                    # the reply may still come: a fresh socket keeps later calls from reading it
                    self._reset()
                    raise ClientTimeout(f"no answer to {op!r} from {self.endpoint} within {timeout:g}s")
                reply = msgpack.unpackb(self._sock.recv(), raw=False)
                if reply.get("id") == rid:
                    break
        if not reply.get("ok"):
            raise error_from_code(reply.get("code", "error"), reply.get("error", "unknown error"))
        return reply.get("result")

    def batch(self, calls: list[dict[str, Any]], reply_timeout_s: float | None = None) -> list[Any]:
        """Many requests in one round trip (``[{"op": "expect", ...}, ...]``): a list holding, per
        call, its result or the :class:`TransferdError` it raised (returned, not raised)."""
        out = []
        for r in self.call("batch", reply_timeout_s, calls=calls):
            out.append(r["result"] if r.get("ok") else error_from_code(r.get("code", "error"), r.get("error", "")))
        return out

    def _reset(self) -> None:
        self._sock.close(linger=0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ping(self, timeout_s: float | None = None) -> dict[str, Any]:
        return cast(dict[str, Any], self.call("ping", timeout_s))

    def stats(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.call("stats"))

    def status(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.call("status"))


class PrefillClient(_Client):
    """Prefill engine, one CP rank: submit a room's chunks, then poll or wait for its outcome."""

    def submit(self, room: int, start: int, src_pages: Rows, *, last: bool = False,
               state: Mapping[str, Rows] | None = None, aux_slot: int | None = None) -> RoomStatus:
        args: dict[str, Any] = {"room": room, "start": start, "src_pages": _pages(src_pages), "last": last}
        if state:
            args["state"] = {k: _pages(v) for k, v in state.items()}
        if aux_slot is not None:
            args["aux_slot"] = int(aux_slot)
        return RoomStatus.from_wire(self.call("submit", **args))

    def poll(self, room: int) -> RoomStatus:
        return RoomStatus.from_wire(self.call("poll", room=room))

    def wait(self, room: int, timeout_s: float = 60.0) -> RoomStatus:
        """Block until the room is Success or Failed, or ``timeout_s`` passes (then its current status)."""
        return RoomStatus.from_wire(self.call("wait", timeout_s + self.timeout_s, room=room, timeout_s=timeout_s))

    def abort(self, room: int, reason: str = "") -> RoomStatus:
        return RoomStatus.from_wire(self.call("abort", room=room, reason=reason))

    def submit_many(self, chunks: list[dict[str, Any]]) -> list[RoomStatus | TransferdError]:
        """Several :meth:`submit` calls (each a dict of its keyword arguments) in one round trip."""
        calls = []
        for c in chunks:
            call: dict[str, Any] = {"op": "submit", "room": c["room"], "start": c.get("start", 0),
                                    "src_pages": _pages(c["src_pages"]), "last": bool(c.get("last", False))}
            if c.get("state"):
                call["state"] = {k: _pages(v) for k, v in c["state"].items()}
            if c.get("aux_slot") is not None:
                call["aux_slot"] = int(c["aux_slot"])
            calls.append(call)
        return _statuses(self.batch(calls))


def _statuses(results: list[Any]) -> list[RoomStatus | TransferdError]:
    return [r if isinstance(r, TransferdError) else RoomStatus.from_wire(r) for r in results]


class DecodeClient(_Client):
    """Decode engine: expect a room from a prefill group, poll or wait, abort, release."""

    def expect(self, room: int, group: str, dst_pages: Rows, *, aux_slot: int, prefix_pages: int = 0,
               state: Mapping[str, Rows] | None = None) -> RoomStatus:
        args: dict[str, Any] = {"room": room, "group": group, "dst_pages": _pages(dst_pages),
                                "prefix_pages": prefix_pages, "aux_slot": int(aux_slot)}
        if state:
            args["state"] = {k: _pages(v) for k, v in state.items()}
        return RoomStatus.from_wire(self.call("expect", **args))

    def poll(self, room: int, group: str) -> RoomStatus:
        return RoomStatus.from_wire(self.call("poll", room=room, group=group))

    def wait(self, room: int, group: str, timeout_s: float = 60.0) -> RoomStatus:
        return RoomStatus.from_wire(self.call("wait", timeout_s + self.timeout_s, room=room, group=group, timeout_s=timeout_s))

    def abort(self, room: int, group: str, reason: str = "") -> RoomStatus:
        """Once this returns, no further byte of the room is written to the decode pool."""
        return RoomStatus.from_wire(self.call("abort", room=room, group=group, reason=reason))

    def release(self, room: int, group: str) -> RoomStatus:
        return RoomStatus.from_wire(self.call("release", room=room, group=group))

    def expect_many(self, rooms: list[dict[str, Any]]) -> list[RoomStatus | TransferdError]:
        """Several :meth:`expect` calls (each a dict of its keyword arguments) in one round trip."""
        calls = []
        for r in rooms:
            call: dict[str, Any] = {"op": "expect", "room": r["room"], "group": r["group"],
                                    "dst_pages": _pages(r["dst_pages"]), "prefix_pages": r.get("prefix_pages", 0),
                                    "aux_slot": int(r["aux_slot"])}
            if r.get("state"):
                call["state"] = {k: _pages(v) for k, v in r["state"].items()}
            calls.append(call)
        return _statuses(self.batch(calls))

    def wait_many(self, rooms: list[tuple[int, str]], timeout_s: float = 60.0) -> list[RoomStatus | TransferdError]:
        """Wait for many rooms at once: answered when every one has ended or its timeout passed."""
        calls = [{"op": "wait", "room": room, "group": group, "timeout_s": timeout_s} for room, group in rooms]
        return _statuses(self.batch(calls, timeout_s + self.timeout_s))

    def release_many(self, rooms: list[tuple[int, str]]) -> list[RoomStatus | TransferdError]:
        return _statuses(self.batch([{"op": "release", "room": room, "group": group} for room, group in rooms]))
