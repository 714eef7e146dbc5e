"""``transferd demo``: real daemons, synthetic engines, every byte verified.

Starts a receiver and ``cp_size`` sender processes, fills every rank's source pool with different
random bytes (so the check also proves *which* rank each byte came from) and the decode pool with
a known pattern, runs rooms (several chunks each, some with prefix pages, some whose last chunk
carries no pages, some submitted before the decode side expected them), then compares the decode
pool with what the policy says must have arrived — and checks that no other row changed.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..client import DecodeClient, PrefillClient
from ..config import ENV_NOT_SETTINGS, Config, ReceiverConfig, SenderConfig, load
from ..errors import ClientTimeout, ConfigError, TransferdError, UnknownRoom
from ..layout import KINDS
from ..pool.shm import Pool, shm_dir
from .faults import FAULT_KINDS, PAUSE_S, Fault, HostilePeer, parse_fault
from .launcher import Launcher
from .ops import write_json
from .procs import dump_logs
from .progress import progress_bar
from .rooms import Room, mismatches, write_guard

log = logging.getLogger(__name__)

PATHS = ("zmq", "stream", "same_host", "mooncake", "nixl")
"""The data paths ``bytes_by_path`` names (docs/DATA-PLANES.md)."""


@dataclass
class DemoRoom(Room):
    """A room of the demo, with what the demo learns about it along the way."""

    prefix_before: list[np.ndarray] = field(default_factory=list)  # per KV buffer: the prefix rows as held
    status: str = ""
    code: str = ""
    reason: str = ""
    mismatched: int = 0


@dataclass
class Summary:
    cp_size: int
    split: str
    rooms_ok: int = 0
    rooms_failed: int = 0
    mismatched_bytes: int = 0
    wire_bytes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    received_bytes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    state_bytes_skipped: int = 0
    same_host_bytes: int = 0
    stream_bytes: int = 0
    mooncake_bytes: int = 0
    nixl_bytes: int = 0
    bytes_by_path: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    """The senders' payload bytes by the path that moved them (``zmq``: the rest of ``wire_bytes``)."""
    expected_bytes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    seconds: float = 0.0
    rooms_failed_by_reason: dict[str, int] = field(default_factory=dict)
    stray_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    corrupted_rooms: int = 0
    recovered: bool = True
    rooms_after_fault: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def child_env(cfg_path: str | None, base: Config, run_dir: str, tag: str,
              faults: Sequence[Fault] = ()) -> dict[str, str]:
    """The daemons' environment: this process's, with its ``TRANSFERD_*`` settings passed on (one
    exported for a demo reaches its daemons, as ``TRANSFERD_SHM_DIR`` must) except
    ``TRANSFERD_CONFIG`` (the daemons get the file by name), then the demo's own on top: the run
    directory, every address, socket and pool name (a demo never collides with a running
    service), the settings taken from ``base`` and what its faults need.
    :func:`overridden_settings` names the exported ones this replaced."""
    env = {k: v for k, v in os.environ.items() if k != "TRANSFERD_CONFIG"}
    rx, tx = ReceiverConfig(), SenderConfig()
    env.update({
        "TRANSFERD_RUN_DIR": run_dir,
        "TRANSFERD_LOG_LEVEL": base.log_level,
        "TRANSFERD_RECEIVER_BIND": "tcp://127.0.0.1:*",
        "TRANSFERD_RECEIVER_STREAM_PORT": "0",
        "TRANSFERD_RECEIVER_ENGINE_SOCKET": rx.engine_socket,
        "TRANSFERD_SENDER_ENGINE_SOCKET": tx.engine_socket,
        "TRANSFERD_RECEIVER_POOL": f"{tag}-{{name}}",
        "TRANSFERD_SENDER_POOL": f"{tag}-{{group}}-r{{rank}}",
        "TRANSFERD_SENDER_CP_SIZE": str(base.sender.cp_size),
        "TRANSFERD_SENDER_SPLIT": base.sender.split,
        "TRANSFERD_SENDER_GROUP": base.sender.group,
        "TRANSFERD_SENDER_SAME_HOST": base.sender.same_host,
        "TRANSFERD_SENDER_DATA_PLANE": base.sender.data_plane,
        "TRANSFERD_RECEIVER_DATA_PLANE": base.receiver.data_plane,
        "TRANSFERD_RECEIVER_METRICS_BIND": "127.0.0.1:0",  # never collide with a running service
        "TRANSFERD_SENDER_METRICS_BIND": "127.0.0.1:0",
    })
    if faults:  # short clocks, so that a fault is detected in about a second
        env.update({
            "TRANSFERD_RECEIVER_HEARTBEAT_INTERVAL_S": "0.2", "TRANSFERD_SENDER_HEARTBEAT_INTERVAL_S": "0.2",
            "TRANSFERD_RECEIVER_HEARTBEAT_MISSES": "5", "TRANSFERD_SENDER_HEARTBEAT_MISSES": "5",
            "TRANSFERD_RECEIVER_STALL_TIMEOUT_S": "5",
        })
    for f in faults:
        setting = FAULT_KINDS[f.kind].setting
        if setting:
            env[setting] = str(f.arg)
        if f.kind == "corrupt-frames":
            env["TRANSFERD_SENDER_SAME_HOST"] = "off"  # corruption happens on the wire: keep the data there
            env["TRANSFERD_SENDER_DATA_PLANE"] = "auto"  # (Mooncake TE and NIXL reads carry no frames to corrupt)
            if base.sender.checksum == "none":  # corruption must be caught: turn the integrity option on
                env["TRANSFERD_SENDER_CHECKSUM"] = "xxh3"
    return env


