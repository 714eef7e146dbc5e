"""The local engine API's wire (transferd.protocol.engine_api): typed requests and replies, every
field's refusal with its exact message, the version check and the batch rules."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transferd.errors import (
    BadRequest,
    DecodeError,
    IndexOutOfRange,
    RoomExists,
    TransferdError,
    UnknownRoom,
    VersionMismatch,
)
from transferd.protocol.engine_api import (
    BATCHABLE,
    LOCAL_API_VERSION,
    MAX_BATCH,
    MAX_TIMEOUT_S,
    RECEIVER_OPS,
    SENDER_OPS,
    Batch,
    BatchReply,
    Expect,
    Ok,
    Ping,
    ReceiverAbort,
    ReceiverPoll,
    ReceiverWait,
    Refusal,
    Release,
    Request,
    SenderAbort,
    SenderPoll,
    SenderWait,
    Stats,
    Status,
    Submit,
    UnknownOp,
    batch_replies,
    build,
    builds,
    call_map,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    packer,
    parse_request,
    request_map,
)
from transferd.protocol.room import RoomRequest, RoomState, RoomStatus

V = LOCAL_API_VERSION

RECEIVER_SAMPLES: list[Request] = [
    Expect(room=7, group="prefill0", dst_pages=(3, 4, 5), prefix_pages=1, state={"conv": (2,)}, aux_slot=9),
    Expect(room=(1 << 64) - 1, group="g", dst_pages=(), aux_slot=0),
    ReceiverPoll(group="prefill0", room=7),
    ReceiverWait(group="prefill0", room=7, timeout_s=2.5),
    ReceiverWait(group="prefill0", room=7),
    ReceiverAbort(group="prefill0", room=7, reason="client went away"),
    Release(group="prefill0", room=7),
    Stats(), Status(), Ping(),
]
SENDER_SAMPLES: list[Request] = [
    Submit(room=7, start=4, src_pages=(10, 11), last=True, state={"conv": (1,), "ssm": (2, 3)}, aux_slot=0),
    Submit(room=7, src_pages=()),
    SenderPoll(room=7),
    SenderWait(room=7, timeout_s=0),
    SenderAbort(room=7),
    Stats(), Status(), Ping(),
]


def wire(op: str, **fields: Any) -> dict[str, Any]:
    return {"id": 1, "v": V, "op": op, **fields}


def refused(obj: Any, served: Any = RECEIVER_OPS) -> TransferdError:
    with pytest.raises(TransferdError) as info:
        parse_request(obj, served)
    return info.value


# -- the roles ---------------------------------------------------------------------------------

def test_each_daemon_serves_exactly_its_ops() -> None:
    assert {op: cls.__name__ for op, cls in RECEIVER_OPS.items()} == {
        "expect": "Expect", "poll": "ReceiverPoll", "wait": "ReceiverWait", "abort": "ReceiverAbort",
        "release": "Release", "stats": "Stats", "status": "Status", "ping": "Ping"}
    assert {op: cls.__name__ for op, cls in SENDER_OPS.items()} == {
        "submit": "Submit", "poll": "SenderPoll", "wait": "SenderWait", "abort": "SenderAbort",
        "stats": "Stats", "status": "Status", "ping": "Ping"}
    assert all(cls.op == op for ops in (RECEIVER_OPS, SENDER_OPS) for op, cls in ops.items())
    assert set(RECEIVER_OPS) | set(SENDER_OPS) == BATCHABLE and "batch" not in BATCHABLE


@pytest.mark.parametrize(("op", "served", "known"), [
    ("submit", RECEIVER_OPS, "batch, abort, expect, ping, poll, release, stats, status, wait"),
    ("expect", SENDER_OPS, "batch, abort, ping, poll, stats, status, submit, wait"),
    ("release", SENDER_OPS, "batch, abort, ping, poll, stats, status, submit, wait"),
    ("explode", RECEIVER_OPS, "batch, abort, expect, ping, poll, release, stats, status, wait"),
])
def test_an_op_of_the_other_daemon_is_unknown(op: str, served: Any, known: str) -> None:
    exc = refused(wire(op, room=1), served)
    assert type(exc) is UnknownOp and exc.code == "bad_request"
    assert str(exc) == f"unknown op {op!r}; known: {known}"


# -- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("req", RECEIVER_SAMPLES, ids=repr)
def test_receiver_requests_round_trip(req: Request) -> None:
    assert type(req).from_wire(req.to_wire()) == req
    assert decode_request(encode_request(41, req), RECEIVER_OPS) == (41, req)


@pytest.mark.parametrize("req", SENDER_SAMPLES, ids=repr)
def test_sender_requests_round_trip(req: Request) -> None:
    assert decode_request(encode_request("x", req), SENDER_OPS) == ("x", req)
    assert msgpack.unpackb(encode_request("x", req)) == {"id": "x", "v": V, "op": req.op, **msgpack.unpackb(
        msgpack.packb(req.to_wire()))}


def test_every_field_is_sent_and_the_defaults_are_the_documented_ones() -> None:
    assert msgpack.unpackb(encode_request(3, Submit(room=5, src_pages=(1,)))) == {
        "id": 3, "v": V, "op": "submit", "room": 5, "start": 0, "src_pages": [1], "last": False, "state": {},
        "aux_slot": None}
    assert parse_request(wire("submit", room=5, src_pages=[1]), SENDER_OPS) == Submit(room=5, src_pages=(1,))
    e = parse_request(wire("expect", room=5, group="g", dst_pages=[1, 2], aux_slot=3), RECEIVER_OPS)
    assert e == Expect(room=5, group="g", dst_pages=(1, 2), prefix_pages=0, state={}, aux_slot=3)
    assert parse_request(wire("wait", room=5, group="g"), RECEIVER_OPS) == ReceiverWait(group="g", room=5,
                                                                                         timeout_s=60.0)
    assert parse_request(wire("abort", room=5), SENDER_OPS) == SenderAbort(room=5, reason="")
    assert parse_request(wire("submit", room=5, src_pages=[], state=None, aux_slot=None), SENDER_OPS) == Submit(
        room=5, src_pages=())


def test_expect_is_the_receivers_room_request() -> None:
    e = Expect(room=5, group="g", dst_pages=(1, 2), prefix_pages=1, state={"conv": (4,)}, aux_slot=3)
    assert e.room_request() == RoomRequest(room=5, group="g", dst_pages=(1, 2), prefix=1, state={"conv": (4,)},
                                           aux_slot=3)


def test_a_request_is_the_same_whoever_builds_it() -> None:
    """The client builds its requests with the daemon's decoder: one request, one set of checks."""
    args = {"room": 5, "src_pages": [1, 2], "last": True, "aux_slot": 0}
    assert build(Submit, args) == parse_request(wire("submit", **args), SENDER_OPS)
    with pytest.raises(BadRequest, match="^room must be an unsigned 64-bit integer, not -1$"):
        build(Submit, {"room": -1, "src_pages": []})
    out = builds(Expect, [Expect(room=1, group="g", dst_pages=(), aux_slot=0),
                          {"room": 2, "group": "g", "dst_pages": [1], "aux_slot": 0},
                          {"room": 3, "group": "", "dst_pages": [1], "aux_slot": 0},
                          ("not", "a", "map")])  # type: ignore[list-item]
    assert out[0] == Expect(room=1, group="g", dst_pages=(), aux_slot=0)
    assert out[1] == Expect(room=2, group="g", dst_pages=(1,), aux_slot=0)
    assert isinstance(out[2], BadRequest) and str(out[2]) == "group must be a non-empty string, not ''"
    assert isinstance(out[3], BadRequest) and "expected a Expect or a map of its fields" in str(out[3])


