#!/usr/bin/env python3
"""Several data streams into one process, alone, against as many plain TCP connections.

    .venv/bin/python scripts/stream_fanin.py [--writers 8] [--rooms 8] [--rows 4] [--rounds 5]

The CP8 block of ``transferd bench`` without the daemons around the sockets: each of
``--writers`` child processes sends ``--rooms`` records of ``--rows`` scattered 1 MiB rows (a
CP8 rank's share of a bulk room), each followed by a payload-less record (its ``done``), through
transferd's StreamWriter (uvloop, the sender's default send buffer) into one StreamServer that
reads them straight into a shared destination; against it, the same rows sent by a blocking
``sendall`` of each row into one process reading non-blocking sockets with a selector, at most
``MULTI_RECV_CHUNK`` a read (the bench's ``raw_tcp_x8``). The two alternate; every round's
destination is checked byte for byte. Each round prints GB/s and CPU seconds per GB of the
receiving process and of the writers summed (each writer's own, from the go signal to its last
byte handed over), then the medians of the paired ratios. No rooms, no ZeroMQ, no engine: what
separates this from the bench's CP8 figures is the daemons' work around the streams
(issue 14's ninth round, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import resource
import selectors
import socket
import statistics
import time
import traceback
from typing import Any

import uvloop

from transferd.protocol.stream import prefix
from transferd.transport.data_stream import MULTI_RECV_CHUNK, SEND_BUFFER, StreamServer, StreamWriter, Target

MiB = 1 << 20
KEY = b"k" * 16


class Shape:
    def __init__(self, writers: int, rooms: int, rows: int) -> None:
        self.writers, self.rooms, self.rows = writers, rooms, rows
        self.span = writers * rooms * rows  # rows (MiB) of source and of destination

    def src_row(self, k: int, r: int, j: int) -> int:
        """Writer ``k``'s row ``j`` of room ``r``: scattered over the source."""
        return ((k * self.rooms + r) * self.rows + j) * 37 % self.span * MiB

    def dst_row(self, k: int, r: int, j: int) -> int:
        return ((k * self.rooms + r) * self.rows + j) * MiB


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _report(fd: int, since: float) -> None:
    os.write(fd, f"{_cpu() - since:15.6f}\n".encode())  # 16 bytes: one atomic pipe write


