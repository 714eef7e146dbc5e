"""CURVE security for the ZeroMQ sockets: key files, the handshake (and connection) monitor, wildcard binds."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ..errors import ConfigError

HANDSHAKE_FAILURES: dict[int, str] = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): "auth",  # the ZAP handler refused the key
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): "handshake",  # e.g. a plain peer against a CURVE socket
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): "handshake",
}


DISCONNECTED = "disconnected"


async def watch_handshakes(sock: zmq.Socket[Any], ctx: zmq.asyncio.Context,
                           on_fail: Callable[[str, str], None], *, handshakes: bool = True,
                           disconnects: bool = False) -> None:
    """Report failed ZeroMQ security handshakes on ``sock`` and, with ``disconnects``, every
    connection it loses (``on_fail("disconnected", ...)``: a peer that closed or died, or one
    ZeroMQ dropped for a frame over MAXMSGSIZE — the socket cannot tell which). Socket monitor
    events, read through an asyncio socket of ``ctx``, which shares ``sock``'s ZeroMQ context;
    libzmq allows one monitor per socket, so this is the only one."""
    from zmq.utils.monitor import parse_monitor_message

    addr = f"inproc://transferd-monitor-{id(sock):x}-{os.getpid()}"
    events = 0
    if handshakes:
        events |= zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    if disconnects:
        events |= zmq.EVENT_DISCONNECTED
    sock.monitor(addr, events)
    mon = ctx.socket(zmq.PAIR)
    mon.connect(addr)
    try:
        while True:
            ev = parse_monitor_message(await mon.recv_multipart())
            where = ev["endpoint"].decode(errors="replace")
            if int(ev["event"]) == zmq.EVENT_DISCONNECTED:
                on_fail(DISCONNECTED, f"a connection to {where} ended")
                continue
            kind = HANDSHAKE_FAILURES.get(int(ev["event"]), "handshake")
            on_fail(kind, f"{kind} failure on {where} (code {ev['value']})")
    finally:
        if not sock.closed:
            sock.disable_monitor()
        mon.close(linger=0)


def load_keypair(path: str, what: str) -> tuple[bytes, bytes]:
    """A CURVE key pair written by ``transferd keygen`` (``NAME.key_secret``)."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: cannot read CURVE key file {path}: {exc}") from None
    if not secret:
        raise ConfigError(f"{what}: {path} holds no secret key (use the .key_secret file from transferd keygen)")
    return public, secret


def load_public_key(path: str, what: str) -> bytes:
    import zmq.auth

    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: cannot read CURVE public key {path}: {exc}") from None
    return public


def is_wildcard(endpoint: str) -> bool:
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    return host in ("*", "0.0.0.0", "[::]", "::")
