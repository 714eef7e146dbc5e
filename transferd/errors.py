"""One error tree for transferd, and the failure codes of rooms.

Every failure that crosses a module boundary is a ``TransferdError``; each has a short stable
``code`` that reaches engines (over the local socket) and metrics alongside the message text.
A room that fails carries a :class:`FailureCode` (on the wire, in the engine API, in metrics).
"""

from __future__ import annotations

from enum import Enum


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


class PoolMismatch(PoolError):
    """The pool found under a name is not the one expected (its layout or its id differs)."""

    code = "pool_mismatch"


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


class StreamError(PeerError):
    """A data stream could not be listened on or connected, or it was lost."""

    code = "stream"


class TransferError(TransferdError):
    """A room's transfer cannot go on."""

    code = "transfer"


class Refused(TransferError):
    """A data message that must not be written (raised and caught inside the receiver's core;
    ``code`` is the counted reason, which becomes the room's failure code)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class BadRequest(TransferError):
    """An engine request is malformed or inconsistent (wrong lengths, duplicates, unknown room)."""

    code = "bad_request"


class RoomExists(BadRequest):
    code = "room_exists"


class UnknownRoom(BadRequest):
    code = "unknown_room"


class Draining(TransferError):
    """The daemon is shutting down and takes no new rooms."""

    code = "draining"


class ClientTimeout(TransferdError):
    """The local daemon did not answer an engine request in time."""

    code = "client_timeout"


class DaemonError(TransferdError):
    """A daemon (or a tool's child process) did not start or stop as it should."""

    code = "daemon"


class FailureCode(str, Enum):
    """Why a room failed: the ``code`` of a failed status, on the wire and in the engine API,
    and the ``reason`` label of ``transferd_rooms{outcome="failed"}``. docs/PROTOCOL.md §11
    describes each (a test holds the two together). A ``fail`` from a sender may carry a code
    of its own: that code is kept as it came."""

    # the decode side
    ABORTED = "aborted"
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    WAITING_TIMEOUT = "waiting_timeout"
    STALLED = "stalled"
    PEER_LOST = "peer_lost"
    PEER_RESTARTED = "peer_restarted"
    INCOMPLETE = "incomplete"
    UNEXPECTED = "unexpected"
    NO_SHM = "no_shm"
    INDEX_OUT_OF_RANGE = "index_out_of_range"
    LENGTH_MISMATCH = "length_mismatch"
    CHECKSUM = "checksum"
    AUX_GUARD = "aux_guard"
    AFTER_DONE = "after_done"
    DUPLICATE = "duplicate"
    PREFILL_FAILED = "prefill_failed"
    SHUTDOWN = "shutdown"
    TRANSPORT_ERROR = "transport_error"
    # the prefill side
    ASSIGN_TIMEOUT = "assign_timeout"
    BAD_ASSIGN = "bad_assign"
    BAD_CHUNK = "bad_chunk"
    SEND_ERROR = "send_error"
    ROOM_EXISTS = "room_exists"

    __hash__ = str.__hash__  # equal to its string as a key too (Enum hashes by name)

    def __str__(self) -> str:
        return self.value


_BY_CODE: dict[str, type[TransferdError]] = {}


def _index(cls: type[TransferdError]) -> None:
    _BY_CODE.setdefault(cls.code, cls)
    for sub in cls.__subclasses__():
        _index(sub)


_index(TransferdError)


def error_from_code(code: str, message: str) -> TransferdError:
    """Rebuild an error raised in the daemon from its wire ``code`` (used by the client)."""
    return _BY_CODE.get(code, TransferdError)(message)