def overridden_settings(env: Mapping[str, str]) -> list[str]:
    """The ``TRANSFERD_*`` settings exported here that the daemons' environment ``env`` replaces
    (or leaves out): the demo says so rather than run with them silently ignored."""
    return sorted(k for k, v in os.environ.items()
                  if k.startswith("TRANSFERD_") and k not in ENV_NOT_SETTINGS and env.get(k) != v)


def say_overridden(tool: str, env: Mapping[str, str]) -> None:
    """Name on stderr the exported settings ``env`` replaces (``tool``: "demo", "soak")."""
    replaced = overridden_settings(env)
    if replaced:
        print(f"transferd {tool}: not passed on to its daemons as exported (the {tool} sets these itself): "
              f"{', '.join(replaced)}", file=sys.stderr)


class _Alloc:
    """Row allocator over one pool dimension (random order, so runs are sometimes contiguous)."""

    def __init__(self, rows: int, rng: np.random.Generator) -> None:
        self.rng = rng
        blocks = [list(range(i, min(i + 4, rows))) for i in range(0, rows, 4)]
        order = rng.permutation(len(blocks))
        self.free = [r for i in order for r in blocks[i]]

    def take(self, n: int, what: str) -> np.ndarray:
        if n > len(self.free):
            raise ConfigError(f"demo needs {n} more {what} but only {len(self.free)} are free; "
                              "raise the pool size or lower demo.in_flight / demo.pages_per_room")
        out, self.free = self.free[:n], self.free[n:]
        return np.asarray(out, dtype=np.int64)

    def give(self, rows: np.ndarray | list[int]) -> None:
        self.free.extend(int(x) for x in rows)


