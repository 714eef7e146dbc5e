"""A hostile or broken peer on a real socket against a real receiver process.

A raw ZeroMQ DEALER with its own identity sends what no correct sender would: malformed msgpack,
headers of the wrong shape, unknown types, wrong versions, bad registrations, and — after
registering correctly as a fake sender and being assigned a room — data that lies about its
length, strays outside its plan, repeats itself, or arrives after ``done``. Every case asserts
the exact refusal code the receiver counts (and one log line for it), the room's outcome, that
not one byte outside the intended rows of the decode pool changed, and that the receiver keeps
serving: a normal room from real sender processes succeeds byte-exact afterwards.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from transferd.config import from_mapping
from transferd.layout import PoolLayout, layout_difference
from transferd.pool import Pool
from transferd.protocol.messages import (
    MAX_BUNDLE_MSGS,
    PROTOCOL_VERSION,
    Assign,
    Bundle,
    Done,
    Fail,
    Ping,
    Pong,
    Register,
    Registered,
    Status,
)
from transferd.protocol.room import RoomState

from .conftest import MOONCAKE
from .harness import MODEL, Cluster, Proc, fill_random
from .rooms import expect, make_room, mismatches, submit_all

KV, STATE, AUX = 0, 1, 2
REAL_GROUP = "real0"
# rows of the decode pool the real senders' rooms use; fake rooms stay below them
REAL_DST, REAL_N, REAL_SLOT = 200, 11, 56

# the fake sender's own pool: same model as the receiver, other row counts (allowed to differ)
FAKE_LAYOUT: PoolLayout = from_mapping(
    {"model": MODEL, "sender": {"kv_pages": 64, "state_slots": 8, "aux_slots": 8}}, "<fake>", env={}
).sender_layout()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def register_header(group: str, rank: int, cp_size: int, layout: PoolLayout = FAKE_LAYOUT, *,
                    split: str = "pages", checksum: str = "none", inc: int = 0x5EED,
                    stream: bool = False) -> dict[str, Any]:
    return Register(group, rank, cp_size, split, layout.fingerprint(), layout.to_wire(), inc, os.getpid(),
                    "hostile-test", 0, checksum, stream=stream).header()


def stream_connect(port: int, hello: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(hello)
    return s


def record(header: bytes, *payloads: bytes, payload_len: int | None = None) -> bytes:
    """One data-stream record (stream.py): u32 header length, u64 payload length, header, payload."""
    body = b"".join(payloads)
    return struct.pack("<IQ", len(header), len(body) if payload_len is None else payload_len) + header + body


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    """The receiver closed ``s`` (within ``timeout``; 0: already)."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except (BlockingIOError, TimeoutError):
        return False


class Fake:
    """A raw DEALER that speaks (or abuses) the wire protocol by hand; answers pings."""

    _ids = itertools.count()

    def __init__(self, endpoint: str, name: str = "fake") -> None:
        self.ident = f"hostile-{name}-{os.getpid()}-{next(self._ids)}".encode()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.ident)
        self.sock.setsockopt(zmq.SNDTIMEO, 10_000)
        self.sock.connect(endpoint)
        self.inbox: list[dict[str, Any]] = []
        self.bundles = 0  # bundles received
        self.stream: socket.socket | None = None
        self.offer: dict[str, Any] = {}  # the registered answer whose stream use_stream opened

    def use_stream(self, reply: dict[str, Any]) -> None:
        """From now on data, data-batch, data-done and done go on the data stream the receiver offered."""
        assert reply["stream_port"] and len(reply["stream_key"]) == 16, reply
        self.offer = reply
        self.stream = stream_connect(reply["stream_port"], b"TDSTREAM" + reply["stream_key"])

    def send(self, *frames: bytes) -> None:
        if self.stream is not None:
            head = msgpack.unpackb(frames[0], raw=False)
            if (isinstance(head, list) and head and head[0] in (1, 4, 5)) or (
                    isinstance(head, dict) and head.get("t") == "done"):
                self.stream.sendall(record(frames[0], *frames[1:]))
                return
        self.sock.send_multipart(list(frames))

    def ctrl(self, header: dict[str, Any]) -> None:
        self.send(pack(header))

    def data(self, tok: int, kind: int, buffer: int, pos: int, count: int, payload: bytes,
             checksum: int | None = None) -> None:
        h = [1, tok, kind, buffer, pos, count] + ([] if checksum is None else [checksum])
        self.send(pack(h), payload)

    def data_done(self, tok: int, rank: int, entries: list[tuple[int, int, int, int]], payloads: list[bytes]) -> None:
        """A data-done message: these entries' rows, then the done of ``rank`` (PROTOCOL §4)."""
        self.send(pack([5, tok, rank, [0, 0, 0], [list(e) for e in entries]]), *payloads)

    def _recv_one(self, timeout_ms: int) -> bool:
        if not self.sock.poll(timeout_ms):
            return False
        frames = self.sock.recv_multipart()
        assert len(frames) == 1, f"receiver sent {len(frames)} frames"
        msg = msgpack.unpackb(frames[0], raw=False)
        msgs = [msg]
        if msg.get("t") == "bundle":  # several in one (PROTOCOL §3.1): each entry a message as sent alone
            assert msg["v"] == PROTOCOL_VERSION and 2 <= len(msg["msgs"]) <= MAX_BUNDLE_MSGS, msg
            msgs = [msgpack.unpackb(e, raw=False) for e in msg["msgs"]]
            assert all(m["t"] in ("registered", "assign", "status", "ping", "pong") for m in msgs), msgs
            self.bundles += 1
        for m in msgs:
            if m.get("t") == "ping":
                self.ctrl(Pong(m["seq"]).header())
            else:
                self.inbox.append(m)
        return True

    def pump(self) -> None:
        while self._recv_one(0):
            pass

    def next(self, t: str, timeout: float = 15.0) -> dict[str, Any]:
        """The next message of type ``t`` (pings are answered on the way)."""
        end = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.inbox):
                if m.get("t") == t:
                    return self.inbox.pop(i)
            left = end - time.monotonic()
            assert left > 0, f"{self.ident!r}: no {t!r} message within {timeout}s (inbox: {self.inbox})"
            self._recv_one(int(min(left, 0.2) * 1000) + 1)

    def register(self, group: str, rank: int = 0, cp_size: int = 1, **kw: Any) -> dict[str, Any]:
        self.ctrl(register_header(group, rank, cp_size, **kw))
        return self.next("registered")

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.sock.close(linger=0)


@dataclass
class Env:
    cluster: Cluster
    ep: str
    dc: Any
    dpool: Pool
    pcs: list[Any]
    spools: list[Pool]
    proc: Proc
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1000))
    fakes: list[Fake] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)  # the fakes' Mooncake engines (kept alive)

    def fake(self, name: str = "fake") -> Fake:
        f = Fake(self.ep, name)
        self.fakes.append(f)
        return f

    def refused(self) -> dict[str, int]:
        return dict(self.dc.stats()["refused"])

    def log_lines(self, code: str) -> int:
        return len(re.findall(rf"refused \({re.escape(code)}\)", self.proc.log.read_text(errors="replace")))

    def until(self, fn: Callable[[], Any], what: str) -> Any:
        def step() -> Any:
            for f in self.fakes:
                f.pump()  # answer the receiver's pings while waiting
            return fn()
        return self.cluster.until(step, what, self.proc)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    keys = set(after) | set(before)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def assert_serves(env: Env) -> None:
    """The receiver is alive and a normal room from the real senders succeeds byte-exact."""
    assert env.proc.proc.poll() is None, f"receiver died:\n{env.cluster.logs()}"
    rid = next(env.ids)
    r = make_room(rid, REAL_GROUP, REAL_N, 2, chunks=[(0, 5), (5, REAL_N)], dst_start=REAL_DST, slot=REAL_SLOT,
                  spools=env.spools)
    before = [rows.copy() for rows in env.dpool.rows]
    expect(env.dc, r)
    submit_all(env.pcs, r)
    st = env.dc.wait(rid, REAL_GROUP, 20)
    assert st.state is RoomState.SUCCESS, (st, env.cluster.logs())
    assert [pc.wait(rid, 20).state for pc in env.pcs] == [RoomState.SUCCESS] * 2
    assert mismatches(r, env.dpool, env.spools, "pages", before) == 0
    env.dc.release(rid, REAL_GROUP)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    c = Cluster(Path(tmp_path_factory.mktemp("hostile")))
    fakes: list[Fake] = []
    try:
        # the receiver also reads with Mooncake TE (from the fakes that offer it; the real senders do not)
        mc = {"data_plane": "mooncake"} if MOONCAKE or os.environ.get("CI") else {}
        ep, dc, dpool = c.receiver(kv_pages=256, state_slots=64, aux_slots=64, **mc)
        assert layout_difference(FAKE_LAYOUT, dpool.layout) is None
        pcs, spools = c.group(REAL_GROUP, 2, [ep], state_slots=64, aux_slots=64)
        for i, p in enumerate(spools):
            fill_random(p, 10 + i)
        e = Env(c, ep, dc, dpool, pcs, spools, c.procs[0])
        e.fakes = fakes
        yield e
    finally:
        for f in fakes:
            f.close()
        codes = c.close()
        for engine in e.engines:
            engine.close()
    bad = {k: v for k, v in codes.items() if v != 0}
    assert not bad, f"daemons did not exit cleanly on SIGTERM: {bad}\n{c.logs()}"


@pytest.fixture
def guard(env: Env) -> Iterator[Env]:
    """Per test: a randomised decode pool; afterwards the receiver still serves."""
    fill_random(env.dpool, next(env.ids))
    yield env
    for f in env.fakes:
        f.close()
    env.fakes.clear()
    assert_serves(env)


def assert_refused_once(env: Env, before: dict[str, int], logs_before: int, code: str) -> None:
    env.until(lambda: env.refused().get(code, 0) > before.get(code, 0), f"refusal {code!r} to be counted")
    assert delta(env.refused(), before) == {code: 1}
    env.until(lambda: env.log_lines(code) == logs_before + 1, f"one log line for {code!r}")


# -- garbage from an identity that never registered -------------------------------------------

ROW = 512  # row_bytes of a KV buffer of the harness model (page 4 × 64 elems × bf16)