# -- every field's refusal ---------------------------------------------------------------------

U64 = "must be an unsigned 64-bit integer, not"

FIELD_REFUSALS: list[tuple[str, Any, dict[str, Any], str]] = [
    # op, served, fields, exact message
    ("expect", RECEIVER_OPS, dict(room=-1, group="g", dst_pages=[1], aux_slot=0), f"room {U64} -1"),
    ("expect", RECEIVER_OPS, dict(room=1 << 64, group="g", dst_pages=[1], aux_slot=0), f"room {U64} {1 << 64}"),
    ("expect", RECEIVER_OPS, dict(room=True, group="g", dst_pages=[1], aux_slot=0), f"room {U64} True"),
    ("expect", RECEIVER_OPS, dict(room="1", group="g", dst_pages=[1], aux_slot=0), f"room {U64} '1'"),
    ("expect", RECEIVER_OPS, dict(room=1.0, group="g", dst_pages=[1], aux_slot=0), f"room {U64} 1.0"),
    ("expect", RECEIVER_OPS, dict(room=1, group="", dst_pages=[1], aux_slot=0),
     "group must be a non-empty string, not ''"),
    ("expect", RECEIVER_OPS, dict(room=1, group=5, dst_pages=[1], aux_slot=0),
     "group must be a non-empty string, not 5"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages="12", aux_slot=0),
     "dst_pages must be a list of integers"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1, True], aux_slot=0),
     "dst_pages must be a list of integers"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1, 2.0], aux_slot=0),
     "dst_pages must be a list of integers"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1, -1], aux_slot=0),
     "dst_pages: index -1 is negative or absurdly large"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1 << 62], aux_slot=0),
     f"dst_pages: index {1 << 62} is negative or absurdly large"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], prefix_pages=-2, aux_slot=0),
     f"prefix_pages {U64} -2"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], prefix_pages=None, aux_slot=0),
     f"prefix_pages {U64} None"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], state=[1], aux_slot=0),
     "state must map state component names to slot lists"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], state={"": [1]}, aux_slot=0),
     "state component must be a non-empty string, not ''"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], state={"conv": [-3]}, aux_slot=0),
     "state[conv]: index -3 is negative or absurdly large"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], state={"conv": 3}, aux_slot=0),
     "state[conv] must be a list of integers"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], aux_slot=None), f"aux_slot {U64} None"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1]), "expect: 'aux_slot' is required"),
    ("expect", RECEIVER_OPS, dict(group="g", dst_pages=[1], aux_slot=0), "expect: 'room' is required"),
    ("expect", RECEIVER_OPS, dict(room=1, group="g", dst_pages=[1], aux_slot=0, prefix_page=1),
     "expect: unknown field 'prefix_page'"),
    ("poll", RECEIVER_OPS, dict(room=1), "poll: 'group' is required"),
    ("poll", RECEIVER_OPS, dict(room=-1, group="g"), f"room {U64} -1"),
    ("poll", RECEIVER_OPS, dict(room=1, group=""), "group must be a non-empty string, not ''"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s=-1),
     "timeout_s must be a finite non-negative number of seconds, not -1"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s="5"),
     "timeout_s must be a finite non-negative number of seconds, not '5'"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s=float("nan")),
     "timeout_s must be a finite non-negative number of seconds, not nan"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s=float("inf")),
     "timeout_s must be a finite non-negative number of seconds, not inf"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s=True),
     "timeout_s must be a finite non-negative number of seconds, not True"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s=1 << 64),
     f"timeout_s must be a finite non-negative number of seconds, not {1 << 64}"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s=1e300), "timeout_s must be at most 86400 seconds, not 1e+300"),
    ("wait", RECEIVER_OPS, dict(room=1, group="g", timeout_s=1 << 63),
     f"timeout_s must be at most 86400 seconds, not {1 << 63}"),
    ("wait", SENDER_OPS, dict(room=1, timeout_s=86400.5), "timeout_s must be at most 86400 seconds, not 86400.5"),
    ("wait", SENDER_OPS, dict(room=1, timeout_s=-0.5), "timeout_s must be a finite non-negative number of seconds, not -0.5"),
    ("wait", SENDER_OPS, dict(room=1, timeout_s=float("-inf")),
     "timeout_s must be a finite non-negative number of seconds, not -inf"),
    ("abort", RECEIVER_OPS, dict(room=1, group="g", reason=5), "reason must be a string, not 5"),
    ("abort", RECEIVER_OPS, dict(room=1, group="g", reason=None), "reason must be a string, not None"),
    ("release", RECEIVER_OPS, dict(room=1, group="g", reason="x"), "release: unknown field 'reason'"),
    ("stats", RECEIVER_OPS, dict(room=1), "stats: unknown field 'room'"),
    ("status", RECEIVER_OPS, dict(verbose=True), "status: unknown field 'verbose'"),
    ("ping", RECEIVER_OPS, dict(calls=[]), "ping: unknown field 'calls'"),
    ("submit", SENDER_OPS, dict(room=1, start=-1, src_pages=[1]), f"start {U64} -1"),
    ("submit", SENDER_OPS, dict(room=1, src_pages=None), "src_pages must be a list of integers"),
    ("submit", SENDER_OPS, dict(room=1), "submit: 'src_pages' is required"),
    ("submit", SENDER_OPS, dict(room=1, src_pages=[1], last=1), "last must be true or false, not 1"),
    ("submit", SENDER_OPS, dict(room=1, src_pages=[1], last=None), "last must be true or false, not None"),
    ("submit", SENDER_OPS, dict(room=1, src_pages=[1], state={"c": [1 << 62]}),
     f"state[c]: index {1 << 62} is negative or absurdly large"),
    ("submit", SENDER_OPS, dict(room=1, src_pages=[1], aux_slot=-1), f"aux_slot {U64} -1"),
    ("submit", SENDER_OPS, dict(room=1, src_pages=[1], src_page=[2]), "submit: unknown field 'src_page'"),
    ("poll", SENDER_OPS, dict(room=1, group="g"), "poll: unknown field 'group'"),
    ("wait", SENDER_OPS, dict(room=1, timeout_s=[]), "timeout_s must be a finite non-negative number of seconds, not []"),
    ("abort", SENDER_OPS, dict(room=None), f"room {U64} None"),
]


