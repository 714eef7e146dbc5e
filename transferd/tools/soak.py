"""``transferd soak``: rooms without pause for minutes or hours through real daemons, while the
fault kinds of :mod:`.faults` are injected one after another; every room verified byte for byte.

Two fleets (a receiver and ``cp_size`` senders each, as ``transferd demo`` starts them) run rooms
side by side, each in its own thread, each through a :class:`~.demo.RoomRunner`:

* the **steady** fleet lives from start to end. Its faults leave its processes alive: a hostile
  peer floods the receiver's ZeroMQ port with garbage, a sender is paused (SIGSTOP for longer
  than the heartbeat deadline, then SIGCONT). Its daemons' memory and descriptors at the start
  and the end are the soak's leak check.
* the **chaos** fleet takes the faults that end processes or need another daemon configuration:
  a sender is killed and restarted, the receiver is killed and restarted at once, and for
  ``drop-frames``, ``corrupt-frames`` and ``slow-receiver`` (``[faults]`` settings a daemon reads
  at start) the whole fleet is restarted with the setting, runs a batch, and is restarted without.

One fault is active at a time. Each is followed by a batch of rooms on the same fleet with the
fault gone, all of which must succeed. docs/FAULTS.md ("Soak") describes the report.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..config import Config, load
from ..pool.shm import shm_dir
from .demo import DemoRoom, RoomRunner, Summary, child_env, say_overridden
from .faults import FAULT_KINDS, Fault
from .launcher import Launcher
from .ops import table, write_json
from .procs import dump_logs, usage

log = logging.getLogger(__name__)

CYCLE = ("kill-sender", "drop-frames", "hostile-flood", "restart-receiver", "corrupt-frames", "pause-sender",
         "slow-receiver")
"""The order of the fault kinds, over and over; a kind of each fleet in turn, the costly
restarts of the chaos fleet spread out, every kind within the first minute."""

STEADY = frozenset({"hostile-flood", "pause-sender"})
"""The kinds injected into the steady fleet: they leave its processes alive."""

ARGS = {"drop-frames": 0.05, "corrupt-frames": 0.05, "slow-receiver": 5.0, "hostile-flood": 20_000.0}
"""The argument of each kind that takes no rank."""

CLOCKS = {  # a dead peer is seen within 2 s (a loaded 2-core host stays clear of it); a stall in 5 s
    "TRANSFERD_RECEIVER_HEARTBEAT_INTERVAL_S": "0.25", "TRANSFERD_SENDER_HEARTBEAT_INTERVAL_S": "0.25",
    "TRANSFERD_RECEIVER_HEARTBEAT_MISSES": "8", "TRANSFERD_SENDER_HEARTBEAT_MISSES": "8",
    "TRANSFERD_RECEIVER_STALL_TIMEOUT_S": "5",
}
ENGINE_TIMEOUT_S = 5.0  # the synthetic engines' API calls


def fleet_env(cfg_path: str | None, base: Config, run_dir: str, tag: str, faults: Sequence[Fault] = (),
              starts: int = 0) -> dict[str, str]:
    """A fleet's daemons' environment: the demo's (:func:`.demo.child_env`), the soak's clocks and
    the faults' seed of this start."""
    env = child_env(cfg_path, base, run_dir, tag, faults)
    env.update(CLOCKS)
    env["TRANSFERD_FAULTS_SEED"] = str(starts)
    return env
ROOM_TIMEOUT_S = 30.0  # demo.timeout_s: a room with no outcome by then counts as failed (demo_timeout)


def schedule(cp_size: int) -> Iterator[Fault]:
    """The faults the soak injects, in order, without end: :data:`CYCLE` again and again; the
    killed sender's rank and the paused one's go round the ranks, one step per cycle."""
    for n in itertools.count():
        for kind in CYCLE:
            if kind == "kill-sender":
                yield Fault(kind, n % cp_size)
            elif kind == "pause-sender":
                yield Fault(kind, (n + 1) % cp_size)
            else:
                yield Fault(kind, ARGS.get(kind, 0.0))