GARBAGE: list[tuple[str, list[bytes], str]] = [
    ("never-used-byte", [b"\xc1"], "decode"),
    ("empty-frame", [b""], "decode"),
    ("truncated-array", [b"\x96\x01\x05"], "decode"),
    ("truncated-str", [b"\xa9abc"], "decode"),
    ("trailing-bytes", [pack({"t": "ping", "v": PROTOCOL_VERSION, "seq": 1}) + b"\x00"], "decode"),
    ("int-header", [pack(42)], "decode"),
    ("str-header", [pack("register")], "decode"),
    ("nil-header", [pack(None)], "decode"),
    ("bin-header", [pack(b"\x01\x02")], "decode"),
    ("float-header", [pack(1.5)], "decode"),
    ("unknown-type", [pack({"t": "explode", "v": PROTOCOL_VERSION})], "decode"),
    ("type-not-str", [pack({"t": 7, "v": PROTOCOL_VERSION})], "decode"),
    ("type-missing", [pack({"v": PROTOCOL_VERSION, "seq": 1})], "decode"),
    ("type-bin", [pack({"t": b"ping", "v": PROTOCOL_VERSION, "seq": 1})], "decode"),
    ("ping-wrong-version", [pack({"t": "ping", "v": PROTOCOL_VERSION + 1, "seq": 1})], "version"),
    ("ping-version-str", [pack({"t": "ping", "v": "1", "seq": 1})], "version"),
    ("ping-seq-str", [pack({"t": "ping", "v": PROTOCOL_VERSION, "seq": "1"})], "decode"),
    ("ping-seq-bool", [pack({"t": "ping", "v": PROTOCOL_VERSION, "seq": True})], "decode"),
    ("ping-seq-negative", [pack({"t": "ping", "v": PROTOCOL_VERSION, "seq": -1})], "decode"),
    ("done-bytes-short", [pack({"t": "done", "v": PROTOCOL_VERSION, "tok": 1, "rank": 0, "bytes": [1, 2]})], "decode"),
    ("data-short", [pack([1, 2, 3]), b"x"], "decode"),
    ("data-long", [pack([1, 1, 0, 0, 0, 1, 0, 9]), b"x"], "decode"),
    ("data-wrong-tag", [pack([9, 1, 0, 0, 0, 1]), b"x"], "decode"),
    ("data-ref-short", [pack([2, 1, 0, 0, 0, 1])], "decode"),
    ("data-kind-3", [pack([1, 1, 3, 0, 0, 1]), b"x"], "decode"),
    ("data-count-0", [pack([1, 1, 0, 0, 0, 0]), b""], "decode"),
    ("data-bool", [pack([1, True, 0, 0, 0, 1]), b"x"], "decode"),
    ("data-negative-pos", [pack([1, 1, 0, 0, -1, 1]), b"x"], "decode"),
    ("data-float", [pack([1, 1, 0, 0, 0.0, 1]), b"x"], "decode"),
    ("data-min-int64-tok", [pack([1, -(1 << 63), 0, 0, 0, 1]), b"x"], "decode"),
    ("data-buffer-2^20", [pack([1, 1, 0, 1 << 20, 0, 1]), b"x"], "decode"),
    ("data-no-payload", [pack([1, 1, 0, 0, 0, 1])], "malformed"),
    ("data-two-payloads", [pack([1, 1, 0, 0, 0, 1]), b"a" * ROW, b"b"], "malformed"),
    ("ping-extra-frame", [pack(Ping(1).header()), b"extra"], "malformed"),
    ("data-done-no-entries", [pack([5, 1, 0, [0, 0, 0], []])], "decode"),
    ("data-done-bytes-short", [pack([5, 1, 0, [0, 0], [[0, 0, 0, 1]]]), b"x"], "decode"),
    ("data-done-rank-str", [pack([5, 1, "0", [0, 0, 0], [[0, 0, 0, 1]]]), b"x"], "decode"),
    ("data-done-no-payload", [pack([5, 1, 0, [0, 0, 0], [[0, 0, 0, 1]]])], "malformed"),
    ("data-done-two-payloads", [pack([5, 1, 0, [0, 0, 0], [[0, 0, 0, 1]]]), b"a" * ROW, b"b"], "malformed"),
    ("data-unregistered", [pack([1, 1, 0, 0, 0, 1]), b"\0" * ROW], "unregistered"),
    ("data-done-unregistered", [pack([5, 1, 0, [0, 0, 0], [[0, 0, 0, 1]]]), b"\0" * ROW], "unregistered"),
    ("ping-unregistered", [pack(Ping(1).header())], "unregistered"),
    ("done-unregistered", [pack(Done(1, 0, 0, 0, 0).header())], "unregistered"),
    ("fail-unregistered", [pack(Fail(1, "x", "y").header())], "unregistered"),
    ("bundle-bad-entry", [pack({"t": "bundle", "v": PROTOCOL_VERSION, "msgs": [b"\xc1"]})], "decode"),
    ("bundle-unregistered", [pack(Bundle((Ping(1), Ping(2))).header())], "unregistered"),
]


@pytest.mark.parametrize(("frames", "code"), [g[1:] for g in GARBAGE], ids=[g[0] for g in GARBAGE])
def test_garbage_from_an_unknown_peer_is_counted_and_writes_nothing(guard: Env, frames: list[bytes],
                                                                      code: str) -> None:
    env = guard
    snap = [rows.copy() for rows in env.dpool.rows]
    before, logs = env.refused(), env.log_lines(code)
    f = env.fake("garbage")
    f.send(*frames)
    assert_refused_once(env, before, logs, code)
    for b, rows in enumerate(env.dpool.rows):
        assert np.array_equal(rows, snap[b]), f"buffer {b} changed"
    # a decode error gets no answer; a wrong-version *register* does (below). Ordering on one
    # connection makes this check exact: the first reply must be to the register sent now.
    f.ctrl(register_header("garbage-probe", 0, 1) | {"v": 99})
    reply = f.next("registered")
    if code == "unregistered":
        # a stranger may be told to register first (rate limited); nothing else answers garbage
        while reply["retry"]:
            assert reply["ok"] is False and "register first" in reply["reason"], reply
            reply = f.next("registered")
    assert reply["ok"] is False and reply["retry"] is False and "protocol version 99" in reply["reason"], reply


# -- registration -------------------------------------------------------------------------

def _other_layout(**model: Any) -> PoolLayout:
    return from_mapping({"model": dict(MODEL, **model)}, "<other>", env={}).sender_layout()


REGISTRATIONS: list[tuple[str, Callable[[str], dict[str, Any]], str, list[str]]] = [
    ("wrong-version", lambda g: register_header(g, 0, 1) | {"v": PROTOCOL_VERSION + 1}, "version",
     [f"protocol version {PROTOCOL_VERSION + 1}", f"speaks {PROTOCOL_VERSION}"]),
    ("no-version", lambda g: {k: v for k, v in register_header(g, 0, 1).items() if k != "v"}, "version",
     ["protocol version None"]),
    ("row-bytes", lambda g: register_header(g, 0, 1, _other_layout(kv_token_elems=32)), "layout",
     ["incompatible layout", "row_bytes", "kv.k.L0", "256", "512"]),
    ("page-size", lambda g: register_header(g, 0, 1, _other_layout(page_size=8)), "layout",
     ["incompatible layout", "page_size differs", "8", "4"]),
    ("buffer-count", lambda g: register_header(g, 0, 1, _other_layout(kv_layers=2)), "layout",
     ["incompatible layout", "buffer count differs"]),
    ("state-dtype", lambda g: register_header(g, 0, 1, _other_layout(
        state=[{"name": "conv", "layers": 3, "slot_shape": [2, 128]},
               {"name": "ssm", "layers": 3, "slot_shape": [128], "dtype": "bf16"}])), "layout",
     ["incompatible layout", "state.ssm.L0", "dtype"]),
    ("fingerprint", lambda g: register_header(g, 0, 1) | {"fp": "0123456789abcdef"}, "layout",
     ["fingerprint does not match"]),
    ("unreadable-layout", lambda g: register_header(g, 0, 1) | {"layout": {"v": PROTOCOL_VERSION, "buffers": 5}}, "layout",
     ["unreadable layout"]),
    ("layout-two-aux", lambda g: register_header(g, 0, 1) | {"layout": dict(
        FAKE_LAYOUT.to_wire(), buffers=FAKE_LAYOUT.to_wire()["buffers"] + [FAKE_LAYOUT.to_wire()["buffers"][-1]])},
     "layout", ["unreadable layout", "exactly one aux buffer"]),
    ("rank-eq-cp", lambda g: register_header(g, 2, 2), "bad_rank", ["rank 2 is outside cp_size 2"]),
    ("rank-far", lambda g: register_header(g, 65536, 8), "bad_rank", ["rank 65536 is outside cp_size 8"]),
    ("split", lambda g: register_header(g, 0, 2, split="diagonal"), "bad_settings", ["split mode", "diagonal"]),
    ("checksum", lambda g: register_header(g, 0, 1, checksum="md5"), "bad_settings", ["checksum", "md5"]),
    ("group-name", lambda g: register_header("bad group/" + g, 0, 1), "bad_settings", ["group name"]),
]


@pytest.mark.parametrize(("make", "code", "needles"), [r[1:] for r in REGISTRATIONS],
                         ids=[r[0] for r in REGISTRATIONS])
def test_bad_registration_is_refused_with_the_reason(guard: Env, make: Callable[[str], dict[str, Any]], code: str,
                                                    needles: list[str]) -> None:
    env = guard
    group = f"reg-{next(env.ids)}"
    before, logs = env.refused(), env.log_lines(code)
    f = env.fake("register")
    f.ctrl(make(group))
    reply = f.next("registered")
    assert reply["ok"] is False and reply["retry"] is False, reply
    for needle in needles:
        assert needle in reply["reason"], (needle, reply["reason"])
    assert_refused_once(env, before, logs, code)
    assert group not in env.dc.status()["groups"]
    # refused means unknown: its data is not attributed to anyone
    b2 = env.refused()
    f.data(1, KV, 0, 0, 1, b"\0" * ROW)
    env.until(lambda: env.refused().get("unregistered", 0) > b2.get("unregistered", 0), "data to be refused")
    assert delta(env.refused(), b2) == {"unregistered": 1}


@pytest.mark.parametrize("field_", ["rank", "cp_size", "inc", "layout", "group", "host", "epoch", "checksum", "fp"])
def test_register_with_a_wrong_field_type_gets_no_answer(guard: Env, field_: str) -> None:
    env = guard
    before, logs = env.refused(), env.log_lines("decode")
    f = env.fake("regtype")
    f.ctrl(register_header(f"rt-{next(env.ids)}", 0, 1) | {field_: [1.5]})
    assert_refused_once(env, before, logs, "decode")
    f.ctrl(register_header("rt-probe", 0, 1) | {"v": 99})
    reply = f.next("registered")  # the first answer on this connection is to the probe
    assert "protocol version 99" in reply["reason"], reply


def test_inconsistent_cp_size_or_split_inside_one_group_is_refused(guard: Env) -> None:
    env = guard
    group = f"incons-{next(env.ids)}"
    a, b, c = env.fake("r0"), env.fake("r1"), env.fake("r1b")
    assert a.register(group, 0, 2)["ok"] is True
    before, logs = env.refused(), env.log_lines("inconsistent_group")
    reply = b.register(group, 1, 3)
    assert reply["ok"] is False and "cp_size 2" in reply["reason"] and "cp_size 3" in reply["reason"], reply
    assert_refused_once(env, before, logs, "inconsistent_group")
    before = env.refused()
    reply = c.register(group, 1, 2, split="layers")
    assert reply["ok"] is False and "split pages" in reply["reason"] and "split layers" in reply["reason"], reply
    env.until(lambda: delta(env.refused(), before) == {"inconsistent_group": 1}, "second refusal")
    g = env.dc.status()["groups"][group]
    assert g["cp_size"] == 2 and g["split"] == "pages" and list(g["ranks"]) == ["0"]


# -- a fake sender that registered correctly and was assigned a room ----------------------

@dataclass
class FakeRoom:
    """A room of the fake group (cp_size 1) and the bytes the fake sends for it."""

    env: Env
    fake: Fake
    group: str
    room: int
    tok: int
    n: int
    prefix: int
    dst: list[int]
    slots: dict[str, list[int]]
    aux: int
    src: dict[int, np.ndarray]
    want: list[np.ndarray]  # what the decode pool must hold: the snapshot plus accepted rows

    @property
    def layout(self) -> PoolLayout:
        return self.env.dpool.layout

    def rows(self, buffer: int, pos: int, count: int) -> bytes:
        return self.src[buffer][pos:pos + count].tobytes()

    def kv(self, buffer: int, pos: int, count: int, *, accepted: bool = True, **kw: Any) -> None:
        self.fake.data(self.tok, KV, buffer, pos, count, self.rows(buffer, pos, count), **kw)
        if accepted:
            self.want[buffer][self.dst[pos:pos + count]] = self.src[buffer][pos:pos + count]

    def state(self, buffer: int, pos: int = 0, count: int = 1, *, accepted: bool = True) -> None:
        self.fake.data(self.tok, STATE, buffer, pos, count, self.rows(buffer, pos, count))
        if accepted:
            comp = self.layout.buffers[buffer].component
            self.want[buffer][self.slots[comp][pos:pos + count]] = self.src[buffer][pos:pos + count]

    def aux_row(self, *, accepted: bool = True) -> None:
        a = self.layout.aux_index
        self.fake.data(self.tok, AUX, a, 0, 1, self.rows(a, 0, 1))
        if accepted:
            self.want[a][self.aux] = self.src[a][0]

    def done(self, rank: int = 0) -> None:
        self.fake.ctrl(Done(self.tok, rank, 0, 0, 0).header())

    def send_all(self, *, done: bool = True) -> int:
        """Every row of the room, honestly; returns the number of data messages sent."""
        for b in self.layout.indices("kv"):
            self.kv(b, self.prefix, self.n - self.prefix)
        for b in self.layout.indices("state"):
            self.state(b, 0, len(self.slots[self.layout.buffers[b].component]))
        self.aux_row()
        if done:
            self.done()
        return len(self.layout.indices("kv")) + len(self.layout.indices("state")) + 1

    def wait(self) -> Any:
        st = self.env.dc.wait(self.room, self.group, 15)
        assert st.state.terminal, st
        return st

    def absorb_real_room(self) -> None:
        """Accept what a real room (:func:`assert_serves`) wrote into its own rows."""
        L, pool = self.layout, self.env.dpool.rows
        for b in L.indices("kv"):
            self.want[b][REAL_DST:REAL_DST + REAL_N] = pool[b][REAL_DST:REAL_DST + REAL_N]
        for b in (*L.indices("state"), L.aux_index):
            self.want[b][REAL_SLOT] = pool[b][REAL_SLOT]

    def check_pool(self) -> None:
        """Not a byte changed but the rows this room was allowed to write."""
        self.env.dc.ping()
        for b, rows in enumerate(self.env.dpool.rows):
            bad = np.nonzero((rows != self.want[b]).any(axis=1))[0]
            assert bad.size == 0, f"buffer {b} ({self.layout.buffers[b].name}) rows {bad[:8].tolist()} differ"


