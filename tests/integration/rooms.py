"""Room helpers for integration tests, with an owner computation written independently of
transferd.protocol.policy (so the tests check the policy instead of repeating it). They live in
``transferd.tools.rooms``, shared with the demo and the bench; this module keeps the tests' names."""

from __future__ import annotations

from typing import Any

import numpy as np

from transferd.pool import Pool
from transferd.protocol.room import RoomState
from transferd.tools import rooms as _rooms
from transferd.tools.rooms import Room, expect, make_room, share, submit_all

__all__ = ["Room", "expect", "land", "make_room", "mismatches", "share", "state_copy_bytes", "submit_all"]


def mismatches(r: Room, dpool: Pool, spools: list[Pool], split: str, before: list[np.ndarray]) -> int:
    """Bytes in the decode pool that differ from what must have arrived (or must be untouched);
    ``before[b]`` is KV buffer b of the decode pool as it was before the room."""
    held = {b: before[b][r.dst[:r.prefix]] for b in dpool.layout.indices("kv")} if r.prefix else None
    return _rooms.mismatches(r, dpool, spools, split, held)


def state_copy_bytes(pool: Pool, slots: int = 1) -> int:
    L = pool.layout
    return sum(L.buffers[b].row_bytes * slots for b in L.indices("state"))


def land(dc: Any, pcs: list[Any], r: Room, dpool: Pool, spools: list[Pool], before: list[np.ndarray],
         split: str = "pages") -> int:
    """Expect the room, submit it on every rank, and wait for it to succeed; then the bytes of
    the decode pool that differ from what must have arrived (:func:`mismatches`)."""
    expect(dc, r)
    submit_all(pcs, r)
    assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    return mismatches(r, dpool, spools, split, before)
