"""transferd.protocol.sender_core: the sender's room life and registration, with a fake clock.

Every event goes in with its time as a plain float; every assertion is on the exact actions the
core queued and the statuses it reports (docs/PROTOCOL.md §5, §6, §11-§13).
"""

from __future__ import annotations

import pytest

from transferd.errors import BadRequest, IndexOutOfRange
from transferd.layout import BufferSpec, ModelSpec, PoolLayout, StateComponent
from transferd.protocol.messages import Assign, Data, Fail, Ping, Pong, Register, Registered, Status
from transferd.protocol.room import RoomState, RoomStatus
from transferd.protocol.sender_core import (
    STREAM_BACKOFF_S,
    Count,
    DropStream,
    Note,
    Pump,
    RoomEnded,
    SendControl,
    SenderCore,
    SendRoom,
    UsePlane,
)
from transferd.types import ConnState, PlaneName, SplitMode

# KV buffers 0..3 (64 pages), conv state 4..5 (8 slots), aux 6 (4 rows)
LAYOUT = ModelSpec(
    name="tiny", dtype="bf16", page_size=4, kv_layers=2, kv_format="mha", kv_token_elems=8,
    state=(StateComponent("conv", 2, (3, 4), "bf16"),), aux_row_bytes=16,
).layout(64, 8, 4)
B, W, T, S, F = (RoomState.BOOTSTRAPPING, RoomState.WAITING, RoomState.TRANSFERRING, RoomState.SUCCESS,
                 RoomState.FAILED)
DEADLINE = 5.0  # heartbeat 1 s x 5 misses


def make(*, rank: int = 0, cp_size: int = 1, retention: int = 100_000) -> SenderCore:
    reg = Register("g", rank, cp_size, "pages", LAYOUT.fingerprint(), LAYOUT.to_wire(), 42)
    return SenderCore(LAYOUT, group="g", rank=rank, cp_size=cp_size, split=SplitMode.PAGES,
                      heartbeat_interval_s=1.0, heartbeat_misses=5, assign_timeout_s=30.0, pool_name="p",
                      register=reg, retention=retention)


def reg_msg(epoch: int = 0, stream: bool = False, rank: int = 0, cp_size: int = 1) -> Register:
    return Register("g", rank, cp_size, "pages", LAYOUT.fingerprint(), LAYOUT.to_wire(), 42, epoch=epoch,
                    stream=stream)


def connect(core: SenderCore, conn: int = 0, *, receiver: str = "rx", inc: int = 7, now: float = 0.0,
            **ok: object) -> None:
    """A connection, registered: its actions are taken."""
    core.add_conn(conn, f"tcp://10.0.0.{conn + 1}:5000", stream_capable=True, now=now)
    core.heard(conn, now)
    core.received(conn, Registered(True, "", receiver, inc, **ok), now)  # type: ignore[arg-type]
    core.take()


def assign(room: int = 1, tok: int = 11, n: int = 4, *, prefix: int = 0, state: dict[str, tuple[int, ...]] | None
           = None, aux: int = 0) -> Assign:
    return Assign(tok, room, n, prefix, tuple(range(20, 20 + n)), dict(state or {}), aux)


def live(core: SenderCore, room: int) -> SendRoom:
    r = core.lookup(room)
    assert r is not None
    return r


def failed(code: str, reason: str) -> RoomStatus:
    return RoomStatus(F, code, reason)


# -- submit checks ---------------------------------------------------------------------------------

