"""``transferd bench``: the entry point: plan, run, clean up, print the table, write the JSON
and the plot."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...config import Config
from ...errors import ConfigError
from ..ops import write_json
from .cluster import daemon_base_env
from .plan import BULK_KEYS, FULL, QUICK, SIZES, dedup_config_path
from .report import format_table, plot, report
from .subjects import Bench


def run_bench(cfg: Config, cfg_path: str | None, *, quick: bool = False, json_path: str | None = None,
              plot_path: str | None = None, repeats: int | None = None, only: str | None = None) -> int:
    """Run the benchmark; print the table, write JSON/plot. 0 when every room succeeded and every
    verified byte matched (figures below a target do not fail the run), 1 otherwise, 2 on usage
    errors."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        print("transferd bench: --plot needs matplotlib, which is not installed "
              "(pip install matplotlib)", file=sys.stderr)
        return 2
    if repeats is not None and repeats < 1:
        print(f"transferd bench: --repeats must be >= 1, not {repeats}", file=sys.stderr)
        return 2
    plan = QUICK if quick else FULL
    if repeats is not None:
        plan = replace(plan, repeats=repeats, target_repeats=repeats)
    try:
        ds_path = dedup_config_path()
    except ConfigError as exc:
        print(f"transferd bench: {exc}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    try:
        load_before = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_before = []
    table_out = sys.stderr if json_path == "-" else sys.stdout
    progress = sys.stderr.isatty()
    tag = f"bench{os.getpid()}"
    run_dir = Path(tempfile.mkdtemp(prefix="transferd-bench-"))
    bench = Bench(plan, quick, run_dir, tag, progress)
    ignored = daemon_base_env(os.environ)[1]
    if ignored:  # said at once: a run meant to measure a setting this way measures the default
        bench.notes["environment"] = (f"{', '.join(ignored)} from the environment not passed to the bench's daemons: "
                                      "the bench gives them their settings itself, so that its runs compare "
                                      "(to measure another setting, change its default and compare runs)")
        print(f"transferd bench: {bench.notes['environment']}", file=sys.stderr)
    if only:
        names = [n for n, _ in bench.subjects()] + [f"mooncake/{k}" for k in SIZES]  # mooncake: when importable
        names += ["staging_gather/1MiB", "staging_scatter/1MiB"]  # the SGLang backend's copies: when torch is
        names += ["e2e_backend/sglang", "e2e_client/sglang"]  # a room through the SGLang backend: when SGLang is
        names += [f"bulk_mc/{k}" for k in BULK_KEYS] + ["small_mc/1"]
        bench.only = [g.strip() for g in only.split(",") if g.strip()]
        unmatched = [g for g in bench.only if not any(fnmatch.fnmatchcase(n, g) for n in names)]
        if unmatched:
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"transferd bench: --only {unmatched[0]!r} matches no subject (there are: {', '.join(names)})",
                  file=sys.stderr)
            return 2
    out: dict[str, Any] | None = None
    ok = False

    def interrupted(signum: int, frame: Any) -> None:  # SIGTERM/SIGHUP clean up like Ctrl-C
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupted)
    try:
        bench.start(ds_path)
        bench.say("measuring")
        bench.run_rounds()
        out = report(bench)
        ok = out["rooms_failed"] == 0 and out["mismatched_bytes"] == 0
    except KeyboardInterrupt:
        bench.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        print("transferd bench: interrupted", file=sys.stderr)
        return 130
    except BaseException:
        bench.dump_logs()
        bench.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if not ok:
        bench.dump_logs()
    bench.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    assert out is not None
    out["host"]["loadavg_before"] = load_before
    out["daemon_exit_codes"] = {k: v for k, v in bench.codes.items() if v not in (0, None)}
    out["seconds"] = round(time.monotonic() - t_start, 2)
    print(format_table(out), file=table_out, flush=True)
    if json_path:
        write_json(out, json_path)
    if plot_path:
        plot(out, plot_path)
    return 0 if ok else 1
