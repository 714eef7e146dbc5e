"""The bench's round schedule: the two sides of every ratio it prints are measured one right
after the other in each round (a burst of load from elsewhere then hits both), and the 1 MiB
block, whose ratios the targets read, gets its own number of rounds."""

from __future__ import annotations

import itertools

from transferd.bench import BULK_KEYS, DEDUP_CPS, SIZES, SMALL_CPS, block_of, schedule


def _names() -> list[str]:
    out = []
    for key in SIZES:
        out += [f"memcpy/{key}", f"raw_zmq/{key}", f"raw_tcp/{key}", f"mooncake/{key}"]
    for key in BULK_KEYS:
        out += [f"bulk/{key}", f"bulk_shm/{key}"]
    out.append("bulk_zmq/1MiB")
    for cp in DEDUP_CPS:
        out.append(f"dedup_on/{cp}")
        if cp > 1:
            out.append(f"dedup_off/{cp}")
    out += [f"small/{cp}" for cp in SMALL_CPS]
    return out


def _ratio_pairs() -> list[tuple[str, str]]:
    """Every pair of subjects the report divides one by the other (bench.report)."""
    pairs = []
    for key in BULK_KEYS:
        msg = "1MiB" if key.endswith("_contig") else key
        pairs += [(f"bulk/{key}", f"raw_zmq/{msg}"), (f"bulk/{key}", f"raw_tcp/{msg}"),
                  (f"bulk/{key}", f"memcpy/{msg}"), (f"bulk_shm/{key}", f"memcpy/{msg}"),
                  (f"bulk_shm/{key}", f"bulk/{key}")]
    pairs += [(f"bulk/{k}", f"mooncake/{k}") for k in SIZES]
    pairs += [("bulk_zmq/1MiB", "raw_zmq/1MiB"), ("bulk/1MiB", "bulk_zmq/1MiB")]
    pairs += [(f"dedup_on/{cp}", f"dedup_off/{cp}") for cp in DEDUP_CPS if cp > 1]
    return pairs


def test_both_sides_of_every_ratio_share_a_block() -> None:
    names = set(_names())
    for a, b in _ratio_pairs():
        assert a in names and b in names, (a, b)
        assert block_of(a) == block_of(b), (a, b)


def test_a_block_is_measured_in_one_run_of_steps_each_round() -> None:
    rounds = schedule(_names(), repeats=5, target_repeats=11)
    assert len(rounds) == 11
    for names in rounds:
        blocks = [block_of(n) for n in names]
        runs = [b for b, _ in itertools.groupby(blocks)]
        assert len(runs) == len(set(runs)), f"a block split within a round: {runs}"
        assert len(names) == len(set(names))


def test_rounds_per_block_and_a_new_order_each_round() -> None:
    names = _names()
    rounds = schedule(names, repeats=5, target_repeats=11)
    counts = {n: sum(n in r for r in rounds) for n in names}
    for n, c in counts.items():
        assert c == (11 if block_of(n) == "1MiB" else 5), (n, c)
    first = rounds[0]
    assert any(r != first for r in rounds[1:5])  # shuffled, not one fixed order
    # equal counts: the plain schedule (every block every round)
    flat = schedule(names, repeats=3, target_repeats=3)
    assert len(flat) == 3 and all(sorted(r) == sorted(names) for r in flat)
