"""Validation of engine requests arriving on the local API socket (pure)."""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest


def u64(v: Any, what: str) -> int:
    if type(v) is not int or not 0 <= v < 1 << 64:
        raise BadRequest(f"{what} must be an unsigned 64-bit integer, not {v!r}")
    return v


def nonempty_str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise BadRequest(f"{what} must be a non-empty string, not {v!r}")
    return v


ROW_LIMIT = 1 << 62


def ints(v: Any, what: str) -> tuple[int, ...]:
    """A list of row indices: non-negative ints small enough to index any pool."""
    if not isinstance(v, (list, tuple)) or not all(type(x) is int for x in v):
        raise BadRequest(f"{what} must be a list of integers")
    for x in v:
        if not 0 <= x < ROW_LIMIT:
            raise BadRequest(f"{what}: index {x} is negative or absurdly large")
    return tuple(v)


def slot_map(v: Any, what: str) -> dict[str, tuple[int, ...]]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequest(f"{what} must map state component names to slot lists")
    return {nonempty_str(k, f"{what} component"): ints(x, f"{what}[{k}]") for k, x in v.items()}
