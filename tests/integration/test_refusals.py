"""Bad input from engines and peers is refused with a reason that names the problem, and
nothing outside the intended rows is written."""

from __future__ import annotations

import numpy as np
import pytest

from transferd.errors import BadRequest, IndexOutOfRange, RoomExists, UnknownRoom
from transferd.protocol.room import RoomState

from .harness import MODEL, Cluster, fill_random, write_guard
from .rooms import expect, make_room, mismatches, submit_all


def test_incompatible_layout_is_refused_with_the_difference(cluster: Cluster) -> None:
    ep, dc, _ = cluster.receiver()
    other = dict(MODEL, kv_token_elems=32)
    pcs, _ = cluster.group("prefill0", 1, [ep], model=other, wait=False)
    st = cluster.until(lambda: (s := pcs[0].status()["receivers"][0])["state"] == "refused" and s, "refusal")
    assert "incompatible layout" in st["reason"] and "row_bytes" in st["reason"], st["reason"]
    assert "kv.k.L0" in st["reason"]
    assert dc.stats()["refused"] == {"layout": 1}
    assert dc.status()["groups"] == {}


def test_inconsistent_group_settings_are_refused(cluster: Cluster) -> None:
    ep, dc, _ = cluster.receiver()
    cluster.group("prefill0", 2, [ep])
    # a third agent claims the same group with another cp_size
    pcs, _ = cluster.group("prefill0", 3, [ep], wait=False, ranks=[2], pool=f"{cluster.tag}-other-r{{rank}}")
    st = cluster.until(lambda: (s := pcs[0].status()["receivers"][0])["state"] == "refused" and s, "refusal")
    assert "cp_size 2" in st["reason"] and "cp_size 3" in st["reason"]


@pytest.mark.parametrize("configured", [False, True], ids=["open", "receiver.groups"])
def test_a_group_squatter_locks_out_an_open_receiver_not_a_configured_one(cluster: Cluster,
                                                                          configured: bool) -> None:
    """Issue 13 item 6: a peer that registers ``prefill0`` first with another cp_size fixes the
    group's settings on an open receiver, locking the real group out; a receiver whose
    configuration names its groups refuses the squatter and serves the real group."""
    ep, dc, dpool = cluster.receiver(**({"groups": ["prefill0:2"]} if configured else {}))
    squat, _ = cluster.group("prefill0", 3, [ep], wait=False, ranks=[2], pool=f"{cluster.tag}-squat-r{{rank}}")
    st = cluster.until(lambda: (s := squat[0].status()["receivers"][0])["state"] in ("registered", "refused") and s,
                       "the squatter's registration to be answered")
    if not configured:
        assert st["state"] == "registered"
        pcs, _ = cluster.group("prefill0", 2, [ep], wait=False)
        st = cluster.until(lambda: (s := pcs[0].status()["receivers"][0])["state"] == "refused" and s, "lock-out")
        assert "cp_size 3" in st["reason"] and "cp_size 2" in st["reason"], st["reason"]
        return
    assert st["state"] == "refused" and "configured here with cp_size 2" in st["reason"], st
    assert dc.stats()["refused"] == {"inconsistent_group": 1}
    pcs, spools = cluster.group("prefill0", 2, [ep])
    for i, p in enumerate(spools):
        fill_random(p, 60 + i)
    r = make_room(90, "prefill0", 9, 2, spools=spools)
    before = [rows.copy() for rows in dpool.rows]
    expect(dc, r)
    submit_all(pcs, r)
    assert dc.wait(r.room, "prefill0", 30).state is RoomState.SUCCESS
    assert mismatches(r, dpool, spools, "pages", before) == 0
    stranger, _ = cluster.group("elsewhere", 1, [ep], wait=False, pool=f"{cluster.tag}-else-r{{rank}}")
    st = cluster.until(lambda: (s := stranger[0].status()["receivers"][0])["state"] == "refused" and s, "refusal")
    assert "group elsewhere is not admitted here (receiver.groups names prefill0)" in st["reason"], st
    assert dc.stats()["refused"] == {"inconsistent_group": 1, "unknown_group": 1}