SUBMIT_REFUSALS = [
    (dict(start=1, src_pages=(1,)), BadRequest,
     "room 1: chunk starts at page position 1, expected 0 (chunks are contiguous and start at 0)"),
    (dict(src_pages=(1, 64)), IndexOutOfRange, "pool 'p': room 1 source page 64 outside buffer kv.k.L0 of 64 rows"),
    (dict(src_pages=(-1,)), IndexOutOfRange, "pool 'p': room 1 source page -1 outside buffer kv.k.L0 of 64 rows"),
    (dict(src_pages=(3, 4, 3)), BadRequest, "room 1: a source page is listed twice in the chunk"),
    (dict(src_pages=(1,), last=True, state={"ssm": (1,)}), BadRequest,
     "room 1: unknown state component 'ssm' (pool has ['conv'])"),
    (dict(src_pages=(1,), last=True, state={"conv": (1, 8)}), IndexOutOfRange,
     "pool 'p': room 1 conv state slot 8 outside buffer state.conv.L0 of 8 rows"),
    (dict(src_pages=(1,), state={"conv": (1,)}), BadRequest, "room 1: state and aux slots belong to the last chunk"),
    (dict(src_pages=(1,), aux_slot=0), BadRequest, "room 1: state and aux slots belong to the last chunk"),
    (dict(src_pages=(1,), last=True, aux_slot=4), IndexOutOfRange,
     "pool 'p': room 1 aux slot 4 outside buffer aux of 4 rows"),
]


@pytest.mark.parametrize(("kw", "error", "message"), SUBMIT_REFUSALS)
def test_submit_refusals(kw: dict[str, object], error: type[Exception], message: str) -> None:
    core = make()
    args = {"start": 0, **kw}
    with pytest.raises(error) as info:
        core.submit(1, args.pop("start"), args.pop("src_pages"), now=0.0, **args)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert core.lookup(1) is None and core.take() == []  # nothing of a refused chunk stays


def test_submit_to_a_pool_without_kv_buffers() -> None:
    layout = PoolLayout("nokv", 4, (BufferSpec("aux", "aux", 0, "aux", "uint8", (16,), 4),))
    core = SenderCore(layout, group="g", rank=0, cp_size=1, split=SplitMode.PAGES, pool_name="p")
    with pytest.raises(IndexOutOfRange) as info:
        core.submit(1, 0, (1, 2), now=0.0)
    assert str(info.value) == "room 1: pool has no KV buffers but 2 source pages were given"
    assert core.submit(1, 0, (), last=True, aux_slot=3, now=0.0) == RoomStatus(B)


def test_submit_refusals_that_need_a_room() -> None:
    core = make()
    connect(core)
    core.submit(1, 0, (1, 2), now=0.0)
    with pytest.raises(BadRequest, match=r"^room 1: chunk starts at page position 0, expected 2 "):
        core.submit(1, 0, (3,), now=0.0)
    core.received(0, assign(1, n=4), 0.0)
    with pytest.raises(BadRequest) as info:
        core.submit(1, 2, (3, 4, 5), now=0.0)
    assert str(info.value) == "room 1: chunk [2, 5) does not fit the room's 4 pages"
    with pytest.raises(BadRequest) as info:
        core.submit(1, 2, (3,), last=True, aux_slot=0, now=0.0)
    assert str(info.value) == ("room 1: chunk [2, 3) does not fit the room's 4 pages (the last chunk must end at "
                               "the last page)")
    core.submit(1, 2, (3, 4), last=True, state={"conv": ()}, aux_slot=0, now=0.0)
    with pytest.raises(BadRequest) as info:
        core.submit(1, 4, (), now=0.0)
    assert str(info.value) == "room 1 already had its last chunk"
    core.abort(2, "", 1.0)
    with pytest.raises(BadRequest) as info:
        core.submit(2, 0, (1,), now=1.0)
    assert str(info.value) == "room 2 already ended (failed: aborted by the prefill engine)"


def test_submit_then_assign_pumps_once() -> None:
    core = make()
    connect(core)
    assert core.submit(1, 0, (1, 2), now=0.0) == RoomStatus(B)
    assert core.take() == []  # no assign yet: nothing to send
    core.received(0, assign(1, n=4), 0.5)
    assert core.take() == [Pump(1)]
    room = live(core, 1)
    assert room.status == RoomStatus(W) and room.sending and room.conn == 0
    assert room.planned == (4 * 4 * 64, 0, 16)  # 4 pages x 4 KV buffers of 64-byte rows; no state slots; aux
    assert room.dst.tolist() == [20, 21, 22, 23]  # type: ignore[union-attr]
    core.submit(1, 2, (3, 4), last=True, aux_slot=1, now=0.6)
    assert core.take() == []  # its loop runs: it picks the chunk up
    c1 = core.next_chunk(room, 0.7)
    c2 = core.next_chunk(room, 0.7)
    assert c1 is not None and c2 is not None and c1.src.tolist() == [1, 2] and c2.last
    assert c2.aux is not None and c2.aux.tolist() == [1]
    assert core.next_chunk(room, 0.7) is None
    assert room.status == RoomStatus(T)
    core.send_finished(room)
    assert not room.sending and core.take() == []


