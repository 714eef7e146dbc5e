"""The baselines beside transferd: one-thread memcpy between two buffers of a shared-memory pool,
raw pyzmq PUSH/PULL and a raw TCP socket from a sender in its own process
(:func:`raw_zmq_sender_main`), and Mooncake Transfer Engine's TCP transport when it is importable
(:class:`Mooncake`, target :func:`mooncake_target_main`), eight raw TCP connections from
eight sender processes (:mod:`.raw_tcp`) into this one, beside the CP8 bulk rooms, and the raw
TCP pair: a sender and a receiver process of :mod:`.raw_tcp`, both idle between measurements. The limits'
pool holds the source in buffer 0 and the destination in buffer 1, as many bytes as a bulk
measurement."""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from ...daemon.malloc import keep_message_buffers_mapped
from ...errors import TransferdError
from ...layout import ModelSpec
from ...pool.shm import Pool, pool_path
from ...transport.data_stream import MULTI_RECV_CHUNK, RECV_CHUNK
from ...transport.planes.same_host import PoolFile, SameHostEngine, SameHostReceiver, cut, map_read_only, unmap
from ..procs import ProcessGroup, popen
from .plan import CP8, POISON, SIZES, Filler, MiB, Plan, cpu_seconds, cpu_since, repo_root
from .raw_tcp import CMD, PORT, recv_exact

RAW_TCP = str(Path(__file__).with_name("raw_tcp.py"))  # run as a script (standard library only)


def _cpu_per_gb(used: list[float] | None, nbytes: int) -> dict[str, float]:
    """A limit's CPU per GB of ``nbytes``: its receiver's (``used[0]``) and its senders' summed
    (the rest), from :func:`.plan.cpu_since`; nothing when a process could not be measured."""
    if used is None:
        return {}
    gb = nbytes / 1e9
    return {"receiver_cpu_s_per_gb": used[0] / gb, "sender_cpu_s_per_gb": sum(used[1:]) / gb}


