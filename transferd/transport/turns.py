"""Rooms waiting their turn to send on one connection: woken one at a time, in order.

Both ways out of a sender — the data stream's writer and a ZeroMQ socket — hold rooms back while
their pipe is full. Waking every waiter when it drains makes all but the first find it taken
again (with a hundred rooms behind one connection, a hundred wake-ups a message); the ways out
wake the first waiter alone, and a woken waiter that will not send (its room stopped, its task
cancelled) hands the turn on."""

from __future__ import annotations

import asyncio
from collections import deque


def wake_first(waiters: deque[asyncio.Future[None]]) -> None:
    """Wake the first waiter still waiting (those cancelled meanwhile are dropped)."""
    while waiters:
        w = waiters.popleft()
        if not w.done():
            w.set_result(None)
            return
