"""The small vocabulary every layer shares: buffer kinds, split modes, connection states, data
planes and names. Nothing here imports anything of transferd but the error tree."""

from __future__ import annotations

import re
from enum import Enum, IntEnum

from .errors import ConfigError, TransferdError


class Kind(IntEnum):
    """What a pool buffer holds; the integer is the ``kind`` field of data messages."""

    KV = 0
    STATE = 1
    AUX = 2

    @property
    def label(self) -> str:
        """The name used in layouts, counters and metrics: ``kv``, ``state``, ``aux``."""
        return self.name.lower()


KIND_LABELS: tuple[str, ...] = tuple(k.label for k in Kind)  # index by the wire's kind integer


class SplitMode(str, Enum):
    """How a CP group divides a room (docs/DESIGN.md, ``protocol/policy.py``)."""

    PAGES = "pages"
    LAYERS = "layers"
    RANK0 = "rank0"

    @classmethod
    def parse(cls, value: str | SplitMode, error: type[TransferdError] = ConfigError) -> SplitMode:
        """The mode named ``value``; ``error`` (a configuration error by default; the wire
        passes its own) names the valid ones otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise error(f"split mode must be one of {', '.join(m.value for m in cls)}, not {value!r}") from None


class ConnState(str, Enum):
    """A sender's connection to one receiver."""

    REGISTERING = "registering"
    REGISTERED = "registered"
    REFUSED = "refused"


class PlaneName(str, Enum):
    """The data planes: how a connection's rows move (``transport/planes``)."""

    ZMQ = "zmq"  # payload frames on the ZeroMQ socket
    STREAM = "stream"  # records on a plain TCP data stream
    SAME_HOST = "same_host"  # the receiver copies the rows out of the sender's pool
    MOONCAKE = "mooncake"  # the receiver reads the rows out of the sender's pool with Mooncake Transfer Engine
    NIXL = "nixl"  # the receiver reads the rows out of the sender's pool with a NIXL agent (UCX)


class DataPlane(str, Enum):
    """The value of the ``data_plane`` setting: today's choice (same-host, stream, ZeroMQ), or
    Mooncake Transfer Engine or NIXL when both sides set it (``transport/planes/mooncake.py``,
    ``transport/planes/nixl.py``)."""

    AUTO = "auto"
    MOONCAKE = "mooncake"
    NIXL = "nixl"


class AutoOff(str, Enum):
    """The value of the ``same_host`` and ``data_stream`` settings."""

    AUTO = "auto"
    OFF = "off"


class ZeroCopy(str, Enum):
    """How a sender hands pool rows to ZeroMQ (``sender.zero_copy``)."""

    DIRECT = "direct"  # to libzmq, with no reference kept (transport/zerocopy.py)
    PYZMQ = "pyzmq"  # as pyzmq frames


CHECKSUMS: tuple[str, ...] = ("none", "xxh3", "crc32")
"""Payload checksum algorithms (``protocol/checksum.py`` has the functions)."""

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""Group and receiver names: they travel in ZeroMQ identities and log lines."""
