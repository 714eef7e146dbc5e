"""The bench's results: :func:`report` (the JSON, docs/PERFORMANCE.md describes every figure),
:func:`format_table` (the table on the terminal) and :func:`plot` (matplotlib, optional)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .plan import (
    BENCH_VERSION,
    BULK_KEYS,
    BULK_LAYERS,
    CP8,
    CP8_ROOMS,
    DEDUP_CPS,
    PRODUCTION_CUT_CP8,
    SIZES,
    SMALL_CPS,
    TARGETS,
    KiB,
    MiB,
    cp8_pages_per_room,
    host,
    median,
    met,
    rnd,
)

if TYPE_CHECKING:
    from .subjects import Bench

LIMITS_NOTE = ("memcpy: np.copyto from one shared-memory pool buffer into another, one thread, "
               "message-sized pieces over a ring as large as a bulk run. pread: the same pieces read "
               "with preadv out of the source pool's file into the mapped destination, as the "
               "same-host path reads a sender's small messages. vm_read: the same pieces read in jobs "
               "of 8 MiB on two threads with process_vm_readv out of a read-only mapping of that file, "
               "as the same-host path reads large messages (its threaded ceiling). raw_zmq_tcp: pyzmq "
               "PUSH/PULL on tcp://127.0.0.1, separate messages (not multipart) sent zero-copy "
               "(copy=False) out of a pool by another process; the receiver copies every frame "
               "into a pool. raw_tcp: the same messages through one plain TCP connection on "
               "127.0.0.1, sendall out of the pool, recv_into straight into the destination pool "
               "(one kernel copy a side): what any TCP transport can reach on this host. raw_tcp_x8: eight "
               "such connections from eight sender processes, each with an eighth of the bytes, into this "
               "one process (non-blocking sockets, a selector, recv_into straight into eight slices of the "
               "destination): the limit beside the CP8 bulk rooms; sender CPU is the eight summed. "
               "raw_tcp_pair (1 MiB): the raw_tcp messages between two processes of their own "
               "(transferd/tools/bench/raw_tcp.py), both idle since their last measurement as transferd's "
               "receiver and sender daemons are, where raw_tcp's receiver is the bench's own process, busy "
               "right up to each measurement; timed from the bench's command to the receiver's answer. "
               "Not a target's limit: it shows what a rest costs a plain TCP pair on this host.")
ZMQ_SOCKET_NOTE = ("the same rooms from a sender with data_stream = \"off\": data messages through the ZeroMQ "
                   "socket (the path with CURVE, or with the stream off); the 1MiB figures above went on a "
                   "data stream (stream_share = 1.0)")
SAME_HOST_NOTE = ("the same rooms from a sender with same_host = \"auto\" and sealed_pool = true into the same "
                  "receiver: data-refs messages over ZeroMQ, the receiver copying rows out of its mapping of the "
                  "sender's sealed pool (limits.pread and limits.vm_read: the kernel's copy out of a plain pool "
                  "file, the path without the seal); shm_share is "
                  "the part of the bytes the sender counted as moved that way (1.0 = the path was used)")
CP8_NOTE = ("eight sender daemons (one group, cp_size 8, split \"pages\", each on its data stream) into one "
            "receiver: rooms of 1 MiB rows, a multiple of 8 pages each so every rank sends the same share, the "
            "bytes of one cp 1 bulk/1MiB measurement; each rank's pool holds only its share of the rooms. "
            "Beside it, in the same block (measured back to back each round): eight raw TCP connections "
            "into one process (limits.raw_tcp_x8). vs_raw_tcp_x8: median of per-round ratios; "
            "sender_cpu_vs_cp1: the eight ranks' summed sender CPU per GB over the cp 1 bulk/1MiB sender's "
            "(medians: the two are in different blocks); raw_tcp_x8_sender_cpu_vs_raw_tcp: the same for the "
            "limits, the eight raw senders' summed CPU per GB over one raw sender's (limits.raw_tcp, the 1 MiB "
            "block): the part of the ratio that is the kernel's, not transferd's. room_ms_mean: the rooms' mean "
            "time from expect to success at the receiver (room_seconds in its stats), median of the rounds; "
            "room_vs_measurement: that over the measurement's time (1.0: every room ends with the last).")
DEDUP_METHOD = ("the same room from two real groups of cp ranks into the same receiver: one with the "
                "de-dup (sender.dedup = true, the default), one without (sender.dedup = false: every rank "
                "ships the replicated state). Wire bytes from the senders' own counters; measured cut = "
                "(off - on) / off; analytic cut = (cp-1)·S / (KV + cp·S + aux) from the layout. At cp 1 "
                "there is nothing to de-duplicate: off is the on group.")


class Figures:
    """Every subject's per-round results: medians over rounds, and medians of per-round ratios."""

    def __init__(self, results: dict[str, list[dict[str, Any]]]) -> None:
        self.res = results

    def med(self, name: str, key: str) -> float | None:
        return median([r.get(key) for r in self.res.get(name, [])])

    def paired(self, a: str, b: str, key_a: str = "gbps", key_b: str = "gbps") -> float | None:
        xs = [x[key_a] / y[key_b] for x, y in zip(self.res.get(a, []), self.res.get(b, []))
              if x.get(key_a) and y.get(key_b)]
        return median(xs)

    def rounds(self, name: str, key: str = "gbps", nd: int = 3) -> list[float | None]:
        return [rnd(r[key], nd) for r in self.res.get(name, [])]


def _msg_key(key: str) -> str:
    """The message size a bulk key's rooms travel in: 64 KiB rows on contiguous pages coalesce."""
    return "1MiB" if key.endswith("_contig") else key


def _limits(f: Figures, b: Bench) -> dict[str, Any]:
    limits: dict[str, Any] = {"memcpy": {}, "pread": {}, "vm_read": {}, "raw_zmq_tcp": {}, "raw_tcp": {}}
    for key, size in SIZES.items():
        for name, out in (("memcpy", "memcpy"), ("pread", "pread"), ("vm_read", "vm_read"), ("raw_zmq", "raw_zmq_tcp"),
                          ("raw_tcp", "raw_tcp")):
            limits[out][key] = {"message_bytes": size, "gbps": rnd(f.med(f"{name}/{key}", "gbps"), 3),
                                "rounds": f.rounds(f"{name}/{key}")}
            if name in ("pread", "vm_read"):
                limits[out][key]["vs_memcpy"] = rnd(f.paired(f"{name}/{key}", f"memcpy/{key}"), 3)
            if name not in ("memcpy", "pread", "vm_read"):
                for side in ("receiver", "sender"):
                    limits[out][key][f"{side}_cpu_s_per_gb"] = rnd(f.med(f"{name}/{key}", f"{side}_cpu_s_per_gb"), 3)
    x8 = "raw_tcp_x8/1MiB"
    limits["raw_tcp_x8"] = {"1MiB": {"message_bytes": MiB, "connections": CP8, "gbps": rnd(f.med(x8, "gbps"), 3),
                                     "rounds": f.rounds(x8),
                                     "receiver_cpu_s_per_gb": rnd(f.med(x8, "receiver_cpu_s_per_gb"), 3),
                                     "sender_cpu_s_per_gb": rnd(f.med(x8, "sender_cpu_s_per_gb"), 3)}}
    pair = "raw_tcp_pair/1MiB"
    limits["raw_tcp_pair"] = {"1MiB": {"message_bytes": MiB, "gbps": rnd(f.med(pair, "gbps"), 3), "rounds": f.rounds(pair),
                                       "vs_raw_tcp": rnd(f.paired(pair, "raw_tcp/1MiB"), 3),
                                       "receiver_cpu_s_per_gb": rnd(f.med(pair, "receiver_cpu_s_per_gb"), 3),
                                       "sender_cpu_s_per_gb": rnd(f.med(pair, "sender_cpu_s_per_gb"), 3)}}
    limits["bytes_per_measurement"] = b.plan.bulk_room_bytes * b.plan.bulk_rooms
    limits["notes"] = LIMITS_NOTE
    return limits


