"""The co-activation layout (storage/layout.py, `colictl convert --layout coactivation`):
experts a routing trace chooses together get adjacent records, so the reader fetches them
as one request; the tokens do not change."""

import json
import subprocess
import sys

import numpy as np
import pytest
from test_coalesce import served

from colibri.ctl import exitcodes
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.cache import ExpertCache
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.container import open_container
from colibri.storage.convert import ExpertPlan, convert
from colibri.storage.demo import write_demo_model
from colibri.storage.layout import TraceInvalid, chain, coactivation_order
from colibri.storage.placement import Placement, open_model

TOGETHER = [2, 9, 14]  # chosen together at every step of the trace


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    demo = write_demo_model(root / "demo")
    m = build_model(str(demo), load_config(str(demo)))
    rng = np.random.default_rng(0)
    with open(root / "trace.jsonl", "w") as f:
        for step in range(40):
            for il in m.moe_layers:
                others = rng.choice([e for e in range(m.n_expert) if e not in TOGETHER], 3, replace=False)
                f.write(json.dumps({"step": step, "layer": il, "experts": TOGETHER + others.tolist()}) + "\n")
    plan = ExpertPlan(m.moe_layers, m.n_expert, m.expert_names)
    convert(open_checkpoint(str(demo)), root / "ids", plan)
    ids, fp = coactivation_order(str(root / "trace.jsonl"), m.moe_layers, m.n_expert)
    convert(open_checkpoint(str(demo)), root / "coact", plan, order={"layout": "coactivation", "source": fp,
                                                                     "experts": ids})
    return root


def test_the_chain_puts_partners_side_by_side():
    pairs = np.zeros((6, 6), np.int64)
    for a, b, n in [(0, 4, 9), (4, 2, 7), (1, 3, 5)]:
        pairs[a, b] = pairs[b, a] = n
    uses = np.array([10, 5, 7, 5, 9, 0])
    assert chain(pairs, uses) == [0, 4, 2, 1, 3, 5]  # most used first; 5 never seen: last


def test_experts_chosen_together_are_read_as_one_request(made):
    c = open_container(str(made / "coact"))
    assert c.manifest["experts"]["order"]["layout"] == "coactivation"
    for il in c.moe_layers:
        offsets = sorted(c.records[(il, e)].offset for e in TOGETHER)
        assert np.all(np.diff(offsets) == c.record_bytes)  # adjacent records
    counts = []
    for name in ("ids", "coact"):
        cache = ExpertCache(open_container(str(made / name)), "all")
        for il in cache.c.moe_layers:
            served(cache, il, TOGETHER)
        counts.append(cache.stats.read_requests)
        cache.close()
    assert counts == [3 * len(c.moe_layers), len(c.moe_layers)]


def test_the_tokens_do_not_change(made):
    got = []
    for name in ("ids", "coact"):
        model = open_model(str(made / name), Placement(budget=2 * 2**20), build_model).model
        got.append([e.token_id for e in generate(model, list(range(3, 40)), SamplingParams(max_tokens=12))
                    if e.kind == "token"])
        model.experts.close()
    assert got[0] == got[1]


def test_a_bad_trace_is_one_line(made, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "layer": 1, "experts": [1, 2]}\nnot json\n')
    m = open_container(str(made / "ids"))
    with pytest.raises(TraceInvalid, match="line 2"):
        coactivation_order(str(bad), m.moe_layers, m.n_expert)

    def colictl(*args):
        return subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", *map(str, args)], capture_output=True,
                              text=True, timeout=300)

    r = colictl(made / "demo", tmp_path / "out", "--layout", "coactivation", "--trace", bad)
    assert r.returncode == exitcodes.BAD_REQUEST and "line 2" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = colictl(made / "demo", tmp_path / "out", "--layout", "coactivation")
    assert r.returncode == exitcodes.USAGE and "--trace" in r.stderr
    r = colictl(made / "demo", tmp_path / "out", "--layout", "coactivation", "--trace", made / "trace.jsonl")
    assert r.returncode == 0, r.stderr
