"""The verdict over bench runs (``transferd/tools/bench/runs.py``): what it refuses."""

from __future__ import annotations

import pytest

from transferd.tools.bench.runs import op_of, verdict


def test_no_runs_or_a_document_without_targets_is_refused() -> None:
    with pytest.raises(ValueError, match="no bench runs"):
        verdict([])
    with pytest.raises(ValueError, match="run 2 has no targets"):
        verdict([{"targets": {}}, {"rooms_ok": 3}])


def test_a_target_without_a_comparison_is_named() -> None:
    assert op_of("dedup.cp8 time on < off", {}) == "<"
    assert op_of("anything", {"op": "<="}) == "<="
    with pytest.raises(ValueError, match="'speed' names no comparison"):
        op_of("speed", {"value": 1.0})
    with pytest.raises(ValueError, match="'speed' names no comparison"):  # an empty entry in every run
        verdict([{"targets": {"speed": {}}}])


def test_a_target_measured_in_some_runs_is_judged_on_those() -> None:
    runs = [{"targets": {"x >= 1": {"value": v, "target": 1.0, "op": ">="}}, "rooms_failed": 0, "mismatched_bytes": 0}
            for v in (None, 0.5, 2.0, 1.5)]
    e = verdict(runs)["targets"]["x >= 1"]
    assert e["runs_measured"] == 3 and e["median"] == 1.5 and e["met"] is True