def _bulk(f: Figures, b: Bench) -> dict[str, Any]:
    bulk: dict[str, Any] = {}
    for key in BULK_KEYS:
        c = b.bulk[key.split("_")[0]]
        row = SIZES[key.split("_")[0]]
        msg_key = _msg_key(key)
        name = f"bulk/{key}"
        bulk[key] = {
            "row_bytes": row, "message_bytes": MiB if key.endswith("_contig") else row,
            "pages": "contiguous" if key.endswith("_contig") else "scattered",
            "pages_per_room": c.pages, "kv_buffers": BULK_LAYERS,
            "room_bytes": c.pages * c.layout.kv_page_bytes() + c.layout.aux_row_bytes,
            "rooms_per_measurement": b.plan.bulk_rooms,
            "gbps": rnd(f.med(name, "gbps"), 3),
            "rounds": f.rounds(name),
            "vs_raw_zmq": rnd(f.paired(name, f"raw_zmq/{msg_key}"), 3),
            "vs_raw_tcp": rnd(f.paired(name, f"raw_tcp/{msg_key}"), 3),
            "vs_memcpy": rnd(f.paired(name, f"memcpy/{msg_key}"), 3),
            "receiver_cpu_s_per_gb": rnd(f.med(name, "receiver_cpu_s_per_gb"), 3),
            "sender_cpu_s_per_gb": rnd(f.med(name, "sender_cpu_s_per_gb"), 3),
            "shm_share": rnd(f.med(name, "shm_share"), 4),
            "stream_share": rnd(f.med(name, "stream_share"), 4),
            "room_ms_mean": rnd(f.med(name, "room_ms_mean"), 2),
            "room_vs_measurement": rnd(f.med(name, "room_vs_measurement"), 3),
        }
    bulk["1MiB"]["vs_raw_tcp_pair"] = rnd(f.paired("bulk/1MiB", "raw_tcp_pair/1MiB"), 3)
    return bulk


def _zmq_socket(f: Figures) -> dict[str, Any]:
    name = "bulk_zmq/1MiB"
    return {
        "note": ZMQ_SOCKET_NOTE,
        "gbps": rnd(f.med(name, "gbps"), 3), "rounds": f.rounds(name),
        "vs_raw_zmq": rnd(f.paired(name, "raw_zmq/1MiB"), 3),
        "stream_vs_zmq_socket": rnd(f.paired("bulk/1MiB", name), 3),
        "receiver_cpu_s_per_gb": rnd(f.med(name, "receiver_cpu_s_per_gb"), 3),
        "sender_cpu_s_per_gb": rnd(f.med(name, "sender_cpu_s_per_gb"), 3),
        "stream_share": rnd(f.med(name, "stream_share"), 4),
    }


def _same_host(f: Figures, bulk: dict[str, Any]) -> dict[str, Any]:
    """The same-host column; each bulk entry gets its two headline figures too."""
    same_host: dict[str, Any] = {"available": True, "note": SAME_HOST_NOTE}
    for key in BULK_KEYS:
        name = f"bulk_shm/{key}"
        same_host[key] = {
            "gbps": rnd(f.med(name, "gbps"), 3), "rounds": f.rounds(name),
            "vs_memcpy": rnd(f.paired(name, f"memcpy/{_msg_key(key)}"), 3),
            "vs_pread": rnd(f.paired(name, f"pread/{_msg_key(key)}"), 3),
            "vs_vm_read": rnd(f.paired(name, f"vm_read/{_msg_key(key)}"), 3),
            "vs_tcp": rnd(f.paired(name, f"bulk/{key}"), 3),
            "receiver_cpu_s_per_gb": rnd(f.med(name, "receiver_cpu_s_per_gb"), 3),
            "sender_cpu_s_per_gb": rnd(f.med(name, "sender_cpu_s_per_gb"), 3),
            "shm_share": rnd(f.med(name, "shm_share"), 4),
        }
        bulk[key]["same_host_gbps"] = same_host[key]["gbps"]
        bulk[key]["same_host_vs_memcpy"] = same_host[key]["vs_memcpy"]
    return same_host


def _small(f: Figures, b: Bench) -> dict[str, Any]:
    small: dict[str, Any] = {}
    for cp in SMALL_CPS:
        lat = np.asarray(b.latencies.get(f"ds{cp}", [])) * 1e3
        small[f"cp{cp}"] = {
            "cp_size": cp,
            "p50_ms": rnd(float(np.percentile(lat, 50)), 3) if lat.size else None,
            "p99_ms": rnd(float(np.percentile(lat, 99)), 3) if lat.size else None,
            "latency_samples": int(lat.size),
            "rooms_per_s": rnd(f.med(f"small/{cp}", "rooms_per_s"), 1),
            "rooms_per_s_rounds": f.rounds(f"small/{cp}", "rooms_per_s", 1),
            "rooms_in_flight": b.plan.small_batch_rooms,
            "engine_rpc_rtt_us": rnd(f.med(f"small/{cp}", "rpc_rtt_us"), 1),
            # CPU per room of the batched rounds (not timed: less moved by a noisy host than rooms/s)
            "receiver_cpu_us_per_room": rnd(f.med(f"small/{cp}", "receiver_cpu_us_per_room"), 1),
            "sender_cpu_us_per_room": rnd(f.med(f"small/{cp}", "sender_cpu_us_per_room"), 1),
        }
    assert b.ds is not None
    lay = b.ds.layout
    small["room"] = {"pages": 1, "state": False, "aux": True, "config": "configs/deepseek-cp8.toml",
                     "kv_bytes": lay.kv_page_bytes(), "messages_per_room_rank0": len(lay.indices("kv")) + 1}
    return small


