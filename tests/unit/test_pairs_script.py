"""scripts/pairs.py: the paired before/after table (the bench runs themselves are the bench's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("pairs", ROOT / "scripts" / "pairs.py")
assert spec is not None and spec.loader is not None
pairs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pairs)


def test_flat_keeps_numbers_only() -> None:
    assert pairs.flat({"a": {"b": 1, "c": "x", "d": True}, "e": 2.5}) == {"a.b": 1.0, "e": 2.5}


def test_table_pairs_ratios_and_counts_the_worse_side() -> None:
    a = [{"bulk.1MiB.gbps": 2.0, "small.cp1.p50_ms": 1.0}, {"bulk.1MiB.gbps": 4.0, "small.cp1.p50_ms": 2.0}]
    b = [{"bulk.1MiB.gbps": 1.0, "small.cp1.p50_ms": 1.5}, {"bulk.1MiB.gbps": 4.4, "small.cp1.p50_ms": 1.0}]
    rows = {r.split("|")[1].strip(): r for r in pairs.table(a, b)[2:]}
    gbps = [c.strip() for c in rows["`bulk.1MiB.gbps`"].split("|")[1:-1]]
    assert gbps[3] == "0.800 (0.500–1.100)"  # per pair 0.5 and 1.1: the median of the pairs, not of the sides
    assert gbps[4] == "1/2"  # lower throughput is worse
    p50 = [c.strip() for c in rows["`small.cp1.p50_ms`"].split("|")[1:-1]]
    assert p50[4] == "1/2"  # a higher time is worse
