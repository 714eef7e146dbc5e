"""SGLang's transfer-backend classes over transferd: the manager, the prefill sender and the decode
receiver that ``get_kv_class`` returns for ``--disaggregation-transfer-backend transferd``.

Each scheduler process (one per prefill CP rank, one per decode rank) holds one
:class:`TransferdKVManager`: a client of its local transferd daemon (the rank's sender agent on
prefill, the host's receiver on decode), the daemon's pool attached, and the staging copies
between the engine's buffers and that pool. SGLang calls every sender and receiver method on the
scheduler's main thread; nothing here starts a thread.

The mapping of SGLang's calls (docs/ENGINES.md has the full table):

* prefill ``init(num_pages, aux_index)`` and ``send(page_indices, state_indices)`` per chunk →
  the rank's own pages (transferd's policy: pages split, replicated state and aux from rank 0)
  gathered into the pool, then ``submit(room, start, pages, last, state, aux_slot)``;
* decode ``init(prefill_dp_rank)`` resolves the transferd group from the request's bootstrap
  address (``[sglang] groups``); ``send_metadata`` → ``expect``;
* ``poll()`` → ``KVPoll`` from one batched status call per ``poll_interval_s`` for every live room
  of the process; on decode, Success is reported only after the room's rows are scattered into the
  engine's buffers;
* ``failure_exception()`` raises SGLang's ``KVTransferError`` with transferd's code and reason;
  ``abort()`` → abort, ``clear()`` → release (decode).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode

from ... import config as config_mod
from ...client import DecodeClient, PrefillClient
from ...config import Config
from ...errors import ConfigError, TransferdError, UnknownRoom
from ...pool.shm import Pool
from ...protocol.policy import rank_plan
from ...protocol.room import RoomState, RoomStatus
from .kvmap import EngineMap, check_tp, map_kv_args
from .staging import Staging

log = logging.getLogger("transferd.sglang")

_KVPOLL = {RoomState.BOOTSTRAPPING: KVPoll.Transferring, RoomState.WAITING: KVPoll.Transferring,
           RoomState.TRANSFERRING: KVPoll.Transferring, RoomState.SUCCESS: KVPoll.Success,
           RoomState.FAILED: KVPoll.Failed}


def load_config() -> Config:
    """The daemon's configuration file, named by ``TRANSFERD_CONFIG`` (the same file the local
    daemon reads: it names the engine socket, the pool and its layout, and the [sglang] section)."""
    path = os.environ.get("TRANSFERD_CONFIG")
    if not path:
        raise ConfigError("the transferd SGLang backend needs TRANSFERD_CONFIG: the path of the transferd "
                          "configuration file of this node (the file its daemon runs with)")
    return config_mod.load(path)


def _parallel() -> dict[str, Any]:
    """This scheduler's ranks from SGLang's runtime context (what its launcher published)."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    out: dict[str, Any] = {}
    for name, default in (("attn_cp_rank", None), ("attn_cp_size", None), ("attn_tp_rank", 0),
                          ("attn_tp_size", 1), ("attn_dp_rank", 0), ("pp_size", 1),
                          ("enable_dsa_cache_layer_split", False), ("enable_kv_cache_sharding", False),
                          ("enable_cp_tp_group_sharing", False)):
        try:
            out[name] = getattr(p, name)
        except Exception:
            out[name] = default
    return out


