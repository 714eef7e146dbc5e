"""A real LocalApiServer on each of its transports (an ipc:// ZeroMQ socket, a unix:// stream
socket), served by an event loop in a thread, with fake handlers; raw clients (a DEALER, a Unix
socket with length-prefixed frames) speak the wire of docs/PROTOCOL.md §17 to it (the version
check, a request, a batch, refusals and their counters), and the Python clients are checked
against it and against fake daemons of another version."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from transferd.client import DecodeClient, PrefillClient
from transferd.errors import BadRequest, RoomExists, UnknownRoom, VersionMismatch
from transferd.protocol.engine_api import (
    LOCAL_API_VERSION,
    RECEIVER_OPS,
    SENDER_OPS,
    Expect,
    Ping,
    ReceiverAbort,
    ReceiverPoll,
    ReceiverWait,
    Release,
    SenderAbort,
    SenderPoll,
    SenderWait,
    Stats,
    Status,
    Submit,
)
from transferd.protocol.room import RoomRequest, RoomState, RoomStatus
from transferd.receiver import api as receiver_api
from transferd.sender import api as sender_api
from transferd.transport.local_api import LocalApiServer
from transferd.transport.local_stream import FRAME, unix_path

V = LOCAL_API_VERSION
WAITING = RoomStatus(RoomState.WAITING)
SUCCESS = RoomStatus(RoomState.SUCCESS)


class Served:
    """A LocalApiServer with ``handlers``, on its own event loop in a thread."""

    def __init__(self, endpoint: str, handlers: Mapping[Any, Callable[[Any], Any]]) -> None:
        self.ctx = zmq.Context()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._endpoint, self._handlers = endpoint, handlers
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self.ready.wait(20), "the server did not start"
        if self.error is not None:
            self.thread.join(20)
            self.loop.close()
            self.ctx.term()
            raise self.error

    def _main(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        try:
            self.srv = LocalApiServer(self.ctx, self._endpoint, self._handlers, "test", None)
        except BaseException as exc:
            self.error = exc
            self.ready.set()
            return
        self.stop: asyncio.Future[None] = self.loop.create_future()
        task = asyncio.ensure_future(self.srv.run())
        self.ready.set()
        await self.stop
        task.cancel()
        self.srv.close()

    def close(self) -> None:
        if self.error is None:
            self.loop.call_soon_threadsafe(self.stop.set_result, None)
        self.thread.join(20)
        self.loop.close()
        self.ctx.term()


class FakeReceiver:
    """The receiver's public methods (receiver/api.py's ReceiverApi), over a dict of rooms."""

    def __init__(self) -> None:
        self.rooms: dict[tuple[str, int], RoomStatus] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.ended: dict[tuple[str, int], list[asyncio.Future[RoomStatus]]] = {}

    def _get(self, group: str, room: int) -> RoomStatus:
        if (group, room) not in self.rooms:
            raise UnknownRoom(f"room {group}/{room} is not held")
        return self.rooms[(group, room)]

    def expect(self, req: RoomRequest) -> RoomStatus:
        self.calls.append(("expect", req))
        if (req.group, req.room) in self.rooms:
            raise RoomExists(f"room {req.group}/{req.room} is still held")
        if req.room == 666:
            raise RuntimeError("a bug")
        if req.room == 667:
            raise ValueError("an unchecked argument")
        self.rooms[(req.group, req.room)] = WAITING
        return WAITING

    def poll(self, group: str, room: int) -> RoomStatus:
        return self._get(group, room)

    def wait(self, group: str, room: int, timeout_s: float) -> asyncio.Future[RoomStatus]:
        """A future (the fake sender's ``wait`` is a coroutine): both kinds of awaitable a handler
        may return go through the server, ended with a status or with an error."""
        self.calls.append(("wait", group, room, timeout_s))
        self._get(group, room)
        fut: asyncio.Future[RoomStatus] = asyncio.get_running_loop().create_future()
        self.ended.setdefault((group, room), []).append(fut)
        return fut

    def abort(self, group: str, room: int, reason: str) -> RoomStatus:
        self.calls.append(("abort", group, room, reason))
        self.rooms[(group, room)] = RoomStatus(RoomState.FAILED, "aborted", reason)
        for fut in self.ended.pop((group, room), ()):  # the room ended: its waits hear how
            fut.set_result(self.rooms[(group, room)])
        return self.rooms[(group, room)]

    def release(self, group: str, room: int) -> RoomStatus:
        status = self._get(group, room)
        del self.rooms[(group, room)]
        for fut in self.ended.pop((group, room), ()):  # the waits' error, as the handler once raised it
            fut.set_exception(UnknownRoom(f"room {group}/{room} is not held"))
        return status

    def stats(self) -> dict[str, Any]:
        return {"role": "receiver", "rooms": len(self.rooms)}

    def status(self) -> dict[str, Any]:
        return {"role": "receiver", "groups": {}}

    def ping_info(self) -> dict[str, Any]:
        return {"name": "decode0", "pid": 1}


class FakeSender:
    """The sender's public methods (sender/api.py's SenderApi)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def submit(self, room_id: int, start: int, src_pages: tuple[int, ...], *, last: bool,
               state: dict[str, tuple[int, ...]], aux_slot: int | None) -> RoomStatus:
        self.calls.append(("submit", room_id, start, src_pages, last, state, aux_slot))
        return WAITING

    def poll(self, room_id: int) -> RoomStatus:
        return SUCCESS

    async def wait(self, room_id: int, timeout_s: float) -> RoomStatus:
        self.calls.append(("wait", room_id, timeout_s))
        return SUCCESS

    def abort(self, room_id: int, reason: str) -> RoomStatus:
        self.calls.append(("abort", room_id, reason))
        return RoomStatus(RoomState.FAILED, "aborted", reason)

    def stats(self) -> dict[str, Any]:
        return {"role": "sender"}

    def status(self) -> dict[str, Any]:
        return {"role": "sender"}

    def ping_info(self) -> dict[str, Any]:
        return {"name": "prefill0/r0", "pid": 2}


