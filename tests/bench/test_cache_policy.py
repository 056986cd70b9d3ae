"""The policy benchmark's replay, Belady's optimum above all, on traces small enough to
count by hand; and that the replay counts what the expert cache does."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from cache_policy import (  # noqa: E402
    read_trace,
    replay_belady,
    replay_cache,
    replay_next_use,
    shape_container,
    trace_stats,
)

from colibri.storage.policy import Policy  # noqa: E402

# the textbook reference string: with 3 frames, OPT faults 7 times, LRU 10 times
CLASSIC = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]


def one_layer(seq):
    return [(i, 0, [e], None) for i, e in enumerate(seq)]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """(n_layers, n_expert) -> a container of that shape for the replay (built once each)."""
    root, made = tmp_path_factory.mktemp("shapes"), {}

    def get(n_layers, n_expert):
        if (n_layers, n_expert) not in made:
            made[n_layers, n_expert] = shape_container(n_layers, n_expert, 1, str(root))
        return made[n_layers, n_expert]

    return get


def test_belady_on_the_textbook_string(shapes):
    assert replay_belady(one_layer(CLASSIC), 3) == {"hits": 5, "misses": 7}
    assert replay_belady(one_layer(CLASSIC), 4)["misses"] == 6
    r = replay_cache(one_layer(CLASSIC), 3, shapes(1, 6), 1, Policy(name="lru"))
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


def test_belady_pools_layers_and_never_loses_to_the_cache(shapes):
    rng = np.random.default_rng(0)
    for _ in range(6):
        trace = [(s, il, sorted(set(rng.zipf(1.5, 3) % 9)), None) for s in range(40) for il in (0, 1)]
        for cap in (2, 4, 8):
            opt = replay_belady(trace, cap)
            for name in ("lru", "learned"):
                r = replay_cache(trace, cap, shapes(2, 9), 1, Policy(name=name))
                assert opt["hits"] >= r["hits"]
                assert opt["hits"] + opt["misses"] == r["hits"] + r["misses"]


def test_trace_structure_and_prediction_quality():
    trace = [(0, 0, [1, 2], [1, 3]), (1, 0, [1, 2], [1, 2]), (2, 0, [4, 5], None)]
    st = trace_stats(trace, [0], 8)
    assert st["reuse_from_previous_step"] == pytest.approx(0.5)  # 2 of 4 experts after the first line
    assert st["prefetch_precision"] == pytest.approx(3 / 4) and st["prefetch_recall"] == pytest.approx(3 / 4)


def test_learned_keeps_the_regulars_through_a_scan(shapes):
    seq = [0, 1, 2] * 3 + [3, 4, 5, 6, 7] + [0, 1, 2]  # regulars, a scan of one-offs, the regulars again
    lru = replay_cache(one_layer(seq), 4, shapes(1, 8), 1, Policy(name="lru"))
    learned = replay_cache(one_layer(seq), 4, shapes(1, 8), 1, Policy(name="learned"))
    assert learned["main_slots"] == 3 and learned["window_slots_per_layer"] == 1
    assert (lru["hits"], learned["hits"]) == (6, 9)  # LRU loses them to the scan; the main region keeps them
    assert replay_belady(one_layer(seq), 4)["hits"] >= learned["hits"]


def test_the_online_replay_of_the_optimum_keeps_what_belady_keeps():
    """OPTgen (storage/optgen.py), one use a moment and a window longer than the trace, keeps
    exactly the reuses Belady's optimum (with bypass) hits, at every capacity."""
    from colibri.storage.optgen import OptGen

    rng = np.random.default_rng(3)
    for _ in range(5):
        seq = (rng.zipf(1.4, 300) % 20).tolist()
        for cap in (1, 2, 4, 8):
            g = OptGen(1, 20, cap, 1, window=len(seq) + 1)
            for e in seq:
                g.visit(0, [e])
            assert g.kept == replay_belady(one_layer(seq), cap)["hits"], cap


