"""Across hosts: the receiver and a cp_size 2 sender group in two network namespaces joined by a
veth pair. A room succeeds over the link; a room in flight when the link is cut fails on both
sides with ``peer_lost`` within the heartbeat deadline; once the link is back the senders register
again by themselves and a new room succeeds byte-exact.

The engine sockets are ``unix://`` paths in ``tmp_path`` and the pools live in ``/dev/shm``, which
both work across network namespaces, so this test process drives both engines from the root
namespace. Creating namespaces needs root (CI runs as root): when that is impossible the test
fails under CI (``CI`` set) and is skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from transferd.client import DecodeClient, PrefillClient
from transferd.config import SenderConfig, load
from transferd.pool import Pool
from transferd.protocol.room import RoomState

from .harness import Cluster, Proc, _try, fill_random
from .rooms import expect, make_room, mismatches, submit_all

GROUP = "prefill0"
HEARTBEAT = {"heartbeat_interval_s": 0.2, "heartbeat_misses": 5}  # a peer is lost after ~1 s of silence
# the namespaces share /dev/shm and the kernel: where the tree has a same-host path (the receiver
# reading the senders' pools), turn it off so that the data really crosses the veth
OVER_THE_LINK = {"same_host": "off"} if "same_host" in {f.name for f in fields(SenderConfig)} else {}
CUT_DEADLINE_S = 10.0  # interval × misses = 1 s, plus generous slack for a loaded 2-core machine


def ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")


class Link:
    """Two namespaces and a veth pair, named after this process so parallel runs never collide.
    The addresses (10.231.0.0/30) exist only inside these namespaces."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{time.monotonic_ns() % 1000:03d}"
        self.ns_r, self.ns_s = f"tdrecv{tag}", f"tdsend{tag}"
        self.veth_r, self.veth_s = f"tdr{tag}", f"tds{tag}"  # <= 15 characters
        self.addr_r, self.addr_s = "10.231.0.1", "10.231.0.2"
        self.made: list[str] = []

    def create(self) -> None:
        for ns in (self.ns_r, self.ns_s):
            ip("netns", "add", ns)
            self.made.append(ns)
        ip("link", "add", self.veth_r, "type", "veth", "peer", "name", self.veth_s)
        ip("link", "set", self.veth_r, "netns", self.ns_r)
        ip("link", "set", self.veth_s, "netns", self.ns_s)
        for ns, dev, addr in ((self.ns_r, self.veth_r, self.addr_r), (self.ns_s, self.veth_s, self.addr_s)):
            ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")

    def cut(self) -> None:
        ip("-n", self.ns_s, "link", "set", self.veth_s, "down")

    def restore(self) -> None:
        ip("-n", self.ns_s, "link", "set", self.veth_s, "up")

    def destroy(self) -> None:
        try:
            # a pair still in the root namespace (creation failed half way); else it goes with its namespaces
            subprocess.run(["ip", "link", "del", self.veth_r], capture_output=True, timeout=30)
            for ns in self.made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        except OSError:
            pass
        self.made.clear()


def spawn(cluster: Cluster, ns: str, label: str, role: str, cfg_path: Path) -> Proc:
    log = cluster.tmp / f"{label}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    with open(log, "wb") as out:
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "transferd", role,
                              "--config", str(cfg_path)], stdout=out, stderr=subprocess.STDOUT, env=env)
    proc = Proc(label, p, log, load(cfg_path, env={}))
    cluster.procs.append(proc)
    return proc


def registered_ranks(dc: DecodeClient) -> set[str]:
    return set(dc.status()["groups"].get(GROUP, {}).get("ranks", {}))


def test_cut_link_fails_rooms_in_flight_and_recovers(tmp_path: Path) -> None:
    link = Link()
    try:
        link.create()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        link.destroy()
        msg = f"cannot create network namespaces joined by a veth pair (needs root and iproute2): {exc}"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set, so this must run: {msg}")
        pytest.skip(msg)

    cluster = Cluster(tmp_path)
    codes: dict[str, int] = {}
    try:
        _run(cluster, link)
    finally:
        codes = cluster.close()  # processes first, then their namespaces
        link.destroy()
    bad = {k: v for k, v in codes.items() if v != 0}
    assert not bad, f"daemons did not exit cleanly on SIGTERM: {bad}\n{cluster.logs()}"


