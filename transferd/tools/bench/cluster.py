"""The bench's real daemons (``python -m transferd receiver|sender``) on the one process harness
(:mod:`transferd.tools.procs`): receivers and the prefill groups that feed them, their engine
clients and pools, and the checks of the rooms they move (byte for byte, with
:func:`transferd.tools.rooms.mismatches`)."""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...client import DecodeClient, PrefillClient
from ...config import ENV_NOT_SETTINGS, Config, load
from ...errors import ClientTimeout, TransferdError
from ...layout import PoolLayout
from ...pool.shm import Pool, shm_dir
from ...protocol.room import RoomState
from ...types import SplitMode
from ..procs import Proc, ProcessGroup
from ..rooms import Room, mismatches
from .plan import BULK_LAYERS, NO_METRICS, POISON, SIZES, repo_root

log = logging.getLogger(__name__)


@dataclass
class Group:
    """One prefill group of ``cp`` sender daemons feeding a cluster's receiver."""

    name: str
    cp: int
    cfg: Config
    procs: list[Proc] = field(default_factory=list)
    pcs: list[PrefillClient] = field(default_factory=list)
    pools: list[Pool] = field(default_factory=list)
    src_pages: list[np.ndarray] = field(default_factory=list)  # per rank: the pages its rooms send


@dataclass
class Cluster:
    """One receiver (one pool layout) and the prefill groups that feed it."""

    name: str
    cfg_path: Path
    env: dict[str, str]
    cfg: Config
    rx: Proc | None = None
    endpoint: str = ""
    dc: DecodeClient | None = None
    dpool: Pool | None = None
    groups: dict[str, Group] = field(default_factory=dict)
    # destination pages, in the order rooms take them
    dst_perm: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    pages: int = 0  # pages per bulk room

    @property
    def layout(self) -> PoolLayout:
        assert self.dpool is not None
        return self.dpool.layout


