"""A listening socket's accepts on the event loop, shared by the data stream's server and the
engine API's Unix socket."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ACCEPT_PAUSE_S = 0.1  # out of descriptors: stop accepting for this long


class Acceptor:
    """Accepts up to ``batch`` connections a wake-up and hands each to ``on_conn(sock, addr)``.
    An accept that fails (out of descriptors or memory) leaves the connection queued and the
    socket readable, so accepting stops for ``ACCEPT_PAUSE_S`` instead of spinning."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 on_conn: Callable[[socket.socket, Any], None], what: str, batch: int) -> None:
        self.loop, self.sock, self.on_conn, self.what, self.batch = loop, sock, on_conn, what, batch
        self._paused: asyncio.TimerHandle | None = None
        loop.add_reader(sock.fileno(), self._on_accept)

    def _on_accept(self) -> None:
        for _ in range(self.batch):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("%s: accept failed (%s); not accepting for %gs", self.what, exc, ACCEPT_PAUSE_S)
                self.loop.remove_reader(self.sock.fileno())
                self._paused = self.loop.call_later(ACCEPT_PAUSE_S, self._resume)
                return
            self.on_conn(conn, addr)

    def _resume(self) -> None:
        self._paused = None
        self.loop.add_reader(self.sock.fileno(), self._on_accept)

    def close(self) -> None:
        """Stop accepting (the socket is the caller's to close)."""
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        else:
            self.loop.remove_reader(self.sock.fileno())
