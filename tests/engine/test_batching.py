"""Continuous batching: requests that share forward steps get exactly the tokens they get
alone, whatever joins or leaves around them; the step reads the union of their experts."""

import numpy as np
import pytest

from colibri.engine import layers
from colibri.engine.generate import Batcher, ChunkSizer, Request, SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.convert import ExpertPlan, convert

from hf_models import build, load_model


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def alone(model, ids, n):
    return [e.token_id for e in generate(model, ids, SamplingParams(max_tokens=n)) if e.kind == "token"]


def together(model, prompts, n, join_at, prefill_chunk=None):
    batcher, got, step = Batcher(model, prefill_chunk), {}, 0
    waiting = sorted(range(len(prompts)), key=lambda i: join_at[i])
    while waiting or batcher.active:
        while waiting and join_at[waiting[0]] <= step:
            i = waiting.pop(0)
            batcher.add(Request(model, prompts[i], SamplingParams(max_tokens=n), rid=i))
            got[i] = []
        for req, ev in batcher.step():
            if ev.kind == "token":
                got[req.id].append(ev.token_id)
        step += 1
    return got


@pytest.mark.parametrize("family,case,dtype", [("mixtral", "basic", "f32"), ("qwen2_moe", "sparse_step_tied_window", "f32"),
                                               ("qwen3_moe", "basic", "bf16"),
                                               ("deepseek_v4", "odd_sigmoid_hc3_yarn", "bf16")])
def test_tokens_identical_alone_and_batched(tmp_path, family, case, dtype):
    import torch

    build(family, case, tmp_path / "hf", seed=13, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model = load_model(str(tmp_path / "hf"))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, model.args.vocab_size, n).tolist() for n in (3, 11, 6, 1)]
    want = {i: alone(model, p, 16) for i, p in enumerate(prompts)}
    assert together(model, prompts, 16, join_at=[0, 0, 3, 7]) == want


@pytest.mark.parametrize("family,case", [("mixtral", "odd_tied_window"), ("deepseek_v3", "q_lora_groups_interleaved"),
                                         ("gpt_oss", "sinks_sliding_clamped"), ("glm_moe_dsa", "full_shared_topk4"),
                                         ("qwen3_moe", "basic"), ("deepseek_v32", "odd_topk7_yarn_mlp_types"),
                                         ("deepseek_v4", "all_types_hash_first")])
def test_chunked_prefill_gives_the_tokens_of_one_step(tmp_path, family, case):
    """Prompts that join running requests go in chunks of 4 tokens a step; every request's
    tokens are those it gets alone (its prompt in one step)."""
    build(family, case, tmp_path / "hf", seed=21)
    model = load_model(str(tmp_path / "hf"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.args.vocab_size, n).tolist() for n in (2, 17, 9, 13)]
    want = {i: alone(model, p, 12) for i, p in enumerate(prompts)}
    assert together(model, prompts, 12, join_at=[0, 2, 3, 9], prefill_chunk=4) == want


def test_a_long_prompt_does_not_stop_a_running_stream(tmp_path):
    """While a 30-token prompt is prefilled in chunks of 4, the running request gets a token
    at every step and no step computes more than a chunk of prompt beside it; unchunked,
    the whole prompt is one step. Alone, a prompt is one step whatever the chunk."""
    build("qwen3_moe", "basic", tmp_path / "hf", seed=22)
    model = load_model(str(tmp_path / "hf"))
    rows = []
    real = model.forward_batch
    model.forward_batch = lambda seqs, **kw: rows.append(sum(len(ids) for ids, _ in seqs)) or real(seqs, **kw)
    for chunk, steps, most in ((4, 8, 4 + 1), (None, 1, 30 + 1)):
        b = Batcher(model, chunk)
        running = Request(model, [1, 2, 3], SamplingParams(max_tokens=40))
        b.add(running)
        b.step()
        rows.clear()
        long = Request(model, list(range(5, 35)), SamplingParams(max_tokens=2))
        b.add(long)
        gaps = []
        while long.prefilling:
            gaps.append(sum(ev.kind == "token" for r, ev in b.step() if r is running))
        assert gaps == [1] * steps and max(rows) == most
    rows.clear()
    b = Batcher(model, 4)
    b.add(Request(model, list(range(5, 35)), SamplingParams(max_tokens=2)))
    b.step()
    assert rows == [30]