@pytest.mark.parametrize(("op", "served", "fields", "message"), FIELD_REFUSALS,
                         ids=[m for *_, m in FIELD_REFUSALS])
def test_every_field_is_checked_with_its_message(op: str, served: Any, fields: dict[str, Any], message: str) -> None:
    exc = refused(wire(op, **fields), served)
    assert type(exc) is BadRequest and exc.code == "bad_request"
    assert str(exc) == message


@pytest.mark.parametrize("timeout", [0, 0.0, 2.5, MAX_TIMEOUT_S, float(MAX_TIMEOUT_S)])
def test_a_wait_takes_any_timeout_from_zero_to_a_day(timeout: float) -> None:
    assert MAX_TIMEOUT_S == 86400  # docs/PROTOCOL.md §17 quotes it
    for req, served in ((wire("wait", room=1, group="g", timeout_s=timeout), RECEIVER_OPS),
                        (wire("wait", room=1, timeout_s=timeout), SENDER_OPS)):
        got = parse_request(req, served)
        assert isinstance(got, (ReceiverWait, SenderWait))
        assert type(got.timeout_s) is float and got.timeout_s == timeout


def test_the_first_bad_field_in_wire_order_is_named() -> None:
    # expect's order: room, group, dst_pages, prefix_pages, state, aux_slot
    assert str(refused(wire("expect", room=-1, group="", dst_pages=None, aux_slot=None))).startswith("room ")
    assert str(refused(wire("expect", room=1, group="", dst_pages=None, aux_slot=None))).startswith("group ")
    assert str(refused(wire("expect", room=1, group="g", dst_pages=None, aux_slot=None))).startswith("dst_pages ")
    assert str(refused(wire("poll", room=-1, group=""))).startswith("group ")  # group first, as before


