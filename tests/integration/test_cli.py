"""The command line on real processes: ``transferd demo`` across CP sizes and split modes,
``transferd launch`` start-up and clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transferd.client import DecodeClient, PrefillClient
from transferd.config import load
from transferd.errors import ClientTimeout
from transferd.protocol.room import RoomState

from .harness import POLL_S, Cluster

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFERD_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.parametrize("cp, split, same_host", [
    (1, "pages", "off"), (2, "pages", "off"), (2, "pages", "auto"), (8, "pages", "off"), (8, "layers", "off"),
    (8, "rank0", "off"), (8, "pages", "auto"),
])
def test_demo_is_byte_exact_with_exact_wire_accounting(tmp_path: Path, cp: int, split: str, same_host: str) -> None:
    out = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--cp-size", str(cp), "--split", split,
                           "--rooms", "12", "--chunks", "3", "--same-host", same_host, "--json", str(out)],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert (s["cp_size"], s["split"]) == (cp, split)
    assert s["rooms_ok"] == 12 and s["rooms_failed"] == 0 and s["mismatched_bytes"] == 0
    assert s["stray_bytes"] == 0 and s["refused"] == {}
    # exactly one copy of everything crossed the wire, and the receiver saw the same bytes
    assert s["wire_bytes"] == s["expected_bytes"] == s["received_bytes"]
    assert s["expected_bytes"]["state"] > 0 and s["expected_bytes"]["kv"] > 0
    skipped = (cp - 1) * s["expected_bytes"]["state"] if split in ("pages", "rank0") else 0
    assert s["state_bytes_skipped"] == skipped
    assert "PASS" in proc.stdout and f"cp_size {cp}, split {split}" in proc.stdout
    # the same-host path moves every byte by the receiver's one copy out of the senders' pools
    assert s["same_host_bytes"] == (sum(s["wire_bytes"].values()) if same_host == "auto" else 0)
    # ... and without it, every byte goes on the senders' data streams (TCP loopback, no CURVE)
    assert s["stream_bytes"] == (0 if same_host == "auto" else sum(s["wire_bytes"].values()))
    assert s["bytes_by_path"] == {"zmq": 0, "stream": s["stream_bytes"], "same_host": s["same_host_bytes"],
                                  "mooncake": 0, "nixl": 0}


@pytest.mark.parametrize("cp, split", [(4, "pages"), (2, "layers")])
def test_demo_over_mooncake_is_byte_exact_and_moves_every_byte_by_engine_reads(
        tmp_path: Path, plane_mooncake: str, cp: int, split: str) -> None:
    """The issue's acceptance run: ``transferd demo --data-plane mooncake --cp-size 4 --json -``."""
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--data-plane", "mooncake", "--cp-size", str(cp),
                           "--split", split, "--rooms", "12", "--json", "-"],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(proc.stdout)  # the JSON alone: the summary went to stderr
    assert s["rooms_ok"] == 12 and s["rooms_failed"] == 0 and s["mismatched_bytes"] == 0 and s["stray_bytes"] == 0
    assert s["wire_bytes"] == s["expected_bytes"] == s["received_bytes"] and s["refused"] == {}
    moved = sum(s["wire_bytes"].values())
    assert s["bytes_by_path"] == {"zmq": 0, "stream": 0, "same_host": 0, "mooncake": moved, "nixl": 0} and moved > 0
    # the replicated state went once: ranks 1..cp-1 skipped it (pages split)
    assert s["state_bytes_skipped"] == ((cp - 1) * s["expected_bytes"]["state"] if split == "pages" else 0)


