"""kvmap: SGLang's KVArgs lined up with a transferd pool (pure: no SGLang, no torch)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from transferd.config import _model
from transferd.engines.sglang.kvmap import check_tp, map_kv_args, state_component_names, suggest_model
from transferd.errors import LayoutError
from transferd.layout import PoolLayout


def kv_args(*, mla: bool = False, layers: int = 3, item: int = 512, pages: int = 32, page: int = 16,
            state: list[tuple[str, list[int]]] | None = None, aux: tuple[int, ...] = (64, 8), **extra: Any) -> Any:
    n = layers if mla else 2 * layers
    state = [("mamba", [96, 160, 96, 160]), ("swa", [128])] if state is None else state
    a = SimpleNamespace(
        kv_data_ptrs=[0x1000 * (i + 1) for i in range(n)], kv_data_lens=[pages * item] * n, kv_item_lens=[item] * n,
        kv_cache_dtype_str="bfloat16", page_size=page, num_draft_entries=0,
        state_types=[SimpleNamespace(value=t) for t, _ in state],
        state_data_ptrs=[[0x90000 + 64 * j for j in range(len(s))] for _, s in state],
        state_data_lens=[[8 * x for x in s] for _, s in state], state_item_lens=[list(s) for _, s in state],
        aux_data_ptrs=[0x70000 + j for j in range(len(aux))], aux_data_lens=[16 * x for x in aux],
        aux_item_lens=list(aux))
    for k, v in extra.items():
        setattr(a, k, v)
    return a


def layout_for(a: Any, mla: bool = False, kv_pages: int = 32, state_slots: int = 8, aux_slots: int = 16,
               **model: Any) -> PoolLayout:
    m = {**suggest_model(a, mla), **model}
    return _model(m, "test").layout(kv_pages, state_slots, aux_slots)


def test_state_components_split_by_row_size() -> None:
    assert state_component_names("swa", [128, 128]) == ["swa", "swa"]
    assert state_component_names("mamba", [96, 160, 96, 160]) == ["mamba.0", "mamba.1", "mamba.0", "mamba.1"]


@pytest.mark.parametrize("mla", [False, True])
def test_suggested_model_maps_back_buffer_for_buffer(mla: bool) -> None:
    a = kv_args(mla=mla)
    layout = layout_for(a, mla)
    m = map_kv_args(a, layout, mla)
    names = [layout.buffers[p.pool_buffer].name for p in m.kv]
    if mla:
        assert names == ["kv.kv.L0", "kv.kv.L1", "kv.kv.L2"]
    else:  # SGLang: K of every layer, then V of every layer
        assert names == ["kv.k.L0", "kv.k.L1", "kv.k.L2", "kv.v.L0", "kv.v.L1", "kv.v.L2"]
    assert [p.engine.ptr for p in m.kv] == a.kv_data_ptrs
    assert [g.components for g in m.state] == [("mamba.0", "mamba.1"), ("swa",)]
    assert [layout.buffers[p.pool_buffer].name for p in m.state[0].pairs] == \
        ["state.mamba.0.L0", "state.mamba.1.L0", "state.mamba.0.L1", "state.mamba.1.L1"]
    assert [f.offset for f in m.aux] == [8, 72]  # behind the 8-byte room guard


@pytest.mark.parametrize(("change", "message"), [
    (dict(page_size=8), r"page_size: engine 16, pool 8"),
    (dict(kv_token_elems=128), r"kv\.k\.L0 row bytes: engine 512, pool 4096"),
    (dict(kv_layers=2), r"KV buffers: engine 6 \(mha\), pool 4"),
    (dict(kv_format="mla"), r"KV buffers: engine 6 \(mha\), pool 3"),
    (dict(aux_row_bytes=64), r"aux row: the engine's 2 metadata fields and the 8-byte room guard need 80 bytes"),
    (dict(state=[{"name": "swa", "layers": 1, "slot_shape": [128], "dtype": "uint8"}]),
     r"no buffer 'state\.mamba\.0\.L0' for tensor 0 of state type 'mamba'"),
])
def test_a_mismatch_is_named(change: dict[str, Any], message: str) -> None:
    a = kv_args()
    with pytest.raises(LayoutError, match=message) as ei:
        map_kv_args(a, layout_for(a, **change), False)
    assert "a [model] that mirrors this engine" in str(ei.value)


def test_too_few_pool_rows_says_how_many() -> None:
    a = kv_args(pages=64)
    with pytest.raises(LayoutError, match=r"kv\.k\.L0 rows: engine 64, pool 32; .* raise its kv_pages to at least 64"):
        map_kv_args(a, layout_for(a, kv_pages=32), False)
    with pytest.raises(LayoutError, match=r"aux rows: engine metadata buffer 0 has 16 rows, pool 4"):
        map_kv_args(a, layout_for(a, kv_pages=64, aux_slots=4), False)


def test_a_pool_component_the_engine_lacks_is_refused() -> None:
    a = kv_args(state=[("swa", [128])])
    extra = [{"name": "swa", "layers": 1, "slot_shape": [128], "dtype": "uint8"},
             {"name": "indexer", "layers": 1, "slot_shape": [64], "dtype": "uint8"}]
    with pytest.raises(LayoutError, match=r"pool has state component 'indexer', which the engine does not keep"):
        map_kv_args(a, layout_for(a, state=extra), False)


def test_unsupported_engine_features_are_refused_by_name() -> None:
    a = kv_args(num_draft_entries=2)
    with pytest.raises(LayoutError, match=r"draft KV .* not supported"):
        map_kv_args(a, layout_for(kv_args()), False)
    odd = kv_args()
    odd.kv_data_ptrs, odd.kv_data_lens, odd.kv_item_lens = odd.kv_data_ptrs[:5], odd.kv_data_lens[:5], odd.kv_item_lens[:5]
    with pytest.raises(LayoutError, match=r"K and V buffers per layer, but KVArgs lists 5"):
        map_kv_args(odd, layout_for(kv_args()), False)


def test_tp_sizes_that_cannot_pair_are_refused_at_construction() -> None:
    check_tp(False, 4, 0, "decode")  # 0: the same TP on both sides
    check_tp(False, 4, 4, "decode")
    check_tp(True, 8, 2, "decode")  # MLA: every prefill TP rank holds the whole latent
    with pytest.raises(LayoutError, match=r"decode attention TP 8 and prefill attention TP 4 differ on a non-MLA model"):
        check_tp(False, 8, 4, "decode")
    with pytest.raises(LayoutError, match=r"prefill attention TP 2 and decode attention TP 4 differ"):
        check_tp(False, 2, 4, "prefill")
    with pytest.raises(LayoutError, match=r"must divide one another"):
        check_tp(True, 4, 3, "decode")
