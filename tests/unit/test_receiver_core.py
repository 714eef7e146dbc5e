"""transferd.protocol.receiver_core: the receiver's decisions, driven by events and a fake clock
(plain floats), with no socket, process or wall clock. The process-level tests in
tests/integration prove the same rules hold on the wire; these pin every rule exactly."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from transferd.errors import BadRequest, RoomExists, UnknownRoom
from transferd.layout import ModelSpec, StateComponent
from transferd.protocol.messages import Assign, Data, DataRefs, Done, Fail, Ping, Register, Registered
from transferd.protocol.receiver_core import (
    Admission,
    Drop,
    Finished,
    Note,
    Peer,
    PeerClosed,
    ReceiverCore,
    Refuse,
    Send,
    Settings,
)
from transferd.protocol.room import RoomRequest, RoomState
from transferd.types import Kind

# KV buffers 0..7 (4 MHA layers, K and V), conv 8..9, ssm 10..12, aux 13
LAYOUT = ModelSpec(
    name="tiny", dtype="bf16", page_size=4, kv_layers=4, kv_format="mha", kv_token_elems=8,
    state=(StateComponent("conv", 2, (3, 4), "bf16"), StateComponent("ssm", 3, (5,), "fp32")),
    aux_row_bytes=16,
).layout(64, 8, 4)
KV_BUFFERS = LAYOUT.indices("kv")
AUX = LAYOUT.aux_index
SETTINGS = Settings(name="decode0", incarnation=7, max_frame_bytes=64 << 20, heartbeat_interval_s=1.0,
                    heartbeat_misses=3, bootstrap_timeout_s=30.0, waiting_timeout_s=600.0, stall_timeout_s=10.0,
                    same_host=True, boot_id="boot-a", stream_port=0)
T0 = 1000.0


def core(**kw: object) -> ReceiverCore:
    s = dataclasses.replace(SETTINGS, **kw)  # type: ignore[arg-type]
    return ReceiverCore(s, LAYOUT, first_token=5)


def register_msg(group: str = "g", rank: int = 0, cp: int = 2, **kw: object) -> Register:
    base: dict[str, object] = dict(group=group, rank=rank, cp_size=cp, split="pages", fingerprint=LAYOUT.fingerprint(),
                                   layout=LAYOUT.to_wire(), incarnation=100 + rank, pid=1, host="h", epoch=0,
                                   checksum="none", boot_id="", pool="", pool_id=0, max_message_bytes=1 << 20,
                                   dedup=True, stream=False)
    base.update(kw)
    return Register(**base)  # type: ignore[arg-type]


def ident(rank: int, group: str = "g", inc: int = 0) -> bytes:
    return f"{group}/{rank}/{inc}".encode()


def join(c: ReceiverCore, rank: int, now: float = T0, *, group: str = "g", cp: int = 2, inc: int = 0,
         **kw: object) -> Peer:
    adm = c.register(ident(rank, group, inc), register_msg(group, rank, cp, incarnation=100 + rank + inc, **kw), now)
    assert isinstance(adm, Admission)
    return c.admit(adm, now, same_host=False, stream_key=os.urandom(16))


def request(room: int = 1, n: int = 4, group: str = "g", prefix: int = 0) -> RoomRequest:
    return RoomRequest(room, group, tuple(range(10, 10 + n)), prefix, {"conv": (1,), "ssm": (2,)}, aux_slot=3)


def of(actions: list[object], kind: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, kind)]


def refusals(actions: list[object]) -> list[str]:
    return [a.code for a in of(actions, Refuse)]


def finished(actions: list[object]) -> list[tuple[str, str]]:
    return [(a.status.state.value, a.status.code) for a in of(actions, Finished)]


def aux_row(room_id: int) -> bytes:
    return np.array([room_id], dtype="<u8").tobytes() + bytes(LAYOUT.aux_row_bytes - 8)


def send_all(c: ReceiverCore, peer: Peer, room_id: int, now: float) -> None:
    """Everything this rank's plan holds for the room, rows claimed and landed, then done."""
    room = c.room(peer.group, room_id)
    assert room.tracker is not None
    plan = room.tracker.plans[peer.rank]
    lo, hi = plan.kv_range
    for b in plan.kv_buffers:
        if hi > lo:
            msg = Data(room.tok, Kind.KV, b, lo, hi - lo)
            assert c.data_room(peer, msg, now) is room
            assert c.claim(room, peer, msg, now) is not None
            c.landed(room, (hi - lo) * LAYOUT.buffers[b].row_bytes, now)
    for b in plan.state_buffers:
        msg = Data(room.tok, Kind.STATE, b, 0, 1)
        assert c.claim(room, peer, msg, now) is not None
        c.landed(room, LAYOUT.buffers[b].row_bytes, now)
    if plan.aux:
        msg = Data(room.tok, Kind.AUX, AUX, 0, 1)
        assert c.aux_ok(room, peer, aux_row(room_id), now)
        assert c.claim(room, peer, msg, now) is not None
        c.landed(room, LAYOUT.aux_row_bytes, now)
    c.done(peer, Done(room.tok, peer.rank, 0, 0, 0), now)