def _dedup_cp(f: Figures, cp: int, kv: int, st: int, aux: int) -> dict[str, Any]:
    on = f.res.get(f"dedup_on/{cp}", [])
    wire = sum(r["wire"] for r in on)
    skipped = sum(r["skipped"] for r in on)
    rooms = sum(r["rooms"] for r in on)
    t_on = f.med(f"dedup_on/{cp}", "seconds")
    off_name = f"dedup_off/{cp}" if cp > 1 else f"dedup_on/{cp}"
    t_off = f.med(off_name, "seconds")
    off_runs = f.res.get(off_name, [])
    off_wire = sum(r["wire"] for r in off_runs)
    off_rooms = sum(r["rooms"] for r in off_runs)
    on_b = wire // rooms if rooms else None
    off_b = off_wire // off_rooms if off_rooms else None
    return {
        "cp_size": cp, "rooms": rooms, "rooms_off": off_rooms,
        "wire_bytes_on": on_b,
        "wire_bytes_off": off_b,
        "wire_mb_on": rnd(on_b / 1e6, 3) if on_b is not None else None,
        "wire_mb_off": rnd(off_b / 1e6, 3) if off_b is not None else None,
        "state_bytes_skipped": skipped // rooms if rooms else None,
        "measured_cut": (off_b - on_b) / off_b if on_b is not None and off_b else None,
        "analytic_cut": (cp - 1) * st / (kv + cp * st + aux),
        "time_ms_on": rnd(t_on * 1e3 if t_on else None, 2),
        "time_ms_off": rnd(t_off * 1e3 if t_off else None, 2),
        "time_on_vs_off": rnd(f.paired(f"dedup_on/{cp}", off_name, "seconds", "seconds"), 3),
        "gbps_on": rnd((wire / rooms) / t_on / 1e9 if rooms and t_on else None, 3),
        "off": "measured: a group with sender.dedup = false" if cp > 1 else
               "the on group (nothing to de-duplicate at cp 1)",
    }


def _dedup(f: Figures, b: Bench) -> dict[str, Any]:
    assert b.ds is not None
    lay = b.ds.layout
    n = b.ds.cfg.demo.pages_per_room
    kv = n * lay.kv_page_bytes()
    st = sum(buf.row_bytes for buf in lay.buffers if buf.kind == "state")
    aux = lay.aux_row_bytes
    dedup: dict[str, Any] = {
        "config": "configs/deepseek-cp8.toml", "model": lay.model, "room_pages": n,
        "room_tokens": n * lay.page_size, "kv_bytes_per_room": kv, "state_bytes_per_room": st,
        "aux_bytes_per_room": aux, "state_kv_ratio": rnd(st / kv, 6), "rooms_per_measurement": b.plan.dedup_rooms,
        "production_cut_cp8": PRODUCTION_CUT_CP8,
        "layout_cut_cp8_no_aux": rnd(7 * st / (kv + 8 * st), 6),
        "method": DEDUP_METHOD,
    }
    for cp in DEDUP_CPS:
        dedup[f"cp{cp}"] = _dedup_cp(f, cp, kv, st, aux)
    return dedup


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cp8(f: Figures, b: Bench) -> dict[str, Any]:
    """The CP8 bulk block: eight ranks into one receiver beside eight raw TCP connections."""
    name, x8 = "bulk_cp8/1MiB", "raw_tcp_x8/1MiB"
    pages = cp8_pages_per_room(b.plan)
    lay = b.bulk["1MiB"].layout
    tx_cpu, cp1_cpu = f.med(name, "sender_cpu_s_per_gb"), f.med("bulk/1MiB", "sender_cpu_s_per_gb")
    raw_cpu = f.med("raw_tcp/1MiB", "sender_cpu_s_per_gb")  # one raw sender (the 1 MiB block)
    return {
        "note": CP8_NOTE, "cp_size": CP8, "split": "pages", "row_bytes": MiB, "kv_buffers": BULK_LAYERS,
        "rooms_per_measurement": CP8_ROOMS, "pages_per_room": pages, "pages_per_rank_per_room": pages // CP8,
        "rank_pool_pages": CP8_ROOMS * pages // CP8,
        "bytes_per_measurement": CP8_ROOMS * (pages * lay.kv_page_bytes() + lay.aux_row_bytes),
        "gbps": rnd(f.med(name, "gbps"), 3), "rounds": f.rounds(name),
        "raw_tcp_x8_gbps": rnd(f.med(x8, "gbps"), 3), "raw_tcp_x8_rounds": f.rounds(x8),
        "vs_raw_tcp_x8": rnd(f.paired(name, x8), 3),
        "receiver_cpu_s_per_gb": rnd(f.med(name, "receiver_cpu_s_per_gb"), 3),
        "sender_cpu_s_per_gb": rnd(tx_cpu, 3),  # the eight ranks summed
        "sender_cpu_s_per_gb_max_rank": rnd(f.med(name, "sender_cpu_s_per_gb_max_rank"), 3),
        "raw_tcp_x8_receiver_cpu_s_per_gb": rnd(f.med(x8, "receiver_cpu_s_per_gb"), 3),
        "raw_tcp_x8_sender_cpu_s_per_gb": rnd(f.med(x8, "sender_cpu_s_per_gb"), 3),
        "cp1_sender_cpu_s_per_gb": rnd(cp1_cpu, 3),
        "sender_cpu_vs_cp1": rnd(_div(tx_cpu, cp1_cpu), 3),
        # the same ratio for the raw limits: what eight connections cost the kernel per byte over one
        "raw_tcp_sender_cpu_s_per_gb": rnd(raw_cpu, 3),
        "raw_tcp_x8_sender_cpu_vs_raw_tcp": rnd(_div(f.med(x8, "sender_cpu_s_per_gb"), raw_cpu), 3),
        "receiver_cpu_vs_cp1": rnd(_div(f.med(name, "receiver_cpu_s_per_gb"),
                                        f.med("bulk/1MiB", "receiver_cpu_s_per_gb")), 3),
        "gbps_vs_cp1": rnd(_div(f.med(name, "gbps"), f.med("bulk/1MiB", "gbps")), 3),
        "stream_share": rnd(f.med(name, "stream_share"), 4),
        "room_ms_mean": rnd(f.med(name, "room_ms_mean"), 2),
        "room_vs_measurement": rnd(f.med(name, "room_vs_measurement"), 3),
        "verified_rooms": b.cp8_checked[0], "mismatched_bytes": b.cp8_checked[1],
    }


