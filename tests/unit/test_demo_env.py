"""The demo's daemons get the settings exported for it (``TRANSFERD_SHM_DIR`` above all: the demo
attaches to their pools there), except the addresses, sockets, pools and run directory the demo
chooses itself, and those it names rather than ignore them silently."""

from __future__ import annotations

import os

import pytest

from transferd.config import load
from transferd.tools.demo import child_env, overridden_settings


def test_exported_settings_pass_on_and_the_demos_own_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"TRANSFERD_SHM_DIR": "/run/pools", "TRANSFERD_SENDER_CHECKSUM": "xxh3",
                 "TRANSFERD_SENDER_DATA_STREAM": "off", "TRANSFERD_RECEIVER_BIND": "tcp://0.0.0.0:57500",
                 "TRANSFERD_RECEIVER_STREAM_PORT": "57600", "TRANSFERD_SENDER_ENGINE_SOCKET": "unix:///run/p.sock",
                 "TRANSFERD_CONFIG": "/etc/transferd/decode.toml", "PATH": "/usr/bin"}.items():
        monkeypatch.setenv(k, v)
    base = load(None)
    env = child_env(None, base, "/tmp/demo-run", "demo1")
    assert env["TRANSFERD_SHM_DIR"] == "/run/pools" and env["PATH"] == "/usr/bin"
    assert env["TRANSFERD_SENDER_CHECKSUM"] == "xxh3" and env["TRANSFERD_SENDER_DATA_STREAM"] == "off"
    assert "TRANSFERD_CONFIG" not in env  # the daemons are given the file by name
    assert env["TRANSFERD_RECEIVER_BIND"] == "tcp://127.0.0.1:*" and env["TRANSFERD_RECEIVER_STREAM_PORT"] == "0"
    assert env["TRANSFERD_SENDER_ENGINE_SOCKET"] == "unix://{run_dir}/{group}-r{rank}.sock"
    assert overridden_settings(env) == ["TRANSFERD_RECEIVER_BIND", "TRANSFERD_RECEIVER_STREAM_PORT",
                                        "TRANSFERD_SENDER_ENGINE_SOCKET"]
    cfg = load(None, env=env)  # what the daemons read: the exported settings and the demo's own
    assert cfg.sender.checksum == "xxh3" and cfg.sender.data_stream == "off"
    assert cfg.run_dir == "/tmp/demo-run" and cfg.sender_engine_socket(0) == "unix:///tmp/demo-run/prefill0-r0.sock"


def test_nothing_named_when_nothing_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("TRANSFERD_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("TRANSFERD_SENDER_CHECKSUM", "xxh3")
    assert overridden_settings(child_env(None, load(None), "/tmp/r", "demo2")) == []
