"""Hybrid families (linear-attention layers with a recurrent state beside full attention):
against transformers past its 64-token prompt chunks, and the guarantees the KV-cache
families keep: a prompt's rows are the same bits in one step or in chunks, alone or
batched; a conversation continued from its saved state (KV and recurrent) gives what one
request of it gives; a request sharing a prefix resumes from a state snapshot the prefix
cache kept (a recurrent state cannot be cut back to an arbitrary prefix)."""

import numpy as np
import pytest
import torch

from colibri.engine import layers
from colibri.engine.generate import Batcher, Request, SamplingParams, generate
from colibri.engine.prefix import PrefixCache

from hf_models import CASES, build, image_text, load_model, read_bytes

HYBRIDS = [(fam, name) for fam in ("qwen3_next", "qwen3_5_moe", "kimi_linear", "inkling2", "glm5_next",
                                                  "qwen4_exp") for name, _ in CASES[fam]]


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def tokens(events):
    return [e.token_id for e in events if e.kind == "token"]


def one_after_another(model, prefix, prompts, n):
    """Each prompt through one batcher with `prefix`, after the one before: (tokens of
    each, prompt tokens each took from the prefix cache)."""
    batcher, got, cached = Batcher(model, prefix=prefix), [], []
    for p in prompts:
        req = Request(model, p, SamplingParams(max_tokens=n))
        batcher.add(req)
        cached.append(req.cached)
        out = []
        while batcher.active:
            out += [ev.token_id for _, ev in batcher.step() if ev.kind == "token"]
        got.append(out)
    return got, cached


@pytest.mark.parametrize("family,case", HYBRIDS)
@pytest.mark.parametrize("n", [63, 64, 70, 130])
def test_long_prompts_match_transformers(tmp_path, family, case, n):
    """transformers takes a prompt in chunks of 64 (its chunked form), colibri token by
    token: the logits (of magnitude 3-4) agree to rounding on both sides of the chunk size.
    transformers' own two forms, its chunked prompt and its token-by-token decode, differ by
    up to 5.2e-4 on these prompts; colibri was within 5.5e-4 of the first and 2.3e-4 of the
    second. A wrong gate, norm or decay moves them by 1e-2 and more."""
    ref = build(family, case, tmp_path, seed=5)
    ours = load_model(str(tmp_path))
    ids = np.random.default_rng(n).integers(0, ours.args.vocab_size, n)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    got = ours.forward(ids, ours.new_cache(n + 1), all_logits=True)
    assert np.abs(got - want).max() <= 1e-3


@pytest.mark.parametrize("family,case", HYBRIDS)
def test_a_prompt_in_chunks_or_batched_gives_the_same_bits(tmp_path, family, case):
    build(family, case, tmp_path, seed=9)
    model = load_model(str(tmp_path))
    rng = np.random.default_rng(4)
    ids, other = rng.integers(0, model.args.vocab_size, 37), rng.integers(0, model.args.vocab_size, 12)
    whole = model.forward(ids, model.new_cache(64), all_logits=True)
    for cuts in ([5, 16, 17, 30], [1, 2, 3, 36]):
        cache, parts = model.new_cache(64), []
        for lo, hi in zip([0, *cuts], [*cuts, len(ids)]):
            parts.append(model.forward(ids[lo:hi], cache, all_logits=True))
        assert np.array_equal(np.concatenate(parts), whole)
    # batched beside another sequence (its prompt shorter: it starts decoding meanwhile)
    a, b = model.new_cache(64), model.new_cache(64)
    first = model.forward_batch([(ids[:20], a), (other, b)], all_logits=True)
    second = model.forward_batch([(ids[20:], a), (other[:1], b)], all_logits=True)
    assert np.array_equal(np.concatenate([first[0], second[0]]), whole)
    assert np.array_equal(first[1], model.forward(other, model.new_cache(64), all_logits=True))


@pytest.mark.parametrize("family,case", HYBRIDS)
def test_a_saved_conversation_carries_the_state_which_cannot_be_cut_back(tmp_path, family, case):
    """A conversation's saved cache carries the recurrent state (its turns continuing as one
    request of the whole: tests/engine/test_sessions.py, which runs the hybrids too); it
    cannot be restored to fewer positions than it has seen."""
    build(family, case, tmp_path, seed=31)
    model = load_model(str(tmp_path))
    ids = np.random.default_rng(1).integers(0, model.args.vocab_size, 7).tolist()
    conv = list(generate(model, ids, SamplingParams(max_tokens=6), keep=True))[-1].conversation
    assert {k for k in conv.kv if k.startswith("state:")} == {"state:" + k for k in model.state_layout()}
    cache = model.new_cache(64)
    with pytest.raises(ValueError, match="recurrent state has seen"):
        cache.restore(conv.kv, len(conv.tokens) - 3)


