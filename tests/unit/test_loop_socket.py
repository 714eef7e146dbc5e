"""transferd.transport.loop_socket.LoopSocket on real ZeroMQ sockets (a DEALER into a ROUTER,
``inproc://``, high-water marks of one message): rooms whose messages wait behind a full pipe are
woken one at a time — when the pipe takes messages again the first waiter alone is woken, and
each message the socket takes wakes the next — not all of them at every turn to find it full
again; a woken room that stopped, or whose send loop is cancelled as it is woken, passes its turn
on; every message arrives exactly once."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import zmq

from transferd.transport.loop_socket import LoopSocket, configure
from transferd.transport.planes.sending import SENT_ZMQ, ConnPipes, RoomTx, SendEnv
from transferd.transport.planes.zmq import ZmqSender

from .turns_helpers import cancel_first_as_woken, counting_waits

_ports = itertools.count()


class Pipe:
    """A LoopSocket DEALER whose peer, a ROUTER, reads only when told to."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        addr = f"inproc://loop-socket-{next(_ports)}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(addr)
        dealer = self.ctx.socket(zmq.DEALER)
        configure(dealer, hwm=1)
        dealer.connect(addr)
        self.link = LoopSocket(dealer, lambda frames: None, "test")
        self.got: list[bytes] = []

    def fill(self) -> int:
        """Messages until the pipe holds no more."""
        n = 0
        while self.link.try_send([b"fill%d" % n]):
            n += 1
        assert n >= 1
        return n

    async def read(self, n: int | None = None, timeout: float = 10.0) -> None:
        """Read ``n`` messages (all that come, until ``timeout`` passes without one, when None),
        giving the loop turns meanwhile."""
        deadline = asyncio.get_running_loop().time() + timeout
        want = len(self.got) + n if n is not None else None
        while want is None or len(self.got) < want:
            try:
                _, body = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if asyncio.get_running_loop().time() > deadline:
                    assert want is None, f"{len(self.got)} messages read, {want} expected"
                    return
                await asyncio.sleep(0.002)
                continue
            self.got.append(body)
            deadline = asyncio.get_running_loop().time() + timeout

    def close(self) -> None:
        self.link.close()
        self.router.close()
        self.ctx.term()


def zmq_plane(link: LoopSocket) -> ZmqSender:
    """The ZeroMQ plane of a connection whose only way out is ``link`` (no pool: the messages
    are built here and handed to ``_emit`` as the plane's batching would)."""
    env = SendEnv(SimpleNamespace(buffers=()), (), None, 1 << 20, 1 << 20)  # type: ignore[arg-type]
    return ZmqSender(env, ConnPipes("test", link))


def waiting_rooms(link: LoopSocket, n: int) -> tuple[list[Any], list[asyncio.Task[int]]]:
    """``n`` rooms each sending one message (``room<i>``) through the ZeroMQ plane, as tasks."""
    plane = zmq_plane(link)
    rooms = [SimpleNamespace(stopped=False) for _ in range(n)]
    tasks = [asyncio.create_task(plane._emit(RoomTx(room, i), b"room%d" % i))  # type: ignore[arg-type]
             for i, room in enumerate(rooms)]
    return rooms, tasks


def test_rooms_waiting_for_a_full_pipe_are_woken_one_at_a_time() -> None:
    """Forty rooms behind a full pipe, read one message at a time: every message arrives exactly
    once, and the rooms wait about once each (a room woken by the message before it may find the
    pipe full again and wait once more); waking every waiter whenever the pipe took messages
    again made it about twenty waits a room."""
    async def main() -> None:
        pipe = Pipe()
        filled = pipe.fill()
        waits = counting_waits(pipe.link)
        _, tasks = waiting_rooms(pipe.link, 40)
        await asyncio.sleep(0.01)
        assert waits[0] == 40 and not any(t.done() for t in tasks)
        for _ in range(filled + 40):
            await pipe.read(1)
            await asyncio.sleep(0.002)
        assert await asyncio.wait_for(asyncio.gather(*tasks), 10) == [SENT_ZMQ] * 40
        assert sorted(pipe.got) == sorted([b"fill%d" % i for i in range(filled)] + [b"room%d" % i for i in range(40)])
        assert waits[0] <= 3 * 40, waits[0]
        pipe.close()

    asyncio.run(main())


def test_a_woken_room_that_stopped_passes_the_turn_on() -> None:
    """Rooms wait behind a full pipe; two of them stop meanwhile (the first in line among
    them). Woken, a stopped room sends nothing and hands the turn on: no room is left waiting
    on a pipe with room in it, and the stopped rooms' messages never go out."""
    async def main() -> None:
        pipe = Pipe()
        filled = pipe.fill()
        rooms, tasks = waiting_rooms(pipe.link, 6)
        await asyncio.sleep(0.01)
        assert len(pipe.link._waiters) == 6
        rooms[0].stopped = True
        rooms[3].stopped = True
        reading = asyncio.create_task(pipe.read(filled + 4))
        sent = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert sent == [0, SENT_ZMQ, SENT_ZMQ, 0, SENT_ZMQ, SENT_ZMQ]
        await asyncio.wait_for(reading, 10)
        await pipe.read(timeout=0.1)  # nothing else comes
        assert sorted(pipe.got) == sorted([b"fill%d" % i for i in range(filled)] + [b"room%d" % i for i in (1, 2, 4, 5)])
        pipe.close()

    asyncio.run(main())


def test_a_room_cancelled_as_it_is_woken_passes_the_turn_on() -> None:
    """The send loop of a room is cancelled (its agent stopping a task) just as its turn came,
    and another while it waits: the waiters after them are woken in their place, and every other
    message arrives."""
    async def main() -> None:
        pipe = Pipe()
        filled = pipe.fill()
        link = pipe.link
        _, tasks = waiting_rooms(link, 4)
        await asyncio.sleep(0.01)
        assert len(link._waiters) == 4
        cancel_first_as_woken(link, tasks[0])  # room 0, first in line
        tasks[2].cancel()  # and room 2 while it waits
        reading = asyncio.create_task(pipe.read(filled + 2))
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert done[1] == SENT_ZMQ and done[3] == SENT_ZMQ
        assert isinstance(done[0], asyncio.CancelledError) and isinstance(done[2], asyncio.CancelledError)
        await asyncio.wait_for(reading, 10)
        await pipe.read(timeout=0.1)
        assert sorted(pipe.got) == sorted([b"fill%d" % i for i in range(filled)] + [b"room1", b"room3"])
        pipe.close()

    asyncio.run(main())


def test_a_closed_socket_fails_every_waiter() -> None:
    """Closing the socket ends every wait with an error naming it, none left hanging."""
    async def main() -> None:
        pipe = Pipe()
        pipe.fill()
        _, tasks = waiting_rooms(pipe.link, 3)
        await asyncio.sleep(0.01)
        pipe.link.close()
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(d, zmq.ZMQError) and "socket closed" in str(d) for d in done), done
        pipe.router.close()
        pipe.ctx.term()

    asyncio.run(main())
