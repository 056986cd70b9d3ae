"""Cache policies: hysteresis, the LRU minimum, hand pins, usage-aware eviction, and that
a repinned expert's bytes are still its own."""

import numpy as np
import pytest

from colibri.storage.cache import ExpertCache
from colibri.storage.errors import BudgetInvalid
from colibri.storage.history import UsageHistory
from colibri.storage.policy import Policy, PolicyInvalid, learned_slots, plan_repin, victim

from hf_models import build_container, served


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return build_container(tmp_path_factory.mktemp("policy"), "qwen3_moe", "basic", seed=9, num_hidden_layers=3)



def counts(table):
    return lambda key: table.get(key, 0.0)


def test_repin_needs_a_clear_margin():
    value = counts({"a": 10.0, "b": 12.0, "c": 13.0, "d": 5.0})
    assert plan_repin(value, ["a"], ["b"], 0, 0.25) == []  # 12 < 1.25 * 10: no churn on noise
    assert plan_repin(value, ["a"], ["c"], 0, 0.25) == [("c", "a")]  # 13 > 12.5
    assert plan_repin(value, ["a"], ["c", "b"], 1, 0.25) == [("c", None)]  # a free slot takes the hottest first
    assert plan_repin(value, ["d", "a"], ["c", "b"], 0, 0.25) == [("c", "d")]  # b is not clearly above a
    assert plan_repin(counts({}), ["a"], ["b"], 3, 0.0) == []  # never pins what was never used


def test_the_hot_set_leaves_the_lru_its_minimum():
    p = Policy(name="lru+pinned", hot_set=1.0)
    assert learned_slots(p, 100, 4, 8, 128) == 100 - 4 * 8  # everything above top-k per layer
    assert learned_slots(p, 20, 4, 8, 128) == 0  # below the minimum: no pins at all
    assert learned_slots(Policy(name="lru"), 100, 4, 8, 128) == 0
    assert learned_slots(Policy(name="learned"), 100, 4, 8, 128) == 0  # one pool: nothing pinned
    assert learned_slots(p, 4 * 128, 4, 8, 128) == 0  # everything fits: nothing to learn


def test_lru_victim():
    lru = ["old", "mid", "new", "newest"]  # oldest first
    assert victim(lru, set()) == "old" and victim(lru, {"old"}) == "mid" and victim(lru, set(lru)) is None


def test_policy_settings_are_checked():
    p = Policy().with_settings({"policy": "lru", "prefetch": "on", "hot_set": "0.3", "repin_every": 64})
    assert (p.name, p.prefetch_reads, p.hot_set, p.repin_every) == ("lru", 8, 0.3, 64)
    for bad in ({"policy": "fifo"}, {"hot_set": "2"}, {"repin_every": "often"}, {"colour": 1},
                {"repin_margin": -1}, {"repin_every": True}, {"prefetch_reads": 1.5}):
        with pytest.raises(PolicyInvalid):
            Policy().with_settings(bad)


def test_cache_repins_live_keeps_bytes_and_hand_pins(container):
    layers, n_exp, rb = container.moe_layers, container.n_expert, container.record_bytes
    top_k = 2
    hist = UsageHistory(layers, n_exp)
    policy = Policy(name="lru+pinned", hot_set=1.0, repin_every=2, repin_margin=0.5)
    budget = (len(layers) * top_k + 3) * rb  # top-k per layer for the LRU, 3 pinned slots
    c = ExpertCache(container, budget, top_k=top_k, policy=policy, history=hist)
    assert c.slots_per_layer == top_k and len(c.pin_free) == 3
    with pytest.raises(BudgetInvalid, match="fewer than 2 slot"):  # pins may not starve the LRU
        c.resize(budget, pinned_bytes=4 * rb)
    ref = ExpertCache(container, "all")
    il = layers[0]
    c.pin(layers[1], 7)  # by hand
    for step in range(12):  # layer il uses expert 3 every step, expert 1 every other step
        c.begin_step()
        served(c, il, [3] if step % 2 else [3, 1])
        served(c, layers[1], [step % n_exp])
    learned = {k for k in c.pinned if k not in c.hand_pins}
    assert (il, 3) in learned and c.stats.repins >= 1
    assert (layers[1], 7) in c.pinned and c.hand_pins == {(layers[1], 7)}  # never repinned away
    for key in learned | {(layers[1], 7)}:  # a repinned expert's bytes are still its own
        got, want = served(c, key[0], [key[1]])[key[1]], served(ref, key[0], [key[1]])[key[1]]
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    misses = c.stats.misses
    served(c, il, [3])
    assert c.stats.misses == misses  # pinned: a hit


