"""Running transferd as a service: metrics scraped from a real endpoint, `transferd status`,
CURVE on real sockets, the systemd notify protocol on a real datagram socket, SIGTERM drain,
`transferd config check` and configuration precedence through the command line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from transferd.errors import TransferdError
from transferd.protocol.messages import PROTOCOL_VERSION
from transferd.protocol.room import RoomState

from .harness import Cluster, fill_random
from .rooms import expect, make_room, mismatches, state_copy_bytes, submit_all

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_endpoint_after_real_rooms(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 2, [ep])
    for i, p in enumerate(spools):
        fill_random(p, i)
    for k in range(3):
        r = make_room(100 + k, "prefill0", 9, 2, prefix=k, dst_start=20 * k, slot=k, spools=spools)
        expect(dc, r)
        submit_all(pcs, r)
        assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    bad = make_room(110, "prefill0", 4, 2, dst_start=100, slot=9, spools=spools)
    expect(dc, bad)
    dc.abort(bad.room, bad.group, "test")
    rx = dc.stats()
    m = _scrape(rx["metrics_port"])
    for kind in ("kv", "state", "aux"):
        assert m[("transferd_bytes_total", (("direction", "received"), ("kind", kind)))] == rx["bytes"][kind]
    # every byte came on the senders' data streams (the default between hosts, here over loopback)
    assert m[("transferd_stream_bytes_total", (("direction", "received"),))] == sum(rx["bytes"].values()) > 0
    assert m[("transferd_rooms_total", (("outcome", "success"), ("reason", "")))] == 3
    assert m[("transferd_rooms_total", (("outcome", "failed"), ("reason", "aborted")))] == 1
    assert m[("transferd_room_duration_seconds_count", (("outcome", "success"),))] == 3
    assert m[("transferd_registered_ranks", (("group", "prefill0"),))] == 2
    assert m[("transferd_bytes_in_flight", ())] == 0
    assert ("transferd_info", (("name", "decode0"), ("protocol", str(PROTOCOL_VERSION)), ("role", "receiver"),
                               ("version", "0.1.0"))) in m
    copy = state_copy_bytes(dpool)
    s1 = pcs[1].stats()
    m1 = _scrape(s1["metrics_port"])
    assert m1[("transferd_state_bytes_skipped_total", ())] == 3 * copy == s1["state_bytes_skipped"]
    assert m1[("transferd_bytes_total", (("direction", "sent"), ("kind", "state")))] == 0
    m0 = _scrape(pcs[0].stats()["metrics_port"])
    assert m0[("transferd_bytes_total", (("direction", "sent"), ("kind", "state")))] == 3 * copy


def test_status_command_shows_ranks_rooms_and_throughput(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    pcs, spools = cluster.group("prefill0", 2, [ep])
    r = make_room(7, "prefill0", 6, 2, spools=spools)
    expect(dc, r)
    # the engine socket is private to its user, in a private directory
    assert dc.endpoint.startswith("unix://")  # the default transport
    sock_path = Path(dc.endpoint[len("unix://"):])
    assert sock_path.stat().st_mode & 0o777 == 0o600 and sock_path.parent.stat().st_mode & 0o777 == 0o700
    cfg_r = cluster.tmp / "receiver-decode0.toml"
    cfg_s = cluster.tmp / "sender-prefill0-r1.toml"
    def run(*a):
        return subprocess.run([sys.executable, "-m", "transferd", "status", *a], cwd=ROOT, env=_env(),
                                        capture_output=True, text=True, timeout=30)
    out = run("--config", str(cfg_r), "--json")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    ranks = st["groups"]["prefill0"]["ranks"]
    assert sorted(ranks) == ["0", "1"] and all(v["pid"] > 0 and v["incarnation"] for v in ranks.values())
    assert st["rooms"] == {"waiting": 1} and "throughput_bytes_per_s" in st
    text = run("--config", str(cfg_r))
    assert text.returncode == 0
    assert "GROUP" in text.stdout and "prefill0" in text.stdout and "rooms: waiting 1" in text.stdout
    sender = run("--config", str(cfg_s), "--sender", "1")
    assert sender.returncode == 0 and "sender prefill0/r1" in sender.stdout and "registered" in sender.stdout
    dc.release(r.room, r.group)
    # nobody there: exit 1 (what a container health check needs)
    for scheme in ("unix", "ipc"):  # either transport
        gone = run("--endpoint", f"{scheme}://{cluster.tmp}/nobody.sock", "--timeout", "0.5")
        assert gone.returncode == 1 and "no answer" in gone.stderr


def _keygen(d: Path, name: str) -> None:
    out = subprocess.run([sys.executable, "-m", "transferd", "keygen", str(d), "--name", name], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert (d / f"{name}.key_secret").stat().st_mode & 0o777 == 0o600


def test_curve_allows_listed_senders_and_refuses_the_rest(cluster: Cluster) -> None:
    keys, allow = cluster.tmp / "keys", cluster.tmp / "allow"
    for name in ("decode", "good", "intruder"):
        _keygen(keys, name)
    allow.mkdir()
    (allow / "good.key").write_bytes((keys / "good.key").read_bytes())
    ep, dc, dpool = cluster.receiver(curve_secret_key=str(keys / "decode.key_secret"), curve_allow_dir=str(allow))
    pcs, spools = cluster.group("prefill0", 1, [ep], curve_secret_key=str(keys / "good.key_secret"),
                                curve_server_key=str(keys / "decode.key"))
    fill_random(spools[0], 1)
    before = [rows.copy() for rows in dpool.rows]
    r = make_room(5, "prefill0", 6, 1, spools=spools)
    expect(dc, r)
    submit_all(pcs, r)
    assert dc.wait(r.room, r.group, 20).state is RoomState.SUCCESS
    assert mismatches(r, dpool, spools, "pages", before) == 0
    # a key that is not on the allow-list, and no key at all: refused at the handshake, counted, logged
    bad, _ = cluster.group("other", 1, [ep], wait=False, curve_secret_key=str(keys / "intruder.key_secret"),
                           curve_server_key=str(keys / "decode.key"), pool=f"{cluster.tag}-intruder-r{{rank}}")
    plain, _ = cluster.group("plain", 1, [ep], wait=False, pool=f"{cluster.tag}-plain-r{{rank}}")
    cluster.until(lambda: dc.stats()["refused"].get("auth", 0) >= 1, "the intruder's refusal")
    cluster.until(lambda: dc.stats()["refused"].get("handshake", 0) >= 1, "the plain sender's refusal")
    assert sorted(dc.status()["groups"]) == ["prefill0"]
    assert bad[0].status()["receivers"][0]["state"] == "registering"
    log = cluster.proc("receiver-decode0").log.read_text()
    assert "refused (auth)" in log and "refused (handshake)" in log


def test_wildcard_bind_without_keys_warns_loudly(cluster: Cluster) -> None:
    cluster.receiver(bind="tcp://0.0.0.0:*")
    log = cluster.proc("receiver-decode0").log.read_text()
    assert "WITHOUT encryption or authentication" in log


def test_systemd_notify_protocol_on_a_real_socket(cluster: Cluster) -> None:
    path = cluster.tmp / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(20)
    cfg = cluster.write_config("notify", {"receiver": {"bind": "tcp://127.0.0.1:*", "pool": f"{cluster.tag}-n",
                                                       "kv_pages": 16, "metrics_bind": ""}})
    env = _env() | {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"}
    proc = subprocess.Popen([sys.executable, "-m", "transferd", "receiver", "--config", str(cfg)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        msgs = []
        while not any("WATCHDOG=1" in m for m in msgs):
            msgs.append(sock.recv(4096).decode())
        assert msgs[0].startswith("READY=1\n") and "STATUS=receiver decode0" in msgs[0]
        assert f"MAINPID={proc.pid}" in msgs[0]
        proc.send_signal(signal.SIGTERM)
        while not any(m.startswith("STOPPING=1") for m in msgs):
            msgs.append(sock.recv(4096).decode())
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
        for f in Path("/dev/shm").glob(f"transferd-{cluster.tag}-n"):
            f.unlink()


def test_sigterm_drains_rooms_in_flight_then_exits_zero(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(drain_timeout_s=20)
    pcs, spools = cluster.group("prefill0", 1, [ep])
    fill_random(spools[0], 2)
    before = [rows.copy() for rows in dpool.rows]
    r = make_room(1, "prefill0", 8, 1, chunks=[(0, 4), (4, 8)], spools=spools)
    expect(dc, r)
    pcs[0].submit(r.room, 0, r.src[0][:4])
    rx = cluster.proc("receiver-decode0").proc
    rx.send_signal(signal.SIGTERM)
    cluster.until(lambda: dc.stats()["draining"], "the drain to start")
    with pytest.raises(TransferdError, match="shutting down and takes no new rooms"):
        dc.expect(2, "prefill0", [50], aux_slot=5)
    pcs[0].submit(r.room, 4, r.src[0][4:], last=True, state=r.state_src[0], aux_slot=r.aux_src[0])
    assert pcs[0].wait(r.room, 20).state is RoomState.SUCCESS  # the room in flight finished
    assert rx.wait(20) == 0
    assert mismatches(r, dpool, spools, "pages", before) == 0


def test_drain_timeout_fails_what_is_left_with_shutting_down(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver(drain_timeout_s=0.5)
    pcs, spools = cluster.group("prefill0", 1, [ep])
    r = make_room(3, "prefill0", 8, 1, chunks=[(0, 4), (4, 8)], spools=spools)
    expect(dc, r)
    pcs[0].submit(r.room, 0, r.src[0][:4])
    rx = cluster.proc("receiver-decode0").proc
    rx.send_signal(signal.SIGTERM)
    assert rx.wait(20) == 0
    st = pcs[0].wait(r.room, 20)  # the prefill side hears the reason
    assert st.state is RoomState.FAILED and st.code == "shutdown" and "shutting down" in st.reason


def test_config_check_and_precedence_on_the_command_line(tmp_path: Path) -> None:
    files = sorted(str(p) for p in (ROOT / "configs").glob("*.toml"))
    out = subprocess.run([sys.executable, "-m", "transferd", "config", "check", *files], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": OK") == len(files)
    bad = tmp_path / "bad.toml"
    bad.write_text('[sender]\ncp_size = 2\ncp_rank = 2\n')
    out = subprocess.run([sys.executable, "-m", "transferd", "config", "check", str(bad)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cp_rank 2 is outside cp_size 2" in out.stderr
    bad.write_text('[receiver]\nbind = "tcp://127.0.0.1:70000"\n')
    out = subprocess.run([sys.executable, "-m", "transferd", "config", "check", str(bad)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "port 70000 is out of range" in out.stderr
    # defaults < file < environment < flags, through a real daemon start-up
    f = tmp_path / "p.toml"
    f.write_text('[receiver]\nname = "fromfile"\nkv_pages = 8\npool = "prec' + str(os.getpid()) + '"\n'
                 'metrics_bind = ""\nbind = "tcp://127.0.0.1:*"\n')
    env = _env() | {"TRANSFERD_RECEIVER_NAME": "fromenv", "TRANSFERD_RUN_DIR": str(tmp_path / "run")}
    out = subprocess.run([sys.executable, "-m", "transferd", "config", "check", "--json", str(f)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["config"]["receiver"]["name"] == "fromenv"
    proc = subprocess.Popen([sys.executable, "-m", "transferd", "receiver", "--config", str(f), "--name", "fromflag"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from transferd.client import DecodeClient
        from transferd.errors import ClientTimeout

        dc = DecodeClient(f"unix://{tmp_path}/run/fromflag.sock", timeout_s=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert dc.stats()["name"] == "fromflag"
                break
            except ClientTimeout:
                assert time.monotonic() < deadline and proc.poll() is None
        dc.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_json_logs_carry_room_and_peer_ids(cluster: Cluster) -> None:
    ep, dc, dpool = cluster.receiver()
    cfg = cluster.write_config("jsonlog", {"log_format": "json", "log_level": "info", "sender": {
        "group": "pj", "cp_size": 1, "receivers": [ep], "pool": f"{cluster.tag}-pj-r{{rank}}", "kv_pages": 64,
        "metrics_bind": "", "same_host": "off"}})
    proc = cluster._spawn("sender-pj-r0", ["sender"], cfg)
    from transferd.client import PrefillClient

    pc = PrefillClient(proc.cfg.sender_engine_socket(0), timeout_s=20)
    cluster.clients.append(pc)
    cluster.until(lambda: pc.status()["receivers"][0]["state"] == "registered", "registration")
    pc.abort(4242, "engine gave up")  # a room-level event on the sender
    lines = [json.loads(line) for line in proc.log.read_text().splitlines() if line.strip()]
    assert lines and all({"ts", "level", "logger", "msg", "pid"} <= set(x) for x in lines)
    assert any("registered with receiver decode0" in x["msg"] for x in lines)
    assert any("room 4242 failed (aborted)" in x["msg"] for x in lines)
