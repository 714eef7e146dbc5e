"""scripts/callback_cpu.py: a real demo's daemons timed callback by callback."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "callback_cpu.py"
spec = importlib.util.spec_from_file_location("callback_cpu", SCRIPT)
assert spec is not None and spec.loader is not None
callback_cpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(callback_cpu)


def test_a_demo_over_data_streams_is_timed_in_each_rank(tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    demo = [sys.executable, "-m", "transferd", "demo", "--cp-size", "2", "--same-host", "off", "--rooms", "6",
            "--chunks", "1", "--run-dir", str(tmp_path / "run")]
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--", *demo], capture_output=True, text=True,
                       timeout=90, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    files = sorted(out.glob("sender-*.json"))
    assert len(files) == 2  # the two ranks; the demo itself is not instrumented
    for f in files:
        d = json.loads(f.read_text())
        assert d["argv"][1] == "sender"
        assert d["calls"]["rooms"] == 6  # distinct rooms, not send loops
        secs, calls = d["seconds"], d["calls"]
        assert calls["ctrl:Assign"] >= 1 and secs["ctrl:Assign"] > 0  # the assigns came through the ZeroMQ socket
        assert any(k.startswith("ctrl:") and "Status" in k for k in calls)  # every room's status came back
        assert calls["flush"] >= 6 and secs["flush"] > 0  # rows went on the data stream (same-host off)
        assert calls["room_steps_own"] >= 6 and secs["room_steps_own"] > 0  # each room's send loop, step by step
        assert calls["engine_api"] >= 6  # the demo's submits (never counted as control messages)
        # disjoint parts, all after the first room: the flushes, and the writable callbacks and send
        # loop steps less their flushes (the ctrl:* callbacks are left out: the first assign's starts
        # before the first room, and a ping or registered may come before it; on_writable holds flushes)
        if "on_writable_own" in secs:
            assert secs["on_writable_own"] <= secs["on_writable"]
        assert 0 < secs["flush"] + secs.get("on_writable_own", 0.0) + secs["room_steps_own"] <= secs["total"]
    # the receiver: every rank-room's rows came as data records on the streams, read and stepped
    (rx,) = out.glob("receiver-*.json")
    d = json.loads(rx.read_text())
    secs, calls = d["seconds"], d["calls"]
    assert d["argv"][1] == "receiver"
    records = calls["data_records"]
    assert records >= 12  # 6 rooms × 2 ranks, each rank's rows of a room in one record or more
    assert calls["record_steps"] >= 3 * records and secs["record_steps"] > 0  # prefix, header, payload each
    assert calls["reads"] >= records and secs["reads"] > 0  # the payloads' copies into the rows
    assert calls["on_readable_own"] >= 1 and secs["on_readable_own"] >= 0  # less its reads and steps
    assert calls["engine_api"] >= 6  # the demo's expects and waits
    lines = r.stdout.splitlines()
    heads = [ln for ln in lines if ln.startswith("sender-")]
    assert len(heads) == 2 and all(": 6 rooms, main thread " in h for h in heads)
    assert any(ln.strip().startswith("ctrl:Assign ") and ln.rstrip().endswith("µs/call") for ln in lines)
    (head,) = [ln for ln in lines if ln.startswith("receiver-")]
    assert f": {records} data records, main thread " in head
    assert any(ln.strip().startswith("reads ") and ln.rstrip().endswith("µs/call") for ln in lines)


def test_usage_and_no_rooms(tmp_path: Path) -> None:
    assert callback_cpu.main(["--out", str(tmp_path)]) == 2  # no "--"
    assert callback_cpu.main(["--out", str(tmp_path), "--"]) == 2  # no command
    (tmp_path / "sender-1.json").write_text(json.dumps({"argv": ["-m", "sender"], "seconds": {"total": 0.0},
                                                        "calls": {"rooms": 0}}))
    (tmp_path / "receiver-2.json").write_text(json.dumps({"argv": ["-m", "receiver"], "seconds": {"total": 0.0},
                                                          "calls": {}}))
    assert callback_cpu.summary(tmp_path) == []  # a sender that sent nothing, a receiver that read nothing: left out
    assert callback_cpu.main(["--out", str(tmp_path), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
