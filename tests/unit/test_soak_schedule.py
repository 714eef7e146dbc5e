"""The soak's pure logic: the fault schedule, which fleet takes each fault, a batch's outcome,
recovery and the pass rule; and the fault spec parser it shares with ``transferd demo``."""

from __future__ import annotations

import itertools
import random

import msgpack
import pytest

from transferd.errors import ConfigError
from transferd.protocol.messages import PROTOCOL_VERSION
from transferd.tools.demo import DemoRoom
from transferd.tools.faults import FAULT_KINDS, Fault, garbage, parse_fault
from transferd.tools.soak import CYCLE, STEADY, fleet_of, outcomes, passed, recovered, schedule


@pytest.mark.parametrize("cp", [1, 2, 3, 8])
def test_every_kind_comes_once_per_cycle_and_the_ranks_go_round(cp: int) -> None:
    faults = list(itertools.islice(schedule(cp), 4 * len(CYCLE)))
    assert set(CYCLE) == set(FAULT_KINDS)  # the soak cycles through every kind there is
    for n in range(4):
        cycle = faults[n * len(CYCLE):(n + 1) * len(CYCLE)]
        assert [f.kind for f in cycle] == list(CYCLE)
        kill = next(f for f in cycle if f.kind == "kill-sender")
        pause = next(f for f in cycle if f.kind == "pause-sender")
        assert (kill.arg, pause.arg) == (n % cp, (n + 1) % cp)
    for f in faults:  # every fault is a valid spec of the one parser, and reads back the same
        assert parse_fault(str(f), cp) == f


def test_the_steady_fleet_takes_only_faults_that_leave_its_processes_alive() -> None:
    assert {"hostile-flood", "pause-sender"} == STEADY
    assert {fleet_of(Fault(k, 0)) for k in STEADY} == {"steady"}
    assert {fleet_of(Fault(k, 0)) for k in set(FAULT_KINDS) - STEADY} == {"chaos"}
    # the configuration faults go to the fleet that is restarted with them
    assert all(fleet_of(Fault(k, 0)) == "chaos" for k, v in FAULT_KINDS.items() if not v.process)
    # the first cycle has at least five kinds before the costly second half
    assert len(set(CYCLE[:5])) == 5


def _room(status: str, code: str = "") -> DemoRoom:
    import numpy as np

    r = DemoRoom(room=1, group="g", n=1, prefix=0, dst=np.zeros(1, np.int64), src=[], chunks=[(0, 1)],
                 state_dst={}, state_src=[], aux_dst=0, aux_src=[])
    r.status, r.code = status, code
    return r


def test_outcomes_and_recovery() -> None:
    rooms = [_room("success"), _room("failed", "peer_lost"), _room("failed", "peer_lost"), _room("failed")]
    assert outcomes(rooms) == {"ok": 1, "failed": {"failed": 1, "peer_lost": 2}}
    assert recovered({"after": {"ok": 8, "failed": {}}})
    assert not recovered({"after": {"ok": 7, "failed": {"incomplete": 1}}})
    assert not recovered({"after": {"ok": 0, "failed": {}}})  # no room ran after it: not shown


def test_the_pass_rule() -> None:
    good = {"corrupted_rooms": 0, "mismatched_bytes": 0, "stray_bytes": 0, "leaked_shm_files": [],
            "recovered": True, "errors": {}, "interrupted": False}
    assert passed(good)
    for key, bad in [("corrupted_rooms", 1), ("mismatched_bytes", 3), ("stray_bytes", 1),
                     ("leaked_shm_files", ["transferd-soak1x0-steady-decode0"]), ("recovered", False),
                     ("errors", {"chaos": "TransferdError()"}), ("interrupted", True)]:
        assert not passed(good | {key: bad}), key


def test_hostile_flood_spec_and_garbage() -> None:
    assert parse_fault("hostile-flood:20000", 2) == Fault("hostile-flood", 20000)
    assert str(Fault("hostile-flood", 20000)) == "hostile-flood:20000"
    for spec in ("hostile-flood:0", "hostile-flood:1.5", "hostile-flood:x", "hostile-flood"):
        with pytest.raises(ConfigError):
            parse_fault(spec, 2)
    rng = random.Random(0)
    msgs = [garbage(rng) for _ in range(600)]
    assert all(m and all(isinstance(f, bytes) for f in m) for m in msgs)
    assert sum(len(m) == 3 for m in msgs) > 50  # some carry stray frames
    assert any(m == [b"\xc1"] for m in msgs)
    # none of them is a well-formed register of this protocol version
    for m in msgs:
        try:
            head = msgpack.unpackb(m[0], raw=False)
        except Exception:
            continue
        assert not (isinstance(head, dict) and head.get("t") == "register" and head.get("v") == PROTOCOL_VERSION and len(m) == 1)
