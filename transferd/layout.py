"""Pool layouts: what buffers a pool holds, how big a row is, and whether two sides agree.

A *model spec* says what a model's caches look like (KV format, layers, page size, state
components, aux row size). A *layout* is a model spec made concrete for one pool: every buffer
with its row count. Two layouts are *compatible* when everything but the row counts agrees; the
*fingerprint* is a hash of exactly that part, and :func:`layout_difference` names the first
difference in words.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from .errors import LayoutError

LAYOUT_VERSION = 1
MAX_LAYOUT_BUFFERS = 4096  # a model with 1,000 layers of K, V and two state buffers fits; more is hostile
MAX_LAYOUT_NAME = 256  # characters of a name, kind, component, dtype or model
MAX_SHAPE_DIMS = 8

BufferKind = Literal["kv", "state", "aux"]
KINDS: tuple[str, ...] = ("kv", "state", "aux")

# name -> (itemsize, numpy dtype string for the always-available view, torch dtype attribute)
# numpy has no bf16 or fp8: those views are raw unsigned integers of the same width.
DTYPES: dict[str, tuple[int, str, str]] = {
    "fp32": (4, "float32", "float32"),
    "fp16": (2, "float16", "float16"),
    "bf16": (2, "uint16", "bfloat16"),
    "fp8_e4m3": (1, "uint8", "float8_e4m3fn"),
    "fp8_e5m2": (1, "uint8", "float8_e5m2"),
    "int32": (4, "int32", "int32"),
    "uint8": (1, "uint8", "uint8"),
}


def dtype_size(dtype: str) -> int:
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise LayoutError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One buffer of a pool: ``rows`` rows of ``shape`` elements of ``dtype``."""

    name: str
    kind: BufferKind
    layer: int
    component: str
    dtype: str
    shape: tuple[int, ...]
    rows: int

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def signature(self) -> tuple[Any, ...]:
        """Everything that must match across sides (row count excluded)."""
        return (self.name, self.kind, self.layer, self.component, self.dtype, list(self.shape))


@dataclass(frozen=True, slots=True)
class StateComponent:
    """A component of the state pool: ``layers`` per-layer buffers whose rows are slots."""

    name: str
    layers: int
    slot_shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a model's transferable caches, independent of pool sizes."""

    name: str = "model"
    dtype: str = "bf16"
    page_size: int = 16
    kv_layers: int = 4
    kv_format: Literal["mha", "mla"] = "mha"
    kv_token_elems: int = 128
    state: tuple[StateComponent, ...] = ()
    aux_row_bytes: int = 64

    def __post_init__(self) -> None:
        dtype_size(self.dtype)
        if self.kv_format not in ("mha", "mla"):
            raise LayoutError(f"kv_format must be 'mha' or 'mla', not {self.kv_format!r}")
        for what, value in (
            ("page_size", self.page_size),
            ("kv_layers", self.kv_layers),
            ("kv_token_elems", self.kv_token_elems),
        ):
            if value < 1:
                raise LayoutError(f"{what} must be >= 1, not {value}")
        if self.aux_row_bytes < 8:
            raise LayoutError(
                f"aux_row_bytes must be >= 8 (the first 8 bytes hold the room id guard), "
                f"not {self.aux_row_bytes}"
            )
        seen: set[str] = set()
        for comp in self.state:
            dtype_size(comp.dtype)
            if comp.name in seen:
                raise LayoutError(f"state component {comp.name!r} is defined twice")
            seen.add(comp.name)
            if comp.layers < 1 or not comp.slot_shape or min(comp.slot_shape) < 1:
                raise LayoutError(f"state component {comp.name!r} needs layers >= 1 and a slot shape")

    def layout(self, kv_pages: int, state_slots: int, aux_slots: int) -> PoolLayout:
        """Make this spec concrete for a pool with the given row counts."""
        for what, value in (("kv_pages", kv_pages), ("state_slots", state_slots), ("aux_slots", aux_slots)):
            if value < 0:
                raise LayoutError(f"{what} must be >= 0, not {value}")
        bufs: list[BufferSpec] = []
        row_shape = (self.page_size, self.kv_token_elems)
        for layer in range(self.kv_layers):
            parts = ("kv",) if self.kv_format == "mla" else ("k", "v")
            for part in parts:
                bufs.append(BufferSpec(f"kv.{part}.L{layer}", "kv", layer, part, self.dtype, row_shape, kv_pages))
        for comp in self.state:
            for layer in range(comp.layers):
                bufs.append(
                    BufferSpec(f"state.{comp.name}.L{layer}", "state", layer, comp.name, comp.dtype,
                               comp.slot_shape, state_slots)
                )
        bufs.append(BufferSpec("aux", "aux", 0, "aux", "uint8", (self.aux_row_bytes,), aux_slots))
        return PoolLayout(model=self.name, page_size=self.page_size, buffers=tuple(bufs))


