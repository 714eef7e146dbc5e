"""transferd.layout: model specs, pool layouts, fingerprints and compatibility."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transferd.errors import LayoutError
from transferd.layout import (
    DTYPES,
    LAYOUT_VERSION,
    BufferSpec,
    ModelSpec,
    PoolLayout,
    StateComponent,
    dtype_size,
    layout_difference,
)


def test_mha_layout_buffers() -> None:
    spec = ModelSpec(name="m", dtype="bf16", page_size=16, kv_layers=3, kv_format="mha", kv_token_elems=128,
                     state=(StateComponent("ssm", 2, (4, 8), "fp32"),), aux_row_bytes=64)
    lay = spec.layout(kv_pages=100, state_slots=7, aux_slots=5)
    assert [b.name for b in lay.buffers] == [
        "kv.k.L0", "kv.v.L0", "kv.k.L1", "kv.v.L1", "kv.k.L2", "kv.v.L2",
        "state.ssm.L0", "state.ssm.L1", "aux",
    ]
    assert lay.indices("kv") == (0, 1, 2, 3, 4, 5)
    assert lay.indices("state") == (6, 7)
    assert lay.indices("aux") == (8,)
    assert lay.aux_index == 8
    k0 = lay.buffers[0]
    assert (k0.kind, k0.layer, k0.component, k0.dtype, k0.shape, k0.rows) == ("kv", 0, "k", "bf16", (16, 128), 100)
    assert k0.row_bytes == 16 * 128 * 2
    assert k0.nbytes == 100 * 16 * 128 * 2
    s1 = lay.buffers[7]
    assert (s1.kind, s1.layer, s1.component, s1.dtype, s1.shape, s1.rows) == ("state", 1, "ssm", "fp32", (4, 8), 7)
    assert s1.row_bytes == 4 * 8 * 4
    aux = lay.buffers[8]
    assert (aux.kind, aux.dtype, aux.shape, aux.rows, aux.row_bytes) == ("aux", "uint8", (64,), 5, 64)
    assert lay.kv_rows == 100
    assert lay.rows_of("state", "ssm") == 7
    assert lay.rows_of("state", "nope") == 0
    assert lay.state_components == ("ssm",)
    assert lay.buffer_row_bytes == tuple(b.row_bytes for b in lay.buffers)  # worked out once, the same
    assert lay.aux_row_bytes == 64
    assert lay.kv_page_bytes() == 6 * 16 * 128 * 2
    assert lay.page_size == 16 and lay.model == "m"


def test_mla_layout_has_one_kv_buffer_per_layer() -> None:
    spec = ModelSpec(dtype="fp8_e4m3", page_size=64, kv_layers=4, kv_format="mla", kv_token_elems=656)
    lay = spec.layout(10, 0, 2)
    kv = [lay.buffers[i] for i in lay.indices("kv")]
    assert [b.name for b in kv] == ["kv.kv.L0", "kv.kv.L1", "kv.kv.L2", "kv.kv.L3"]
    assert [b.layer for b in kv] == [0, 1, 2, 3]
    assert all(b.component == "kv" and b.row_bytes == 64 * 656 * 1 for b in kv)
    assert lay.indices("state") == ()
    assert lay.state_components == ()
    assert lay.kv_page_bytes() == 4 * 64 * 656


@pytest.mark.parametrize(("dtype", "size"), [("fp32", 4), ("fp16", 2), ("bf16", 2), ("fp8_e4m3", 1),
                                              ("fp8_e5m2", 1), ("int32", 4), ("uint8", 1)])
def test_row_bytes_per_dtype(dtype: str, size: int) -> None:
    assert dtype_size(dtype) == size
    lay = ModelSpec(dtype=dtype, page_size=3, kv_token_elems=5).layout(1, 0, 1)
    assert lay.buffers[0].row_bytes == 3 * 5 * size


def test_unknown_dtype() -> None:
    with pytest.raises(LayoutError, match="'fp4'"):
        dtype_size("fp4")


# -- fingerprint -------------------------------------------------------------------------

SPEC = ModelSpec(state=(StateComponent("conv", 2, (3, 4), "bf16"),))


def test_fingerprint_ignores_row_counts_and_model_name() -> None:
    a = SPEC.layout(10, 2, 3)
    b = SPEC.layout(999, 77, 1)
    assert a != b
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16
    int(a.fingerprint(), 16)
    c = ModelSpec(name="other", state=SPEC.state).layout(10, 2, 3)
    assert c.fingerprint() == a.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "fp16"},          # same itemsize, different dtype
        {"dtype": "fp32"},
        {"page_size": 32},
        {"kv_token_elems": 64},
        {"kv_layers": 5},
        {"kv_format": "mla"},
        {"aux_row_bytes": 128},
        {"state": (StateComponent("conv", 2, (4, 3), "bf16"),)},   # same row_bytes, other shape
        {"state": (StateComponent("conv", 2, (3, 4), "fp16"),)},
        {"state": (StateComponent("conv", 3, (3, 4), "bf16"),)},
        {"state": (StateComponent("conv2", 2, (3, 4), "bf16"),)},
        {"state": ()},
    ],
)
def test_fingerprint_changes_with_anything_but_rows(change: dict[str, Any]) -> None:
    base = SPEC.layout(10, 2, 3)
    other = ModelSpec(**{**_spec_fields(SPEC), **change}).layout(10, 2, 3)
    assert other.fingerprint() != base.fingerprint()
    assert layout_difference(base, other) is not None


def _spec_fields(spec: ModelSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in ModelSpec.__dataclass_fields__}


# -- layout_difference -------------------------------------------------------------------

def test_difference_none_for_different_row_counts() -> None:
    assert layout_difference(SPEC.layout(10, 2, 3), SPEC.layout(4096, 64, 256)) is None


def test_difference_page_size() -> None:
    a = ModelSpec(page_size=16).layout(8, 0, 1)
    b = ModelSpec(page_size=32).layout(8, 0, 1)
    msg = layout_difference(a, b, "prefill", "decode")
    assert msg is not None
    assert "page_size" in msg and "prefill 16" in msg and "decode 32" in msg


def test_difference_buffer_count() -> None:
    a = ModelSpec(kv_layers=4).layout(8, 0, 1)
    b = ModelSpec(kv_layers=2).layout(8, 0, 1)
    msg = layout_difference(a, b)
    assert msg is not None
    assert "buffer count" in msg and "sender 9" in msg and "receiver 5" in msg
    assert "kv 8" in msg and "kv 4" in msg


def test_difference_row_bytes() -> None:
    a = ModelSpec(kv_token_elems=128).layout(8, 0, 1)
    b = ModelSpec(kv_token_elems=64).layout(8, 0, 1)
    msg = layout_difference(a, b)
    assert msg is not None
    assert "row_bytes" in msg and "kv.k.L0" in msg
    assert str(16 * 128 * 2) in msg and str(16 * 64 * 2) in msg


def test_difference_dtype() -> None:
    a = ModelSpec(dtype="bf16").layout(8, 0, 1)
    b = ModelSpec(dtype="fp16").layout(8, 0, 1)
    msg = layout_difference(a, b)
    assert msg is not None
    assert "dtype" in msg and "'bf16'" in msg and "'fp16'" in msg and "buffer 0" in msg


def test_difference_shape_with_same_row_bytes() -> None:
    a = ModelSpec(state=(StateComponent("s", 1, (2, 8), "fp32"),)).layout(8, 1, 1)
    b = ModelSpec(state=(StateComponent("s", 1, (8, 2), "fp32"),)).layout(8, 1, 1)
    msg = layout_difference(a, b)
    assert msg is not None
    assert "shape" in msg and "state.s.L0" in msg


def test_difference_kv_format() -> None:
    # MHA with 2 layers and MLA with 4 layers have the same buffer count: the name differs.
    a = ModelSpec(kv_layers=2, kv_format="mha").layout(8, 0, 1)
    b = ModelSpec(kv_layers=4, kv_format="mla").layout(8, 0, 1)
    msg = layout_difference(a, b)
    assert msg is not None and "name" in msg


# -- wire form ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_wire_round_trip(fmt: str) -> None:
    lay = ModelSpec(name="x", kv_format=fmt, state=(StateComponent("conv", 2, (3, 4), "fp8_e5m2"),)).layout(17, 5, 3)
    wire = lay.to_wire()
    assert wire["v"] == LAYOUT_VERSION
    # through msgpack, as it travels in a register message
    back = PoolLayout.from_wire(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False))
    assert back == lay
    assert back.buffers == lay.buffers
    assert back.fingerprint() == lay.fingerprint()
    assert back.indices("state") == lay.indices("state")
    assert layout_difference(lay, back) is None


def _wire() -> dict[str, Any]:
    return SPEC.layout(10, 2, 3).to_wire()


def _mut(f: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    w = copy.deepcopy(_wire())
    f(w)
    return w


MALFORMED = {
    "not a map": [1, 2, 3],
    "none": None,
    "missing v": _mut(lambda w: w.pop("v")),
    "wrong version": _mut(lambda w: w.update(v=LAYOUT_VERSION + 1)),
    "missing buffers": _mut(lambda w: w.pop("buffers")),
    "missing model": _mut(lambda w: w.pop("model")),
    "page_size not int": _mut(lambda w: w.update(page_size="big")),
    "short buffer entry": _mut(lambda w: w["buffers"][0].pop()),
    "long buffer entry": _mut(lambda w: w["buffers"][0].append(1)),
    "buffer not a list": _mut(lambda w: w["buffers"].__setitem__(0, 5)),
    "unknown kind": _mut(lambda w: w["buffers"][0].__setitem__(1, "weights")),
    "unhashable kind": _mut(lambda w: w["buffers"][0].__setitem__(1, ["kv"])),
    "unknown dtype": _mut(lambda w: w["buffers"][0].__setitem__(4, "fp4")),
    "shape not a list": _mut(lambda w: w["buffers"][0].__setitem__(5, 7)),
    "empty shape": _mut(lambda w: w["buffers"][0].__setitem__(5, [])),
    "zero dim": _mut(lambda w: w["buffers"][0].__setitem__(5, [16, 0])),
    "negative rows": _mut(lambda w: w["buffers"][0].__setitem__(6, -1)),
    "rows not int": _mut(lambda w: w["buffers"][0].__setitem__(6, "many")),
    "no aux": _mut(lambda w: w["buffers"].pop()),
    "two aux": _mut(lambda w: w["buffers"].append(list(w["buffers"][-1]))),
    "buffers not a list": _mut(lambda w: w.__setitem__("buffers", {"0": w["buffers"][0]})),
    "a name of 257 chars": _mut(lambda w: w["buffers"][0].__setitem__(0, "n" * 257)),
    "a model name of 257 chars": _mut(lambda w: w.__setitem__("model", "m" * 257)),
    "shape of 9 dims": _mut(lambda w: w["buffers"][0].__setitem__(5, [1] * 9)),
}


def test_a_layout_over_the_buffer_limit_is_refused_before_any_per_buffer_work() -> None:
    from transferd.layout import MAX_LAYOUT_BUFFERS

    w = _wire()
    w["buffers"] = [object()] * (MAX_LAYOUT_BUFFERS + 1)  # not even a valid buffer: never looked at
    with pytest.raises(LayoutError, match=f"a layout of {MAX_LAYOUT_BUFFERS + 1} buffers exceeds the limit of "
                                          f"{MAX_LAYOUT_BUFFERS}"):
        PoolLayout.from_wire(w)


@pytest.mark.parametrize("wire", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_wire_is_layout_error(wire: Any) -> None:
    with pytest.raises(LayoutError):
        PoolLayout.from_wire(wire)


@pytest.mark.parametrize("slot", [2, 6])  # layer, rows
def test_malformed_wire_infinite_number_is_layout_error(slot: int) -> None:
    w = _wire()
    w["buffers"][0][slot] = float("inf")
    with pytest.raises(LayoutError):
        PoolLayout.from_wire(w)


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                  st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8))
_json = st.recursive(_leaf, lambda kids: st.one_of(st.lists(kids, max_size=8),
                                                   st.dictionaries(st.text(max_size=8), kids, max_size=6)),
                     max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(
    slot=st.integers(0, 6),
    value=_json.filter(lambda v: not (isinstance(v, float) and v in (float("inf"), float("-inf")))),
)
def test_from_wire_refuses_garbage_only_with_layout_error(slot: int, value: Any) -> None:
    w = _wire()
    w["buffers"][1][slot] = value
    try:
        PoolLayout.from_wire(w)
    except LayoutError:
        pass


# -- ModelSpec / PoolLayout validation ---------------------------------------------------

@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"dtype": "fp4"}, "fp4"),
        ({"kv_format": "gqa"}, "kv_format"),
        ({"page_size": 0}, "page_size"),
        ({"kv_layers": 0}, "kv_layers"),
        ({"kv_token_elems": -1}, "kv_token_elems"),
        ({"aux_row_bytes": 7}, "aux_row_bytes"),
        ({"state": (StateComponent("a", 1, (4,), "bf16"), StateComponent("a", 2, (4,), "bf16"))}, "twice"),
        ({"state": (StateComponent("a", 0, (4,), "bf16"),)}, "'a'"),
        ({"state": (StateComponent("a", 1, (), "bf16"),)}, "'a'"),
        ({"state": (StateComponent("a", 1, (4, 0), "bf16"),)}, "'a'"),
        ({"state": (StateComponent("a", 1, (4,), "int4"),)}, "int4"),
    ],
)
def test_model_spec_validation(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        ModelSpec(**kwargs)


@pytest.mark.parametrize("what", ["kv_pages", "state_slots", "aux_slots"])
def test_negative_row_counts(what: str) -> None:
    counts = {"kv_pages": 1, "state_slots": 1, "aux_slots": 1, what: -1}
    with pytest.raises(LayoutError, match=what):
        SPEC.layout(**counts)


def test_zero_rows_allowed() -> None:
    lay = SPEC.layout(0, 0, 0)
    assert all(b.rows == 0 and b.nbytes == 0 for b in lay.buffers)
    assert lay.kv_rows == 0


def test_pool_layout_needs_exactly_one_aux() -> None:
    kv = BufferSpec("kv.k.L0", "kv", 0, "k", "bf16", (4,), 1)
    with pytest.raises(LayoutError, match="aux"):
        PoolLayout("m", 4, (kv,))
    aux = BufferSpec("aux", "aux", 0, "aux", "uint8", (8,), 1)
    with pytest.raises(LayoutError, match="aux"):
        PoolLayout("m", 4, (kv, aux, aux))
    bad = BufferSpec("w", "weights", 0, "w", "bf16", (4,), 1)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="'weights'"):
        PoolLayout("m", 4, (bad, aux))


def test_dtype_table_is_consistent() -> None:
    import numpy as np

    for name, (size, np_name, _torch_name) in DTYPES.items():
        assert np.dtype(np_name).itemsize == size, name


def test_pool_layout_rows_consistent_per_kind_and_component() -> None:
    aux = BufferSpec("aux", "aux", 0, "aux", "uint8", (8,), 1)
    k0 = BufferSpec("kv.k.L0", "kv", 0, "k", "bf16", (4,), 5)
    v0 = BufferSpec("kv.v.L0", "kv", 0, "v", "bf16", (4,), 6)   # KV buffers share the page count
    with pytest.raises(LayoutError, match="'kv.v.L0' has 6 rows"):
        PoolLayout("m", 4, (k0, v0, aux))
    a0 = BufferSpec("state.a.L0", "state", 0, "a", "fp32", (2,), 3)
    a1 = BufferSpec("state.a.L1", "state", 1, "a", "fp32", (2,), 4)
    with pytest.raises(LayoutError, match="'state.a.L1' has 4 rows"):
        PoolLayout("m", 4, (a0, a1, aux))
    # different components may have different slot counts
    b0 = BufferSpec("state.b.L0", "state", 0, "b", "fp32", (2,), 9)
    lay = PoolLayout("m", 4, (k0, a0, b0, aux))
    assert (lay.rows_of("state", "a"), lay.rows_of("state", "b")) == (3, 9)


def test_pool_layout_aux_row_holds_the_room_guard() -> None:
    with pytest.raises(LayoutError, match="8-byte room id guard"):
        PoolLayout("m", 4, (BufferSpec("aux", "aux", 0, "aux", "uint8", (7,), 1),))


def test_wire_with_inconsistent_rows_refused() -> None:
    w = _wire()
    w["buffers"][1][6] += 1  # kv.v.L0 gets one page more than kv.k.L0
    with pytest.raises(LayoutError, match="rows"):
        PoolLayout.from_wire(w)
