#!/usr/bin/env python3
"""How transferd's cost grows with the work: cp_size × rooms in flight, and two prefill groups.

    python scripts/scale.py                      # the full table (~90 s on 2 cores), from the repo root
    python scripts/scale.py --quick              # cp 1, 8 × 1, 64 rooms + the two groups (~20 s)
    python scripts/scale.py --json scale.json    # also write the numbers ("-": JSON on stdout, table on stderr)

Real daemons (``python -m transferd receiver|sender``) over TCP loopback, the same-host path off
(sender ``same_host = "off"``), metrics endpoints off, pools named ``transferd-scale<pid>-*`` in
/dev/shm. One receiver per cp_size (its concurrencies run in ascending order), and one receiver
fed by two groups of cp 2. A room is 8 scattered pages of 4 KV buffers × 64 KiB rows (one message
per row) plus the 64-byte aux row: 2 MiB + 64 B, the same bytes whatever the cp_size (each rank
sends its contiguous slice of the pages; rank 0 sends the aux row).

A *pass* at K rooms in flight runs waves until at least ``--min-rooms`` rooms moved: a wave submits
K rooms on every rank, expects them all, waits for all of them and releases them. Time is the sum
over waves of first ``expect`` → last ``Success``; CPU is the receiver's (and the senders') utime +
stime from /proc/<pid>/stat over the whole pass; RSS is the receiver's VmRSS / RssAnon / RssShmem
from /proc/<pid>/status sampled every 20 ms, the peak over the measured passes. Each configuration
runs one warm-up pass (discarded, but its rooms are checked too) and then ``--repeats`` passes;
figures are medians. In every wave room 0, every 16th room and the last room of each group are
compared byte for byte with the rows their ranks sent (destination rows poisoned first).

Built from ``transferd.tools.bench``'s daemons and checks (``Fleet``); docs/PERFORMANCE.md, "Scale",
describes the figures and a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

import numpy as np

from transferd.client import PrefillClient
from transferd.pool import Pool, shm_dir
from transferd.tools.bench import Cluster, Filler, Fleet, Group, KiB, cpu_seconds, host
from transferd.tools.rooms import write_guard

SCALE_VERSION = 1
ROW = "64KiB"  # transferd.tools.bench's bulk model: 4 MLA KV buffers, rows of 64 KiB, aux row of 64 B
PAGES = 8  # pages per room
SRC_PAGES = 128  # source pages per rank (rooms cycle through a random permutation of them)
VERIFY_EVERY = 16
FULL = {"cps": (1, 2, 4, 8), "rooms": (1, 16, 64, 256), "min_rooms": 128, "pairs": 64}
QUICK = {"cps": (1, 8), "rooms": (1, 64), "min_rooms": 64, "pairs": 64}


def _status_kb(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


class _RssPeak:
    """Samples one process's /proc/<pid>/status in a thread; keeps the peak of each figure (kB)."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for k, v in _status_kb(self.pid).items():
            self.peak[k] = max(self.peak.get(k, 0), v)

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _med(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def _rnd(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


class Phase:
    """One receiver, its groups (name → cp) and the configurations run against it."""

    def __init__(self, name: str, groups: dict[str, int], max_rooms_per_group: int, run_dir: Path, tag: str,
                 repeats: int) -> None:
        self.name = name
        self.repeats = repeats
        run_dir.mkdir(parents=True, exist_ok=True)
        self.fleet = Fleet(run_dir, tag, room_timeout_s=120.0)
        self.spec = groups
        self.max_k = max_rooms_per_group
        self.c: Cluster | None = None
        self.groups: list[Group] = []
        self.passes = 0

    # -- start-up (the steps of transferd.tools.bench's Bench.start, for one cluster) -------------
    def start(self) -> None:
        b = self.fleet
        deadline = time.monotonic() + 180.0
        rx_pages = self.max_k * len(self.spec) * PAGES
        aux = self.max_k * len(self.spec)
        c = b.cluster(self.name, b.write_bulk_config(ROW), (rx_pages, 0, aux), (SRC_PAGES, 0, self.max_k))
        self.c = c
        b.answer(c, deadline)
        dc = c.dc
        assert dc is not None
        for gname, cp in self.spec.items():
            self.groups.append(b.group(c, gname, cp, same_host=False))
        for g in self.groups:
            g.pcs = [PrefillClient(g.cfg.sender_engine_socket(r), timeout_s=2.0) for r in range(g.cp)]
        b.registered(self.groups, deadline)
        c.dpool = Pool.attach(c.cfg.receiver_pool_name())
        for rows in c.dpool.rows:  # touched once, like a warm engine's pool
            rows[:] = 0
        rng = np.random.default_rng(29)
        for gi, g in enumerate(self.groups):
            g.pools = [Pool.attach(g.cfg.sender_pool_name(r)) for r in range(g.cp)]
            for r, pool in enumerate(g.pools):
                for buf in pool.layout.indices("kv"):
                    Filler(5000 + 100 * gi + 10 * r + buf).rows(pool.rows[buf], range(pool.layout.kv_rows))
                g.src_pages.append(rng.permutation(pool.layout.kv_rows))
        c.dst_perm = rng.permutation(c.layout.kv_rows)
        c.pages = PAGES
        dc.timeout_s = 60.0
        for g in self.groups:
            for pc in g.pcs:
                pc.timeout_s = 60.0

    @property
    def rx_pid(self) -> int:
        assert self.c is not None and self.c.rx is not None
        return self.c.rx.proc.pid

    # -- one pass -----------------------------------------------------------------------------
    def one_pass(self, k: int, waves: int) -> dict[str, Any]:
        b, c = self.fleet, self.c
        assert c is not None and c.dc is not None
        dc = c.dc
        room_bytes = PAGES * c.layout.kv_page_bytes() + c.layout.aux_row_bytes
        tx_pids = [p.proc.pid for g in self.groups for p in g.procs]
        frames0 = int(dc.stats()["frames"])
        cpu0 = cpu_seconds(self.rx_pid)
        tx0 = [cpu_seconds(p) for p in tx_pids]
        seconds, ok, total, verified0, mism0 = 0.0, 0, 0, b.verified_rooms, b.mismatched
        for w in range(waves):
            rooms: list[tuple[int, Group, int, np.ndarray, list[np.ndarray], int, int]] = []
            base = (self.passes * waves + w) * k
            for j in range(k):  # expects alternate between groups, so the groups run side by side
                for gi, g in enumerate(self.groups):
                    room = b.room_id()
                    d0 = (gi * k + j) * PAGES
                    dst = c.dst_perm[d0:d0 + PAGES]
                    idx = ((base + j) * PAGES + np.arange(PAGES)) % SRC_PAGES
                    srcs = [g.src_pages[r][idx] for r in range(g.cp)]
                    rooms.append((room, g, j, dst, srcs, gi * k + j, j))
            for room, g, j, dst, srcs, aux_dst, aux_src in rooms:
                write_guard(g.pools[0], aux_src, room)
                for r, pc in enumerate(g.pcs):
                    pc.submit(room, 0, srcs[r].tolist(), last=True, aux_slot=aux_src)
            check = [r for r in rooms if r[2] % VERIFY_EVERY == 0 or r[2] == k - 1]
            for room, g, j, dst, srcs, aux_dst, aux_src in check:
                b.poison(c, dst, {}, aux_dst)
            t0 = time.perf_counter()
            for room, g, j, dst, srcs, aux_dst, aux_src in rooms:
                dc.expect(room, g.name, dst.tolist(), aux_slot=aux_dst)
            ok += b.wait_all(c, [(g.name, room) for room, g, *_ in rooms])
            seconds += time.perf_counter() - t0
            total += len(rooms)
            for room, g, j, dst, srcs, aux_dst, aux_src in check:
                b.verify(c, g, dst, srcs, {}, {}, aux_dst, aux_src)
            b.release(c, [(g.name, room) for room, g, *_ in rooms])
        cpu1 = cpu_seconds(self.rx_pid)
        tx1 = [cpu_seconds(p) for p in tx_pids]
        frames = int(dc.stats()["frames"]) - frames0
        self.passes += 1
        gb = total * room_bytes / 1e9
        out: dict[str, Any] = {
            "rooms": total, "rooms_ok": ok, "bytes": total * room_bytes, "seconds": seconds,
            "gbps": gb / seconds if ok == total else None, "rooms_per_s": total / seconds if ok == total else None,
            "receiver_cpu_s": None, "receiver_cpu_s_per_gb": None, "sender_cpu_s_per_gb": None,
            "receiver_data_frames_per_room": frames / total,
            "verified_rooms": b.verified_rooms - verified0, "mismatched_bytes": b.mismatched - mism0,
        }
        if cpu0 is not None and cpu1 is not None:
            out["receiver_cpu_s"] = cpu1 - cpu0
            out["receiver_cpu_s_per_gb"] = (cpu1 - cpu0) / gb
        if None not in tx0 and None not in tx1:
            out["sender_cpu_s_per_gb"] = sum(t1 - t0 for t0, t1 in zip(tx0, tx1)) / gb  # type: ignore[operator]
        return out

    def config(self, k: int, min_rooms: int) -> dict[str, Any]:
        """One warm-up pass (discarded), then ``repeats`` measured passes; medians and the RSS peak."""
        per_wave = k * len(self.groups)
        waves = max(1, -(-min_rooms // per_wave))
        warm = self.one_pass(k, waves)
        with _RssPeak(self.rx_pid) as rss:
            runs = [self.one_pass(k, waves) for _ in range(self.repeats)]
        all_runs = [warm, *runs]
        return {
            "cp_size": self.groups[0].cp, "groups": len(self.groups), "rooms_per_group": k,
            "rooms_in_flight": per_wave, "waves_per_pass": waves, "rooms_per_pass": waves * per_wave,
            "gbps": _rnd(_med([r["gbps"] for r in runs]), 3),
            "rooms_per_s": _rnd(_med([r["rooms_per_s"] for r in runs]), 1),
            "receiver_cpu_s_per_gb": _rnd(_med([r["receiver_cpu_s_per_gb"] for r in runs]), 3),
            "sender_cpu_s_per_gb": _rnd(_med([r["sender_cpu_s_per_gb"] for r in runs]), 3),
            "receiver_vmrss_mib_peak": _rnd(rss.peak.get("VmRSS", 0) / KiB, 1) if rss.peak else None,
            "receiver_rssanon_mib_peak": _rnd(rss.peak.get("RssAnon", 0) / KiB, 1) if rss.peak else None,
            "receiver_rssshmem_mib_peak": _rnd(rss.peak.get("RssShmem", 0) / KiB, 1) if rss.peak else None,
            "receiver_data_frames_per_room": _rnd(_med([r["receiver_data_frames_per_room"] for r in runs]), 2),
            "rooms": sum(r["rooms"] for r in all_runs), "rooms_ok": sum(r["rooms_ok"] for r in all_runs),
            "all_ok": all(r["rooms_ok"] == r["rooms"] for r in all_runs),
            "verified_rooms": sum(r["verified_rooms"] for r in all_runs),
            "mismatched_bytes": sum(r["mismatched_bytes"] for r in all_runs),
            "loadavg_1m": _rnd(os.getloadavg()[0], 2),
            "passes": [{k2: (_rnd(v, 4) if isinstance(v, float) else v) for k2, v in r.items()} for r in runs],
            "warmup": {k2: (_rnd(v, 4) if isinstance(v, float) else v) for k2, v in warm.items()},
        }

    def close(self) -> dict[str, int | None]:
        self.fleet.close_clients()
        codes = self.fleet.stop()
        self.fleet.remove_pools()
        return {k: v for k, v in codes.items() if v not in (0, None)}


# -- output -------------------------------------------------------------------------------------

def _f(x: Any, fmt: str) -> str:
    return "—" if x is None else fmt.format(x)


def format_table(out: dict[str, Any]) -> str:
    h = out["host"]
    r0 = out["room"]
    lines = [f"transferd scale ({'quick' if out['quick'] else 'full'}): TCP loopback, same-host off; room = "
             f"{r0['pages']} scattered pages × {r0['kv_buffers']} KV buffers × {r0['row_bytes'] // KiB} KiB rows + "
             f"{r0['aux_bytes']} B aux ({r0['room_bytes'] / 1e6:.2f} MB); median of {out['repeats']} passes after "
             f"one warm-up; {h['cpus']} CPUs, load {h['loadavg_before']} → {h['loadavg']}; "
             f"{out['seconds']:.0f} s", "",
             "| cp | groups | rooms in flight | rooms/pass | GB/s | rooms/s | rx CPU s/GB | tx CPU s/GB (all ranks) "
             "| rx VmRSS MiB (peak) | rx RssAnon MiB (peak) | rooms ok | verified rooms / mismatched B |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in out["rows"]:
        cp = " + ".join([str(r["cp_size"])] * r["groups"])  # two groups of cp 2: "2 + 2"
        inflight = (f"{r['groups']} × {r['rooms_per_group']}" if r["groups"] > 1 else str(r["rooms_in_flight"]))
        lines.append(
            f"| {cp} | {r['groups']} | {inflight} | {r['rooms_per_pass']} | {_f(r['gbps'], '{:.2f}')} | "
            f"{_f(r['rooms_per_s'], '{:.0f}')} | {_f(r['receiver_cpu_s_per_gb'], '{:.2f}')} | "
            f"{_f(r['sender_cpu_s_per_gb'], '{:.2f}')} | {_f(r['receiver_vmrss_mib_peak'], '{:.0f}')} | "
            f"{_f(r['receiver_rssanon_mib_peak'], '{:.0f}')} | {r['rooms_ok']}/{r['rooms']} | "
            f"{r['verified_rooms']} / {r['mismatched_bytes']} |")
    lines.append("")
    lines.append(f"rooms: {out['rooms_ok']} ok, {out['rooms_failed']} failed; {out['verified_rooms']} verified byte "
                 f"for byte, {out['mismatched_bytes']} mismatched bytes")
    return "\n".join(lines)


# -- entry point --------------------------------------------------------------------------------

def _csv_ints(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"needs integers >= 1: {s!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="cp 1, 8 × 1, 64 rooms and the two groups: < 60 s")
    ap.add_argument("--json", metavar="PATH", help="write the numbers here ('-': stdout, the table then on stderr)")
    ap.add_argument("--repeats", type=int, default=3, help="measured passes per configuration (default 3)")
    ap.add_argument("--cps", type=_csv_ints, help="cp sizes (default 1,2,4,8; quick 1,8)")
    ap.add_argument("--rooms", type=_csv_ints, help="rooms in flight (default 1,16,64,256; quick 1,64)")
    ap.add_argument("--min-rooms", type=int, help="rooms per pass at least (waves of K; default 128, quick 64)")
    ap.add_argument("--pair-rooms", type=int, help="rooms in flight per group, two groups of cp 2 (default 64; "
                                                   "0 = skip)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    plan = dict(QUICK if args.quick else FULL)
    for key, val in (("cps", args.cps), ("rooms", args.rooms), ("min_rooms", args.min_rooms),
                     ("pairs", args.pair_rooms)):
        if val is not None:
            plan[key] = val
    rooms = tuple(sorted(plan["rooms"]))
    table_out = sys.stderr if args.json == "-" else sys.stdout

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    t_start = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    tag = f"scale{os.getpid()}"
    run_dir = Path(tempfile.mkdtemp(prefix="transferd-scale-"))
    phases: list[tuple[str, dict[str, int], tuple[int, ...]]] = [(f"cp{cp}", {f"c{cp}": cp}, rooms)
                                                                  for cp in plan["cps"]]
    if plan["pairs"]:
        phases.append(("pair", {"ga": 2, "gb": 2}, (int(plan["pairs"]),)))
    rows: list[dict[str, Any]] = []
    codes: dict[str, int | None] = {}
    room_info: dict[str, Any] = {}
    failed = False
    try:
        for name, groups, ks in phases:
            ph = Phase(name, groups, max(ks), run_dir / name, f"{tag}-{name}", args.repeats)
            bad = False
            try:
                ph.start()
                assert ph.c is not None
                lay = ph.c.layout
                room_info = {"pages": PAGES, "kv_buffers": len(lay.indices("kv")), "row_bytes": 64 * KiB,
                             "aux_bytes": lay.aux_row_bytes,
                             "room_bytes": PAGES * lay.kv_page_bytes() + lay.aux_row_bytes,
                             "data_messages_per_room": PAGES * len(lay.indices("kv")) + 1,
                             "source_pages_per_rank": SRC_PAGES}
                for k in ks:
                    row = ph.config(k, int(plan["min_rooms"]))
                    rows.append(row)
                    print(f"[scale] {name} rooms {row['rooms_in_flight']}: {_f(row['gbps'], '{:.2f}')} GB/s, "
                          f"{_f(row['receiver_cpu_s_per_gb'], '{:.2f}')} rx CPU s/GB, "
                          f"{row['rooms_ok']}/{row['rooms']} ok ({time.monotonic() - t_start:.0f} s)",
                          file=sys.stderr, flush=True)
                    if not row["all_ok"] or row["mismatched_bytes"]:
                        bad = failed = True
            except Exception:
                bad = True
                raise
            finally:
                if bad:  # the daemons' last log lines
                    ph.fleet.dump_logs()
                codes.update({f"{name}/{k}": v for k, v in ph.close().items()})
    except KeyboardInterrupt:
        print("scale: interrupted", file=sys.stderr)
        return 130
    finally:
        for f in shm_dir().glob(f"transferd-{tag}-*"):
            f.unlink(missing_ok=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    host_info = host()
    host_info["loadavg_before"] = load_before
    out: dict[str, Any] = {
        "scale_version": SCALE_VERSION, "quick": args.quick, "repeats": args.repeats, "host": host_info,
        "room": room_info, "min_rooms_per_pass": plan["min_rooms"], "verify_every": VERIFY_EVERY,
        "rows": rows,
        "rooms_ok": sum(r["rooms_ok"] for r in rows),
        "rooms_failed": sum(r["rooms"] - r["rooms_ok"] for r in rows),
        "verified_rooms": sum(r["verified_rooms"] for r in rows),
        "mismatched_bytes": sum(r["mismatched_bytes"] for r in rows),
        "daemon_exit_codes": codes,
        "seconds": round(time.monotonic() - t_start, 1),
    }
    print(format_table(out), file=table_out, flush=True)
    if args.json == "-":
        print(json.dumps(out, indent=2), flush=True)
    elif args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if failed or out["rooms_failed"] or out["mismatched_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())
