"""One error tree for transferd.

Every failure that crosses a module boundary is a ``TransferdError``; each has a short stable
``code`` that reaches engines (over the local socket) and metrics alongside the message text.
"""

from __future__ import annotations


class TransferdError(Exception):
    """Root of every error transferd raises on purpose."""

    code = "error"


class ConfigError(TransferdError):
    """A configuration file, environment variable or flag is invalid."""

    code = "config"


class LayoutError(TransferdError):
    """A pool layout is invalid, or two layouts are incompatible."""

    code = "layout"


class PoolError(TransferdError):
    """A shared-memory pool cannot be created, attached or indexed."""

    code = "pool"


class IndexOutOfRange(PoolError):
    """A page, slot or row index lies outside the pool. Nothing was written."""

    code = "index_out_of_range"


class ProtocolError(TransferdError):
    """A message could not be decoded or violates the protocol."""

    code = "protocol"


class VersionMismatch(ProtocolError):
    """The peer speaks another version of a wire (ZeroMQ messages, or the local engine API)."""

    code = "version"

    def __init__(self, message: str, msg_type: str = "") -> None:
        super().__init__(message)
        self.msg_type = msg_type  # the message type whose version did not match


class DecodeError(ProtocolError):
    code = "decode"


class PeerError(TransferdError):
    """Something about a peer (the other daemon) went wrong."""

    code = "peer"


class PeerRejected(PeerError):
    code = "rejected"


class PeerTimeout(PeerError):
    code = "peer_timeout"


class PeerGone(PeerError):
    code = "peer_lost"


class TransferError(TransferdError):
    """A room's transfer failed."""

    code = "transfer"


class RoomAborted(TransferError):
    code = "aborted"


class BadRequest(TransferError):
    """An engine request is malformed or inconsistent (wrong lengths, duplicates, unknown room)."""

    code = "bad_request"


class RoomExists(BadRequest):
    code = "room_exists"


class UnknownRoom(BadRequest):
    code = "unknown_room"


class ClientTimeout(TransferdError):
    """The local daemon did not answer an engine request in time."""

    code = "client_timeout"


_BY_CODE: dict[str, type[TransferdError]] = {}


def _index(cls: type[TransferdError]) -> None:
    _BY_CODE.setdefault(cls.code, cls)
    for sub in cls.__subclasses__():
        _index(sub)


_index(TransferdError)


def error_from_code(code: str, message: str) -> TransferdError:
    """Rebuild an error raised in the daemon from its wire ``code`` (used by the client)."""
    return _BY_CODE.get(code, TransferdError)(message)
