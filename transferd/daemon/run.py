"""Running a daemon: the event loop until a signal drains it, and the collector tuned."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

import numpy as np

from .base import AgentBase, new_event_loop
from .malloc import keep_message_buffers_mapped

log = logging.getLogger(__name__)

GC_THRESHOLDS = (20_000, 10, 10)  # Python's default is (700, 10, 10)


def tune_gc() -> None:
    """A daemon's cyclic garbage collector, tuned once it is set up: what exists now (modules,
    configuration, the agent) is frozen out of every later collection, and the youngest
    generation is collected after 20,000 allocations instead of 700, so most per-message objects
    are freed by reference counting before a collection looks at them (the measurement is in
    docs/history/PERFORMANCE-LOG.md). Daemons only: a library leaves its host process's
    collector alone."""
    gc.collect()  # what is already garbage (the argument parser, say) must not be frozen with the rest
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def warm_up() -> None:
    """What a daemon's first room would otherwise import: numpy's first ``np.unique`` imports
    ``numpy.ma`` (≈ 6 ms on the development host, more under load; the sender checks every chunk's
    source pages with it, the receiver a large room's destinations). Done before serving, so that
    :func:`tune_gc` freezes it with the rest."""
    np.unique(np.zeros(2, dtype=np.int64))


def run_agent(agent: AgentBase) -> int:
    """Run a daemon until SIGTERM/SIGINT, which drain it (a second signal stops it at once)."""
    keep_message_buffers_mapped()
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    drains: list[asyncio.Task[None]] = []

    def on_signal(signum: int) -> None:
        log.info("%s: %s received, draining (up to %.0fs)", agent.name, signal.Signals(signum).name,
                 agent.drain_timeout_s)
        drains.append(loop.create_task(agent.drain()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    warm_up()
    tune_gc()
    try:
        loop.run_until_complete(agent.serve())
    finally:
        loop.close()
    return 0
