"""The deployment files: systemd units, the compose file, the example configurations.

* Both units pass ``systemd-analyze verify`` (any warning about them counts as a failure: verify
  exits 0 on an unknown key or an unparsable value and only prints it), and they keep the
  settings that shared-memory pools, the notify protocol and the SIGTERM drain depend on.
* ``docker-compose config`` accepts ``deploy/compose/docker-compose.yml`` with the required
  variables set, refuses it without them, and every service's ``TRANSFERD_*`` environment and
  ``--cp-rank`` resolve to a valid configuration.
* Every ``configs/*.toml`` loads; the receiver/sender pair agrees on the layout.

``systemd-analyze`` (package ``systemd``) and ``docker-compose`` (Debian package
``docker-compose``; it validates a file without a Docker engine) are external tools: when one is
missing the test fails under CI (``CI`` set) and is skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from transferd.config import Config, ReceiverConfig, SenderConfig, load

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = ["transferd-receiver.service", "transferd-sender@.service", "sglang-prefill.service", "sglang-decode.service"]
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
APT = "apt-get install -y --no-install-recommends systemd docker-compose"
DRAIN_S = max(getattr(ReceiverConfig(), "drain_timeout_s", 30.0), getattr(SenderConfig(), "drain_timeout_s", 30.0))


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        why = f"{tool} is not installed ({APT})"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def seconds(value: str) -> float:
    """A systemd / compose time span: ``45``, ``45s``, ``1min 30s``, ``1m30s``."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts and "".join(n + u for n, u in parts) == value.replace(" ", ""), f"cannot read {value!r} as a time"
    return sum(float(n) * units[u] for n, u in parts)


def drain_timeouts() -> list[float]:
    """The default drain timeout and every one set by a shipped configuration."""
    out = [DRAIN_S]
    for path in CONFIGS:
        cfg = load(path, env={})
        out += [getattr(cfg.receiver, "drain_timeout_s", 0.0), getattr(cfg.sender, "drain_timeout_s", 0.0)]
    return out


# -- systemd ------------------------------------------------------------------------------------

def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        assert section is not None and "=" in line, f"not a unit line: {raw!r}"
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def analyze_verify(unit: Path) -> tuple[int, str]:
    tool = need("systemd-analyze")
    args = [tool, "verify", "--man=no"]
    if "--recursive-errors" in _analyze_help(tool):
        args.append("--recursive-errors=no")  # the host's own units are not under test
    env = dict(os.environ, SYSTEMD_LOG_LEVEL="info", SYSTEMD_LOG_COLOR="0")
    proc = subprocess.run([*args, unit.name], cwd=unit.parent, env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


@cache
def _analyze_help(tool: str) -> str:
    return subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=30).stdout


def verifiable_copy(name: str, dest: Path, edit: tuple[str, str] | None = None) -> Path:
    """The unit, copied into ``dest`` with ExecStart's binary replaced by one that exists here
    (verify checks that the command is executable), optionally with one textual edit."""
    text = (SYSTEMD / name).read_text()
    script = Path(sys.executable).with_name("transferd")
    binary = str(script) if os.access(script, os.X_OK) else "/bin/true"
    exe = "/opt/sglang/bin/python" if name.startswith("sglang-") else "/usr/local/bin/transferd"
    assert f"ExecStart={exe} " in text
    text = text.replace(f"ExecStart={exe} ", f"ExecStart={sys.executable if name.startswith('sglang-') else binary} ")
    if edit is not None:
        assert edit[0] in text, f"{edit[0]!r} not in {name}"
        text = text.replace(edit[0], edit[1], 1)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / name
    out.write_text(text)
    return out


def verify_problems(unit: Path) -> str:
    """What verify had to say about the unit (empty when it is clean)."""
    rc, out = analyze_verify(unit)
    stem = unit.name.split("@")[0].removesuffix(".service")
    about_unit = [line for line in out.splitlines() if stem in line]
    return out if rc != 0 or about_unit else ""


@pytest.mark.parametrize("name", UNITS)
def test_unit_passes_systemd_analyze_verify(name: str, tmp_path: Path) -> None:
    unit = verifiable_copy(name, tmp_path)
    assert verify_problems(unit) == "", f"systemd-analyze verify {name}"


@pytest.mark.parametrize("edit", [("Type=notify", "Type=notifyy"), ("Restart=on-failure", "Restartt=on-failure"),
                                  ("TimeoutStopSec=45", "TimeoutStopSec=45x"), ("[Service]", "[Servic]")],
                         ids=["bad-value", "unknown-key", "bad-time", "unknown-section"])