def _run(cluster: Cluster, link: Link) -> None:
    # -- receiver in its namespace, bound to its veth address -----------------------------
    rpath = cluster.write_config("receiver", {"receiver": {
        "name": "decode0", "bind": f"tcp://{link.addr_r}:*", "pool": f"{cluster.tag}-decode0",
        "kv_pages": 256, "state_slots": 32, "aux_slots": 32, **HEARTBEAT, **OVER_THE_LINK}})
    rproc = spawn(cluster, link.ns_r, "receiver", "receiver", rpath)
    dc = DecodeClient(rproc.cfg.receiver_engine_socket(), timeout_s=20)
    cluster.clients.append(dc)
    stats = cluster.until(lambda: _try(dc.ping, 0.5) and dc.stats(), "the receiver to answer", rproc)
    endpoint = stats["data_endpoint"]
    assert endpoint.startswith(f"tcp://{link.addr_r}:"), endpoint
    dpool = Pool.attach(rproc.cfg.receiver_pool_name())
    cluster.pools.append(dpool)

    # -- a cp_size 2 group in the other namespace ----------------------------------------
    pcs: list[PrefillClient] = []
    spools: list[Pool] = []
    for rank in range(2):
        spath = cluster.write_config(f"sender-r{rank}", {"sender": {
            "group": GROUP, "cp_size": 2, "cp_rank": rank, "split": "pages", "receivers": [endpoint],
            "pool": f"{cluster.tag}-{GROUP}-r{{rank}}", "kv_pages": 256, "state_slots": 32, "aux_slots": 32,
            **HEARTBEAT, **OVER_THE_LINK}})
        sproc = spawn(cluster, link.ns_s, f"sender-r{rank}", "sender", spath)
        pc = PrefillClient(sproc.cfg.sender_engine_socket(rank), timeout_s=20)
        cluster.clients.append(pc)
        cluster.until(lambda: _try(pc.ping, 0.5), f"sender r{rank} to answer", sproc)
        pool = Pool.attach(sproc.cfg.sender_pool_name(rank))
        cluster.pools.append(pool)
        fill_random(pool, 100 + rank)
        pcs.append(pc)
        spools.append(pool)
    cluster.until(lambda: registered_ranks(dc) == {"0", "1"}, "both ranks to register across the veth", rproc)
    fill_random(dpool, 7)

    def run_room(room: int, dst_start: int, slot: int) -> None:
        r = make_room(room, GROUP, 14, 2, chunks=[(0, 6), (6, 14)], dst_start=dst_start, slot=slot, spools=spools)
        before = [rows.copy() for rows in dpool.rows]
        expect(dc, r)
        submit_all(pcs, r)
        st = dc.wait(r.room, GROUP, 20)
        assert st.state is RoomState.SUCCESS, (st, cluster.logs())
        assert [pc.wait(r.room, 20).state for pc in pcs] == [RoomState.SUCCESS] * 2
        assert mismatches(r, dpool, spools, "pages", before) == 0
        dc.release(r.room, GROUP)

    # 1. a room across the link, byte-exact
    run_room(1, 0, 0)
    stats = dc.stats()
    assert stats["bytes"]["kv"] > 0 and stats.get("shm_bytes", 0) == 0, stats

    # 2. a room in flight: expected, first chunk sent (rank 0 owns positions 0..6), then the link goes
    r = make_room(2, GROUP, 14, 2, chunks=[(0, 6), (6, 14)], dst_start=40, slot=4, spools=spools)
    expect(dc, r)
    for rank, pc in enumerate(pcs):
        pc.submit(r.room, 0, r.src[rank][0:6])
    cluster.until(lambda: dc.poll(r.room, GROUP).state is RoomState.TRANSFERRING, "the first chunk to arrive",
                  rproc)
    link.cut()
    # the deadline itself is pinned by tests/unit/test_receiver_core.py (a fake clock); here only
    # a generous bound, so that a hang fails instead of waiting forever
    st = cluster.until(lambda: (s := dc.poll(r.room, GROUP)).state.terminal and s, "the room to fail", rproc,
                       timeout=CUT_DEADLINE_S + 5)
    assert st.state is RoomState.FAILED and st.code == "peer_lost", st
    assert re.search(rf"prefill {GROUP} rank [01]\b", st.reason), st.reason
    assert "missed heartbeats" in st.reason, st.reason
    # the prefill side gives the receiver up too and fails the room, without a timeout of its own
    for pc in pcs:
        sst = pc.wait(r.room, CUT_DEADLINE_S)
        assert sst.state is RoomState.FAILED and sst.code == "peer_lost", sst
        assert "decode0" in sst.reason, sst.reason
    dc.release(r.room, GROUP)

    # 3. the link comes back: the senders register again by themselves, and a new room succeeds
    link.restore()

    def back() -> bool:
        return registered_ranks(dc) == {"0", "1"} and all(
            c["state"] == "registered" for pc in pcs for c in pc.status()["receivers"])
    cluster.until(back, "both ranks to register again after the link came back", rproc)
    run_room(3, 80, 8)
    assert rproc.proc.poll() is None
