"""The room-duration histogram kept as plain counts (``transferd/daemon/metrics.py``): what a
scrape shows is what prometheus_client's own ``Histogram`` shows for the same rooms."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from transferd.daemon.metrics import DURATION_BUCKETS, AgentMetrics, RoomDurations


def _exposition(reg: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(reg).decode().splitlines() if "_created" not in line]


def test_the_same_rooms_scrape_as_prometheus_clients_histogram() -> None:
    rng = random.Random(7)
    ours, theirs = CollectorRegistry(auto_describe=False), CollectorRegistry()
    durations = RoomDurations()
    ours.register(durations)
    ref = Histogram("transferd_room_duration_seconds", "Room duration (receiver: expect → end; sender: first chunk → end)",
                    labelnames=["outcome"], buckets=DURATION_BUCKETS, registry=theirs)
    # every bound exactly (a value on a bound counts in that bucket), either side of each, and beyond the last
    values = [b * f for b in DURATION_BUCKETS for f in (0.999, 1.0, 1.001)] + [0.0, 120.0]
    values += [rng.uniform(0, 70) for _ in range(200)]
    for v in values:
        outcome = "success" if rng.random() < 0.8 else "failed"
        durations.observe(outcome, v)
        ref.labels(outcome).observe(v)
    assert _exposition(ours) == _exposition(theirs)


def test_an_agent_exports_nothing_before_its_first_room_and_counts_each_after() -> None:
    m = AgentMetrics(lambda: {})
    assert next(iter(m.durations.collect())).samples == []
    m.observe("success", 0.003)
    m.observe("success", 0.003)
    samples = {(s.name, s.labels.get("le")): s.value for s in next(iter(m.durations.collect())).samples}
    assert samples[("transferd_room_duration_seconds_bucket", "0.0025")] == 0
    assert samples[("transferd_room_duration_seconds_bucket", "0.005")] == 2
    assert samples[("transferd_room_duration_seconds_count", None)] == 2
    assert abs(samples[("transferd_room_duration_seconds_sum", None)] - 0.006) < 1e-12
