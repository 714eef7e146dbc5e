"""The NIXL plane: the receiver reads the rows out of the sender's pool with a NIXL agent over
its UCX backend (TCP or shared memory on one host, RDMA on clusters), after its checks
(docs/DATA-PLANES.md, docs/PROTOCOL.md §5 and "NIXL").

It is the Mooncake plane with another engine behind the same seam. Both sides create a NIXL
agent and register their pool's buffers with it (host memory, ``DRAM``). ``register`` carries the
sender's agent metadata (``nixl_md``, bounded), its agent name (``te_session``) and the address
of each buffer (``te_addrs``); ``registered.te`` says the receiver will read. The sender sends
data-refs, as on the same host; the receiver loads the metadata (one agent per name: another
peer cannot replace what a name stands for) and pulls with the Mooncake plane's :class:`Reader`:

* **The receiver decides what is written.** A data-refs message passes the core's room checks,
  the source rows' range check against the sender's layout and the core's ``claim`` before one
  read is issued; NIXL reads exactly the claimed destination rows (one descriptor per run
  consecutive on both sides), and NIXL itself refuses a descriptor outside what the sender
  registered. The aux row goes through a staging row and its guard first.
* **Bounded.** Transfer requests of at most ``receiver.nixl_batch_entries`` descriptors, at most
  ``receiver.nixl_reads_in_flight`` at once.
* **Abort is a barrier.** The Reader's: no read starts for a room that ended; abort, release and
  wait answer once the room's reads in flight settled. A read past ``receiver.nixl_read_timeout_s``
  is cancelled (NIXL releases its request); one NIXL cannot cancel is waited for, never
  abandoned while it may still write.
* **Honest.** A read NIXL fails fails the room with ``transport_error`` naming the peer, its
  agent and NIXL's error (``NIXL_ERR_REMOTE_DISCONNECT`` when the sender is gone).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config import NIXL_MODULES
from ...errors import ConfigError, TransferdError
from ...types import PlaneName
from .mooncake import MooncakeReceiver, MooncakeSender
from .reads import Reader, ReadSink

log = logging.getLogger(__name__)

POLL_MAX_S = 0.001  # the longest pause between two looks at a transfer request's state
ERRORS_KEPT = 1024  # failed reads whose NIXL error is kept for their rooms' reasons


def _nixl_api() -> Any:
    """NIXL's Python API (``nixl_agent``), from the first wheel that imports."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines: several per agent; set it to see them
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ConfigError(f"data_plane = \"nixl\" needs NIXL: pip install 'transferd[nixl]' ({'; '.join(errors)})")


def nixl_error(exc: BaseException) -> str:
    """NIXL's words for a failure: its status name (``NIXL_ERR_…``) and the exception's class."""
    return f"{exc} ({type(exc).__name__})" if str(exc) else type(exc).__name__


@dataclass(slots=True, eq=False)
class _Remote:
    """A remote agent this engine has loaded: its metadata, the peers that use it, reads running."""

    md: bytes
    users: int = 1
    reads: int = 0