def _make_room(i: int, cfg: Config, rng: np.random.Generator, dec: dict[str, _Alloc],
               src: list[dict[str, _Alloc]], comps: tuple[str, ...], pools: list[Pool]) -> DemoRoom:
    d = cfg.demo
    cp = cfg.sender.cp_size
    n = int(rng.integers(max(1, d.pages_per_room // 2), d.pages_per_room + 1))
    prefix = int(rng.integers(1, n)) if d.prefix_every and i % d.prefix_every == 1 and n > 1 else 0
    n_chunks = max(1, d.chunks)
    empty_last = bool(d.empty_last_every) and i % d.empty_last_every == 2 and n_chunks > 1
    cuts = np.linspace(0, n, (n_chunks - 1 if empty_last else n_chunks) + 1).astype(int).tolist()
    chunks = list(itertools.pairwise(cuts))
    if empty_last:
        chunks.append((n, n))
    room_id = int(rng.integers(1, 2**63))
    aux_src = [int(src[r]["aux"].take(1, "source aux slots")[0]) for r in range(cp)]
    for r in range(cp):  # the engine writes the room id guard into its aux row
        write_guard(pools[r], aux_src[r], room_id)
    return DemoRoom(
        room=room_id, group=cfg.sender.group, n=n, prefix=prefix, dst=dec["kv"].take(n, "decode pages"),
        src=[src[r]["kv"].take(n, "source pages") for r in range(cp)], chunks=chunks,
        state_dst={c: dec[c].take(1, f"decode {c} slots") for c in comps},
        state_src=[{c: src[r][c].take(1, f"source {c} slots") for c in comps} for r in range(cp)],
        aux_dst=int(dec["aux"].take(1, "decode aux slots")[0]), aux_src=aux_src,
    )


def _verify(room: DemoRoom, cfg: Config, dpool: Pool, spools: list[Pool]) -> int:
    """Mismatched bytes of one successful room, against an owner of every row computed apart
    from the policy (tools/rooms.py); the prefix rows must be as the decode side held them."""
    held = dict(zip(dpool.layout.indices("kv"), room.prefix_before))
    return mismatches(room, dpool, spools, cfg.split, held)


def run_demo(base: Config, cfg_path: str | None, json_path: str | None = None,
             fault_specs: list[str] | None = None) -> int:
    t_start = time.monotonic()
    tag = f"demo{os.getpid()}"

    def interrupted(signum: int, frame: Any) -> None:  # SIGTERM/SIGHUP: stop the daemons, clean up
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    if not base.sender.dedup:
        print("transferd demo: sender.dedup = false is a comparison setting (transferd bench measures it); the demo's "
              "engines hold different state on each rank and check exactly-once delivery, so it runs with the de-dup on",
              file=sys.stderr)
        return 2
    faults = [parse_fault(f, base.sender.cp_size) for f in fault_specs or []]
    with tempfile.TemporaryDirectory(prefix="transferd-demo-") as run_dir:
        env = child_env(cfg_path, base, run_dir, tag, faults)
        say_overridden("demo", env)
        cfg = load(cfg_path, env=env)
        cfg = cfg.with_overrides("demo", **{k: getattr(base.demo, k) for k in base.demo.__dataclass_fields__})
        launcher = Launcher(cfg, cfg_path, env=env, log_dir=Path(run_dir) / "logs")
        try:
            launcher.start()
            summary = _run_rooms(cfg, launcher, faults)
        except BaseException:
            dump_logs(Path(run_dir) / "logs")
            raise
        finally:
            launcher.stop()
            for f in shm_dir().glob(f"transferd-{tag}-*"):  # pools of killed daemons
                f.unlink(missing_ok=True)
        if not _passed(summary, cfg):
            dump_logs(Path(run_dir) / "logs")
    summary.seconds = round(time.monotonic() - t_start, 3)
    # with --json -, stdout carries the JSON alone: the human summary goes to stderr
    _print_summary(summary, _passed(summary, cfg), sys.stderr if json_path == "-" else sys.stdout)
    if json_path:
        write_json(summary.to_json(), json_path, sort_keys=True)
    return 0 if _passed(summary, cfg) else 1


def _passed(s: Summary, cfg: Config) -> bool:
    """Without faults: every room ok and byte-exact. With faults: no room reported Success with
    wrong bytes, nothing written outside the rooms, every room ended, and (process faults) every
    room after the fault succeeded."""
    if s.corrupted_rooms or s.stray_bytes or s.mismatched_bytes:
        return False
    if s.rooms_ok + s.rooms_failed != cfg.demo.rooms:
        return False
    if not s.faults:
        return s.rooms_failed == 0
    return s.recovered


class _Engines:
    """The synthetic engines' clients; a rank whose daemon is down is skipped until it is back."""

    def __init__(self, cfg: Config, timeout_s: float) -> None:
        self.cfg = cfg
        self.dc = DecodeClient(cfg.receiver_engine_socket(), timeout_s=timeout_s)
        self.pcs = [PrefillClient(cfg.sender_engine_socket(r), timeout_s=timeout_s) for r in range(cfg.sender.cp_size)]
        self.down: set[int] = set()

    def submit(self, room: DemoRoom, k: int) -> None:
        a, b = room.chunks[k]
        last = k == len(room.chunks) - 1
        for r, pc in enumerate(self.pcs):
            if r in self.down:
                continue
            try:
                if last:
                    pc.submit(room.room, a, room.src[r][a:b], last=True,
                              state={c: v for c, v in room.state_src[r].items()}, aux_slot=room.aux_src[r])
                else:
                    pc.submit(room.room, a, room.src[r][a:b])
            except ClientTimeout:
                self.down.add(r)
            except TransferdError as exc:  # e.g. the room already failed on that rank
                log.info("room %d rank %d: submit refused: %s", room.room, r, exc)

    def close(self) -> None:
        self.dc.close()
        for pc in self.pcs:
            pc.close()


class RoomRunner:
    """Rooms in batches through one set of running daemons (a :class:`Launcher`), every byte
    verified: the demo's engines, pools and row allocators, and the faults injected into them.
    ``transferd demo`` runs one; ``transferd soak`` runs one per fleet and daemon configuration.
    Outcomes are added to ``summary``."""

    def __init__(self, cfg: Config, launcher: Launcher, summary: Summary, *, engine_timeout_s: float,
                 seed: int | None = None) -> None:
        d = cfg.demo
        self.cfg, self.launcher, self.summary = cfg, launcher, summary
        seed = d.seed if seed is None else seed
        self.rng = np.random.default_rng(seed)
        self.dpool = Pool.attach(cfg.receiver_pool_name())
        self.spools = [Pool.attach(cfg.sender_pool_name(r)) for r in range(cfg.sender.cp_size)]
        layout = self.layout = self.dpool.layout
        self.comps = layout.state_components
        for r, p in enumerate(self.spools):  # different bytes on every rank
            _fill(p, np.random.default_rng(seed * 1000 + r + 1))
        _fill(self.dpool, np.random.default_rng(seed * 1000))
        self.snapshot = [rows.copy() for rows in self.dpool.rows]
        self.touched = [np.zeros(rows.shape[0], dtype=bool) for rows in self.dpool.rows]
        rng = self.rng
        self.dec = {"kv": _Alloc(layout.kv_rows, rng), "aux": _Alloc(layout.buffers[layout.aux_index].rows, rng),
                    **{c: _Alloc(layout.rows_of("state", c), rng) for c in self.comps}}
        self.src = [{"kv": _Alloc(p.layout.kv_rows, rng), "aux": _Alloc(p.layout.buffers[p.layout.aux_index].rows, rng),
                     **{c: _Alloc(p.layout.rows_of("state", c), rng) for c in self.comps}} for p in self.spools]
        self.engines = _Engines(cfg, engine_timeout_s)
        self.timers: list[threading.Timer] = []
        self.made = 0
        self._flood: tuple[HostilePeer, int, dict[str, Any]] | None = None  # the peer, refused before, record

    def batch(self, n: int, inject: Callable[[], None] | None = None) -> list[DemoRoom]:
        """Run ``n`` rooms at once to their end and verify them: each expected (every other one
        after its first chunk, as a prefill engine ahead of the decode side), then ``inject()``
        (faults), then the other chunks; then every room settled, checked and its rows given back."""
        cfg, s, layout, summary = self.cfg, self.cfg.sender, self.layout, self.summary
        batch = [_make_room(self.made + i, cfg, self.rng, self.dec, self.src, self.comps, self.spools) for i in range(n)]
        self.made += n
        for room in batch:  # what the decode side holds in the prefix rows (earlier rooms wrote there)
            room.prefix_before = [self.dpool.rows[b][room.dst[:room.prefix]].copy() for b in layout.indices("kv")]
        for i, room in enumerate(batch):
            early = i % 2 == 1  # the prefill engine is sometimes ahead of the decode side
            if early:
                self.engines.submit(room, 0)
            try:
                self.engines.dc.expect(room.room, s.group, room.dst, aux_slot=room.aux_dst, prefix_pages=room.prefix,
                                       state={c: v for c, v in room.state_dst.items()})
            except (ClientTimeout, TransferdError) as exc:
                room.status, room.reason = "failed", f"expect: {exc}"
            if not early:
                self.engines.submit(room, 0)
        if inject is not None:
            inject()
        for k in range(1, max(len(r.chunks) for r in batch)):
            for room in batch:
                if k < len(room.chunks):
                    self.engines.submit(room, k)
        for room in batch:
            _settle(room, self.engines, cfg, self.launcher)
            if room.status == "success":
                room.mismatched = _verify(room, cfg, self.dpool, self.spools)
                summary.rooms_ok += 1
                if room.mismatched:
                    summary.corrupted_rooms += 1
            else:
                summary.rooms_failed += 1
                key = room.code or "failed"
                summary.rooms_failed_by_reason[key] = summary.rooms_failed_by_reason.get(key, 0) + 1
                log.info("room %d: failed (%s) %s", room.room, room.code, room.reason)
            summary.mismatched_bytes += room.mismatched
            _account_expected(summary, room, layout)
            _mark(self.touched, room, layout)
            # give rows back; the next batch reuses them (catches writes that arrive late)
            self.dec["kv"].give(room.dst)
            self.dec["aux"].give([room.aux_dst])
            for c in self.comps:
                self.dec[c].give(room.state_dst[c])
            for r in range(s.cp_size):
                self.src[r]["kv"].give(room.src[r])
                self.src[r]["aux"].give([room.aux_src[r]])
                for c in self.comps:
                    self.src[r][c].give(room.state_src[r][c])
        return batch

    def inject(self, f: Fault, *, restart_now: bool = False) -> dict[str, Any]:
        """Inject a process fault into the running daemons; returns what was done (for reports).
        ``restart_now``: a killed receiver is started again at once (the demo waits until its
        engine times out on it)."""
        log.warning("injecting fault %s", f)
        launcher, engines = self.launcher, self.engines
        detail: dict[str, Any] = {}
        if f.kind == "kill-sender":
            label = f"sender r{int(f.arg)}"
            detail["pid"] = _pid(launcher, label)
            launcher.kill(label, signal.SIGKILL)
            engines.down.add(int(f.arg))
        elif f.kind == "restart-receiver":
            detail["pid"] = _pid(launcher, "receiver")
            launcher.kill("receiver", signal.SIGKILL)
            if restart_now:
                launcher.supervise_once()
        elif f.kind == "pause-sender":
            label = f"sender r{int(f.arg)}"
            detail["pid"] = _pid(launcher, label)
            launcher.kill(label, signal.SIGSTOP)
            engines.down.add(int(f.arg))
            t = threading.Timer(PAUSE_S, launcher.kill, (label, signal.SIGCONT))
            t.start()
            self.timers.append(t)
            detail["paused_s"] = PAUSE_S
        elif f.kind == "hostile-flood":
            before = _refused_total(engines.dc)
            peer = HostilePeer(launcher.receiver_endpoint, seed=self.made)
            self._flood = (peer, before, detail)
            detail["sent"] = peer.send(int(f.arg))
        return detail

    def recover(self, timeout_s: float = 60.0) -> None:
        """After a process fault: the paused sender resumed, dead daemons restarted, every rank
        registered again, and (a flood) every garbage message counted as refused."""
        deadline = time.monotonic() + timeout_s
        for t in self.timers:
            t.join()
        self.timers.clear()
        self.launcher.supervise_once()  # restarts what was killed
        self.launcher.wait_registered(deadline)
        self.engines.down.clear()
        if self._flood is not None:
            peer, before, detail = self._flood
            self._flood = None
            try:
                while True:  # the receiver works through its queue of garbage
                    peer.drain()
                    detail["refused"] = _refused_total(self.engines.dc) - before
                    if detail["refused"] >= peer.sent or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            finally:
                peer.close()

    def finish(self) -> None:
        """Add the bytes changed outside every room's rows, and the daemons' counters, to the summary."""
        summary = self.summary
        summary.stray_bytes += self.stray_bytes()  # nothing outside the destination rows may have changed
        rx = self.engines.dc.stats()
        summary.received_bytes = dict(rx["bytes"])
        summary.refused = dict(rx["refused"])
        for pc in self.engines.pcs:
            st = pc.stats()
            for kind in KINDS:
                summary.wire_bytes[kind] += st["bytes"][kind]
            summary.state_bytes_skipped += st["state_bytes_skipped"]
            summary.same_host_bytes += st["shm_bytes"]
            summary.stream_bytes += st["stream_bytes"]
            summary.mooncake_bytes += st["mooncake_bytes"]
            summary.nixl_bytes += st["nixl_bytes"]
        summary.bytes_by_path = by_path(sum(summary.wire_bytes.values()), summary.same_host_bytes,
                                        summary.stream_bytes, summary.mooncake_bytes, summary.nixl_bytes)

    def stray_bytes(self) -> int:
        """Decode-pool bytes changed outside every room's destination rows so far."""
        return sum(int(np.count_nonzero(rows[~self.touched[b]] != self.snapshot[b][~self.touched[b]]))
                   for b, rows in enumerate(self.dpool.rows))

    def close(self) -> None:
        for t in self.timers:
            t.cancel()
        if self._flood is not None:
            self._flood[0].close()
        self.engines.close()
        self.dpool.close()
        for p in self.spools:
            p.close()


def _fill(pool: Pool, g: np.random.Generator) -> None:
    """Random bytes in every row of every buffer."""
    for rows in pool.rows:
        rows[:] = np.frombuffer(g.bytes(rows.size), np.uint8).reshape(rows.shape)


def _pid(launcher: Launcher, label: str) -> int | None:
    c = next((c for c in launcher.children if c.label == label), None)
    return None if c is None or c.proc is None else c.proc.pid


def _refused_total(dc: DecodeClient) -> int:
    return sum(dc.stats()["refused"].values())


def _run_rooms(cfg: Config, launcher: Launcher, faults: list[Fault]) -> Summary:
    d = cfg.demo
    process_faults = [f for f in faults if f.process]
    summary = Summary(cp_size=cfg.sender.cp_size, split=cfg.split.value, faults=[str(f) for f in faults])
    n_batches = math.ceil(d.rooms / max(1, d.in_flight))
    fault_batch = n_batches // 2 if process_faults else -1
    runner = RoomRunner(cfg, launcher, summary, engine_timeout_s=2.0 if faults else 60.0)
    done = 0
    bar = progress_bar(enabled=sys.stderr.isatty(),  # a bar on a terminal only
                       total=d.rooms, unit="room", desc="transferd demo", file=sys.stderr, leave=False)
    try:
        for bi in range(n_batches):
            inject = None
            if bi == fault_batch:
                def inject() -> None:
                    for f in process_faults:
                        runner.inject(f)
            batch = runner.batch(min(d.in_flight, d.rooms - done), inject)
            for room in batch:
                if fault_batch >= 0 and bi > fault_batch:
                    summary.rooms_after_fault += 1
                    if room.status != "success":
                        summary.recovered = False
                bar.update(1)
            done += len(batch)
            if bi == fault_batch:
                runner.recover()
        if process_faults and fault_batch == n_batches - 1:
            summary.recovered = False  # the fault hit the last batch: recovery was never shown
        runner.finish()
    finally:
        bar.close()
        runner.close()
    return summary


def _settle(room: DemoRoom, engines: _Engines, cfg: Config, launcher: Launcher) -> None:
    """Wait until the decode side ends the room, release it, and let every live rank learn it."""
    group = cfg.sender.group
    deadline = time.monotonic() + cfg.demo.timeout_s
    while not room.status:
        try:
            st = engines.dc.wait(room.room, group, max(0.1, min(5.0, deadline - time.monotonic())))
        except ClientTimeout:
            st = None
            launcher.supervise_once()  # a dead receiver comes back (and has forgotten its rooms)
        except UnknownRoom:  # the receiver restarted and forgot the room
            room.status, room.code, room.reason = "failed", "receiver_restarted", "the receiver restarted"
            break
        if st is not None and st.state.terminal:
            room.status, room.code, room.reason = st.state.value, st.code, st.reason
        elif time.monotonic() > deadline:
            room.status, room.code, room.reason = "failed", "demo_timeout", "no outcome within demo.timeout_s"
    try:
        engines.dc.release(room.room, group)
    except (ClientTimeout, TransferdError):
        pass
    for r, pc in enumerate(engines.pcs):
        if r in engines.down:
            continue
        if room.status != "success":  # as an engine would: a room the decode side failed is given up here too
            try:  # (a receiver killed between its answer to expect and its assign leaves it unassigned)
                pc.abort(room.room, f"the decode side ended it: {room.code}")
            except (ClientTimeout, TransferdError):
                pass
        try:
            pst = pc.wait(room.room, cfg.demo.timeout_s)
        except (ClientTimeout, TransferdError):
            continue
        if room.status == "success" and pst.state.value != "success":
            room.status, room.code, room.reason = "failed", pst.code, f"rank {r}: {pst.reason}"


def _account_expected(summary: Summary, room: DemoRoom, layout: Any) -> None:
    summary.expected_bytes["kv"] += (room.n - room.prefix) * layout.kv_page_bytes()
    summary.expected_bytes["state"] += sum(
        len(room.state_dst[layout.buffers[b].component]) * layout.buffers[b].row_bytes for b in layout.indices("state"))
    summary.expected_bytes["aux"] += layout.aux_row_bytes


def _mark(touched: list[np.ndarray], room: DemoRoom, layout: Any) -> None:
    for b in layout.indices("kv"):
        touched[b][room.dst[room.prefix:]] = True
    for b in layout.indices("state"):
        touched[b][room.state_dst[layout.buffers[b].component]] = True
    touched[layout.aux_index][room.aux_dst] = True


def by_path(total: int, same_host: int, stream: int, mooncake: int, nixl: int = 0) -> dict[str, int]:
    """Payload bytes by the path that moved them: ZeroMQ frames are what the others did not."""
    return {"zmq": total - same_host - stream - mooncake - nixl, "stream": stream, "same_host": same_host,
            "mooncake": mooncake, "nixl": nixl}


def _mb(x: int) -> str:
    return f"{x / 1e6:.2f} MB"


def _print_summary(s: Summary, ok: bool, out: TextIO) -> None:
    total_wire = sum(s.wire_bytes.values())
    print(f"transferd demo: cp_size {s.cp_size}, split {s.split}: {s.rooms_ok} rooms ok, {s.rooms_failed} failed, "
          f"{s.mismatched_bytes} mismatched bytes in {s.seconds:.2f}s — {'PASS' if ok else 'FAIL'}", file=out)
    over_zmq = s.bytes_by_path["zmq"]
    via = "".join([f", {_mb(s.mooncake_bytes)} of it by Mooncake TE reads" if s.mooncake_bytes else "",
                   f", {_mb(s.nixl_bytes)} of it by NIXL reads" if s.nixl_bytes else "",
                   f", {_mb(s.same_host_bytes)} of it by the same-host path" if s.same_host_bytes else "",
                   f", {_mb(s.stream_bytes)} on data streams" if s.stream_bytes else "",
                   f", {_mb(over_zmq)} through ZeroMQ" if over_zmq else ""])
    print(f"  moved:    kv {_mb(s.wire_bytes['kv'])}, state {_mb(s.wire_bytes['state'])}, aux {_mb(s.wire_bytes['aux'])}"
          f" (total {_mb(total_wire)}{via})", file=out)
    print(f"  expected: kv {_mb(s.expected_bytes['kv'])}, state {_mb(s.expected_bytes['state'])}, "
          f"aux {_mb(s.expected_bytes['aux'])} (one copy of each)", file=out)
    print(f"  de-dup:   {_mb(s.state_bytes_skipped)} of replicated state not sent", file=out)
    if s.rooms_failed_by_reason:
        print("  failures: " + ", ".join(f"{k} {v}" for k, v in sorted(s.rooms_failed_by_reason.items())), file=out)
    if s.faults:
        print(f"  faults:   {', '.join(s.faults)}; corrupted rooms {s.corrupted_rooms}; "
              f"{'recovered' if s.recovered else 'NOT recovered'} ({s.rooms_after_fault} rooms after the fault)", file=out)
