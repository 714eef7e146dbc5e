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

The package: :mod:`.plan` (what a run measures, the round schedule), :mod:`.cluster` (the
daemons, on :mod:`transferd.tools.procs`), :mod:`.peers` (the baselines and their child
processes), :mod:`.subjects` (the measured subjects and the rounds), :mod:`.report` (the JSON,
the table, the plot), :mod:`.run` (``transferd bench``).
"""

from __future__ import annotations

from .cluster import Cluster, Fleet, Group
from .peers import Limits, Mooncake, mooncake_target_main, raw_zmq_sender_main
from .plan import (
    BULK_KEYS,
    DEDUP_CPS,
    FULL,
    QUICK,
    SIZES,
    SMALL_CPS,
    Filler,
    KiB,
    MiB,
    Plan,
    block_of,
    cpu_seconds,
    host,
    schedule,
)
from .report import format_table, plot, report
from .run import run_bench
from .subjects import Bench

__all__ = [
    "BULK_KEYS", "DEDUP_CPS", "FULL", "QUICK", "SIZES", "SMALL_CPS", "Bench", "Cluster", "Filler", "Fleet", "Group",
    "KiB", "Limits", "MiB", "Mooncake", "Plan", "block_of", "cpu_seconds", "format_table", "host",
    "mooncake_target_main", "plot", "raw_zmq_sender_main", "report", "run_bench", "schedule",
]
