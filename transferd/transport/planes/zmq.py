"""The ZeroMQ data plane: rows as payload frames of data and data-batch messages on the
connection's DEALER socket (docs/PROTOCOL.md §2, §4, §6).

Sender side (:class:`ZmqSender`): a room's rows go in runs that are consecutive in both the
source and the destination, each run cut into pieces of at most ``max_message_bytes``. A piece
of more than half a message is a data message of its own; smaller ones gather in the room's
batch, sent as one data-batch message when the next would overflow it (bytes or
``MAX_BATCH_ENTRIES``), at a chunk's end and before done. Each message is held back until the
next one is ready, so that a room's last one and its ``done`` go as one data-done message (a
rank-room then ends with one message, not two). The data stream plane
(:mod:`.stream`) frames the very same messages, so it inherits all of this and replaces only
``_emit``.

Receiver side (:class:`ZmqReceiver`): the payload frame of each data message (or data-batch
entry) is checked for its length and checksum, then copied into the claimed rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...protocol.messages import MAX_BATCH_ENTRIES, Data, DataBatch, DataDone, Done, encode
from ...protocol.room import runs
from ...types import KIND_LABELS, Kind, PlaneName
from .receiving import PayloadReceiver
from .sending import BURST, SENT_STREAM, SENT_ZMQ, ConnPipes, Piece, RoomTx, SendEnv


class ZmqSender:
    """Rows as ZeroMQ frames: zero-copy out of the pool (``zerocopy.PoolSender`` where libzmq is
    reachable, else pyzmq frames)."""

    name = PlaneName.ZMQ

    def __init__(self, env: SendEnv, pipes: ConnPipes) -> None:
        self.env = env
        self.pipes = pipes
        self.link = pipes.link
        self.zc = pipes.rows
        self.rows = env.rows
        self.row_bytes = env.row_bytes
        self.cap = env.max_message_bytes
        self.bytes_sent = 0

    # -- the plane's interface -----------------------------------------------------------------
    async def send_rows(self, tx: RoomTx, kind: Kind, buffers: tuple[int, ...], src: np.ndarray,
                        dst: np.ndarray, base: int) -> None:
        pieces = runs(src, dst)
        cap, room = self.cap, tx.room
        for b in buffers:
            step = max(1, cap // self.row_bytes[b])
            for a, e in pieces:
                for p in range(a, e, step):
                    if room.stopped:
                        return  # aborted or failed: stop sending this room at once
                    count, row = min(step, e - p), int(src[p])
                    if not self._join(tx, kind, b, base + p, count, row):  # no coroutine for what the batch takes
                        await self._send(tx, kind, b, base + p, count, row)

    async def end_chunk(self, tx: RoomTx) -> None:
        await self._emit_batch(tx)
        held, tx.held = tx.held, []
        if held and not tx.room.stopped:
            await self._send_pieces(tx, held)

    async def send_done(self, tx: RoomTx, done: Done) -> None:
        room = tx.room
        await self._emit_batch(tx)
        if room.stopped:
            return
        room.handed = True
        held, tx.held = tx.held, []
        if held:  # the last data and the done: one data-done message
            await self._send_pieces(tx, held, done)
        else:
            await self._emit(tx, encode(done))

    async def _emit_batch(self, tx: RoomTx) -> None:
        pieces, tx.batch, tx.batch_bytes = tx.batch, [], 0
        if pieces and not tx.room.stopped:
            await self._emit_pieces(tx, pieces)

    def discard(self, tx: RoomTx) -> None:
        tx.batch.clear()  # entries not sent: nothing of a stopped room leaves any more
        tx.batch_bytes = 0
        tx.held.clear()

    def close(self) -> None:
        pass  # the socket belongs to the connection

    # -- runs -> messages ------------------------------------------------------------------------
    def _join(self, tx: RoomTx, kind: Kind, buffer: int, pos: int, count: int, src_row: int) -> bool:
        """Rows of one run as an entry of the room's batch, when they take at most half a message
        and the batch has room for them: True (nothing to send yet; scattered 64 KiB rows are 128
        entries of an 8 MiB stream record); False leaves them to :meth:`_send`."""
        nbytes = count * self.row_bytes[buffer]
        batch, cap = tx.batch, self.cap
        if 2 * nbytes > cap or tx.batch_bytes + nbytes > cap or len(batch) >= MAX_BATCH_ENTRIES:
            return False
        tx.room.handed = True
        piece = self._piece(tx, kind, buffer, pos, count, src_row)
        if piece is not None:
            batch.append(piece)
            tx.batch_bytes += nbytes
        return True

    async def _send(self, tx: RoomTx, kind: Kind, buffer: int, pos: int, count: int, src_row: int) -> None:
        """Rows of one run that :meth:`_join` did not take: a message of their own when they fill
        more than half a message, else the first entry of a new batch once the full one is sent
        (batches also go at a chunk's end and before done)."""
        room = tx.room
        room.handed = True
        if 2 * count * self.row_bytes[buffer] > self.cap:
            piece = self._piece(tx, kind, buffer, pos, count, src_row)
            if piece is not None:
                await self._emit_pieces(tx, [piece])
            return
        await self._emit_batch(tx)  # the batch is full: send it (held back), then this entry starts the next
        if not room.stopped:
            self._join(tx, kind, buffer, pos, count, src_row)

    def _piece(self, tx: RoomTx, kind: Kind, buffer: int, pos: int, count: int, src_row: int) -> Piece | None:
        """One data entry: its header fields and payload rows (a copy only for a corrupting
        fault); None when a fault drops it."""
        env = self.env
        payload = self.rows[buffer][src_row:src_row + count]
        csum = env.checksum(payload) if env.checksum is not None else None
        copied = False
        if env.faults_on:
            x = env.fault_rng.random()
            if x < env.faults.drop_frames:
                env.counters.dropped["fault_drop_frame"] += 1
                return None
            if x < env.faults.drop_frames + env.faults.corrupt_frames:
                env.counters.dropped["fault_corrupt_frame"] += 1
                payload, copied = payload.copy(), True
                flat = payload.reshape(-1)
                flat[env.fault_rng.randrange(flat.size)] ^= 0xFF
        return Data(tx.tok, kind, buffer, pos, count, csum), payload, copied

    async def _emit_pieces(self, tx: RoomTx, pieces: list[Piece]) -> None:
        """One message's entries: held back until the next message is ready (then sent first),
        so that the room's last one can carry its ``done`` (``send_done``); ``end_chunk`` sends
        it otherwise."""
        held, tx.held = tx.held, pieces
        if held:
            await self._send_pieces(tx, held)

    async def _send_pieces(self, tx: RoomTx, pieces: list[Piece], done: Done | None = None) -> None:
        entries = tuple(d for d, _, _ in pieces)
        if done is not None:
            header = encode(DataDone(tx.tok, entries, done))
        else:
            header = encode(entries[0] if len(entries) == 1 else DataBatch(tx.tok, entries))
        # rows of the pool go out with no reference kept (zerocopy.py); a fault's corrupted copy
        # (and every payload where libzmq is not reachable) as pyzmq frames — memoryviews, not
        # ndarrays: pyzmq formats repr() of what it queues (~30 µs for an array)
        direct = self.zc is not None and not any(c for _, _, c in pieces)
        nbytes = sum(p.nbytes for _, p, _ in pieces)
        if direct:  # the payload frames are the rows' addresses: no pyzmq frame objects to build
            sent = await self._emit(tx, header, [p for _, p, _ in pieces], nbytes, rows=True)
        else:
            sent = await self._emit(tx, header, [p.data for _, p, _ in pieces], nbytes)
        if not sent:
            return
        counters = self.env.counters
        for d, payload, _ in pieces:
            counters.add(KIND_LABELS[d.kind], payload.nbytes)
        tx.room.sent += nbytes
        self.bytes_sent += nbytes
        if sent == SENT_STREAM:
            counters.stream_bytes += nbytes

    # -- one message -----------------------------------------------------------------------------
    async def _emit(self, tx: RoomTx, header: bytes, payload: Sequence[Any] = (), nbytes: int = 0, *,
                    rows: bool = False) -> int:
        """Send one message of a room — ``header``, then the ``payload`` buffers (``nbytes`` in
        all) — waiting while the pipe is full: ``SENT_ZMQ``, or 0 (nothing sent) when the room
        stopped meanwhile — nothing of a stopped room leaves after its fail message. ``rows``:
        the payload is rows of the pool (ndarrays), which ZeroMQ gets with no reference kept
        (zerocopy.py); otherwise buffers pyzmq may hold."""
        room, link, zc = tx.room, self.link, self.zc
        while True:
            if rows:
                assert zc is not None
                sent = zc.try_send(header, [(r.ctypes.data, r.nbytes) for r in payload])
                link.kick(sent)
            else:
                sent = link.try_send([header, *payload], copy=False)
            if sent:
                break
            await link.writable()
            if room.stopped:
                link.pass_on()
                return 0
        await self._turn()
        return SENT_ZMQ

    async def _turn(self) -> None:
        """After a message the pipe took at once: every ``BURST`` of them, give the loop a turn."""
        env = self.env
        env.burst += 1
        if env.burst >= BURST:
            env.burst = 0
            await asyncio.sleep(0)


class ZmqReceiver(PayloadReceiver):
    """The payload frames of data and data-batch messages, copied into the rows (one copy)."""

    name = PlaneName.ZMQ
