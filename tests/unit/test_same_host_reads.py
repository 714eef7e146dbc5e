"""The same-host plane's threaded reads: how a message's runs are cut into jobs, and the engine
that reads them out of a pool file — byte-exact, by ``process_vm_readv`` over the receiver's own
read-only mapping and by ``pread``, and safely (a short count, never SIGBUS) when the file shrinks
under it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transferd.transport.planes.same_host import (
    IOV_MAX,
    MAP_COPY_RUNS,
    PoolFile,
    SameHostEngine,
    cut,
    map_copy,
    map_read_only,
    unmap,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=0, max_size=30), st.integers(1, 4096))
def test_cut_covers_every_byte_once_in_order_within_the_limit(lengths: list[int], limit: int) -> None:
    entries, addr, off = [], 10_000, 7
    for n in lengths:
        entries.append((addr, off, n))
        addr += n + 3  # runs apart on both sides
        off += 2 * n
    jobs = cut([a for a, _, _ in entries], [o for _, o, _ in entries], [n for _, _, n in entries], limit)
    want = [(a + i, o + i) for a, o, n in entries for i in range(n)]
    got = [(a + i, o + i) for local, remote, lens in jobs for a, o, n in zip(local, remote, lens) for i in range(n)]
    assert got == want  # every byte once, in order, address and offset in step
    assert all(0 < sum(lens) <= limit for _, _, lens in jobs)
    assert all(sum(lens) == limit for _, _, lens in jobs[:-1])  # only the last job is short


@pytest.fixture
def pool_file() -> Iterator[tuple[str, np.ndarray]]:
    path = f"/dev/shm/transferd-test-reads-{os.getpid()}"
    data = np.random.default_rng(5).integers(0, 256, 4 << 20, dtype=np.uint8)
    data.tofile(path)
    yield path, data
    os.unlink(path)


def _engine(path: str, vm: bool) -> tuple[SameHostEngine, PoolFile]:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    f = PoolFile(fd, map_read_only(fd, size) if vm else 0, size)
    eng = SameHostEngine()
    eng.files["s"] = f
    return eng, f


def _close(f: PoolFile) -> None:
    unmap(f.base, f.length)
    os.close(f.fd)


@pytest.mark.parametrize("vm", [True, False], ids=["process_vm_readv", "pread"])
def test_engine_reads_scattered_runs_byte_exact(pool_file: tuple[str, np.ndarray], vm: bool) -> None:
    path, data = pool_file
    eng, f = _engine(path, vm)
    try:
        assert bool(f.base) is vm
        rng = np.random.default_rng(6)
        n = IOV_MAX + 300  # more runs than one system call takes
        rb = 1024
        src = rng.permutation(len(data) // rb)[:n]
        dst = np.zeros(n * rb + 64, np.uint8)
        order = rng.permutation(n)
        local = [int(dst.ctypes.data) + int(i) * rb for i in order]
        remote = [int(s) * rb for s in src]
        assert eng.read("s", local, remote, [rb] * n) == 0
        want = np.zeros_like(dst)
        for i, s in zip(order, src):
            want[i * rb:(i + 1) * rb] = data[s * rb:(s + 1) * rb]
        assert np.array_equal(dst, want)
        assert eng.vm is True  # the kernel allowed it here (pread only after a refusal)
    finally:
        _close(f)


@pytest.mark.parametrize("vm", [True, False], ids=["process_vm_readv", "pread"])
def test_a_file_shrunk_under_the_mapping_reads_short_never_sigbus(pool_file: tuple[str, np.ndarray],
                                                                  vm: bool) -> None:
    path, data = pool_file
    eng, f = _engine(path, vm)
    try:
        dst = np.zeros(1 << 20, np.uint8)
        os.truncate(path, 1 << 20)  # the peer shrinks its pool after registration
        # a run that crosses the new end, and one wholly past it: both come back -1, and this
        # process (which maps the file) is still here to say so
        assert eng.read("s", [int(dst.ctypes.data)], [(1 << 20) - 4096], [8192]) == -1
        assert eng.read("s", [int(dst.ctypes.data)], [3 << 20], [4096]) == -1
        assert eng.read("s", [int(dst.ctypes.data)], [0], [4096]) == 0  # what is left reads fine
        assert np.array_equal(dst[:4096], data[:4096])
    finally:
        _close(f)


def test_engine_refuses_an_unknown_session_and_a_bad_descriptor(pool_file: tuple[str, np.ndarray]) -> None:
    path, _ = pool_file
    eng, f = _engine(path, False)
    _close(f)
    dst = np.zeros(4096, np.uint8)
    assert eng.read("nope", [int(dst.ctypes.data)], [0], [4096]) == -2
    eng.files["s"] = PoolFile(-1)
    assert eng.read("s", [int(dst.ctypes.data)], [0], [4096]) == -2  # EBADF


@pytest.fixture
def sealed_file() -> Iterator[tuple[int, np.ndarray]]:
    import fcntl

    data = np.random.default_rng(8).integers(0, 256, 4 << 20, dtype=np.uint8)
    fd = os.memfd_create("transferd-test-sealed", os.MFD_ALLOW_SEALING)
    os.write(fd, data.tobytes())
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("runs", [8, MAP_COPY_RUNS + 1, IOV_MAX + 5],
                         ids=["memmove", "process_vm_readv", "process_vm_readv-two-calls"])
def test_a_sealed_file_is_read_byte_exact_by_memmove_or_one_system_call(sealed_file: tuple[int, np.ndarray],
                                                                         runs: int) -> None:
    """A job of few runs out of a sealed file is copied in user space out of the mapping; one of
    many short runs takes process_vm_readv; both land every byte."""
    fd, data = sealed_file
    f = PoolFile(fd, map_read_only(fd, len(data)), len(data), sealed=True)
    eng = SameHostEngine()
    eng.files["s"] = f
    try:
        rb = len(data) // 2048 if runs <= MAP_COPY_RUNS else 1024
        rng = np.random.default_rng(runs)
        src = rng.permutation(len(data) // rb)[:runs]
        dst = np.zeros(runs * rb, np.uint8)
        order = rng.permutation(runs)
        assert eng.read("s", [int(dst.ctypes.data) + int(i) * rb for i in order], [int(s) * rb for s in src],
                        [rb] * runs) == 0
        want = np.zeros_like(dst)
        for i, s in zip(order, src):
            want[i * rb:(i + 1) * rb] = data[s * rb:(s + 1) * rb]
        assert np.array_equal(dst, want)
    finally:
        unmap(f.base, f.length)


def test_map_copy_refuses_a_run_past_the_layout_end_and_copies_nothing_of_it(sealed_file: tuple[int, np.ndarray]) -> None:
    fd, data = sealed_file
    f = PoolFile(fd, map_read_only(fd, len(data)), len(data), sealed=True)
    try:
        dst = np.zeros(8192, np.uint8)
        assert map_copy(f, [int(dst.ctypes.data)], [len(data) - 4096], [8192]) == -1
        assert map_copy(f, [int(dst.ctypes.data)], [-4096], [4096]) == -1
        assert not dst.any()
        assert map_copy(f, [int(dst.ctypes.data)], [len(data) - 8192], [8192]) == 0
        assert np.array_equal(dst, data[-8192:])
    finally:
        unmap(f.base, f.length)


def test_holes_punched_in_a_sealed_file_read_as_zeros_never_a_fault(sealed_file: tuple[int, np.ndarray]) -> None:
    """The seal stops a shrink, not a hole: a peer that punches one makes its rows read as zeros
    (the kernel fills the hole on the fault), and this process copies on unharmed."""
    import ctypes

    fd, data = sealed_file
    libc = ctypes.CDLL(None, use_errno=True)
    falloc = libc.fallocate
    falloc.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    f = PoolFile(fd, map_read_only(fd, len(data)), len(data), sealed=True)
    try:
        dst = np.full(1 << 20, 0xFF, np.uint8)
        assert map_copy(f, [int(dst.ctypes.data)], [1 << 20], [1 << 20]) == 0  # the pages are mapped now
        assert falloc(fd, 0x01 | 0x02, 1 << 20, 1 << 20) == 0  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
        assert map_copy(f, [int(dst.ctypes.data)], [1 << 20], [1 << 20]) == 0
        assert not dst.any()
        assert map_copy(f, [int(dst.ctypes.data)], [0], [1 << 20]) == 0
        assert np.array_equal(dst, data[:1 << 20])
    finally:
        unmap(f.base, f.length)
