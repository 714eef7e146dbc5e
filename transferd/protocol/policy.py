"""Who sends what: the one pure function both sides use.

Given a group's ``cp_size`` and split mode, a rank, the room's page count and prefix, and the
pool layout, :func:`rank_plan` says exactly which (buffer, position range) KV runs, which state
buffers and whether the aux row that rank sends. The receiver computes the same plan for every
rank and accepts nothing outside it.

Split modes (see DESIGN.md):

* ``pages``  — rank r sends a contiguous slice of the room's page positions for every KV buffer;
  replicated state and aux come from rank 0 only.
* ``layers`` — cache layer split: every rank sends all positions, but only for the KV layers it
  owns; each rank sends the state layers it owns; aux from rank 0.
* ``rank0``  — rank 0 sends everything; the other ranks send nothing but still report done.

Layer ownership uses the same contiguous split as pages, over each kind's layer count (KV layers,
and each state component's layers separately).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadRequest
from ..layout import PoolLayout
from ..types import SplitMode


def contiguous_slice(n: int, cp_size: int, rank: int) -> tuple[int, int]:
    """The ``[start, end)`` share of ``n`` items for ``rank``: the first ``n % cp_size`` ranks
    get one extra. ``n = 10, cp = 3`` gives ``[0:4], [4:7], [7:10]``."""
    if cp_size < 1:
        raise BadRequest(f"cp_size must be >= 1, not {cp_size}")
    if not 0 <= rank < cp_size:
        raise BadRequest(f"rank {rank} is outside cp_size {cp_size}")
    if n < 0:
        raise BadRequest(f"item count must be >= 0, not {n}")
    base, extra = divmod(n, cp_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def skips_replicated_state(cp_size: int, rank: int, split: SplitMode, dedup: bool = True) -> bool:
    """The de-dup decision: does this rank leave the replicated state to rank 0? With ``dedup``
    off, pages-split ranks each send their own copy, as engines without the de-dup do (the
    rank0 mode sends everything from rank 0 either way)."""
    return cp_size > 1 and rank != 0 and (split is SplitMode.RANK0 or (split is SplitMode.PAGES and dedup))


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank sends for one room (whole-room view; chunks intersect ``kv_range``)."""

    rank: int
    kv_buffers: tuple[int, ...]
    kv_range: tuple[int, int]
    state_buffers: tuple[int, ...]
    aux: bool
    state_skipped: tuple[int, ...]
    """State buffers this rank holds but does not send (the de-dup), for accounting."""

    @property
    def kv_positions(self) -> int:
        return max(0, self.kv_range[1] - self.kv_range[0])

    def chunk_range(self, start: int, end: int) -> tuple[int, int]:
        """The part of this rank's KV positions that falls in chunk ``[start, end)``."""
        lo, hi = max(start, self.kv_range[0]), min(end, self.kv_range[1])
        return (lo, hi) if lo < hi else (lo, lo)


def _owned_layers(layers: int, cp_size: int, rank: int) -> range:
    a, b = contiguous_slice(layers, cp_size, rank)
    return range(a, b)


def rank_plan(
    layout: PoolLayout,
    cp_size: int,
    rank: int,
    split: SplitMode,
    n_pages: int,
    prefix_pages: int = 0,
    dedup: bool = True,
) -> RankPlan:
    """Exactly what ``rank`` of a ``cp_size`` group sends for a room of ``n_pages`` positions
    whose first ``prefix_pages`` the decode side already holds. ``dedup`` off (pages split
    only): every rank also sends the replicated state, which the receiver then takes from each."""
    contiguous_slice(0, cp_size, rank)  # validates cp_size and rank for every mode
    if not 0 <= prefix_pages <= n_pages:
        raise BadRequest(f"prefix_pages {prefix_pages} must lie in [0, {n_pages}]")
    kv_all = layout.indices("kv")
    state_all = layout.indices("state")
    if split is SplitMode.RANK0 or cp_size == 1:
        mine = rank == 0
        kv_buffers = kv_all if mine else ()
        kv_range = (prefix_pages, n_pages) if mine else (n_pages, n_pages)
        state = state_all if mine else ()
    elif split is SplitMode.PAGES:
        a, b = contiguous_slice(n_pages, cp_size, rank)
        a = max(a, prefix_pages)
        kv_range = (a, b) if a < b else (b, b)
        kv_buffers = kv_all if kv_range[0] < kv_range[1] else ()
        state = state_all if rank == 0 or not dedup else ()
    else:  # LAYERS
        kv_layers = 1 + max((layout.buffers[i].layer for i in kv_all), default=-1)
        own = _owned_layers(kv_layers, cp_size, rank)
        kv_buffers = tuple(i for i in kv_all if layout.buffers[i].layer in own)
        kv_range = (prefix_pages, n_pages) if kv_buffers else (n_pages, n_pages)
        state_list: list[int] = []
        for comp in layout.state_components:
            idx = [i for i in state_all if layout.buffers[i].component == comp]
            n_layers = 1 + max(layout.buffers[i].layer for i in idx)
            own_s = _owned_layers(n_layers, cp_size, rank)
            state_list += [i for i in idx if layout.buffers[i].layer in own_s]
        state = tuple(state_list)
    if kv_range[0] >= kv_range[1]:
        kv_buffers = ()
    skipped = state_all if skips_replicated_state(cp_size, rank, split, dedup) else ()
    return RankPlan(
        rank=rank,
        kv_buffers=tuple(kv_buffers),
        kv_range=kv_range,
        state_buffers=tuple(state),
        aux=rank == 0,
        state_skipped=tuple(skipped),
    )


def group_plans(
    layout: PoolLayout, cp_size: int, split: SplitMode, n_pages: int, prefix_pages: int = 0, dedup: bool = True
) -> list[RankPlan]:
    return [rank_plan(layout, cp_size, r, split, n_pages, prefix_pages, dedup) for r in range(cp_size)]
