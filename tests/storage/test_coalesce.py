"""Coalesced expert reads: a step's misses whose records are adjacent in their file are
read as one request (the reader's own request counter says how many), into the same
bytes as one read each; a bad record in a run is read again alone; tokens unchanged."""

import shutil

import numpy as np
import pytest

from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.cache import ExpertCache
from colibri.storage.container import open_container
from colibri.storage.convert import convert
from colibri.storage.demo import write_demo_model
from colibri.storage.errors import ExpertReadError
from colibri.storage.placement import Placement, open_model


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    from colibri.storage.checkpoint import load_config, open_checkpoint
    from colibri.storage.convert import ExpertPlan

    root = tmp_path_factory.mktemp("coalesce")
    demo = write_demo_model(root / "demo")
    m = build_model(str(demo), load_config(str(demo)))
    convert(open_checkpoint(str(demo)), root / "c", ExpertPlan(m.moe_layers, m.n_expert, m.expert_names))
    return root / "c"


def served(cache, il, ids):
    got = {}
    for batch in cache.stream(il, ids):
        for ie, views in batch:
            got[ie] = [np.array(v) for v in views]
    return got


def test_adjacent_misses_are_one_read_of_the_same_bytes(container):
    c = open_container(str(container))
    together = ExpertCache(c, "all")
    alone = ExpertCache(open_container(str(container)), "all", coalesce=False)
    il = c.moe_layers[1]
    a, b = served(together, il, [9, 4, 3, 5]), served(alone, il, [9, 4, 3, 5])
    assert together.stats.misses == alone.stats.misses == 4
    assert together.stats.read_requests == 2 and alone.stats.read_requests == 4  # 3-4-5 as one, 9 alone
    assert a.keys() == b.keys() and all(np.array_equal(x, y) for ie in a for x, y in zip(a[ie], b[ie]))
    assert served(together, il, [3, 4, 5]) and together.stats.read_requests == 2  # hits now: no read
    together.close()
    alone.close()


def test_a_bad_record_in_a_run_is_read_alone_and_named(container, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(container, bad)
    c = open_container(str(bad))
    il = c.moe_layers[0]
    rec = c.records[(il, 6)]
    with open(rec.file, "r+b") as f:
        f.seek(rec.offset + 10)
        f.write(b"\x55\xaa")
    cache = ExpertCache(c, "all")
    with pytest.raises(ExpertReadError, match=f"layer {il} expert 6"):
        served(cache, il, [5, 6, 7])
    assert cache.stats.read_requests == 1 + 2  # the run, then expert 6 alone twice (it stays bad)
    assert served(cache, il, [5, 7]).keys() == {5, 7} and cache.stats.read_requests == 3  # they had landed
    cache.close()


def test_tokens_are_the_same_with_and_without_coalescing(container):
    ids = list(range(1, 40))
    runs = {}
    for coalesce in (True, False):
        model = open_model(str(container), Placement(budget=2 * 2**20, coalesce=coalesce), build_model).model
        toks = [e.token_id for e in generate(model, ids, SamplingParams(max_tokens=12)) if e.kind == "token"]
        runs[coalesce] = (toks, model.experts.stats.read_requests, model.experts.stats.misses)
        model.experts.close()
    assert runs[True][0] == runs[False][0]
    assert runs[True][2] == runs[False][2] and runs[True][1] < runs[False][1]  # the same misses, fewer requests
