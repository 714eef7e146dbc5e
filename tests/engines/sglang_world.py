"""A small SGLang world for the backend tests: the KV and state an SGLang scheduler would hold, as
CPU tensors, described to the backend with SGLang's own ``KVArgs``, and "scheduler-like" prefill
processes that drive SGLang's sender interface exactly as its prefill event loop does (poll until
WaitingForInput, ``init``, ``send`` per chunk with the last chunk's state, poll until Success).

Every byte is a pure function of (rank, buffer, row), so the decode side knows what must arrive
without seeing the prefill processes' memory.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PAGE = 4  # tokens per page
LAYERS = 2
HEADS, HEAD_DIM = 2, 16  # bf16: one page of one layer's K is 4 × 2 × 16 × 2 = 256 bytes
KV_ITEM = PAGE * HEADS * HEAD_DIM * 2
ENGINE_PAGES = 64
MAMBA_ITEMS = (96, 160, 96, 160)  # conv, temporal, conv, temporal: two sizes -> two components
SWA_ITEM = 128
STATE_ROWS = 16
AUX_ITEMS = (64, 8, 16)  # output ids, bootstrap room, cached tokens (SGLang pads rows to >= 64 bytes on RDMA)
AUX_ROWS = 16

# what the daemons must be configured with: kvmap.suggest_model() of these KVArgs
MODEL = {
    "name": "sglang-test", "dtype": "bf16", "page_size": PAGE, "kv_layers": LAYERS, "kv_format": "mha",
    "kv_token_elems": HEADS * HEAD_DIM, "aux_row_bytes": 128,
    "state": [{"name": "mamba.0", "layers": 2, "slot_shape": [96], "dtype": "uint8"},
              {"name": "mamba.1", "layers": 2, "slot_shape": [160], "dtype": "uint8"},
              {"name": "swa", "layers": 1, "slot_shape": [128], "dtype": "uint8"}],
}


def content(rank: int, buf: str, row: int, n: int) -> np.ndarray:
    """The bytes a rank's engine holds in ``buf`` at ``row``: a pure function, so the other side can check."""
    seed = (rank * 1_000_003 + sum(map(ord, buf)) * 7919 + row) & 0xFFFFFFFF
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@dataclass
class Engine:
    """One rank's engine memory: CPU tensors, and SGLang's KVArgs pointing at them."""

    kv: list[Any]
    mamba: list[Any]
    swa: list[Any]
    aux: list[Any]
    kv_args: Any = None
    names: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, fill_rank: int | None, device: str = "cpu") -> Engine:
        import torch
        from sglang.srt.disaggregation.base.conn import KVArgs, StateType

        def buf(rows: int, item: int, name: str) -> Any:
            t = torch.zeros((rows, item), dtype=torch.uint8)
            if fill_rank is not None:
                for r in range(rows):
                    t[r] = torch.from_numpy(content(fill_rank, name, r, item))
            return t.to(device)

        kv = [buf(ENGINE_PAGES, KV_ITEM, f"k{layer}") for layer in range(LAYERS)] + \
             [buf(ENGINE_PAGES, KV_ITEM, f"v{layer}") for layer in range(LAYERS)]
        mamba = [buf(STATE_ROWS, n, f"mamba{j}") for j, n in enumerate(MAMBA_ITEMS)]
        swa = [buf(ENGINE_PAGES, SWA_ITEM, "swa")]
        aux = [buf(AUX_ROWS, n, f"aux{j}") for j, n in enumerate(AUX_ITEMS)]
        e = cls(kv, mamba, swa, aux)
        a = KVArgs()
        a.engine_rank = 0
        a.kv_data_ptrs = [t.data_ptr() for t in kv]
        a.kv_data_lens = [t.numel() for t in kv]
        a.kv_item_lens = [KV_ITEM] * len(kv)
        a.kv_layer_ids = list(range(LAYERS)) * 2
        a.kv_cache_dtype_str = "bfloat16"
        a.page_size = PAGE
        a.aux_data_ptrs = [t.data_ptr() for t in aux]
        a.aux_data_lens = [t.numel() for t in aux]
        a.aux_item_lens = list(AUX_ITEMS)
        a.state_types = [StateType.MAMBA, StateType.SWA]
        a.state_data_ptrs = [[t.data_ptr() for t in mamba], [t.data_ptr() for t in swa]]
        a.state_data_lens = [[t.numel() for t in mamba], [t.numel() for t in swa]]
        a.state_item_lens = [list(MAMBA_ITEMS), [SWA_ITEM]]
        a.gpu_id = 0
        a.system_dp_rank = 0
        a.pp_rank = 0
        a.num_draft_entries = 0
        e.kv_args = a
        return e


