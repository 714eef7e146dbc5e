"""Paired runs of `transferd bench --quick` on two checkouts, to compare two commits.

Each checkout needs its own virtual environment (``python3 -m venv .venv && .venv/bin/pip install
-e .`` in it; a ``git worktree`` of the other commit does). The runs alternate A, B, then B, A, and
so on, so that the order within a pair cancels out; the table gives, per figure, the median and
range of each side and of the per-pair ratios B ÷ A, and in how many pairs B was worse (lower
throughput or ratio, higher time or CPU). docs/PERFORMANCE.md, "To compare two commits".

    python scripts/pairs.py ../before . --pairs 6 --out /tmp/pairs          # the whole quick bench
    python scripts/pairs.py ../before . --only 'small/1,small/8'             # some subjects
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

FIGURES = re.compile(r"(gbps|vs_|ratios|p50_ms|p99_ms|rooms_per_s|cpu_s_per_gb|measured_cut|time_on_vs_off)")
LOWER_IS_BETTER = re.compile(r"(cpu_s_per_gb|_ms$|time_on_vs_off)")


def flat(x: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(x, dict):
        for k, v in x.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        out[prefix] = float(x)
    return out


def run(tree: Path, json_path: Path, only: str | None) -> None:
    argv = [str(tree / ".venv" / "bin" / "transferd"), "bench", "--quick", "--json", str(json_path)]
    if only:
        argv += ["--only", only]
    with open(json_path.with_suffix(".table"), "wb") as table:
        subprocess.run(argv, cwd=tree, stdout=table, stderr=subprocess.STDOUT, timeout=900, check=True)


def table(a: list[dict[str, float]], b: list[dict[str, float]]) -> list[str]:
    lines = ["| figure | A: median (range) | B: median (range) | B ÷ A per pair: median (range) | B worse in |",
             "|---|---|---|---|---|"]
    for key in a[0]:
        if not FIGURES.search(key) or not all(key in x for x in b):
            continue
        va, vb = [x[key] for x in a], [x[key] for x in b]
        ratios = [y / x for x, y in zip(va, vb) if x]
        if not ratios:
            continue
        worse = sum(1 for r in ratios if (r > 1.0005 if LOWER_IS_BETTER.search(key) else r < 0.9995))

        def f(v: list[float]) -> str:
            return f"{statistics.median(v):.3f} ({min(v):.3f}–{max(v):.3f})"
        lines.append(f"| `{key}` | {f(va)} | {f(vb)} | {f(ratios)} | {worse}/{len(ratios)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="checkout A (before)")
    p.add_argument("b", type=Path, help="checkout B (after)")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--only", help="the bench's --only globs")
    p.add_argument("--out", type=Path, default=Path("pairs-out"), help="directory for the JSON and tables")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    a_runs: list[dict[str, float]] = []
    b_runs: list[dict[str, float]] = []
    for i in range(args.pairs):
        order = [("a", args.a.resolve()), ("b", args.b.resolve())]
        for side, tree in order if i % 2 == 0 else order[::-1]:
            path = args.out / f"{side}-{i + 1}.json"
            run(tree, path, args.only)
            (a_runs if side == "a" else b_runs).append(flat(json.loads(path.read_text())))
            print(f"pair {i + 1}: {side} done", file=sys.stderr)
    print("\n".join(table(a_runs, b_runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
