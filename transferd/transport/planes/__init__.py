"""The data planes: how a room's rows move once a core decided they may.

Each plane is one module with its sender-side class and, beside it, its receiver side. A
connection's plane is chosen when it registers — Mooncake Transfer Engine reads when both sides
set ``data_plane = "mooncake"`` (NIXL reads: ``"nixl"``), the same-host path when the receiver mapped the sender's pool,
the data stream when one was offered and may be used, ZeroMQ frames
otherwise — and built from :data:`SENDER_PLANES`. A new plane is one module implementing
:class:`~.sending.SenderPlane` and :class:`~.receiving.ReceiverPlane`, a
:class:`~transferd.types.PlaneName`, an entry in both tables here, and its configuration
(docs/DATA-PLANES.md).
"""

from __future__ import annotations

from ...types import PlaneName
from .mooncake import MooncakeEngine, MooncakeReceiver, MooncakeSender, local_hostname
from .nixl import NixlEngine, NixlReceiver, NixlSender
from .reads import Reader
from .receiving import PayloadReceiver, ReceiverPlane
from .same_host import SameHostEngine, SameHostReceiver, SameHostSender
from .sending import ConnPipes, RoomTx, SendEnv, SenderPlane, SenderPlaneFactory
from .stream import RowSink, StreamReceiver, StreamSender
from .zmq import ZmqReceiver, ZmqSender

SENDER_PLANES: dict[PlaneName, SenderPlaneFactory] = {
    PlaneName.ZMQ: ZmqSender,
    PlaneName.STREAM: StreamSender,
    PlaneName.SAME_HOST: SameHostSender,
    PlaneName.MOONCAKE: MooncakeSender,
    PlaneName.NIXL: NixlSender,
}


RECEIVER_PLANES: dict[PlaneName, type] = {
    PlaneName.ZMQ: ZmqReceiver,
    PlaneName.STREAM: StreamReceiver,
    PlaneName.SAME_HOST: SameHostReceiver,
    PlaneName.MOONCAKE: MooncakeReceiver,
    PlaneName.NIXL: NixlReceiver,
}
"""The receiver side of each plane: ZeroMQ and stream take the layout's row sizes, the same-host
plane the sender's pool mapped at registration, the Mooncake and NIXL planes the receiver's engine
reader and the sender's session (NIXL: agent name) and buffer addresses."""


def sender_plane(name: PlaneName, env: SendEnv, pipes: ConnPipes) -> SenderPlane:
    """The sender side of plane ``name`` for one connection."""
    return SENDER_PLANES[name](env, pipes)


__all__ = [
    "RECEIVER_PLANES",
    "SENDER_PLANES",
    "ConnPipes",
    "MooncakeEngine",
    "MooncakeReceiver",
    "NixlEngine",
    "NixlReceiver",
    "PayloadReceiver",
    "Reader",
    "ReceiverPlane",
    "RoomTx",
    "RowSink",
    "SameHostEngine",
    "SameHostReceiver",
    "SendEnv",
    "SenderPlane",
    "StreamReceiver",
    "ZmqReceiver",
    "local_hostname",
    "sender_plane",
]
