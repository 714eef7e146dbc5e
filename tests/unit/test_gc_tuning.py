"""A daemon serves with its cyclic garbage collector tuned (transferd.daemon.run.tune_gc): what existed at
start frozen out of collections, the youngest generation collected less often. Run in a child
process, so this test's own interpreter keeps its collector as it was."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import transferd

ROOT = Path(transferd.__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import gc, json, sys
    from transferd.daemon.base import AgentBase
    from transferd.daemon.run import GC_THRESHOLDS, run_agent

    before = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(), "ma": "numpy.ma" in sys.modules}

    class Probe(AgentBase):
        async def serve(self):
            self.seen = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                         "ma": "numpy.ma" in sys.modules}

    probe = Probe()
    run_agent(probe)
    print(json.dumps({"before": before, "serving": probe.seen, "want": GC_THRESHOLDS}))
""")


def test_a_daemon_serves_with_its_collector_tuned() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"]["threshold"] != out["want"]  # Python's own default until the daemon starts
    assert tuple(out["serving"]["threshold"]) == tuple(out["want"])
    assert out["serving"]["frozen"] > 1000  # modules, classes, the configuration: out of every collection


def test_a_daemon_imports_what_its_first_room_would_before_serving() -> None:
    """numpy's first np.unique imports numpy.ma: a daemon does it at start, not in its first room."""
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"]["ma"] is False and out["serving"]["ma"] is True
