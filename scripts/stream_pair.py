#!/usr/bin/env python3
"""The data stream's two ends alone against a plain TCP connection, on loopback.

    .venv/bin/python scripts/stream_pair.py [--records 64] [--rounds 7] [--send-buffer 524288]

A child process sends 8 MiB records of eight 1 MiB rows, scattered over a 256 MiB source, to
this process, which lands them in a 256 MiB shared mapping (touched once before, so no
first-touch faults): either transferd's StreamWriter -> StreamReader (uvloop, non-blocking,
the sender's SO_SNDBUF as given, the receiver's 4 MiB), or a blocking ``sendall`` of each row
-> ``recv_into`` 64 KiB at a time with the kernel's buffers (the bench's raw TCP limit). The two
alternate; each round prints GB/s and the receiver's and sender's CPU seconds per GB, then the
median of the paired ratios. No rooms, no engine, no ZeroMQ: what is left between the two is
the sockets' handling alone (issue 14's eighth round, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import resource
import socket
import statistics
import time

import uvloop

from transferd.protocol.stream import prefix
from transferd.transport.data_stream import (
    RECEIVE_BUFFER,
    RECV_CHUNK,
    StreamReader,
    StreamWriter,
    Target,
    tune_socket,
)

MiB = 1 << 20
ROWS = 8  # rows of 1 MiB a record
SPAN = 256  # MiB of source and of destination


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _row(i: int, j: int, step: int) -> int:
    return ((i * ROWS + j) * step % SPAN) * MiB


def _send(raw: bool, port: int, records: int, send_buffer: int, src: memoryview) -> None:
    if raw:
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(records):
            for j in range(ROWS):
                o = _row(i, j, 37)
                c.sendall(src[o:o + MiB])
        c.close()
        return

    async def main() -> None:
        w = StreamWriter("pair", lambda why: None, send_buffer)
        await w.connect("127.0.0.1", port, b"k" * 16, 5)
        header = b"h" * 40
        for i in range(records):
            bufs = [prefix(len(header), ROWS * MiB), header] + [src[_row(i, j, 37):][:MiB] for j in range(ROWS)]
            while not w.try_write(bufs):
                await w.writable()
            await asyncio.sleep(0)
        await w.writable()
        w.close()
    uvloop.run(main())


def _receive(raw: bool, rx: socket.socket, records: int, dst: memoryview) -> None:
    if raw:
        rx.setblocking(True)
        for i in range(records):
            for j in range(ROWS):
                o, got = _row(i, j, 53), 0
                while got < MiB:
                    n = rx.recv_into(dst[o + got:o + min(got + RECV_CHUNK, MiB)])
                    if not n:
                        raise SystemExit("the raw sender closed early")
                    got += n
        return

    async def main() -> None:
        done = asyncio.get_running_loop().create_future()
        landed = [0]

        class Rows:
            def stream_hello(self, reader: StreamReader, hello: bytes) -> bool:
                return True

            def stream_record(self, reader: StreamReader, header: bytes, payload_len: int) -> Target:
                i = landed[0]

                def fin() -> None:
                    landed[0] += 1
                    if landed[0] == records:
                        done.set_result(None)
                return Target([dst[_row(i, j, 53):][:MiB] for j in range(ROWS)], fin)

            def stream_closed(self, reader: StreamReader, reason: str) -> None:
                if not done.done():
                    done.set_exception(SystemExit(f"stream closed early: {reason}"))
        StreamReader(rx, "pair", Rows(), max_payload=ROWS * MiB, scratch=memoryview(bytearray(64)))
        await done
    uvloop.run(main())


def once(raw: bool, records: int, send_buffer: int, src: memoryview, dst: memoryview) -> tuple[float, float, float]:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        srv.close()
        try:
            _send(raw, port, records, send_buffer, src)
        finally:
            os._exit(0)
    rx, _ = srv.accept()
    srv.close()
    if not raw:
        tune_socket(rx, rcvbuf=RECEIVE_BUFFER)  # as the receiver tunes an accepted stream
    t0, c0 = time.perf_counter(), _cpu()
    _receive(raw, rx, records, dst)
    dt, dc = time.perf_counter() - t0, _cpu() - c0
    rx.close()
    _, status, ru = os.wait4(pid, 0)
    if status:
        raise SystemExit(f"the sender exited with status {status}")
    gb = records * ROWS * MiB / 1e9
    return gb / dt, dc / gb, (ru.ru_utime + ru.ru_stime) / gb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=64, help="8 MiB records a round (default 64: 512 MiB)")
    ap.add_argument("--rounds", type=int, default=7, help="paired rounds (default 7)")
    ap.add_argument("--send-buffer", type=int, default=512 << 10, help="the writer's SO_SNDBUF, 0 = autotuning")
    args = ap.parse_args()
    src = mmap.mmap(-1, SPAN * MiB)
    src.write(os.urandom(MiB) * SPAN)
    dst = mmap.mmap(-1, SPAN * MiB)  # shared with the child: no copy-on-write after the fork
    dst.write(b"\1" * (SPAN * MiB))
    pairs = []
    for _ in range(args.rounds):
        raw = once(True, args.records, args.send_buffer, memoryview(src), memoryview(dst))
        stream = once(False, args.records, args.send_buffer, memoryview(src), memoryview(dst))
        pairs.append((raw, stream))
        print(f"raw {raw[0]:.2f} GB/s (CPU s/GB: receiver {raw[1]:.3f}, sender {raw[2]:.3f})   "
              f"stream {stream[0]:.2f} GB/s ({stream[1]:.3f}, {stream[2]:.3f})   ratio {stream[0] / raw[0]:.3f}")
    print(f"stream / raw TCP, median of {args.rounds} paired rounds: "
          f"{statistics.median(s[0] / r[0] for r, s in pairs):.3f} (send buffer {args.send_buffer} bytes)")


if __name__ == "__main__":
    main()
