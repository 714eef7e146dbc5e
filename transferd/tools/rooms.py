"""Rooms as a synthetic engine makes them, shared by the demo, the bench and the integration
tests: the room record, the room-id guard a prefill engine writes into its aux row, the engine
calls that expect and submit a room, and a byte-exact check of the decode pool.

The check computes which rank owns every row on its own (:func:`share`), without
``transferd.protocol.policy``: it tests the policy instead of repeating it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..client import DecodeClient, PrefillClient
from ..pool.shm import Pool
from ..types import SplitMode


def write_guard(pool: Pool, slot: int, room: int) -> None:
    """The prefill engine writes the room id into the first 8 bytes of its aux row (little
    endian); the receiver checks it."""
    pool.rows[pool.layout.aux_index][slot, :8] = np.frombuffer(np.uint64(room).astype("<u8").tobytes(), np.uint8)


def share(n: int, cp: int, r: int) -> range:
    """Contiguous share of n items for rank r: sizes n//cp, the first n%cp ranks one more."""
    sizes = [n // cp + (1 if i < n % cp else 0) for i in range(cp)]
    start = sum(sizes[:r])
    return range(start, start + sizes[r])


def _owner(item: int, n: int, cp: int) -> int:
    return next(k for k in range(cp) if item in share(n, cp, k))


@dataclass
class Room:
    """One room of one group: ``n`` page positions (the first ``prefix`` already held by the
    decode side), destination pages, per-rank source pages, chunks ``[a, b)`` of positions,
    state slots by component and aux slots (per rank on the source side)."""

    room: int
    group: str
    n: int
    prefix: int
    dst: np.ndarray
    src: list[np.ndarray]
    chunks: list[tuple[int, int]]
    state_dst: dict[str, Any]
    state_src: list[dict[str, Any]]
    aux_dst: int
    aux_src: list[int]


def make_room(room: int, group: str, n: int, cp: int, *, prefix: int = 0, chunks: list[tuple[int, int]] | None = None,
              dst_start: int = 0, src_start: int = 0, slot: int = 0, dst_order: str = "mixed",
              spools: list[Pool] | None = None) -> Room:
    """A room over consecutive rows (``dst_order="mixed"``: pairs of destination pages swapped
    now and then, so runs break); with ``spools`` the guard is written into every rank's aux row."""
    dst = np.arange(dst_start, dst_start + n)
    if dst_order == "mixed":  # swap pairs so runs are broken now and then
        dst = dst.copy()
        for i in range(1, n - 1, 5):
            dst[i], dst[i + 1] = dst[i + 1], dst[i]
    src = [np.arange(src_start, src_start + n) for _ in range(cp)]
    r = Room(room, group, n, prefix, dst, src, chunks or [(0, n)],
             {"conv": [slot], "ssm": [slot]}, [{"conv": [slot + 1], "ssm": [slot + 1]} for _ in range(cp)],
             aux_dst=slot, aux_src=[slot + 2] * cp)
    if spools:
        for p, s in zip(spools, r.aux_src):
            write_guard(p, s, room)
    return r


def expect(dc: DecodeClient, r: Room) -> None:
    dc.expect(r.room, r.group, r.dst, aux_slot=r.aux_dst, prefix_pages=r.prefix, state=r.state_dst)


def submit_all(pcs: list[PrefillClient], r: Room) -> None:
    """Every chunk on every rank; the last one with the state and aux slots."""
    for k, (a, b) in enumerate(r.chunks):
        last = k == len(r.chunks) - 1
        for rank, pc in enumerate(pcs):
            if last:
                pc.submit(r.room, a, r.src[rank][a:b], last=True, state=r.state_src[rank], aux_slot=r.aux_src[rank])
            else:
                pc.submit(r.room, a, r.src[rank][a:b])


def mismatches(r: Room, dpool: Pool, spools: Sequence[Pool], split: str | SplitMode,
               held: Mapping[int, np.ndarray] | None = None, *, dedup: bool = True) -> int:
    """Bytes of room ``r`` in the decode pool that differ from what must have arrived: page
    position p of KV buffer b from its owner (``pages``: the rank whose :func:`share` of the
    positions holds p; ``layers``: the rank whose share of the KV layers holds b's layer;
    ``rank0``: rank 0), each state buffer from rank 0 (``layers``: the owner of its layer in
    its component; ``pages`` with ``dedup`` off: every rank, which each sent its copy), the aux
    row from rank 0. The ``prefix`` positions must be untouched: ``held[b]`` are the rows the
    decode side held there in KV buffer b (one per prefix position)."""
    split = SplitMode(split)
    L = dpool.layout
    cp = len(spools)
    bad = 0
    kv = L.indices("kv")
    kv_layers = 1 + max((L.buffers[b].layer for b in kv), default=-1)
    positions = np.arange(r.prefix, r.n)
    page_owners = np.zeros(positions.size, dtype=np.int64)
    for k in range(cp):
        mine = share(r.n, cp, k)
        page_owners[(positions >= mine.start) & (positions < mine.stop)] = k
    for b in kv:
        if r.prefix:
            assert held is not None, "a room with prefix pages needs the rows held there"
            bad += int(np.count_nonzero(dpool.rows[b][r.dst[:r.prefix]] != held[b]))
        if split is SplitMode.PAGES:
            owners = page_owners
        elif split is SplitMode.LAYERS:
            owners = np.full(positions.size, _owner(L.buffers[b].layer, kv_layers, cp), dtype=np.int64)
        else:
            owners = np.zeros(positions.size, dtype=np.int64)
        for k in np.unique(owners).tolist():
            pos = positions[owners == k]
            bad += int(np.count_nonzero(dpool.rows[b][r.dst[pos]] != spools[k].rows[b][r.src[k][pos]]))
    for b in L.indices("state"):
        comp, layer = L.buffers[b].component, L.buffers[b].layer
        if split is SplitMode.LAYERS:
            n_layers = 1 + max(L.buffers[i].layer for i in L.indices("state") if L.buffers[i].component == comp)
            senders = [_owner(layer, n_layers, cp)]
        elif split is SplitMode.PAGES and not dedup:
            senders = list(range(cp))
        else:
            senders = [0]
        for k in senders:
            d, s = list(r.state_dst.get(comp, [])), list(r.state_src[k].get(comp, []))
            if d:
                bad += int(np.count_nonzero(dpool.rows[b][d] != spools[k].rows[b][s]))
    a = L.aux_index
    bad += int(np.count_nonzero(dpool.rows[a][r.aux_dst] != spools[0].rows[a][r.aux_src[0]]))
    return bad
