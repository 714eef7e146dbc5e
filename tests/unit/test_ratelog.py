"""Refusal log lines are rate-limited per peer and reason; memory stays bounded (fake clock)."""

from __future__ import annotations

import logging

import pytest

from transferd.daemon.ratelog import RefusalLog


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def out() -> tuple[logging.Logger, Lines]:
    log = logging.getLogger("test.ratelog")
    log.propagate = False
    h = Lines()
    log.handlers = [h]
    log.setLevel(logging.INFO)
    return log, h


def test_first_few_then_one_summary_per_window(out: tuple[logging.Logger, Lines]) -> None:
    log, h = out
    r = RefusalLog(log, "receiver d", burst=3, window_s=10.0)
    for i in range(1000):
        r.refused("decode", "b'peer'", f"garbage {i}", 1.0 + i * 0.001)
    assert len(h.lines) == 3  # the first three, each with its reason
    assert h.lines[0] == "receiver d: refused (decode) from b'peer': garbage 0"
    assert "further ones from this peer for this reason are counted" in h.lines[2]
    r.flush(5.0)  # the window is not over: nothing yet
    assert len(h.lines) == 3
    r.flush(11.5)
    assert h.lines[3] == "receiver d: refused (decode) from b'peer': 997 more not logged in the last 10 s (last: garbage 999)"
    assert r.entries == {}  # forgotten once summed up
    r.refused("decode", "b'peer'", "again", 12.0)  # a new window logs again
    assert h.lines[4].endswith(": again")


def test_peers_and_reasons_are_limited_separately(out: tuple[logging.Logger, Lines]) -> None:
    log, h = out
    r = RefusalLog(log, "rx", burst=1, window_s=10.0)
    for _ in range(5):
        r.refused("decode", "a", "x", 0.0)
        r.refused("decode", "b", "x", 0.0)
        r.refused("layout", "a", "y", 0.0)
    assert len(h.lines) == 3
    r.refused("decode", "a", "late", 10.5)  # the next refusal after the window brings the summary
    assert h.lines[3] == "rx: refused (decode) from a: 4 more not logged in the last 10 s (last: x)"
    assert h.lines[4].startswith("rx: refused (decode) from a: late")


def test_memory_is_bounded_under_many_peers(out: tuple[logging.Logger, Lines]) -> None:
    log, h = out
    r = RefusalLog(log, "rx", burst=1, window_s=10.0, max_keys=8)
    for i in range(10_000):
        r.refused("decode", f"peer{i}", "x", 0.0)
    assert len(r.entries) == 9  # 8 peers, then every other peer under one entry
    assert len(h.lines) == 9
    r.flush(20.0)
    assert h.lines[-1] == "rx: refused (decode) from other peers: 9991 more not logged in the last 10 s (last: x)"
    assert r.entries == {}


def test_lines_are_bounded_per_code_over_fresh_identities(out: tuple[logging.Logger, Lines]) -> None:
    """Thousands of fresh identities would each get ``burst`` lines: past ``code_burst`` lines of
    one code in a window, that code's refusals are only summed up (under "other peers")."""
    log, h = out
    r = RefusalLog(log, "rx", burst=5, window_s=10.0, code_burst=20)
    for i in range(3000):
        r.refused("bad_rank", f"peer{i}", f"x{i}", 0.0)
    r.refused("decode", "peerA", "other code", 0.0)  # another code has its own budget
    assert len(h.lines) == 21
    assert sum("bad_rank" in line for line in h.lines) == 20
    r.flush(10.5)
    assert h.lines[-1] == "rx: refused (bad_rank) from other peers: 2980 more not logged in the last 10 s (last: x2999)"
    assert r.entries == {} and r.per_code == {}