def _ratios(bulk: dict[str, Any], same_host_ratio: float | None, cp8: dict[str, Any]) -> dict[str, Any]:
    by_size = {key: bulk[key]["vs_raw_zmq"] for key in BULK_KEYS}
    by_size_tcp = {key: bulk[key]["vs_raw_tcp"] for key in BULK_KEYS}
    return {
        "tcp_vs_raw_zmq": by_size.get("1MiB"),
        "tcp_vs_raw_zmq_by_size": by_size,
        "tcp_vs_raw_tcp": by_size_tcp.get("1MiB"),
        "tcp_vs_raw_tcp_by_size": by_size_tcp,
        "tcp_vs_raw_tcp_pair": bulk["1MiB"]["vs_raw_tcp_pair"],
        "same_host_vs_memcpy": same_host_ratio,
        "cp8_tcp_vs_raw_tcp": cp8["vs_raw_tcp_x8"],
        "cp8_sender_cpu_vs_cp1": cp8["sender_cpu_vs_cp1"],
        "notes": {"tcp_vs_raw_zmq": "transferd bulk rooms of 1 MiB rows vs raw pyzmq with 1 MiB messages, "
                                    "same bytes, median of per-round ratios",
                  "tcp_vs_raw_tcp": "the same rooms vs one plain TCP connection (sendall / recv_into), same "
                                    "message size and bytes, median of per-round ratios",
                  "tcp_vs_raw_tcp_pair": ("the same rooms vs the raw TCP pair: that connection between two "
                                          "processes that idle between measurements as the daemons do (no target)"),
                  "same_host_vs_memcpy": ("transferd's same-host path, bulk rooms of 1 MiB rows, vs one-thread "
                                          "memcpy of 1 MiB pieces, median of per-round ratios"),
                  "cp8_tcp_vs_raw_tcp": ("eight sender daemons of one cp 8 group into one receiver, 1 MiB rows, "
                                         "vs eight raw TCP connections into one process, same bytes, median of "
                                         "per-round ratios (cp8 block)"),
                  "cp8_sender_cpu_vs_cp1": ("the cp 8 group's sender CPU per GB summed over its eight ranks over "
                                            "the cp 1 bulk/1MiB sender's; medians (different blocks)")},
    }


MOONCAKE_TARGET = f">= {TARGETS['vs_mooncake_tcp']:g}x mooncake tcp"


def _target(value: float | None, key: str, at_least: bool, limit: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"value": value, "target": TARGETS[key], "op": ">=" if at_least else "<=",
                           "met": met(value, TARGETS[key], at_least)}
    if limit:
        out["limit"] = limit  # what the value is measured against, in the same run
    return out


def _g(x: float | None) -> str:
    return "—" if x is None else f"{x:g}"


def _targets(ratios: dict[str, Any], small: dict[str, Any], dedup: dict[str, Any], limits: dict[str, Any],
             bulk: dict[str, Any], cp8: dict[str, Any]) -> dict[str, Any]:
    """Issue 14's targets: ratios to the host's limits measured in the same run, the small rooms'
    absolute figures, the de-dup's exact cut (the Mooncake ones are added with the peer)."""
    c1, c8, d8 = small["cp1"], small["cp8"], dedup["cp8"]
    out: dict[str, Any] = {}
    for key in ("1MiB", "256KiB", "64KiB"):
        t = TARGETS[f"tcp_vs_raw_tcp_{key}"]
        pair = (f"; the raw pair, two idle processes, {_g(limits['raw_tcp_pair']['1MiB']['gbps'])} GB/s = "
                f"{_g(limits['raw_tcp_pair']['1MiB']['vs_raw_tcp'])} × the raw tcp socket"
                if key == "1MiB" and limits["raw_tcp_pair"]["1MiB"]["gbps"] is not None else "")
        out[f"bulk.{key}.vs_raw_tcp >= {t:g}"] = _target(
            bulk[key]["vs_raw_tcp"], f"tcp_vs_raw_tcp_{key}", True,
            f"raw tcp socket {_g(limits['raw_tcp'][key]['gbps'])} GB/s, transferd {_g(bulk[key]['gbps'])} GB/s{pair}")
    out[f"same_host_vs_memcpy >= {TARGETS['same_host_vs_memcpy']:g}"] = _target(
        ratios["same_host_vs_memcpy"], "same_host_vs_memcpy", True,
        f"memcpy 1 MiB {_g(limits['memcpy']['1MiB']['gbps'])} GB/s, the ceiling of a sealed pool's memmove; the "
        f"kernel's copies out of a plain pool file: preadv {_g(limits['pread']['1MiB']['gbps'])} GB/s = "
        f"{_g(limits['pread']['1MiB']['vs_memcpy'])} × memcpy, process_vm_readv on 2 threads "
        f"{_g(limits['vm_read']['1MiB']['gbps'])} GB/s = {_g(limits['vm_read']['1MiB']['vs_memcpy'])} × memcpy")
    out[f"small_rooms.cp1.p50_ms <= {TARGETS['small_cp1_p50_ms']:g}"] = _target(c1["p50_ms"], "small_cp1_p50_ms", False)
    out[f"small_rooms.cp1.p99_ms <= {TARGETS['small_cp1_p99_ms']:g}"] = _target(c1["p99_ms"], "small_cp1_p99_ms", False)
    out[f"small_rooms.cp1.rooms_per_s >= {TARGETS['small_cp1_rooms_per_s']:g}"] = _target(
        c1["rooms_per_s"], "small_cp1_rooms_per_s", True)
    out[f"small_rooms.cp8.rooms_per_s >= {TARGETS['small_cp8_rooms_per_s']:g}"] = _target(
        c8["rooms_per_s"], "small_cp8_rooms_per_s", True)
    out[f"cp8_tcp_vs_raw_tcp >= {TARGETS['cp8_tcp_vs_raw_tcp']:g}"] = _target(
        ratios["cp8_tcp_vs_raw_tcp"], "cp8_tcp_vs_raw_tcp", True,
        f"eight raw tcp connections {_g(cp8['raw_tcp_x8_gbps'])} GB/s, transferd cp 8 {_g(cp8['gbps'])} GB/s")
    out[f"cp8_sender_cpu_vs_cp1 <= {TARGETS['cp8_sender_cpu_vs_cp1']:g}"] = _target(
        ratios["cp8_sender_cpu_vs_cp1"], "cp8_sender_cpu_vs_cp1", False,
        f"sender CPU s/GB: cp 8 summed {_g(cp8['sender_cpu_s_per_gb'])}, cp 1 {_g(cp8['cp1_sender_cpu_s_per_gb'])}, "
        f"eight raw senders summed {_g(cp8['raw_tcp_x8_sender_cpu_s_per_gb'])} = "
        f"{_g(cp8['raw_tcp_x8_sender_cpu_vs_raw_tcp'])} × one raw sender's {_g(cp8['raw_tcp_sender_cpu_s_per_gb'])}")
    out["dedup.cp8.measured_cut == analytic_cut"] = {
        "value": d8["measured_cut"], "target": d8["analytic_cut"], "op": "==",
        "met": None if d8["measured_cut"] is None else abs(d8["measured_cut"] - d8["analytic_cut"]) < 1e-9}
    t_on = d8["time_on_vs_off"]
    out["dedup.cp8 time on < off"] = {"value": t_on, "target": 1.0, "op": "<", "met": None if t_on is None else t_on < 1.0}
    out[MOONCAKE_TARGET] = {"value": None, "target": TARGETS["vs_mooncake_tcp"], "op": ">=", "met": None}
    return out


