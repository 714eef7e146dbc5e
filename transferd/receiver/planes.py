"""The receiving side of the data planes: where the bytes of a data message come from, checked
before the claim, and how they are written into the destination rows once the core claimed them.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..pool import Pool
from ..pool.rows import copy_rows
from ..protocol.messages import Data, DataRef, DataRefs
from ..protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
from ..types import PlaneName


class ReceiverPlane(Protocol):
    """How a peer's rows reach the decode pool once the core has decided they may.

    ``source`` checks what a data message carries (its payload, or the rows it names) and
    returns a handle to the bytes, or None after telling the core (``core.reject``) why not;
    ``first_row`` gives the first row's bytes (the aux guard is read from it); ``write`` moves
    the message's rows into ``dst`` — at ``first`` onward, or at ``rows`` — and returns True when
    they are in place now (False: the plane reports them landed later); ``close`` ends it."""

    name: PlaneName

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: Any, payload: Any,
               now: float) -> Any | None: ...

    def first_row(self, msg: Any, src: Any) -> Any: ...

    def write(self, msg: Any, dst: np.ndarray, first: int, rows: np.ndarray | None, src: Any) -> bool: ...

    def close(self) -> None: ...


class PayloadPlane:
    """Rows that arrive as payload bytes: a ZeroMQ payload frame, or a data-stream record read
    into a buffer. One copy, from the payload into the rows."""

    def __init__(self, name: PlaneName, row_bytes: list[int]) -> None:
        self.name = name
        self._row_bytes = row_bytes

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: Data, payload: Any,
               now: float) -> Any | None:
        return payload if core.payload_ok(room, peer, msg, payload, now) else None

    def first_row(self, msg: Data, src: Any) -> Any:
        return src

    def write(self, msg: Data, dst: np.ndarray, first: int, rows: np.ndarray | None, src: Any) -> bool:
        count = msg.count
        data = np.frombuffer(src, dtype=np.uint8).reshape(count, self._row_bytes[msg.buffer])
        if rows is None:
            dst[first:first + count] = data
        else:
            dst[rows] = data
        return True

    def close(self) -> None:
        pass


class SameHostPlane:
    """Rows named in the sender's own pool (data-ref, data-refs), mapped here: copied straight
    out of it, one copy."""

    name = PlaneName.SAME_HOST

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, payload: Any,
               now: float) -> np.ndarray | None:
        n_src = self.pool.rows[msg.buffer].shape[0]
        if isinstance(msg, DataRefs):
            if len(payload) != msg.count * 8:
                core.reject(room, peer, "length_mismatch", f"data-refs list of {len(payload)} bytes for "
                                                          f"{msg.count} rows (8 bytes each)", now)
                return None
            src_rows = np.frombuffer(payload, dtype="<i8")
            lo, hi = int(src_rows.min()), int(src_rows.max()) + 1
        else:
            lo, hi = msg.src_row, msg.src_row + msg.count
            src_rows = np.arange(lo, hi, dtype=np.int64)
        if lo < 0 or hi > n_src:
            core.reject(room, peer, "index_out_of_range", f"data-ref rows [{lo}, {hi}) of buffer {msg.buffer} "
                                                          f"outside the sender's {n_src} rows", now)
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
