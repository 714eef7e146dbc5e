"""Real daemons in real processes for integration tests: configs in tmp_path, pools in /dev/shm
under unique names, engine sockets as unix:// in tmp_path, receivers on random loopback ports."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from transferd.client import DecodeClient, PrefillClient
from transferd.config import Config, load
from transferd.errors import ClientTimeout
from transferd.pool import Pool
from transferd.tools import procs
from transferd.tools.rooms import write_guard

__all__ = ["MODEL", "POLL_S", "Cluster", "Proc", "dump_toml", "fill_random", "write_guard"]

POLL_S = 0.02  # between polls of a condition, always under a deadline (Cluster.until)

MODEL = {
    "name": "test-hybrid", "dtype": "bf16", "page_size": 4, "kv_layers": 3, "kv_format": "mha",
    "kv_token_elems": 64, "aux_row_bytes": 48,
    "state": [{"name": "conv", "layers": 3, "slot_shape": [2, 128]},
              {"name": "ssm", "layers": 3, "slot_shape": [256], "dtype": "fp32"}],
}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def dump_toml(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for k, v in data.items():
        if not isinstance(v, dict):
            lines.append(f"{k} = {_toml_value(v)}")
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"\n[{k}]")
            tables = []
            for kk, vv in v.items():
                if isinstance(vv, list) and vv and isinstance(vv[0], dict):
                    tables.append((kk, vv))
                else:
                    lines.append(f"{kk} = {_toml_value(vv)}")
            for kk, entries in tables:
                for e in entries:
                    lines.append(f"\n[[{k}.{kk}]]")
                    lines += [f"{a} = {_toml_value(b)}" for a, b in e.items()]
    return "\n".join(lines) + "\n"


@dataclass
class Proc(procs.Proc):
    """A daemon of the cluster: label, process, log file and its configuration."""

    log: Path
    cfg: Config


@dataclass
class Cluster:
    tmp: Path
    tag: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    procs: list[Proc] = field(default_factory=list)
    clients: list[Any] = field(default_factory=list)
    pools: list[Pool] = field(default_factory=list)
    killed: list[Proc] = field(default_factory=list)
    plane: str = "auto"
    """``data_plane`` of every daemon: "mooncake" or "nixl" runs the suite over that engine (conftest.py)."""

    def check_plane(self, stats: dict[str, Any]) -> None:
        """Over Mooncake or NIXL, every byte a daemon moved went through that engine's reads (``stats``)."""
        if self.plane in ("mooncake", "nixl"):
            moved = sum(stats["bytes"].values())
            assert stats[f"{self.plane}_bytes"] == moved, (stats[f"{self.plane}_bytes"], moved)

    def _plane(self) -> dict[str, Any]:
        return {"data_plane": self.plane} if self.plane != "auto" else {}

    def write_config(self, name: str, data: dict[str, Any]) -> Path:
        base: dict[str, Any] = {"run_dir": str(self.tmp / "run"), "log_level": "info", "model": MODEL}
        base.update(data)
        path = self.tmp / f"{name}.toml"
        path.write_text(dump_toml(base))
        return path

    def _spawn(self, label: str, argv: list[str], cfg_path: Path) -> Proc:
        log = self.tmp / f"{label}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
        p = procs.popen([sys.executable, "-m", "transferd", *argv, "--config", str(cfg_path)], env=env, log_path=log,
                        new_session=False)
        proc = Proc(label, p, log, load(cfg_path, env={}))
        self.procs.append(proc)
        return proc

    def receiver(self, name: str = "decode0", *, kv_pages: int = 256, model: dict[str, Any] | None = None,
                 faults: dict[str, Any] | None = None, sender: dict[str, Any] | None = None,
                 **extra: Any) -> tuple[str, DecodeClient, Pool]:
        """A receiver; ``extra`` goes into its [receiver] section, ``sender`` is a [sender]
        section for its file (which `config check` validates against the receiver's)."""
        data: dict[str, Any] = {"receiver": {"name": name, "bind": "tcp://127.0.0.1:*", "pool": f"{self.tag}-{name}",
                                             "kv_pages": kv_pages, "state_slots": 32, "aux_slots": 32,
                                             "metrics_bind": "127.0.0.1:0", **self._plane(), **extra}}
        if model:
            data["model"] = model
        if faults:
            data["faults"] = faults
        if sender:
            data["sender"] = sender
        path = self.write_config(f"receiver-{name}", data)
        proc = self._spawn(f"receiver-{name}", ["receiver"], path)
        dc = DecodeClient(proc.cfg.receiver_engine_socket(), timeout_s=20)
        self.clients.append(dc)
        stats = self.until(lambda: _try(dc.ping, 0.5) and dc.stats(), f"receiver {name} to answer", proc)
        pool = Pool.attach(proc.cfg.receiver_pool_name())
        self.pools.append(pool)
        return stats["data_endpoint"], dc, pool

    def group(self, group: str, cp_size: int, receivers: list[str], *, split: str = "pages",
              kv_pages: int = 256, model: dict[str, Any] | None = None, wait: bool = True,
              ranks: list[int] | None = None, faults: dict[str, Any] | None = None,
              **extra: Any) -> tuple[list[PrefillClient], list[Pool]]:
        clients, pools = [], []
        for rank in range(cp_size) if ranks is None else ranks:
            data: dict[str, Any] = {"sender": {
                "group": group, "cp_size": cp_size, "cp_rank": rank, "split": split, "receivers": receivers,
                "pool": f"{self.tag}-{group}-r{{rank}}", "kv_pages": kv_pages, "state_slots": 32,
                "aux_slots": 32, "same_host": "off", "metrics_bind": "127.0.0.1:0",
                **self._plane(), **extra}}  # data over the socket unless a test asks
            if model:
                data["model"] = model
            if faults:
                data["faults"] = faults
            path = self.write_config(f"sender-{group}-r{rank}", data)
            proc = self._spawn(f"sender-{group}-r{rank}", ["sender"], path)
            pc = PrefillClient(proc.cfg.sender_engine_socket(rank), timeout_s=20)
            self.clients.append(pc)
            self.until(lambda: _try(pc.ping, 0.5), f"sender {group} r{rank} to answer", proc)
            pool = Pool.attach(proc.cfg.sender_pool_name(rank))
            self.pools.append(pool)
            clients.append(pc)
            pools.append(pool)
        if wait:
            for pc in clients:
                self.until(lambda: all(r["state"] == "registered" for r in pc.status()["receivers"]),
                           f"{group} to register with every receiver")
        return clients, pools

    def kill(self, label: str, sig: int = signal.SIGKILL) -> Proc:
        """Signal the newest process of that label; a SIGKILLed one is not expected to exit cleanly."""
        p = self.proc(label)
        p.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            p.proc.wait(10)
            self.killed.append(p)
        return p

    def proc(self, label: str) -> Proc:
        return next(p for p in reversed(self.procs) if p.label == label)

    def restart(self, label: str, **replace: Any) -> Proc:
        """Start a process again with its config (a fresh incarnation); ``replace`` edits the
        receiver section (e.g. a concrete ``bind`` to come back on the same port)."""
        old = self.proc(label)
        path = self.tmp / f"{label}.toml"
        if replace:
            import tomllib

            data = tomllib.loads(path.read_text())
            data["receiver"].update(replace)
            path.write_text(dump_toml(data))
        role = "receiver" if label.startswith("receiver") else "sender"
        new = self._spawn(f"{label}", [role], path)
        assert new is not old
        return new

    def until(self, fn: Any, what: str, proc: Proc | None = None, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            out = fn()
            if out:
                return out
            if proc is not None and proc.proc.poll() is not None:
                raise AssertionError(f"{proc.label} exited with {proc.proc.returncode}:\n{proc.log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n" + self.logs())
            time.sleep(POLL_S)

    def logs(self) -> str:
        return "\n".join(f"--- {p.label} ---\n{p.log.read_text(errors='replace')[-3000:]}" for p in self.procs)

    def close(self) -> dict[str, int | None]:
        for c in self.clients:
            c.close()
        for p in self.pools:
            p.close()
        live = [p for p in self.procs if p not in self.killed]
        # SIGCONT first (a test may have paused one); SIGKILL after 15 s: exit code -9, a loud failure
        codes = procs.stop([(p.label, p.proc) for p in live], timeout_s=15.0, cont=True)
        for f in Path("/dev/shm").glob(f"transferd-{self.tag}-*"):
            f.unlink()
        return codes


def _try(fn: Any, timeout: float) -> Any:
    try:
        return fn(timeout) if fn.__name__ == "ping" else fn()
    except ClientTimeout:
        return None


def fill_random(pool: Pool, seed: int) -> None:
    g = np.random.default_rng(seed)
    for rows in pool.rows:
        rows[:] = g.integers(0, 256, rows.shape, dtype=np.uint8)
