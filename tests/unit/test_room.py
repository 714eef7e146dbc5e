"""transferd.protocol.room: room status transitions, request validation and exact-once coverage."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transferd.errors import BadRequest
from transferd.layout import ModelSpec, PoolLayout, StateComponent
from transferd.protocol.policy import SplitMode, group_plans
from transferd.protocol.room import (
    CoverageTracker,
    Refused,
    RoomRequest,
    RoomState,
    RoomStatus,
    TrackerShape,
    advance,
    run_ends,
)

KV, STATE, AUX = 0, 1, 2

# KV buffers 0..7 (4 MHA layers), conv 8..9, ssm 10..12, aux 13
LAYOUT = ModelSpec(
    name="tiny", dtype="bf16", page_size=4, kv_layers=4, kv_format="mha", kv_token_elems=8,
    state=(StateComponent("conv", 2, (3, 4), "bf16"), StateComponent("ssm", 3, (5,), "fp32")),
    aux_row_bytes=16,
).layout(64, 8, 4)


def _status(s: RoomState, code: str = "", reason: str = "") -> RoomStatus:
    return RoomStatus(s, code, reason)


B, W, T, S, F = (RoomState.BOOTSTRAPPING, RoomState.WAITING, RoomState.TRANSFERRING, RoomState.SUCCESS,
                 RoomState.FAILED)


# -- advance -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("cur", "new", "result"),
    [
        (B, W, W), (B, T, T), (W, T, T), (T, S, S), (B, S, S),     # forward
        (W, B, W), (T, W, T), (T, B, T), (T, T, T),                # never backward
        (B, F, F), (W, F, F), (T, F, F),                           # failed overrides
        (S, F, S), (S, B, S), (S, T, S), (F, S, F), (F, B, F),     # terminal is final
    ],
)
def test_advance(cur: RoomState, new: RoomState, result: RoomState) -> None:
    assert advance(_status(cur), _status(new)).state is result


def test_advance_keeps_reason_of_the_winner() -> None:
    failed = _status(F, "peer_lost", "rank 3 gone")
    assert advance(_status(T), failed) == failed
    # a later failure does not overwrite the first one's reason
    assert advance(failed, _status(F, "aborted", "later")) == failed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(RoomState)), max_size=12))
def test_advance_sequences(events: list[RoomState]) -> None:
    order = list(RoomState)
    cur = _status(B)
    for e in events:
        nxt = advance(cur, _status(e))
        if cur.state.terminal:
            assert nxt == cur
        elif e is F:
            assert nxt.state is F
        else:
            assert order.index(nxt.state) >= order.index(cur.state)
        cur = nxt


def test_room_status_wire_round_trip() -> None:
    st_ = RoomStatus(F, "aborted", "by engine")
    assert RoomStatus.from_wire(st_.to_wire()) == st_
    assert RoomStatus.from_wire({"state": "success"}) == RoomStatus(S)
    assert [s.terminal for s in RoomState] == [False, False, False, True, True]


# -- RoomRequest.validate ----------------------------------------------------------------

def _req(**kw: object) -> RoomRequest:
    base: dict[str, object] = dict(room=7, group="g", dst_pages=(3, 4, 5, 9), prefix=0,
                                   state={"conv": (0, 1), "ssm": (2,)}, aux_slot=1)
    base.update(kw)
    return RoomRequest(**base)  # type: ignore[arg-type]


def test_valid_request() -> None:
    _req().validate(LAYOUT)
    _req(dst_pages=(), state={}, prefix=0).validate(LAYOUT)
    _req(dst_pages=(0, 63), prefix=2, aux_slot=3).validate(LAYOUT)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"dst_pages": (3, 64)}, "destination page 64"),
        ({"dst_pages": (-1, 3)}, "destination page -1"),
        ({"dst_pages": (3, 4, 3)}, "destination page 3 listed twice"),
        ({"state": {"conv": (8,)}}, "conv state slot 8"),
        ({"state": {"ssm": (-2,)}}, "ssm state slot -2"),
        ({"state": {"ssm": (1, 5, 1)}}, "ssm state slot 1 listed twice"),
        ({"state": {"mamba": (1,)}}, "unknown state component 'mamba'"),
        ({"aux_slot": 4}, "aux slot 4"),
        ({"aux_slot": -1}, "aux slot -1"),
        ({"prefix": 5}, "prefix_pages 5"),
        ({"prefix": -1}, "prefix_pages -1"),
    ],
)
def test_invalid_request(kw: dict[str, object], needle: str) -> None:
    with pytest.raises(BadRequest, match=needle) as info:
        _req(**kw).validate(LAYOUT)
    assert "room 7" in str(info.value)


# -- run_ends ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("rows", "ends"),
    [
        ((), []),
        ((5,), [1]),
        ((3, 4, 5, 9, 10, 2), [3, 3, 3, 5, 5, 6]),
        ((1, 3, 5), [1, 2, 3]),
        ((7, 6, 5), [1, 2, 3]),
        ((0, 1, 2, 3), [4, 4, 4, 4]),
    ],
)
def test_run_ends(rows: tuple[int, ...], ends: list[int]) -> None:
    assert run_ends(rows).tolist() == ends


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=30))
def test_run_ends_property(rows: list[int]) -> None:
    ends = run_ends(tuple(rows)).tolist()
    for i, e in enumerate(ends):
        assert i < e <= len(rows)
        assert rows[i:e] == list(range(rows[i], rows[i] + e - i))
        if e < len(rows):
            assert rows[e] != rows[e - 1] + 1  # maximal run


# -- CoverageTracker ---------------------------------------------------------------------

REQ = RoomRequest(room=11, group="g", dst_pages=(10, 11, 12, 20, 21, 30, 31, 32, 33, 40), prefix=2,
                  state={"conv": (3, 4), "ssm": (5, 7, 6)}, aux_slot=2)


def _frames(layout: PoolLayout, cp_size: int, split: SplitMode, req: RoomRequest) -> list[tuple[int, int, int, int, int]]:
    """Every (rank, kind, buffer, pos, count) frame that covers the room exactly once, one row each."""
    out = []
    for p in group_plans(layout, cp_size, split, len(req.dst_pages), req.prefix):
        for b in p.kv_buffers:
            out += [(p.rank, KV, b, pos, 1) for pos in range(*p.kv_range)]
        for b in p.state_buffers:
            n = len(req.state.get(layout.buffers[b].component, ()))
            out += [(p.rank, STATE, b, pos, 1) for pos in range(n)]
        if p.aux:
            out.append((p.rank, AUX, layout.aux_index, 0, 1))
    return out


@pytest.mark.parametrize("split", list(SplitMode))
@pytest.mark.parametrize("cp_size", [1, 3, 8])
def test_full_coverage_completes(split: SplitMode, cp_size: int) -> None:
    tr = CoverageTracker(LAYOUT, cp_size, split, REQ)
    frames = _frames(LAYOUT, cp_size, split, REQ)
    kv_positions = len(REQ.dst_pages) - REQ.prefix
    assert len(frames) == 8 * kv_positions + 2 * 2 + 3 * 3 + 1
    assert not tr.started
    for f in frames:
        rank, kind, buf, pos, count = f
        first, rows = tr.accept(*f)
        if kind == KV:
            assert (first, rows) == (REQ.dst_pages[pos], None)
        elif kind == STATE:
            comp = LAYOUT.buffers[buf].component
            assert (first, rows) == (REQ.state[comp][pos], None)
        else:
            assert (first, rows) == (REQ.aux_slot, None)
        assert not tr.complete
    assert tr.started
    for r in range(cp_size - 1):
        assert tr.rank_done(r) is None
        assert not tr.complete
    assert tr.rank_done(cp_size - 1) is None
    assert tr.complete
    assert tr.kv_got[:, REQ.prefix:].all() and not tr.kv_got[:, :REQ.prefix].any()
    assert tr.aux_got
    exp = tr.expected_bytes
    assert exp["kv"] == kv_positions * LAYOUT.kv_page_bytes()
    assert exp["state"] == 2 * 2 * (3 * 4 * 2) + 3 * 3 * (5 * 4)
    assert exp["aux"] == LAYOUT.aux_row_bytes


@settings(max_examples=100, deadline=None)
@given(
    split=st.sampled_from(list(SplitMode)),
    cp_size=st.integers(1, 6),
    n=st.integers(0, 12),
    prefix_frac=st.floats(0, 1),
    seed=st.randoms(use_true_random=False),
)
def test_coverage_any_order_completes_and_replays_are_duplicates(
    split: SplitMode, cp_size: int, n: int, prefix_frac: float, seed: object
) -> None:
    prefix = int(n * prefix_frac)
    req = RoomRequest(room=1, group="g", dst_pages=tuple(range(40, 40 + n)), prefix=prefix,
                      state={"conv": (0, 1, 2), "ssm": (4,)}, aux_slot=0)
    tr = CoverageTracker(LAYOUT, cp_size, split, req)
    frames = _frames(LAYOUT, cp_size, split, req)
    seed.shuffle(frames)  # type: ignore[attr-defined]
    for f in frames:
        tr.accept(*f)
    for f in frames[:3]:
        with pytest.raises(Refused) as info:
            tr.accept(*f)
        assert info.value.code == "duplicate"
    assert [tr.rank_done(r) for r in range(cp_size)] == [None] * cp_size
    assert tr.complete


@pytest.mark.parametrize("split", list(SplitMode))
def test_rooms_sharing_a_shape_keep_their_own_counts(split: SplitMode) -> None:
    """The receiver builds one TrackerShape per plan list and every room with those plans starts
    from it: what one room receives, and its own state rows, never reach another's tracker."""
    plans = group_plans(LAYOUT, 3, split, len(REQ.dst_pages), REQ.prefix)
    shape = TrackerShape(LAYOUT, plans)
    bare = RoomRequest(room=2, group="g", dst_pages=REQ.dst_pages, prefix=REQ.prefix, state={}, aux_slot=1)
    a = CoverageTracker(LAYOUT, 3, split, REQ, shape=shape)
    b = CoverageTracker(LAYOUT, 3, split, bare, shape=shape)
    fresh = CoverageTracker(LAYOUT, 3, split, REQ)  # its own shape, as without the cache
    assert a.remaining == fresh.remaining and a.expected_bytes == fresh.expected_bytes
    assert b.expected_bytes["state"] == 0 and b.expected_bytes["kv"] == a.expected_bytes["kv"]
    for f in _frames(LAYOUT, 3, split, REQ):
        a.accept(*f)
    assert [a.rank_done(r) for r in range(3)] == [None] * 3 and a.complete
    assert shape.remaining == CoverageTracker(LAYOUT, 3, split, bare).remaining  # the shape is unchanged
    assert not b.kv_got.any() and not b.aux_got and not b.done
    # a room without state rows refuses a state frame; the shared empty rows cannot be written
    st_frame = next(f for f in _frames(LAYOUT, 3, split, REQ) if f[1] == STATE)
    with pytest.raises(Refused):
        b.accept(*st_frame)
    assert all(not v.flags.writeable for v in b.state_dst.values())
    for f in _frames(LAYOUT, 3, split, bare):
        b.accept(*f)
    assert [b.rank_done(r) for r in range(3)] == [None] * 3 and b.complete


