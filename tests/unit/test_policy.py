"""transferd.protocol.policy: the de-dup decision and who sends what (DESIGN.md, "the policy")."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transferd.errors import BadRequest, ConfigError, TransferdError
from transferd.layout import ModelSpec, PoolLayout, StateComponent
from transferd.protocol.policy import (
    RankPlan,
    SplitMode,
    contiguous_slice,
    group_plans,
    rank_plan,
    skips_replicated_state,
)

PAGES, LAYERS, RANK0 = SplitMode.PAGES, SplitMode.LAYERS, SplitMode.RANK0

# 4 MHA layers -> KV buffers 0..7 (k, v per layer); conv (2 layers) -> 8, 9; ssm (3 layers) -> 10..12;
# aux -> 13.
LAYOUT = ModelSpec(
    name="tiny", dtype="bf16", page_size=4, kv_layers=4, kv_format="mha", kv_token_elems=8,
    state=(StateComponent("conv", 2, (3, 4), "bf16"), StateComponent("ssm", 3, (5,), "fp32")),
    aux_row_bytes=16,
).layout(64, 8, 4)
KV = tuple(range(8))
STATE = (8, 9, 10, 11, 12)


def test_layout_indices_are_what_these_tests_assume() -> None:
    assert LAYOUT.indices("kv") == KV
    assert LAYOUT.indices("state") == STATE
    assert LAYOUT.aux_index == 13
    assert [LAYOUT.buffers[i].layer for i in KV] == [0, 0, 1, 1, 2, 2, 3, 3]


# -- the de-dup decision table (DESIGN.md: tests must pin it down) --------------------------

@pytest.mark.parametrize(
    ("cp_size", "rank", "split", "skip"),
    [
        (1, 0, PAGES, False),   # (cp 1, rank 0, no split) -> send
        (8, 0, PAGES, False),   # (8, 0, no) -> send
        (8, 1, PAGES, True),    # (8, 1, no) -> skip
        (8, 7, PAGES, True),    # (8, 7, no) -> skip
        (8, 1, LAYERS, False),  # (8, 1, split=layers) -> send
        # the same rule for the other non-split mode
        (1, 0, RANK0, False),
        (8, 0, RANK0, False),
        (8, 3, RANK0, True),
        (8, 0, LAYERS, False),
        (8, 7, LAYERS, False),
    ],
)
def test_dedup_decision_table(cp_size: int, rank: int, split: SplitMode, skip: bool) -> None:
    assert skips_replicated_state(cp_size, rank, split) is skip


@pytest.mark.parametrize("split", list(SplitMode))
@pytest.mark.parametrize("cp_size", [1, 2, 8])
def test_state_skipped_in_plan_follows_the_decision(split: SplitMode, cp_size: int) -> None:
    for rank in range(cp_size):
        plan = rank_plan(LAYOUT, cp_size, rank, split, n_pages=10)
        expected = STATE if skips_replicated_state(cp_size, rank, split) else ()
        assert plan.state_skipped == expected


def test_split_mode_parse() -> None:
    assert SplitMode.parse("pages") is PAGES
    assert SplitMode.parse("layers") is LAYERS
    assert SplitMode.parse(RANK0) is RANK0
    with pytest.raises(ConfigError, match="'nope'"):
        SplitMode.parse("nope")


# -- contiguous slices -------------------------------------------------------------------

def test_contiguous_slice_design_example() -> None:
    assert [contiguous_slice(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


def test_contiguous_slice_more_ranks_than_items() -> None:
    assert [contiguous_slice(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert contiguous_slice(0, 3, 2) == (0, 0)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 10_000), cp_size=st.integers(1, 64))
def test_contiguous_slices_partition_the_range(n: int, cp_size: int) -> None:
    slices = [contiguous_slice(n, cp_size, r) for r in range(cp_size)]
    # contiguous and disjoint: each starts where the previous ended; together they cover [0, n)
    assert slices[0][0] == 0
    assert slices[-1][1] == n
    for (_, end), (start, _) in itertools.pairwise(slices):
        assert start == end
    sizes = [b - a for a, b in slices]
    assert all(s >= 0 for s in sizes)
    assert sum(sizes) == n
    assert max(sizes) - min(sizes) <= 1
    # the larger shares come first
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(
    ("n", "cp_size", "rank", "exc"),
    [
        (10, 0, 0, BadRequest),
        (10, -1, 0, BadRequest),
        (10, 3, 3, BadRequest),
        (10, 3, -1, BadRequest),
        (-1, 3, 0, BadRequest),
    ],
)
def test_contiguous_slice_errors(n: int, cp_size: int, rank: int, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        contiguous_slice(n, cp_size, rank)


# -- rank_plan: pages mode ---------------------------------------------------------------

def test_pages_mode_plans_n10_cp3() -> None:
    plans = group_plans(LAYOUT, 3, PAGES, 10)
    assert [p.rank for p in plans] == [0, 1, 2]
    assert [p.kv_range for p in plans] == [(0, 4), (4, 7), (7, 10)]
    assert all(p.kv_buffers == KV for p in plans)
    assert plans[0].state_buffers == STATE and plans[0].aux and plans[0].state_skipped == ()
    for p in plans[1:]:
        assert p.state_buffers == ()
        assert p.aux is False
        assert p.state_skipped == STATE
    assert [p.kv_positions for p in plans] == [4, 3, 3]


def test_pages_mode_prefix_pages_are_not_sent() -> None:
    plans = group_plans(LAYOUT, 3, PAGES, 10, prefix_pages=5)
    # rank 0's slice [0:4] lies wholly in the prefix: it sends no KV, but still state and aux
    assert plans[0].kv_buffers == ()
    assert plans[0].kv_positions == 0
    assert plans[0].state_buffers == STATE and plans[0].aux
    assert plans[1].kv_range == (5, 7) and plans[1].kv_buffers == KV
    assert plans[2].kv_range == (7, 10) and plans[2].kv_buffers == KV


def test_pages_mode_whole_room_is_prefix() -> None:
    plans = group_plans(LAYOUT, 2, PAGES, 6, prefix_pages=6)
    assert all(p.kv_buffers == () and p.kv_positions == 0 for p in plans)
    assert plans[0].state_buffers == STATE and plans[0].aux


def test_chunk_range_intersects_the_slice() -> None:
    plan = rank_plan(LAYOUT, 3, 1, PAGES, 10)  # [4, 7)
    assert plan.chunk_range(0, 5) == (4, 5)
    assert plan.chunk_range(5, 6) == (5, 6)
    assert plan.chunk_range(3, 12) == (4, 7)
    for start, end in [(0, 3), (0, 4), (7, 10), (8, 9)]:
        lo, hi = plan.chunk_range(start, end)
        assert lo == hi, (start, end)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 200),
    cp_size=st.integers(1, 9),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    prefix_frac=st.floats(0, 1),
)
def test_chunks_partition_each_ranks_slice(n: int, cp_size: int, cuts: list[int], prefix_frac: float) -> None:
    prefix = int(n * prefix_frac)
    bounds = sorted({0, n, *(c for c in cuts if c <= n)})
    for plan in group_plans(LAYOUT, cp_size, PAGES, n, prefix):
        got: list[int] = []
        for a, b in itertools.pairwise(bounds):
            lo, hi = plan.chunk_range(a, b)
            assert lo <= hi
            assert a <= lo or lo == hi
            got.extend(range(lo, hi))
        assert got == list(range(*plan.kv_range))


# -- rank_plan: layers mode --------------------------------------------------------------

def test_layers_mode_cp2() -> None:
    r0, r1 = group_plans(LAYOUT, 2, LAYERS, 10, prefix_pages=3)
    assert r0.kv_buffers == (0, 1, 2, 3)  # layers 0, 1 (k and v)
    assert r1.kv_buffers == (4, 5, 6, 7)  # layers 2, 3
    assert r0.kv_range == r1.kv_range == (3, 10)
    # conv has 2 layers (8, 9), ssm 3 layers (10, 11, 12): split each component separately
    assert r0.state_buffers == (8, 10, 11)
    assert r1.state_buffers == (9, 12)
    assert (r0.aux, r1.aux) == (True, False)
    assert r0.state_skipped == r1.state_skipped == ()


def test_layers_mode_more_ranks_than_layers() -> None:
    plans = group_plans(LAYOUT, 8, LAYERS, 10)
    assert [p.kv_buffers for p in plans[:4]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for p in plans[4:]:
        assert p.kv_buffers == ()
        assert p.kv_positions == 0
    assert [p.state_buffers for p in plans[:3]] == [(8, 10), (9, 11), (12,)]
    assert all(p.state_buffers == () for p in plans[3:])


def test_layers_mode_mla_one_buffer_per_layer() -> None:
    layout = ModelSpec(kv_format="mla", kv_layers=5, page_size=2, kv_token_elems=4).layout(8, 0, 2)
    plans = group_plans(layout, 2, LAYERS, 4)
    assert [p.kv_buffers for p in plans] == [(0, 1, 2), (3, 4)]
    assert all(p.state_buffers == () for p in plans)


# -- rank_plan: rank0 mode and cp 1 ------------------------------------------------------

def test_rank0_mode() -> None:
    plans = group_plans(LAYOUT, 4, RANK0, 10, prefix_pages=2)
    assert plans[0].kv_buffers == KV and plans[0].kv_range == (2, 10)
    assert plans[0].state_buffers == STATE and plans[0].aux and plans[0].state_skipped == ()
    for p in plans[1:]:
        assert p.kv_buffers == () and p.kv_positions == 0
        assert p.state_buffers == () and not p.aux
        assert p.state_skipped == STATE


@pytest.mark.parametrize("split", list(SplitMode))
def test_cp1_sends_everything(split: SplitMode) -> None:
    plan = rank_plan(LAYOUT, 1, 0, split, 7, prefix_pages=1)
    assert plan == RankPlan(rank=0, kv_buffers=KV, kv_range=(1, 7), state_buffers=STATE, aux=True,
                            state_skipped=())


# -- whole-group coverage property -------------------------------------------------------

@st.composite
def layouts(draw: st.DrawFn) -> PoolLayout:
    comps = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), max_size=3))
    spec = ModelSpec(
        kv_format=draw(st.sampled_from(["mha", "mla"])),
        kv_layers=draw(st.integers(1, 12)),
        page_size=2,
        kv_token_elems=2,
        state=tuple(StateComponent(f"c{i}", layers, (width,), "fp16") for i, (layers, width) in enumerate(comps)),
    )
    return spec.layout(4, 2, 2)


@settings(max_examples=200, deadline=None)
@given(
    layout=layouts(),
    split=st.sampled_from(list(SplitMode)),
    cp_size=st.integers(1, 10),
    n=st.integers(0, 40),
    prefix_frac=st.floats(0, 1),
)
def test_group_covers_everything_exactly_once(
    layout: PoolLayout, split: SplitMode, cp_size: int, n: int, prefix_frac: float
) -> None:
    prefix = int(n * prefix_frac)
    kv_all = layout.indices("kv")
    state_all = layout.indices("state")
    plans = group_plans(layout, cp_size, split, n, prefix)
    assert [p.rank for p in plans] == list(range(cp_size))

    kv_seen = Counter((b, pos) for p in plans for b in p.kv_buffers for pos in range(*p.kv_range))
    assert kv_seen == Counter((b, pos) for b in kv_all for pos in range(prefix, n))
    for p in plans:
        assert set(p.kv_buffers) <= set(kv_all)
        assert prefix <= p.kv_range[0] <= p.kv_range[1] <= n or p.kv_positions == 0
        assert (p.kv_positions == 0) == (p.kv_buffers == ())

    state_seen = Counter(b for p in plans for b in p.state_buffers)
    if split is RANK0 and cp_size > 1:
        assert plans[0].state_buffers == state_all
    assert state_seen == Counter(state_all)  # every state buffer exactly once, in every mode

    assert [p.aux for p in plans] == [r == 0 for r in range(cp_size)]

    for p in plans:
        if split is LAYERS or cp_size == 1 or p.rank == 0:
            assert p.state_skipped == ()
        else:
            assert p.state_skipped == state_all


# -- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("split", list(SplitMode))
@pytest.mark.parametrize(("n", "prefix"), [(10, 11), (10, -1), (0, 1)])
def test_prefix_outside_room_is_bad_request(split: SplitMode, n: int, prefix: int) -> None:
    with pytest.raises(BadRequest, match="prefix_pages"):
        rank_plan(LAYOUT, 2, 0, split, n, prefix)


@pytest.mark.parametrize("split", [PAGES, LAYERS])
@pytest.mark.parametrize(("cp_size", "rank"), [(8, 8), (8, -1), (0, 0), (-2, 0)])
def test_bad_rank_or_cp_size(split: SplitMode, cp_size: int, rank: int) -> None:
    with pytest.raises(BadRequest):
        rank_plan(LAYOUT, cp_size, rank, split, 10)


@pytest.mark.parametrize(
    ("cp_size", "rank", "split"),
    [(8, 8, RANK0), (8, -1, RANK0), (0, 0, RANK0), (1, 5, PAGES), (1, 1, LAYERS)],
)
def test_bad_rank_or_cp_size_in_rank0_mode_and_cp1(cp_size: int, rank: int, split: SplitMode) -> None:
    try:
        plan = rank_plan(LAYOUT, cp_size, rank, split, 10)
    except TransferdError:
        return
    raise AssertionError(f"rank {rank} of cp_size {cp_size} ({split.value}) got a plan: {plan}")


# -- the de-dup switch (sender.dedup = false: every pages-split rank ships the replicated state) ----

@pytest.mark.parametrize("cp_size", [2, 8])
def test_dedup_off_every_pages_rank_sends_the_state(cp_size: int) -> None:
    on = group_plans(LAYOUT, cp_size, PAGES, 10)
    off = group_plans(LAYOUT, cp_size, PAGES, 10, dedup=False)
    for a, b in zip(on, off):
        assert b.state_buffers == STATE and b.state_skipped == ()
        assert (a.kv_buffers, a.kv_range, a.aux) == (b.kv_buffers, b.kv_range, b.aux)  # only the state changes
    assert [p.rank for p in off if p.aux] == [0]
    assert all(not skips_replicated_state(cp_size, r, PAGES, dedup=False) for r in range(cp_size))


@pytest.mark.parametrize("split", [LAYERS, RANK0])
def test_dedup_off_changes_nothing_outside_the_pages_split(split: SplitMode) -> None:
    assert group_plans(LAYOUT, 4, split, 10) == group_plans(LAYOUT, 4, split, 10, dedup=False)
