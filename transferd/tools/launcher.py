"""Start a receiver and N sender agents as supervised child processes (``transferd launch``,
``transferd demo``, tests). A child that dies unexpectedly is restarted (a receiver on the same
address it first bound, so senders re-register with it), up to a limit."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..client import DecodeClient, PrefillClient
from ..config import Config
from ..errors import ClientTimeout, TransferdError
from . import procs
from .procs import die_with_parent

__all__ = ["Child", "Launcher", "die_with_parent"]
log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Child:
    role: str
    rank: int
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "receiver" if self.role == "receiver" else f"sender r{self.rank}"


class Launcher:
    """Owns the child processes. ``start()`` returns once every daemon answers on its engine
    socket and every rank is registered with the receiver."""

    def __init__(self, cfg: Config, config_path: str | None, *, env: Mapping[str, str] | None = None,
                 common_args: list[str] | None = None, sender_args: list[str] | None = None, max_restarts: int = 3, log_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.env = dict(os.environ if env is None else env)
        self.common = common_args or []
        self.sender_args = sender_args or []
        self.max_restarts = max_restarts
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.receiver_endpoint = ""

    def _base(self, role: str) -> list[str]:
        argv = [sys.executable, "-m", "transferd", role]
        if self.config_path:
            argv += ["--config", str(self.config_path)]
        return argv + self.common + (self.sender_args if role == "sender" else [])

    def _spawn(self, child: Child) -> None:
        path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            path = self.log_dir / f"{child.label.replace(' ', '-')}.log"
        child.proc = procs.popen(child.argv, env=self.env, log_path=path)
        log.info("started %s (pid %d)", child.label, child.proc.pid)

    def start(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        rx = Child("receiver", 0, self._base("receiver"))
        self._spawn(rx)
        self.children.append(rx)
        dc = DecodeClient(self.cfg.receiver_engine_socket(), timeout_s=1.0)
        try:
            stats = self._await(dc.stats, rx, deadline)
        finally:
            dc.close()
        self.receiver_endpoint = stats["data_endpoint"]
        # a restarted receiver must come back on the same address
        rx.argv += ["--bind", self.receiver_endpoint]
        cp = self.cfg.sender.cp_size
        for rank in range(cp):
            argv = [*self._base("sender"), "--cp-rank", str(rank), "--receiver", self.receiver_endpoint]
            child = Child("sender", rank, argv)
            self._spawn(child)
            self.children.append(child)
        for child in self.children[1:]:
            pc = PrefillClient(self.cfg.sender_engine_socket(child.rank), timeout_s=1.0)
            try:
                self._await(pc.ping, child, deadline)
            finally:
                pc.close()
        self.wait_registered(deadline)

    def wait_registered(self, deadline: float) -> None:
        dc = DecodeClient(self.cfg.receiver_engine_socket(), timeout_s=1.0)
        try:
            while True:
                st = self._await(dc.status, self.children[0], deadline)
                ranks = st["groups"].get(self.cfg.sender.group, {}).get("ranks", {})
                if len(ranks) == self.cfg.sender.cp_size:
                    return
                self._check_alive()
                if time.monotonic() > deadline:
                    raise TransferdError(f"only ranks {sorted(ranks)} of {self.cfg.sender.group} registered "
                                         f"with the receiver before the deadline")
                time.sleep(0.05)
        finally:
            dc.close()

    def _await(self, fn: Callable[[], T], child: Child, deadline: float) -> T:
        while True:
            try:
                return fn()
            except ClientTimeout:
                pass
            if child.proc is not None and child.proc.poll() is not None:
                raise TransferdError(f"{child.label} exited with status {child.proc.returncode} during start-up")
            if time.monotonic() > deadline:
                raise TransferdError(f"{child.label} did not answer on its engine socket in time")

    def _check_alive(self) -> None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is not None:
                raise TransferdError(f"{c.label} exited with status {c.proc.returncode}")

    def kill(self, label: str, sig: int) -> None:
        """Send a signal to one child by label (``receiver``, ``sender r3``) — fault injection."""
        for c in self.children:
            if c.label == label and c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(sig)
                if sig == signal.SIGKILL:
                    c.proc.wait()
                return

    def supervise_once(self) -> bool:
        """Restart children that died; returns False once one exceeded its restart limit."""
        ok = True
        now = time.monotonic()
        for c in self.children:
            if c.proc is None or c.proc.poll() is None:
                continue
            c.restarts = [t for t in c.restarts if now - t < 60.0]
            if len(c.restarts) >= self.max_restarts:
                log.error("%s exited with status %s and was restarted %d times in 60s; giving up",
                          c.label, c.proc.returncode, len(c.restarts))
                ok = False
                continue
            log.warning("%s exited with status %s; restarting it", c.label, c.proc.returncode)
            c.restarts.append(now)
            self._spawn(c)
        return ok

    def stop(self, timeout_s: float = 10.0, drain_s: float = 3.0) -> dict[str, int | None]:
        """SIGTERM every child (senders first): each drains its rooms in flight; after ``drain_s``
        a second SIGTERM stops the rest at once (rooms left fail with "shutting down"); after
        ``timeout_s`` stragglers are killed. Returns the exit codes."""
        return procs.stop([(c.label, c.proc) for c in reversed(self.children) if c.proc is not None],
                          timeout_s=timeout_s, drain_s=drain_s)