# -- the version --------------------------------------------------------------------------------

@pytest.mark.parametrize(("v", "shown"), [(1, "1"), (3, "3"), (0, "0"), ("2", "'2'"), (2.0, "2.0"), (True, "True"),
                                          (None, "None")])
def test_another_version_is_refused_naming_both(v: Any, shown: str) -> None:
    exc = refused({"id": 1, "v": v, "op": "ping"})
    assert type(exc) is VersionMismatch and exc.code == "version"
    assert str(exc) == f"engine API version {shown} from the client; this daemon speaks 2"


def test_a_request_without_a_version_reads_as_version_1() -> None:
    exc = refused({"id": 1, "op": "ping"})
    assert type(exc) is VersionMismatch
    assert str(exc) == 'engine API version 1 (no "v") from the client; this daemon speaks 2'
    assert LOCAL_API_VERSION == 2


def test_the_version_is_checked_before_anything_else_in_the_map() -> None:
    assert type(refused({"v": 1, "op": "explode", "junk": 1})) is VersionMismatch
    assert type(refused({"v": 1})) is VersionMismatch
    assert type(refused({"v": 1, "op": "batch", "calls": "nope"})) is VersionMismatch


def test_every_request_sent_carries_the_version() -> None:
    for req in (*RECEIVER_SAMPLES, *SENDER_SAMPLES):
        assert msgpack.unpackb(encode_request(1, req))["v"] == V
    assert request_map(9, "explode", {"a": 1}) == {"id": 9, "v": V, "op": "explode", "a": 1}


