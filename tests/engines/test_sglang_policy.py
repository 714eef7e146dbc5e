"""transferd's who-sends-what policy agrees with SGLang 0.5.23's own functions, over a grid.

SGLang's CP page split (``_get_cp_rank_page_bounds``), its per-chunk CP filter
(``filter_kv_indices_for_cp_rank``) and its replicated-state skip rule
(``CommonKVManager._should_skip_cp_replicated_state_transfer``) are called as SGLang calls them,
for cp 1–8, 0–200 pages, every rank, layer split on and off, and compared with
``transferd.protocol.policy``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from tests.engines.conftest import require_sglang
from transferd.layout import ModelSpec, StateComponent
from transferd.protocol.policy import contiguous_slice, rank_plan, skips_replicated_state
from transferd.types import SplitMode

require_sglang()

from sglang.srt.disaggregation.common.conn import CommonKVManager  # noqa: E402
from sglang.srt.disaggregation.utils import _get_cp_rank_page_bounds, filter_kv_indices_for_cp_rank  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

LAYOUT = ModelSpec(page_size=4, kv_layers=4, kv_token_elems=8,
                   state=(StateComponent("swa", 4, (16,), "uint8"),)).layout(256, 8, 8)


def test_page_split_matches_sglang() -> None:
    checked = 0
    for cp in range(1, 9):
        for total in range(201):
            for rank in range(cp):
                assert contiguous_slice(total, cp, rank) == _get_cp_rank_page_bounds(total, rank, cp), (cp, total, rank)
                # transferd's plan for the room (no prefix) covers exactly SGLang's bounds
                lo, hi = _get_cp_rank_page_bounds(total, rank, cp)
                plan = rank_plan(LAYOUT, cp, rank, SplitMode.PAGES, total)
                assert set(range(*plan.kv_range)) == set(range(lo, hi)), (cp, total, rank)
                checked += 1
    assert checked == 201 * 36


def test_chunk_filter_matches_sglang() -> None:
    """Chunk by chunk, the positions a rank sends are the ones SGLang's CP filter keeps."""
    for cp in range(1, 9):
        for total in range(0, 201, 3):
            for chunk in (1, 5, 16, 64):
                for rank in range(cp):
                    mgr = SimpleNamespace(attn_cp_rank=rank, attn_cp_size=cp)
                    plan = rank_plan(LAYOUT, cp, rank, SplitMode.PAGES, total)
                    for start in range(0, max(total, 1), chunk):
                        end = min(start + chunk, total)
                        pages = np.arange(1000 + start, 1000 + end)
                        kept, sl = filter_kv_indices_for_cp_rank(mgr, pages, slice(start, end), total_pages=total)
                        lo, hi = plan.chunk_range(start, end)
                        assert list(range(sl.start, sl.stop)) == list(range(lo, hi)), (cp, total, chunk, rank, start)
                        assert kept.tolist() == pages[lo - start:hi - start].tolist()


def test_replicated_state_skip_matches_sglang() -> None:
    mgr = object.__new__(CommonKVManager)  # as SGLang's own CPU tests build one: no sockets, no threads
    for layer_split in (False, True):
        split = SplitMode.LAYERS if layer_split else SplitMode.PAGES
        with get_parallel().override(enable_dsa_cache_layer_split=layer_split, enable_cp_tp_group_sharing=False):
            for cp in range(1, 9):
                for rank in range(cp):
                    mgr.attn_cp_size, mgr.attn_cp_rank, mgr.kv_shard_size = cp, rank, 1
                    theirs = mgr._should_skip_cp_replicated_state_transfer()
                    assert skips_replicated_state(cp, rank, split) == theirs, (layer_split, cp, rank)
                    plan = rank_plan(LAYOUT, cp, rank, split, 10)
                    if theirs:  # skipped: the rank sends no state and counts all of it as skipped
                        assert plan.state_buffers == () and plan.state_skipped == LAYOUT.indices("state")
                    elif not layer_split:  # rank 0 (or cp 1) sends all of it
                        assert plan.state_buffers == LAYOUT.indices("state")
                    else:  # layer split: each rank sends the state layers it owns, together all of them once
                        owned = [LAYOUT.buffers[i].layer for i in plan.state_buffers]
                        assert owned == list(range(*contiguous_slice(4, cp, rank)))
