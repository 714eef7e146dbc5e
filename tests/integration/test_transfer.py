"""End-to-end transfers through real daemon processes over loopback TCP, byte-exact, with exact
wire accounting."""

from __future__ import annotations

import os

import numpy as np
import pytest

from transferd.errors import BadRequest, UnknownRoom
from transferd.protocol.room import RoomState

from .harness import MODEL, Cluster, fill_random
from .rooms import expect, land, make_room, mismatches, state_copy_bytes, submit_all


def _sum_bytes(pcs, kind: str) -> int:
    return sum(pc.stats()["bytes"][kind] for pc in pcs)


@pytest.mark.planes
def test_chunked_room_with_prefix_and_empty_last_chunk(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 2, [ep])
    for i, p in enumerate(spools):
        fill_random(p, i + 1)
    fill_random(dpool, 99)
    before = [rows.copy() for rows in dpool.rows]
    # 12 pages, decode already holds 5, three chunks, the last one carrying only state and aux
    r = make_room(7, "prefill0", 12, 2, prefix=5, chunks=[(0, 4), (4, 12), (12, 12)], dst_start=40, spools=spools)
    expect(dc, r)
    submit_all(pcs, r)
    st = dc.wait(r.room, r.group, 20)
    assert st.state is RoomState.SUCCESS, st
    assert [pc.wait(r.room, 20).state for pc in pcs] == [RoomState.SUCCESS] * 2
    assert mismatches(r, dpool, spools, "pages", before) == 0
    # every other row of the decode pool is untouched
    touched = {b: set() for b in range(len(dpool.rows))}
    for b in dpool.layout.indices("kv"):
        touched[b] = set(r.dst[r.prefix:].tolist())
    for b in dpool.layout.indices("state"):
        touched[b] = {r.state_dst[dpool.layout.buffers[b].component][0]}
    touched[dpool.layout.aux_index] = {r.aux_dst}
    for b, rows in enumerate(dpool.rows):
        keep = np.array([i not in touched[b] for i in range(rows.shape[0])])
        assert np.array_equal(rows[keep], before[b][keep]), f"buffer {b} changed outside the room"
    # wire accounting: KV is exactly the 7 non-prefix pages, state one copy, the de-dup saved one
    layout = dpool.layout
    copy = state_copy_bytes(dpool)
    assert _sum_bytes(pcs, "kv") == 7 * layout.kv_page_bytes()
    assert _sum_bytes(pcs, "state") == copy
    assert _sum_bytes(pcs, "aux") == layout.aux_row_bytes
    assert pcs[0].stats()["state_bytes_skipped"] == 0
    assert pcs[1].stats()["state_bytes_skipped"] == copy
    # pages 0..5 belong to rank 0, 6..11 to rank 1: rank 0 sends only position 5
    assert pcs[0].stats()["bytes"]["kv"] == 1 * layout.kv_page_bytes()
    assert dc.stats()["bytes"] == {"kv": 7 * layout.kv_page_bytes(), "state": copy, "aux": layout.aux_row_bytes}
    cluster.check_plane(dc.stats())
    for pc in pcs:
        cluster.check_plane(pc.stats())
    dc.release(r.room, r.group)