def test_verify_catches_a_broken_unit(edit: tuple[str, str], tmp_path: Path) -> None:
    """The check above can fail here: a broken copy of the receiver unit is reported."""
    unit = verifiable_copy("transferd-receiver.service", tmp_path, edit)
    assert verify_problems(unit) != ""


@pytest.mark.parametrize("name", UNITS[:2])
def test_unit_settings(name: str) -> None:
    unit = parse_unit((SYSTEMD / name).read_text())
    svc = unit["Service"]

    def one(key: str) -> str:
        assert len(svc.get(key, [])) == 1, f"{name}: expected exactly one {key}=, got {svc.get(key)}"
        return svc[key][0]

    assert one("Type") == "notify" and one("NotifyAccess") == "main"
    assert seconds(one("WatchdogSec")) > 0
    assert one("User") == one("Group") == "transferd"
    assert svc["EnvironmentFile"] == ["-/etc/default/transferd"]
    assert one("Restart") == "on-failure"
    stop_s = seconds(one("TimeoutStopSec"))
    assert stop_s > max(drain_timeouts()), f"{name}: TimeoutStopSec {stop_s}s must exceed the drain timeout"
    # the engine sockets: run_dir is the unit's runtime directory, private to the user
    assert "TRANSFERD_RUN_DIR=/run/transferd" in svc["Environment"]
    assert one("RuntimeDirectory") == "transferd" and one("RuntimeDirectoryMode") == "0700"
    # shared by every rank on the host: stopping one unit must not delete the others' sockets
    assert one("RuntimeDirectoryPreserve") == "yes"
    # pools in /dev/shm must stay the engines' and the other units' too
    assert svc.get("PrivateDevices", ["no"]) == ["no"], "PrivateDevices= gives the unit a private /dev/shm"
    assert svc.get("DynamicUser", ["no"]) == ["no"], "DynamicUser= implies RemoveIPC=yes"
    assert one("RemoveIPC") == "no", "RemoveIPC=yes deletes the user's pools when one unit stops"
    assert "/dev/shm" in " ".join(svc["ReadWritePaths"]).split()
    for key in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem"):
        assert not any("/dev" in v for v in svc.get(key, [])), f"{key}= touches /dev"
    assert one("NoNewPrivileges") == "yes" and one("ProtectSystem") == "strict"
    exec_start = one("ExecStart").split()
    assert exec_start[0] == "/usr/local/bin/transferd"
    if name.startswith("transferd-sender@"):
        assert exec_start[1:] == ["sender", "--config", "/etc/transferd/sender.toml", "--cp-rank", "%i"]
    else:
        assert exec_start[1:] == ["receiver", "--config", "/etc/transferd/receiver.toml"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_sglang_units_start_sglang_on_transferd(role: str) -> None:
    """The SGLang server units: after the node's transferd units, as their user, reading the same
    configuration file, with the transferd backend; and the prefill server's bootstrap address is the
    one configs/sglang-cp8.toml maps to the prefill group."""
    unit = parse_unit((SYSTEMD / f"sglang-{role}.service").read_text())
    svc = unit["Service"]
    cfg_file = "/etc/transferd/sender.toml" if role == "prefill" else "/etc/transferd/receiver.toml"
    assert f"TRANSFERD_CONFIG={cfg_file}" in svc["Environment"]
    assert "TRANSFERD_RUN_DIR=/run/transferd" in svc["Environment"]
    assert svc["User"] == svc["Group"] == ["transferd"]
    assert svc["RemoveIPC"] == ["no"]
    needs = " ".join(unit["Unit"]["Requires"]).split()
    assert needs == ([f"transferd-sender@{r}.service" for r in range(8)] if role == "prefill"
                     else ["transferd-receiver.service"])
    argv = svc["ExecStart"][0].split()
    assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "transferd"
    assert argv[argv.index("--disaggregation-mode") + 1] == role
    cfg = load(ROOT / "configs" / "sglang-cp8.toml", env={})
    if role == "prefill":
        host = argv[argv.index("--host") + 1]
        port = argv[argv.index("--disaggregation-bootstrap-port") + 1]
        assert f"{host}:{port}={cfg.sender.group}" in cfg.sglang.groups
        assert int(argv[argv.index("--attn-cp-size") + 1]) == cfg.sender.cp_size


def test_default_file_names_only_real_settings() -> None:
    """Every TRANSFERD_* line of /etc/default/transferd (commented or not) is a setting that the
    daemons accept: an unknown TRANSFERD_* name would keep them from starting."""
    text = (SYSTEMD / "transferd.default").read_text()
    env = dict(re.findall(r"^#?(TRANSFERD_[A-Z0-9_]+)=(\S*)$", text, re.MULTILINE))
    assert len(env) >= 10
    env.pop("TRANSFERD_SHM_DIR", None)  # not a configuration key, read by the pool module
    cfg = load(ROOT / "configs" / "receiver.toml", env=env)
    assert cfg.log_format == "json" and cfg.receiver.bind == env["TRANSFERD_RECEIVER_BIND"]


# -- docker compose -------------------------------------------------------------------------------

COMPOSE_ENV = {"DECODE_ADDR": "10.0.0.2", "CP_SIZE": "8", "KEYS_DIR": "/etc/transferd/keys"}


def compose_config(env: dict[str, str], cwd: Path, path: Path = COMPOSE) -> subprocess.CompletedProcess[str]:
    tool = need("docker-compose")
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
    return subprocess.run([tool, "-f", str(path), "config"], cwd=cwd, env={**base, **env},
                          capture_output=True, text=True, timeout=60)


def yaml_to_data(text: str) -> Any:
    """The YAML that ``docker-compose config`` prints, as Python data: with PyYAML when this
    interpreter has it, else with the interpreter that runs docker-compose (which needs it)."""
    try:
        import yaml
    except ImportError:
        first = Path(need("docker-compose")).read_bytes()[:200].split(b"\n")[0].decode(errors="replace")
        if not first.startswith("#!"):
            pytest.fail("PyYAML is not importable and docker-compose is not a Python script")
        python = first[2:].strip().split()
        out = subprocess.run([*python, "-c", "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"],
                             input=text, capture_output=True, text=True, timeout=60, check=True)
        return json.loads(out.stdout)
    return yaml.safe_load(text)


def test_compose_file_validates(tmp_path: Path) -> None:
    proc = compose_config(COMPOSE_ENV, tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = yaml_to_data(proc.stdout)
    services: dict[str, Any] = data["services"]
    prefill = sorted(n for n in services if n.startswith("prefill-r"))
    assert "decode" in services and prefill == [f"prefill-r{r}" for r in range(8)]
    for name, svc in services.items():
        assert re.fullmatch(r"transferd:\d+\.\d+\.\d+", svc["image"]), f"{name}: pin the image by version"
        assert svc.get("ipc") == "host" or "shm_size" in svc, f"{name}: pools need the engines' /dev/shm"
        assert seconds(svc["stop_grace_period"]) > max(drain_timeouts()), f"{name}: stop_grace_period vs drain"
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "transferd", "status"], f"{name}: the health check must ask the daemon"
        mounts = {v.split(":")[1]: v for v in svc["volumes"]}
        assert mounts["/etc/transferd/keys"].endswith(":ro"), f"{name}: keys are mounted read-only"
        assert mounts["/etc/transferd/keys"].startswith(COMPOSE_ENV["KEYS_DIR"] + ":")
        # the service's configuration, resolved as the daemon will resolve it
        toml = mounts["/etc/transferd/transferd.toml"].split(":")[0]
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert all(k.startswith("TRANSFERD_") for k in env), f"{name}: {sorted(env)}"
        cmd = svc["command"]
        cfg: Config = load(toml, env=env)
        if name == "decode":
            assert cmd[0] == "receiver"
            assert cfg.receiver.bind == "tcp://10.0.0.2:57500"
            assert cfg.receiver.curve_secret_key and cfg.receiver.curve_allow_dir
        else:
            rank = int(cmd[cmd.index("--cp-rank") + 1])
            assert cmd[0] == "sender" and name == f"prefill-r{rank}"
            assert test[test.index("--cp-rank") + 1] == str(rank), f"{name}: the health check asks another rank"
            cfg = cfg.with_overrides("sender", cp_rank=rank)  # validated: rank < cp_size
            assert cfg.sender.receivers == ("tcp://10.0.0.2:57500",) and cfg.sender.cp_size == 8
            assert cfg.sender.curve_secret_key and cfg.sender.curve_server_key


@pytest.mark.parametrize("missing", sorted(COMPOSE_ENV))
def test_compose_has_no_defaults_for_addresses_sizes_or_keys(missing: str, tmp_path: Path) -> None:
    env = {k: v for k, v in COMPOSE_ENV.items() if k != missing}
    proc = compose_config(env, tmp_path)
    assert proc.returncode != 0 and missing in proc.stderr, proc.stderr


COMPOSE_MC = ROOT / "deploy" / "compose" / "docker-compose.mooncake-rdma.yml"
COMPOSE_MC_ENV = {"DECODE_ADDR": "10.0.0.2", "PREFILL_ADDR": "10.0.0.1", "CP_SIZE": "8", "RDMA_DEVICE": "mlx5_0"}


def test_mooncake_rdma_compose_file_validates(tmp_path: Path) -> None:
    """The RDMA variant: every service resolves to data_plane = "mooncake" over rdma, with the
    device, the locked memory and the node addresses it needs, and no CURVE."""
    proc = compose_config(COMPOSE_MC_ENV, tmp_path, COMPOSE_MC)
    assert proc.returncode == 0, proc.stderr
    services: dict[str, Any] = yaml_to_data(proc.stdout)["services"]
    assert sorted(services) == ["decode", *(f"prefill-r{r}" for r in range(8))]
    for name, svc in services.items():
        assert re.fullmatch(r"transferd:\d+\.\d+\.\d+-mooncake", svc["image"]), name
        assert svc["build"]["args"]["EXTRAS"] == "mooncake"
        assert any(str(d).startswith("/dev/infiniband") for d in svc["devices"]), name
        assert "IPC_LOCK" in svc["cap_add"] and svc["ipc"] == "host"
        assert seconds(svc["stop_grace_period"]) > max(drain_timeouts()), name
        mounts = {v.split(":")[1]: v for v in svc["volumes"]}
        cfg: Config = load(mounts["/etc/transferd/transferd.toml"].split(":")[0],
                           env={k: str(v) for k, v in svc["environment"].items()})
        side = cfg.receiver if name == "decode" else cfg.sender
        assert (side.data_plane, side.mooncake_protocol, side.mooncake_device) == ("mooncake", "rdma", "mlx5_0")
        assert side.mooncake_hostname == ("10.0.0.2" if name == "decode" else "10.0.0.1")
        assert not side.curve_secret_key
        if name != "decode":
            cmd = svc["command"]
            cfg.with_overrides("sender", cp_rank=int(cmd[cmd.index("--cp-rank") + 1]))


@pytest.mark.parametrize("missing", sorted(COMPOSE_MC_ENV))
def test_mooncake_rdma_compose_has_no_defaults_for_addresses_sizes_or_devices(missing: str, tmp_path: Path) -> None:
    env = {k: v for k, v in COMPOSE_MC_ENV.items() if k != missing}
    proc = compose_config(env, tmp_path, COMPOSE_MC)
    assert proc.returncode != 0 and missing in proc.stderr, proc.stderr


# -- configurations ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path: Path) -> None:
    cfg = load(path, env={})
    cfg.receiver_layout()
    cfg.sender_layout()
    for rank in range(cfg.sender.cp_size):
        cfg.with_overrides("sender", cp_rank=rank)
    # a wildcard bind only together with CURVE keys
    host = cfg.receiver.bind.split("://", 1)[-1].rsplit(":", 1)[0]
    if host in ("*", "0.0.0.0", "[::]", "::"):
        assert getattr(cfg.receiver, "curve_secret_key", ""), f"{path.name}: wildcard bind without CURVE"


def test_expected_configs_exist() -> None:
    assert {"local.toml", "receiver.toml", "sender.toml", "cp8-multinode.toml", "mooncake-rdma.toml"} <= {
        p.name for p in CONFIGS}


def test_mooncake_rdma_config_reads_over_rdma_with_both_sides_agreeing() -> None:
    cfg = load(ROOT / "configs" / "mooncake-rdma.toml", env={})
    for side in (cfg.receiver, cfg.sender):
        assert (side.data_plane, side.mooncake_protocol) == ("mooncake", "rdma") and side.mooncake_device
        assert side.mooncake_hostname and not side.mooncake_hostname.startswith("127.")
    assert cfg.sender.receivers == (cfg.receiver.bind,) and not cfg.receiver.curve_secret_key
    assert cfg.model == load(ROOT / "configs" / "cp8-multinode.toml", env={}).model


def test_receiver_and_sender_configs_share_the_layout() -> None:
    rcv = load(ROOT / "configs" / "receiver.toml", env={})
    snd = load(ROOT / "configs" / "sender.toml", env={})
    assert rcv.model == snd.model
    assert rcv.receiver_layout().fingerprint() == snd.sender_layout().fingerprint()
    assert snd.sender.receivers == (rcv.receiver.bind,)


def test_multinode_config_binds_a_real_address_with_curve() -> None:
    cfg = load(ROOT / "configs" / "cp8-multinode.toml", env={})
    assert cfg.model.kv_format == "mla" and cfg.sender.cp_size == 8
    host = cfg.receiver.bind.split("://", 1)[-1].rsplit(":", 1)[0]
    assert not host.startswith("127.") and host not in ("localhost", "*", "0.0.0.0")
    assert cfg.sender.receivers == (cfg.receiver.bind,)
    assert cfg.receiver.curve_secret_key and cfg.receiver.curve_allow_dir
    assert cfg.sender.curve_secret_key and cfg.sender.curve_server_key
