"""Named shared-memory pools with a self-describing header.

A pool is one file under ``/dev/shm`` (``transferd-<name>``): a 4 KiB-aligned header that
describes the layout, then every buffer, each aligned to 4 KiB. Any process attaches by name and
gets numpy views (always) or torch views (when torch is installed) of the same bytes.

A pool may instead be **sealed** (``Pool.create(..., sealed=True)``, ``sender.sealed_pool``): a
``memfd_create`` file sealed against shrinking (``F_SEAL_SHRINK``, then ``F_SEAL_SEAL``), held
open by its creator and named under ``/dev/shm`` by a symbolic link to ``/proc/<pid>/fd/<n>``.
Attaching by name works the same (in the creator's pid namespace); a receiver that sees the seal
may copy out of its own mapping in user space, since no one can shrink the file under it (docs/
DATA-PLANES.md). A sealed pool lives while a process holds it, so it is not re-attached after its
creator restarts.

Header: ``b"TRDPOOL\\0"`` magic, u32 header format version, u32 length of the msgpack layout
description that follows, u64 data offset, then the msgpack ``PoolLayout.to_wire()`` map and the
16-hex-digit fingerprint. The file is fully written before it appears under its final name, so an
attaching process never sees a half-written header.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from ..errors import IndexOutOfRange, LayoutError, PoolError, PoolMismatch
from ..layout import DTYPES, PoolLayout, layout_difference

log = logging.getLogger(__name__)

MAGIC = b"TRDPOOL\0"
HEADER_FORMAT = 1
ALIGN = 4096
_HDR = struct.Struct("<8sIIQ")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")


def shm_dir() -> Path:
    return Path(os.environ.get("TRANSFERD_SHM_DIR", "/dev/shm"))


def pool_path(name: str) -> Path:
    if not _NAME_RE.match(name):
        raise PoolError(f"pool name {name!r} must be 1-201 characters of letters, digits, '_', '.', '-'")
    return shm_dir() / f"transferd-{name}"


def host_boot_id() -> str:
    """This kernel's boot id (same on both sides ⇒ same host, so /dev/shm may be shared)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def is_sealed(fd: int) -> bool:
    """Whether the file behind ``fd`` can never shrink (a memfd sealed with ``F_SEAL_SHRINK``;
    a plain tmpfs file cannot be sealed)."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:
        return False


def _write_header(mm: mmap.mmap, desc: bytes, data_off: int) -> None:
    mm[:_HDR.size] = _HDR.pack(MAGIC, HEADER_FORMAT, len(desc), data_off)
    mm[_HDR.size:_HDR.size + len(desc)] = desc


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


class Pool:
    """A mapped pool. Use :meth:`create` or :meth:`attach`; :meth:`close` unmaps."""

    def __init__(self, name: str, layout: PoolLayout, mm: mmap.mmap, offsets: list[int], owner: bool,
                 pool_id: int = 0, sealed: bool = False, fd: int = -1) -> None:
        self.name = name
        self.sealed = sealed  # the file cannot shrink (a sealed memfd)
        self._fd = fd  # a sealed pool's memfd, held by its creator: its name links to it
        self.pool_id = pool_id  # random at creation: tells two pools of the same name apart
        self.layout = layout
        self._mm = mm
        self._owner = owner
        self.offsets = offsets
        base = np.frombuffer(mm, dtype=np.uint8)
        self.rows: list[np.ndarray] = []
        for off, b in zip(offsets, layout.buffers):
            self.rows.append(base[off:off + b.nbytes].reshape(b.rows, b.row_bytes))
        self._base = base

    # -- lifecycle -----------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, layout: PoolLayout, *, exist_ok: bool = False, sealed: bool = False) -> Pool:
        """Create a pool (zero-filled). With ``exist_ok``, attach to an existing pool of a
        compatible layout and the same row counts instead; anything else is an error. With
        ``sealed``, the pool is a memfd sealed against shrinking (the module's docstring)."""
        path = pool_path(name)
        if path.is_symlink() and not path.exists():
            # a sealed pool whose creator is gone (it crashed): an engine may still hold the old
            # memory mapped, and writes there from now on are not this pool's
            log.warning("pool %r: the sealed pool named at %s belonged to a process that is gone; a new one "
                        "is created, and engines attached to the old one must attach again", name, path)
            path.unlink(missing_ok=True)
        if path.exists():
            if not exist_ok:
                raise PoolError(f"pool {name!r} already exists at {path}")
            pool = cls.attach(name)
            diff = layout_difference(pool.layout, layout, "existing pool", "configured")
            if diff is None and pool.layout.to_wire() != layout.to_wire():
                diff = "row counts differ from the configured ones"
            if diff:
                pool.close()
                raise LayoutError(f"pool {name!r} exists with another layout: {diff}")
            return pool
        pool_id = int.from_bytes(os.urandom(8), "little") >> 1
        desc = msgpack.packb({"layout": layout.to_wire(), "fp": layout.fingerprint(), "id": pool_id},
                             use_bin_type=True)
        data_off = _align(_HDR.size + len(desc))
        offsets = []
        off = data_off
        for b in layout.buffers:
            offsets.append(off)
            off = _align(off + b.nbytes)
        total = max(off, ALIGN)
        if sealed:
            return cls._create_sealed(name, path, layout, offsets, total, desc, data_off, pool_id)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _write_header(mm, desc, data_off)
            try:
                os.link(tmp, path)  # fails if someone else created it meanwhile
            except FileExistsError:
                mm.close()
                raise PoolError(f"pool {name!r} was created concurrently by another process") from None
        finally:
            os.close(fd)
            tmp.unlink(missing_ok=True)
        return cls(name, layout, mm, offsets, owner=True, pool_id=pool_id)

    @classmethod
    def _create_sealed(cls, name: str, path: Path, layout: PoolLayout, offsets: list[int], total: int, desc: bytes,
                       data_off: int, pool_id: int) -> Pool:
        try:
            fd = os.memfd_create(f"transferd-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError) as exc:
            raise PoolError(f"pool {name!r}: cannot create a sealed pool here (memfd_create: {exc})") from None
        try:
            os.ftruncate(fd, total)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            _write_header(mm, desc, data_off)
        except OSError as exc:
            os.close(fd)
            raise PoolError(f"pool {name!r}: cannot set up a sealed pool: {exc.strerror or exc}") from None
        try:
            os.symlink(f"/proc/{os.getpid()}/fd/{fd}", path)  # fails if someone else created it meanwhile
        except OSError as exc:
            mm.close()
            os.close(fd)
            if isinstance(exc, FileExistsError):
                raise PoolError(f"pool {name!r} was created concurrently by another process") from None
            raise PoolError(f"pool {name!r}: cannot name the sealed pool at {path}: {exc.strerror or exc}") from None
        return cls(name, layout, mm, offsets, owner=True, pool_id=pool_id, sealed=True, fd=fd)

    @classmethod
    def attach(cls, name: str) -> Pool:
        path = pool_path(name)
        try:
            # O_NONBLOCK: a stale link of a sealed pool may name another process's pipe by now
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PoolError(f"pool {name!r} does not exist (looked for {path})") from None
        except OSError as exc:
            raise PoolError(f"pool {name!r}: cannot open {path}: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise PoolError(f"pool {name!r}: {path} is not a regular file")
            size = st.st_size
            sealed = is_sealed(fd)
            # the header is read with pread, not out of the mapping: a peer that shrinks its file
            # meanwhile makes a read come back short, where a load from the mapping would SIGBUS
            head = os.pread(fd, _HDR.size, 0)
            if len(head) < _HDR.size:
                raise PoolError(f"pool {name!r}: file of {size} bytes is too small for a header")
            magic, fmt, desc_len, data_off = _HDR.unpack(head)
            if magic != MAGIC:
                raise PoolError(f"pool {name!r}: not a transferd pool (bad magic {magic!r})")
            if fmt != HEADER_FORMAT:
                raise PoolError(f"pool {name!r}: header format {fmt}, this transferd reads {HEADER_FORMAT}")
            if _HDR.size + desc_len > size:
                raise PoolError(f"pool {name!r}: header length {desc_len} runs past the file")
            raw_desc = os.pread(fd, desc_len, _HDR.size)
            if len(raw_desc) < desc_len:
                raise PoolError(f"pool {name!r}: header length {desc_len} runs past the file")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise PoolError(f"pool {name!r}: cannot map {path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        try:
            desc: Any = msgpack.unpackb(raw_desc, raw=False)
            layout = PoolLayout.from_wire(desc["layout"])
            if layout.fingerprint() != desc["fp"]:
                raise PoolError(f"pool {name!r}: header fingerprint does not match its layout")
            offsets = []
            off = data_off
            end = data_off
            for b in layout.buffers:
                offsets.append(off)
                end = off + b.nbytes
                off = _align(end)
            if end > size or data_off < _HDR.size + desc_len:
                raise PoolError(f"pool {name!r}: layout needs {end} bytes, file has {size}")
        except (PoolError, LayoutError):
            mm.close()
            raise
        except Exception as exc:
            mm.close()
            raise PoolError(f"pool {name!r}: unreadable header: {exc!r}") from None
        pool_id = desc.get("id", 0) if isinstance(desc.get("id", 0), int) else 0
        return cls(name, layout, mm, offsets, owner=False, pool_id=pool_id, sealed=sealed)

    @classmethod
    def open(cls, name: str, layout: PoolLayout, *, create: bool, sealed: bool = False) -> tuple[Pool, bool]:
        """A daemon's pool: created (or re-attached after a restart) when ``create``, and then the
        daemon's own (the bool is True: it unlinks it at the end); otherwise attached, and
        refused unless its layout matches ``layout`` (:class:`PoolMismatch`). ``sealed``: create
        it as a sealed memfd."""
        if create:
            return cls.create(name, layout, exist_ok=True, sealed=sealed), True
        pool = cls.attach(name)
        diff = layout_difference(pool.layout, layout, "pool", "config")
        if diff:
            pool.close()
            raise PoolMismatch(f"pool {name!r} does not match the configuration: {diff}")
        return pool, False

    def close(self) -> None:
        self.rows = []
        self._base = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # views still exported (e.g. zero-copy frames in flight); unmapped when released
        if self._fd >= 0:
            os.close(self._fd)  # the mapping (and anyone else's) keeps the memory
            self._fd = -1

    def unlink(self) -> None:
        pool_path(self.name).unlink(missing_ok=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- views ---------------------------------------------------------------------------
    def view(self, buffer: int) -> np.ndarray:
        """Typed numpy view of one buffer: shape ``(rows, *row_shape)`` (bf16/fp8 as raw uints)."""
        b = self.layout.buffers[buffer]
        return self.rows[buffer].view(DTYPES[b.dtype][1]).reshape(b.rows, *b.shape)

    def torch_view(self, buffer: int) -> Any:
        """Typed torch view of one buffer (bf16, fp16, fp8, fp32, …), sharing the pool's memory."""
        import torch  # imported only here: the daemon never needs torch

        b = self.layout.buffers[buffer]
        dt = getattr(torch, DTYPES[b.dtype][2])
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, offset=self.offsets[buffer], count=b.nbytes) \
            if b.nbytes else torch.empty(0, dtype=torch.uint8)
        return raw.view(dt).reshape(b.rows, *b.shape)

    def buffer_index(self, name: str) -> int:
        for i, b in enumerate(self.layout.buffers):
            if b.name == name:
                return i
        raise PoolError(f"pool {self.name!r} has no buffer {name!r}")

    def check_rows(self, buffer: int, rows: Any, what: str = "row") -> None:
        """Raise :class:`IndexOutOfRange` unless every row index lies inside ``buffer``."""
        n = self.layout.buffers[buffer].rows
        arr = np.asarray(rows, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            bad = int(arr[(arr < 0) | (arr >= n)][0])
            raise IndexOutOfRange(
                f"pool {self.name!r}: {what} {bad} outside buffer {self.layout.buffers[buffer].name} of {n} rows"
            )