@dataclass(frozen=True, slots=True)
class PoolLayout:
    model: str
    page_size: int
    buffers: tuple[BufferSpec, ...]
    _by_kind: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)
    # what the per-room paths ask for again and again, worked out once (the layout never changes)
    _state_components: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)
    _row_bytes: tuple[int, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        by_kind: dict[str, list[int]] = {k: [] for k in KINDS}
        for i, b in enumerate(self.buffers):
            if b.kind not in by_kind:
                raise LayoutError(f"buffer {b.name!r} has unknown kind {b.kind!r}")
            by_kind[b.kind].append(i)
        if len(by_kind["aux"]) != 1:
            raise LayoutError(f"a layout needs exactly one aux buffer, found {len(by_kind['aux'])}")
        aux = self.buffers[by_kind["aux"][0]]
        if aux.row_bytes < 8:
            raise LayoutError(f"the aux row must hold at least the 8-byte room id guard, not {aux.row_bytes} bytes")
        rows: dict[tuple[str, str], int] = {}
        for b in self.buffers:
            key = (b.kind, "" if b.kind == "kv" else b.component)
            if rows.setdefault(key, b.rows) != b.rows:
                raise LayoutError(f"buffer {b.name!r} has {b.rows} rows, other {key[0]} buffers of "
                                  f"{key[1] or 'the pool'} have {rows[key]}")
        self._by_kind.update({k: tuple(v) for k, v in by_kind.items()})
        object.__setattr__(self, "_state_components",
                           tuple(dict.fromkeys(self.buffers[i].component for i in by_kind["state"])))
        object.__setattr__(self, "_row_bytes", tuple(b.row_bytes for b in self.buffers))

    # -- derived views -------------------------------------------------------------------
    def indices(self, kind: str) -> tuple[int, ...]:
        """Global buffer indices of one kind, in layout order."""
        return self._by_kind[kind]

    @property
    def kv_rows(self) -> int:
        kv = self.indices("kv")
        return self.buffers[kv[0]].rows if kv else 0

    @property
    def state_components(self) -> tuple[str, ...]:
        """The state components, in layout order."""
        return self._state_components

    @property
    def buffer_row_bytes(self) -> tuple[int, ...]:
        """Each buffer's row size in bytes, by global buffer index."""
        return self._row_bytes

    def rows_of(self, kind: str, component: str | None = None) -> int:
        for i in self.indices(kind):
            b = self.buffers[i]
            if component is None or b.component == component:
                return b.rows
        return 0

    @property
    def aux_index(self) -> int:
        return self.indices("aux")[0]

    @property
    def aux_row_bytes(self) -> int:
        return self.buffer_row_bytes[self.aux_index]

    def kv_page_bytes(self) -> int:
        """Bytes of one page position across every KV buffer."""
        return sum(self.buffers[i].row_bytes for i in self.indices("kv"))

    # -- identity ------------------------------------------------------------------------
    def signature(self) -> dict[str, Any]:
        return {
            "v": LAYOUT_VERSION,
            "page_size": self.page_size,
            "buffers": [list(b.signature()) for b in self.buffers],
        }

    def fingerprint(self) -> str:
        blob = msgpack.packb(self.signature(), use_bin_type=True)
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": LAYOUT_VERSION,
            "model": self.model,
            "page_size": self.page_size,
            "buffers": [[*b.signature(), b.rows] for b in self.buffers],
        }

    @classmethod
    def from_wire(cls, data: Any) -> PoolLayout:
        try:
            if data["v"] != LAYOUT_VERSION:
                raise LayoutError(f"layout version {data['v']} is not {LAYOUT_VERSION}")
            raw = data["buffers"]
            if not isinstance(raw, list):
                raise TypeError("buffers must be a list")
            if len(raw) > MAX_LAYOUT_BUFFERS:  # before any per-buffer work: a hostile size costs nothing
                raise LayoutError(f"a layout of {len(raw)} buffers exceeds the limit of {MAX_LAYOUT_BUFFERS}")
            bufs = tuple(
                BufferSpec(_s(n), _s(k), _i(layer), _s(c), _s(dt), _shape(shape), _i(rows))  # type: ignore[arg-type]
                for n, k, layer, c, dt, shape, rows in raw
            )
            out = cls(model=_s(data["model"]), page_size=_i(data["page_size"]), buffers=bufs)
        except LayoutError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise LayoutError(f"malformed layout description: {exc!r}") from None
        for b in out.buffers:
            dtype_size(b.dtype)
            if b.rows < 0 or not b.shape or min(b.shape) < 1:
                raise LayoutError(f"buffer {b.name!r} has a bad shape {b.shape} or rows {b.rows}")
        return out