# -- registration: the refusal table ----------------------------------------------------------

BAD_REGISTRATIONS = [
    ("split", dict(split="diagonal"), "bad_settings", "split mode must be one of pages, layers, rank0"),
    ("checksum", dict(checksum="md5"), "bad_settings", "checksum must be one of none, xxh3, crc32"),
    ("group name", dict(group="bad name!"), "bad_settings", "must be 1-64 letters"),
    ("rank", dict(rank=2, cp_size=2), "bad_rank", "rank 2 is outside cp_size 2"),
    ("fingerprint", dict(fingerprint="0123456789abcdef"), "layout",
     "layout fingerprint does not match the layout sent with it"),
    ("unreadable layout", dict(fingerprint="x", layout={"v": 1}), "layout", "unreadable layout"),
    ("frame limit", dict(max_message_bytes=128 << 20), "frame_limit", "exceed this receiver's max_frame_bytes"),
]


@pytest.mark.parametrize(("what", "fields", "code", "text"), BAD_REGISTRATIONS, ids=[r[0] for r in BAD_REGISTRATIONS])
def test_registration_refusals(what: str, fields: dict[str, object], code: str, text: str) -> None:
    c = core()
    msg = register_msg(**{"group": "g", "rank": 0, "cp": 2, **{k: v for k, v in fields.items() if k != "cp_size"}})
    if "cp_size" in fields:
        msg = register_msg("g", msg.rank, int(fields["cp_size"]))  # type: ignore[call-overload]
    assert c.register(b"x", msg, T0) is None
    acts = c.drain()
    assert refusals(acts) == [code]
    assert text in of(acts, Refuse)[0].reason
    (reply,) = of(acts, Send)
    assert isinstance(reply.msg, Registered) and not reply.msg.ok and text in reply.msg.reason
    assert not c.peers and not c.groups


def test_incompatible_layout_is_explained_after_the_fingerprint() -> None:
    other = ModelSpec(name="tiny", dtype="bf16", page_size=8, kv_layers=4, kv_format="mha", kv_token_elems=8,
                      state=(), aux_row_bytes=16).layout(64, 8, 4)
    c = core()
    assert c.register(b"x", register_msg(fingerprint=other.fingerprint(), layout=other.to_wire()), T0) is None
    (r,) = of(c.drain(), Refuse)
    assert r.code == "layout" and "incompatible layout: page_size differs" in r.reason


def test_a_matching_fingerprint_must_name_the_layout_sent_with_it() -> None:
    c = core()
    assert c.register(b"x", register_msg(layout={"garbage": True}), T0) is None
    (r,) = of(c.drain(), Refuse)
    assert r.code == "layout" and "unreadable layout" in r.reason


def test_inconsistent_group() -> None:
    c = core()
    join(c, 0, cp=2)
    c.drain()
    assert c.register(ident(1), register_msg(rank=1, cp=4), T0) is None
    (r,) = of(c.drain(), Refuse)
    assert r.code == "inconsistent_group" and "registered with cp_size 2" in r.reason


