"""Issue 14's "done when", run as written: ``transferd bench --quick`` several times back to back,
then each target's value in every run, the median, and whether the median meets it.

    python scripts/bench_runs.py                          # three --quick runs, JSON kept in a new temp dir
    python scripts/bench_runs.py --runs 5 --out runs/     # five, each run's JSON in runs/runN.json
    python scripts/bench_runs.py --from a.json b.json c.json   # judge runs already made
    python scripts/bench_runs.py -- --only 'bulk/*,raw_tcp/*'  # arguments after -- go to every bench run

Each run is a fresh ``python -m transferd bench`` (its own daemons, its own limits measured in the
same run), with this interpreter. The verdict (``--json PATH``, or ``-`` for stdout) lists per
target the runs' values, the median and met; a run with failed rooms or mismatched bytes fails it.
Exit status: 0 every target met and every run clean, 1 a target not met (or not measured), 2 a run
failed or a document could not be read. docs/PERFORMANCE.md, "Issue 14's verdict over three runs".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transferd.tools.bench.runs import table, verdict  # noqa: E402


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench_runs: cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise SystemExit(f"bench_runs: {path} is not a bench JSON document")
    return doc


def main(argv: list[str]) -> int:
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="bench runs, back to back (default 3)")
    ap.add_argument("--out", type=Path, help="directory for each run's JSON (default: a new temp directory)")
    ap.add_argument("--full", action="store_true", help="without --quick (the long bench)")
    ap.add_argument("--from", dest="docs", nargs="+", type=Path, metavar="JSON",
                    help="judge these bench JSON documents instead of running the bench")
    ap.add_argument("--json", dest="json_out", metavar="PATH", help="write the verdict as JSON ('-': stdout)")
    args = ap.parse_args(argv)
    if args.docs and bench_args:
        ap.error("arguments for the bench (after --) go with runs, not with --from")
    if not args.docs and args.runs < 1:
        ap.error("--runs must be at least 1")
    say = sys.stderr if args.json_out == "-" else sys.stdout
    if args.docs:
        runs = [_load(p) for p in args.docs]
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="transferd-bench-runs-"))
        out.mkdir(parents=True, exist_ok=True)
        runs = []
        for k in range(1, args.runs + 1):
            path = out / f"run{k}.json"
            cmd = [sys.executable, "-m", "transferd", "bench", *([] if args.full else ["--quick"]),
                   "--json", str(path), *bench_args]
            print(f"bench run {k} of {args.runs}: {' '.join(cmd[1:])}", file=say, flush=True)
            # the bench's own table goes to this process's stderr; its JSON to the file
            rc = subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr).returncode
            if rc != 0:
                print(f"bench_runs: run {k} exited {rc}; its output is above", file=sys.stderr)
                return 2
            runs.append(_load(path))
        print(f"each run's JSON: {out}/run1.json ... run{args.runs}.json", file=say)
    try:
        v = verdict(runs)
    except ValueError as exc:
        print(f"bench_runs: {exc}", file=sys.stderr)
        return 2
    print(table(v), file=say)
    if args.json_out:
        text = json.dumps(v, indent=2)
        if args.json_out == "-":
            print(text)
        else:
            Path(args.json_out).write_text(text + "\n")
    return 2 if v["bad_runs"] else 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
