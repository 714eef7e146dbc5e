"""``transferd`` command line: ``receiver``, ``sender``, ``launch``, ``demo``, ``soak``, ``bench``,
``status``, ``config check``, ``keygen``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from . import logs
from .config import Config, load
from .daemon.run import run_agent
from .errors import TransferdError

log = logging.getLogger("transferd")


def find_default_config() -> str | None:
    """``$TRANSFERD_CONFIG``, else ``./configs/local.toml``, else the one beside the source tree."""
    env = os.environ.get("TRANSFERD_CONFIG")
    if env:
        return env
    for p in (Path.cwd() / "configs" / "local.toml", Path(__file__).resolve().parent.parent / "configs" / "local.toml"):
        if p.is_file():
            return str(p)
    return None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="TOML configuration file (default: configs/local.toml)")
    p.add_argument("--run-dir", help="directory for engine sockets (default: from config)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="log level")
    p.add_argument("--log-format", choices=["text", "json"], help="text for people, json for journald/docker")


def _sender_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp-size", type=int, help="context-parallel size of the prefill group")
    p.add_argument("--split", choices=["pages", "layers", "rank0"], help="who-sends-what split mode")
    p.add_argument("--group", help="prefill group name")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="transferd", description="Move KV cache and request state from prefill "
                                 "CP ranks to decode workers.")
    from . import __version__
    from .protocol.messages import PROTOCOL_VERSION

    ap.add_argument("--version", action="version", version=f"transferd {__version__} (protocol {PROTOCOL_VERSION})")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("receiver", help="run the decode-side receiver")
    _common(p)
    p.add_argument("--bind", help="ZeroMQ endpoint for senders, e.g. tcp://127.0.0.1:57500 (port * = any)")
    p.add_argument("--name", help="receiver name")

    p = sub.add_parser("sender", help="run the sender agent of one prefill CP rank")
    _common(p)
    _sender_flags(p)
    p.add_argument("--cp-rank", type=int, help="this agent's CP rank")
    p.add_argument("--receiver", action="append", help="receiver endpoint (repeatable; replaces the config's list)")

    p = sub.add_parser("launch", help="start a receiver and N senders on this host, supervised")
    _common(p)
    _sender_flags(p)

    p = sub.add_parser("demo", help="run rooms through real daemons with synthetic engines and verify every byte")
    _common(p)
    _sender_flags(p)
    p.add_argument("--rooms", type=int, help="number of rooms")
    p.add_argument("--chunks", type=int, help="chunks per room")
    p.add_argument("--pages", type=int, help="pages per room (upper bound; rooms vary)")
    p.add_argument("--in-flight", type=int, help="rooms in flight at once")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--json", metavar="PATH", help="write a machine-readable summary to PATH ('-': stdout, the JSON "
                   "alone; the human summary goes to stderr then)")
    p.add_argument("--same-host", choices=["auto", "off"],
                   help="auto: the receiver reads the senders' pools directly (one copy); off: all data over ZeroMQ")
    p.add_argument("--data-plane", choices=["auto", "mooncake", "nixl"],
                   help="mooncake: every daemon moves the rows with Mooncake Transfer Engine (TCP on this host); "
                        "nixl: with NIXL (UCX on this host); "
                        "auto: today's choice (same-host, data stream, ZeroMQ)")
    p.add_argument("--fault", action="append", metavar="SPEC",
                   help="inject a fault while rooms run (repeatable): kill-sender:R, restart-receiver, "
                        "pause-sender:R, drop-frames:P, corrupt-frames:P, slow-receiver:MS, hostile-flood:N")

    p = sub.add_parser("soak", help="run rooms through real daemons for minutes or hours while faults are injected "
                       "one after another; every byte verified, memory, descriptors and pool files checked")
    _common(p)
    _sender_flags(p)
    howlong = p.add_mutually_exclusive_group(required=True)
    howlong.add_argument("--seconds", type=float, help="how long to inject faults and run rooms")
    howlong.add_argument("--minutes", type=float, help="the same, in minutes")
    p.add_argument("--json", metavar="PATH", help="write the report to PATH ('-': stdout, the JSON alone; the "
                   "table goes to stderr then)")
    p.add_argument("--chunks", type=int, help="chunks per room")
    p.add_argument("--pages", type=int, help="pages per room (upper bound; rooms vary)")
    p.add_argument("--in-flight", type=int, help="rooms per batch")
    p.add_argument("--seed", type=int, help="random seed")
    p.add_argument("--same-host", choices=["auto", "off"],
                   help="auto: the receiver reads the senders' pools directly (one copy); off: all data over ZeroMQ")

    p = sub.add_parser("status", help="ask a running daemon how it is doing (exit 1 if it does not answer)")
    _common(p)
    who = p.add_mutually_exclusive_group()
    who.add_argument("--sender", "--cp-rank", type=int, metavar="RANK", dest="sender",
                     help="ask the sender agent of this CP rank")
    who.add_argument("--receiver", action="store_true", help="ask the receiver (the default)")
    p.add_argument("--endpoint", help="engine socket to ask instead of the configured one")
    p.add_argument("--json", action="store_true", help="machine-readable output: stdout carries JSON alone (one "
                   "line per refresh with --watch)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS", help="refresh every N seconds")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer")

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_cmd", required=True)
    c = csub.add_parser("check", help="validate files and print the resolved configuration")
    c.add_argument("files", nargs="+")
    c.add_argument("--json", action="store_true", help="stdout carries one JSON document alone (a list for "
                   "several files); problems still go to stderr")

    p = sub.add_parser("keygen", help="write a CURVE key pair (NAME.key, NAME.key_secret)")
    p.add_argument("directory")
    p.add_argument("--name", default=None, help="key name (default: the host name)")

    p = sub.add_parser("bench", help="measure the host's limits and transferd side by side")
    _common(p)
    p.add_argument("--quick", action="store_true", help="a short run (under a minute on 2 cores)")
    p.add_argument("--json", metavar="PATH", help="write the results to PATH ('-': stdout, the JSON alone; the "
                   "table goes to stderr then)")
    p.add_argument("--plot", metavar="PATH.png", help="draw throughput vs size and the de-dup bars (needs matplotlib)")
    p.add_argument("--repeats", type=int, help="interleaved rounds per measurement (median reported)")
    p.add_argument("--only", metavar="GLOBS", help="measure only the subjects matching these comma-separated "
                   "globs (e.g. 'raw_zmq/*,bulk/*'); the rest of the table stays empty")
    return ap


def resolve_config(args: argparse.Namespace) -> tuple[Config, str | None]:
    path = args.config or find_default_config()
    cfg = load(path)
    top: dict[str, Any] = {}
    if args.run_dir:
        top["run_dir"] = args.run_dir
    if args.log_level:
        top["log_level"] = args.log_level
    if args.log_format:
        top["log_format"] = args.log_format
    if top:
        from dataclasses import replace

        cfg = replace(cfg, **top)
    if args.cmd == "receiver":
        cfg = cfg.with_overrides("receiver", bind=args.bind, name=args.name)
    if args.cmd in ("sender", "launch", "demo", "soak"):
        cfg = cfg.with_overrides("sender", cp_size=args.cp_size, split=args.split, group=args.group)
    if args.cmd == "sender":
        cfg = cfg.with_overrides("sender", cp_rank=args.cp_rank,
                                 receivers=tuple(args.receiver) if args.receiver else None)
    if args.cmd == "demo":
        cfg = cfg.with_overrides("sender", same_host=args.same_host, data_plane=args.data_plane)
        cfg = cfg.with_overrides("receiver", data_plane=args.data_plane)
        cfg = cfg.with_overrides("demo", rooms=args.rooms, chunks=args.chunks, pages_per_room=args.pages,
                                 in_flight=args.in_flight, seed=args.seed)
    if args.cmd == "soak":
        cfg = cfg.with_overrides("sender", same_host=args.same_host)
        cfg = cfg.with_overrides("demo", chunks=args.chunks, pages_per_room=args.pages, in_flight=args.in_flight,
                                 seed=args.seed)
    return cfg, path


def cmd_launch(cfg: Config, path: str | None) -> int:
    from .tools.launcher import Launcher

    launcher = Launcher(cfg, path, common_args=["--run-dir", cfg.run_dir],
                        sender_args=["--cp-size", str(cfg.sender.cp_size), "--split", cfg.sender.split,
                                     "--group", cfg.sender.group])
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        launcher.start()
        print(f"transferd: receiver {cfg.receiver.name} on {launcher.receiver_endpoint} "
              f"(engine socket {cfg.receiver_engine_socket()}); {cfg.sender.cp_size} sender(s) of "
              f"{cfg.sender.group}: " + ", ".join(cfg.sender_engine_socket(r) for r in range(cfg.sender.cp_size)),
              flush=True)
        ok = True
        while not stopping and ok:
            time.sleep(0.2)
            ok = launcher.supervise_once()
    except TransferdError as exc:
        log.error("launch failed: %s", exc)
        ok = False
    finally:
        codes = launcher.stop()
        log.info("stopped: %s", ", ".join(f"{k} exit {v}" for k, v in codes.items()))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "config":
        from .tools.ops import config_check

        return config_check(args.files, args.json)
    if args.cmd == "keygen":
        from .tools.ops import keygen

        return keygen(args.directory, args.name or socket.gethostname().split(".")[0])
    try:
        cfg, path = resolve_config(args)
    except TransferdError as exc:
        print(f"transferd: {exc}", file=sys.stderr)
        return 2
    logs.configure(cfg.log_level, cfg.log_format)
    try:
        if args.cmd == "receiver":
            from .receiver import Receiver

            return run_agent(Receiver(cfg))
        if args.cmd == "sender":
            from .sender import SenderAgent

            return run_agent(SenderAgent(cfg))
        if args.cmd == "launch":
            return cmd_launch(cfg, path)
        if args.cmd == "status":
            from .tools.ops import status

            return status(cfg, args.sender, args.endpoint, args.json, args.watch, args.timeout)
        if args.cmd == "demo":
            from .tools.demo import run_demo

            return run_demo(cfg, path, json_path=args.json, fault_specs=args.fault)
        if args.cmd == "soak":
            from .tools.soak import run_soak

            seconds = args.seconds if args.seconds is not None else args.minutes * 60.0
            if not seconds > 0:
                print("transferd soak: the duration must be > 0", file=sys.stderr)
                return 2
            return run_soak(cfg, path, seconds, json_path=args.json)
        if args.cmd == "bench":
            from .tools.bench import run_bench

            return run_bench(cfg, path, quick=args.quick, json_path=args.json, plot_path=args.plot,
                             repeats=args.repeats, only=args.only)
    except TransferdError as exc:
        log.error("%s", exc)
        return 1
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