def _raw_writer(shape: Shape, k: int, port: int, src: memoryview, rep: int) -> None:
    c = socket.create_connection(("127.0.0.1", port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if c.recv(1) != b"g":
        raise SystemExit("no go signal")
    c0 = _cpu()
    for r in range(shape.rooms):
        for j in range(shape.rows):
            o = shape.src_row(k, r, j)
            c.sendall(src[o:o + MiB])
    _report(rep, c0)
    c.close()


def _stream_writer(shape: Shape, k: int, port: int, src: memoryview, rep: int, go: int, send_buffer: int) -> None:
    async def main() -> None:
        w = StreamWriter(f"writer {k}", lambda why: None, send_buffer)
        await w.connect("127.0.0.1", port, KEY, 5)
        if os.read(go, 1) != b"g":
            raise SystemExit("no go signal")
        c0 = _cpu()
        for r in range(shape.rooms):
            header = f"{k} {r}".encode()
            rows = [src[shape.src_row(k, r, j):][:MiB] for j in range(shape.rows)]
            for rec, small in (([prefix(len(header), shape.rows * MiB), header, *rows], False),
                               ([prefix(len(header), 0), header], True)):
                while not w.try_write(rec, small=small):
                    await w.writable()
                await asyncio.sleep(0)
        await w.writable()
        _report(rep, c0)
        await asyncio.sleep(0.05)  # the corked records of the last turn go at its end
        w.close()
    uvloop.run(main())


def _fork(fn: Any, *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()  # the parent then stops on the exit status
        finally:
            os._exit(code)
    return pid


def _receive_raw(shape: Shape, src: memoryview, dst: memoryview, rep: int) -> tuple[float, float, list[int]]:
    srv = socket.create_server(("127.0.0.1", 0), backlog=shape.writers)
    port = srv.getsockname()[1]
    pids = [_fork(_raw_writer, shape, k, port, src, rep) for k in range(shape.writers)]
    socks: dict[int, socket.socket] = {}
    for _ in range(shape.writers):  # which writer a connection is does not matter: check() tells by its rows
        conn, _ = srv.accept()
        socks[len(socks)] = conn
    srv.close()
    share = shape.rooms * shape.rows * MiB
    got = dict.fromkeys(socks, 0)
    sel = selectors.DefaultSelector()
    t0, c0 = time.perf_counter(), _cpu()
    for i, s in socks.items():
        s.setblocking(False)
        s.send(b"g")
        sel.register(s, selectors.EVENT_READ, i)
    left = len(socks)
    while left:
        events = sel.select(30.0)
        if not events:
            raise SystemExit("the raw writers went quiet")
        for ev, _ in events:
            i = ev.data
            s, n = socks[i], got[i]
            try:
                while n < share:
                    r = s.recv_into(dst[i * share + n:i * share + min(n + MULTI_RECV_CHUNK, share)])
                    if not r:
                        raise SystemExit("a raw writer closed early")
                    n += r
            except BlockingIOError:
                pass
            got[i] = n
            if n == share:
                sel.unregister(s)
                left -= 1
    dt, dc = time.perf_counter() - t0, _cpu() - c0
    sel.close()
    for s in socks.values():
        s.close()
    return dt, dc, pids


def _receive_stream(shape: Shape, src: memoryview, dst: memoryview, rep: int,
                    send_buffer: int) -> tuple[float, float, list[int]]:
    go_r, go_w = os.pipe()
    out: dict[str, Any] = {}

    async def main() -> None:
        fin = asyncio.get_running_loop().create_future()
        dones = [0]

        class Rows:
            def stream_hello(self, reader: Any, hello: bytes) -> bool:
                reader.peer = hello
                return hello.endswith(KEY)

            def stream_record(self, reader: Any, header: bytes, payload_len: int) -> Target:
                k, r = (int(x) for x in header.split())
                if not payload_len:
                    dones[0] += 1
                    if dones[0] == shape.writers * shape.rooms and not fin.done():
                        fin.set_result(None)
                    return Target([])
                return Target([dst[shape.dst_row(k, r, j):][:MiB] for j in range(shape.rows)])

            def stream_closed(self, reader: Any, reason: str) -> None:
                if dones[0] < shape.writers * shape.rooms and not fin.done():
                    fin.set_exception(SystemExit(f"a stream closed early: {reason}"))
        server = StreamServer("127.0.0.1", 0, Rows(), shape.rows * MiB)
        out["pids"] = [_fork(_stream_writer, shape, k, server.port, src, rep, go_r, send_buffer)
                       for k in range(shape.writers)]
        deadline = time.monotonic() + 30
        while sum(1 for r in server.readers if r.peer is not None) < shape.writers:
            if time.monotonic() > deadline:
                raise SystemExit("the stream writers did not connect")
            await asyncio.sleep(0.005)
        t0, c0 = time.perf_counter(), _cpu()
        os.write(go_w, b"g" * shape.writers)
        await asyncio.wait_for(fin, 60)
        out["dt"], out["dc"] = time.perf_counter() - t0, _cpu() - c0
        server.close()
    try:
        uvloop.run(main())
    finally:
        os.close(go_r)
        os.close(go_w)
    return out["dt"], out["dc"], out["pids"]


def once(raw: bool, shape: Shape, src: memoryview, dst: memoryview, send_buffer: int) -> tuple[float, float, float]:
    """One round: (GB/s, receiving process CPU s/GB, writers' summed CPU s/GB); the destination
    is checked byte for byte first."""
    dst[:] = b"\1" * len(dst)  # poisoned: a row that does not arrive cannot pass for one
    rep_r, rep_w = os.pipe()
    try:
        if raw:
            dt, dc, pids = _receive_raw(shape, src, dst, rep_w)
        else:
            dt, dc, pids = _receive_stream(shape, src, dst, rep_w, send_buffer)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if status:
                raise SystemExit(f"a writer exited with status {status}")
        writers = sum(float(os.read(rep_r, 16)) for _ in pids)
    finally:
        os.close(rep_r)
        os.close(rep_w)
    check(raw, shape, src, dst)
    gb = shape.span * MiB / 1e9
    return gb / dt, dc / gb, writers / gb


def check(raw: bool, shape: Shape, src: memoryview, dst: memoryview) -> None:
    """Every row where it belongs. Raw connections land a writer's rows in the order sent, in the
    share of whichever connection it was accepted as: each share must be one writer's rows."""
    share = shape.rooms * shape.rows
    rows = {bytes(src[shape.src_row(k, 0, 0):][:64]): k for k in range(shape.writers)}  # a writer by its first row
    for i in range(shape.writers):
        k = rows.get(bytes(dst[i * share * MiB:][:64]), -1) if raw else i
        for r in range(shape.rooms):
            for j in range(shape.rows):
                at = (i * share + r * shape.rows + j) * MiB if raw else shape.dst_row(k, r, j)
                if k < 0 or dst[at:at + MiB] != src[shape.src_row(k, r, j):][:MiB]:
                    raise SystemExit(f"{'raw' if raw else 'stream'}: writer {k} room {r} row {j} did not arrive intact")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, default=8, help="writer processes (default 8: a CP8 group)")
    ap.add_argument("--rooms", type=int, default=8, help="records a writer sends a round (default 8)")
    ap.add_argument("--rows", type=int, default=4, help="1 MiB rows a record (default 4: a CP8 rank's share of a "
                                                        "bench room)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    ap.add_argument("--send-buffer", type=int, default=SEND_BUFFER, help="the stream writers' SO_SNDBUF")
    args = ap.parse_args()
    shape = Shape(args.writers, args.rooms, args.rows)
    src = mmap.mmap(-1, shape.span * MiB)
    for i in range(shape.span):  # every row different: a row landing in the wrong place shows
        src[i * MiB:(i + 1) * MiB] = (os.urandom(4096) + i.to_bytes(8, "little")) * (MiB // 4104) + bytes(
            MiB % 4104)
    dst = mmap.mmap(-1, shape.span * MiB)  # shared with the children: no copy-on-write after a fork
    pairs = []
    for _ in range(args.rounds):
        raw = once(True, shape, memoryview(src), memoryview(dst), args.send_buffer)
        stream = once(False, shape, memoryview(src), memoryview(dst), args.send_buffer)
        pairs.append((raw, stream))
        print(f"raw {raw[0]:.2f} GB/s (CPU s/GB: receiver {raw[1]:.3f}, writers {raw[2]:.3f})   "
              f"stream {stream[0]:.2f} GB/s ({stream[1]:.3f}, {stream[2]:.3f})   "
              f"ratio {stream[0] / raw[0]:.3f}, writers' CPU {stream[2] / raw[2]:.3f}", flush=True)
    print(f"{shape.writers} streams / {shape.writers} raw TCP connections, medians of {args.rounds} paired rounds: "
          f"GB/s {statistics.median(s[0] / r[0] for r, s in pairs):.3f}, "
          f"writers' CPU per GB {statistics.median(s[2] / r[2] for r, s in pairs):.3f}, "
          f"receiver's CPU per GB {statistics.median(s[1] / r[1] for r, s in pairs):.3f}; "
          f"every row intact ({shape.span} MiB a round)")


if __name__ == "__main__":
    main()
