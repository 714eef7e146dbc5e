"""The same-host plane: the receiver copies the rows out of the sender's pool file, which it
opened at registration (docs/PROTOCOL.md §4 data-refs, §5 step 4).

Sender side (:class:`SameHostSender`): per buffer, data-refs messages of up to
``shm_message_bytes`` of rows (and a row list within ``max_message_bytes``), consecutive
positions, scattered source rows or not; their row lists are the only payload. ``done`` takes the
ZeroMQ socket like the ZeroMQ plane's.

Receiver side (:class:`SameHostReceiver`): the sender's pool file, opened at registration; the
rows a data-ref or data-refs message names are checked against its layout, then copied by the
kernel straight into the destination rows — one copy. The aux row and messages under 256 KiB
are read with ``pread`` on the event loop; larger messages are cut into jobs of 8 MiB that the
receiver's same-host :class:`~.reads.Reader` reads on its threads, each job one
``process_vm_readv`` call out of a read-only mapping of the file that this process never touches
itself (:class:`SameHostEngine`). Either way a file the peer shrinks after registration makes the
copy come back short instead of raising SIGBUS in the receiver (a copy in user space out of a
mapping of a truncated file faults on the first touch past its end): what a peer does to its own
file can fail its rooms, never the daemon or the other groups (docs/FAULTS.md §8).

A **sealed** pool (a memfd sealed against shrinking, :mod:`transferd.pool.shm`) cannot be cut
short, so there the receiver copies out of its mapping in user space (``memmove``, the GIL
released for each run), on the loop and on the threads alike; the kernel's seal, checked on the
receiver's own descriptor, decides, not anything the sender says.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ...errors import FailureCode
from ...pool import Pool
from ...pool.shm import is_sealed, pool_path
from ...protocol.messages import DataRef, DataRefs, encode
from ...protocol.receiver_core import DecodeRoom, Peer, ReceiverCore
from ...types import KIND_LABELS, Kind, PlaneName
from .reads import Job, Reader, ReadSink, Refs, live, read_ended, run_entries
from .sending import RoomTx
from .zmq import ZmqSender


class SameHostSender(ZmqSender):
    name = PlaneName.SAME_HOST

    async def send_rows(self, tx: RoomTx, kind: Kind, buffers: tuple[int, ...], src: np.ndarray,
                        dst: np.ndarray, base: int) -> None:
        room = tx.room
        for b in buffers:
            # the row list (8 bytes a row) also stays within max_message_bytes, which the
            # receiver checked against its frame limit at registration
            step = max(1, min(self.env.shm_message_bytes // self.row_bytes[b], self.cap // 8))
            for p in range(0, len(src), step):
                if room.stopped:
                    return
                await self._send_refs(tx, kind, b, base + p, src[p:p + step])

    async def _send_refs(self, tx: RoomTx, kind: Kind, buffer: int, pos: int, src_rows: np.ndarray) -> None:
        """Name the rows; the receiver copies them out of this pool after its checks."""
        env = self.env
        tx.room.handed = True
        if env.faults.drop_frames and env.fault_rng.random() < env.faults.drop_frames:
            env.counters.dropped["fault_drop_frame"] += 1
            return
        count = len(src_rows)
        rows = np.ascontiguousarray(src_rows, dtype="<i8").tobytes()
        if not await self._emit(tx, encode(DataRefs(tx.tok, kind, buffer, pos, count)), [rows], len(rows)):
            return
        nbytes = count * self.row_bytes[buffer]
        env.counters.add(KIND_LABELS[kind], nbytes)
        self._count(nbytes)
        tx.room.sent += nbytes
        self.bytes_sent += nbytes

    def _count(self, nbytes: int) -> None:
        """The part of the bytes this path moved (the Mooncake plane counts its own)."""
        self.env.counters.shm_bytes += nbytes


def ref_rows(core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, payload: Any, n_src: int,
             now: float) -> np.ndarray | None:
    """The source rows a data-ref or data-refs message names, checked against the sender's
    ``n_src`` rows of that buffer; None after telling the core why not (every plane that reads
    rows out of the sender's pool, the same-host one and Mooncake's, checks them here)."""
    if isinstance(msg, DataRefs):
        if len(payload) != msg.count * 8:
            core.reject(room, peer, FailureCode.LENGTH_MISMATCH, f"data-refs list of {len(payload)} bytes for "
                                                                 f"{msg.count} rows (8 bytes each)", now)
            return None
        src_rows = np.frombuffer(payload, dtype="<i8")
        lo, hi = int(src_rows.min()), int(src_rows.max()) + 1
    else:
        lo, hi = msg.src_row, msg.src_row + msg.count
        src_rows = np.arange(lo, hi, dtype=np.int64)
    if lo < 0 or hi > n_src:
        core.reject(room, peer, FailureCode.INDEX_OUT_OF_RANGE, f"data-ref rows [{lo}, {hi}) of buffer "
                                                                f"{msg.buffer} outside the sender's {n_src} rows", now)
        return None
    return src_rows


_sessions = itertools.count(1)


@dataclass(slots=True, eq=False)
class PoolFile:
    """A peer's pool file as the same-host engine reads it: the descriptor, and the address of
    this receiver's read-only mapping of it (0: none). The mapping is never touched from user
    space: only the kernel reads it, in ``process_vm_readv``, and a page past a shrunk file's end
    comes back as a short count there (EFAULT), never as SIGBUS."""

    fd: int
    base: int = 0
    length: int = 0
    sealed: bool = False  # sealed against shrinking and mapped to the layout's end: copied in user space


class SameHostEngine:
    """The same-host plane's read engine for :class:`~.reads.Reader`: the rows out of the peers'
    pool files, named by session, straight into decode-pool addresses, on the reader's threads.
    A job is one ``process_vm_readv`` call (every run of it in one system call, the GIL released
    once; this process reading its own read-only mapping of the file) where the kernel allows it,
    else ``pread(2)`` per run. ``read`` returns 0, -1 when a file came back short (it shrank: the
    rows never land), or -2 when the kernel refused the read."""

    def __init__(self) -> None:
        self.files: dict[str, PoolFile] = {}  # session -> its file (the plane closes it after its jobs)
        self.vm = True  # process_vm_readv works here (a seccomp profile may refuse it: pread then)
        self.pid = os.getpid()

    def register(self, buffers: Sequence[np.ndarray]) -> tuple[int, ...]:
        return ()  # nothing to register: the destination is this process's own memory

    def read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        f = self.files.get(session)
        if f is None:
            return -2
        if f.sealed and len(lens) <= MAP_COPY_RUNS:
            return map_copy(f, local, remote, lens)
        if self.vm and f.base:
            rc = self._vm_read(f, local, remote, lens)
            if rc == 0:
                return 0
        # no mapping, the call refused, or a short count: pread says precisely which
        return pread_into(f.fd, local, remote, lens)

    def _vm_read(self, f: PoolFile, local: list[int], remote: list[int], lens: list[int]) -> int:
        n = len(lens)
        if not n:
            return 0
        if max(remote[i] + lens[i] for i in range(n)) > f.length:
            return -1
        want = sum(lens)
        iov = np.empty((2, n, 2), np.uint64)  # struct iovec {void *base; size_t len}, local then remote
        iov[0, :, 0] = local
        iov[1, :, 0] = remote
        iov[1, :, 0] += f.base
        iov[:, :, 1] = lens
        addr = iov.ctypes.data
        got = 0
        for i in range(0, n, IOV_MAX):
            k = min(IOV_MAX, n - i)
            r = _pvr(self.pid, addr + 16 * i, k, addr + 16 * (n + i), k, 0)
            if r < 0:
                if ctypes.get_errno() in (errno.EPERM, errno.ENOSYS):
                    self.vm = False  # refused here for good: pread from now on
                return -2
            got += r
        return 0 if got == want else -1

    def close(self) -> None:
        pass  # the planes own their files


IOV_MAX = 1024
# a job of at most this many runs is copied in user space out of a sealed file's mapping, one
# GIL-releasing memmove a run; a job of more (short, scattered rows) takes one process_vm_readv:
# a thread that takes the GIL back after every 64 KiB run waits on the loop (docs/PERFORMANCE.md)
MAP_COPY_RUNS = 32
_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]
_pread.restype = ctypes.c_ssize_t
_pvr = _libc.process_vm_readv
_pvr.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_pvr.restype = ctypes.c_ssize_t
_mmap = _libc.mmap
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
_mmap.restype = ctypes.c_void_p
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_read_only(fd: int, length: int) -> int:
    """The address of a read-only shared mapping of the file's first ``length`` bytes (0 when
    the kernel refuses). Only ``process_vm_readv`` reads it."""
    if length <= 0:
        return 0
    addr = _mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    return 0 if addr in (None, _MAP_FAILED) else int(addr)


def unmap(base: int, length: int) -> None:
    if base:
        _munmap(base, length)


def map_copy(f: PoolFile, local: Sequence[int], remote: Sequence[int], lens: Sequence[int]) -> int:
    """Copy runs out of the mapping of a sealed file (it cannot shrink, so no page of the
    mapping can fault): 0, or -1 when a run lies past the layout's end (never copied)."""
    base, end = f.base, f.length
    for dst, off, n in zip(local, remote, lens):
        if off < 0 or off + n > end:
            return -1
        _memmove(dst, base + off, n)
    return 0


