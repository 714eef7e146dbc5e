"""Faults on real processes: dead and restarted peers, the abort barrier, the two clocks,
backpressure, integrity. Each asserts which rooms fail, with what reason, within what deadline,
and that every room reported Success is byte-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from transferd.protocol.room import RoomState

from .harness import Cluster, fill_random
from .rooms import expect, make_room, mismatches, submit_all

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_S = 0.05
FAST = {"heartbeat_interval_s": 0.2, "heartbeat_misses": 5}  # a peer is lost after 1 s of silence


def _ok_room(cluster, dc, dpool, pcs, spools, room_id, group, cp, **kw) -> None:
    before = [rows.copy() for rows in dpool.rows]
    r = make_room(room_id, group, 8, cp, spools=spools, **kw)
    expect(dc, r)
    submit_all(pcs, r)
    st = dc.wait(r.room, group, 20)
    assert st.state is RoomState.SUCCESS, st
    assert mismatches(r, dpool, spools, "pages", before) == 0
    dc.release(r.room, group)


@pytest.mark.planes
def test_killed_sender_fails_exactly_its_groups_rooms_within_the_deadline(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(kv_pages=512, **FAST)
    pa, pools_a = cluster.group("pa", 2, [ep], **FAST)
    pb, pools_b = cluster.group("pb", 1, [ep], **FAST)
    for i, p in enumerate(pools_a + pools_b):
        fill_random(p, i)
    ra = make_room(1, "pa", 10, 2, chunks=[(0, 5), (5, 10)], dst_start=0, spools=pools_a)
    rb = make_room(2, "pb", 10, 1, chunks=[(0, 5), (5, 10)], dst_start=100, slot=4, spools=pools_b)
    before = [rows.copy() for rows in dpool.rows]
    for r, pcs in ((ra, pa), (rb, pb)):
        expect(dc, r)
        for rank, pc in enumerate(pcs):
            pc.submit(r.room, 0, r.src[rank][:5])
    cluster.kill("sender-pa-r1")
    st = dc.wait(ra.room, "pa", 15)  # the heartbeat deadline itself: tests/unit/test_receiver_core.py
    assert st.state is RoomState.FAILED and st.code == "peer_lost", st
    # its data stream closes with the process (or, with no stream, its heartbeats stop)
    assert "prefill pa rank 1" in st.reason and ("data stream" in st.reason or "missed heartbeats" in st.reason)
    assert pa[0].wait(ra.room, 10).state is RoomState.FAILED  # rank 0 learns it from the receiver
    # the other group is untouched and finishes its room
    pb[0].submit(rb.room, 5, rb.src[0][5:], last=True, state=rb.state_src[0], aux_slot=rb.aux_src[0])
    assert dc.wait(rb.room, "pb", 20).state is RoomState.SUCCESS
    assert mismatches(rb, dpool, pools_b, "pages", before) == 0
    # the killed rank comes back as a new incarnation and its group works again
    cluster.restart("sender-pa-r1")
    cluster.until(lambda: len(dc.status()["groups"].get("pa", {}).get("ranks", {})) == 2, "pa rank 1 back")
    pa[1] = type(pa[1])(pa[1].endpoint, timeout_s=20)
    cluster.clients.append(pa[1])
    _ok_room(cluster, dc, dpool, pa, pools_a, 3, "pa", 2, dst_start=200, slot=8)


@pytest.mark.planes
def test_restarted_sender_is_a_new_incarnation_and_old_rooms_fail(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(**FAST)
    pcs, spools = cluster.group("prefill0", 2, [ep], heartbeat_interval_s=30.0)
    inc = dc.status()["groups"]["prefill0"]["ranks"]["0"]["incarnation"]
    r = make_room(9, "prefill0", 8, 2, chunks=[(0, 4), (4, 8)], spools=spools)
    expect(dc, r)
    cluster.kill("sender-prefill0-r0")
    cluster.restart("sender-prefill0-r0")  # back before any heartbeat deadline
    st = dc.wait(r.room, "prefill0", 15)
    assert st.state is RoomState.FAILED and st.code in ("peer_restarted", "peer_lost"), st
    assert "rank 0" in st.reason
    ranks = cluster.until(lambda: (g := dc.status()["groups"].get("prefill0")) and len(g["ranks"]) == 2 and g["ranks"],
                          "re-registration")
    assert ranks["0"]["incarnation"] != inc
    pcs[0] = type(pcs[0])(pcs[0].endpoint, timeout_s=20)
    cluster.clients.append(pcs[0])
    _ok_room(cluster, dc, dpool, pcs, spools, 10, "prefill0", 2)


@pytest.mark.planes
def test_dead_receiver_fails_its_rooms_and_the_group_keeps_serving_the_other(cluster: Cluster) -> None:
    ep1, dc1, pool1 = cluster.receiver("decode1", **FAST)
    ep2, dc2, pool2 = cluster.receiver("decode2", **FAST)
    pcs, spools = cluster.group("prefill0", 2, [ep1, ep2], **FAST)
    for i, p in enumerate(spools):
        fill_random(p, i)
    r1 = make_room(21, "prefill0", 8, 2, chunks=[(0, 4), (4, 8)], spools=spools)
    expect(dc1, r1)
    for rank, pc in enumerate(pcs):
        pc.submit(r1.room, 0, r1.src[rank][:4])
    # a rank learns the room is decode1's from its assign: killed before that reaches a rank, the
    # room is nobody's there and rightly waits (a rank that registered a moment before the kill)
    cluster.until(lambda: all(pc.poll(r1.room).state is not RoomState.BOOTSTRAPPING for pc in pcs),
                  "both ranks to have room 21's assign")
    cluster.kill("receiver-decode1")
    for pc in pcs:
        st = pc.wait(r1.room, 15)  # the sender's heartbeat deadline itself: tests/unit/test_sender_core.py
        assert st.state is RoomState.FAILED and st.code == "peer_lost", st
        assert "receiver decode1" in st.reason
    _ok_room(cluster, dc2, pool2, pcs, spools, 22, "prefill0", 2, slot=3)


@pytest.mark.planes
def test_restarted_receiver_is_registered_with_again_automatically(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(**FAST)
    pcs, spools = cluster.group("prefill0", 2, [ep], **FAST)
    _ok_room(cluster, dc, dpool, pcs, spools, 30, "prefill0", 2)
    cluster.kill("receiver-decode0")
    cluster.restart("receiver-decode0", bind=ep)  # same address, new incarnation, no operator action
    dc.timeout_s = 2
    cluster.until(lambda: _registered(dc) == 2, "both ranks to register with the new receiver")
    dc.timeout_s = 20
    # the receiver counts a rank when it sends its welcome; the rank reads it a loop turn later
    cluster.until(lambda: all(s["receivers"][0]["state"] == "registered" for s in (pc.status() for pc in pcs)),
                  "both ranks to read the new receiver's welcome")
    _ok_room(cluster, dc, dpool, pcs, spools, 31, "prefill0", 2, slot=5)


def _registered(dc) -> int:
    from transferd.errors import ClientTimeout

    try:
        return len(dc.status()["groups"].get("prefill0", {}).get("ranks", {}))
    except ClientTimeout:
        return 0


def test_stall_clock_fails_a_stuck_transfer_but_not_a_slow_one(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(kv_pages=512, stall_timeout_s=1.0, faults={"slow_receiver_ms": 25})
    pcs, spools = cluster.group("prefill0", 1, [ep], max_message_bytes=4096,
                                stream_record_bytes=4096)  # 8 rows a frame: 90 frames
    fill_random(spools[0], 1)
    before = [rows.copy() for rows in dpool.rows]
    # slow but progressing: ~3 s of frames 25 ms apart, each resetting the 1 s stall clock
    r = make_room(40, "prefill0", 120, 1, dst_order="linear", spools=spools)
    expect(dc, r)
    t0 = time.monotonic()
    submit_all(pcs, r)
    assert dc.wait(r.room, "prefill0", 60).state is RoomState.SUCCESS
    assert time.monotonic() - t0 > 1.5, "the transfer was not slower than the stall clock"
    assert mismatches(r, dpool, spools, "pages", before) == 0
    # stuck: the first chunk arrives, the prefill engine never submits the rest
    r2 = make_room(41, "prefill0", 8, 1, chunks=[(0, 4), (4, 8)], dst_start=200, slot=2, spools=spools)
    expect(dc, r2)
    pcs[0].submit(r2.room, 0, r2.src[0][:4])
    st = dc.wait(r2.room, "prefill0", 15)
    assert st.state is RoomState.FAILED and st.code == "stalled" and "ranks not done: [0]" in st.reason
    assert pcs[0].wait(r2.room, 10).code == "stalled"


def test_a_slow_receiver_slows_queued_rooms_instead_of_failing_them(tmp_path: Path) -> None:
    """Issue 13 item 7: rooms queued behind others on a busy but progressing connection are
    slowed, not stalled. Ten rooms at once through a receiver that pauses 50 ms after every
    message, with a 1 s stall clock: each room waits seconds behind the others' rows (before the
    fix, about half of them failed ``stalled``); every one succeeds byte-exact."""
    out = tmp_path / "s.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env.update(PYTHONPATH=str(ROOT), TRANSFERD_RECEIVER_STALL_TIMEOUT_S="1.0")
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--cp-size", "2", "--rooms", "10",
                           "--in-flight", "10", "--fault", "slow-receiver:50", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["rooms_failed_by_reason"] == {} and s["rooms_ok"] == 10, s["rooms_failed_by_reason"]
    assert s["corrupted_rooms"] == 0 and s["mismatched_bytes"] == 0


def test_queue_clocks_are_separate_from_liveness(cluster: Cluster) -> None:
    ep, dc, _ = cluster.receiver(bootstrap_timeout_s=1.0)
    pcs, spools = cluster.group("prefill0", 1, [ep], assign_timeout_s=1.0)
    # prefill submitted, no decode instance ever expects it: the queueing clock on the sender
    pcs[0].submit(50, 0, [1, 2], last=True, state={"conv": [0], "ssm": [0]}, aux_slot=0)
    st = pcs[0].wait(50, 15)
    assert st.state is RoomState.FAILED and st.code == "assign_timeout"
    # decode expects a room from a group that never registers: the bootstrap clock on the receiver
    dc.expect(51, "nobody", [1, 2], aux_slot=0)
    st = dc.wait(51, "nobody", 15)
    assert st.state is RoomState.FAILED and st.code == "bootstrap_timeout" and "nobody" in st.reason


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_backpressure_bounds_memory_under_a_slow_receiver(cluster: Cluster) -> None:
    model = {"name": "big", "dtype": "bf16", "page_size": 16, "kv_layers": 4, "kv_format": "mha",
             "kv_token_elems": 8192, "aux_row_bytes": 64, "state": []}  # 256 KiB pages
    ep, dc, dpool = cluster.receiver(kv_pages=200, model=model, faults={"slow_receiver_ms": 3}, recv_hwm=16)
    pcs, spools = cluster.group("prefill0", 1, [ep], kv_pages=200, model=model, send_hwm=16)
    fill_random(spools[0], 3)
    rx_pid = cluster.proc("receiver-decode0").proc.pid
    tx_pid = cluster.proc("sender-prefill0-r0").proc.pid
    base = {pid: _rss_anon(pid) for pid in (rx_pid, tx_pid)}
    # 200 pages × 8 buffers × 256 KiB = 400 MiB through a receiver that takes 3 ms per 1 MiB message
    dst = list(range(200))
    dc.expect(60, "prefill0", dst, aux_slot=0)
    aux = spools[0].rows[spools[0].layout.aux_index]
    aux[0, :8] = np.frombuffer(np.uint64(60).tobytes(), np.uint8)
    pcs[0].submit(60, 0, list(range(200)), last=True, aux_slot=0)
    peak = dict(base)
    while (st := dc.poll(60, "prefill0")).state is not RoomState.SUCCESS:
        assert not st.state.terminal, st  # one poll per round: the room may end between two polls
        for pid in peak:
            peak[pid] = max(peak[pid], _rss_anon(pid))
        time.sleep(SAMPLE_S)  # sampling interval, not a wait for an event
    growth = {pid: peak[pid] - base[pid] for pid in peak}
    assert growth[rx_pid] < 96 << 20, f"receiver grew {growth[rx_pid] >> 20} MiB"
    assert growth[tx_pid] < 96 << 20, f"sender grew {growth[tx_pid] >> 20} MiB"
    for b in dpool.layout.indices("kv"):
        assert np.array_equal(dpool.rows[b][:200], spools[0].rows[b][:200])


def test_checksum_turns_corruption_into_a_failed_room(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 1, [ep], checksum="xxh3", faults={"corrupt_frames": 1.0})
    fill_random(spools[0], 1)
    r = make_room(70, "prefill0", 6, 1, spools=spools)
    before = dpool.rows[0][r.dst].copy()
    expect(dc, r)
    submit_all(pcs, r)
    st = dc.wait(r.room, "prefill0", 15)
    assert st.state is RoomState.FAILED and st.code == "checksum" and "checksum mismatch" in st.reason
    assert np.array_equal(dpool.rows[0][r.dst], before)  # the corrupted frame was not written
    assert dc.stats()["refused"]["checksum"] == 1


@pytest.mark.parametrize("spec, reason", [
    ("kill-sender:1", "peer_lost"), ("restart-receiver", "receiver_restarted"), ("pause-sender:0", "peer_lost"),
    ("drop-frames:0.05", "incomplete"), ("corrupt-frames:0.05", "checksum"), ("slow-receiver:1", None),
])
def test_demo_fault_harness(tmp_path: Path, spec: str, reason: str | None) -> None:
    _demo_fault(tmp_path, spec, reason)


@pytest.mark.parametrize("spec, reason", [
    ("kill-sender:1", "peer_lost"), ("restart-receiver", "receiver_restarted"), ("drop-frames:0.05", "incomplete"),
])
@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_demo_fault_harness_over_an_engine_plane(tmp_path: Path, request: pytest.FixtureRequest, engine: str,
                                                 spec: str, reason: str) -> None:
    """The same faults with every row read by the receiver's engine, Mooncake TE or NIXL (cp 2:
    the dropped data-refs, the killed sender's reads and the restarted receiver's engine)."""
    request.getfixturevalue(f"plane_{engine}")  # skips here without the wheel, fails under CI
    s = _demo_fault(tmp_path, spec, reason, "--data-plane", engine, "--cp-size", "2")
    assert s["bytes_by_path"][engine] == sum(s["wire_bytes"].values()) > 0, s["bytes_by_path"]


def _demo_fault(tmp_path: Path, spec: str, reason: str | None, *extra: str) -> dict:
    out = tmp_path / "s.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--rooms", "16", "--in-flight", "4",
                           "--fault", spec, "--json", str(out), *extra], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["faults"] == [spec] and s["corrupted_rooms"] == 0 and s["mismatched_bytes"] == 0
    assert s["rooms_ok"] + s["rooms_failed"] == 16 and s["recovered"]
    if reason is None:
        assert s["rooms_failed"] == 0
    else:
        assert s["rooms_failed"] > 0 and set(s["rooms_failed_by_reason"]) == {reason}, s["rooms_failed_by_reason"]
    if spec.split(":")[0] in ("kill-sender", "restart-receiver", "pause-sender"):
        assert s["rooms_after_fault"] > 0  # rooms ran after the fault, and all succeeded
    return s
