"""A room end to end through the SGLang backend, beside the same room through the plain client.

Both move the same rooms (``ROOMS`` rooms of the 1 MiB bulk model: 4 MLA layers of 1 MiB pages)
from one sender daemon of the 1 MiB bulk cluster to its receiver, over TCP:

* ``e2e_backend/sglang``: SGLang's interface on transferd's classes (``TransferdKVSender`` /
  ``TransferdKVReceiver``), with engine KV in CPU tensors: ``send_metadata`` on decode, ``init`` +
  ``send`` on prefill (the gather into the pool included), ``poll()`` until Success (the scatter
  into the decode engine included);
* ``e2e_client/sglang``: the engine API directly (the rows already in the pool), ``expect_many``,
  ``submit``, ``wait_many``.

The ratio is what the backend's staging copies and its polling cost a room. Needs SGLang (its
import takes seconds, paid once at start); without it the subjects are not listed.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ...errors import TransferdError
from .cluster import Cluster, Group, bulk_model

ROOMS = 4
POLL_GAP_S = 0.0005  # between two polls of the rooms, as a scheduler's loop iterations are


def available() -> bool:
    return importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torch") is not None


def _toml(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


class SglangRoomBench:
    def __init__(self, c: Cluster, g: Group, run_dir: Path) -> None:
        import torch
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from ...engines.sglang.conn import TransferdKVManager, TransferdKVReceiver, TransferdKVSender

        self.c, self.g, self.KVPoll = c, g, KVPoll
        self.sender_cls, self.receiver_cls = TransferdKVSender, TransferdKVReceiver
        layout = c.layout
        self.P = c.pages
        rows = self.P * ROOMS
        item = layout.buffers[layout.indices("kv")[0]].row_bytes
        self.src = [torch.randint(0, 256, (rows, item), dtype=torch.uint8) for _ in layout.indices("kv")]
        self.dst = [torch.zeros((rows, item), dtype=torch.uint8) for _ in layout.indices("kv")]
        self.aux_src = torch.randint(0, 256, (ROOMS, layout.aux_row_bytes - 8), dtype=torch.uint8)
        self.aux_dst = torch.zeros_like(self.aux_src)
        model = bulk_model("1MiB")
        base = ["[model]", *[f"{k} = {_toml(v)}" for k, v in model.items()]]
        rcfg = run_dir / "sglang-decode.toml"
        rcfg.write_text("\n".join([*base, "", "[receiver]", f"pool = {_toml(c.cfg.receiver_pool_name())}",
                                   f"engine_socket = {_toml(c.cfg.receiver_engine_socket())}", "",
                                   "[sglang]", f'groups = ["bench:1={g.name}"]', 'device = "cpu"', ""]))
        scfg = run_dir / "sglang-prefill.toml"
        scfg.write_text("\n".join([*base, "", "[sender]", f"group = {_toml(g.name)}",
                                   f"pool = {_toml(g.cfg.sender_pool_name(0))}",
                                   f"engine_socket = {_toml(g.cfg.sender_engine_socket(0))}", "",
                                   "[sglang]", 'device = "cpu"', ""]))

        def args(kv: list[Any], aux: Any) -> Any:
            return SimpleNamespace(
                kv_data_ptrs=[t.data_ptr() for t in kv], kv_data_lens=[t.numel() for t in kv],
                kv_item_lens=[item] * len(kv), kv_cache_dtype_str="bfloat16", page_size=layout.page_size,
                num_draft_entries=0, state_types=[], state_data_ptrs=[], state_data_lens=[], state_item_lens=[],
                aux_data_ptrs=[aux.data_ptr()], aux_data_lens=[aux.numel()], aux_item_lens=[aux.shape[1]], gpu_id=0)

        old = os.environ.get("TRANSFERD_CONFIG")
        try:
            os.environ["TRANSFERD_CONFIG"] = str(scfg)
            self.pm = TransferdKVManager(args(self.src, self.aux_src), DisaggregationMode.PREFILL, None, True)
            os.environ["TRANSFERD_CONFIG"] = str(rcfg)
            self.dm = TransferdKVManager(args(self.dst, self.aux_dst), DisaggregationMode.DECODE, None, True)
        finally:
            if old is None:
                os.environ.pop("TRANSFERD_CONFIG", None)
            else:
                os.environ["TRANSFERD_CONFIG"] = old
        self.room = 1 << 40
        self.mismatched = 0
        self.rooms_failed = 0

    def _pages(self, j: int) -> list[int]:
        return list(range(j * self.P, (j + 1) * self.P))

    def backend(self) -> dict[str, Any]:
        KVPoll = self.KVPoll
        for t in self.dst:
            t[0].fill_(0)
        self.aux_dst.zero_()
        t0 = time.perf_counter()
        recvs, senders = [], []
        for j in range(ROOMS):
            self.room += 1
            r = self.receiver_cls(self.dm, "bench:1", self.room)
            r.init(0)
            r.send_metadata(np.asarray(self._pages(j)), j, [])
            s = self.sender_cls(self.pm, "bench:1", self.room)
            s.init(self.P, j)
            s.send(np.asarray(self._pages(j)), [])
            recvs.append(r)
            senders.append(s)
        pending = list(recvs)
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if r.poll() not in (KVPoll.Success, KVPoll.Failed)]
            if pending:  # a scheduler polls once per loop iteration, between forward passes: not a spin
                time.sleep(POLL_GAP_S)
        dt = time.perf_counter() - t0
        ok = sum(r.poll() == KVPoll.Success for r in recvs)
        self.rooms_failed += ROOMS - ok
        for a, b in zip(self.src, self.dst):
            if not bool((a[0] == b[0]).all()):
                self.mismatched += int(a[0].numel())
        for r, s in zip(recvs, senders):
            r.clear()
            s.clear()
        nbytes = ROOMS * self.P * sum(t[0].numel() for t in self.src)
        return {"gbps": nbytes / dt / 1e9 if ok == ROOMS else None, "seconds": dt}

    def client(self) -> dict[str, Any]:
        c, g = self.c, self.g
        assert c.dc is not None
        pc = self.pm.prefill
        t0 = time.perf_counter()
        rooms = []
        expects = []
        for j in range(ROOMS):
            self.room += 1
            rooms.append(self.room)
            expects.append({"room": self.room, "group": g.name, "dst_pages": self._pages(j), "aux_slot": j})
        for st in c.dc.expect_many(expects):
            if isinstance(st, Exception):
                raise TransferdError(f"bench: expect refused: {st}")
        for j, room in enumerate(rooms):
            self.pm.pool.rows[self.pm.pool.layout.aux_index][j, :8] = np.frombuffer(
                room.to_bytes(8, "little"), np.uint8)
            pc.submit(room, 0, self._pages(j), last=True, aux_slot=j)
        done = c.dc.wait_many([(r, g.name) for r in rooms], 60)
        dt = time.perf_counter() - t0
        ok = sum(1 for d in done if not isinstance(d, Exception) and d.state.value == "success")
        self.rooms_failed += ROOMS - ok
        c.dc.release_many([(r, g.name) for r in rooms])
        nbytes = ROOMS * self.P * sum(t[0].numel() for t in self.src)
        return {"gbps": nbytes / dt / 1e9 if ok == ROOMS else None, "seconds": dt}

    def close(self) -> None:
        self.pm.close()
        self.dm.close()
