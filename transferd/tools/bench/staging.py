"""The SGLang backend's staging copies, measured beside memcpy: the prefill gather (engine buffers →
pool) and the decode scatter (pool → engine buffers) that ``transferd.engines.sglang.staging`` runs
for every room, over CPU torch tensors standing for the engine's KV. Paired in the bench's rounds
with ``memcpy/1MiB`` (numpy's copy of the same bytes between two pool buffers).

Needs torch (the ``sglang`` extra); without it the subjects are not listed and the report says so.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import numpy as np

from ...layout import ModelSpec
from ...pool.shm import Pool

PAGE_BYTES = 1 << 20  # one 1 MiB row per page: the 1MiB column of the bench
LAYERS = 4


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


class StagingBench:
    """An engine of ``LAYERS`` KV buffers (CPU tensors) and a pool that mirrors it; the pages of one
    round are scattered over the engine (every other page), as a real request's pages are."""

    def __init__(self, total_bytes: int, tag: str) -> None:
        import torch

        from ...engines.sglang.kvmap import EngineBuffer, EngineMap, Pair
        from ...engines.sglang.staging import Staging

        pages = max(2, total_bytes // (PAGE_BYTES * LAYERS))
        rows = 2 * pages
        layout = ModelSpec(name="staging", dtype="uint8", page_size=1, kv_layers=LAYERS, kv_format="mla",
                           kv_token_elems=PAGE_BYTES).layout(rows, 0, 1)
        self.pool = Pool.create(f"{tag}-staging", layout)
        self.engine = [torch.randint(0, 256, (rows, PAGE_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
        kv = tuple(Pair(EngineBuffer(t.data_ptr(), t.numel(), PAGE_BYTES), b)
                   for t, b in zip(self.engine, layout.indices("kv")))
        self.staging = Staging(self.pool, EngineMap(1, kv, (), (), layout.aux_index, layout.aux_row_bytes), "cpu")
        self.pages = np.arange(0, rows, 2)
        self.mismatched = 0

    def gather(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        moved = self.staging.gather(self.pages, None, None, 0)
        dt = time.perf_counter() - t0
        buf = self.pool.layout.indices("kv")[0]
        p = int(self.pages[-1])
        if not np.array_equal(self.pool.rows[buf][p], self.engine[0][p].numpy()):
            self.mismatched += PAGE_BYTES
        return {"gbps": moved / dt / 1e9}

    def scatter(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        moved = self.staging.scatter(self.pages, None, None)
        dt = time.perf_counter() - t0
        return {"gbps": moved / dt / 1e9}

    def close(self) -> None:
        self.staging.close()
        self.pool.close()
        self.pool.unlink()