class NixlEngine:
    """One NIXL agent with a UCX backend, and the pool buffers registered with it.

    The agent is used from the event loop (peers' metadata) and from the reader's worker threads
    (reads), so it runs with NIXL's strict thread synchronisation. ``session`` is the agent's
    name, which peers use to name it."""

    def __init__(self, name: str, *, ucx_devices: str = "", ucx_modules: str = "^efa",
                 read_timeout_s: float = 30.0) -> None:
        if ucx_modules:
            # the wheel's UCX loads its EFA module, which links the system's libefa, libibverbs and a
            # second libnl beside the wheel's own copy: the process then crashes at exit in libnl's
            # destructor (docs/DATA-PLANES.md). The environment's own UCX_MODULES wins.
            os.environ.setdefault("UCX_MODULES", ucx_modules)
        api = _nixl_api()
        self.session = name
        self.read_timeout_s = read_timeout_s
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        try:
            self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=[], sync_mode=sync))
            if "UCX" not in self.agent.get_plugin_list():
                raise TransferdError(f"NIXL has no UCX plugin (plugins: {', '.join(self.agent.get_plugin_list())})")
            self.agent.create_backend("UCX", {"ucx_devices": ucx_devices} if ucx_devices else {})
        except TransferdError:
            raise
        except Exception as exc:
            raise TransferdError(f"NIXL agent {name!r} with a UCX backend did not start: {nixl_error(exc)}") from exc
        self._registered: list[Any] = []
        self._remotes: dict[str, _Remote] = {}
        self._lock = threading.RLock()  # _error takes it too, also from under it
        self._errors: dict[int, str] = {}  # failed reads' error ids -> NIXL's words (taken by describe)
        self._ids = itertools.count(1)

    # -- local memory ------------------------------------------------------------------------------
    def register(self, buffers: Sequence[np.ndarray]) -> tuple[int, ...]:
        """Register each buffer that has bytes (host memory); the address of each one's first row."""
        addrs = tuple(int(b.ctypes.data) for b in buffers)
        descs = [(addr, b.nbytes, 0, "") for addr, b in zip(addrs, buffers) if b.nbytes]
        if descs:
            try:
                self._registered.append(self.agent.register_memory(descs, "DRAM"))
            except Exception as exc:
                raise TransferdError(f"NIXL register_memory of {len(descs)} buffers failed: {nixl_error(exc)}") from exc
        return addrs

    def metadata(self) -> bytes:
        """This agent's metadata (its UCX addresses and registered memory), for ``register``."""
        return bytes(self.agent.get_agent_metadata())

    # -- remote agents (on the event loop) -----------------------------------------------------
    def add_peer(self, name: str, md: bytes) -> str | None:
        """Load a peer's agent metadata under ``name``; None, or why not. A name already loaded
        is shared only by identical metadata: no peer replaces what another's name stands for."""
        with self._lock:
            known = self._remotes.get(name)
            if known is not None:
                if known.md != md:
                    return f"NIXL agent {name!r} is already loaded here with other metadata"
                known.users += 1
                return None
            if name == self.session:
                return f"NIXL agent {name!r} is this receiver's own"
            try:
                got = self.agent.add_remote_agent(md)
            except Exception as exc:
                return f"NIXL could not load agent {name!r}'s metadata: {nixl_error(exc)}"
            got = got.decode("utf-8", "replace") if isinstance(got, bytes) else str(got)
            if got != name:
                self._forget(got)  # a name already loaded never gets here: loading it again fails in NIXL
                return f"the metadata is agent {got[:80]!r}'s, not {name!r}'s"
            self._remotes[name] = _Remote(md)
            return None

    def drop_peer(self, name: str) -> None:
        """A peer that used ``name`` left; the agent is unloaded once nobody uses it and no read
        of it runs (a running read is never pulled from under NIXL)."""
        with self._lock:
            known = self._remotes.get(name)
            if known is None:
                return
            known.users -= 1
            if known.users <= 0 and known.reads == 0:
                del self._remotes[name]
                self._forget(name)

    def _forget(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:
            log.warning("NIXL could not unload agent %r: %s", name, nixl_error(exc))

    # -- reads (on the reader's worker threads) --------------------------------------------------
    def read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        """One transfer request of reads from agent ``session`` (blocking): 0, or a negative id
        whose NIXL error :meth:`describe` gives."""
        with self._lock:
            known = self._remotes.get(session)
            if known is None or known.users <= 0:
                return self._error(f"NIXL agent {session!r} is not loaded (its peer left)")
            known.reads += 1
        try:
            return self._read(session, local, remote, lens)
        finally:
            with self._lock:
                known.reads -= 1
                if known.users <= 0 and known.reads == 0 and self._remotes.get(session) is known:
                    del self._remotes[session]
                    self._forget(session)

    def _read(self, session: str, local: list[int], remote: list[int], lens: list[int]) -> int:
        n = len(lens)
        loc = np.zeros((n, 3), np.uint64)
        rem = np.zeros((n, 3), np.uint64)
        loc[:, 0], loc[:, 1] = local, lens
        rem[:, 0], rem[:, 1] = remote, lens
        agent = self.agent
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(loc, "DRAM"), agent.get_xfer_descs(rem, "DRAM"),
                                           session)
        except Exception as exc:  # e.g. NIXL_ERR_NOT_FOUND: a descriptor outside what the peer registered
            return self._error(f"NIXL refused the transfer request: {nixl_error(exc)}")
        late = ""  # set once the read ran past the timeout and its cancelling began
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + self.read_timeout_s
            pause = 0.0
            while state == "PROC":
                if not late and time.monotonic() > deadline:
                    late = (f"NIXL read not done after {self.read_timeout_s:g} s (receiver.nixl_read_timeout_s): "
                            "cancelled")
                    try:
                        handle.release()  # cancels it: NIXL frees the request, no byte lands after this
                    except Exception as exc:  # NIXL began cancelling but the request lives on: wait for its end
                        log.warning("NIXL read from %r past %g s is being cancelled (%s): waiting for it to end",
                                    session, self.read_timeout_s, nixl_error(exc))
                    else:
                        return self._error(late)
                time.sleep(pause)  # UCX's progress thread moves the bytes; this only looks
                pause = min(POLL_MAX_S, pause * 2 or 0.00002)
                state = agent.check_xfer_state(handle)
            if late or state != "DONE":
                return self._error(late or f"NIXL transfer state {state}")
        except Exception as exc:  # NIXL_ERR_REMOTE_DISCONNECT and the like: raised by post or check
            return self._error(f"{late}: {nixl_error(exc)}" if late else nixl_error(exc))
        finally:
            try:
                handle.release()  # a no-op when the timeout released it
            except Exception as exc:
                log.warning("NIXL could not release a read's request: %s", nixl_error(exc))
        return 0

    def _error(self, what: str) -> int:
        rc = -next(self._ids)
        with self._lock:
            self._errors[rc] = what
            while len(self._errors) > ERRORS_KEPT:  # the oldest go: their rooms have heard by now
                del self._errors[next(iter(self._errors))]
        return rc

    def describe(self, rc: int) -> str:
        """NIXL's words for a failed read's ``rc`` (every job of the failed request asks)."""
        return self._errors.get(rc, f"NIXL read returned {rc}")

    def close(self) -> None:
        """Unload the peers and deregister the buffers (a peer's read of them fails from now on)."""
        with self._lock:
            for name in list(self._remotes):
                self._forget(name)
            self._remotes.clear()
        for reg in self._registered:
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:
                log.warning("NIXL deregister_memory failed: %s", nixl_error(exc))
        self._registered.clear()


