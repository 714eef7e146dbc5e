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


def test_totals_are_the_scraped_count_and_sum_per_outcome() -> None:
    """The engine API's ``stats`` carries ``room_seconds`` (the bench's rooms' mean time reads it):
    the same count and sum a scrape shows, per outcome, with or without the endpoint."""
    rng = random.Random(11)
    d = RoomDurations()
    assert d.totals() == {}
    for _ in range(300):
        d.observe("success" if rng.random() < 0.7 else "failed", rng.uniform(0, 90))
    scraped = {(s.name, s.labels["outcome"]): s.value for s in next(iter(d.collect())).samples
               if s.name.endswith(("_count", "_sum"))}
    for outcome, t in d.totals().items():
        assert t["count"] == scraped[("transferd_room_duration_seconds_count", outcome)]
        assert abs(t["sum"] - scraped[("transferd_room_duration_seconds_sum", outcome)]) < 1e-5
    assert sum(t["count"] for t in d.totals().values()) == 300


def test_a_measurements_mean_room_time_from_two_stats() -> None:
    from transferd.tools.bench.plan import room_ms_mean, room_seconds

    d = RoomDurations()
    d.observe("success", 0.5)
    before = room_seconds({"room_seconds": d.totals()})
    for x in (1.0, 2.0):
        d.observe("success", x)
    d.observe("failed", 7.0)  # not a success: not counted
    assert room_ms_mean(before, room_seconds({"room_seconds": d.totals()}), 4.0) == {
        "room_ms_mean": 1500.0, "room_vs_measurement": 0.375}
    assert room_ms_mean(before, before, 4.0) == {}  # no room ended: no figure
    assert room_seconds({}) == (0, 0.0)  # a receiver without the field
