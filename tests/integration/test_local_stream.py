"""The engine API's unix:// transport (docs/PROTOCOL.md §17) against clients that misbehave: a
frame over the limit, a request a byte at a time, many requests in one write, replies never
read, too many connections, a client gone while its wait runs; and the Python client against a
daemon that is not up yet, that is restarted between calls, or that is not there at all. A real
LocalApiServer on an event loop in a thread, real Unix sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from tests.integration.test_local_api import FakeReceiver, Served, UnixWire, V
from transferd.client import DecodeClient
from transferd.errors import ClientTimeout
from transferd.receiver import api as receiver_api
from transferd.transport import local_stream
from transferd.transport.local_api import MAX_LOCAL_REQUEST_BYTES
from transferd.transport.local_stream import FRAME, UnixConn


def _served(endpoint: str) -> tuple[Served, FakeReceiver]:
    fake = FakeReceiver()
    return Served(endpoint, receiver_api.handlers(fake)), fake


def _ask(w: UnixWire, obj: object) -> dict[str, object]:
    w.send(msgpack.packb(obj, use_bin_type=True))
    reply: dict[str, object] = msgpack.unpackb(w.recv(), raw=False)
    return reply


def _closed(sock: socket.socket) -> bool:
    """True once the daemon has closed this connection (EOF or reset within 20 s)."""
    sock.settimeout(20)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


PING = {"id": 1, "v": V, "op": "ping"}
PONG = {"id": 1, "v": V, "ok": True, "result": {"name": "decode0", "pid": 1}}


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"unix://{tmp_path}/api/rx.sock"


@pytest.fixture
def served(endpoint: str) -> Iterator[tuple[Served, FakeReceiver]]:
    s, fake = _served(endpoint)
    try:
        yield s, fake
    finally:
        s.close()


def _signalled(monkeypatch: pytest.MonkeyPatch, method: str) -> threading.Semaphore:
    """A semaphore released after each call of ``UnixConn.<method>`` on the daemon's loop (patched
    before the connection is accepted: the loop holds the bound method)."""
    sem, orig = threading.Semaphore(0), getattr(UnixConn, method)

    def signalling(self: UnixConn, *a: object) -> None:
        orig(self, *a)
        sem.release()
    monkeypatch.setattr(UnixConn, method, signalling)
    return sem


def test_the_socket_is_private_and_a_stale_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "api").mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "api" / "rx.sock"))  # a previous run's, nobody listening
    stale.close()
    s, _ = _served(f"unix://{tmp_path}/api/rx.sock")
    try:
        path = tmp_path / "api" / "rx.sock"
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
        w = UnixWire(str(path))
        assert _ask(w, PING) == PONG
        w.close()
    finally:
        s.close()
    assert not (tmp_path / "api" / "rx.sock").exists()  # removed on close


def test_a_frame_over_the_limit_closes_that_connection_only(endpoint: str, served: tuple[Served, FakeReceiver]) -> None:
    s, fake = served
    bad, good = UnixWire(endpoint[7:]), UnixWire(endpoint[7:])
    assert _ask(good, PING) == PONG
    bad.send(b"")  # connects; an empty frame is a request that does not decode
    assert msgpack.unpackb(bad.recv(), raw=False)["code"] == "decode"
    bad.sock.sendall(FRAME.pack(MAX_LOCAL_REQUEST_BYTES + 1) + b"x" * 100)
    assert _closed(bad.sock)
    assert s.srv.refused["engine_too_large"] == 1 and s.srv.refused["engine_decode"] == 1
    assert _ask(good, {**PING, "id": 2}) == {**PONG, "id": 2}
    assert fake.calls == []
    bad.close()
    good.close()


def test_a_request_a_byte_at_a_time_and_many_in_one_write(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _signalled(monkeypatch, "_on_readable")
    s, _ = _served(endpoint)
    try:
        w = UnixWire(endpoint[7:])
        w.send(b"")  # connect
        w.recv()
        assert reads.acquire(timeout=20)
        body = msgpack.packb(PING, use_bin_type=True)
        for b in FRAME.pack(len(body)) + body:  # each byte read by a read of its own
            w.sock.sendall(bytes([b]))
            assert reads.acquire(timeout=20), "the daemon did not read the byte"
        assert msgpack.unpackb(w.recv(), raw=False) == PONG
        # more than one loop turn's budget of requests in one write: every one answered, in order
        n = 3 * local_stream.BUDGET + 5
        w.sock.sendall(b"".join(FRAME.pack(len(b)) + b for b in
                                (msgpack.packb({**PING, "id": i}, use_bin_type=True) for i in range(n))))
        assert [msgpack.unpackb(w.recv(), raw=False)["id"] for _ in range(n)] == list(range(n))
        w.close()
    finally:
        s.close()


def test_replies_left_unread_close_the_connection_and_others_are_served(
        endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_stream, "MAX_PENDING_REPLY_BYTES", 64 << 10)
    s, _ = _served(endpoint)
    try:
        good = UnixWire(endpoint[7:])
        hog = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.connect(endpoint[7:])
        hog.settimeout(20)
        stats = msgpack.packb({"id": 1, "v": V, "op": "stats"}, use_bin_type=True)
        frame = FRAME.pack(len(stats)) + stats
        sent = 0
        try:
            while s.srv.refused["engine_unread_replies"] == 0 and sent < 200_000:
                hog.sendall(frame * 100)  # never reads a reply
                sent += 100
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed(hog)  # counted before it is closed
        assert s.srv.refused["engine_unread_replies"] == 1
        assert _ask(good, PING) == PONG  # the loop was never blocked
        hog.close()
        good.close()
    finally:
        s.close()


def test_connections_past_the_limit_are_closed_and_counted(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_stream, "MAX_CONNECTIONS", 2)
    closes = _signalled(monkeypatch, "close")  # the one past the limit is never a UnixConn
    s, _ = _served(endpoint)
    try:
        a, b, c = (UnixWire(endpoint[7:]) for _ in range(3))
        assert _ask(a, PING) == PONG and _ask(b, PING) == PONG
        try:
            c.send(msgpack.packb(PING, use_bin_type=True))  # may find it closed already
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed(c.sock)
        assert s.srv.refused["engine_too_many_connections"] == 1
        a.close()  # a place comes free
        assert closes.acquire(timeout=20)
        d = UnixWire(endpoint[7:])
        assert _ask(d, PING) == PONG
        for w in (b, c, d):
            w.close()
    finally:
        s.close()


def test_a_client_gone_while_its_wait_runs_leaves_the_daemon_serving(
        endpoint: str, served: tuple[Served, FakeReceiver]) -> None:
    s, fake = served
    w = UnixWire(endpoint[7:])
    _ask(w, {"id": 1, "v": V, "op": "expect", "room": 5, "group": "g", "dst_pages": [], "aux_slot": 0})
    w.send(msgpack.packb({"id": 2, "v": V, "op": "wait", "group": "g", "room": 5, "timeout_s": 30},
                         use_bin_type=True))
    deadline = time.monotonic() + 20
    while ("wait", "g", 5, 30.0) not in fake.calls:  # the wait's coroutine starts a loop turn later:
        assert time.monotonic() < deadline, "the wait never started"
        assert _ask(w, {**PING, "id": 3})["id"] == 3  # each round trip gives the loop a turn
    w.close()  # gone before the wait's answer
    other = UnixWire(endpoint[7:])
    assert _ask(other, {"id": 4, "v": V, "op": "release", "group": "g", "room": 5})["ok"] is True  # ends the wait
    assert _ask(other, PING) == PONG
    other.close()


def test_the_client_waits_for_a_daemon_that_comes_up_and_survives_its_restart(tmp_path: Path) -> None:
    endpoint = f"unix://{tmp_path}/rx.sock"
    dc = DecodeClient(endpoint, timeout_s=20)
    served: list[Served] = []
    late = threading.Timer(0.3, lambda: served.append(_served(endpoint)[0]))
    late.start()
    try:
        assert dc.ping() == {"name": "decode0", "pid": 1}  # connected once the daemon was up
        served.pop().close()
        served.append(_served(endpoint)[0])  # restarted: the old connection is dead
        assert dc.ping() == {"name": "decode0", "pid": 1}
    finally:
        late.join()
        for s in served:
            s.close()
        dc.close()


def test_the_client_names_the_endpoint_when_no_daemon_answers(tmp_path: Path) -> None:
    endpoint = f"unix://{tmp_path}/nobody.sock"
    dc = DecodeClient(endpoint, timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(ClientTimeout, match=f"no answer to 'ping' from {endpoint} within 0.3s: no daemon listening"):
        dc.ping()
    assert time.monotonic() - t0 < 10
    dc.close()
