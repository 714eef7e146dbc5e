"""The data-stream plane: the ZeroMQ plane's data, data-batch and done messages as records on
a plain TCP connection to the receiver (docs/PROTOCOL.md §2.1; the wire is
:mod:`transferd.protocol.stream`, the socket :class:`~transferd.transport.data_stream.StreamWriter`).

Sender side (:class:`StreamSender`): the batching is the ZeroMQ plane's; each message becomes
one record, ``prefix | header | payload`` handed to the kernel at once, the payload straight out
of the pool. The connection's stream is read at every message (``ConnPipes.stream``): until it
connects the data waits; when it never connected (``fallback``), or once the shell dropped it,
the messages take the ZeroMQ socket as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ...errors import TransferdError
from ...protocol.stream import prefix
from ...types import PlaneName
from .sending import BURST, SENT_STREAM, SENT_ZMQ, RoomTx
from .zmq import ZmqSender


class StreamSender(ZmqSender):
    name = PlaneName.STREAM

    async def _emit(self, tx: RoomTx, header: bytes, payload: Sequence[Any] = (), nbytes: int = 0, *,
                    rows: bool = False) -> int:
        """As :meth:`ZmqSender._emit`, on the data stream while the connection has one:
        ``SENT_STREAM`` when the stream took the message."""
        room, pipes, link, zc = tx.room, self.pipes, self.link, self.zc
        while True:
            writer = pipes.stream
            if writer is not None:  # the data stream: one record, payload straight out of the pool
                if writer.try_write([prefix(len(header), nbytes), header, *payload]):
                    how = SENT_STREAM
                    break
                try:
                    await writer.writable()
                except TransferdError:
                    if writer.fallback and not room.stopped:
                        continue  # it never connected: the ZeroMQ socket takes the data instead
                    raise
                if room.stopped:
                    return 0
                continue
            if rows:
                assert zc is not None
                sent = zc.try_send(header, [(r.ctypes.data, r.nbytes) for r in payload])
                link.kick()
            else:
                sent = link.try_send([header, *payload], copy=False)
            if sent:
                how = SENT_ZMQ
                break
            await link.writable()
            if room.stopped:
                return 0
        env = self.env
        env.burst += 1
        if env.burst >= BURST:  # the pipe kept taking messages: give the loop a turn anyway
            env.burst = 0
            await asyncio.sleep(0)
        return how

    def close(self) -> None:
        writer, self.pipes.stream = self.pipes.stream, None
        if writer is not None:
            writer.close()