_memmove = ctypes.memmove  # a foreign call: the GIL is released while it copies


def copy_runs(f: PoolFile, local: list[int], remote: list[int], lens: list[int]) -> int:
    """The loop's copy of a few runs: out of the mapping where the file is sealed, else ``pread``
    (0, or -1 when they do not all land, as :func:`pread_into`)."""
    return map_copy(f, local, remote, lens) if f.sealed else pread_into(f.fd, local, remote, lens)


def pread_into(fd: int, local: list[int], remote: list[int], lens: list[int]) -> int:
    """Read ``lens[i]`` bytes at file offset ``remote[i]`` to address ``local[i]``, every entry
    whole: 0; -1 when the file ended first (it shrank); -2 when the kernel refused (EBADF, EIO).
    The caller owns the addresses: they lie inside memory it holds mapped."""
    for addr, offset, length in zip(local, remote, lens):
        dst, off, n = addr, offset, length
        while n > 0:
            got = _pread(fd, dst, n, off)
            if got < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                return -2
            if got == 0:
                return -1
            dst += got
            off += got
            n -= got
    return 0


def cut(addrs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int],
        limit: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Runs in order (``addrs[i]``, ``offsets[i]``, ``lengths[i]``), cut into jobs of at most
    ``limit`` bytes (a run longer than that is split across jobs, its address and offset moved in
    step): each job as ``(addresses, offsets, lengths)``. Every byte of every run is in exactly one
    job, in order."""
    jobs: list[tuple[list[int], list[int], list[int]]] = []
    local: list[int] = []
    remote: list[int] = []
    lens: list[int] = []
    room = limit
    for address, offset, length in zip(addrs, offsets, lengths):
        addr, off, n = address, offset, length
        while n > 0:
            take = min(n, room)
            local.append(addr)
            remote.append(off)
            lens.append(take)
            addr += take
            off += take
            n -= take
            room -= take
            if room == 0:
                jobs.append((local, remote, lens))
                local, remote, lens = [], [], []
                room = limit
    if lens:
        jobs.append((local, remote, lens))
    return jobs


class SameHostReceiver:
    """Rows named in the sender's own pool (data-ref, data-refs), read out of its file straight
    into the destination rows: one copy, and nothing a peer can revoke is mapped. A message of at
    least ``THREAD_MIN_BYTES`` is cut into jobs of ``JOB_BYTES`` that the receiver's same-host
    :class:`~.reads.Reader` reads on its threads (they land later); the aux row and smaller
    messages are read on the loop, where a thread hand-off would cost more than the copy."""

    name = PlaneName.SAME_HOST
    THREAD_MIN_BYTES = 256 << 10
    JOB_BYTES = 8 << 20  # a thread hand-off is dear on 2 cores: 8 MiB jobs beat 2 MiB ones (docs/PERFORMANCE.md)

    def __init__(self, pool: Pool, reader: Reader, sink: ReadSink) -> None:
        # the pool was attached to check its id and layout; from here on only its file is read
        self.pool_name = pool.name
        self.path = pool_path(pool.name)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        st = os.fstat(fd)
        self.ino = (st.st_dev, st.st_ino)
        sealed = is_sealed(fd)
        self.offsets = list(pool.offsets)
        self.row_bytes = pool.layout.buffer_row_bytes
        self.rows = [b.rows for b in pool.layout.buffers]
        end = max((o + b.nbytes for o, b in zip(pool.offsets, pool.layout.buffers)), default=0)
        # the descriptor, the mapping, the layout's end; a sealed file mapped that far is copied in user space
        base = map_read_only(fd, end)
        self.file = PoolFile(fd, base, end, sealed and bool(base) and st.st_size >= end)
        self.broken = ""  # why the file can no longer be read (a short read seen): every later message is refused
        pool.close()
        self.reader = reader
        self.sink = sink
        engine = reader.engine
        assert isinstance(engine, SameHostEngine)
        self.engine = engine
        self.session = f"{self.pool_name}#{next(_sessions)}"
        engine.files[self.session] = self.file
        self.jobs = 0  # queued or running on the reader: the file stays open until they are done
        self.closing = False

    def _unusable(self) -> str:
        """Why the peer's pool file cannot be read from any more ("" if it can)."""
        if self.broken:
            return self.broken
        try:
            st = os.fstat(self.file.fd)
        except OSError as exc:
            return f"the sender's pool {self.pool_name!r} cannot be read: {exc.strerror}"
        if st.st_size < self.file.length:
            return (f"the sender's pool {self.pool_name!r} shrank to {st.st_size} bytes after registration "
                    f"(its layout needs {self.file.length})")
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return f"the sender's pool {self.pool_name!r} was unlinked after registration"
        if (now.st_dev, now.st_ino) != self.ino:
            return f"the sender's pool {self.pool_name!r} was replaced by another file after registration"
        if st.st_nlink == 0 and not self.file.sealed:  # a memfd has no links: its name is a link to its creator's descriptor
            return f"the sender's pool {self.pool_name!r} was unlinked after registration"
        return ""

    def source(self, core: ReceiverCore, room: DecodeRoom, peer: Peer, msg: DataRef | DataRefs, payload: Any,
               now: float) -> Refs | None:
        src_rows = ref_rows(core, room, peer, msg, payload, self.rows[msg.buffer], now)
        if src_rows is None:
            return None
        why = self._unusable()
        if why:
            core.reject(room, peer, FailureCode.NO_SHM, why, now)
            return None
        return Refs(room, peer, src_rows)

    def first_row(self, msg: DataRef | DataRefs, src: Refs) -> Any:
        n = self.row_bytes[msg.buffer]
        off = self.offsets[msg.buffer] + int(src.rows[0]) * n
        f = self.file
        if f.sealed and off + n <= f.length:
            return ctypes.string_at(f.base + off, n)
        data = os.pread(f.fd, n, off)
        if len(data) != n:
            self.broken = self._short(-1, n)
            return b"\0" * n  # the aux guard then fails this room; the next message sees `broken`
        return data

    def write(self, msg: DataRef | DataRefs, dst: np.ndarray, first: int, rows: np.ndarray | None,
              src: Refs) -> bool:
        rb = self.row_bytes[msg.buffer]
        entries = run_entries(dst, first, rows, msg.count, src.rows, rb, self.offsets[msg.buffer])
        if msg.count * rb < self.THREAD_MIN_BYTES or msg.kind == Kind.AUX:
            local, remote, lens = entries
            rc = copy_runs(self.file, local, remote, lens)
            if rc != 0:  # the file shrank between the check and the read: these rows never land
                self._failed(src.room, src.peer, rc, sum(lens), time.monotonic())
                return False
            return True
        room, peer = src.room, src.peer
        core = self.sink.core
        for local, remote, lens in cut(*entries, self.JOB_BYTES):
            core.stream_read(room, peer.rank, +1)
            self.jobs += 1
            nbytes = sum(lens)
            self.reader.submit(Job(room.tok, self.session, local, remote, lens, partial(live, room),
                                   self._landed_fn(room, peer, msg.buffer, nbytes), nbytes=nbytes))
        return False

    def _short(self, rc: int, nbytes: int) -> str:
        if rc == -1:
            return f"the sender's pool {self.pool_name!r} shrank under a read of {nbytes} bytes"
        return f"the sender's pool {self.pool_name!r} could not be read ({nbytes} bytes)"

    def _landed_fn(self, room: DecodeRoom, peer: Peer, buffer: int, nbytes: int) -> Callable[[int | None, int], None]:
        def landed(rc: int | None, row: int) -> None:
            self.jobs -= 1
            if self.closing and not self.jobs:
                self._close_file()
            read_ended(self.sink, room, peer, self.name, buffer, nbytes, rc, row, failed=self._failed)
        return landed

    def _failed(self, room: DecodeRoom, peer: Peer, rc: int, nbytes: int, now: float) -> None:
        self.broken = self.broken or self._short(rc, nbytes)
        self.sink.core.reject(room, peer, FailureCode.NO_SHM, self._short(rc, nbytes), now)

    def close(self) -> None:
        self.closing = True
        if not self.jobs:
            self._close_file()

    def _close_file(self) -> None:
        # a closed descriptor's number is reused by the kernel: it leaves the engine first, and
        # only once no job of this plane is queued or running
        f = self.file
        if f.fd >= 0:
            self.engine.files.pop(self.session, None)
            unmap(f.base, f.length)
            os.close(f.fd)
            f.fd, f.base, f.sealed = -1, 0, False