def test_engine_requests_are_validated_before_anything_moves(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(kv_pages=64)
    pcs, spools = cluster.group("prefill0", 1, [ep], kv_pages=64)
    fill_random(dpool, 5)
    before = [rows.copy() for rows in dpool.rows]
    with pytest.raises(BadRequest, match="destination page 64 outside the pool's 64 rows"):
        dc.expect(1, "prefill0", [1, 2, 64], aux_slot=0)
    with pytest.raises(BadRequest, match="destination page 2 listed twice"):
        dc.expect(1, "prefill0", [1, 2, 2], aux_slot=0)
    with pytest.raises(BadRequest, match="unknown state component 'nope'"):
        dc.expect(1, "prefill0", [1], aux_slot=0, state={"nope": [1]})
    with pytest.raises(BadRequest, match="aux slot 99 outside"):
        dc.expect(1, "prefill0", [1], aux_slot=99)
    with pytest.raises(BadRequest, match="prefix_pages 4 outside"):
        dc.expect(1, "prefill0", [1, 2], aux_slot=0, prefix_pages=4)
    with pytest.raises(BadRequest, match="room must be an unsigned 64-bit integer"):
        dc.call("expect", room=-1, group="prefill0", dst_pages=[1], aux_slot=0)
    with pytest.raises(BadRequest, match="unknown op 'explode'"):
        dc.call("explode")
    with pytest.raises(UnknownRoom):
        dc.poll(12345, "prefill0")
    dc.expect(1, "prefill0", [1, 2, 3], aux_slot=0)
    with pytest.raises(RoomExists, match="still held"):
        dc.expect(1, "prefill0", [4, 5, 6], aux_slot=1)
    with pytest.raises(IndexOutOfRange, match="source page 64 outside"):
        pcs[0].submit(1, 0, [0, 64])
    with pytest.raises(BadRequest, match="listed twice"):
        pcs[0].submit(1, 0, [3, 3])
    with pytest.raises(BadRequest, match="chunk starts at page position 2, expected 0"):
        pcs[0].submit(1, 2, [3])
    with pytest.raises(BadRequest, match="does not fit the room's 3 pages"):
        pcs[0].submit(1, 0, [1, 2, 3, 4])
    with pytest.raises(IndexOutOfRange, match="conv state slot 32 outside"):
        pcs[0].submit(1, 0, [1, 2, 3], last=True, state={"conv": [32]}, aux_slot=0)
    # none of that moved a byte, and the room is still usable
    for b, rows in enumerate(dpool.rows):
        assert np.array_equal(rows, before[b])
    assert dc.poll(1, "prefill0").state is RoomState.WAITING
    # every refused engine request is counted by its code (and so visible in the metrics)
    assert dc.stats()["refused"] == {"engine_bad_request": 6, "engine_unknown_op": 1, "engine_unknown_room": 1,
                                     "engine_room_exists": 1}
    assert pcs[0].stats()["refused"] == {"engine_index_out_of_range": 2, "engine_bad_request": 3}
    dc.release(1, "prefill0")


def test_aux_guard_mismatch_fails_the_room_and_writes_no_aux(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 2, [ep])
    fill_random(dpool, 1)
    r = make_room(77, "prefill0", 6, 2, slot=3, spools=spools)
    write_guard(spools[0], r.aux_src[0], 78)  # rank 0's engine put another request's row in the slot
    aux_before = dpool.rows[dpool.layout.aux_index][r.aux_dst].copy()
    expect(dc, r)
    # rank 1 first: the room may fail as soon as rank 0's aux row arrives, and a rank that learns
    # of the end before its engine submits refuses the late chunk (correctly)
    for rank in (1, 0):
        pcs[rank].submit(r.room, 0, r.src[rank], last=True, state=r.state_src[rank], aux_slot=r.aux_src[rank])
    st = dc.wait(r.room, r.group, 20)
    assert st.state is RoomState.FAILED and st.code == "aux_guard"
    assert "room id 78, expected 77" in st.reason
    assert [pc.wait(r.room, 20).code for pc in pcs] == ["aux_guard"] * 2
    assert np.array_equal(dpool.rows[dpool.layout.aux_index][r.aux_dst], aux_before)
    assert dc.stats()["refused"] == {"aux_guard": 1}


def test_decode_abort_is_a_barrier(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 2, [ep])
    fill_random(dpool, 4)
    r = make_room(5, "prefill0", 10, 2, chunks=[(0, 5), (5, 10)], spools=spools)
    expect(dc, r)
    for rank, pc in enumerate(pcs):
        pc.submit(r.room, 0, r.src[rank][0:5])
    st = dc.abort(r.room, r.group, "client went away")
    assert st.state is RoomState.FAILED and st.code == "aborted" and "client went away" in st.reason
    after_abort = [rows.copy() for rows in dpool.rows]
    # the prefill side learns of it; whatever it still sends is dropped, never written
    for rank, pc in enumerate(pcs):
        try:
            pc.submit(r.room, 5, r.src[rank][5:10], last=True, state=r.state_src[rank], aux_slot=r.aux_src[rank])
        except BadRequest as exc:
            assert "already ended" in str(exc)
    assert [pc.wait(r.room, 20).code for pc in pcs] == ["aborted"] * 2
    dc.ping()  # a round trip through the receiver's loop after the senders' last frames
    for b, rows in enumerate(dpool.rows):
        assert np.array_equal(rows, after_abort[b])
    dc.release(r.room, r.group)


def test_prefill_abort_reaches_decode_at_once(cluster: Cluster) -> None:
    ep, dc, _ = cluster.receiver(heartbeat_interval_s=30.0)
    pcs, spools = cluster.group("prefill0", 2, [ep])
    r = make_room(11, "prefill0", 8, 2, spools=spools)
    expect(dc, r)
    pcs[0].submit(r.room, 0, r.src[0][:4])
    pcs[1].abort(r.room, "engine ran out of memory")
    # heartbeats are 30 s apart: only the fail message can end this wait in time
    st = dc.wait(r.room, r.group, 10)
    assert st.state is RoomState.FAILED and st.code == "aborted"
    assert "prefill prefill0 rank 1" in st.reason and "out of memory" in st.reason
    assert pcs[0].wait(r.room, 10).state is RoomState.FAILED


def test_release_of_a_live_room_aborts_it_and_allows_reuse(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 1, [ep])
    r = make_room(3, "prefill0", 4, 1, spools=spools)
    expect(dc, r)
    st = dc.release(r.room, r.group)
    assert st.state is RoomState.FAILED and st.code == "aborted"
    with pytest.raises(UnknownRoom):
        dc.poll(r.room, r.group)

    def heard() -> bool:  # the engine never submitted: the sender knows the room from its assign only
        try:
            pcs[0].poll(r.room)
            return True
        except UnknownRoom:
            return False
    cluster.until(heard, "the sender to hear of the room (its assign, then the release)")
    assert pcs[0].wait(r.room, 10).state is RoomState.FAILED


def test_prefill_abort_after_frames_left_ends_only_when_the_receiver_answers(cluster: Cluster) -> None:
    """Frames go out zero-copy and may still read the pool after abort returns: the room ends on
    the prefill side only once the receiver has seen the abort (after every frame of the room),
    so an engine that waits for the end before reusing its pages is safe."""
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 1, [ep])
    r = make_room(12, "prefill0", 8, 1, chunks=[(0, 4), (4, 8)], spools=spools)
    expect(dc, r)
    pcs[0].submit(r.room, 0, r.src[0][:4])
    cluster.until(lambda: dc.poll(r.room, r.group).state is RoomState.TRANSFERRING, "the first chunk to arrive")
    st = pcs[0].abort(r.room, "engine preempted the request")
    assert st.state is not RoomState.SUCCESS
    with pytest.raises(BadRequest, match="is ending|already ended"):
        pcs[0].submit(r.room, 4, r.src[0][4:], last=True, state=r.state_src[0], aux_slot=r.aux_src[0])
    end = pcs[0].wait(r.room, 10)
    assert end.state is RoomState.FAILED and end.code == "aborted" and "preempted" in end.reason
    dst = dc.wait(r.room, r.group, 10)
    assert dst.state is RoomState.FAILED and dst.code == "aborted" and "preempted" in dst.reason


def test_a_rank_with_another_dedup_setting_is_refused(cluster: Cluster) -> None:
    ep, dc, _ = cluster.receiver()
    cluster.group("prefill0", 2, [ep], ranks=[0])
    pcs, _ = cluster.group("prefill0", 2, [ep], wait=False, ranks=[1], dedup=False)
    st = cluster.until(lambda: (s := pcs[0].status()["receivers"][0])["state"] == "refused" and s, "refusal")
    assert "dedup on" in st["reason"] and "dedup off" in st["reason"]
    assert dc.stats()["refused"] == {"inconsistent_group": 1}