def open_room(env: Env, fake: Fake, group: str, *, n: int = 6, prefix: int = 0, n_slots: int = 1,
              rank: int = 0) -> FakeRoom:
    L = env.dpool.layout
    rid = next(env.ids)
    g = np.random.default_rng(rid)
    base = int(g.integers(0, REAL_DST - max(10, n)))
    dst = [base + i for i in range(n)]
    if n > 3:
        dst[1], dst[2] = dst[2], dst[1]  # a broken run
    slots = {c: [int(s) for s in g.choice(48, n_slots, replace=False)] for c in L.state_components}
    aux = int(g.integers(0, 48))
    src = {b: g.integers(0, 256, (n, L.buffers[b].row_bytes), dtype=np.uint8) for b in L.indices("kv")}
    src |= {b: g.integers(0, 256, (n_slots, L.buffers[b].row_bytes), dtype=np.uint8) for b in L.indices("state")}
    arow = g.integers(0, 256, (1, L.aux_row_bytes), dtype=np.uint8)
    arow[0, :8] = np.frombuffer(np.uint64(rid).astype("<u8").tobytes(), np.uint8)
    src[L.aux_index] = arow
    want = [rows.copy() for rows in env.dpool.rows]
    env.dc.expect(rid, group, dst, aux_slot=aux, prefix_pages=prefix, state=slots)
    a = fake.next("assign")
    assert (a["room"], a["n"], a["prefix"], a["dst"], a["aux"]) == (rid, n, prefix, dst, aux), a
    assert a["state"] == slots
    return FakeRoom(env, fake, group, rid, a["tok"], n, prefix, dst, slots, aux, src, want)


def fake_sender(env: Env, *, channel: str = "zmq", **reg: Any) -> tuple[Fake, str]:
    """A registered fake of a new group; ``channel="stream"``: its data goes on a data stream."""
    group = f"fake-{next(env.ids)}"
    f = env.fake("sender")
    reply = f.register(group, 0, 1, stream=channel == "stream", **reg)
    assert reply["ok"] is True, reply
    if channel == "stream":
        f.use_stream(reply)
    else:
        assert reply["stream_port"] == 0 and reply["stream_key"] == b"", reply  # offered only when asked
    return f, group


def fake_room(env: Env, *, channel: str = "zmq", reg: dict[str, Any] | None = None,
              **room_kw: Any) -> tuple[Fake, str, FakeRoom]:
    """A fake sender of a new group (:func:`fake_sender`) and a room it was assigned (:func:`open_room`)."""
    fake, group = fake_sender(env, channel=channel, **(reg or {}))
    return fake, group, open_room(env, fake, group, **room_kw)


def _kv0(r: FakeRoom) -> int:
    return r.layout.indices("kv")[0]


def _st0(r: FakeRoom) -> int:
    return r.layout.indices("state")[0]


def case_length_short(r: FakeRoom) -> None:
    r.fake.data(r.tok, KV, _kv0(r), 0, 2, r.rows(_kv0(r), 0, 2)[:-1])


def case_length_long(r: FakeRoom) -> None:
    r.fake.data(r.tok, KV, _kv0(r), 0, 2, r.rows(_kv0(r), 0, 3))


def case_length_state_empty(r: FakeRoom) -> None:
    r.fake.data(r.tok, STATE, _st0(r), 0, 1, b"")


def case_length_after_good_rows(r: FakeRoom) -> None:
    r.kv(_kv0(r), 0, 3)  # accepted and written: an intended row
    r.fake.data(r.tok, KV, _kv0(r), 3, 1, r.rows(_kv0(r), 3, 1) + b"\0")


def case_kv_past_the_end(r: FakeRoom) -> None:
    r.fake.data(r.tok, KV, _kv0(r), r.n - 1, 2, r.rows(_kv0(r), 0, 2))


def case_kv_far_away(r: FakeRoom) -> None:
    r.fake.data(r.tok, KV, _kv0(r), (1 << 40) - 1, 1, r.rows(_kv0(r), 0, 1))


def case_kv_in_the_prefix(r: FakeRoom) -> None:
    r.kv(_kv0(r), 0, 1, accepted=False)  # the room (below) has prefix 2


def case_duplicate_overlap(r: FakeRoom) -> None:
    r.kv(_kv0(r), 0, 4)
    r.fake.data(r.tok, KV, _kv0(r), 3, 2, np.full(2 * ROW, 0xAB, np.uint8).tobytes())


def case_duplicate_replay(r: FakeRoom) -> None:
    r.kv(_kv0(r), 2, 2)
    r.fake.data(r.tok, KV, _kv0(r), 2, 2, bytes(2 * ROW))


def case_duplicate_state(r: FakeRoom) -> None:
    r.state(_st0(r))
    r.fake.data(r.tok, STATE, _st0(r), 0, 1, bytes(r.layout.buffers[_st0(r)].row_bytes))


def case_duplicate_aux(r: FakeRoom) -> None:
    r.aux_row()
    r.aux_row(accepted=False)


def case_buffer_out_of_range(r: FakeRoom) -> None:
    r.fake.data(r.tok, KV, len(r.layout.buffers), 0, 1, r.rows(_kv0(r), 0, 1))


def case_buffer_far_out_of_range(r: FakeRoom) -> None:
    r.fake.data(r.tok, STATE, (1 << 20) - 1, 0, 1, b"\0" * 16)


def case_kind_kv_for_a_state_buffer(r: FakeRoom) -> None:
    b = _st0(r)
    r.fake.data(r.tok, KV, b, 0, 1, bytes(r.layout.buffers[b].row_bytes))


def case_kind_aux_for_a_kv_buffer(r: FakeRoom) -> None:
    r.fake.data(r.tok, AUX, _kv0(r), 0, 1, r.rows(_kv0(r), 0, 1))


def case_state_slot_beyond_the_room(r: FakeRoom) -> None:
    b = _st0(r)  # the room has one slot per component: position 1 is not the room's
    r.fake.data(r.tok, STATE, b, 1, 1, bytes(r.layout.buffers[b].row_bytes))


def case_state_count_beyond_the_room(r: FakeRoom) -> None:
    b = _st0(r)
    r.fake.data(r.tok, STATE, b, 0, 2, bytes(2 * r.layout.buffers[b].row_bytes))


def case_aux_guard(r: FakeRoom) -> None:
    a = r.layout.aux_index
    row = r.src[a][0].copy()
    row[:8] = np.frombuffer(np.uint64(r.room + 1).astype("<u8").tobytes(), np.uint8)
    r.fake.data(r.tok, AUX, a, 0, 1, row.tobytes())


def case_aux_guard_zero(r: FakeRoom) -> None:
    a = r.layout.aux_index
    r.fake.data(r.tok, AUX, a, 0, 1, bytes(r.layout.aux_row_bytes))


def case_aux_at_position_1(r: FakeRoom) -> None:
    a = r.layout.aux_index
    r.fake.data(r.tok, AUX, a, 1, 1, r.rows(a, 0, 1))


def case_aux_two_rows(r: FakeRoom) -> None:
    a = r.layout.aux_index
    r.fake.data(r.tok, AUX, a, 0, 2, r.rows(a, 0, 1) * 2)


def case_checksum_missing(r: FakeRoom) -> None:
    r.kv(_kv0(r), 0, 1, accepted=False)


def case_checksum_wrong(r: FakeRoom) -> None:
    payload = r.rows(_kv0(r), 0, 1)
    r.fake.data(r.tok, KV, _kv0(r), 0, 1, payload, checksum=zlib.crc32(payload) ^ 1)


def case_checksum_right_then_wrong(r: FakeRoom) -> None:
    payload = r.rows(_kv0(r), 0, 2)
    r.kv(_kv0(r), 0, 2, checksum=zlib.crc32(payload))
    payload = r.rows(_kv0(r), 2, 1)
    r.fake.data(r.tok, KV, _kv0(r), 2, 1, payload, checksum=(zlib.crc32(payload) + 1) & 0xFFFFFFFF)


def case_done_with_rows_missing(r: FakeRoom) -> None:
    for b in r.layout.indices("kv"):
        r.kv(b, 0, r.n)
    r.done()  # no state, no aux


def case_done_with_nothing_sent(r: FakeRoom) -> None:
    r.done()


def case_done_missing_one_kv_row(r: FakeRoom) -> None:
    kv = r.layout.indices("kv")
    for b in kv:
        r.kv(b, 0, r.n - (1 if b == kv[-1] else 0))
    for b in r.layout.indices("state"):
        r.state(b)
    r.aux_row()
    r.done()


# name, case, code the room fails with, refusal counted (None: a room failure, not a refused frame),
# register kwargs, room kwargs
ROOM_CASES: list[tuple[str, Callable[[FakeRoom], None], str, str | None, dict[str, Any], dict[str, Any]]] = [
    ("length-short", case_length_short, "length_mismatch", "length_mismatch", {}, {}),
    ("length-long", case_length_long, "length_mismatch", "length_mismatch", {}, {}),
    ("length-state-empty", case_length_state_empty, "length_mismatch", "length_mismatch", {}, {}),
    ("length-after-good-rows", case_length_after_good_rows, "length_mismatch", "length_mismatch", {}, {}),
    ("kv-past-the-end", case_kv_past_the_end, "unexpected", "unexpected", {}, {}),
    ("kv-far-away", case_kv_far_away, "unexpected", "unexpected", {}, {}),
    ("kv-in-the-prefix", case_kv_in_the_prefix, "unexpected", "unexpected", {}, {"prefix": 2}),
    ("duplicate-overlap", case_duplicate_overlap, "duplicate", "duplicate", {}, {}),
    ("duplicate-replay", case_duplicate_replay, "duplicate", "duplicate", {}, {}),
    ("duplicate-state", case_duplicate_state, "duplicate", "duplicate", {}, {}),
    ("duplicate-aux", case_duplicate_aux, "duplicate", "duplicate", {}, {}),
    ("buffer-out-of-range", case_buffer_out_of_range, "unexpected", "unexpected", {}, {}),
    ("buffer-far-out-of-range", case_buffer_far_out_of_range, "unexpected", "unexpected", {}, {}),
    ("kind-kv-for-state-buffer", case_kind_kv_for_a_state_buffer, "unexpected", "unexpected", {}, {}),
    ("kind-aux-for-kv-buffer", case_kind_aux_for_a_kv_buffer, "unexpected", "unexpected", {}, {}),
    ("state-slot-beyond-room", case_state_slot_beyond_the_room, "unexpected", "unexpected", {}, {}),
    ("state-count-beyond-room", case_state_count_beyond_the_room, "unexpected", "unexpected", {}, {}),
    ("aux-guard", case_aux_guard, "aux_guard", "aux_guard", {}, {}),
    ("aux-guard-zero", case_aux_guard_zero, "aux_guard", "aux_guard", {}, {}),
    ("aux-position-1", case_aux_at_position_1, "unexpected", "unexpected", {}, {}),
    ("aux-two-rows", case_aux_two_rows, "unexpected", "unexpected", {}, {}),
    ("checksum-missing", case_checksum_missing, "checksum", "checksum", {"checksum": "crc32"}, {}),
    ("checksum-wrong", case_checksum_wrong, "checksum", "checksum", {"checksum": "crc32"}, {}),
    ("checksum-right-then-wrong", case_checksum_right_then_wrong, "checksum", "checksum", {"checksum": "crc32"}, {}),
    ("done-rows-missing", case_done_with_rows_missing, "incomplete", None, {}, {}),
    ("done-nothing-sent", case_done_with_nothing_sent, "incomplete", None, {}, {}),
    ("done-one-kv-row-missing", case_done_missing_one_kv_row, "incomplete", None, {}, {}),
]