@pytest.mark.planes
def test_many_rooms_two_groups_one_receiver(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(kv_pages=1024)
    groups = {"pa": 2, "pb": 3}
    made = {g: cluster.group(g, cp, [ep]) for g, cp in groups.items()}
    seed = 1
    for pcs, spools in made.values():
        for p in spools:
            fill_random(p, seed)
            seed += 1
    fill_random(dpool, 0)
    before = [rows.copy() for rows in dpool.rows]
    rooms = []
    per_group = 10
    for gi, (g, cp) in enumerate(groups.items()):
        pcs, spools = made[g]
        for i in range(per_group):
            k = gi * per_group + i
            rooms.append(make_room(1000 + i, g, 9 + i % 4, cp, prefix=i % 3, chunks=None, dst_start=k * 16,
                                   src_start=i * 16, slot=k, spools=spools))
    # all expected first, then every chunk of every room: all rooms are in flight at once
    for r in rooms:
        expect(dc, r)
    for r in rooms:
        n = r.n
        r.chunks = [(0, n // 2), (n // 2, n)]
        submit_all(made[r.group][0], r)
    for r in rooms:
        assert dc.wait(r.room, r.group, 30).state is RoomState.SUCCESS
    for r in rooms:
        spools = made[r.group][1]
        assert mismatches(r, dpool, spools, "pages", before) == 0, f"room {r.group}/{r.room}"
    copy = state_copy_bytes(dpool)
    for g, cp in groups.items():
        pcs = made[g][0]
        assert _sum_bytes(pcs, "state") == per_group * copy, g
        assert sum(pc.stats()["state_bytes_skipped"] for pc in pcs) == per_group * (cp - 1) * copy, g
    rx = dc.stats()
    assert rx["rooms"] == {"success": len(rooms)} and not rx["refused"]
    assert rx["bytes"]["state"] == len(rooms) * copy
    cluster.check_plane(rx)


@pytest.mark.planes
def test_one_group_serves_two_receivers(cluster: Cluster) -> None:
    ep1, dc1, pool1 = cluster.receiver("decode1")
    ep2, dc2, pool2 = cluster.receiver("decode2")
    pcs, spools = cluster.group("prefill0", 2, [ep1, ep2])
    for i, p in enumerate(spools):
        fill_random(p, 10 + i)
    fill_random(pool1, 1)
    fill_random(pool2, 2)
    before = {id(pool1): [r.copy() for r in pool1.rows], id(pool2): [r.copy() for r in pool2.rows]}
    placed = []
    for i in range(8):
        dc, pool = (dc1, pool1) if i % 2 == 0 else (dc2, pool2)
        r = make_room(500 + i, "prefill0", 10, 2, prefix=i % 2, dst_start=i * 12, src_start=i * 12, slot=i,
                      spools=spools)
        expect(dc, r)
        placed.append((r, dc, pool))
    for r, _, _ in placed:
        submit_all(pcs, r)
    for r, dc, pool in placed:
        assert dc.wait(r.room, r.group, 30).state is RoomState.SUCCESS
        assert mismatches(r, pool, spools, "pages", before[id(pool)]) == 0
    assert dc1.stats()["rooms"] == {"success": 4} and dc2.stats()["rooms"] == {"success": 4}
    # a sender hears of a room's end from its receiver right after the decode engine does (the
    # status may still be on its way when the decode side's wait returns)
    assert [pc.wait(r.room, 10).state for r, _, _ in placed for pc in pcs] == [RoomState.SUCCESS] * 16
    assert [pc.stats()["rooms"] for pc in pcs] == [{"success": 8}] * 2
    cluster.check_plane(dc1.stats())
    cluster.check_plane(dc2.stats())


@pytest.mark.planes
@pytest.mark.parametrize("split", ["layers", "rank0"])
def test_split_modes_cp4(cluster: Cluster, split: str) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 4, [ep], split=split)
    for i, p in enumerate(spools):
        fill_random(p, 20 + i)
    fill_random(dpool, 3)
    before = [rows.copy() for rows in dpool.rows]
    r = make_room(9, "prefill0", 11, 4, prefix=2, chunks=[(0, 5), (5, 11)], dst_start=3, spools=spools)
    expect(dc, r)
    submit_all(pcs, r)
    assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    assert mismatches(r, dpool, spools, split, before) == 0
    cluster.check_plane(dc.stats())
    copy = state_copy_bytes(dpool)
    assert _sum_bytes(pcs, "state") == copy
    skipped = sum(pc.stats()["state_bytes_skipped"] for pc in pcs)
    assert skipped == (0 if split == "layers" else 3 * copy)
    kv_by_rank = [pc.stats()["bytes"]["kv"] for pc in pcs]
    assert sum(kv_by_rank) == 9 * dpool.layout.kv_page_bytes()
    if split == "rank0":
        assert kv_by_rank[1:] == [0, 0, 0]
    else:  # 3 KV layers over 4 ranks: ranks 0..2 own one layer each, rank 3 none
        assert kv_by_rank[3] == 0 and kv_by_rank[0] == kv_by_rank[1] == kv_by_rank[2] > 0


def test_same_host_path_is_byte_exact_and_keeps_the_abort_barrier(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 2, [ep], same_host="auto")
    assert all(pc.stats()["shm_bytes"] == 0 for pc in pcs)
    for i, p in enumerate(spools):
        fill_random(p, 30 + i)
    fill_random(dpool, 31)
    before = [rows.copy() for rows in dpool.rows]
    r = make_room(80, "prefill0", 12, 2, prefix=3, chunks=[(0, 6), (6, 12)], spools=spools)
    expect(dc, r)
    submit_all(pcs, r)
    assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    assert mismatches(r, dpool, spools, "pages", before) == 0
    rx = dc.stats()
    moved = sum(rx["bytes"].values())
    assert rx["shm_bytes"] == moved == sum(sum(pc.stats()["bytes"].values()) for pc in pcs) > 0
    dc.release(r.room, r.group)
    # abort mid-room: the receiver does the copy, so nothing lands after abort returns
    r2 = make_room(81, "prefill0", 10, 2, chunks=[(0, 5), (5, 10)], dst_start=100, slot=6, spools=spools)
    expect(dc, r2)
    for rank, pc in enumerate(pcs):
        pc.submit(r2.room, 0, r2.src[rank][:5])
    dc.abort(r2.room, r2.group, "stop")
    after = [rows.copy() for rows in dpool.rows]
    for rank, pc in enumerate(pcs):
        try:
            pc.submit(r2.room, 5, r2.src[rank][5:], last=True, state=r2.state_src[rank], aux_slot=r2.aux_src[rank])
        except Exception as exc:  # the room may already have ended on that rank
            assert "already ended" in str(exc)
    assert [pc.wait(r2.room, 10).code for pc in pcs] == ["aborted"] * 2
    dc.ping()
    assert all(np.array_equal(a, b) for a, b in zip(after, dpool.rows))


BIG_ROWS = {**MODEL, "kv_token_elems": 32768}  # 256 KiB KV pages: 40 of them are 10 MiB a layer


@pytest.mark.parametrize("cp", [1, 3])
def test_same_host_messages_read_by_several_threads_land_byte_exact(cluster: Cluster, cp: int) -> None:
    """Messages of >= 256 KiB are cut into jobs of 8 MiB (across broken runs) that the receiver's
    threads read; every byte lands once, and abort answers only after the jobs of its room have
    settled: after it, the decode pool does not change."""
    ep, dc, dpool = cluster.receiver(model=BIG_ROWS, kv_pages=200, same_host_read_threads=3)
    pcs, spools = cluster.group("prefill0", cp, [ep], same_host="auto", model=BIG_ROWS, kv_pages=128)
    for i, p in enumerate(spools):
        fill_random(p, 40 + i)
    fill_random(dpool, 41)
    before = [rows.copy() for rows in dpool.rows]
    batches0 = dc.stats()["same_host_reads"]["batches"]
    r = make_room(90, "prefill0", 40 * cp, cp, prefix=3, chunks=[(0, 40 * cp)], spools=spools)
    assert land(dc, pcs, r, dpool, spools, before) == 0
    rx = dc.stats()
    assert rx["shm_bytes"] == sum(rx["bytes"].values()) > 0
    reads = rx["same_host_reads"]
    assert reads["copy"] == "process_vm_readv" and reads["failed"] == 0
    # every rank's 3 KV layers of about 10 MiB: two jobs each (the rank holding the prefix, one less page)
    assert reads["batches"] - batches0 >= 2 * 3 * cp
    dc.release(r.room, r.group)
    # aborted while their jobs are queued or running: nothing lands once abort has answered
    rooms = [make_room(91 + k, "prefill0", 25, cp, chunks=[(0, 25)], dst_start=120 + 25 * k, slot=4 + 3 * k,
                       spools=spools) for k in range(3)]
    for rr in rooms:
        expect(dc, rr)
    for rr in rooms:
        submit_all(pcs, rr)
    for rr in rooms:
        dc.abort(rr.room, rr.group, "stop")
    after = [rows.copy() for rows in dpool.rows]
    for rr in rooms:
        assert all(pc.wait(rr.room, 10).state.terminal for pc in pcs)
    dc.ping()
    assert all(np.array_equal(a, b) for a, b in zip(after, dpool.rows))


def test_a_pool_truncated_under_threaded_reads_fails_its_rooms_and_not_the_receiver(cluster: Cluster) -> None:
    """The receiver's threads read large messages out of a read-only mapping of the sender's
    pool file with process_vm_readv; the test truncates that file while rooms are being read.
    The copy comes back short (never SIGBUS in the receiver), the rooms fail ``no_shm``, and a
    same-host room of another group then lands byte-exact."""
    from transferd.pool.shm import pool_path

    ep, dc, dpool = cluster.receiver(model=BIG_ROWS, kv_pages=200)
    pcs, spools = cluster.group("prefill0", 1, [ep], same_host="auto", model=BIG_ROWS, kv_pages=128)
    fill_random(spools[0], 50)
    rooms = [make_room(120 + k, "prefill0", 40, 1, chunks=[(0, 40)], dst_start=40 * k, slot=4 + 3 * k,
                       spools=spools) for k in range(4)]
    for rr in rooms:
        expect(dc, rr)
    for rr in rooms:
        submit_all(pcs, rr)
    os.truncate(pool_path(spools[0].name), 4096)  # while the rooms' 10 MiB messages are read
    states = [dc.wait(rr.room, rr.group, 20) for rr in rooms]
    assert all(st.state.terminal for st in states)
    failed = [st for st in states if st.state is RoomState.FAILED]
    assert failed and all(st.code == "no_shm" and "shrank" in st.reason for st in failed), failed
    assert dc.ping()
    pcs2, spools2 = cluster.group("prefill1", 1, [ep], same_host="auto", model=BIG_ROWS, kv_pages=128)
    fill_random(spools2[0], 51)
    fill_random(dpool, 52)
    before = [rows.copy() for rows in dpool.rows]
    r = make_room(130, "prefill1", 40, 1, chunks=[(0, 40)], dst_start=160, slot=20, spools=spools2)
    expect(dc, r)
    submit_all(pcs2, r)
    assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    assert mismatches(r, dpool, spools2, "pages", before) == 0


@pytest.mark.parametrize("model", [MODEL, BIG_ROWS], ids=["small-rows-on-the-loop", "big-rows-on-threads"])
def test_sealed_pools_are_copied_out_of_a_mapping_byte_exact_and_cannot_be_shrunk(cluster: Cluster,
                                                                                 model: dict) -> None:
    """Senders with ``sealed_pool``: their pools are memfds sealed against shrinking, and the
    receiver, seeing the seal on its own descriptor, copies rows out of its mapping in user
    space (small messages and the aux row on the loop, large ones on its threads). Every byte
    lands; the sender cannot shrink its pool; a hole it punches reads as zeros in the next room
    and the receiver carries on."""
    import ctypes

    from transferd.pool.shm import pool_path

    big = model is BIG_ROWS
    ep, dc, dpool = cluster.receiver(model=model, kv_pages=200)
    pcs, spools = cluster.group("prefill0", 2, [ep], same_host="auto", sealed_pool=True, model=model, kv_pages=128)
    assert all(p.sealed for p in spools)
    for i, p in enumerate(spools):
        fill_random(p, 60 + i)
    fill_random(dpool, 61)
    before = [rows.copy() for rows in dpool.rows]
    n = 80 if big else 12
    r = make_room(140, "prefill0", n, 2, prefix=3, chunks=[(0, n // 2), (n // 2, n)], spools=spools)
    assert land(dc, pcs, r, dpool, spools, before) == 0
    rx = dc.stats()
    assert rx["shm_bytes"] == sum(rx["bytes"].values()) > 0
    assert rx["same_host_reads"]["sealed_pools"] == 2 and rx["same_host_reads"]["failed"] == 0
    dc.release(r.room, r.group)
    path = pool_path(spools[0].name)
    with pytest.raises(PermissionError):
        os.truncate(path, 4096)  # the seal holds against the pool's own creator's kin
    # a hole over rank 0's whole KV range: its rows of the next room read as zeros
    fd = os.open(path, os.O_RDWR)
    try:
        falloc = ctypes.CDLL(None, use_errno=True).fallocate
        falloc.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        kv0 = spools[0].layout.indices("kv")[0]
        start = spools[0].offsets[kv0]
        assert falloc(fd, 0x03, start, spools[0].layout.buffers[kv0].nbytes) == 0  # KEEP_SIZE | PUNCH_HOLE
    finally:
        os.close(fd)
    assert not spools[0].rows[kv0].any()
    before = [rows.copy() for rows in dpool.rows]
    r2 = make_room(141, "prefill0", n, 2, chunks=[(0, n)], dst_start=100, slot=6, spools=spools)
    assert land(dc, pcs, r2, dpool, spools, before) == 0  # against what the pools hold now
    assert dc.ping()


def test_same_host_path_can_be_turned_off_on_the_receiver(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(same_host="off")
    pcs, spools = cluster.group("prefill0", 1, [ep], same_host="auto")
    r = make_room(82, "prefill0", 4, 1, spools=spools)
    expect(dc, r)
    submit_all(pcs, r)
    assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    assert dc.stats()["shm_bytes"] == 0 and sum(dc.stats()["bytes"].values()) > 0


@pytest.mark.planes
def test_batched_engine_calls(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 2, [ep])
    for i, p in enumerate(spools):
        fill_random(p, 40 + i)
    before = [rows.copy() for rows in dpool.rows]
    rooms = [make_room(300 + k, "prefill0", 6, 2, dst_start=10 * k, src_start=10 * k, slot=k, spools=spools)
             for k in range(8)]
    # one bad entry fails alone: the others are expected
    specs = [dict(room=r.room, group=r.group, dst_pages=r.dst, aux_slot=r.aux_dst, state=r.state_dst) for r in rooms]
    specs.insert(3, dict(room=999, group="prefill0", dst_pages=[10_000], aux_slot=0))
    out = dc.expect_many(specs)
    assert isinstance(out[3], BadRequest) and "destination page 10000 outside" in str(out[3])
    assert all(s.state is RoomState.WAITING for k, s in enumerate(out) if k != 3)
    for rank, pc in enumerate(pcs):
        res = pc.submit_many([dict(room=r.room, start=0, src_pages=r.src[rank], last=True, state=r.state_src[rank],
                                   aux_slot=r.aux_src[rank]) for r in rooms])
        assert not any(isinstance(x, Exception) for x in res)
    st = dc.wait_many([(r.room, r.group) for r in rooms] + [(12345, "prefill0")], 20)
    assert [s.state for s in st[:-1]] == [RoomState.SUCCESS] * 8 and isinstance(st[-1], UnknownRoom)
    for r in rooms:
        assert mismatches(r, dpool, spools, "pages", before) == 0
    assert all(s.state is RoomState.SUCCESS for s in dc.release_many([(r.room, r.group) for r in rooms]))
    nested = dc.batch([{"op": "batch", "calls": []}, {"op": "ping"}])
    assert isinstance(nested[0], BadRequest) and "do not nest" in str(nested[0]) and nested[1]["name"] == "decode0"


@pytest.mark.parametrize("zero_copy", ["direct", "pyzmq"])
def test_both_zero_copy_modes_are_byte_exact_over_tcp(cluster: Cluster, zero_copy: str) -> None:
    """sender.zero_copy: rows handed to libzmq with no reference kept, or pyzmq's frames; rooms
    big enough to fill the pipe (the sender waits at the high-water mark), then a clean stop."""
    from transferd.transport import zerocopy

    assert zerocopy.available(), "libzmq not reachable through ctypes: the direct path is not exercised"
    ep, dc, dpool = cluster.receiver(kv_pages=512)
    pcs, spools = cluster.group("prefill0", 2, [ep], kv_pages=512, zero_copy=zero_copy, send_hwm=4)
    for i, p in enumerate(spools):
        fill_random(p, 70 + i)
    before = [rows.copy() for rows in dpool.rows]
    rooms = [make_room(400 + k, "prefill0", 120, 2, dst_start=120 * k, src_start=7 * k, slot=k, spools=spools)
             for k in range(4)]
    for r in rooms:
        expect(dc, r)
        submit_all(pcs, r)
    st = dc.wait_many([(r.room, r.group) for r in rooms], 30)
    assert [s.state for s in st] == [RoomState.SUCCESS] * 4
    for r in rooms:
        assert mismatches(r, dpool, spools, "pages", before) == 0
    assert dc.stats()["shm_bytes"] == 0


def test_a_sender_stopped_with_rows_in_flight_exits_cleanly(cluster: Cluster) -> None:
    """zero_copy = direct keeps no reference to the rows libzmq is sending (the sender unmaps its
    pool only after the ZeroMQ context is gone): SIGTERM with the pipe full ends in exit 0, and
    the decode side learns of the end."""
    import signal

    ep, dc, dpool = cluster.receiver(kv_pages=512, faults={"slow_receiver_ms": 20}, recv_hwm=4)
    pcs, spools = cluster.group("prefill0", 1, [ep], kv_pages=512, send_hwm=64, drain_timeout_s=0.3,
                                zero_copy="direct", max_message_bytes=4096,
                                stream_record_bytes=4096)  # hundreds of messages, 20 ms each
    fill_random(spools[0], 5)
    r = make_room(500, "prefill0", 400, 1, spools=spools)
    expect(dc, r)
    submit_all(pcs, r)
    sender = cluster.proc("sender-prefill0-r0")
    cluster.until(lambda: dc.stats()["bytes"].get("kv", 0) > 0, "the first rows to arrive", sender)
    assert pcs[0].poll(r.room).state is RoomState.TRANSFERRING  # frames are in flight, more are queued
    sender.proc.send_signal(signal.SIGTERM)
    assert sender.proc.wait(20) == 0, sender.log.read_text()[-3000:]
    st = dc.wait(r.room, r.group, 20)
    assert st.state is RoomState.FAILED and st.code in ("shutdown", "peer_lost"), st


@pytest.mark.planes
def test_dedup_off_every_rank_ships_the_state_and_the_room_is_byte_exact(cluster: Cluster) -> None:
    """sender.dedup = false (the comparison setting): the pages-split ranks each send their own
    copy of the replicated state; the receiver takes it once from each, and the bytes on the wire
    are the de-dup's saving exactly."""
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 4, [ep], dedup=False)
    for i, p in enumerate(spools):
        fill_random(p, 90 + i)
    r = make_room(600, "prefill0", 12, 4, spools=spools)
    for rank in range(1, 4):  # every rank holds the same replicated state (what the de-dup relies on)
        for b in spools[0].layout.indices("state"):
            comp = spools[0].layout.buffers[b].component
            spools[rank].rows[b][r.state_src[rank][comp]] = spools[0].rows[b][r.state_src[0][comp]]
    before = [rows.copy() for rows in dpool.rows]
    expect(dc, r)
    submit_all(pcs, r)
    assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    assert mismatches(r, dpool, spools, "pages", before) == 0
    assert dc.stats()["bytes"]["state"] == 4 * state_copy_bytes(dpool)
    assert all(pc.stats()["state_bytes_skipped"] == 0 for pc in pcs)
    assert [pc.stats()["bytes"].get("state", 0) for pc in pcs] == [state_copy_bytes(dpool)] * 4
    cluster.check_plane(dc.stats())


def test_cp4_without_dedup_on_data_streams_is_byte_exact(cluster: Cluster) -> None:
    """Four ranks' data streams into one receiver at once: 64 KiB KV and conv-state rows read
    straight into the pool (every rank writes the same state rows: the de-dup is off), small ssm
    rows and aux through each stream's own buffer. Every byte came on a stream."""
    model = {"name": "big-rows", "dtype": "bf16", "page_size": 16, "kv_layers": 2, "kv_format": "mha",
             "kv_token_elems": 2048, "aux_row_bytes": 64,
             "state": [{"name": "conv", "layers": 2, "slot_shape": [2, 16384]},
                       {"name": "ssm", "layers": 1, "slot_shape": [64]}]}
    ep, dc, dpool = cluster.receiver(kv_pages=64, model=model)
    pcs, spools = cluster.group("p4", 4, [ep], kv_pages=64, model=model, dedup=False)
    for i, p in enumerate(spools):
        fill_random(p, 40 + i)
    fill_random(dpool, 49)
    before = [rows.copy() for rows in dpool.rows]
    r = make_room(11, "p4", 24, 4, dst_start=8, spools=spools)
    L = dpool.layout
    assert L.buffers[L.indices("kv")[0]].row_bytes == 64 << 10
    for b in L.indices("state"):  # replicated state: the same bytes on every rank
        comp = L.buffers[b].component
        for k in range(1, 4):
            spools[k].rows[b][r.state_src[k][comp]] = spools[0].rows[b][r.state_src[0][comp]]
    expect(dc, r)
    submit_all(pcs, r)
    st = dc.wait(r.room, r.group, 30)
    assert st.state is RoomState.SUCCESS, (st, cluster.logs())
    assert mismatches(r, dpool, spools, "pages", before) == 0
    stats = dc.stats()
    assert stats["stream_bytes"] == sum(stats["bytes"].values()) > 0
    assert sum(pc.stats()["stream_bytes"] for pc in pcs) == stats["stream_bytes"]
    assert stats["bytes"]["state"] == 4 * state_copy_bytes(dpool)  # every rank sent its copy
    dc.release(r.room, r.group)