class Limits:
    """The limits' pool, the raw sender process and its sockets, and the Mooncake peer."""

    def __init__(self, plan: Plan, tag: str) -> None:
        self.plan = plan
        self.tag = tag
        self.pool: Pool | None = None
        self.raw: subprocess.Popen[bytes] | None = None
        self.raw_ctx: zmq.Context[Any] | None = None
        self.pull: zmq.Socket[Any] | None = None
        self.ctrl: zmq.Socket[Any] | None = None
        self.tcp_listen: socket.socket | None = None
        self.tcp: socket.socket | None = None  # the raw TCP limit's receiving end
        self.x8_listen: socket.socket | None = None
        self.x8: list[subprocess.Popen[bytes]] = []  # the eight raw TCP senders (.raw_tcp)
        self.x8_socks: list[socket.socket] = []  # their connections' receiving ends
        self.procs: ProcessGroup | None = None
        self.pair_listen: socket.socket | None = None
        self.pair: list[subprocess.Popen[bytes]] = []  # the raw pair's receiver and sender (.raw_tcp)
        self.pair_ctrl: socket.socket | None = None  # the bench's connection to the pair's receiver
        self.mooncake: Mooncake | None = None

    @property
    def total(self) -> int:
        """Bytes of one measurement: those of a bulk run."""
        return self.plan.bulk_room_bytes * self.plan.bulk_rooms

    def start(self, procs: ProcessGroup, run_dir: Path, notes: dict[str, str]) -> None:
        """The pool, the raw sender (a child of ``procs``) and, when importable, Mooncake."""
        ring = self.total
        lim = ModelSpec(name="bench-limits", dtype="uint8", page_size=1, kv_layers=2, kv_format="mla",
                        kv_token_elems=MiB).layout(ring // MiB, 0, 1)
        self.pool = Pool.create(f"{self.tag}-limits", lim)
        # the baseline is tuned like the daemons: its receiver (here) and its sender keep message
        # buffers mapped (transferd/malloc.py)
        keep_message_buffers_mapped()
        self.procs = procs
        self._start_raw_sender(procs)
        self._start_x8_senders(procs)
        self._start_pair(procs)
        if importlib.util.find_spec("mooncake") is None:
            notes["peers"] = ("mooncake-transfer-engine-non-cuda is not installed: no Mooncake column "
                              "(pip install mooncake-transfer-engine-non-cuda; it needs Debian's libibverbs1)")
        else:
            try:
                self.mooncake = Mooncake(self.pool, run_dir)
            except Exception as exc:  # a peer that does not start is a note, not a failed bench
                notes["peers"] = f"mooncake is installed but did not start: {exc!r}"
                self.mooncake = None

    def fill(self) -> None:
        """The source bytes, and the destination touched once (no first-touch faults)."""
        assert self.pool is not None
        Filler(7).rows(self.pool.rows[0], range(self.pool.rows[0].shape[0]))
        self.pool.rows[1][:] = 0

    def _start_raw_sender(self, procs: ProcessGroup) -> None:
        assert self.pool is not None
        self.raw_ctx = zmq.Context()
        self.pull = self.raw_ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind("tcp://127.0.0.1:*")
        self.ctrl = self.raw_ctx.socket(zmq.PAIR)
        self.ctrl.setsockopt(zmq.LINGER, 0)
        self.ctrl.bind("tcp://127.0.0.1:*")
        self.tcp_listen = socket.create_server(("127.0.0.1", 0))
        self.tcp_listen.settimeout(60)
        argv = [sys.executable, "-c", "import sys; from transferd.tools.bench.peers import raw_zmq_sender_main as m; "
                "sys.exit(m(sys.argv[1:]))", self.ctrl.getsockopt_string(zmq.LAST_ENDPOINT),
                self.pull.getsockopt_string(zmq.LAST_ENDPOINT), self.pool.name,
                f"127.0.0.1:{self.tcp_listen.getsockname()[1]}"]
        self.raw = procs.spawn("raw-zmq-sender", argv, {}).proc

    def _start_x8_senders(self, procs: ProcessGroup) -> None:
        """The eight raw TCP senders: each maps buffer 0 of the pool and connects here."""
        assert self.pool is not None
        self.x8_listen = socket.create_server(("127.0.0.1", 0), backlog=CP8)
        self.x8_listen.settimeout(60)
        src = self.pool.rows[0]
        for k in range(CP8):
            argv = [sys.executable, RAW_TCP, "send", f"127.0.0.1:{self.x8_listen.getsockname()[1]}",
                    str(pool_path(self.pool.name)), str(self.pool.offsets[0]), str(src.nbytes)]
            self.x8.append(procs.spawn(f"raw-tcp-sender-{k}", argv, {}).proc)

    def _start_pair(self, procs: ProcessGroup) -> None:
        """The raw pair's receiver: it maps buffer 1 of the pool and connects here (its sender is
        started once it has said where to connect, :meth:`wait_ready`)."""
        assert self.pool is not None
        self.pair_listen = socket.create_server(("127.0.0.1", 0))
        self.pair_listen.settimeout(60)
        dst = self.pool.rows[1]
        argv = [sys.executable, RAW_TCP, "receive",
                str(self.pair_listen.getsockname()[1]), str(pool_path(self.pool.name)), str(self.pool.offsets[1]),
                str(dst.nbytes), str(RECV_CHUNK)]
        self.pair.append(procs.spawn("raw-tcp-pair-receiver", argv, {}).proc)

    def _pair_ready(self, check: Callable[[], None]) -> None:
        """The pair's receiver says its port; its sender is started and connects to it."""
        assert self.pool is not None and self.pair_listen is not None and self.procs is not None
        check()
        ctrl, _ = self.pair_listen.accept()
        ctrl.settimeout(60)
        ctrl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pair_ctrl = ctrl
        said = recv_exact(ctrl, PORT.size)
        if len(said) != PORT.size:
            raise TransferdError("bench: the raw tcp pair's receiver closed before it named its port")
        port = PORT.unpack(said)[0]
        src = self.pool.rows[0]
        argv = [sys.executable, RAW_TCP, "send", f"127.0.0.1:{port}",
                str(pool_path(self.pool.name)), str(self.pool.offsets[0]), str(src.nbytes)]
        self.pair.append(self.procs.spawn("raw-tcp-pair-sender", argv, {}).proc)
        check()
        if recv_exact(ctrl, 1) != b"r":
            raise TransferdError("bench: the raw tcp pair did not connect")
        ctrl.settimeout(30)

    def wait_ready(self, check: Callable[[], None]) -> None:
        """Until the raw sender says it is ready (``check`` raises if a child died meanwhile)."""
        assert self.ctrl is not None
        deadline = time.monotonic() + 60
        while not self.ctrl.poll(200):
            check()
            if time.monotonic() > deadline:
                raise TransferdError("bench: the raw zmq sender did not start")
        if self.ctrl.recv() != b"ready":
            raise TransferdError("bench: the raw zmq sender said something unexpected")
        assert self.tcp_listen is not None
        self.tcp, _ = self.tcp_listen.accept()  # it connected before it said ready
        self.tcp.settimeout(30)
        assert self.x8_listen is not None
        while len(self.x8_socks) < CP8:  # which sender a connection is does not matter: each gets a slice
            check()
            conn, _ = self.x8_listen.accept()
            conn.setblocking(False)
            self.x8_socks.append(conn)
        self._pair_ready(check)

    # -- subjects ------------------------------------------------------------------------
    def memcpy(self, key: str) -> dict[str, Any]:
        assert self.pool is not None
        size = SIZES[key]
        src, dst = self.pool.rows[0].reshape(-1), self.pool.rows[1].reshape(-1)
        ring = dst.size // size
        n = self.total // size
        t0 = time.perf_counter()
        for i in range(n):
            o = (i % ring) * size
            np.copyto(dst[o:o + size], src[o:o + size])
        dt = time.perf_counter() - t0
        return {"gbps": n * size / dt / 1e9}

    def pread(self, key: str) -> dict[str, Any]:
        """The same-host path's own ceiling: the same pieces as :meth:`memcpy`, read with
        ``preadv`` out of the pool's file (the kernel's copy out of the tmpfs page cache, page by
        page) into the mapped destination, as the receiver reads a same-host sender's rows
        without mapping them (FAULTS.md §8)."""
        assert self.pool is not None
        size = SIZES[key]
        dst = self.pool.rows[1].reshape(-1)
        mem, base = dst.data, self.pool.offsets[0]  # the source: buffer 0 in the pool's file
        ring = dst.size // size
        n = self.total // size
        fd = os.open(pool_path(self.pool.name), os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            for i in range(n):
                o = (i % ring) * size
                if os.preadv(fd, [mem[o:o + size]], base + o) != size:
                    raise TransferdError("bench: a short read from the limits pool's file")
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
        return {"gbps": n * size / dt / 1e9}

    def vm_read(self, key: str) -> dict[str, Any]:
        """The same-host path's threaded ceiling: the same pieces as :meth:`memcpy`, read the way
        the receiver reads large messages — :class:`SameHostEngine` (``process_vm_readv`` out of a
        read-only mapping of the pool's file), jobs of 8 MiB on two threads (the default
        ``receiver.same_host_read_threads``): the fastest copy that a peer shrinking its file
        cannot turn into SIGBUS."""
        assert self.pool is not None
        size = SIZES[key]
        dst = self.pool.rows[1].reshape(-1)
        addr, base = int(dst.ctypes.data), self.pool.offsets[0]
        n = min(self.total, dst.size) // size
        fd = os.open(pool_path(self.pool.name), os.O_RDONLY)
        end = base + n * size
        f = PoolFile(fd, map_read_only(fd, end), end)
        engine = SameHostEngine()
        engine.files["limits"] = f
        jobs = cut([addr + i * size for i in range(n)], [base + i * size for i in range(n)], [size] * n,
                   SameHostReceiver.JOB_BYTES)
        try:
            with ThreadPoolExecutor(2, thread_name_prefix="bench-vm-read") as ex:
                t0 = time.perf_counter()
                rcs = list(ex.map(lambda job: engine.read("limits", *job), jobs))
                dt = time.perf_counter() - t0
        finally:
            unmap(f.base, f.length)
            os.close(fd)
        if any(rcs) or not f.base or not engine.vm:
            raise TransferdError(f"bench: the process_vm_readv limit could not read the limits pool (rc {rcs[:4]})")
        return {"gbps": n * size / dt / 1e9}

    def _raw(self, key: str, how: str, receive: Callable[[np.ndarray, int, int], None]) -> dict[str, Any]:
        """One baseline measurement: the sender subprocess sends the bulk bytes in messages of
        ``key``'s size over ``how`` ("zmq" or "tcp"); ``receive(dst, size, n)`` takes them into
        the ring ``dst`` in this process. The CPU of both sides is read around it."""
        assert self.pool is not None and self.ctrl is not None and self.raw is not None
        size = SIZES[key]
        dst = self.pool.rows[1].reshape(-1)
        n = self.total // size
        pids = [os.getpid(), self.raw.pid]  # this process is the receiver (the bench is idle meanwhile)
        cpu0 = [cpu_seconds(pid) for pid in pids]
        t0 = time.perf_counter()
        self.ctrl.send(msgpack.packb([size, n, how]))
        receive(dst, size, n)
        dt = time.perf_counter() - t0
        if not self.ctrl.poll(30_000) or self.ctrl.recv() != b"sent":
            raise TransferdError(f"bench: the raw {how} sender did not confirm")
        return {"gbps": n * size / dt / 1e9, **_cpu_per_gb(cpu_since(pids, cpu0), n * size)}

    def raw_zmq(self, key: str) -> dict[str, Any]:
        """Raw pyzmq: PUSH/PULL, zero-copy sends, every frame copied into the ring."""
        assert self.pull is not None
        pull = self.pull

        def receive(dst: np.ndarray, size: int, n: int) -> None:
            ring = dst.size // size
            for i in range(n):
                buf = np.frombuffer(pull.recv(copy=False).buffer, dtype=np.uint8)
                if buf.size != size:
                    raise TransferdError(f"bench: raw zmq frame of {buf.size} bytes, expected {size}")
                o = (i % ring) * size
                np.copyto(dst[o:o + size], buf)
        return self._raw(key, "zmq", receive)

    def raw_tcp(self, key: str) -> dict[str, Any]:
        """The raw TCP limit: the same messages as ``raw_zmq`` through one plain TCP connection
        (``sendall`` out of the pool), received with ``recv_into`` straight into the ring of the
        destination pool: one kernel copy a side, no framing beyond the fixed size."""
        assert self.tcp is not None
        recv_into = self.tcp.recv_into

        def receive(dst: np.ndarray, size: int, n: int) -> None:
            ring, mem = dst.size // size, dst.data
            for i in range(n):
                o = (i % ring) * size
                view, got = mem[o:o + size], 0
                while got < size:
                    k = recv_into(view[got:got + RECV_CHUNK])
                    if not k:
                        raise TransferdError("bench: the raw tcp sender closed its connection")
                    got += k
        return self._raw(key, "tcp", receive)

    def raw_tcp_pair(self, key: str) -> dict[str, Any]:
        """The raw TCP pair: the same messages as ``raw_tcp`` on one plain TCP connection between
        two processes of their own (:mod:`.raw_tcp`), both idle since their last measurement, as
        transferd's daemons are; timed here from the command to the receiver's answer. CPU of
        both ends."""
        assert self.pair_ctrl is not None and len(self.pair) == 2
        size = SIZES[key]
        n = self.total // size
        pids = [p.pid for p in self.pair]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        t0 = time.perf_counter()
        self.pair_ctrl.sendall(CMD.pack(0, n * size, size))
        if recv_exact(self.pair_ctrl, 1) != b"d":
            raise TransferdError("bench: the raw tcp pair did not finish (see raw-tcp-pair-*.log)")
        dt = time.perf_counter() - t0
        return {"gbps": n * size / dt / 1e9, **_cpu_per_gb(cpu_since(pids, cpu0), n * size)}

    def raw_tcp_x8(self, key: str) -> dict[str, Any]:
        """Eight raw TCP connections into this one process, beside the CP8 bulk rooms: each of
        the eight sender processes sends its eighth of the bulk bytes in messages of ``key``'s
        size (``sendall`` out of the pool); this process takes them with non-blocking sockets and
        a selector, ``recv_into`` straight into that eighth of the destination ring, at most
        ``MULTI_RECV_CHUNK`` a read, as the data stream reads while several streams are in a
        payload. CPU of this process and of the eight
        senders summed, per GB."""
        assert self.pool is not None and len(self.x8_socks) == CP8
        size = SIZES[key]
        mem = self.pool.rows[1].reshape(-1).data
        share = self.total // CP8 // size * size
        socks = self.x8_socks
        got = [0] * CP8
        pids = [os.getpid()] + [p.pid for p in self.x8]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        sel = selectors.DefaultSelector()
        try:
            t0 = time.perf_counter()
            for k, s in enumerate(socks):
                if s.send(CMD.pack(k * share, share, size)) != CMD.size:
                    raise TransferdError("bench: a raw tcp x8 command did not fit the socket buffer")
                sel.register(s, selectors.EVENT_READ, k)
            left = CP8
            while left:
                events = sel.select(30.0)
                if not events:
                    raise TransferdError("bench: the raw tcp x8 senders went quiet")
                for ev, _ in events:
                    k = ev.data
                    s, base, n = socks[k], k * share, got[k]
                    try:
                        while n < share:  # until the socket is drained
                            r = s.recv_into(mem[base + n:base + min(n + MULTI_RECV_CHUNK, share)])
                            if not r:
                                raise TransferdError("bench: a raw tcp x8 sender closed its connection")
                            n += r
                    except BlockingIOError:
                        pass
                    got[k] = n
                    if n == share:
                        sel.unregister(s)
                        left -= 1
            dt = time.perf_counter() - t0
        finally:
            sel.close()
        nbytes = CP8 * share  # this process is the receiver (the bench is idle meanwhile); the eight senders summed
        return {"gbps": nbytes / dt / 1e9, "bytes": nbytes, **_cpu_per_gb(cpu_since(pids, cpu0), nbytes)}

    def mooncake_tcp(self, key: str, notes: dict[str, str]) -> dict[str, Any]:
        assert self.mooncake is not None and self.pool is not None
        verify = key not in self.mooncake.verified
        if verify:  # memcpy and raw zmq leave the same bytes there: start from a known other pattern
            self.pool.rows[1][:] = POISON
        total = self.total
        cpu0 = [cpu_seconds(os.getpid()), cpu_seconds(self.mooncake.proc.pid)]
        try:
            dt = self.mooncake.write(SIZES[key], total)
        except Exception as exc:
            notes["peers"] = f"mooncake tcp transfer failed: {exc}"
            return {"gbps": None}
        cpu1 = [cpu_seconds(os.getpid()), cpu_seconds(self.mooncake.proc.pid)]
        if verify:
            self.mooncake.mismatched += int(np.count_nonzero(self.pool.rows[1] != self.pool.rows[0]))
            self.mooncake.verified.add(key)
        out: dict[str, Any] = {"gbps": total / dt / 1e9}
        if None not in cpu0 and None not in cpu1:  # the initiator (this process) and the target
            out["initiator_cpu_s_per_gb"] = (cpu1[0] - cpu0[0]) / (total / 1e9)  # type: ignore[operator]
            out["target_cpu_s_per_gb"] = (cpu1[1] - cpu0[1]) / (total / 1e9)  # type: ignore[operator]
        return out

    # -- teardown ------------------------------------------------------------------------
    def stop_sender(self) -> None:
        """Ask the raw senders to exit (the process group stops them otherwise)."""
        for s in self.x8_socks:  # the eight raw TCP senders: the closed connection ends them
            s.close()
        self.x8_socks = []
        if self.pair_ctrl is not None:  # the pair's receiver, and with it its sender
            self.pair_ctrl.close()
            self.pair_ctrl = None
        for p in (*self.x8, *self.pair):
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass  # stopped with the daemons
        if self.ctrl is not None and self.raw is not None and self.raw.poll() is None:
            try:
                self.ctrl.send(msgpack.packb(None), flags=zmq.NOBLOCK)
                self.raw.wait(5)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass  # stopped with the daemons

    def close(self) -> None:
        """The sockets and the Mooncake peer (the pool stays: :meth:`remove_pool`)."""
        for s in (self.pull, self.ctrl):
            if s is not None:
                s.close(linger=0)
        for t in (self.tcp, self.tcp_listen, self.x8_listen, *self.x8_socks, self.pair_listen, self.pair_ctrl):
            if t is not None:
                t.close()
        if self.raw_ctx is not None:
            self.raw_ctx.term()
        if self.mooncake is not None:
            self.mooncake.close()

    def remove_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.unlink()


# -- the raw zmq sender (its own process) ---------------------------------------------------------

def raw_zmq_sender_main(argv: list[str]) -> int:
    """``python -c ... raw_zmq_sender_main(ctrl, data, pool, tcp_host:port)``: on each ``[size,
    count, "zmq"|"tcp"]`` from the control socket, send ``count`` messages of ``size`` bytes out of
    buffer 0 of the pool, zero-copy through ZeroMQ or ``sendall`` on a plain TCP connection;
    ``None`` ends it."""
    ctrl_ep, data_ep, pool_name, tcp_addr = argv
    keep_message_buffers_mapped()
    pool = Pool.attach(pool_name)
    src = pool.rows[0].reshape(-1)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(data_ep)
    ctrl = ctx.socket(zmq.PAIR)
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl.connect(ctrl_ep)
    host, _, port = tcp_addr.rpartition(":")
    tcp = socket.create_connection((host, int(port)))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = src.data
    ctrl.send(b"ready")
    try:
        while True:
            if not ctrl.poll(600_000):
                return 1  # the bench went away
            cmd = msgpack.unpackb(ctrl.recv())
            if not cmd:
                return 0
            size, count, how = int(cmd[0]), int(cmd[1]), cmd[2]
            ring = src.size // size
            send = tcp.sendall if how == "tcp" else partial(push.send, copy=False)
            for i in range(count):
                o = (i % ring) * size
                send(view[o:o + size])
            ctrl.send(b"sent")
    finally:
        tcp.close()
        del view
        push.close(linger=0)
        ctrl.close(linger=0)
        ctx.term()
        del src
        pool.close()


# -- Mooncake Transfer Engine (the peer column) ----------------------------------------------------

class Mooncake:
    """Mooncake Transfer Engine's TCP transport (P2P handshake, no metadata server), the peer column:
    this process writes buffer 0 of the limits' pool into buffer 1 as mapped by a target process
    (``mooncake_target_main``), in pieces of the message size, batches of at most 16 MiB."""

    def __init__(self, pool: Pool, run_dir: Path) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # its INFO lines would bury the table on stderr
        from mooncake.engine import TransferEngine

        self.verified: set[str] = set()
        self.mismatched = 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root()),
                                                                           os.environ.get("PYTHONPATH")]))}
        self.proc = popen(
            [sys.executable, "-c", "import sys; from transferd.tools.bench.peers import mooncake_target_main as m; "
             "sys.exit(m(sys.argv[1:]))", pool.name], env=env, log_path=run_dir / "logs" / "mooncake-target.log",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line:
                raise TransferdError("the mooncake target process exited before it was ready")
            info = json.loads(line)
            self.target, self.dst = f"127.0.0.1:{info['port']}", int(info["addr"])
            self.te = TransferEngine()
            if self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise TransferdError("TransferEngine.initialize failed")
            src = pool.rows[0]
            self.src, self.ring = int(src.ctypes.data), src.nbytes
            if self.te.register_memory(self.src, self.ring) != 0:
                raise TransferdError("TransferEngine.register_memory failed")
        except BaseException:
            self.close()
            raise

    def write(self, size: int, total: int) -> float:
        n = total // size
        batch = max(1, (16 * MiB) // size)
        slots = self.ring // size
        t0 = time.perf_counter()
        for b0 in range(0, n, batch):
            offs = [((b0 + i) % slots) * size for i in range(min(batch, n - b0))]
            rc = self.te.batch_transfer_sync_write(self.target, [self.src + o for o in offs],
                                                   [self.dst + o for o in offs], [size] * len(offs))
            if rc != 0:
                raise TransferdError(f"batch_transfer_sync_write returned {rc}")
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def mooncake_target_main(argv: list[str]) -> int:
    """The Mooncake target: maps the pool, registers buffer 1, prints ``{"port", "addr"}``, and
    serves until a line arrives on stdin."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from mooncake.engine import TransferEngine

    pool = Pool.attach(argv[0])
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        return 1
    dst = pool.rows[1]
    if te.register_memory(int(dst.ctypes.data), dst.nbytes) != 0:
        return 1
    print(json.dumps({"port": te.get_rpc_port(), "addr": int(dst.ctypes.data)}), flush=True)
    sys.stdin.readline()
    return 0
