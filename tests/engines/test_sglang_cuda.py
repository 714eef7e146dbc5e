"""The CP4 → decode scenario of test_sglang_backend.py with the engines' KV in CUDA memory: the
staging copies run on a CUDA stream between device tensors and the page-locked pool.

Runs only where torch sees a GPU (``scripts/gpu_check.sh`` runs it on a GPU machine); elsewhere
every test here is skipped, and the reason says so.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from tests.engines.conftest import require_sglang

require_sglang()

import torch  # noqa: E402

from tests.engines.test_sglang_backend import cp4_scenario  # noqa: E402
from tests.integration.harness import Cluster  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the CUDA staging path runs on a GPU machine "
                                       "(scripts/gpu_check.sh); the same scenario runs on CPU tensors in "
                                       "test_sglang_backend.py")


def test_cp4_prefill_to_decode_with_cuda_tensors(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA cannot be used in a child forked after the parent touched it: the prefill ranks are spawned
    cp4_scenario(cluster, monkeypatch, "cuda", multiprocessing.get_context("spawn"))


def test_cuda_staging_bandwidth() -> None:
    """Gather (device → pinned pool) and scatter (pool → device) of 256 MiB in 1 MiB pages: printed."""
    from transferd.engines.sglang.kvmap import EngineBuffer, EngineMap, Pair
    from transferd.engines.sglang.staging import Staging
    from transferd.layout import ModelSpec
    from transferd.pool.shm import Pool

    pages, item = 256, 1 << 20
    layout = ModelSpec(dtype="uint8", page_size=1, kv_layers=1, kv_format="mla", kv_token_elems=item).layout(pages, 0, 1)
    pool = Pool.create(f"gpucheck-{time.monotonic_ns()}", layout)
    try:
        src = torch.randint(0, 256, (pages, item), dtype=torch.uint8, device="cuda")
        emap = EngineMap(1, (Pair(EngineBuffer(src.data_ptr(), src.numel(), item), layout.indices("kv")[0]),), (), (),
                         layout.aux_index, layout.aux_row_bytes)
        st = Staging(pool, emap, "cuda")
        rows = list(range(pages))
        for what, fn in (("gather", lambda: st.gather(rows, None, None, 0)), ("scatter", lambda: st.scatter(rows, None, None))):
            fn()
            t0 = time.perf_counter()
            moved = fn()
            dt = time.perf_counter() - t0
            print(f"CUDA staging {what}: {moved / dt / 1e9:.1f} GB/s ({moved >> 20} MiB)")
        assert torch.equal(torch.from_numpy(pool.rows[layout.indices("kv")[0]]).cuda(), src)
        st.close()
    finally:
        pool.close()
        pool.unlink()
