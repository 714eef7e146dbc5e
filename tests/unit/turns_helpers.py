"""Helpers shared by the tests of the two ways out of a sender that hold rooms back while their
pipe is full (``StreamWriter``, ``LoopSocket``): both keep a ``_waiters`` queue woken through
``_wake_one`` (``transferd/transport/turns.py``)."""

from __future__ import annotations

import asyncio
from typing import Any


def cancel_first_as_woken(way_out: Any, task: asyncio.Task[Any]) -> None:
    """Make ``way_out`` cancel ``task`` right after it wakes the waiter now first in line, before
    that task's loop runs it: a room whose send loop is cancelled just as its turn came."""
    first, wake = way_out._waiters[0], way_out._wake_one

    def wake_then_cancel() -> None:
        woke_first = bool(way_out._waiters) and way_out._waiters[0] is first
        wake()
        if woke_first:
            assert first.done() and not first.cancelled()
            task.cancel()

    way_out._wake_one = wake_then_cancel


def counting_waits(way_out: Any) -> list[int]:
    """Count ``way_out``'s waits for room (each one a wake-up of a room's send loop)."""
    waits = [0]
    real = way_out.writable

    async def writable() -> None:
        waits[0] += 1
        await real()

    way_out.writable = writable
    return waits
