"""The expert cache on its own: O_DIRECT with a buffered fallback, slots, LRU, read errors."""

import errno
import logging
import os
import threading

import numpy as np
import pytest

from colibri.storage import reader as reader_mod
from colibri.storage.cache import ExpertCache
from colibri.storage.errors import BudgetInvalid, ExpertReadError
from colibri.storage.policy import POLICIES, Policy

from hf_models import build_container, served


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return build_container(tmp_path_factory.mktemp("cache"), "qwen3_moe", "basic", seed=9)


def test_o_direct_by_default(container):
    c = ExpertCache(container, "min")
    assert c.reader.direct and c.reader.fallback_reason is None
    assert c.arena.ctypes.data % 4096 == 0 and c.record_bytes % 4096 == 0


def test_buffered_fallback_when_o_direct_is_refused(container, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a):  # a file system without O_DIRECT cannot be made here: fake its refusal
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="colibri.storage"):
        c = ExpertCache(container, "all")
    assert not c.reader.direct and "O_DIRECT refused" in c.reader.fallback_reason
    assert len([r for r in caplog.records if "O_DIRECT" in r.message]) == 1  # logged once
    monkeypatch.undo()
    ref = ExpertCache(container, "all")
    for il in container.moe_layers:
        a, b = served(c, il, [0, 3, 5]), served(ref, il, [0, 3, 5])
        for ie in a:
            for x, y in zip(a[ie], b[ie]):
                np.testing.assert_array_equal(x, y)


def test_lru_keeps_the_recent_and_counts(container):
    il = container.moe_layers[0]
    c = ExpertCache(container, 2 * len(container.moe_layers) * container.record_bytes)  # 2 slots per layer
    served(c, il, [1, 2])
    served(c, il, [1])  # 1 is now the most recent
    served(c, il, [3])  # evicts 2
    assert set(c.lru[il]) == {1, 3}
    assert (c.stats.hits, c.stats.misses, c.stats.evictions) == (1, 3, 1)
    assert c.stats.bytes_read == 3 * c.record_bytes


def test_no_lookahead_once_the_whole_model_is_resident(container):
    """The router lookahead costs a norm and a router a layer; with every expert resident it
    could only predict reads that cannot happen, so the cache stops asking for it."""
    c = ExpertCache(container, "all")
    assert c.lookahead  # cold: the lookahead starts the reads
    for il in container.moe_layers[:-1]:
        served(c, il, list(range(container.n_expert)))
    assert c.lookahead  # one layer still on disk
    served(c, container.moe_layers[-1], list(range(container.n_expert)))
    assert not c.lookahead
    small = ExpertCache(container, "min")
    for il in container.moe_layers:
        served(small, il, list(range(container.n_expert)))
    assert small.lookahead  # a budget below the model: experts keep coming from disk


def test_read_time_counts_reads_started_ahead(container):
    """io_wall_s is the time with reads in flight, however they were started: reads a
    prefetch started count before the step streams them (read GB/s = bytes / io_wall_s)."""
    il = container.moe_layers[0]
    c = ExpertCache(container, "all")
    assert c.prefetch(il, [0, 1, 2], max_reads=3) == 3
    for _, fut in c.prefetched[il].values():
        fut.result()
    assert c.stats.io_wall_s > 0 and c.reader._io_busy == 0
    before = c.stats.io_wall_s
    served(c, il, [0, 1, 2])  # all three were read ahead: nothing more is in flight
    assert c.stats.io_wall_s == before and c.stats.bytes_read == 3 * c.record_bytes


def test_reads_ahead_scale_with_the_steps_tokens(container):
    """The lookahead reads at most the policy's prefetch_reads per token of the step: a
    decode token's few, a prompt's whole predicted union (so the disk reads on while the
    prompt's attention runs; 8 reads ahead for a 512-token step left it idle)."""
    il, n = container.moe_layers[0], container.n_expert
    for tokens, want in ((1, 2), (3, 6), (64, n)):
        c = ExpertCache(container, "all", policy=Policy(prefetch_reads=2))
        assert c.prefetch(il, list(range(n)), tokens) == want
        assert sorted(c.prefetched[il]) == list(range(want))
        c.settle_prefetch()


