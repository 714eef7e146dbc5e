"""The agents as a library: receiver and senders in threads of the test process, same sockets
and pools as the daemons."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
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
        # not run by systemd: no notifier loop waking every 5 s for nothing (test_service has the real one)
        assert "NOTIFY_SOCKET" not in os.environ
        for a in (rx, *senders):
            assert not a.agent.call(lambda a=a: [t for t in a.agent._tasks if t.get_name().endswith(":notify")])
            assert a.agent.call(lambda a=a: [t for t in a.agent._tasks if t.get_name().endswith(":tick")])
        # direct calls on the agents' loops (no engine socket) ...
        rx.agent.call(lambda: None)
        from transferd.protocol.room import RoomRequest

        st = rx.agent.call(rx.agent.expect, RoomRequest(99, "prefill0", tuple(range(10, 20)), 0,
                                                        {"conv": (2,), "ssm": (2,)}, 3))
        assert st.state in (RoomState.BOOTSTRAPPING, RoomState.WAITING)
        # ... and the same engine sockets a daemon has
        pcs = [PrefillClient(cfg.sender_engine_socket(r)) for r in range(2)]
        dc = DecodeClient(cfg.receiver_engine_socket())
        # waits whose time runs out answer the status as it is then, and leave no waiter behind
        assert not dc.wait(99, "prefill0", 0.05).state.terminal
        assert not dc.wait_many([(99, "prefill0"), (99, "prefill0")], 0.05)[1].state.terminal
        pcs[0].submit(99, 0, list(range(30, 35)))  # the room is known to rank 0, not ended
        assert not pcs[0].wait(99, 0.05).state.terminal
        assert rx.agent.call(lambda: dict(rx.agent._waiters)) == {}
        assert senders[0].agent.call(lambda: dict(senders[0].agent.waiters)) == {}
        # waits the room's end answers: one alone and two in a batch on the receiver, one on a rank
        early: list[object] = []
        w1, w2 = DecodeClient(cfg.receiver_engine_socket()), DecodeClient(cfg.receiver_engine_socket())
        w3 = PrefillClient(cfg.sender_engine_socket(0))
        waiting = [threading.Thread(target=lambda: early.append(w1.wait(99, "prefill0", 20))),
                   threading.Thread(target=lambda: early.extend(w2.wait_many([(99, "prefill0")] * 2, 20))),
                   threading.Thread(target=lambda: early.append(w3.wait(99, 20)))]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 20
        while (rx.agent.call(lambda: sum(map(len, rx.agent._waiters.values()))) < 3
               or senders[0].agent.call(lambda: len(senders[0].agent.waiters)) < 1):
            assert time.monotonic() < deadline and all(t.is_alive() for t in waiting), early
            dc.ping()  # a round trip through the receiver's loop, not a sleep
        assert not early
        pcs[0].submit(99, 5, list(range(35, 40)), last=True, state={"conv": [4], "ssm": [4]}, aux_slot=1)
        pcs[1].submit(99, 0, list(range(30, 40)), last=True, state={"conv": [4], "ssm": [4]}, aux_slot=1)
        assert dc.wait(99, "prefill0", 20).state is RoomState.SUCCESS
        for t in waiting:
            t.join(20)
        assert [getattr(st, "state", st) for st in early] == [RoomState.SUCCESS] * 4
        assert rx.agent.call(lambda: dict(rx.agent._waiters)) == {}
        assert senders[0].agent.call(lambda: dict(senders[0].agent.waiters)) == {}
        for b in dpool.layout.indices("kv"):
            assert np.array_equal(dpool.rows[b][10:15], spools[0].rows[b][30:35])
            assert np.array_equal(dpool.rows[b][15:20], spools[1].rows[b][35:40])
        for b in dpool.layout.indices("state"):
            assert np.array_equal(dpool.rows[b][2], spools[0].rows[b][4])
        for c in [dc, *pcs, w1, w2, w3]:
            c.close()
    finally:
        for s in senders:
            s.stop()
        rx.stop()
    assert not list(Path("/dev/shm").glob(f"transferd-{tag}-*")), "pools left behind"
