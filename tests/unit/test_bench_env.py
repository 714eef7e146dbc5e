"""The bench gives its daemons their settings itself: ``TRANSFERD_*`` settings in its own
environment do not reach them (a run meant to measure a setting that way would measure the
default), and it names the ones it drops; variables that hold no setting pass through."""

from __future__ import annotations

from transferd.tools.bench.cluster import daemon_base_env


def test_settings_are_dropped_and_named_the_rest_passes() -> None:
    env, ignored = daemon_base_env({
        "PATH": "/usr/bin", "TRANSFERD_SENDER_STREAM_SEND_BUFFER_BYTES": "0", "TRANSFERD_LOG_LEVEL": "debug",
        "TRANSFERD_SHM_DIR": "/run/pools", "TRANSFERD_CONFIG": "/etc/transferd/decode.toml", "XTRANSFERD_A": "1"})
    assert env == {"PATH": "/usr/bin", "TRANSFERD_SHM_DIR": "/run/pools", "XTRANSFERD_A": "1"}
    # TRANSFERD_CONFIG names a file (the bench writes its own), not a setting: dropped, not named
    assert ignored == ["TRANSFERD_LOG_LEVEL", "TRANSFERD_SENDER_STREAM_SEND_BUFFER_BYTES"]


def test_nothing_to_say_without_settings() -> None:
    assert daemon_base_env({"HOME": "/root"}) == ({"HOME": "/root"}, [])