def test_next_chunk_refuses_what_the_assign_contradicts() -> None:
    core = make()
    connect(core)
    core.submit(1, 0, (1, 2, 3, 4), last=True, state={"conv": (1,)}, now=0.0)
    core.received(0, assign(1, n=4, state={"conv": (5, 6)}), 0.0)
    core.take()
    room = live(core, 1)
    assert core.next_chunk(room, 2.0) is None
    reason = "state component 'conv': 1 source slots for 2 destination slots"
    assert core.take() == [RoomEnded(1, failed("bad_chunk", reason), 0.0),
                           SendControl(0, Fail(11, "bad_chunk", reason), True)]
    core2 = make()
    connect(core2)
    core2.submit(1, 0, (1, 2, 3, 4), last=True, now=0.0)
    core2.received(0, assign(1, n=4), 0.0)
    core2.take()
    assert core2.next_chunk(live(core2, 1), 1.0) is None
    assert live(core2, 1).status == failed("bad_chunk", "the last chunk names no aux slot (rank 0 sends the aux row)")


# -- assign --------------------------------------------------------------------------------------

def test_repeated_and_duplicate_assign() -> None:
    core = make()
    connect(core, 0, receiver="rx0")
    connect(core, 1, receiver="rx1")
    core.received(0, assign(5, tok=11), 0.0)
    assert core.take() == [] and live(core, 5).status == RoomStatus(W)
    core.received(0, assign(5, tok=11), 0.1)  # the same tok again: ignored
    assert core.take() == []
    core.received(1, assign(5, tok=99), 0.2)
    reason = "room 5 of g is already assigned by receiver rx0"
    assert core.take() == [Count("refused", "duplicate_assign"),
                           Note("warning", f"{reason}; refusing the assignment from rx1"),
                           SendControl(1, Fail(99, "room_exists", reason), False)]
    room = live(core, 5)
    assert room.conn == 0 and room.tok == 11 and room.status == RoomStatus(W)  # untouched


def test_assign_of_an_ended_room() -> None:
    core = make()
    connect(core)
    core.abort(7, "engine gave up", 0.0)
    assert core.take() == [RoomEnded(7, failed("aborted", "engine gave up"), 0.0)]  # no assign: no fail sent
    core.received(0, assign(7, tok=21), 1.0)
    assert core.take() == [SendControl(0, Fail(21, "aborted", "room 7 already ended on the prefill side: "
                                                              "engine gave up"), True)]
    # an ended room whose assign had this tok: ignored
    core.received(0, assign(8, tok=31), 1.0)
    core.received(0, Status(31, 8, "success"), 2.0)
    assert core.take() == [RoomEnded(8, RoomStatus(S), 1.0)]
    core.received(0, assign(8, tok=31), 3.0)
    assert core.take() == []
    core.received(0, assign(8, tok=32), 3.0)
    assert core.take() == [SendControl(0, Fail(32, "aborted", "room 8 already ended on the prefill side: "), True)]


def test_bad_assign_and_length_mismatch() -> None:
    core = make()
    connect(core)
    core.received(0, assign(1, tok=11, state={"ssm": (1,)}), 0.0)
    reason = "assignment names unknown state component 'ssm'"
    assert core.take() == [RoomEnded(1, failed("bad_assign", reason), 0.0),
                           SendControl(0, Fail(11, "bad_assign", reason), True)]
    core.submit(2, 0, (1, 2, 3), last=True, aux_slot=0, now=1.0)
    core.received(0, assign(2, tok=12, n=4), 2.0)
    reason = "the engine submitted 3 pages, the decode side expects 4"
    assert core.take() == [RoomEnded(2, failed("length_mismatch", reason), 1.0),
                           SendControl(0, Fail(12, "length_mismatch", reason), True)]


