"""io_uring reads (storage/uring.py through the expert reader): the same bytes and the same
tokens as the preadv pool, fault drills on its reads too, `auto` measuring both, and a
clear reason wherever it cannot be used."""

import sys

import numpy as np
import pytest
from test_coalesce import container, served  # noqa: F401 (the fixture: the demo as a container)

from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.cache import ExpertCache
from colibri.storage.container import open_container
from colibri.storage.errors import ExpertReadError
from colibri.storage.faults import FaultPlan
from colibri.storage.placement import Placement, open_model
from colibri.storage.uring import usable

WHY = usable()
needs_uring = pytest.mark.skipif(WHY is not None, reason=f"io_uring not usable here: {WHY}")


@needs_uring
def test_the_ring_reads_the_bytes_the_pool_reads(container):  # noqa: F811
    ring = ExpertCache(open_container(str(container)), "all", reader="io_uring", queue_depth=8)
    pool = ExpertCache(open_container(str(container)), "all")
    assert ring.reader.kind == "io_uring" and ring.describe()["queue_depth"] == 8
    for il in ring.c.moe_layers:
        a, b = served(ring, il, [0, 1, 2, 7, 11, 12]), served(pool, il, [0, 1, 2, 7, 11, 12])
        assert all(np.array_equal(x, y) for ie in a for x, y in zip(a[ie], b[ie]))
    assert ring.stats.read_requests == pool.stats.read_requests == 3 * len(ring.c.moe_layers)  # runs on both paths
    ring.close()
    pool.close()


@needs_uring
def test_tokens_are_the_same_through_the_ring(container):  # noqa: F811
    runs = []
    for reader in ("io_uring", "preadv"):
        model = open_model(str(container), Placement(budget=2 * 2**20, reader=reader), build_model).model
        runs.append([e.token_id for e in generate(model, list(range(1, 30)), SamplingParams(max_tokens=10))
                     if e.kind == "token"])
        model.experts.close()
    assert runs[0] == runs[1]


@needs_uring
@pytest.mark.parametrize("kind", ["eio", "short", "corrupt"])
def test_fault_drills_hit_the_rings_reads(container, kind):  # noqa: F811
    c = open_container(str(container))
    il = c.moe_layers[2]
    once = ExpertCache(c, "all", reader="io_uring", faults=FaultPlan.parse(f"{kind}@{il}:3x1"))
    assert served(once, il, [3]).keys() == {3} and once.stats.read_errors == 1  # the ring's read failed, then alone
    once.close()
    always = ExpertCache(open_container(str(container)), "all", reader="io_uring",
                         faults=FaultPlan.parse(f"{kind}@{il}:3"))
    with pytest.raises(ExpertReadError, match=f"layer {il} expert 3"):
        served(always, il, [3])
    always.close()


@needs_uring
def test_auto_measures_both_and_says_which(container):  # noqa: F811
    cache = ExpertCache(open_container(str(container)), "all", reader="auto")
    d = cache.describe()
    (ring_gbs, ring_work), (pool_gbs, pool_work) = (cache.reader.auto_measured[k] for k in ("io_uring", "preadv"))
    faster = ring_gbs > pool_gbs and ring_work >= 0.9 * pool_work  # more bytes, the engine's thread not slowed
    assert d["reader"] == ("io_uring" if faster else "preadv"), (d, cache.reader.auto_measured)
    assert f"io_uring read {ring_gbs:.2f} GB/s" in d["reader_note"] and f"pool {pool_gbs:.2f} GB/s" in d["reader_note"]
    assert cache.stats.read_requests == 0  # the measurement is not counted as the model's reads
    cache.close()


def test_without_the_binding_reads_fall_back_and_say_why(container, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "liburing", None)  # import fails
    assert "not installed" in usable()
    cache = ExpertCache(open_container(str(container)), "all", reader="io_uring")
    assert cache.reader.kind == "preadv" and "not installed" in cache.describe()["reader_note"]
    assert served(cache, cache.c.moe_layers[0], [1, 2]).keys() == {1, 2}
    cache.close()
