"""Wire messages between sender agents and receivers, and their codec.

Every message is a ZeroMQ multipart message whose first frame is a msgpack header. Control
headers are maps with ``"t"`` (type) and ``"v"`` (protocol version); the hot ``data`` header is a
short array ``[1, tok, kind, buffer, pos, count]`` followed by exactly one raw payload frame.
Nothing here does I/O; ``docs/PROTOCOL.md`` describes the same format in prose.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from ..errors import DecodeError, VersionMismatch

# Incompatible changes bump this; peers with another version are refused at registration.
# History:
#   1 — first version: register/registered, assign, data, data-ref, done, fail, status, ping/pong.
#   2 — data-refs: same-host rows listed one by one in a second frame (scattered pages in one
#       message); data batches: several small data entries, one payload frame each, in one
#       message; register.dedup (the group's de-dup setting). A version-1 receiver would refuse
#       the new messages, so the versions do not mix.
#   3 — the data stream: register.stream (the sender would use one), registered.stream_port and
#       registered.stream_key (the receiver offers one); data, data-batch and done messages may
#       then travel as records on a plain TCP connection (docs/PROTOCOL.md, "data stream").
#   4 — Mooncake Transfer Engine: register.te_session and register.te_addrs (the sender's engine
#       session id and the address of each of its pool's buffers), registered.te (the receiver
#       reads the rows with its own engine); data-refs then name rows the receiver reads remotely.
#   5 — NIXL: register.nixl_md (the sender's NIXL agent metadata, at most MAX_NIXL_MD bytes); with
#       it, te_session is that agent's name and te_addrs its registered buffers' addresses, and
#       registered.te says the receiver reads them with its own NIXL agent. A version-4 receiver
#       would take such a register for a Mooncake offer, so the versions do not mix.
#   6 — bundles: a receiver sends a sender the control messages of one loop iteration in one
#       "bundle" message (each entry the bytes of the message alone, in order), so a batch of
#       rooms is one ZeroMQ message per rank instead of one per room. A version-5 sender would
#       refuse a bundle as an unknown type, so the versions do not mix.
#   7 — data-done: a rank's last data entries of a room and its done in one message (one record
#       on a data stream), so a rank-room ends with one message where it took two. A version-6
#       receiver would refuse the header as a data header of the wrong shape, so the versions do
#       not mix.
PROTOCOL_VERSION = 7
MAX_TE_SESSION = 255  # "host:port" of an engine, or a NIXL agent's name; longer is hostile
MAX_NIXL_MD = 1 << 20  # a NIXL agent's metadata: ~45 bytes a buffer per transport on TCP; more is hostile

MAX_CP_SIZE = 1024
DATA_TAG = 1
DATA_REF_TAG = 2
DATA_REFS_TAG = 3
DATA_BATCH_TAG = 4
DATA_DONE_TAG = 5
MAX_BATCH_ENTRIES = 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024  # an assign for a very long room still fits; more is hostile
# What a receiver accepts from senders, checked on the frame's length before any decoding: the
# largest legitimate header is a register whose layout has MAX_LAYOUT_BUFFERS buffers (~0.3 MB)
# with a NIXL metadata blob of MAX_NIXL_MD bytes.
MAX_INBOUND_HEADER_BYTES = 2 << 20
U64_MAX = (1 << 64) - 1


def _req(d: dict[str, Any], key: str, typ: type | tuple[type, ...], what: str) -> Any:
    try:
        value = d[key]
    except KeyError:
        raise DecodeError(f"{what}: missing field {key!r}") from None
    if typ is int and isinstance(value, bool):
        raise DecodeError(f"{what}: field {key!r} must be int, not bool")
    if not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise DecodeError(f"{what}: field {key!r} must be {names}, not {type(value).__name__}")
    return value


def _int(d: dict[str, Any], key: str, what: str, lo: int = 0, hi: int = U64_MAX) -> int:
    value: int = _req(d, key, int, what)
    if not lo <= value <= hi:
        raise DecodeError(f"{what}: field {key!r}={value} outside [{lo}, {hi}]")
    return value


def _int_list(d: dict[str, Any], key: str, what: str) -> tuple[int, ...]:
    value = _req(d, key, list, what)
    if not all(type(x) is int and 0 <= x <= U64_MAX for x in value):
        raise DecodeError(f"{what}: field {key!r} must be a list of non-negative ints")
    return tuple(value)


def _slots_map(d: dict[str, Any], key: str, what: str) -> dict[str, tuple[int, ...]]:
    value = _req(d, key, dict, what)
    out: dict[str, tuple[int, ...]] = {}
    for comp, slots in value.items():
        if not isinstance(comp, str):
            raise DecodeError(f"{what}: field {key!r} keys must be component names")
        out[comp] = _int_list({comp: slots}, comp, f"{what} {key}")
    return out


@dataclass(frozen=True, slots=True)
class Register:
    """Sender → receiver: the first message on every connection."""

    T: ClassVar[str] = "register"
    group: str
    rank: int
    cp_size: int
    split: str
    fingerprint: str
    layout: dict[str, Any]
    incarnation: int
    pid: int = 0
    host: str = ""
    epoch: int = 0
    """Bumped each time the sender gives this receiver up for lost; a higher epoch from the same
    identity ends the rooms the old connection had."""
    checksum: str = "none"
    """Per-frame checksum this sender appends to data headers: ``none``, ``xxh3`` or ``crc32``."""
    boot_id: str = ""
    """The host's boot id: equal on both sides means the same kernel (and maybe the same /dev/shm)."""
    pool: str = ""
    """The sender's pool name, offered for the same-host path ("" = not offered)."""
    pool_id: int = 0
    """The random id in that pool's header: the receiver must find exactly this pool under the name."""
    max_message_bytes: int = 0
    """The largest data message this sender sends (checked against the receiver's frame limit)."""
    dedup: bool = True
    """The group's de-dup setting: off, every pages-split rank sends the replicated state too."""
    stream: bool = False
    """This sender would send its data on a data stream, if the receiver offers one."""
    te_session: str = ""
    """Its Mooncake Transfer Engine's session id ``host:port`` ("" = not offered)."""
    te_addrs: tuple[int, ...] = ()
    """With ``te_session``: the address of each pool buffer's first row in that engine."""
    nixl_md: bytes = b""
    """Its NIXL agent's metadata: with it, ``te_session`` is that agent's name (the NIXL plane)."""

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "group": self.group, "rank": self.rank,
                "cp_size": self.cp_size, "split": self.split, "fp": self.fingerprint,
                "layout": self.layout, "inc": self.incarnation, "pid": self.pid, "host": self.host,
                "epoch": self.epoch, "checksum": self.checksum, "boot_id": self.boot_id, "pool": self.pool,
                "pool_id": self.pool_id, "max_msg": self.max_message_bytes, "dedup": self.dedup,
                "stream": self.stream, "te_session": self.te_session, "te_addrs": list(self.te_addrs),
                "nixl_md": self.nixl_md}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Register:
        w = "register"
        out = cls(group=_req(d, "group", str, w), rank=_int(d, "rank", w, 0, 1 << 16),
                  cp_size=_int(d, "cp_size", w, 1, MAX_CP_SIZE), split=_req(d, "split", str, w),
                  fingerprint=_req(d, "fp", str, w), layout=_req(d, "layout", dict, w),
                  incarnation=_int(d, "inc", w), pid=_int(d, "pid", w, 0, 1 << 32),
                  host=_req(d, "host", str, w), epoch=_int(d, "epoch", w),
                  checksum=_req(d, "checksum", str, w), boot_id=_req(d, "boot_id", str, w),
                  pool=_req(d, "pool", str, w), pool_id=_int(d, "pool_id", w),
                  max_message_bytes=_int(d, "max_msg", w), dedup=_req(d, "dedup", bool, w),
                  stream=_req(d, "stream", bool, w))
        session: str = _req(d, "te_session", str, w)
        addrs = _int_list(d, "te_addrs", w)
        if len(session) > MAX_TE_SESSION or (session == "") != (len(addrs) == 0):
            raise DecodeError(f"register: te_session of {len(session)} characters with {len(addrs)} te_addrs "
                              f"(a session of at most {MAX_TE_SESSION} goes with the buffers' addresses, none with none)")
        md: bytes = _req(d, "nixl_md", bytes, w)
        if len(md) > MAX_NIXL_MD or (md and not session):
            raise DecodeError(f"register: nixl_md of {len(md)} bytes with a te_session of {len(session)} characters "
                              f"(at most {MAX_NIXL_MD} bytes, with the agent's name in te_session)")
        if session and (not (md or ":" in session) or not session.isprintable() or 0 in addrs):
            raise DecodeError(f"register: te_session {session[:80]!r} is not HOST:PORT (or, with nixl_md, a "
                              "printable agent name), or an address is 0")
        return dataclasses.replace(out, te_session=session, te_addrs=addrs, nixl_md=md)


