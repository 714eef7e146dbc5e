"""Reads on worker threads, for every plane whose receiver pulls the rows itself: Mooncake TE and
NIXL read out of the sender's registered pool, the same-host plane out of its pool file.

One :class:`Reader` per engine: a bounded queue of :class:`Job` (the reads of one room from one
source), batches of at most ``batch_entries`` entries (and ``batch_bytes`` bytes, when set),
``in_flight`` batches at once on ``threads`` worker threads (the engine releases the GIL), the
results back on the event loop.

* **Abort is a barrier.** A job waiting in the queue is dropped unread once its room is terminal
  (``Job.alive``); :meth:`Reader.settled` and :meth:`Reader.after` resolve when the room's reads
  queued or running have settled, and the receiver answers abort, release and wait — and tells
  the senders the room's ``status`` — only then: after either, no byte of the room is read or
  written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from ...protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
from ...protocol.room import runs
from ...types import PlaneName

log = logging.getLogger(__name__)

STAGING_ROWS = 64  # aux rows read at once (each into a registered staging row)


class ReadEngine(Protocol):
    """What :class:`Reader` needs of an engine (Mooncake TE in ``mooncake.py``, NIXL in
    ``nixl.py``, the same-host plane's :class:`~.same_host.SameHostEngine`)."""

    def register(self, buffers: Sequence[np.ndarray]) -> tuple[int, ...]: ...

    def read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int: ...

    def close(self) -> None: ...


class ReadSink(Protocol):
    """What a reading plane needs of the receiver's data path."""

    core: ReceiverCore

    def data(self, peer: Peer, plane: Any, msg: Any, payload: Any, now: float) -> None: ...

    def landed(self, room: DecodeRoom, how: PlaneName, buffer: int, nbytes: int, now: float) -> None: ...

    def flush(self) -> None: ...


@dataclass(slots=True, eq=False)
class Job:
    """One engine batch: reads of one room from one session."""

    tok: int
    session: str
    local: list[int]
    remote: list[int]
    lens: list[int]
    alive: Callable[[], bool]  # asked before the read starts: False drops it (the room ended)
    done: Callable[[int | None, int], None]  # (engine rc, or None: dropped unread; staging row)
    staging: bool = False  # reads into a staging row (taken when it starts, given back after done)
    nbytes: int = 0  # the bytes it reads (the batch_bytes bound; 0 where the reader has none)


@dataclass(slots=True, eq=False)
class Reader:
    """Every engine read of a receiver: a bounded queue, ``in_flight`` batches at once on worker
    threads (the engine releases the GIL), results back on the event loop."""

    engine: ReadEngine
    batch_entries: int
    in_flight: int
    staging_row_bytes: int
    threads: int = 0  # worker threads of an engine that reads in one call (0: one per batch in flight)
    batch_bytes: int = 0  # bytes per batch at most (0: bounded by entries alone); a job is never split
    thread_name: str = "mooncake-read"
    running: int = 0
    queue: deque[Job] = field(default_factory=deque)
    pending: dict[int, int] = field(default_factory=dict)  # room token -> batches queued or running
    waiters: dict[int, list[Callable[[], None]]] = field(default_factory=dict)
    staging: np.ndarray = field(init=False)
    free_rows: list[int] = field(init=False)
    executor: ThreadPoolExecutor = field(init=False)
    pipelined: bool = field(init=False)
    waiter: ThreadPoolExecutor | None = field(init=False)
    reads: int = 0  # batches the engine ran
    failed: int = 0  # of those, the ones it failed

    def __post_init__(self) -> None:
        # an engine that can start a batch and wait for it apart (Mooncake TE) gets one thread
        # that starts batches and one that waits for the oldest: the engine's wait polls without
        # sleeping, so one waiting thread, not one per batch in flight, spins on the two cores
        self.pipelined = callable(getattr(self.engine, "start", None)) and callable(getattr(self.engine, "wait", None))
        workers = 1 if self.pipelined else (self.threads or self.in_flight)
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix=self.thread_name)
        self.waiter = ThreadPoolExecutor(1, thread_name_prefix=f"{self.thread_name}-wait") if self.pipelined else None
        self.staging = np.zeros((STAGING_ROWS, max(self.staging_row_bytes, 8)), np.uint8)
        self.engine.register([self.staging])
        self.free_rows = list(range(STAGING_ROWS))

    def submit(self, job: Job) -> None:
        self.pending[job.tok] = self.pending.get(job.tok, 0) + 1
        self.queue.append(job)
        self._pump()

    def busy(self, tok: int) -> bool:
        return tok in self.pending

    def after(self, tok: int, fn: Callable[[], None]) -> None:
        """``fn()`` once the room's reads have settled (now, when none is queued or running)."""
        if tok in self.pending:
            self.waiters.setdefault(tok, []).append(fn)
        else:
            fn()

    async def settled(self, tok: int) -> None:
        """Until the room's reads have settled (read, failed, or dropped unread)."""
        if tok in self.pending:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.after(tok, partial(_settle_future, fut))
            await fut

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while self.running < self.in_flight and self.queue:
            batch = self._take()
            if not batch:
                return  # a staging row comes back when a running aux read finishes
            local: list[int] = []
            remote: list[int] = []
            lens: list[int] = []
            for job, _ in batch:
                local += job.local
                remote += job.remote
                lens += job.lens
            self.running += 1
            if self.pipelined:
                self.executor.submit(self._start, loop, batch, local, remote, lens)
                continue
            fut = self.executor.submit(self.engine.read, batch[0][0].session, local, remote, lens)
            fut.add_done_callback(partial(_back_on_loop, loop, self._finished, batch))

    def _start(self, loop: asyncio.AbstractEventLoop, batch: list[tuple[Job, int]], local: list[int],
               remote: list[int], lens: list[int]) -> None:
        """(The starting thread.) Submit the batch, then queue the wait for it behind the waits
        for the batches started before it."""
        assert self.waiter is not None
        engine: Any = self.engine
        try:
            bid = int(engine.start(batch[0][0].session, local, remote, lens))
        except Exception as exc:  # the binding raised: the wait reports it as the engine's failure
            log.error("engine read from %s could not start: %r", batch[0][0].session, exc)
            bid = 0
        fut = self.waiter.submit(engine.wait, bid)
        fut.add_done_callback(partial(_back_on_loop, loop, self._finished, batch))

    def _take(self) -> list[tuple[Job, int]]:
        """The next engine batch: queued jobs of one session, in order, as many as fit in
        ``batch_entries`` (small rooms' runs share a batch); a job of a room that ended is
        dropped unread on the way (the barrier); an aux job takes a staging row."""
        batch: list[tuple[Job, int]] = []
        entries = nbytes = 0
        while self.queue:
            job = self.queue[0]
            if not job.alive():  # the barrier: no new read for a room that ended
                self.queue.popleft()
                job.done(None, -1)
                self._settle(job.tok)
                continue
            if batch and (job.session != batch[0][0].session or entries + len(job.lens) > self.batch_entries
                          or (self.batch_bytes and nbytes + job.nbytes > self.batch_bytes)):
                break
            row = -1
            if job.staging:
                if not self.free_rows:
                    break
                row = self.free_rows.pop()
                job.local = [int(self.staging[row].ctypes.data)]
            self.queue.popleft()
            batch.append((job, row))
            entries += len(job.lens)
            nbytes += job.nbytes
        return batch

    def _finished(self, batch: list[tuple[Job, int]], fut: Future[int]) -> None:
        self.running -= 1
        self.reads += 1
        try:
            rc = fut.result()
        except Exception as exc:  # the binding raised: report it as the engine's failure
            log.error("engine read from %s raised %r", batch[0][0].session, exc)
            rc = -1
        if rc != 0:
            self.failed += 1
        try:
            for job, row in batch:  # one engine batch: one outcome for every job in it
                try:
                    job.done(rc, row)
                finally:
                    if row >= 0:
                        self.free_rows.append(row)
                    self._settle(job.tok)
        finally:
            self._pump()

    def _settle(self, tok: int) -> None:
        left = self.pending[tok] - 1
        if left:
            self.pending[tok] = left
            return
        del self.pending[tok]
        for fn in self.waiters.pop(tok, ()):
            fn()

    def drop_queued(self) -> None:
        """The receiver stops: no read starts any more (on the loop)."""
        while self.queue:
            job = self.queue.popleft()
            job.done(None, -1)
            self._settle(job.tok)

    def close(self) -> None:
        """Wait for the reads in flight (they write into the pool), then release the engine's
        memory (blocking: in a worker thread, after :meth:`drop_queued`)."""
        self.executor.shutdown(wait=True)  # every batch started has queued its wait by then
        if self.waiter is not None:
            self.waiter.shutdown(wait=True)
        self.engine.close()