def test_multi_row_frames_contiguous_and_scattered_destinations() -> None:
    tr = CoverageTracker(LAYOUT, 1, SplitMode.PAGES, REQ)
    # positions 2..4 map to pages 12, 20, 21: not consecutive -> index array
    first, rows = tr.accept(0, KV, 0, 2, 3)
    assert first == -1
    assert rows is not None and rows.tolist() == [12, 20, 21]
    # positions 5..8 map to 30..33: one contiguous run
    assert tr.accept(0, KV, 0, 5, 4) == (30, None)
    # position 9 alone
    assert tr.accept(0, KV, 0, 9, 1) == (40, None)
    # state: ssm slots (5, 7, 6) are not consecutive; conv (3, 4) are
    first, rows = tr.accept(0, STATE, 10, 0, 3)
    assert first == -1 and rows is not None and rows.tolist() == [5, 7, 6]
    assert tr.accept(0, STATE, 8, 0, 2) == (3, None)
    first, rows = tr.accept(0, STATE, 11, 1, 2)
    assert first == -1 and rows is not None and rows.tolist() == [7, 6]
    assert tr.accept(0, STATE, 11, 0, 1) == (5, None)


def test_duplicate_overlapping_range() -> None:
    tr = CoverageTracker(LAYOUT, 1, SplitMode.PAGES, REQ)
    tr.accept(0, KV, 3, 4, 2)
    with pytest.raises(Refused, match="position 5") as info:
        tr.accept(0, KV, 3, 5, 3)
    assert info.value.code == "duplicate"
    # the refused frame marked nothing: positions 6, 7 are still accepted
    tr.accept(0, KV, 3, 6, 2)
    tr.accept(0, STATE, 9, 0, 2)
    with pytest.raises(Refused) as info:
        tr.accept(0, STATE, 9, 1, 1)
    assert info.value.code == "duplicate"
    tr.accept(0, AUX, LAYOUT.aux_index, 0, 1)
    with pytest.raises(Refused) as info:
        tr.accept(0, AUX, LAYOUT.aux_index, 0, 1)
    assert info.value.code == "duplicate"


