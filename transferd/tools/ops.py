"""Operator commands: ``config check``, ``status``, ``keygen``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..client import DecodeClient, PrefillClient
from ..config import Config, load
from ..errors import ClientTimeout, TransferdError


def config_check(paths: list[str], as_json: bool = False) -> int:
    """Validate each file (with the ``TRANSFERD_*`` environment applied) and print the resolved
    configuration; exit 2 naming the first problem of every bad file. ``as_json``: stdout carries
    one JSON document alone — ``{"file", "config"}`` (or ``{"file", "error"}``) for one file, a
    list of them for several — and problems still go to stderr."""
    bad = 0
    docs: list[dict[str, Any]] = []
    for p in paths:
        try:
            cfg = load(p)
        except TransferdError as exc:
            print(f"{p}: INVALID: {exc}", file=sys.stderr)
            docs.append({"file": p, "error": str(exc)})
            bad += 1
            continue
        resolved = dataclasses.asdict(cfg)
        if as_json:
            docs.append({"file": p, "config": resolved})
        else:
            print(f"{p}: OK")
            for section, value in resolved.items():
                if isinstance(value, dict):
                    print(f"  [{section}]")
                    for k, v in value.items():
                        print(f"    {k} = {_short(v)}")
                else:
                    print(f"  {section} = {_short(value)}")
            s = cfg.sender
            layout = cfg.receiver_layout()
            print(f"  # layout {layout.fingerprint()}: {len(layout.indices('kv'))} KV buffers, "
                  f"{len(layout.indices('state'))} state buffers; {layout.kv_page_bytes()} KV bytes per page")
            print(f"  # receiver engine socket {cfg.receiver_engine_socket()}, pool {cfg.receiver_pool_name()}; "
                  f"sender rank {s.cp_rank} engine socket {cfg.sender_engine_socket()}, pool {cfg.sender_pool_name()}")
    if as_json:
        print(json.dumps(docs[0] if len(docs) == 1 else docs, default=list, indent=2))
    return 2 if bad else 0


def _short(v: Any) -> str:
    text = json.dumps(v, default=list)
    return text if len(text) < 160 else text[:157] + "..."


def keygen(directory: str, name: str) -> int:
    """Write a CURVE key pair: ``NAME.key`` (public, to hand out) and ``NAME.key_secret`` (0600)."""
    import zmq.auth

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (d / f"{name}{suffix}").exists():
            print(f"transferd keygen: {d / (name + suffix)} exists; refusing to overwrite it", file=sys.stderr)
            return 2
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    print(f"public key: {public}  (copy it into the receiver's curve_allow_dir, or give it to senders as "
          f"curve_server_key)\nsecret key: {secret}  (keep it private: mode 0600)")
    return 0


def _client(cfg: Config, sender_rank: int | None, endpoint: str | None, timeout: float) -> Any:
    if endpoint:
        return (PrefillClient if sender_rank is not None else DecodeClient)(endpoint, timeout_s=timeout)
    if sender_rank is not None:
        return PrefillClient(cfg.sender_engine_socket(sender_rank), timeout_s=timeout)
    return DecodeClient(cfg.receiver_engine_socket(), timeout_s=timeout)


def status(cfg: Config, sender_rank: int | None, endpoint: str | None, as_json: bool, watch: float | None,
           timeout: float = 2.0) -> int:
    """Ask a running daemon over its engine socket; exit 1 when it does not answer (health checks)."""
    client = _client(cfg, sender_rank, endpoint, timeout)
    last: tuple[float, int] | None = None
    try:
        while True:
            try:
                st = client.status()
            except ClientTimeout as exc:
                print(f"transferd status: {exc}", file=sys.stderr)
                return 1
            now = time.monotonic()
            moved = sum(st["stats"]["bytes"].values())
            rate = (moved - last[1]) / (now - last[0]) if last else moved / max(st["stats"]["uptime_s"], 1e-9)
            last = (now, moved)
            if as_json:
                st["throughput_bytes_per_s"] = rate
                print(json.dumps(st, indent=None if watch else 2), flush=True)
            else:
                if watch and sys.stdout.isatty():
                    print("\x1b[2J\x1b[H", end="")
                print(render(st, rate), flush=True)
            if not watch:
                return 0
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def write_json(doc: Any, path: str, *, sort_keys: bool = False) -> None:
    """A tool's JSON result (``--json PATH``): to the file, or alone on stdout for ``-``."""
    text = json.dumps(doc, indent=2, sort_keys=sort_keys)
    if path == "-":
        print(text, flush=True)
    else:
        Path(path).write_text(text + "\n")


def table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as aligned lines (each indented by two spaces); the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(st: dict[str, Any], rate: float) -> str:
    s = st["stats"]
    out: list[str] = []
    if st["role"] == "receiver":
        out.append(f"receiver {st['name']}  pid {st['pid']} on {st['host']}  data {st['data_endpoint']}  "
                   f"up {s['uptime_s']:.0f}s  metrics :{s['metrics_port'] or '-'}"
                   + ("  DRAINING" if s.get("draining") else ""))
        rows = [["GROUP", "CP", "SPLIT", "RANK", "INCARNATION", "PID", "HOST", "LAST HEARD"]]
        for g, gv in sorted(st["groups"].items()):
            for rank, rv in sorted(gv["ranks"].items(), key=lambda kv: int(kv[0])):
                rows.append([g, str(gv["cp_size"]), gv["split"], rank, f"{rv['incarnation']:016x}", str(rv["pid"]),
                             rv["host"], f"{rv['last_seen_s']:.1f}s ago"])
        out += ["registered ranks:"] + (table(rows) if len(rows) > 1 else ["  (none)"])
    else:
        out.append(f"sender {st['group']}/r{st['rank']} of cp {st['cp_size']} ({st['split']})  pid {st['pid']} on "
                   f"{st['host']}  incarnation {st['incarnation']:016x}  up {s['uptime_s']:.0f}s  "
                   f"metrics :{s['metrics_port'] or '-'}" + ("  DRAINING" if s.get("draining") else ""))
        rows = [["RECEIVER", "ENDPOINT", "STATE", "LAST HEARD", "NOTE"]]
        for r in st["receivers"]:
            heard = "-" if r["last_heard_s"] is None else f"{r['last_heard_s']:.1f}s ago"
            rows.append([r["receiver"] or "?", r["endpoint"], r["state"], heard, r["reason"]])
        out += ["receivers:", *table(rows)]
    rooms = ", ".join(f"{k} {v}" for k, v in sorted(st["rooms"].items())) or "none"
    out.append(f"rooms: {rooms}")
    b = s["bytes"]
    out.append(f"moved: kv {b['kv'] / 1e6:.1f} MB, state {b['state'] / 1e6:.1f} MB, aux {b['aux'] / 1e6:.3f} MB"
               f" ({s['shm_bytes'] / 1e6:.1f} MB same-host, {s.get('stream_bytes', 0) / 1e6:.1f} MB on data streams);"
               f" {rate / 1e6:.1f} MB/s"
               + (f"; de-dup skipped {s['state_bytes_skipped'] / 1e6:.1f} MB" if st["role"] == "sender" else ""))
    if s["refused"]:
        out.append("refused: " + ", ".join(f"{k} {v}" for k, v in sorted(s["refused"].items())))
    if s["failures"]:
        out.append("failed rooms: " + ", ".join(f"{k} {v}" for k, v in sorted(s["failures"].items())))
    return "\n".join(out)