def _i(x: Any) -> int:
    if type(x) is not int:
        raise TypeError(f"expected an integer, got {x!r}")
    return x


def _s(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {x!r}")
    if len(x) > MAX_LAYOUT_NAME:
        raise ValueError(f"a string of {len(x)} characters (at most {MAX_LAYOUT_NAME})")
    return x


def _shape(x: Any) -> tuple[int, ...]:
    if not isinstance(x, list) or len(x) > MAX_SHAPE_DIMS:
        raise ValueError(f"a shape must be a list of at most {MAX_SHAPE_DIMS} integers, not {x!r:.80}")
    return tuple(_i(d) for d in x)


def layout_difference(a: PoolLayout, b: PoolLayout, a_name: str = "sender", b_name: str = "receiver") -> str | None:
    """Name the first difference that makes two layouts incompatible, or None if they agree.

    Row counts (how many pages/slots each side has) may differ; nothing else may.
    """
    if a.page_size != b.page_size:
        return f"page_size differs: {a_name} {a.page_size}, {b_name} {b.page_size}"
    if len(a.buffers) != len(b.buffers):
        return (
            f"buffer count differs: {a_name} {len(a.buffers)} "
            f"({_kind_counts(a)}), {b_name} {len(b.buffers)} ({_kind_counts(b)})"
        )
    for i, (x, y) in enumerate(zip(a.buffers, b.buffers)):
        for attr in ("name", "kind", "layer", "component", "dtype", "shape"):
            vx, vy = getattr(x, attr), getattr(y, attr)
            if vx != vy:
                what = "row_bytes" if attr == "shape" and x.row_bytes != y.row_bytes else attr
                if what == "row_bytes":
                    return (
                        f"buffer {i} ({x.name}) row_bytes differs: {a_name} {x.row_bytes} "
                        f"(shape {x.shape}), {b_name} {y.row_bytes} (shape {y.shape})"
                    )
                return f"buffer {i} ({x.name}) {attr} differs: {a_name} {vx!r}, {b_name} {vy!r}"
    return None


def _kind_counts(layout: PoolLayout) -> str:
    return ", ".join(f"{k} {len(layout.indices(k))}" for k in KINDS)