def test_unexpected_frames_pages_mode() -> None:
    # n = 10, prefix 2, cp 3: rank 0 -> [2, 4), rank 1 -> [4, 7), rank 2 -> [7, 10)
    tr = CoverageTracker(LAYOUT, 3, SplitMode.PAGES, REQ)
    assert [p.kv_range for p in tr.plans] == [(2, 4), (4, 7), (7, 10)]
    cases = [
        (0, KV, 0, 0, 1),     # prefix position
        (0, KV, 0, 1, 2),     # straddles the prefix
        (0, KV, 0, 3, 2),     # runs into rank 1's slice
        (1, KV, 0, 7, 1),     # rank 2's position
        (2, KV, 0, 9, 2),     # past the room
        (1, KV, 8, 4, 1),     # a state buffer sent as KV
        (1, KV, 13, 4, 1),    # aux buffer as KV
        (1, STATE, 8, 0, 1),  # rank 1 does not send replicated state (the de-dup)
        (0, STATE, 3, 0, 1),  # a KV buffer sent as state
        (0, STATE, 8, 1, 2),  # conv has 2 slots in this room
        (1, AUX, 13, 0, 1),   # aux from rank 1
        (0, AUX, 12, 0, 1),   # wrong aux buffer
        (0, AUX, 13, 1, 1),   # aux pos must be 0
        (0, AUX, 13, 0, 2),   # aux count must be 1
    ]
    for f in cases:
        with pytest.raises(Refused) as info:
            tr.accept(*f)
        assert info.value.code == "unexpected", f
    assert not tr.started
    assert not tr.kv_got.any() and not any(v.any() for v in tr.state_got.values())


