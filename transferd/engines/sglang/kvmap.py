"""How SGLang's ``KVArgs`` lines up with a transferd pool: which engine buffer each pool buffer
mirrors, row for row, and the first difference in words when they do not line up.

Pure: plain integers in, a map or a :class:`~transferd.errors.LayoutError` out (no torch, no
SGLang import), so the checks are unit-tested without either.

The mirroring rules (docs/ENGINES.md):

* **KV.** SGLang gives one buffer per layer (MLA) or one per layer for K and then one per layer for
  V (MHA); a row is one page (``kv_item_lens``). transferd's ``kv.k.L<l>``/``kv.v.L<l>`` (MHA) or
  ``kv.kv.L<l>`` (MLA) mirror them; engine page ``p`` travels in pool row ``p``.
* **State.** Each SGLang state type becomes one transferd state component of the same name, its
  tensors the component's layers. A type whose tensors have rows of different sizes (a conv state
  beside a temporal state) becomes one component per size, ``<type>.0``, ``<type>.1``, … in order of
  first appearance. Engine slot ``s`` travels in pool slot ``s``.
* **Aux.** SGLang's metadata buffers (one per field) pack into transferd's single aux row: bytes
  0–7 are the room id guard, then each field's row in ``aux_data_ptrs`` order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import LayoutError
from ...layout import PoolLayout, dtype_size

AUX_GUARD_BYTES = 8

# SGLang's kv_cache_dtype_str -> transferd's dtype names (what the suggested [model] block says)
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
           "auto": "bf16"}


@dataclass(frozen=True, slots=True)
class EngineBuffer:
    """One of the engine's buffers, as ``KVArgs`` gives it: a base address, a size, a row size."""

    ptr: int
    nbytes: int
    item_bytes: int

    @property
    def rows(self) -> int:
        return self.nbytes // self.item_bytes if self.item_bytes else 0


@dataclass(frozen=True, slots=True)
class Pair:
    """An engine buffer and the pool buffer that mirrors it row for row."""

    engine: EngineBuffer
    pool_buffer: int


@dataclass(frozen=True, slots=True)
class StateGroup:
    """One SGLang state type: its components in the pool and the pairs that move its slots."""

    state_type: str
    components: tuple[str, ...]
    pairs: tuple[Pair, ...]


@dataclass(frozen=True, slots=True)
class AuxField:
    offset: int  # in the pool's aux row
    engine: EngineBuffer


@dataclass(frozen=True, slots=True)
class EngineMap:
    page_size: int
    kv: tuple[Pair, ...]
    state: tuple[StateGroup, ...]  # aligned with KVArgs.state_types
    aux: tuple[AuxField, ...]
    aux_buffer: int
    aux_row_bytes: int


def _value(t: Any) -> str:
    return str(getattr(t, "value", t))


def state_component_names(state_type: str, item_lens: Sequence[int]) -> list[str]:
    """The component each tensor of one state type goes to (see the module docstring)."""
    sizes: list[int] = []
    for n in item_lens:
        if n not in sizes:
            sizes.append(n)
    if len(sizes) <= 1:
        return [state_type] * len(item_lens)
    return [f"{state_type}.{sizes.index(n)}" for n in item_lens]


