#!/usr/bin/env python3
"""Engine-side example: move one room through daemons started with `transferd launch`.

    transferd launch --config configs/local.toml &      # a receiver and 2 senders
    python scripts/client_example.py --config configs/local.toml

The decode engine expects the room, each prefill rank's engine submits its chunks, both wait.
"""

from __future__ import annotations

import argparse

import numpy as np

from transferd.client import DecodeClient, PrefillClient
from transferd.config import load
from transferd.pool import Pool


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/local.toml")
    ap.add_argument("--room", type=int, default=2024)
    args = ap.parse_args()
    cfg = load(args.config)
    group, cp = cfg.sender.group, cfg.sender.cp_size

    # Engines see the same shared-memory pools as the daemons (attach by name).
    src_pools = [Pool.attach(cfg.sender_pool_name(r)) for r in range(cp)]
    dst_pool = Pool.attach(cfg.receiver_pool_name())
    rng = np.random.default_rng(0)
    for pool in src_pools:  # "prefill": write KV pages 0..9, state slot 0, aux slot 0
        for b in range(len(pool.rows)):
            pool.rows[b][:10] = rng.integers(0, 256, pool.rows[b][:10].shape, dtype=np.uint8)
        pool.rows[pool.layout.aux_index][0, :8] = np.frombuffer(np.uint64(args.room).tobytes(), np.uint8)

    decode = DecodeClient(cfg.receiver_engine_socket())
    prefill = [PrefillClient(cfg.sender_engine_socket(r)) for r in range(cp)]

    # Decode: the room's 10 pages go to pages 100..109; the first 2 are already cached (prefix).
    state = {c: [5] for c in dst_pool.layout.state_components}
    decode.expect(args.room, group, list(range(100, 110)), prefix_pages=2, state=state, aux_slot=3)

    # Prefill, every rank: two chunks; the last one names the state slots and the aux slot.
    src_state = {c: [0] for c in dst_pool.layout.state_components}
    for pc in prefill:
        pc.submit(args.room, 0, list(range(0, 6)))
        pc.submit(args.room, 6, list(range(6, 10)), last=True, state=src_state, aux_slot=0)

    status = decode.wait(args.room, group, timeout_s=30)
    print(f"decode: room {args.room} {status.state.value} {status.reason}")
    print("prefill:", ", ".join(pc.wait(args.room, timeout_s=30).state.value for pc in prefill))
    decode.release(args.room, group)

    for pool in (*src_pools, dst_pool):
        pool.close()
    return 0 if status.state.value == "success" else 1


if __name__ == "__main__":
    raise SystemExit(main())
