"""transferd.pool.shm: named shared-memory pools, their header, and numpy/torch views.

Every test points TRANSFERD_SHM_DIR at its own tmp_path, so nothing touches /dev/shm.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import msgpack
import numpy as np
import pytest

import transferd
from transferd.errors import IndexOutOfRange, LayoutError, PoolError, PoolMismatch
from transferd.layout import ModelSpec, PoolLayout, StateComponent
from transferd.pool.shm import _HDR, ALIGN, HEADER_FORMAT, MAGIC, Pool, pool_path, shm_dir

REPO_ROOT = Path(transferd.__file__).resolve().parent.parent

SPEC = ModelSpec(
    name="tiny", dtype="bf16", page_size=4, kv_layers=2, kv_format="mha", kv_token_elems=8,
    state=(StateComponent("conv", 2, (3, 4), "fp16"), StateComponent("ssm", 1, (5,), "fp32")),
    aux_row_bytes=24,
)
LAYOUT = SPEC.layout(kv_pages=6, state_slots=3, aux_slots=2)


@pytest.fixture(autouse=True)
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRANSFERD_SHM_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def pool(shm: Path) -> Iterator[Pool]:
    p = Pool.create("p0", LAYOUT)
    yield p
    p.close()


def _fill(p: Pool, salt: int) -> list[bytes]:
    """Write a distinct pattern into every buffer; return what was written."""
    out = []
    for i, rows in enumerate(p.rows):
        pattern = (np.arange(rows.size, dtype=np.uint32) * 31 + i * 7 + salt).astype(np.uint8)
        rows.reshape(-1)[:] = pattern
        out.append(pattern.tobytes())
    return out


# -- location and naming -----------------------------------------------------------------

def test_pool_path_follows_env_on_every_call(shm: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert shm_dir() == shm
    assert pool_path("abc") == shm / "transferd-abc"
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("TRANSFERD_SHM_DIR", str(other))
    assert pool_path("abc") == other / "transferd-abc"


@pytest.mark.parametrize("name", ["", "../etc", "a/b", ".hidden", "-x", "sp ace", "x" * 202, "ü"])
def test_bad_names(name: str) -> None:
    with pytest.raises(PoolError, match="pool name"):
        pool_path(name)
    with pytest.raises(PoolError):
        Pool.create(name, LAYOUT)
    with pytest.raises(PoolError):
        Pool.attach(name)


def test_good_names() -> None:
    for name in ["a", "decode0", "prefill0-r7", "A.b_c-9", "x" * 201]:
        assert pool_path(name).name == f"transferd-{name}"


# -- create / attach ---------------------------------------------------------------------

def test_create_writes_file_with_header(pool: Pool, shm: Path) -> None:
    path = shm / "transferd-p0"
    assert path.exists()
    assert sorted(p.name for p in shm.iterdir()) == ["transferd-p0"]  # no temp files left
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = path.read_bytes()
    magic, fmt, desc_len, data_off = _HDR.unpack_from(raw, 0)
    assert magic == MAGIC and fmt == HEADER_FORMAT
    desc = msgpack.unpackb(raw[_HDR.size:_HDR.size + desc_len], raw=False)
    assert desc["fp"] == LAYOUT.fingerprint()
    assert PoolLayout.from_wire(desc["layout"]) == LAYOUT
    assert data_off % ALIGN == 0 and data_off >= _HDR.size + desc_len
    assert pool.offsets[0] == data_off
    assert all(off % ALIGN == 0 for off in pool.offsets)
    ends = [off + b.nbytes for off, b in zip(pool.offsets, LAYOUT.buffers)]
    assert all(end <= nxt for end, nxt in zip(ends, pool.offsets[1:]))  # no overlap
    assert len(raw) >= ends[-1] and len(raw) % ALIGN == 0
    # zero-filled
    assert all(not r.any() for r in pool.rows)


def test_attach_same_process_sees_same_bytes(pool: Pool) -> None:
    written = _fill(pool, 3)
    other = Pool.attach("p0")
    try:
        assert other.layout == LAYOUT
        assert other.offsets == pool.offsets
        assert [r.tobytes() for r in other.rows] == written
        # and the other way round
        other.rows[1][2, :] = 0xAB
        assert (pool.rows[1][2] == 0xAB).all()
    finally:
        other.close()


def test_attach_from_another_process(pool: Pool, shm: Path) -> None:
    written = _fill(pool, 5)
    script = textwrap.dedent(
        """
        import hashlib, sys
        from transferd.pool import Pool
        p = Pool.attach("p0")
        for r in p.rows:
            print(hashlib.sha256(r.tobytes()).hexdigest())
        p.rows[0][:] = 0x5A          # KV buffer 0, every page
        p.view(p.layout.aux_index)[1, :8] = list(range(1, 9))
        p.close()
        """
    )
    env = {**os.environ, "TRANSFERD_SHM_DIR": str(shm),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    import hashlib

    assert res.stdout.split() == [hashlib.sha256(w).hexdigest() for w in written]
    assert (pool.rows[0] == 0x5A).all()
    assert pool.rows[1].tobytes() == written[1]  # the neighbour is untouched
    assert pool.rows[LAYOUT.aux_index][1, :8].tolist() == list(range(1, 9))
    assert pool.rows[LAYOUT.aux_index][1, 8:].tobytes() == written[LAYOUT.aux_index][24 + 8:48]


def test_attach_missing() -> None:
    with pytest.raises(PoolError, match="does not exist"):
        Pool.attach("nothere")


def test_create_twice_fails(pool: Pool) -> None:
    with pytest.raises(PoolError, match="already exists"):
        Pool.create("p0", LAYOUT)


def test_create_exist_ok_same_layout_attaches(pool: Pool) -> None:
    written = _fill(pool, 9)
    again = Pool.create("p0", LAYOUT, exist_ok=True)
    try:
        assert [r.tobytes() for r in again.rows] == written  # attached, not re-zeroed
    finally:
        again.close()


@pytest.mark.parametrize(
    ("other", "needle"),
    [
        (ModelSpec(**{**{f: getattr(SPEC, f) for f in ModelSpec.__dataclass_fields__}, "page_size": 8}).layout(6, 3, 2),
         "page_size"),
        (ModelSpec(**{**{f: getattr(SPEC, f) for f in ModelSpec.__dataclass_fields__}, "dtype": "fp16"}).layout(6, 3, 2),
         "dtype"),
        (ModelSpec(**{**{f: getattr(SPEC, f) for f in ModelSpec.__dataclass_fields__}, "kv_layers": 3}).layout(6, 3, 2),
         "buffer count"),
        (SPEC.layout(7, 3, 2), "row counts"),
    ],
)
def test_create_exist_ok_different_layout(pool: Pool, other: PoolLayout, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle) as info:
        Pool.create("p0", other, exist_ok=True)
    assert "'p0'" in str(info.value)


def test_open_creates_an_owned_pool_or_attaches_a_matching_one(pool: Pool) -> None:
    written = _fill(pool, 3)
    again, owned = Pool.open("p0", SPEC.layout(9, 3, 2), create=False)  # other row counts: compatible
    try:
        assert not owned and [r.tobytes() for r in again.rows] == written
    finally:
        again.close()
    fresh, owned = Pool.open("p1", LAYOUT, create=True)
    try:
        assert owned and fresh.layout == LAYOUT
    finally:
        fresh.unlink()
        fresh.close()


def test_open_refuses_a_pool_of_another_layout(pool: Pool) -> None:
    other = ModelSpec(**{**{f: getattr(SPEC, f) for f in ModelSpec.__dataclass_fields__}, "page_size": 8}).layout(6, 3, 2)
    with pytest.raises(PoolMismatch, match="pool 'p0' does not match the configuration: page_size differs"):
        Pool.open("p0", other, create=False)


# -- corrupted files ---------------------------------------------------------------------

def _path() -> Path:
    return pool_path("p0")


def test_corrupted_magic(pool: Pool) -> None:
    with open(_path(), "r+b") as fh:
        fh.write(b"NOTAPOOL")
    with pytest.raises(PoolError, match="magic"):
        Pool.attach("p0")


def test_wrong_header_format(pool: Pool) -> None:
    with open(_path(), "r+b") as fh:
        fh.seek(8)
        fh.write((HEADER_FORMAT + 1).to_bytes(4, "little"))
    with pytest.raises(PoolError, match="header format"):
        Pool.attach("p0")


def test_header_length_past_file(pool: Pool) -> None:
    with open(_path(), "r+b") as fh:
        fh.seek(12)
        fh.write((1 << 31).to_bytes(4, "little"))
    with pytest.raises(PoolError, match="past the file"):
        Pool.attach("p0")


def test_file_too_small(shm: Path) -> None:
    (shm / "transferd-small").write_bytes(b"TRDPOOL\0")
    with pytest.raises(PoolError, match="too small"):
        Pool.attach("small")


def test_garbage_description(pool: Pool) -> None:
    _, _, desc_len, _ = _HDR.unpack_from(_path().read_bytes(), 0)
    with open(_path(), "r+b") as fh:
        fh.seek(_HDR.size)
        fh.write(b"\xc1" * desc_len)
    with pytest.raises(PoolError, match="unreadable header"):
        Pool.attach("p0")


def test_header_fingerprint_must_match_layout(pool: Pool) -> None:
    raw = _path().read_bytes()
    _, _, desc_len, _ = _HDR.unpack_from(raw, 0)
    desc = msgpack.unpackb(raw[_HDR.size:_HDR.size + desc_len], raw=False)
    fp = desc["fp"]
    desc["fp"] = ("0" if fp[0] != "0" else "1") + fp[1:]
    blob = msgpack.packb(desc, use_bin_type=True)
    assert len(blob) == desc_len
    with open(_path(), "r+b") as fh:
        fh.seek(_HDR.size)
        fh.write(blob)
    with pytest.raises(PoolError, match="fingerprint"):
        Pool.attach("p0")


def test_header_layout_too_big_for_file(pool: Pool) -> None:
    os.truncate(_path(), pool.offsets[-1] - ALIGN)
    with pytest.raises(PoolError, match="needs"):
        Pool.attach("p0")


def test_truncated_inside_last_buffer(pool: Pool) -> None:
    # a file cut inside the last 4 KiB page: still refused as a PoolError, not a bare ValueError
    last = pool.offsets[-1] + LAYOUT.buffers[-1].nbytes
    os.truncate(_path(), last - 1)
    with pytest.raises(PoolError, match="needs"):
        Pool.attach("p0")
    os.truncate(_path(), last)  # exactly the bytes the layout needs is enough
    Pool.attach("p0").close()


def test_unlink(pool: Pool) -> None:
    pool.unlink()
    assert not _path().exists()
    with pytest.raises(PoolError, match="does not exist"):
        Pool.attach("p0")
    pool.unlink()  # idempotent


def test_context_manager_closes(shm: Path) -> None:
    with Pool.create("cm", LAYOUT) as p:
        p.rows[0][0, 0] = 1
    assert p.rows == []
    with Pool.attach("cm") as q:
        assert q.rows[0][0, 0] == 1


# -- indexing ----------------------------------------------------------------------------

def test_check_rows(pool: Pool) -> None:
    pool.check_rows(0, [0, 5, 3])
    pool.check_rows(0, np.arange(6))
    pool.check_rows(0, [])
    pool.check_rows(LAYOUT.aux_index, 1)
    with pytest.raises(IndexOutOfRange, match=r"page 6 outside buffer kv.k.L0 of 6 rows") as info:
        pool.check_rows(0, [1, 6, 2], what="page")
    assert isinstance(info.value, PoolError)
    with pytest.raises(IndexOutOfRange, match=r"row -1 outside"):
        pool.check_rows(0, [-1])
    with pytest.raises(IndexOutOfRange, match=r"slot 3 outside buffer state.ssm.L0 of 3 rows"):
        pool.check_rows(pool.buffer_index("state.ssm.L0"), [0, 3], what="slot")
    with pytest.raises(IndexOutOfRange, match=r"row 2 outside buffer aux of 2 rows"):
        pool.check_rows(LAYOUT.aux_index, 2)


def test_buffer_index(pool: Pool) -> None:
    assert pool.buffer_index("kv.k.L0") == 0
    assert pool.buffer_index("kv.v.L1") == 3
    assert pool.buffer_index("aux") == LAYOUT.aux_index
    with pytest.raises(PoolError, match="'kv.q.L0'"):
        pool.buffer_index("kv.q.L0")


# -- numpy views -------------------------------------------------------------------------

def test_numpy_views_typed_and_shared(pool: Pool) -> None:
    k0 = pool.view(0)
    assert k0.dtype == np.uint16 and k0.shape == (6, 4, 8)  # bf16 as raw uint16
    conv = pool.view(pool.buffer_index("state.conv.L1"))
    assert conv.dtype == np.float16 and conv.shape == (3, 3, 4)
    ssm = pool.view(pool.buffer_index("state.ssm.L0"))
    assert ssm.dtype == np.float32 and ssm.shape == (3, 5)
    aux = pool.view(LAYOUT.aux_index)
    assert aux.dtype == np.uint8 and aux.shape == (2, 24)

    ssm[1] = np.arange(5, dtype=np.float32) + 0.5
    raw = pool.rows[pool.buffer_index("state.ssm.L0")]
    assert raw[1].tobytes() == (np.arange(5, dtype=np.float32) + 0.5).tobytes()
    assert not raw[0].any() and not raw[2].any()
    k0[4, 1, 2] = 0x3F80
    assert pool.rows[0][4].view(np.uint16).reshape(4, 8)[1, 2] == 0x3F80
    assert np.shares_memory(k0, pool.rows[0])


def test_zero_row_pool(shm: Path) -> None:
    with Pool.create("empty", SPEC.layout(0, 0, 0)) as p:
        assert all(r.shape[0] == 0 for r in p.rows)
        assert p.view(0).shape == (0, 4, 8)
        with Pool.attach("empty") as q:
            assert q.layout == p.layout


# -- torch views -------------------------------------------------------------------------

TORCH_SPEC = ModelSpec(
    dtype="bf16", page_size=2, kv_layers=1, kv_format="mla", kv_token_elems=4,
    state=(StateComponent("h", 1, (3,), "fp16"), StateComponent("idx", 1, (8,), "fp8_e4m3"),
           StateComponent("s", 1, (2, 2), "fp32")),
    aux_row_bytes=8,
)


def test_torch_views_dtypes_and_shared_memory(shm: Path, torch_mod: ModuleType) -> None:
    torch = torch_mod
    with Pool.create("t", TORCH_SPEC.layout(3, 2, 1)) as p:
        kv, h, idx, s = (p.buffer_index(n) for n in ("kv.kv.L0", "state.h.L0", "state.idx.L0", "state.s.L0"))
        expect = {kv: (torch.bfloat16, (3, 2, 4)), h: (torch.float16, (2, 3)),
                  idx: (torch.float8_e4m3fn, (2, 8)), s: (torch.float32, (2, 2, 2)),
                  p.layout.aux_index: (torch.uint8, (1, 8))}
        for b, (dt, shape) in expect.items():
            t = p.torch_view(b)
            assert t.dtype == dt, p.layout.buffers[b].name
            assert tuple(t.shape) == shape

        # numpy -> torch: bf16 1.0 is 0x3F80, fp8 e4m3 1.0 is 0x38
        p.view(kv)[2, 1, 3] = 0x3F80
        assert p.torch_view(kv)[2, 1, 3].item() == 1.0
        assert p.torch_view(kv).float().sum().item() == 1.0
        p.view(idx)[1, 7] = 0x38
        assert p.torch_view(idx)[1, 7].float().item() == 1.0
        p.view(h)[0] = np.array([1.5, -2.0, 0.25], dtype=np.float16)
        assert p.torch_view(h)[0].tolist() == [1.5, -2.0, 0.25]

        # torch -> numpy
        p.torch_view(s)[1] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        assert p.view(s)[1].tolist() == [[1.0, 2.0], [3.0, 4.0]]
        assert not p.view(s)[0].any()
        p.torch_view(kv)[0, 0, 0] = -3.0
        assert p.view(kv)[0, 0, 0] == torch.tensor(-3.0, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
        # buffers do not bleed into each other
        assert not p.view(h)[1].any()
        assert not p.view(p.layout.aux_index).any()

        # the torch view aliases the same memory as the numpy view
        t = p.torch_view(s)
        assert t.data_ptr() == p.view(s).ctypes.data
        del t


def test_torch_view_of_zero_row_buffer(shm: Path, torch_mod: ModuleType) -> None:
    with Pool.create("z", TORCH_SPEC.layout(0, 0, 1)) as p:
        t = p.torch_view(0)
        assert tuple(t.shape) == (0, 2, 4) and t.dtype == torch_mod.bfloat16


# -- the torch helper itself (tests/unit/conftest.py) ------------------------------------

def test_require_torch_skips_locally_and_fails_under_ci(
    monkeypatch: pytest.MonkeyPatch, torch_loader: Callable[[], ModuleType]
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        torch_loader()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        torch_loader()


# -- sealed pools (a memfd that cannot shrink, named by a link) ----------------------------

def _env(shm: Path) -> dict[str, str]:
    return {**os.environ, "TRANSFERD_SHM_DIR": str(shm),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def test_a_sealed_pool_is_a_memfd_that_cannot_shrink_named_by_a_link(shm: Path) -> None:
    import fcntl

    from transferd.pool.shm import is_sealed

    p = Pool.create("sealed", LAYOUT, sealed=True)
    try:
        path = pool_path("sealed")
        assert p.sealed and path.is_symlink()
        assert os.readlink(path).startswith(f"/proc/{os.getpid()}/fd/")
        fd = os.open(path, os.O_RDWR)
        try:
            assert is_sealed(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SEAL  # no one can change the seals any more
            size = os.fstat(fd).st_size
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size - 4096)  # what a hostile peer would do to its own pool
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)
        written = _fill(p, 9)
        q = Pool.attach("sealed")  # by name, as an engine or a same-host receiver attaches
        try:
            assert q.sealed and q.pool_id == p.pool_id and q.layout == LAYOUT
            assert [r.tobytes() for r in q.rows] == written
        finally:
            q.close()
    finally:
        p.unlink()
        p.close()
    assert not path.is_symlink()


def test_a_plain_pool_is_not_sealed(pool: Pool) -> None:
    from transferd.pool.shm import is_sealed

    assert not pool.sealed and not Pool.attach("p0").sealed
    fd = os.open(pool_path("p0"), os.O_RDONLY)
    try:
        assert not is_sealed(fd)  # a tmpfs file can never be sealed
    finally:
        os.close(fd)


def test_another_process_attaches_a_sealed_pool_by_name_and_shares_its_bytes(shm: Path) -> None:
    p = Pool.create("sealed", LAYOUT, sealed=True)
    try:
        written = _fill(p, 3)
        script = textwrap.dedent(
            """
            import hashlib
            from transferd.pool import Pool
            p = Pool.attach("sealed")
            print(int(p.sealed), *[hashlib.sha256(r.tobytes()).hexdigest() for r in p.rows])
            p.rows[0][:] = 0x3C
            p.close()
            """
        )
        res = subprocess.run([sys.executable, "-c", script], env=_env(shm), capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr
        import hashlib

        assert res.stdout.split() == ["1"] + [hashlib.sha256(w).hexdigest() for w in written]
        assert (p.rows[0] == 0x3C).all() and p.rows[1].tobytes() == written[1]
    finally:
        p.unlink()
        p.close()


def test_a_sealed_pool_of_a_process_that_is_gone_is_replaced_loudly(shm: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    script = textwrap.dedent(
        """
        from transferd.pool import Pool
        from tests.unit.test_pool import LAYOUT
        p = Pool.create("gone", LAYOUT, sealed=True)
        print(p.pool_id)
        """
    )
    res = subprocess.run([sys.executable, "-c", script], env=_env(shm), capture_output=True, text=True,
                         timeout=60, cwd=REPO_ROOT)
    assert res.returncode == 0, res.stderr
    old_id = int(res.stdout)
    path = pool_path("gone")
    assert path.is_symlink() and not path.exists()  # its creator exited without unlinking: a stale link
    with pytest.raises(PoolError, match="does not exist"):
        Pool.attach("gone")
    with caplog.at_level("WARNING", logger="transferd.pool.shm"):
        p, owned = Pool.open("gone", LAYOUT, create=True, sealed=True)
    try:
        assert owned and p.sealed and p.pool_id != old_id
        assert "belonged to a process that is gone" in caplog.text and "must attach again" in caplog.text
        assert Pool.attach("gone").pool_id == p.pool_id
    finally:
        p.unlink()
        p.close()


def test_attach_refuses_a_name_that_links_to_something_other_than_a_file(shm: Path) -> None:
    r, w = os.pipe()
    try:
        os.symlink(f"/proc/{os.getpid()}/fd/{r}", pool_path("pipe"))  # a stale link whose fd number was reused
        with pytest.raises(PoolError, match="not a regular file"):
            Pool.attach("pipe")  # and it returns at once: a pipe is never waited on
    finally:
        os.close(r)
        os.close(w)


def test_a_sealed_pool_created_twice_fails_and_close_releases_the_descriptor(shm: Path) -> None:
    p = Pool.create("twice", LAYOUT, sealed=True)
    try:
        fd = p._fd
        assert fd >= 0 and os.fstat(fd)
        with pytest.raises(PoolError, match="already exists"):
            Pool.create("twice", LAYOUT, sealed=True)
        q = Pool.create("twice", LAYOUT, exist_ok=True, sealed=True)  # a restart while it lives: attach
        assert q.pool_id == p.pool_id and not q._owner
        q.close()
    finally:
        p.unlink()
        p.close()
    assert p._fd == -1  # closed once (a second close would hit whatever reuses the number)


def test_attach_reads_the_header_with_pread_so_a_file_shrunk_after_fstat_is_an_error_not_sigbus(
        pool: Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer may shrink its pool file between the attacher's ``fstat`` and its reading of the
    header: the header comes from ``pread`` (a short read, named as such), never from the mapping
    (a load there past the file's last page would kill this process with SIGBUS)."""
    path = pool_path("p0")
    size = path.stat().st_size
    real_fstat = os.fstat

    class Shrunk:  # what fstat said an instant before the peer truncated its file
        def __init__(self, st: os.stat_result) -> None:
            self.st_mode, self.st_size = st.st_mode, size

    os.truncate(path, _HDR.size + 8)  # the magic survives, the layout description does not
    monkeypatch.setattr(os, "fstat", lambda fd: Shrunk(real_fstat(fd)))
    with pytest.raises(PoolError, match="runs past the file"):
        Pool.attach("p0")