@pytest.mark.parametrize("family,case", HYBRIDS[::2])
def test_requests_sharing_a_prefix_resume_from_a_state_snapshot(tmp_path, family, case):
    """The prefix cache keeps a hybrid's state where a prompt pauses (every 16 positions
    here, and at its last block boundary): a request sharing the whole prefix resumes at
    its deepest snapshot, one sharing part of it at an earlier one, each with the tokens a
    fresh computation gives; the prompt that paused gives its own tokens too."""
    build(family, case, tmp_path, seed=3)
    model = load_model(str(tmp_path))
    rng = np.random.default_rng(8)
    shared = rng.integers(0, model.args.vocab_size, 45).tolist()
    prompts = [shared + [5, 6], shared + [7], shared[:30] + [9, 9, 9]]
    want = [tokens(generate(model, p, SamplingParams(max_tokens=5))) for p in prompts]
    prefix = PrefixCache(1 << 30, snapshot_tokens=16)
    got, cached = one_after_another(model, prefix, prompts, 5)
    assert got == want
    assert cached == [0, 32, 16] and prefix.counters["state_snapshots"] >= 2
    small = PrefixCache(prefix.bytes - 1, snapshot_tokens=16)  # no room for every snapshot: fewer kept, none wrong
    assert one_after_another(model, small, prompts, 5)[0] == want


@pytest.mark.parametrize("family,case", HYBRIDS[1::2])
def test_a_resent_conversation_resumes_after_the_reply(tmp_path, family, case):
    """A chat client that resends the conversation (the gateway's) gets the reply's state
    back: the prefix cache keeps the state at the reply's last block boundary, so the next
    turn computes only what follows it (not the reply again), with a fresh computation's
    tokens. Without snapshots between (snapshot_tokens past the prompt) it would resume at
    the prompt's last block boundary (32)."""
    build(family, case, tmp_path, seed=4)
    model = load_model(str(tmp_path))
    rng = np.random.default_rng(5)
    first = rng.integers(0, model.args.vocab_size, 37).tolist()
    prefix = PrefixCache(1 << 30, snapshot_tokens=1024)
    (reply,), _ = one_after_another(model, prefix, [first], 30)  # 37 + 29 in the cache: 64 a boundary on the way
    turn = first + reply + rng.integers(0, model.args.vocab_size, 5).tolist()
    want = tokens(generate(model, turn, SamplingParams(max_tokens=6)))
    got, cached = one_after_another(model, prefix, [turn], 6)
    assert got == [want] and cached == [64]


def test_the_snapshot_interval_follows_the_models_bytes(tmp_path):
    """state_snapshot_tokens auto: a snapshot every as many positions as take its bytes in
    KV, in whole blocks (the daemon's default); a number as given; a model without state
    keeps the engine's default; the daemon's config takes auto or a positive number."""
    from colibri.daemon.config import ConfigError, load
    from colibri.engine.prefix import BLOCK, snapshot_interval

    build("qwen3_next", "basic_three_to_one", tmp_path / "h", seed=1)
    model = load_model(str(tmp_path / "h"))
    state, kv = model.state_bytes_per_sequence(), model.kv_bytes_per_token()
    got = snapshot_interval("auto", model)
    assert got % BLOCK == 0 and abs(got - state / kv) <= BLOCK / 2 and snapshot_interval(100, model) == 100
    build("qwen3_moe", "basic", tmp_path / "a", seed=1)
    assert snapshot_interval("auto", load_model(str(tmp_path / "a"))) == PrefixCache.SNAPSHOT_TOKENS
    assert load(None).state_snapshot_tokens == "auto"
    for bad in (0, "often"):
        (tmp_path / "c.yaml").write_text(f"state_snapshot_tokens: {bad}\n")
        with pytest.raises(ConfigError, match="state_snapshot_tokens"):
            load(str(tmp_path / "c.yaml"))


def test_an_image_text_checkpoint_runs_its_text_model_and_never_reads_the_vision_tower(tmp_path):
    """Qwen3.5 as the hub ships it: Qwen3_5MoeForConditionalGeneration, the text config under
    `text_config` and the text weights under model.language_model. colibri's logits are the
    image-text model's on text; loading reads far less than the vision tower's bytes (the
    kernel's count of this process's reads); a container keeps only the text model."""
    import transformers

    from colibri.engine.registry import build_model
    from colibri.storage.checkpoint import load_config, open_checkpoint
    from colibri.storage.container import open_container
    from colibri.storage.convert import ExpertPlan, convert

    text = dict(dict(CASES["qwen3_5_moe"])["basic_three_to_one"], eos_token_id=None, bos_token_id=None,
                pad_token_id=None)
    vision = dict(depth=2, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=48,
                  num_position_embeddings=16, patch_size=4, temporal_patch_size=2)
    ref = image_text("Qwen3_5MoeForConditionalGeneration", transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=vision), tmp_path / "hf")
    visual = sum(p.numel() * 4 for n, p in ref.named_parameters() if ".visual." in f".{n}")
    assert visual > 5 << 20

    before = read_bytes()
    ours = load_model(str(tmp_path / "hf"))
    assert read_bytes() - before < visual // 4
    ids = np.random.default_rng(2).integers(0, 101, 19)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids)[None]).logits[0].numpy()
    got = ours.forward(ids, ours.new_cache(32), all_logits=True)
    assert np.abs(got - want).max() <= 1e-4

    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(model.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "c",
            ExpertPlan(model.moe_layers, model.n_expert, model.expert_names, model.dense_names()))
    c = open_container(str(tmp_path / "c"))
    names = list(c.dense.where)
    assert names and not any("visual" in n for n in names) and all(
        n.startswith("model.language_model.") or n == "lm_head.weight" for n in names)
    placed = load_model(str(tmp_path / "c"))
    assert np.array_equal(placed.forward(ids, placed.new_cache(32), all_logits=True), got)