def test_learned_opt_follows_a_workload_that_moves_on(shapes):
    """Two phases: four regulars, then four others and never the first again. Counts alone
    hold on to the first phase's experts for as long as their uses outweigh the new ones';
    weighed by what the optimum keeps, they go once their last uses leave the window. On
    the regular phase both reach the optimum."""
    first = [0, 1, 2, 3] * 30
    seq = first + [4, 5, 6, 7] * 30
    kw = dict(prefetch_reads=0)
    opt = replay_belady(one_layer(seq), 5)["hits"]
    learned = replay_cache(one_layer(seq), 5, shapes(1, 8), 1, Policy(name="learned", **kw))["hits"]
    learned_opt = replay_cache(one_layer(seq), 5, shapes(1, 8), 1, Policy(name="learned-opt", **kw))["hits"]
    assert learned < learned_opt < opt and opt - learned_opt <= (opt - learned) // 2
    for name in ("learned", "learned-opt"):  # the first phase alone: every use after the first hits
        assert replay_cache(one_layer(first), 5, shapes(1, 8), 1, Policy(name=name, **kw))["hits"] \
            == replay_belady(one_layer(first), 5)["hits"] == len(first) - 4


def test_belady_without_bypass_keeps_what_it_reads():
    trace = one_layer([1, 2, 1])
    assert replay_belady(trace, 1) == {"hits": 1, "misses": 2}  # 2 streams through, 1 stays
    assert replay_belady(trace, 1, bypass=False) == {"hits": 0, "misses": 3}  # 2 must be kept: 1 goes
    assert replay_belady(one_layer(CLASSIC), 3, bypass=False) == {"hits": 5, "misses": 7}  # the textbook OPT


@pytest.mark.parametrize("name", ["lru", "lru+pinned", "learned", "learned-opt"])
def test_the_replay_counts_what_the_serving_cache_did(tmp_path, shapes, name):
    """A model served with a cache writes its routing trace; replayed on a container of the
    same shape (other bytes), the replay hits and misses exactly as the serving cache did:
    the benchmark measures the daemon's cache, not a model of it."""
    from colibri.engine.generate import SamplingParams, generate

    from hf_models import build_container, load_model

    c = build_container(tmp_path, "qwen3_moe", "basic", seed=4, num_hidden_layers=3, num_experts=12)
    policy = Policy(name=name, prefetch_reads=0, repin_every=4)
    for per_layer in (1, 3, 5):
        cap = per_layer * len(c.moe_layers)
        path = tmp_path / f"trace-{per_layer}.jsonl"
        with open(path, "w") as f:
            model = load_model(tmp_path / "c", budget=cap * c.record_bytes, policy=policy, trace=f)
            for seed, prompt in enumerate(([5, 9, 13, 2, 7, 7, 1, 40, 3], [8], [22, 23, 24, 25])):
                for _ in generate(model, prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=seed)):
                    pass
        st = model.experts.stats
        model.experts.inner.close()  # (the trace's writer wraps the cache)
        trace = read_trace(str(path))
        r = replay_cache(trace, cap, shapes(3, 12), 2, policy)
        assert (r["hits"], r["misses"]) == (st.hits, st.misses), per_layer


def test_next_use_keeps_the_regulars_and_lets_one_offs_through():
    """The studied policy on a trace whose optimum is plain: three regulars every other step,
    one-offs between them; a pool of 3 and a window of 1 hit every regular after its first
    use, as Belady does with the same 4 slots, but for the one the first one-off displaces
    (used once each, the one-off is the more recent: only their second use tells them apart)."""
    trace = []
    for s in range(40):
        trace.append((s, 0, [0, 1, 2] if s % 2 == 0 else [10 + s], None))
    r = replay_next_use(trace, 4, [0], 64, 1)
    assert r["window_slots"] == 1
    assert replay_belady(trace, 4)["hits"] == 3 * 19
    assert r["hits"] == 3 * 19 - 1


def test_next_use_shadows_replay_their_own_candidates():
    from next_use import NextUse

    rng = np.random.default_rng(3)
    m = NextUse(2, 16, 6, 1)
    for s in range(200):
        m.step()
        hot = [s % 16, (s + 1) % 16] if s % 40 < 20 else [int(e) for e in rng.choice(4, 2, replace=False)]
        for li in range(2):
            m.access(li, sorted(set(hot + [int(rng.integers(16))])))
    pools = m.pools[: len(m.half_lives)]
    assert len({p.tobytes() for p in pools}) > 1  # the candidates decide differently
    assert len(set(m.score)) > 1
