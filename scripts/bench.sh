#!/usr/bin/env bash
# transferd bench from the repository root — the host's limits and transferd side by side.
#   scripts/bench.sh --quick --json -        # under a minute on 2 cores, JSON on stdout, table on stderr
#   scripts/bench.sh --json bench.json --plot bench.png --repeats 9
# Python: $PYTHON, else .venv/bin/python when it exists, else python3. See docs/PERFORMANCE.md.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" -m transferd bench "$@"