def test_a_predicted_expert_the_router_did_not_choose_is_not_waited_for(container, monkeypatch):
    """A read started ahead for an expert the step then did not ask for lands in the
    background: the step goes on without it, and the expert is resident once it lands.
    (Waiting for it cost a decode at 10 % budget ~20 % of its time.)"""
    il = container.moe_layers[0]
    c = ExpertCache(container, "all")
    rec = container.records[(il, 5)]
    landed = threading.Event()  # set only after the step: a step that waits for the read fails it
    real = os.preadv

    def preadv(fd, bufs, offset):
        if fd == c.reader.fds[rec.file] and offset == rec.offset and not landed.wait(5):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(reader_mod.os, "preadv", preadv)  # a slow disk cannot be made here
    assert c.prefetch(il, [5], max_reads=1) == 1
    assert 1 in served(c, il, [1])  # 5 predicted, 1 chosen: returns with 5's read still in flight
    assert c.stats.prefetch_wasted == 1
    landed.set()
    hits = c.stats.hits
    got = served(c, il, [5])  # a hit, with the bytes a plain read gives
    assert c.stats.hits == hits + 1
    monkeypatch.undo()
    for x, y in zip(got[5], served(ExpertCache(container, "all"), il, [5])[5]):
        np.testing.assert_array_equal(x, y)


def test_int4_hits_count_a_step_as_stream_does(tmp_path_factory):
    """A warm decode step takes its int4 experts' addresses straight from the slots
    (int4_hits): the same addresses the views have, and the cache afterwards exactly as if
    stream() had served the step (stats, recency, usage, the learned region); a step with a
    miss is left to stream() with nothing counted."""
    q4 = build_container(tmp_path_factory.mktemp("q4"), "qwen3_moe", "basic", seed=4,
                         convert_kw={"expert_dtype": "int4", "group_size": 32}, hidden_size=64,
                         moe_intermediate_size=32)
    layers, n = q4.moe_layers, q4.n_expert
    rng = np.random.default_rng(2)
    hot = 0.5 ** np.arange(n) / (0.5 ** np.arange(n)).sum()  # a skewed routing: steps of hits and of misses
    steps = [(layers[i % len(layers)], sorted(rng.choice(n, 2, replace=False, p=hot).tolist())) for i in range(160)]
    for name in POLICIES:
        budget = 3 * len(layers) * q4.record_bytes  # 3 slots a layer: hits, misses and evictions
        plain = ExpertCache(q4, budget, policy=Policy(name=name))
        quick = ExpertCache(q4, budget, policy=Policy(name=name))
        taken = 0
        for il, ids in steps:
            served(plain, il, ids)
            before = quick.stats.copy()
            got = quick.int4_hits(il, ids)
            if got is None:
                assert quick.stats == before, name  # nothing counted: stream() serves it
                served(quick, il, ids)
                continue
            taken += 1
            g, layouts, addrs = got
            views = [quick.views(quick.lru[il][ie] if ie in quick.lru[il] else
                                 quick.pinned.get((il, ie), quick.main.get((il, ie)))) for ie in ids]
            assert g == 32 and all(v.int4[1] is layouts for v in views)
            np.testing.assert_array_equal(addrs, np.frombuffer(b"".join(v.int4[2] for v in views), np.int64).reshape(-1, 6))
        assert taken > 10, name
        counts = [{k: v for k, v in vars(c.stats).items() if not k.endswith("_s")} for c in (quick, plain)]
        assert counts[0] == counts[1], name  # every count (the times are the clock's)
        assert {il: list(d.items()) for il, d in quick.lru.items()} == {il: list(d.items()) for il, d in plain.lru.items()}
        assert quick.main == plain.main and quick.pinned == plain.pinned, name
        np.testing.assert_array_equal(quick.history.values(), plain.history.values())
    assert ExpertCache(build_container(tmp_path_factory.mktemp("bf16"), "qwen3_moe", "basic", seed=4),
                       "all").int4_hits(layers[0], [0]) is None  # not int4: always stream()


def test_more_experts_than_slots_stream_through(container):
    il = container.moe_layers[0]
    c = ExpertCache(container, "min")  # one slot per layer
    got = served(c, il, list(range(container.n_expert)))
    ref = served(ExpertCache(container, "all"), il, list(range(container.n_expert)))
    assert sorted(got) == list(range(container.n_expert))
    for ie in got:
        for x, y in zip(got[ie], ref[ie]):
            np.testing.assert_array_equal(x, y)


