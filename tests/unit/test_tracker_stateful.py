"""transferd.protocol.room.CoverageTracker driven by hypothesis' stateful testing.

Random and adversarial sequences of ``accept(rank, kind, buffer, pos, count)`` and
``rank_done(rank)`` across cp_size 1..4, every split mode, prefixes and several layouts, checked
against a model whose plans are recomputed here from the DESIGN.md formula (not via
``transferd.protocol.policy``):

* a frame is accepted iff its rank has not reported done, every row it names lies in that rank's
  plan, and none of those rows was accepted before; a refused frame changes nothing;
* an accepted frame returns exactly the destination rows the room request names for it;
* ``rank_done`` returns a reason iff that rank still had planned rows missing (or reported done
  before);
* ``complete`` is true iff every planned row was accepted exactly once and every rank is done.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from transferd.errors import Refused
from transferd.layout import ModelSpec, PoolLayout, StateComponent
from transferd.protocol.room import CoverageTracker, RoomRequest
from transferd.types import SplitMode

KV, STATE, AUX = 0, 1, 2

LAYOUTS: list[PoolLayout] = [
    # 4 MHA layers (KV buffers 0..7), conv 2 layers, ssm 3 layers, aux
    ModelSpec(name="hybrid", dtype="bf16", page_size=2, kv_layers=4, kv_format="mha", kv_token_elems=4,
              state=(StateComponent("conv", 2, (3,), "bf16"), StateComponent("ssm", 3, (2,), "fp32")),
              aux_row_bytes=16).layout(48, 12, 6),
    # 1 MLA layer, one state component of 5 layers
    ModelSpec(name="mla", dtype="fp8_e4m3", page_size=1, kv_layers=1, kv_format="mla", kv_token_elems=8,
              state=(StateComponent("idx", 5, (4,), "bf16"),), aux_row_bytes=8).layout(40, 10, 4),
    # no state at all, 3 MLA layers
    ModelSpec(name="plain", dtype="fp16", page_size=4, kv_layers=3, kv_format="mla", kv_token_elems=2,
              aux_row_bytes=24).layout(40, 4, 4),
]


def share(n: int, cp: int, r: int) -> range:
    """Contiguous share of n items for rank r: sizes n // cp, the first n % cp ranks get one more."""
    sizes = [n // cp + (1 if i < n % cp else 0) for i in range(cp)]
    start = sum(sizes[:r])
    return range(start, start + sizes[r])


Row = tuple[int, int, int]  # (kind, buffer, position)


def model_plans(layout: PoolLayout, cp: int, split: str, n: int, prefix: int,
                slots: dict[str, list[int]]) -> list[set[Row]]:
    """Every (kind, buffer, position) row each rank must send, from the DESIGN.md table."""
    bufs = list(enumerate(layout.buffers))
    kv = [(i, b) for i, b in bufs if b.kind == "kv"]
    state = [(i, b) for i, b in bufs if b.kind == "state"]
    aux = next(i for i, b in bufs if b.kind == "aux")
    kv_layers = 1 + max(b.layer for _, b in kv)
    plans: list[set[Row]] = [set() for _ in range(cp)]
    sent = range(prefix, n)
    for r in range(cp):
        p = plans[r]
        if cp == 1 or split == "rank0":
            if r == 0:
                p |= {(KV, i, pos) for i, _ in kv for pos in sent}
                p |= {(STATE, i, j) for i, b in state for j in range(len(slots[b.component]))}
        elif split == "pages":
            p |= {(KV, i, pos) for i, _ in kv for pos in share(n, cp, r) if pos >= prefix}
            if r == 0:
                p |= {(STATE, i, j) for i, b in state for j in range(len(slots[b.component]))}
        else:  # layers
            p |= {(KV, i, pos) for i, b in kv if b.layer in share(kv_layers, cp, r) for pos in sent}
            for i, b in state:
                layers = 1 + max(x.layer for _, x in state if x.component == b.component)
                if b.layer in share(layers, cp, r):
                    p |= {(STATE, i, j) for j in range(len(slots[b.component]))}
        if r == 0:
            p.add((AUX, aux, 0))
    return plans


class TrackerMachine(RuleBasedStateMachine):
    layout: PoolLayout
    tracker: CoverageTracker
    plans: list[set[Row]]

    @initialize(data=st.data(), cp=st.integers(1, 4), split=st.sampled_from(["pages", "layers", "rank0"]),
                which=st.integers(0, len(LAYOUTS) - 1))
    def setup(self, data: Any, cp: int, split: str, which: int) -> None:
        L = self.layout = LAYOUTS[which]
        n = data.draw(st.integers(0, 9), label="n_pages")
        prefix = data.draw(st.integers(0, n), label="prefix")
        # destination pages: distinct rows, in an arbitrary order (runs and breaks)
        dst = data.draw(st.permutations(range(L.kv_rows)), label="dst")[:n]
        slots: dict[str, list[int]] = {}
        for comp in L.state_components:
            rows = L.rows_of("state", comp)
            k = data.draw(st.integers(0, 3), label=f"{comp} slots")
            slots[comp] = data.draw(st.permutations(range(rows)), label=f"{comp} slot order")[:k]
        aux_slot = data.draw(st.integers(0, L.buffers[L.aux_index].rows - 1), label="aux slot")
        self.req = RoomRequest(room=7, group="g", dst_pages=tuple(dst), prefix=prefix,
                               state={c: tuple(v) for c, v in slots.items() if v or data.draw(st.booleans())},
                               aux_slot=aux_slot)
        self.slots = {c: list(self.req.state.get(c, ())) for c in L.state_components}
        self.cp, self.split, self.n = cp, split, n
        self.tracker = CoverageTracker(L, cp, SplitMode(split), self.req)
        self.plans = model_plans(L, cp, split, n, prefix, self.slots)
        self.accepted: set[Row] = set()
        self.done: set[int] = set()

    # -- helpers ---------------------------------------------------------------------------
    def _dst_rows(self, kind: int, buffer: int, pos: int, count: int) -> list[int]:
        if kind == KV:
            return list(self.req.dst_pages[pos:pos + count])
        if kind == STATE:
            return self.slots[self.layout.buffers[buffer].component][pos:pos + count]
        return [self.req.aux_slot]

    def _send(self, rank: int, kind: int, buffer: int, pos: int, count: int) -> None:
        plan = self.plans[rank]
        # a frame longer than the whole plan cannot lie in it (and must not be expanded row by row)
        rows = {(kind, buffer, p) for p in range(pos, pos + count)} if count <= len(plan) else None
        if rank in self.done:
            want: str | None = "after_done"
        elif rows is None or not rows <= plan:
            want = "unexpected"
        elif rows & self.accepted:
            want = "duplicate"
        else:
            want = None
        try:
            first, idx = self.tracker.accept(rank, kind, buffer, pos, count)
        except Refused as exc:
            assert want is not None, f"frame {(rank, kind, buffer, pos, count)} refused ({exc.code}: {exc.reason})"
            assert exc.code == want, f"frame {(rank, kind, buffer, pos, count)}: {exc.code} ({exc.reason}), want {want}"
            event(f"refused {exc.code}")
            return
        assert want is None and rows is not None, f"frame {(rank, kind, buffer, pos, count)} accepted, want {want}"
        got = list(range(first, first + count)) if idx is None else [int(x) for x in idx]
        assert first == -1 or idx is None
        assert got == self._dst_rows(kind, buffer, pos, count)
        self.accepted |= rows
        event("accepted")

    def _missing(self, rank: int) -> list[Row]:
        return sorted(self.plans[rank] - self.accepted)

    # -- rules -----------------------------------------------------------------------------
    @rule(data=st.data())
    def send_missing_run(self, data: Any) -> None:
        """A frame that should be accepted: part of a run of rows this rank has not sent yet."""
        ranks = [r for r in range(self.cp) if self._missing(r)]
        if not ranks:
            return
        rank = data.draw(st.sampled_from(ranks), label="rank")
        kind, buffer, pos = data.draw(st.sampled_from(self._missing(rank)), label="row")
        count = 1
        while (kind, buffer, pos + count) in self.plans[rank] and (kind, buffer, pos + count) not in self.accepted:
            count += 1
        self._send(rank, kind, buffer, pos, data.draw(st.integers(1, count), label="count"))

    @rule(data=st.data())
    def send_near_plan(self, data: Any) -> None:
        """A frame around some planned row of some rank: overlaps, spills past the plan, replays."""
        rank = data.draw(st.integers(0, self.cp - 1), label="rank")
        everything = sorted(set().union(*self.plans))
        if not everything:
            return
        kind, buffer, pos = data.draw(st.sampled_from(everything), label="near")
        pos = max(0, pos + data.draw(st.integers(-2, 2), label="shift"))
        self._send(rank, kind, buffer, pos, data.draw(st.integers(1, 4), label="count"))

    @rule(data=st.data())
    def replay_accepted(self, data: Any) -> None:
        """A frame over rows already accepted, from their own rank (a duplicate unless done)."""
        if not self.accepted:
            return
        kind, buffer, pos = data.draw(st.sampled_from(sorted(self.accepted)), label="replayed")
        rank = next(r for r in range(self.cp) if (kind, buffer, pos) in self.plans[r])
        back = data.draw(st.integers(0, 2), label="back")
        self._send(rank, kind, buffer, max(0, pos - back), data.draw(st.integers(1, 3), label="count"))

    @rule(rank=st.integers(0, 3), kind=st.sampled_from([KV, STATE, AUX]), buffer=st.integers(0, 20),
          pos=st.one_of(st.integers(0, 12), st.integers(0, (1 << 40) - 1)),
          count=st.one_of(st.integers(1, 12), st.integers(1, (1 << 32) - 1)))
    def send_anything(self, rank: int, kind: int, buffer: int, pos: int, count: int) -> None:
        """Any frame the wire format lets through (the receiver only passes registered ranks)."""
        if rank < self.cp:
            self._send(rank, kind, buffer, pos, count)

    @rule(rank=st.integers(0, 3))
    def rank_done(self, rank: int) -> None:
        if rank >= self.cp:
            return
        missing = self._missing(rank)
        again = rank in self.done
        reason = self.tracker.rank_done(rank)
        self.done.add(rank)
        if missing or again:
            assert reason, f"rank {rank} done with {len(missing)} rows missing (again={again}) but no reason"
            if missing and not again:
                assert f"{len(missing)} planned rows" in reason, reason
        else:
            assert reason is None, f"rank {rank} done with its whole plan, yet: {reason}"

    @rule()
    def finish_everything(self) -> None:
        """Send every remaining planned row (one row per frame) of ranks not yet done, then done."""
        for rank in range(self.cp):
            for kind, buffer, pos in self._missing(rank):
                self._send(rank, kind, buffer, pos, 1)
        for rank in range(self.cp):
            if rank not in self.done:
                self.rank_done(rank)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def completion_matches_the_model(self) -> None:
        if not hasattr(self, "tracker"):
            return
        everything = set().union(*self.plans)
        want = everything <= self.accepted and self.done == set(range(self.cp))
        assert self.tracker.complete is want, (
            f"complete={self.tracker.complete}, model says {want}: missing {sorted(everything - self.accepted)[:5]}, "
            f"done {sorted(self.done)} of cp {self.cp}")
        assert self.accepted <= everything  # exactly once, and nothing outside the plans
        if want:
            event(f"complete (cp {self.cp}, {self.split})")

    @invariant()
    def plans_are_disjoint_and_marks_match(self) -> None:
        if not hasattr(self, "tracker"):
            return
        seen: set[Row] = set()
        for p in self.plans:
            assert not (p & seen)
            seen |= p
        # KV destination rows the tracker marked equal the ones the model accepted
        got = {(KV, b, int(pos)) for b, row in zip(self.layout.indices("kv"), self.tracker.kv_got)
               for pos in np.nonzero(row)[0]}
        assert got == {r for r in self.accepted if r[0] == KV}
        got = {(STATE, b, int(j)) for (_, b), row in self.tracker.state_got.items() for j in np.nonzero(row)[0]}
        assert got == {r for r in self.accepted if r[0] == STATE}
        assert self.tracker.aux_got is any(r[0] == AUX for r in self.accepted)


TrackerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_coverage_tracker_against_the_model = TrackerMachine.TestCase
