"""A room's send loop: what the sender's core lets out, handed to the connection's data plane.

Per chunk: the KV rows of this rank's plan; after the last chunk, the state rows of the
components it sends, the aux row (rank 0), then the batch and ``done`` — each through the plane of
the connection the room's assign came on (``transport/planes``). The core checks each chunk
before it is sent (``next_chunk``) and hears of a send error (``send_failed``)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import zmq

from ..daemon.accounting import Accounting
from ..errors import TransferdError
from ..layout import PoolLayout
from ..protocol.messages import Done
from ..protocol.sender_core import Chunk, SenderCore, SendRoom
from ..transport.planes import RoomTx, SenderPlane
from ..types import Kind
from .conn import Connections

_NO_ROWS = np.empty(0, np.int64)


class RoomSender:
    def __init__(self, name: str, rank: int, layout: PoolLayout, core: SenderCore, conns: Connections,
                 acct: Accounting, spawn: Callable[[Awaitable[Any], str], Any], act: Callable[[], None]) -> None:
        self.name = name
        self.rank = rank
        self.layout = layout
        self.core = core
        self.conns = conns
        self.acct = acct
        self.spawn = spawn
        self.act = act
        self._comp_of = tuple(b.component for b in layout.buffers)
        self._row_bytes = layout.buffer_row_bytes

    def pump(self, room_id: int) -> None:
        """Start the room's send loop (the core said ``Pump``: it is assigned and has chunks)."""
        room = self.core.rooms[room_id]
        self.spawn(self._send_room(room), f"room {room_id}")

    async def _send_room(self, room: SendRoom) -> None:
        core = self.core
        assert room.conn is not None
        conn = self.conns.conns[int(room.conn)]
        tx = RoomTx(room, room.tok)
        plane = conn.plane
        try:
            while True:
                chunk = core.next_chunk(room, time.monotonic())
                if chunk is None:
                    break
                plane = conn.plane  # a new registration may have chosen another
                await self._send_kv(plane, tx, room, chunk)
                if not chunk.last:
                    await plane.end_chunk(tx)  # the next chunk may come much later
                if chunk.last and not room.stopped:
                    await self._send_last(plane, tx, room, chunk)
        except (zmq.ZMQError, TransferdError) as exc:
            core.send_failed(room, f"{self.name} could not send: {exc}", time.monotonic())
        finally:
            if room.stopped:
                plane.discard(tx)
        core.send_finished(room)  # not when cancelled: the agent is stopping
        self.act()

    async def _send_kv(self, plane: SenderPlane, tx: RoomTx, room: SendRoom, chunk: Chunk) -> None:
        plan = room.plan
        assert plan is not None and room.dst is not None
        lo, hi = plan.chunk_range(chunk.start, chunk.end)
        if lo >= hi or not plan.kv_buffers:
            return
        src = chunk.src[lo - chunk.start:hi - chunk.start]
        await plane.send_rows(tx, Kind.KV, plan.kv_buffers, src, room.dst[lo:hi], lo)

    async def _send_last(self, plane: SenderPlane, tx: RoomTx, room: SendRoom, chunk: Chunk) -> None:
        plan, a = room.plan, room.assign
        assert plan is not None and a is not None
        layout, comp_of = self.layout, self._comp_of
        for comp in layout.state_components:
            bufs = tuple(b for b in plan.state_buffers if comp_of[b] == comp)
            if bufs:
                dst = np.asarray(a.state.get(comp, ()), dtype=np.int64)
                await plane.send_rows(tx, Kind.STATE, bufs, chunk.state.get(comp, _NO_ROWS), dst, 0)
        if plan.state_skipped and a.state:
            row_bytes = self._row_bytes
            self.acct.state_bytes_skipped += sum(len(a.state.get(comp_of[b], ())) * row_bytes[b]
                                                 for b in plan.state_skipped)
        if plan.aux and not room.stopped:
            assert chunk.aux is not None
            await plane.send_rows(tx, Kind.AUX, (layout.aux_index,), chunk.aux, chunk.aux, 0)
        await plane.send_done(tx, Done(a.tok, self.rank, *room.planned))  # the batch too, and the last data with it