@dataclass(frozen=True, slots=True)
class Registered:
    """Receiver → sender: registration accepted (``ok``) or refused with ``reason``."""

    T: ClassVar[str] = "registered"
    ok: bool
    reason: str
    receiver: str
    incarnation: int
    retry: bool = False
    """On a refusal: register again (the receiver does not know this peer, e.g. it restarted)."""
    shm: bool = False
    """Accepted with the same-host path: the receiver reads the sender's pool; send data-ref."""
    stream_port: int = 0
    """Accepted with a data stream: connect to this TCP port of the receiver's host (0 = none)."""
    stream_key: bytes = b""
    """The 16 bytes the sender's hello on that stream must carry (empty when no stream)."""
    te: bool = False
    """Accepted with Mooncake Transfer Engine: the receiver reads the rows the data-refs name."""

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "ok": self.ok, "reason": self.reason,
                "receiver": self.receiver, "inc": self.incarnation, "retry": self.retry, "shm": self.shm,
                "stream_port": self.stream_port, "stream_key": self.stream_key, "te": self.te}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Registered:
        w = "registered"
        out = cls(ok=_req(d, "ok", bool, w), reason=_req(d, "reason", str, w),
                  receiver=_req(d, "receiver", str, w), incarnation=_int(d, "inc", w),
                  retry=_req(d, "retry", bool, w), shm=_req(d, "shm", bool, w),
                  stream_port=_int(d, "stream_port", w, 0, 65535), stream_key=_req(d, "stream_key", bytes, w),
                  te=_req(d, "te", bool, w))
        if (out.stream_port == 0) != (len(out.stream_key) == 0) or len(out.stream_key) not in (0, 16):
            raise DecodeError(f"registered: stream_port {out.stream_port} with a {len(out.stream_key)}-byte "
                              "stream_key (a port goes with a 16-byte key, no port with none)")
        return out