def test_a_configured_receiver_admits_only_its_groups_with_their_settings() -> None:
    """Issue 13 item 6: on an open receiver the first rank to register fixes a group's settings,
    so a squatter registering ``g`` with another cp_size locks the real group out; a receiver
    configured with receiver.groups refuses the squatter and admits the real group."""
    from transferd.types import SplitMode

    open_core = core()
    join(open_core, 0, cp=4, group="g")  # the squatter comes first
    open_core.drain()
    assert open_core.register(ident(0, inc=1), register_msg(rank=0, cp=2), T0) is None
    assert refusals(open_core.drain()) == ["inconsistent_group"]  # the real group is locked out
    c = core(admit={"g": (2, SplitMode.PAGES, True), "h": (1, SplitMode.LAYERS, False)})
    assert c.register(ident(0, inc=9), register_msg(rank=0, cp=4), T0) is None  # the squatter
    (r,) = of(c.drain(), Refuse)
    assert r.code == "inconsistent_group"
    assert r.reason == ("registration of g rank 0: group g is configured here with cp_size 2 split pages dedup on; "
                        "rank 0 says cp_size 4 split pages dedup on")
    assert c.register(b"stranger", register_msg(group="other", rank=0, cp=1), T0) is None
    (r,) = of(c.drain(), Refuse)
    assert r.code == "unknown_group" and "group other is not admitted here (receiver.groups names g, h)" in r.reason
    assert c.register(b"x", register_msg(group="h", rank=0, cp=1, split="layers"), T0) is None  # dedup differs
    assert refusals(c.drain()) == ["inconsistent_group"]
    p0, p1 = join(c, 0, cp=2), join(c, 1, cp=2)  # the real group
    assert c.groups["g"].ranks == {0: p0.ident, 1: p1.ident}
    assert isinstance(c.register(b"y", register_msg(group="h", rank=0, cp=1, split="layers", dedup=False), T0),
                      Admission)


def test_a_strangers_refused_registrations_are_answered_at_most_once_a_second() -> None:
    c = core()
    for i in range(10):  # ten in 0.9 s: one answer, ten refusals
        assert c.register(b"stranger", register_msg(rank=5, cp=2), T0 + i * 0.1) is None
    acts = c.drain()
    assert refusals(acts) == ["bad_rank"] * 10 and len(of(acts, Send)) == 1
    c.register(b"stranger", register_msg(rank=5, cp=2), T0 + 1.0)  # a second later: answered again
    assert len(of(c.drain(), Send)) == 1
    c.unregistered(b"stranger", "ping", T0 + 1.0)  # a nudge is another kind of answer: its own clock
    assert len(of(c.drain(), Send)) == 1
    p0 = join(c, 0)  # a registered peer's registrations are always answered
    c.drain()
    for i in range(3):
        c.register(p0.ident, register_msg(rank=0, cp=4), T0 + 2 + i * 0.1)
    assert len(of(c.drain(), Send)) == 3


def test_same_host_candidate_needs_the_same_boot_id_and_the_setting() -> None:
    assert core().register(b"x", register_msg(pool="p", boot_id="boot-a"), T0).same_host_pool == "p"  # type: ignore[union-attr]
    assert core().register(b"x", register_msg(pool="p", boot_id="boot-b"), T0).same_host_pool == ""  # type: ignore[union-attr]
    assert core(same_host=False).register(b"x", register_msg(pool="p", boot_id="boot-a"), T0).same_host_pool == ""  # type: ignore[union-attr]


def test_mooncake_is_agreed_when_both_sides_set_it_and_wins_over_same_host_and_stream() -> None:
    addrs = tuple(4096 * (i + 1) for i in range(len(LAYOUT.buffers)))
    msg = register_msg(pool="p", boot_id="boot-a", stream=True, te_session="h:1", te_addrs=addrs)
    c = core(stream_port=4000, mooncake=True)
    adm = c.register(b"a", msg, T0)
    assert isinstance(adm, Admission) and adm.te and adm.same_host_pool == ""
    peer = c.admit(adm, T0, same_host=False, stream_key=b"k" * 16, te=True)
    (reply,) = of(c.drain(), Send)
    assert reply.msg.te and not reply.msg.shm and reply.msg.stream_port == 0 and peer.te and not c.stream_keys
    # a repeated register keeps it
    assert c.register(b"a", msg, T0 + 1) is None
    (reply,) = of(c.drain(), Send)
    assert reply.msg.te
    # one side only: today's choice, with a warning
    c = core(stream_port=4000)
    adm = c.register(b"a", msg, T0)
    assert isinstance(adm, Admission) and not adm.te and adm.same_host_pool == "p"
    assert any("no engine" in n.text for n in of(c.drain(), Note))
    adm = core(mooncake=True).register(b"a", register_msg(), T0)
    assert isinstance(adm, Admission) and not adm.te


