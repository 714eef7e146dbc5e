"""Room lifecycle and the receiver's exact-once coverage tracker. Pure: no I/O, no pool access.

A room moves ``bootstrapping → waiting → transferring → success | failed``; status only moves
forward, ``failed`` overrides anything that is not terminal, and a terminal status never changes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..errors import BadRequest, Refused
from ..layout import KINDS, PoolLayout
from ..types import Kind, SplitMode
from .policy import RankPlan, group_plans


class RoomState(str, Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING = "waiting"  # WaitingForInput
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


_ORDER = {s: i for i, s in enumerate(RoomState)}


@dataclass(frozen=True, slots=True)
class RoomStatus:
    state: RoomState
    code: str = ""
    reason: str = ""

    def to_wire(self) -> dict[str, str]:
        return {"state": self.state.value, "code": self.code, "reason": self.reason}

    @classmethod
    def from_wire(cls, d: dict[str, str]) -> RoomStatus:
        return cls(RoomState(d["state"]), d.get("code", ""), d.get("reason", ""))


def advance(current: RoomStatus, new: RoomStatus) -> RoomStatus:
    """The status after an event: forward only, failure overrides, terminal is final."""
    if current.state.terminal:
        return current
    if new.state is RoomState.FAILED:
        return new
    return new if _ORDER[new.state] > _ORDER[current.state] else current


@dataclass(frozen=True, slots=True)
class RoomRequest:
    """What the decode engine expects: destinations for a room coming from ``group``."""

    room: int
    group: str
    dst_pages: tuple[int, ...]
    prefix: int
    state: dict[str, tuple[int, ...]]
    aux_slot: int

    def validate(self, layout: PoolLayout) -> None:
        """Check every index against the decode pool before anything can be written."""
        n = len(self.dst_pages)
        if not 0 <= self.prefix <= n:
            raise BadRequest(f"room {self.room}: prefix_pages {self.prefix} outside [0, {n}]")
        _check_rows("destination page", self.dst_pages, layout.kv_rows, self.room)
        comps = layout.state_components
        for comp in self.state:
            if comp not in comps:
                raise BadRequest(f"room {self.room}: unknown state component {comp!r} (pool has {list(comps)})")
        for comp in comps:
            slots = self.state.get(comp, ())
            _check_rows(f"{comp} state slot", slots, layout.rows_of("state", comp), self.room)
        aux_rows = layout.buffers[layout.aux_index].rows
        if not 0 <= self.aux_slot < aux_rows:
            raise BadRequest(f"room {self.room}: aux slot {self.aux_slot} outside the pool's {aux_rows} aux rows")


def _check_rows(what: str, rows: tuple[int, ...], limit: int, room: int) -> None:
    if not rows:
        return
    if len(rows) <= 64:  # the common small case: plain Python beats numpy's set-up cost here
        bad_rows = [r for r in rows if not 0 <= r < limit]
        if bad_rows:
            raise BadRequest(f"room {room}: {what} {bad_rows[0]} outside the pool's {limit} rows")
        if len(set(rows)) != len(rows):
            seen: set[int] = set()
            twice = next(r for r in rows if r in seen or seen.add(r))  # type: ignore[func-returns-value]
            raise BadRequest(f"room {room}: {what} {twice} listed twice")
        return
    arr = np.asarray(rows, dtype=np.int64)
    bad = arr[(arr < 0) | (arr >= limit)]
    if bad.size:
        raise BadRequest(f"room {room}: {what} {int(bad[0])} outside the pool's {limit} rows")
    if np.unique(arr).size != arr.size:
        vals, counts = np.unique(arr, return_counts=True)
        raise BadRequest(f"room {room}: {what} {int(vals[counts > 1][0])} listed twice")


def run_ends(rows: tuple[int, ...]) -> np.ndarray:
    """``out[i]`` = end of the run of consecutive rows that starts at ``i``
    (``rows[i..out[i])`` are ``rows[i], rows[i]+1, …``)."""
    n = len(rows)
    if n <= 1:  # most state lists and every one-page room: no numpy run search
        return np.full(n, 1, dtype=np.int64)
    out = np.empty(n, dtype=np.int64)
    arr = np.asarray(rows, dtype=np.int64)
    breaks = np.nonzero(np.diff(arr) != 1)[0] + 1  # first index of each new run
    ends = np.append(breaks, n)
    starts = np.insert(breaks, 0, 0)
    for s, e in zip(starts.tolist(), ends.tolist()):
        out[s:e] = e
    return out


def runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int]]:
    """Split positions ``0..len(src)`` into ``[a, b)`` runs where both ``src`` and ``dst`` rows are
    consecutive — each run moves as one block."""
    n = len(src)
    if n <= 1:
        return [(0, n)] if n else []
    brk = np.nonzero((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    edges = [0, *brk.tolist(), n]
    return list(itertools.pairwise(edges))


class TrackerShape:
    """What a :class:`CoverageTracker` takes from its plans alone, the same for every room with
    those plans (the receiver keeps one beside each plan list it caches): the KV rows and aux row
    each rank owes and their bytes, which state buffers each rank sends (their rows come from the
    room's request), the buffers' lookups."""

    __slots__ = ("expected_bytes", "kv_bufs", "kv_local", "no_state", "plans", "remaining", "state_rows")

    def __init__(self, layout: PoolLayout, plans: list[RankPlan]) -> None:
        self.plans = plans
        self.kv_local = {b: i for i, b in enumerate(layout.indices("kv"))}
        self.kv_bufs = [frozenset(p.kv_buffers) for p in plans]
        self.remaining = [0] * len(plans)
        self.expected_bytes = {k: 0 for k in KINDS}
        self.state_rows: list[tuple[int, int, str, int]] = []  # rank, buffer, component, row bytes
        row_bytes = layout.buffer_row_bytes
        for p in plans:
            self.remaining[p.rank] += len(p.kv_buffers) * p.kv_positions
            self.expected_bytes["kv"] += p.kv_positions * sum(row_bytes[b] for b in p.kv_buffers)
            self.state_rows += [(p.rank, b, layout.buffers[b].component, row_bytes[b]) for b in p.state_buffers]
            if p.aux:
                self.remaining[p.rank] += 1
                self.expected_bytes["aux"] += layout.aux_row_bytes
        empty = np.empty(0, dtype=np.int64)
        empty.flags.writeable = False
        self.no_state = {c: empty for c in layout.state_components}


class CoverageTracker:
    """What the receiver must see for one room, exactly once, and what it has seen.

    Built from the same :func:`group_plans` the senders use. :meth:`accept` checks one data
    frame against the plan and returns the destination rows, or raises :class:`Refused`.
    """

    def __init__(self, layout: PoolLayout, cp_size: int, split: SplitMode, req: RoomRequest,
                 shape: TrackerShape | None = None) -> None:
        self.layout = layout
        self.req = req
        n = len(req.dst_pages)
        if shape is None:
            shape = TrackerShape(layout, group_plans(layout, cp_size, split, n, req.prefix))
        self.plans: list[RankPlan] = shape.plans
        self.dst = np.asarray(req.dst_pages, dtype=np.int64)
        self.dst_list = [int(p) for p in req.dst_pages]
        self.dst_run_end = run_ends(req.dst_pages)
        if req.state:
            self.state_dst = {c: np.asarray(req.state.get(c, ()), dtype=np.int64) for c in layout.state_components}
            self.state_run_end = {c: run_ends(tuple(v.tolist())) for c, v in self.state_dst.items()}
        else:  # most rooms: no state rows, nothing to index (read-only, shared)
            self.state_dst = self.state_run_end = shape.no_state
        self._kv_local = shape.kv_local
        self.kv_got = np.zeros((len(shape.kv_local), n), dtype=bool)
        # (rank, buffer) -> slots seen: one sending rank per buffer with the de-dup, every rank without it
        self.state_got: dict[tuple[int, int], np.ndarray] = {}
        self.aux_got = False
        self.remaining = shape.remaining[:]
        self.expected_bytes = dict(shape.expected_bytes)
        self._kv_bufs = shape.kv_bufs
        for rank, b, comp, row_bytes in shape.state_rows:
            rows = len(req.state.get(comp, ()))
            self.state_got[(rank, b)] = np.zeros(rows, dtype=bool)
            self.remaining[rank] += rows
            self.expected_bytes["state"] += rows * row_bytes
        self.done: set[int] = set()

    @property
    def cp_size(self) -> int:
        return len(self.plans)

    def accept(self, rank: int, kind: int, buffer: int, pos: int, count: int) -> tuple[int, np.ndarray | None]:
        """Validate a frame; on success mark it received and return the destination rows as
        ``(first_row, None)`` when they are consecutive, else ``(-1, row_indices)``."""
        if rank in self.done:
            raise Refused("after_done", f"rank {rank} sent data after reporting done")
        if kind == Kind.KV:
            if buffer not in self._kv_bufs[rank]:
                raise Refused("unexpected", f"rank {rank} is not to send KV buffer {buffer}")
            lo, hi = self.plans[rank].kv_range
            if pos < lo or pos + count > hi:
                raise Refused("unexpected", f"rank {rank} sent KV positions [{pos}, {pos + count}) "
                                            f"outside its plan [{lo}, {hi})")
            if count == 1:  # scattered pages: one row a frame or batch entry, no slices
                seen = self.kv_got[self._kv_local[buffer]]
                if seen[pos]:
                    raise Refused("duplicate", f"KV buffer {buffer} position {pos} arrived twice")
                seen[pos] = True
                self.remaining[rank] -= 1
                return self.dst_list[pos], None
            got = self.kv_got[self._kv_local[buffer], pos:pos + count]
            if got.any():
                raise Refused("duplicate", f"KV buffer {buffer} position {pos + int(got.argmax())} arrived twice")
            got[:] = True
            self.remaining[rank] -= count
            if self.dst_run_end[pos] >= pos + count:
                return int(self.dst[pos]), None
            return -1, self.dst[pos:pos + count]
        if kind == Kind.STATE:
            slots = self.state_got.get((rank, buffer))
            if slots is None:
                raise Refused("unexpected", f"rank {rank} is not to send state buffer {buffer}")
            if pos + count > len(slots):
                raise Refused("unexpected", f"state positions [{pos}, {pos + count}) outside the room's "
                                            f"{len(slots)} slots")
            seg = slots[pos:pos + count]
            if seg.any():
                raise Refused("duplicate", f"state buffer {buffer} slot position {pos + int(seg.argmax())} arrived twice")
            seg[:] = True
            self.remaining[rank] -= count
            comp = self.layout.buffers[buffer].component
            dst = self.state_dst[comp]
            if self.state_run_end[comp][pos] >= pos + count:
                return int(dst[pos]), None
            return -1, dst[pos:pos + count]
        # aux
        if not self.plans[rank].aux or buffer != self.layout.aux_index or pos != 0 or count != 1:
            raise Refused("unexpected", f"rank {rank} sent an unexpected aux frame (buffer {buffer}, pos {pos}, count {count})")
        if self.aux_got:
            raise Refused("duplicate", "aux row arrived twice")
        self.aux_got = True
        self.remaining[rank] -= 1
        return self.req.aux_slot, None

    def rank_done(self, rank: int) -> str | None:
        """Record a rank's done; returns a failure reason if its share is incomplete."""
        if rank in self.done:
            return f"rank {rank} reported done twice"
        self.done.add(rank)
        if self.remaining[rank]:
            return f"rank {rank} reported done with {self.remaining[rank]} planned rows not received"
        return None

    @property
    def complete(self) -> bool:
        return len(self.done) == self.cp_size and not any(self.remaining)

    @property
    def started(self) -> bool:
        return bool(self.aux_got or self.done or self.kv_got.any())