def test_the_auto_chunk_follows_the_measured_steps():
    """prefill_chunk auto: each chunk size's step time beside decoding measured; the largest
    chunk, at most twice the last, whose predicted step fits AIM x GAP decode steps (from one
    token to more at the prompt path's price); a step over the target believed at once;
    within its bounds; steps with nothing decoding teach it nothing."""
    z = ChunkSizer()
    assert z.chunk == 1 and z.decode_s is None
    z.observe(0.05, 1, 1)  # no decode-only step measured yet: nothing to compare with
    assert z.chunk == 1 and not z.cost
    z.observe(0.1, 0, 2)
    z.observe(0.1, 40, 0)  # a prompt alone
    assert z.decode_s == pytest.approx(0.1) and z.chunk == 1
    z.observe(0.125, 1, 1)  # one token adds 25 ms: two on the prompt path would add 200 ms, over 1.7x
    assert z.predict(2) == pytest.approx(0.1 + 2 * 0.025 * z.PROMPT_PATH) and z.chunk == 1
    z = ChunkSizer()
    z.observe(0.1, 0, 1)
    z.observe(0.105, 1, 1)  # 5 ms a token: 2 tokens predicted at 0.14 s fit
    assert z.chunk == 2
    z.observe(0.14, 2, 1)  # 20 ms a token from 2 on: up to 3 more fit 0.17 s (doubling at most)
    assert z.chunk == 3
    for _ in range(6):
        before = z.chunk
        z.observe(0.1 + 0.02 * z.chunk, z.chunk, 1)
        assert z.chunk <= 2 * before and z.predict(z.chunk) <= z.AIM * z.GAP * z.decode_s + 1e-9
    assert z.chunk == 3  # 0.16 s at 3, 0.18 s predicted at 4: over 1.7x
    z.observe(0.25, 3, 1)  # over 2x: believed at once
    assert z.cost[3] == pytest.approx(0.25) and z.chunk == 2
    z = ChunkSizer()
    z.observe(0.1, 0, 1)
    for _ in range(20):
        z.observe(0.1, z.chunk, 1)  # prompt tokens for free
    assert z.chunk == ChunkSizer.LARGEST


@pytest.mark.parametrize("family,case", [("qwen3_moe", "basic"), ("qwen3_next", "basic_three_to_one"),
                                         ("kimi_linear", "odd_no_q_lora_two_shared"), ("inkling2", "sliding_full_blocks"),
                                         ("glm5_next", "one_stream_groups_no_bound"), ("qwen4_exp", "ple_qsa_hc2")])
def test_auto_chunks_give_the_tokens_of_one_step(tmp_path, family, case):
    # a hybrid's recurrent state advances chunk by chunk, whatever sizes auto picks
    build(family, case, tmp_path / "hf", seed=23)
    model = load_model(str(tmp_path / "hf"))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, model.args.vocab_size, n).tolist() for n in (2, 40, 9)]
    want = {i: alone(model, p, 10) for i, p in enumerate(prompts)}
    assert together(model, prompts, 10, join_at=[0, 2, 3], prefill_chunk="auto") == want


def test_forward_batch_rows_equal_alone(tmp_path):
    build("olmoe", "gqa_clip_tied_bias", tmp_path / "hf", seed=4)
    model = load_model(str(tmp_path / "hf"))
    seqs = [np.arange(5), np.arange(20, 29), np.array([7])]
    caches = [model.new_cache(16) for _ in seqs]
    batched = model.forward_batch(list(zip(seqs, caches)), all_logits=True)
    for ids, got in zip(seqs, batched):
        np.testing.assert_array_equal(got, model.forward(ids, model.new_cache(16), all_logits=True))


