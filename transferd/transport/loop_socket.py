"""ZeroMQ plumbing shared by the agents: socket options, ``ipc://`` endpoints, and :class:`LoopSocket`."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio

from .turns import wake_first

log = logging.getLogger(__name__)

# pyzmq's constants are enum members: ``events & zmq.POLLIN`` builds a new IntFlag (≈ 2 µs on
# Python 3.11), ``zmq.SNDMORE | flags`` one too (≈ 1 µs), per message; the hot paths below use
# plain ints (docs/PERFORMANCE.md, "Small rooms against d6fb2c2")
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def prepare_socket_path(path: Path) -> None:
    """Create a socket file's directory, private to this user (0700), and remove a stale socket
    from a previous run (binding would otherwise fail or hijack)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists():
        path.unlink()


def restrict_socket_path(path: Path) -> None:
    """Make a socket file readable and writable by its owner only (0600)."""
    if path.exists():
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


def prepare_ipc(endpoint: str) -> None:
    """:func:`prepare_socket_path` for an ``ipc://`` endpoint."""
    path = ipc_path(endpoint)
    if path is not None:
        prepare_socket_path(path)


def restrict_ipc(endpoint: str) -> None:
    """:func:`restrict_socket_path` for an ``ipc://`` endpoint."""
    path = ipc_path(endpoint)
    if path is not None:
        restrict_socket_path(path)


def configure(sock: zmq.Socket[Any], *, hwm: int = 0) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if hwm:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)


class LoopSocket:
    """A ZeroMQ socket driven by the event loop straight from its file descriptor.

    pyzmq's asyncio sockets make a Future per message, look the running loop up (a ``getpid()``
    system call on Python 3.11) and touch the poller for every send: most of a sender's CPU at
    1 MiB messages. Here the messages that arrived are drained in a loop and handed to
    ``on_message`` (at most ``budget`` per loop iteration, so timers and the engine API keep
    their turn); ``try_send`` sends at once and ``writable`` waits only while the high-water mark
    holds a message back. When the socket takes messages again, the first waiter alone is woken,
    and each message the socket takes wakes the next (with a hundred rooms behind a full pipe,
    waking all of them to find it full again was a hundred wake-ups a message); a woken waiter
    that will not send calls ``pass_on``.

    ZeroMQ's descriptor is edge-triggered and any operation on the socket may consume its signal:
    after every send the socket's events are looked at again on the next loop iteration
    (``kick``), and the reader never goes back to sleep before ``EVENTS`` says there is nothing
    left to read.
    """

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[Any]], None], name: str, *,
                 copy: bool = True, budget: int = 64) -> None:
        self.sock = sock
        self.on_message = on_message
        self.name = name
        self.copy = copy
        self.budget = budget
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._scheduled = False
        self._paused: asyncio.TimerHandle | None = None
        self.loop.add_reader(self._fd, self._on_ready)
        self.kick()

    def kick(self, took: bool = False) -> None:
        """Look at the socket's events again on the next loop iteration: after every operation on
        the socket (this class's sends, and any made outside it). ``took``: the operation was a
        message the socket took, so the next waiter tries too, without waiting for that look."""
        if took and self._waiters:
            self._wake_one()
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self.loop.call_soon(self._on_ready)

    def _on_ready(self) -> None:
        self._scheduled = False
        sock = self.sock
        n = 0
        while not self.closed:
            events = cast(int, sock.getsockopt(_EVENTS))
            if events & _POLLOUT and self._waiters:
                self._wake_one()
            if not events & _POLLIN or self._paused is not None:
                return
            if n >= self.budget:
                self.kick()  # more to read: after the other callbacks of this iteration
                return
            try:
                frames = self._recv()
            except zmq.Again:
                return
            n += 1
            try:
                self.on_message(frames)
            except Exception:  # the handler's bug must not stop the socket for every peer
                log.exception("%s: error while handling a message", self.name)

    def _wake_one(self) -> None:
        wake_first(self._waiters)

    def pass_on(self) -> None:
        """A woken waiter that will not send after all (its room stopped): the next one gets the
        turn if the socket still has room, so none is left waiting on a pipe with room in it."""
        self.kick()

    def _recv(self) -> list[Any]:
        """One whole message, as ``recv_multipart(NOBLOCK)`` gives it (a multipart message
        arrives whole: only its first part can be missing), without pyzmq's option lookup per
        part (a frame knows whether more follow)."""
        sock = self.sock
        if self.copy:
            parts: list[Any] = [sock.recv(_NOBLOCK)]
            while sock.getsockopt(_RCVMORE):
                parts.append(sock.recv(_NOBLOCK))
            return parts
        frame = sock.recv(_NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = sock.recv(_NOBLOCK, copy=False)
            frames.append(frame)
        return frames

    def pause(self, seconds: float) -> None:
        """Read nothing for ``seconds`` (fault injection: a slow decode side)."""
        if self._paused is None and not self.closed:
            self._paused = self.loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self._paused = None
        self.kick()

    def try_send(self, frames: list[Any], *, copy: bool = True) -> bool:
        """Send at once; False (nothing sent) when the high-water mark holds the message back.
        Other ZeroMQ errors (an unknown peer on a ROUTER) are raised."""
        sock = self.sock
        took = False
        try:
            if all(type(f) is bytes for f in frames):  # control messages: nothing to check first
                for f in frames[:-1]:
                    sock.send(f, _SNDMORE_NOBLOCK, copy=copy)
                sock.send(frames[-1], _NOBLOCK, copy=copy)
            else:  # pyzmq checks every part is a buffer before it sends any
                sock.send_multipart(frames, _NOBLOCK, copy=copy)
            took = True
            return True
        except zmq.Again:
            return False
        finally:
            self.kick(took)

    async def writable(self) -> None:
        """Wait until the socket may take a message again (or is closed)."""
        if self.closed:
            raise zmq.ZMQError(zmq.ENOTSOCK, f"{self.name}: socket closed")
        fut: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(fut)
        self.kick()
        try:
            await fut
        except asyncio.CancelledError:
            self.kick()  # it may have been woken already: the turn must not end with it
            raise

    async def send(self, frames: list[Any], *, copy: bool = True) -> None:
        """Send, waiting while the high-water mark holds the message back (backpressure)."""
        while not self.try_send(frames, copy=copy):
            await self.writable()

    def close(self, linger: int = 0) -> None:
        if self.closed:
            return
        self.closed = True
        if self._paused is not None:
            self._paused.cancel()
        self.loop.remove_reader(self._fd)
        for w in self._waiters:
            if not w.done():
                w.set_exception(zmq.ZMQError(zmq.ENOTSOCK, f"{self.name}: socket closed"))
        self._waiters.clear()
        self.sock.close(linger=linger)
