"""The prefix cache (engine/prefix.py): a request that starts with tokens already computed
takes their KV blocks and computes only the rest, with the tokens of a fresh computation;
blocks are shared, held while used, and evicted least recently used under a byte budget."""

import numpy as np
import pytest

from colibri.engine import layers
from colibri.engine.generate import Batcher, Request, SamplingParams, generate
from colibri.engine.prefix import BLOCK, PrefixCache
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.convert import ExpertPlan, convert

from hf_models import build, load_model


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def fresh(model, ids, n):
    return [e.token_id for e in generate(model, ids, SamplingParams(max_tokens=n)) if e.kind == "token"]


def run(batcher, model, prompts, n):
    """The prompts together in `batcher`; (tokens, done stats) of each."""
    reqs = [Request(model, p, SamplingParams(max_tokens=n), rid=i) for i, p in enumerate(prompts)]
    for r in reqs:
        batcher.add(r)
    got, stats = {i: [] for i in range(len(prompts))}, {}
    while batcher.active:
        for r, ev in batcher.step():
            if ev.kind == "token":
                got[r.id].append(ev.token_id)
            else:
                stats[r.id] = ev.stats
    return [got[i] for i in range(len(prompts))], [stats[i] for i in range(len(prompts))]


def prompts(model, seed=4):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, model.args.vocab_size, 2 * BLOCK + 7).tolist()
    return [shared + rng.integers(0, model.args.vocab_size, n).tolist() for n in (5, 9, 3)]


@pytest.mark.parametrize("family,case", [
    ("qwen3_moe", "basic"), ("mixtral", "odd_tied_window"), ("deepseek_v3", "q_lora_groups_interleaved"),
    ("gpt_oss", "sinks_sliding_clamped"), ("glm_moe_dsa", "full_shared_topk4"),
    ("deepseek_v32", "topk4_dense_first"), ("deepseek_v4", "all_types_hash_first")])
def test_a_request_from_cached_blocks_gives_the_tokens_of_a_fresh_one(tmp_path, family, case):
    build(family, case, tmp_path / "hf", seed=23)
    model = load_model(str(tmp_path / "hf"))
    a, b, c = prompts(model)
    batcher = Batcher(model, prefix=PrefixCache(1 << 30))
    (got_a,), (st_a,) = run(batcher, model, [a], 6)
    assert st_a["cached_prompt_tokens"] == 0 and got_a == fresh(model, a, 6)
    (got_b,), (st_b,) = run(batcher, model, [b], 6)  # the shared 39 tokens: two whole blocks reused
    assert st_b["cached_prompt_tokens"] == 2 * BLOCK and got_b == fresh(model, b, 6)
    (again,), (st_again,) = run(batcher, model, [a + got_a], 4)  # a's reply too, where decode rows are exact
    whole = (len(a) + len(got_a) - 1) // BLOCK * BLOCK if model.DECODE_ROWS_EXACT else len(a) // BLOCK * BLOCK
    assert st_again["cached_prompt_tokens"] == whole and again == fresh(model, a + got_a, 4)
    (got_c,), _ = run(Batcher(model, prefix=batcher.prefix), model, [c], 6)
    assert got_c == fresh(model, c, 6)


def test_concurrent_requests_share_the_blocks_of_their_prefix(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=8)
    model = load_model(str(tmp_path / "hf"))
    a, b, c = prompts(model)
    prefix = PrefixCache(1 << 30)
    batcher = Batcher(model, prefix=prefix)
    run(batcher, model, [a[:2 * BLOCK + 1]], 1)  # the shared part, computed once: 2 blocks
    assert len(prefix.blocks) == 2
    reqs = [Request(model, p, SamplingParams(max_tokens=3), rid=i) for i, p in enumerate((b, c))]
    pool = model.kv_pool
    used = pool.used
    for r in reqs:
        batcher.add(r)
    assert [len(r.held) for r in reqs] == [2, 2] and all(blk.refs == 2 for blk in prefix.blocks.values())
    # never copied: both requests' tables start with the cache's own two blocks, no new block
    root = next(blk for blk in prefix.blocks.values() if blk.parent is None)
    shared = [root.bid, prefix.blocks[next(iter(root.children))].bid]  # the chain, in position order
    assert all(r.cache.table[:2].tolist() == shared for r in reqs) and pool.used == used
    assert all(pool.refs[bid] == 3 for bid in shared)  # the cache's and the two requests'
    assert prefix.describe()["held_blocks"] == 2  # two requests, the same two blocks: not copied into the cache twice
    while batcher.active:
        batcher.step()
    assert all(blk.refs == 0 for blk in prefix.blocks.values())
    # b's and c's own blocks hang below the shared two: 2 + 1 each (b: 48 tokens + 2 replies, c: 42 + 2)
    assert len(prefix.blocks) == 2 + (len(b) + 2) // BLOCK - 2 + (len(c) + 2) // BLOCK - 2
    del reqs, r
    assert pool.used == len(prefix.blocks)  # the requests gone, the pool holds the cached blocks only
    prefix.resize(0)
    assert pool.used == 0


def test_eviction_never_takes_a_block_a_running_request_holds(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=9)
    model = load_model(str(tmp_path / "hf"))
    a, b, _ = prompts(model)
    block_bytes = model.kv_pool.block_bytes
    prefix = PrefixCache(2 * block_bytes)  # room for two blocks
    batcher = Batcher(model, prefix=prefix)
    run(batcher, model, [a], 1)
    kept = set(prefix.blocks)
    assert len(kept) == 2
    held = Request(model, b, SamplingParams(max_tokens=50), rid="b")
    batcher.add(held)  # holds both blocks while it runs
    assert len(held.held) == 2
    rng = np.random.default_rng(0)
    other = rng.integers(0, model.args.vocab_size, 3 * BLOCK).tolist()
    fresh_req = Request(model, other, SamplingParams(max_tokens=1), rid="x")
    batcher.add(fresh_req)
    while fresh_req in batcher.active:
        batcher.step()
    assert set(prefix.blocks) == kept  # nothing of `other` fit; nothing held went
    held.cancelled = True
    batcher.step()
    run(batcher, model, [other], 1)  # no holder now: least recently used goes
    assert set(prefix.blocks) != kept and len(prefix.blocks) == 2 and prefix.counters["evicted_blocks"] >= 2


def test_prefix_reuse_at_the_minimum_expert_budget(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=5)
    m = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(open_checkpoint(str(tmp_path / "hf")), tmp_path / "c", ExpertPlan(m.moe_layers, m.n_expert, m.expert_names))
    model = load_model(str(tmp_path / "c"), budget="min")
    a, b, _ = prompts(model)
    want = fresh(load_model(str(tmp_path / "c"), budget="min"), b, 6)
    batcher = Batcher(model, prefix=PrefixCache(1 << 30))
    run(batcher, model, [a], 2)
    (got,), (st,) = run(batcher, model, [b], 6)
    assert st["cached_prompt_tokens"] == 2 * BLOCK and got == want
