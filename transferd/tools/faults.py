"""``transferd demo --fault SPEC`` and ``transferd soak``: the one parser of fault specs, what
each kind does, and the hostile peer's flood."""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgpack
import zmq

from ..errors import ConfigError
from ..protocol.messages import PROTOCOL_VERSION

__all__ = ["DATA_FAULTS", "FAULT_KINDS", "PAUSE_S", "PROCESS_FAULTS", "Fault", "FaultKind", "HostilePeer", "garbage",
           "parse_fault"]

PAUSE_S = 3.0
"""How long ``pause-sender`` keeps the sender stopped (SIGSTOP ... SIGCONT)."""


@dataclass(frozen=True)
class FaultKind:
    """One kind of ``--fault``: what its argument is (None: it takes none), whether it acts on the
    running daemons from outside (their processes or their port: the demo injects it half-way) or
    inside them (configuration from the start), and for the latter the ``[faults]`` setting it
    turns on."""

    arg: str | None  # "rank", "fraction", "ms", "count"
    process: bool
    setting: str = ""


FAULT_KINDS: dict[str, FaultKind] = {
    "kill-sender": FaultKind("rank", True),
    "restart-receiver": FaultKind(None, True),
    "pause-sender": FaultKind("rank", True),
    "drop-frames": FaultKind("fraction", False, "TRANSFERD_FAULTS_DROP_FRAMES"),
    "corrupt-frames": FaultKind("fraction", False, "TRANSFERD_FAULTS_CORRUPT_FRAMES"),
    "slow-receiver": FaultKind("ms", False, "TRANSFERD_FAULTS_SLOW_RECEIVER_MS"),
    "hostile-flood": FaultKind("count", True),
}
PROCESS_FAULTS = tuple(k for k, v in FAULT_KINDS.items() if v.process)
DATA_FAULTS = tuple(k for k, v in FAULT_KINDS.items() if not v.process)


@dataclass(frozen=True)
class Fault:
    kind: str
    arg: float

    @property
    def process(self) -> bool:
        return FAULT_KINDS[self.kind].process

    def __str__(self) -> str:
        if FAULT_KINDS[self.kind].arg is None:
            return self.kind
        return f"{self.kind}:{self.arg:g}"


def parse_fault(spec: str, cp_size: int) -> Fault:
    """The one parser of ``--fault`` specs: ``kill-sender:R``, ``restart-receiver``,
    ``pause-sender:R``, ``drop-frames:P``, ``corrupt-frames:P``, ``slow-receiver:MS``,
    ``hostile-flood:N``."""
    kind, _, arg = spec.partition(":")
    fk = FAULT_KINDS.get(kind)
    if fk is not None and fk.arg is None:
        if arg:
            raise ConfigError(f"fault {spec!r}: {kind} takes no argument")
        return Fault(kind, 0)
    if fk is None:
        raise ConfigError(f"unknown fault {spec!r}; known: kill-sender:R, restart-receiver, pause-sender:R, "
                          "drop-frames:P, corrupt-frames:P, slow-receiver:MS, hostile-flood:N")
    try:
        value = float(arg)
    except ValueError:
        raise ConfigError(f"fault {spec!r} needs a number after ':'") from None
    if fk.arg == "rank" and (not value.is_integer() or not 0 <= value < cp_size):
        raise ConfigError(f"fault {spec!r}: rank must be an integer in [0, {cp_size})")
    if fk.arg == "fraction" and not 0 < value <= 1:
        raise ConfigError(f"fault {spec!r}: the fraction must lie in (0, 1]")
    if fk.arg == "ms" and value <= 0:
        raise ConfigError(f"fault {spec!r}: milliseconds must be > 0")
    if fk.arg == "count" and (not value.is_integer() or not 1 <= value <= 10_000_000):
        raise ConfigError(f"fault {spec!r}: the count must be an integer in [1, 10000000]")
    return Fault(kind, value)


def garbage(rng: random.Random) -> list[bytes]:
    """One message a hostile or broken peer might send: not msgpack, random bytes, a header of the
    wrong shape, a message of unknown type or wrong version, or one with a stray frame."""
    kind = rng.randrange(6)
    if kind == 0:
        return [b"\xc1"]  # a byte msgpack never uses
    if kind == 1:
        return [rng.randbytes(rng.randrange(1, 64))]
    if kind == 2:
        return [msgpack.packb([1, "x", -1, None])]  # a data header array of the wrong shape
    if kind == 3:
        return [msgpack.packb({"t": "nonsense", "v": PROTOCOL_VERSION, "seq": rng.randrange(1 << 30)})]
    if kind == 4:
        return [msgpack.packb({"t": "register", "v": 99})]
    return [msgpack.packb({"t": "ping", "v": PROTOCOL_VERSION, "seq": 1}), rng.randbytes(1024), rng.randbytes(8)]


class HostilePeer:
    """``hostile-flood:N``: a peer that connects to a receiver's ZeroMQ port, never registers and
    sends it garbage (:func:`garbage`) as fast as it takes it. Every message must be refused and
    counted (``refused[...]``), none written anywhere. Keep it open until the receiver has counted
    them: ZeroMQ drops what a closed peer's connection still held; :meth:`drain` reads what the
    receiver answered (refused registrations), so its replies do not pile up."""

    def __init__(self, endpoint: str, *, seed: int = 0, timeout_s: float = 30.0) -> None:
        self.rng = random.Random(seed)
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"hostile-flood-{seed}-{self.rng.getrandbits(32):08x}".encode())
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock.connect(endpoint)
        self.sent = 0

    def send(self, n: int) -> int:
        """Send ``n`` garbage messages; returns how many went out (fewer only if the receiver
        stopped taking them for ``timeout_s``)."""
        for i in range(n):
            try:
                self.sock.send_multipart(garbage(self.rng))
            except zmq.Again:
                return i
            self.sent += 1
            if i % 1024 == 1023:
                self.drain()
        return n

    def drain(self) -> None:
        while True:
            try:
                self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        self.sock.close()