@dataclass(frozen=True, slots=True)
class Assign:
    """Receiver → every rank of the group: a room's destinations and its transfer token."""

    T: ClassVar[str] = "assign"
    tok: int
    room: int
    n_pages: int
    prefix: int
    dst_pages: tuple[int, ...]
    state: dict[str, tuple[int, ...]] = field(default_factory=dict)
    aux_slot: int = 0

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "tok": self.tok, "room": self.room,
                "n": self.n_pages, "prefix": self.prefix, "dst": list(self.dst_pages),
                "state": {k: list(v) for k, v in self.state.items()}, "aux": self.aux_slot}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Assign:
        w = "assign"
        out = cls(tok=_int(d, "tok", w), room=_int(d, "room", w), n_pages=_int(d, "n", w),
                  prefix=_int(d, "prefix", w), dst_pages=_int_list(d, "dst", w),
                  state=_slots_map(d, "state", w), aux_slot=_int(d, "aux", w))
        if len(out.dst_pages) != out.n_pages or out.prefix > out.n_pages:
            raise DecodeError(f"assign: {len(out.dst_pages)} destination pages for n={out.n_pages}, "
                              f"prefix={out.prefix}")
        return out


@dataclass(frozen=True, slots=True)
class Data:
    """Sender → receiver: ``count`` rows of one buffer starting at room position ``pos``.

    ``kind`` 0 = KV (positions are page positions), 1 = state (positions index the room's slot
    list of that buffer's component), 2 = aux (pos 0, count 1). The payload frame that follows
    holds exactly ``count × row_bytes`` bytes.
    """

    tok: int
    kind: int
    buffer: int
    pos: int
    count: int
    checksum: int | None = None
    """Checksum of the payload (algorithm announced at registration), when enabled."""

    def header(self) -> list[int]:
        h = [DATA_TAG, self.tok, self.kind, self.buffer, self.pos, self.count]
        if self.checksum is not None:
            h.append(self.checksum)
        return h


@dataclass(frozen=True, slots=True)
class DataBatch:
    """Sender → receiver: several data entries of one room in one message, for rows too small to
    fill a message alone. Header ``[4, tok, [[kind, buffer, pos, count(, checksum)], …]]`` (2 to
    ``MAX_BATCH_ENTRIES`` entries), then one payload frame per entry, in order. Each entry is
    checked and written exactly as a :class:`Data` message would be."""

    tok: int
    entries: tuple[Data, ...]

    def header(self) -> list[Any]:
        return [DATA_BATCH_TAG, self.tok, [d.header()[2:] for d in self.entries]]


