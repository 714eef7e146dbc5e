"""Configuration: TOML files, ``TRANSFERD_*`` environment variables and CLI flags.

Precedence: built-in defaults < file < environment < explicit flags. Unknown keys are errors that
name the key and the file. Sizes accept ``"64MiB"``; durations carry their unit in the key name.
Strings may use ``{name}``, ``{group}``, ``{rank}`` and ``{run_dir}`` placeholders.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from .errors import ConfigError, LayoutError
from .layout import ModelSpec, PoolLayout, StateComponent
from .types import CHECKSUMS, NAME_RE, AutoOff, DataPlane, SplitMode, ZeroCopy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any, what: str = "size") -> int:
    """``4096``, ``"64KiB"``, ``"1MiB"``, ``"2GB"`` → bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"{what} must be >= 0, not {value}")
        return value
    m = _SIZE_RE.match(str(value)) if isinstance(value, (str, float)) else None
    if not m:
        raise ConfigError(f"{what}: cannot read {value!r} as a size (examples: 4096, \"64KiB\", \"1MiB\")")
    nbytes = float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()]
    if not nbytes.is_integer():
        raise ConfigError(f"{what}: {value!r} is not a whole number of bytes")
    return int(nbytes)


def default_run_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return str(Path(base) / "transferd") if base else f"/tmp/transferd-{os.getuid()}"


@dataclass(frozen=True, slots=True)
class ReceiverConfig:
    name: str = "decode0"
    bind: str = "tcp://127.0.0.1:57500"
    engine_socket: str = "unix://{run_dir}/{name}.sock"
    pool: str = "{name}"
    create_pool: bool = True
    kv_pages: int = 4096
    state_slots: int = 64
    aux_slots: int = 256
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 5
    bootstrap_timeout_s: float = 120.0
    stall_timeout_s: float = 60.0
    waiting_timeout_s: float = 600.0  # assigned, but the prefill side never started sending
    same_host: AutoOff = AutoOff.AUTO  # read same-host senders' pools directly ("auto") or never ("off")
    same_host_read_threads: int = 2  # threads that read same-host messages of >= 256 KiB (1-64)
    data_stream: AutoOff = AutoOff.AUTO  # offer senders a plain TCP data stream ("auto": tcp:// bind, no CURVE) or not ("off")
    stream_port: int = 0  # the data stream's TCP port on the bind address (0 = any free port)
    stream_receive_buffer_bytes: int = 4 << 20  # SO_RCVBUF of each data stream (0 = the kernel's autotuning)
    data_plane: DataPlane = DataPlane.AUTO  # "mooncake"/"nixl": read the rows of senders that offer it with that engine
    mooncake_protocol: str = "tcp"  # Mooncake TE transport: "tcp" (tested here) or "rdma" (RDMA NICs)
    mooncake_device: str = ""  # RDMA device names, comma-separated ("" = Mooncake picks every device)
    mooncake_hostname: str = ""  # the address peers reach this engine at ("" = the bind address's host)
    mooncake_batch_entries: int = 512  # reads per engine batch (Mooncake's TCP queue rejects ~4096 at once)
    mooncake_reads_in_flight: int = 2  # engine batches running at once (entries × batches stays <= 2048)
    nixl_ucx_devices: str = ""  # NIXL's UCX backend: devices it may use, e.g. "mlx5_0:1" ("" = UCX picks)
    nixl_ucx_modules: str = "^efa"  # UCX_MODULES when the environment does not set it (docs/DATA-PLANES.md)
    nixl_batch_entries: int = 1024  # reads per NIXL transfer request (runs consecutive on both sides are one)
    nixl_reads_in_flight: int = 4  # NIXL transfer requests running at once
    nixl_read_timeout_s: float = 30.0  # a NIXL read not done by then fails its room (transport_error)
    max_frame_bytes: int = 64 << 20
    send_hwm: int = 100_000
    recv_hwm: int = 32
    drain_timeout_s: float = 30.0
    metrics_bind: str = "127.0.0.1:9464"  # Prometheus endpoint ("" = off; port 0 = any free port)
    curve_secret_key: str = ""  # this receiver's CURVE key pair (transferd keygen); "" = no encryption
    curve_allow_dir: str = ""  # public keys of the senders allowed in (required with curve_secret_key)
    # the prefill groups this receiver admits, "NAME:CP_SIZE[:SPLIT[:dedup|nodedup]]" (split
    # default "pages", dedup on); () = any group, the first rank to register fixes its settings
    groups: tuple[str, ...] = ()

    def expand(self, s: str, run_dir: str) -> str:
        return s.format(name=self.name, run_dir=run_dir)

    def admitted(self) -> dict[str, tuple[int, SplitMode, bool]] | None:
        """``groups`` parsed: name -> (cp_size, split, dedup); None for an open receiver."""
        if not self.groups:
            return None
        out: dict[str, tuple[int, SplitMode, bool]] = {}
        for entry in self.groups:
            parts = entry.split(":")
            where = f"receiver.groups entry {entry!r}"
            if not 2 <= len(parts) <= 4:
                raise ConfigError(f"{where} must read NAME:CP_SIZE[:SPLIT[:dedup|nodedup]]")
            name = parts[0]
            if not NAME_RE.match(name):
                raise ConfigError(f"{where}: group name {name!r} must be 1-64 letters, digits, '_', '.', '-'")
            if name in out:
                raise ConfigError(f"{where}: group {name} is listed twice")
            try:
                cp = int(parts[1])
            except ValueError:
                raise ConfigError(f"{where}: cp_size {parts[1]!r} is not an integer") from None
            if not 1 <= cp <= 1024:
                raise ConfigError(f"{where}: cp_size must lie in [1, 1024], not {cp}")
            split = SplitMode.parse(parts[2], ConfigError) if len(parts) > 2 else SplitMode.PAGES
            if len(parts) > 3 and parts[3] not in ("dedup", "nodedup"):
                raise ConfigError(f"{where}: the fourth field must be dedup or nodedup, not {parts[3]!r}")
            out[name] = (cp, split, len(parts) < 4 or parts[3] == "dedup")
        return out


