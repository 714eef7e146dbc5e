"""The receiver's decisions, with no I/O: registrations and peer replacement, the room table,
the verdict on every control and data message, the three room clocks, peer loss and abort.

The shell (``transferd/receiver/``) feeds it events — a decoded message from a peer identity,
an engine request, ``tick(now)`` — and executes what it queues (:meth:`ReceiverCore.drain`):
control messages to send, refusals and drops to count and log, rooms that ended, peers whose
registration ended. The data path asks the core for a verdict before a byte is written
(:meth:`data_room`, :meth:`claim`, :meth:`aux_ok`, :meth:`reject`) and reports the rows that
landed (:meth:`landed`). Every clock value is an argument; the core reads none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..errors import BadRequest, FailureCode, Refused, RoomExists, TransferdError, UnknownRoom
from ..layout import PoolLayout, layout_difference
from ..types import KIND_LABELS, NAME_RE, SplitMode
from .checksum import checksum_function
from .messages import Assign, Data, DataRef, DataRefs, Done, Fail, Ping, Register, Registered, Status
from .policy import group_plans
from .room import CoverageTracker, RoomRequest, RoomState, RoomStatus, TrackerShape, advance

AUX_GUARD = np.dtype("<u8")
NUDGE_EVERY_S = 1.0  # an unknown identity is asked to register at most this often
MAX_NUDGED = 4096  # identities remembered for that; beyond it the memory is cleared
DataMessage = Data | DataRef | DataRefs


# -- state -------------------------------------------------------------------------------------

@dataclass(slots=True)
class Peer:
    """A registered sender (one CP rank of a group), known by its ZeroMQ identity."""

    ident: bytes
    group: str
    rank: int
    incarnation: int
    pid: int
    host: str
    registered_at: float
    last_seen: float
    epoch: int = 0
    checksum: Callable[[Any], int] | None = None
    same_host: bool = False  # the receiver reads this sender's pool (the same-host plane)
    stream_key: bytes = b""  # the data stream offered at registration (its hello carries this key)
    streaming: bool = False  # its data stream is open
    te: bool = False  # the receiver reads this sender's rows with Mooncake Transfer Engine
    last_data: float = 0.0  # the last data from it, for any room (rows, a record's bytes, a done)

    @property
    def label(self) -> str:
        return f"prefill {self.group} rank {self.rank}"


@dataclass(slots=True)
class Group:
    name: str
    cp_size: int
    split: SplitMode
    dedup: bool = True
    ranks: dict[int, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeRoom:
    req: RoomRequest
    tok: int
    created: float
    status: RoomStatus = field(default_factory=lambda: RoomStatus(RoomState.BOOTSTRAPPING))
    tracker: CoverageTracker | None = None
    assigned: dict[int, bytes] = field(default_factory=dict)
    finished: float = 0.0
    last_progress: float = 0.0
    received: int = 0
    streaming: dict[int, int] = field(default_factory=dict)  # rank -> payloads being read into the rows now

    @property
    def key(self) -> tuple[str, int]:
        return (self.req.group, self.req.room)


# -- actions (what the shell does; plain slotted classes: one or more per event, on the hot path) --

@dataclass(slots=True)
class Send:
    """Send a control message to a peer identity (never blocking; dropped and counted if it cannot go)."""

    ident: bytes
    msg: Registered | Assign | Ping | Status | Any


@dataclass(slots=True)
class Refuse:
    """A refused message: count ``refused[code]`` and log it."""

    code: str
    reason: str
    ident: bytes = b""


@dataclass(slots=True)
class Drop:
    """A message dropped silently (late, or for a room that is over): count ``dropped[key]``."""

    key: str


@dataclass(slots=True)
class Finished:
    """A room reached its terminal status: count it, wake its waiters, then tell its senders."""

    room: DecodeRoom
    status: RoomStatus


@dataclass(slots=True)
class PeerClosed:
    """A registration ended: release what the shell holds for it (its pool mapping, its stream).
    ``reason`` is logged when given; ``heartbeat`` counts a missed heartbeat deadline."""

    peer: Peer
    reason: str = ""
    heartbeat: bool = False


@dataclass(slots=True)
class Note:
    """A log line."""

    level: Literal["info", "warning"]
    text: str


Action = Send | Refuse | Drop | Finished | PeerClosed | Note


@dataclass(frozen=True, slots=True)
class Admission:
    """A registration that passed every check: what :meth:`ReceiverCore.admit` completes once
    the shell has tried the same-host pool (when :attr:`same_host_pool` names one)."""

    ident: bytes
    msg: Register
    split: SplitMode
    checksum: Callable[[Any], int] | None
    same_host_pool: str  # the pool to attach for the same-host plane ("" = not a candidate)
    te: bool = False  # a candidate for the Mooncake plane: both sides set data_plane = "mooncake"


@dataclass(frozen=True, slots=True)
class Settings:
    """What the core needs of the receiver's configuration and host."""

    name: str
    incarnation: int
    max_frame_bytes: int
    heartbeat_interval_s: float
    heartbeat_misses: int
    bootstrap_timeout_s: float
    waiting_timeout_s: float
    stall_timeout_s: float
    same_host: bool = True  # the same-host plane is allowed (receiver.same_host = "auto")
    boot_id: str = ""  # this host's boot id ("" = unknown: no same-host plane)
    stream_port: int = 0  # the data-stream port offered to senders (0 = no data streams)
    mooncake: bool = False  # this receiver reads with Mooncake Transfer Engine (data_plane = "mooncake")
    admit: Mapping[str, tuple[int, SplitMode, bool]] | None = None  # receiver.groups: name -> (cp_size, split,
    # dedup) of the only groups admitted; None = any group (its first rank fixes its settings)
    nixl: bool = False  # this receiver reads with a NIXL agent (data_plane = "nixl")