@dataclass(frozen=True, slots=True)
class DataRef:
    """Sender → receiver on the same host: like :class:`Data`, but instead of a payload frame the
    receiver copies ``count`` rows starting at ``src_row`` of the same buffer of the sender's pool
    (one copy, done by the receiver after its checks). Header ``[2, tok, kind, buffer, pos, count,
    src_row]``, no payload frame."""

    tok: int
    kind: int
    buffer: int
    pos: int
    count: int
    src_row: int

    def header(self) -> list[int]:
        return [DATA_REF_TAG, self.tok, self.kind, self.buffer, self.pos, self.count, self.src_row]


@dataclass(frozen=True, slots=True)
class DataRefs:
    """Sender → receiver on the same host: positions ``[pos, pos + count)`` of one buffer whose
    rows lie anywhere in the sender's pool. The frame that follows lists their source rows, in
    position order, as ``count`` little-endian int64 values; the receiver checks them all, then
    copies one block per run that is consecutive on both sides. Header
    ``[3, tok, kind, buffer, pos, count]``."""

    tok: int
    kind: int
    buffer: int
    pos: int
    count: int

    def header(self) -> list[int]:
        return [DATA_REFS_TAG, self.tok, self.kind, self.buffer, self.pos, self.count]


@dataclass(frozen=True, slots=True)
class Done:
    """Sender → receiver: this rank has sent everything its plan holds for the room."""

    T: ClassVar[str] = "done"
    tok: int
    rank: int
    kv_bytes: int
    state_bytes: int
    aux_bytes: int

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "tok": self.tok, "rank": self.rank,
                "bytes": [self.kv_bytes, self.state_bytes, self.aux_bytes]}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Done:
        w = "done"
        b = _req(d, "bytes", list, w)
        if len(b) != 3 or not all(type(x) is int and x >= 0 for x in b):
            raise DecodeError("done: field 'bytes' must be three non-negative ints")
        return cls(tok=_int(d, "tok", w), rank=_int(d, "rank", w, 0, 1 << 16),
                   kv_bytes=b[0], state_bytes=b[1], aux_bytes=b[2])


@dataclass(frozen=True, slots=True)
class DataDone:
    """Sender → receiver: a rank's last data entries of a room and that rank's ``done``, in one
    message. Header ``[5, tok, rank, [kv_bytes, state_bytes, aux_bytes], [[kind, buffer, pos,
    count(, checksum)], …]]`` (1 to ``MAX_BATCH_ENTRIES`` entries), then one payload frame per
    entry. Handled exactly as the data-batch of its entries followed by the done."""

    tok: int
    entries: tuple[Data, ...]
    done: Done

    def header(self) -> list[Any]:
        d = self.done
        return [DATA_DONE_TAG, self.tok, d.rank, [d.kv_bytes, d.state_bytes, d.aux_bytes],
                [e.header()[2:] for e in self.entries]]


@dataclass(frozen=True, slots=True)
class Fail:
    """Sender → receiver: the prefill side failed or aborted the room."""

    T: ClassVar[str] = "fail"
    tok: int
    code: str
    reason: str

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "tok": self.tok, "code": self.code,
                "reason": self.reason}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Fail:
        w = "fail"
        return cls(tok=_int(d, "tok", w), code=_req(d, "code", str, w), reason=_req(d, "reason", str, w))


@dataclass(frozen=True, slots=True)
class Status:
    """Receiver → every rank: the room's terminal outcome (``success`` or ``failed``)."""

    T: ClassVar[str] = "status"
    tok: int
    room: int
    state: str
    code: str = ""
    reason: str = ""

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "tok": self.tok, "room": self.room,
                "state": self.state, "code": self.code, "reason": self.reason}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Status:
        w = "status"
        state = _req(d, "state", str, w)
        if state not in ("success", "failed"):
            raise DecodeError(f"status: state must be 'success' or 'failed', not {state!r}")
        return cls(tok=_int(d, "tok", w), room=_int(d, "room", w), state=state,
                   code=_req(d, "code", str, w), reason=_req(d, "reason", str, w))


