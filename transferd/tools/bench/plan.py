"""What the bench measures and in what order: the plan of a run, the sizes, the round schedule,
and the small helpers every part shares (medians, CPU seconds of a process, distinct fill bytes)."""

from __future__ import annotations

import os
import platform
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from ...errors import ConfigError

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
NO_METRICS = {"TRANSFERD_RECEIVER_METRICS_BIND": "", "TRANSFERD_SENDER_METRICS_BIND": ""}
CP8 = 8  # the CP8 bulk block: ranks of its one group, and raw TCP connections beside it
CP8_ROOMS = 8  # rooms per CP8 measurement: each rank's pool then holds a room's worth of pages
# issue 14: ratios to the host's limits measured in the same run (and issue 12's Mooncake plane)
TARGETS: dict[str, float] = {
    "tcp_vs_raw_tcp_1MiB": 0.9, "tcp_vs_raw_tcp_256KiB": 0.9, "tcp_vs_raw_tcp_64KiB": 0.75,
    "same_host_vs_memcpy": 0.9, "small_cp1_p50_ms": 1.0, "small_cp1_p99_ms": 3.0,
    "small_cp1_rooms_per_s": 3000.0, "small_cp8_rooms_per_s": 1000.0,
    "cp8_tcp_vs_raw_tcp": 0.85, "cp8_sender_cpu_vs_cp1": 1.5,
    "vs_mooncake_tcp": 1.3, "mooncake_plane_vs_mooncake_tcp": 0.95}


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


def cp8_pages_per_room(plan: Plan) -> int:
    """Pages per room of the CP8 bulk block: :data:`CP8_ROOMS` rooms of 1 MiB rows carry the bytes
    of one cp 1 ``bulk/1MiB`` measurement, a multiple of :data:`CP8` pages each (every rank
    sends the same share of every room)."""
    pages = plan.bulk_room_bytes * plan.bulk_rooms // (BULK_LAYERS * MiB * CP8_ROOMS)
    if pages < CP8 or pages % CP8:
        raise ConfigError(f"bench plan: {plan.bulk_room_bytes * plan.bulk_rooms} bulk bytes do not make "
                          f"{CP8_ROOMS} rooms of a multiple of {CP8} pages of {BULK_LAYERS} MiB")
    return pages


def repo_root() -> Path:
    """The source tree's root (``transferd/tools/bench/plan.py`` is three folders below it)."""
    return Path(__file__).resolve().parents[3]


def dedup_config_path() -> Path:
    """``configs/deepseek-cp8.toml`` in the working directory, else beside the source tree."""
    for p in (Path.cwd() / "configs" / "deepseek-cp8.toml", repo_root() / "configs" / "deepseek-cp8.toml"):
        if p.is_file():
            return p
    raise ConfigError("configs/deepseek-cp8.toml not found (looked in the working directory and beside the "
                      "transferd source tree)")


# -- small helpers ---------------------------------------------------------------------------

def median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(statistics.median(vals)) if vals else None


def rnd(x: float | None, nd: int = 4) -> float | None:
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
    if kind in ("bulk_cp8", "raw_tcp_x8"):
        return "cp8"
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


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds of a process (Linux; None elsewhere): its threads' time on a CPU from
    ``/proc/PID/task/*/schedstat`` (nanoseconds; a measurement of 256 MiB is ~0.1 s of CPU,
    and the 10 ms clock ticks of utime + stime made its s/GB move in steps of 0.037), else
    utime + stime."""
    try:
        tasks, total = os.listdir(f"/proc/{pid}/task"), 0
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except FileNotFoundError:
                continue  # the thread ended meanwhile
        return total / 1e9
    except (OSError, IndexError, ValueError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def cpu_since(pids: list[int], before: list[float | None]) -> list[float] | None:
    """CPU seconds each process used since ``before`` (its :func:`cpu_seconds` then); None when
    any of them cannot be measured."""
    now = [cpu_seconds(pid) for pid in pids]
    if None in now or None in before:
        return None
    return [b - a for a, b in zip(before, now)]  # type: ignore[operator]


def room_seconds(stats: dict[str, Any]) -> tuple[int, float]:
    """Successful rooms a receiver has ended and their expect → end durations summed (its
    ``stats``' ``room_seconds``)."""
    ok = stats.get("room_seconds", {}).get("success", {})
    return int(ok.get("count", 0)), float(ok.get("sum", 0.0))


def room_ms_mean(before: tuple[int, float], after: tuple[int, float], seconds: float) -> dict[str, float]:
    """A measurement's rooms' mean expect → end time (ms), and that over the measurement's time:
    1.0 when every room ends with the last one, about half when they end one after another."""
    n, s = after[0] - before[0], after[1] - before[1]
    if n <= 0 or seconds <= 0:
        return {}
    return {"room_ms_mean": s / n * 1e3, "room_vs_measurement": s / n / seconds}


class Filler:
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


def met(v: float | None, target: float, at_least: bool) -> bool | None:
    if v is None:
        return None
    return v >= target if at_least else v <= target


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_model(cpuinfo: str | None) -> str | None:
    """The first ``model name`` of ``/proc/cpuinfo``'s text, with its ``model`` number (a vCPU's
    name is often only "Intel(R) Xeon(R) Processor")."""
    name = model = None
    for line in (cpuinfo or "").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name is None:
            name = value.strip()
        elif key == "model" and model is None:
            model = value.strip()
    if name is None:
        return None
    return f"{name} (model {model})" if model else name


def sched_params(cmdline: str | None) -> dict[str, str]:
    """The kernel command line's scheduler and CPU-idle parameters (``sched_*``, ``cpuidle*``,
    ``haltpoll*``, ``isolcpus``, ``nohz*``, ``idle``): they move every figure of the bench, and
    some kernels carry their own (a guest kernel's ``sched_vcpu_pack``, docs/PERFORMANCE.md,
    sixteenth round)."""
    out: dict[str, str] = {}
    for word in (cmdline or "").split():
        if word == "--":  # what follows is init's, not the kernel's
            break
        key, _, value = word.partition("=")
        if key.startswith(("sched_", "cpuidle", "haltpoll", "nohz")) or key in ("isolcpus", "idle"):
            out[key] = value
    return out


def host() -> dict[str, Any]:
    """The host as it bears on the figures: CPUs (and those this process may use), load, kernel,
    the scheduler's and TCP's settings, and the versions of what carries the bytes."""
    try:
        load_avg = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_avg = []
    try:
        allowed: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = None
    return {"cpus": os.cpu_count(), "cpus_allowed": allowed, "loadavg": load_avg,
            "cpu_model": cpu_model(_read("/proc/cpuinfo")), "kernel": platform.release(),
            "kernel_sched_params": sched_params(_read("/proc/cmdline")),
            "cpuidle_driver": _read("/sys/devices/system/cpu/cpuidle/current_driver"),
            "tcp_congestion_control": _read("/proc/sys/net/ipv4/tcp_congestion_control"),
            "python": platform.python_version(),
            "pyzmq": zmq.pyzmq_version(), "libzmq": zmq.zmq_version(), "numpy": np.__version__,
            "machine": platform.machine(), "system": platform.system()}
