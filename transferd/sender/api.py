"""The sender's engine API: what each typed request of :data:`~transferd.protocol.engine_api.SENDER_OPS`
does, as calls of the sender agent's public methods (the decoding, the checks and the replies are
:mod:`transferd.protocol.engine_api`; the socket is :class:`~transferd.transport.local_api.LocalApiServer`)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from ..protocol.engine_api import Ping, Request, SenderAbort, SenderPoll, SenderWait, Stats, Status, Submit
from ..protocol.room import RoomStatus
from ..transport.local_api import Handler


class SenderApi(Protocol):
    """What a sender agent offers its prefill engine (one CP rank; rooms keyed by room id)."""

    def submit(self, room_id: int, start: int, src_pages: tuple[int, ...], /, *, last: bool,
               state: dict[str, tuple[int, ...]], aux_slot: int | None) -> RoomStatus: ...

    def poll(self, room_id: int, /) -> RoomStatus: ...

    async def wait(self, room_id: int, timeout_s: float, /) -> RoomStatus: ...

    def abort(self, room_id: int, reason: str, /) -> RoomStatus: ...

    def stats(self) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def ping_info(self) -> dict[str, Any]: ...


def handlers(agent: SenderApi) -> dict[type[Request], Handler]:
    """The sender's handler table for :class:`~transferd.transport.local_api.LocalApiServer`:
    exactly the requests of ``SENDER_OPS``."""

    def submit(r: Submit) -> RoomStatus:
        return agent.submit(r.room, r.start, r.src_pages, last=r.last, state=dict(r.state), aux_slot=r.aux_slot)

    def poll(r: SenderPoll) -> RoomStatus:
        return agent.poll(r.room)

    def wait(r: SenderWait) -> Awaitable[RoomStatus]:  # the coroutine itself: the server awaits it
        return agent.wait(r.room, r.timeout_s)

    def abort(r: SenderAbort) -> RoomStatus:
        return agent.abort(r.room, r.reason)

    def stats(r: Stats) -> dict[str, Any]:
        return agent.stats()

    def status(r: Status) -> dict[str, Any]:
        return agent.status()

    def ping(r: Ping) -> dict[str, Any]:
        return agent.ping_info()

    return {Submit: submit, SenderPoll: poll, SenderWait: wait, SenderAbort: abort, Stats: stats, Status: status,
            Ping: ping}