@dataclass(frozen=True, slots=True)
class Ping:
    T: ClassVar[str] = "ping"
    seq: int

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "seq": self.seq}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Ping:
        return cls(seq=_int(d, "seq", "ping"))


@dataclass(frozen=True, slots=True)
class Pong:
    T: ClassVar[str] = "pong"
    seq: int

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "seq": self.seq}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Pong:
        return cls(seq=_int(d, "seq", "pong"))


MAX_BUNDLE_MSGS = 1024  # entries of one bundle
BUNDLE_BYTES = 64 << 10  # a receiver starts a new bundle past this many bytes of entries (a larger message goes alone)


@dataclass(frozen=True, slots=True)
class Bundle:
    """Control messages from a receiver to one sender, in the order it sent them, in one ZeroMQ
    message: each entry is the encoded message exactly as it would travel alone (its own type
    and version), decoded and checked as such. Only the messages a receiver sends a sender may
    be bundled (``BUNDLED``); a bundle with any bad entry is refused whole."""

    T: ClassVar[str] = "bundle"
    msgs: tuple[Any, ...]  # the decoded entries (Registered, Assign, Status, Ping or Pong)
    frames: tuple[bytes, ...] = field(default=(), compare=False)  # the entries as encoded (what :meth:`header` sends)

    def header(self) -> dict[str, Any]:
        return {"t": self.T, "v": PROTOCOL_VERSION, "msgs": list(self.frames or map(encode, self.msgs))}

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Bundle:
        raw = _req(d, "msgs", list, "bundle")
        if not 1 <= len(raw) <= MAX_BUNDLE_MSGS:
            raise DecodeError(f"bundle with {len(raw)} entries (1 to {MAX_BUNDLE_MSGS})")
        msgs = []
        for i, frame in enumerate(raw):
            if type(frame) is not bytes:
                raise DecodeError(f"bundle entry {i}: must be bin (an encoded message), not {type(frame).__name__}")
            try:
                msg = decode_header(frame, _in_bundle=True)
            except DecodeError as exc:
                raise DecodeError(f"bundle entry {i}: {exc}") from None
            except VersionMismatch as exc:
                raise VersionMismatch(f"bundle entry {i}: {exc}", exc.msg_type) from None
            if not isinstance(msg, BUNDLED):
                raise DecodeError(f"bundle entry {i}: {type(msg).__name__} cannot be bundled "
                                  "(registered, assign, status, ping and pong only)")
            msgs.append(msg)
        return cls(tuple(msgs), tuple(raw))


BUNDLED = (Registered, Assign, Status, Ping, Pong)
Control = Register | Registered | Assign | Done | Fail | Status | Ping | Pong | Bundle
Message = Control | Data | DataRef | DataRefs | DataBatch | DataDone

CONTROL_TYPES: dict[str, Any] = {
    c.T: c for c in (Register, Registered, Assign, Done, Fail, Status, Ping, Pong, Bundle)
}


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.header(), use_bin_type=True)


def _rows_in_range(tok: int, kind: int, buf: int, pos: int, count: int) -> bool:
    """The fields every data-like header shares: token, kind, buffer, position, row count."""
    return (0 <= tok <= U64_MAX and kind in (0, 1, 2) and 0 <= buf < 1 << 20 and 0 <= pos < 1 << 40
            and 1 <= count < 1 << 32)


def _data_fields(tok: int, kind: int, buf: int, pos: int, count: int, csum: int | None, obj: Any) -> Data:
    if not (_rows_in_range(tok, kind, buf, pos, count) and (csum is None or 0 <= csum <= U64_MAX)):
        raise DecodeError(f"data header fields out of range: {obj}")
    return Data(tok, kind, buf, pos, count, csum)


def _entries(tok: int, raw: list[Any], what: str) -> tuple[Data, ...]:
    """The entries of a data-batch or data-done header, each checked as a data header."""
    entries = []
    for e in raw:
        if not isinstance(e, list) or len(e) not in (4, 5) or not all(type(x) is int for x in e):
            raise DecodeError(f"{what} entry must be [kind, buffer, pos, count(, checksum)] of ints")
        entries.append(_data_fields(tok, e[0], e[1], e[2], e[3], e[4] if len(e) == 5 else None, e))
    return tuple(entries)