@pytest.fixture(params=["ipc", "unix"])
def endpoint(tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return f"{request.param}://{tmp_path}/api.sock"


@pytest.fixture
def receiver(endpoint: str) -> Iterator[tuple[Served, FakeReceiver]]:
    fake = FakeReceiver()
    s = Served(endpoint, receiver_api.handlers(fake))
    try:
        yield s, fake
    finally:
        s.close()


@pytest.fixture
def sender(endpoint: str) -> Iterator[tuple[Served, FakeSender]]:
    fake = FakeSender()
    s = Served(endpoint, sender_api.handlers(fake))
    try:
        yield s, fake
    finally:
        s.close()


class UnixWire:
    """One connection to a unix:// endpoint, framing by hand (u32 big-endian length, body)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(20)
        self.path, self.connected = path, False  # connected at the first send, as a DEALER would
        self.buf = b""

    def send(self, body: bytes) -> None:
        if not self.connected:
            self.sock.connect(self.path)
            self.connected = True
        self.sock.sendall(FRAME.pack(len(body)) + body)

    def recv(self) -> bytes:
        while True:
            if len(self.buf) >= 4:
                (n,) = FRAME.unpack_from(self.buf)
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return body
            data = self.sock.recv(1 << 16)
            assert data, "the daemon closed the connection"
            self.buf += data

    def close(self, linger: int = 0) -> None:
        self.sock.close()


class Raw:
    """A raw client speaking the wire by hand: a DEALER, or a Unix stream socket."""

    def __init__(self, endpoint: str) -> None:
        path = unix_path(endpoint)
        self.unix = UnixWire(str(path)) if path is not None else None
        if self.unix is None:
            self.zsock = zmq.Context.instance().socket(zmq.DEALER)
            self.zsock.setsockopt(zmq.LINGER, 0)
            self.zsock.connect(endpoint)

    def send_bytes(self, body: bytes) -> None:
        if self.unix is not None:
            self.unix.send(body)
        else:
            self.zsock.send(body)

    def send(self, obj: Any) -> None:
        self.send_bytes(msgpack.packb(obj, use_bin_type=True))

    def recv(self) -> dict[str, Any]:
        if self.unix is not None:
            body = self.unix.recv()
        else:
            assert self.zsock.poll(20_000), "no reply within 20 s"
            body = self.zsock.recv()
        reply: dict[str, Any] = msgpack.unpackb(body, raw=False)
        return reply

    def ask(self, obj: Any) -> dict[str, Any]:
        self.send(obj)
        return self.recv()

    def close(self) -> None:
        if self.unix is not None:
            self.unix.close()
        else:
            self.zsock.close(linger=0)


@pytest.fixture
def raw(endpoint: str) -> Iterator[Raw]:
    r = Raw(endpoint)
    yield r
    r.close()


# -- the version --------------------------------------------------------------------------------

def test_a_version_1_request_is_refused_naming_both_versions(receiver: tuple[Served, FakeReceiver], raw: Raw) -> None:
    s, fake = receiver
    assert raw.ask({"id": 7, "v": 1, "op": "expect", "room": 1, "group": "g", "dst_pages": [1], "aux_slot": 0}) == {
        "id": 7, "v": V, "ok": False, "code": "version",
        "error": "engine API version 1 from the client; this daemon speaks 2"}
    assert raw.ask({"id": 8, "op": "ping"}) == {  # what a version-1 client sends: no "v"
        "id": 8, "v": V, "ok": False, "code": "version",
        "error": 'engine API version 1 (no "v") from the client; this daemon speaks 2'}
    assert fake.calls == [] and fake.rooms == {}  # nothing was done
    assert s.srv.refused == {"engine_version": 2}


def test_the_client_raises_the_daemons_version_refusal(endpoint: str) -> None:
    """A daemon of a later version refuses this client's requests; the client raises the refusal
    as a VersionMismatch naming the endpoint and both versions."""
    with FakeDaemon(endpoint, lambda req: {"id": req["id"], "v": 3, "ok": False, "code": "version",
                                           "error": f"engine API version {req['v']} from the client; "
                                                    "this daemon speaks 3"}) as daemon:
        dc = DecodeClient(endpoint, timeout_s=20)
        with pytest.raises(VersionMismatch) as info:
            dc.ping()
        dc.close()
    assert str(info.value) == (f"engine API of {endpoint}: engine API version 2 from the client; "
                               "this daemon speaks 3")
    assert daemon.got == [{"id": 1, "v": 2, "op": "ping"}]


def test_the_client_refuses_a_reply_without_a_version(endpoint: str) -> None:
    """A version-1 daemon ignores "v" and answers without one: the client raises, naming both."""
    with FakeDaemon(endpoint, lambda req: {"id": req["id"], "ok": True, "result": {"name": "old", "pid": 1}}):
        pc = PrefillClient(endpoint, timeout_s=20)
        with pytest.raises(VersionMismatch) as info:
            pc.ping()
        pc.close()
    assert str(info.value) == (f'engine API of {endpoint}: engine API version 1 (no "v") from the daemon; '
                               "this client speaks 2")


class FakeDaemon:
    """A ROUTER (or a Unix listening socket) answering one request with ``answer(request)``,
    from a thread."""

    def __init__(self, endpoint: str, answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        path = unix_path(endpoint)
        self.listen: socket.socket | None = None
        if path is not None:
            self.listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listen.bind(str(path))
            self.listen.listen(1)
            self.listen.settimeout(20)
        else:
            self.sock = zmq.Context.instance().socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.bind(endpoint)
        self.answer = answer
        self.got: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        if self.listen is not None:
            conn, _ = self.listen.accept()
            wire = UnixWire.__new__(UnixWire)
            wire.sock, wire.buf, wire.connected = conn, b"", True
            conn.settimeout(20)
            req = msgpack.unpackb(wire.recv(), raw=False)
            self.got.append(req)
            wire.send(msgpack.packb(self.answer(req), use_bin_type=True))
            wire.close()
        elif self.sock.poll(20_000):
            ident, body = self.sock.recv_multipart()
            req = msgpack.unpackb(body, raw=False)
            self.got.append(req)
            self.sock.send_multipart([ident, msgpack.packb(self.answer(req), use_bin_type=True)])

    def __enter__(self) -> FakeDaemon:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(25)
        if self.listen is not None:
            self.listen.close()
        else:
            self.sock.close(linger=0)


# -- requests and replies ------------------------------------------------------------------------

def test_a_correct_request_gets_its_result(receiver: tuple[Served, FakeReceiver], raw: Raw) -> None:
    s, fake = receiver
    reply = raw.ask({"id": "a", "v": V, "op": "expect", "room": 5, "group": "prefill0", "dst_pages": [3, 4],
                     "prefix_pages": 1, "state": {"conv": [2]}, "aux_slot": 9})
    assert reply == {"id": "a", "v": V, "ok": True, "result": {"state": "waiting", "code": "", "reason": ""}}
    assert fake.calls == [("expect", RoomRequest(5, "prefill0", (3, 4), 1, {"conv": (2,)}, 9))]
    assert raw.ask({"id": 2, "v": V, "op": "ping"}) == {"id": 2, "v": V, "ok": True,
                                                         "result": {"name": "decode0", "pid": 1}}
    assert raw.ask({"id": 3, "v": V, "op": "abort", "group": "prefill0", "room": 5, "reason": "gone"})["result"] == {
        "state": "failed", "code": "aborted", "reason": "gone"}
    assert s.srv.refused == {}


def test_refusals_are_answered_and_counted_by_code(receiver: tuple[Served, FakeReceiver], raw: Raw) -> None:
    s, fake = receiver
    assert raw.ask({"id": 1, "v": V, "op": "submit", "room": 1, "src_pages": []}) == {
        "id": 1, "v": V, "ok": False, "code": "bad_request",
        "error": "unknown op 'submit'; known: batch, abort, expect, ping, poll, release, stats, status, wait"}
    assert raw.ask({"id": 2, "v": V, "op": "expect", "room": -1, "group": "g", "dst_pages": [1], "aux_slot": 0}) == {
        "id": 2, "v": V, "ok": False, "code": "bad_request",
        "error": "room must be an unsigned 64-bit integer, not -1"}
    assert raw.ask({"id": 3, "v": V, "op": "poll", "group": "g", "room": 1}) == {
        "id": 3, "v": V, "ok": False, "code": "unknown_room", "error": "room g/1 is not held"}
    assert raw.ask({"id": 4, "v": V, "op": "expect", "room": 667, "group": "g", "dst_pages": [], "aux_slot": 0}) == {
        "id": 4, "v": V, "ok": False, "code": "bad_request",
        "error": "expect: bad arguments: ValueError: an unchecked argument"}
    assert raw.ask({"id": 5, "v": V, "op": "expect", "room": 666, "group": "g", "dst_pages": [], "aux_slot": 0}) == {
        "id": 5, "v": V, "ok": False, "code": "internal", "error": "expect: internal error: RuntimeError: a bug"}
    assert raw.ask([1, 2]) == {"id": None, "v": V, "ok": False, "code": "decode",
                               "error": "malformed request: request must be a map with a string 'op'"}
    raw.send_bytes(b"\xc1")
    reply = raw.recv()
    assert reply["id"] is None and reply["code"] == "decode" and reply["error"].startswith("malformed request: ")
    assert s.srv.refused == {"engine_unknown_op": 1, "engine_bad_request": 2, "engine_unknown_room": 1,
                             "engine_decode": 2}  # the internal error is logged, not counted
    assert [c[0] for c in fake.calls] == ["expect", "expect"]  # the checked ones only


def test_a_wait_is_answered_when_it_ends_and_others_are_served_meanwhile(
        receiver: tuple[Served, FakeReceiver], raw: Raw) -> None:
    s, fake = receiver
    raw.ask({"id": 1, "v": V, "op": "expect", "room": 5, "group": "g", "dst_pages": [], "aux_slot": 0})
    raw.send({"id": "w", "v": V, "op": "wait", "group": "g", "room": 5, "timeout_s": 30})
    # the wait is pending; a poll on the same socket is answered first
    assert raw.ask({"id": "p", "v": V, "op": "poll", "group": "g", "room": 5})["id"] == "p"
    assert raw.ask({"id": "r", "v": V, "op": "release", "group": "g", "room": 5})["id"] == "r"
    # the release ended the wait with the error its room now gives
    assert raw.recv() == {"id": "w", "v": V, "ok": False, "code": "unknown_room", "error": "room g/5 is not held"}
    assert ("wait", "g", 5, 30.0) in fake.calls


def test_a_batch_answers_each_call_in_place(receiver: tuple[Served, FakeReceiver], raw: Raw) -> None:
    s, fake = receiver
    reply = raw.ask({"id": 9, "v": V, "op": "batch", "calls": [
        {"op": "expect", "room": 1, "group": "g", "dst_pages": [1], "aux_slot": 0},
        {"op": "expect", "room": 1, "group": "g", "dst_pages": [1], "aux_slot": 0},
        {"op": "poll", "group": "g", "room": 1},
        {"op": "batch", "calls": []},
        {"op": "submit", "room": 1, "src_pages": []},
        {"op": "ping", "v": 1},
        {"op": "wait", "group": "g", "room": 1, "timeout_s": -1},
        {"op": "ping"},
    ]})
    assert reply == {"id": 9, "v": V, "ok": True, "result": [
        {"ok": True, "result": {"state": "waiting", "code": "", "reason": ""}},
        {"ok": False, "code": "room_exists", "error": "room g/1 is still held"},
        {"ok": True, "result": {"state": "waiting", "code": "", "reason": ""}},
        {"ok": False, "code": "bad_request", "error": "batches do not nest"},
        {"ok": False, "code": "bad_request",
         "error": "unknown op 'submit'; known: batch, abort, expect, ping, poll, release, stats, status, wait"},
        {"ok": False, "code": "version", "error": "engine API version 1 from the client; this daemon speaks 2"},
        {"ok": False, "code": "bad_request",
         "error": "timeout_s must be a finite non-negative number of seconds, not -1"},
        {"ok": True, "result": {"name": "decode0", "pid": 1}},
    ]}
    assert s.srv.refused == {"engine_room_exists": 1, "engine_bad_request": 2, "engine_unknown_op": 1,
                             "engine_version": 1}
    assert raw.ask({"id": 10, "v": V, "op": "batch", "calls": "x"}) == {
        "id": 10, "v": V, "ok": False, "code": "bad_request",
        "error": "batch: 'calls' must be a list of at most 65536 request maps"}


def test_a_batch_of_waits_answers_when_the_last_one_ends(receiver: tuple[Served, FakeReceiver]) -> None:
    s, fake = receiver
    dc = DecodeClient(s.srv.bound, timeout_s=20)
    out = dc.expect_many([Expect(room=r, group="g", dst_pages=(), aux_slot=0) for r in (1, 2)]
                         + [{"room": 3, "group": "g", "dst_pages": range(2), "aux_slot": 0}])
    assert out == [WAITING] * 3
    waiter = DecodeClient(s.srv.bound, timeout_s=20)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.extend(waiter.wait_many([(1, "g"), (2, "g"), (9, "g")], 30)))
    t.start()
    # both waits are registered once their handlers ran; then end them
    while sum(1 for c in list(fake.calls) if c[0] == "wait") < 2:
        assert t.is_alive(), result
        dc.ping()  # a round trip through the server's loop, not a sleep
    assert not result
    assert dc.abort(1, "g", "stop") == RoomStatus(RoomState.FAILED, "aborted", "stop")  # one ends ...
    assert dc.ping() and not result  # ... the batch still waits for the other
    assert dc.release(2, "g") == WAITING
    t.join(20)
    assert not t.is_alive()
    assert result[0] == RoomStatus(RoomState.FAILED, "aborted", "stop")  # how it ended
    assert isinstance(result[1], UnknownRoom) and str(result[1]) == "room g/2 is not held"  # released meanwhile
    assert isinstance(result[2], UnknownRoom) and str(result[2]) == "room g/9 is not held"
    dc.close()
    waiter.close()


# -- the Python clients against the server ----------------------------------------------------------

def test_the_decode_client(receiver: tuple[Served, FakeReceiver]) -> None:
    import numpy as np

    s, fake = receiver
    dc = DecodeClient(s.srv.bound, timeout_s=20)
    assert dc.expect(np.int64(4), "g", np.arange(3), aux_slot=np.int32(2), prefix_pages=1,  # type: ignore[arg-type]
                     state={"conv": np.array([7])}) == WAITING
    assert fake.calls[-1] == ("expect", RoomRequest(4, "g", (0, 1, 2), 1, {"conv": (7,)}, 2))
    assert dc.poll(4, "g") == WAITING
    assert dc.abort(4, "g", "bye") == RoomStatus(RoomState.FAILED, "aborted", "bye")
    assert dc.release(4, "g").code == "aborted"
    with pytest.raises(UnknownRoom):
        dc.poll(4, "g")
    assert dc.ping() == {"name": "decode0", "pid": 1}
    assert dc.stats() == {"role": "receiver", "rooms": 0} and dc.status() == {"role": "receiver", "groups": {}}
    # a request the client itself refuses is never sent (the daemon counts nothing)
    with pytest.raises(BadRequest, match="^room must be an unsigned 64-bit integer, not -1$"):
        dc.expect(-1, "g", [1], aux_slot=0)
    # raw calls are sent as given, and checked by the daemon
    with pytest.raises(BadRequest, match="^room must be an unsigned 64-bit integer, not -1$"):
        dc.call("expect", room=-1, group="g", dst_pages=[1], aux_slot=0)
    with pytest.raises(BadRequest, match="^unknown op 'explode'"):
        dc.call("explode")
    assert s.srv.refused == {"engine_unknown_room": 1, "engine_bad_request": 1, "engine_unknown_op": 1}
    out = dc.expect_many([{"room": 1, "group": "g", "dst_pages": [1], "aux_slot": 0},
                          {"room": 2, "group": "g", "dst_pages": [1], "aux_slot": 0, "prefix_page": 1},
                          {"room": 1, "group": "g", "dst_pages": [1], "aux_slot": 0}])
    assert out[0] == WAITING
    assert isinstance(out[1], BadRequest) and str(out[1]) == "expect: unknown field 'prefix_page'"
    assert isinstance(out[2], RoomExists)
    raw = dc.batch([{"op": "batch", "calls": []}, Ping()])
    assert isinstance(raw[0], BadRequest) and str(raw[0]) == "batches do not nest" and raw[1]["name"] == "decode0"
    dc.close()


def test_a_wait_timeout_that_is_nan_negative_infinite_or_over_a_day_is_refused(
        receiver: tuple[Served, FakeReceiver]) -> None:
    s, fake = receiver
    dc = DecodeClient(s.srv.bound, timeout_s=20)
    assert dc.expect(1, "g", [1], aux_slot=0) == WAITING
    bad = {float("nan"): "a finite non-negative number of seconds, not nan",
           -1: "a finite non-negative number of seconds, not -1",
           float("inf"): "a finite non-negative number of seconds, not inf",
           1e300: "at most 86400 seconds, not 1e+300",  # the client once died here: OverflowError in poll
           1 << 63: f"at most 86400 seconds, not {1 << 63}"}
    for timeout, says in bad.items():
        # the client refuses it before sending; sent raw, the daemon refuses it with the same words
        with pytest.raises(BadRequest) as client:
            dc.wait(1, "g", timeout_s=timeout)
        with pytest.raises(BadRequest) as daemon:
            dc.call("wait", room=1, group="g", timeout_s=timeout)
        assert str(client.value) == str(daemon.value) == f"timeout_s must be {says}"
        many = dc.wait_many([(1, "g")], timeout_s=timeout)
        assert len(many) == 1 and isinstance(many[0], BadRequest) and str(many[0]) == f"timeout_s must be {says}"
    assert s.srv.refused == {"engine_bad_request": len(bad)}
    assert not [c for c in fake.calls if c[0] == "wait"]  # no wait reached the receiver
    dc.close()


def test_the_prefill_client(sender: tuple[Served, FakeSender]) -> None:
    import numpy as np

    s, fake = sender
    pc = PrefillClient(s.srv.bound, timeout_s=20)
    assert pc.submit(3, 0, np.array([5, 6]), last=1, state={"conv": [1]}, aux_slot=np.int64(0)) == WAITING  # type: ignore[arg-type]
    assert fake.calls[-1] == ("submit", 3, 0, (5, 6), True, {"conv": (1,)}, 0)
    assert pc.poll(3) == SUCCESS and pc.wait(3, 5) == SUCCESS and fake.calls[-1] == ("wait", 3, 5.0)
    assert pc.abort(3).reason == "" and fake.calls[-1] == ("abort", 3, "")
    assert pc.ping() == {"name": "prefill0/r0", "pid": 2}
    out = pc.submit_many([Submit(room=4, src_pages=(1,)), {"room": 5, "src_pages": range(2), "last": True},
                          {"room": 6, "src_pages": [-1]}])
    assert out[:2] == [WAITING, WAITING]
    assert isinstance(out[2], BadRequest) and str(out[2]) == "src_pages: index -1 is negative or absurdly large"
    assert fake.calls[-2:] == [("submit", 4, 0, (1,), False, {}, None), ("submit", 5, 0, (0, 1), True, {}, None)]
    assert pc.submit_many([{"room": -1, "src_pages": []}])[0].__class__ is BadRequest  # nothing sent at all
    with pytest.raises(BadRequest, match="^unknown op 'expect'"):
        pc.call("expect", room=1, group="g", dst_pages=[], aux_slot=0)
    assert s.srv.refused == {"engine_unknown_op": 1}
    pc.close()


def test_a_reply_that_cannot_be_encoded_is_an_internal_error_and_the_next_one_is_whole(
        endpoint: str, raw: Raw) -> None:
    """The server keeps one msgpack Packer: a reply that fails half-way must not leave its bytes
    in the next one."""
    fake = FakeReceiver()
    table = receiver_api.handlers(fake)
    table[Stats] = lambda r: {"role": "receiver", "bad": object()}
    s = Served(endpoint, table)
    try:
        reply = raw.ask({"id": 1, "v": V, "op": "stats"})
        assert reply["id"] == 1 and reply["ok"] is False and reply["code"] == "internal"
        assert reply["error"].startswith("internal error: reply not encodable: ")
        assert raw.ask({"id": 2, "v": V, "op": "ping"}) == {"id": 2, "v": V, "ok": True,
                                                             "result": {"name": "decode0", "pid": 1}}
    finally:
        s.close()


def test_a_client_packs_each_request_alone(receiver: tuple[Served, FakeReceiver]) -> None:
    """The client keeps one msgpack Packer too: an argument msgpack cannot carry fails that call
    alone; the next request goes out whole."""
    s, fake = receiver
    dc = DecodeClient(s.srv.bound, timeout_s=20)
    with pytest.raises(TypeError):
        dc.call("poll", room=1, group=object())
    assert dc.ping() == {"name": "decode0", "pid": 1}
    assert dc.expect(8, "g", [1, 2], aux_slot=0) == WAITING
    assert fake.calls[-1] == ("expect", RoomRequest(8, "g", (1, 2), 0, {}, 0))
    dc.close()


# -- the handler tables --------------------------------------------------------------------------------

def test_each_role_handles_exactly_its_requests() -> None:
    assert set(receiver_api.handlers(FakeReceiver())) == set(RECEIVER_OPS.values())
    assert set(sender_api.handlers(FakeSender())) == set(SENDER_OPS.values())
    assert {Expect, ReceiverPoll, ReceiverWait, ReceiverAbort, Release, Stats, Status, Ping} == set(RECEIVER_OPS.values())
    assert {Submit, SenderPoll, SenderWait, SenderAbort, Stats, Status, Ping} == set(SENDER_OPS.values())


def test_a_table_of_no_role_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="not one role's ops"):
        Served(endpoint, {Expect: print, Submit: print})
