"""The Mooncake plane: the receiver reads the rows out of the sender's pool with Mooncake
Transfer Engine (TCP here, RDMA on clusters), after its checks (docs/DATA-PLANES.md,
docs/PROTOCOL.md §5 and "Mooncake Transfer Engine").

Both sides register their pool's buffers with their own engine. ``register`` carries the
sender's engine session id and the address of each buffer; ``registered.te`` says the receiver
will read. Then the sender sends exactly what the same-host path sends — data-refs messages
naming the source rows of each run, then ``done`` on its ZeroMQ socket — and the receiver pulls:

* **The receiver decides what is written.** A data-refs message passes the core's room checks,
  its rows are checked against the sender's buffer, its destination rows claimed by the core
  (the plan, duplicates), and only then read by the engine straight into those rows. The aux
  row is read into a registered staging row first; its room guard is checked there and it goes
  the ZeroMQ payload's way (``DataPath.data``) from there.
* **Bounded.** All reads go through one :class:`Reader` per receiver: batches of at most
  ``receiver.mooncake_batch_entries`` (runs consecutive on both sides are one entry; queued
  reads of one sender share a batch up to that many) and at most
  ``receiver.mooncake_reads_in_flight`` batches at once, so the engine's queue never holds more
  than 2,048 entries (its TCP transport rejects a whole batch once its queue is full).
* **Abort is a barrier.** A batch waiting in the queue is dropped once its room is terminal (no
  new read); ``Reader.settled`` resolves when the room's reads in flight have finished, and the
  receiver answers abort, release and wait only then. A ``done`` that arrives while reads of its
  room are in flight is handed to the core after they settle (``Reader.after``).
* **Honest.** A read the engine fails (or times out: ``MC_TRANSFER_TIMEOUT``) fails the room
  with ``transport_error``, naming the peer and the engine's return code.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ...errors import ConfigError, FailureCode, TransferdError
from ...protocol.messages import DataRef, DataRefs
from ...protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
from ...types import Kind, PlaneName
from .reads import Job, Reader, ReadSink, Refs, live, read_ended, run_entries
from .same_host import SameHostSender, ref_rows

log = logging.getLogger(__name__)

# -- the engine --------------------------------------------------------------------------------

class MooncakeEngine:
    """One Mooncake Transfer Engine (P2P handshake, no metadata server) and the pool buffers
    registered with it."""

    def __init__(self, hostname: str, protocol: str, device: str) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines: several per peer; set it to see them
        try:
            engine_mod: Any = importlib.import_module("mooncake.engine")
        except ImportError as exc:
            raise ConfigError(f"data_plane = \"mooncake\" needs Mooncake Transfer Engine: pip install "
                              f"'transferd[mooncake]' (and Debian's libibverbs1): {exc}") from exc
        self.te = engine_mod.TransferEngine()
        rc = self.te.initialize(hostname, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferdError(f"Mooncake TransferEngine.initialize({hostname!r}, \"P2PHANDSHAKE\", {protocol!r}, "
                                 f"{device!r}) returned {rc}")
        self.session = f"{hostname}:{self.te.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, buffers: Sequence[np.ndarray]) -> tuple[int, ...]:
        """Register each buffer (every one that has bytes); the address of each one's first row."""
        addrs = tuple(int(b.ctypes.data) for b in buffers)
        for addr, b in zip(addrs, buffers):
            if b.nbytes:
                rc = self.te.register_memory(addr, b.nbytes)
                if rc != 0:
                    raise TransferdError(f"Mooncake register_memory of {b.nbytes} bytes at {addr:#x} returned {rc}")
                self._registered.append(addr)
        return addrs

    def read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        """One batch of reads from ``session`` (blocking, the GIL released): 0 or the engine's
        negative return code."""
        return int(self.te.batch_transfer_sync_read(session, local, remote, lens))

    def start(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        """Submit one batch of reads (the GIL released, returns once queued): its batch id, or
        0 when the engine refused it (it answers -1 as an unsigned id when it cannot open the
        peer's segment)."""
        bid = int(self.te.batch_transfer_async_read(session, local, remote, lens))
        return 0 if bid in (-1, (1 << 64) - 1) else bid

    def wait(self, bid: int) -> int:
        """Until a started batch has completed (the engine polls its status, the GIL released):
        0, or -1 when it failed, timed out or never started."""
        return int(self.te.get_batch_transfer_status([bid])) if bid else -1

    def close(self) -> None:
        """Unregister the buffers (a peer's read of them fails from now on)."""
        for addr in self._registered:
            self.te.unregister_memory(addr)
        self._registered.clear()


def local_hostname(configured: str, peer_endpoint: str) -> str:
    """The address peers reach this engine at: ``configured``, else the address of the local
    interface that routes to ``peer_endpoint``'s host (``tcp://host:port``)."""
    if configured:
        return configured
    host = peer_endpoint.rpartition("://")[2].rpartition(":")[0].strip("[]")
    if host in ("", "*", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet leaves: this only asks the routing table
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


# -- sender side -------------------------------------------------------------------------------

class MooncakeSender(SameHostSender):
    """Data-refs (the same-host plane's messages); the receiver reads the rows they name with
    its engine. ``done`` follows them on the ZeroMQ socket."""

    name = PlaneName.MOONCAKE

    def _count(self, nbytes: int) -> None:
        self.env.counters.mooncake_bytes += nbytes


# -- receiver side -----------------------------------------------------------------------------

class _Staged:
    """The aux row, read into a staging row: it continues as a ZeroMQ payload would (the
    room's checks again, the guard, the claim, one copy), counted as the reading plane's."""

    def __init__(self, row_bytes: list[int], name: PlaneName = PlaneName.MOONCAKE) -> None:
        self._row_bytes = row_bytes
        self.name = name

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: Any, payload: Any,
               now: float) -> Any | None:
        return payload  # its length is the message's rows by construction

    def first_row(self, msg: Any, src: Any) -> Any:
        return src

    def write(self, msg: Any, dst: np.ndarray, first: int, rows: np.ndarray | None, src: Any) -> bool:
        data = np.frombuffer(src, dtype=np.uint8).reshape(msg.count, self._row_bytes[msg.buffer])
        if rows is None:
            dst[first:first + msg.count] = data
        else:
            dst[rows] = data
        return True

    def close(self) -> None:
        pass


class MooncakeReceiver:
    """One peer's rows, read out of its pool by this receiver's engine."""

    name = PlaneName.MOONCAKE

    def __init__(self, reader: Reader, sink: ReadSink, session: str, addrs: tuple[int, ...],
                 row_bytes: list[int], n_rows: list[int], label: str) -> None:
        self.reader = reader
        self.sink = sink
        self.session = session
        self.addrs = addrs
        self.row_bytes = row_bytes
        self.n_rows = n_rows
        self.label = label
        self.staged = _Staged(row_bytes, self.name)

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, payload: Any,
               now: float) -> Refs | None:
        src_rows = ref_rows(core, room, peer, msg, payload, self.n_rows[msg.buffer], now)
        if src_rows is None:
            return None
        if msg.kind == Kind.AUX:  # its guard is read first: into a staging row, then on as a payload
            self._stage(room, peer, msg, src_rows)
            return None
        return Refs(room, peer, src_rows)

    def first_row(self, msg: Any, src: Any) -> Any:
        raise AssertionError("the aux row of an engine plane is staged, never read in place")

    def write(self, msg: DataRef | DataRefs, dst: np.ndarray, first: int, rows: np.ndarray | None,
              src: Refs) -> bool:
        """Queue the engine reads of the claimed rows; they land later (False)."""
        local, remote, lens = run_entries(dst, first, rows, msg.count, src.rows, self.row_bytes[msg.buffer],
                                          self.addrs[msg.buffer])
        room, rank = src.room, src.peer.rank
        step = self.reader.batch_entries
        for i in range(0, len(lens), step):
            self.sink.core.stream_read(room, rank, +1)
            part = lens[i:i + step]
            self.reader.submit(Job(room.tok, self.session, local[i:i + step], remote[i:i + step], part,
                                    partial(live, room),
                                    self._landed_fn(room, src.peer, msg.buffer, sum(part))))
        return False

    def _landed_fn(self, room: DecodeRoom, peer: Peer, buffer: int, nbytes: int) -> Callable[[int | None, int], None]:
        return partial(read_ended, self.sink, room, peer, self.name, buffer, nbytes, failed=self._failed)

    def _failed(self, room: DecodeRoom, peer: Peer, rc: int, nbytes: int, now: float) -> None:
        self.sink.core.reject(room, peer, FailureCode.TRANSPORT_ERROR, self._failure(rc, nbytes), now)

    def _failure(self, rc: int, nbytes: int) -> str:
        """The reason a failed read gives its room (the engine's own words where it has them)."""
        return f"Mooncake TE read of {nbytes} bytes from {self.session} ({self.label}) failed: the engine returned {rc}"

    def _stage(self, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, src_rows: np.ndarray) -> None:
        """Read the aux row into a staging row; then it goes on as a payload (``DataPath.data``)."""
        rb = self.row_bytes[msg.buffer]
        if msg.count != 1 or rb > self.reader.staging.shape[1]:
            self.sink.core.reject(room, peer, FailureCode.UNEXPECTED, f"aux data-refs of {msg.count} rows of {rb} "
                                                                      "bytes (one row of the aux buffer is read)",
                                  time.monotonic())
            return
        core = self.sink.core
        core.stream_read(room, peer.rank, +1)

        def staged(rc: int | None, row: int) -> None:
            core.stream_read(room, peer.rank, -1)
            if rc is None or room.status.state.terminal:
                return
            now = time.monotonic()
            if rc == 0:
                self.sink.data(peer, self.staged, msg, self.reader.staging[row, :rb].data, now)
            else:
                self._failed(room, peer, rc, rb, now)
            self.sink.flush()
        self.reader.submit(Job(room.tok, self.session, [], [self.addrs[msg.buffer] + int(src_rows[0]) * rb], [rb],
                                partial(live, room), staged, staging=True))

    def close(self) -> None:
        pass  # the reader and the engine belong to the receiver; the peer's reads settle there