def test_kimi_linear_config_as_the_hub_spells_it_loads_the_same(tmp_path):
    """The hub's Kimi Linear config keeps its linear layers in `linear_attn_config` (1-indexed
    `kda_layers` / `full_attn_layers`, `head_dim`, `num_heads`, `short_conv_kernel_size`)."""
    from hf_models import rewrite_config

    build("kimi_linear", "q_lora_groups_mixed", tmp_path / "v5", seed=2)
    build("kimi_linear", "q_lora_groups_mixed", tmp_path / "hub", seed=2)

    def hub(cfg):
        types = cfg.pop("layer_types")
        cfg["linear_attn_config"] = {
            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
            "head_dim": cfg.pop("linear_head_dim"), "num_heads": cfg.pop("linear_num_heads"),
            "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim")}

    rewrite_config(tmp_path / "hub", hub)
    a, b = (load_model(str(tmp_path / d)) for d in ("v5", "hub"))
    assert b.args.layer_types == a.args.layer_types and b.args.linear_head_dim == 8
    ids = np.random.default_rng(1).integers(0, 64, 9)
    assert np.array_equal(a.forward(ids, a.new_cache(16), all_logits=True), b.forward(ids, b.new_cache(16), all_logits=True))


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_recurrent_kernels_against_numpy(per_channel):
    """The delta rule (one thread and every thread: the same bits) and the short
    convolution against plain numpy, the state carried from one call to the next."""
    from colibri.engine.recurrent import gated_delta_rule, gated_delta_rule_par, short_conv

    rng = np.random.default_rng(0)
    T, Hk, Hv, dk, dv = 9, 2, 6, 5, 7
    q, k = (rng.standard_normal((T, Hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((T, Hv, dv)).astype(np.float32)
    g = -rng.random((T, Hv, dk if per_channel else 1)).astype(np.float32)
    beta = rng.random((T, Hv)).astype(np.float32)
    S0 = rng.standard_normal((Hv, dk, dv)).astype(np.float32)
    S, want = S0.astype(np.float64), np.empty((T, Hv, dv))
    for t in range(T):
        for h in range(Hv):
            kh, qh = k[t, h // 3], q[t, h // 3]
            S[h] *= np.exp(g[t, h])[:, None]
            delta = (v[t, h] - S[h].T @ kh) * beta[t, h]
            S[h] += np.outer(kh, delta)
            want[t, h] = S[h].T @ qh
    outs = []
    for kernel in (gated_delta_rule, gated_delta_rule_par):
        state, out = S0.copy(), np.empty((T, Hv, dv), np.float32)
        kernel(q, k, v, g, beta, state, out)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(state, S, rtol=1e-4, atol=1e-4)
        outs.append((out, state))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])

    C, K = 5, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    st0 = rng.standard_normal((C, K - 1)).astype(np.float32)
    ext = np.concatenate([st0.T, x])  # [K - 1 + T, C]
    pre = np.stack([(w * ext[t : t + K].T).sum(axis=1) for t in range(T)])
    state, out = st0.copy(), np.empty_like(x)
    short_conv(x[:4], w, state, out[:4])  # in two calls: the state carries the last inputs over
    short_conv(x[4:], w, state, out[4:])
    np.testing.assert_allclose(out, pre / (1 + np.exp(-pre)), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(state, ext[-(K - 1):].T)


def test_a_snapshot_is_kept_where_a_prompt_leaves_the_cached_blocks(tmp_path):
    """The second request to share a prefix computes it from the deepest snapshot (none
    here) and pauses where it leaves the cached blocks; the third resumes there."""
    build("qwen3_next", "basic_three_to_one", tmp_path, seed=4)
    model = load_model(str(tmp_path))
    rng = np.random.default_rng(5)
    first = rng.integers(0, model.args.vocab_size, 70).tolist()
    prompts = [first, first[:50] + [1, 2, 3], first[:50] + [4, 5]]
    want = [tokens(generate(model, p, SamplingParams(max_tokens=4))) for p in prompts]
    got, cached = one_after_another(model, PrefixCache(1 << 30), prompts, 4)
    assert got == want and cached == [0, 0, 48]