def test_unexpected_frames_layers_mode() -> None:
    tr = CoverageTracker(LAYOUT, 2, SplitMode.LAYERS, REQ)
    # rank 0 owns KV layers 0-1 (buffers 0-3), conv L0 (8), ssm L0-L1 (10, 11)
    tr.accept(0, KV, 3, 2, 8)
    tr.accept(1, KV, 4, 2, 8)
    tr.accept(1, STATE, 9, 0, 2)
    for f in [(0, KV, 4, 2, 1), (1, KV, 0, 2, 1), (1, STATE, 8, 0, 1), (0, STATE, 12, 0, 1)]:
        with pytest.raises(Refused) as info:
            tr.accept(*f)
        assert info.value.code == "unexpected", f


def test_rank0_mode_other_ranks_send_nothing() -> None:
    tr = CoverageTracker(LAYOUT, 4, SplitMode.RANK0, REQ)
    for r in (1, 2, 3):
        with pytest.raises(Refused) as info:
            tr.accept(r, KV, 0, 5, 1)
        assert info.value.code == "unexpected"
        assert tr.rank_done(r) is None  # nothing was planned for them
    assert not tr.complete


def test_data_after_done_refused() -> None:
    tr = CoverageTracker(LAYOUT, 2, SplitMode.PAGES, REQ)
    assert tr.rank_done(1) is not None  # incomplete, but it is recorded as done
    with pytest.raises(Refused) as info:
        tr.accept(1, KV, 0, 6, 1)
    assert info.value.code == "after_done"