@dataclass(frozen=True, slots=True)
class SenderConfig:
    group: str = "prefill0"
    cp_size: int = 1
    cp_rank: int = 0
    split: SplitMode = SplitMode.PAGES
    receivers: tuple[str, ...] = ("tcp://127.0.0.1:57500",)
    engine_socket: str = "unix://{run_dir}/{group}-r{rank}.sock"
    pool: str = "{group}-r{rank}"
    create_pool: bool = True
    kv_pages: int = 4096
    state_slots: int = 64
    aux_slots: int = 256
    max_message_bytes: int = 1 << 20
    # rows per record on the data stream (several messages' worth: its cost is per record, not per byte)
    stream_record_bytes: int = 8 << 20
    # SO_SNDBUF of the data stream (0 = the kernel's autotuning); raise it where the link's
    # bandwidth x round trip exceeds it (docs/CONFIG.md)
    stream_send_buffer_bytes: int = 512 << 10
    send_hwm: int = 32
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 5
    assign_timeout_s: float = 300.0
    checksum: str = "none"
    same_host: AutoOff = AutoOff.AUTO  # offer this pool to a receiver on the same host ("auto") or never ("off")
    # create the pool as a memfd sealed against shrinking: a same-host receiver may then copy out of a
    # mapping of it (attachers must share this pid namespace; not re-attached after a restart)
    sealed_pool: bool = False
    shm_message_bytes: int = 16 << 20  # rows per data-refs message on the same-host path
    zero_copy: ZeroCopy = ZeroCopy.DIRECT  # "direct": rows handed to libzmq with no reference kept; "pyzmq": pyzmq frames
    data_stream: AutoOff = AutoOff.AUTO  # send data on the receiver's data stream when it offers one ("auto") or never ("off")
    data_plane: DataPlane = DataPlane.AUTO  # "mooncake"/"nixl": offer the pool to receivers' reads with that engine
    mooncake_protocol: str = "tcp"  # Mooncake TE transport: "tcp" (tested here) or "rdma" (RDMA NICs)
    mooncake_device: str = ""  # RDMA device names, comma-separated ("" = Mooncake picks every device)
    mooncake_hostname: str = ""  # the address receivers reach this engine at ("" = the route to the first receiver)
    nixl_ucx_devices: str = ""  # NIXL's UCX backend: devices it may use, e.g. "mlx5_0:1" ("" = UCX picks)
    nixl_ucx_modules: str = "^efa"  # UCX_MODULES when the environment does not set it (docs/DATA-PLANES.md)
    dedup: bool = True  # pages split: only rank 0 sends the replicated state; false: every rank does (the group agrees)
    drain_timeout_s: float = 30.0
    metrics_bind: str = "127.0.0.1:9470"  # Prometheus endpoint; the CP rank is added to the port
    curve_secret_key: str = ""  # this sender's CURVE key pair; "" = no encryption
    curve_server_key: str = ""  # the receivers' public key (required with curve_secret_key)

    def expand(self, s: str, run_dir: str) -> str:
        return s.format(group=self.group, rank=self.cp_rank, run_dir=run_dir)


