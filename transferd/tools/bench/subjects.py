"""The measured subjects and the run: the daemons started for them, their source bytes, transferd's
bulk rooms (TCP on a data stream, the same-host path, the ZeroMQ socket), the de-dup rooms, the
small rooms, the baselines of :mod:`.peers`, and the interleaved rounds of :func:`.plan.schedule`."""

from __future__ import annotations

import fnmatch
import logging
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ...client import PrefillClient
from ...config import load
from ...errors import TransferdError
from ...pool.shm import Pool
from ...protocol.room import RoomState
from ..progress import progress_bar
from ..rooms import write_guard
from .cluster import Cluster, Fleet
from .peers import Limits
from .plan import (
    BULK_KEYS,
    BULK_LAYERS,
    CP8,
    CP8_ROOMS,
    DEDUP_CPS,
    SIZES,
    SMALL_CPS,
    Filler,
    Plan,
    cp8_pages_per_room,
    cpu_seconds,
    cpu_since,
    room_ms_mean,
    room_seconds,
    schedule,
)
from .sglang_room import SglangRoomBench
from .sglang_room import available as sglang_available
from .staging import StagingBench
from .staging import available as staging_available

log = logging.getLogger(__name__)
Subject = Callable[[], dict[str, Any]]


class Bench:
    """One run: the daemons (:class:`.cluster.Fleet`), the baselines (:class:`.peers.Limits`),
    every subject's results per round and the small rooms' latencies."""

    def __init__(self, plan: Plan, quick: bool, run_dir: Path, tag: str, progress: bool) -> None:
        self.plan = plan
        self.quick = quick
        self.run_dir = run_dir
        self.tag = tag
        self.progress = progress
        self.fleet = Fleet(run_dir, tag, plan.room_timeout_s)
        self.limits = Limits(plan, tag)
        self.bulk: dict[str, Cluster] = {}
        self.ds: Cluster | None = None
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.latencies: dict[str, list[float]] = {}  # small rooms' group -> expect → Success, seconds
        self.notes: dict[str, str] = {}
        self.codes: dict[str, int | None] = {}
        self.only: list[str] = []  # subject globs (--only); empty: all
        self.staging: StagingBench | None = None  # the SGLang backend's copies (needs torch)
        self.sgl: SglangRoomBench | None = None  # a room through the SGLang backend (needs SGLang)
        self.cp8_src: list[list[np.ndarray]] = []  # CP8 bulk: [room][rank] the source pages a rank submits
        self.cp8_checked = [0, 0]  # CP8 bulk: rooms verified byte for byte, bytes that differed

    def say(self, msg: str) -> None:
        if self.progress:
            print(f"\r\033[K[bench] {msg}", end="", file=sys.stderr, flush=True)

    # -- start-up ------------------------------------------------------------------------
    def start(self, ds_path: Path) -> None:
        p, fleet = self.plan, self.fleet
        deadline = time.monotonic() + 180.0
        self.limits.start(fleet.procs, self.run_dir, self.notes)
        if staging_available():
            self.staging = StagingBench(p.bulk_room_bytes * 2, self.tag)
        else:
            self.notes["sglang_staging"] = "torch is not installed (pip install -e '.[sglang]')"
        fleet.mooncake = self.limits.mooncake is not None  # the Mooncake plane beside the raw peer
        # receivers first (their addresses are picked by the kernel), then every sender at once
        for key in ("64KiB", "256KiB", "1MiB"):
            pages = p.bulk_room_bytes // (BULK_LAYERS * SIZES[key])
            n = pages * p.bulk_rooms
            self.bulk[key] = fleet.cluster(f"bulk{key.lower()}", fleet.write_bulk_config(key), (n, 0, 64), (n, 0, 64))
        n = load(ds_path, env={}).demo.pages_per_room
        aux = max(p.small_batch_rooms, 8 * p.dedup_rooms)
        self.ds = ds = fleet.cluster("dsrx", ds_path, (n * p.dedup_rooms + p.small_batch_rooms, 8 * p.dedup_rooms, aux),
                                     (n, 1, aux))
        self.say("starting daemons")
        for c in fleet.clusters.values():
            fleet.answer(c, deadline)
        for c in self.bulk.values():
            fleet.group(c, f"b{c.name[4:]}", 1)
            fleet.group(c, f"s{c.name[4:]}", 1, same_host=True)
            fleet.group(c, f"z{c.name[4:]}", 1, stream=False)  # TCP through the ZeroMQ socket only
            if fleet.mooncake:
                fleet.group(c, f"m{c.name[4:]}", 1, mooncake=True)  # read by the receiver's Mooncake TE
        # the CP8 bulk block: one cp 8 group into the 1 MiB receiver, each rank's pool only as
        # large as the pages it sends (its share of every room)
        fleet.group(self.bulk["1MiB"], "c1mib", CP8, kv_pages=CP8_ROOMS * cp8_pages_per_room(p) // CP8)
        if sglang_available():  # a fourth group of the 1 MiB cluster: the rooms through the SGLang backend
            fleet.group(self.bulk["1MiB"], "g1mib", 1)
        else:
            self.notes["sglang_room"] = "SGLang is not installed (docs/ENGINES.md, Installing)"
        for cp in DEDUP_CPS:
            fleet.group(ds, f"ds{cp}", cp)
        for cp in DEDUP_CPS[1:]:  # the same groups with the de-dup off: every rank ships the state
            fleet.group(ds, f"dsoff{cp}", cp, dedup=False)
        if fleet.mooncake:
            fleet.group(ds, "dsmc1", 1, mooncake=True)  # small rooms over Mooncake TE
        self.limits.fill()  # meanwhile
        groups = [g for c in fleet.clusters.values() for g in c.groups.values()]
        for g in groups:
            g.pcs = [PrefillClient(g.cfg.sender_engine_socket(rank), timeout_s=2.0) for rank in range(g.cp)]
        fleet.registered(groups, deadline)
        self.say("filling pools")
        for c in fleet.clusters.values():
            c.dpool = Pool.attach(c.cfg.receiver_pool_name())
            for rows in c.dpool.rows:  # touch the destination once, like a warm engine's pool
                rows[:] = 0
            for g in c.groups.values():
                g.pools = [Pool.attach(g.cfg.sender_pool_name(r)) for r in range(g.cp)]
        self._prepare_bulk()
        self._prepare_cp8()
        self._prepare_ds()
        if "g1mib" in self.bulk["1MiB"].groups:
            self.say("importing SGLang")
            self.sgl = SglangRoomBench(self.bulk["1MiB"], self.bulk["1MiB"].groups["g1mib"], self.run_dir)
        for c in fleet.clusters.values():
            assert c.dc is not None
            c.dc.timeout_s = 30.0
            for g in c.groups.values():
                for pc in g.pcs:
                    pc.timeout_s = 30.0

    def _prepare_bulk(self) -> None:
        p = self.plan
        rng = np.random.default_rng(11)
        for key, c in self.bulk.items():
            for gi, g in enumerate(gg for gg in c.groups.values() if gg.cp == 1):
                rows = g.pools[0].layout.kv_rows
                for b in g.pools[0].layout.indices("kv"):
                    Filler(100 + b + 10 * len(key) + 1000 * gi).rows(g.pools[0].rows[b], range(rows))
                g.src_pages = [rng.permutation(rows)]
            c.dst_perm = rng.permutation(c.layout.kv_rows)
            c.pages = p.bulk_room_bytes // (BULK_LAYERS * SIZES[key])

    def _prepare_cp8(self) -> None:
        """Every rank's pool holds its share of every CP8 room (distinct bytes per rank). A rank
        reads only its own positions of the source pages it submits, but the list must cover
        the room with distinct pages of its pool: the other positions name its pages of other
        rooms (never read)."""
        g = self.bulk["1MiB"].groups["c1mib"]
        P = cp8_pages_per_room(self.plan)
        q = P // CP8
        rng = np.random.default_rng(17)
        perms = []
        for r, pool in enumerate(g.pools):
            f = Filler(3000 + r)
            for b in pool.layout.indices("kv"):
                f.rows(pool.rows[b], range(pool.layout.kv_rows))
            perms.append(rng.permutation(pool.layout.kv_rows))  # room j's own pages: [j*q, (j+1)*q)
        g.src_pages = perms
        self.cp8_src = []
        for j in range(CP8_ROOMS):
            srcs = []
            for r, perm in enumerate(perms):
                own = perm[j * q:(j + 1) * q]
                rest = np.concatenate([perm[:j * q], perm[(j + 1) * q:]])[:P - q]
                srcs.append(np.concatenate([rest[:r * q], own, rest[r * q:]]))
            self.cp8_src.append(srcs)

    def _prepare_ds(self) -> None:
        assert self.ds is not None
        rng = np.random.default_rng(13)
        layout = self.ds.layout
        n = self.ds.cfg.demo.pages_per_room
        for gi, g in enumerate(self.ds.groups.values()):
            for r, pool in enumerate(g.pools):
                f = Filler(1000 + 37 * gi + r)
                kv_rows = pool.layout.kv_rows
                perm = rng.permutation(kv_rows)[:n]
                g.src_pages.append(perm)
                for b in layout.indices("kv"):
                    f.rows(pool.rows[b], range(kv_rows))
                fs = Filler(5000 + gi)  # the replicated state: the same bytes on every rank of a group
                for b in layout.indices("state"):
                    fs.rows(pool.rows[b], [0])  # slot 0 is the room's
        self.ds.dst_perm = rng.permutation(layout.kv_rows)

    # -- subjects ------------------------------------------------------------------------
    def bulk_room(self, key: str, path: str = "tcp") -> dict[str, Any]:
        """Bulk rooms of one sender: ``tcp`` (the default path between hosts: a data stream),
        ``shm`` (the same-host path), ``zmq`` (TCP through the ZeroMQ socket, no data stream) or
        ``mooncake`` (read by the receiver's Mooncake TE over its TCP transport)."""
        fleet = self.fleet
        contig = key.endswith("_contig")
        c = self.bulk[key.split("_")[0]]
        assert c.dc is not None and c.rx is not None
        g = c.groups[{"tcp": "b", "shm": "s", "zmq": "z", "mooncake": "m"}[path] + c.name[4:]]
        pc, sp = g.pcs[0], g.pools[0]
        P, R = c.pages, self.plan.bulk_rooms
        rooms: list[tuple[int, np.ndarray, np.ndarray]] = []
        for j in range(R):
            room = fleet.room_id()
            if contig:
                src = np.arange(j * P, (j + 1) * P)
                dst = np.arange(j * P, (j + 1) * P)
            else:
                src = g.src_pages[0][j * P:(j + 1) * P]
                dst = c.dst_perm[j * P:(j + 1) * P]
            write_guard(sp, j, room)
            pc.submit(room, 0, src.tolist(), last=True, aux_slot=j)
            rooms.append((room, src, dst))
        fleet.poison(c, rooms[0][2], {}, 0)
        s0 = pc.stats()
        shm0, stream0, mc0 = (int(s0.get(k, 0)) for k in ("shm_bytes", "stream_bytes", "mooncake_bytes"))
        pids = [c.rx.proc.pid, g.procs[0].proc.pid]
        rs0 = room_seconds(c.dc.stats())
        cpu0 = [cpu_seconds(pid) for pid in pids]
        expects = [{"room": room, "group": g.name, "dst_pages": dst.tolist(), "aux_slot": j}
                   for j, (room, _, dst) in enumerate(rooms)]
        t0 = time.perf_counter()
        for st in c.dc.expect_many(expects):  # one engine call for all, as a batching engine would
            if isinstance(st, Exception):
                raise TransferdError(f"bench: expect refused: {st}")
        ok = fleet.wait_all(c, [(g.name, room) for room, _, _ in rooms])
        dt = time.perf_counter() - t0
        cpu = cpu_since(pids, cpu0)
        rs = room_ms_mean(rs0, room_seconds(c.dc.stats()), dt)
        s1 = pc.stats()
        shm, stream = int(s1.get("shm_bytes", 0)) - shm0, int(s1.get("stream_bytes", 0)) - stream0
        mc = int(s1.get("mooncake_bytes", 0)) - mc0
        _room0, src0, dst0 = rooms[0]
        fleet.verify(c, g, dst0, [src0], {}, {}, 0, 0)
        fleet.release(c, [(g.name, room) for room, _, _ in rooms])
        nbytes = R * (P * c.layout.kv_page_bytes() + c.layout.aux_row_bytes)
        out: dict[str, Any] = {"gbps": nbytes / dt / 1e9 if ok == R else None, "seconds": dt,
                               "shm_share": shm / nbytes, "stream_share": stream / nbytes,
                               "mooncake_share": mc / nbytes, **rs}
        if cpu is not None:
            out["receiver_cpu_s_per_gb"], out["sender_cpu_s_per_gb"] = (x / (nbytes / 1e9) for x in cpu)
        return out

    def bulk_cp8(self) -> dict[str, Any]:
        """CP8 bulk over TCP: :data:`CP8_ROOMS` rooms of 1 MiB rows from the eight ranks of one
        group (split "pages", each rank on its data stream) into one receiver, the bytes of one
        cp 1 ``bulk/1MiB`` measurement; the receiver's CPU and the eight senders' summed."""
        fleet, c = self.fleet, self.bulk["1MiB"]
        assert c.dc is not None and c.rx is not None
        g = c.groups["c1mib"]
        P, R = cp8_pages_per_room(self.plan), CP8_ROOMS
        rooms = []
        for j in range(R):
            room = fleet.room_id()
            write_guard(g.pools[0], j, room)
            rooms.append((room, c.dst_perm[j * P:(j + 1) * P]))
        for r, pc in enumerate(g.pcs):  # one engine call per rank for all rooms
            for st in pc.submit_many([dict(room=room, src_pages=self.cp8_src[j][r].tolist(), last=True, aux_slot=j)
                                      for j, (room, _) in enumerate(rooms)]):
                if isinstance(st, Exception):
                    raise TransferdError(f"bench: cp8 submit refused: {st}")
        fleet.poison(c, rooms[0][1], {}, 0)
        stream0 = sum(int(pc.stats().get("stream_bytes", 0)) for pc in g.pcs)
        pids = [c.rx.proc.pid] + [p.proc.pid for p in g.procs]
        rs0 = room_seconds(c.dc.stats())
        cpu0 = [cpu_seconds(pid) for pid in pids]
        t0 = time.perf_counter()
        for st in c.dc.expect_many([{"room": room, "group": g.name, "dst_pages": dst.tolist(), "aux_slot": j}
                                    for j, (room, dst) in enumerate(rooms)]):
            if isinstance(st, Exception):
                raise TransferdError(f"bench: expect refused: {st}")
        ok = fleet.wait_all(c, [(g.name, room) for room, _ in rooms])
        dt = time.perf_counter() - t0
        d = cpu_since(pids, cpu0)
        rs = room_ms_mean(rs0, room_seconds(c.dc.stats()), dt)
        stream = sum(int(pc.stats().get("stream_bytes", 0)) for pc in g.pcs) - stream0
        bad0 = fleet.mismatched
        fleet.verify(c, g, rooms[0][1], self.cp8_src[0], {}, {}, 0, 0)
        self.cp8_checked[0] += 1
        self.cp8_checked[1] += fleet.mismatched - bad0
        fleet.release(c, [(g.name, room) for room, _ in rooms])
        nbytes = R * (P * c.layout.kv_page_bytes() + c.layout.aux_row_bytes)
        out: dict[str, Any] = {"gbps": nbytes / dt / 1e9 if ok == R else None, "seconds": dt,
                               "stream_share": stream / nbytes, "bytes": nbytes, **rs}
        if d is not None:
            gb = nbytes / 1e9
            out["receiver_cpu_s_per_gb"] = d[0] / gb
            out["sender_cpu_s_per_gb"] = sum(d[1:]) / gb  # the eight ranks summed
            out["sender_cpu_s_per_gb_max_rank"] = max(d[1:]) / gb
        return out

    def _ds_state(self, slot: int) -> dict[str, Sequence[int]]:
        return {comp: [slot] for comp in self.ds.layout.state_components}  # type: ignore[union-attr]

    def dedup_on(self, cp: int) -> dict[str, Any]:
        return self._dedup_room(f"ds{cp}")

    def dedup_off(self, cp: int) -> dict[str, Any]:
        """The same room from a group with ``sender.dedup = false``: every rank ships the state."""
        return self._dedup_room(f"dsoff{cp}")

    def _dedup_room(self, name: str) -> dict[str, Any]:
        fleet, c = self.fleet, self.ds
        assert c is not None and c.dc is not None
        g = c.groups[name]
        n = c.cfg.demo.pages_per_room
        R = self.plan.dedup_rooms
        rooms = []
        for j in range(R):
            room = fleet.room_id()
            write_guard(g.pools[0], j, room)
            for r, pc in enumerate(g.pcs):
                pc.submit(room, 0, g.src_pages[r].tolist(), last=True, state=self._ds_state(0), aux_slot=j)
            rooms.append((room, c.dst_perm[j * n:(j + 1) * n]))
        fleet.poison(c, rooms[0][1], self._ds_state(0), 0)
        before = fleet.sent([g])
        t0 = time.perf_counter()
        for j, (room, dst) in enumerate(rooms):
            c.dc.expect(room, g.name, dst.tolist(), aux_slot=j, state=self._ds_state(j))
        ok = fleet.wait_all(c, [(g.name, room) for room, _ in rooms])
        dt = time.perf_counter() - t0
        after = fleet.sent([g])
        fleet.verify(c, g, rooms[0][1], g.src_pages, self._ds_state(0), self._ds_state(0), 0, 0)
        fleet.release(c, [(g.name, room) for room, _ in rooms])
        return {"seconds": dt / R if ok == R else None, "wire": after[0] - before[0], "skipped": after[1] - before[1],
                "rooms": R}

    def small(self, cp: int, prefix: str = "ds") -> dict[str, Any]:
        """One-page rooms with the aux row: latency one at a time, then rooms/s with many in flight
        (``prefix`` "dsmc": from the group the receiver reads with Mooncake TE)."""
        fleet, c = self.fleet, self.ds
        assert c is not None and c.dc is not None
        g = c.groups[f"{prefix}{cp}"]
        p = self.plan
        K = p.small_batch_rooms
        base = self.plan.dedup_rooms * c.cfg.demo.pages_per_room  # small rooms' pages follow the de-dup rooms'
        dst_pages = c.dst_perm[base:base + K]
        kv_src = g.pools[0].layout.kv_rows

        def src_page(r: int, i: int) -> int:
            return int(g.src_pages[r][i % len(g.src_pages[r])]) % kv_src

        def submit(i: int, slot: int) -> int:
            room = fleet.room_id()
            write_guard(g.pools[0], slot, room)
            for r, pc in enumerate(g.pcs):
                pc.submit(room, 0, [src_page(r, i)], last=True, aux_slot=slot)
            return room

        def check(i: int, slot: int) -> None:
            fleet.verify(c, g, np.array([dst_pages[slot]]), [np.array([src_page(r, i)]) for r in range(cp)],
                         {}, {}, slot, slot)

        # the engine API's own round trip (a ping), for reading the latencies below
        rtt = []
        for _ in range(20):
            t0 = time.perf_counter()
            c.dc.ping()
            rtt.append(time.perf_counter() - t0)
        # latency: one room at a time, the prefill side having submitted first
        lat = []
        for i in range(p.small_latency_rooms):
            slot = i % K
            room = submit(i, slot)
            verify = i % p.small_verify_every == 0
            if verify:
                fleet.poison(c, np.array([dst_pages[slot]]), {}, slot)
            t0 = time.perf_counter()
            c.dc.expect(room, g.name, [int(dst_pages[slot])], aux_slot=slot)
            st = c.dc.wait(room, g.name, p.room_timeout_s)
            t1 = time.perf_counter()
            if st.state is RoomState.SUCCESS:
                fleet.ok_rooms += 1
                lat.append(t1 - t0)
                if verify:
                    check(i, slot)
            else:
                fleet.failed_rooms[st.code or st.state.value] += 1
                log.error("bench: small room %d of %s ended %s: %s", room, g.name, st.state.value, st.reason)
            c.dc.release(room, g.name)
        self.latencies.setdefault(g.name, []).extend(lat)
        # throughput: K rooms in flight, the engines batching their calls (submit_many,
        # expect_many, wait_many: one round trip each instead of one per room)
        rooms = [fleet.room_id() for _ in range(K)]
        for i, room in enumerate(rooms):
            write_guard(g.pools[0], i, room)
        for r, pc in enumerate(g.pcs):
            pc.submit_many([dict(room=room, src_pages=[src_page(r, i)], last=True, aux_slot=i)
                            for i, room in enumerate(rooms)])
        for i in range(0, K, p.small_verify_every):
            fleet.poison(c, np.array([dst_pages[i]]), {}, i)
        assert c.rx is not None
        pids = [c.rx.proc.pid] + [pr.proc.pid for pr in g.procs]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        t0 = time.perf_counter()
        c.dc.expect_many([dict(room=room, group=g.name, dst_pages=[int(dst_pages[i])], aux_slot=i)
                          for i, room in enumerate(rooms)])
        ok = fleet.wait_all(c, [(g.name, room) for room in rooms])
        dt = time.perf_counter() - t0
        d = cpu_since(pids, cpu0)
        for i in range(0, K, p.small_verify_every):
            check(i, i)
        fleet.release(c, [(g.name, room) for room in rooms])
        out = {"rooms_per_s": K / dt if ok == K else None, "p50_ms": 1e3 * float(np.percentile(lat, 50)) if lat else None,
               "rpc_rtt_us": 1e6 * float(np.median(rtt))}
        if d is not None:  # the batch's CPU, per room: the receiver's, the ranks' summed
            out["receiver_cpu_us_per_room"] = 1e6 * d[0] / K
            out["sender_cpu_us_per_room"] = 1e6 * sum(d[1:]) / K
        return out

    def mooncake_tcp(self, key: str) -> dict[str, Any]:
        return self.limits.mooncake_tcp(key, self.notes)

    # -- rounds --------------------------------------------------------------------------
    def subjects(self) -> list[tuple[str, Subject]]:
        lim = self.limits
        out: list[tuple[str, Subject]] = []
        for key in SIZES:
            out.append((f"memcpy/{key}", partial(lim.memcpy, key)))
            out.append((f"pread/{key}", partial(lim.pread, key)))
            out.append((f"vm_read/{key}", partial(lim.vm_read, key)))
            out.append((f"raw_zmq/{key}", partial(lim.raw_zmq, key)))
            out.append((f"raw_tcp/{key}", partial(lim.raw_tcp, key)))
        for key in BULK_KEYS:
            out.append((f"bulk/{key}", partial(self.bulk_room, key)))
            out.append((f"bulk_shm/{key}", partial(self.bulk_room, key, "shm")))
        out.append(("bulk_zmq/1MiB", partial(self.bulk_room, "1MiB", "zmq")))
        out.append(("bulk_cp8/1MiB", self.bulk_cp8))  # the CP8 block: eight ranks beside eight raw connections
        out.append(("raw_tcp_x8/1MiB", partial(lim.raw_tcp_x8, "1MiB")))
        out.append(("raw_tcp_pair/1MiB", partial(lim.raw_tcp_pair, "1MiB")))  # in the 1 MiB block
        for cp in DEDUP_CPS:
            out.append((f"dedup_on/{cp}", partial(self.dedup_on, cp)))
            if cp > 1:
                out.append((f"dedup_off/{cp}", partial(self.dedup_off, cp)))
        for cp in SMALL_CPS:
            out.append((f"small/{cp}", partial(self.small, cp)))
        if lim.mooncake is not None:
            for key in SIZES:
                out.append((f"mooncake/{key}", partial(self.mooncake_tcp, key)))
            for key in BULK_KEYS:  # transferd's Mooncake plane on the same bytes as the raw peer
                out.append((f"bulk_mc/{key}", partial(self.bulk_room, key, "mooncake")))
            out.append(("small_mc/1", partial(self.small, 1, "dsmc")))
        if self.staging is not None:
            out.append(("staging_gather/1MiB", self.staging.gather))
            out.append(("staging_scatter/1MiB", self.staging.scatter))
        if self.sgl is not None:
            out.append(("e2e_backend/sglang", self.sgl.backend))
            out.append(("e2e_client/sglang", self.sgl.client))
        if self.only:
            out = [(n, fn) for n, fn in out if any(fnmatch.fnmatchcase(n, g) for g in self.only)]
        return out

    def run_rounds(self) -> None:
        self.limits.wait_ready(self.fleet.procs.check)
        subjects = self.subjects()
        fns = dict(subjects)
        rounds = schedule([n for n, _ in subjects], self.plan.repeats, self.plan.target_repeats)
        # a bar on a terminal only (the table and the JSON never mix with it)
        bar = progress_bar(enabled=self.progress, total=len(subjects) + sum(map(len, rounds)), unit="step",
                           desc="transferd bench", file=sys.stderr, leave=False)
        try:
            # one discarded pass: page-table faults of every daemon's first touch of its pool, TCP
            # slow start and lazy imports belong to no round (the bench's own mappings are already warm)
            for name, fn in subjects:
                bar.set_postfix_str(f"warm-up {name}", refresh=False)
                fn()
                bar.update(1)
            self.latencies = {}
            for k, names in enumerate(rounds):
                for name in names:
                    bar.set_postfix_str(f"round {k + 1}/{len(rounds)} {name}", refresh=False)
                    self.results.setdefault(name, []).append(fns[name]())
                    bar.update(1)
        finally:
            bar.close()

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.sgl is not None:
            self.sgl.close()
        self.limits.stop_sender()
        self.fleet.close_clients()
        self.limits.close()
        self.codes = self.fleet.stop()
        self.limits.remove_pool()
        self.fleet.remove_pools()
        if self.progress:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    def dump_logs(self) -> None:
        self.fleet.dump_logs()