def test_a_batch_of_expects_reaches_the_sender_in_bundles_in_order(guard: Env) -> None:
    """PROTOCOL §3.1: the receiver's messages to one sender in one loop iteration go in bundles
    (the first alone at once); every assign arrives once, in the order of the batch. A bundle
    sent *to* a receiver is refused."""
    env = guard
    f, group = fake_sender(env)
    rids = [next(env.ids) for _ in range(40)]
    env.dc.expect_many([dict(room=r, group=group, dst_pages=[i], aux_slot=i % 48) for i, r in enumerate(rids)])
    got = [f.next("assign") for _ in rids]
    assert [(a["room"], a["dst"], a["aux"]) for a in got] == [(r, [i], i % 48) for i, r in enumerate(rids)]
    assert f.bundles >= 1, "40 assigns in one engine call, none bundled"
    assert len({a["tok"] for a in got}) == len(rids)
    before, logs = env.refused(), env.log_lines("unexpected_type")
    f.ctrl(Bundle((Ping(1), Pong(2))).header())
    assert_refused_once(env, before, logs, "unexpected_type")
    env.dc.release_many([(r, group) for r in rids])


@pytest.mark.parametrize("channel", ["zmq", "stream"])
@pytest.mark.parametrize(("case", "code", "refusal", "reg", "room_kw"), [c[1:] for c in ROOM_CASES],
                         ids=[c[0] for c in ROOM_CASES])
def test_fake_sender_bad_data_fails_the_room_and_writes_nothing(
        guard: Env, case: Callable[[FakeRoom], None], code: str, refusal: str | None, reg: dict[str, Any],
        room_kw: dict[str, Any], channel: str) -> None:
    """Every case twice: data on the ZeroMQ socket, and as records on a data stream."""
    env = guard
    fake, group, r = fake_room(env, channel=channel, reg=reg, **room_kw)
    before, fails_before = env.refused(), dict(env.dc.stats()["failures"])
    logs = env.log_lines(refusal) if refusal else 0
    case(r)
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == code, st
    assert f"{group} rank 0" in st.reason, st.reason
    if refusal is not None:
        assert_refused_once(env, before, logs, refusal)
    else:
        assert delta(env.refused(), before) == {}
    assert delta(env.dc.stats()["failures"], fails_before) == {code: 1}
    # the peer hears the outcome too
    status = fake.next("status")
    assert (status["tok"], status["state"], status["code"]) == (r.tok, "failed", code), status
    r.check_pool()
    # frames that still come for the failed room are dropped, never written
    dropped = env.dc.stats()["dropped"].get("room_not_live", 0)
    want = [w.copy() for w in r.want]
    late = r.send_all(done=False)
    r.want = want
    env.until(lambda: env.dc.stats()["dropped"].get("room_not_live", 0) == dropped + late, "late frames dropped")
    assert env.dc.poll(r.room, group).code == code
    r.check_pool()
    env.dc.release(r.room, group)


@pytest.mark.parametrize("channel", ["zmq", "stream"])
def test_a_data_done_writes_its_rows_then_counts_as_the_done(guard: Env, channel: str) -> None:
    """A data-done message is its entries, each exactly as a data message, then its done exactly
    as a done message: a done naming another rank is refused (the rows before it stay written),
    an honest one completes the room; an entry refused fails the room and the done after it
    finds no live room."""
    env = guard
    fake, group, r = fake_room(env, channel=channel)
    L = r.layout
    kv = L.indices("kv")
    for b in kv[:-1]:
        r.kv(b, 0, r.n)
    for b in L.indices("state"):
        r.state(b, 0, len(r.slots[L.buffers[b].component]))
    r.aux_row()
    last = kv[-1]
    before, logs = env.refused(), env.log_lines("wrong_peer")
    fake.data_done(r.tok, 1, [(KV, last, 0, 2)], [r.rows(last, 0, 2)])  # its done names rank 1
    r.want[last][r.dst[0:2]] = r.src[last][0:2]
    assert_refused_once(env, before, logs, "wrong_peer")
    assert env.dc.poll(r.room, group).state is RoomState.TRANSFERRING
    r.check_pool()
    fake.data_done(r.tok, 0, [(KV, last, 2, r.n - 3), (KV, last, r.n - 1, 1)],
                   [r.rows(last, 2, r.n - 3), r.rows(last, r.n - 1, 1)])
    r.want[last][r.dst[2:]] = r.src[last][2:]
    assert r.wait().state is RoomState.SUCCESS
    assert fake.next("status")["state"] == "success"
    r.check_pool()
    env.dc.release(r.room, group)
    # an entry past the room's end: the room fails; its done is dropped (no live room), nothing written
    r = open_room(env, fake, group)
    dropped = env.dc.stats()["dropped"].get("done_not_live", 0)
    before, logs = env.refused(), env.log_lines("unexpected")
    fake.data_done(r.tok, 0, [(KV, kv[0], r.n, 1)], [bytes(ROW)])
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "unexpected", st
    assert_refused_once(env, before, logs, "unexpected")
    env.until(lambda: env.dc.stats()["dropped"].get("done_not_live", 0) == dropped + 1, "the done dropped")
    r.check_pool()
    env.dc.release(r.room, group)


def test_data_for_a_token_never_assigned_is_refused_and_the_room_still_completes(guard: Env) -> None:
    env = guard
    fake, group, r = fake_room(env)
    before, logs = env.refused(), env.log_lines("unknown_room")
    for tok in (r.tok + 1, r.tok ^ (1 << 40), 0):
        fake.data(tok, KV, _kv0(r), 0, 1, bytes(ROW))
    env.until(lambda: env.refused().get("unknown_room", 0) >= before.get("unknown_room", 0) + 3, "refusals")
    assert delta(env.refused(), before) == {"unknown_room": 3}
    assert env.log_lines("unknown_room") == logs + 3
    assert env.dc.poll(r.room, group).state is RoomState.WAITING
    r.check_pool()
    # the honest frames of the fake then complete the room, byte-exact, and nothing else moved
    r.send_all()
    st = r.wait()
    assert st.state is RoomState.SUCCESS, st
    assert fake.next("status")["state"] == "success"
    r.check_pool()
    # data after success (after its own done) is dropped, never written
    dropped = env.dc.stats()["dropped"].get("room_not_live", 0)
    want = [w.copy() for w in r.want]
    r.src = {b: 255 - v for b, v in r.src.items()}
    late = r.send_all(done=False)
    r.want = want
    env.until(lambda: env.dc.stats()["dropped"].get("room_not_live", 0) == dropped + late, "late frames dropped")
    r.check_pool()
    assert delta(env.refused(), before) == {"unknown_room": 3}
    # a released room's token is unknown again
    env.dc.release(r.room, group)
    fake.data(r.tok, KV, _kv0(r), 0, 1, r.rows(_kv0(r), 0, 1))
    env.until(lambda: env.refused().get("unknown_room", 0) == before.get("unknown_room", 0) + 4, "refusal")
    r.check_pool()


def test_a_peer_not_assigned_to_the_room_is_refused_and_the_room_goes_on(guard: Env) -> None:
    env = guard
    fake, group = fake_sender(env)
    other, _ = fake_sender(env)
    r = open_room(env, fake, group)
    before, logs = env.refused(), env.log_lines("wrong_peer")
    other.data(r.tok, KV, _kv0(r), 0, 1, r.rows(_kv0(r), 0, 1))            # another group's peer
    other.ctrl(Done(r.tok, 0, 0, 0, 0).header())
    r.done(rank=1)                                                          # its own room, another rank
    env.until(lambda: env.refused().get("wrong_peer", 0) >= before.get("wrong_peer", 0) + 3, "refusals")
    assert delta(env.refused(), before) == {"wrong_peer": 3}
    assert env.log_lines("wrong_peer") == logs + 3
    assert env.dc.poll(r.room, group).state is RoomState.WAITING
    r.check_pool()
    r.send_all()
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    env.dc.release(r.room, group)


def test_data_after_its_own_done_fails_the_room(guard: Env) -> None:
    """Rank 0 of a cp_size 2 group finishes its share and reports done; then it sends again."""
    env = guard
    group = f"fake2-{next(env.ids)}"
    r0, r1 = env.fake("r0"), env.fake("r1")
    assert r0.register(group, 0, 2)["ok"] and r1.register(group, 1, 2)["ok"]
    r = open_room(env, r0, group, n=6)
    assert r1.next("assign")["tok"] == r.tok
    # pages: rank 0 owns positions [0, 3), state and aux
    for b in r.layout.indices("kv"):
        r.kv(b, 0, 3)
    for b in r.layout.indices("state"):
        r.state(b)
    r.aux_row()
    r.done()
    env.dc.ping()
    assert env.dc.poll(r.room, group).state is RoomState.TRANSFERRING
    before, logs = env.refused(), env.log_lines("after_done")
    r.fake.data(r.tok, KV, _kv0(r), 1, 1, bytes(ROW))  # a row it already sent, after done
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "after_done", st
    assert f"{group} rank 0" in st.reason and "after reporting done" in st.reason, st.reason
    assert_refused_once(env, before, logs, "after_done")
    assert [f.next("status")["code"] for f in (r0, r1)] == ["after_done"] * 2
    r.check_pool()
    env.dc.release(r.room, group)


def test_messages_a_receiver_never_gets_are_refused_from_a_registered_peer(guard: Env) -> None:
    env = guard
    fake, group, r = fake_room(env)
    before, logs = env.refused(), env.log_lines("unexpected_type")
    fake.ctrl(Assign(9, 9, 1, 0, (0,), {}, 0).header())
    fake.ctrl(Registered(True, "", "x", 1).header())
    fake.ctrl(Status(r.tok, r.room, "success").header())
    env.until(lambda: env.refused().get("unexpected_type", 0) >= before.get("unexpected_type", 0) + 3, "refusals")
    assert delta(env.refused(), before) == {"unexpected_type": 3}
    assert env.log_lines("unexpected_type") == logs + 3
    # done and fail for tokens that name no live room are dropped, not counted as refusals
    dropped = dict(env.dc.stats()["dropped"])
    fake.ctrl(Done(r.tok + 7, 0, 0, 0, 0).header())
    fake.ctrl(Fail(r.tok + 7, "x", "y").header())
    def drops() -> dict[str, int]:  # fakes of earlier tests closing may add lost connections meanwhile
        return {k: v for k, v in delta(env.dc.stats()["dropped"], dropped).items() if k != "connection_lost"}
    env.until(lambda: drops() == {"done_not_live": 1, "fail_not_live": 1}, "drops")
    assert delta(env.refused(), before) == {"unexpected_type": 3}
    # a status claiming success changed nothing: the room is still waiting for its rows
    assert env.dc.poll(r.room, group).state is RoomState.WAITING
    r.send_all()
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_header_over_16_mib_is_a_decode_error(guard: Env) -> None:
    env = guard
    before, logs = env.refused(), env.log_lines("decode")
    f = env.fake("bighead")
    f.send(pack(Ping(1).header() | {"pad": b"\0" * (16 << 20)}))
    assert_refused_once(env, before, logs, "decode")
    # the refusal's own log line names the cause (other lines, such as a heartbeat to a fake of an
    # earlier test that has gone, may be logged after it)
    refusals = [line for line in env.proc.log.read_text(errors="replace").splitlines() if "refused (decode)" in line]
    assert refusals and "exceeds" in refusals[-1], refusals[-1:]