class StatusBoard:
    """Every live room's transferd status, refreshed by one batched ``poll`` per interval.

    The scheduler polls every room on every loop; this turns N polls per loop into at most one
    round trip per ``interval`` for all of them."""

    def __init__(self, client: PrefillClient | DecodeClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.calls: dict[Any, dict[str, Any]] = {}
        self.status: dict[Any, RoomStatus] = {}
        self._at = 0.0
        self.round_trips = 0

    def watch(self, key: Any, call: dict[str, Any]) -> None:
        self.calls[key] = call
        self._at = 0.0  # a new room: the next poll asks

    def forget(self, key: Any) -> None:
        self.calls.pop(key, None)
        self.status.pop(key, None)

    def get(self, key: Any) -> RoomStatus | None:
        st = self.status.get(key)
        if st is not None and st.state.terminal:
            return st
        now = time.monotonic()
        if now - self._at >= self.interval:
            self.refresh()
            self._at = time.monotonic()
        return self.status.get(key)

    def refresh(self) -> None:
        keys = [k for k in self.calls if not (k in self.status and self.status[k].state.terminal)]
        if not keys:
            return
        try:
            answers = self.client.batch([self.calls[k] for k in keys])
        except TransferdError as exc:  # the daemon is gone or does not answer: every room fails
            for k in keys:
                self.status[k] = RoomStatus(RoomState.FAILED, exc.code, f"transferd daemon: {exc}")
            return
        finally:
            self.round_trips += 1
        for k, a in zip(keys, answers):
            if isinstance(a, TransferdError):
                self.status[k] = RoomStatus(RoomState.FAILED, a.code, str(a))
            else:
                self.status[k] = RoomStatus.from_wire(a)


class TransferdKVManager(BaseKVManager):  # type: ignore[misc]  # SGLang ships no type hints
    """One per scheduler process: the daemon client, the attached pool and the staging copies."""

    supports_host_destination = False

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.cfg = load_config()
        par = _parallel()
        self.parallel = par
        for flag, what in (("enable_dsa_cache_layer_split", "--enable-dsa-cache-layer-split"),
                           ("enable_kv_cache_sharding", "KV cache sharding"),
                           ("enable_cp_tp_group_sharing", "CP-TP group sharing")):
            if par[flag] is True:
                raise ConfigError(f"{what} is not supported by the transferd backend (use mooncake)")
        if isinstance(par["pp_size"], int) and par["pp_size"] > 1:
            raise ConfigError(f"pipeline-parallel prefill (pp_size {par['pp_size']}) is not supported by the "
                              f"transferd backend")
        self.is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        if not self.is_prefill and disaggregation_mode != DisaggregationMode.DECODE:
            raise ConfigError(f"the transferd backend serves prefill or decode, not {disaggregation_mode}")
        self.tp_rank = par["attn_tp_rank"] if isinstance(par["attn_tp_rank"], int) else 0
        self.tp_size = par["attn_tp_size"] if isinstance(par["attn_tp_size"], int) else 1
        g = self.cfg.sglang
        check_tp(self.is_mla_backend, self.tp_size, g.peer_tp_size, "prefill" if self.is_prefill else "decode")
        self.peer_tp = g.peer_tp_size or self.tp_size
        if self.is_prefill:
            cp_size = par["attn_cp_size"] if isinstance(par["attn_cp_size"], int) else None
            cp_rank = par["attn_cp_rank"] if isinstance(par["attn_cp_rank"], int) else None
            if cp_size is None or cp_rank is None:
                if self.cfg.sender.cp_size != 1:
                    raise ConfigError("SGLang's runtime context has no attention-CP rank for this process, and "
                                      f"the transferd sender is configured for cp_size {self.cfg.sender.cp_size}")
                cp_size, cp_rank = 1, 0
            if cp_size != self.cfg.sender.cp_size:
                raise ConfigError(f"SGLang runs attention CP {cp_size}, the transferd sender group "
                                  f"{self.cfg.sender.group!r} is configured for cp_size {self.cfg.sender.cp_size} "
                                  f"in {self.cfg.source}")
            self.cp_size, self.cp_rank = cp_size, cp_rank
            pool_name = self.cfg.sender_pool_name(cp_rank)
            endpoint = self.cfg.sender_engine_socket(cp_rank)
            self.prefill_client: PrefillClient | None = PrefillClient(endpoint, timeout_s=g.client_timeout_s)
            self.decode_client: DecodeClient | None = None
            self.client: PrefillClient | DecodeClient = self.prefill_client
        else:
            self.cp_size, self.cp_rank = 1, 0
            pool_name = self.cfg.receiver_pool_name()
            endpoint = self.cfg.receiver_engine_socket()
            self.prefill_client = None
            self.decode_client = DecodeClient(endpoint, timeout_s=g.client_timeout_s)
            self.client = self.decode_client
        self.endpoint = endpoint
        try:
            self.client.ping(timeout_s=g.client_timeout_s)
        except TransferdError as exc:
            self.client.close()
            raise ConfigError(f"the transferd daemon at {endpoint} does not answer ({exc}); start it first "
                              f"(transferd {'sender' if self.is_prefill else 'receiver'} --config {self.cfg.source})") from None
        self.pool = Pool.attach(pool_name)
        try:
            self.emap: EngineMap = map_kv_args(args, self.pool.layout, self.is_mla_backend, where=f"pool {pool_name!r}")
            self.staging = Staging(self.pool, self.emap, self._device(g.device))
        except Exception:
            self.pool.close()
            self.client.close()
            raise
        self.board = StatusBoard(self.client, g.poll_interval_s)
        self.groups = self._groups()
        log.info("transferd %s backend: %s, pool %s, %s", "prefill" if self.is_prefill else "decode", endpoint,
                 pool_name, f"CP rank {self.cp_rank}/{self.cp_size}" if self.is_prefill else f"TP rank {self.tp_rank}")

    def _device(self, setting: str) -> str:
        if setting != "auto":
            return setting
        import torch

        if torch.cuda.is_available():
            return f"cuda:{int(getattr(self.kv_args, 'gpu_id', 0) or 0)}"
        return "cpu"

    def _groups(self) -> dict[str, str]:
        out = {}
        for entry in self.cfg.sglang.groups:
            addr, _, group = entry.partition("=")
            out[addr.strip()] = group.strip()
        return out

    def group_for(self, bootstrap_addr: str, prefill_dp_rank: int) -> str:
        """The transferd group that serves the prefill instance at ``bootstrap_addr``."""
        template = self.groups.get(bootstrap_addr) or self.cfg.sglang.default_group
        if not template:
            known = ", ".join(sorted(self.groups)) or "none"
            raise ConfigError(f"no transferd group is configured for the prefill bootstrap address {bootstrap_addr} "
                              f"(known: {known}); add \"{bootstrap_addr}=GROUP\" to [sglang] groups in {self.cfg.source}")
        # {tp}: this decode rank's TP rank; {prefill_tp}: the prefill TP rank that holds its pages
        # (MLA: every prefill TP rank holds the whole latent, so decode rank t reads t mod prefill TP)
        return template.format(dp=prefill_dp_rank, tp=self.tp_rank, prefill_tp=self.tp_rank % self.peer_tp)

    @property
    def prefill(self) -> PrefillClient:
        assert self.prefill_client is not None, "a decode manager has no prefill client"
        return self.prefill_client

    @property
    def decode(self) -> DecodeClient:
        assert self.decode_client is not None, "a prefill manager has no decode client"
        return self.decode_client

    def register_to_bootstrap(self) -> None:
        """Nothing to do: transferd's sender agents register with the receiver themselves."""

    def close(self) -> None:
        self.staging.close()
        self.client.close()
        self.pool.close()


def _pages(v: Any) -> np.ndarray:
    return np.asarray([] if v is None else v, dtype=np.int64).reshape(-1)


def _state_map(emap: EngineMap, state_indices: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for group, slots in zip(emap.state, state_indices or ()):
        if slots is None:
            continue
        rows = _pages(slots).tolist()
        for comp in group.components:
            out[comp] = rows
    return out


class TransferdKVSender(BaseKVSender):  # type: ignore[misc]
    """Prefill, one room on one CP rank: gathers its share into the pool and submits it chunk by chunk."""

    def __init__(self, mgr: TransferdKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self.num_kv_indices: int | None = None
        self.aux_index: int | None = None
        self.curr_idx = 0
        self.submitted = False
        self.failure: RoomStatus | None = None
        self.conclude_state: int | None = None
        self.metric = KVTransferMetric()
        self.bytes_staged = 0
        self._t0: float | None = None

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = None if aux_index is None else int(aux_index)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # a room's last chunk goes even when empty: it ends the room

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None,
             indices_event: Any = None) -> None:
        if self.failure is not None or self.conclude_state is not None:
            return
        mgr = self.kv_mgr
        if self.num_kv_indices is None:
            self._fail("bad_request", "send() before init()")
            return
        pages = _pages(kv_indices)
        start = self.curr_idx
        self.curr_idx += len(pages)
        n = self.num_kv_indices
        last = self.curr_idx >= n
        if self.curr_idx > n:
            self._fail("bad_request", f"chunks carry {self.curr_idx} pages, init() announced {n}")
            return
        s = mgr.cfg.sender
        plan = rank_plan(mgr.pool.layout, mgr.cp_size, mgr.cp_rank, s.split, n, 0, s.dedup)
        lo, hi = plan.chunk_range(start, self.curr_idx)
        mine = pages[lo - start:hi - start]
        state = _state_map(mgr.emap, state_indices) if last else None
        only = frozenset(plan.kv_buffers) | frozenset(plan.state_buffers) if plan.kv_buffers or plan.state_buffers else frozenset()
        if self._t0 is None:
            self._t0 = time.perf_counter()
        try:
            self.bytes_staged += mgr.staging.gather(mine, state_indices if last and plan.state_buffers else None,
                                                    self.aux_index if last and plan.aux else None,
                                                    self.bootstrap_room, only)
            status = mgr.prefill.submit(self.bootstrap_room, start, pages.tolist(), last=last,
                                       state=state if last else None,
                                       aux_slot=self.aux_index if last else None)
        except TransferdError as exc:
            # a room that already ended (the decode side aborted it, a peer was lost) refuses the
            # next chunk: report why it ended, not the refusal that followed
            try:
                st = mgr.prefill.poll(self.bootstrap_room)
            except TransferdError:
                st = None
            if st is not None and st.state is RoomState.FAILED:
                self.failure = st
            else:
                self._fail(exc.code, f"submit refused by transferd sender {mgr.endpoint}: {exc}")
            return
        if not self.submitted:
            self.submitted = True
            mgr.board.watch(self.bootstrap_room, {"op": "poll", "room": self.bootstrap_room})
        if status.state is RoomState.FAILED:
            self.failure = status

    def _fail(self, code: str, reason: str) -> None:
        self.failure = RoomStatus(RoomState.FAILED, code, reason)

    def poll(self) -> Any:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.failure is not None:
            return KVPoll.Failed
        if not self.submitted:
            return KVPoll.WaitingForInput
        st = self.kv_mgr.board.get(self.bootstrap_room)
        if st is None:
            return KVPoll.Transferring
        if st.state is RoomState.FAILED:
            self.failure = st
            return KVPoll.Failed
        if st.state is RoomState.SUCCESS:
            if self._t0 is not None and self.metric.transfer_latency_s is None:
                self.metric.transfer_latency_s = time.perf_counter() - self._t0
            return KVPoll.Success
        return KVPoll.Transferring

    def get_transfer_metric(self) -> KVTransferMetric:
        self.metric.transfer_total_bytes = self.bytes_staged
        return self.metric

    def failure_exception(self) -> None:
        st = self.failure or RoomStatus(RoomState.FAILED, "error", "the room failed")
        raise KVTransferError(self.bootstrap_room, f"transferd {st.code}: {st.reason}")

    def abort(self) -> None:
        if self.failure is None and self.conclude_state is None and self.submitted:
            try:
                self.kv_mgr.prefill.abort(self.bootstrap_room, "aborted by SGLang")
            except TransferdError as exc:
                log.info("room %d: abort: %s", self.bootstrap_room, exc)
        if self.failure is None:
            self._fail("aborted", "aborted by SGLang")
        self.conclude_state = KVPoll.Failed

    def clear(self) -> None:
        self.kv_mgr.board.forget(self.bootstrap_room)


class TransferdKVReceiver(BaseKVReceiver):  # type: ignore[misc]
    """Decode, one room: ``expect`` on the receiver, then scatter the pool rows into the engine."""

    def __init__(self, mgr: TransferdKVManager, bootstrap_addr: str, bootstrap_room: int | None = None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.group: str | None = None
        self.failure: RoomStatus | None = None
        self.expected = False
        self.scattered = False
        self.initialized = False
        self.conclude_state: int | None = None
        self.abort_notified = False
        self.bootstrap_infos: list[Any] = []
        self._pages = np.zeros(0, dtype=np.int64)
        self._state: Any = None
        self._aux: int | None = None

    @property
    def key(self) -> tuple[str | None, int]:
        return (self.group, self.bootstrap_room)

    def init(self, prefill_dp_rank: int = 0) -> None:
        self.initialized = True
        try:
            self.group = self.kv_mgr.group_for(self.bootstrap_addr, int(prefill_dp_rank or 0))
        except ConfigError as exc:
            self.failure = RoomStatus(RoomState.FAILED, exc.code, str(exc))

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: Any = None,
                      decode_prefix_len: int | None = None, destination: Any = None, **_: Any) -> None:
        if self.failure is not None or self.group is None:
            return
        mgr = self.kv_mgr
        if destination is not None and str(getattr(destination, "value", destination)) == "host":
            self.failure = RoomStatus(RoomState.FAILED, "bad_request", "host KV destinations are not supported by the "
                                      "transferd backend")
            return
        if aux_index is None:
            self.failure = RoomStatus(RoomState.FAILED, "bad_request", "send_metadata() without an aux_index")
            return
        page = mgr.emap.page_size
        prefix_tokens = int(decode_prefix_len or 0)
        if prefix_tokens % page:
            self.failure = RoomStatus(RoomState.FAILED, "bad_request",
                                      f"decode prefix of {prefix_tokens} tokens is not a whole number of "
                                      f"{page}-token pages")
            return
        prefix = prefix_tokens // page
        pages = _pages(kv_indices)
        # positions [0, prefix) are already on the decode side and never written; transferd still
        # wants a distinct pool row for each, so they name rows this room does not use
        taken = set(pages.tolist())
        filler: list[int] = []
        row = 0
        while len(filler) < prefix:
            if row not in taken:
                filler.append(row)
            row += 1
        self._pages, self._state, self._aux = pages, state_indices, int(aux_index)
        try:
            status = mgr.decode.expect(self.bootstrap_room, self.group, filler + pages.tolist(),
                                       aux_slot=int(aux_index), prefix_pages=prefix,
                                       state=_state_map(mgr.emap, state_indices))
        except TransferdError as exc:
            self.failure = RoomStatus(RoomState.FAILED, exc.code,
                                      f"expect refused by transferd receiver {mgr.endpoint}: {exc}")
            return
        self.expected = True
        mgr.board.watch(self.key, {"op": "poll", "room": self.bootstrap_room, "group": self.group})
        if status.state is RoomState.FAILED:
            self.failure = status

    def poll(self) -> Any:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.failure is not None:
            return KVPoll.Failed
        if not self.initialized:
            return KVPoll.Bootstrapping
        if not self.expected:
            return KVPoll.WaitingForInput
        if self.scattered:
            return KVPoll.Success
        st = self.kv_mgr.board.get(self.key)
        if st is None:
            return KVPoll.Transferring
        if st.state is RoomState.FAILED:
            self.failure = st
            return KVPoll.Failed
        if st.state is RoomState.SUCCESS:
            self.kv_mgr.staging.scatter(self._pages, self._state, self._aux)
            self.scattered = True
            return KVPoll.Success
        return _KVPOLL[st.state]

    def failure_exception(self) -> None:
        st = self.failure or RoomStatus(RoomState.FAILED, "error", "the room failed")
        raise KVTransferError(self.bootstrap_room, f"transferd {st.code}: {st.reason}")

    def abort(self) -> None:
        """Once this returns, transferd writes no further byte of the room, and the engine's
        buffers are never written for it (only a Success poll scatters)."""
        if self.expected and self.failure is None and not self.scattered and self.group is not None:
            try:
                self.kv_mgr.decode.abort(self.bootstrap_room, self.group, "aborted by SGLang")
            except TransferdError as exc:
                log.info("room %d: abort: %s", self.bootstrap_room, exc)
        if self.failure is None and not self.scattered:
            self.failure = RoomStatus(RoomState.FAILED, "aborted", "aborted by SGLang")
        self.conclude_state = KVPoll.Failed if not self.scattered else KVPoll.Success

    def is_abort_release_safe(self) -> bool:
        return True  # the engine's rows are written only inside a Success poll, never after abort

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        self.abort_notified = True

    def clear(self) -> None:
        if self.expected and self.group is not None:
            try:
                self.kv_mgr.decode.release(self.bootstrap_room, self.group)
            except UnknownRoom:
                pass
            except TransferdError as exc:
                log.info("room %d: release: %s", self.bootstrap_room, exc)
            self.expected = False
        self.kv_mgr.board.forget(self.key)
