"""Room helpers for integration tests, with an owner computation written independently of
transferd.protocol.policy (so the tests check the policy instead of repeating it)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transferd.client import DecodeClient, PrefillClient
from transferd.pool import Pool

from .harness import write_guard


def share(n: int, cp: int, r: int) -> range:
    """Contiguous share of n items for rank r: sizes n//cp, the first n%cp ranks one more."""
    sizes = [n // cp + (1 if i < n % cp else 0) for i in range(cp)]
    start = sum(sizes[:r])
    return range(start, start + sizes[r])


@dataclass
class Room:
    room: int
    group: str
    n: int
    prefix: int
    dst: np.ndarray
    src: list[np.ndarray]
    chunks: list[tuple[int, int]]
    state_dst: dict[str, list[int]]
    state_src: list[dict[str, list[int]]]
    aux_dst: int
    aux_src: list[int]


def make_room(room: int, group: str, n: int, cp: int, *, prefix: int = 0, chunks: list[tuple[int, int]] | None = None,
              dst_start: int = 0, src_start: int = 0, slot: int = 0, dst_order: str = "mixed",
              spools: list[Pool] | None = None) -> Room:
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
    for k, (a, b) in enumerate(r.chunks):
        last = k == len(r.chunks) - 1
        for rank, pc in enumerate(pcs):
            if last:
                pc.submit(r.room, a, r.src[rank][a:b], last=True, state=r.state_src[rank], aux_slot=r.aux_src[rank])
            else:
                pc.submit(r.room, a, r.src[rank][a:b])


def mismatches(r: Room, dpool: Pool, spools: list[Pool], split: str, before: list[np.ndarray]) -> int:
    """Bytes in the decode pool that differ from what must have arrived (or must be untouched)."""
    L = dpool.layout
    cp = len(spools)
    bad = 0
    kv = L.indices("kv")
    kv_layers = 1 + max(L.buffers[b].layer for b in kv)
    for b in kv:
        layer = L.buffers[b].layer
        for pos in range(r.n):
            row = dpool.rows[b][r.dst[pos]]
            if pos < r.prefix:
                want = before[b][r.dst[pos]]
            elif split == "pages":
                owner = next(k for k in range(cp) if pos in share(r.n, cp, k))
                want = spools[owner].rows[b][r.src[owner][pos]]
            elif split == "layers":
                owner = next(k for k in range(cp) if layer in share(kv_layers, cp, k))
                want = spools[owner].rows[b][r.src[owner][pos]]
            else:
                want = spools[0].rows[b][r.src[0][pos]]
            bad += int(np.count_nonzero(row != want))
    for b in L.indices("state"):
        comp, layer = L.buffers[b].component, L.buffers[b].layer
        n_layers = 1 + max(L.buffers[i].layer for i in L.indices("state") if L.buffers[i].component == comp)
        owner = next(k for k in range(cp) if layer in share(n_layers, cp, k)) if split == "layers" else 0
        for d, s in zip(r.state_dst[comp], r.state_src[owner][comp]):
            bad += int(np.count_nonzero(dpool.rows[b][d] != spools[owner].rows[b][s]))
    a = L.aux_index
    bad += int(np.count_nonzero(dpool.rows[a][r.aux_dst] != spools[0].rows[a][r.aux_src[0]]))
    return bad


def state_copy_bytes(pool: Pool, slots: int = 1) -> int:
    L = pool.layout
    return sum(L.buffers[b].row_bytes * slots for b in L.indices("state"))