def test_huge_registers_from_strangers_are_refused_on_their_size_and_real_rooms_go_on(cluster: Cluster) -> None:
    """Issue 13 item 2: three ~15 MB registers (layouts of 500,000 buffers) from an identity that
    never registered blocked the receiver for seconds each, and a real sender missed its
    heartbeats. A header over 2 MiB is refused on its length, before any decoding; a register
    within it but with more than 4,096 buffers is refused before any per-buffer work. With a
    1 s heartbeat deadline on both sides, the real group's rooms go on succeeding meanwhile."""
    hb = {"heartbeat_interval_s": 0.2, "heartbeat_misses": 5}
    ep, dc, dpool = cluster.receiver(kv_pages=256, state_slots=64, aux_slots=64, **hb)
    pcs, spools = cluster.group(REAL_GROUP, 2, [ep], state_slots=64, aux_slots=64, **hb)
    for i, p in enumerate(spools):
        fill_random(p, 40 + i)
    env = Env(cluster, ep, dc, dpool, pcs, spools, cluster.procs[0])
    try:
        wire = FAKE_LAYOUT.to_wire()
        entry = wire["buffers"][0]
        huge = pack(register_header("squat", 0, 1) | {"layout": wire | {"buffers": [entry] * 500_000}})
        many = pack(register_header("squat", 0, 1) | {"layout": wire | {"buffers": [entry] * 20_000}})
        assert len(huge) > 10 << 20 and len(many) < 1 << 20
        before = env.refused()
        fakes = [env.fake(f"huge{i}") for i in range(3)]
        for f in fakes:
            f.send(huge)
        env.until(lambda: delta(env.refused(), before) == {"decode": 3}, "three oversized headers refused")
        assert "exceeds 2097152" in env.proc.log.read_text(errors="replace")
        for f in fakes:
            f.send(many)
        layout_refusals = [f.next("registered") for f in fakes]
        assert all(not r["ok"] and "exceeds the limit of 4096" in r["reason"] for r in layout_refusals), layout_refusals
        assert_serves(env)
        assert dc.stats()["heartbeat_misses"] == {}, dc.stats()["heartbeat_misses"]
    finally:
        for f in env.fakes:
            f.close()