# -- framing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [msgpack.packb([1, 2]), msgpack.packb("ping"), msgpack.packb(None)])
def test_a_body_that_is_not_a_map_is_a_decode_error_without_an_id(body: bytes) -> None:
    rid, exc = decode_request(body, RECEIVER_OPS)
    assert rid is None and type(exc) is DecodeError
    assert str(exc) == "malformed request: request must be a map with a string 'op'"


def test_a_map_without_a_string_op_is_a_decode_error_with_its_id() -> None:
    for obj in ({"id": 4, "v": V}, {"id": 4, "v": V, "op": 3}):
        rid, exc = decode_request(msgpack.packb(obj), RECEIVER_OPS)
        assert rid == 4 and type(exc) is DecodeError
        assert str(exc) == "malformed request: request must be a map with a string 'op'"


def test_bytes_that_are_not_msgpack_are_a_decode_error() -> None:
    rid, exc = decode_request(b"\xc1", RECEIVER_OPS)
    assert rid is None and type(exc) is DecodeError and str(exc).startswith("malformed request: ")
    rid, exc = decode_request(msgpack.packb({"v": V, "op": "ping"}) + b"x", RECEIVER_OPS)
    assert rid is None and type(exc) is DecodeError


_scalars = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                       max_leaves=12)
_keys = st.sampled_from(["id", "v", "op", "room", "group", "dst_pages", "src_pages", "state", "aux_slot", "calls",
                         "timeout_s", "last", "reason", "start", "prefix_pages"])
_ops = st.sampled_from(["batch", "expect", "submit", "poll", "wait", "abort", "release", "ping", "x"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values | _ops, max_size=8), st.booleans(), st.booleans())
def test_any_map_decodes_to_a_request_or_an_error(obj: dict[str, Any], versioned: bool, receiver: bool) -> None:
    if versioned:
        obj["v"] = V
    served = RECEIVER_OPS if receiver else SENDER_OPS
    rid, out = decode_request(msgpack.packb(obj), served)
    assert rid == obj.get("id")
    assert isinstance(out, (Request, TransferdError))
    if isinstance(out, Request) and not isinstance(out, Batch):
        assert type(out) is served[out.op] and type(out).from_wire(out.to_wire()) == out


# -- batches -------------------------------------------------------------------------------------