def test_nixl_is_agreed_only_by_a_receiver_that_reads_with_nixl() -> None:
    addrs = tuple(4096 * (i + 1) for i in range(len(LAYOUT.buffers)))
    offer = register_msg(pool="p", boot_id="boot-a", te_session="transferd-g-r0-1", te_addrs=addrs, nixl_md=b"md")
    adm = core(nixl=True).register(b"a", offer, T0)
    assert isinstance(adm, Admission) and adm.te and adm.same_host_pool == ""
    c = core(mooncake=True)  # a Mooncake receiver does not take a NIXL offer for its own: today's choice
    adm = c.register(b"a", offer, T0)
    assert isinstance(adm, Admission) and not adm.te and adm.same_host_pool == "p"
    assert any("offers NIXL reads" in n.text and 'is not "nixl"' in n.text for n in of(c.drain(), Note))
    mooncake_offer = register_msg(te_session="h:1", te_addrs=addrs)  # nor a NIXL receiver a Mooncake one
    adm = core(nixl=True).register(b"a", mooncake_offer, T0)
    assert isinstance(adm, Admission) and not adm.te


def test_mooncake_addresses_must_name_every_buffer() -> None:
    c = core(mooncake=True)
    assert c.register(b"a", register_msg(te_session="h:1", te_addrs=(4096,)), T0) is None
    (r,) = of(c.drain(), Refuse)
    assert r.code == "bad_settings" and f"te_addrs names 1 buffers, the layout has {len(LAYOUT.buffers)}" in r.reason


def test_a_stream_is_offered_only_when_asked_served_and_not_same_host() -> None:
    c = core(stream_port=4000)
    adm = c.register(b"a", register_msg(rank=0, stream=True), T0)
    assert adm is not None
    peer = c.admit(adm, T0, same_host=False, stream_key=b"k" * 16)
    (reply,) = of(c.drain(), Send)
    assert reply.msg.stream_port == 4000 and reply.msg.stream_key == b"k" * 16 and c.stream_keys == {b"k" * 16: b"a"}
    adm = c.register(b"b", register_msg(rank=1, stream=True), T0)
    assert adm is not None
    c.admit(adm, T0, same_host=True, stream_key=b"j" * 16)
    (reply,) = of(c.drain(), Send)
    assert reply.msg.shm and reply.msg.stream_port == 0 and b"j" * 16 not in c.stream_keys
    # the hello with the key opens the stream once; a second hello with it is refused
    assert c.stream_opened(b"k" * 16, "1.2.3.4:5") is peer and peer.streaming
    assert c.stream_opened(b"k" * 16, "1.2.3.4:6") is None
    assert refusals(c.drain()) == ["stream_key"]


# -- rooms: assignment, completion -----------------------------------------------------------

def test_a_room_is_assigned_to_every_rank_and_succeeds_once_all_rows_and_dones_arrive() -> None:
    c = core()
    p0, p1 = join(c, 0), join(c, 1)
    c.drain()
    assert c.expect(request(), T0).state is RoomState.WAITING
    acts = c.drain()
    assigns = of(acts, Send)
    assert [(s.ident, type(s.msg)) for s in assigns] == [(p0.ident, Assign), (p1.ident, Assign)]
    send_all(c, p0, 1, T0 + 1)
    assert c.room("g", 1).status.state is RoomState.TRANSFERRING
    send_all(c, p1, 1, T0 + 2)
    assert finished(c.drain()) == [("success", "")]
    assert c.room("g", 1).finished == T0 + 2


def test_expect_before_the_group_registers_assigns_on_registration() -> None:
    c = core()
    c.expect(request(), T0)
    assert c.room("g", 1).status.state is RoomState.BOOTSTRAPPING
    join(c, 0)
    assert c.room("g", 1).status.state is RoomState.BOOTSTRAPPING  # one of two ranks
    join(c, 1)
    assert c.room("g", 1).status.state is RoomState.WAITING
    assert len(of(c.drain(), Send)) == 4  # two registered answers, two assigns


