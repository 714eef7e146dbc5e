"""The SGLang backend against the real SGLang 0.5.23 classes and real transferd daemons.

A prefill CP4 group of four scheduler-like processes (forked, each with CPU tensors as its KV and
its own sender agent) → one decode rank (this process, with the receiver daemon): SGLang's
``load_plugins()`` resolves the backend, SGLang's sender/receiver interface is driven as its event
loops drive it, and the decode engine's tensors are compared byte for byte afterwards.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engines.conftest import require_sglang
from tests.engines.sglang_world import (
    AUX_ITEMS,
    ENGINE_PAGES,
    KV_ITEM,
    LAYERS,
    MAMBA_ITEMS,
    MODEL,
    PAGE,
    SWA_ITEM,
    Engine,
    Room,
    backend_classes,
    content,
    parallel,
    prefill_rank,
)
from tests.integration.harness import Cluster

require_sglang()

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import KVTransferError  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, _get_cp_rank_page_bounds  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()

BOOT = "127.0.0.1:8998"  # the prefill instance's bootstrap address, as decode requests carry it
KV_NAMES = [f"k{layer}" for layer in range(LAYERS)] + [f"v{layer}" for layer in range(LAYERS)]
FORK = multiprocessing.get_context("fork")


def test_load_plugins_resolves_the_backend_in_a_fresh_process() -> None:
    """What every SGLang process does at start: load_plugins(), then TransferBackend(name)."""
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.disaggregation.utils import TransferBackend, KVClassType, get_kv_class\n"
        "from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES as C\n"
        "b = TransferBackend('transferd')\n"
        "print(b.name, 'transferd' in C)\n"
        "for t in (KVClassType.MANAGER, KVClassType.SENDER, KVClassType.RECEIVER, KVClassType.BOOTSTRAP_SERVER):\n"
        "    c = get_kv_class(b, t); print(t.name, c.__module__, c.__name__)\n"
        "for name in ('mooncake', 'nixl', 'fake'):\n"
        "    c = get_kv_class(TransferBackend(name), KVClassType.SENDER); print(name, c.__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "TRANSFERD True"
    assert lines[1] == "MANAGER transferd.engines.sglang.conn TransferdKVManager"
    assert lines[2] == "SENDER transferd.engines.sglang.conn TransferdKVSender"
    assert lines[3] == "RECEIVER transferd.engines.sglang.conn TransferdKVReceiver"
    assert lines[4] == "BOOTSTRAP_SERVER sglang.srt.disaggregation.common.conn CommonKVBootstrapServer"
    assert lines[5] == "mooncake sglang.srt.disaggregation.mooncake.conn"
    assert lines[6] == "nixl sglang.srt.disaggregation.nixl.conn"
    assert lines[7] == "fake sglang.srt.disaggregation.fake.conn"


def test_another_sglang_version_is_refused_by_name() -> None:
    from transferd.engines.sglang import SGLANG_VERSION, UnsupportedSGLang, check_version

    assert check_version() == SGLANG_VERSION
    with pytest.raises(UnsupportedSGLang, match=r"supports sglang 0\.5\.23 only, this environment has sglang 0\.5\.22"):
        check_version("0.5.22")


# -- the CP4 world -----------------------------------------------------------------------------
def start(cluster: Cluster, cp: int = 4, device: str = "cpu", **extra: Any) -> tuple[Path, list[Path]]:
    """Receiver + a CP group whose pools mirror the test engine; returns their config files."""
    ep, _, _ = cluster.receiver(model=MODEL, kv_pages=ENGINE_PAGES, state_slots=ENGINE_PAGES, aux_slots=32,
                                heartbeat_interval_s=0.2, heartbeat_misses=5)
    cluster.group("prefill0", cp, [ep], model=MODEL, kv_pages=ENGINE_PAGES, state_slots=ENGINE_PAGES, aux_slots=32,
                  heartbeat_interval_s=0.2, heartbeat_misses=5, **extra)
    rcfg = cluster.tmp / "receiver-decode0.toml"
    with rcfg.open("a") as fh:
        fh.write(f'\n[sglang]\ngroups = ["{BOOT}=prefill0"]\ndevice = "{device}"\n')
    scfgs = [cluster.tmp / f"sender-prefill0-r{r}.toml" for r in range(cp)]
    for path in scfgs:
        with path.open("a") as fh:
            fh.write(f'\n[sglang]\ndevice = "{device}"\n')
    return rcfg, scfgs


class Prefill:
    """The four forked scheduler-like prefill ranks."""

    def __init__(self, cfgs: list[Path], rooms: list[Room], device: str = "cpu", ctx: Any = FORK) -> None:
        self.conns, self.procs = [], []
        for r, cfg in enumerate(cfgs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=prefill_rank, args=(r, len(cfgs), str(cfg), rooms, child, BOOT, device), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for r, c in enumerate(self.conns):
            self.expect(r, "ready", 120)

    def expect(self, rank: int, kind: str, timeout: float = 60) -> tuple[Any, ...]:
        conn = self.conns[rank]
        assert conn.poll(timeout), f"prefill rank {rank} sent nothing within {timeout}s (waiting for {kind})"
        msg = conn.recv()
        assert msg[0] != "error", f"prefill rank {rank} failed:\n{msg[2]}"
        assert msg[0] == kind, msg
        return msg

    def finish(self) -> None:
        for r, c in enumerate(self.conns):
            if self.procs[r].is_alive():
                c.send("exit")
                self.expect(r, "bye")
                self.procs[r].join(10)


def decode_engine(rcfg: Path, monkeypatch: pytest.MonkeyPatch, device: str = "cpu") -> tuple[Engine, Any, Any]:
    monkeypatch.setenv("TRANSFERD_CONFIG", str(rcfg))
    parallel(attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1)
    engine = Engine.make(fill_rank=None, device=device)
    manager_cls, _, receiver_cls = backend_classes()
    return engine, manager_cls(engine.kv_args, DisaggregationMode.DECODE, None, False), receiver_cls


def expect_room(mgr: Any, receiver_cls: Any, room: Room) -> Any:
    recv = receiver_cls(mgr, BOOT, room.room)
    assert recv.poll() == KVPoll.Bootstrapping
    recv.init(0)
    assert recv.poll() == KVPoll.WaitingForInput
    recv.send_metadata(np.array(room.dst_pages, dtype=np.int32), room.aux_dst,
                       [np.array([room.mamba_dst]), np.array(room.swa_dst)], decode_prefix_len=room.prefix_pages * PAGE)
    return recv


def poll_until_done(recvs: list[Any], timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        states = [r.poll() for r in recvs]
        if all(s in (KVPoll.Success, KVPoll.Failed) for s in states):
            return states
        assert time.monotonic() < deadline, f"rooms still {states} after {timeout}s"
        # block on the receiver until the first unfinished room ends or 50 ms pass, then poll all
        r = next(r for r, s in zip(recvs, states) if s not in (KVPoll.Success, KVPoll.Failed))
        if r.expected and r.group is not None:
            r.kv_mgr.decode.wait(r.bootstrap_room, r.group, timeout_s=0.05)


def owner(pos: int, n: int, cp: int) -> int:
    """SGLang's own CP page split decides which prefill rank holds position ``pos``."""
    return next(r for r in range(cp) if _get_cp_rank_page_bounds(n, r, cp)[0] <= pos < _get_cp_rank_page_bounds(n, r, cp)[1])


