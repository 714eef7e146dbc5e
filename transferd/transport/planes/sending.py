"""The sender side of the data-plane seam: how a connection's rows leave once the sender's core
decided they may (:mod:`transferd.protocol.sender_core`).

A :class:`SenderPlane` belongs to one receiver connection and is chosen when it registers
(``transport/planes/__init__.py`` has the registry): ZeroMQ frames (:mod:`.zmq`), the TCP data
stream (:mod:`.stream`) or same-host row references (:mod:`.same_host`). The send loop hands it a
room's rows per chunk (``send_rows``), then ends the chunk (``end_chunk``: the room's small
pieces go out as one batch), and after the last chunk's rows the room's ``done`` (``send_done``:
the batch too, and where it can the last data with it, as one message). Every method checks
``tx.room.stopped`` between messages: nothing of a stopped room leaves after its fail.

This is the hot path (1 MiB messages at GB/s, small rooms at thousands a second): a plane adds
no allocation per message beyond the header and the payload views, sends the rows zero-copy, and
gives the event loop a turn after every 64 messages the pipe took at once (``SendEnv.burst``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...config import FaultsConfig
from ...layout import PoolLayout
from ...protocol.messages import Data, Done
from ...types import Kind, PlaneName
from ..data_stream import StreamWriter
from ..loop_socket import LoopSocket
from ..zerocopy import PoolSender

SENT_ZMQ, SENT_STREAM = 1, 2  # how a message left (0: not at all, the room stopped)
BURST = 64  # messages sent without waiting before the data path gives the loop a turn anyway

Piece = tuple[Data, np.ndarray, bool]
"""One data entry: its header fields, its payload rows, and whether those are a copy (a fault)."""


class RoomLink(Protocol):
    """What a plane sees of a room (the core's ``SendRoom``)."""

    handed: bool  # set by the plane: something of the room reached it (the abort barrier)
    sent: int  # payload bytes handed over

    @property
    def stopped(self) -> bool: ...


@dataclass(slots=True, eq=False)
class RoomTx:
    """One run of a room's send loop on a plane: its token, its batch of small entries not
    sent yet, and the entries of the message held back until the next one is ready (the
    room's last goes with its ``done``); both empty at the end of a chunk, unless the room
    stopped."""

    room: RoomLink
    tok: int
    batch: list[Piece] = field(default_factory=list)
    batch_bytes: int = 0
    held: list[Piece] = field(default_factory=list)


class SendCounters(Protocol):
    """The agent's counters a plane adds to (``daemon.accounting.Accounting``)."""

    dropped: Counter[str]
    shm_bytes: int
    stream_bytes: int
    mooncake_bytes: int
    nixl_bytes: int

    def add(self, kind: str, nbytes: int) -> None: ...


@dataclass(slots=True, eq=False)
class SendEnv:
    """What every sender plane of an agent shares: the pool, its settings and counters."""

    layout: PoolLayout
    rows: Sequence[np.ndarray]  # the pool's buffers, one row per first index
    counters: SendCounters
    max_message_bytes: int
    shm_message_bytes: int
    stream_record_bytes: int = 0  # the data stream's cap per record (0: max_message_bytes)
    checksum: Callable[[Any], int] | None = None
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    fault_rng: random.Random = field(default_factory=random.Random)
    faults_on: bool = False  # checked per data message: computed once
    burst: int = 0  # messages sent since the data path last gave the loop a turn (all planes)
    row_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.faults_on = self.faults.active
        self.row_bytes = tuple(b.row_bytes for b in self.layout.buffers)


@dataclass(slots=True, eq=False)
class ConnPipes:
    """A connection's sockets, as the shell holds them; a plane reads ``stream`` at every
    message (the shell sets it, and clears it when the stream is dropped or never connected)."""

    name: str
    link: LoopSocket
    rows: PoolSender | None = None  # zero-copy rows without pyzmq's reference keeping (zerocopy.py)
    stream: StreamWriter | None = None


class SenderPlane(Protocol):
    """How one connection's rows leave. Raises ``zmq.ZMQError`` or ``TransferdError`` when it
    cannot send (the room then fails with ``send_error``)."""

    name: PlaneName
    bytes_sent: int  # payload bytes this plane handed over (rows, or row lists on the same host)

    async def send_rows(self, tx: RoomTx, kind: Kind, buffers: tuple[int, ...], src: np.ndarray,
                        dst: np.ndarray, base: int) -> None:
        """Rows ``src`` (pool rows, in position order) of each buffer for room positions
        ``base, base + 1, …``, whose destination rows are ``dst`` (runs consecutive on both
        sides move as one block)."""

    async def end_chunk(self, tx: RoomTx) -> None:
        """Send what waits in the room's batch (at a chunk's end, and before done)."""

    async def send_done(self, tx: RoomTx, done: Done) -> None:
        """What waits in the room's batch, then the room's ``done``, on the same channel as its
        data and after all of it (nothing when the room stopped)."""

    def discard(self, tx: RoomTx) -> None:
        """The room stopped: drop its unsent batch."""

    def close(self) -> None:
        """The connection's registration ended: release what the plane holds."""


SenderPlaneFactory = Callable[[SendEnv, ConnPipes], SenderPlane]