def test_demo_passes_exported_settings_to_its_daemons_and_names_the_ones_it_sets(tmp_path: Path) -> None:
    """Pools in another directory (``TRANSFERD_SHM_DIR``: the daemons once made theirs in /dev/shm
    whatever it said, and the demo, looking in the right place, found none), a setting exported
    for the run (no data stream: every byte on the ZeroMQ socket), and one the demo chooses itself
    (an address: named on stderr, not silently replaced)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env = _env(tmp_path) | {"TRANSFERD_SHM_DIR": str(shm), "TRANSFERD_SENDER_DATA_STREAM": "off",
                            "TRANSFERD_RECEIVER_BIND": "tcp://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--cp-size", "2", "--same-host", "off",
                           "--rooms", "6", "--json", "-"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(proc.stdout)
    assert s["rooms_ok"] == 6 and s["rooms_failed"] == 0 and s["mismatched_bytes"] == 0 and s["stray_bytes"] == 0
    moved = sum(s["wire_bytes"].values())
    assert s["bytes_by_path"] == {"zmq": moved, "stream": 0, "same_host": 0, "mooncake": 0, "nixl": 0} and moved > 0
    named = [line for line in proc.stderr.splitlines() if "not passed on to its daemons" in line]
    assert len(named) == 1 and named[0].endswith(": TRANSFERD_RECEIVER_BIND"), proc.stderr
    assert list(shm.iterdir()) == []  # the pools were made there and removed at the end


def test_demo_fails_loudly_when_its_pools_are_too_small(tmp_path: Path) -> None:
    cfg = (ROOT / "configs" / "local.toml").read_text().replace("kv_pages = 1024\nstate_slots = 64\naux_slots = 64\n"
                                                               "max_message_bytes", "kv_pages = 16\nstate_slots = 64\n"
                                                               "aux_slots = 64\nmax_message_bytes")
    path = tmp_path / "small.toml"
    path.write_text(cfg)
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--config", str(path), "--rooms", "2"],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "source pages but only" in proc.stderr


def test_launch_starts_a_working_pair_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    cfg_text = (ROOT / "configs" / "local.toml").read_text()
    cfg_text = cfg_text.replace('bind = "tcp://127.0.0.1:57500"', 'bind = "tcp://127.0.0.1:*"')
    cfg_text = cfg_text.replace('pool = "{name}"', f'pool = "launch{os.getpid()}-{{name}}"')
    cfg_text = cfg_text.replace('pool = "{group}-r{rank}"', f'pool = "launch{os.getpid()}-{{group}}-r{{rank}}"')
    path = tmp_path / "launch.toml"
    path.write_text(cfg_text)
    env = _env(tmp_path)
    env["TRANSFERD_RUN_DIR"] = str(tmp_path / "run")
    env["TRANSFERD_RECEIVER_METRICS_BIND"] = env["TRANSFERD_SENDER_METRICS_BIND"] = "127.0.0.1:0"
    cfg = load(path, env=env)
    proc = subprocess.Popen([sys.executable, "-m", "transferd", "launch", "--config", str(path), "--cp-size", "2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            if line.startswith("transferd: receiver"):
                ready.set()  # launch has finished starting every daemon

    threading.Thread(target=read, daemon=True).start()
    try:
        dc = DecodeClient(cfg.receiver_engine_socket(), timeout_s=1)
        deadline = time.monotonic() + 60
        while True:
            try:
                groups = dc.status()["groups"]
                if len(groups.get("prefill0", {}).get("ranks", {})) == 2:
                    break
            except ClientTimeout:
                pass
            assert proc.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "launch did not come up"
            time.sleep(POLL_S)  # polling under the deadline above
        pids = [int(r["pid"]) for r in groups["prefill0"]["ranks"].values()] + [dc.status()["pid"]]
        # one room through the launched daemons
        pcs = [PrefillClient(cfg.sender_engine_socket(r), timeout_s=20) for r in range(2)]
        from transferd.pool import Pool

        spools = [Pool.attach(cfg.sender_pool_name(r)) for r in range(2)]
        for p in spools:
            p.rows[p.layout.aux_index][0, :8] = list((4242).to_bytes(8, "little"))
        dc.timeout_s = 20
        dc.expect(4242, "prefill0", list(range(8)), aux_slot=0, state={"conv": [0], "ssm": [0]})
        for pc in pcs:
            pc.submit(4242, 0, list(range(100, 108)), last=True, state={"conv": [1], "ssm": [1]}, aux_slot=0)
        assert dc.wait(4242, "prefill0", 20).state is RoomState.SUCCESS
        for p in spools:
            p.close()
        for c in [dc, *pcs]:
            c.close()
        # supervision: a sender that dies is started again and registers as a new incarnation
        assert ready.wait(60), "".join(output)
        old = groups["prefill0"]["ranks"]["1"]
        os.kill(old["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        dc = DecodeClient(cfg.receiver_engine_socket(), timeout_s=1)
        while True:
            try:
                rank1 = dc.status()["groups"].get("prefill0", {}).get("ranks", {}).get("1")
                if rank1 and rank1["pid"] != old["pid"]:
                    break
            except ClientTimeout:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "".join(output)
            time.sleep(POLL_S)
        assert rank1["incarnation"] != old["incarnation"]
        pids.append(rank1["pid"])
        dc.close()
        # the README's client example runs against the same daemons (the restarted rank included)
        ex = subprocess.run([sys.executable, str(ROOT / "scripts" / "client_example.py"), "--config", str(path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert ex.returncode == 0, ex.stdout + ex.stderr
        assert "decode: room 2024 success" in ex.stdout and "prefill: success, success" in ex.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in pids:  # every child is gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not list(Path("/dev/shm").glob(f"transferd-launch{os.getpid()}-*")), "pools left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_demo_many_batches_reusing_rows(tmp_path: Path) -> None:
    """Rows go back to the free lists after every batch; prefix rows then hold an earlier room's
    bytes, which must be left exactly as they were (a demo bug once compared them with the pool's
    first contents)."""
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--rooms", "48", "--in-flight", "3",
                           "--json", str(out)], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(out.read_text())
    assert s["rooms_ok"] == 48 and s["mismatched_bytes"] == 0 and s["corrupted_rooms"] == 0


def test_json_dash_puts_the_json_alone_on_stdout_and_the_summary_on_stderr(tmp_path: Path, cluster: Cluster) -> None:
    """``--json -`` (demo here; bench and soak in their own tests) and the ``--json`` flags (status,
    config check): stdout parses as one JSON document in full, so ``transferd demo --json - | jq
    .rooms_ok`` works; the human summary goes to stderr. Without ``--json -`` it stays on stdout."""
    env = _env(tmp_path)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "transferd", *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    demo = run("demo", "--rooms", "4", "--json", "-")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    s = json.loads(demo.stdout)
    assert s["rooms_ok"] == 4 and s["mismatched_bytes"] == 0
    assert "transferd demo: cp_size 2, split pages: 4 rooms ok, 0 failed" in demo.stderr and "PASS" in demo.stderr
    plain = run("demo", "--rooms", "4")
    assert plain.returncode == 0 and "4 rooms ok" in plain.stdout and "PASS" in plain.stdout
    # config check --json: one document, for one file and for several
    files = sorted(str(p) for p in (ROOT / "configs").glob("*.toml"))[:2]
    one = run("config", "check", "--json", files[0])
    assert one.returncode == 0 and json.loads(one.stdout)["file"] == files[0]
    both = run("config", "check", "--json", *files)
    assert both.returncode == 0 and [d["file"] for d in json.loads(both.stdout)] == files
    bad = tmp_path / "bad.toml"
    bad.write_text("[sender]\ncp_size = 2\ncp_rank = 2\n")
    mixed = run("config", "check", "--json", files[0], str(bad))
    docs = json.loads(mixed.stdout)
    assert mixed.returncode == 2 and "config" in docs[0] and "cp_rank 2 is outside cp_size 2" in docs[1]["error"]
    assert "INVALID" in mixed.stderr
    # status --json, of a receiver and of a sender
    ep, dc, _ = cluster.receiver()
    pcs, _ = cluster.group("prefill0", 1, [ep])
    cluster.until(lambda: len(dc.status()["groups"].get("prefill0", {}).get("ranks", {})) == 1, "registration")
    rx = run("status", "--json", "--endpoint", dc.endpoint)
    assert rx.returncode == 0, rx.stderr
    st = json.loads(rx.stdout)
    assert st["role"] == "receiver" and list(st["groups"]["prefill0"]["ranks"]) == ["0"]
    tx = run("status", "--json", "--sender", "0", "--endpoint", pcs[0].endpoint)
    assert tx.returncode == 0, tx.stderr
    assert json.loads(tx.stdout)["role"] == "sender"


def test_demo_hostile_flood_is_refused_in_full_and_fails_no_room(tmp_path: Path) -> None:
    """``--fault hostile-flood:N``: a peer that never registers sends N garbage messages to the
    receiver's ZeroMQ port while rooms are in flight; every one is refused and counted, every
    room succeeds byte-exact, nothing is written outside the rooms."""
    proc = subprocess.run([sys.executable, "-m", "transferd", "demo", "--rooms", "16", "--in-flight", "4",
                           "--fault", "hostile-flood:5000", "--json", "-"], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads(proc.stdout)
    assert s["faults"] == ["hostile-flood:5000"] and s["recovered"] and s["rooms_after_fault"] == 4
    assert s["rooms_ok"] == 16 and s["rooms_failed"] == 0 and s["mismatched_bytes"] == s["stray_bytes"] == 0
    assert sum(s["refused"].values()) == 5000  # not msgpack, bad headers, wrong version, stray frames
    assert {"decode", "malformed", "version"} <= set(s["refused"])