def test_hysteresis_keeps_the_set_stable(container):
    layers, n_exp, rb = container.moe_layers, container.n_expert, container.record_bytes
    hist = UsageHistory(layers, n_exp)
    c = ExpertCache(container, (len(layers) * 2 + 1) * rb, top_k=2, history=hist,
                    policy=Policy(name="lru+pinned", hot_set=1.0, repin_every=1, repin_margin=1.0))
    il = layers[0]
    for _ in range(4):  # expert 0 earns the one pinned slot
        c.begin_step()
        served(c, il, [0])
    assert set(c.pinned) == {(il, 0)}
    for _ in range(6):  # expert 1 now as often as 0 was, but not twice as much: 0 stays
        c.begin_step()
        served(c, il, [1])
    assert set(c.pinned) == {(il, 0)}
    for _ in range(30):  # far more: it takes over
        c.begin_step()
        served(c, il, [1])
    assert set(c.pinned) == {(il, 1)}


def test_warm_start_reads_what_the_history_says_is_hot(container):
    layers, n_exp, rb = container.moe_layers, container.n_expert, container.record_bytes
    hist = UsageHistory(layers, n_exp)
    for ie in (5, 5, 5, 2, 2, 7):
        hist.record(layers[-1], [ie])
    c = ExpertCache(container, (len(layers) * 2 + 2) * rb, top_k=2, history=hist,
                    policy=Policy(name="lru+pinned", hot_set=1.0))
    assert c.warm_start() == 2 and set(c.pinned) == {(layers[-1], 5), (layers[-1], 2)}
    assert c.stats.bytes_read == 2 * rb
    c.set_policy(Policy(name="lru"))  # a policy without a hot set lets them go
    assert not c.pinned and c.policy.name == "lru"
    pool = ExpertCache(container, (len(layers) * 2 + 2) * rb, top_k=2, history=hist, policy=Policy(name="learned"))
    assert pool.warm_start() == 3 and set(pool.main) == {(layers[-1], e) for e in (5, 2, 7)}  # the main region
    ref = ExpertCache(container, "all")
    for ie in (5, 2, 7):
        for a, b in zip(served(pool, layers[-1], [ie])[ie], served(ref, layers[-1], [ie])[ie]):
            np.testing.assert_array_equal(a, b)
    assert pool.stats.misses == 0


def test_learned_gives_a_busy_layer_more_room_and_keeps_the_frequent(container):
    layers, n_exp, rb = container.moe_layers, container.n_expert, container.record_bytes
    c = ExpertCache(container, len(layers) * 4 * rb, top_k=2, policy=Policy(name="learned"))
    assert c.slots_per_layer == 1 and c.main_slots == len(layers) * 3  # a window of 1, the rest main
    ref = ExpertCache(container, "all")
    il = layers[0]
    for step in range(10):  # layer il alone, 4 experts in turn, expert 0 every step
        c.begin_step()
        for ie, w in served(c, il, [0, 1 + step % 3]).items():
            for a, b in zip(w, served(ref, il, [ie])[ie]):
                np.testing.assert_array_equal(a, b)
    resident = set(c.lru[il]) | {ie for jl, ie in c.main if jl == il}
    assert resident == {0, 1, 2, 3} and c.stats.misses == 4  # it took the idle layers' room; read once each
    for step in range(12):  # a burst of one-off experts elsewhere does not push out expert 0
        c.begin_step()
        served(c, layers[1], [step % n_exp])
    assert (il, 0) in c.main