def check_bytes(engine: Engine, rooms: list[Room], cp: int) -> None:
    """Every row the rooms own holds exactly what the owning prefill rank had; every other row is zero."""
    written: dict[str, set[int]] = {}
    for room in rooms:
        src, n = room.src_pages, len(room.src_pages)
        assert n - room.prefix_pages == len(room.dst_pages)
        for pos in range(room.prefix_pages, n):
            dst = room.dst_pages[pos - room.prefix_pages]
            r = owner(pos, n, cp)
            for j, name in enumerate(KV_NAMES):
                got = engine.kv[j][dst].cpu().numpy()
                assert np.array_equal(got, content(r, name, src[pos], KV_ITEM)), \
                    f"room {room.room} position {pos}: {name} of decode page {dst} is not rank {r}'s page {src[pos]}"
                written.setdefault(name, set()).add(dst)
        for j, item in enumerate(MAMBA_ITEMS):  # replicated state: rank 0's copy, never another rank's
            assert np.array_equal(engine.mamba[j][room.mamba_dst].cpu().numpy(), content(0, f"mamba{j}", room.mamba_src, item))
            written.setdefault(f"mamba{j}", set()).add(room.mamba_dst)
        for s, d in zip(room.swa_src, room.swa_dst):
            assert np.array_equal(engine.swa[0][d].cpu().numpy(), content(0, "swa", s, SWA_ITEM))
            written.setdefault("swa", set()).add(d)
        for j, item in enumerate(AUX_ITEMS):
            assert np.array_equal(engine.aux[j][room.aux_dst].cpu().numpy(), content(0, f"aux{j}", room.aux_src, item))
            written.setdefault(f"aux{j}", set()).add(room.aux_dst)
    bufs = {**{n: engine.kv[j] for j, n in enumerate(KV_NAMES)}, **{f"mamba{j}": t for j, t in enumerate(engine.mamba)},
            "swa": engine.swa[0], **{f"aux{j}": t for j, t in enumerate(engine.aux)}}
    for name, t in bufs.items():
        rest = [i for i in range(t.shape[0]) if i not in written.get(name, set())]
        assert not t[rest].any(), f"{name}: rows no room owns were written"


