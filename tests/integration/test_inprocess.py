"""The agents as a library: receiver and senders in threads of the test process, same sockets
and pools as the daemons."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import numpy as np

from transferd.client import DecodeClient, PrefillClient
from transferd.config import from_mapping
from transferd.daemon.base import AgentThread
from transferd.protocol.room import RoomState
from transferd.receiver import Receiver
from transferd.sender import SenderAgent

from .harness import MODEL, fill_random, write_guard


def test_agents_in_process(tmp_path: Path) -> None:
    tag = f"ip{uuid.uuid4().hex[:8]}"
    cfg = from_mapping({
        "run_dir": str(tmp_path), "model": MODEL,
        "receiver": {"bind": "tcp://127.0.0.1:*", "pool": f"{tag}-rx", "kv_pages": 64, "metrics_bind": ""},
        "sender": {"cp_size": 2, "pool": f"{tag}-{{group}}-r{{rank}}", "kv_pages": 64, "metrics_bind": ""},
    }, "test", env={})
    rx = AgentThread(Receiver(cfg)).start()
    senders = []
    try:
        ep = rx.agent.data_endpoint
        for r in range(2):
            c = dataclasses.replace(cfg, sender=dataclasses.replace(cfg.sender, cp_rank=r, receivers=(ep,)))
            senders.append(AgentThread(SenderAgent(c)).start())
        spools = [s.agent.pool for s in senders]
        dpool = rx.agent.pool
        assert dpool is not None and all(spools)
        for i, p in enumerate(spools):
            fill_random(p, i)
            write_guard(p, 1, 99)
        # direct calls on the agents' loops (no engine socket) ...
        rx.agent.call(lambda: None)
        from transferd.protocol.room import RoomRequest

        st = rx.agent.call(rx.agent.expect, RoomRequest(99, "prefill0", tuple(range(10, 20)), 0,
                                                        {"conv": (2,), "ssm": (2,)}, 3))
        assert st.state in (RoomState.BOOTSTRAPPING, RoomState.WAITING)
        # ... and the same engine sockets a daemon has
        pcs = [PrefillClient(cfg.sender_engine_socket(r)) for r in range(2)]
        for r, pc in enumerate(pcs):
            pc.submit(99, 0, list(range(30, 40)), last=True, state={"conv": [4], "ssm": [4]}, aux_slot=1)
        dc = DecodeClient(cfg.receiver_engine_socket())
        assert dc.wait(99, "prefill0", 20).state is RoomState.SUCCESS
        for b in dpool.layout.indices("kv"):
            assert np.array_equal(dpool.rows[b][10:15], spools[0].rows[b][30:35])
            assert np.array_equal(dpool.rows[b][15:20], spools[1].rows[b][35:40])
        for b in dpool.layout.indices("state"):
            assert np.array_equal(dpool.rows[b][2], spools[0].rows[b][4])
        for c in [dc, *pcs]:
            c.close()
    finally:
        for s in senders:
            s.stop()
        rx.stop()
    assert not list(Path("/dev/shm").glob(f"transferd-{tag}-*")), "pools left behind"