def test_a_frame_over_max_frame_bytes_drops_the_connection_not_the_receiver(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(max_frame_bytes="1MiB", kv_pages=256, state_slots=64, aux_slots=64,
                                     sender={"stream_record_bytes": "1MiB"})
    pcs, spools = cluster.group(REAL_GROUP, 2, [ep], state_slots=64, aux_slots=64, stream_record_bytes="1MiB")
    for i, p in enumerate(spools):
        fill_random(p, 30 + i)
    fill_random(dpool, 31)
    env = Env(cluster, ep, dc, dpool, pcs, spools, cluster.procs[0])
    try:
        fake, group = fake_sender(env)
        r = open_room(env, fake, group)
        before = env.refused()
        # 2 MiB + 512 bytes of KV rows in one frame: ZeroMQ's MAXMSGSIZE cuts the connection
        big = (2 << 20) // ROW + 1
        fake.data(r.tok, KV, _kv0(r), 0, big, bytes(big * ROW))
        # the receiver never saw it, wrote nothing, and serves everybody else
        assert_serves(env)
        assert delta(env.refused(), before) == {}
        assert dc.poll(r.room, group).state is RoomState.WAITING
        # its only trace: the lost connection, counted and logged with the limit named
        env.until(lambda: dc.stats()["dropped"].get("connection_lost", 0) >= 1, "the lost connection counted")
        assert "which ZeroMQ drops with its connection" in env.proc.log.read_text(errors="replace")
        r.absorb_real_room()
        r.check_pool()
        # the fake's DEALER reconnects under the same identity (still registered: a ping is answered);
        # its honest frames then complete the room
        deadline = time.monotonic() + 20
        while True:
            fake.ctrl(Ping(7).header())
            try:
                fake.next("pong", timeout=1.0)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "the fake never got through again"
        assert env.refused() == before
        r.send_all()
        assert r.wait().state is RoomState.SUCCESS
        r.check_pool()
        dc.release(r.room, group)
        assert_serves(env)
    finally:
        for f in env.fakes:
            f.close()


def proc_alive(env: Env) -> bool:
    return env.proc.proc.poll() is None


# -- fuzz ---------------------------------------------------------------------------------

FIELDS = ["t", "v", "group", "rank", "cp_size", "split", "fp", "layout", "inc", "pid", "host", "epoch", "checksum",
          "tok", "room", "n", "prefix", "dst", "state", "aux", "bytes", "code", "reason", "seq", "ok", "retry"]
TYPES = ["register", "registered", "assign", "done", "fail", "status", "ping", "pong", "data", ""]


def rand_obj(g: np.random.Generator, depth: int = 0) -> Any:
    k = int(g.integers(0, 12 if depth < 3 else 8))
    if k == 0:
        return int(g.integers(-3, 10))
    if k == 1:
        edges = [0, 1, (1 << 20) - 1, 1 << 20, (1 << 32) - 1, 1 << 40, (1 << 63) - 1, (1 << 64) - 1, -(1 << 63), -1]
        return edges[int(g.integers(0, len(edges)))]
    if k == 2:
        return float(g.choice([0.0, -1.5, 1e300, float("nan"), float("inf")]))
    if k == 3:
        return str(g.choice(TYPES + FIELDS + ["pages", "layers", "rank0", "crc32", "xxh3", "é\u2603", "\x00"]))
    if k == 4:
        return g.integers(0, 256, int(g.integers(0, 24)), dtype=np.uint8).tobytes()
    if k == 5:
        return bool(g.integers(0, 2))
    if k == 6:
        return None
    if k == 7:
        return "".join(chr(int(c)) for c in g.integers(32, 127, int(g.integers(0, 12))))
    if k in (8, 9):
        return [rand_obj(g, depth + 1) for _ in range(int(g.integers(0, 8)))]
    return {rand_obj(g, 3) if g.integers(0, 4) == 0 else str(g.choice(FIELDS)): rand_obj(g, depth + 1)
            for _ in range(int(g.integers(0, 8)))}


def fuzz_messages(g: np.random.Generator, count: int, toks: list[int], layout: PoolLayout,
                  group: str) -> Iterator[list[bytes]]:
    """Random bytes, random msgpack objects, and valid messages with fields mutated or bytes flipped."""
    nbuf = len(layout.buffers)
    valid: list[Callable[[], Any]] = [
        lambda: register_header(group, 0, 1),
        lambda: Ping(int(g.integers(0, 100))).header(),
        lambda: Pong(1).header(),
        lambda: Done(int(g.choice(toks)), 0, 0, 0, 0).header(),
        lambda: Fail(int(g.choice(toks)), "fuzz", "fuzz").header(),
        lambda: Assign(int(g.choice(toks)), 1, 1, 0, (1,), {}, 0).header(),
        lambda: Status(int(g.choice(toks)), 1, "failed", "x", "y").header(),
        lambda: [1, int(g.choice(toks)), int(g.integers(0, 3)), int(g.integers(0, nbuf + 2)), int(g.integers(0, 8)),
                 int(g.integers(1, 4))],
    ]
    for _ in range(count):
        k = int(g.integers(0, 10))
        if k <= 1:
            frames = [g.integers(0, 256, int(g.choice([0, 1, 2, 3, 7, 16, 64, 300])), dtype=np.uint8).tobytes()]
        elif k <= 3:
            frames = [pack(rand_obj(g))]
        else:
            h = valid[int(g.integers(0, len(valid)))]()
            if isinstance(h, dict):
                for _ in range(int(g.integers(0, 3))):
                    key = str(g.choice(list(h) + FIELDS))
                    if g.integers(0, 3) == 0:
                        h.pop(key, None)
                    else:
                        h[key] = rand_obj(g)
                frames = [pack(h)]
            else:
                if g.integers(0, 3) == 0:
                    h[int(g.integers(0, len(h)))] = rand_obj(g)
                frames = [pack(h)]
                if isinstance(h[3], int) and 0 <= h[3] < nbuf and isinstance(h[5], int) and 0 < h[5] < 8 \
                        and g.integers(0, 2) == 0:
                    frames.append(g.integers(0, 256, h[5] * layout.buffers[h[3]].row_bytes, dtype=np.uint8).tobytes())
                else:
                    frames.append(g.integers(0, 256, int(g.integers(0, 600)), dtype=np.uint8).tobytes())
            if k == 9:  # flip or cut bytes of the header
                b = bytearray(frames[0])
                for _ in range(int(g.integers(1, 4))):
                    b[int(g.integers(0, len(b)))] = int(g.integers(0, 256))
                frames[0] = bytes(b[: int(g.integers(1, len(b) + 1))])
        if g.integers(0, 12) == 0:  # the wrong number of frames
            frames = [*frames, b"\x00" * int(g.integers(0, 40))] if g.integers(0, 2) else frames[:1]
        yield frames


def test_fuzz_the_data_socket_then_a_normal_room_succeeds(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(kv_pages=256, state_slots=64, aux_slots=64)
    pcs, spools = cluster.group(REAL_GROUP, 2, [ep], state_slots=64, aux_slots=64)
    for i, p in enumerate(spools):
        fill_random(p, 40 + i)
    fill_random(dpool, 41)
    env = Env(cluster, ep, dc, dpool, pcs, spools, cluster.procs[0])
    try:
        snap = [rows.copy() for rows in dpool.rows]
        allowed = [np.zeros(rows.shape[0], bool) for rows in dpool.rows]
        stranger = env.fake("stranger")
        g = np.random.default_rng(20240601)
        sent, all_rooms = 0, []
        for round_ in range(8):
            # a registered fake with live rooms (fresh each round: the fuzz fails rooms and may even
            # re-register the fake elsewhere), so that fuzzed data reaches the receiver's deep checks
            fake, group = fake_sender(env)
            rooms = [open_room(env, fake, group, n=4) for _ in range(10)]
            all_rooms += [(group, r) for r in rooms]
            toks = [r.tok for r in rooms] + [0, 1, rooms[0].tok + 999]
            for r in rooms:
                for b in dpool.layout.indices("kv"):
                    allowed[b][r.dst] = True
                for b in dpool.layout.indices("state"):
                    allowed[b][r.slots[dpool.layout.buffers[b].component]] = True
                allowed[dpool.layout.aux_index][r.aux] = True
            # the stranger's registrations name another group: taking over the fake's group would
            # be a legitimate restart (peer_restarted) and end the fuzz of its rooms early
            mine = fuzz_messages(g, 340, toks, dpool.layout, group)
            theirs = fuzz_messages(g, 160, toks, dpool.layout, f"s{group}")
            for frames in mine:
                fake.send(*frames)
                stranger.send(*next(theirs, [b"\xc1"]))
                sent += 2
            fake.pump()
            stranger.pump()
        # a probe on each connection: its answer comes after everything sent before it was handled
        # (a refused registration is answered at most once a second per identity: the probe is
        # sent again until one is)
        for n, f in enumerate((fake, stranger)):
            last = [0.0]

            def answered() -> bool | None:
                if time.monotonic() - last[0] > 1.1:
                    f.ctrl(register_header("probe", 0, 1) | {"v": 4242 + n})
                    last[0] = time.monotonic()
                return any(m.get("t") == "registered" and f"version {4242 + n}" in m.get("reason", "")
                           for m in f.inbox) or None
            env.until(answered, "the probe's answer")
        stats = dc.stats()
        assert proc_alive(env), cluster.logs()
        assert stats["refused"].get("internal_error", 0) == 0, (stats, cluster.logs())
        assert sum(stats["refused"].values()) + sum(stats["dropped"].values()) > sent // 2, stats
        for b, rows in enumerate(dpool.rows):
            changed = np.nonzero((rows != snap[b]).any(axis=1))[0]
            outside = [int(x) for x in changed if not allowed[b][x]]
            assert not outside, f"buffer {b} rows {outside[:8]} outside the fuzzed rooms changed"
        # no fuzzed room may have passed as a success without its exact bytes
        for group, r in all_rooms:
            st = dc.poll(r.room, group)
            assert st.state is not RoomState.SUCCESS, (r.room, st)
            dc.release(r.room, group)
        assert_serves(env)
        # and an honest fake (new identity) is served byte-exact too
        honest, hgroup = fake_sender(env)
        h = open_room(env, honest, hgroup)
        h.send_all()
        assert h.wait().state is RoomState.SUCCESS
        h.check_pool()
        dc.release(h.room, hgroup)
        assert_serves(env)
    finally:
        for f in env.fakes:
            f.close()


# -- an identity that changes its story ---------------------------------------------------

def test_rooms_of_a_silent_peer_fail_even_after_it_claimed_another_group(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(kv_pages=256, state_slots=64, aux_slots=64, heartbeat_interval_s=0.2,
                                     heartbeat_misses=5)
    env = Env(cluster, ep, dc, dpool, [], [], cluster.procs[0])
    fake = env.fake("switch")
    ga, gb = "switch-a", "switch-b"
    assert fake.register(ga)["ok"] is True
    r = open_room(env, fake, ga)
    fake.register(gb)  # the same identity now claims rank 0 of another group (accepted or refused)
    fake.close()  # and goes silent: no pongs, nothing
    env.fakes.clear()

    def gone() -> bool:
        return not any(rank.get("host") == "hostile-test" for g in dc.status()["groups"].values()
                       for rank in g["ranks"].values())
    try:
        env.until(gone, "the silent identity to be forgotten")
        # the room of group a was assigned to exactly this identity: it must fail, naming the peer
        st = dc.wait(r.room, ga, 2.0)
        assert st.state is RoomState.FAILED and st.code == "peer_lost", st
        assert "rank 0" in st.reason, st.reason
    finally:
        dc.release(r.room, ga)  # a room left live would hold up the receiver's drain on SIGTERM


# -- the same-host path (data-ref: the receiver copies rows out of the sender's own pool) -------

def _data_ref(f: Fake, tok: int, kind: int, buffer: int, pos: int, count: int, src_row: int) -> None:
    f.send(pack([2, tok, kind, buffer, pos, count, src_row]))


def _data_refs(f: Fake, tok: int, kind: int, buffer: int, pos: int, rows: list[int], *,
               list_bytes: bytes | None = None) -> None:
    body = np.asarray(rows, dtype="<i8").tobytes() if list_bytes is None else list_bytes
    f.send(pack([3, tok, kind, buffer, pos, len(rows)]), body)


REFS_PATHS = ["same_host", "mooncake"]
"""The two planes whose data-refs name rows the receiver fetches itself: the same-host copy and
Mooncake TE reads (the fake registers its pool with an engine of its own)."""


def _needs_mooncake() -> None:
    if not MOONCAKE:
        if os.environ.get("CI"):
            pytest.fail("mooncake-transfer-engine is not installed (pip install -e '.[mooncake]'; libibverbs1)")
        pytest.skip("mooncake-transfer-engine is not installed")


def _shm_fake(env: Env, path: str = "same_host") -> tuple[Fake, str, Pool]:
    """A fake sender whose data-refs the receiver serves from the fake's own pool: mapped (same
    host) or read with Mooncake TE."""
    from transferd.pool import host_boot_id

    name = f"{env.cluster.tag}-fakeshm-{next(env.ids)}"
    spool = Pool.create(name, FAKE_LAYOUT)
    env.cluster.pools.append(spool)
    fill_random(spool, 5)
    group = f"fakeshm-{next(env.ids)}"
    fake = env.fake("shm")
    if path == "mooncake":
        _needs_mooncake()
        from transferd.transport.planes import MooncakeEngine

        engine = MooncakeEngine("127.0.0.1", "tcp", "")
        env.engines.append(engine)
        fake.ctrl(register_header(group, 0, 1) | {"te_session": engine.session,
                                                  "te_addrs": list(engine.register(spool.rows))})
    else:
        fake.ctrl(register_header(group, 0, 1) | {"boot_id": host_boot_id(), "pool": name, "pool_id": spool.pool_id})
    reply = fake.next("registered")
    assert reply["ok"] is True and reply["shm"] is (path == "same_host") and reply["te"] is (path == "mooncake"), reply
    return fake, group, spool


@pytest.mark.parametrize("refs", ["data-ref", "data-refs"])
def test_data_refs_without_an_agreed_same_host_path_fail_the_room(guard: Env, refs: str) -> None:
    env = guard
    fake, group, r = fake_room(env)
    before, logs = env.refused(), env.log_lines("no_shm")
    if refs == "data-ref":
        _data_ref(fake, r.tok, KV, _kv0(r), 0, 1, 0)
    else:
        _data_refs(fake, r.tok, KV, _kv0(r), 0, [0])
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "no_shm", st
    assert_refused_once(env, before, logs, "no_shm")
    r.check_pool()
    env.dc.release(r.room, group)


@pytest.mark.parametrize("path", REFS_PATHS)
def test_data_ref_rows_outside_the_senders_pool_fail_the_room_and_good_refs_complete_one(guard: Env, path: str) -> None:
    env = guard
    fake, group, spool = _shm_fake(env, path)
    rows = FAKE_LAYOUT.kv_rows
    # rows [rows - 1, rows + 1) of the sender's own pool: one past its end
    r = open_room(env, fake, group)
    before, logs = env.refused(), env.log_lines("index_out_of_range")
    _data_ref(fake, r.tok, KV, _kv0(r), 0, 2, rows - 1)
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "index_out_of_range", st
    assert_refused_once(env, before, logs, "index_out_of_range")
    r.check_pool()
    env.dc.release(r.room, group)
    # honest references complete a room byte-exact out of the sender's pool
    r = open_room(env, fake, group)
    L = r.layout
    src = [5, 6, 7, 9, 10, 11]
    for b in L.indices("kv"):
        _data_ref(fake, r.tok, KV, b, 0, 3, 5)
        _data_ref(fake, r.tok, KV, b, 3, 3, 9)
        r.want[b][r.dst] = spool.rows[b][src]
    for b in L.indices("state"):
        _data_ref(fake, r.tok, STATE, b, 0, 1, 2)
        r.want[b][r.slots[L.buffers[b].component][0]] = spool.rows[b][2]
    a = L.aux_index
    spool.rows[a][4, :8] = np.frombuffer(np.uint64(r.room).astype("<u8").tobytes(), np.uint8)
    _data_ref(fake, r.tok, AUX, a, 0, 1, 4)
    r.want[a][r.aux] = spool.rows[a][4]
    r.done()
    st = r.wait()
    assert st.state is RoomState.SUCCESS, st
    r.check_pool()
    env.dc.release(r.room, group)


@pytest.mark.parametrize("path", REFS_PATHS)
@pytest.mark.parametrize("case, rows, list_bytes, code", [
    ("past-the-end", [3, FAKE_LAYOUT.kv_rows], None, "index_out_of_range"),
    ("negative", [-1, 2], None, "index_out_of_range"),
    ("list-short", [3, 4], np.asarray([3], "<i8").tobytes(), "length_mismatch"),
    ("list-odd-bytes", [3, 4], b"\x00" * 15, "length_mismatch"),
])
def test_bad_data_refs_fail_the_room_and_write_nothing(guard: Env, case: str, rows: list[int],
                                                       list_bytes: bytes | None, code: str, path: str) -> None:
    env = guard
    fake, group, _ = _shm_fake(env, path)
    r = open_room(env, fake, group)
    before, logs = env.refused(), env.log_lines(code)
    _data_refs(fake, r.tok, KV, _kv0(r), 0, rows, list_bytes=list_bytes)
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == code, st
    assert_refused_once(env, before, logs, code)
    r.check_pool()
    env.dc.release(r.room, group)


@pytest.mark.parametrize("path", REFS_PATHS)
def test_scattered_data_refs_complete_a_room_byte_exact(guard: Env, path: str) -> None:
    env = guard
    fake, group, spool = _shm_fake(env, path)
    r = open_room(env, fake, group)
    L = r.layout
    n = len(r.dst)
    src = [11, 4, 5, 9, 2, 7, 8, 1][:n]  # runs of one and two rows, both directions
    assert len(src) == n
    for b in L.indices("kv"):
        _data_refs(fake, r.tok, KV, b, 0, src[:n // 2])
        _data_refs(fake, r.tok, KV, b, n // 2, src[n // 2:])
        r.want[b][r.dst] = spool.rows[b][src]
    for b in L.indices("state"):
        _data_refs(fake, r.tok, STATE, b, 0, [3])
        r.want[b][r.slots[L.buffers[b].component][0]] = spool.rows[b][3]
    a = L.aux_index
    spool.rows[a][6, :8] = np.frombuffer(np.uint64(r.room).astype("<u8").tobytes(), np.uint8)
    _data_refs(fake, r.tok, AUX, a, 0, [6])
    r.want[a][r.aux] = spool.rows[a][6]
    r.done()
    st = r.wait()
    assert st.state is RoomState.SUCCESS, st
    r.check_pool()
    env.dc.release(r.room, group)


@pytest.mark.parametrize("path", REFS_PATHS)
def test_an_aux_row_with_the_wrong_room_id_fails_the_room_and_is_not_written(guard: Env, path: str) -> None:
    env = guard
    fake, group, spool = _shm_fake(env, path)
    r = open_room(env, fake, group)
    a = r.layout.aux_index
    spool.rows[a][3, :8] = np.frombuffer(np.uint64(r.room + 1).astype("<u8").tobytes(), np.uint8)
    before, logs = env.refused(), env.log_lines("aux_guard")
    _data_refs(fake, r.tok, AUX, a, 0, [3])
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "aux_guard", st
    assert_refused_once(env, before, logs, "aux_guard")
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_mooncake_read_the_engine_fails_fails_the_room_with_transport_error(guard: Env) -> None:
    """A session nobody serves, and addresses outside what the sender registered: the engine
    fails the read; the room fails naming the peer's session and the engine's code; nothing is
    written; the receiver goes on serving."""
    _needs_mooncake()
    env = guard
    for session, offset in (("127.0.0.1:1", 0), (None, 1 << 40)):
        fake, group, spool = _shm_fake(env, "mooncake")
        good = env.engines[-1]  # register again (epoch 1) with what the engine will fail on
        addrs = [int(b.ctypes.data) + offset for b in spool.rows]
        fake.ctrl(register_header(group, 0, 1) | {"epoch": 1, "te_session": session or good.session,
                                                  "te_addrs": addrs})
        assert fake.next("registered")["te"] is True
        r = open_room(env, fake, group)
        _data_refs(fake, r.tok, KV, _kv0(r), 0, list(range(r.n)))
        r.done()
        st = r.wait()
        assert st.state is RoomState.FAILED and st.code == "transport_error", st
        assert "Mooncake TE read of" in st.reason and (session or good.session) in st.reason, st.reason
        assert f"{group} rank 0" in st.reason, st.reason
        r.check_pool()
        env.dc.release(r.room, group)


def test_abort_of_a_mooncake_room_returns_after_its_reads_settled(guard: Env) -> None:
    """The abort barrier over Mooncake TE: rows named before the abort may be read until abort
    returns; nothing of the room is written after it."""
    _needs_mooncake()
    env = guard
    fake, group, spool = _shm_fake(env, "mooncake")
    r = open_room(env, fake, group, n=40)
    dropped = env.dc.stats()["dropped"].get("room_not_live", 0)
    for b in r.layout.indices("kv"):
        _data_refs(fake, r.tok, KV, b, 0, list(range(40)))
    env.dc.abort(r.room, group, "engine gave up")
    after = [rows.copy() for rows in env.dpool.rows]
    for b in r.layout.indices("kv"):  # later refs of the room: dropped, never read
        _data_refs(fake, r.tok, KV, b, 0, list(range(40)))
    env.until(lambda: env.dc.stats()["dropped"].get("room_not_live", 0) >= dropped + len(r.layout.indices("kv")),
              "the late refs to be dropped")
    assert env.dc.poll(r.room, group).code == "aborted"
    assert all(np.array_equal(a, b) for a, b in zip(after, env.dpool.rows)), "bytes written after abort returned"
    env.dc.release(r.room, group)


# -- data batches (several small entries of one room in one message) ---------------------------

def _batch(r: FakeRoom, entries: list[tuple[int, int, int, int]], *, frames: int | None = None) -> None:
    payloads = [r.rows(b, pos, count) for _, b, pos, count in entries]
    r.fake.send(pack([4, r.tok, [list(e) for e in entries]]), *payloads[:frames])


def test_a_data_batch_completes_a_room_byte_exact(guard: Env) -> None:
    env = guard
    fake, group, r = fake_room(env)
    L = r.layout
    entries = [(KV, b, 0, r.n) for b in L.indices("kv")]
    entries += [(STATE, b, 0, len(r.slots[L.buffers[b].component])) for b in L.indices("state")]
    entries.append((AUX, L.aux_index, 0, 1))
    _batch(r, entries)
    for kind, b, pos, count in entries:
        dst = r.dst if kind == KV else r.slots[L.buffers[b].component] if kind == STATE else [r.aux]
        r.want[b][dst[pos:pos + count]] = r.src[b][pos:pos + count]
    r.done()
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_data_batch_short_of_payload_frames_is_refused_and_writes_nothing(guard: Env) -> None:
    env = guard
    fake, group, r = fake_room(env)
    kv0 = _kv0(r)
    before, logs = env.refused(), env.log_lines("malformed")
    _batch(r, [(KV, kv0, 0, 1), (KV, kv0, 1, 1)], frames=1)
    assert_refused_once(env, before, logs, "malformed")
    r.check_pool()
    r.send_all()  # the room is still live and completes honestly
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_bad_entry_in_a_data_batch_fails_the_room_and_later_entries_are_not_written(guard: Env) -> None:
    env = guard
    fake, group, r = fake_room(env)
    kv0 = _kv0(r)
    before, logs = env.refused(), env.log_lines("duplicate")
    # entry 2 repeats entry 1's position: the room fails there; entry 3 is dropped, never written
    _batch(r, [(KV, kv0, 0, 2), (KV, kv0, 1, 1), (KV, kv0, 2, 2)])
    r.want[kv0][r.dst[0:2]] = r.src[kv0][0:2]
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "duplicate", st
    assert_refused_once(env, before, logs, "duplicate")
    r.check_pool()
    env.dc.release(r.room, group)


def test_an_identity_moving_to_another_rank_of_its_group_keeps_the_group(guard: Env) -> None:
    """The same identity registers as rank 0, then as rank 1 of the same group: its old place is
    dropped — the group with it, as that was its last rank — and the new place must belong to
    the group the receiver knows, not to the dropped one."""
    env = guard
    group = f"mover-{next(env.ids)}"
    f = env.fake("mover")
    assert f.register(group, 0, 2)["ok"] is True
    assert f.register(group, 1, 2)["ok"] is True
    groups = env.dc.status()["groups"]
    assert group in groups and list(groups[group]["ranks"]) == ["1"], groups
    g = env.fake("other")  # the group completes with a second sender as rank 0
    assert g.register(group, 0, 2)["ok"] is True
    assert sorted(env.dc.status()["groups"][group]["ranks"]) == ["0", "1"]


# -- the data stream (stream.py) ---------------------------------------------------------------

def test_a_stream_room_completes_byte_exact_rows_read_straight_and_batched(guard: Env) -> None:
    """Records on a data stream: KV payloads of 64 KiB (read straight into the rows, scattered
    destination included), state and aux in a data batch (through the stream's buffer), done."""
    env = guard
    fake, group, r = fake_room(env, channel="stream", n=128)
    L = r.layout
    before = env.dc.stats()["stream_bytes"]
    for b in L.indices("kv"):
        r.kv(b, 0, r.n)
    entries = [(STATE, b, 0, 1) for b in L.indices("state")] + [(AUX, L.aux_index, 0, 1)]
    _batch(r, entries)
    for kind, b, _, _ in entries:
        dst = r.slots[L.buffers[b].component][0] if kind == STATE else r.aux
        r.want[b][dst] = r.src[b][0]
    r.done()
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    moved = sum(a.nbytes for a in r.src.values())
    assert env.dc.stats()["stream_bytes"] - before == moved
    env.dc.release(r.room, group)


def test_a_large_stream_batch_is_read_straight_into_every_entrys_rows(guard: Env) -> None:
    """A data batch of 64 KiB or more on a stream (rows too small to fill a message alone, the
    common MLA case) is read straight into the rows of every entry, scattered destination
    included, with no stop in the stream's buffer; byte-exact."""
    env = guard
    fake, group, r = fake_room(env, channel="stream", n=128)
    L = r.layout
    before = env.dc.stats()["stream_bytes"]
    kv = [(KV, b, 0, r.n) for b in L.indices("kv")]
    assert sum(c * L.buffers[b].row_bytes for _, b, _, c in kv) >= 64 << 10  # the direct path's minimum
    _batch(r, [(KV, kv[0][1], 0, 100), (KV, kv[0][1], 100, 28)])  # entries of one buffer
    _batch(r, [(KV, b, 0, 64) for _, b, _, _ in kv[1:]] + [(KV, b, 64, 64) for _, b, _, _ in kv[1:]])
    for _, b, _, _ in kv:
        r.want[b][r.dst] = r.src[b]
    entries = [(STATE, b, 0, 1) for b in L.indices("state")] + [(AUX, L.aux_index, 0, 1)]
    _batch(r, entries)  # small: through the stream's buffer
    for kind, b, _, _ in entries:
        r.want[b][r.slots[L.buffers[b].component][0] if kind == STATE else r.aux] = r.src[b][0]
    r.done()
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    assert env.dc.stats()["stream_bytes"] - before == sum(a.nbytes for a in r.src.values())
    env.dc.release(r.room, group)


@pytest.mark.parametrize("guard_ok", [True, False], ids=["guard-ok", "guard-wrong"])
def test_an_aux_row_in_a_large_stream_batch_is_checked_before_it_is_written(guard: Env, guard_ok: bool) -> None:
    """A room's last batch often carries its aux row beside KV rows: the KV entries are read
    straight into their rows, the aux row into the stream's buffer; its guard is checked before
    it is written. A wrong room id fails the room ``aux_guard`` with the aux row unwritten (the
    KV rows before it landed, as from the ZeroMQ socket)."""
    env = guard
    fake, group, r = fake_room(env, channel="stream", n=128)
    L = r.layout
    a = L.aux_index
    if not guard_ok:
        r.src[a][0, :8] = np.frombuffer(np.uint64(r.room + 1).astype("<u8").tobytes(), np.uint8)
    before, logs = env.refused(), env.log_lines("aux_guard")
    kv = [(KV, b, 0, r.n) for b in L.indices("kv")]
    assert sum(c * L.buffers[b].row_bytes for _, b, _, c in kv) >= 64 << 10  # the direct path's minimum
    _batch(r, [*kv, (AUX, a, 0, 1)])
    for _, b, _, _ in kv:
        r.want[b][r.dst] = r.src[b]
    if guard_ok:
        r.want[a][r.aux] = r.src[a][0]
        _batch(r, [(STATE, b, 0, 1) for b in L.indices("state")])
        for b in L.indices("state"):
            r.want[b][r.slots[L.buffers[b].component][0]] = r.src[b][0]
        r.done()
        assert r.wait().state is RoomState.SUCCESS
        assert delta(env.refused(), before) == {}
    else:
        st = r.wait()
        assert st.state is RoomState.FAILED and st.code == "aux_guard", st
        assert_refused_once(env, before, logs, "aux_guard")
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_bad_entry_in_a_large_stream_batch_fails_the_room_and_none_of_it_is_written(guard: Env) -> None:
    """Every entry of a batch read straight into the rows is checked before a byte is read: a
    duplicate in entry 2 fails the room, the whole payload is read past and dropped (entry 1
    included), and the stream stays in step for the next room."""
    env = guard
    fake, group, r = fake_room(env, channel="stream", n=128)
    kv0 = _kv0(r)
    before, logs = env.refused(), env.log_lines("duplicate")
    _batch(r, [(KV, kv0, 0, 64), (KV, kv0, 32, 16), (KV, kv0, 64, 64)])
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "duplicate", st
    assert_refused_once(env, before, logs, "duplicate")
    r.check_pool()  # nothing of the batch landed
    env.dc.release(r.room, group)
    r2 = open_room(env, fake, group, n=128)
    r2.send_all()
    assert r2.wait().state is RoomState.SUCCESS
    r2.check_pool()
    env.dc.release(r2.room, group)


@pytest.mark.parametrize("hello, code", [(b"TDSTREAM" + bytes(16), "stream_key"),
                                         (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "stream_hello")])
def test_a_stream_without_a_valid_hello_is_refused_and_closed(guard: Env, hello: bytes, code: str) -> None:
    env = guard
    fake, group = fake_sender(env, channel="stream")  # a stream port is open
    port = fake.stream.getpeername()[1]  # type: ignore[union-attr]
    before, logs = env.refused(), env.log_lines(code)
    s = stream_connect(port, hello)
    try:
        assert closed_by_peer(s)
    finally:
        s.close()
    assert_refused_once(env, before, logs, code)


def test_a_stream_key_serves_one_connection(guard: Env) -> None:
    env = guard
    f, group = fake_sender(env, channel="stream")
    before, logs = env.refused(), env.log_lines("stream_key")
    again = stream_connect(f.offer["stream_port"], b"TDSTREAM" + f.offer["stream_key"])
    try:
        assert closed_by_peer(again)
    finally:
        again.close()
    assert_refused_once(env, before, logs, "stream_key")
    r = open_room(env, f, group)  # the first stream still carries the fake's data
    r.send_all()
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    env.dc.release(r.room, group)


@pytest.mark.parametrize("case", ["header-too-long", "payload-over-max-frame", "closed-mid-record"])
def test_a_broken_stream_loses_the_peer_and_fails_its_room(guard: Env, case: str) -> None:
    env = guard
    fake, group, r = fake_room(env, channel="stream")
    kv0 = _kv0(r)
    head = pack([1, r.tok, KV, kv0, 0, 2])
    s = fake.stream
    assert s is not None
    if case == "header-too-long":
        s.sendall(struct.pack("<IQ", (1 << 20) + 1, 0))
    elif case == "payload-over-max-frame":
        s.sendall(struct.pack("<IQ", len(head), (64 << 20) + 1) + head)
    else:
        s.sendall(record(head, r.rows(kv0, 0, 2))[:-100])  # then the connection ends
        s.close()
        fake.stream = None
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "peer_lost", st
    assert "data stream" in st.reason, st.reason
    if case != "closed-mid-record":
        assert closed_by_peer(s)
    r.check_pool() if case != "closed-mid-record" else None
    env.dc.release(r.room, group)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_stream_stalled_inside_a_rooms_first_record_fails_it_at_the_stall_clock(cluster: Cluster,
                                                                                  where: str) -> None:
    """Issue 13 item 5: a data stream that stops inside a room's first (large) record, while its
    peer keeps answering heartbeats, fails the room ``stalled`` at ``stall_timeout_s`` with a
    reason naming the stream (before: the room stayed ``waiting`` until ``waiting_timeout_s``,
    "sent nothing"). The receiver closes that stream; other groups go on."""
    ep, dc, dpool = cluster.receiver(kv_pages=256, state_slots=64, aux_slots=64, stall_timeout_s=1.0,
                                     waiting_timeout_s=120.0)
    env = Env(cluster, ep, dc, dpool, [], [], cluster.procs[0])
    fill_random(dpool, 77)
    try:
        fake, group, r = fake_room(env, channel="stream", n=128)
        kv0 = _kv0(r)
        s = fake.stream
        assert s is not None
        rows = r.rows(kv0, 0, r.n)  # 64 KiB: read straight into the rows
        rec = record(pack([1, r.tok, KV, kv0, 0, r.n]), rows)
        cut = len(rec) - len(rows) + len(rows) // 2 if where == "payload" else 20
        s.sendall(rec[:cut])  # then nothing more on the stream; pings are still answered
        if where == "payload":
            r.want[kv0][r.dst[:64]] = r.src[kv0][:64]
        # env.until answers the fake's pings meanwhile: the peer is alive, heartbeats go on
        st = env.until(lambda: (p := dc.poll(r.room, group)).state.terminal and p,
                       "the room to end (the stall clock must cover the record in progress)")
        assert st.code == "stalled", st
        assert "data stream" in st.reason and "stalled" in st.reason and "inside" in st.reason, st.reason
        assert closed_by_peer(s)
        r.check_pool()
        dc.release(r.room, group)
    finally:
        for f in env.fakes:
            f.close()


def test_rows_of_a_room_aborted_while_its_payload_arrives_are_not_written(guard: Env) -> None:
    """The abort barrier on a stream: a payload read straight into the rows stops at the abort;
    its later bytes are read and dropped."""
    env = guard
    fake, group, r = fake_room(env, channel="stream", n=128)
    kv0 = _kv0(r)
    s = fake.stream
    assert s is not None
    rows = r.rows(kv0, 0, r.n)
    half = len(rows) // 2  # 64 of 128 rows
    s.sendall(record(pack([1, r.tok, KV, kv0, 0, r.n]), rows[:half], payload_len=len(rows)))
    r.want[kv0][r.dst[:64]] = r.src[kv0][:64]
    pool = env.dpool.rows[kv0]
    env.until(lambda: bool((pool[r.dst[:64]] == r.src[kv0][:64]).all()), "the first half to land in the rows")
    env.dc.abort(r.room, group, "engine gave up")
    assert env.dc.poll(r.room, group).state is RoomState.FAILED
    s.sendall(rows[half:])
    dropped = env.dc.stats()["dropped"].get("room_not_live", 0)
    r.kv(kv0, 0, 2, accepted=False)  # a later record of the room: dropped, and the stream is still in step
    env.until(lambda: env.dc.stats()["dropped"].get("room_not_live", 0) == dropped + 1, "the late record dropped")
    r.check_pool()
    env.dc.release(r.room, group)


def test_messages_other_than_data_and_done_on_a_stream_are_refused(guard: Env) -> None:
    env = guard
    fake, group, r = fake_room(env, channel="stream")
    s = fake.stream
    assert s is not None
    for i, head in enumerate([Fail(r.tok, "x", "y").header(), Ping(1).header(), [2, r.tok, KV, _kv0(r), 0, 1, 0]]):
        before, logs = env.refused(), env.log_lines("unexpected_type")
        s.sendall(record(pack(head)))
        assert_refused_once(env, before, logs, "unexpected_type")
    r.send_all()  # the stream stays in step and the room completes
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_done_past_the_stream_while_its_rows_arrive_fails_the_room(guard: Env) -> None:
    """Rows read straight into the pool are claimed before their bytes arrive: a done that
    overtakes them (sent on ZeroMQ, which the reference sender never does) must not end the room
    as a success."""
    env = guard
    fake, group, r = fake_room(env, channel="stream", n=128)
    kv0 = _kv0(r)
    s = fake.stream
    assert s is not None
    rows = r.rows(kv0, 0, r.n)
    s.sendall(record(pack([1, r.tok, KV, kv0, 0, r.n]), rows[:len(rows) // 2], payload_len=len(rows)))
    r.want[kv0][r.dst[:64]] = r.src[kv0][:64]
    pool = env.dpool.rows[kv0]
    env.until(lambda: bool((pool[r.dst[:64]] == r.src[kv0][:64]).all()), "the first half to land in the rows")
    fake.sock.send_multipart([pack(Done(r.tok, 0, 0, 0, 0).header())])  # past the stream
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "incomplete", st
    assert "still arriving on its data stream" in st.reason, st.reason
    s.sendall(rows[len(rows) // 2:])  # the rest is dropped
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_repeated_register_keeps_the_stream(guard: Env) -> None:
    env = guard
    f, group = fake_sender(env, channel="stream")
    again = f.register(group, 0, 1, stream=True)  # same identity, same epoch: a duplicate
    assert again["ok"] is True and again["stream_port"] == 0 and again["stream_key"] == b"", again
    r = open_room(env, f, group)
    r.send_all()  # on the first stream, which still belongs to this registration
    assert r.wait().state is RoomState.SUCCESS
    r.check_pool()
    env.dc.release(r.room, group)


def test_a_flood_of_silent_stream_connections_does_not_keep_a_sender_out(guard: Env) -> None:
    """Connections that never send a hello are bounded (64 waiting; the oldest goes), and a sender
    that says its hello at once still gets its stream."""
    env = guard
    fake, _ = fake_sender(env, channel="stream")
    port = fake.stream.getpeername()[1]  # type: ignore[union-attr]
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(80)]
    try:
        env.until(lambda: sum(closed_by_peer(s, 0) for s in silent) >= 16, "the oldest silent connections to close")
        f2, g2 = fake_sender(env, channel="stream")
        r = open_room(env, f2, g2)
        r.send_all()
        assert r.wait().state is RoomState.SUCCESS
        r.check_pool()
        env.dc.release(r.room, g2)
    finally:
        for s in silent:
            s.close()


@pytest.mark.parametrize("how", ["truncate", "unlink", "replace"])
def test_a_peer_that_shrinks_unlinks_or_replaces_its_pool_fails_its_rooms_only(guard: Env, how: str) -> None:
    """The receiver reads a same-host peer's rows from the pool's file (preadv), never from a
    mapping of it: a file the peer truncates after registration cannot SIGBUS the receiver. The
    peer's rooms fail with a reason naming what happened; the daemon and another group go on."""
    import os

    from transferd.pool.shm import pool_path

    env = guard
    fake, group, spool = _shm_fake(env)
    path = pool_path(spool.name)
    if how == "truncate":
        os.truncate(path, 4096)  # past the header: every row is gone (this process never touches spool again)
    elif how == "unlink":
        os.unlink(path)
    else:
        os.unlink(path)
        path.write_bytes(b"\0" * 8192)
    r = open_room(env, fake, group)
    before = env.refused()
    _data_ref(fake, r.tok, KV, _kv0(r), 0, 1, 0)
    st = r.wait()
    assert st.state is RoomState.FAILED and st.code == "no_shm", st
    word = {"truncate": "shrank to 4096 bytes", "unlink": "was unlinked", "replace": "was replaced"}[how]
    assert word in st.reason and spool.name in st.reason, st.reason
    assert env.refused().get("no_shm", 0) == before.get("no_shm", 0) + 1
    r.check_pool()  # nothing written
    env.dc.release(r.room, group)
    # the receiver is alive and another same-host group completes a room byte-exact
    fake2, group2, spool2 = _shm_fake(env)
    r2 = open_room(env, fake2, group2)
    L = r2.layout
    n = len(r2.dst)
    for b in L.indices("kv"):
        _data_ref(fake2, r2.tok, KV, b, 0, n, 1)
        r2.want[b][r2.dst] = spool2.rows[b][1:1 + n]
    for b in L.indices("state"):
        _data_ref(fake2, r2.tok, STATE, b, 0, 1, 2)
        r2.want[b][r2.slots[L.buffers[b].component][0]] = spool2.rows[b][2]
    a = L.aux_index
    spool2.rows[a][4, :8] = np.frombuffer(np.uint64(r2.room).astype("<u8").tobytes(), np.uint8)
    _data_ref(fake2, r2.tok, AUX, a, 0, 1, 4)
    r2.want[a][r2.aux] = spool2.rows[a][4]
    r2.done()
    assert r2.wait().state is RoomState.SUCCESS
    r2.check_pool()
    env.dc.release(r2.room, group2)


def test_a_garbage_flood_is_counted_in_full_and_logged_in_a_few_lines(guard: Env) -> None:
    """Refusal logs are rate-limited per peer and reason: every refusal is counted, the first few
    are logged one line each, the rest summed up (daemon/ratelog.py); the receiver's RSS stays
    flat (printed: the RSS of the receiver before and after)."""
    env = guard
    before, logs = env.refused(), env.log_lines("decode")
    pid = env.proc.proc.pid

    def rss_kb() -> int:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    f = env.fake("flood")
    for _ in range(200):  # warm-up: the allocator's first arenas
        f.send(b"\xc1")
    env.until(lambda: env.refused().get("decode", 0) >= before.get("decode", 0) + 200, "the warm-up to be refused")
    rss0 = rss_kb()
    n = 20_000
    for _ in range(n):
        f.send(b"\xc1")
    env.until(lambda: env.refused().get("decode", 0) >= before.get("decode", 0) + 200 + n, "the flood to be refused")
    rss1 = rss_kb()
    print(f"receiver RSS {rss0} kB -> {rss1} kB over {n} refused messages ({(rss1 - rss0) * 1024 / n:.1f} B each)")
    assert env.refused()["decode"] == before.get("decode", 0) + 200 + n  # every one counted
    assert env.log_lines("decode") - logs <= 5  # the first five lines of this peer and reason, no more
    assert rss1 - rss0 < 4096, f"RSS grew {rss1 - rss0} kB over {n} refused messages"


def test_a_strangers_refused_registrations_are_answered_at_most_once_a_second(guard: Env) -> None:
    """5,000 registrations the receiver must refuse, from one identity that never reads: every
    one is counted, but it is answered at most once a second (before: 5,000 answers queued
    towards it — the RSS creep of a flood that never reads — and, once it left, one WARNING line
    per answer that found no peer). A registered sender's registrations are always answered."""
    env = guard
    before = env.refused()
    f = env.fake("noreader")
    bad = pack(register_header("noreader", 5, 2))  # rank 5 of cp_size 2: refused bad_rank
    n = 5000
    t0 = time.monotonic()
    for _ in range(n):
        f.send(bad)
    env.until(lambda: env.refused().get("bad_rank", 0) == before.get("bad_rank", 0) + n, "every register refused")
    elapsed = time.monotonic() - t0
    f.pump()
    answers = [m for m in f.inbox if m.get("t") == "registered"]
    assert 1 <= len(answers) <= elapsed + 2, f"{len(answers)} answers to {n} registrations in {elapsed:.1f}s"
    assert all(not m["ok"] and "rank 5 is outside cp_size 2" in m["reason"] for m in answers), answers


def test_rss_stays_flat_under_a_long_mixed_garbage_stream_from_many_identities(guard: Env) -> None:
    """Issue 13 item 4. An outside client measured ~35 B of RSS per refused message. From one
    identity, RSS is flat (test above); what grows is per *connection*: each ZeroMQ connection
    holds ~20-30 KB while it lives, and after a burst of short-lived identities the allocator
    keeps its high-water mark (transferd keeps freed memory mapped on purpose: daemon/malloc.py).
    Two things made it grow without bound, both fixed: every refused registration was answered,
    so a flood that never reads queued one answer per message towards it (now at most one a
    second per identity), and the heap freed after a burst stayed mapped (now given back while
    the receiver holds no room, every 10 s). After warm-up waves, three more waves — 45,000
    refused messages of every garbage kind above and refused registrations, from 900 identities
    that come and go — leave the idle receiver's RSS flat."""
    env = guard
    pid = env.proc.proc.pid

    def rss_kb() -> int:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    kinds = [frames for _, frames, _ in GARBAGE] + [[pack(register_header("mix", 9, 2))]]

    def total() -> int:
        return sum(env.dc.stats()["refused"].values())

    def wave(n_ids: int, per_id: int) -> int:
        for i in range(n_ids):
            f = env.fake("mix")
            for j in range(per_id):
                f.send(*kinds[(i + j) % len(kinds)])
            f.sock.close(linger=30_000)
            env.fakes.remove(f)
        # what was still queued when a fake left goes with its connection (ZeroMQ), so the count
        # cannot be waited for exactly: polled until it has not moved for half a second
        last, since = [-1], [0.0]

        def settled() -> bool:
            now = total()
            if now != last[0]:
                last[0], since[0] = now, time.monotonic()
                return False
            return time.monotonic() - since[0] >= 0.5
        env.until(settled, "the wave to be refused")
        return n_ids * per_id

    def trimmed() -> None:
        """The idle receiver's next heap trim (its stats count them)."""
        seen = env.dc.stats()["heap_trims"]
        env.until(lambda: env.dc.stats()["heap_trims"] > seen, "the idle receiver's heap trim")

    for _ in range(2):
        wave(300, 20)
    trimmed()
    rss0, count0 = rss_kb(), total()
    n = sum(wave(300, 50) for _ in range(3))
    trimmed()
    rss1, got = rss_kb(), total() - count0
    print(f"receiver RSS {rss0} kB -> {rss1} kB over {got} refused messages of {n} sent "
          f"({(rss1 - rss0) * 1024 / max(got, 1):.1f} B each)")
    assert got > n // 2, f"only {got} of {n} messages reached the receiver"
    assert rss1 - rss0 < 4096, f"RSS grew {rss1 - rss0} kB over {got} refused messages"