def test_a_batch_holds_each_call_or_its_error_in_place() -> None:
    calls = [
        {"op": "poll", "room": 1, "group": "g"},
        {"op": "batch", "calls": []},
        {"op": "explode"},
        {"room": 1},
        {"op": "wait", "room": 1, "group": "g", "timeout_s": -1},
        {"op": "ping", "v": 1},
        {"op": "ping", "v": V},
        {"op": "ping", "id": 3},
        {"op": "submit", "room": 1, "src_pages": []},
    ]
    b = parse_request(wire("batch", calls=calls), RECEIVER_OPS)
    assert isinstance(b, Batch) and len(b.calls) == len(calls)
    c = b.calls
    assert c[0] == ReceiverPoll(group="g", room=1)
    assert type(c[1]) is BadRequest and str(c[1]) == "batches do not nest"
    assert type(c[2]) is UnknownOp and str(c[2]).startswith("unknown op 'explode'; known: batch, abort, expect")
    assert type(c[3]) is UnknownOp and str(c[3]).startswith("unknown op None; known: batch")
    assert type(c[4]) is BadRequest and str(c[4]).startswith("timeout_s must be")
    assert type(c[5]) is VersionMismatch and str(c[5]) == "engine API version 1 from the client; this daemon speaks 2"
    assert c[6] == Ping()
    assert type(c[7]) is BadRequest and str(c[7]) == "ping: unknown field 'id'"
    assert type(c[8]) is UnknownOp  # a sender's op in a receiver's batch


@pytest.mark.parametrize("calls", ["x", None, {"op": "ping"}, [{"op": "ping"}, 3], [{"op": "ping"}] * (MAX_BATCH + 1)])
def test_a_batch_whose_calls_are_not_a_list_of_maps_is_refused_whole(calls: Any) -> None:
    exc = refused(wire("batch", calls=calls))
    assert type(exc) is BadRequest
    assert str(exc) == f"batch: 'calls' must be a list of at most {MAX_BATCH} request maps"


def test_batch_limits() -> None:
    assert MAX_BATCH == 65536
    full = parse_request(wire("batch", calls=[{"op": "ping"}] * MAX_BATCH), SENDER_OPS)
    assert isinstance(full, Batch) and full.calls == (Ping(),) * MAX_BATCH
    empty = parse_request(wire("batch", calls=[]), SENDER_OPS)
    assert isinstance(empty, Batch) and empty.calls == ()
    assert str(refused(wire("batch"))) == f"batch: 'calls' must be a list of at most {MAX_BATCH} request maps"
    assert str(refused(wire("batch", calls=[], timeout_s=3))) == "batch: unknown field 'timeout_s'"


def test_a_batch_sent_is_its_calls_without_ids() -> None:
    b = Batch((Submit(room=1, src_pages=(2,)), SenderPoll(room=1)))
    sent = msgpack.unpackb(encode_request(5, b))
    assert sent == {"id": 5, "v": V, "op": "batch", "calls": [
        {"op": "submit", "room": 1, "start": 0, "src_pages": [2], "last": False, "state": {}, "aux_slot": None},
        {"op": "poll", "room": 1}]}
    assert decode_request(encode_request(5, b), SENDER_OPS) == (5, b)
    assert call_map(SenderPoll(room=1)) == {"op": "poll", "room": 1}
    with pytest.raises(TypeError):
        Batch((BadRequest("no"),)).to_wire()


def test_requests_are_compiled_from_their_fields() -> None:
    """Each op's decoder and to_wire are generated from its dataclass fields: every field, in
    declaration order, and nothing else."""
    from dataclasses import fields
    for cls in {*RECEIVER_OPS.values(), *SENDER_OPS.values()}:
        names = [f.name for f in fields(cls)]
        sample = next(r for r in (*RECEIVER_SAMPLES, *SENDER_SAMPLES) if type(r) is cls)
        assert list(sample.to_wire()) == names, cls
        assert cls.from_wire(sample.to_wire()) == sample
        assert cls.from_wire({**sample.to_wire(), "id": 1, "v": V, "op": cls.op}, frozenset({"id", "v", "op"})) == sample
        with pytest.raises(BadRequest, match=f"^{cls.op}: unknown field 'id'$"):
            cls.from_wire({**sample.to_wire(), "id": 1})