def test_messages_before_registration_and_ping() -> None:
    core = make()
    core.add_conn(0, "ipc:///tmp/x", stream_capable=False, now=0.0)
    assert core.take() == [SendControl(0, reg_msg(), False)]
    core.received(0, assign(1), 0.1)
    core.received(0, Status(1, 1, "success"), 0.1)
    core.received(0, Ping(3), 0.1)
    core.received(0, Pong(3), 0.1)
    assert core.take() == [Count("refused", "not_registered"), Count("refused", "not_registered"),
                           SendControl(0, Pong(3), False)]
    assert core.lookup(1) is None
    core.received(0, Registered(True, "", "rx", 1), 0.2)
    core.take()
    core.received(0, Data(1, 0, 0, 0, 1), 0.3)
    assert core.take() == [Count("refused", "unexpected_type"),
                           Note("warning", "Data is not sent to a sender; refused")]


# -- status, abort and the ending barrier ----------------------------------------------------------

def assigned(core: SenderCore, room: int = 1, tok: int = 11, now: float = 0.0) -> SendRoom:
    core.submit(room, 0, (1, 2, 3, 4), last=True, aux_slot=0, now=now)
    core.received(0, assign(room, tok=tok), now)
    assert core.take() == [Pump(room)]
    return live(core, room)


def test_status_success_failure_and_unknown() -> None:
    core = make()
    connect(core)
    r1, r2 = assigned(core, 1, 11), assigned(core, 2, 12, now=1.0)
    core.received(0, Status(12, 1, "success"), 2.0)  # tok of another room
    core.received(0, Status(11, 3, "success"), 2.0)  # no such room
    assert core.take() == [Count("dropped", "status_unknown_room")] * 2
    core.received(0, Status(11, 1, "success"), 2.0)
    core.received(0, Status(12, 2, "failed", "stalled", "no data for 60.0s"), 2.0)
    assert core.take() == [RoomEnded(1, RoomStatus(S), 0.0), RoomEnded(2, failed("stalled", "no data for 60.0s"), 1.0)]
    assert r1.status == RoomStatus(S) and r2.stopped and core.rooms == {}
    core.received(0, Status(11, 1, "failed", "x", "y"), 3.0)  # a live room only
    assert core.take() == [Count("dropped", "status_unknown_room")]


def test_abort_before_assign_ends_at_once() -> None:
    core = make()
    connect(core)
    core.submit(1, 0, (1,), now=0.0)
    assert core.abort(1, "", 2.0) == failed("aborted", "aborted by the prefill engine")
    assert core.take() == [RoomEnded(1, failed("aborted", "aborted by the prefill engine"), 0.0)]
    assert core.abort(1, "again", 3.0) == failed("aborted", "aborted by the prefill engine")  # terminal is final
    assert core.take() == []


def test_abort_after_assign_nothing_handed_ends_at_once() -> None:
    core = make()
    connect(core)
    room = assigned(core)
    assert core.abort(1, "stop", 1.0) == failed("aborted", "stop")
    assert core.take() == [RoomEnded(1, failed("aborted", "stop"), 0.0), SendControl(0, Fail(11, "aborted", "stop"), True)]
    assert core.next_chunk(room, 1.0) is None and not room.chunks


def test_abort_after_frames_handed_waits_for_the_receiver() -> None:
    core = make()
    connect(core)
    room = assigned(core)
    assert core.next_chunk(room, 0.5) is not None
    room.handed = True  # the send loop gave a data plane something of it
    assert core.abort(1, "stop", 1.0) == RoomStatus(T)  # ending: not terminal yet
    assert core.take() == [SendControl(0, Fail(11, "aborted", "stop"), True)]
    assert room.stopped and room.ending == failed("aborted", "stop")
    with pytest.raises(BadRequest) as info:
        core.submit(1, 4, (), now=1.5)
    assert str(info.value) == "room 1 is ending (aborted: stop)"
    core.abort(1, "twice", 1.5)  # stopped: nothing more
    core.heard(0, 5.0)
    core.tick(1.0 + DEADLINE)  # not past the deadline yet
    assert core.take() == [] and 1 in core.rooms
    core.heard(0, 6.0)
    core.received(0, Status(11, 1, "failed", "aborted", "prefill g rank 0: stop"), 6.0)
    assert core.take() == [RoomEnded(1, failed("aborted", "prefill g rank 0: stop"), 0.0)]