def test_expect_refuses_a_held_room_and_bad_requests() -> None:
    c = core()
    c.expect(request(), T0)
    with pytest.raises(RoomExists):
        c.expect(request(), T0)
    with pytest.raises(BadRequest, match="destination page 64 outside the pool's 64 rows"):
        c.expect(RoomRequest(2, "g", (64,), 0, {}, 0), T0)
    with pytest.raises(UnknownRoom):
        c.room("g", 99)


# -- the verdict on data ---------------------------------------------------------------------

def test_data_verdicts() -> None:
    c = core()
    p0, _ = join(c, 0), join(c, 1)
    stranger = join(c, 0, group="h", cp=1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    c.drain()
    assert c.data_room(p0, Data(12345, Kind.KV, 0, 0, 1), T0) is None
    assert refusals(c.drain()) == ["unknown_room"]
    assert c.data_room(stranger, Data(room.tok, Kind.KV, 0, 0, 1), T0) is None
    assert refusals(c.drain()) == ["wrong_peer"]
    assert room.status.state is RoomState.WAITING  # a stranger cannot fail someone else's room
    # a kind that does not match the buffer fails the room
    assert c.data_room(p0, Data(room.tok, Kind.STATE, KV_BUFFERS[0], 0, 1), T0) is None
    acts = c.drain()
    assert refusals(acts) == ["unexpected"] and finished(acts) == [("failed", "unexpected")]
    # late frames after the end are dropped, never written
    assert c.data_room(p0, Data(room.tok, Kind.KV, 0, 0, 1), T0) is None
    assert of(c.drain(), Drop) == [Drop("room_not_live")]


@pytest.mark.parametrize(("what", "msg", "code"), [
    ("outside the plan", Data(0, Kind.KV, 0, 2, 1), "unexpected"),  # rank 0 owns positions [0, 2)
    ("state of another rank", Data(0, Kind.STATE, 8, 0, 1), None),
])
def test_claims_follow_the_plan(what: str, msg: Data, code: str | None) -> None:
    c = core()
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    c.drain()
    claimed = c.claim(room, p0, Data(room.tok, msg.kind, msg.buffer, msg.pos, msg.count), T0)
    if code is None:
        assert claimed == (1, None)  # rank 0 sends the replicated state: conv slot 1
        assert c.claim(room, p0, Data(room.tok, msg.kind, msg.buffer, msg.pos, msg.count), T0) is None
        assert finished(c.drain()) == [("failed", "duplicate")]
    else:
        assert claimed is None
        assert finished(c.drain()) == [("failed", code)]


def test_payload_length_checksum_and_aux_guard() -> None:
    c = core()
    p0, _ = join(c, 0, checksum="crc32"), join(c, 1, checksum="crc32")
    for i, (payload, csum, code) in enumerate([
        (b"x" * 3, None, "length_mismatch"),
        (b"x" * LAYOUT.buffers[0].row_bytes, None, "checksum"),
        (b"x" * LAYOUT.buffers[0].row_bytes, 1, "checksum"),
    ]):
        c.expect(request(room=10 + i), T0)
        room = c.room("g", 10 + i)
        c.drain()
        assert not c.payload_ok(room, p0, Data(room.tok, Kind.KV, 0, 0, 1, csum), payload, T0)
        assert finished(c.drain()) == [("failed", code)]
    c.expect(request(room=20), T0)
    room = c.room("g", 20)
    c.drain()
    assert not c.aux_ok(room, p0, aux_row(21), T0)
    acts = c.drain()
    assert finished(acts) == [("failed", "aux_guard")] and "carries room id 21, expected 20" in of(acts, Refuse)[0].reason


def test_done_rules() -> None:
    c = core()
    p0, p1 = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    c.drain()
    c.done(p0, Done(room.tok, 1, 0, 0, 0), T0)  # a done naming another rank
    assert refusals(c.drain()) == ["wrong_peer"]
    c.done(p0, Done(room.tok, 0, 0, 0, 0), T0)  # done with rows missing
    acts = c.drain()
    assert finished(acts) == [("failed", "incomplete")]
    assert "rank 0 reported done with" in of(acts, Finished)[0].status.reason
    c.done(p1, Done(room.tok, 1, 0, 0, 0), T0)
    assert of(c.drain(), Drop) == [Drop("done_not_live")]


def test_a_done_that_overtakes_a_straight_read_fails_the_room() -> None:
    c = core()
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    c.stream_read(room, 0, +1)
    c.done(p0, Done(room.tok, 0, 0, 0, 0), T0)
    acts = c.drain()
    assert finished(acts) == [("failed", "incomplete")]
    assert "still arriving on its data stream" in of(acts, Finished)[0].status.reason


def test_a_fail_from_an_assigned_rank_ends_the_room_with_its_code() -> None:
    c = core()
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    c.fail(p0, Fail(room.tok, "", "engine abort"), T0)
    (f,) = of(c.drain(), Finished)
    assert (f.status.code, f.status.reason) == ("prefill_failed", "prefill g rank 0: engine abort")


# -- abort is a barrier ---------------------------------------------------------------------

def test_abort_then_nothing_more_is_claimed_or_landed() -> None:
    c = core()
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    c.drain()
    assert c.abort("g", 1, "", T0 + 1).code == "aborted"
    assert finished(c.drain()) == [("failed", "aborted")]
    assert c.data_room(p0, Data(room.tok, Kind.KV, 0, 0, 1), T0 + 2) is None  # the frame that was in flight
    assert of(c.drain(), Drop) == [Drop("room_not_live")]
    assert c.release("g", 1, T0 + 3).code == "aborted" and not c.rooms and not c.by_tok
    assert c.drain() == []  # released after its end: no second Finished


def test_release_of_a_live_room_fails_it_first() -> None:
    c = core()
    c.expect(request(), T0)
    assert c.release("g", 1, T0).reason == "released by the decode engine before completion"
    assert finished(c.drain()) == [("failed", "aborted")]


# -- the three clocks -----------------------------------------------------------------------

def test_bootstrap_clock() -> None:
    c = core(heartbeat_misses=10_000)
    join(c, 0)
    c.expect(request(), T0)
    c.tick(T0 + 30.0)
    assert finished(c.drain()) == []
    c.tick(T0 + 30.01)
    (f,) = of(c.drain(), Finished)
    assert f.status.code == "bootstrap_timeout"
    assert f.status.reason == "prefill group g did not register all ranks within 30s (assigned: [0])"


def test_waiting_clock_starts_when_every_rank_is_assigned() -> None:
    c = core(heartbeat_misses=10_000)
    join(c, 0, T0)
    c.expect(request(), T0)
    join(c, 1, T0 + 5)
    c.tick(T0 + 605.0)
    assert finished(c.drain()) == []
    c.tick(T0 + 605.01)
    assert finished(c.drain()) == [("failed", "waiting_timeout")]


def test_stall_clock_resets_with_every_landed_row() -> None:
    c = core(heartbeat_misses=10_000)
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    for i, t in enumerate((T0 + 1, T0 + 9, T0 + 18)):
        assert c.claim(room, p0, Data(room.tok, Kind.KV, KV_BUFFERS[i], 0, 2), t) is not None
        c.landed(room, 2 * LAYOUT.buffers[KV_BUFFERS[i]].row_bytes, t)
        c.tick(t + 9.99)
        assert finished(c.drain()) == []
    c.tick(T0 + 28.01)
    (f,) = of(c.drain(), Finished)
    assert f.status.code == "stalled"
    assert f.status.reason == "no data for 10.0s; ranks not done: [0, 1] (and nothing from them for any room in 10s)"


def test_a_room_queued_behind_others_on_a_moving_connection_is_slowed_not_stalled() -> None:
    """The stall clock measures the connection: while a rank the room waits for keeps sending
    rows of other rooms (a slow receiver works through its queue), the room waits."""
    c = core(heartbeat_misses=10_000, waiting_timeout_s=100.0)
    p0, p1 = join(c, 0), join(c, 1)
    c.expect(request(1), T0)
    c.expect(request(2), T0)
    r1, r2 = c.room("g", 1), c.room("g", 2)
    first = Data(r1.tok, Kind.KV, KV_BUFFERS[0], 0, 2)
    assert c.data_room(p0, first, T0) is r1 and c.claim(r1, p0, first, T0) is not None
    c.landed(r1, 2 * LAYOUT.buffers[KV_BUFFERS[0]].row_bytes, T0)
    send_all(c, p1, 1, T0)  # rank 1 is done with room 1: only rank 0's connection matters
    for t in range(1, 30):  # rank 0 sends room 2's rows, one row a second, for 29 s
        msg = Data(r2.tok, Kind.KV, KV_BUFFERS[1], t % 2, 1)
        assert c.data_room(p0, msg, T0 + t) is r2
        c.tick(T0 + t + 0.5)
    assert finished(c.drain()) == []
    assert r1.status.state is RoomState.TRANSFERRING  # 29 s without its own progress: slowed
    c.tick(T0 + 29 + 10.01)  # then rank 0 stops sending anything
    acts = c.drain()
    assert [(f.room.req.room, f.status.code) for f in of(acts, Finished)] == [(1, "stalled")]
    assert r1.status.reason == ("no data for 39.0s; ranks not done: [0] (and nothing from them for any room in "
                                "10s)"), r1.status.reason


def test_a_room_starved_on_a_moving_connection_fails_at_the_waiting_timeout() -> None:
    c = core(heartbeat_misses=10_000, waiting_timeout_s=100.0)
    p0, p1 = join(c, 0), join(c, 1)
    c.expect(request(1), T0)
    c.expect(request(2, n=40), T0)
    r1, r2 = c.room("g", 1), c.room("g", 2)
    msg = Data(r1.tok, Kind.KV, KV_BUFFERS[0], 0, 1)
    assert c.data_room(p0, msg, T0) is r1 and c.claim(r1, p0, msg, T0) is not None
    c.landed(r1, LAYOUT.buffers[KV_BUFFERS[0]].row_bytes, T0)
    for t in range(1, 101):  # rank 0 (and rank 1) keep the connections moving with room 2's rows
        for p in (p0, p1):
            assert c.data_room(p, Data(r2.tok, Kind.KV, KV_BUFFERS[0], 0, 1), T0 + t) is r2
        c.tick(T0 + t + 0.5)
        if t < 100:
            assert finished(c.drain()) == [], t
    f, f2 = of(c.drain(), Finished)
    assert f.room is r1 and f.status.code == "stalled"
    assert f2.room is r2 and f2.status.code == "waiting_timeout"  # nothing of it ever accepted
    assert "ranks [0, 1] kept sending other rooms' rows, but none of this room's within waiting_timeout_s 100s" in \
        f.status.reason


def test_a_stream_stopped_inside_a_record_stalls_the_rooms_waiting_for_its_rank() -> None:
    """A straight read that starts is the room's progress (waiting -> transferring); a stream
    that then stops inside the record fails, at stall_timeout_s, every room still waiting for
    that rank, naming the stream; between records an idle stream is no fault."""
    c = core(heartbeat_misses=10_000)
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(1), T0)
    c.expect(request(2), T0)
    r1, r2 = c.room("g", 1), c.room("g", 2)
    send_all(c, p0, 2, T0)  # rank 0 is done with room 2
    c.drain()
    assert r1.status.state is RoomState.WAITING
    c.stream_read(r1, 0, +1, T0 + 1)
    assert r1.status.state is RoomState.TRANSFERRING and r1.last_progress == T0 + 1
    assert not c.stream_idle(p0, 50.0, "", T0 + 51)  # between records: heartbeats decide
    assert not c.stream_idle(p0, 10.0, "the payload of a record (4096 of 8192 bytes)", T0 + 11)
    assert c.drain() == []
    assert c.stream_idle(p0, 10.01, "the payload of a record (4096 of 8192 bytes)", T0 + 11.01)
    acts = c.drain()
    assert [(f.room.req.room, f.status.code) for f in of(acts, Finished)] == [(1, "stalled")]
    assert r1.status.reason == ("the data stream of prefill g rank 0 (pid 1 on h) stalled: no byte for 10.0s inside "
                                "the payload of a record (4096 of 8192 bytes)")
    assert not r2.status.state.terminal  # it waits for rank 1 only