def fleet_of(f: Fault) -> str:
    """``steady`` or ``chaos``: which fleet takes fault ``f``."""
    return "steady" if f.kind in STEADY else "chaos"


def outcomes(rooms: list[DemoRoom]) -> dict[str, Any]:
    """``{"ok": n, "failed": {code: n}}`` of a batch."""
    failed = Counter(r.code or "failed" for r in rooms if r.status != "success")
    return {"ok": sum(r.status == "success" for r in rooms), "failed": dict(sorted(failed.items()))}


def recovered(record: dict[str, Any]) -> bool:
    """A fault was recovered from: rooms ran on its fleet after it, and every one succeeded."""
    after = record["after"]
    return after["ok"] > 0 and not after["failed"]


@dataclass
class Job:
    fault: Fault
    at_s: float
    done: threading.Event = field(default_factory=threading.Event)
    record: dict[str, Any] = field(default_factory=dict)


class FleetLoop(threading.Thread):
    """One fleet: starts its daemons, runs batches of rooms until told to stop, injects the faults
    handed to it between two batches; samples its daemons after the first batch and at the end."""

    def __init__(self, name: str, soak: Soak) -> None:
        super().__init__(name=f"soak-{name}", daemon=True)
        self.fleet, self.soak = name, soak
        self.summary = Summary(cp_size=soak.base.sender.cp_size, split=soak.base.split.value)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.launcher: Launcher | None = None
        self.runner: RoomRunner | None = None
        self.starts = 0
        self.start_sample: dict[str, dict[str, Any]] = {}
        self.end_sample: dict[str, dict[str, Any]] = {}
        self.exit_codes: dict[str, int | None] = {}
        self.batches = 0

    # -- the fleet's daemons -------------------------------------------------------------
    def up(self, faults: tuple[Fault, ...] = ()) -> None:
        """Start the fleet's daemons (with ``faults``' ``[faults]`` settings) and a runner on them."""
        soak = self.soak
        run_dir = soak.run_dir / self.fleet
        env = fleet_env(soak.cfg_path, soak.base, str(run_dir), f"{soak.tag}-{self.fleet}", faults, self.starts)
        cfg = load(soak.cfg_path, env=env)
        cfg = cfg.with_overrides("demo", **{k: getattr(soak.base.demo, k) for k in soak.base.demo.__dataclass_fields__})
        cfg = cfg.with_overrides("demo", timeout_s=ROOM_TIMEOUT_S)
        self.launcher = Launcher(cfg, soak.cfg_path, env=env, log_dir=run_dir / "logs", max_restarts=1_000_000)
        self.launcher.start()
        self.runner = RoomRunner(cfg, self.launcher, self.summary, engine_timeout_s=ENGINE_TIMEOUT_S,
                                 seed=soak.base.demo.seed + 7919 * self.starts + (0 if self.fleet == "steady" else 1))
        self.starts += 1

    def down(self) -> None:
        """Check the pools for bytes written outside the rooms, then stop the daemons."""
        if self.runner is not None:
            self.summary.stray_bytes += self.runner.stray_bytes()
            self.runner.close()
            self.runner = None
        if self.launcher is not None:
            codes = self.launcher.stop()
            self.exit_codes.update({k: v for k, v in codes.items() if v not in (0, None)})
            self.launcher = None

    def sample(self) -> dict[str, dict[str, Any]]:
        """Each daemon's pid, memory (kB) and open descriptors now (:func:`~.procs.usage`)."""
        out: dict[str, dict[str, Any]] = {}
        assert self.launcher is not None
        for c in self.launcher.children:
            if c.proc is not None and c.proc.poll() is None:
                u = usage(c.proc.pid)
                if u is not None:
                    out[c.label] = {"pid": c.proc.pid, **u}
        return out

    # -- rooms and faults ---------------------------------------------------------------
    def batch(self, inject: Any = None) -> list[DemoRoom]:
        assert self.runner is not None
        self.batches += 1
        return self.runner.batch(self.soak.base.demo.in_flight, inject)

    def run(self) -> None:
        try:
            self.up()
            self.batch()  # warm-up: the allocators' and ZeroMQ's first buffers
            self.start_sample = self.sample()
            self.ready.set()
            while not self.stopping.is_set():
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    self.batch()
                    continue
                try:
                    self.inject(job)
                finally:
                    job.done.set()
            self.end_sample = self.sample()
        except BaseException as exc:  # handed to the main thread
            self.error = exc
            self.ready.set()
        finally:
            try:
                self.down()
            except BaseException as exc:
                self.error = self.error or exc

    def inject(self, job: Job) -> None:
        """The fault's batch (a process fault injected while its rooms are in flight; a
        configuration fault on daemons restarted with it), recovery, then a batch without it."""
        f = job.fault
        rec = job.record
        rec.update(fault=str(f), kind=f.kind, fleet=self.fleet, at_s=round(job.at_s, 3), detail={})
        t0 = time.monotonic()
        if f.process:
            runner = self.runner
            assert runner is not None

            def hit() -> None:
                rec["detail"] = runner.inject(f, restart_now=True)

            during = self.batch(hit)
            runner.recover()
        else:
            log.warning("injecting fault %s (restarting the %s fleet with it)", f, self.fleet)
            t = [time.monotonic()]
            self.down()
            t.append(time.monotonic())
            self.up((f,))
            t.append(time.monotonic())
            during = self.batch()
            t.append(time.monotonic())
            self.down()
            t.append(time.monotonic())
            self.up()
            t.append(time.monotonic())
            steps = ("stop", "start_with_it", "batch", "stop_again", "start_without")
            rec["detail"] = {"setting": FAULT_KINDS[f.kind].setting,
                             "steps_s": {k: round(b - a, 2) for k, (a, b) in zip(steps, itertools.pairwise(t))}}
        rec["during"] = outcomes(during)
        rec["after"] = outcomes(self.batch())
        rec["recovered"] = recovered(rec)
        rec["seconds"] = round(time.monotonic() - t0, 3)


