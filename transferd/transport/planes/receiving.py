"""The receiver side of the data-plane seam: where a data message's bytes come from, checked
before the core claims their rows, and how they reach the decode pool once it has.

The receiver's data path (``transferd/receiver/data.py``) runs every data message the same way:
the core's room checks (``ReceiverCore.data_room``), then the plane's ``source`` (what the
message carries), the aux guard on ``first_row``, the core's ``claim``, the plane's ``write``,
and ``landed``. docs/DATA-PLANES.md says what a new plane implements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ...protocol.messages import Data
from ...protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
from ...types import PlaneName


class ReceiverPlane(Protocol):
    """How a peer's rows reach the decode pool once the core has decided they may.

    ``source`` checks what a data message carries (its payload, or the rows it names) and
    returns a handle to the bytes, or None after telling the core (``core.reject``) why not;
    ``first_row`` gives the first row's bytes (the aux guard is read from it); ``write`` moves
    the message's rows into ``dst`` — at ``first`` onward, or at ``rows`` — and returns True when
    they are in place now (False: the plane reports them landed later); ``close`` releases what
    the plane holds for its peer."""

    name: PlaneName

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: Any, payload: Any,
               now: float) -> Any | None: ...

    def first_row(self, msg: Any, src: Any) -> Any: ...

    def write(self, msg: Any, dst: np.ndarray, first: int, rows: np.ndarray | None, src: Any) -> bool: ...

    def close(self) -> None: ...


class PayloadReceiver:
    """Rows that arrive as payload bytes (a ZeroMQ payload frame, a data-stream record read into
    a buffer): their length and checksum checked, then one copy into the rows."""

    name = PlaneName.ZMQ

    def __init__(self, row_bytes: Sequence[int]) -> None:
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