@dataclass(frozen=True, slots=True)
class SglangConfig:
    """The SGLang backend (transferd.engines.sglang), read by the engine's processes, not the daemons."""

    # "HOST:PORT=GROUP" entries: the transferd group that serves the prefill instance whose
    # bootstrap server is HOST:PORT. GROUP may hold {dp} (the request's prefill DP rank) and {tp}
    # (this decode rank's attention-TP rank).
    groups: tuple[str, ...] = ()
    default_group: str = ""  # the group for a bootstrap address not in `groups` ("" = such a room fails)
    peer_tp_size: int = 0  # the other side's attention-TP size (0 = the same as this side's)
    device: str = "auto"  # where the engine's KV lives: "auto" (cuda if torch sees a GPU), "cpu", "cuda"
    poll_interval_s: float = 0.001  # one batched status call per interval serves every room's poll()
    client_timeout_s: float = 10.0  # a daemon that does not answer within this fails the call


@dataclass(frozen=True, slots=True)
class DemoConfig:
    rooms: int = 24
    chunks: int = 3
    pages_per_room: int = 24
    prefix_every: int = 3
    empty_last_every: int = 4
    in_flight: int = 8
    seed: int = 1
    timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class FaultsConfig:
    """Fault injection, for tests and ``transferd demo --fault`` only. Off by default."""

    drop_frames: float = 0.0       # sender: fraction of data messages silently not sent
    corrupt_frames: float = 0.0    # sender: fraction of data messages with one byte flipped after checksumming
    slow_receiver_ms: float = 0.0  # receiver: pause after every data message
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(self.drop_frames or self.corrupt_frames or self.slow_receiver_ms)


