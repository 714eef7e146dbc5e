"""copy_rows: the receiver's one-pass row copy for same-host data-refs."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from transferd.pool.rows import copy_rows


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_copy_rows_equals_fancy_indexing(data: st.DataObject) -> None:
    n_src, n_dst = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 24))
    k = data.draw(st.integers(1, min(n_src, n_dst)))
    src_rows = np.asarray(data.draw(st.lists(st.integers(0, n_src - 1), min_size=k, max_size=k)), np.int64)
    dst_rows = np.asarray(data.draw(st.permutations(range(n_dst)))[:k], np.int64)  # destinations are unique
    rng = np.random.default_rng(k)
    src = rng.integers(0, 255, (n_src, 16), dtype=np.uint8)
    dst = rng.integers(0, 255, (n_dst, 16), dtype=np.uint8)
    want = dst.copy()
    want[dst_rows] = src[src_rows]
    copy_rows(dst, dst_rows, src, src_rows)
    assert np.array_equal(dst, want)