def test_ending_room_ends_on_its_own_after_the_deadline() -> None:
    core = make()
    connect(core)
    room = assigned(core)
    room.handed = True
    core.abort(1, "stop", 1.0)
    core.take()
    core.heard(0, 6.0)  # the receiver is alive, it just never answers for this room
    core.tick(6.0)
    assert core.take() == []
    core.tick(6.01)
    assert core.take() == [RoomEnded(1, failed("aborted", "stop"), 0.0)]


def test_abort_handed_but_connection_not_registered_ends_at_once() -> None:
    core = make()
    connect(core)
    room = assigned(core)
    room.handed = True
    core.received(0, Registered(False, "group changed", "rx", 7), 1.0)  # now refused
    core.take()
    core.abort(1, "stop", 2.0)
    assert core.take() == [RoomEnded(1, failed("aborted", "stop"), 0.0), SendControl(0, Fail(11, "aborted", "stop"), True)]


def test_send_failed_is_a_send_error() -> None:
    core = make()
    connect(core)
    room = assigned(core)
    core.send_failed(room, "sender g/r0 could not send: boom", 1.0)
    assert core.take() == [RoomEnded(1, failed("send_error", "sender g/r0 could not send: boom"), 0.0),
                           SendControl(0, Fail(11, "send_error", "sender g/r0 could not send: boom"), True)]


# -- clocks ----------------------------------------------------------------------------------------

def test_assign_timeout() -> None:
    core = make()
    connect(core)
    core.submit(1, 0, (1,), now=10.0)
    core.abort(2, "", 10.0)  # already terminal: no clock
    core.take()
    core.heard(0, 40.0)
    core.tick(40.0)
    assert core.take() == []
    core.tick(40.5)
    assert core.take() == [RoomEnded(1, failed("assign_timeout", "no receiver expected room 1 within 30s"), 10.0)]


def test_heartbeat_deadline_gives_up_that_connection_only() -> None:
    core = make()
    connect(core, 0, receiver="rx0")
    connect(core, 1, receiver="rx1")
    a = assigned(core, 1, 11)
    core.received(1, assign(2, tok=12), 0.0)
    b = live(core, 2)
    core.submit(3, 0, (1,), now=0.0)  # not assigned: on no connection
    ending = assigned(core, 4, 14)
    ending.handed = True
    core.abort(4, "stop", 0.5)
    core.take()
    core.heard(1, 5.5)
    core.tick(5.0)
    assert core.take() == []
    core.tick(5.5)
    reason = "receiver rx0 at tcp://10.0.0.1:5000 missed heartbeats for 5.5s"
    assert core.take() == [
        Count("heartbeat_misses", "rx0"), Note("warning", reason), DropStream(0),
        RoomEnded(1, failed("peer_lost", reason), 0.0), SendControl(0, Fail(11, "peer_lost", reason), False),
        RoomEnded(4, failed("aborted", "stop"), 0.0),  # an ending room ends with its own status
        SendControl(0, reg_msg(epoch=1, stream=True), False),
    ]
    assert a.stopped and not b.stopped and core.lookup(3) is not None and 3 in core.rooms
    assert core.conns[0].state is ConnState.REGISTERING and core.conns[1].state is ConnState.REGISTERED


