"""Issue 14's verdict over several bench runs: each target's value in every run, the median, and
whether the median meets the target (``scripts/bench_runs.py`` runs the bench and prints this).

A run is one ``transferd bench --json`` document. A target is met when the median of its values
over the runs is on the right side of it; the de-dup cut (``==``) only when every run's cut was
exact. A target that a run did not measure (no value) is judged on the runs that did, and named;
one that no run measured is "not measured", which is not met. A run with failed rooms or mismatched
bytes makes the whole verdict a failure, whatever its figures."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

OPS = (">=", "<=", "==", "<")
_NAME_OP = re.compile(r"(>=|<=|==|<)")


def op_of(name: str, target: dict[str, Any]) -> str:
    """The target's comparison: its ``op`` (bench JSON since this module), else the one its name
    carries ("cp8_tcp_vs_raw_tcp >= 0.85", "dedup.cp8 time on < off")."""
    op = target.get("op")
    if op in OPS:
        return str(op)
    m = _NAME_OP.search(name)
    if m is None:
        raise ValueError(f"target {name!r} names no comparison ({', '.join(OPS)})")
    return m.group(1)


def _holds(value: float, op: str, target: float) -> bool:
    if op == ">=":
        return value >= target
    if op == "<=":
        return value <= target
    if op == "<":
        return value < target
    return abs(value - target) < 1e-9


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def verdict(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per target (in the first run's order, then any the later runs add): the runs' values, the
    median, and whether it is met; per run its rooms and bytes; ``ok`` when every run was clean
    and every target met."""
    if not runs:
        raise ValueError("no bench runs to judge")
    names: list[str] = []
    for i, run in enumerate(runs):
        targets = run.get("targets")
        if not isinstance(targets, dict):
            raise ValueError(f"run {i + 1} has no targets (not a `transferd bench --json` document?)")
        names += [n for n in targets if n not in names]
    out: dict[str, Any] = {}
    for name in names:
        ts = [run["targets"].get(name) or {} for run in runs]
        op = op_of(name, next((t for t in ts if t), {}))
        values = [_number(t.get("value")) for t in ts]
        have = [(v, _number(t.get("target"))) for v, t in zip(values, ts) if v is not None]
        entry: dict[str, Any] = {"op": op, "values": values, "median": None, "target": None, "met": False,
                                 "runs_measured": len(have)}
        goal = have[0][1] if have else None
        if goal is not None:
            entry["median"] = median = statistics.median(v for v, _ in have)
            entry["target"] = goal
            # the de-dup cut: exact in every run (against each run's own analytic figure)
            entry["met"] = (all(g is not None and _holds(v, op, g) for v, g in have) if op == "=="
                            else _holds(median, op, goal))
        out[name] = entry
    clean = [{"rooms_ok": run.get("rooms_ok"), "rooms_failed": run.get("rooms_failed"),
              "mismatched_bytes": run.get("mismatched_bytes"), "seconds": run.get("seconds")} for run in runs]
    bad_runs = [i + 1 for i, c in enumerate(clean) if c["rooms_failed"] != 0 or c["mismatched_bytes"] != 0]
    missed = [n for n, e in out.items() if not e["met"]]
    return {"runs": len(runs), "targets": out, "run_checks": clean, "bad_runs": bad_runs, "missed": missed,
            "ok": not bad_runs and not missed}


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.4g}"


def table(v: dict[str, Any]) -> str:
    """The verdict as text: one line a target, then the runs' checks and the summary."""
    n = v["runs"]
    width = max(len(name) for name in v["targets"]) + 2
    head = "target".ljust(width) + "".join(f"run {i + 1}".rjust(9) for i in range(n)) + "median".rjust(9) + "  met"
    lines = [head]
    for name, e in v["targets"].items():
        if e["runs_measured"] == 0:
            met = "not measured"
        else:
            met = "yes" if e["met"] else "NO"
            if e["runs_measured"] < n:
                met += f" (measured in {e['runs_measured']} of {n} runs)"
        lines.append(name.ljust(width) + "".join(_fmt(x).rjust(9) for x in e["values"])
                     + _fmt(e["median"]).rjust(9) + f"  {met}")
    for i, c in enumerate(v["run_checks"]):
        lines.append(f"run {i + 1}: {c['rooms_ok']} rooms ok, {c['rooms_failed']} failed, "
                     f"{c['mismatched_bytes']} mismatched bytes, {_fmt(c['seconds'])} s")
    if v["bad_runs"]:
        lines.append(f"FAILED: run(s) {', '.join(map(str, v['bad_runs']))} had failed rooms or mismatched bytes")
    lines.append(f"every target met in the median of {n} run(s)" if not v["missed"] else
                 f"{len(v['missed'])} target(s) not met in the median of {n} run(s): {'; '.join(v['missed'])}")
    return "\n".join(lines)