def test_streamed_batch_reads_the_union_once(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=5)
    m = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(open_checkpoint(str(tmp_path / "hf")), tmp_path / "c", ExpertPlan(m.moe_layers, m.n_expert, m.expert_names))
    model = load_model(str(tmp_path / "c"), budget="all")
    seqs = [np.arange(i, i + 6) for i in range(0, 60, 6)]  # 10 requests, 60 tokens, 8 experts
    model.forward_batch([(s, model.new_cache(8)) for s in seqs])
    st = model.experts.stats
    assert st.misses <= model.n_expert * len(model.moe_layers)  # never more than one read per expert
    assert st.fetches == len(model.moe_layers)  # one request for the union per layer
    # the union saving: each sequence alone asks for its own union; the batch, once, for all of them
    routed = 0
    for s in seqs:
        one = load_model(str(tmp_path / "c"), budget="all")
        one.forward(s, one.new_cache(8))
        assert one.experts.stats.routed == one.experts.stats.experts
        routed += one.experts.stats.experts
    assert st.routed == routed and st.as_dict()["union_saving"] == round(routed / st.experts, 4) > 1
    want = {i: alone(load_model(str(tmp_path / "c"), budget="min"), s.tolist(), 8) for i, s in enumerate(seqs[:3])}
    assert together(load_model(str(tmp_path / "c"), budget="min"), [s.tolist() for s in seqs[:3]], 8,
                    join_at=[0, 1, 2]) == want
    assert together(load_model(str(tmp_path / "c"), budget="min"), [s.tolist() for s in seqs[:3]], 8,
                    join_at=[0, 1, 2], prefill_chunk=2) == want  # streamed at the minimum budget, in chunks


def test_cancel_leaves_with_a_done_event(tmp_path):
    build("mixtral", "basic", tmp_path / "hf", seed=6)
    model = load_model(str(tmp_path / "hf"))
    b = Batcher(model)
    a, c = Request(model, [1, 2, 3], SamplingParams(max_tokens=50)), Request(model, [4, 5], SamplingParams(max_tokens=5))
    b.add(a)
    b.add(c)
    b.step()
    a.cancelled = True
    events = b.step()
    assert [(r is a, ev.kind, ev.finish_reason) for r, ev in events if r is a] == [(True, "done", "cancelled")]
    assert b.active == [c]


def test_int4_rows_are_the_same_alone_and_batched(tmp_path):
    """int4 experts compute a prompt's rows by the prompt-token kernels and a decoding
    sequence's row by the decode kernels; the choice follows the sequence, not the batch, so
    prompts and decode steps mixed in one step give each sequence the bits it gets alone."""
    build("qwen3_moe", "basic", tmp_path / "hf", seed=12, hidden_size=128, moe_intermediate_size=64)
    m = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(open_checkpoint(str(tmp_path / "hf")), tmp_path / "c", ExpertPlan(m.moe_layers, m.n_expert, m.expert_names),
            expert_dtype="int4", group_size=32)
    model = load_model(str(tmp_path / "c"), budget="all")
    seqs = [np.arange(3, 12), np.array([40]), np.arange(20, 26)]
    ref = [model.forward(s, model.new_cache(16), all_logits=True) for s in seqs]
    caches = [model.new_cache(16) for _ in seqs]
    batched = model.forward_batch([(s, c) for s, c in zip(seqs, caches)], all_logits=True)
    for want, got in zip(ref, batched):
        np.testing.assert_array_equal(got, want)
    prompts = [s.tolist() for s in seqs]
    want = {i: alone(model, p, 10) for i, p in enumerate(prompts)}
    assert together(model, prompts, 10, join_at=[0, 2, 5]) == want  # prompts join decoding sequences