def test_registration_cadence() -> None:
    core = make()
    core.add_conn(0, "tcp://h:1", stream_capable=True, now=0.0)
    assert core.take() == [SendControl(0, reg_msg(stream=True), False)]
    core.tick(1.0)
    assert core.take() == []
    core.tick(1.01)  # registering: again after more than one interval
    assert core.take() == [SendControl(0, reg_msg(stream=True), False)]
    core.received(0, Registered(False, "layout differs", "rx", 7), 1.5)
    assert core.take() == [Count("refused", "registration_refused"),
                           Note("error", "receiver rx at tcp://h:1 refused registration: layout differs")]
    assert core.conns[0].state is ConnState.REFUSED and core.conns[0].reason == "layout differs"
    core.tick(11.01)
    assert core.take() == []
    core.tick(11.02)  # refused: again after ten intervals
    assert core.take() == [SendControl(0, reg_msg(stream=True), False)]


def test_registered_chooses_the_plane() -> None:
    core = make()
    core.add_conn(0, "tcp://h:1", stream_capable=True, now=0.0)
    core.add_conn(1, "tcp://h:2", stream_capable=True, now=0.0)
    core.add_conn(2, "ipc:///x", stream_capable=False, now=0.0)
    core.take()
    key = bytes(range(16))
    core.received(0, Registered(True, "", "rx", 7, shm=True), 0.1)
    core.received(1, Registered(True, "", "rx", 7, stream_port=9, stream_key=key), 0.1)
    core.received(2, Registered(True, "", "rx", 7, stream_port=9, stream_key=key), 0.1)
    assert core.take() == [
        UsePlane(0, PlaneName.SAME_HOST), Note("info", "registered with receiver rx at tcp://h:1 (same-host path: "
                                                       "the receiver reads this pool)"),
        UsePlane(1, PlaneName.STREAM, 9, key), Note("info", "registered with receiver rx at tcp://h:2 (data stream "
                                                            "to port 9)"),
        UsePlane(2, PlaneName.ZMQ), Note("info", "registered with receiver rx at ipc:///x (data over the socket)"),
    ]
    assert core.conns[0].shm and not core.conns[1].shm
    # the answer to a repeated register: nothing changes
    core.received(1, Registered(True, "", "rx", 7), 0.2)
    assert core.take() == [] and core.conns[1].plane is PlaneName.STREAM


def test_receiver_restart_and_nudge_give_the_receiver_up() -> None:
    core = make()
    connect(core, receiver="rx", inc=7)
    assigned(core, 1, 11)
    core.received(0, Registered(True, "", "rx", 8), 1.0)  # another incarnation
    reason = "receiver rx restarted"
    assert core.take() == [
        Note("warning", reason), DropStream(0), RoomEnded(1, failed("peer_lost", reason), 0.0),
        SendControl(0, Fail(11, "peer_lost", reason), False), SendControl(0, reg_msg(epoch=1, stream=True), False),
        UsePlane(0, PlaneName.ZMQ), Note("info", "registered with receiver rx at tcp://10.0.0.1:5000 (data over "
                                                 "the socket)"),
    ]
    assert core.conns[0].state is ConnState.REGISTERED and core.conns[0].receiver_inc == 8
    core.received(0, Registered(False, "unknown peer: register first", "rx", 8, retry=True), 2.0)
    reason = ("receiver rx at tcp://10.0.0.1:5000 no longer knows this sender (it restarted, or gave this sender up "
              "after a pause or a cut link)")
    assert core.take() == [Note("warning", reason), DropStream(0), SendControl(0, reg_msg(epoch=2, stream=True), False),
                           SendControl(0, reg_msg(epoch=2, stream=True), False)]
    core.received(0, Registered(False, "unknown peer: register first", "rx", 8, retry=True), 2.5)  # registering
    assert core.take() == [SendControl(0, reg_msg(epoch=2, stream=True), False)]


