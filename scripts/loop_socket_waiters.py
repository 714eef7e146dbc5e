#!/usr/bin/env python3
"""Many rooms' sends waiting behind one ZeroMQ socket's full pipe: CPU and wake-ups a message.

    .venv/bin/python scripts/loop_socket_waiters.py [--waiters 1 16 128 1024] [--messages 20000]

``--waiters`` coroutines on one uvloop share ``--messages`` messages of 64 KiB, each sent with
:meth:`LoopSocket.try_send` and, while the high-water mark (4 messages) holds it back, a wait on
:meth:`LoopSocket.writable` — the ZeroMQ plane's send path (``data_stream = "off"``, or CURVE),
with one room per coroutine. A DEALER sends over loopback TCP to a ROUTER in a child process
that reads as fast as it can. Prints, per count of waiters, this process's CPU per message,
the waits resumed per message, and the wall time. Every message is counted at the reader.

With every waiter woken whenever the pipe takes messages again (transferd before issue 14's
twenty-first round), the resumed waits grow with the waiters (≈ 36 a message at 1,024, 250 µs of
CPU a message); with one woken at a time they stay near one a message (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import time

import zmq

from transferd.transport.loop_socket import LoopSocket, configure

PAYLOAD = 64 << 10
HWM = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reader(port: int, total: int, ready: mp.synchronize.Event, got: mp.sharedctypes.Synchronized) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    n = 0
    while n < total:
        _, body = sock.recv_multipart(copy=False)
        assert len(body) == PAYLOAD
        n += 1
    got.value = n
    sock.close()
    ctx.term()


async def send_all(port: int, waiters: int, each: int) -> tuple[float, float, float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    configure(sock, hwm=HWM)
    sock.connect(f"tcp://127.0.0.1:{port}")
    link = LoopSocket(sock, lambda frames: None, "waiters")
    payload = b"x" * PAYLOAD
    resumed = 0

    async def room() -> None:
        nonlocal resumed
        for _ in range(each):
            while not link.try_send([payload]):
                await link.writable()
                resumed += 1

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(room() for _ in range(waiters)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    link.close(linger=10_000)  # every message queued reaches the reader
    ctx.term()
    n = waiters * each
    return cpu / n * 1e6, resumed / n, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waiters", type=int, nargs="+", default=[1, 16, 128, 1024])
    ap.add_argument("--messages", type=int, default=20_000)
    args = ap.parse_args()
    import uvloop

    for waiters in args.waiters:
        each = max(1, args.messages // waiters)
        port, ready, got = free_port(), mp.Event(), mp.Value("q", 0)
        child = mp.Process(target=reader, args=(port, waiters * each, ready, got))
        child.start()
        if not ready.wait(30):
            raise SystemExit("the reader did not start")
        cpu, resumed, wall = uvloop.run(send_all(port, waiters, each))
        child.join(60)
        if got.value != waiters * each:
            raise SystemExit(f"the reader got {got.value} messages of {waiters * each}")
        print(f"waiters {waiters:5d}: {cpu:6.1f} µs CPU a message, {resumed:6.2f} waits resumed a message, "
              f"{wall:5.2f} s", flush=True)


if __name__ == "__main__":
    main()