def _mooncake_target(f: Figures, ratios: dict[str, Any], targets: dict[str, Any]) -> None:
    """With the peer measured: its ratio and its target."""
    v = f.paired("bulk/1MiB", "mooncake/1MiB")
    ratios["vs_mooncake_tcp"] = rnd(v, 3)
    ratios["notes"]["vs_mooncake_tcp"] = ("transferd bulk rooms of 1 MiB rows over TCP vs Mooncake Transfer "
                                          "Engine's TCP transport writing the same bytes in 1 MiB pieces")
    need = f.paired("mooncake/1MiB", "raw_tcp/1MiB")
    targets[MOONCAKE_TARGET] = _target(
        rnd(v, 3), "vs_mooncake_tcp", True,
        f"{TARGETS['vs_mooncake_tcp']:g} × Mooncake = {_g(rnd(TARGETS['vs_mooncake_tcp'] * need, 3) if need else None)}"
        " × the raw tcp socket")


def _peers(f: Figures, b: Bench) -> dict[str, Any]:
    mooncake = b.limits.mooncake
    if mooncake is None:
        return {}
    by_size = {key: rnd(f.med(f"mooncake/{key}", "gbps"), 3) for key in SIZES}
    b.notes.setdefault("peers", "Mooncake Transfer Engine, TCP transport, P2P handshake, target in another "
                                "process writing into a shared-memory pool; same bytes as the bulk rooms")
    return {"mooncake_tcp_gbps": by_size["1MiB"], "mooncake_tcp_gbps_by_size": by_size,
            "mooncake_tcp_rounds": {key: f.rounds(f"mooncake/{key}") for key in SIZES},
            "transferd_tcp_vs_mooncake_tcp_by_size": {key: rnd(f.paired(f"bulk/{key}", f"mooncake/{key}"), 3)
                                                      for key in SIZES},
            # what the Mooncake target asks of any transport: its rate times the target, over the raw
            # TCP limit measured in the same rounds (> 1: beyond a plain socket on this host)
            "mooncake_target_vs_raw_tcp_by_size": {
                key: rnd(TARGETS["vs_mooncake_tcp"] * r, 3) if (r := f.paired(f"mooncake/{key}", f"raw_tcp/{key}"))
                else None for key in SIZES},
            "mooncake_tcp_cpu_s_per_gb_by_size": {
                key: {side: rnd(f.med(f"mooncake/{key}", f"{side}_cpu_s_per_gb"), 3) for side in ("initiator", "target")}
                for key in SIZES},
            "mooncake_tcp_mismatched_bytes": mooncake.mismatched}


def _staging(f: Figures, b: Bench) -> dict[str, Any]:
    """The SGLang backend's staging copies (engine buffers <-> pool, CPU), paired with memcpy."""
    if "staging_gather/1MiB" not in b.results:
        return {"available": False, "note": b.notes.get("sglang_staging", "not measured in this run")}
    return {"available": True,
            "gather_gbps": rnd(f.med("staging_gather/1MiB", "gbps"), 3),
            "scatter_gbps": rnd(f.med("staging_scatter/1MiB", "gbps"), 3),
            "gather_vs_memcpy": rnd(f.paired("staging_gather/1MiB", "memcpy/1MiB"), 3),
            "scatter_vs_memcpy": rnd(f.paired("staging_scatter/1MiB", "memcpy/1MiB"), 3),
            "gather_rounds": f.rounds("staging_gather/1MiB"), "scatter_rounds": f.rounds("staging_scatter/1MiB"),
            "mismatched_bytes": b.staging.mismatched if b.staging is not None else 0}


def _sglang_room(f: Figures, b: Bench) -> dict[str, Any]:
    """Rooms through the SGLang backend beside the same rooms through the plain client."""
    if "e2e_backend/sglang" not in b.results:
        return {"available": False, "note": b.notes.get("sglang_room", "not measured in this run")}
    sgl = b.sgl
    return {"available": True, "rooms_per_measurement": 4,
            "backend_gbps": rnd(f.med("e2e_backend/sglang", "gbps"), 3),
            "client_gbps": rnd(f.med("e2e_client/sglang", "gbps"), 3),
            "backend_vs_client": rnd(f.paired("e2e_backend/sglang", "e2e_client/sglang"), 3),
            "backend_ms": rnd(1e3 * (f.med("e2e_backend/sglang", "seconds") or 0), 2),
            "client_ms": rnd(1e3 * (f.med("e2e_client/sglang", "seconds") or 0), 2),
            "mismatched_bytes": sgl.mismatched if sgl is not None else 0,
            "rooms_failed": sgl.rooms_failed if sgl is not None else 0}
MOONCAKE_PLANE_NOTE = ("the same bulk rooms from a sender with data_plane = \"mooncake\" into the same receiver: "
                       "data-refs over ZeroMQ, the receiver reading the rows with its Mooncake Transfer Engine "
                       "(TCP transport, P2P handshake) straight into the destination rows; vs_mooncake_tcp: paired "
                       "per round with Mooncake's raw TCP transport moving the same bytes in messages of the rows' "
                       "size (the raw peer writes, the plane reads: both one TCP stream through the engine); "
                       "mooncake_share 1.0 = every byte went that way")


