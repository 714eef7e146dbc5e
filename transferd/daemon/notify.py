"""The systemd notify protocol (sd_notify(3)): datagrams to ``$NOTIFY_SOCKET``."""

from __future__ import annotations

import os
import socket


def notify_socket() -> str:
    """``$NOTIFY_SOCKET``: where notifications go, or "" when not run by systemd with ``Type=notify``."""
    return os.environ.get("NOTIFY_SOCKET", "")


def sd_notify(message: str) -> bool:
    """Send one notification; a no-op (False) when not run by systemd with ``Type=notify``."""
    addr = notify_socket()
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


def watchdog_interval_s() -> float | None:
    """Half of ``$WATCHDOG_USEC`` when the watchdog is meant for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None