@dataclass(frozen=True, slots=True)
class Config:
    model: ModelSpec = field(default_factory=ModelSpec)
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig)
    sender: SenderConfig = field(default_factory=SenderConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    sglang: SglangConfig = field(default_factory=SglangConfig)
    run_dir: str = field(default_factory=default_run_dir)
    log_level: str = "info"
    log_format: str = "text"
    source: str = "<defaults>"

    # -- derived -------------------------------------------------------------------------
    def receiver_layout(self) -> PoolLayout:
        r = self.receiver
        return self.model.layout(r.kv_pages, r.state_slots, r.aux_slots)

    def sender_layout(self) -> PoolLayout:
        s = self.sender
        return self.model.layout(s.kv_pages, s.state_slots, s.aux_slots)

    def receiver_pool_name(self) -> str:
        return self.receiver.expand(self.receiver.pool, self.run_dir)

    def receiver_engine_socket(self) -> str:
        return self.receiver.expand(self.receiver.engine_socket, self.run_dir)

    def sender_pool_name(self, rank: int | None = None) -> str:
        s = self.sender if rank is None else replace(self.sender, cp_rank=rank)
        return s.expand(s.pool, self.run_dir)

    def sender_engine_socket(self, rank: int | None = None) -> str:
        s = self.sender if rank is None else replace(self.sender, cp_rank=rank)
        return s.expand(s.engine_socket, self.run_dir)

    @property
    def split(self) -> SplitMode:
        return self.sender.split

    def with_overrides(self, section: str, **values: Any) -> Config:
        """Apply explicit (CLI) values to one section, validated like file values."""
        cur = getattr(self, section)
        merged = _section(type(cur), {k: v for k, v in values.items() if v is not None}, section, "command-line flags", cur)
        out = replace(self, **{section: merged})
        out.validate()
        return out

    def validate(self) -> None:
        s = self.sender
        if s.cp_size < 1:
            raise ConfigError(f"sender.cp_size must be >= 1, not {s.cp_size}")
        if not 0 <= s.cp_rank < s.cp_size:
            raise ConfigError(f"sender.cp_rank {s.cp_rank} is outside cp_size {s.cp_size}")
        for key in ("max_message_bytes", "stream_record_bytes"):
            if getattr(s, key) < 4096:
                raise ConfigError(f"sender.{key} must be >= 4096, not {getattr(s, key)}")
        for where, value in (("sender.stream_send_buffer_bytes", s.stream_send_buffer_bytes),
                             ("receiver.stream_receive_buffer_bytes", self.receiver.stream_receive_buffer_bytes)):
            if value != 0 and not 4096 <= value <= 1 << 30:
                raise ConfigError(f"{where} must be 0 (the kernel's autotuning) or 4KiB-1GiB, not {value}")
        if s.sealed_pool and not s.create_pool:
            raise ConfigError("sender.sealed_pool = true needs sender.create_pool = true: only the pool's creator "
                              "can seal it (an engine that creates the pool passes sealed=True itself)")
        if not s.receivers:
            raise ConfigError("sender.receivers is empty: name at least one receiver endpoint")
        for what, name in (("sender.group", s.group), ("receiver.name", self.receiver.name)):
            if not NAME_RE.match(name):
                raise ConfigError(f"{what} {name!r} must be 1-64 characters of letters, digits, '_', '.', '-'")
        if s.checksum not in CHECKSUMS:
            raise ConfigError(f"sender.checksum must be one of {', '.join(CHECKSUMS)}, not {s.checksum!r}")
        r, f = self.receiver, self.faults
        r.admitted()  # raises on a bad receiver.groups entry
        if not 0 <= r.stream_port <= 65535:
            raise ConfigError(f"receiver.stream_port must lie in [0, 65535], not {r.stream_port}")
        if not 1 <= r.same_host_read_threads <= 64:
            raise ConfigError(f"receiver.same_host_read_threads must lie in [1, 64], not {r.same_host_read_threads}")
        _at_least(0, True, r.stall_timeout_s, "receiver.stall_timeout_s", r.bootstrap_timeout_s,
                  "receiver.bootstrap_timeout_s", r.waiting_timeout_s, "receiver.waiting_timeout_s",
                  s.assign_timeout_s, "sender.assign_timeout_s", r.heartbeat_interval_s,
                  "receiver.heartbeat_interval_s", s.heartbeat_interval_s, "sender.heartbeat_interval_s")
        _at_least(0, False, r.drain_timeout_s, "receiver.drain_timeout_s", s.drain_timeout_s,
                  "sender.drain_timeout_s", f.slow_receiver_ms, "faults.slow_receiver_ms")
        check_endpoint(r.bind, "receiver.bind", bind=True)
        for i, ep in enumerate(s.receivers):
            check_endpoint(ep, f"sender.receivers[{i}]", bind=False)
        for what, hostport in (("receiver.metrics_bind", r.metrics_bind), ("sender.metrics_bind", s.metrics_bind)):
            if hostport:
                parse_hostport(hostport, what)
        if bool(r.curve_secret_key) != bool(r.curve_allow_dir):
            raise ConfigError("receiver.curve_secret_key and receiver.curve_allow_dir go together "
                              "(the key pair encrypts, the directory lists the senders allowed in)")
        if bool(s.curve_secret_key) != bool(s.curve_server_key):
            raise ConfigError("sender.curve_secret_key and sender.curve_server_key go together")
        if not (0 <= f.drop_frames <= 1 and 0 <= f.corrupt_frames <= 1):
            raise ConfigError(f"faults: drop_frames and corrupt_frames must lie in [0, 1] "
                              f"(got {f.drop_frames}, {f.corrupt_frames})")
        for key in ("max_message_bytes", "stream_record_bytes"):
            if r.max_frame_bytes < getattr(s, key):
                raise ConfigError(f"receiver.max_frame_bytes ({r.max_frame_bytes}) is below "
                                  f"sender.{key} ({getattr(s, key)})")
        _check_mooncake(self)
        _check_nixl(self)
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be 'text' or 'json', not {self.log_format!r}")
        g = self.sglang
        for i, entry in enumerate(g.groups):
            addr, sep, group = entry.partition("=")
            if not sep or not group.strip():
                raise ConfigError(f"sglang.groups[{i}] {entry!r} must read HOST:PORT=GROUP")
            parse_hostport(addr.strip(), f"sglang.groups[{i}]")
        if g.peer_tp_size < 0:
            raise ConfigError(f"sglang.peer_tp_size must be >= 0 (0: the same as this side's), not {g.peer_tp_size}")
        if g.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"sglang.device must be 'auto', 'cpu' or 'cuda', not {g.device!r}")
        _at_least(0, True, g.poll_interval_s, "sglang.poll_interval_s", g.client_timeout_s, "sglang.client_timeout_s")
        self.receiver_layout()
        self.sender_layout()