# -- sender side -------------------------------------------------------------------------------

class NixlSender(MooncakeSender):
    """Data-refs (the same-host plane's messages); the receiver reads the rows they name with its
    NIXL agent. ``done`` follows them on the ZeroMQ socket."""

    name = PlaneName.NIXL

    def _count(self, nbytes: int) -> None:
        self.env.counters.nixl_bytes += nbytes


# -- receiver side -----------------------------------------------------------------------------

class NixlReceiver(MooncakeReceiver):
    """One peer's rows, read out of its pool by this receiver's NIXL agent (the Mooncake plane's
    checks, claim, reader and abort barrier; only the engine differs)."""

    name = PlaneName.NIXL

    def __init__(self, reader: Reader, sink: ReadSink, session: str, addrs: tuple[int, ...],
                 row_bytes: list[int], n_rows: list[int], label: str) -> None:
        super().__init__(reader, sink, session, addrs, row_bytes, n_rows, label)
        assert isinstance(reader.engine, NixlEngine)
        self.engine: NixlEngine = reader.engine

    def _failure(self, rc: int, nbytes: int) -> str:
        return (f"NIXL read of {nbytes} bytes from agent {self.session} ({self.label}) failed: "
                f"{self.engine.describe(rc)}")

    def close(self) -> None:
        self.engine.drop_peer(self.session)