def bulk_model(key: str) -> dict[str, Any]:
    """The bulk rooms' model: 4 MLA KV buffers whose rows are ``key``'s size, a 64-byte aux row."""
    row = SIZES[key]
    return {"name": f"bench-bulk-{key}", "dtype": "bf16", "page_size": 16, "kv_layers": BULK_LAYERS,
            "kv_format": "mla", "kv_token_elems": row // (16 * 2), "aux_row_bytes": 64}


def daemon_base_env(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The base environment of the bench's daemons: ``environ`` without its ``TRANSFERD_*``
    settings, since the bench gives every daemon its settings itself, so that runs compare, nor
    ``TRANSFERD_CONFIG`` (the bench writes its own files); and the settings it dropped."""
    settings = sorted(k for k in environ if k.startswith("TRANSFERD_") and k not in ENV_NOT_SETTINGS)
    drop = {*settings, "TRANSFERD_CONFIG"}
    return {k: v for k, v in environ.items() if k not in drop}, settings


class Fleet:
    """The daemons of one run (child processes, stopped together), the engine clients and pools
    that reach them, and the tally of the rooms they moved."""

    def __init__(self, run_dir: Path, tag: str, room_timeout_s: float) -> None:
        self.run_dir = run_dir
        self.tag = tag
        self.room_timeout_s = room_timeout_s
        env = daemon_base_env(os.environ)[0]
        root = str(repo_root())
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.procs = ProcessGroup(env, run_dir / "logs")
        self.procs.log_dir.mkdir(parents=True, exist_ok=True)
        self.clusters: dict[str, Cluster] = {}
        self.mismatched = 0
        self.verified_rooms = 0
        self.failed_rooms: Counter[str] = Counter()
        self.ok_rooms = 0
        self.mooncake = False  # receivers also read with Mooncake TE (groups that ask for it use it)
        self._room = random.getrandbits(40) << 16

    def room_id(self) -> int:
        self._room += 1
        return self._room

    # -- start-up ------------------------------------------------------------------------
    def env(self, cluster: str, rx: tuple[int, int, int], tx: tuple[int, int, int]) -> dict[str, str]:
        """A cluster's settings: pool sizes (KV pages, state slots, aux slots) of its receiver
        (``rx``) and of each sender (``tx``)."""
        return {
            "TRANSFERD_RUN_DIR": str(self.run_dir),
            "TRANSFERD_LOG_LEVEL": "warning",
            "TRANSFERD_LOG_FORMAT": "text",
            "TRANSFERD_RECEIVER_NAME": cluster,
            "TRANSFERD_RECEIVER_BIND": "tcp://127.0.0.1:*",
            "TRANSFERD_RECEIVER_ENGINE_SOCKET": "unix://{run_dir}/{name}.sock",
            "TRANSFERD_RECEIVER_POOL": f"{self.tag}-{{name}}",
            "TRANSFERD_RECEIVER_KV_PAGES": str(rx[0]),
            "TRANSFERD_RECEIVER_STATE_SLOTS": str(rx[1]),
            "TRANSFERD_RECEIVER_AUX_SLOTS": str(rx[2]),
            "TRANSFERD_SENDER_ENGINE_SOCKET": "unix://{run_dir}/{group}-r{rank}.sock",
            "TRANSFERD_SENDER_POOL": f"{self.tag}-{{group}}-r{{rank}}",
            "TRANSFERD_SENDER_SPLIT": "pages",
            "TRANSFERD_SENDER_KV_PAGES": str(tx[0]),
            "TRANSFERD_SENDER_STATE_SLOTS": str(tx[1]),
            "TRANSFERD_SENDER_AUX_SLOTS": str(tx[2]),
            **({"TRANSFERD_RECEIVER_DATA_PLANE": "mooncake"} if self.mooncake else {}),
            **NO_METRICS,
        }

    def write_bulk_config(self, key: str) -> Path:
        m = bulk_model(key)
        lines = ['log_level = "warning"', "", "[model]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in m.items()]
        lines += ["", "[sender]", 'max_message_bytes = "1MiB"', ""]
        path = self.run_dir / f"bulk-{key}.toml"
        path.write_text("\n".join(lines))
        return path

    def cluster(self, name: str, cfg_path: Path, rx: tuple[int, int, int], tx: tuple[int, int, int]) -> Cluster:
        """Start a receiver (its address is picked by the kernel: see :meth:`answer`)."""
        env = self.env(name, rx, tx)
        c = Cluster(name, cfg_path, env, load(cfg_path, env=env))
        c.rx = self.procs.spawn(f"receiver-{name}", [sys.executable, "-m", "transferd", "receiver", "--config",
                                                     str(cfg_path)], env)
        self.clusters[name] = c
        return c

    def answer(self, c: Cluster, deadline: float) -> None:
        """Wait until ``c``'s receiver answers; learn its data address."""
        dc = DecodeClient(c.cfg.receiver_engine_socket(), timeout_s=2.0)
        c.dc = dc
        c.endpoint = self.until(lambda: dc.ping(0.5) and dc.stats()["data_endpoint"], f"{c.name} to answer",
                                deadline)

    def group(self, c: Cluster, name: str, cp: int, same_host: bool = False, dedup: bool = True,
              stream: bool = True, mooncake: bool = False, kv_pages: int | None = None) -> Group:
        """Start the ``cp`` sender daemons of a group feeding ``c`` (over TCP loopback unless asked;
        ``mooncake``: the receiver reads the rows with Mooncake TE; ``kv_pages``: each rank's pool
        holds that many KV pages instead of the cluster's)."""
        env = {**c.env, **({"TRANSFERD_SENDER_KV_PAGES": str(kv_pages)} if kv_pages is not None else {}),
               "TRANSFERD_SENDER_GROUP": name, "TRANSFERD_SENDER_CP_SIZE": str(cp),
               "TRANSFERD_SENDER_DATA_PLANE": "mooncake" if mooncake else "auto",
               "TRANSFERD_SENDER_DEDUP": "true" if dedup else "false",
               "TRANSFERD_SENDER_DATA_STREAM": "auto" if stream else "off",
               "TRANSFERD_SENDER_SAME_HOST": "auto" if same_host else "off",  # TCP loopback unless asked
               # a same-host group's pools are sealed memfds: its receiver copies out of a mapping
               "TRANSFERD_SENDER_SEALED_POOL": "true" if same_host else "false"}
        g = Group(name, cp, load(c.cfg_path, env=env))
        for rank in range(cp):
            g.procs.append(self.procs.spawn(
                f"sender-{name}-r{rank}",
                [sys.executable, "-m", "transferd", "sender", "--config", str(c.cfg_path), "--cp-rank", str(rank),
                 "--receiver", c.endpoint], env))
        c.groups[name] = g
        return g

    def registered(self, groups: Sequence[Group], deadline: float) -> None:
        """Wait until every rank of ``groups`` answers and is registered with its receiver."""
        for g in groups:
            for rank, pc in enumerate(g.pcs):
                self.until(lambda: pc.ping(0.5) and all(r["state"] == "registered" for r in pc.status()["receivers"]),
                           f"sender {g.name} r{rank} to register", deadline)

    def until(self, fn: Callable[[], Any], what: str, deadline: float) -> Any:
        while True:
            try:
                out = fn()
            except ClientTimeout:
                out = None
            if out:
                return out
            self.procs.check()
            if time.monotonic() > deadline:
                raise TransferdError(f"bench: timed out waiting for {what}")
            time.sleep(0.02)

    # -- rooms -----------------------------------------------------------------------------
    def poison(self, c: Cluster, dst: np.ndarray, state: dict[str, Sequence[int]], aux: int) -> None:
        """A known pattern in a room's destination rows, so that bytes that never arrived show."""
        assert c.dpool is not None
        lay = c.layout
        for b in lay.indices("kv"):
            c.dpool.rows[b][dst] = POISON
        for b in lay.indices("state"):
            slots = state.get(lay.buffers[b].component, [])
            if slots:
                c.dpool.rows[b][slots] = POISON
        c.dpool.rows[lay.aux_index][aux] = POISON

    def verify(self, c: Cluster, g: Group, dst: np.ndarray, srcs: list[np.ndarray],
               state_dst: dict[str, Sequence[int]], state_src: dict[str, Sequence[int]], aux_dst: int,
               aux_src: int) -> None:
        """Byte-exact comparison of one successful room with what each rank must have sent."""
        assert c.dpool is not None
        room = Room(0, g.name, len(dst), 0, dst, srcs, [(0, len(dst))], dict(state_dst), [dict(state_src)] * g.cp,
                    aux_dst, [aux_src] * g.cp)
        bad = mismatches(room, c.dpool, g.pools, SplitMode.PAGES, dedup=g.cfg.sender.dedup)
        self.mismatched += bad
        self.verified_rooms += 1
        if bad:
            log.error("bench: %s room on %s: %d bytes differ from the source", g.name, c.name, bad)

    def wait_all(self, c: Cluster, group_rooms: list[tuple[str, int]]) -> int:
        """Wait for rooms (one engine call for all); count the successes and failures."""
        assert c.dc is not None
        ok = 0
        statuses = c.dc.wait_many([(room, group) for group, room in group_rooms], self.room_timeout_s)
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

    @staticmethod
    def release(c: Cluster, group_rooms: list[tuple[str, int]]) -> None:
        assert c.dc is not None
        c.dc.release_many([(room, group) for group, room in group_rooms])

    @staticmethod
    def sent(groups: list[Group]) -> tuple[int, int, dict[str, int]]:
        """Wire bytes, skipped state bytes and bytes by kind, from the senders' own counters."""
        wire, skipped, kinds = 0, 0, Counter[str]()
        for g in groups:
            for pc in g.pcs:
                s = pc.stats()
                wire += sum(int(v) for v in s["bytes"].values())
                kinds.update({k: int(v) for k, v in s["bytes"].items()})
                skipped += int(s["state_bytes_skipped"])
        return wire, skipped, dict(kinds)

    # -- teardown ------------------------------------------------------------------------
    def close_clients(self) -> None:
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

    def stop(self) -> dict[str, int | None]:
        """Stop every child (the newest first); their exit codes."""
        return self.procs.stop()

    def remove_pools(self) -> None:
        for f in shm_dir().glob(f"transferd-{self.tag}-*"):  # pools of daemons that did not exit cleanly
            f.unlink(missing_ok=True)

    def dump_logs(self) -> None:
        for p in self.procs.procs:
            tail = p.tail(12)
            if tail.strip():
                print(f"--- {p.label} ---\n{tail}", file=sys.stderr)
