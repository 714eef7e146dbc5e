"""Counters every daemon keeps: wire bytes by kind, de-dup savings, refusals by reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..layout import KINDS


@dataclass(slots=True)
class Accounting:
    bytes: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    frames: int = 0
    shm_bytes: int = 0  # the part of ``bytes`` moved by the same-host path (not on the wire)
    stream_bytes: int = 0  # the part of ``bytes`` moved on data streams (stream.py), not through ZeroMQ
    mooncake_bytes: int = 0  # the part of ``bytes`` moved by Mooncake Transfer Engine reads (mooncake.py)
    nixl_bytes: int = 0  # the part of ``bytes`` moved by NIXL reads (nixl.py)
    state_bytes_skipped: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    rooms: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    heartbeat_misses: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.frames += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "bytes": dict(self.bytes),
            "frames": self.frames,
            "shm_bytes": self.shm_bytes,
            "stream_bytes": self.stream_bytes,
            "mooncake_bytes": self.mooncake_bytes,
            "nixl_bytes": self.nixl_bytes,
            "state_bytes_skipped": self.state_bytes_skipped,
            "refused": dict(self.refused),
            "dropped": dict(self.dropped),
            "rooms": dict(self.rooms),
            "failures": dict(self.failures),
            "heartbeat_misses": dict(self.heartbeat_misses),
        }