def suggest_model(kv_args: Any, is_mla: bool) -> dict[str, Any]:
    """The ``[model]`` table of a transferd configuration whose pools mirror this engine's buffers
    (what the daemons must be configured with; ``transferd config check`` validates it)."""
    ptrs = list(kv_args.kv_data_ptrs)
    item = list(kv_args.kv_item_lens)
    page = int(kv_args.page_size)
    dtype = _DTYPES.get(str(getattr(kv_args, "kv_cache_dtype_str", "auto")).lower(), "uint8")
    size = dtype_size(dtype)
    layers = len(ptrs) if is_mla else len(ptrs) // 2
    elems = item[0] // (page * size) if item else 0
    out: dict[str, Any] = {"dtype": dtype, "page_size": page, "kv_layers": layers,
                           "kv_format": "mla" if is_mla else "mha", "kv_token_elems": elems}
    states = []
    for t, lens in zip(kv_args.state_types, kv_args.state_item_lens):
        names = state_component_names(_value(t), list(lens))
        for name in dict.fromkeys(names):
            n = names.count(name)
            states.append({"name": name, "layers": n, "slot_shape": [lens[names.index(name)]], "dtype": "uint8"})
    if states:
        out["state"] = states
    aux = AUX_GUARD_BYTES + sum(int(x) for x in kv_args.aux_item_lens)
    out["aux_row_bytes"] = -(-aux // 64) * 64
    return out


def check_tp(is_mla: bool, own_tp: int, peer_tp: int, role: str) -> None:
    """Refuse prefill and decode attention-TP sizes that the backend cannot pair: on a non-MLA model
    each TP rank holds other heads, so a page of one side is not a page of the other."""
    if peer_tp and peer_tp != own_tp and not is_mla:
        other = "decode" if role == "prefill" else "prefill"
        raise LayoutError(f"{role} attention TP {own_tp} and {other} attention TP {peer_tp} differ on a non-MLA model: "
                          f"the transferd backend moves whole pages between equal TP ranks only (each rank holds "
                          f"other KV heads); run both sides with the same TP, or use the mooncake backend")
    if peer_tp and peer_tp != own_tp and max(own_tp, peer_tp) % min(own_tp, peer_tp):
        raise LayoutError(f"attention TP sizes {own_tp} and {peer_tp} must divide one another")


def map_kv_args(kv_args: Any, layout: PoolLayout, is_mla: bool, where: str = "pool") -> EngineMap:
    """Line ``kv_args`` up with ``layout``; raise :class:`LayoutError` naming the first mismatch."""
    def fail(what: str) -> LayoutError:
        return LayoutError(f"SGLang's KV buffers and transferd {where} differ: {what} "
                           f"(a [model] that mirrors this engine: {suggest_model(kv_args, is_mla)})")

    if int(getattr(kv_args, "num_draft_entries", 0) or 0):
        raise LayoutError("speculative decoding's draft KV (KVArgs.num_draft_entries > 0) is not supported "
                          "by the transferd backend yet")
    page = int(kv_args.page_size)
    if layout.page_size != page:
        raise fail(f"page_size: engine {page}, {where} {layout.page_size}")
    ptrs, lens, items = list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
    if not len(ptrs) == len(lens) == len(items):
        raise LayoutError(f"KVArgs is inconsistent: {len(ptrs)} kv_data_ptrs, {len(lens)} kv_data_lens, "
                          f"{len(items)} kv_item_lens")
    kv_idx = layout.indices("kv")
    if is_mla:
        names = [f"kv.kv.L{layer}" for layer in range(len(ptrs))]
    else:
        if len(ptrs) % 2:
            raise fail(f"an MHA engine has K and V buffers per layer, but KVArgs lists {len(ptrs)} buffers")
        layers = len(ptrs) // 2
        names = [f"kv.k.L{layer}" for layer in range(layers)] + [f"kv.v.L{layer}" for layer in range(layers)]
    if len(kv_idx) != len(names):
        fmt = "mla" if is_mla else "mha"
        raise fail(f"KV buffers: engine {len(names)} ({fmt}), {where} {len(kv_idx)}")
    by_name = {layout.buffers[i].name: i for i in range(len(layout.buffers))}
    kv: list[Pair] = []
    for j, name in enumerate(names):
        if name not in by_name:
            raise fail(f"{where} has no buffer {name!r} for engine KV buffer {j}")
        kv.append(_pair(layout, by_name[name], EngineBuffer(int(ptrs[j]), int(lens[j]), int(items[j])), fail, where))

    groups: list[StateGroup] = []
    seen: set[str] = set()
    types = list(getattr(kv_args, "state_types", None) or [])
    for k, t in enumerate(types):
        s_ptrs = list(kv_args.state_data_ptrs[k])
        s_lens = list(kv_args.state_data_lens[k])
        s_items = list(kv_args.state_item_lens[k])
        comps = state_component_names(_value(t), s_items)
        pairs = []
        layer_of: dict[str, int] = {}
        for j, comp in enumerate(comps):
            layer = layer_of.get(comp, 0)
            layer_of[comp] = layer + 1
            name = f"state.{comp}.L{layer}"
            if name not in by_name:
                raise fail(f"{where} has no buffer {name!r} for tensor {j} of state type {_value(t)!r}")
            pairs.append(_pair(layout, by_name[name], EngineBuffer(int(s_ptrs[j]), int(s_lens[j]), int(s_items[j])),
                               fail, where))
        for comp, n in layer_of.items():
            have = sum(1 for i in layout.indices("state") if layout.buffers[i].component == comp)
            if have != n:
                raise fail(f"state component {comp!r}: engine {n} tensors, {where} {have} layers")
        seen.update(layer_of)
        groups.append(StateGroup(_value(t), tuple(dict.fromkeys(comps)), tuple(pairs)))
    extra = [c for c in layout.state_components if c not in seen]
    if extra:
        raise fail(f"{where} has state component {extra[0]!r}, which the engine does not keep")

    aux_fields: list[AuxField] = []
    off = AUX_GUARD_BYTES
    aux_rows = layout.buffers[layout.aux_index].rows
    for j, (p, n, item) in enumerate(zip(kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens)):
        eb = EngineBuffer(int(p), int(n), int(item))
        if eb.rows > aux_rows:
            raise fail(f"aux rows: engine metadata buffer {j} has {eb.rows} rows, {where} {aux_rows}; "
                       f"raise aux_slots to at least {eb.rows}")
        aux_fields.append(AuxField(off, eb))
        off += eb.item_bytes
    if off > layout.aux_row_bytes:
        raise fail(f"aux row: the engine's {len(aux_fields)} metadata fields and the 8-byte room guard need "
                   f"{off} bytes, {where} rows hold {layout.aux_row_bytes}")
    return EngineMap(page, tuple(kv), tuple(groups), tuple(aux_fields), layout.aux_index, layout.aux_row_bytes)


def _pair(layout: PoolLayout, index: int, eb: EngineBuffer, fail: Any, where: str) -> Pair:
    b = layout.buffers[index]
    if b.row_bytes != eb.item_bytes:
        raise fail(f"{b.name} row bytes: engine {eb.item_bytes}, {where} {b.row_bytes}")
    if eb.rows > b.rows:
        raise fail(f"{b.name} rows: engine {eb.rows}, {where} {b.rows}; the pool mirrors the engine's rows one "
                   f"for one, so raise its {'kv_pages' if b.kind == 'kv' else 'state_slots'} to at least {eb.rows}")
    return Pair(eb, index)