@dataclass
class Room:
    """One request: its id, pages per chunk (prefill page indices), and its slots."""

    room: int
    chunks: list[list[int]]  # prefill engine page indices, chunk by chunk
    dst_pages: list[int]  # decode engine pages, after the prefix
    prefix_pages: int = 0
    mamba_src: int = 1
    mamba_dst: int = 2
    swa_src: list[int] = field(default_factory=lambda: [5, 6])
    swa_dst: list[int] = field(default_factory=lambda: [9, 10])
    aux_src: int = 3
    aux_dst: int = 4
    stop_after: int | None = None  # prefill sends only this many chunks (abort tests)

    @property
    def src_pages(self) -> list[int]:
        return [p for c in self.chunks for p in c]


def parallel(**values: Any) -> None:
    """Set this process's ranks in SGLang's runtime context, as SGLang's launcher publishes them."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(**values)


def backend_classes() -> tuple[Any, Any, Any]:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    b = TransferBackend("transferd")
    return (get_kv_class(b, KVClassType.MANAGER), get_kv_class(b, KVClassType.SENDER),
            get_kv_class(b, KVClassType.RECEIVER))


def prefill_rank(rank: int, cp_size: int, cfg_path: str, rooms: list[Room], conn: Any, bootstrap: str,
                 device: str = "cpu") -> None:
    """A scheduler-like prefill CP rank (a forked or spawned child): drives SGLang's sender
    interface for every room and reports each room's final KVPoll to the parent over ``conn``."""
    try:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.plugins import load_plugins

        load_plugins()  # what every SGLang scheduler process runs first (a no-op after a fork)
        os.environ["TRANSFERD_CONFIG"] = cfg_path
        parallel(attn_cp_rank=rank, attn_cp_size=cp_size, attn_tp_rank=0, attn_tp_size=1)
        engine = Engine.make(fill_rank=rank, device=device)
        manager_cls, sender_cls, _ = backend_classes()
        mgr = manager_cls(engine.kv_args, DisaggregationMode.PREFILL, None, False)
        conn.send(("ready", rank))
        for room in rooms:
            sender = sender_cls(mgr, bootstrap, room.room)
            assert sender.poll() == KVPoll.WaitingForInput
            sender.init(len(room.src_pages), room.aux_src)
            n_chunks = len(room.chunks) if room.stop_after is None else room.stop_after
            for k, chunk in enumerate(room.chunks[:n_chunks]):
                last = k == len(room.chunks) - 1
                state = [np.array([room.mamba_src]), np.array(room.swa_src)] if last else None
                if sender.should_send_kv_chunk(len(chunk), last):
                    sender.send(np.array(chunk, dtype=np.int32), state)
            if room.stop_after is not None:
                conn.send(("partial", room.room))
                cmd = conn.recv()  # the parent aborted the room on decode: now send the rest
                for k, chunk in enumerate(room.chunks[n_chunks:], start=n_chunks):
                    last = k == len(room.chunks) - 1
                    state = [np.array([room.mamba_src]), np.array(room.swa_src)] if last else None
                    sender.send(np.array(chunk, dtype=np.int32), state)
            deadline = time.monotonic() + 60
            while True:
                st = sender.poll()
                if st in (KVPoll.Success, KVPoll.Failed) or time.monotonic() > deadline:
                    break
                # between two polls (a scheduler's forward pass), block on the agent until the
                # room ends or 50 ms pass: an event, not a sleep
                mgr.prefill.wait(room.room, timeout_s=0.05)
            reason = ""
            if st == KVPoll.Failed:
                try:
                    sender.failure_exception()
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
            conn.send(("room", room.room, int(st), reason, sender.get_transfer_metric().transfer_total_bytes))
            sender.clear()
        cmd = conn.recv()
        assert cmd == "exit", cmd
        mgr.close()
        conn.send(("bye", rank))
    except Exception:
        conn.send(("error", rank, traceback.format_exc()))
