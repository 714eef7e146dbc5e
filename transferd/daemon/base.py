"""What both agents share: the asyncio (uvloop) lifecycle, and running in a thread in-process."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import zmq.asyncio

from ..errors import DaemonError, Draining
from .metrics import AgentMetrics
from .notify import notify_socket, sd_notify, watchdog_interval_s

log = logging.getLogger(__name__)
T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a core dependency; keep running without it
        return asyncio.new_event_loop()


class AgentBase:
    """``serve()`` runs until ``stop()``; subclasses implement ``_start()``/``_close()``."""

    name = "agent"
    metrics_bind = ""
    metrics_port_offset = 0
    drain_timeout_s = 30.0

    def __init__(self) -> None:
        self.ctx: zmq.asyncio.Context | None = None
        self.zctx: zmq.Context[Any] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started = threading.Event()
        self.ready: asyncio.Event | None = None  # set when bound (receiver) / registered (sender)
        self.draining = False
        self.metrics = AgentMetrics(self.metric_snapshot)
        self.t_start = time.time()

    # -- what subclasses report ------------------------------------------------------------
    def live_rooms(self) -> int:
        raise NotImplementedError

    def status_line(self) -> str:
        raise NotImplementedError

    def metric_snapshot(self) -> dict[str, Any]:
        raise NotImplementedError

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise Draining(f"{self.name} is shutting down and takes no new rooms")

    async def _start(self) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        raise NotImplementedError

    def spawn(self, coro: Awaitable[Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(f"{self.name}:{what}")
        task.add_done_callback(self._task_done)
        self._tasks.add(task)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s: task %s crashed: %r", self.name, task.get_name(), exc, exc_info=exc)
            self.stop()

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self.ready = asyncio.Event()
        self.ctx = zmq.asyncio.Context()
        self.zctx = zmq.Context.shadow(self.ctx.underlying)  # plain sockets of the same context (LoopSocket)
        try:
            await self._start()
            if self.metrics_bind:
                self.metrics.serve(self.metrics_bind, self.metrics_port_offset)
            if notify_socket():  # run by systemd (Type=notify); else the loop would wake for nothing
                self.spawn(self._notify_loop(), "notify")
            self.started.set()
            await self._stop_event.wait()
        finally:
            sd_notify("STOPPING=1")
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close()
            self.metrics.close()
            self.ctx.destroy(linger=0)
            self._after_context()
            self.started.set()

    def _after_context(self) -> None:
        """Runs once the ZeroMQ context is terminated: no I/O thread reads memory any more."""

    async def _notify_loop(self) -> None:
        """systemd: READY=1 once ready, then STATUS= lines, and WATCHDOG=1 pings from this event
        loop (so a stuck loop is restarted by systemd) when the unit sets WatchdogSec."""
        assert self.ready is not None
        await self.ready.wait()
        sd_notify(f"READY=1\nSTATUS={self.status_line()}\nMAINPID={os.getpid()}")
        interval = watchdog_interval_s()
        while True:
            await asyncio.sleep(min(interval or 5.0, 5.0))
            sd_notify(("WATCHDOG=1\n" if interval else "") + f"STATUS={self.status_line()}")

    async def drain(self) -> None:
        """SIGTERM: take no new rooms, let rooms in flight finish for up to ``drain_timeout_s``,
        then stop (the rest fail with "shutting down")."""
        if self.draining:
            self.stop()  # a second signal: stop now
            return
        self.draining = True
        sd_notify(f"STOPPING=1\nSTATUS=draining {self.live_rooms()} rooms")
        deadline = time.monotonic() + self.drain_timeout_s
        while self.live_rooms() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.live_rooms():
            log.warning("%s: drain timeout (%.0fs): failing %d rooms still in flight", self.name,
                        self.drain_timeout_s, self.live_rooms())
        self.stop()

    def stop(self) -> None:
        """Ask ``serve()`` to return; safe from any thread."""
        loop, ev = self.loop, self._stop_event
        if loop is None or ev is None:
            return
        try:
            loop.call_soon_threadsafe(ev.set)
        except RuntimeError:  # loop already closed
            pass

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 30.0) -> T:
        """Run ``fn(*args)`` on the agent's loop from another thread and return its result
        (awaiting it when it returns an awaitable) — the in-process engine API."""
        assert self.loop is not None, "agent is not running"

        async def run() -> T:
            out = fn(*args)
            if asyncio.iscoroutine(out) or isinstance(out, asyncio.Future):
                return cast(T, await out)
            return out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)


class AgentThread:
    """Run an agent in a background thread of this process (library use, tests)."""

    def __init__(self, agent: AgentBase) -> None:
        self.agent = agent
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"transferd-{agent.name}", daemon=True)

    def _run(self) -> None:
        loop = new_event_loop()
        try:
            loop.run_until_complete(self.agent.serve())
        except BaseException as exc:  # reported by start()/stop()
            self.error = exc
            self.agent.started.set()
        finally:
            loop.close()

    def start(self, timeout: float = 30.0) -> AgentThread:
        self.thread.start()
        if not self.agent.started.wait(timeout):
            raise DaemonError(f"{self.agent.name} did not start within {timeout}s")
        if self.error is not None:
            raise self.error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.agent.stop()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise DaemonError(f"{self.agent.name} did not stop within {timeout}s")
        if self.error is not None:
            raise self.error

    def __enter__(self) -> AgentThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