# -- peers: heartbeats, restarts, epochs -----------------------------------------------------

def test_heartbeats_pings_and_peer_loss() -> None:
    c = core()
    p0, p1 = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    c.drain()
    c.tick(T0 + 0.5)  # odd tick: no ping
    assert of(c.drain(), Send) == []
    c.tick(T0 + 1.0)
    assert sorted((s.ident, s.msg) for s in of(c.drain(), Send)) == [(p0.ident, Ping(2)), (p1.ident, Ping(2))]
    assert c.seen(p1.ident, T0 + 2.5) is p1
    c.tick(T0 + 3.01)  # rank 0 silent for more than interval × misses
    acts = c.drain()
    (gone,) = of(acts, PeerClosed)
    assert gone.peer is p0 and gone.heartbeat and "missed heartbeats for 3.0s" in gone.reason
    assert finished(acts) == [("failed", "peer_lost")]
    assert p0.ident not in c.peers and c.groups["g"].ranks == {1: p1.ident}


def test_a_restarted_rank_fails_the_rooms_of_its_old_incarnation() -> None:
    c = core()
    old, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    c.drain()
    new = join(c, 0, inc=1)  # a new identity for the same place
    acts = c.drain()
    assert [g.peer for g in of(acts, PeerClosed)] == [old]
    (f,) = of(acts, Finished)
    assert f.status.code == "peer_restarted" and "(incarnation 100 -> 101)" in f.status.reason
    assert c.groups["g"].ranks[0] == new.ident
    assert any(isinstance(a, Note) and "restarted" in a.text for a in acts)