def test_read_error_names_the_expert_and_frees_the_slot(container, monkeypatch):
    il = container.moe_layers[-1]
    c = ExpertCache(container, "min")

    def eio(fd, bufs, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(reader_mod.os, "preadv", eio)  # a failing disk cannot be made here either
    with pytest.raises(ExpertReadError, match=f"layer {il} expert 4 from .*experts-.* at offset"):
        served(c, il, [4])
    monkeypatch.undo()
    assert len(c.free[il]) == 1  # the slot came back
    assert 4 in served(c, il, [4])


def test_resize_keeps_the_most_recent_and_their_bytes(container):
    il = container.moe_layers[0]
    n_moe, rb = len(container.moe_layers), container.record_bytes
    c = ExpertCache(container, 4 * n_moe * rb)
    for ie in (0, 1, 2, 3):
        served(c, il, [ie])
    ref = served(ExpertCache(container, "all"), il, [0, 1, 2, 3])
    c.resize(2 * n_moe * rb)  # shrink: the two most recent stay
    assert list(c.lru[il]) == [2, 3] and c.slots_per_layer == 2 and c.arena_bytes == 2 * n_moe * rb
    misses = c.stats.misses
    got = served(c, il, [2, 3])
    assert c.stats.misses == misses  # still resident after the move
    for ie in (2, 3):
        for x, y in zip(got[ie], ref[ie]):
            np.testing.assert_array_equal(x, y)
    c.resize("all")  # grow: everything kept, room for the rest
    assert list(c.lru[il]) == [2, 3] and c.slots_per_layer == container.n_expert
    got = served(c, il, [0, 1, 2, 3])
    for ie in range(4):
        for x, y in zip(got[ie], ref[ie]):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(BudgetInvalid, match="minimum"):
        c.resize(rb)
    assert c.slots_per_layer == container.n_expert  # a refused resize changes nothing


def test_reserved_hugepages_and_the_fallback(container):
    with open("/proc/sys/vm/nr_hugepages") as f:
        before = int(f.read())
    need = -(-container.expert_bytes // (2 * 2**20))
    c = ExpertCache(container, "all", hugetlb=True)
    if before < need:  # the pool cannot hold it: transparent hugepages, and the reason
        assert "fallback from reserved hugepages" in c.describe()["hugepages"] and "vm.nr_hugepages" in c.describe()["hugepages"]
    try:  # reserve the pages (root can) and get them
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(before + need))
    except OSError:
        pytest.skip("cannot reserve hugepages here")
    try:
        c2 = ExpertCache(container, "all", hugetlb=True)
        if c2.describe()["hugepages"].startswith("fallback"):
            pytest.skip(f"the kernel gave no hugepages: {c2.describe()['hugepages']}")
        assert c2.describe()["hugepages"].startswith("reserved")
        il = container.moe_layers[0]
        got, ref = served(c2, il, [0, 1]), served(ExpertCache(container, "all"), il, [0, 1])
        for ie in got:
            for x, y in zip(got[ie], ref[ie]):
                np.testing.assert_array_equal(x, y)
        del c2, got
    finally:
        import gc

        gc.collect()
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(before))


def test_pins_stay_resident_and_count_against_the_budget(container):
    layers_ = container.moe_layers
    il, n_moe, rb = layers_[0], len(layers_), container.record_bytes
    c = ExpertCache(container, 2 * n_moe * rb)  # 2 LRU slots per layer
    with pytest.raises(BudgetInvalid, match="no room to pin"):
        c.pin(il, 5)
    with pytest.raises(BudgetInvalid, match="at most"):
        c.resize(2 * n_moe * rb, pinned_bytes=2 * n_moe * rb)  # nothing left for the LRU
    c.resize(3 * n_moe * rb, pinned_bytes=n_moe * rb)  # room for n_moe pins, 2 LRU slots per layer
    assert c.slots_per_layer == 2 and c.pinned_bytes == n_moe * rb
    served(c, il, [5])
    c.pin(il, 5)  # resident already: moved out of the LRU, no read
    c.pin(il, 6)  # read now
    assert c.stats.misses == 1 and c.stats.bytes_read == 2 * rb
    ref = served(ExpertCache(container, "all"), il, [5, 6])
    for ie in range(8):  # churn the LRU: the pins never leave
        served(c, il, [ie])
    misses = c.stats.misses
    got = served(c, il, [5, 6])
    assert c.stats.misses == misses
    for ie in (5, 6):
        for x, y in zip(got[ie], ref[ie]):
            np.testing.assert_array_equal(x, y)
    c.resize("all")  # the pins survive a resize
    assert set(c.pinned) == {(il, 5), (il, 6)}
    c.unpin(il, 5)
    assert set(c.pinned) == {(il, 6)} and len(c.pin_free) == n_moe - 1
    with pytest.raises(KeyError):
        c.unpin(il, 5)
