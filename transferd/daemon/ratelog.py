"""Refusal log lines, rate-limited per peer and reason, so garbage traffic cannot fill the journal.

The first ``burst`` refusals of one (peer, code) in a window are logged one line each, as before;
later ones of that window are only counted, and the next refusal after the window, or the next
:meth:`RefusalLog.flush` (the agents' tick), logs one summary line with the count. The counters
(``refused[code]``, the metrics) still count every refusal: only the log lines are limited.

Memory is bounded whatever a peer sends: at most ``max_keys`` (peer, code) entries are kept; past
that, refusals are counted under one entry per code for every other peer ("other peers"). Lines
are bounded whatever the number of peers: at most ``code_burst`` lines per code in a window over
all peers (a flood from thousands of fresh identities would otherwise log ``burst`` lines each);
past that, the code's refusals are only summed up, under "other peers".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

BURST = 5  # lines per (peer, code) in one window
CODE_BURST = 100  # lines per code in one window, over every peer
WINDOW_S = 30.0
MAX_KEYS = 1024


@dataclass(slots=True)
class _Entry:
    start: float
    logged: int = 0
    suppressed: int = 0
    last_why: str = ""


class RefusalLog:
    def __init__(self, log: logging.Logger, name: str, *, burst: int = BURST, window_s: float = WINDOW_S,
                 max_keys: int = MAX_KEYS, head: str = "refused ({code}) from {peer}",
                 code_burst: int = CODE_BURST) -> None:
        self.log = log
        self.name = name
        self.head = head  # what a line says before its reason: the code and the peer filled in
        self.burst = burst
        self.window_s = window_s
        self.max_keys = max_keys
        self.code_burst = code_burst
        self.entries: dict[tuple[str, str], _Entry] = {}
        self.per_code: dict[str, _Entry] = {}  # lines per code in its current window, over every peer
        self.lines = 0  # log lines written (refusal lines and summaries), for tests and stats

    def refused(self, code: str, peer: str, why: str, now: float) -> None:
        c = self.per_code.get(code)
        if c is None or now - c.start >= self.window_s:
            c = self.per_code[code] = _Entry(now)
        if c.logged >= self.code_burst:  # this code's lines of the window are spent: summed up only
            key = ("other peers", code)
            e = self.entries.get(key)
            if e is None:
                e = self.entries[key] = _Entry(now, logged=self.burst)
            e.suppressed += 1
            e.last_why = why
            return
        key = (peer, code)
        e = self.entries.get(key)
        if e is None:
            if len(self.entries) >= self.max_keys:
                key = ("other peers", code)
                e = self.entries.get(key)
            if e is None:
                e = self.entries[key] = _Entry(now)
        if now - e.start >= self.window_s:
            self._summary(key, e)
            e.start, e.logged = now, 0
        if e.logged < self.burst:
            e.logged += 1
            c.logged += 1
            self.lines += 1
            more = (f" (the {self.burst}th in {now - e.start:.0f} s: further ones from this peer for this reason are "
                    f"counted and summed up every {self.window_s:.0f} s)") if e.logged == self.burst else ""
            self.log.warning("%s: %s: %s%s", self.name, self.head.format(code=code, peer=key[0]), why, more)
        else:
            e.suppressed += 1
            e.last_why = why

    def _summary(self, key: tuple[str, str], e: _Entry) -> None:
        if e.suppressed:
            self.lines += 1
            self.log.warning("%s: %s: %d more not logged in the last %.0f s (last: %s)", self.name,
                             self.head.format(code=key[1], peer=key[0]), e.suppressed, self.window_s, e.last_why)
            e.suppressed = 0

    def flush(self, now: float) -> None:
        """Summaries of the windows that ended; entries idle for a window are forgotten."""
        for key, e in list(self.entries.items()):
            if now - e.start >= self.window_s:
                self._summary(key, e)
                del self.entries[key]
        for code, c in list(self.per_code.items()):
            if now - c.start >= self.window_s:
                del self.per_code[code]