def decode_header(frame: bytes | memoryview, limit: int = MAX_HEADER_BYTES, *, _in_bundle: bool = False) -> Message:
    """Decode a header frame of at most ``limit`` bytes; raises :class:`DecodeError` or
    :class:`VersionMismatch` with a reason that names the problem. Never evaluates anything but
    msgpack scalars and containers."""
    if len(frame) > limit:
        raise DecodeError(f"header of {len(frame)} bytes exceeds {limit}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"malformed msgpack header: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, list) and obj and obj[0] == DATA_REF_TAG:
        if len(obj) != 7 or not all(type(x) is int for x in obj):
            raise DecodeError("data-ref header must be [2, tok, kind, buffer, pos, count, src_row] of ints")
        tok, kind, buf, pos, count, src_row = obj[1:]
        if not (_rows_in_range(tok, kind, buf, pos, count) and 0 <= src_row < 1 << 40):
            raise DecodeError(f"data-ref header fields out of range: {obj}")
        return DataRef(tok, kind, buf, pos, count, src_row)
    if isinstance(obj, list) and obj and obj[0] == DATA_BATCH_TAG:
        if len(obj) != 3 or type(obj[1]) is not int or not isinstance(obj[2], list):
            raise DecodeError("data-batch header must be [4, tok, [[kind, buffer, pos, count(, checksum)], ...]]")
        tok, raw = obj[1], obj[2]
        if not 0 <= tok <= U64_MAX:
            raise DecodeError(f"data-batch token out of range: {tok}")
        if not 2 <= len(raw) <= MAX_BATCH_ENTRIES:
            raise DecodeError(f"data-batch with {len(raw)} entries (2 to {MAX_BATCH_ENTRIES})")
        return DataBatch(tok, _entries(tok, raw, "data-batch"))
    if isinstance(obj, list) and obj and obj[0] == DATA_DONE_TAG:
        if (len(obj) != 5 or type(obj[1]) is not int or type(obj[2]) is not int or not isinstance(obj[3], list)
                or not isinstance(obj[4], list)):
            raise DecodeError("data-done header must be [5, tok, rank, [kv_bytes, state_bytes, aux_bytes], "
                              "[[kind, buffer, pos, count(, checksum)], ...]]")
        tok, rank, nbytes, raw = obj[1:]
        if not 0 <= tok <= U64_MAX:
            raise DecodeError(f"data-done token out of range: {tok}")
        if not 0 <= rank <= 1 << 16:
            raise DecodeError(f"data-done rank out of range: {rank}")
        if len(nbytes) != 3 or not all(type(x) is int and 0 <= x <= U64_MAX for x in nbytes):
            raise DecodeError("data-done: its bytes must be three non-negative ints")
        if not 1 <= len(raw) <= MAX_BATCH_ENTRIES:
            raise DecodeError(f"data-done with {len(raw)} entries (1 to {MAX_BATCH_ENTRIES})")
        return DataDone(tok, _entries(tok, raw, "data-done"), Done(tok, rank, *nbytes))
    if isinstance(obj, list) and obj and obj[0] == DATA_REFS_TAG:
        if len(obj) != 6 or not all(type(x) is int for x in obj):
            raise DecodeError("data-refs header must be [3, tok, kind, buffer, pos, count] of ints")
        tok, kind, buf, pos, count = obj[1:]
        if not _rows_in_range(tok, kind, buf, pos, count):
            raise DecodeError(f"data-refs header fields out of range: {obj}")
        return DataRefs(tok, kind, buf, pos, count)
    if isinstance(obj, list):
        if len(obj) not in (6, 7) or obj[0] != DATA_TAG or not all(type(x) is int for x in obj):
            raise DecodeError("data header must be [1, tok, kind, buffer, pos, count(, checksum)] of ints")
        tok, kind, buf, pos, count = obj[1:6]
        return _data_fields(tok, kind, buf, pos, count, obj[6] if len(obj) == 7 else None, obj)
    if not isinstance(obj, dict):
        raise DecodeError(f"header must be a map or a data array, not {type(obj).__name__}")
    t = obj.get("t")
    cls = CONTROL_TYPES.get(t) if isinstance(t, str) else None
    if cls is None:
        raise DecodeError(f"unknown message type {t!r}")
    if _in_bundle and cls is Bundle:  # refused before its entries are looked at: no nesting
        raise DecodeError("Bundle cannot be bundled")
    v = obj.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise VersionMismatch(f"{t}: protocol version {v!r}, this side speaks {PROTOCOL_VERSION}", str(t))
    msg: Message = cls.parse(obj)
    return msg
