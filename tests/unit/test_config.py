"""transferd.config: sizes, TOML/env/CLI precedence, unknown keys, types and model specs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import transferd
from transferd.config import Config, from_mapping, load, parse_size
from transferd.errors import ConfigError, TransferdError
from transferd.layout import StateComponent
from transferd.types import SplitMode

REPO_ROOT = Path(transferd.__file__).resolve().parent.parent


# -- parse_size --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("value", "size"),
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        ("64MiB", 64 * 2**20),
        ("1.5KiB", 1536),
        ("1KiB", 1024),
        ("10 kib", 10240),
        (" 2GB ", 2 * 10**9),
        ("3kB", 3000),
        ("1TiB", 2**40),
        ("7B", 7),
        ("0.5MiB", 2**19),
    ],
)
def test_parse_size(value: Any, size: int) -> None:
    assert parse_size(value) == size


@pytest.mark.parametrize("value", ["abc", "", "-1", -1, "1.5.5", "10XB", "1 MiBs", "MiB", True, None, [1], "1e3"])
def test_parse_size_bad(value: Any) -> None:
    with pytest.raises(ConfigError, match="sender.max_message_bytes"):
        parse_size(value, "sender.max_message_bytes")


@pytest.mark.parametrize("value", [1.5, "1.5", "1.5B", "0.3KiB"])
def test_parse_size_fractional_bytes_refused(value: Any) -> None:
    with pytest.raises(ConfigError):
        parse_size(value)


# -- defaults and the shipped file -------------------------------------------------------

def test_defaults() -> None:
    cfg = load(None, env={})
    assert cfg.source == "<defaults>"
    assert cfg == from_mapping({}, "<defaults>", env={})
    assert cfg.receiver.bind == "tcp://127.0.0.1:57500"
    assert cfg.sender.cp_size == 1 and cfg.split is SplitMode.PAGES
    assert cfg.sender.receivers == ("tcp://127.0.0.1:57500",)


def test_shipped_local_config_loads() -> None:
    path = REPO_ROOT / "configs" / "local.toml"
    if not path.exists():
        pytest.skip("configs/local.toml not in this tree")
    cfg = load(path, env={})
    assert cfg.source == str(path)
    assert cfg.sender_layout().fingerprint() == cfg.receiver_layout().fingerprint()


def test_placeholders() -> None:
    cfg = from_mapping({"run_dir": "/run/x", "sender": {"group": "pf", "cp_size": 4, "cp_rank": 1},
                        "receiver": {"name": "dec"}}, env={})
    assert cfg.receiver_pool_name() == "dec"
    assert cfg.receiver_engine_socket() == "unix:///run/x/dec.sock"
    assert cfg.sender_pool_name() == "pf-r1"
    assert cfg.sender_pool_name(rank=3) == "pf-r3"
    assert cfg.sender_engine_socket(2) == "unix:///run/x/pf-r2.sock"


# -- unknown keys name the key and the source -------------------------------------------

@pytest.mark.parametrize(
    ("data", "key", "where"),
    [
        ({"recever": {}}, "'recever'", None),
        ({"receiver": {"bnd": "x"}}, "'bnd'", "[receiver]"),
        ({"sender": {"cp": 2}}, "'cp'", "[sender]"),
        ({"demo": {"roms": 2}}, "'roms'", "[demo]"),
        ({"model": {"layers": 2}}, "'layers'", "[model]"),
        ({"model": {"state": [{"name": "a", "layers": 1, "slot_shape": 4, "dtyp": "fp32"}]}}, "'dtyp'",
         "[[model.state]] entry 0"),
    ],
)
def test_unknown_keys(data: dict[str, Any], key: str, where: str | None) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping(data, "/etc/transferd/site.toml", env={})
    msg = str(info.value)
    assert key in msg and "/etc/transferd/site.toml" in msg
    if where:
        assert where in msg


def test_section_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match=r"\[receiver\] in f.toml must be a table"):
        from_mapping({"receiver": "tcp://x"}, "f.toml", env={})
    with pytest.raises(ConfigError, match="log_level in f.toml"):
        from_mapping({"log_level": 3}, "f.toml", env={})


# -- types -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("receiver", "kv_pages", "many"),
        ("receiver", "kv_pages", True),
        ("receiver", "kv_pages", 1.5),
        ("receiver", "kv_pages", [1]),
        ("receiver", "create_pool", 1),
        ("receiver", "create_pool", "maybe"),
        ("receiver", "bind", 5),
        ("receiver", "heartbeat_interval_s", True),
        ("receiver", "heartbeat_interval_s", "soon"),
        ("sender", "receivers", [1, 2]),
        ("sender", "receivers", 5),
        ("sender", "max_message_bytes", "lots"),
        ("demo", "seed", "x"),
    ],
)
def test_bad_types(section: str, key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({section: {key: value}}, "f.toml", env={})
    assert f"{section}.{key}" in str(info.value) and "f.toml" in str(info.value)


def test_coercions() -> None:
    cfg = from_mapping(
        {"receiver": {"kv_pages": 2.0, "create_pool": "off", "heartbeat_interval_s": 2},
         "sender": {"receivers": "tcp://a:1, tcp://b:2", "max_message_bytes": "2MiB", "cp_size": "4"}},
        env={},
    )
    assert cfg.receiver.kv_pages == 2 and type(cfg.receiver.kv_pages) is int
    assert cfg.receiver.create_pool is False
    assert cfg.receiver.heartbeat_interval_s == 2.0 and type(cfg.receiver.heartbeat_interval_s) is float
    assert cfg.sender.receivers == ("tcp://a:1", "tcp://b:2")
    assert cfg.sender.max_message_bytes == 2 * 2**20
    assert cfg.sender.cp_size == 4
    assert from_mapping({"receiver": {"max_frame_bytes": "8MiB"}}, env={}).receiver.max_frame_bytes == 8 * 2**20
    assert from_mapping({"sender": {"checksum": "crc32"}}, env={}).sender.checksum == "crc32"
    buffers = from_mapping({"sender": {"stream_send_buffer_bytes": "256KiB"},
                            "receiver": {"stream_receive_buffer_bytes": 0}}, env={})
    assert buffers.sender.stream_send_buffer_bytes == 256 << 10 and buffers.receiver.stream_receive_buffer_bytes == 0


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"sender": {"cp_size": 0}}, "cp_size"),
        ({"sender": {"cp_size": 2, "cp_rank": 2}}, "cp_rank 2"),
        ({"sender": {"cp_rank": -1}}, "cp_rank -1"),
        ({"sender": {"split": "rows"}}, "'rows'"),
        ({"sender": {"max_message_bytes": 100}}, "max_message_bytes"),
        ({"sender": {"receivers": []}}, "receivers"),
        ({"receiver": {"heartbeat_interval_s": 0}}, "receiver.heartbeat_interval_s"),
        ({"sender": {"heartbeat_interval_s": -1}}, "sender.heartbeat_interval_s"),
        ({"log_format": "xml"}, "log_format"),
        ({"sender": {"group": "a/b"}}, "sender.group"),
        ({"receiver": {"name": ""}}, "receiver.name"),
        ({"sender": {"checksum": "md5"}}, "'md5'"),
        ({"receiver": {"stall_timeout_s": 0}}, "receiver.stall_timeout_s"),
        ({"receiver": {"bootstrap_timeout_s": -1}}, "receiver.bootstrap_timeout_s"),
        ({"sender": {"assign_timeout_s": 0}}, "sender.assign_timeout_s"),
        ({"receiver": {"max_frame_bytes": "64KiB"}, "sender": {"max_message_bytes": "1MiB"}},
         "receiver.max_frame_bytes"),
        ({"sender": {"stream_record_bytes": 100}}, "sender.stream_record_bytes must be >= 4096"),
        ({"sender": {"stream_send_buffer_bytes": 100}},
         r"sender.stream_send_buffer_bytes must be 0 \(the kernel's autotuning\) or 4KiB-1GiB, not 100"),
        ({"receiver": {"stream_receive_buffer_bytes": "2GiB"}}, "receiver.stream_receive_buffer_bytes must be 0"),
        ({"receiver": {"stream_receive_buffer_bytes": -1}}, "receiver.stream_receive_buffer_bytes in f.toml must be >= 0"),
        ({"receiver": {"max_frame_bytes": "4MiB"}}, r"below sender.stream_record_bytes \(8388608\)"),
        ({"receiver": {"data_plane": "ucx"}}, "'ucx'"),
        ({"sender": {"nixl_ucx_devices": "mlx5_0:1;reboot"}}, "sender.nixl_ucx_devices"),
        ({"receiver": {"nixl_ucx_modules": "^efa rm"}}, "receiver.nixl_ucx_modules"),
        ({"receiver": {"nixl_batch_entries": 0}}, "receiver.nixl_batch_entries must lie in"),
        ({"receiver": {"nixl_reads_in_flight": 65}}, "receiver.nixl_reads_in_flight must lie in"),
        ({"receiver": {"same_host_read_threads": 0}}, r"receiver.same_host_read_threads must lie in \[1, 64\], not 0"),
        ({"receiver": {"same_host_read_threads": 65}}, "receiver.same_host_read_threads must lie in"),
        ({"sender": {"sealed_pool": True, "create_pool": False}}, "sender.sealed_pool = true needs sender.create_pool"),
        ({"receiver": {"nixl_read_timeout_s": 0}}, "receiver.nixl_read_timeout_s"),
        ({"sender": {"data_plane": "nixl", "curve_secret_key": "k", "curve_server_key": "s"}}, "unencrypted"),
        ({"sender": {"mooncake_protocol": "efa"}}, "sender.mooncake_protocol must be one of tcp, rdma"),
        ({"receiver": {"mooncake_device": "mlx5_0;rm -rf"}}, "receiver.mooncake_device"),
        ({"sender": {"mooncake_hostname": "10.0.0.1:1234"}}, "sender.mooncake_hostname"),
        ({"receiver": {"mooncake_batch_entries": 0}}, "receiver.mooncake_batch_entries must lie in"),
        ({"receiver": {"mooncake_batch_entries": 4096}}, "receiver.mooncake_batch_entries must lie in"),
        ({"receiver": {"mooncake_batch_entries": 1024, "mooncake_reads_in_flight": 4}},
         "rejects a whole batch"),
        ({"receiver": {"data_plane": "mooncake", "curve_secret_key": "k", "curve_allow_dir": "d"}},
         "unencrypted"),
    ],
)
def test_validation(data: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        from_mapping(data, "f.toml", env={})


# -- [model] and [[model.state]] ---------------------------------------------------------

def test_model_and_state_components() -> None:
    cfg = from_mapping(
        {"model": {"name": "m", "dtype": "fp16", "page_size": 32, "kv_layers": 3, "kv_format": "mla",
                   "kv_token_elems": 576, "aux_row_bytes": "1KiB",
                   "state": [{"name": "conv", "layers": 3, "slot_shape": [3, 64]},
                             {"name": "ssm", "layers": 2, "slot_shape": 128, "dtype": "fp32"}]}},
        "f.toml", env={},
    )
    m = cfg.model
    assert (m.name, m.dtype, m.page_size, m.kv_layers, m.kv_format, m.kv_token_elems, m.aux_row_bytes) == (
        "m", "fp16", 32, 3, "mla", 576, 1024)
    assert m.state == (StateComponent("conv", 3, (3, 64), "fp16"),   # dtype defaults to the model's
                       StateComponent("ssm", 2, (128,), "fp32"))     # an int slot_shape is one dimension
    lay = cfg.receiver_layout()
    assert lay.state_components == ("conv", "ssm")
    assert len(lay.indices("state")) == 5
    assert lay.rows_of("state", "ssm") == cfg.receiver.state_slots


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"layers": 1, "slot_shape": 4}, "lacks 'name'"),
        ({"name": "a", "slot_shape": 4}, "lacks 'layers'"),
        ({"name": "a", "layers": 1}, "lacks 'slot_shape'"),
        ("conv", "must be a table"),
    ],
)
def test_bad_state_entries(entry: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        from_mapping({"model": {"state": [entry]}}, "f.toml", env={})
    assert "entry 0 of f.toml" in str(info.value)


def test_model_value_errors_are_transferd_errors() -> None:
    for model in ({"page_size": 0}, {"dtype": "fp4"}, {"kv_format": "gqa"},
                  {"state": [{"name": "a", "layers": 1, "slot_shape": 4}] * 2}):
        with pytest.raises(TransferdError):
            from_mapping({"model": model}, "f.toml", env={})
    with pytest.raises(ConfigError, match=r"model.page_size in f.toml"):
        from_mapping({"model": {"page_size": "16"}}, "f.toml", env={})


@pytest.mark.parametrize(
    "model",
    [
        {"kv_layers": 2.5},                                                  # TypeError escapes
        {"page_size": True},                                                 # accepted as page_size True
        {"state": [{"name": "a", "layers": "x", "slot_shape": 4}]},          # ValueError escapes
        {"state": [{"name": "a", "layers": 1, "slot_shape": "big"}]},        # ValueError escapes
        {"state": [{"name": "a", "layers": 1.7, "slot_shape": 4}]},          # truncated to 1
        "not a table",                                                       # ValueError escapes
    ],
    ids=["float-layers", "bool-page-size", "str-state-layers", "str-slot-shape", "float-state-layers",
         "model-not-table"],
)
def test_model_bad_types_are_config_errors(model: Any) -> None:
    with pytest.raises(ConfigError):
        from_mapping({"model": model}, "f.toml", env={})


# -- precedence: defaults < file < env < CLI ---------------------------------------------

FILE = {"receiver": {"bind": "tcp://127.0.0.1:1111", "kv_pages": 10}, "sender": {"cp_size": 2}}


def test_file_beats_defaults() -> None:
    cfg = from_mapping(FILE, "f.toml", env={})
    assert cfg.receiver.bind == "tcp://127.0.0.1:1111"
    assert cfg.receiver.kv_pages == 10
    assert cfg.receiver.state_slots == 64  # untouched keys keep the defaults
    assert cfg.source == "f.toml"


def test_env_beats_file() -> None:
    env = {"TRANSFERD_RECEIVER_BIND": "tcp://127.0.0.1:2222", "PATH": "/bin", "TRANSFERD_SHM_DIR": "/x"}
    cfg = from_mapping(FILE, "f.toml", env=env)
    assert cfg.receiver.bind == "tcp://127.0.0.1:2222"
    assert cfg.receiver.kv_pages == 10


def test_env_defaults_to_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFERD_RECEIVER_BIND", "tcp://127.0.0.1:3333")
    assert from_mapping(FILE, "f.toml").receiver.bind == "tcp://127.0.0.1:3333"


def test_env_values_are_coerced() -> None:
    env = {"TRANSFERD_SENDER_CP_SIZE": "8", "TRANSFERD_SENDER_CP_RANK": "7",
           "TRANSFERD_SENDER_RECEIVERS": "tcp://a:1,tcp://b:2", "TRANSFERD_RECEIVER_CREATE_POOL": "no",
           "TRANSFERD_RECEIVER_HEARTBEAT_INTERVAL_S": "0.25", "TRANSFERD_SENDER_MAX_MESSAGE_BYTES": "4MiB",
           "TRANSFERD_LOG_LEVEL": "debug", "TRANSFERD_RUN_DIR": "/run/t", "TRANSFERD_SENDER_SPLIT": "layers"}
    cfg = from_mapping({}, "f.toml", env=env)
    assert (cfg.sender.cp_size, cfg.sender.cp_rank) == (8, 7)
    assert cfg.sender.receivers == ("tcp://a:1", "tcp://b:2")
    assert cfg.receiver.create_pool is False
    assert cfg.receiver.heartbeat_interval_s == 0.25
    assert cfg.sender.max_message_bytes == 4 * 2**20
    assert cfg.log_level == "debug" and cfg.run_dir == "/run/t"
    assert cfg.split is SplitMode.LAYERS


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"TRANSFERD_RECEIVER_BND": "x"}, "'bnd'"),
        ({"TRANSFERD_FOO": "x"}, "TRANSFERD_FOO"),
        ({"TRANSFERD_MODEL_DTYPE": "fp16"}, "TRANSFERD_MODEL_DTYPE"),
        ({"TRANSFERD_RECEIVER": "x"}, "TRANSFERD_RECEIVER"),
        ({"TRANSFERD_SENDER_CP_SIZE": "two"}, "TRANSFERD_SENDER_CP_SIZE"),
        ({"TRANSFERD_SENDER_CP_RANK": "5"}, "cp_rank 5"),  # validated after env is applied
    ],
)
def test_bad_env(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        from_mapping({}, "f.toml", env=env)


def test_cli_beats_env() -> None:
    cfg = from_mapping(FILE, "f.toml", env={"TRANSFERD_RECEIVER_BIND": "tcp://127.0.0.1:2222"})
    out = cfg.with_overrides("receiver", bind="tcp://127.0.0.1:4444", kv_pages=None)
    assert out.receiver.bind == "tcp://127.0.0.1:4444"
    assert out.receiver.kv_pages == 10  # None means "flag not given"
    assert cfg.receiver.bind == "tcp://127.0.0.1:2222"  # the original is unchanged (frozen)
    unchanged = cfg.with_overrides("receiver", bind=None)
    assert unchanged.receiver.bind == "tcp://127.0.0.1:2222"


def test_cli_overrides_validated() -> None:
    cfg = from_mapping(FILE, "f.toml", env={})
    with pytest.raises(ConfigError, match="command-line flags"):
        cfg.with_overrides("sender", cp_sise=2)
    with pytest.raises(ConfigError, match="cp_rank 3"):
        cfg.with_overrides("sender", cp_rank=3)
    with pytest.raises(ConfigError, match="sender.cp_size"):
        cfg.with_overrides("sender", cp_size="x")
    assert cfg.with_overrides("sender", cp_size="4", cp_rank=3).sender.cp_rank == 3


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.log_level = "debug"  # type: ignore[misc]


# -- load() ------------------------------------------------------------------------------

def test_load_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load(p, env={})
    assert str(p) in str(info.value)


def test_load_invalid_toml(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[receiver\nbind = ")
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load(p, env={})
    assert str(p) in str(info.value)


def test_load_file_and_env(tmp_path: Path) -> None:
    p = tmp_path / "site.toml"
    p.write_text(
        'log_level = "debug"\n'
        "[receiver]\n"
        'bind = "tcp://127.0.0.1:5555"\n'
        "kv_pages = 12\n"
        "[sender]\n"
        'max_message_bytes = "64KiB"\n'
        "[model]\n"
        'dtype = "fp16"\n'
        "[[model.state]]\n"
        'name = "conv"\n'
        "layers = 2\n"
        "slot_shape = [3, 8]\n"
    )
    cfg = load(str(p), env={"TRANSFERD_RECEIVER_KV_PAGES": "20"})
    assert cfg.source == str(p)
    assert cfg.log_level == "debug"
    assert cfg.receiver.bind == "tcp://127.0.0.1:5555"
    assert cfg.receiver.kv_pages == 20
    assert cfg.sender.max_message_bytes == 65536
    assert cfg.model.state == (StateComponent("conv", 2, (3, 8), "fp16"),)


def test_load_unknown_key_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "typo.toml"
    p.write_text("[sender]\ncp_sise = 2\n")
    with pytest.raises(ConfigError, match="'cp_sise'") as info:
        load(p, env={})
    assert str(p) in str(info.value)


@pytest.mark.parametrize(("groups", "error"), [
    (["prefill0"], "must read NAME:CP_SIZE"),
    (["prefill0:4:pages:dedup:x"], "must read NAME:CP_SIZE"),
    (["bad name:4"], "group name 'bad name' must be"),
    (["p:four"], "cp_size 'four' is not an integer"),
    (["p:0"], "cp_size must lie in [1, 1024], not 0"),
    (["p:2:diagonal"], "split mode must be one of pages, layers, rank0"),
    (["p:2:pages:maybe"], "must be dedup or nodedup"),
    (["p:2", "p:4"], "group p is listed twice"),
])
def test_receiver_groups_are_validated(groups: list[str], error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        from_mapping({"receiver": {"groups": groups}}, "<t>", env={})


def test_receiver_groups_parse_with_defaults() -> None:
    from transferd.types import SplitMode

    cfg = from_mapping({"receiver": {"groups": ["prefill0:4", "p1:8:layers", "p2:2:pages:nodedup"]}}, "<t>", env={})
    assert cfg.receiver.admitted() == {"prefill0": (4, SplitMode.PAGES, True), "p1": (8, SplitMode.LAYERS, True),
                                       "p2": (2, SplitMode.PAGES, False)}
    assert from_mapping({}, "<t>", env={}).receiver.admitted() is None
    env = {"TRANSFERD_RECEIVER_GROUPS": "a:1,b:2:rank0"}
    assert set(from_mapping({}, "<t>", env=env).receiver.admitted() or {}) == {"a", "b"}
