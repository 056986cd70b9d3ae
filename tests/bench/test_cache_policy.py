"""The policy benchmark's replay, Belady's optimum above all, on traces small enough to
count by hand."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from cache_policy import replay_belady, replay_lru, trace_stats  # noqa: E402

from colibri.storage.policy import Policy  # noqa: E402

# the textbook reference string: with 3 frames, OPT faults 7 times, LRU 10 times
CLASSIC = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]


def one_layer(seq):
    return [(i, 0, [e], None) for i, e in enumerate(seq)]


def test_belady_on_the_textbook_string():
    assert replay_belady(one_layer(CLASSIC), 3) == {"hits": 5, "misses": 7}
    assert replay_belady(one_layer(CLASSIC), 4)["misses"] == 6
    r = replay_lru(one_layer(CLASSIC), 3, [0], 6, 1, Policy(name="lru"))
    assert (r["hits"], r["misses"]) == (2, 10)


def test_belady_evicts_the_farthest_next_use_never_one_needed_now():
    # capacity 2; a line's experts are served together
    trace = [(0, 0, [1, 2], None), (1, 0, [3, 1], None), (2, 0, [1], None), (3, 0, [2], None)]
    # step 1: 3 is never needed again, so it only streams through; 1 and 2 stay and hit
    assert replay_belady(trace, 2) == {"hits": 3, "misses": 3}
    trace[-1] = (3, 0, [3], None)
    # now 3 is needed last but 2 never again: 2 goes (not 1, which this line needs)
    assert replay_belady(trace, 2) == {"hits": 3, "misses": 3}
    trace = [(0, 0, [1, 2], None), (1, 0, [3, 1], None), (2, 0, [2], None), (3, 0, [1], None)]
    # 1 is needed now and 2 sooner than 3's never: 3 streams; then 2 and 1 hit
    assert replay_belady(trace, 2) == {"hits": 3, "misses": 3}


def test_belady_pools_layers_and_never_loses_to_lru():
    rng = np.random.default_rng(0)
    for _ in range(20):
        trace = [(s, il, sorted(set(rng.zipf(1.5, 3) % 9)), None) for s in range(40) for il in (0, 1)]
        for cap in (2, 4, 8):
            opt = replay_belady(trace, cap)
            lru = replay_lru(trace, cap, [0, 1], 9, 1, Policy(name="lru"))
            assert opt["hits"] >= lru["hits"]
            assert opt["hits"] + opt["misses"] == lru["hits"] + lru["misses"]


def test_trace_structure_and_prediction_quality():
    trace = [(0, 0, [1, 2], [1, 3]), (1, 0, [1, 2], [1, 2]), (2, 0, [4, 5], None)]
    st = trace_stats(trace, [0], 8)
    assert st["reuse_from_previous_step"] == pytest.approx(0.5)  # 2 of 4 experts after the first line
    assert st["prefetch_precision"] == pytest.approx(3 / 4) and st["prefetch_recall"] == pytest.approx(3 / 4)


def test_learned_keeps_the_regulars_through_a_scan():
    seq = [0, 1, 2] * 3 + [3, 4, 5, 6, 7] + [0, 1, 2]  # regulars, a scan of one-offs, the regulars again
    lru = replay_lru(one_layer(seq), 4, [0], 8, 1, Policy(name="lru"))
    learned = replay_lru(one_layer(seq), 4, [0], 8, 1, Policy(name="learned"))
    assert learned["main_slots"] == 3 and learned["lru_slots_per_layer"] == 1
    assert (lru["hits"], learned["hits"]) == (6, 9)  # LRU loses them to the scan; the main region keeps them
    assert replay_belady(one_layer(seq), 4)["hits"] >= learned["hits"]