MOONCAKE_PROTOCOLS = ("tcp", "rdma")
MOONCAKE_MAX_ENTRIES = 2048  # entries in flight at once that Mooncake's TCP transport takes without rejecting
_DEVICES_RE = re.compile(r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")
_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)$")


def _check_engine_plane(side: str, c: ReceiverConfig | SenderConfig, plane: DataPlane, engine: str,
                        installed: Callable[[], bool], install: str) -> None:
    """A side that sets ``data_plane`` to a transfer engine: not with CURVE (the engine moves the
    rows unencrypted), and only with the engine's wheel importable."""
    if c.data_plane is not plane:
        return
    if c.curve_secret_key:
        raise ConfigError(f"{side}.data_plane = \"{plane.value}\" with {side}.curve_secret_key: {engine} moves "
                          "the rows unencrypted; use one or the other")
    if not installed():
        raise ConfigError(f"{side}.data_plane = \"{plane.value}\" needs {install}")


def _check_mooncake(cfg: Config) -> None:
    """The Mooncake Transfer Engine settings of both sections (docs/CONFIG.md)."""
    import importlib.util

    r, s = cfg.receiver, cfg.sender
    for side, c in (("receiver", r), ("sender", s)):
        if c.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ConfigError(f"{side}.mooncake_protocol must be one of {', '.join(MOONCAKE_PROTOCOLS)}, "
                              f"not {c.mooncake_protocol!r}")
        if c.mooncake_device and not _DEVICES_RE.match(c.mooncake_device):
            raise ConfigError(f"{side}.mooncake_device {c.mooncake_device!r} must be device names separated by "
                              "commas (e.g. \"mlx5_0,mlx5_1\"), or empty for every device")
        if c.mooncake_hostname and not _HOST_RE.match(c.mooncake_hostname):
            raise ConfigError(f"{side}.mooncake_hostname {c.mooncake_hostname!r} must be a host name or address "
                              "(no port: the engine picks its own)")
        _check_engine_plane(side, c, DataPlane.MOONCAKE, "Mooncake TE", lambda: importlib.util.find_spec("mooncake") is not None,
                            "Mooncake Transfer Engine: pip install 'transferd[mooncake]' (and Debian's libibverbs1)")
    if not 1 <= r.mooncake_batch_entries <= MOONCAKE_MAX_ENTRIES:
        raise ConfigError(f"receiver.mooncake_batch_entries must lie in [1, {MOONCAKE_MAX_ENTRIES}], "
                          f"not {r.mooncake_batch_entries}")
    if r.mooncake_reads_in_flight < 1 or r.mooncake_batch_entries * r.mooncake_reads_in_flight > MOONCAKE_MAX_ENTRIES:
        raise ConfigError(f"receiver.mooncake_reads_in_flight ({r.mooncake_reads_in_flight}) × "
                          f"receiver.mooncake_batch_entries ({r.mooncake_batch_entries}) must lie in "
                          f"[1, {MOONCAKE_MAX_ENTRIES}]: Mooncake's TCP transport rejects a whole batch once its queue "
                          "is full")


NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels' packages, the CUDA 12 one first (transferd[nixl])
NIXL_MAX_ENTRIES = 65536  # entries of one NIXL transfer request (one descriptor list)
_UCX_MODULES_RE = re.compile(r"^\^?[A-Za-z0-9_*]+(,[A-Za-z0-9_*]+)*$")


def nixl_installed() -> bool:
    """Whether a NIXL wheel is importable (``pip install 'transferd[nixl]'``)."""
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in NIXL_MODULES)


def _check_nixl(cfg: Config) -> None:
    """The NIXL settings of both sections (docs/CONFIG.md)."""
    r, s = cfg.receiver, cfg.sender
    for side, c in (("receiver", r), ("sender", s)):
        if c.nixl_ucx_devices and not _DEVICES_RE.match(c.nixl_ucx_devices):
            raise ConfigError(f"{side}.nixl_ucx_devices {c.nixl_ucx_devices!r} must be UCX device names separated "
                              "by commas (e.g. \"mlx5_0:1,mlx5_1:1\"), or empty for every device")
        if c.nixl_ucx_modules and not _UCX_MODULES_RE.match(c.nixl_ucx_modules):
            raise ConfigError(f"{side}.nixl_ucx_modules {c.nixl_ucx_modules!r} must be a UCX_MODULES list "
                              "(module names separated by commas, \"^\" first to exclude them), or empty")
        _check_engine_plane(side, c, DataPlane.NIXL, "NIXL (UCX)", nixl_installed, "NIXL: pip install 'transferd[nixl]'")
    if not 1 <= r.nixl_batch_entries <= NIXL_MAX_ENTRIES:
        raise ConfigError(f"receiver.nixl_batch_entries must lie in [1, {NIXL_MAX_ENTRIES}], not {r.nixl_batch_entries}")
    if not 1 <= r.nixl_reads_in_flight <= 64:
        raise ConfigError(f"receiver.nixl_reads_in_flight must lie in [1, 64], not {r.nixl_reads_in_flight}")
    _at_least(0, True, r.nixl_read_timeout_s, "receiver.nixl_read_timeout_s")


def _at_least(lo: float, strict: bool, *pairs: Any) -> None:
    """``pairs`` = value, name, value, name, …: each must be > lo (strict) or >= lo."""
    for value, what in zip(pairs[::2], pairs[1::2]):
        if value < lo or (strict and value == lo):
            raise ConfigError(f"{what} must be {'>' if strict else '>='} {lo}, not {value}")