_ENGINES = {"mooncake": "Mooncake TE", "nixl": "NIXL"}  # the engines a sender may offer its pool to


def _engine_of(msg: Register) -> str:
    """The engine a register offers the pool to (meaningful with a ``te_session``)."""
    return "nixl" if msg.nixl_md else "mooncake"


# -- the core ----------------------------------------------------------------------------------

class ReceiverCore:
    def __init__(self, settings: Settings, layout: PoolLayout, first_token: int) -> None:
        self.s = settings
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        self.peers: dict[bytes, Peer] = {}
        self.groups: dict[str, Group] = {}
        self.rooms: dict[tuple[str, int], DecodeRoom] = {}
        self.by_tok: dict[int, DecodeRoom] = {}
        self.stream_keys: dict[bytes, bytes] = {}  # offered stream key -> peer identity
        self._next_tok = first_token
        self._nudged: dict[bytes, float] = {}
        self._answered: dict[bytes, float] = {}  # identities whose registration was refused: when last told
        self._shapes: dict[tuple[int, SplitMode, int, int, bool], TrackerShape] = {}
        self._row_bytes = layout.buffer_row_bytes
        self._kind_of = [b.kind for b in layout.buffers]
        self._max_row_bytes = max(self._row_bytes)
        self._seq = 0
        self.actions: list[Action] = []

    def drain(self) -> list[Action]:
        """The actions queued since the last call, in order."""
        out, self.actions = self.actions, []
        return out

    # -- small helpers -------------------------------------------------------------------------
    def _refuse(self, code: str, reason: str, ident: bytes = b"") -> None:
        self.actions.append(Refuse(code, reason, ident))

    def _registered(self, ok: bool, reason: str = "", **kw: Any) -> Registered:
        return Registered(ok, reason, self.s.name, self.s.incarnation, **kw)

    def rooms_of(self, group: str) -> list[DecodeRoom]:
        return [r for r in self.rooms.values() if r.req.group == group]

    def seen(self, ident: bytes, now: float) -> Peer | None:
        """Any message from a registered peer counts as a heartbeat."""
        peer = self.peers.get(ident)
        if peer is not None:
            peer.last_seen = now
        return peer

    def unregistered(self, ident: bytes, what: str, now: float) -> None:
        """A message other than ``register`` from an unknown identity: refused, and the peer is
        told (at most once a second) to register — it may be registered with this receiver's
        previous incarnation."""
        self._refuse("unregistered", f"{what} from an unregistered peer", ident)
        self._answer(self._nudged, ident, self._registered(False, "unknown peer: register first", retry=True), now)

    def _answer(self, sent: dict[bytes, float], ident: bytes, msg: Registered, now: float) -> None:
        """An answer to an identity that is not registered: at most one a second per identity
        and kind (``sent``: the nudges, or the refused registrations); a sender retries far less
        often, and a flood that never reads its answers would otherwise have one queued towards
        it for every message it sends."""
        if now - sent.get(ident, -NUDGE_EVERY_S) < NUDGE_EVERY_S:
            return
        if len(sent) > MAX_NUDGED:
            sent.clear()
        sent[ident] = now
        self.actions.append(Send(ident, msg))

    def undecodable(self, ident: bytes, code: str, reason: str, *, register: bool = False, now: float = 0.0) -> None:
        """A header that could not be decoded: refused; a ``register`` of another protocol
        version is answered (at most once a second), so that the sender can say why."""
        self._refuse(code, reason, ident)
        if register:
            self._answer(self._answered, ident, self._registered(False, reason), now)

    # -- registration --------------------------------------------------------------------------
    def register(self, ident: bytes, msg: Register, now: float) -> Admission | None:
        """Check a ``register``. A refusal or a repeated register is answered here (None is
        returned); a registration to complete is returned as an :class:`Admission`."""
        def refuse(reason: str, code: str) -> None:
            self._refuse(code, f"registration of {msg.group} rank {msg.rank}: {reason}", ident)
            if ident in self.peers:  # a registered peer's new register: always answered
                self.actions.append(Send(ident, self._registered(False, reason)))
            else:
                self._answer(self._answered, ident, self._registered(False, reason), now)

        try:
            split = SplitMode.parse(msg.split, BadRequest)
            checksum = checksum_function(msg.checksum, BadRequest)
        except TransferdError as exc:
            refuse(str(exc), "bad_settings")
            return None
        if not NAME_RE.match(msg.group):
            refuse(f"group name {msg.group[:80]!r} must be 1-64 letters, digits, '_', '.', '-'", "bad_settings")
            return None
        if msg.rank >= msg.cp_size:
            refuse(f"rank {msg.rank} is outside cp_size {msg.cp_size}", "bad_rank")
            return None
        if self.s.admit is not None:  # a configured receiver: only its groups, with their settings
            rule = self.s.admit.get(msg.group)
            if rule is None:
                refuse(f"group {msg.group} is not admitted here (receiver.groups names "
                       f"{', '.join(sorted(self.s.admit))})", "unknown_group")
                return None
            if rule != (msg.cp_size, split, msg.dedup):
                refuse(f"group {msg.group} is configured here with cp_size {rule[0]} split {rule[1].value} dedup "
                       f"{'on' if rule[2] else 'off'}; rank {msg.rank} says cp_size {msg.cp_size} split "
                       f"{split.value} dedup {'on' if msg.dedup else 'off'}", "inconsistent_group")
                return None
        # the fingerprint first (the vLLM order): a peer of another layout is refused on it, its
        # layout decoded only to explain why; a matching one must still send the layout it names
        problem = self._layout_problem(msg, msg.fingerprint == self.fingerprint)
        if problem:
            refuse(problem, "layout")
            return None
        biggest = max(msg.max_message_bytes, self._max_row_bytes)  # equal fingerprints: equal row sizes
        if biggest > self.s.max_frame_bytes:
            refuse(f"messages of up to {biggest} bytes exceed this receiver's max_frame_bytes "
                   f"{self.s.max_frame_bytes} (the sender's largest of max_message_bytes, stream_record_bytes "
                   f"and a row)", "frame_limit")
            return None
        group = self.groups.get(msg.group)
        if group is not None and (group.cp_size != msg.cp_size or group.split is not split
                                  or group.dedup != msg.dedup):
            refuse(f"group {msg.group} is registered with cp_size {group.cp_size} split {group.split.value} "
                   f"dedup {'on' if group.dedup else 'off'}; rank {msg.rank} says cp_size {msg.cp_size} split "
                   f"{split.value} dedup {'on' if msg.dedup else 'off'}", "inconsistent_group")
            return None
        known = self.peers.get(ident)
        if known is not None and (known.group, known.rank) != (msg.group, msg.rank):
            # the same identity now claims another place: it has left its old one
            self.peer_lost(known, f"{known.label} registered again as {msg.group} rank {msg.rank}", now,
                           heartbeat=False)
            known = None
        if known is not None and msg.epoch <= known.epoch:
            # a repeated register (several queued while this receiver was away): the registration
            # goes on as it is — its plane, its stream or unused key, its rooms; nothing new offered
            known.last_seen = now
            self.actions.append(Send(ident, self._registered(True, shm=known.same_host, te=known.te)))
            self._assign_waiting(self._group_for(msg, split), msg.rank, now)
            return None
        if msg.te_session and len(msg.te_addrs) != len(self._row_bytes):
            refuse(f"te_addrs names {len(msg.te_addrs)} buffers, the layout has {len(self._row_bytes)}", "bad_settings")
            return None
        engine = _engine_of(msg)
        if msg.te_session and (self.s.nixl if engine == "nixl" else self.s.mooncake):  # the same-host pool is not needed
            return Admission(ident, msg, split, checksum, "", te=True)
        if msg.te_session:  # a receiver that reads with an engine also serves senders that do not
            self.actions.append(Note("warning", f"{msg.group} rank {msg.rank} offers {_ENGINES[engine]} reads but "
                                                f"this receiver has no engine for it (receiver.data_plane is not "
                                                f"\"{engine}\"): today's data plane"))
        candidate = ""
        if msg.pool and self.s.same_host and msg.boot_id and msg.boot_id == self.s.boot_id:
            candidate = msg.pool
        return Admission(ident, msg, split, checksum, candidate)

    def _layout_problem(self, msg: Register, same_fingerprint: bool) -> str | None:
        """Why the sender's layout does not do here (None: it does)."""
        try:
            theirs = PoolLayout.from_wire(msg.layout)
        except TransferdError as exc:
            return f"unreadable layout: {exc}"
        if theirs.fingerprint() != msg.fingerprint:
            return "layout fingerprint does not match the layout sent with it"
        if same_fingerprint:
            return None
        return f"incompatible layout: {layout_difference(theirs, self.layout)}"

    def _group_for(self, msg: Register, split: SplitMode) -> Group:
        group = self.groups.get(msg.group)
        if group is None:
            group = self.groups[msg.group] = Group(msg.group, msg.cp_size, split, msg.dedup)
        return group

    def admit(self, adm: Admission, now: float, *, same_host: bool, stream_key: bytes, te: bool = False) -> Peer:
        """Complete a registration: ``same_host`` says whether the shell attached the offered
        pool; ``stream_key`` is a fresh random key, used if a data stream is offered; ``te``
        whether the shell will read the sender's rows with Mooncake Transfer Engine."""
        ident, msg = adm.ident, adm.msg
        group = self._group_for(msg, adm.split)
        known = self.peers.get(ident)
        if known is not None:  # a higher epoch: the sender gave this receiver up and came back
            self._close_peer(known)
            reason = f"prefill {msg.group} rank {msg.rank} lost its connection to this receiver and registered again"
            self.actions.append(Note("warning", reason))
            self._fail_rooms_assigned_to(msg.group, msg.rank, ident, FailureCode.PEER_LOST, reason, now)
        old_ident = group.ranks.get(msg.rank)
        if old_ident is not None and old_ident != ident:
            old = self.peers.pop(old_ident, None)
            if old is not None:
                self._close_peer(old)
            reason = (f"prefill {msg.group} rank {msg.rank} restarted (incarnation "
                      f"{old.incarnation if old else '?'} -> {msg.incarnation})")
            self.actions.append(Note("warning", reason))
            self._fail_rooms_assigned_to(msg.group, msg.rank, old_ident, FailureCode.PEER_RESTARTED, reason, now)
        group.ranks[msg.rank] = ident
        peer = self.peers[ident] = Peer(ident, msg.group, msg.rank, msg.incarnation, msg.pid, msg.host, now, now,
                                        msg.epoch, adm.checksum, same_host, te=te)
        port = 0
        if msg.stream and self.s.stream_port and not same_host and not te:
            peer.stream_key, port = stream_key, self.s.stream_port
            self.stream_keys[stream_key] = ident
        self.actions.append(Send(ident, self._registered(True, shm=same_host, stream_port=port,
                                                         stream_key=peer.stream_key if port else b"", te=te)))
        how = (f"{_ENGINES[_engine_of(msg)]} reads from {msg.te_session}" if te else
               f"same-host path via pool {msg.pool}" if same_host else
               f"data stream on port {port}" if port else "data over the socket")
        self.actions.append(Note("info", f"registered {msg.group} rank {msg.rank}/{msg.cp_size} ({adm.split.value}, "
                                         f"incarnation {msg.incarnation:x}, pid {msg.pid} on {msg.host}, {how})"))
        self._assign_waiting(group, msg.rank, now)
        return peer

    def _close_peer(self, peer: Peer) -> None:
        """A registration ends: its stream key, if never used, goes with it (every peer that
        leaves passes here, so no offered key outlives its peer)."""
        self.stream_keys.pop(peer.stream_key, None)
        self.actions.append(PeerClosed(peer))

    def peer_lost(self, peer: Peer, reason: str, now: float, *, heartbeat: bool = True) -> None:
        """A peer is gone (heartbeats, a broken stream, another registration): its rooms fail."""
        self.peers.pop(peer.ident, None)
        self.stream_keys.pop(peer.stream_key, None)
        self.actions.append(PeerClosed(peer, reason, heartbeat))
        group = self.groups.get(peer.group)
        if group is not None and group.ranks.get(peer.rank) == peer.ident:
            del group.ranks[peer.rank]
            if not group.ranks:  # a group that comes back may have other settings (cp_size, split)
                del self.groups[peer.group]
                for room in self.rooms_of(peer.group):
                    if not room.assigned:
                        room.tracker = None
        self._fail_rooms_assigned_to(peer.group, peer.rank, peer.ident, FailureCode.PEER_LOST, reason, now)

    def _fail_rooms_assigned_to(self, group: str, rank: int, ident: bytes, code: str, reason: str,
                                now: float) -> None:
        for room in self.rooms_of(group):
            if room.assigned.get(rank) == ident:
                self.finish(room, RoomStatus(RoomState.FAILED, code, reason), now)

    def _assign_waiting(self, group: Group, rank: int, now: float) -> None:
        """Assign this rank every live room of the group it has no assignment for yet."""
        for room in self.rooms_of(group.name):
            if not room.status.state.terminal and room.assigned.get(rank) is None:
                self._assign(room, group, rank, now)

    # -- data streams --------------------------------------------------------------------------
    def stream_opened(self, key: bytes | None, addr: str) -> Peer | None:
        """A data stream's hello: the peer that was offered this key, or None (refused)."""
        if key is None:
            return None
        ident = self.stream_keys.pop(key, None)
        peer = self.peers.get(ident) if ident is not None else None
        if peer is None or peer.stream_key != key or peer.streaming:
            self._refuse("stream_key", f"data stream from {addr} with a key no registered peer holds")
            return None
        peer.streaming = True
        self.actions.append(Note("info", f"{peer.group} rank {peer.rank} sends its data on a stream from {addr}"))
        return peer

    def stream_closed(self, peer: Peer, reason: str, now: float) -> None:
        """A peer's data stream ended: a lost connection (its rooms cannot complete)."""
        if self.peers.get(peer.ident) is peer and peer.streaming:
            peer.streaming = False
            self.peer_lost(peer, f"{peer.label} (pid {peer.pid} on {peer.host}): {reason}", now, heartbeat=False)

    # -- rooms ---------------------------------------------------------------------------------
    def _assign(self, room: DecodeRoom, group: Group, rank: int, now: float) -> None:
        ident = group.ranks[rank]
        req = room.req
        room.assigned[rank] = ident
        self.actions.append(Send(ident, Assign(room.tok, req.room, len(req.dst_pages), req.prefix, req.dst_pages,
                                               req.state, req.aux_slot)))
        if room.tracker is None:
            key = (group.cp_size, group.split, len(req.dst_pages), req.prefix, group.dedup)
            shape = self._shapes.get(key)
            if shape is None:  # plans depend only on these five values: most rooms reuse them
                if len(self._shapes) > 4096:
                    self._shapes.clear()
                shape = self._shapes[key] = TrackerShape(self.layout, group_plans(self.layout, *key))
            room.tracker = CoverageTracker(self.layout, group.cp_size, group.split, req, shape=shape)
        if len(room.assigned) == group.cp_size:
            room.status = advance(room.status, RoomStatus(RoomState.WAITING))
            room.last_progress = now

    def finish(self, room: DecodeRoom, status: RoomStatus, now: float) -> None:
        new = advance(room.status, status)
        if new is room.status:
            return
        room.status = new
        room.finished = now
        self.actions.append(Finished(room, new))

    def expect(self, req: RoomRequest, now: float) -> RoomStatus:
        """The decode engine expects a room (raises :class:`BadRequest` for a bad request)."""
        req.validate(self.layout)
        old = self.rooms.get((req.group, req.room))
        if old is not None:
            raise RoomExists(f"room {req.group}/{req.room} is still held ({old.status.state.value}); release it first")
        tok = self._next_tok
        self._next_tok = (self._next_tok + 1) & ((1 << 64) - 1) or 1
        room = DecodeRoom(req, tok, now)
        self.rooms[room.key] = room
        self.by_tok[tok] = room
        group = self.groups.get(req.group)
        if group is not None:
            for rank in sorted(group.ranks):
                self._assign(room, group, rank, now)
        return room.status

    def room(self, group: str, room_id: int) -> DecodeRoom:
        room = self.rooms.get((group, room_id))
        if room is None:
            raise UnknownRoom(f"room {group}/{room_id} is not held by receiver {self.s.name}")
        return room

    def abort(self, group: str, room_id: int, reason: str, now: float) -> RoomStatus:
        room = self.room(group, room_id)
        self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.ABORTED, reason or "aborted by the decode engine"), now)
        return room.status

    def release(self, group: str, room_id: int, now: float) -> RoomStatus:
        room = self.room(group, room_id)
        self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.ABORTED, "released by the decode engine before completion"),
                    now)
        del self.rooms[room.key]
        self.by_tok.pop(room.tok, None)
        return room.status

    def shutdown(self, now: float) -> None:
        for room in list(self.rooms.values()):
            self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.SHUTDOWN, f"shutting down: receiver {self.s.name} "
                                                                     "stopped before the room ended"), now)

    # -- control messages from a registered peer -----------------------------------------------
    def done(self, peer: Peer, msg: Done, now: float) -> None:
        peer.last_data = now
        room = self.by_tok.get(msg.tok)
        if room is None or room.status.state.terminal:
            self.actions.append(Drop("done_not_live"))
            return
        if room.assigned.get(peer.rank) != peer.ident or msg.rank != peer.rank:
            self._refuse("wrong_peer", f"done for room {room.key} from a peer not assigned to it", peer.ident)
            return
        assert room.tracker is not None
        room.last_progress = now
        if room.streaming.get(peer.rank):  # only a done sent past its stream can overtake its rows
            self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.INCOMPLETE, f"{peer.group} rank {peer.rank} reported "
                                                                         "done while rows of the room were still "
                                                                         "arriving on its data stream"), now)
            return
        problem = room.tracker.rank_done(peer.rank)
        if problem:
            self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.INCOMPLETE, f"{peer.group} {problem}"), now)
        elif room.tracker.complete:
            self.finish(room, RoomStatus(RoomState.SUCCESS), now)

    def fail(self, peer: Peer, msg: Fail, now: float) -> None:
        room = self.by_tok.get(msg.tok)
        if room is None or room.assigned.get(peer.rank) != peer.ident:
            self.actions.append(Drop("fail_not_live"))
            return
        self.finish(room, RoomStatus(RoomState.FAILED, msg.code or FailureCode.PREFILL_FAILED,
                                     f"prefill {peer.group} rank {peer.rank}: {msg.reason}"), now)

    # -- the verdict on data -------------------------------------------------------------------
    def data_room(self, peer: Peer, msg: DataMessage, now: float) -> DecodeRoom | None:
        """The live room a data message is for, if this peer may write it and the buffer is of
        the kind the message says (the checks that need no payload byte); None otherwise."""
        peer.last_data = now  # its connection moves, whatever the verdict
        room = self.by_tok.get(msg.tok)
        if room is None:
            self._refuse("unknown_room", f"data for unknown transfer token {msg.tok:x}", peer.ident)
            return None
        if room.status.state.terminal:
            self.actions.append(Drop("room_not_live"))  # late frames after abort/failure: never written
            return None
        if room.assigned.get(peer.rank) != peer.ident or room.req.group != peer.group:
            self._refuse("wrong_peer", f"{peer.group} rank {peer.rank} sent data for room {room.key} "
                                       "it was not assigned", peer.ident)
            return None
        if msg.buffer >= len(self._row_bytes) or self._kind_of[msg.buffer] != KIND_LABELS[msg.kind]:
            self.reject(room, peer, FailureCode.UNEXPECTED, f"data kind {msg.kind} for buffer {msg.buffer} "
                                                  "does not match the layout", now)
            return None
        return room

    def reject(self, room: DecodeRoom, peer: Peer, code: str, reason: str, now: float) -> None:
        """A data message of the room must not be written: refused, and the room fails."""
        self._refuse(code, f"room {room.key}: {reason}", peer.ident)
        self.finish(room, RoomStatus(RoomState.FAILED, code, f"{peer.group} rank {peer.rank}: {reason}"), now)

    def payload_ok(self, room: DecodeRoom, peer: Peer, msg: Data, payload: Any, now: float) -> bool:
        """A data payload (ZeroMQ frame or stream record): its length, and its checksum when
        the sender announced one."""
        row_bytes = self._row_bytes[msg.buffer]
        if len(payload) != msg.count * row_bytes:
            self.reject(room, peer, FailureCode.LENGTH_MISMATCH,
                        f"payload of {len(payload)} bytes for {msg.count} rows of {row_bytes} bytes", now)
            return False
        if peer.checksum is not None:
            if msg.checksum is None:
                self.reject(room, peer, FailureCode.CHECKSUM, "data frame without the checksum its sender announced", now)
                return False
            if peer.checksum(payload) != msg.checksum:
                self.reject(room, peer, FailureCode.CHECKSUM, f"payload checksum mismatch in buffer {msg.buffer} "
                                                    f"rows [{msg.pos}, {msg.pos + msg.count})", now)
                return False
        return True

    def aux_ok(self, room: DecodeRoom, peer: Peer, first_row: Any, now: float) -> bool:
        """The aux row's first 8 bytes carry the room id (the room guard)."""
        guard = int(np.frombuffer(first_row, dtype=AUX_GUARD, count=1)[0])
        if guard != room.req.room:
            self.reject(room, peer, FailureCode.AUX_GUARD, f"aux row carries room id {guard}, expected {room.req.room}", now)
            return False
        return True

    def claim(self, room: DecodeRoom, peer: Peer, msg: DataMessage, now: float) -> tuple[int, Any] | None:
        """The destination rows of a data message — ``(first_row, None)`` for one run, else
        ``(-1, rows)`` — marked received in the room's coverage; None (the room failed) when
        the plan refuses them."""
        assert room.tracker is not None
        try:
            return room.tracker.accept(peer.rank, msg.kind, msg.buffer, msg.pos, msg.count)
        except Refused as exc:
            self.reject(room, peer, exc.code, exc.reason, now)
            return None

    def stream_read(self, room: DecodeRoom, rank: int, delta: int, now: float | None = None) -> None:
        """A straight read of ``rank``'s rows of the room from its data stream starts (+1, with
        ``now``) or ends (-1): a ``done`` of that rank meanwhile has overtaken its rows. Rows
        arriving are the room's progress: from then on the stall clock, not the waiting one,
        measures it (a record that stops half-way fails it at ``stall_timeout_s``)."""
        room.streaming[rank] = room.streaming.get(rank, 0) + delta
        if now is not None:
            room.last_progress = now
            if room.status.state is RoomState.WAITING:
                room.status = advance(room.status, RoomStatus(RoomState.TRANSFERRING))

    def stream_idle(self, peer: Peer, idle_s: float, in_record: str, now: float) -> bool:
        """The shell's report on a peer's data stream at a tick: no byte for ``idle_s`` seconds;
        ``in_record`` describes the record it stopped inside ("" = between records). A stream
        that stopped inside a record for ``stall_timeout_s`` has stalled: every room of the peer
        that still waits for its rank fails ``stalled`` naming the stream, and True is returned
        (the shell closes it; the peer's other rooms then fail as a lost peer). Between records,
        an idle stream is just idle (heartbeats say whether the peer lives)."""
        if not in_record or idle_s <= self.s.stall_timeout_s or self.peers.get(peer.ident) is not peer:
            return False
        reason = (f"the data stream of {peer.label} (pid {peer.pid} on {peer.host}) stalled: no byte for "
                  f"{idle_s:.1f}s inside {in_record}")
        for room in self.rooms_of(peer.group):
            if (room.assigned.get(peer.rank) == peer.ident and not room.status.state.terminal
                    and (room.tracker is None or peer.rank not in room.tracker.done)):
                self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.STALLED, reason), now)
        self.actions.append(Note("warning", reason))
        return True

    def landed(self, room: DecodeRoom, nbytes: int, now: float) -> None:
        """Claimed rows of a room are in place: progress, and the room ends if that completes it."""
        room.received += nbytes
        room.last_progress = now
        if room.status.state is not RoomState.TRANSFERRING:
            room.status = advance(room.status, RoomStatus(RoomState.TRANSFERRING))
        assert room.tracker is not None
        if room.tracker.complete:
            self.finish(room, RoomStatus(RoomState.SUCCESS), now)

    def row_bytes(self, buffer: int) -> int:
        return self._row_bytes[buffer]

    # -- the clocks ----------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Heartbeats and the three room clocks; called every half heartbeat interval. A sender
        silent for ``interval × misses`` is lost (liveness); a room whose group has not
        registered every rank within ``bootstrap_timeout_s`` fails (queueing for the prefill
        side); a waiting room with nothing accepted for ``waiting_timeout_s``, or a transferring
        one with no progress for ``stall_timeout_s`` whose ranks' connections stopped too, fails
        (progress; see :meth:`_stall_check`)."""
        s = self.s
        deadline = s.heartbeat_interval_s * s.heartbeat_misses
        self._seq += 1
        for peer in list(self.peers.values()):
            if now - peer.last_seen > deadline:
                self.peer_lost(peer, f"{peer.label} (pid {peer.pid} on {peer.host}) missed heartbeats for "
                                     f"{now - peer.last_seen:.1f}s", now)
            elif self._seq % 2 == 0:
                self.actions.append(Send(peer.ident, Ping(self._seq)))
        for room in list(self.rooms.values()):
            st = room.status.state
            if st.terminal:
                continue
            if room.tracker is None or len(room.assigned) < room.tracker.cp_size:
                if now - room.created > s.bootstrap_timeout_s:
                    self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.BOOTSTRAP_TIMEOUT,
                                                 f"prefill group {room.req.group} did not register all ranks within "
                                                 f"{s.bootstrap_timeout_s:g}s (assigned: {sorted(room.assigned)})"),
                                now)
            elif st is RoomState.WAITING and now - room.last_progress > s.waiting_timeout_s:
                self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.WAITING_TIMEOUT,
                                             f"prefill group {room.req.group} sent nothing for the room within "
                                             f"{s.waiting_timeout_s:g}s of its assignment"), now)
            elif st is RoomState.TRANSFERRING and now - room.last_progress > s.stall_timeout_s:
                self._stall_check(room, now)

    def _stall_check(self, room: DecodeRoom, now: float) -> None:
        """A transferring room with no progress of its own for ``stall_timeout_s``. If a rank it
        still waits for keeps sending (rows of rooms queued ahead of it on the same connection),
        it is being slowed, not stalled: it waits, up to ``waiting_timeout_s`` without progress
        of its own. If none of them sent anything for ``stall_timeout_s``, it has stalled."""
        s = self.s
        assert room.tracker is not None
        idle = now - room.last_progress
        waiting = [r for r in range(room.tracker.cp_size) if r not in room.tracker.done]
        moving = []
        for rank in waiting:
            peer = self.peers.get(room.assigned.get(rank, b""))
            if peer is not None and now - peer.last_data <= s.stall_timeout_s:
                moving.append(rank)
        if not moving:
            reason = (f"no data for {idle:.1f}s; ranks not done: {waiting} (and nothing from them for any room "
                      f"in {s.stall_timeout_s:g}s)")
        elif idle > s.waiting_timeout_s:
            reason = (f"no data for {idle:.1f}s; ranks not done: {waiting} (ranks {moving} kept sending other rooms' "
                      f"rows, but none of this room's within waiting_timeout_s {s.waiting_timeout_s:g}s)")
        else:
            return
        self.finish(room, RoomStatus(RoomState.FAILED, FailureCode.STALLED, reason), now)

    # -- introspection -------------------------------------------------------------------------
    def live_rooms(self) -> int:
        return sum(1 for r in list(self.rooms.values()) if not r.status.state.terminal)

