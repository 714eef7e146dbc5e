"""The Prometheus endpoint of a daemon (prometheus_client, one registry per agent).

Counters are read from the agent's :class:`~transferd.accounting.Accounting` at scrape time (a
custom collector), so the data path never touches prometheus_client. The room-duration histogram
too: a room's end adds one to a plain list of bucket counts (:class:`RoomDurations`), which the
scrape turns into the histogram's series (prometheus_client's ``Histogram.labels().observe()``
took ≈ 36 µs of a sender's CPU a room, cold, where a room ends; docs/PERFORMANCE.md, issue 14's
twenty-second round).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ..config import parse_hostport
from ..errors import ConfigError, FailureCode

log = logging.getLogger(__name__)

DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# the "le" labels as prometheus_client's Histogram wrote them ("1.0", "+Inf"): the same series as before
_LE: tuple[str, ...] = (*(str(floatToGoString(b)) for b in DURATION_BUCKETS),  # type: ignore[no-untyped-call]
                        "+Inf")


Snapshot = Callable[[], dict[str, Any]]
"""An agent's ``metric_snapshot``: counters and gauges, a consistent copy made under the GIL."""


class _AgentCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot()
        role = snap["role"]
        direction = "sent" if role == "sender" else "received"
        info = InfoMetricFamily("transferd", "transferd daemon identity")
        info.add_metric([], {k: str(v) for k, v in snap["info"].items()})
        yield info
        c = CounterMetricFamily("transferd_bytes", "Payload bytes moved, by kind and direction",
                                labels=["direction", "kind"])
        for kind, n in snap["bytes"].items():
            c.add_metric([direction, kind], n)
        yield c
        c = CounterMetricFamily("transferd_same_host_bytes", "Part of transferd_bytes moved by the same-host path",
                                labels=["direction"])
        c.add_metric([direction], snap["shm_bytes"])
        yield c
        c = CounterMetricFamily("transferd_stream_bytes", "Part of transferd_bytes moved on data streams (plain TCP, "
                                "not through ZeroMQ)", labels=["direction"])
        c.add_metric([direction], snap["stream_bytes"])
        yield c
        c = CounterMetricFamily("transferd_mooncake_bytes", "Part of transferd_bytes moved by Mooncake Transfer "
                                "Engine reads", labels=["direction"])
        c.add_metric([direction], snap["mooncake_bytes"])
        yield c
        c = CounterMetricFamily("transferd_nixl_bytes", "Part of transferd_bytes moved by NIXL reads",
                                labels=["direction"])
        c.add_metric([direction], snap["nixl_bytes"])
        yield c
        c = CounterMetricFamily("transferd_frames", "Data messages moved", labels=["direction"])
        c.add_metric([direction], snap["frames"])
        yield c
        c = CounterMetricFamily("transferd_state_bytes_skipped",
                                "Replicated state bytes not sent thanks to the CP de-dup (senders)")
        c.add_metric([], snap["state_bytes_skipped"])
        yield c
        c = CounterMetricFamily("transferd_rooms", "Rooms ended, by outcome and reason code",
                                labels=["outcome", "reason"])
        ok = snap["rooms"].get("success", 0)
        c.add_metric(["success", ""], ok)
        for reason, n in failure_series(snap["failures"]).items():
            c.add_metric(["failed", reason], n)
        yield c
        yield _by_label("transferd_refused_messages", "Messages or requests refused, by reason", "reason",
                        snap["refused"])
        yield _by_label("transferd_dropped_messages", "Messages dropped (late frames after a room ended, full "
                        "pipes, injected faults), by reason", "reason", snap["dropped"])
        yield _by_label("transferd_heartbeat_misses", "Peers given up after missing their heartbeats", "peer",
                        snap["heartbeat_misses"])
        g = GaugeMetricFamily("transferd_rooms_live", "Rooms not yet ended, by state", labels=["state"])
        for state, n in snap["live"].items():
            g.add_metric([state], n)
        yield g
        g = GaugeMetricFamily("transferd_bytes_in_flight", "Bytes of started rooms not yet moved")
        g.add_metric([], snap["in_flight"])
        yield g
        g = GaugeMetricFamily("transferd_registered_ranks", "Registered CP ranks (receiver: per group; "
                              "sender: receivers registered with)", labels=["group"])
        for group, n in snap["registered"].items():
            g.add_metric([group], n)
        yield g


def failure_series(failures: dict[str, int]) -> dict[str, int]:
    """Failed rooms by code: every :class:`~transferd.errors.FailureCode` from the start (a
    dashboard sees each series before its first failure), and any other code a sender sent."""
    out = {code.value: 0 for code in FailureCode}
    out.update(failures)
    return out


def _by_label(name: str, doc: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in counts.items():
        family.add_metric([key], n)
    return family


class RoomDurations(Collector):
    """``transferd_room_duration_seconds`` by outcome. Per outcome one list: the count of each
    bucket (``DURATION_BUCKETS``, then +Inf), not cumulative, and the sum last. ``observe`` runs on
    the event loop's thread; a scrape (prometheus_client's server thread) copies each list in one
    step under the GIL (its sum may lag the buckets by the room ending meanwhile)."""

    def __init__(self) -> None:
        self.by_outcome: dict[str, list[Any]] = {}

    def observe(self, outcome: str, seconds: float) -> None:
        c = self.by_outcome.get(outcome)
        if c is None:
            c = self.by_outcome[outcome] = [0] * (len(DURATION_BUCKETS) + 1) + [0.0]
        c[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1  # the first bound >= seconds: "le"
        c[-1] += seconds

    def totals(self) -> dict[str, dict[str, float]]:
        """Per outcome, the rooms ended and their durations summed (the histogram's ``_count`` and
        ``_sum``; the engine API's ``stats`` carries them, with or without the endpoint)."""
        return {outcome: {"count": sum(c[:-1]), "sum": round(c[-1], 6)} for outcome, c in list(self.by_outcome.items())}

    def collect(self) -> Iterator[Any]:
        h = HistogramMetricFamily("transferd_room_duration_seconds",
                                  "Room duration (receiver: expect → end; sender: first chunk → end)",
                                  labels=["outcome"])
        for outcome, counts in list(self.by_outcome.items()):
            c = list(counts)
            buckets, n = [], 0
            for bound, k in zip(_LE, c[:-1]):
                n += k
                buckets.append((bound, n))
            h.add_metric([outcome], buckets, c[-1])
        yield h


class AgentMetrics:
    """The registry, the room-duration histogram, and the HTTP endpoint of one agent."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.registry = CollectorRegistry(auto_describe=False)  # collect() only at scrape time
        self.registry.register(_AgentCollector(snapshot))
        self.durations = RoomDurations()
        self.registry.register(self.durations)
        self.observe = self.durations.observe  # once a room, where it ends
        self.server: Any = None
        self.port = 0

    def serve(self, bind: str, port_offset: int = 0) -> None:
        host, port = parse_hostport(bind, "metrics_bind")
        if port:
            port += port_offset
        try:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"metrics endpoint {host}:{port}: {exc.strerror or exc}") from None
        self.port = self.server.server_port
        if host not in ("127.0.0.1", "::1", "localhost"):
            log.warning("metrics endpoint listens on %s:%d (not loopback)", host, self.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
