"""Streaming experts through the cache changes speed, never tokens: every family, every
budget from one slot per layer to all resident, against transformers."""

import io
import json

import numpy as np
import pytest
import torch

from colibri.daemon.maps import RoutingLog
from colibri.engine import layers
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.convert import convert, plan_for
from colibri.storage.errors import BudgetInvalid
from colibri.storage.policy import POLICIES, Policy
from colibri.storage.sizes import parse_size

from hf_models import ALL_CASES, build, load_model

N_NEW = 32


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def to_container(src, dst, **kw):
    model = build_model(str(src), load_config(str(src)))
    convert(model.source(open_checkpoint(str(src))), dst,
            plan_for(model), **kw)
    return str(dst)


def greedy(model, ids, n=N_NEW):
    return [e.token_id for e in generate(model, ids, SamplingParams(max_tokens=n)) if e.kind == "token"]


def budgets(path):
    probe = load_model(path, budget="min")
    rb, n_moe, n_exp = probe.experts.c.record_bytes, len(probe.moe_layers), probe.n_expert
    return {"one slot per layer": "min", "half": rb * n_moe * max(n_exp // 2, 1), "all": "all"}


@pytest.mark.parametrize("family,case", ALL_CASES)
def test_tokens_identical_at_every_budget(tmp_path, family, case):
    ref = build(family, case, tmp_path / "hf", seed=21)
    path = to_container(tmp_path / "hf", tmp_path / "c")
    resident = load_model(str(tmp_path / "hf"))
    ids = np.random.default_rng(4).integers(0, resident.args.vocab_size, 13)
    with torch.no_grad():
        hf = ref.generate(torch.tensor(ids)[None], max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    want_logits = resident.forward(ids, resident.new_cache(16), all_logits=True)
    for name, budget in budgets(path).items():
        model = load_model(path, budget=budget)
        got = model.forward(ids, model.new_cache(16), all_logits=True)
        np.testing.assert_array_equal(got, want_logits, err_msg=name)  # bit for bit, whatever came from disk
        assert greedy(model, ids) == hf, name
        # below "all" the experts really cycled through the slots; at "all" nothing was evicted
        assert (model.experts.stats.evictions > 0) == (name != "all"), name


def test_int4_tokens_identical_at_every_budget(tmp_path):
    """Quantized experts are the container's own weights: whatever the budget (one slot per
    layer: the experts arrive one by one and each is a job of its own for the compute crew;
    all resident: one job per layer), the logits and the decoded tokens are the same bits."""
    build("qwen3_moe", "basic", tmp_path / "hf", seed=8, hidden_size=128, moe_intermediate_size=64)
    path = to_container(tmp_path / "hf", tmp_path / "c", expert_dtype="int4", group_size=32)
    ids = np.random.default_rng(5).integers(0, 101, 9)
    runs, fast = {}, []
    for name, budget in budgets(path).items():
        model = load_model(path, budget=budget)
        if name == "all":  # a step of resident experts takes their addresses from the slots (int4_hits)
            cache = model.experts

            def counted(il, ids, inner=cache.int4_hits):
                got = inner(il, ids)
                fast.append(got is not None)
                return got

            cache.int4_hits = counted
            model.experts = log = RoutingLog(cache)  # as the daemon wraps it: every step still logged
        logits = model.forward(ids, model.new_cache(16), all_logits=True)
        runs[name] = (logits, greedy(model, ids, n=12), [e.token_id for e in generate(
            model, ids, SamplingParams(max_tokens=12, temperature=1.0, seed=3)) if e.kind == "token"])
    assert sum(fast) > 10 and len(log.log) == log.step * len(model.moe_layers)
    want = runs.pop("all")
    for name, got in runs.items():
        np.testing.assert_array_equal(got[0], want[0], err_msg=name)
        assert got[1:] == want[1:], name


def test_budget_limits_and_words(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=1)
    path = to_container(tmp_path / "hf", tmp_path / "c")
    m = load_model(path, budget="min")
    rb, n_moe = m.experts.c.record_bytes, len(m.moe_layers)
    assert m.experts.n_slots == n_moe
    with pytest.raises(BudgetInvalid, match=f"minimum is .*{n_moe * rb} bytes"):
        load_model(path, budget=n_moe * rb - 1)
    assert load_model(path, budget="all").experts.n_slots == n_moe * m.n_expert
    all_bytes = n_moe * m.n_expert * rb
    assert load_model(path, budget=3 * all_bytes).experts.n_slots == n_moe * m.n_expert  # never more than all
    with pytest.raises(BudgetInvalid, match="above this box's limit of .* of RAM less"):  # nor above the RAM
        load_model(path, budget=10**15)
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("100KiB") == 102400 and parse_size("12345") == 12345 and parse_size("min") == "min"
    with pytest.raises(BudgetInvalid, match="cannot read"):
        parse_size("lots")


def test_batch_union_reads_each_expert_once_per_step(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=3)
    path = to_container(tmp_path / "hf", tmp_path / "c")
    trace = io.StringIO()
    model = load_model(path, budget="all", trace=trace)
    ids = np.random.default_rng(0).integers(0, 101, 40)  # 40 tokens x top-2 over 8 experts: heavy overlap
    model.forward(ids, model.new_cache(48))
    lines = [json.loads(line) for line in trace.getvalue().splitlines()]
    assert [ln["layer"] for ln in lines] == model.moe_layers and {ln["step"] for ln in lines} == {0}
    union = sum(len(ln["experts"]) for ln in lines)
    assert union < 40 * 2 * len(model.moe_layers)  # the tokens share experts
    st = model.experts.stats
    assert st.misses == union and st.hits == 0  # each unique expert of the step read once
    assert st.bytes_read == union * model.experts.inner.record_bytes
    before = st.misses
    model.forward(ids[:1], model.new_cache(4))  # everything is resident now: no reads
    assert model.experts.stats.misses == before


def test_routing_trace_lines(tmp_path):
    build("mixtral", "basic", tmp_path / "hf", seed=2)
    trace = io.StringIO()
    model = load_model(str(tmp_path / "hf"), trace=trace)
    greedy(model, np.arange(5), n=4)
    lines = [json.loads(line) for line in trace.getvalue().splitlines()]
    assert len(lines) == 4 * len(model.moe_layers)  # prefill + 3 decode steps, one line per layer
    assert [ln["step"] for ln in lines] == [s for s in range(4) for _ in model.moe_layers]
    assert all(len(ln["experts"]) == 2 for ln in lines if ln["step"] > 0)  # decode: top-k of one token
    assert all(ln["experts"] == sorted(set(ln["experts"])) for ln in lines)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_container_runs_close_to_bf16(tmp_path, dtype):
    build("mixtral", "basic", tmp_path / "hf", seed=8, hidden_size=128, intermediate_size=64)
    ref = load_model(to_container(tmp_path / "hf", tmp_path / "bf16", expert_dtype="bf16"))
    q = load_model(to_container(tmp_path / "hf", tmp_path / dtype, expert_dtype=dtype, group_size=32), budget="min")
    assert q.precision()["experts"] == dtype and q.precision()["lossy"]
    ids = np.arange(9)
    a = ref.forward(ids, ref.new_cache(12), all_logits=True)
    b = q.forward(ids, q.new_cache(12), all_logits=True)
    rel = np.abs(a - b).max() / np.abs(a).max()
    assert rel < (0.4 if dtype == "int4" else 0.1), rel  # a flipped router choice moves logits more


@pytest.mark.parametrize("family,case", [("qwen3_moe", "basic"), ("qwen2_moe", "sparse_step_tied_window"),
                                         ("mixtral", "odd_tied_window"), ("deepseek_v3", "q_lora_groups_interleaved"),
                                         ("qwen3_next", "basic_three_to_one"), ("kimi_linear", "q_lora_groups_mixed"),
                                         ("deepseek_v4", "odd_sigmoid_hc3_yarn"), ("inkling2", "sliding_full_blocks"),
                                         ("glm5_next", "kda_pools_shared_hc2"), ("qwen4_exp", "ple_qsa_hc2")])
def test_prefetch_moves_data_never_tokens(tmp_path, family, case):
    build(family, case, tmp_path / "hf", seed=31)
    path = to_container(tmp_path / "hf", tmp_path / "c")
    ids = np.random.default_rng(6).integers(0, 60, 9)
    want = greedy(load_model(path, budget="min"), ids, 24)
    for budget in ("min", budgets(path)["half"]):
        model = load_model(path, budget=budget, prefetch=4)
        assert greedy(model, ids, 24) == want
        st = model.experts.stats
        assert st.prefetch_issued > 0 and st.prefetch_used + st.prefetch_wasted <= st.prefetch_issued
        assert st.prefetch_used > 0  # the lookahead guesses some right even on random weights


@pytest.mark.parametrize("family,case", [("qwen3_moe", "basic"), ("qwen2_moe", "sparse_step_tied_window"),
                                         ("mixtral", "odd_tied_window"), ("olmoe", "basic"),
                                         ("deepseek_v3", "no_q_lora_yarn_bias_odd"),
                                         ("glm4_moe", "partial_rotary_qk_norm_groups"),
                                         ("glm_moe_dsa", "full_shared_topk4"), ("deepseek_v32", "topk4_dense_first"),
                                         ("gpt_oss", "sinks_sliding_clamped"),
                                         ("minimax_m2", "odd_full_rotary_tied"), ("qwen3_next", "odd_mix_sparse_tied"),
                                         ("qwen3_5_moe", "basic_three_to_one"), ("kimi_linear", "q_lora_groups_mixed"),
                                         ("deepseek_v4", "all_types_hash_first"),
                                         ("inkling2", "sliding_full_blocks"), ("glm5_next", "kda_pools_shared_hc2"),
                                         ("qwen4_exp", "ple_qsa_hc2")])
def test_tokens_identical_with_every_policy(tmp_path, family, case):
    ref = build(family, case, tmp_path / "hf", seed=41)
    path = to_container(tmp_path / "hf", tmp_path / "c")
    probe = load_model(path, budget="min")
    ids = np.random.default_rng(5).integers(0, probe.args.vocab_size, 11)
    with torch.no_grad():
        hf = ref.generate(torch.tensor(ids)[None], max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    top_k, n_moe = probe.args.num_experts_per_tok, len(probe.moe_layers)
    budget = probe.experts.c.record_bytes * n_moe * (top_k + 1)  # the LRU minimum and room for a hot set
    for name in POLICIES:
        for prefetch in (0, 4):
            policy = Policy(name=name, hot_set=1.0, repin_every=2, prefetch_reads=prefetch)
            hist = tmp_path / f"history-{name}-{prefetch}"
            for run in ("cold", "warm"):  # warm: the cold run's history picks the pins at start
                model = load_model(path, budget=budget, policy=policy, state_dir=str(hist))
                st = model.experts.stats
                if run == "warm" and policy.name != "lru":  # read in from the history at start
                    assert len(model.experts.pinned) > 0 or st.bytes_read > 0, name
                assert greedy(model, ids) == hf, (name, prefetch, run)
                assert st.evictions > 0 and (st.prefetch_issued > 0) == (prefetch > 0)
                if policy.learns and run == "cold":
                    assert st.repins > 0, name
                assert model.experts.history.save()
