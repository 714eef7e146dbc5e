"""The engine-side Python client: talks to a local transferd daemon over its private socket.

``PrefillClient`` (one per prefill CP rank, talking to that rank's sender agent) and
``DecodeClient`` (talking to the decode host's receiver). Both are synchronous and thread-safe;
errors raised in the daemon come back as the same :class:`~transferd.errors.TransferdError`
subclass with the daemon's message.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import zmq

from .errors import ClientTimeout, DecodeError, TransferdError, VersionMismatch
from .protocol.engine_api import (
    LOCAL_API_VERSION,
    Expect,
    Ok,
    Ping,
    ReceiverAbort,
    ReceiverPoll,
    ReceiverWait,
    Refusal,
    Release,
    Request,
    SenderAbort,
    SenderPoll,
    SenderWait,
    Stats,
    Status,
    Submit,
    batch_replies,
    builds,
    call_map,
    decode_reply,
    packer,
    request_map,
)
from .protocol.room import RoomState, RoomStatus
from .transport.local_stream import FRAME, unix_path

__all__ = ["LOCAL_API_VERSION", "DecodeClient", "PrefillClient", "RoomState", "RoomStatus"]


MAX_REPLY_BYTES = 1 << 30  # a longer reply from a unix:// daemon is refused, not read

Rows = Sequence[int] | np.ndarray
"""Page or slot indices: a list, a range or a numpy integer array."""

R = TypeVar("R", bound=Request)

_PING, _STATS, _STATUS = Ping(), Stats(), Status()  # no fields: one of each serves every call


def _pages(v: Rows) -> list[int]:
    return list(map(int, v if type(v) is list else v.tolist() if hasattr(v, "tolist") else v))


def _int(v: Any) -> Any:
    """A numpy integer as a Python int; anything else as it is (the request's check judges it)."""
    return v if type(v) is int or type(v) is str else int(v) if isinstance(v, np.integer) else v


def _rows(v: Any) -> Any:
    """Page or slot indices (a sequence, a range, a numpy array) as a list of Python ints;
    anything else as it is (the request's check judges it)."""
    v = _int(v)
    return _pages(v) if not isinstance(v, (str, bytes)) and hasattr(v, "__iter__") else v


def _slot_map(v: Any) -> Any:
    if v is None:
        return v
    v = _int(v)
    return {k: _pages(x) for k, x in v.items()} if isinstance(v, Mapping) else v


def _aux(v: Any) -> Any:
    v = _int(v)
    return int(v) if v is not None and not isinstance(v, bool) else v


def _normalize(args: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :meth:`PrefillClient.submit` or :meth:`DecodeClient.expect` in their
    wire form: numpy rows and integers as Python ones, ``last`` as a bool, ``aux_slot`` as an int
    (as those methods always took them); checked afterwards by the request's own decoder."""
    out = {k: _int(v) for k, v in args.items()}
    for key in ("src_pages", "dst_pages"):
        if key in out and not isinstance(out[key], (str, bytes)) and hasattr(out[key], "__iter__"):
            out[key] = _pages(out[key])
    if isinstance(out.get("state"), Mapping):
        out["state"] = {k: _pages(v) for k, v in out["state"].items()}
    if "last" in out:
        out["last"] = bool(out["last"])
    if out.get("aux_slot") is not None and not isinstance(out["aux_slot"], bool):
        out["aux_slot"] = int(out["aux_slot"])
    return out


class _ZmqLink:
    """An ``ipc://`` or ``tcp://`` endpoint: a DEALER; replies matched by id."""

    def __init__(self, endpoint: str, ctx: zmq.Context[Any] | None) -> None:
        self.endpoint = endpoint
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._new()

    def _new(self) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def roundtrip(self, body: bytes, rid: int, op: str, timeout: float) -> Ok | Refusal:
        self._sock.send(body)
        while True:
            if not self._sock.poll(int(timeout * 1000)):
                # the reply may still come: a fresh socket keeps later calls from reading it
                self.reset()
                raise ClientTimeout(f"no answer to {op!r} from {self.endpoint} within {timeout:g}s")
            reply_id, outcome = decode_reply(self._sock.recv())
            if reply_id == rid:
                return outcome

    def reset(self) -> None:
        self._sock.close(linger=0)
        self._sock = self._new()

    def close(self) -> None:
        self._sock.close(linger=0)


class _UnixLink:
    """A ``unix://PATH`` endpoint: one stream connection, each message framed by its u32
    big-endian length (docs/PROTOCOL.md §17). Connected at the first call and again after the
    daemon closed it; a call waits up to its timeout for a daemon that is not up yet."""

    def __init__(self, endpoint: str, path: str) -> None:
        self.endpoint = endpoint
        self.path = path
        self._sock: socket.socket | None = None
        self._buf = bytearray()

    def _connect(self, deadline: float, op: str, timeout: float) -> socket.socket:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.connect(self.path)
                return sock
            except (TimeoutError, FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise ClientTimeout(f"no answer to {op!r} from {self.endpoint} within {timeout:g}s: no daemon "
                                        f"listening ({exc})") from None
                time.sleep(0.01)
            except OSError as exc:
                sock.close()
                raise ClientTimeout(f"{op!r} to {self.endpoint}: cannot connect: {exc}") from None

    def roundtrip(self, body: bytes, rid: int, op: str, timeout: float) -> Ok | Refusal:
        deadline = time.monotonic() + timeout
        frame = FRAME.pack(len(body)) + body
        for retry in (False, True):  # a connection the daemon closed since the last call is made again
            fresh = retry or self._sock is None
            if self._sock is None:
                self._sock = self._connect(deadline, op, timeout)
            sock = self._sock
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(frame)
                break
            except TimeoutError:
                self.reset()
                raise ClientTimeout(f"{op!r} to {self.endpoint}: not taken within {timeout:g}s") from None
            except OSError as exc:
                self.reset()
                if fresh:
                    raise ClientTimeout(f"{op!r} to {self.endpoint}: the connection failed: {exc}") from None
        while True:
            reply = self._frame(deadline, op, timeout)
            reply_id, outcome = decode_reply(reply)
            if reply_id == rid:
                return outcome

    def _frame(self, deadline: float, op: str, timeout: float) -> bytes:
        buf = self._buf
        while True:
            if len(buf) >= FRAME.size:
                (n,) = FRAME.unpack_from(buf)
                if n > MAX_REPLY_BYTES:
                    self.reset()
                    raise DecodeError(f"a reply of {n} bytes from {self.endpoint}, over the limit of {MAX_REPLY_BYTES}")
                if len(buf) >= FRAME.size + n:
                    body = bytes(buf[FRAME.size:FRAME.size + n])
                    del buf[:FRAME.size + n]
                    return body
            left = deadline - time.monotonic()
            assert self._sock is not None
            try:
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                self.reset()  # the reply may still come: a fresh connection keeps later calls from reading it
                raise ClientTimeout(f"no answer to {op!r} from {self.endpoint} within {timeout:g}s") from None
            except OSError as exc:
                self.reset()
                raise ClientTimeout(f"no answer to {op!r} from {self.endpoint}: {exc}") from None
            if not data:
                self.reset()
                raise ClientTimeout(f"no answer to {op!r} from {self.endpoint}: the daemon closed the connection")
            buf += data

    def reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf.clear()

    def close(self) -> None:
        self.reset()


class _Client:
    def __init__(self, endpoint: str, *, timeout_s: float = 30.0, ctx: zmq.Context[Any] | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        path = unix_path(endpoint)
        self._link: _ZmqLink | _UnixLink = _ZmqLink(endpoint, ctx) if path is None else _UnixLink(endpoint, str(path))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pack = packer()  # used under the lock only

    def call(self, op: str, reply_timeout_s: float | None = None, **args: Any) -> Any:
        """Send one request, ``{"id", "v", "op", **args}`` with ``args`` as given (the daemon
        checks them), and wait for its reply; raises the daemon's error or ClientTimeout."""
        return self._result(self._roundtrip(op, args, reply_timeout_s))

    def request(self, req: Request, reply_timeout_s: float | None = None) -> Any:
        """Send one typed request and wait for its result; raises the daemon's error."""
        return self._result(self._roundtrip(req.op, req.to_wire(), reply_timeout_s))

    def _roundtrip(self, op: str, args: Mapping[str, Any], reply_timeout_s: float | None) -> Ok | Refusal:
        timeout = self.timeout_s if reply_timeout_s is None else reply_timeout_s
        with self._lock:
            rid = next(self._ids)
            return self._link.roundtrip(self._pack(request_map(rid, op, args)), rid, op, timeout)

    def _result(self, outcome: Ok | Refusal) -> Any:
        if isinstance(outcome, Refusal):
            if outcome.code == VersionMismatch.code:  # the daemon, or its reply, is of another version
                raise VersionMismatch(f"engine API of {self.endpoint}: {outcome.message}")
            raise outcome.error()
        return outcome.result

    def batch(self, calls: Sequence[Mapping[str, Any] | Request],
              reply_timeout_s: float | None = None) -> list[Any]:
        """Many requests in one round trip (typed requests, or request maps such as
        ``{"op": "expect", ...}``, sent as given): a list holding, per call, its result or the
        :class:`TransferdError` it raised (returned, not raised)."""
        wire = [call_map(c) if isinstance(c, Request) else dict(c) for c in calls]
        replies = batch_replies(self.call("batch", reply_timeout_s, calls=wire))
        return [r.error() if isinstance(r, Refusal) else r.result for r in replies]

    def _batched(self, items: Sequence[Request | TransferdError],
                 reply_timeout_s: float | None = None) -> list[Any]:
        """A batch of the items that are requests; an item that is an error (a request refused
        before it was sent) keeps its place in the answer."""
        sent = [i for i in items if isinstance(i, Request)]
        answers = iter(self.batch(sent, reply_timeout_s) if sent else [])
        return [next(answers) if isinstance(i, Request) else i for i in items]

    def _reset(self) -> None:
        self._link.reset()

    def close(self) -> None:
        self._link.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ping(self, timeout_s: float | None = None) -> dict[str, Any]:
        return cast(dict[str, Any], self.request(_PING, timeout_s))

    def stats(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.request(_STATS))

    def status(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.request(_STATUS))


def _status(result: Any) -> RoomStatus:
    return RoomStatus.from_wire(result)


def _statuses(results: list[Any]) -> list[RoomStatus | TransferdError]:
    return [r if isinstance(r, TransferdError) else RoomStatus.from_wire(r) for r in results]


def _requests(cls: type[R], items: Sequence[R | Mapping[str, Any]]) -> list[R | TransferdError]:
    return builds(cls, [i if isinstance(i, cls) or not isinstance(i, Mapping) else _normalize(i) for i in items])


class PrefillClient(_Client):
    """Prefill engine, one CP rank: submit a room's chunks, then poll or wait for its outcome."""

    def submit(self, room: int, start: int, src_pages: Rows, *, last: bool = False,
               state: Mapping[str, Rows] | None = None, aux_slot: int | None = None) -> RoomStatus:
        # what _normalize does, spelt out for the one call (in its order: pages, state, last, aux_slot)
        pages, slots, ends, aux = _rows(src_pages), _slot_map(state), bool(_int(last)), _aux(aux_slot)
        req = Submit.from_wire({"room": _int(room), "start": _int(start), "src_pages": pages, "last": ends,
                                "state": slots, "aux_slot": aux})
        return _status(self.request(req))

    def poll(self, room: int) -> RoomStatus:
        return _status(self.request(SenderPoll.from_wire({"room": _int(room)})))

    def wait(self, room: int, timeout_s: float = 60.0) -> RoomStatus:
        """Block until the room is Success or Failed, or ``timeout_s`` passes (then its current status)."""
        req = SenderWait.from_wire({"room": _int(room), "timeout_s": _int(timeout_s)})
        return _status(self.request(req, timeout_s + self.timeout_s))

    def abort(self, room: int, reason: str = "") -> RoomStatus:
        return _status(self.request(SenderAbort.from_wire({"room": _int(room), "reason": _int(reason)})))

    def submit_many(self, chunks: Sequence[Submit | Mapping[str, Any]]) -> list[RoomStatus | TransferdError]:
        """Several :meth:`submit` calls in one round trip, each a :class:`Submit` or a dict of
        :meth:`submit`'s keyword arguments. A chunk whose arguments are refused before sending
        gets its :class:`~transferd.errors.BadRequest` in its place; the others are sent."""
        return _statuses(self._batched(_requests(Submit, chunks)))


class DecodeClient(_Client):
    """Decode engine: expect a room from a prefill group, poll or wait, abort, release."""

    def expect(self, room: int, group: str, dst_pages: Rows, *, aux_slot: int, prefix_pages: int = 0,
               state: Mapping[str, Rows] | None = None) -> RoomStatus:
        pages, slots, aux = _rows(dst_pages), _slot_map(state), _aux(aux_slot)  # as _normalize does
        req = Expect.from_wire({"room": _int(room), "group": _int(group), "dst_pages": pages, "aux_slot": aux,
                                "prefix_pages": _int(prefix_pages), "state": slots})
        return _status(self.request(req))

    def poll(self, room: int, group: str) -> RoomStatus:
        return _status(self.request(ReceiverPoll.from_wire({"room": _int(room), "group": _int(group)})))

    def wait(self, room: int, group: str, timeout_s: float = 60.0) -> RoomStatus:
        req = ReceiverWait.from_wire({"room": _int(room), "group": _int(group), "timeout_s": _int(timeout_s)})
        return _status(self.request(req, timeout_s + self.timeout_s))

    def abort(self, room: int, group: str, reason: str = "") -> RoomStatus:
        """Once this returns, no further byte of the room is written to the decode pool."""
        return _status(self.request(ReceiverAbort.from_wire({"room": _int(room), "group": _int(group),
                                                             "reason": _int(reason)})))

    def release(self, room: int, group: str) -> RoomStatus:
        return _status(self.request(Release.from_wire({"room": _int(room), "group": _int(group)})))

    def expect_many(self, rooms: Sequence[Expect | Mapping[str, Any]]) -> list[RoomStatus | TransferdError]:
        """Several :meth:`expect` calls in one round trip, each an :class:`Expect` or a dict of
        :meth:`expect`'s keyword arguments. A room whose arguments are refused before sending
        gets its :class:`~transferd.errors.BadRequest` in its place; the others are sent."""
        return _statuses(self._batched(_requests(Expect, rooms)))

    def wait_many(self, rooms: list[tuple[int, str]], timeout_s: float = 60.0) -> list[RoomStatus | TransferdError]:
        """Wait for many rooms at once: answered when every one has ended or its timeout passed."""
        items = builds(ReceiverWait, [_normalize({"room": room, "group": group, "timeout_s": timeout_s})
                                      for room, group in rooms])
        return _statuses(self._batched(items, timeout_s + self.timeout_s))

    def release_many(self, rooms: list[tuple[int, str]]) -> list[RoomStatus | TransferdError]:
        items = builds(Release, [_normalize({"room": room, "group": group}) for room, group in rooms])
        return _statuses(self._batched(items))