def test_rank_done_with_missing_rows_names_them() -> None:
    tr = CoverageTracker(LAYOUT, 2, SplitMode.PAGES, REQ)
    # n = 10, prefix 2, cp 2: rank 1 -> [5, 10) of 8 KV buffers = 40 rows, no state, no aux
    assert tr.plans[1].kv_range == (5, 10)
    for b in range(8):
        tr.accept(1, KV, b, 5, 4)  # leaves position 9 of every buffer out
    reason = tr.rank_done(1)
    assert reason is not None
    assert "rank 1" in reason and "8 planned rows" in reason
    # rank 0 ([2, 5)) sends nothing at all: 8 * 3 KV rows + 2 * 2 conv + 3 * 3 ssm + 1 aux
    reason0 = tr.rank_done(0)
    assert reason0 is not None and f"{8 * 3 + 4 + 9 + 1} planned rows" in reason0
    assert not tr.complete


def test_rank_done_twice() -> None:
    tr = CoverageTracker(LAYOUT, 1, SplitMode.PAGES, RoomRequest(1, "g", (), 0, {}, 0))
    tr.accept(0, AUX, LAYOUT.aux_index, 0, 1)
    assert tr.rank_done(0) is None
    assert tr.complete
    reason = tr.rank_done(0)
    assert reason is not None and "twice" in reason


def test_incomplete_without_all_done() -> None:
    tr = CoverageTracker(LAYOUT, 3, SplitMode.PAGES, REQ)
    for f in _frames(LAYOUT, 3, SplitMode.PAGES, REQ):
        tr.accept(*f)
    assert tr.rank_done(0) is None and tr.rank_done(2) is None
    assert not tr.complete
    assert tr.rank_done(1) is None
    assert tr.complete


def test_tracker_remaining_per_rank() -> None:
    tr = CoverageTracker(LAYOUT, 3, SplitMode.PAGES, REQ)
    # rank 0: 2 positions × 8 KV + conv 2×2 + ssm 3×3 + aux; ranks 1, 2: 3 positions × 8
    assert tr.remaining == [16 + 4 + 9 + 1, 24, 24]
    assert tr.cp_size == 3


def test_all_frame_orders_small_room() -> None:
    """Exhaustive over orders of a tiny room: completion never depends on arrival order."""
    layout = ModelSpec(kv_layers=1, kv_format="mla", page_size=1, kv_token_elems=1, aux_row_bytes=8).layout(4, 0, 1)
    req = RoomRequest(5, "g", (3, 1, 2), 0, {}, 0)
    frames = _frames(layout, 2, SplitMode.PAGES, req)
    assert len(frames) == 4
    for order in itertools.permutations(frames):
        tr = CoverageTracker(layout, 2, SplitMode.PAGES, req)
        for f in order:
            tr.accept(*f)
        assert tr.rank_done(0) is None and tr.rank_done(1) is None and tr.complete
        assert np.array_equal(tr.dst, np.array([3, 1, 2]))


def test_tracker_with_dedup_off_takes_the_state_once_from_every_rank() -> None:
    from transferd.protocol.policy import group_plans as plans_of

    layout = LAYOUT
    req = RoomRequest(room=7, group="g", dst_pages=tuple(range(6)), prefix=0,
                      state={c: (0,) for c in layout.state_components}, aux_slot=0)
    plans = plans_of(layout, 2, SplitMode.PAGES, 6, 0, dedup=False)
    tr = CoverageTracker(layout, 2, SplitMode.PAGES, req, TrackerShape(layout, plans))
    st = layout.indices("state")
    assert tr.expected_bytes["state"] == 2 * sum(layout.buffers[b].row_bytes for b in st)
    for rank in (0, 1):
        for b in st:
            tr.accept(rank, 1, b, 0, 1)
    with pytest.raises(Refused) as err:
        tr.accept(1, 1, st[0], 0, 1)  # the same rank twice is still a duplicate
    assert err.value.code == "duplicate"