_ENDPOINT_RE = re.compile(r"^(tcp)://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+|\*):(\*|\d+)$")


def check_endpoint(ep: str, what: str, *, bind: bool) -> None:
    """``tcp://host:port`` (port ``*`` only for binding), or ``ipc://path``."""
    if ep.startswith("ipc://") and len(ep) > 6:
        return
    m = _ENDPOINT_RE.match(ep)
    if not m:
        raise ConfigError(f"{what}: {ep!r} is not an endpoint like tcp://127.0.0.1:57500 or ipc:///path")
    port = m.group(3)
    if port == "*":
        if not bind:
            raise ConfigError(f"{what}: {ep!r}: a port of * only makes sense for binding")
    elif not 1 <= int(port) <= 65535:
        raise ConfigError(f"{what}: port {port} is out of range (1-65535)")


def parse_hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what}: {value!r} must be HOST:PORT with a port in 0-65535 (0 = any free port)")
    return host.strip("[]"), int(port)


_ENUMS: dict[str, type[Enum]] = {"SplitMode": SplitMode, "AutoOff": AutoOff, "ZeroCopy": ZeroCopy,
                                  "DataPlane": DataPlane}
"""Settings whose values are one of an enum's (checked where the file is read)."""
_SIZE_KEYS = {"max_message_bytes", "stream_record_bytes", "aux_row_bytes", "max_frame_bytes", "shm_message_bytes",
              "stream_send_buffer_bytes", "stream_receive_buffer_bytes"}


def _coerce(cls: type, name: str, value: Any, where: str) -> Any:
    f = {x.name: x for x in fields(cls)}[name]
    t = str(f.type)
    if name in _SIZE_KEYS:
        return parse_size(value, where)
    try:
        if t == "bool":
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        if t == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if t == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if t == "str":
            if not isinstance(value, str):
                raise ValueError(value)
            return value
        if t in _ENUMS:
            kind = _ENUMS[t]
            try:
                return kind(value)
            except ValueError:
                raise ConfigError(f"{where} must be one of {', '.join(repr(m.value) for m in kind)}, "
                                  f"not {value!r}") from None
        if t.startswith("tuple[str"):
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError(value)
            return tuple(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a valid {t}") from None
    return value


def _section(cls: type, data: Mapping[str, Any], section: str, source: str, base: Any = None) -> Any:
    known = {f.name for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in [{section}] of {source} (known: {', '.join(sorted(known))})")
        values[key] = _coerce(cls, key, value, f"{section}.{key} in {source}")
    return replace(base, **values) if base is not None else cls(**values)


_MODEL_TYPES: dict[str, type] = {"name": str, "dtype": str, "page_size": int, "kv_layers": int,
                                  "kv_format": str, "kv_token_elems": int}


def _typed(value: Any, typ: type, what: str) -> Any:
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{what}: {value!r} is not a valid {typ.__name__}")
    return value


def _model(data: Any, where: str) -> ModelSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"[model] in {where} must be a table")
    data = dict(data)
    comps = data.pop("state", [])
    known = set(_MODEL_TYPES) | {"aux_row_bytes"}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in [model] of {where} (known: state, {', '.join(sorted(known))})")
        if key == "aux_row_bytes":
            data[key] = parse_size(value, f"model.aux_row_bytes in {where}")
        else:
            _typed(value, _MODEL_TYPES[key], f"model.{key} in {where}")
    if not isinstance(comps, list):
        raise ConfigError(f"model.state in {where} must be an array of tables ([[model.state]])")
    states = []
    for i, c in enumerate(comps):
        at = f"[[model.state]] entry {i} of {where}"
        if not isinstance(c, dict):
            raise ConfigError(f"{at} must be a table")
        extra = set(c) - {"name", "layers", "slot_shape", "dtype"}
        if extra:
            raise ConfigError(f"unknown key {sorted(extra)[0]!r} in {at} (known: name, layers, slot_shape, dtype)")
        missing = [k for k in ("name", "layers", "slot_shape") if k not in c]
        if missing:
            raise ConfigError(f"{at} lacks {missing[0]!r}")
        shape = c["slot_shape"]
        shape = [shape] if not isinstance(shape, list) else shape
        for x in shape:
            _typed(x, int, f"slot_shape of {at}")
        states.append(StateComponent(_typed(c["name"], str, f"name of {at}"), _typed(c["layers"], int, f"layers of {at}"),
                                     tuple(shape), _typed(c.get("dtype", data.get("dtype", "bf16")), str, f"dtype of {at}")))
    try:
        return ModelSpec(state=tuple(states), **data)
    except LayoutError as exc:
        raise ConfigError(f"[model] of {where}: {exc}") from None


_SECTIONS: dict[str, type] = {"receiver": ReceiverConfig, "sender": SenderConfig, "demo": DemoConfig,
                              "faults": FaultsConfig, "sglang": SglangConfig}
_TOP = {"run_dir", "log_level", "log_format"}


def from_mapping(data: Mapping[str, Any], source: str = "<mapping>", env: Mapping[str, str] | None = None) -> Config:
    cfg = Config(source=source)
    for key, value in data.items():
        if key == "model":
            cfg = replace(cfg, model=_model(value, source))
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] in {source} must be a table")
            changes: dict[str, Any] = {key: _section(_SECTIONS[key], value, key, source, getattr(cfg, key))}
            cfg = replace(cfg, **changes)
        elif key in _TOP:
            if not isinstance(value, str):
                raise ConfigError(f"{key} in {source} must be a string")
            top: dict[str, Any] = {key: value}
            cfg = replace(cfg, **top)
        else:
            raise ConfigError(f"unknown key {key!r} in {source} (known: model, receiver, sender, demo, faults, sglang, "
                              f"{', '.join(sorted(_TOP))})")
    cfg = _apply_env(cfg, os.environ if env is None else env)
    cfg.validate()
    return cfg


