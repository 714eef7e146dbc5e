"""The same-host plane: the receiver copies the rows out of the sender's pool, which it mapped
at registration (docs/PROTOCOL.md §4 data-refs, §5 step 4).

Sender side (:class:`SameHostSender`): per buffer, data-refs messages of up to
``shm_message_bytes`` of rows (and a row list within ``max_message_bytes``), consecutive
positions, scattered source rows or not; their row lists are the only payload. ``done`` takes the
ZeroMQ socket like the ZeroMQ plane's.

Receiver side (:class:`SameHostReceiver`): the sender's pool, mapped at registration; the rows a
data-ref or data-refs message names are checked against it, then copied straight out of it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import FailureCode
from ...pool import Pool
from ...pool.rows import copy_rows
from ...protocol.messages import DataRef, DataRefs, encode
from ...protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
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
        self._count(nbytes)
        tx.room.sent += nbytes
        self.bytes_sent += nbytes

    def _count(self, nbytes: int) -> None:
        """The part of the bytes this path moved (the Mooncake plane counts its own)."""
        self.env.counters.shm_bytes += nbytes


class SameHostReceiver:
    """Rows named in the sender's own pool (data-ref, data-refs), copied straight out of its
    mapping here: one copy."""

    name = PlaneName.SAME_HOST

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, payload: Any,
               now: float) -> np.ndarray | None:
        n_src = self.pool.rows[msg.buffer].shape[0]
        if isinstance(msg, DataRefs):
            if len(payload) != msg.count * 8:
                core.reject(room, peer, FailureCode.LENGTH_MISMATCH, f"data-refs list of {len(payload)} bytes for "
                                                                     f"{msg.count} rows (8 bytes each)", now)
                return None
            src_rows = np.frombuffer(payload, dtype="<i8")
            lo, hi = int(src_rows.min()), int(src_rows.max()) + 1
        else:
            lo, hi = msg.src_row, msg.src_row + msg.count
            src_rows = np.arange(lo, hi, dtype=np.int64)
        if lo < 0 or hi > n_src:
            core.reject(room, peer, FailureCode.INDEX_OUT_OF_RANGE, f"data-ref rows [{lo}, {hi}) of buffer "
                                                                    f"{msg.buffer} outside the sender's {n_src} rows",
                        now)
            return None
        return src_rows

    def first_row(self, msg: DataRef | DataRefs, src: np.ndarray) -> Any:
        return self.pool.rows[msg.buffer][int(src[0])].data

    def write(self, msg: DataRef | DataRefs, dst: np.ndarray, first: int, rows: np.ndarray | None,
              src: np.ndarray) -> bool:
        dst_rows = np.arange(first, first + msg.count) if rows is None else rows
        copy_rows(dst, dst_rows, self.pool.rows[msg.buffer], src)
        return True

    def close(self) -> None:
        self.pool.close()
