"""Optional per-frame payload checksums (the integrity option)."""

from __future__ import annotations

import zlib
from typing import Any, Callable

from ..errors import ConfigError

ALGORITHMS = ("none", "xxh3", "crc32")


def checksum_function(name: str) -> Callable[[Any], int] | None:
    """The function for ``name`` (``None`` for ``"none"``); xxh3 needs the xxhash package."""
    if name == "none":
        return None
    if name == "crc32":
        return zlib.crc32
    if name == "xxh3":
        try:
            import xxhash
        except ImportError:
            raise ConfigError("checksum 'xxh3' needs the xxhash package (pip install xxhash)") from None
        return xxhash.xxh3_64_intdigest
    raise ConfigError(f"checksum must be one of {', '.join(ALGORITHMS)}, not {name!r}")
