"""The copies between the engine's buffers and the transferd pool: gathered on prefill before
``submit``, scattered on decode after Success and before ``poll()`` reports it.

One code path for CPU and CUDA: torch views over the raw addresses ``KVArgs`` gives (a
``__cuda_array_interface__`` on CUDA, a ctypes array on the CPU), copied run by run (a run is a
stretch of consecutive rows, moved as one block). On CUDA the pool is page-locked with
``cudaHostRegister`` and the copies are asynchronous on a stream of their own, which first waits
for the engine's current stream (the KV it just wrote) and is synchronized before the daemon is
told (prefill) or the engine is (decode).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import IndexOutOfRange
from ...pool.shm import Pool
from ...protocol.room import runs
from .kvmap import AUX_GUARD_BYTES, EngineBuffer, EngineMap

torch: Any
try:
    import torch
except ImportError:  # the backend needs torch; the daemon does not
    torch = None


def _require_torch() -> Any:
    if torch is None:
        raise ImportError("transferd's SGLang backend needs torch (pip install 'transferd[sglang]')")
    return torch


class _CudaArray:
    """A raw device address made a torch tensor without a copy."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def engine_rows(buf: EngineBuffer, device: Any) -> Any:
    """A ``uint8 [rows, item_bytes]`` view of one engine buffer (memory stays the engine's)."""
    t = _require_torch()
    n = buf.rows * buf.item_bytes
    if n == 0:
        return t.empty((0, buf.item_bytes), dtype=t.uint8, device=device)
    if device.type == "cuda":
        flat = t.as_tensor(_CudaArray(buf.ptr, n), device=device)
    else:
        flat = t.frombuffer((ctypes.c_uint8 * n).from_address(buf.ptr), dtype=t.uint8)
    return flat.view(buf.rows, buf.item_bytes)


class Staging:
    """Copies rows between one engine's buffers and the pool that mirrors them (row ``r`` ↔ row ``r``)."""

    def __init__(self, pool: Pool, emap: EngineMap, device: str) -> None:
        t = _require_torch()
        self.pool = pool
        self.emap = emap
        self.device = t.device(device)
        self.cuda = self.device.type == "cuda"
        self._registered: list[int] = []
        self.stream = None
        if self.cuda:
            # page-lock the pool so device copies are DMA and may run asynchronously
            base = np.frombuffer(pool._mm, dtype=np.uint8)
            ptr, size = base.ctypes.data, base.nbytes
            err = t.cuda.cudart().cudaHostRegister(ptr, size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of pool {pool.name!r} ({size} bytes) failed: error {int(err)}")
            self._registered.append(ptr)
            self.stream = t.cuda.Stream(device=self.device)
        prow = [t.from_numpy(r) for r in pool.rows]
        self.kv = [(engine_rows(p.engine, self.device), prow[p.pool_buffer]) for p in emap.kv]
        self.kv_buffers = [p.pool_buffer for p in emap.kv]
        self.state = [[(engine_rows(p.engine, self.device), prow[p.pool_buffer]) for p in g.pairs]
                      for g in emap.state]
        self.state_buffers = [[p.pool_buffer for p in g.pairs] for g in emap.state]
        self.aux_pool = prow[emap.aux_buffer]
        self.aux = [(f.offset, f.engine.item_bytes, engine_rows(f.engine, self.device)) for f in emap.aux]
        self.kv_rows = min((e.shape[0] for e, _ in self.kv), default=0)

    # -- the copies ----------------------------------------------------------------------
    def _copy(self, pairs: list[tuple[Any, Any]], rows: Sequence[int] | np.ndarray, to_pool: bool) -> int:
        arr = np.asarray(rows, dtype=np.int64)
        # engine row r is pool row r: a run of consecutive rows is one block on both sides
        blocks = [(int(arr[a]), b - a) for a, b in runs(arr, arr)]
        moved = 0
        for eng, pool in pairs:
            limit = min(eng.shape[0], pool.shape[0])
            for first, n in blocks:
                if first < 0 or first + n > limit:
                    raise IndexOutOfRange(f"rows {first}..{first + n - 1} lie outside the engine buffer of {limit} rows")
                if to_pool:
                    pool[first:first + n].copy_(eng[first:first + n], non_blocking=self.cuda)
                else:
                    eng[first:first + n].copy_(pool[first:first + n], non_blocking=self.cuda)
                moved += n * eng.shape[1]
        return moved

    def _run(self, fn: Any) -> int:
        if not self.cuda:
            return int(fn())
        t = _require_torch()
        assert self.stream is not None
        self.stream.wait_stream(t.cuda.current_stream(self.device))
        with t.cuda.stream(self.stream):
            moved = fn()
        self.stream.synchronize()
        return int(moved)

    def gather(self, pages: Sequence[int] | np.ndarray, state: Sequence[Sequence[int] | None] | None,
               aux_row: int | None, room: int, only: frozenset[int] | None = None) -> int:
        """Prefill: engine → pool for these pages, state slots (per state type) and aux row,
        for the pool buffers in ``only`` (None: all); synchronized on return. Returns bytes copied."""
        def work() -> int:
            kv = [p for p, b in zip(self.kv, self.kv_buffers) if only is None or b in only]
            moved = self._copy(kv, pages, True) if len(pages) else 0
            for pairs, bufs, slots in zip(self.state, self.state_buffers, state or ()):
                if slots is not None and len(slots):
                    mine = [p for p, b in zip(pairs, bufs) if only is None or b in only]
                    moved += self._copy(mine, slots, True)
            if aux_row is not None:
                moved += self._aux_to_pool(aux_row, room)
            return moved
        return self._run(work)

    def scatter(self, pages: Sequence[int] | np.ndarray, state: Sequence[Sequence[int] | None] | None,
                aux_row: int | None) -> int:
        """Decode: pool → engine for these pages, state slots and aux row; synchronized on return."""
        def work() -> int:
            moved = self._copy(self.kv, pages, False)
            for pairs, slots in zip(self.state, state or ()):
                if slots is not None and len(slots):
                    moved += self._copy(pairs, slots, False)
            if aux_row is not None:
                for off, n, eng in self.aux:
                    eng[aux_row].copy_(self.aux_pool[aux_row, off:off + n], non_blocking=self.cuda)
                    moved += n
            return moved
        return self._run(work)

    def _aux_to_pool(self, row: int, room: int) -> int:
        t = _require_torch()
        dst = self.aux_pool[row]
        dst[:AUX_GUARD_BYTES].copy_(t.frombuffer(bytearray(room.to_bytes(8, "little")), dtype=t.uint8))
        moved = AUX_GUARD_BYTES
        for off, n, eng in self.aux:
            dst[off:off + n].copy_(eng[row], non_blocking=self.cuda)
            moved += n
        return moved

    def close(self) -> None:
        if self._registered:
            t = _require_torch()
            for ptr in self._registered:
                t.cuda.cudart().cudaHostUnregister(ptr)
            self._registered.clear()
