"""FailureCode is the one list of room failure codes: docs/PROTOCOL.md §11 documents exactly
these, the cores raise no other, and the metrics carry every one from the start."""

from __future__ import annotations

import re
from pathlib import Path

from transferd.errors import FailureCode

ROOT = Path(__file__).resolve().parents[2]


def _section_11() -> str:
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    start = text.index("## 11. Room lifecycle, statuses and failure codes")
    return text[start:text.index("\n## 12.", start)]


def test_protocol_md_documents_exactly_the_failure_codes() -> None:
    documented: set[str] = set()
    in_codes = False  # inside a table whose first column is "code" (the receiver's and the sender's)
    for line in _section_11().splitlines():
        if not line.startswith("|"):
            in_codes = False
            continue
        first = line.split("|")[1].strip()
        if first == "code":
            in_codes = True
        elif in_codes and not first.startswith("---"):
            documented |= {m for m in re.findall(r"`([^`]+)`", first) if re.fullmatch(r"[a-z_]+", m)}
    documented.discard("fail")  # the message's name: "`room_exists` (in `fail` only)"
    assert documented == {c.value for c in FailureCode}


def test_the_cores_name_no_code_outside_the_list() -> None:
    codes = {c.value for c in FailureCode}
    for name in ("receiver_core.py", "sender_core.py"):
        src = (ROOT / "transferd" / "protocol" / name).read_text()
        for raw in re.findall(r"RoomState\.FAILED, \"([a-z_]+)\"", src):
            assert raw in codes, f"{name}: failure code {raw!r} is not a FailureCode"


def test_the_metrics_carry_every_code(tmp_path: Path) -> None:
    from transferd.daemon.metrics import failure_series

    assert set(failure_series({"peer_lost": 2, "custom_engine_code": 1})) == {c.value for c in FailureCode} | {
        "custom_engine_code"}
    assert failure_series({"peer_lost": 2})["peer_lost"] == 2
    assert failure_series({})["stalled"] == 0
