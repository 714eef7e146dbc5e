"""The same-host plane: the receiver copies the rows out of the sender's pool, which it mapped
at registration (docs/PROTOCOL.md §4 data-refs, §5 step 4).

Sender side (:class:`SameHostSender`): per buffer, data-refs messages of up to
``shm_message_bytes`` of rows (and a row list within ``max_message_bytes``), consecutive
positions, scattered source rows or not; their row lists are the only payload. ``done`` takes the
ZeroMQ socket like the ZeroMQ plane's.

Receiver side (:class:`SameHostReceiver`): the sender's pool file, opened at registration; the
rows a data-ref or data-refs message names are checked against its layout, then read with
``preadv`` from the file straight into the destination rows: one copy, as from a mapping, but a
file the peer shrinks after registration makes the read come back short instead of raising
SIGBUS in the receiver (a mapping of a truncated file faults on the first touch past its end). The
receiver never maps a peer's pool: what a peer does to its own file can fail its rooms, never the
daemon or the other groups (docs/FAULTS.md).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...errors import FailureCode
from ...pool import Pool
from ...pool.shm import pool_path
from ...protocol.messages import DataRef, DataRefs, encode
from ...protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
from ...protocol.room import runs
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


def ref_rows(core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, payload: Any, n_src: int,
             now: float) -> np.ndarray | None:
    """The source rows a data-ref or data-refs message names, checked against the sender's
    ``n_src`` rows of that buffer; None after telling the core why not (every plane that reads
    rows out of the sender's pool, the same-host one and Mooncake's, checks them here)."""
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
                                                                f"{msg.buffer} outside the sender's {n_src} rows", now)
        return None
    return src_rows


class SameHostReceiver:
    """Rows named in the sender's own pool (data-ref, data-refs), read out of its file straight
    into the destination rows with ``preadv``: one copy, and nothing a peer can revoke is mapped."""

    name = PlaneName.SAME_HOST

    def __init__(self, pool: Pool) -> None:
        # the pool was attached to check its id and layout; from here on only its file is read
        self.pool_name = pool.name
        self.path = pool_path(pool.name)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(self.fd)
        self.ino = (st.st_dev, st.st_ino)
        self.offsets = list(pool.offsets)
        self.row_bytes = [b.row_bytes for b in pool.layout.buffers]
        self.rows = [b.rows for b in pool.layout.buffers]
        self.end = max((o + b.nbytes for o, b in zip(pool.offsets, pool.layout.buffers)), default=0)
        self.broken = ""  # why the file can no longer be read (a short read seen): every later message is refused
        pool.close()

    def _unusable(self) -> str:
        """Why the peer's pool file cannot be read from any more ("" if it can)."""
        if self.broken:
            return self.broken
        try:
            st = os.fstat(self.fd)
        except OSError as exc:
            return f"the sender's pool {self.pool_name!r} cannot be read: {exc.strerror}"
        if st.st_size < self.end:
            return (f"the sender's pool {self.pool_name!r} shrank to {st.st_size} bytes after registration "
                    f"(its layout needs {self.end})")
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return f"the sender's pool {self.pool_name!r} was unlinked after registration"
        if (now.st_dev, now.st_ino) != self.ino:
            return f"the sender's pool {self.pool_name!r} was replaced by another file after registration"
        if st.st_nlink == 0:
            return f"the sender's pool {self.pool_name!r} was unlinked after registration"
        return ""

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, payload: Any,
               now: float) -> np.ndarray | None:
        src_rows = ref_rows(core, room, peer, msg, payload, self.rows[msg.buffer], now)
        if src_rows is None:
            return None
        why = self._unusable()
        if why:
            core.reject(room, peer, FailureCode.NO_SHM, why, now)
            return None
        return src_rows

    def first_row(self, msg: DataRef | DataRefs, src: np.ndarray) -> Any:
        n = self.row_bytes[msg.buffer]
        data = os.pread(self.fd, n, self.offsets[msg.buffer] + int(src[0]) * n)
        if len(data) != n:
            self.broken = f"the sender's pool {self.pool_name!r} shrank under a read (got {len(data)} of {n} bytes)"
            return b"\0" * n  # the aux guard then fails this room; the next message sees `broken`
        return data

    def write(self, msg: DataRef | DataRefs, dst: np.ndarray, first: int, rows: np.ndarray | None,
              src: np.ndarray) -> bool:
        dst_rows = np.arange(first, first + msg.count) if rows is None else rows
        rb, base = self.row_bytes[msg.buffer], self.offsets[msg.buffer]
        for a, b in runs(src, dst_rows):
            d, s = int(dst_rows[a]), int(src[a])
            want = (b - a) * rb
            got = os.preadv(self.fd, [dst[d:d + b - a].data], base + s * rb)
            if got != want:  # the file shrank between the check and the read: these rows never land
                self.broken = (f"the sender's pool {self.pool_name!r} shrank under a read (got {got} of {want} "
                               f"bytes)")
                return False
        return True

    def close(self) -> None:
        os.close(self.fd)