def test_a_kept_packer_packs_each_map_alone() -> None:
    pack = packer()
    assert msgpack.unpackb(pack({"a": 1})) == {"a": 1}
    assert msgpack.unpackb(pack({"b": b"x"})) == {"b": b"x"}  # bin type, as packb(use_bin_type=True)
    with pytest.raises(TypeError):
        pack({"c": object()})
    assert pack({"d": [1, 2]}) == msgpack.packb({"d": [1, 2]}, use_bin_type=True)
    body = encode_reply(7, Ok(RoomStatus(RoomState.SUCCESS)), pack)
    assert body == encode_reply(7, Ok(RoomStatus(RoomState.SUCCESS)))


# -- replies -------------------------------------------------------------------------------------

def test_replies_round_trip() -> None:
    st_ = RoomStatus(RoomState.FAILED, "aborted", "by the engine")
    assert msgpack.unpackb(encode_reply(3, Ok(st_))) == {
        "id": 3, "v": V, "ok": True, "result": {"state": "failed", "code": "aborted", "reason": "by the engine"}}
    assert decode_reply(encode_reply(3, Ok(st_))) == (3, Ok(st_.to_wire()))
    assert decode_reply(encode_reply(4, Ok({"name": "decode0", "pid": 1}))) == (4, Ok({"name": "decode0", "pid": 1}))
    assert msgpack.unpackb(encode_reply(None, Refusal("decode", "malformed"))) == {
        "id": None, "v": V, "ok": False, "code": "decode", "error": "malformed"}
    assert decode_reply(encode_reply(5, Refusal("unknown_room", "room g/1"))) == (5, Refusal("unknown_room", "room g/1"))
    batch = BatchReply((Ok(st_), Refusal("bad_request", "batches do not nest"), Ok(None)))
    rid, out = decode_reply(encode_reply(6, batch))
    assert rid == 6 and isinstance(out, Ok)
    assert batch_replies(out.result) == [Ok(st_.to_wire()), Refusal("bad_request", "batches do not nest"), Ok(None)]


def test_a_refusal_is_its_error_class() -> None:
    for code, cls in [("bad_request", BadRequest), ("unknown_room", UnknownRoom), ("room_exists", RoomExists),
                      ("index_out_of_range", IndexOutOfRange), ("version", VersionMismatch), ("decode", DecodeError),
                      ("internal", TransferdError), ("no such code", TransferdError)]:
        exc = Refusal(code, "why").error()
        assert type(exc) is cls and str(exc) == "why"
    assert Refusal.of(UnknownOp("unknown op 'x'")) == Refusal("bad_request", "unknown op 'x'")


@pytest.mark.parametrize(("reply", "shown"), [({"id": 1, "ok": True, "result": None}, '1 (no "v")'),
                                              ({"id": 1, "v": 3, "ok": True, "result": None}, "3")])
def test_a_reply_of_another_version_is_a_version_refusal(reply: dict[str, Any], shown: str) -> None:
    assert decode_reply(msgpack.packb(reply)) == (1, Refusal(
        "version", f"engine API version {shown} from the daemon; this client speaks 2"))


@pytest.mark.parametrize("body", [b"\xc1", msgpack.packb([1]), msgpack.packb({"id": 1, "v": V}),
                                  msgpack.packb({"id": 1, "v": V, "ok": 1})])
def test_a_malformed_reply_is_a_decode_error(body: bytes) -> None:
    with pytest.raises(DecodeError, match="malformed engine API reply"):
        decode_reply(body)
    with pytest.raises(DecodeError, match="a batch's result must be a list of reply maps"):
        batch_replies([{"ok": True}, 3])


def test_a_daemons_version_refusal_is_read_whatever_its_version() -> None:
    """Its shape is the same in every version: a client learns why, not just that, it was refused."""
    for v in ({}, {"v": 3}, {"v": 1}):
        reply = {"id": 1, **v, "ok": False, "code": "version", "error": "engine API version 2 from the client; "
                                                                          "this daemon speaks 3"}
        assert decode_reply(msgpack.packb(reply)) == (1, Refusal("version", reply["error"]))
    other = {"id": 1, "v": 3, "ok": False, "code": "unknown_room", "error": "x"}
    assert decode_reply(msgpack.packb(other))[1].code == "version"  # any other reply of v3 is not read