def test_a_repeated_register_keeps_the_registration_and_a_higher_epoch_replaces_it() -> None:
    c = core()
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    c.drain()
    assert c.register(p0.ident, register_msg(rank=0, epoch=0), T0 + 1) is None  # repeated: answered at once
    acts = c.drain()
    assert [type(s.msg) for s in of(acts, Send)] == [Registered] and not of(acts, Finished)
    assert c.peers[p0.ident] is p0 and p0.last_seen == T0 + 1
    adm = c.register(p0.ident, register_msg(rank=0, epoch=1), T0 + 2)
    assert adm is not None
    c.admit(adm, T0 + 2, same_host=False, stream_key=b"")
    acts = c.drain()
    (f,) = of(acts, Finished)
    assert f.status.code == "peer_lost" and "lost its connection to this receiver" in f.status.reason
    assert c.peers[p0.ident] is not p0 and c.peers[p0.ident].epoch == 1


def test_an_identity_that_moves_to_another_place_leaves_its_old_one() -> None:
    c = core()
    p0 = join(c, 0, cp=1)
    c.drain()
    adm = c.register(p0.ident, register_msg("h", 0, 1), T0)
    assert adm is not None
    acts = c.drain()
    (gone,) = of(acts, PeerClosed)
    assert gone.peer is p0 and "registered again as h rank 0" in gone.reason and not gone.heartbeat
    assert "g" not in c.groups


