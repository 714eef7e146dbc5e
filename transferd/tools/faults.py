"""``transferd demo --fault SPEC``: the one parser of fault specs and what each kind does."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["DATA_FAULTS", "FAULT_KINDS", "PROCESS_FAULTS", "Fault", "FaultKind", "parse_fault"]


@dataclass(frozen=True)
class FaultKind:
    """One kind of ``--fault``: what its argument is (None: it takes none), whether it acts on the
    daemons' processes (the demo injects it half-way) or inside them (configuration from the start),
    and for the latter the ``[faults]`` setting it turns on."""

    arg: str | None  # "rank", "fraction", "ms"
    process: bool
    setting: str = ""


FAULT_KINDS: dict[str, FaultKind] = {
    "kill-sender": FaultKind("rank", True),
    "restart-receiver": FaultKind(None, True),
    "pause-sender": FaultKind("rank", True),
    "drop-frames": FaultKind("fraction", False, "TRANSFERD_FAULTS_DROP_FRAMES"),
    "corrupt-frames": FaultKind("fraction", False, "TRANSFERD_FAULTS_CORRUPT_FRAMES"),
    "slow-receiver": FaultKind("ms", False, "TRANSFERD_FAULTS_SLOW_RECEIVER_MS"),
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
    ``pause-sender:R``, ``drop-frames:P``, ``corrupt-frames:P``, ``slow-receiver:MS``."""
    kind, _, arg = spec.partition(":")
    fk = FAULT_KINDS.get(kind)
    if fk is not None and fk.arg is None:
        if arg:
            raise ConfigError(f"fault {spec!r}: {kind} takes no argument")
        return Fault(kind, 0)
    if fk is None:
        raise ConfigError(f"unknown fault {spec!r}; known: kill-sender:R, restart-receiver, pause-sender:R, "
                          "drop-frames:P, corrupt-frames:P, slow-receiver:MS")
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
    return Fault(kind, value)