ROOMS = [
    Room(2**62 + 1, chunks=[[11, 12, 13], [14, 15, 16, 17], [18, 19, 20]], dst_pages=list(range(30, 40)),
         mamba_src=1, mamba_dst=2, swa_src=[5, 6], swa_dst=[9, 10], aux_src=3, aux_dst=4),
    Room(2**62 + 2, chunks=[[40]], dst_pages=[50], mamba_src=4, mamba_dst=5, swa_src=[7], swa_dst=[11],
         aux_src=5, aux_dst=6),
    Room(2**62 + 3, chunks=[[21, 22, 23], [24, 25, 26, 27]], dst_pages=[41, 42, 43, 44, 45], prefix_pages=2,
         mamba_src=6, mamba_dst=7, swa_src=[8, 9, 10], swa_dst=[12, 13, 14], aux_src=7, aux_dst=8),
    Room(2**62 + 4, chunks=[[60, 2, 33], [7, 8]], dst_pages=[22, 23, 24, 1, 0], mamba_src=8, mamba_dst=9,
         swa_src=[11], swa_dst=[15], aux_src=9, aux_dst=10),
]


def test_cp4_prefill_to_decode_rooms_are_byte_exact(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    cp4_scenario(cluster, monkeypatch, "cpu", FORK)


def cp4_scenario(cluster: Cluster, monkeypatch: pytest.MonkeyPatch, device: str, ctx: Any) -> None:
    """Four prefill ranks → one decode rank, every room of ROOMS byte-exact in the decode engine."""
    rcfg, scfgs = start(cluster, device=device)
    engine, mgr, receiver_cls = decode_engine(rcfg, monkeypatch, device)
    recvs = [expect_room(mgr, receiver_cls, room) for room in ROOMS]
    prefill = Prefill(scfgs, ROOMS, device, ctx)
    states = poll_until_done(recvs)
    failures = []
    for recv, st in zip(recvs, states):
        if st == KVPoll.Failed:
            with pytest.raises(KVTransferError) as ei:
                recv.failure_exception()
            failures.append(str(ei.value))
    assert not failures, failures
    check_bytes(engine, ROOMS, 4)
    for room in ROOMS:  # every prefill rank saw its sender reach Success
        for r in range(4):
            msg = prefill.expect(r, "room")
            assert msg[1] == room.room and msg[2] == KVPoll.Success, msg
    prefill.finish()
    stats = cluster.clients[0].stats()
    # the de-dup: the replicated state travelled once per room (from rank 0), never from ranks 1-3
    state_bytes = sum(2 * 96 + 2 * 160 + 128 * len(room.swa_src) for room in ROOMS)
    assert stats["bytes"]["state"] == state_bytes, stats["bytes"]
    for recv in recvs:
        recv.clear()
    mgr.close()


def test_abort_mid_room_writes_nothing_after_it_returns(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    rcfg, scfgs = start(cluster)
    engine, mgr, receiver_cls = decode_engine(rcfg, monkeypatch)
    room = Room(2**61 + 7, chunks=[[3, 4, 5, 6], [7, 8, 9, 10]], dst_pages=list(range(20, 28)), stop_after=1)
    recv = expect_room(mgr, receiver_cls, room)
    prefill = Prefill(scfgs, [room])
    for r in range(4):
        prefill.expect(r, "partial")
    recv.abort()
    assert recv.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="aborted"):
        recv.failure_exception()
    for c in prefill.conns:  # now the prefill ranks send the rest of the room
        c.send("go")
    for r in range(4):  # the prefill side fails too, saying why: the decode side aborted the room
        msg = prefill.expect(r, "room")
        assert msg[2] == KVPoll.Failed and "transferd aborted:" in msg[3] and "submit refused" not in msg[3], msg
    # every rank has sent (or been refused) the rest; the engine's rows are written only by the
    # Success poll's scatter, so a failed room's poll can never write them
    assert recv.poll() == KVPoll.Failed
    for t in [*engine.kv, *engine.mamba, *engine.swa, *engine.aux]:
        assert not t.any(), "the decode engine's memory was written for an aborted room"
    prefill.finish()
    recv.clear()
    mgr.close()


def test_killed_prefill_rank_fails_the_decode_room_naming_it(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    rcfg, scfgs = start(cluster)
    engine, mgr, receiver_cls = decode_engine(rcfg, monkeypatch)
    room = Room(2**60 + 9, chunks=[[3, 4, 5, 6], [7, 8, 9, 10]], dst_pages=list(range(20, 28)), stop_after=1)
    recv = expect_room(mgr, receiver_cls, room)
    prefill = Prefill(scfgs, [room])
    for r in range(4):
        prefill.expect(r, "partial")
    t0 = time.monotonic()
    cluster.kill("sender-prefill0-r2")  # the rank's transferd agent dies (and with it the rank)
    prefill.procs[2].kill()
    st = poll_until_done([recv], timeout=30)[0]
    took = time.monotonic() - t0
    assert st == KVPoll.Failed
    with pytest.raises(KVTransferError) as ei:
        recv.failure_exception()
    assert "peer_lost" in str(ei.value) and "rank 2" in str(ei.value), str(ei.value)
    print(f"decode poll() reported Failed {took:.2f}s after rank 2 died (heartbeat deadline 5 × 0.2 s)")
    assert took < 10, f"Failed only after {took:.1f}s"
    for t in [*engine.kv, *engine.mamba, *engine.swa, *engine.aux]:
        assert not t.any()
    for r in (0, 1, 3):
        prefill.conns[r].send("go")
        prefill.expect(r, "room")
    prefill.finish()
    recv.clear()
    mgr.close()


def test_poll_is_one_round_trip_per_interval_for_every_room(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler polls every room on every loop: the backend answers them from one batched call."""
    rcfg, _ = start(cluster, cp=1)
    with rcfg.open("a") as fh:
        fh.write("poll_interval_s = 0.05\n")
    engine, mgr, receiver_cls = decode_engine(rcfg, monkeypatch)
    rooms = [Room(1000 + i, chunks=[[i]], dst_pages=[i], mamba_dst=i % 16, swa_dst=[i], aux_dst=i % 16)
             for i in range(16)]
    recvs = [expect_room(mgr, receiver_cls, room) for room in rooms]
    before = mgr.board.round_trips
    t0 = time.perf_counter()
    loops = 0
    while time.perf_counter() - t0 < 0.2:  # a scheduler loop: every room polled
        for r in recvs:
            assert r.poll() == KVPoll.Transferring
        loops += 1
    spent = time.perf_counter() - t0
    trips = mgr.board.round_trips - before
    polls = loops * len(recvs)
    print(f"{polls} polls in {spent * 1e3:.0f} ms: {spent / polls * 1e6:.1f} µs per room per poll, "
          f"{trips} round trips to the daemon")
    assert loops > trips, (loops, trips)
    assert trips <= spent / 0.05 + 2
    for r in recvs:
        r.abort()
        r.clear()
    mgr.close()
