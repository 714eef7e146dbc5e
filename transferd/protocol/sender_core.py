"""The sender's decisions, pure: its connections' registration state and its room life.

:class:`SenderCore` takes events — a decoded message from a receiver (``received``), an engine
request (``submit``, ``abort``), a tick carrying the current time (``tick``), the send loop's
progress (``next_chunk``, ``send_failed``, ``send_finished``), a lost data stream or shutdown —
and queues actions the shell executes in order (``take``): send a control message, start a
room's send loop, choose a connection's data plane, count, log, report a room's end. Nothing
here reads a clock, touches a socket or the pool, or logs: every time is an argument, and a room
names its connection by an id. The shell's send loop marks a room ``handed`` (something of it
reached a data plane) and adds to its ``sent`` bytes directly; both only feed this core's
decisions (the ending barrier, the in-flight gauge).

docs/PROTOCOL.md §5 (registration), §6 (rooms and assigns), §11-§13 (statuses, clocks, abort).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ..errors import BadRequest, FailureCode, IndexOutOfRange
from ..layout import PoolLayout
from ..types import ConnState, PlaneName, SplitMode
from .messages import Assign, Bundle, Control, Fail, Message, Ping, Pong, Register, Registered, Status
from .policy import RankPlan, rank_plan
from .room import RoomState, RoomStatus, advance

ConnId = int | str
"""How a room names its connection (the shell's index or name for it)."""

TERMINAL_RETENTION = 100_000  # ended rooms remembered by id (a late assign gets their outcome)
PLAN_CACHE = 4096  # distinct (n_pages, prefix) plans kept; then the cache starts over
STREAM_FAILURES, STREAM_BACKOFF_S = 3, 300.0  # streams lost unused in a row; then ZeroMQ for this long

# The failure codes a sender gives a room (docs/PROTOCOL.md §11); a receiver's code arrives in
# its status and is kept as sent.
ABORTED = FailureCode.ABORTED
ASSIGN_TIMEOUT = FailureCode.ASSIGN_TIMEOUT
BAD_ASSIGN = FailureCode.BAD_ASSIGN
LENGTH_MISMATCH = FailureCode.LENGTH_MISMATCH
BAD_CHUNK = FailureCode.BAD_CHUNK
SEND_ERROR = FailureCode.SEND_ERROR
PEER_LOST = FailureCode.PEER_LOST
SHUTDOWN = FailureCode.SHUTDOWN
ROOM_EXISTS = FailureCode.ROOM_EXISTS  # only in the fail that refuses a second assign
SENDER_CODES = (ABORTED, ASSIGN_TIMEOUT, BAD_ASSIGN, LENGTH_MISMATCH, BAD_CHUNK, SEND_ERROR, PEER_LOST, SHUTDOWN,
                ROOM_EXISTS)

Level = Literal["debug", "info", "warning", "error"]
CounterName = Literal["refused", "dropped", "heartbeat_misses"]


# -- actions -------------------------------------------------------------------------------------

@dataclass(slots=True)
class SendControl:
    """Send ``msg`` on connection ``conn``: ``reliable`` waits behind the data while the pipe is
    full; otherwise it is dropped (and counted) when the pipe is full."""

    conn: ConnId
    msg: Control
    reliable: bool


@dataclass(slots=True)
class RoomEnded:
    """A room became terminal: wake its waiters, count and observe it (``created`` is the time
    the room became known, on the clock the events carry)."""

    room: int
    status: RoomStatus
    created: float


@dataclass(slots=True)
class Pump:
    """Start the room's send loop (it is assigned, has chunks and none runs)."""

    room: int


@dataclass(slots=True)
class UsePlane:
    """The connection registered anew: close its data stream, if any, and send its rows on
    ``plane`` from now on (a stream plane connects to ``stream_port`` with ``stream_key``)."""

    conn: ConnId
    plane: PlaneName
    stream_port: int = 0
    stream_key: bytes = b""


@dataclass(slots=True)
class DropStream:
    """The receiver was given up: close the connection's data stream (its data takes ZeroMQ)."""

    conn: ConnId


@dataclass(slots=True)
class Count:
    """Add one to ``counter[key]``."""

    counter: CounterName
    key: str


@dataclass(slots=True)
class Note:
    """A log line of the agent."""

    level: Level
    text: str


Action = SendControl | RoomEnded | Pump | UsePlane | DropStream | Count | Note


# -- state ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class SenderConn:
    """The sender's view of one receiver connection (§5, §12)."""

    id: ConnId
    endpoint: str
    stream_capable: bool  # a tcp:// endpoint and data streams allowed: ask for one
    state: ConnState = ConnState.REGISTERING
    receiver: str = ""
    receiver_inc: int = 0
    reason: str = ""
    last_heard: float = 0.0
    last_register: float = 0.0
    epoch: int = 0
    plane: PlaneName = PlaneName.ZMQ  # as agreed at the last registration
    stream_failures: int = 0  # streams lost in a row before carrying a record
    no_stream_until: float = 0.0  # after too many of those: do not ask for one before this time

    @property
    def shm(self) -> bool:
        return self.plane is PlaneName.SAME_HOST


@dataclass(slots=True)
class Chunk:
    start: int
    src: np.ndarray
    last: bool
    state: dict[str, np.ndarray]
    aux: np.ndarray | None  # the aux slot, as one row (last chunk only)

    @property
    def end(self) -> int:
        return self.start + len(self.src)


@dataclass(slots=True, eq=False)
class SendRoom:
    room: int
    created: float
    status: RoomStatus = field(default_factory=lambda: RoomStatus(RoomState.BOOTSTRAPPING))
    conn: ConnId | None = None
    assign: Assign | None = None
    plan: RankPlan | None = None
    dst: np.ndarray | None = None
    chunks: collections.deque[Chunk] = field(default_factory=collections.deque)
    next_start: int = 0
    last_submitted: bool = False
    sending: bool = False  # the shell's send loop runs for it
    planned: tuple[int, int, int] = (0, 0, 0)  # kv, state, aux bytes this rank sends (known once assigned)
    sent: int = 0  # written by the send loop
    handed: bool = False  # written by the send loop: a data plane has (had) something of it
    ending: RoomStatus | None = None  # failed here while frames may be in flight: waits for the receiver
    ending_since: float = 0.0

    @property
    def stopped(self) -> bool:
        """Send nothing more for this room."""
        return self.status.state.terminal or self.ending is not None

    @property
    def tok(self) -> int:
        assert self.assign is not None
        return self.assign.tok


def _shed(room: SendRoom) -> None:
    """An ended room is remembered (up to ``retention`` of them) only for its status and token: a
    late or repeated ``assign`` and the engine's late requests need nothing else. Its page lists
    go (they were ~2.6 KB a small room: 250 MB a sender at the cap in a 30-minute soak; now
    ~0.4 KB)."""
    a = room.assign
    if a is not None and (len(a.dst_pages) or a.state):
        room.assign = Assign(a.tok, a.room, a.n_pages, a.prefix, (), {}, a.aux_slot)
    room.dst = None
    room.plan = None
    room.chunks = _NO_CHUNKS  # an empty deque is 760 bytes; this shared one keeps nothing appended


_NO_CHUNKS: collections.deque[Chunk] = collections.deque(maxlen=0)


# -- the core ------------------------------------------------------------------------------------

class SenderCore:
    def __init__(self, layout: PoolLayout, *, group: str, rank: int, cp_size: int, split: SplitMode,
                 dedup: bool = True, heartbeat_interval_s: float = 1.0, heartbeat_misses: int = 5,
                 assign_timeout_s: float = 300.0, pool_name: str = "", register: Register | None = None,
                 retention: int = TERMINAL_RETENTION) -> None:
        self.layout = layout
        self.group, self.rank, self.cp_size, self.split, self.dedup = group, rank, cp_size, split, dedup
        self.interval = heartbeat_interval_s
        self.deadline = heartbeat_interval_s * heartbeat_misses
        self.assign_timeout_s = assign_timeout_s
        self.pool_name = pool_name
        self.register = register if register is not None else Register(
            group, rank, cp_size, split.value, layout.fingerprint(), layout.to_wire(), 0)
        self.retention = retention
        self.conns: dict[ConnId, SenderConn] = {}
        self.rooms: dict[int, SendRoom] = {}  # live rooms
        self.ended: collections.OrderedDict[int, SendRoom] = collections.OrderedDict()  # the last terminal ones
        self.actions: list[Action] = []
        kv = layout.indices("kv")
        self._kv0 = kv[0] if kv else None
        self._plans: dict[tuple[int, int], RankPlan] = {}

    def take(self) -> list[Action]:
        """The actions queued since the last call, in order."""
        out, self.actions = self.actions, []
        return out

    # -- connections -----------------------------------------------------------------------------
    def add_conn(self, conn_id: ConnId, endpoint: str, *, stream_capable: bool, now: float) -> SenderConn:
        conn = self.conns[conn_id] = SenderConn(conn_id, endpoint, stream_capable)
        self._register(conn, now)
        return conn

    def heard(self, conn_id: ConnId, now: float) -> None:
        """Any message arrived on the connection, decodable or not."""
        self.conns[conn_id].last_heard = now

    def received(self, conn_id: ConnId, msg: Message, now: float) -> None:
        """A decoded message from the connection's receiver."""
        conn = self.conns[conn_id]
        if isinstance(msg, Bundle):  # its entries in order, each as if it had come alone
            for m in msg.msgs:
                self.received(conn_id, m, now)
        elif isinstance(msg, Registered):
            self._on_registered(conn, msg, now)
        elif isinstance(msg, Ping):
            self.actions.append(SendControl(conn_id, Pong(msg.seq), False))
        elif isinstance(msg, Pong):
            pass
        elif conn.state is not ConnState.REGISTERED:
            self.actions.append(Count("refused", "not_registered"))
        elif isinstance(msg, Assign):
            self.assign(conn_id, msg, now)
        elif isinstance(msg, Status):
            self.status(conn_id, msg)
        else:
            self.actions.append(Count("refused", "unexpected_type"))
            self.actions.append(Note("warning", f"{type(msg).__name__} is not sent to a sender; refused"))

    def _register(self, conn: SenderConn, now: float) -> None:
        conn.last_register = now
        stream = conn.stream_capable and now >= conn.no_stream_until
        self.actions.append(SendControl(conn.id, dataclasses.replace(self.register, epoch=conn.epoch, stream=stream),
                                        False))

    def _on_registered(self, conn: SenderConn, msg: Registered, now: float) -> None:
        registered = conn.state is ConnState.REGISTERED
        if msg.ok:
            again = registered and conn.receiver_inc == msg.incarnation
            if registered and not again:
                self._conn_lost(conn, f"receiver {conn.receiver} restarted", now)
            conn.state, conn.receiver, conn.receiver_inc, conn.reason = (
                ConnState.REGISTERED, msg.receiver, msg.incarnation, "")
            if again:
                return  # the answer to a repeated register: the connection, its path and stream go on
            if msg.te and self.register.nixl_md:
                conn.plane, how = PlaneName.NIXL, "NIXL: the receiver reads this pool"
            elif msg.te:
                conn.plane, how = PlaneName.MOONCAKE, "Mooncake TE: the receiver reads this pool"
            elif msg.shm:
                conn.plane, how = PlaneName.SAME_HOST, "same-host path: the receiver reads this pool"
            elif msg.stream_port and conn.stream_capable:
                conn.plane, how = PlaneName.STREAM, f"data stream to port {msg.stream_port}"
            else:
                conn.plane, how = PlaneName.ZMQ, "data over the socket"
            stream = conn.plane is PlaneName.STREAM
            self.actions.append(UsePlane(conn.id, conn.plane, msg.stream_port if stream else 0,
                                         msg.stream_key if stream else b""))
            self.actions.append(Note("info", f"registered with receiver {msg.receiver} at {conn.endpoint} ({how})"))
        elif msg.retry:
            if registered:
                self._conn_lost(conn, f"receiver {msg.receiver} at {conn.endpoint} no longer knows this sender "
                                      "(it restarted, or gave this sender up after a pause or a cut link)", now)
            conn.state = ConnState.REGISTERING
            self._register(conn, now)
        else:
            conn.state, conn.receiver, conn.reason = ConnState.REFUSED, msg.receiver, msg.reason
            self.actions.append(Count("refused", "registration_refused"))
            self.actions.append(Note("error", f"receiver {msg.receiver} at {conn.endpoint} refused registration: "
                                              f"{msg.reason}"))

    def stream_lost(self, conn_id: ConnId, *, carried: bool, reason: str, now: float) -> None:
        """The connection's current data stream ended; ``carried``: it took at least one record."""
        conn = self.conns[conn_id]
        # something at that port that is not the receiver would fail every room, over and over
        conn.stream_failures = 0 if carried else conn.stream_failures + 1
        if conn.stream_failures >= STREAM_FAILURES:
            conn.stream_failures, conn.no_stream_until = 0, now + STREAM_BACKOFF_S
            self.actions.append(Note("warning", f"{STREAM_FAILURES} data streams to {conn.endpoint} ended before "
                                                f"carrying anything; not asking for one for {STREAM_BACKOFF_S:g}s "
                                                "(data over the ZeroMQ socket)"))
        if conn.state is ConnState.REGISTERED:
            self._conn_lost(conn, f"receiver {conn.receiver} at {conn.endpoint}: {reason}", now)

    def _conn_lost(self, conn: SenderConn, reason: str, now: float) -> None:
        """Give a receiver up: fail its rooms here, tell it (if it can still hear), register anew
        under a higher epoch so that it ends those rooms too."""
        self.actions.append(Note("warning", reason))
        self.actions.append(DropStream(conn.id))
        for room in list(self.rooms.values()):
            if room.conn == conn.id:
                self._end_now(room, PEER_LOST, reason, now)
        conn.epoch += 1
        conn.state = ConnState.REGISTERING
        self._register(conn, now)

    # -- clocks ----------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """The receiver pings every connection; a receiver silent for ``interval × misses`` is
        lost. Rooms no receiver has expected within ``assign_timeout_s`` fail (the queueing
        clock); an ending room the receiver never answered ends after the same deadline."""
        interval, deadline = self.interval, self.deadline
        for conn in self.conns.values():
            if conn.state is ConnState.REGISTERED:
                if now - conn.last_heard > deadline:
                    self.actions.append(Count("heartbeat_misses", conn.receiver or conn.endpoint))
                    self._conn_lost(conn, f"receiver {conn.receiver} at {conn.endpoint} missed heartbeats "
                                          f"for {now - conn.last_heard:.1f}s", now)
            elif conn.state is ConnState.REGISTERING and now - conn.last_register > interval:
                self._register(conn, now)
            elif conn.state is ConnState.REFUSED and now - conn.last_register > 10 * interval:
                self._register(conn, now)  # the receiver's view of the group may have changed
        for room in list(self.rooms.values()):
            if room.ending is not None and now - room.ending_since > deadline:
                self._set_terminal(room, room.ending)  # the receiver never answered: end it anyway
            elif room.assign is None and now - room.created > self.assign_timeout_s:
                self._fail(room, ASSIGN_TIMEOUT, f"no receiver expected room {room.room} within "
                                                 f"{self.assign_timeout_s:g}s", now)

    # -- engine requests -------------------------------------------------------------------------
    def submit(self, room_id: int, start: int, src_pages: Sequence[int] | np.ndarray, *, now: float,
               last: bool = False, state: Mapping[str, Sequence[int]] | None = None,
               aux_slot: int | None = None) -> RoomStatus:
        """Queue one chunk of a room: source pages for positions ``[start, start + len)``; the last
        chunk also names the state slots and the aux slot. Every index is checked first (the
        shell refuses a new room while draining, before this)."""
        room = self.rooms.get(room_id)
        ended = self.ended.get(room_id)
        if room is None and ended is not None:
            raise BadRequest(f"room {room_id} already ended ({ended.status.state.value}: {ended.status.reason})")
        if room is not None and room.ending is not None:
            raise BadRequest(f"room {room_id} is ending ({room.ending.code}: {room.ending.reason})")
        if room is not None and room.last_submitted:
            raise BadRequest(f"room {room_id} already had its last chunk")
        expected = room.next_start if room is not None else 0
        if start != expected:
            raise BadRequest(f"room {room_id}: chunk starts at page position {start}, expected {expected} "
                             "(chunks are contiguous and start at 0)")
        layout = self.layout
        src = np.asarray(src_pages, dtype=np.int64)
        if self._kv0 is not None:
            self._check_rows(self._kv0, src, f"room {room_id} source page")
        elif len(src):
            raise IndexOutOfRange(f"room {room_id}: pool has no KV buffers but {len(src)} source pages were given")
        if len(src) > 1 and len(np.unique(src)) != len(src):
            raise BadRequest(f"room {room_id}: a source page is listed twice in the chunk")
        st: dict[str, np.ndarray] = {}
        for comp, slots in (state or {}).items():
            if comp not in layout.state_components:
                raise BadRequest(f"room {room_id}: unknown state component {comp!r} "
                                 f"(pool has {list(layout.state_components)})")
            b = next(i for i in layout.indices("state") if layout.buffers[i].component == comp)
            arr = np.asarray(slots, dtype=np.int64)
            self._check_rows(b, arr, f"room {room_id} {comp} state slot")
            st[comp] = arr
        if (state or aux_slot is not None) and not last:
            raise BadRequest(f"room {room_id}: state and aux slots belong to the last chunk")
        aux = None
        if aux_slot is not None:
            aux = np.asarray([aux_slot], dtype=np.int64)
            self._check_rows(layout.aux_index, aux, f"room {room_id} aux slot")
        if room is not None and room.assign is not None:
            n = room.assign.n_pages
            end = start + len(src)
            if end > n or (last and end != n):
                raise BadRequest(f"room {room_id}: chunk [{start}, {end}) does not fit the room's {n} pages"
                                 + (" (the last chunk must end at the last page)" if last else ""))
        if room is None:
            room = self._new_room(room_id, now)
        room.chunks.append(Chunk(start, src, last, st, aux))
        room.next_start = start + len(src)
        room.last_submitted = last
        self._pump(room)
        return room.status

    def _check_rows(self, buffer: int, arr: np.ndarray, what: str) -> None:
        """The pool's own check (``Pool.check_rows``), on the layout's row counts."""
        spec = self.layout.buffers[buffer]
        n = spec.rows
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            bad = int(arr[(arr < 0) | (arr >= n)][0])
            raise IndexOutOfRange(f"pool {self.pool_name!r}: {what} {bad} outside buffer {spec.name} of {n} rows")

    def abort(self, room_id: int, reason: str, now: float) -> RoomStatus:
        """The engine aborts the room (one not known yet is remembered as aborted)."""
        room = self.lookup(room_id) or self._new_room(room_id, now)
        self._fail(room, ABORTED, reason or "aborted by the prefill engine", now)
        return room.status

    def lookup(self, room_id: int) -> SendRoom | None:
        """A live room, or a remembered ended one."""
        return self.rooms.get(room_id) or self.ended.get(room_id)

    def shutdown(self, reason: str, now: float) -> None:
        """The agent stops: every live room ends now."""
        for room in list(self.rooms.values()):
            self._end_now(room, SHUTDOWN, reason, now)

    # -- receiver messages -----------------------------------------------------------------------
    def assign(self, conn_id: ConnId, msg: Assign, now: float) -> None:
        """A receiver expects the room (§6); the connection is registered."""
        room = self.rooms.get(msg.room)
        ended = self.ended.get(msg.room)
        if room is None and ended is not None:
            if ended.assign is not None and ended.assign.tok == msg.tok:
                return  # a repeated assignment of a room that is over
            # aborted before any receiver expected it, or an id still remembered from an ended room
            self.actions.append(SendControl(conn_id, Fail(
                msg.tok, ended.status.code or ABORTED,
                f"room {msg.room} already ended on the prefill side: {ended.status.reason}"), True))
            return
        if room is not None and room.assign is not None:
            if room.assign.tok == msg.tok:
                return
            self.actions.append(Count("refused", "duplicate_assign"))
            holder = self.conns.get(room.conn) if room.conn is not None else None
            reason = (f"room {msg.room} of {self.group} is already assigned by receiver "
                      f"{holder.receiver if holder else '?'}")
            self.actions.append(Note("warning", f"{reason}; refusing the assignment from "
                                                f"{self.conns[conn_id].receiver}"))
            self.actions.append(SendControl(conn_id, Fail(msg.tok, ROOM_EXISTS, reason), False))
            return
        if room is None:
            room = self._new_room(msg.room, now)
        room.conn, room.assign = conn_id, msg
        missing = [c for c in msg.state if c not in self.layout.state_components]
        if missing:
            self._fail(room, BAD_ASSIGN, f"assignment names unknown state component {missing[0]!r}", now)
            return
        plan = self._plans.get((msg.n_pages, msg.prefix))
        if plan is None:  # a plan depends only on the room's length and prefix here: most rooms reuse one
            if len(self._plans) > PLAN_CACHE:
                self._plans.clear()
            plan = self._plans[(msg.n_pages, msg.prefix)] = rank_plan(
                self.layout, self.cp_size, self.rank, self.split, msg.n_pages, msg.prefix, self.dedup)
        room.plan = plan
        rows, row_bytes = self.layout.buffers, self.layout.buffer_row_bytes
        room.planned = (plan.kv_positions * sum(row_bytes[b] for b in plan.kv_buffers),
                        sum(len(msg.state.get(rows[b].component, ())) * row_bytes[b] for b in plan.state_buffers),
                        self.layout.aux_row_bytes if plan.aux else 0)
        room.dst = np.asarray(msg.dst_pages, dtype=np.int64)
        room.status = advance(room.status, RoomStatus(RoomState.WAITING))
        if room.last_submitted and room.next_start != msg.n_pages:
            self._fail(room, LENGTH_MISMATCH, f"the engine submitted {room.next_start} pages, the decode side "
                                              f"expects {msg.n_pages}", now)
            return
        self._pump(room)

    def status(self, conn_id: ConnId, msg: Status) -> None:
        """The receiver's terminal outcome for a room (dropped unless it names a live room's tok)."""
        room = self.rooms.get(msg.room)
        if room is None or room.assign is None or room.assign.tok != msg.tok:
            self.actions.append(Count("dropped", "status_unknown_room"))
            return
        state = RoomState.SUCCESS if msg.state == "success" else RoomState.FAILED
        self._set_terminal(room, RoomStatus(state, msg.code, msg.reason))

    # -- the send loop's events ------------------------------------------------------------------
    def next_chunk(self, room: SendRoom, now: float) -> Chunk | None:
        """The next chunk to send, checked against the assign; None when there is none or the
        room stopped (a chunk that does not fit fails the room: ``bad_chunk``)."""
        if not room.chunks or room.stopped:
            return None
        chunk = room.chunks.popleft()
        problem = self._check_chunk(room, chunk)
        if problem:
            self._fail(room, BAD_CHUNK, problem, now)
            return None
        room.status = advance(room.status, RoomStatus(RoomState.TRANSFERRING))
        return chunk

    def send_failed(self, room: SendRoom, reason: str, now: float) -> None:
        self._fail(room, SEND_ERROR, reason, now)

    def send_finished(self, room: SendRoom) -> None:
        """The room's send loop returned; start it again if more came meanwhile."""
        room.sending = False
        if room.status.state.terminal:
            _shed(room)
        self._pump(room)

    def _check_chunk(self, room: SendRoom, chunk: Chunk) -> str | None:
        assert room.assign is not None
        a = room.assign
        if chunk.end > a.n_pages:
            return f"chunk [{chunk.start}, {chunk.end}) runs past the room's {a.n_pages} pages"
        if chunk.last:
            if chunk.end != a.n_pages:
                return f"last chunk ends at page {chunk.end}, the decode side expects {a.n_pages} pages"
            for comp in self.layout.state_components:
                want = len(a.state.get(comp, ()))
                have = len(chunk.state.get(comp, ()))
                if room.plan and any(self.layout.buffers[b].component == comp for b in room.plan.state_buffers) \
                        and have != want:
                    return f"state component {comp!r}: {have} source slots for {want} destination slots"
            if room.plan and room.plan.aux and chunk.aux is None:
                return "the last chunk names no aux slot (rank 0 sends the aux row)"
        return None

    # -- room life -------------------------------------------------------------------------------
    def _new_room(self, room_id: int, now: float) -> SendRoom:
        room = SendRoom(room_id, now)
        self.rooms[room_id] = room
        self.ended.pop(room_id, None)
        return room

    def _pump(self, room: SendRoom) -> None:
        if room.assign is not None and room.chunks and not room.sending and not room.stopped:
            room.sending = True
            self.actions.append(Pump(room.room))

    def _set_terminal(self, room: SendRoom, status: RoomStatus) -> None:
        new = advance(room.status, status)
        if new is room.status:
            return
        room.status = new
        room.chunks.clear()
        if self.rooms.get(room.room) is room:
            del self.rooms[room.room]
            self.ended[room.room] = room
            while len(self.ended) > self.retention:
                self.ended.popitem(last=False)
        if not room.sending:  # else once its send loop returned (it may still read them)
            _shed(room)
        self.actions.append(RoomEnded(room.room, new, room.created))

    def _fail(self, room: SendRoom, code: str, reason: str, now: float, *, reliable: bool = True) -> None:
        """A prefill-side failure (an engine abort, a bad chunk): stop sending and tell the receiver
        at once. If something of the room was already handed to a data plane, frames sent zero-copy
        out of the pool may still read it: the room then ends only when the receiver answers (its
        status follows our frames on the same connection), or after the heartbeat deadline, so an
        engine that waits for the end before reusing the pages never has them read afterwards.
        Otherwise it ends here at once."""
        if room.stopped:
            return
        status = RoomStatus(RoomState.FAILED, code, reason)
        conn = self.conns.get(room.conn) if room.conn is not None else None
        connected = conn is not None and conn.state is ConnState.REGISTERED
        if reliable and room.handed and connected:
            room.ending, room.ending_since = status, now
            room.chunks.clear()
        else:
            self._set_terminal(room, status)
        if room.conn is not None and room.assign is not None:
            self.actions.append(SendControl(room.conn, Fail(room.assign.tok, code, reason), reliable))

    def _end_now(self, room: SendRoom, code: str, reason: str, now: float) -> None:
        """End a room at once (its connection is gone, or the agent stops), ending or not."""
        if room.ending is not None:
            self._set_terminal(room, room.ending)
        else:
            self._fail(room, code, reason, now, reliable=False)