def test_an_unknown_peer_is_nudged_at_most_once_a_second() -> None:
    c = core()
    c.unregistered(b"z", "data", T0)
    c.unregistered(b"z", "data", T0 + 0.5)
    c.unregistered(b"z", "data", T0 + 1.0)
    acts = c.drain()
    assert refusals(acts) == ["unregistered"] * 3
    nudges = [s.msg for s in of(acts, Send)]
    assert len(nudges) == 2 and all(m.retry and not m.ok for m in nudges)


def test_a_broken_stream_loses_its_peer() -> None:
    c = core(stream_port=4000)
    adm = c.register(b"a", register_msg(rank=0, cp=1, stream=True), T0)
    assert adm is not None
    peer = c.admit(adm, T0, same_host=False, stream_key=b"k" * 16)
    c.expect(request(), T0)
    assert c.stream_opened(b"k" * 16, "addr") is peer
    c.drain()
    c.stream_closed(peer, "data stream from addr closed in mid-message", T0 + 1)
    acts = c.drain()
    (f,) = of(acts, Finished)
    assert f.status.code == "peer_lost" and f.status.reason.endswith("data stream from addr closed in mid-message")
    assert not of(acts, PeerClosed)[0].heartbeat


def test_shutdown_fails_every_live_room() -> None:
    c = core()
    c.expect(request(1), T0)
    c.expect(request(2), T0)
    c.shutdown(T0)
    assert finished(c.drain()) == [("failed", "shutdown")] * 2


def test_same_host_refs_are_refused_without_the_plane_by_the_shell_not_the_core() -> None:
    # the core has no notion of where bytes come from: a DataRefs header gets the same
    # room checks as data (the shell refuses no_shm when the peer has no same-host plane)
    c = core()
    p0, _ = join(c, 0), join(c, 1)
    c.expect(request(), T0)
    room = c.room("g", 1)
    assert c.data_room(p0, DataRefs(room.tok, Kind.KV, 0, 0, 1), T0) is room