@dataclass(frozen=True)
class Soak:
    """What both fleets share: the configuration, the run directory, the pool files' tag."""

    base: Config
    cfg_path: str | None
    run_dir: Path
    tag: str


def run_soak(base: Config, cfg_path: str | None, seconds: float, json_path: str | None = None) -> int:
    """Run the soak for ``seconds`` (the fault under way then is finished); print the table (to
    stderr when the JSON goes to stdout) and write the JSON. 0 when it passed (:func:`passed`),
    1 when not, 130 when interrupted."""
    t_start = time.monotonic()
    tag = f"soak{os.getpid()}x{secrets.token_hex(2)}"  # names this run's pool files

    def interrupted(signum: int, frame: Any) -> None:  # SIGTERM/SIGHUP: stop the daemons, report
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    if not base.sender.dedup:
        print("transferd soak: sender.dedup = false is a comparison setting; the soak verifies exactly-once "
              "delivery and runs with the de-dup on", file=sys.stderr)
        return 2
    out = sys.stderr if json_path == "-" else sys.stdout
    say_overridden("soak", fleet_env(cfg_path, base, "", tag))
    records: list[dict[str, Any]] = []
    interrupt = False
    with tempfile.TemporaryDirectory(prefix="transferd-soak-") as tmp:
        soak = Soak(base, cfg_path, Path(tmp), tag)
        loops = {name: FleetLoop(name, soak) for name in ("steady", "chaos")}
        t0 = time.monotonic()
        try:
            for lp in loops.values():
                lp.start()
            for lp in loops.values():
                lp.ready.wait()
            t0 = time.monotonic()
            if not _broken(loops):
                print(f"transferd soak: {len(loops)} fleets up; {seconds:g}s of rooms and faults (tag {tag})",
                      file=sys.stderr, flush=True)
            for f in schedule(base.sender.cp_size):
                if time.monotonic() - t0 >= seconds or _broken(loops):
                    break
                job = Job(f, time.monotonic() - t0)
                loops[fleet_of(f)].jobs.put(job)
                while not job.done.wait(0.5) and not _broken(loops):
                    pass
                if "after" in job.record:
                    records.append(job.record)
                    _progress(job.record)
        except KeyboardInterrupt:
            interrupt = True
            print("transferd soak: interrupted; stopping the fleets", file=sys.stderr, flush=True)
        finally:
            soaked = time.monotonic() - t0
            for lp in loops.values():
                lp.stopping.set()
            for lp in loops.values():
                lp.join()
        leaked = sorted(p.name for p in shm_dir().glob(f"transferd-{tag}-*"))
        for name in leaked:  # report them, then do not leave them behind
            (shm_dir() / name).unlink(missing_ok=True)
        errors = {n: repr(lp.error) for n, lp in loops.items() if lp.error is not None}
        if errors or not _passed_rooms(loops):
            for lp in loops.values():
                dump_logs(Path(tmp) / lp.fleet / "logs", f"{lp.fleet}/")
    report = _report(base, loops, records, leaked, seconds, soaked, time.monotonic() - t_start, tag, errors, interrupt)
    _print(report, out)
    if json_path:
        write_json(report, json_path)
    if interrupt:
        return 130
    return 0 if report["passed"] else 1


