"""The one process harness of the tools and the integration tests: start a child that dies with
its parent, find one that exited, stop a set of them on SIGTERM (a second SIGTERM after a drain,
SIGKILL after a deadline). :class:`~transferd.tools.launcher.Launcher` (``transferd launch``,
``transferd demo``), the bench's daemons and ``tests/integration/harness.Cluster`` are built on it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TransferdError

log = logging.getLogger(__name__)
POLL_S = 0.02  # between polls of the children's exit, always under a deadline


def die_with_parent() -> None:
    """In a child before exec: SIGTERM it when the launching process dies (Linux PR_SET_PDEATHSIG),
    so a killed launcher, demo, bench or test run leaves no daemons behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def popen(argv: Sequence[str], *, env: Mapping[str, str] | None, log_path: Path | None = None,
          stdin: int | None = None, stdout: int | None = None, new_session: bool = True) -> subprocess.Popen[bytes]:
    """Start one child that dies with this process. With ``log_path`` its output is appended
    there (stdout and stderr, or stderr alone when ``stdout`` is given, e.g. a pipe); without, it
    inherits ours. ``new_session``: its own session, so a terminal's Ctrl-C reaches it only
    through us."""
    out = open(log_path, "ab") if log_path is not None else None
    try:
        stderr = None if out is None else (subprocess.STDOUT if stdout is None else out)
        return subprocess.Popen(list(argv), env=None if env is None else dict(env), stdin=stdin,
                                stdout=out if stdout is None else stdout, stderr=stderr,
                                start_new_session=new_session, preexec_fn=die_with_parent)
    finally:
        if out is not None:
            out.close()  # the child has its own descriptor


@dataclass
class Proc:
    """One child: its label, process and log file (None: it writes to ours)."""

    label: str
    proc: subprocess.Popen[bytes]
    log: Path | None

    def tail(self, lines: int = 15) -> str:
        """The last lines of its log ("" when it has none or it cannot be read)."""
        if self.log is None:
            return ""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def dump_logs(log_dir: Path, prefix: str = "") -> None:
    """The last 20 lines of every log in ``log_dir`` on stderr (a failed demo or soak)."""
    for f in sorted(log_dir.glob("*.log")):
        tail = f.read_text(errors="replace").splitlines()[-20:]
        print(f"--- {prefix}{f.name} (last {len(tail)} lines) ---", file=sys.stderr)
        for line in tail:
            print(line, file=sys.stderr)


def usage(pid: int) -> dict[str, int] | None:
    """A running process's memory and descriptors: ``rss_kb`` (``VmRSS`` of ``/proc/PID/status``),
    its parts ``rss_anon_kb`` (private memory: where a leak shows) and ``rss_shmem_kb`` (shared
    memory mapped and touched: a daemon's pool pages, up to the pool's size), and ``fds`` (entries
    of ``/proc/PID/fd``). None once it is gone."""
    fields = {"VmRSS": "rss_kb", "RssAnon": "rss_anon_kb", "RssShmem": "rss_shmem_kb"}
    try:
        out = {fields[k]: int(v.split()[0]) for k, _, v in
               (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines()) if k in fields}
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return None
    return out


def exited(procs: Sequence[Proc]) -> Proc | None:
    """The first of ``procs`` that is no longer running."""
    return next((p for p in procs if p.proc.poll() is not None), None)


def stop(procs: Sequence[tuple[str, subprocess.Popen[bytes]]], *, timeout_s: float, drain_s: float | None = None,
         cont: bool = False) -> dict[str, int | None]:
    """SIGTERM every running child of ``procs``, in that order (``cont``: a SIGCONT first, for one
    a test paused); each drains its rooms in flight. After ``drain_s`` (None: never) a second
    SIGTERM stops the rest at once; after ``timeout_s`` stragglers are killed. Returns the exit
    codes by label, in the order given."""
    for _, p in procs:
        if p.poll() is None:
            if cont:
                p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    start = time.monotonic()
    second = drain_s is None
    while any(p.poll() is None for _, p in procs):
        elapsed = time.monotonic() - start
        if not second and elapsed > drain_s:  # type: ignore[operator]
            second = True
            for _, p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        if elapsed > timeout_s:
            for label, p in procs:
                if p.poll() is None:
                    log.error("%s did not stop within %.0fs; killing it", label, timeout_s)
                    p.kill()
                    p.wait()
            break
        time.sleep(POLL_S)
    return {label: p.returncode for label, p in procs}


@dataclass
class ProcessGroup:
    """Children started together and stopped together, each logging to ``log_dir/<label>.log``;
    ``env`` is every child's base environment."""

    env: Mapping[str, str]
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def spawn(self, label: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              stdin: int | None = subprocess.DEVNULL) -> Proc:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{label}.log"
        p = Proc(label, popen(argv, env={**self.env, **(env or {})}, log_path=path, stdin=stdin), path)
        self.procs.append(p)
        return p

    def check(self) -> None:
        """Raise if a child exited (with the end of its log)."""
        p = exited(self.procs)
        if p is not None:
            raise TransferdError(f"{p.label} exited with status {p.proc.returncode}:\n{p.tail()}")

    def stop(self, timeout_s: float = 15.0, drain_s: float | None = None) -> dict[str, int | None]:
        """Stop every child, the newest first."""
        return stop([(p.label, p.proc) for p in reversed(self.procs)], timeout_s=timeout_s, drain_s=drain_s)