def _mooncake_plane(f: Figures, b: Bench, ratios: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    """transferd over Mooncake TE beside raw Mooncake TE (when the peer is measured)."""
    plane: dict[str, Any] = {"note": MOONCAKE_PLANE_NOTE}
    for key in BULK_KEYS:
        name = f"bulk_mc/{key}"
        plane[key] = {
            "gbps": rnd(f.med(name, "gbps"), 3), "rounds": f.rounds(name),
            "vs_mooncake_tcp": rnd(f.paired(name, f"mooncake/{_msg_key(key)}"), 3),
            "vs_transferd_tcp": rnd(f.paired(name, f"bulk/{key}"), 3),
            "vs_raw_tcp": rnd(f.paired(name, f"raw_tcp/{_msg_key(key)}"), 3),
            "receiver_cpu_s_per_gb": rnd(f.med(name, "receiver_cpu_s_per_gb"), 3),
            "sender_cpu_s_per_gb": rnd(f.med(name, "sender_cpu_s_per_gb"), 3),
            "mooncake_share": rnd(f.med(name, "mooncake_share"), 4),
        }
    lat = np.asarray(b.latencies.get("dsmc1", [])) * 1e3
    plane["small_cp1"] = {
        "p50_ms": rnd(float(np.percentile(lat, 50)), 3) if lat.size else None,
        "p99_ms": rnd(float(np.percentile(lat, 99)), 3) if lat.size else None,
        "latency_samples": int(lat.size),
        "rooms_per_s": rnd(f.med("small_mc/1", "rooms_per_s"), 1),
        "rooms_per_s_rounds": f.rounds("small_mc/1", "rooms_per_s", 1),
        "vs_transferd_tcp_rooms_per_s": rnd(f.paired("small_mc/1", "small/1", "rooms_per_s", "rooms_per_s"), 3),
    }
    v = plane["1MiB"]["vs_mooncake_tcp"]
    ratios["mooncake_plane_vs_mooncake_tcp"] = v
    ratios["notes"]["mooncake_plane_vs_mooncake_tcp"] = ("transferd bulk rooms of 1 MiB rows over its Mooncake plane vs "
                                                         "Mooncake TE's raw TCP transport on the same bytes")
    targets[">= 0.95x mooncake tcp (mooncake plane)"] = _target(v, "mooncake_plane_vs_mooncake_tcp", True)
    return plane


def _bytes_by_path(b: Bench) -> dict[str, int]:
    """Payload bytes the run's senders moved, by path (``zmq``: what no other path moved)."""
    total = shm = stream = mc = nx = 0
    for c in b.fleet.clusters.values():
        for g in c.groups.values():
            for pc in g.pcs:
                s = pc.stats()
                total += sum(int(v) for v in s["bytes"].values())
                shm, stream = shm + int(s["shm_bytes"]), stream + int(s["stream_bytes"])
                mc += int(s.get("mooncake_bytes", 0))
                nx += int(s.get("nixl_bytes", 0))
    return {"zmq": total - shm - stream - mc - nx, "stream": stream, "same_host": shm, "mooncake": mc, "nixl": nx}


def report(b: Bench) -> dict[str, Any]:
    """The JSON of a run (its shape is part of the interface: tests/integration/test_bench.py)."""
    f = Figures(b.results)
    limits = _limits(f, b)
    bulk = _bulk(f, b)
    bulk["1MiB"]["zmq_socket"] = _zmq_socket(f)
    same_host = _same_host(f, bulk)
    small = _small(f, b)
    dedup = _dedup(f, b)
    cp8 = _cp8(f, b)
    ratios = _ratios(bulk, same_host["1MiB"]["vs_memcpy"], cp8)
    targets = _targets(ratios, small, dedup, limits, bulk, cp8)
    plane: dict[str, Any] = {"available": False}
    if b.limits.mooncake is not None:
        _mooncake_target(f, ratios, targets)
        plane = {"available": True, **_mooncake_plane(f, b, ratios, targets)}
    fleet = b.fleet
    return {
        "bench_version": BENCH_VERSION, "quick": b.quick, "repeats": b.plan.repeats,
        "target_repeats": b.plan.target_repeats,
        "host": host(), "limits": limits, "bulk": bulk, "cp8": cp8,
        "same_host": same_host, "mooncake_plane": plane, "bytes_by_path": _bytes_by_path(b),
        "small_rooms": small, "dedup": dedup, "ratios": ratios, "targets": targets,
        "peers": _peers(f, b), "sglang_staging": _staging(f, b),
        "sglang_room": _sglang_room(f, b), "notes": b.notes,
        "mismatched_bytes": fleet.mismatched + (b.staging.mismatched if b.staging is not None else 0)
        + (b.sgl.mismatched if b.sgl is not None else 0),
        "verified_rooms": fleet.verified_rooms,
        "rooms_ok": fleet.ok_rooms,
        "rooms_failed": sum(fleet.failed_rooms.values()) + (b.sgl.rooms_failed if b.sgl is not None else 0),
        "rooms_failed_by_reason": dict(fleet.failed_rooms),
    }


# -- the table and the plot -----------------------------------------------------------------------

def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def table_header(out: dict[str, Any]) -> list[str]:
    """The table's first lines: the run's shape, and the host as it bears on the figures."""
    h = out["host"]
    rounds = f"{out['repeats']}" + (f" (the 1 MiB block {out['target_repeats']} times)"
                                   if out.get("target_repeats", out["repeats"]) != out["repeats"] else "")
    lines = [f"transferd bench ({'quick' if out['quick'] else 'full'}): {rounds} interleaved rounds, "
             f"medians; {h['cpus']} CPUs, load {h.get('loadavg_before', [])} → {h['loadavg']}; "
             f"pyzmq {h['pyzmq']} / libzmq {h['libzmq']}; GB/s = 1e9 B/s"]
    if h.get("kernel"):
        sched = " ".join(f"{k}={v}" if v else k for k, v in h.get("kernel_sched_params", {}).items())
        lines.append(f"{h.get('cpu_model') or 'CPU ?'}; kernel {h['kernel']}"
                     + (f" ({sched})" if sched else "")
                     + (f"; cpuidle {h['cpuidle_driver']}" if h.get("cpuidle_driver") else "")
                     + (f"; TCP {h['tcp_congestion_control']}" if h.get("tcp_congestion_control") else ""))
    return lines


def format_table(out: dict[str, Any]) -> str:
    lines = [*table_header(out), ""]
    lim, bulk = out["limits"], out["bulk"]
    keys = list(SIZES)
    w = 12
    lines.append("message size".ljust(34) + "".join(k.rjust(w) for k in keys))
    lines.append("memcpy → pool (1 thread) GB/s".ljust(34) + "".join(_f(lim["memcpy"][k]["gbps"]).rjust(w) for k in keys))
    lines.append("preadv pool file → pool GB/s".ljust(34) + "".join(_f(lim["pread"][k]["gbps"]).rjust(w) for k in keys))
    lines.append("process_vm_readv ×2 threads GB/s".ljust(34)
                 + "".join(_f(lim["vm_read"][k]["gbps"]).rjust(w) for k in keys))
    lines.append("raw pyzmq tcp, zero-copy GB/s".ljust(34) + "".join(_f(lim["raw_zmq_tcp"][k]["gbps"]).rjust(w) for k in keys))
    for side in ("receiver", "sender"):
        lines.append(f"  {side} CPU s/GB".ljust(34)
                     + "".join(_f(lim["raw_zmq_tcp"][k].get(f"{side}_cpu_s_per_gb")).rjust(w) for k in keys))
    if "raw_tcp" in lim:
        lines.append("raw tcp socket, recv_into GB/s".ljust(34) + "".join(_f(lim["raw_tcp"][k]["gbps"]).rjust(w)
                                                                     for k in keys))
        for side in ("receiver", "sender"):
            lines.append(f"  {side} CPU s/GB".ljust(34)
                         + "".join(_f(lim["raw_tcp"][k].get(f"{side}_cpu_s_per_gb")).rjust(w) for k in keys))
    pair = lim.get("raw_tcp_pair", {}).get("1MiB", {})
    if pair.get("gbps") is not None:
        lines.append("raw tcp pair, two idle processes".ljust(34) + "".join(
            (_f(pair["gbps"]) if k == "1MiB" else "").rjust(w) for k in keys)
            + f"  ({_f(pair['vs_raw_tcp'])} × the raw tcp socket)")
    lines.append("transferd tcp (scattered) GB/s".ljust(34) + "".join(_f(bulk[k]["gbps"]).rjust(w) for k in keys))
    lines.append("  × raw pyzmq".ljust(34) + "".join(_f(bulk[k]["vs_raw_zmq"]).rjust(w) for k in keys))
    lines.append("  × raw tcp socket".ljust(34) + "".join(_f(bulk[k].get("vs_raw_tcp")).rjust(w) for k in keys))
    if pair.get("gbps") is not None:
        lines.append("  × raw tcp pair (two idle)".ljust(34) + "".join(
            (_f(bulk[k].get("vs_raw_tcp_pair")) if k == "1MiB" else "").rjust(w) for k in keys))
    lines.append("  × memcpy".ljust(34) + "".join(_f(bulk[k]["vs_memcpy"]).rjust(w) for k in keys))
    lines.append("  receiver CPU s/GB".ljust(34) + "".join(_f(bulk[k]["receiver_cpu_s_per_gb"]).rjust(w) for k in keys))
    lines.append("  sender CPU s/GB".ljust(34) + "".join(_f(bulk[k]["sender_cpu_s_per_gb"]).rjust(w) for k in keys))
    peers = out["peers"]
    if peers.get("mooncake_tcp_gbps_by_size"):
        mc = peers["mooncake_tcp_gbps_by_size"]
        lines.append("Mooncake TE tcp (peer) GB/s".ljust(34) + "".join(_f(mc[k]).rjust(w) for k in keys))
        rel = peers["transferd_tcp_vs_mooncake_tcp_by_size"]
        lines.append("  transferd tcp × Mooncake".ljust(34) + "".join(_f(rel[k]).rjust(w) for k in keys))
        need = peers.get("mooncake_target_vs_raw_tcp_by_size")
        if need:
            lines.append(f"  {TARGETS['vs_mooncake_tcp']:g} × Mooncake ÷ raw tcp socket".ljust(34)
                         + "".join(_f(need[k]).rjust(w) for k in keys))
    bc = bulk["64KiB_contig"]
    lines.append(f"transferd tcp, 64 KiB rows on contiguous pages (1 MiB messages): {_f(bc['gbps'])} GB/s, "
                 f"{_f(bc['vs_raw_zmq'])} × raw pyzmq 1 MiB")
    zs = bulk["1MiB"].get("zmq_socket")
    if zs:
        lines.append(f"transferd tcp without the data stream (ZeroMQ socket), 1 MiB rows: {_f(zs['gbps'])} GB/s, "
                     f"{_f(zs['vs_raw_zmq'])} × raw pyzmq; the stream is {_f(zs['stream_vs_zmq_socket'])} × this")
    c8 = out.get("cp8")
    if c8:
        x8 = out["limits"]["raw_tcp_x8"]["1MiB"]
        lines.append(f"CP8 bulk over TCP, 1 MiB rows, 8 ranks → 1 receiver ({c8['rooms_per_measurement']} rooms of "
                     f"{c8['pages_per_room']} pages): {_f(c8['gbps'])} GB/s, {_f(c8['vs_raw_tcp_x8'])} × eight raw tcp "
                     f"connections ({_f(x8['gbps'])} GB/s)")
        lines.append(f"  CPU s/GB: receiver {_f(c8['receiver_cpu_s_per_gb'])} (raw {_f(x8['receiver_cpu_s_per_gb'])}), "
                     f"senders summed {_f(c8['sender_cpu_s_per_gb'])} (raw {_f(x8['sender_cpu_s_per_gb'])}) = "
                     f"{_f(c8['sender_cpu_vs_cp1'])} × cp 1's {_f(c8['cp1_sender_cpu_s_per_gb'])}; the eight raw senders "
                     f"{_f(c8['raw_tcp_x8_sender_cpu_vs_raw_tcp'])} × one raw sender's {_f(c8['raw_tcp_sender_cpu_s_per_gb'])}")
        lines.append(f"  a room's mean time, expect → success: {_f(c8['room_ms_mean'])} ms = "
                     f"{_f(c8['room_vs_measurement'])} × the measurement's (cp 1, 1 MiB rows: "
                     f"{_f(bulk['1MiB']['room_vs_measurement'])})")
    sh = out["same_host"]
    if sh.get("available"):
        lines.append("transferd same-host (rows) GB/s".ljust(34) + "".join(_f(sh[k]["gbps"]).rjust(w) for k in keys))
        lines.append("  × memcpy".ljust(34) + "".join(_f(sh[k]["vs_memcpy"]).rjust(w) for k in keys))
        lines.append("  × preadv from the pool file".ljust(34) + "".join(_f(sh[k]["vs_pread"]).rjust(w) for k in keys))
        lines.append("  × process_vm_readv ×2 threads".ljust(34) + "".join(_f(sh[k]["vs_vm_read"]).rjust(w)
                                                                        for k in keys))
        lines.append("  × transferd tcp".ljust(34) + "".join(_f(sh[k]["vs_tcp"]).rjust(w) for k in keys))
        lines.append("  receiver CPU s/GB".ljust(34) + "".join(_f(sh[k]["receiver_cpu_s_per_gb"]).rjust(w)
                                                            for k in keys))
        shc = sh["64KiB_contig"]
        lines.append(f"transferd same-host, 64 KiB rows on contiguous pages: {_f(shc['gbps'])} GB/s, "
                     f"{_f(shc['vs_memcpy'])} × memcpy 1 MiB")
    else:
        lines.append(f"same-host path: — ({sh['note']})")
    st = out.get("sglang_staging", {})
    if st.get("available"):
        lines.append(f"SGLang backend staging, 1 MiB pages (CPU): gather {_f(st['gather_gbps'])} GB/s "
                     f"({_f(st['gather_vs_memcpy'])} × memcpy), scatter {_f(st['scatter_gbps'])} GB/s "
                     f"({_f(st['scatter_vs_memcpy'])} × memcpy)")
    else:
        lines.append(f"SGLang backend staging: — ({st.get('note', 'not measured')})")
    sg = out.get("sglang_room", {})
    if sg.get("available"):
        lines.append(f"SGLang backend, {sg['rooms_per_measurement']} rooms of 16 MiB end to end: {_f(sg['backend_gbps'])} "
                     f"GB/s ({_f(sg['backend_ms'])} ms), plain client {_f(sg['client_gbps'])} GB/s "
                     f"({_f(sg['client_ms'])} ms): {_f(sg['backend_vs_client'])} × the client")
    else:
        lines.append(f"SGLang backend rooms: — ({sg.get('note', 'not measured')})")
    mp = out.get("mooncake_plane", {})
    if mp.get("available"):
        lines.append("transferd over Mooncake TE GB/s".ljust(34) + "".join(_f(mp[k]["gbps"]).rjust(w) for k in keys))
        lines.append("  × raw Mooncake TE tcp".ljust(34) + "".join(_f(mp[k]["vs_mooncake_tcp"]).rjust(w) for k in keys))
        lines.append("  × transferd tcp".ljust(34) + "".join(_f(mp[k]["vs_transferd_tcp"]).rjust(w) for k in keys))
        lines.append("  receiver CPU s/GB".ljust(34) + "".join(_f(mp[k]["receiver_cpu_s_per_gb"]).rjust(w)
                                                            for k in keys))
        sm = mp["small_cp1"]
        lines.append(f"transferd over Mooncake TE, small rooms cp 1: p50 {_f(sm['p50_ms'], '{:.3f}')} ms, "
                     f"{_f(sm['rooms_per_s'], '{:.0f}')} rooms/s ({_f(sm['vs_transferd_tcp_rooms_per_s'])} × tcp)")
    bp = out.get("bytes_by_path")
    if bp:
        lines.append("bytes by path (MB): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in bp.items()))
    lines.append("")
    sr = out["small_rooms"]
    lines.append(f"small rooms (1 page of {sr['room']['kv_bytes'] // 1024} KiB over {sr['room']['messages_per_room_rank0'] - 1} "
                 f"KV buffers + aux, no state; expect → Success from the decode engine):")
    lines.append("  cp   p50 ms   p99 ms   rooms/s (" + f"{sr['cp1']['rooms_in_flight']} in flight, batched)   "
                 "engine API round trip (ping) µs   CPU µs/room: receiver, senders")
    for cp in SMALL_CPS:
        s = sr[f"cp{cp}"]
        lines.append(f"  {cp:<3}{_f(s['p50_ms'], '{:.3f}').rjust(7)}  {_f(s['p99_ms'], '{:.3f}').rjust(7)}  "
                     f"{_f(s['rooms_per_s'], '{:.0f}').rjust(8)}  {_f(s['engine_rpc_rtt_us'], '{:.0f}').rjust(27)}"
                     f"  {_f(s['receiver_cpu_us_per_room'], '{:.0f}').rjust(20)}, {_f(s['sender_cpu_us_per_room'], '{:.0f}')}")
    lines.append("")
    d = out["dedup"]
    lines.append(f"CP de-dup, {d['config']} ({d['model']}): a {d['room_tokens']}-token room, KV "
                 f"{d['kv_bytes_per_room'] / 1e6:.2f} MB, replicated state {d['state_bytes_per_room'] / 1e6:.2f} MB "
                 f"(S/KV {d['state_kv_ratio']:.4f})")
    lines.append("  cp  wire MB off  wire MB on   cut measured  cut analytic    ms off   ms on   on/off   (ms per room, "
                 "expect → Success)")
    for cp in DEDUP_CPS:
        e = d[f"cp{cp}"]
        cut_m = None if e["measured_cut"] is None else 100 * e["measured_cut"]
        lines.append(f"  {cp:<3}{_f(e['wire_mb_off']).rjust(10)}  {_f(e['wire_mb_on']).rjust(10)}   "
                     f"{_f(cut_m, '{:.4f} %').rjust(12)}  {_f(100 * e['analytic_cut'], '{:.4f} %').rjust(12)}  "
                     f"{_f(e['time_ms_off'], '{:.1f}').rjust(8)}  {_f(e['time_ms_on'], '{:.1f}').rjust(6)}  "
                     f"{_f(e['time_on_vs_off']).rjust(7)}")
    lines.append(f"  production figure at cp 8: {100 * d['production_cut_cp8']:.2f} %; this layout without the aux "
                 f"row: {100 * d['layout_cut_cp8_no_aux']:.4f} %. off: the same room from a group with "
                 "sender.dedup = false; bytes from the senders' counters")
    lines.append("")
    lines.append("targets:")
    for name, t in out["targets"].items():
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        v = t["value"]
        lines.append(f"  {name:<42} {_f(v, '{:.4g}') if isinstance(v, (int, float)) else '—':>10}  {met}"
                     + (f" ({t['limit']})" if t["met"] is False and t.get("limit") else ""))
    lines.append(f"peers: {out['notes'].get('peers', 'none')}")
    if "environment" in out["notes"]:
        lines.append(f"environment: {out['notes']['environment']}")
    lines.append(f"rooms: {out['rooms_ok']} ok, {out['rooms_failed']} failed; {out['verified_rooms']} verified byte "
                 f"for byte, {out['mismatched_bytes']} mismatched bytes; {out.get('seconds', 0):.1f} s")
    return "\n".join(lines)


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    xs = [SIZES[k] / KiB for k in SIZES]
    series = [("memcpy → pool", [out["limits"]["memcpy"][k]["gbps"] for k in SIZES]),
              ("raw pyzmq tcp", [out["limits"]["raw_zmq_tcp"][k]["gbps"] for k in SIZES]),
              ("transferd tcp", [out["bulk"][k]["gbps"] for k in SIZES])]
    if out["same_host"].get("available"):
        series.append(("transferd same-host", [out["same_host"][k]["gbps"] for k in SIZES]))
    if out["peers"].get("mooncake_tcp_gbps_by_size"):
        series.append(("Mooncake TE tcp", [out["peers"]["mooncake_tcp_gbps_by_size"][k] for k in SIZES]))
    for label, ys in series:
        ax1.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [k for k in SIZES])
    ax1.set_xlabel("message size")
    ax1.set_ylabel("GB/s")
    ax1.set_title("throughput vs message size")
    ax1.legend()
    ax1.grid(alpha=0.3)
    d = out["dedup"]
    cps = list(DEDUP_CPS)
    x = np.arange(len(cps))
    off = [d[f"cp{c}"]["wire_mb_off"] or 0 for c in cps]
    on = [d[f"cp{c}"]["wire_mb_on"] or 0 for c in cps]
    ax2.bar(x - 0.2, off, 0.4, label="de-dup off")
    ax2.bar(x + 0.2, on, 0.4, label="de-dup on")
    for i, c in enumerate(cps):
        cut = d[f"cp{c}"]["measured_cut"]
        if cut:
            ax2.text(x[i] + 0.2, on[i], f"−{100 * cut:.2f} %", ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(x, [f"cp {c}" for c in cps])
    ax2.set_ylabel("wire MB per room")
    ax2.set_title(f"CP de-dup: bytes ({d['room_tokens']}-token room)")
    ax2.legend()
    t_off = [d[f"cp{c}"]["time_ms_off"] or 0 for c in cps]
    t_on = [d[f"cp{c}"]["time_ms_on"] or 0 for c in cps]
    ax3.bar(x - 0.2, t_off, 0.4, label="de-dup off")
    ax3.bar(x + 0.2, t_on, 0.4, label="de-dup on")
    ax3.set_xticks(x, [f"cp {c}" for c in cps])
    ax3.set_ylabel("ms per room (expect → Success)")
    ax3.set_title("CP de-dup: transfer time")
    ax3.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
