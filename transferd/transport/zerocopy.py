"""Zero-copy sends out of the pool without pyzmq's garbage-collector thread.

pyzmq keeps a Python reference to every zero-copy frame until libzmq is done with it: a dict
entry, then a message to a helper thread when libzmq frees the frame, and that thread taking the
GIL to drop the reference — for every message, with a ``getpid()`` on the way. A sender agent's
payloads lie in its pool, a mapping that stays in place until the ZeroMQ context is gone (the
agent unmaps it only after ``ctx.term``), and the abort barrier already keeps the engine from
reusing rows while frames may read them. So libzmq may read the rows with no reference kept:
``zmq_msg_init_data`` with no free function, through ctypes on the libzmq that pyzmq loaded.
Where that library cannot be found, :func:`available` is False and the agent uses pyzmq's
zero-copy frames.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import zmq

from ..errors import TransferdError

log = logging.getLogger(__name__)

ZMQ_MSG_T_BYTES = 64  # sizeof(zmq_msg_t) in libzmq 4.x
_DONTWAIT = int(zmq.DONTWAIT)  # plain ints: an operation on pyzmq's enum members builds a new one
_MORE_DONTWAIT = int(zmq.SNDMORE) | _DONTWAIT
_lib: Any = None
_tried = False


def _load() -> Any:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    import zmq.backend  # noqa: F401  (loads libzmq into this process)

    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                name = line.rsplit(" ", 1)[-1].strip()
                if "libzmq" in name.rsplit("/", 1)[-1] and name.startswith("/"):
                    path = name
                    break
    except OSError:
        return None
    if path is None:
        log.debug("libzmq not found in this process's mappings: pyzmq's zero-copy frames are used")
        return None
    lib = ctypes.PyDLL(path)  # the GIL stays held: these calls never block (DONTWAIT)
    lib.zmq_msg_init_data.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                      ctypes.c_void_p]
    lib.zmq_msg_init_data.restype = ctypes.c_int
    lib.zmq_msg_send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.zmq_msg_send.restype = ctypes.c_int
    lib.zmq_msg_close.argtypes = [ctypes.c_void_p]
    lib.zmq_msg_close.restype = ctypes.c_int
    lib.zmq_errno.argtypes = []
    lib.zmq_errno.restype = ctypes.c_int
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


class PoolSender:
    """Two-frame messages (a header, then rows of a mapping that outlives the socket's context)
    on one plain ZeroMQ socket."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        lib = _load()
        if lib is None:
            raise TransferdError("libzmq is not reachable through ctypes here (use zero_copy = \"pyzmq\")")
        self.lib = lib
        self.sock = sock
        self.handle = ctypes.c_void_p(sock.underlying)
        self.msg = ctypes.create_string_buffer(ZMQ_MSG_T_BYTES)

    def try_send(self, header: bytes, parts: list[tuple[int, int]]) -> bool:
        """Send ``header`` then one frame per ``(address, nbytes)`` without waiting; False
        (nothing sent) when the high-water mark holds the message back."""
        try:
            self.sock.send(header, _MORE_DONTWAIT)
        except zmq.Again:
            return False
        lib, msg, last = self.lib, self.msg, len(parts) - 1
        for i, (addr, nbytes) in enumerate(parts):
            lib.zmq_msg_init_data(msg, addr, nbytes, None, None)
            # later parts of a message whose first part was taken are never refused for the
            # high-water mark (libzmq counts whole messages)
            if lib.zmq_msg_send(msg, self.handle, _MORE_DONTWAIT if i < last else _DONTWAIT) < 0:
                err = lib.zmq_errno()
                lib.zmq_msg_close(msg)
                raise zmq.ZMQError(err)
        return True