# TRANSFERD_* variables that hold no setting: the pools' directory and the configuration file's path
ENV_NOT_SETTINGS = frozenset({"TRANSFERD_SHM_DIR", "TRANSFERD_CONFIG"})


def _apply_env(cfg: Config, env: Mapping[str, str]) -> Config:
    """``TRANSFERD_<SECTION>_<KEY>`` (e.g. ``TRANSFERD_RECEIVER_BIND``) and ``TRANSFERD_RUN_DIR``,
    ``TRANSFERD_LOG_LEVEL``, ``TRANSFERD_LOG_FORMAT``. Unknown ``TRANSFERD_`` names are errors
    (except the few that are not configuration, such as ``TRANSFERD_SHM_DIR``)."""
    for name, value in env.items():
        if not name.startswith("TRANSFERD_") or name in ENV_NOT_SETTINGS:
            continue
        rest = name[len("TRANSFERD_"):].lower()
        if rest in _TOP:
            top: dict[str, Any] = {rest: value}
            cfg = replace(cfg, **top)
            continue
        section, _, key = rest.partition("_")
        if section not in _SECTIONS or not key:
            raise ConfigError(f"environment variable {name} names no setting "
                              f"(use TRANSFERD_<SECTION>_<KEY>, sections: {', '.join(_SECTIONS)})")
        cfg = replace(cfg, **{section: _section(_SECTIONS[section], {key: value}, section, f"${name}",
                                                getattr(cfg, section))})
    return cfg


def load(path: str | Path | None, env: Mapping[str, str] | None = None) -> Config:
    if path is None:
        return from_mapping({}, "<defaults>", env)
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    return from_mapping(data, str(p), env)
