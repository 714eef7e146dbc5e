"""The local engine API's wire: typed requests and replies, their strict decoder, the batch rules
and the API version (pure; docs/PROTOCOL.md §17 describes the same format in prose).

A request is one msgpack map ``{"id": any, "v": LOCAL_API_VERSION, "op": str, ...fields}``; a
reply is ``{"id": echoed, "v": LOCAL_API_VERSION, "ok": true, "result": value}`` or ``{"id", "v",
"ok": false, "code": str, "error": str}``. Each op is a slotted dataclass below whose fields are
the request's fields; :func:`parse_request` checks every one of them (types, bounds, unknown
fields) before a daemon acts on it, with a decoder generated per class from those fields. :data:`RECEIVER_OPS` and :data:`SENDER_OPS` say which ops each
daemon serves; an op of the other daemon is an unknown op there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from ..errors import BadRequest, DecodeError, TransferdError, VersionMismatch, error_from_code
from .room import RoomRequest, RoomStatus

# Incompatible changes bump this; a request or reply of another version is refused.
# History:
#   1 — first version; defined but never sent (a map without "v" reads as version 1).
#   2 — "v" sent in every request and reply and checked; requests decoded strictly (unknown
#       fields, a non-bool "last", a non-number "timeout_s", a non-str "reason" are refused).
LOCAL_API_VERSION = 2

MAX_BATCH = 65536
"""The most calls one ``batch`` request may hold."""

ROW_LIMIT = 1 << 62
"""Page and slot indices are below this (any pool's row count is)."""

MAX_TIMEOUT_S = 86400
"""The longest ``timeout_s`` a ``wait`` takes: a day. The room clocks end a room long before (their
defaults are minutes); an engine that wants to wait longer calls ``wait`` again."""

_UNVERSIONED = 1
"""The version a map without ``"v"`` is read as: version 1 never sent one."""


# -- field checks (their messages are part of the API: tests and PROTOCOL.md quote them) ---------

def u64(v: Any, what: str) -> int:
    if type(v) is not int or not 0 <= v < 1 << 64:
        raise BadRequest(f"{what} must be an unsigned 64-bit integer, not {v!r}")
    return v


def nonempty_str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise BadRequest(f"{what} must be a non-empty string, not {v!r}")
    return v


def ints(v: Any, what: str) -> tuple[int, ...]:
    """A list of row indices: non-negative ints small enough to index any pool."""
    if not isinstance(v, (list, tuple)) or not set(map(type, v)) <= _INT_ONLY:  # bool is not int here
        raise BadRequest(f"{what} must be a list of integers")
    if v and (min(v) < 0 or max(v) >= ROW_LIMIT):  # at C speed; the message names the first one
        bad = next(x for x in v if not 0 <= x < ROW_LIMIT)
        raise BadRequest(f"{what}: index {bad} is negative or absurdly large")
    return tuple(v)


_INT_ONLY = frozenset({int})


def slot_map(v: Any, what: str) -> dict[str, tuple[int, ...]]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequest(f"{what} must map state component names to slot lists")
    return {nonempty_str(k, f"{what} component"): ints(x, f"{what}[{k}]") for k, x in v.items()}


def optional_u64(v: Any, what: str) -> int | None:
    return None if v is None else u64(v, what)


def boolean(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise BadRequest(f"{what} must be true or false, not {v!r}")
    return v


def seconds(v: Any, what: str) -> float:
    """A wait's timeout: NaN, a negative number and infinity are refused, and so is anything over
    :data:`MAX_TIMEOUT_S` (the client could not wait for its reply, uvloop would cap it silently)."""
    if not ((type(v) is int and 0 <= v < 1 << 64) or (type(v) is float and math.isfinite(v) and v >= 0)):
        raise BadRequest(f"{what} must be a finite non-negative number of seconds, not {v!r}")
    if v > MAX_TIMEOUT_S:
        raise BadRequest(f"{what} must be at most {MAX_TIMEOUT_S} seconds, not {v!r}")
    return float(v)


def text(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise BadRequest(f"{what} must be a string, not {v!r}")
    return v


class UnknownOp(BadRequest):
    """An op this daemon does not serve (code ``bad_request``, counted as ``engine_unknown_op``)."""


# -- requests -------------------------------------------------------------------------------

Check = Callable[[Any, str], Any]
R = TypeVar("R", bound="Request")


def _field(check: Check, **default: Any) -> Any:
    """A request field decoded by ``check(value, name)``; ``default`` makes it optional."""
    return field(metadata={"check": check}, **default)


@dataclass(slots=True)
class Request:
    """Base of every request. ``op`` names it on the wire; the fields are its wire fields.

    Requests are plain slotted objects (not frozen: a frozen dataclass pays ``object.__setattr__``
    per field on every construction); nothing changes one after it is built. Each class's
    :meth:`from_wire` and :meth:`to_wire` are compiled from its fields when the class is defined
    (:func:`_compiled`): straight-line code in declaration order, no loop over the fields, no
    intermediate dict."""

    op: ClassVar[str] = ""
    _decode: ClassVar[Callable[[Mapping[Any, Any], frozenset[Any]], Any]]

    def to_wire(self) -> dict[str, Any]:
        """The request's fields (without ``id``, ``v`` and ``op``), every one of them."""
        return {}

    @classmethod
    def from_wire(cls: type[R], d: Mapping[Any, Any], envelope: frozenset[str] = frozenset()) -> R:
        """Decode and check the fields of ``d`` (which may also hold the ``envelope`` keys).
        Raises :class:`BadRequest` naming the first field that is unknown, missing or wrong."""
        return cls._decode(d, envelope)  # type: ignore[no-any-return]


_MISSING = object()
_TOP = frozenset({"id", "v", "op"})
_CALL = frozenset({"v", "op"})


def _compiled(cls: type[R]) -> type[R]:
    """Give a request class its decoder and ``to_wire``, generated from its fields.

    The decoder refuses an unknown key first (the first one in the map's order), then runs each
    field's check in declaration order (the first bad or missing field is the one named), then
    builds the object with its keyword ``__init__``: the rules of :meth:`Request.from_wire`, as
    straight-line code."""
    op = cls.op
    specs = [(f.name, f.metadata["check"], f.default_factory if f.default is MISSING else f.default)
             for f in fields(cls)]
    names = frozenset(name for name, _, _ in specs)
    allowed: dict[frozenset[Any], frozenset[Any]] = {e: names | e for e in (frozenset(), _TOP, _CALL)}
    env: dict[str, Any] = {"_cls": cls, "_MISSING": _MISSING, "_allowed": allowed, "_unknown": _unknown_field,
                           "_missing": _missing_field}
    lines = ["def _decode(d, envelope):",
             "    ok = _allowed.get(envelope)",
             "    if ok is None:",
             "        ok = _allowed[envelope] = _names | envelope",
             "    if not d.keys() <= ok:",
             "        _unknown(_op, d, ok)"]
    env["_names"], env["_op"] = names, op
    for i, (name, check, default) in enumerate(specs):
        env[f"_c{i}"] = check
        lines.append(f"    v = d.get({name!r}, _MISSING)")
        if default is MISSING:
            lines += ["    if v is _MISSING:", f"        _missing(_op, {name!r})", f"    a{i} = _c{i}(v, {name!r})"]
        elif callable(default):
            env[f"_d{i}"] = default
            lines.append(f"    a{i} = _d{i}() if v is _MISSING else _c{i}(v, {name!r})")
        else:
            env[f"_d{i}"] = default
            lines.append(f"    a{i} = _d{i} if v is _MISSING else _c{i}(v, {name!r})")
    lines.append("    return _cls(" + ", ".join(f"{name}=a{i}" for i, (name, _, _) in enumerate(specs)) + ")")
    lines += ["def to_wire(self):",
              "    return {" + ", ".join(f"{name!r}: self.{name}" for name, _, _ in specs) + "}"]
    exec("\n".join(lines), env)  # generated from the class's own field names
    cls._decode = env["_decode"]
    to_wire = env["to_wire"]
    to_wire.__qualname__ = f"{cls.__qualname__}.to_wire"
    to_wire.__doc__ = Request.to_wire.__doc__
    cls.to_wire = to_wire  # type: ignore[method-assign]
    return cls


def _unknown_field(op: str, d: Mapping[Any, Any], allowed: frozenset[Any]) -> None:
    for k in d:
        if k not in allowed:
            raise BadRequest(f"{op}: unknown field {k!r}")


def _missing_field(op: str, name: str) -> None:
    raise BadRequest(f"{op}: {name!r} is required")


# prefill engine → sender ----------------------------------------------------------------------

@_compiled
@dataclass(slots=True, kw_only=True)
class Submit(Request):
    """Queue one chunk of a room: source pages for positions ``[start, start + len)``."""

    op: ClassVar[str] = "submit"
    room: int = _field(u64)
    start: int = _field(u64, default=0)
    src_pages: tuple[int, ...] = _field(ints)
    last: bool = _field(boolean, default=False)
    state: dict[str, tuple[int, ...]] = field(default_factory=dict, metadata={"check": slot_map})
    aux_slot: int | None = _field(optional_u64, default=None)


@_compiled
@dataclass(slots=True, kw_only=True)
class SenderPoll(Request):
    op: ClassVar[str] = "poll"
    room: int = _field(u64)


@_compiled
@dataclass(slots=True, kw_only=True)
class SenderWait(Request):
    op: ClassVar[str] = "wait"
    room: int = _field(u64)
    timeout_s: float = _field(seconds, default=60.0)


@_compiled
@dataclass(slots=True, kw_only=True)
class SenderAbort(Request):
    op: ClassVar[str] = "abort"
    room: int = _field(u64)
    reason: str = _field(text, default="")


# decode engine → receiver ---------------------------------------------------------------------

@_compiled
@dataclass(slots=True, kw_only=True)
class Expect(Request):
    """Destinations for a room coming from ``group`` (checked against the pool by the receiver)."""

    op: ClassVar[str] = "expect"
    room: int = _field(u64)
    group: str = _field(nonempty_str)
    dst_pages: tuple[int, ...] = _field(ints)
    prefix_pages: int = _field(u64, default=0)
    state: dict[str, tuple[int, ...]] = field(default_factory=dict, metadata={"check": slot_map})
    aux_slot: int = _field(u64)

    def room_request(self) -> RoomRequest:
        return RoomRequest(room=self.room, group=self.group, dst_pages=self.dst_pages, prefix=self.prefix_pages,
                           state=dict(self.state), aux_slot=self.aux_slot)


@_compiled
@dataclass(slots=True, kw_only=True)
class ReceiverPoll(Request):
    op: ClassVar[str] = "poll"
    group: str = _field(nonempty_str)
    room: int = _field(u64)


@_compiled
@dataclass(slots=True, kw_only=True)
class ReceiverWait(Request):
    op: ClassVar[str] = "wait"
    group: str = _field(nonempty_str)
    room: int = _field(u64)
    timeout_s: float = _field(seconds, default=60.0)


@_compiled
@dataclass(slots=True, kw_only=True)
class ReceiverAbort(Request):
    op: ClassVar[str] = "abort"
    group: str = _field(nonempty_str)
    room: int = _field(u64)
    reason: str = _field(text, default="")


@_compiled
@dataclass(slots=True, kw_only=True)
class Release(Request):
    op: ClassVar[str] = "release"
    group: str = _field(nonempty_str)
    room: int = _field(u64)


# either daemon -------------------------------------------------------------------------------

@_compiled
@dataclass(slots=True)
class Stats(Request):
    op: ClassVar[str] = "stats"


@_compiled
@dataclass(slots=True)
class Status(Request):
    op: ClassVar[str] = "status"


@_compiled
@dataclass(slots=True)
class Ping(Request):
    op: ClassVar[str] = "ping"


@dataclass(slots=True)
class Batch(Request):
    """Many calls in one round trip, answered together with one reply per call. A call that did
    not decode is kept, in its place, as the error it is answered with."""

    op: ClassVar[str] = "batch"
    calls: tuple[Request | TransferdError, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        out = []
        for c in self.calls:
            if not isinstance(c, Request):
                raise TypeError(f"a batch to send holds requests only, not {c!r}")
            out.append(call_map(c))
        return {"calls": out}


def _ops(*classes: type[Request]) -> dict[str, type[Request]]:
    return {c.op: c for c in classes}


RECEIVER_OPS: Mapping[str, type[Request]] = _ops(
    Expect, ReceiverPoll, ReceiverWait, ReceiverAbort, Release, Stats, Status, Ping)
"""The ops a receiver serves (besides ``batch``)."""

SENDER_OPS: Mapping[str, type[Request]] = _ops(Submit, SenderPoll, SenderWait, SenderAbort, Stats, Status, Ping)
"""The ops a sender serves (besides ``batch``)."""

BATCHABLE: frozenset[str] = frozenset(RECEIVER_OPS) | frozenset(SENDER_OPS)
"""Every op but ``batch`` may be a call of a batch (batches do not nest)."""



def _version_of(d: Mapping[Any, Any]) -> str:
    """How a map's ``"v"`` reads in a refusal: absent is version 1, which sent none."""
    return f'{_UNVERSIONED} (no "v")' if "v" not in d else repr(d["v"])


def _check_version(d: Mapping[Any, Any]) -> None:
    v = d.get("v", _UNVERSIONED)
    if type(v) is not int or v != LOCAL_API_VERSION:
        raise VersionMismatch(f"engine API version {_version_of(d)} from the client; "
                              f"this daemon speaks {LOCAL_API_VERSION}")


def _unknown_op(op: Any, served: Mapping[str, type[Request]]) -> UnknownOp:
    return UnknownOp(f"unknown op {op!r}; known: batch, {', '.join(sorted(served))}")


def parse_request(obj: Any, served: Mapping[str, type[Request]]) -> Request:
    """Decode one request map (already unpacked) for a daemon serving ``served``
    (:data:`RECEIVER_OPS` or :data:`SENDER_OPS`).

    Raises :class:`DecodeError` (not a map, no str ``op``), :class:`VersionMismatch` (``"v"``
    absent or not :data:`LOCAL_API_VERSION`), :class:`UnknownOp`, or :class:`BadRequest` (a field).
    A ``batch`` whose ``calls`` are well formed is returned even when some calls are not: each
    such call is its error in :attr:`Batch.calls`.
    """
    if not isinstance(obj, dict):
        raise DecodeError("malformed request: request must be a map with a string 'op'")
    v = obj.get("v", _UNVERSIONED)
    if type(v) is not int or v != LOCAL_API_VERSION:
        _check_version(obj)  # raises, with the message
    op = obj.get("op")
    if not isinstance(op, str):
        raise DecodeError("malformed request: request must be a map with a string 'op'")
    cls = served.get(op)
    if cls is not None:
        return cls._decode(obj, _TOP)  # type: ignore[no-any-return]
    if op == "batch":
        return _parse_batch(obj, served)
    raise _unknown_op(op, served)


def _parse_batch(obj: dict[Any, Any], served: Mapping[str, type[Request]]) -> Batch:
    calls = obj.get("calls")
    if not isinstance(calls, list) or len(calls) > MAX_BATCH or not all(isinstance(c, dict) for c in calls):
        raise BadRequest(f"batch: 'calls' must be a list of at most {MAX_BATCH} request maps")
    for k in obj:
        if k not in _TOP and k != "calls":
            raise BadRequest(f"batch: unknown field {k!r}")
    return Batch(tuple(_parse_call(c, served) for c in calls))


def _parse_call(c: dict[Any, Any], served: Mapping[str, type[Request]]) -> Request | TransferdError:
    """One call of a batch: its request, or the error it is answered with. A call inherits the
    batch's version; one that names a version itself must name the same."""
    try:
        if "v" in c:
            _check_version(c)
        op = c.get("op")
        if op == Batch.op:
            raise BadRequest("batches do not nest")
        cls = served.get(op) if isinstance(op, str) else None
        if cls is None:
            raise _unknown_op(op, served)
        return cls.from_wire(c, _CALL)
    except TransferdError as exc:
        return exc


def call_map(req: Request) -> dict[str, Any]:
    """A request as a call of a batch: ``{"op", ...fields}``."""
    return {"op": req.op, **req.to_wire()}


def request_map(rid: Any, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The map a client sends: ``{"id", "v", "op", ...args}`` (``args`` as given, unchecked)."""
    return {"id": rid, "v": LOCAL_API_VERSION, "op": op, **args}


def encode_request(rid: Any, req: Request) -> bytes:
    return _pack(request_map(rid, req.op, req.to_wire()))


def decode_request(body: bytes, served: Mapping[str, type[Request]]) -> tuple[Any, Request | TransferdError]:
    """One request frame: its ``id`` (echoed in the reply; None when the frame is not a map) and
    its request, or the error it is answered with. Never raises a :class:`TransferdError`."""
    try:
        obj = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        return None, DecodeError(f"malformed request: {exc}")
    rid = obj.get("id") if isinstance(obj, dict) else None
    try:
        return rid, parse_request(obj, served)
    except TransferdError as exc:
        return rid, exc
    except (TypeError, ValueError, OverflowError) as exc:  # never a crash, whatever the map holds
        return rid, DecodeError(f"malformed request: {type(exc).__name__}: {exc}")


# -- replies ---------------------------------------------------------------------------------

@dataclass(slots=True)
class Ok:
    """A request's result: a room status, or a map (stats, status, ping), as its handler made it."""

    result: Any


@dataclass(slots=True)
class Refusal:
    """A request that failed: the error's stable ``code`` and its message."""

    code: str
    message: str

    @classmethod
    def of(cls, exc: TransferdError) -> Refusal:
        return cls(exc.code, str(exc))

    def error(self) -> TransferdError:
        """The error this refusal stands for (by code; an unknown code is a TransferdError)."""
        return error_from_code(self.code, self.message)


@dataclass(slots=True)
class BatchReply:
    """The answer to a batch: one reply per call, in order."""

    replies: tuple[Ok | Refusal, ...]


Reply = Ok | Refusal | BatchReply


def _result_wire(result: Any) -> Any:
    return result.to_wire() if isinstance(result, RoomStatus) else result


def reply_body(reply: Reply) -> dict[str, Any]:
    """``{"ok": true, "result"}`` or ``{"ok": false, "code", "error"}`` (a batch call's reply)."""
    if isinstance(reply, Ok):
        return {"ok": True, "result": _result_wire(reply.result)}
    if isinstance(reply, Refusal):
        return {"ok": False, "code": reply.code, "error": reply.message}
    return {"ok": True, "result": [reply_body(r) for r in reply.replies]}


def encode_reply(rid: Any, reply: Reply, pack: Callable[[Any], bytes] | None = None) -> bytes:
    """A reply frame; ``pack`` is a :func:`packer`'s (one thread's), or None for a fresh one."""
    pack = pack or _pack
    if type(reply) is Ok:  # the common case, without the intermediate map
        result = reply.result
        return pack({"id": rid, "v": LOCAL_API_VERSION, "ok": True,
                     "result": result.to_wire() if isinstance(result, RoomStatus) else result})
    return pack({"id": rid, "v": LOCAL_API_VERSION, **reply_body(reply)})


def decode_reply(body: bytes) -> tuple[Any, Ok | Refusal]:
    """A reply frame: its ``id`` and its outcome (a batch's result is a list of reply maps; see
    :func:`batch_replies`). A reply of another version is a ``version`` refusal, except a daemon's
    own ``version`` refusal, which is read whatever its ``"v"`` (its shape is the same in every
    version); a frame that is not a reply at all raises :class:`DecodeError`."""
    try:
        obj = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        raise DecodeError(f"malformed engine API reply: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"malformed engine API reply: {type(obj).__name__}, not a map")
    rid = obj.get("id")
    v = obj.get("v", _UNVERSIONED)
    ok = obj.get("ok")
    if ok is True and type(v) is int and v == LOCAL_API_VERSION:  # the common case first
        return rid, Ok(obj.get("result"))
    if ok is False and obj.get("code") == VersionMismatch.code:
        return rid, _outcome(obj)  # a version refusal reads the same in every version
    if type(v) is not int or v != LOCAL_API_VERSION:
        return rid, Refusal(VersionMismatch.code, f"engine API version {_version_of(obj)} from the daemon; "
                                                  f"this client speaks {LOCAL_API_VERSION}")
    return rid, _outcome(obj)


def _outcome(obj: Mapping[Any, Any]) -> Ok | Refusal:
    ok = obj.get("ok")
    if ok is True:
        return Ok(obj.get("result"))
    if ok is False:
        return Refusal(str(obj.get("code", "error")), str(obj.get("error", "unknown error")))
    raise DecodeError(f"malformed engine API reply: 'ok' is {ok!r}")


def batch_replies(result: Any) -> list[Ok | Refusal]:
    """The per-call replies in a batch's result."""
    if not isinstance(result, list) or not all(isinstance(r, dict) for r in result):
        raise DecodeError("malformed engine API reply: a batch's result must be a list of reply maps")
    return [_outcome(r) for r in result]


def build(cls: type[R], args: Mapping[str, Any]) -> R:
    """A request from keyword arguments, checked exactly as the daemon checks it (a client builds
    its requests this way, so a bad one is refused before it is sent, with the same message)."""
    return cls.from_wire(args)


def builds(cls: type[R], items: Sequence[R | Mapping[str, Any]]) -> list[R | TransferdError]:
    """:func:`build` for many: each item a ``cls`` already, or its keyword arguments (whose error
    takes its place)."""
    out: list[R | TransferdError] = []
    for item in items:
        if isinstance(item, cls):
            out.append(item)
            continue
        try:
            if not isinstance(item, Mapping):
                raise BadRequest(f"{cls.op}: expected a {cls.__name__} or a map of its fields, not {item!r}")
            out.append(cls.from_wire(item))
        except TransferdError as exc:
            out.append(exc)
    return out


def packer() -> Callable[[Any], bytes]:
    """A msgpack packer of this wire's options, to keep and reuse from ONE thread (``msgpack.packb``
    builds a new Packer, and its buffer, on every call)."""
    return msgpack.Packer(use_bin_type=True).pack


def _pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data
