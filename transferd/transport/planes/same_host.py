"""The same-host plane: the receiver copies the rows out of the sender's pool, which it mapped
at registration (docs/PROTOCOL.md §4 data-refs, §5 step 4).

Sender side (:class:`SameHostSender`): per buffer, data-refs messages of up to
``shm_message_bytes`` of rows (and a row list within ``max_message_bytes``), consecutive
positions, scattered source rows or not; their row lists are the only payload. ``done`` takes the
ZeroMQ socket like the ZeroMQ plane's.
"""

from __future__ import annotations

import numpy as np

from ...protocol.messages import DataRefs, encode
from ...types import KIND_LABELS, Kind, PlaneName
from .sending import RoomTx
from .zmq import ZmqSender


class SameHostSender(ZmqSender):
    name = PlaneName.SAME_HOST

    async def send_rows(self, tx: RoomTx, kind: Kind, buffers: tuple[int, ...], src: np.ndarray,
                        dst: np.ndarray, base: int) -> None:
        room = tx.room
        for b in buffers:
            # the row list (8 bytes a row) also stays within max_message_bytes, which the
            # receiver checked against its frame limit at registration
            step = max(1, min(self.env.shm_message_bytes // self.row_bytes[b], self.cap // 8))
            for p in range(0, len(src), step):
                if room.stopped:
                    return
                await self._send_refs(tx, kind, b, base + p, src[p:p + step])

    async def _send_refs(self, tx: RoomTx, kind: Kind, buffer: int, pos: int, src_rows: np.ndarray) -> None:
        """Name the rows; the receiver copies them out of this pool after its checks."""
        env = self.env
        tx.room.handed = True
        if env.faults.drop_frames and env.fault_rng.random() < env.faults.drop_frames:
            env.counters.dropped["fault_drop_frame"] += 1
            return
        count = len(src_rows)
        rows = np.ascontiguousarray(src_rows, dtype="<i8").tobytes()
        if not await self._emit(tx, encode(DataRefs(tx.tok, kind, buffer, pos, count)), [rows], len(rows)):
            return
        nbytes = count * self.row_bytes[buffer]
        env.counters.add(KIND_LABELS[kind], nbytes)
        env.counters.shm_bytes += nbytes
        tx.room.sent += nbytes
        self.bytes_sent += nbytes