def test_stream_lost_gives_up_and_backs_off() -> None:
    core = make()
    connect(core, receiver="rx")
    core.stream_lost(0, carried=True, reason="the receiver closed the data stream", now=1.0)
    reason = "receiver rx at tcp://10.0.0.1:5000: the receiver closed the data stream"
    assert core.take() == [Note("warning", reason), DropStream(0),
                           SendControl(0, reg_msg(epoch=1, stream=True), False)]
    core.stream_lost(0, carried=False, reason="x", now=2.0)  # registering: not given up again
    core.stream_lost(0, carried=False, reason="x", now=3.0)
    assert core.take() == [] and core.conns[0].stream_failures == 2
    core.stream_lost(0, carried=False, reason="x", now=4.0)
    assert core.take() == [Note("warning", "3 data streams to tcp://10.0.0.1:5000 ended before carrying anything; "
                                           "not asking for one for 300s (data over the ZeroMQ socket)")]
    assert core.conns[0].no_stream_until == 4.0 + STREAM_BACKOFF_S and core.conns[0].stream_failures == 0
    core.tick(5.5)
    assert core.take() == [SendControl(0, reg_msg(epoch=1, stream=False), False)]  # no stream asked for
    core.tick(304.0)
    assert core.take() == [SendControl(0, reg_msg(epoch=1, stream=True), False)]


def test_shutdown_ends_every_live_room_now() -> None:
    core = make()
    connect(core)
    assigned(core, 1, 11)
    core.submit(2, 0, (1,), now=0.0)
    ending = assigned(core, 3, 13)
    ending.handed = True
    core.abort(3, "stop", 0.0)
    core.take()
    reason = "shutting down: sender g/r0 stopped before the room ended"
    core.shutdown(reason, 1.0)
    assert core.take() == [RoomEnded(1, failed("shutdown", reason), 0.0), SendControl(0, Fail(11, "shutdown", reason), False),
                           RoomEnded(2, failed("shutdown", reason), 0.0), RoomEnded(3, failed("aborted", "stop"), 0.0)]
    assert core.rooms == {}


def test_retention_is_bounded() -> None:
    core = make(retention=3)
    for r in range(5):
        core.abort(r, "", float(r))
    assert list(core.ended) == [2, 3, 4] and core.lookup(1) is None
    core.take()
    core.submit(1, 0, (1,), now=9.0)  # forgotten: a new room
    assert live(core, 1).status == RoomStatus(B)
    with pytest.raises(BadRequest, match="^room 3 already ended"):
        core.submit(3, 0, (1,), now=9.0)


def test_an_ended_room_keeps_its_status_and_token_not_its_page_lists() -> None:
    """Up to 100,000 ended rooms are remembered: whole, they held ~2.6 KB each (a sender grew
    by 168 MB in a 30-minute soak). What a late assign or request needs stays; the lists go,
    once the room's send loop (which may still read them) has returned."""
    core = make()
    connect(core)
    core.received(0, assign(8, tok=31, n=64), 0.0)
    core.submit(8, 0, list(range(64)), now=0.0, last=True, aux_slot=0)
    room = live(core, 8)
    assert room.sending and room.dst is not None and len(room.assign.dst_pages) == 64  # type: ignore[union-attr]
    core.received(0, Status(31, 8, "success"), 1.0)  # it ends while its send loop still runs
    assert room.status == RoomStatus(S) and room.dst is not None  # kept for the loop
    core.send_finished(room)
    assert room.dst is None and room.plan is None and room.assign is not None
    assert room.assign.dst_pages == () and room.assign.state == {} and room.tok == 31
    assert len(room.chunks) == 0 and room.chunks.maxlen == 0  # the shared empty queue, not a deque of its own
    core.take()
    core.received(0, assign(8, tok=31, n=64), 2.0)  # a repeated assignment of a room that is over
    assert core.take() == []
    with pytest.raises(BadRequest, match="^room 8 already ended"):
        core.submit(8, 0, (1,), now=3.0)


def test_plan_follows_rank_and_prefix() -> None:
    core = make(rank=1, cp_size=2)
    connect(core)
    core.received(0, assign(1, tok=11, n=6, prefix=1), 0.0)
    room = live(core, 1)
    assert room.plan is not None and room.plan.kv_range == (3, 6) and not room.plan.aux
    assert room.planned == (3 * 4 * 64, 0, 0)
    core.received(0, assign(2, tok=12, n=6, prefix=1), 0.0)
    assert live(core, 2).plan is room.plan  # cached by (n_pages, prefix)
