"""The prefill-side sender agent of one CP rank: a shell around
:class:`~transferd.protocol.sender_core.SenderCore`.

It registers with every configured receiver, learns each room's destinations from the receiver
that expects it (``assign``), and streams what the shared policy says this rank sends: its KV
slice (coalesced runs, zero-copy out of the pool, ≤ ``max_message_bytes`` per message), the
replicated state only if the de-dup leaves it to this rank, the aux row on rank 0, then ``done``.
The decisions are the core's; this module owns the lifecycle, the engine API, the clock that
feeds ``tick``, and carries out the core's actions (sockets in :mod:`.conn`, the send loop in
:mod:`.send`, the rows' way out in ``transport/planes``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from typing import Any

from .. import __version__
from ..config import Config
from ..daemon.accounting import Accounting
from ..daemon.base import AgentBase
from ..errors import UnknownRoom
from ..layout import PoolLayout
from ..pool import Pool, host_boot_id
from ..protocol.checksum import checksum_function
from ..protocol.messages import PROTOCOL_VERSION, Register
from ..protocol.room import RoomState, RoomStatus
from ..protocol.sender_core import (
    TERMINAL_RETENTION,
    Action,
    Count,
    DropStream,
    Note,
    Pump,
    RoomEnded,
    SendControl,
    SenderCore,
    UsePlane,
)
from ..transport.curve import load_keypair, load_public_key
from ..transport.local_api import LocalApiServer
from ..transport.planes import MooncakeEngine, NixlEngine, SendEnv, local_hostname
from ..types import AutoOff, ConnState, DataPlane, SplitMode
from . import api
from .conn import Connections
from .send import RoomSender

log = logging.getLogger(__name__)

__all__ = ["TERMINAL_RETENTION", "SenderAgent"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class SenderAgent(AgentBase):
    def __init__(self, cfg: Config, *, pool: Pool | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        s = cfg.sender
        self.scfg = s
        self.group, self.rank, self.cp_size = s.group, s.cp_rank, s.cp_size
        self.split = SplitMode.parse(s.split)
        self.name = f"sender {s.group}/r{s.cp_rank}"
        self.layout: PoolLayout = pool.layout if pool is not None else cfg.sender_layout()
        self.pool = pool
        self._own_pool = False
        self.incarnation = random.getrandbits(63)
        self.acct = Accounting()
        self.engine_endpoint = ""
        self.metrics_bind = s.metrics_bind
        self.metrics_port_offset = s.cp_rank
        self.drain_timeout_s = s.drain_timeout_s
        self.engine: MooncakeEngine | NixlEngine | None = None  # sender.data_plane = "mooncake"/"nixl": the pool registered with it
        self.te_addrs: tuple[int, ...] = ()
        self.core = self._new_core()
        self.waiters: dict[int, list[asyncio.Future[None]]] = {}
        self.conns: Connections | None = None
        self.sender: RoomSender | None = None

    def _biggest_message(self) -> int:
        """``register.max_msg``: the largest data message, or data-stream record, this sender sends."""
        s = self.scfg
        return max(s.max_message_bytes, s.stream_record_bytes if s.data_stream == AutoOff.AUTO else 0)

    def _new_core(self) -> SenderCore:
        s, pool = self.scfg, self.pool
        register = Register(self.group, self.rank, self.cp_size, self.split.value, self.layout.fingerprint(),
                            self.layout.to_wire(), self.incarnation, os.getpid(), socket.gethostname(), 0, s.checksum,
                            host_boot_id(), pool.name if s.same_host == AutoOff.AUTO and pool else "",
                            pool.pool_id if pool else 0, self._biggest_message(), s.dedup, False,
                            self.engine.session if self.engine else "", self.te_addrs,
                            self.engine.metadata() if isinstance(self.engine, NixlEngine) else b"")
        return SenderCore(self.layout, group=self.group, rank=self.rank, cp_size=self.cp_size, split=self.split,
                          dedup=s.dedup, heartbeat_interval_s=s.heartbeat_interval_s,
                          heartbeat_misses=s.heartbeat_misses, assign_timeout_s=s.assign_timeout_s,
                          pool_name=pool.name if pool else "", register=register)

    # -- lifecycle -----------------------------------------------------------------------
    async def _start(self) -> None:
        assert self.ctx is not None and self.zctx is not None
        if self.pool is None:
            self.pool, self._own_pool = Pool.open(self.cfg.sender_pool_name(), self.layout,
                                                  create=self.scfg.create_pool, sealed=self.scfg.sealed_pool)
            self.layout = self.pool.layout
        if self.scfg.data_plane is DataPlane.MOONCAKE:
            s = self.scfg
            self.engine = MooncakeEngine(local_hostname(s.mooncake_hostname, s.receivers[0]), s.mooncake_protocol,
                                         s.mooncake_device)
            self.te_addrs = self.engine.register(self.pool.rows)
            log.info("%s: Mooncake TE (%s) at %s offers this pool to receivers' reads", self.name,
                     s.mooncake_protocol, self.engine.session)
        elif self.scfg.data_plane is DataPlane.NIXL:
            s = self.scfg
            self.engine = NixlEngine(f"transferd-{self.group}-r{self.rank}-{self.incarnation:016x}",
                                     ucx_devices=s.nixl_ucx_devices, ucx_modules=s.nixl_ucx_modules)
            self.te_addrs = self.engine.register(self.pool.rows)
            log.info("%s: NIXL agent %s (UCX) offers this pool to receivers' reads", self.name, self.engine.session)
        self.core = self._new_core()  # now with the pool's name, id and layout (and engine)
        s, faults = self.scfg, self.cfg.faults
        env = SendEnv(self.layout, self.pool.rows, self.acct, s.max_message_bytes, s.shm_message_bytes,
                      s.stream_record_bytes, checksum_function(s.checksum), faults,
                      random.Random(faults.seed * 1000 + s.cp_rank))
        self.conns = Connections(self.name, s, self.core, self.acct, env, self.spawn, self._act)
        self.sender = RoomSender(self.name, self.rank, self.layout, self.core, self.conns, self.acct, self.spawn,
                                 self._act)
        ident = f"{self.group}/{self.rank}/{self.incarnation:016x}".encode()
        keys = None
        if s.curve_secret_key:
            keys = (*load_keypair(s.curve_secret_key, "sender.curve_secret_key"),
                    load_public_key(s.curve_server_key, "sender.curve_server_key"))
        self.conns.open(self.zctx, self.ctx, ident, keys)
        self.api = LocalApiServer(self.zctx, self.cfg.sender_engine_socket(), api.handlers(self), self.name,
                                  self.acct.refused)
        self.engine_endpoint = self.api.bound
        self.spawn(self.api.run(), "engine-api")
        self.spawn(self._tick_loop(), "tick")
        self.spawn(self._ready_when_registered(), "ready")
        log.info("%s: cp %d/%d split %s, receivers %s, engine API on %s, pool %s", self.name, self.rank,
                 self.cp_size, self.split.value, ", ".join(s.receivers), self.engine_endpoint, self.pool.name)

    def _registered(self) -> int:
        return sum(1 for c in self.core.conns.values() if c.state is ConnState.REGISTERED)

    async def _ready_when_registered(self, limit_s: float = 10.0) -> None:
        """Ready once registered with every receiver — or after ``limit_s`` with a receiver
        missing (a receiver that is down must not keep the prefill side from starting)."""
        assert self.ready is not None
        deadline = time.monotonic() + limit_s
        while self._registered() < len(self.core.conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.ready.set()

    async def _tick_loop(self) -> None:
        """The core's clocks (heartbeat deadline, registering again, the ending barrier's and the
        assign deadline), every half heartbeat interval."""
        while True:
            await asyncio.sleep(self.scfg.heartbeat_interval_s / 2)
            self.core.tick(time.monotonic())
            self._act()

    async def _close(self) -> None:
        self.core.shutdown(f"shutting down: sender {self.group}/r{self.rank} stopped before the room ended",
                           time.monotonic())
        self._act()
        await asyncio.sleep(0.05)  # let the engines' pending waits and the fail messages go out
        if hasattr(self, "api"):
            self.api.close()
        if self.conns is not None:
            self.conns.close()
        if self.engine is not None:  # receivers' reads of the pool fail from now on
            self.engine.close()
        if self.pool is not None and self._own_pool:
            self.pool.unlink()  # the name goes now; the mapping stays until the context is gone

    def _after_context(self) -> None:
        if self.pool is not None:
            self.pool.close()  # no I/O thread can still be sending rows out of it

    # -- the core's actions ----------------------------------------------------------------
    def _act(self) -> None:
        """Carry out what the core queued, in order."""
        actions = self.core.take()
        while actions:
            for a in actions:
                self._do(a)
            actions = self.core.take()

    def _do(self, a: Action) -> None:
        conns = self.conns
        if isinstance(a, SendControl):
            assert conns is not None
            if a.reliable:
                conns.send_reliable(int(a.conn), a.msg)
            else:
                conns.send_ctrl(int(a.conn), a.msg)
        elif isinstance(a, Pump):
            assert self.sender is not None
            self.sender.pump(a.room)
        elif isinstance(a, RoomEnded):
            self._room_ended(a)
        elif isinstance(a, Count):
            getattr(self.acct, a.counter)[a.key] += 1
        elif isinstance(a, Note):
            log.log(_LEVELS[a.level], "%s: %s", self.name, a.text)
        elif isinstance(a, UsePlane):
            assert conns is not None
            conns.use_plane(int(a.conn), a.plane, a.stream_port, a.stream_key)
        elif isinstance(a, DropStream):
            assert conns is not None
            conns.drop_stream(int(a.conn))

    def _room_ended(self, a: RoomEnded) -> None:
        st = a.status
        self.metrics.observe(st.state.value, time.monotonic() - a.created)
        self.acct.rooms[st.state.value] += 1
        if st.state is RoomState.FAILED:
            self.acct.failures[st.code] += 1
            log.warning("%s: room %d failed (%s): %s", self.name, a.room, st.code, st.reason)
        for fut in self.waiters.pop(a.room, ()):
            if not fut.done():
                fut.set_result(None)

    # -- engine API ----------------------------------------------------------------------
    def submit(self, room_id: int, start: int, src_pages: tuple[int, ...], *, last: bool = False,
               state: dict[str, tuple[int, ...]] | None = None, aux_slot: int | None = None) -> RoomStatus:
        """Queue one chunk of a room: source pages for positions ``[start, start + len)``; the last
        chunk also names the state slots and the aux slot. Every index is checked first."""
        if room_id not in self.core.rooms:
            self.refuse_if_draining()
        status = self.core.submit(room_id, start, src_pages, last=last, state=state, aux_slot=aux_slot,
                                  now=time.monotonic())
        self._act()
        return status

    def abort(self, room_id: int, reason: str = "") -> RoomStatus:
        status = self.core.abort(room_id, reason, time.monotonic())
        self._act()
        return status

    def poll(self, room_id: int) -> RoomStatus:
        room = self.core.lookup(room_id)
        if room is None:
            raise UnknownRoom(f"room {room_id} is not known to {self.name}")
        return room.status

    async def wait(self, room_id: int, timeout_s: float) -> RoomStatus:
        room = self.core.lookup(room_id)
        if room is None:
            raise UnknownRoom(f"room {room_id} is not known to {self.name}")
        if not room.status.state.terminal:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            waiters = self.waiters.setdefault(room_id, [])
            waiters.append(fut)
            try:
                await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters and self.waiters.get(room_id) is waiters:
                    del self.waiters[room_id]
        return room.status

    def ping_info(self) -> dict[str, Any]:
        return {"name": self.name, "pid": os.getpid()}

    # -- introspection -------------------------------------------------------------------
    def live_rooms(self) -> int:
        return len(self.core.rooms)

    def status_line(self) -> str:
        return (f"sender {self.group}/r{self.rank}: {len(self.core.rooms)} rooms in flight; registered with "
                f"{self._registered()}/{len(self.core.conns)} receivers; "
                f"{sum(self.acct.bytes.values()) / 1e9:.3f} GB sent")

    def metric_snapshot(self) -> dict[str, Any]:
        live: dict[str, int] = {}
        in_flight = 0
        for r in list(self.core.rooms.values()):
            live[r.status.state.value] = live.get(r.status.state.value, 0) + 1
            if r.status.state is RoomState.TRANSFERRING:
                in_flight += max(0, sum(r.planned) - r.sent)
        out = self.acct.snapshot()
        out.update(role="sender", live=live, in_flight=in_flight, registered={self.group: self._registered()},
                   info={"role": "sender", "group": self.group, "rank": str(self.rank), "cp_size": str(self.cp_size),
                         "version": __version__, "protocol": str(PROTOCOL_VERSION)})
        return out

    def stats(self) -> dict[str, Any]:
        out = self.acct.snapshot()
        out.update(role="sender", group=self.group, rank=self.rank, cp_size=self.cp_size, split=self.split.value,
                   pid=os.getpid(), incarnation=self.incarnation, engine_endpoint=self.engine_endpoint,
                   metrics_port=self.metrics.port, uptime_s=round(time.time() - self.t_start, 3),
                   draining=self.draining)
        return out

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        by_state: dict[str, int] = {}
        for room in (*self.core.rooms.values(), *self.core.ended.values()):
            by_state[room.status.state.value] = by_state.get(room.status.state.value, 0) + 1
        return {
            "role": "sender", "group": self.group, "rank": self.rank, "cp_size": self.cp_size,
            "split": self.split.value, "host": socket.gethostname(), "pid": os.getpid(),
            "incarnation": self.incarnation, "layout_fingerprint": self.layout.fingerprint(),
            "receivers": [{"endpoint": c.endpoint, "state": c.state.value, "receiver": c.receiver, "reason": c.reason,
                           "last_heard_s": round(now - c.last_heard, 3) if c.last_heard else None}
                          for c in self.core.conns.values()],
            "rooms": by_state,
            "stats": self.stats(),
        }
