"""The data planes: how a room's rows move once a core decided they may.

Each plane is one module with its sender-side class (and, beside it, its receiver side). A
connection's plane is chosen when it registers — the same-host path when the receiver mapped
the sender's pool, the data stream when one was offered and may be used, ZeroMQ frames
otherwise — and built from :data:`SENDER_PLANES`. A new plane is one module implementing
:class:`~.sending.SenderPlane`, a :class:`~transferd.types.PlaneName`, an entry here, and its
configuration.
"""

from __future__ import annotations

from ...types import PlaneName
from .same_host import SameHostSender
from .sending import ConnPipes, RoomTx, SendEnv, SenderPlane, SenderPlaneFactory
from .stream import StreamSender
from .zmq import ZmqSender

SENDER_PLANES: dict[PlaneName, SenderPlaneFactory] = {
    PlaneName.ZMQ: ZmqSender,
    PlaneName.STREAM: StreamSender,
    PlaneName.SAME_HOST: SameHostSender,
}


def sender_plane(name: PlaneName, env: SendEnv, pipes: ConnPipes) -> SenderPlane:
    """The sender side of plane ``name`` for one connection."""
    return SENDER_PLANES[name](env, pipes)


__all__ = ["SENDER_PLANES", "ConnPipes", "RoomTx", "SendEnv", "SenderPlane", "sender_plane"]
