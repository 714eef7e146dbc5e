"""The data-stream wire (docs/PROTOCOL.md §2.1): a plain TCP connection per sender and
receiver that carries data, data-batch, data-done and done messages past ZeroMQ.

The sender opens it with the hello (``b"TDSTREAM"`` and the 16-byte key the receiver offered
in ``registered``), then writes records::

    u32 header length | u64 payload length | msgpack header | payload bytes

The header is exactly the message's ZeroMQ header (:mod:`.messages`); the payload is its
payload frames back to back. This module is the wire only; the sockets are in
``transport/data_stream.py``.
"""

from __future__ import annotations

import struct

HELLO_MAGIC = b"TDSTREAM"
KEY_BYTES = 16
HELLO_BYTES = len(HELLO_MAGIC) + KEY_BYTES
PREFIX = struct.Struct("<IQ")
"""A record's prefix: header length (u32), payload length (u64), little-endian."""
MAX_STREAM_HEADER = 1 << 20  # a data-batch of 1024 entries with checksums is ~30 KiB
HELLO_TIMEOUT_S = 5.0  # a sender writes its hello right after connecting


def hello(key: bytes) -> bytes:
    """The first bytes a sender writes on a stream."""
    return HELLO_MAGIC + key


def hello_key(data: bytes) -> bytes | None:
    """The key of a hello, or None when ``data`` does not start with the magic."""
    return data[len(HELLO_MAGIC):] if data.startswith(HELLO_MAGIC) else None


def prefix(header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(header_len, payload_len)


def prefix_problem(header_len: int, payload_len: int, max_payload: int) -> str | None:
    """Why a record prefix ends the stream (None: it is within the limits)."""
    if not 1 <= header_len <= MAX_STREAM_HEADER or payload_len > max_payload:
        return (f"record with a {header_len}-byte header and a {payload_len}-byte payload (limits "
                f"{MAX_STREAM_HEADER} and {max_payload})")
    return None
