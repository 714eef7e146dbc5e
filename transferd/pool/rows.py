"""Copies of rows into a pool buffer."""

from __future__ import annotations

import numpy as np

from ..protocol.room import runs


def copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """``dst[dst_rows] = src[src_rows]`` in one pass over the bytes: one block copy per run of
    rows consecutive on both sides (a fancy-index assignment gathers into a temporary first)."""
    for a, b in runs(src_rows, dst_rows):
        d, s = int(dst_rows[a]), int(src_rows[a])
        dst[d:d + b - a] = src[s:s + b - a]
