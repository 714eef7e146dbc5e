"""The receiver's engine API: what each typed request of :data:`~transferd.protocol.engine_api.RECEIVER_OPS`
does, as calls of the receiver's public methods (the decoding, the checks and the replies are
:mod:`transferd.protocol.engine_api`; the socket is :class:`~transferd.transport.local_api.LocalApiServer`)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from ..protocol.engine_api import (
    Expect,
    Ping,
    ReceiverAbort,
    ReceiverPoll,
    ReceiverWait,
    Release,
    Request,
    Stats,
    Status,
)
from ..protocol.room import RoomRequest, RoomStatus
from ..transport.local_api import Handler


class ReceiverApi(Protocol):
    """What a receiver offers its decode engine (the rooms are keyed by ``(group, room)``)."""

    def expect(self, req: RoomRequest, /) -> RoomStatus: ...

    def poll(self, group: str, room: int, /) -> RoomStatus: ...

    async def wait(self, group: str, room: int, timeout_s: float, /) -> RoomStatus: ...

    def abort(self, group: str, room: int, reason: str, /) -> RoomStatus | Awaitable[RoomStatus]:
        """The room's status, or (engine reads of it in flight) an awaitable of it that
        resolves once they settled: abort is a barrier."""

    def release(self, group: str, room: int, /) -> RoomStatus | Awaitable[RoomStatus]: ...

    def stats(self) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def ping_info(self) -> dict[str, Any]: ...


def handlers(agent: ReceiverApi) -> dict[type[Request], Handler]:
    """The receiver's handler table for :class:`~transferd.transport.local_api.LocalApiServer`:
    exactly the requests of ``RECEIVER_OPS``."""

    def expect(r: Expect) -> RoomStatus:
        return agent.expect(r.room_request())

    def poll(r: ReceiverPoll) -> RoomStatus:
        return agent.poll(r.group, r.room)

    def wait(r: ReceiverWait) -> Awaitable[RoomStatus]:  # the coroutine itself: the server awaits it
        return agent.wait(r.group, r.room, r.timeout_s)

    def abort(r: ReceiverAbort) -> RoomStatus | Awaitable[RoomStatus]:  # an awaitable: after its reads settled
        return agent.abort(r.group, r.room, r.reason)

    def release(r: Release) -> RoomStatus | Awaitable[RoomStatus]:
        return agent.release(r.group, r.room)

    def stats(r: Stats) -> dict[str, Any]:
        return agent.stats()

    def status(r: Status) -> dict[str, Any]:
        return agent.status()

    def ping(r: Ping) -> dict[str, Any]:
        return agent.ping_info()

    return {Expect: expect, ReceiverPoll: poll, ReceiverWait: wait, ReceiverAbort: abort, Release: release,
            Stats: stats, Status: status, Ping: ping}
