"""transferd.protocol.messages: header codec round trips and refusal of bad input."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transferd.errors import DecodeError, ProtocolError, VersionMismatch
from transferd.layout import ModelSpec
from transferd.protocol.messages import (
    CONTROL_TYPES,
    DATA_TAG,
    MAX_BUNDLE_MSGS,
    MAX_HEADER_BYTES,
    MAX_NIXL_MD,
    PROTOCOL_VERSION,
    U64_MAX,
    Assign,
    Bundle,
    Data,
    DataDone,
    Done,
    Fail,
    Message,
    Ping,
    Pong,
    Register,
    Registered,
    Status,
    decode_header,
    encode,
)

LAYOUT_WIRE = ModelSpec().layout(8, 0, 2).to_wire()

SAMPLES: list[Message] = [
    Register(group="prefill0", rank=3, cp_size=8, split="pages", fingerprint="0123456789abcdef",
             layout=LAYOUT_WIRE, incarnation=U64_MAX, pid=4242, host="node-7"),
    Register(group="g", rank=0, cp_size=1, split="layers", fingerprint="", layout={}, incarnation=0,
             epoch=3, checksum="crc32", stream=True),
    Register(group="g", rank=1, cp_size=2, split="pages", fingerprint="", layout={}, incarnation=0,
             te_session="10.0.0.7:15099", te_addrs=(1 << 40, U64_MAX)),
    Register(group="g", rank=1, cp_size=2, split="pages", fingerprint="", layout={}, incarnation=0,
             te_session="transferd-g-r1-00000000000000ff", te_addrs=(1 << 40, 4096), nixl_md=b"\x00md" * 100),
    Registered(ok=True, reason="", receiver="decode0", incarnation=17),
    Registered(ok=True, reason="", receiver="decode0", incarnation=17, stream_port=65535, stream_key=bytes(range(16))),
    Registered(ok=True, reason="", receiver="decode0", incarnation=17, te=True),
    Registered(ok=False, reason="layout differs", receiver="decode0", incarnation=1, retry=True),
    Assign(tok=U64_MAX, room=12345678901234, n_pages=4, prefix=1, dst_pages=(9, 10, 11, 40),
           state={"conv": (1, 2), "ssm": ()}, aux_slot=3),
    Assign(tok=0, room=0, n_pages=0, prefix=0, dst_pages=()),
    Data(tok=7, kind=0, buffer=12, pos=1 << 39, count=5),
    Data(tok=U64_MAX, kind=2, buffer=0, pos=0, count=1),
    Data(tok=3, kind=1, buffer=2, pos=4, count=2, checksum=U64_MAX),
    DataDone(tok=9, entries=(Data(9, 0, 1, 2, 3),), done=Done(9, 7, 1 << 40, 0, 64)),
    DataDone(tok=U64_MAX, entries=(Data(U64_MAX, 0, 1, 2, 3), Data(U64_MAX, 2, 4, 0, 1, checksum=77)),
             done=Done(U64_MAX, 1 << 16, 0, 0, 0)),
    Done(tok=9, rank=2, kv_bytes=1 << 40, state_bytes=0, aux_bytes=64),
    Fail(tok=9, code="aborted", reason="engine aborted the request — ünïcode"),
    Status(tok=1, room=2, state="success"),
    Status(tok=1, room=2, state="failed", code="peer_lost", reason="rank 3 gone"),
    Ping(seq=0),
    Pong(seq=U64_MAX),
    Bundle((Status(tok=1, room=2, state="success"), Ping(seq=3))),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode_header(frame)
    assert type(back) is type(msg)
    assert back == msg
    # memoryview frames (zero-copy zmq frames) decode the same
    assert decode_header(memoryview(frame)) == msg


def test_every_control_type_is_sampled() -> None:
    sampled = {type(m) for m in SAMPLES}
    assert set(CONTROL_TYPES.values()) <= sampled
    assert Data in sampled


@pytest.mark.parametrize("port,key", [(0, b"k" * 16), (4000, b""), (4000, b"k" * 15), (65536, b"k" * 16)])
def test_registered_stream_offer_must_be_a_port_with_a_16_byte_key(port: int, key: bytes) -> None:
    obj = msgpack.unpackb(encode(Registered(True, "", "decode0", 1)), raw=False)
    obj["stream_port"], obj["stream_key"] = port, key
    with pytest.raises(DecodeError, match="stream_port|stream_key"):
        decode_header(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("session,addrs,needle", [
    ("", [4096], "te_session of 0 characters with 1 te_addrs"),
    ("h:1", [], "te_session of 3 characters with 0 te_addrs"),
    ("h" * 300 + ":1", [4096], "te_session of 302 characters"),
    ("nohostport", [4096], "is not HOST:PORT"),
    ("h:1", [4096, 0], "an address is 0"),
    ("h:1", [-1], "te_addrs"),
    ("h:1", ["4096"], "te_addrs"),
])
def test_register_te_session_goes_with_its_buffer_addresses(session: str, addrs: list[Any], needle: str) -> None:
    obj = msgpack.unpackb(encode(SAMPLES[0]), raw=False)
    obj["te_session"], obj["te_addrs"] = session, addrs
    with pytest.raises(DecodeError, match=needle):
        decode_header(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize("session,md,needle", [
    ("", b"md", "nixl_md of 2 bytes with a te_session of 0 characters"),
    ("agent", b"m" * (MAX_NIXL_MD + 1), f"nixl_md of {MAX_NIXL_MD + 1} bytes"),
    ("agent\n", b"md", "printable agent name"),
    ("agent", "md", "nixl_md"),
])
def test_register_nixl_md_is_bounded_and_goes_with_an_agent_name(session: str, md: Any, needle: str) -> None:
    obj = msgpack.unpackb(encode(SAMPLES[0]), raw=False)
    obj["te_session"], obj["te_addrs"], obj["nixl_md"] = session, [4096] if session else [], md
    with pytest.raises(DecodeError, match=needle):
        decode_header(msgpack.packb(obj, use_bin_type=True))


def test_register_nixl_md_names_an_agent_without_a_port() -> None:
    obj = msgpack.unpackb(encode(SAMPLES[0]), raw=False)
    obj["te_session"], obj["te_addrs"], obj["nixl_md"] = "transferd-g-r0-1f", [4096, 8192, 12288], b"\x00" * MAX_NIXL_MD
    msg = decode_header(msgpack.packb(obj, use_bin_type=True))
    assert isinstance(msg, Register) and msg.nixl_md == b"\x00" * MAX_NIXL_MD and msg.te_session == "transferd-g-r0-1f"


def test_data_header_is_a_short_array() -> None:
    assert msgpack.unpackb(encode(Data(1, 1, 2, 3, 4))) == [DATA_TAG, 1, 1, 2, 3, 4]
    assert msgpack.unpackb(encode(Data(1, 1, 2, 3, 4, checksum=99))) == [DATA_TAG, 1, 1, 2, 3, 4, 99]
    assert decode_header(encode(Data(1, 1, 2, 3, 4))).checksum is None


def test_control_headers_carry_type_and_version() -> None:
    for msg in SAMPLES:
        if isinstance(msg, (Data, DataDone)):
            continue
        obj = msgpack.unpackb(encode(msg), raw=False)
        assert obj["t"] == type(msg).T
        assert obj["v"] == PROTOCOL_VERSION


# -- arbitrary input ---------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_protocol_errors(frame: bytes) -> None:
    try:
        decode_header(frame)
    except (DecodeError, VersionMismatch):
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), U64_MAX), st.floats(),
                  st.text(max_size=6), st.binary(max_size=6))
_value = st.recursive(_leaf, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-(1 << 63), U64_MAX)),
                                                                    kids, max_size=4)),
                      max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_structured_garbage_raises_only_protocol_errors(data: st.DataObject) -> None:
    """Valid msgpack shaped like a real header, with one field replaced by anything."""
    msg = data.draw(st.sampled_from(SAMPLES))
    obj = msgpack.unpackb(encode(msg), raw=False)
    if isinstance(obj, list):
        obj[data.draw(st.integers(0, len(obj) - 1))] = data.draw(_value)
    else:
        key = data.draw(st.sampled_from(sorted(obj)))
        if data.draw(st.booleans()):
            obj[key] = data.draw(_value)
        else:
            del obj[key]
    frame = msgpack.packb(obj, use_bin_type=True)
    try:
        out = decode_header(frame)
    except ProtocolError as exc:
        assert isinstance(exc, (DecodeError, VersionMismatch))
        assert str(exc)
    else:
        assert type(out) is type(msg)


def test_malformed_msgpack() -> None:
    with pytest.raises(DecodeError, match="malformed"):
        decode_header(b"\xc1")
    with pytest.raises(DecodeError, match="malformed"):
        decode_header(encode(Ping(1))[:-1])
    with pytest.raises(DecodeError):
        decode_header(b"")


def test_oversized_header_refused_before_parsing() -> None:
    with pytest.raises(DecodeError, match="exceeds"):
        decode_header(b"\x00" * (MAX_HEADER_BYTES + 1))


@pytest.mark.parametrize("obj", [5, "ping", b"x", None, 1.5])
def test_header_must_be_map_or_array(obj: Any) -> None:
    with pytest.raises(DecodeError, match="map or a data array"):
        decode_header(msgpack.packb(obj))


# -- version and type --------------------------------------------------------------------

@pytest.mark.parametrize("v", [0, PROTOCOL_VERSION + 1, "1", None, True, float(PROTOCOL_VERSION)])
def test_wrong_version(v: Any) -> None:
    # True and 1.0 compare equal to 1 in Python; the version must still be refused as not an int
    obj = Ping(3).header()
    obj["v"] = v
    with pytest.raises(VersionMismatch, match="ping") as info:
        decode_header(msgpack.packb(obj))
    assert info.value.msg_type == "ping"


def test_missing_version() -> None:
    obj = Ping(3).header()
    del obj["v"]
    with pytest.raises(VersionMismatch):
        decode_header(msgpack.packb(obj))


@pytest.mark.parametrize("t", ["nope", "Ping", "", 1, None, ["ping"]])
def test_unknown_type(t: Any) -> None:
    with pytest.raises(DecodeError, match="unknown message type"):
        decode_header(msgpack.packb({"t": t, "v": PROTOCOL_VERSION}))


def test_unknown_type_wins_over_version() -> None:
    # an unknown type is reported as such, not as a version problem
    with pytest.raises(DecodeError, match="unknown message type 'hello'"):
        decode_header(msgpack.packb({"t": "hello", "v": 99}))


# -- field validation --------------------------------------------------------------------

def _with(msg: Message, **fields: Any) -> bytes:
    obj = msg.header()
    assert isinstance(obj, dict)
    obj.update(fields)
    return msgpack.packb(obj, use_bin_type=True)


def _without(msg: Message, key: str) -> bytes:
    obj = msg.header()
    assert isinstance(obj, dict)
    del obj[key]
    return msgpack.packb(obj, use_bin_type=True)


def _first(cls: type) -> Any:
    return next(m for m in SAMPLES if type(m) is cls)


REG: Register = _first(Register)
REGD: Registered = _first(Registered)
ASSIGN: Assign = _first(Assign)
DONE: Done = _first(Done)
FAIL: Fail = _first(Fail)
STATUS: Status = _first(Status)


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (_with(Ping(1), seq=True), "seq"),                # bool is not an int
        (_with(Ping(1), seq="1"), "seq"),                 # str is not an int
        (_with(Ping(1), seq=1.0), "seq"),
        (_with(REG, rank=True), "rank"),
        (_with(REG, cp_size="8"), "cp_size"),
        (_with(REG, group=5), "group"),
        (_with(REG, layout=[1, 2]), "layout"),
        (_with(REG, fp=b"abc"), "fp"),
        (_with(REG, epoch="1"), "epoch"),
        (_with(REG, checksum=0), "checksum"),
        (_with(REGD, ok=1), "ok"),                  # int is not a bool
        (_with(REGD, retry="no"), "retry"),
        (_with(ASSIGN, tok="7"), "tok"),
        (_with(ASSIGN, dst=[1, True, 2, 3]), "dst"),
        (_with(ASSIGN, dst="1234"), "dst"),
        (_with(ASSIGN, state=[1]), "state"),
        (_with(ASSIGN, state={"conv": [1, "2"]}), "conv"),
        (_with(ASSIGN, state={1: [1]}), "state"),
        (_with(ASSIGN, aux=None), "aux"),
        (_with(DONE, bytes=[1, 2]), "bytes"),
        (_with(DONE, bytes=[1, 2, True]), "bytes"),
        (_with(DONE, bytes={"kv": 1}), "bytes"),
        (_with(FAIL, code=None), "code"),
        (_with(STATUS, state="done"), "state"),
        (_with(STATUS, reason=3), "reason"),
    ],
)
def test_wrong_field_types_name_the_field(frame: bytes, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_header(frame)
    assert repr(field) in str(info.value) or field in str(info.value)


@pytest.mark.parametrize(
    ("frame", "field"),
    [
        (_with(Ping(1), seq=-1), "seq"),
        (_with(REG, rank=-1), "rank"),
        (_with(REG, cp_size=0), "cp_size"),
        (_with(REG, rank=(1 << 16) + 1), "rank"),
        (_with(REG, pid=-5), "pid"),
        (_with(REG, inc=-1), "inc"),
        (_with(REG, epoch=-1), "epoch"),
        (_with(ASSIGN, tok=-1), "tok"),
        (_with(ASSIGN, room=-3), "room"),
        (_with(ASSIGN, dst=[1, -2, 3, 4]), "dst"),
        (_with(ASSIGN, state={"conv": [-1]}), "conv"),
        (_with(ASSIGN, aux=-1), "aux"),
        (_with(DONE, bytes=[1, -2, 3]), "bytes"),
        (_with(DONE, rank=-1), "rank"),
        (_with(STATUS, tok=-1), "tok"),
    ],
)
def test_negative_or_out_of_range_ints_name_the_field(frame: bytes, field: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_header(frame)
    assert f"'{field}'" in str(info.value)


@pytest.mark.parametrize(
    ("msg", "key"),
    [(Ping(1), "seq"), (REG, "fp"), (REG, "host"), (REG, "epoch"), (ASSIGN, "dst"), (DONE, "bytes"), (REGD, "retry")],
)
def test_missing_field_named(msg: Message, key: str) -> None:
    with pytest.raises(DecodeError, match=f"missing field '{key}'"):
        decode_header(_without(msg, key))


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 5},                      # 4 destinations for n = 5
        {"n": 3},
        {"prefix": 5},                 # prefix beyond n
    ],
)
def test_assign_inconsistent_lengths(fields: dict[str, Any]) -> None:
    with pytest.raises(DecodeError, match="assign"):
        decode_header(_with(ASSIGN, **fields))


# -- the data header ---------------------------------------------------------------------

def _data(*items: Any) -> bytes:
    return msgpack.packb(list(items))


@pytest.mark.parametrize(
    "frame",
    [
        _data(1, 7, 3, 0, 0, 1),            # kind 3
        _data(1, 7, -1, 0, 0, 1),           # kind negative
        _data(1, -1, 0, 0, 0, 1),           # tok negative
        _data(1, 7, 0, -1, 0, 1),           # buffer negative
        _data(1, 7, 0, 1 << 20, 0, 1),      # buffer too large
        _data(1, 7, 0, 0, -1, 1),           # pos negative
        _data(1, 7, 0, 0, 1 << 40, 1),      # pos too large
        _data(1, 7, 0, 0, 0, 0),            # count zero
        _data(1, 7, 0, 0, 0, -4),           # count negative
        _data(1, 7, 0, 0, 0, 1 << 32),      # count too large
        _data(1, 7, 0, 0, 0, 1, -1),        # checksum negative
    ],
)
def test_data_header_out_of_range(frame: bytes) -> None:
    with pytest.raises(DecodeError, match="out of range"):
        decode_header(frame)


@pytest.mark.parametrize(
    "frame",
    [
        _data(1, 7, 0, 0, 0),               # too short
        _data(1, 7, 0, 0, 0, 1, 0, 0),      # too long
        _data(1, 7, 0, 0, 0, 1, "c"),       # checksum not an int
        _data(9, 7, 0, 0, 0, 1),            # unknown tag
        _data(3, 7, 0, 0, 0),               # data-refs without its count
        _data(3, 7, 0, 0, 0, 1, 5),         # data-refs with a src_row (the rows are a frame)
        _data(2, 7, 0, 0, 0, 1),            # data-ref tag without its src_row
        _data(1, 7, 0, 0, 0, True),         # bool
        _data(1, 7, 0, 0, 0, 1.0),          # float
        _data(1, "7", 0, 0, 0, 1),          # str
        _data(True, 7, 0, 0, 0, 1),
        _data(),
    ],
)
def test_data_header_shape(frame: bytes) -> None:
    with pytest.raises(DecodeError, match="data(-refs?)? header"):
        decode_header(frame)


def test_data_ref_round_trip_and_limits() -> None:
    from transferd.protocol.messages import DataRef

    m = DataRef(5, 0, 3, 7, 2, 99)
    assert decode_header(encode(m)) == m
    with pytest.raises(DecodeError, match="data-ref header fields out of range"):
        decode_header(_data(2, 5, 0, 3, 7, 0, 99))  # count 0
    with pytest.raises(DecodeError, match="data-ref header fields out of range"):
        decode_header(_data(2, 5, 0, 3, 7, 1, 1 << 40))


def test_data_refs_round_trip_and_limits() -> None:
    from transferd.protocol.messages import DataRefs

    m = DataRefs(5, 1, 3, 7, 2)
    assert decode_header(encode(m)) == m
    for bad in (_data(3, 5, 0, 3, 7, 0), _data(3, 5, 3, 3, 7, 1), _data(3, -1, 0, 3, 7, 1),
                _data(3, 5, 0, 1 << 20, 7, 1), _data(3, 5, 0, 3, 1 << 40, 1)):
        with pytest.raises(DecodeError, match="data-refs header fields out of range"):
            decode_header(bad)


def test_data_batch_round_trip_and_limits() -> None:
    from transferd.protocol.messages import MAX_BATCH_ENTRIES, DataBatch

    m = DataBatch(9, (Data(9, 0, 1, 2, 3), Data(9, 2, 4, 0, 1, checksum=77)))
    assert decode_header(encode(m)) == m
    entry = [0, 1, 2, 3]
    for bad, why in [
        (msgpack.packb([4, 9, [entry]]), "data-batch with 1 entries"),
        (msgpack.packb([4, 9, [entry] * (MAX_BATCH_ENTRIES + 1)]), f"with {MAX_BATCH_ENTRIES + 1} entries"),
        (msgpack.packb([4, 9, entry]), "data-batch entry must be"),
        (msgpack.packb([4, 9, [entry, [0, 1, 2]]]), "data-batch entry must be"),
        (msgpack.packb([4, 9, [entry, [0, 1, 2, True]]]), "data-batch entry must be"),
        (msgpack.packb([4, 9, [entry, [3, 1, 2, 3]]]), "data header fields out of range"),
        (msgpack.packb([4, 9, [entry, [0, 1, 2, 0]]]), "data header fields out of range"),
        (msgpack.packb([4, -1, [entry, entry]]), "data-batch token out of range"),
        (msgpack.packb([4, 9]), "data-batch header must be"),
    ]:
        with pytest.raises(DecodeError, match=why):
            decode_header(bad)


def test_data_done_round_trip_and_limits() -> None:
    from transferd.protocol.messages import DATA_DONE_TAG, MAX_BATCH_ENTRIES

    m = DataDone(9, (Data(9, 0, 1, 2, 3),), Done(9, 2, 5, 6, 7))
    assert msgpack.unpackb(encode(m)) == [DATA_DONE_TAG, 9, 2, [5, 6, 7], [[0, 1, 2, 3]]]
    back = decode_header(encode(m))
    assert back == m and back.done == Done(9, 2, 5, 6, 7)  # the done names the entries' room
    entry, nb = [0, 1, 2, 3], [1, 2, 3]
    for bad, why in [
        (msgpack.packb([5, 9, 2, nb, []]), "data-done with 0 entries"),
        (msgpack.packb([5, 9, 2, nb, [entry] * (MAX_BATCH_ENTRIES + 1)]), f"with {MAX_BATCH_ENTRIES + 1} entries"),
        (msgpack.packb([5, 9, 2, nb, entry]), "data-done entry must be"),
        (msgpack.packb([5, 9, 2, nb, [entry, [0, 1, 2]]]), "data-done entry must be"),
        (msgpack.packb([5, 9, 2, nb, [[0, 1, 2, True]]]), "data-done entry must be"),
        (msgpack.packb([5, 9, 2, nb, [[3, 1, 2, 3]]]), "data header fields out of range"),
        (msgpack.packb([5, 9, 2, nb, [[0, 1, 2, 0]]]), "data header fields out of range"),
        (msgpack.packb([5, -1, 2, nb, [entry]]), "data-done token out of range"),
        (msgpack.packb([5, 9, (1 << 16) + 1, nb, [entry]]), "data-done rank out of range"),
        (msgpack.packb([5, 9, -1, nb, [entry]]), "data-done rank out of range"),
        (msgpack.packb([5, 9, 2, [1, 2], [entry]]), "its bytes must be three non-negative ints"),
        (msgpack.packb([5, 9, 2, [1, 2, -3], [entry]]), "its bytes must be three non-negative ints"),
        (msgpack.packb([5, 9, 2, [1, 2, "3"], [entry]]), "its bytes must be three non-negative ints"),
        (msgpack.packb([5, 9, 2, nb]), "data-done header must be"),
        (msgpack.packb([5, 9, "2", nb, [entry]]), "data-done header must be"),
        (msgpack.packb([5, 9, 2, 6, [entry]]), "data-done header must be"),
    ]:
        with pytest.raises(DecodeError, match=why):
            decode_header(bad)


def test_data_header_limits_inclusive() -> None:
    assert decode_header(_data(1, U64_MAX, 1, (1 << 20) - 1, (1 << 40) - 1, (1 << 32) - 1)) == Data(
        U64_MAX, 1, (1 << 20) - 1, (1 << 40) - 1, (1 << 32) - 1
    )
    assert decode_header(_data(1, 0, 0, 0, 0, 1, U64_MAX)) == Data(0, 0, 0, 0, 1, checksum=U64_MAX)
    assert decode_header(_data(1, 0, 0, 0, 0, 1, 0)).checksum == 0


# -- bundles (PROTOCOL §3.1) --------------------------------------------------------------

def _bundle(entries: list[Any], **fields: Any) -> bytes:
    return msgpack.packb({"t": "bundle", "v": PROTOCOL_VERSION, "msgs": entries} | fields, use_bin_type=True)


def test_a_bundle_carries_its_entries_in_order_exactly_as_sent_alone() -> None:
    msgs = [Registered(True, "", "rx", 7), ASSIGN, Status(tok=1, room=2, state="failed", code="timeout"),
            Ping(seq=9), Pong(seq=1)]
    back = decode_header(encode(Bundle(tuple(msgs))))
    assert isinstance(back, Bundle) and list(back.msgs) == msgs
    assert back.frames == tuple(encode(m) for m in msgs)
    # the entries' bytes are sent as given (a receiver encodes each message once)
    frames = tuple(encode(m) for m in msgs)
    assert decode_header(encode(Bundle(tuple(msgs), frames))) == back


@pytest.mark.parametrize("entries,why", [
    ([], "bundle with 0 entries"),
    ([encode(Ping(1))] * (MAX_BUNDLE_MSGS + 1), f"bundle with {MAX_BUNDLE_MSGS + 1} entries"),
    (["ping"], "bundle entry 0: must be bin"),
    ([{"t": "ping", "v": PROTOCOL_VERSION, "seq": 1}], "bundle entry 0: must be bin"),
    ([encode(Ping(1)), b"\xc1"], "bundle entry 1: malformed msgpack"),
    ([encode(Done(tok=9, rank=0, kv_bytes=1, state_bytes=0, aux_bytes=0))], "bundle entry 0: Done cannot be bundled"),
    ([msgpack.packb([1, 7, 0, 0, 0, 1])], "bundle entry 0: Data cannot be bundled"),
    ([encode(Ping(1)), _bundle([encode(Ping(2))])], "bundle entry 1: Bundle cannot be bundled"),
])
def test_a_bad_bundle_is_refused_whole_naming_the_entry(entries: list[Any], why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        decode_header(_bundle(entries))


def test_a_bundle_entry_of_another_version_is_a_version_error() -> None:
    entry = msgpack.packb({"t": "ping", "v": PROTOCOL_VERSION + 1, "seq": 1})
    with pytest.raises(VersionMismatch, match="bundle entry 1: ping: protocol version"):
        decode_header(_bundle([encode(Ping(1)), entry]))


def test_bundles_nested_deeply_are_refused_at_the_first_level() -> None:
    frame = encode(Ping(1))
    for _ in range(2000):  # decoded level by level, it would overflow the stack
        frame = _bundle([frame])
    with pytest.raises(DecodeError, match="bundle entry 0: Bundle cannot be bundled"):
        decode_header(frame)