def _broken(loops: dict[str, FleetLoop]) -> bool:
    """A fleet broke down (its thread ended with an error); the soak stops and reports it."""
    return any(lp.error is not None or not lp.is_alive() for lp in loops.values())


def _passed_rooms(loops: dict[str, FleetLoop]) -> bool:
    return not any(lp.summary.corrupted_rooms or lp.summary.mismatched_bytes or lp.summary.stray_bytes
                   for lp in loops.values())


def _progress(rec: dict[str, Any]) -> None:
    d, a = rec["during"], rec["after"]
    failed = ", ".join(f"{k} {v}" for k, v in d["failed"].items()) or "none failed"
    print(f"transferd soak: {rec['at_s']:7.1f}s {rec['fault']} ({rec['fleet']}): {d['ok']} ok, {failed}; "
          f"after it {a['ok']} ok, {sum(a['failed'].values())} failed", file=sys.stderr, flush=True)


def _daemons(loops: dict[str, FleetLoop]) -> list[dict[str, Any]]:
    rows = []
    for name, lp in loops.items():
        for label in sorted(set(lp.start_sample) | set(lp.end_sample), key=lambda x: (x != "receiver", x)):
            s, e = lp.start_sample.get(label, {}), lp.end_sample.get(label, {})
            row = {"fleet": name, "daemon": label, "pid_start": s.get("pid"), "pid_end": e.get("pid"),
                   "long_lived": bool(s) and s.get("pid") == e.get("pid")}
            for k in ("rss_kb", "rss_anon_kb", "rss_shmem_kb", "fds"):
                row[f"{k}_start"], row[f"{k}_end"] = s.get(k), e.get(k)
            rows.append(row)
    return rows


def _report(base: Config, loops: dict[str, FleetLoop], records: list[dict[str, Any]], leaked: list[str],
            asked: float, soaked: float, total: float, tag: str, errors: dict[str, str],
            interrupt: bool) -> dict[str, Any]:
    by_reason: Counter[str] = Counter()
    for lp in loops.values():
        by_reason.update(lp.summary.rooms_failed_by_reason)
    s = {k: sum(getattr(lp.summary, k) for lp in loops.values())
         for k in ("rooms_ok", "rooms_failed", "corrupted_rooms", "mismatched_bytes", "stray_bytes")}
    kinds = sorted({r["kind"] for r in records})
    report: dict[str, Any] = {
        "seconds_asked": asked, "seconds_soaked": round(soaked, 3), "seconds": round(total, 3), "tag": tag,
        "cp_size": base.sender.cp_size, "split": base.split.value, **s,
        "rooms_failed_by_reason": dict(sorted(by_reason.items())),
        "rooms_by_fleet": {n: {"ok": lp.summary.rooms_ok, "failed": lp.summary.rooms_failed, "batches": lp.batches,
                               "starts": lp.starts} for n, lp in loops.items()},
        "faults_injected": records, "fault_kinds": kinds,
        "recovered": bool(records) and all(r["recovered"] for r in records),
        "daemons": _daemons(loops), "leaked_shm_files": leaked,
        "daemon_exit_codes": {f"{n}/{k}": v for n, lp in loops.items() for k, v in lp.exit_codes.items()},
        "errors": errors, "interrupted": interrupt,
    }
    report["passed"] = passed(report)
    return report


