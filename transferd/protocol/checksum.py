"""Optional per-frame payload checksums (the integrity option)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import xxhash

from ..errors import ProtocolError, TransferdError
from ..types import CHECKSUMS


def checksum_function(name: str, error: type[TransferdError] = ProtocolError) -> Callable[[Any], int] | None:
    """The function for ``name`` (``None`` for ``"none"``); ``error`` names the valid ones for
    any other name (a protocol error: the name comes from a peer's ``register``)."""
    if name == "none":
        return None
    if name == "crc32":
        return zlib.crc32
    if name == "xxh3":
        return xxhash.xxh3_64_intdigest
    raise error(f"checksum must be one of {', '.join(CHECKSUMS)}, not {name!r}")