def _settle_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _back_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[list[tuple[Job, int]], Future[int]], None],
                  batch: list[tuple[Job, int]], fut: Future[int]) -> None:
    loop.call_soon_threadsafe(fn, batch, fut)


def live(room: DecodeRoom) -> bool:
    return not room.status.state.terminal


@dataclass(slots=True, eq=False)
class Refs:
    """What ``source`` checked: the room, the peer and the source rows of one message."""

    room: DecodeRoom
    peer: Peer
    rows: np.ndarray


def run_entries(dst: np.ndarray, first: int, rows: np.ndarray | None, count: int, src_rows: np.ndarray,
                row_bytes: int, remote_base: int) -> tuple[list[int], list[int], list[int]]:
    """The reads of one claimed message, one entry per run of rows consecutive on both sides:
    destination addresses in ``dst`` (at ``first`` onward, or at ``rows``), source positions
    ``remote_base + src_row × row_bytes`` (an address in the peer's registered memory, or an
    offset in its pool file), and lengths."""
    dst_rows = np.arange(first, first + count, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    local_base = int(dst.ctypes.data)
    local: list[int] = []
    remote: list[int] = []
    lens: list[int] = []
    for a, e in runs(src_rows, dst_rows):
        local.append(local_base + int(dst_rows[a]) * row_bytes)
        remote.append(remote_base + int(src_rows[a]) * row_bytes)
        lens.append((e - a) * row_bytes)
    return local, remote, lens


def read_ended(sink: ReadSink, room: DecodeRoom, peer: Peer, how: PlaneName, buffer: int, nbytes: int,
               rc: int | None, row: int = -1, *,
               failed: Callable[[DecodeRoom, Peer, int, int, float], None]) -> None:
    """A job's outcome, on the loop (every reading plane's ``Job.done``): the rows landed (rc 0),
    or ``failed`` says why the room fails; nothing when the job was dropped unread (rc None) or
    its room ended meanwhile."""
    sink.core.stream_read(room, peer.rank, -1)
    if rc is None or room.status.state.terminal:
        return  # dropped unread, or the room ended meanwhile: nothing more of it counts
    now = time.monotonic()
    if rc == 0:
        sink.landed(room, how, buffer, nbytes, now)
    else:
        failed(room, peer, rc, nbytes, now)
    sink.flush()
