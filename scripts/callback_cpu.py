"""Where a daemon's CPU goes, callback by callback, as the event loop runs them.

``python scripts/callback_cpu.py [--out DIR] -- COMMAND...`` runs ``COMMAND`` (``transferd bench
...``, ``transferd demo``, ``transferd launch ...``) with a ``sitecustomize`` on ``PYTHONPATH`` that
times, in every ``python -m transferd sender`` process the command starts, the main thread's CPU
(``time.thread_time``) spent in:

* each call of the control socket's readable callback (``LoopSocket._on_ready``), by the kinds of
  control message it handled (``ctrl:Assign+Bundle``, ``ctrl:Status``, ``ctrl:Ping``, ...;
  ``ctrl:none`` when it read nothing: the look after a send), and each engine API request
  (``engine_api``; in both daemons);
* the data stream's writes (``flush``: ``StreamWriter._flush``, the ``sendmsg`` calls and their
  bookkeeping) and its writable callbacks (``on_writable``, which flushes too; ``on_writable_own``:
  the same less its flushes);
* each step of a room's send loop (``room_steps_own``: ``RoomSender._send_room`` from one ``await``
  to the next, less the flushes it made);
* everything the thread spent from its first room to its exit (``total``), engine API calls and the
  clock's ticks included.

In every ``python -m transferd receiver`` process, the main thread's CPU spent in:

* the data streams' reads (``reads``: the ``recv_into``/``recvmsg_into`` calls, the kernel's copy
  into the rows) and their readable callbacks less those reads and less the record steps
  (``on_readable_own``: the read loop's bookkeeping);
* each record step (``record_steps``: a prefix, header or payload completed and acted on: the
  header's checks, decoding and claims, a payload's landing, a ``done``);
* the control socket's callbacks (``ctrl:Pong``, ...) and the engine API's requests, as in a sender;
* everything from its first data record to its exit (``total``).

Each process writes ``DIR/sender-PID.json`` or ``DIR/receiver-PID.json`` at exit; then this prints,
per sender that sent rooms, each figure per room (a rank-room at cp > 1) and per call, and per
receiver that read data records, each figure per data record (a record with a payload; at cp 8
in the bench, one per rank-room) and per call. The times are the callbacks' own, cold
caches and all: what a wake-up of an idle daemon costs, which ``timeit`` of the same code, warm,
does not show (docs/PERFORMANCE.md, issue 14's nineteenth round). The instrument costs ~1 µs a
timed call. Nothing of transferd is changed; nothing is timed when the variable is unset.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "TD_CALLBACK_CPU_DIR"  # not TRANSFERD_*: the bench passes those on as settings only

SITECUSTOMIZE = r'''
import os, sys
_out = os.environ.get("TD_CALLBACK_CPU_DIR")
# python -m transferd sender|receiver ... (or the transferd script)
_role = sys.argv[1] if _out and sys.argv[1:2] in (["sender"], ["receiver"]) else None
if _role:
    import atexit, collections.abc, json, time
    from collections import defaultdict
    _tt = time.thread_time
    _acc, _cnt, _t0, _kinds, _rooms = defaultdict(float), defaultdict(int), [None], [], set()

    def _note(key, t, f0=None):  # the CPU since t, less the flushes since f0 when given
        _acc[key] += _tt() - t - (0.0 if f0 is None else _acc["flush"] - f0)
        _cnt[key] += 1

    def _timed(cls, name, key, own=None):  # own: the same less the flushes it made
        f = getattr(cls, name)
        def w(*a, **k):
            t, f0 = _tt(), _acc["flush"]
            try:
                return f(*a, **k)
            finally:
                _note(key, t)
                if own:
                    _note(own, t, f0)
        setattr(cls, name, w)

    from transferd.transport.local_api import LocalApiServer
    from transferd.transport.loop_socket import LoopSocket

    _on_ready = LoopSocket._on_ready
    def on_ready(self):  # the control socket's callbacks, by the kinds of message they handled
        if "engine API" in self.name:
            return _on_ready(self)  # timed as engine_api, request by request
        del _kinds[:]
        t = _tt()
        try:
            return _on_ready(self)
        finally:
            _note("ctrl:" + ("+".join(sorted(set(_kinds))) or "none"), t)
    LoopSocket._on_ready = on_ready
    _timed(LocalApiServer, "_on_request", "engine_api")

    def _dump():
        _acc["total"] = _tt() - _t0[0] if _t0[0] is not None else 0.0
        if _role == "sender":
            _cnt["rooms"] = len(_rooms)
        with open(os.path.join(_out, f"{_role}-{os.getpid()}.json"), "w") as fh:
            json.dump({"argv": sys.argv, "seconds": _acc, "calls": _cnt}, fh)
    atexit.register(_dump)

if _role == "sender":
    from transferd.protocol.sender_core import SenderCore
    from transferd.sender.send import RoomSender
    from transferd.transport.data_stream import StreamWriter

    _received = SenderCore.received
    def received(self, cid, msg, now):
        _kinds.append(type(msg).__name__)
        return _received(self, cid, msg, now)
    SenderCore.received = received
    _timed(StreamWriter, "_flush", "flush")
    _timed(StreamWriter, "_on_writable", "on_writable", own="on_writable_own")

    class _TimedSteps(collections.abc.Coroutine):  # a room's send loop, step by step, less its flushes
        def __init__(self, coro):
            self._c = coro
        def send(self, value):
            t, f0 = _tt(), _acc["flush"]
            try:
                return self._c.send(value)
            finally:
                _note("room_steps_own", t, f0)
        def throw(self, *exc):
            return self._c.throw(*exc)
        def close(self):
            return self._c.close()
        def __await__(self):
            return self
        def __next__(self):
            return self.send(None)
    _send_room = RoomSender._send_room
    RoomSender._send_room = lambda self, room: _TimedSteps(_send_room(self, room))

    _pump = RoomSender.pump
    def pump(self, room_id):
        if _t0[0] is None:
            _t0[0] = _tt()
        _rooms.add(room_id)  # a room's send loop may start again (a chunk after the loop ended)
        return _pump(self, room_id)
    RoomSender.pump = pump

if _role == "receiver":
    import transferd.receiver.data as _data
    from transferd.receiver.data import DataPath
    from transferd.transport.data_stream import StreamReader

    _decode = _data.decode_header
    def decode_header(*a, **k):
        msg = _decode(*a, **k)
        _kinds.append(type(msg).__name__)
        return msg
    _data.decode_header = decode_header

    class _TimedSock:  # a stream's socket whose reads are timed (the kernel's copy into the rows)
        def __init__(self, sock):
            self._s = sock
        def __getattr__(self, name):
            return getattr(self._s, name)

    def _timed_read(name):
        def read(self, *a):
            t = _tt()
            try:
                return getattr(self._s, name)(*a)
            finally:
                _note("reads", t)
        return read
    _TimedSock.recv_into = _timed_read("recv_into")
    _TimedSock.recvmsg_into = _timed_read("recvmsg_into")

    _init = StreamReader.__init__
    def init(self, sock, *a, **k):
        _init(self, sock, *a, **k)
        self.sock = _TimedSock(sock)
    StreamReader.__init__ = init

    _on_readable = StreamReader._on_readable
    def on_readable(self):
        t, r0, s0 = _tt(), _acc["reads"], _acc["record_steps"]
        try:
            return _on_readable(self)
        finally:
            _acc["on_readable_own"] += _tt() - t - (_acc["reads"] - r0) - (_acc["record_steps"] - s0)
            _cnt["on_readable_own"] += 1
    StreamReader._on_readable = on_readable
    _timed(StreamReader, "_step", "record_steps")

    _record = DataPath.stream_record
    def stream_record(self, reader, header, payload_len):
        if payload_len and _t0[0] is None:
            _t0[0] = _tt()
        _cnt["data_records"] += bool(payload_len)
        return _record(self, reader, header, payload_len)
    DataPath.stream_record = stream_record
'''
assert ENV in SITECUSTOMIZE


# per role: the count each figure is divided by, and its words (a rank-room is a room at cp > 1)
UNITS = {"sender": ("rooms", "rooms", "room", "room"),
         "receiver": ("data_records", "data records", "record", "data record")}


def summary(out: Path) -> list[str]:
    """One block of lines per sender process that sent rooms (each figure per room), then per
    receiver process that read data records (per data record)."""
    lines = []
    for role, (count_key, plural, unit, first) in UNITS.items():
        for f in sorted(out.glob(f"{role}-*.json")):
            d = json.loads(f.read_text())
            secs, calls = d["seconds"], d["calls"]
            units = calls.get(count_key, 0)
            if not units:
                continue
            argv = d["argv"]
            who = f.stem if role != "sender" else \
                f"{f.stem} (rank {argv[argv.index('--cp-rank') + 1] if '--cp-rank' in argv else '?'})"
            lines.append(f"{who}: {units} {plural}, main thread {secs['total'] * 1e6 / units:.1f} µs a {unit} "
                         f"from its first {first} to its exit")
            for key in sorted(k for k in secs if k != "total"):
                n = calls.get(key, 0)
                if not n:
                    continue  # read, never timed (no flush in a process without a stream)
                lines.append(f"  {key:<36} {secs[key] * 1e6 / units:9.1f} µs/{unit} {n / units:7.2f} calls/{unit} "
                             f"{secs[key] * 1e6 / n:8.1f} µs/call")
    return lines


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: callback_cpu.py [--out DIR] -- COMMAND...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="callback_cpu.py")
    p.add_argument("--out", type=Path, default=None, help="where the processes' figures go (default: a new temp dir)")
    args = p.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if not command:
        print("callback_cpu.py: no command after --", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="callback-cpu-"))
    inject = out / "inject"
    inject.mkdir(parents=True, exist_ok=True)
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, **{ENV: str(out.resolve())})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(inject.resolve()), env.get("PYTHONPATH", "")) if p)
    rc = subprocess.call(command, env=env)
    lines = summary(out)
    print("\n".join(lines) if lines else f"callback_cpu.py: no daemon sent a room or read a record (figures in {out})")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
