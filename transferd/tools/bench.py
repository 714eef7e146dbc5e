"""``transferd bench``: the host's limits and transferd, measured side by side in one run.

* **limits** — one-thread ``np.copyto`` into a shared-memory :class:`~transferd.pool.Pool`; raw
  pyzmq PUSH/PULL over TCP loopback, zero-copy frames out of a pool, the sender in its own
  process, the receiver copying every frame into a pool. Both at the message sizes transferd
  sends (64 KiB, 256 KiB, 1 MiB) and on the same bytes as the bulk rooms.
* **bulk** — transferd end to end through real daemons over TCP loopback: expect → Success for
  rooms of 64 KiB, 256 KiB and 1 MiB KV rows on scattered pages (one message per row), and of
  64 KiB rows on contiguous pages (coalesced into 1 MiB messages). Sampled rooms are compared
  byte for byte with their sources.
* **small rooms** — one page and the aux row: latency (expect → Success, from the decode engine's
  view, the prefill engine having submitted first) and rooms/s with many rooms in flight, at
  cp_size 1 and 8.
* **de-dup** — ``configs/deepseek-cp8.toml``, a typical room from real groups of cp 1, 2, 4, 8 with
  the de-dup on and (cp > 1) with it off (``sender.dedup = false``: every rank ships the replicated
  state): wire bytes from the daemons' own counters and the time of the room, the measured cut
  beside the analytic one.
* **peers** — Mooncake Transfer Engine's TCP transport when it is importable.

Each subject is measured once per round; every round runs the subjects in a new shuffled order
and the figures are medians over rounds (ratios: medians of per-round ratios). GB/s is 1e9 B/s.
docs/PERFORMANCE.md describes every figure.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import logging
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from ..client import DecodeClient, PrefillClient
from ..config import Config, load
from ..daemon.malloc import keep_message_buffers_mapped
from ..errors import ClientTimeout, ConfigError, TransferdError
from ..layout import ModelSpec, PoolLayout
from ..pool.shm import Pool, shm_dir
from ..protocol.policy import group_plans
from ..protocol.room import RoomState
from ..transport.data_stream import RECV_CHUNK
from ..types import SplitMode
from .launcher import die_with_parent
from .progress import progress_bar

log = logging.getLogger(__name__)

BENCH_VERSION = 1
KiB, MiB = 1 << 10, 1 << 20
SIZES: dict[str, int] = {"64KiB": 64 * KiB, "256KiB": 256 * KiB, "1MiB": MiB}
BULK_KEYS = ("64KiB", "256KiB", "1MiB", "64KiB_contig")
DEDUP_CPS = (1, 2, 4, 8)
SMALL_CPS = (1, 8)
PRODUCTION_CUT_CP8 = 0.8497
BULK_LAYERS = 4
POISON = 0xA5
# no Prometheus endpoints: their fixed ports would collide across the bench's ~40 processes
_NO_METRICS = {"TRANSFERD_RECEIVER_METRICS_BIND": "", "TRANSFERD_SENDER_METRICS_BIND": ""}
TARGETS = {"tcp_vs_raw_zmq": 0.9, "same_host_vs_memcpy": 0.8, "small_cp1_p50_ms": 1.0,
           "small_cp1_rooms_per_s": 2000.0, "vs_mooncake_tcp": 2.0}


@dataclass(frozen=True, slots=True)
class Plan:
    """How much work one run does."""

    repeats: int
    target_repeats: int  # rounds of the 1 MiB block, whose ratios the targets read (cheap: ~0.5 s a round)
    bulk_room_bytes: int  # KV bytes of one bulk room
    bulk_rooms: int  # bulk rooms per measurement, all in flight; the limits move the same bytes
    dedup_rooms: int  # typical rooms per de-dup measurement, in flight together (times are per room)
    small_latency_rooms: int  # one after another
    small_batch_rooms: int  # all in flight
    small_verify_every: int
    room_timeout_s: float = 60.0


QUICK = Plan(repeats=5, target_repeats=11, bulk_room_bytes=16 * MiB, bulk_rooms=16, dedup_rooms=1, small_latency_rooms=40,
             small_batch_rooms=128, small_verify_every=16)
FULL = Plan(repeats=7, target_repeats=15, bulk_room_bytes=16 * MiB, bulk_rooms=32, dedup_rooms=1, small_latency_rooms=200,
            small_batch_rooms=512, small_verify_every=32)


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def dedup_config_path() -> Path:
    """``configs/deepseek-cp8.toml`` in the working directory, else beside the source tree."""
    for p in (Path.cwd() / "configs" / "deepseek-cp8.toml", repo_root() / "configs" / "deepseek-cp8.toml"):
        if p.is_file():
            return p
    raise ConfigError("configs/deepseek-cp8.toml not found (looked in the working directory and beside the "
                      "transferd source tree)")


# -- small helpers ---------------------------------------------------------------------------

def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def block_of(name: str) -> str:
    """The block a subject is measured in. Every ratio the bench prints compares subjects of one
    block, and a block's subjects are measured one right after another in each round: a burst of
    load from elsewhere on the host then falls on both sides of a ratio, not on one of them."""
    kind, _, arg = name.partition("/")
    if kind in ("dedup_on", "dedup_off"):
        return "dedup"
    if kind == "small":
        return "small"
    return "1MiB" if arg.endswith("_contig") else arg  # 64 KiB rows on contiguous pages: 1 MiB messages


def schedule(names: Sequence[str], repeats: int, target_repeats: int, seed: int = 20240) -> list[list[str]]:
    """The measured rounds: ``repeats`` of them, each one the blocks in a new order and each
    block's subjects in a new order, one after another. The 1 MiB block (whose ratios the targets
    read) is measured ``target_repeats`` times, spread evenly over the rounds — twice in some of
    them, at different places — so that a slow spell of the host lands on a few of its
    measurements, not on a run of them at the end."""
    blocks: dict[str, list[str]] = {}
    for name in names:
        blocks.setdefault(block_of(name), []).append(name)
    rounds = max(repeats, 1 if target_repeats and "1MiB" in blocks else 0)
    order = random.Random(seed)
    out: list[list[str]] = []
    for k in range(rounds):
        todo = [b for b in blocks if b != "1MiB" and k < repeats]
        order.shuffle(todo)
        if "1MiB" in blocks:
            times = (k + 1) * target_repeats // rounds - k * target_repeats // rounds
            gaps = len(todo) + 1  # before, between and after the other blocks: never twice in a row
            at = sorted(order.sample(range(gaps), times) if times <= gaps else [gaps - 1] * times, reverse=True)
            for gap in at:
                todo.insert(gap, "1MiB")
        names_k: list[str] = []
        for b in todo:
            members = blocks[b][:]
            order.shuffle(members)
            names_k.extend(members)
        out.append(names_k)
    return out


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (Linux); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class _Filler:
    """Distinct pseudo-random bytes per row at memcpy speed: slices of one random block, each row
    starting at a different offset; pools filled with different seeds never share a row."""

    BLOCK = 4 * MiB

    def __init__(self, seed: int) -> None:
        self.block = np.random.default_rng(seed).integers(0, 256, self.BLOCK + MiB, dtype=np.uint8)
        self.k = 0

    def row(self, dst: np.ndarray) -> None:
        n, off = dst.size, 0
        while off < n:
            k = min(n - off, self.BLOCK)
            s = (self.k * 997) % MiB
            self.k += 1
            dst[off:off + k] = self.block[s:s + k]
            off += k

    def rows(self, buf: np.ndarray, idx: Any) -> None:
        for i in np.asarray(idx, dtype=np.int64).reshape(-1).tolist():
            self.row(buf[i])


def _guard(pool: Pool, slot: int, room: int) -> None:
    """The prefill engine writes the room id into its aux row (the receiver checks it)."""
    pool.rows[pool.layout.aux_index][slot, :8] = np.array([room], dtype="<u8").view(np.uint8)


# -- real daemons -------------------------------------------------------------------------------

@dataclass
class _Proc:
    label: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class _Group:
    name: str
    cp: int
    cfg: Config
    procs: list[_Proc] = field(default_factory=list)
    pcs: list[PrefillClient] = field(default_factory=list)
    pools: list[Pool] = field(default_factory=list)
    src_pages: list[np.ndarray] = field(default_factory=list)  # per rank: the pages its rooms send


@dataclass
class _Cluster:
    """One receiver (one pool layout) and the prefill groups that feed it."""

    name: str
    cfg_path: Path
    env: dict[str, str]
    cfg: Config
    rx: _Proc | None = None
    endpoint: str = ""
    dc: DecodeClient | None = None
    dpool: Pool | None = None
    groups: dict[str, _Group] = field(default_factory=dict)
    # destination pages, in the order rooms take them
    dst_perm: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pages: int = 0  # pages per bulk room

    @property
    def layout(self) -> PoolLayout:
        assert self.dpool is not None
        return self.dpool.layout


class _Daemons:
    """Child processes of this run (``python -m transferd receiver|sender``), stopped together."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.procs: list[_Proc] = []
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
        root = str(repo_root())
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.base_env = env

    def spawn(self, label: str, argv: list[str], env: dict[str, str]) -> _Proc:
        path = self.run_dir / "logs" / f"{label}.log"
        with open(path, "ab") as out:
            p = subprocess.Popen(argv, env={**self.base_env, **env}, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        proc = _Proc(label, p, path)
        self.procs.append(proc)
        return proc

    def check(self) -> None:
        for p in self.procs:
            if p.proc.poll() is not None:
                raise TransferdError(f"{p.label} exited with status {p.proc.returncode}:\n{self.tail(p)}")

    @staticmethod
    def tail(p: _Proc, lines: int = 15) -> str:
        try:
            return "\n".join(p.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        for p in reversed(self.procs):
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int | None] = {}
        for p in reversed(self.procs):
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
            codes[p.label] = p.proc.returncode
        return codes


# -- the run ------------------------------------------------------------------------------------

class _Bench:
    def __init__(self, plan: Plan, quick: bool, run_dir: Path, tag: str, progress: bool) -> None:
        self.plan = plan
        self.quick = quick
        self.run_dir = run_dir
        self.tag = tag
        self.progress = progress
        self.daemons = _Daemons(run_dir)
        self.clusters: dict[str, _Cluster] = {}
        self.bulk: dict[str, _Cluster] = {}
        self.ds: _Cluster | None = None
        self.lim_pool: Pool | None = None
        self.raw: subprocess.Popen[bytes] | None = None
        self.raw_ctx: zmq.Context[Any] | None = None
        self.pull: zmq.Socket[Any] | None = None
        self.ctrl: zmq.Socket[Any] | None = None
        self.tcp_listen: socket.socket | None = None
        self.tcp: socket.socket | None = None  # the raw TCP limit's receiving end
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.latencies: dict[int, list[float]] = {cp: [] for cp in SMALL_CPS}
        self.mismatched = 0
        self.verified_rooms = 0
        self.failed_rooms: Counter[str] = Counter()
        self.ok_rooms = 0
        self._room = random.getrandbits(40) << 16
        self.notes: dict[str, str] = {}
        self.codes: dict[str, int | None] = {}
        self.mooncake: _Mooncake | None = None
        self.only: list[str] = []  # subject globs (--only); empty: all

    # -- output --------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        if self.progress:
            print(f"\r\033[K[bench] {msg}", end="", file=sys.stderr, flush=True)

    def room_id(self) -> int:
        self._room += 1
        return self._room

    # -- start-up ------------------------------------------------------------------------
    def _env(self, cluster: str, rx: tuple[int, int, int], tx: tuple[int, int, int]) -> dict[str, str]:
        return {
            "TRANSFERD_RUN_DIR": str(self.run_dir),
            "TRANSFERD_LOG_LEVEL": "warning",
            "TRANSFERD_LOG_FORMAT": "text",
            "TRANSFERD_RECEIVER_NAME": cluster,
            "TRANSFERD_RECEIVER_BIND": "tcp://127.0.0.1:*",
            "TRANSFERD_RECEIVER_ENGINE_SOCKET": "ipc://{run_dir}/{name}.sock",
            "TRANSFERD_RECEIVER_POOL": f"{self.tag}-{{name}}",
            "TRANSFERD_RECEIVER_KV_PAGES": str(rx[0]),
            "TRANSFERD_RECEIVER_STATE_SLOTS": str(rx[1]),
            "TRANSFERD_RECEIVER_AUX_SLOTS": str(rx[2]),
            "TRANSFERD_SENDER_ENGINE_SOCKET": "ipc://{run_dir}/{group}-r{rank}.sock",
            "TRANSFERD_SENDER_POOL": f"{self.tag}-{{group}}-r{{rank}}",
            "TRANSFERD_SENDER_SPLIT": "pages",
            "TRANSFERD_SENDER_KV_PAGES": str(tx[0]),
            "TRANSFERD_SENDER_STATE_SLOTS": str(tx[1]),
            "TRANSFERD_SENDER_AUX_SLOTS": str(tx[2]),
            **_NO_METRICS,
        }

    def _cluster(self, name: str, cfg_path: Path, rx: tuple[int, int, int], tx: tuple[int, int, int]) -> _Cluster:
        env = self._env(name, rx, tx)
        c = _Cluster(name, cfg_path, env, load(cfg_path, env=env))
        c.rx = self.daemons.spawn(f"receiver-{name}", [sys.executable, "-m", "transferd", "receiver", "--config",
                                                       str(cfg_path)], env)
        self.clusters[name] = c
        return c

    def _group(self, c: _Cluster, name: str, cp: int, same_host: bool = False, dedup: bool = True,
               stream: bool = True) -> _Group:
        env = {**c.env, "TRANSFERD_SENDER_GROUP": name, "TRANSFERD_SENDER_CP_SIZE": str(cp),
               "TRANSFERD_SENDER_DEDUP": "true" if dedup else "false",
               "TRANSFERD_SENDER_DATA_STREAM": "auto" if stream else "off",
               "TRANSFERD_SENDER_SAME_HOST": "auto" if same_host else "off"}  # TCP loopback unless asked
        g = _Group(name, cp, load(c.cfg_path, env=env))
        for rank in range(cp):
            g.procs.append(self.daemons.spawn(
                f"sender-{name}-r{rank}",
                [sys.executable, "-m", "transferd", "sender", "--config", str(c.cfg_path), "--cp-rank", str(rank),
                 "--receiver", c.endpoint], env))
        c.groups[name] = g
        return g

    def _until(self, fn: Callable[[], Any], what: str, deadline: float) -> Any:
        while True:
            try:
                out = fn()
            except ClientTimeout:
                out = None
            if out:
                return out
            self.daemons.check()
            if time.monotonic() > deadline:
                raise TransferdError(f"bench: timed out waiting for {what}")
            time.sleep(0.02)

    def _bulk_model(self, key: str) -> dict[str, Any]:
        row = SIZES[key]
        return {"name": f"bench-bulk-{key}", "dtype": "bf16", "page_size": 16, "kv_layers": BULK_LAYERS,
                "kv_format": "mla", "kv_token_elems": row // (16 * 2), "aux_row_bytes": 64}

    def _write_bulk_config(self, key: str) -> Path:
        m = self._bulk_model(key)
        lines = ['log_level = "warning"', "", "[model]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in m.items()]
        lines += ["", "[sender]", 'max_message_bytes = "1MiB"', ""]
        path = self.run_dir / f"bulk-{key}.toml"
        path.write_text("\n".join(lines))
        return path

    def start(self, ds_path: Path) -> None:
        p = self.plan
        deadline = time.monotonic() + 180.0
        # the limits' pool: buffer 0 is the source, buffer 1 the destination, as big as a bulk run
        ring = p.bulk_room_bytes * p.bulk_rooms
        lim = ModelSpec(name="bench-limits", dtype="uint8", page_size=1, kv_layers=2, kv_format="mla",
                        kv_token_elems=MiB).layout(ring // MiB, 0, 1)
        self.lim_pool = Pool.create(f"{self.tag}-limits", lim)
        # the baseline is tuned like the daemons: its receiver (here) and its sender keep message
        # buffers mapped (transferd/malloc.py)
        keep_message_buffers_mapped()
        self._start_raw_sender()
        if importlib.util.find_spec("mooncake") is None:
            self.notes["peers"] = ("mooncake-transfer-engine-non-cuda is not installed: no Mooncake column "
                                   "(pip install mooncake-transfer-engine-non-cuda; it needs Debian's libibverbs1)")
        else:
            try:
                self.mooncake = _Mooncake(self.lim_pool, self.run_dir)
            except Exception as exc:  # a peer that does not start is a note, not a failed bench
                self.notes["peers"] = f"mooncake is installed but did not start: {exc!r}"
                self.mooncake = None
        # receivers first (their addresses are picked by the kernel), then every sender at once
        for key in ("64KiB", "256KiB", "1MiB"):
            pages = p.bulk_room_bytes // (BULK_LAYERS * SIZES[key])
            n = pages * p.bulk_rooms
            self.bulk[key] = self._cluster(f"bulk{key.lower()}", self._write_bulk_config(key), (n, 0, 64), (n, 0, 64))
        base = load(ds_path, env={})
        n = base.demo.pages_per_room
        aux = max(p.small_batch_rooms, 8 * p.dedup_rooms)
        self.ds = self._cluster("dsrx", ds_path, (n * p.dedup_rooms + p.small_batch_rooms, 8 * p.dedup_rooms, aux),
                                (n, 1, aux))
        self.say("starting daemons")
        for c in self.clusters.values():
            dc = DecodeClient(c.cfg.receiver_engine_socket(), timeout_s=2.0)
            c.dc = dc
            c.endpoint = self._until(lambda: dc.ping(0.5) and dc.stats()["data_endpoint"], f"{c.name} to answer",
                                     deadline)
        for c in self.bulk.values():
            self._group(c, f"b{c.name[4:]}", 1)
            self._group(c, f"s{c.name[4:]}", 1, same_host=True)
            self._group(c, f"z{c.name[4:]}", 1, stream=False)  # TCP through the ZeroMQ socket only
        for cp in DEDUP_CPS:
            self._group(self.ds, f"ds{cp}", cp)
        for cp in DEDUP_CPS[1:]:  # the same groups with the de-dup off: every rank ships the state
            self._group(self.ds, f"dsoff{cp}", cp, dedup=False)
        # meanwhile: the limits' source bytes, and the destination touched once (no first-touch faults)
        f = _Filler(7)
        f.rows(self.lim_pool.rows[0], range(self.lim_pool.rows[0].shape[0]))
        self.lim_pool.rows[1][:] = 0
        for c in self.clusters.values():
            for g in c.groups.values():
                for rank in range(g.cp):
                    pc = PrefillClient(g.cfg.sender_engine_socket(rank), timeout_s=2.0)
                    g.pcs.append(pc)
        for c in self.clusters.values():
            for g in c.groups.values():
                for rank, pc in enumerate(g.pcs):
                    self._until(lambda: pc.ping(0.5) and all(r["state"] == "registered"
                                                             for r in pc.status()["receivers"]),
                                f"sender {g.name} r{rank} to register", deadline)
        self.say("filling pools")
        for c in self.clusters.values():
            c.dpool = Pool.attach(c.cfg.receiver_pool_name())
            for rows in c.dpool.rows:  # touch the destination once, like a warm engine's pool
                rows[:] = 0
            for g in c.groups.values():
                g.pools = [Pool.attach(g.cfg.sender_pool_name(r)) for r in range(g.cp)]
        self._prepare_bulk()
        self._prepare_ds()
        for c in self.clusters.values():
            assert c.dc is not None
            c.dc.timeout_s = 30.0
            for g in c.groups.values():
                for pc in g.pcs:
                    pc.timeout_s = 30.0

    def _start_raw_sender(self) -> None:
        assert self.lim_pool is not None
        self.raw_ctx = zmq.Context()
        self.pull = self.raw_ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind("tcp://127.0.0.1:*")
        self.ctrl = self.raw_ctx.socket(zmq.PAIR)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.bind("tcp://127.0.0.1:*")
        self.tcp_listen = socket.create_server(("127.0.0.1", 0))
        self.tcp_listen.settimeout(60)
        argv = [sys.executable, "-c", "import sys; from transferd.tools.bench import raw_zmq_sender_main as m; "
                "sys.exit(m(sys.argv[1:]))", self.ctrl.getsockopt_string(zmq.LAST_ENDPOINT),
                self.pull.getsockopt_string(zmq.LAST_ENDPOINT), self.lim_pool.name,
                f"127.0.0.1:{self.tcp_listen.getsockname()[1]}"]
        self.raw = self.daemons.spawn("raw-zmq-sender", argv, {}).proc

    def _wait_raw_ready(self) -> None:
        assert self.ctrl is not None
        deadline = time.monotonic() + 60
        while not self.ctrl.poll(200):
            self.daemons.check()
            if time.monotonic() > deadline:
                raise TransferdError("bench: the raw zmq sender did not start")
        if self.ctrl.recv() != b"ready":
            raise TransferdError("bench: the raw zmq sender said something unexpected")
        assert self.tcp_listen is not None
        self.tcp, _ = self.tcp_listen.accept()  # it connected before it said ready
        self.tcp.settimeout(30)

    def _prepare_bulk(self) -> None:
        p = self.plan
        rng = np.random.default_rng(11)
        for key, c in self.bulk.items():
            for gi, g in enumerate(c.groups.values()):
                rows = g.pools[0].layout.kv_rows
                for b in g.pools[0].layout.indices("kv"):
                    _Filler(100 + b + 10 * len(key) + 1000 * gi).rows(g.pools[0].rows[b], range(rows))
                g.src_pages = [rng.permutation(rows)]
            c.dst_perm = rng.permutation(c.layout.kv_rows)
            c.pages = p.bulk_room_bytes // (BULK_LAYERS * SIZES[key])

    def _prepare_ds(self) -> None:
        assert self.ds is not None
        rng = np.random.default_rng(13)
        layout = self.ds.layout
        n = self.ds.cfg.demo.pages_per_room
        for gi, g in enumerate(self.ds.groups.values()):
            for r, pool in enumerate(g.pools):
                f = _Filler(1000 + 37 * gi + r)
                kv_rows = pool.layout.kv_rows
                perm = rng.permutation(kv_rows)[:n]
                g.src_pages.append(perm)
                for b in layout.indices("kv"):
                    f.rows(pool.rows[b], range(kv_rows))
                fs = _Filler(5000 + gi)  # the replicated state: the same bytes on every rank of a group
                for b in layout.indices("state"):
                    fs.rows(pool.rows[b], [0])  # slot 0 is the room's
        self.ds.dst_perm = rng.permutation(layout.kv_rows)

    # -- verification --------------------------------------------------------------------
    def _poison(self, c: _Cluster, dst: np.ndarray, state: dict[str, Sequence[int]], aux: int) -> None:
        assert c.dpool is not None
        lay = c.layout
        for b in lay.indices("kv"):
            c.dpool.rows[b][dst] = POISON
        for b in lay.indices("state"):
            slots = state.get(lay.buffers[b].component, [])
            if slots:
                c.dpool.rows[b][slots] = POISON
        c.dpool.rows[lay.aux_index][aux] = POISON

    def _verify(self, c: _Cluster, g: _Group, dst: np.ndarray, srcs: list[np.ndarray],
                state_dst: dict[str, Sequence[int]], state_src: dict[str, Sequence[int]], aux_dst: int,
                aux_src: int) -> None:
        """Byte-exact comparison of one successful room with what the policy says each rank sent."""
        assert c.dpool is not None
        lay = c.layout
        bad = 0
        for plan in group_plans(lay, g.cp, SplitMode.PAGES, len(dst), 0, g.cfg.sender.dedup):
            sp = g.pools[plan.rank]
            lo, hi = plan.kv_range
            for b in plan.kv_buffers:
                bad += int(np.count_nonzero(c.dpool.rows[b][dst[lo:hi]] != sp.rows[b][srcs[plan.rank][lo:hi]]))
            for b in plan.state_buffers:
                comp = lay.buffers[b].component
                d, s = state_dst.get(comp, []), state_src.get(comp, [])
                if d:
                    bad += int(np.count_nonzero(c.dpool.rows[b][d] != sp.rows[b][s]))
            if plan.aux:
                a = lay.aux_index
                bad += int(np.count_nonzero(c.dpool.rows[a][aux_dst] != sp.rows[a][aux_src]))
        self.mismatched += bad
        self.verified_rooms += 1
        if bad:
            log.error("bench: %s room on %s: %d bytes differ from the source", g.name, c.name, bad)

    def _wait_all(self, c: _Cluster, group_rooms: list[tuple[str, int]]) -> int:
        assert c.dc is not None
        ok = 0
        statuses = c.dc.wait_many([(room, group) for group, room in group_rooms], self.plan.room_timeout_s)
        for (group, room), st in zip(group_rooms, statuses):  # one engine call for all (wait_many)
            if isinstance(st, Exception):
                self.failed_rooms[getattr(st, "code", "error")] += 1
                log.error("bench: room %d of %s: %s", room, group, st)
            elif st.state is RoomState.SUCCESS:
                ok += 1
            else:
                self.failed_rooms[st.code or st.state.value] += 1
                log.error("bench: room %d of %s ended %s (%s): %s", room, group, st.state.value, st.code, st.reason)
        self.ok_rooms += ok
        return ok

    def _release(self, c: _Cluster, group_rooms: list[tuple[str, int]]) -> None:
        assert c.dc is not None
        c.dc.release_many([(room, group) for group, room in group_rooms])

    @staticmethod
    def _sent(groups: list[_Group]) -> tuple[int, int, dict[str, int]]:
        wire, skipped, kinds = 0, 0, Counter[str]()
        for g in groups:
            for pc in g.pcs:
                s = pc.stats()
                wire += sum(int(v) for v in s["bytes"].values())
                kinds.update({k: int(v) for k, v in s["bytes"].items()})
                skipped += int(s["state_bytes_skipped"])
        return wire, skipped, dict(kinds)

    # -- subjects ------------------------------------------------------------------------
    def memcpy(self, key: str) -> dict[str, Any]:
        assert self.lim_pool is not None
        size = SIZES[key]
        src, dst = self.lim_pool.rows[0].reshape(-1), self.lim_pool.rows[1].reshape(-1)
        total = self.plan.bulk_room_bytes * self.plan.bulk_rooms
        ring = dst.size // size
        n = total // size
        t0 = time.perf_counter()
        for i in range(n):
            o = (i % ring) * size
            np.copyto(dst[o:o + size], src[o:o + size])
        dt = time.perf_counter() - t0
        return {"gbps": n * size / dt / 1e9}

    def _raw(self, key: str, how: str, receive: Callable[[np.ndarray, int, int], None]) -> dict[str, Any]:
        """One baseline measurement: the sender subprocess sends the bulk bytes in messages of
        ``key``'s size over ``how`` ("zmq" or "tcp"); ``receive(dst, size, n)`` takes them into
        the ring ``dst`` in this process. The CPU of both sides is read around it."""
        assert self.lim_pool is not None and self.ctrl is not None and self.raw is not None
        size = SIZES[key]
        dst = self.lim_pool.rows[1].reshape(-1)
        n = (self.plan.bulk_room_bytes * self.plan.bulk_rooms) // size
        cpu0 = [_cpu_seconds(os.getpid()), _cpu_seconds(self.raw.pid)]
        t0 = time.perf_counter()
        self.ctrl.send(msgpack.packb([size, n, how]))
        receive(dst, size, n)
        dt = time.perf_counter() - t0
        if not self.ctrl.poll(30_000) or self.ctrl.recv() != b"sent":
            raise TransferdError(f"bench: the raw {how} sender did not confirm")
        cpu1 = [_cpu_seconds(os.getpid()), _cpu_seconds(self.raw.pid)]
        out: dict[str, Any] = {"gbps": n * size / dt / 1e9}
        if None not in cpu0 and None not in cpu1:  # this process is the receiver (the bench is idle meanwhile)
            gb = n * size / 1e9
            out["receiver_cpu_s_per_gb"] = (cpu1[0] - cpu0[0]) / gb  # type: ignore[operator]
            out["sender_cpu_s_per_gb"] = (cpu1[1] - cpu0[1]) / gb  # type: ignore[operator]
        return out

    def raw_zmq(self, key: str) -> dict[str, Any]:
        """Raw pyzmq: PUSH/PULL, zero-copy sends, every frame copied into the ring."""
        assert self.pull is not None
        pull = self.pull

        def receive(dst: np.ndarray, size: int, n: int) -> None:
            ring = dst.size // size
            for i in range(n):
                buf = np.frombuffer(pull.recv(copy=False).buffer, dtype=np.uint8)
                if buf.size != size:
                    raise TransferdError(f"bench: raw zmq frame of {buf.size} bytes, expected {size}")
                o = (i % ring) * size
                np.copyto(dst[o:o + size], buf)
        return self._raw(key, "zmq", receive)

    def raw_tcp(self, key: str) -> dict[str, Any]:
        """The raw TCP limit: the same messages as ``raw_zmq`` through one plain TCP connection
        (``sendall`` out of the pool), received with ``recv_into`` straight into the ring of the
        destination pool: one kernel copy a side, no framing beyond the fixed size."""
        assert self.tcp is not None
        recv_into = self.tcp.recv_into

        def receive(dst: np.ndarray, size: int, n: int) -> None:
            ring, mem = dst.size // size, dst.data
            for i in range(n):
                o = (i % ring) * size
                view, got = mem[o:o + size], 0
                while got < size:
                    k = recv_into(view[got:got + RECV_CHUNK])
                    if not k:
                        raise TransferdError("bench: the raw tcp sender closed its connection")
                    got += k
        return self._raw(key, "tcp", receive)

    def bulk_room(self, key: str, path: str = "tcp") -> dict[str, Any]:
        """Bulk rooms of one sender: ``tcp`` (the default path between hosts: a data stream),
        ``shm`` (the same-host path) or ``zmq`` (TCP through the ZeroMQ socket, no data stream)."""
        contig = key.endswith("_contig")
        c = self.bulk[key.split("_")[0]]
        assert c.dc is not None and c.rx is not None
        g = list(c.groups.values())[("tcp", "shm", "zmq").index(path)]
        pc, sp = g.pcs[0], g.pools[0]
        P, R = c.pages, self.plan.bulk_rooms
        rooms: list[tuple[int, np.ndarray, np.ndarray]] = []
        for j in range(R):
            room = self.room_id()
            if contig:
                src = np.arange(j * P, (j + 1) * P)
                dst = np.arange(j * P, (j + 1) * P)
            else:
                src = g.src_pages[0][j * P:(j + 1) * P]
                dst = c.dst_perm[j * P:(j + 1) * P]
            _guard(sp, j, room)
            pc.submit(room, 0, src.tolist(), last=True, aux_slot=j)
            rooms.append((room, src, dst))
        self._poison(c, rooms[0][2], {}, 0)
        s0 = pc.stats()
        shm0, stream0 = int(s0.get("shm_bytes", 0)), int(s0.get("stream_bytes", 0))
        cpu0 = [_cpu_seconds(c.rx.proc.pid), _cpu_seconds(g.procs[0].proc.pid)]
        expects = [{"room": room, "group": g.name, "dst_pages": dst.tolist(), "aux_slot": j}
                   for j, (room, _, dst) in enumerate(rooms)]
        t0 = time.perf_counter()
        for st in c.dc.expect_many(expects):  # one engine call for all, as a batching engine would
            if isinstance(st, Exception):
                raise TransferdError(f"bench: expect refused: {st}")
        ok = self._wait_all(c, [(g.name, room) for room, _, _ in rooms])
        dt = time.perf_counter() - t0
        cpu1 = [_cpu_seconds(c.rx.proc.pid), _cpu_seconds(g.procs[0].proc.pid)]
        s1 = pc.stats()
        shm, stream = int(s1.get("shm_bytes", 0)) - shm0, int(s1.get("stream_bytes", 0)) - stream0
        _room0, src0, dst0 = rooms[0]
        self._verify(c, g, dst0, [src0], {}, {}, 0, 0)
        self._release(c, [(g.name, room) for room, _, _ in rooms])
        nbytes = R * (P * c.layout.kv_page_bytes() + c.layout.aux_row_bytes)
        out: dict[str, Any] = {"gbps": nbytes / dt / 1e9 if ok == R else None, "seconds": dt,
                               "shm_share": shm / nbytes, "stream_share": stream / nbytes}
        if None not in cpu0 and None not in cpu1:
            gb = nbytes / 1e9
            out["receiver_cpu_s_per_gb"] = (cpu1[0] - cpu0[0]) / gb  # type: ignore[operator]
            out["sender_cpu_s_per_gb"] = (cpu1[1] - cpu0[1]) / gb  # type: ignore[operator]
        return out

    def _ds_state(self, slot: int) -> dict[str, Sequence[int]]:
        return {comp: [slot] for comp in self.ds.layout.state_components}  # type: ignore[union-attr]

    def dedup_on(self, cp: int) -> dict[str, Any]:
        return self._dedup_room(f"ds{cp}")

    def dedup_off(self, cp: int) -> dict[str, Any]:
        """The same room from a group with ``sender.dedup = false``: every rank ships the state."""
        return self._dedup_room(f"dsoff{cp}")

    def _dedup_room(self, name: str) -> dict[str, Any]:
        c = self.ds
        assert c is not None and c.dc is not None
        g = c.groups[name]
        n = c.cfg.demo.pages_per_room
        R = self.plan.dedup_rooms
        rooms = []
        for j in range(R):
            room = self.room_id()
            _guard(g.pools[0], j, room)
            for r, pc in enumerate(g.pcs):
                pc.submit(room, 0, g.src_pages[r].tolist(), last=True, state=self._ds_state(0), aux_slot=j)
            rooms.append((room, c.dst_perm[j * n:(j + 1) * n]))
        self._poison(c, rooms[0][1], self._ds_state(0), 0)
        before = self._sent([g])
        t0 = time.perf_counter()
        for j, (room, dst) in enumerate(rooms):
            c.dc.expect(room, g.name, dst.tolist(), aux_slot=j, state=self._ds_state(j))
        ok = self._wait_all(c, [(g.name, room) for room, _ in rooms])
        dt = time.perf_counter() - t0
        after = self._sent([g])
        self._verify(c, g, rooms[0][1], g.src_pages, self._ds_state(0), self._ds_state(0), 0, 0)
        self._release(c, [(g.name, room) for room, _ in rooms])
        return {"seconds": dt / R if ok == R else None, "wire": after[0] - before[0], "skipped": after[1] - before[1],
                "rooms": R}

    def small(self, cp: int) -> dict[str, Any]:
        c = self.ds
        assert c is not None and c.dc is not None
        g = c.groups[f"ds{cp}"]
        p = self.plan
        K = p.small_batch_rooms
        base = self.plan.dedup_rooms * c.cfg.demo.pages_per_room  # small rooms' pages follow the de-dup rooms'
        dst_pages = c.dst_perm[base:base + K]
        kv_src = g.pools[0].layout.kv_rows

        def submit(i: int, slot: int) -> int:
            room = self.room_id()
            _guard(g.pools[0], slot, room)
            for r, pc in enumerate(g.pcs):
                pc.submit(room, 0, [int(g.src_pages[r][i % len(g.src_pages[r])]) % kv_src], last=True, aux_slot=slot)
            return room

        def check(i: int, slot: int) -> None:
            self._verify(c, g, np.array([dst_pages[slot]]),
                         [np.array([int(g.src_pages[r][i % len(g.src_pages[r])]) % kv_src]) for r in range(cp)],
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
                self._poison(c, np.array([dst_pages[slot]]), {}, slot)
            t0 = time.perf_counter()
            c.dc.expect(room, g.name, [int(dst_pages[slot])], aux_slot=slot)
            st = c.dc.wait(room, g.name, p.room_timeout_s)
            t1 = time.perf_counter()
            if st.state is RoomState.SUCCESS:
                self.ok_rooms += 1
                lat.append(t1 - t0)
                if verify:
                    check(i, slot)
            else:
                self.failed_rooms[st.code or st.state.value] += 1
                log.error("bench: small room %d of %s ended %s: %s", room, g.name, st.state.value, st.reason)
            c.dc.release(room, g.name)
        self.latencies[cp] += lat
        # throughput: K rooms in flight, the engines batching their calls (submit_many,
        # expect_many, wait_many: one round trip each instead of one per room)
        rooms = [self.room_id() for _ in range(K)]
        for i, room in enumerate(rooms):
            _guard(g.pools[0], i, room)
        for r, pc in enumerate(g.pcs):
            pc.submit_many([dict(room=room, src_pages=[int(g.src_pages[r][i % len(g.src_pages[r])]) % kv_src],
                                 last=True, aux_slot=i) for i, room in enumerate(rooms)])
        for i in range(0, K, p.small_verify_every):
            self._poison(c, np.array([dst_pages[i]]), {}, i)
        t0 = time.perf_counter()
        c.dc.expect_many([dict(room=room, group=g.name, dst_pages=[int(dst_pages[i])], aux_slot=i)
                          for i, room in enumerate(rooms)])
        ok = self._wait_all(c, [(g.name, room) for room in rooms])
        dt = time.perf_counter() - t0
        for i in range(0, K, p.small_verify_every):
            check(i, i)
        self._release(c, [(g.name, room) for room in rooms])
        return {"rooms_per_s": K / dt if ok == K else None, "p50_ms": 1e3 * float(np.percentile(lat, 50)) if lat else None,
                "rpc_rtt_us": 1e6 * float(np.median(rtt))}

    # -- rounds --------------------------------------------------------------------------
    def subjects(self) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
        out: list[tuple[str, Callable[[], dict[str, Any]]]] = []
        for key in SIZES:
            out.append((f"memcpy/{key}", partial(self.memcpy, key)))
            out.append((f"raw_zmq/{key}", partial(self.raw_zmq, key)))
            out.append((f"raw_tcp/{key}", partial(self.raw_tcp, key)))
        for key in BULK_KEYS:
            out.append((f"bulk/{key}", partial(self.bulk_room, key)))
            out.append((f"bulk_shm/{key}", partial(self.bulk_room, key, "shm")))
        out.append(("bulk_zmq/1MiB", partial(self.bulk_room, "1MiB", "zmq")))
        for cp in DEDUP_CPS:
            out.append((f"dedup_on/{cp}", partial(self.dedup_on, cp)))
            if cp > 1:
                out.append((f"dedup_off/{cp}", partial(self.dedup_off, cp)))
        for cp in SMALL_CPS:
            out.append((f"small/{cp}", partial(self.small, cp)))
        if self.mooncake is not None:
            for key in SIZES:
                out.append((f"mooncake/{key}", partial(self.mooncake_tcp, key)))
        if self.only:
            out = [(n, fn) for n, fn in out if any(fnmatch.fnmatchcase(n, g) for g in self.only)]
        return out

    def mooncake_tcp(self, key: str) -> dict[str, Any]:
        assert self.mooncake is not None and self.lim_pool is not None
        verify = key not in self.mooncake.verified
        if verify:  # memcpy and raw zmq leave the same bytes there: start from a known other pattern
            self.lim_pool.rows[1][:] = POISON
        total = self.plan.bulk_room_bytes * self.plan.bulk_rooms
        try:
            dt = self.mooncake.write(SIZES[key], total)
        except Exception as exc:
            self.notes["peers"] = f"mooncake tcp transfer failed: {exc}"
            return {"gbps": None}
        if verify:
            self.mooncake.mismatched += int(np.count_nonzero(self.lim_pool.rows[1] != self.lim_pool.rows[0]))
            self.mooncake.verified.add(key)
        return {"gbps": total / dt / 1e9}

    def run_rounds(self) -> None:
        self._wait_raw_ready()
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
            self.latencies = {cp: [] for cp in SMALL_CPS}
            for k, names in enumerate(rounds):
                for name in names:
                    bar.set_postfix_str(f"round {k + 1}/{len(rounds)} {name}", refresh=False)
                    self.results.setdefault(name, []).append(fns[name]())
                    bar.update(1)
        finally:
            bar.close()

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        if self.ctrl is not None and self.raw is not None and self.raw.poll() is None:
            try:
                self.ctrl.send(msgpack.packb(None), flags=zmq.NOBLOCK)
                self.raw.wait(5)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass  # stopped with the daemons below
        for c in self.clusters.values():
            if c.dc is not None:
                c.dc.close()
            for g in c.groups.values():
                for pc in g.pcs:
                    pc.close()
                for pool in g.pools:
                    pool.close()
            if c.dpool is not None:
                c.dpool.close()
        for s in (self.pull, self.ctrl):
            if s is not None:
                s.close(linger=0)
        for t in (self.tcp, self.tcp_listen):
            if t is not None:
                t.close()
        if self.raw_ctx is not None:
            self.raw_ctx.term()
        if self.mooncake is not None:
            self.mooncake.close()
        self.codes = self.daemons.stop()
        if self.lim_pool is not None:
            self.lim_pool.close()
            self.lim_pool.unlink()
        for f in shm_dir().glob(f"transferd-{self.tag}-*"):  # pools of daemons that did not exit cleanly
            f.unlink(missing_ok=True)
        if self.progress:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    def _peers_report(self, med: Callable[[str, str], float | None],
                      paired: Callable[[str, str], float | None]) -> dict[str, Any]:
        if self.mooncake is None:
            return {}
        by_size = {key: _r(med(f"mooncake/{key}", "gbps"), 3) for key in SIZES}
        self.notes.setdefault("peers", "Mooncake Transfer Engine, TCP transport, P2P handshake, target in another "
                                       "process writing into a shared-memory pool; same bytes as the bulk rooms")
        return {"mooncake_tcp_gbps": by_size["1MiB"], "mooncake_tcp_gbps_by_size": by_size,
                "mooncake_tcp_rounds": {key: [_r(r["gbps"], 3) for r in self.results.get(f"mooncake/{key}", [])]
                                        for key in SIZES},
                "transferd_tcp_vs_mooncake_tcp_by_size": {key: _r(paired(f"bulk/{key}", f"mooncake/{key}"), 3)
                                                          for key in SIZES},
                # what 2 × Mooncake asks of any transport: its rate doubled, over the raw TCP limit
                # measured in the same rounds (> 1: beyond a plain socket on this host)
                "twice_mooncake_vs_raw_tcp_by_size": {key: _r(2 * r, 3) if (r := paired(f"mooncake/{key}",
                                                                                       f"raw_tcp/{key}")) else None
                                                      for key in SIZES},
                "mooncake_tcp_mismatched_bytes": self.mooncake.mismatched}

    def dump_logs(self) -> None:
        for p in self.daemons.procs:
            tail = self.daemons.tail(p, 12)
            if tail.strip():
                print(f"--- {p.label} ---\n{tail}", file=sys.stderr)

    # -- the report ----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        res = self.results

        def med(name: str, key: str) -> float | None:
            return _median([r.get(key) for r in res.get(name, [])])

        def paired(a: str, b: str, key_a: str = "gbps", key_b: str = "gbps") -> float | None:
            xs = [x[key_a] / y[key_b] for x, y in zip(res.get(a, []), res.get(b, []))
                  if x.get(key_a) and y.get(key_b)]
            return _median(xs)

        limits: dict[str, Any] = {"memcpy": {}, "raw_zmq_tcp": {}, "raw_tcp": {}}
        for key, size in SIZES.items():
            for name, out in (("memcpy", "memcpy"), ("raw_zmq", "raw_zmq_tcp"), ("raw_tcp", "raw_tcp")):
                limits[out][key] = {"message_bytes": size, "gbps": _r(med(f"{name}/{key}", "gbps"), 3),
                                    "rounds": [_r(r["gbps"], 3) for r in res.get(f"{name}/{key}", [])]}
                if name != "memcpy":
                    for side in ("receiver", "sender"):
                        limits[out][key][f"{side}_cpu_s_per_gb"] = _r(med(f"{name}/{key}", f"{side}_cpu_s_per_gb"), 3)
        limits["bytes_per_measurement"] = self.plan.bulk_room_bytes * self.plan.bulk_rooms
        limits["notes"] = ("memcpy: np.copyto from one shared-memory pool buffer into another, one thread, "
                           "message-sized pieces over a ring as large as a bulk run. raw_zmq_tcp: pyzmq "
                           "PUSH/PULL on tcp://127.0.0.1, separate messages (not multipart) sent zero-copy "
                           "(copy=False) out of a pool by another process; the receiver copies every frame "
                           "into a pool. raw_tcp: the same messages through one plain TCP connection on "
                           "127.0.0.1, sendall out of the pool, recv_into straight into the destination pool "
                           "(one kernel copy a side): what any TCP transport can reach on this host.")
        bulk: dict[str, Any] = {}
        by_size: dict[str, float | None] = {}
        for key in BULK_KEYS:
            c = self.bulk[key.split("_")[0]]
            row = SIZES[key.split("_")[0]]
            msg = MiB if key.endswith("_contig") else row
            msg_key = "1MiB" if key.endswith("_contig") else key
            ratio = paired(f"bulk/{key}", f"raw_zmq/{msg_key}")
            by_size[key] = _r(ratio, 3)
            bulk[key] = {
                "row_bytes": row, "message_bytes": msg, "pages": "contiguous" if key.endswith("_contig") else "scattered",
                "pages_per_room": c.pages, "kv_buffers": BULK_LAYERS,
                "room_bytes": c.pages * c.layout.kv_page_bytes() + c.layout.aux_row_bytes,
                "rooms_per_measurement": self.plan.bulk_rooms,
                "gbps": _r(med(f"bulk/{key}", "gbps"), 3),
                "rounds": [_r(r["gbps"], 3) for r in res.get(f"bulk/{key}", [])],
                "vs_raw_zmq": _r(ratio, 3),
                "vs_raw_tcp": _r(paired(f"bulk/{key}", f"raw_tcp/{msg_key}"), 3),
                "vs_memcpy": _r(paired(f"bulk/{key}", f"memcpy/{msg_key}"), 3),
                "receiver_cpu_s_per_gb": _r(med(f"bulk/{key}", "receiver_cpu_s_per_gb"), 3),
                "sender_cpu_s_per_gb": _r(med(f"bulk/{key}", "sender_cpu_s_per_gb"), 3),
                "shm_share": _r(med(f"bulk/{key}", "shm_share"), 4),
                "stream_share": _r(med(f"bulk/{key}", "stream_share"), 4),
            }
        zmq_only = "bulk_zmq/1MiB"
        bulk["1MiB"]["zmq_socket"] = {
            "note": ("the same rooms from a sender with data_stream = \"off\": data messages through the ZeroMQ "
                     "socket (the path with CURVE, or with the stream off); the 1MiB figures above went on a "
                     "data stream (stream_share = 1.0)"),
            "gbps": _r(med(zmq_only, "gbps"), 3), "rounds": [_r(r["gbps"], 3) for r in res.get(zmq_only, [])],
            "vs_raw_zmq": _r(paired(zmq_only, "raw_zmq/1MiB"), 3),
            "stream_vs_zmq_socket": _r(paired("bulk/1MiB", zmq_only), 3),
            "receiver_cpu_s_per_gb": _r(med(zmq_only, "receiver_cpu_s_per_gb"), 3),
            "sender_cpu_s_per_gb": _r(med(zmq_only, "sender_cpu_s_per_gb"), 3),
            "stream_share": _r(med(zmq_only, "stream_share"), 4),
        }
        same_host: dict[str, Any] = {
            "available": True,
            "note": ("the same rooms from a sender with same_host = \"auto\" into the same receiver: data-refs "
                     "messages over ZeroMQ, the receiver copying rows out of the sender's pool; shm_share is "
                     "the part of the bytes the sender counted as moved that way (1.0 = the path was used)"),
        }
        for key in BULK_KEYS:
            msg_key = "1MiB" if key.endswith("_contig") else key
            name = f"bulk_shm/{key}"
            same_host[key] = {
                "gbps": _r(med(name, "gbps"), 3), "rounds": [_r(r["gbps"], 3) for r in res.get(name, [])],
                "vs_memcpy": _r(paired(name, f"memcpy/{msg_key}"), 3),
                "vs_tcp": _r(paired(name, f"bulk/{key}"), 3),
                "receiver_cpu_s_per_gb": _r(med(name, "receiver_cpu_s_per_gb"), 3),
                "sender_cpu_s_per_gb": _r(med(name, "sender_cpu_s_per_gb"), 3),
                "shm_share": _r(med(name, "shm_share"), 4),
            }
            bulk[key]["same_host_gbps"] = same_host[key]["gbps"]
            bulk[key]["same_host_vs_memcpy"] = same_host[key]["vs_memcpy"]
        same_host_ratio = same_host["1MiB"]["vs_memcpy"]
        same_host_note = ("transferd's same-host path, bulk rooms of 1 MiB rows, vs one-thread memcpy of "
                          "1 MiB pieces, median of per-round ratios")
        small: dict[str, Any] = {}
        for cp in SMALL_CPS:
            lat = np.asarray(self.latencies[cp]) * 1e3
            small[f"cp{cp}"] = {
                "cp_size": cp,
                "p50_ms": _r(float(np.percentile(lat, 50)), 3) if lat.size else None,
                "p99_ms": _r(float(np.percentile(lat, 99)), 3) if lat.size else None,
                "latency_samples": int(lat.size),
                "rooms_per_s": _r(med(f"small/{cp}", "rooms_per_s"), 1),
                "rooms_per_s_rounds": [_r(r["rooms_per_s"], 1) for r in res.get(f"small/{cp}", [])],
                "rooms_in_flight": self.plan.small_batch_rooms,
                "engine_rpc_rtt_us": _r(med(f"small/{cp}", "rpc_rtt_us"), 1),
            }
        assert self.ds is not None
        lay = self.ds.layout
        n = self.ds.cfg.demo.pages_per_room
        kv = n * lay.kv_page_bytes()
        st = sum(b.row_bytes for b in lay.buffers if b.kind == "state")
        aux = lay.aux_row_bytes
        small["room"] = {"pages": 1, "state": False, "aux": True, "config": "configs/deepseek-cp8.toml",
                         "kv_bytes": lay.kv_page_bytes(), "messages_per_room_rank0": len(lay.indices("kv")) + 1}
        dedup: dict[str, Any] = {
            "config": "configs/deepseek-cp8.toml", "model": lay.model, "room_pages": n,
            "room_tokens": n * lay.page_size, "kv_bytes_per_room": kv, "state_bytes_per_room": st,
            "aux_bytes_per_room": aux, "state_kv_ratio": _r(st / kv, 6), "rooms_per_measurement": self.plan.dedup_rooms,
            "production_cut_cp8": PRODUCTION_CUT_CP8,
            "layout_cut_cp8_no_aux": _r(7 * st / (kv + 8 * st), 6),
            "method": ("the same room from two real groups of cp ranks into the same receiver: one with the "
                       "de-dup (sender.dedup = true, the default), one without (sender.dedup = false: every rank "
                       "ships the replicated state). Wire bytes from the senders' own counters; measured cut = "
                       "(off - on) / off; analytic cut = (cp-1)·S / (KV + cp·S + aux) from the layout. At cp 1 "
                       "there is nothing to de-duplicate: off is the on group."),
        }
        for cp in DEDUP_CPS:
            on = res.get(f"dedup_on/{cp}", [])
            wire = sum(r["wire"] for r in on)
            skipped = sum(r["skipped"] for r in on)
            rooms = sum(r["rooms"] for r in on)
            t_on = med(f"dedup_on/{cp}", "seconds")
            off_name = f"dedup_off/{cp}" if cp > 1 else f"dedup_on/{cp}"
            t_off = med(off_name, "seconds")
            off_runs = res.get(off_name, [])
            off_wire = sum(r["wire"] for r in off_runs)
            off_rooms = sum(r["rooms"] for r in off_runs)
            on_b = wire // rooms if rooms else None
            off_b = off_wire // off_rooms if off_rooms else None
            dedup[f"cp{cp}"] = {
                "cp_size": cp, "rooms": rooms, "rooms_off": off_rooms,
                "wire_bytes_on": on_b,
                "wire_bytes_off": off_b,
                "wire_mb_on": _r(on_b / 1e6, 3) if on_b is not None else None,
                "wire_mb_off": _r(off_b / 1e6, 3) if off_b is not None else None,
                "state_bytes_skipped": skipped // rooms if rooms else None,
                "measured_cut": (off_b - on_b) / off_b if on_b is not None and off_b else None,
                "analytic_cut": (cp - 1) * st / (kv + cp * st + aux),
                "time_ms_on": _r(t_on * 1e3 if t_on else None, 2),
                "time_ms_off": _r(t_off * 1e3 if t_off else None, 2),
                "time_on_vs_off": _r(paired(f"dedup_on/{cp}", off_name, "seconds", "seconds"), 3),
                "gbps_on": _r((wire / rooms) / t_on / 1e9 if rooms and t_on else None, 3),
                "off": "measured: a group with sender.dedup = false" if cp > 1 else
                       "the on group (nothing to de-duplicate at cp 1)",
            }
        ratios = {
            "tcp_vs_raw_zmq": by_size.get("1MiB"),
            "tcp_vs_raw_zmq_by_size": by_size,
            "same_host_vs_memcpy": same_host_ratio,
            "notes": {"tcp_vs_raw_zmq": "transferd bulk rooms of 1 MiB rows vs raw pyzmq with 1 MiB messages, "
                                        "same bytes, median of per-round ratios",
                      "same_host_vs_memcpy": same_host_note},
        }
        c1 = small["cp1"]
        targets = {
            "tcp_vs_raw_zmq >= 0.9": {"value": ratios["tcp_vs_raw_zmq"],
                                      "met": _met(ratios["tcp_vs_raw_zmq"], TARGETS["tcp_vs_raw_zmq"], True)},
            "same_host_vs_memcpy >= 0.8": {"value": same_host_ratio,
                                           "met": _met(same_host_ratio, TARGETS["same_host_vs_memcpy"], True)},
            "small_rooms.cp1.p50_ms <= 1": {"value": c1["p50_ms"], "met": _met(c1["p50_ms"], 1.0, False)},
            "small_rooms.cp1.rooms_per_s >= 2000": {"value": c1["rooms_per_s"],
                                                    "met": _met(c1["rooms_per_s"], 2000.0, True)},
            "dedup.cp8.measured_cut == analytic_cut": {
                "value": dedup["cp8"]["measured_cut"],
                "met": dedup["cp8"]["measured_cut"] is not None
                and abs(dedup["cp8"]["measured_cut"] - dedup["cp8"]["analytic_cut"]) < 1e-9},
            "dedup.cp8 time on < off": {"value": dedup["cp8"]["time_on_vs_off"],
                                        "met": _met(dedup["cp8"]["time_on_vs_off"], 1.0, False)},
            ">= 2x mooncake tcp": {"value": None, "met": None},
        }
        if self.mooncake is not None:
            v = paired("bulk/1MiB", "mooncake/1MiB")
            ratios["vs_mooncake_tcp"] = _r(v, 3)
            ratios["notes"]["vs_mooncake_tcp"] = ("transferd bulk rooms of 1 MiB rows over TCP vs Mooncake Transfer "
                                                  "Engine's TCP transport writing the same bytes in 1 MiB pieces")
            targets[">= 2x mooncake tcp"] = {"value": _r(v, 3), "met": _met(v, TARGETS["vs_mooncake_tcp"], True)}
        return {
            "bench_version": BENCH_VERSION, "quick": self.quick, "repeats": self.plan.repeats,
            "target_repeats": self.plan.target_repeats,
            "host": _host(), "limits": limits, "bulk": bulk,
            "same_host": same_host,
            "small_rooms": small, "dedup": dedup, "ratios": ratios, "targets": targets,
            "peers": self._peers_report(med, paired), "notes": self.notes,
            "mismatched_bytes": self.mismatched, "verified_rooms": self.verified_rooms,
            "rooms_ok": self.ok_rooms, "rooms_failed": sum(self.failed_rooms.values()),
            "rooms_failed_by_reason": dict(self.failed_rooms),
        }


class _Mooncake:
    """Mooncake Transfer Engine's TCP transport (P2P handshake, no metadata server), the peer column:
    this process writes buffer 0 of the limits' pool into buffer 1 as mapped by a target process
    (``mooncake_target_main``), in pieces of the message size, batches of at most 16 MiB."""

    def __init__(self, pool: Pool, run_dir: Path) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines would bury the table on stderr
        from mooncake.engine import TransferEngine

        self.verified: set[str] = set()
        self.mismatched = 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root()),
                                                                           os.environ.get("PYTHONPATH")]))}
        self.log = open(run_dir / "logs" / "mooncake-target.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from transferd.tools.bench import mooncake_target_main as m; "
             "sys.exit(m(sys.argv[1:]))", pool.name], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, start_new_session=True, preexec_fn=die_with_parent)
        try:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line:
                raise TransferdError("the mooncake target process exited before it was ready")
            info = json.loads(line)
            self.target, self.dst = f"127.0.0.1:{info['port']}", int(info["addr"])
            self.te = TransferEngine()
            if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise TransferdError("TransferEngine.initialize failed")
            src = pool.rows[0]
            self.src, self.ring = int(src.ctypes.data), src.nbytes
            if self.te.register_memory(self.src, self.ring) != 0:
                raise TransferdError("TransferEngine.register_memory failed")
        except BaseException:
            self.close()
            raise

    def write(self, size: int, total: int) -> float:
        n = total // size
        batch = max(1, (16 * MiB) // size)
        slots = self.ring // size
        t0 = time.perf_counter()
        for b0 in range(0, n, batch):
            offs = [((b0 + i) % slots) * size for i in range(min(batch, n - b0))]
            rc = self.te.batch_transfer_sync_write(self.target, [self.src + o for o in offs],
                                                   [self.dst + o for o in offs], [size] * len(offs))
            if rc != 0:
                raise TransferdError(f"batch_transfer_sync_write returned {rc}")
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def mooncake_target_main(argv: list[str]) -> int:
    """The Mooncake target: maps the pool, registers buffer 1, prints ``{"port", "addr"}``, and
    serves until a line arrives on stdin."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from mooncake.engine import TransferEngine

    pool = Pool.attach(argv[0])
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        return 1
    dst = pool.rows[1]
    if te.register_memory(int(dst.ctypes.data), dst.nbytes) != 0:
        return 1
    print(json.dumps({"port": te.get_rpc_port(), "addr": int(dst.ctypes.data)}), flush=True)
    sys.stdin.readline()
    return 0


def _met(v: float | None, target: float, at_least: bool) -> bool | None:
    if v is None:
        return None
    return v >= target if at_least else v <= target


def _host() -> dict[str, Any]:
    try:
        load_avg = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_avg = []
    return {"cpus": os.cpu_count(), "loadavg": load_avg, "python": platform.python_version(),
            "pyzmq": zmq.pyzmq_version(), "libzmq": zmq.zmq_version(), "numpy": np.__version__,
            "machine": platform.machine(), "system": platform.system()}


# -- the raw zmq sender (its own process) ---------------------------------------------------------

def raw_zmq_sender_main(argv: list[str]) -> int:
    """``python -c ... raw_zmq_sender_main(ctrl, data, pool, tcp_host:port)``: on each ``[size,
    count, "zmq"|"tcp"]`` from the control socket, send ``count`` messages of ``size`` bytes out of
    buffer 0 of the pool, zero-copy through ZeroMQ or ``sendall`` on a plain TCP connection;
    ``None`` ends it."""
    ctrl_ep, data_ep, pool_name, tcp_addr = argv
    keep_message_buffers_mapped()
    pool = Pool.attach(pool_name)
    src = pool.rows[0].reshape(-1)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(data_ep)
    ctrl = ctx.socket(zmq.PAIR)
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl.connect(ctrl_ep)
    host, _, port = tcp_addr.rpartition(":")
    tcp = socket.create_connection((host, int(port)))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = src.data
    ctrl.send(b"ready")
    try:
        while True:
            if not ctrl.poll(600_000):
                return 1  # the bench went away
            cmd = msgpack.unpackb(ctrl.recv())
            if not cmd:
                return 0
            size, count, how = int(cmd[0]), int(cmd[1]), cmd[2]
            ring = src.size // size
            send = tcp.sendall if how == "tcp" else partial(push.send, copy=False)
            for i in range(count):
                o = (i % ring) * size
                send(view[o:o + size])
            ctrl.send(b"sent")
    finally:
        tcp.close()
        del view
        push.close(linger=0)
        ctrl.close(linger=0)
        ctx.term()
        del src
        pool.close()


# -- the table and the plot -----------------------------------------------------------------------

def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def format_table(out: dict[str, Any]) -> str:
    h = out["host"]
    rounds = f"{out['repeats']}" + (f" (the 1 MiB block {out['target_repeats']} times)"
                                   if out.get("target_repeats", out["repeats"]) != out["repeats"] else "")
    lines = [f"transferd bench ({'quick' if out['quick'] else 'full'}): {rounds} interleaved rounds, "
             f"medians; {h['cpus']} CPUs, load {h.get('loadavg_before', [])} → {h['loadavg']}; "
             f"pyzmq {h['pyzmq']} / libzmq {h['libzmq']}; GB/s = 1e9 B/s", ""]
    lim, bulk = out["limits"], out["bulk"]
    keys = list(SIZES)
    w = 12
    lines.append("message size".ljust(34) + "".join(k.rjust(w) for k in keys))
    lines.append("memcpy → pool (1 thread) GB/s".ljust(34) + "".join(_f(lim["memcpy"][k]["gbps"]).rjust(w) for k in keys))
    lines.append("raw pyzmq tcp, zero-copy GB/s".ljust(34) + "".join(_f(lim["raw_zmq_tcp"][k]["gbps"]).rjust(w) for k in keys))
    for side in ("receiver", "sender"):
        lines.append(f"  {side} CPU s/GB".ljust(34)
                     + "".join(_f(lim["raw_zmq_tcp"][k].get(f"{side}_cpu_s_per_gb")).rjust(w) for k in keys))
    if "raw_tcp" in lim:
        lines.append("raw tcp socket, recv_into GB/s".ljust(34) + "".join(_f(lim["raw_tcp"][k]["gbps"]).rjust(w)
                                                                     for k in keys))
        for side in ("receiver", "sender"):
            lines.append(f"  {side} CPU s/GB".ljust(34)
                         + "".join(_f(lim["raw_tcp"][k].get(f"{side}_cpu_s_per_gb")).rjust(w) for k in keys))
    lines.append("transferd tcp (scattered) GB/s".ljust(34) + "".join(_f(bulk[k]["gbps"]).rjust(w) for k in keys))
    lines.append("  × raw pyzmq".ljust(34) + "".join(_f(bulk[k]["vs_raw_zmq"]).rjust(w) for k in keys))
    lines.append("  × raw tcp socket".ljust(34) + "".join(_f(bulk[k].get("vs_raw_tcp")).rjust(w) for k in keys))
    lines.append("  × memcpy".ljust(34) + "".join(_f(bulk[k]["vs_memcpy"]).rjust(w) for k in keys))
    lines.append("  receiver CPU s/GB".ljust(34) + "".join(_f(bulk[k]["receiver_cpu_s_per_gb"]).rjust(w) for k in keys))
    lines.append("  sender CPU s/GB".ljust(34) + "".join(_f(bulk[k]["sender_cpu_s_per_gb"]).rjust(w) for k in keys))
    peers = out["peers"]
    if peers.get("mooncake_tcp_gbps_by_size"):
        mc = peers["mooncake_tcp_gbps_by_size"]
        lines.append("Mooncake TE tcp (peer) GB/s".ljust(34) + "".join(_f(mc[k]).rjust(w) for k in keys))
        rel = peers["transferd_tcp_vs_mooncake_tcp_by_size"]
        lines.append("  transferd tcp × Mooncake".ljust(34) + "".join(_f(rel[k]).rjust(w) for k in keys))
        need = peers.get("twice_mooncake_vs_raw_tcp_by_size")
        if need:
            lines.append("  2 × Mooncake ÷ raw tcp socket".ljust(34) + "".join(_f(need[k]).rjust(w) for k in keys))
    bc = bulk["64KiB_contig"]
    lines.append(f"transferd tcp, 64 KiB rows on contiguous pages (1 MiB messages): {_f(bc['gbps'])} GB/s, "
                 f"{_f(bc['vs_raw_zmq'])} × raw pyzmq 1 MiB")
    zs = bulk["1MiB"].get("zmq_socket")
    if zs:
        lines.append(f"transferd tcp without the data stream (ZeroMQ socket), 1 MiB rows: {_f(zs['gbps'])} GB/s, "
                     f"{_f(zs['vs_raw_zmq'])} × raw pyzmq; the stream is {_f(zs['stream_vs_zmq_socket'])} × this")
    sh = out["same_host"]
    if sh.get("available"):
        lines.append("transferd same-host (rows) GB/s".ljust(34) + "".join(_f(sh[k]["gbps"]).rjust(w) for k in keys))
        lines.append("  × memcpy".ljust(34) + "".join(_f(sh[k]["vs_memcpy"]).rjust(w) for k in keys))
        lines.append("  × transferd tcp".ljust(34) + "".join(_f(sh[k]["vs_tcp"]).rjust(w) for k in keys))
        lines.append("  receiver CPU s/GB".ljust(34) + "".join(_f(sh[k]["receiver_cpu_s_per_gb"]).rjust(w)
                                                            for k in keys))
        shc = sh["64KiB_contig"]
        lines.append(f"transferd same-host, 64 KiB rows on contiguous pages: {_f(shc['gbps'])} GB/s, "
                     f"{_f(shc['vs_memcpy'])} × memcpy 1 MiB")
    else:
        lines.append(f"same-host path: — ({sh['note']})")
    lines.append("")
    sr = out["small_rooms"]
    lines.append(f"small rooms (1 page of {sr['room']['kv_bytes'] // 1024} KiB over {sr['room']['messages_per_room_rank0'] - 1} "
                 f"KV buffers + aux, no state; expect → Success from the decode engine):")
    lines.append("  cp   p50 ms   p99 ms   rooms/s (" + f"{sr['cp1']['rooms_in_flight']} in flight, batched)   "
                 "engine API round trip (ping) µs")
    for cp in SMALL_CPS:
        s = sr[f"cp{cp}"]
        lines.append(f"  {cp:<3}{_f(s['p50_ms'], '{:.3f}').rjust(7)}  {_f(s['p99_ms'], '{:.3f}').rjust(7)}  "
                     f"{_f(s['rooms_per_s'], '{:.0f}').rjust(8)}  {_f(s['engine_rpc_rtt_us'], '{:.0f}').rjust(27)}")
    lines.append("")
    d = out["dedup"]
    lines.append(f"CP de-dup, {d['config']} ({d['model']}): a {d['room_tokens']}-token room, KV "
                 f"{d['kv_bytes_per_room'] / 1e6:.2f} MB, replicated state {d['state_bytes_per_room'] / 1e6:.2f} MB "
                 f"(S/KV {d['state_kv_ratio']:.4f})")
    lines.append("  cp  wire MB off  wire MB on   cut measured  cut analytic    ms off   ms on   on/off   (ms per room, "
                 "expect → Success)")
    for cp in DEDUP_CPS:
        e = d[f"cp{cp}"]
        cut_m = None if e["measured_cut"] is None else 100 * e["measured_cut"]
        lines.append(f"  {cp:<3}{_f(e['wire_mb_off']).rjust(10)}  {_f(e['wire_mb_on']).rjust(10)}   "
                     f"{_f(cut_m, '{:.4f} %').rjust(12)}  {_f(100 * e['analytic_cut'], '{:.4f} %').rjust(12)}  "
                     f"{_f(e['time_ms_off'], '{:.1f}').rjust(8)}  {_f(e['time_ms_on'], '{:.1f}').rjust(6)}  "
                     f"{_f(e['time_on_vs_off']).rjust(7)}")
    lines.append(f"  production figure at cp 8: {100 * d['production_cut_cp8']:.2f} %; this layout without the aux "
                 f"row: {100 * d['layout_cut_cp8_no_aux']:.4f} %. off: the same room from a group with "
                 "sender.dedup = false; bytes from the senders' counters")
    lines.append("")
    lines.append("targets:")
    for name, t in out["targets"].items():
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        v = t["value"]
        lines.append(f"  {name:<42} {_f(v, '{:.4g}') if isinstance(v, (int, float)) else '—':>10}  {met}")
    lines.append(f"peers: {out['notes'].get('peers', 'none')}")
    lines.append(f"rooms: {out['rooms_ok']} ok, {out['rooms_failed']} failed; {out['verified_rooms']} verified byte "
                 f"for byte, {out['mismatched_bytes']} mismatched bytes; {out.get('seconds', 0):.1f} s")
    return "\n".join(lines)


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    xs = [SIZES[k] / KiB for k in SIZES]
    series = [("memcpy → pool", [out["limits"]["memcpy"][k]["gbps"] for k in SIZES]),
              ("raw pyzmq tcp", [out["limits"]["raw_zmq_tcp"][k]["gbps"] for k in SIZES]),
              ("transferd tcp", [out["bulk"][k]["gbps"] for k in SIZES])]
    if out["same_host"].get("available"):
        series.append(("transferd same-host", [out["same_host"][k]["gbps"] for k in SIZES]))
    if out["peers"].get("mooncake_tcp_gbps_by_size"):
        series.append(("Mooncake TE tcp", [out["peers"]["mooncake_tcp_gbps_by_size"][k] for k in SIZES]))
    for label, ys in series:
        ax1.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [k for k in SIZES])
    ax1.set_xlabel("message size")
    ax1.set_ylabel("GB/s")
    ax1.set_title("throughput vs message size")
    ax1.legend()
    ax1.grid(alpha=0.3)
    d = out["dedup"]
    cps = list(DEDUP_CPS)
    x = np.arange(len(cps))
    off = [d[f"cp{c}"]["wire_mb_off"] or 0 for c in cps]
    on = [d[f"cp{c}"]["wire_mb_on"] or 0 for c in cps]
    ax2.bar(x - 0.2, off, 0.4, label="de-dup off")
    ax2.bar(x + 0.2, on, 0.4, label="de-dup on")
    for i, c in enumerate(cps):
        cut = d[f"cp{c}"]["measured_cut"]
        if cut:
            ax2.text(x[i] + 0.2, on[i], f"−{100 * cut:.2f} %", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(x, [f"cp {c}" for c in cps])
    ax2.set_ylabel("wire MB per room")
    ax2.set_title(f"CP de-dup: bytes ({d['room_tokens']}-token room)")
    ax2.legend()
    t_off = [d[f"cp{c}"]["time_ms_off"] or 0 for c in cps]
    t_on = [d[f"cp{c}"]["time_ms_on"] or 0 for c in cps]
    ax3.bar(x - 0.2, t_off, 0.4, label="de-dup off")
    ax3.bar(x + 0.2, t_on, 0.4, label="de-dup on")
    ax3.set_xticks(x, [f"cp {c}" for c in cps])
    ax3.set_ylabel("ms per room (expect → Success)")
    ax3.set_title("CP de-dup: transfer time")
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- entry point ----------------------------------------------------------------------------------

def run_bench(cfg: Config, cfg_path: str | None, *, quick: bool = False, json_path: str | None = None,
              plot_path: str | None = None, repeats: int | None = None, only: str | None = None) -> int:
    """Run the benchmark; print the table, write JSON/plot. 0 when every room succeeded and every
    verified byte matched (figures below a target do not fail the run), 1 otherwise, 2 on usage
    errors."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        print("transferd bench: --plot needs matplotlib, which is not installed "
              "(pip install matplotlib)", file=sys.stderr)
        return 2
    if repeats is not None and repeats < 1:
        print(f"transferd bench: --repeats must be >= 1, not {repeats}", file=sys.stderr)
        return 2
    plan = QUICK if quick else FULL
    if repeats is not None:
        plan = replace(plan, repeats=repeats, target_repeats=repeats)
    try:
        ds_path = dedup_config_path()
    except ConfigError as exc:
        print(f"transferd bench: {exc}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    try:
        load_before = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_before = []
    table_out = sys.stderr if json_path == "-" else sys.stdout
    progress = sys.stderr.isatty()
    tag = f"bench{os.getpid()}"
    run_dir = Path(tempfile.mkdtemp(prefix="transferd-bench-"))
    bench = _Bench(plan, quick, run_dir, tag, progress)
    if only:
        names = [n for n, _ in bench.subjects()] + [f"mooncake/{k}" for k in SIZES]  # mooncake: when importable
        bench.only = [g.strip() for g in only.split(",") if g.strip()]
        unmatched = [g for g in bench.only if not any(fnmatch.fnmatchcase(n, g) for n in names)]
        if unmatched:
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"transferd bench: --only {unmatched[0]!r} matches no subject (there are: {', '.join(names)})",
                  file=sys.stderr)
            return 2
    out: dict[str, Any] | None = None
    ok = False

    def interrupted(signum: int, frame: Any) -> None:  # SIGTERM/SIGHUP clean up like Ctrl-C
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    try:
        bench.start(ds_path)
        bench.say("measuring")
        bench.run_rounds()
        out = bench.report()
        ok = out["rooms_failed"] == 0 and out["mismatched_bytes"] == 0
    except KeyboardInterrupt:
        bench.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        print("transferd bench: interrupted", file=sys.stderr)
        return 130
    except BaseException:
        bench.dump_logs()
        bench.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if not ok:
        bench.dump_logs()
    bench.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    assert out is not None
    out["host"]["loadavg_before"] = load_before
    out["daemon_exit_codes"] = {k: v for k, v in bench.codes.items() if v not in (0, None)}
    out["seconds"] = round(time.monotonic() - t_start, 2)
    print(format_table(out), file=table_out, flush=True)
    if json_path:
        text = json.dumps(out, indent=2, sort_keys=False)
        if json_path == "-":
            print(text, flush=True)
        else:
            Path(json_path).write_text(text + "\n")
    if plot_path:
        plot(out, plot_path)
    return 0 if ok else 1