def passed(r: dict[str, Any]) -> bool:
    """No room reported success with wrong bytes, nothing written outside the rooms, no pool file
    of this run left under /dev/shm, faults were injected and rooms succeeded after every one, and
    neither fleet broke down."""
    return (r["corrupted_rooms"] == 0 and r["mismatched_bytes"] == 0 and r["stray_bytes"] == 0
            and not r["leaked_shm_files"] and r["recovered"] and not r["errors"] and not r["interrupted"])


def _mb(kb: int | None) -> str:
    return "-" if kb is None else f"{kb / 1024:.1f}"


def _print(r: dict[str, Any], out: TextIO) -> None:
    print(f"transferd soak: {r['seconds_soaked']:.0f}s of faults and rooms (asked {r['seconds_asked']:g}s; "
          f"{r['seconds']:.0f}s in all), cp_size {r['cp_size']}, split {r['split']} — "
          f"{'PASS' if r['passed'] else 'FAIL'}", file=out)
    failed = ", ".join(f"{k} {v}" for k, v in r["rooms_failed_by_reason"].items())
    print(f"  rooms:     {r['rooms_ok']} ok, {r['rooms_failed']} failed{': ' + failed if failed else ''}", file=out)
    print(f"  verified:  {r['corrupted_rooms']} corrupted rooms, {r['mismatched_bytes']} mismatched bytes, "
          f"{r['stray_bytes']} stray bytes, {len(r['leaked_shm_files'])} leaked pool files", file=out)
    recs = r["faults_injected"]
    print(f"  faults:    {len(recs)} injected, {len(r['fault_kinds'])} kinds; "
          f"{'rooms succeeded after every one' if r['recovered'] else 'NOT recovered after every one'}", file=out)
    rows = [["AT", "FLEET", "FAULT", "DURING: OK", "FAILED BY CODE", "AFTER: OK", "FAILED"]]
    for rec in recs:
        d, a = rec["during"], rec["after"]
        rows.append([f"{rec['at_s']:.1f}s", rec["fleet"], rec["fault"], str(d["ok"]),
                     ", ".join(f"{k} {v}" for k, v in d["failed"].items()) or "-", str(a["ok"]),
                     str(sum(a["failed"].values()))])
    for line in table(rows):
        print("  " + line, file=out)
    rows = [["FLEET", "DAEMON", "PID", "RSS MB", "OF IT ANON", "SHMEM", "FDS"]]
    for d in r["daemons"]:
        pid = str(d["pid_start"]) if d["long_lived"] else f"{d['pid_start']} -> {d['pid_end']}"
        rows.append([d["fleet"], d["daemon"], pid] + [f"{_mb(d[k + '_start'])} -> {_mb(d[k + '_end'])}" for k in
                                                      ("rss_kb", "rss_anon_kb", "rss_shmem_kb")]
                    + [f"{d['fds_start']} -> {d['fds_end']}"])
    print("  daemons, start -> end (start: after the first batch; two pids: restarted by faults; SHMEM: the pool "
          "pages it touched, up to the pool's size):", file=out)
    for line in table(rows):
        print("  " + line, file=out)
    if r["leaked_shm_files"]:
        print("  leaked:    " + ", ".join(r["leaked_shm_files"]), file=out)
    if r["daemon_exit_codes"]:
        print("  exit:      " + ", ".join(f"{k} {v}" for k, v in r["daemon_exit_codes"].items()), file=out)
    for name, err in r["errors"].items():
        print(f"  error:     {name}: {err}", file=out)
