"""The bench's round schedule: the two sides of every ratio it prints are measured one right
after the other in each round (a burst of load from elsewhere then hits both), and the 1 MiB
block, whose ratios the targets read, gets its own number of rounds."""

from __future__ import annotations

import itertools

from transferd.tools.bench import BULK_KEYS, DEDUP_CPS, SIZES, SMALL_CPS, block_of, schedule


def _names() -> list[str]:
    out = []
    for key in SIZES:
        out += [f"memcpy/{key}", f"pread/{key}", f"vm_read/{key}", f"raw_zmq/{key}", f"raw_tcp/{key}", f"mooncake/{key}"]
    for key in BULK_KEYS:
        out += [f"bulk/{key}", f"bulk_shm/{key}"]
    out.append("bulk_zmq/1MiB")
    for cp in DEDUP_CPS:
        out.append(f"dedup_on/{cp}")
        if cp > 1:
            out.append(f"dedup_off/{cp}")
    out += [f"small/{cp}" for cp in SMALL_CPS]
    out += ["bulk_cp8/1MiB", "raw_tcp_x8/1MiB", "raw_tcp_pair/1MiB"]
    return out


def _ratio_pairs() -> list[tuple[str, str]]:
    """Every pair of subjects the report divides one by the other (bench.report)."""
    pairs = []
    for key in BULK_KEYS:
        msg = "1MiB" if key.endswith("_contig") else key
        pairs += [(f"bulk/{key}", f"raw_zmq/{msg}"), (f"bulk/{key}", f"raw_tcp/{msg}"),
                  (f"bulk/{key}", f"memcpy/{msg}"), (f"bulk_shm/{key}", f"memcpy/{msg}"),
                  (f"bulk_shm/{key}", f"pread/{msg}"), (f"pread/{msg}", f"memcpy/{msg}"),
                  (f"bulk_shm/{key}", f"vm_read/{msg}"), (f"vm_read/{msg}", f"memcpy/{msg}"),
                  (f"bulk_shm/{key}", f"bulk/{key}")]
    pairs += [(f"bulk/{k}", f"mooncake/{k}") for k in SIZES]
    pairs += [("bulk_zmq/1MiB", "raw_zmq/1MiB"), ("bulk/1MiB", "bulk_zmq/1MiB")]
    pairs += [(f"dedup_on/{cp}", f"dedup_off/{cp}") for cp in DEDUP_CPS if cp > 1]
    pairs.append(("bulk_cp8/1MiB", "raw_tcp_x8/1MiB"))  # the CP8 block
    pairs += [("raw_tcp_pair/1MiB", "raw_tcp/1MiB"), ("bulk/1MiB", "raw_tcp_pair/1MiB")]  # the raw pair
    return pairs


def test_both_sides_of_every_ratio_share_a_block() -> None:
    names = set(_names())
    for a, b in _ratio_pairs():
        assert a in names and b in names, (a, b)
        assert block_of(a) == block_of(b), (a, b)


def test_a_block_is_measured_in_one_run_of_steps_each_time() -> None:
    rounds = schedule(_names(), repeats=5, target_repeats=11)
    assert len(rounds) == 5
    members = {}
    for n in _names():
        members.setdefault(block_of(n), set()).add(n)
    for names in rounds:
        runs = [(b, [n for n in grp]) for b, grp in itertools.groupby(names, key=block_of)]
        for b, run in runs:  # each time a block comes up, all of its subjects, once each
            assert sorted(run) == sorted(members[b]), (b, run)
        others = [b for b, _ in runs if b != "1MiB"]
        assert len(others) == len(set(others)), f"a block split within a round: {others}"


def test_the_1mib_block_is_spread_over_the_rounds() -> None:
    rounds = schedule(_names(), repeats=5, target_repeats=11)
    per_round = [sum(1 for b, _ in itertools.groupby(r, key=block_of) if b == "1MiB") for r in rounds]
    assert per_round == [2, 2, 2, 2, 3]  # 11 over 5 rounds, never bunched at the end
    # only the 1 MiB block measured (--only 'bulk/1MiB,...'): every round holds its share
    only = schedule(["bulk/1MiB", "raw_zmq/1MiB"], repeats=5, target_repeats=11)
    assert [len(r) // 2 for r in only] == [2, 2, 2, 2, 3]


def test_rounds_per_block_and_a_new_order_each_round() -> None:
    names = _names()
    rounds = schedule(names, repeats=5, target_repeats=11)
    counts = {n: sum(r.count(n) for r in rounds) for n in names}
    for n, c in counts.items():
        assert c == (11 if block_of(n) == "1MiB" else 5), (n, c)
    first = rounds[0]
    assert any(r != first for r in rounds[1:5])  # shuffled, not one fixed order
    # equal counts: the plain schedule (every block every round)
    flat = schedule(names, repeats=3, target_repeats=3)
    assert len(flat) == 3 and all(sorted(r) == sorted(names) for r in flat)
