"""What DeepSeek-V4 adds beyond the shared family tests (which check its logits, 32 greedy
tokens, decode, chunks, batches, budgets and policies against transformers): the
indexer's choice matters past index_topk, the sequence keeps the rows its layout says,
DeepSeek's own tensor names load the same, the router's softmax scoring, and a token ->
expert table that is not integers is refused."""

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from colibri.engine.models import deepseek_v4
from colibri.storage.errors import UnsupportedDtype

from hf_models import build, load_model


@pytest.fixture(scope="module", autouse=True)
def _init():
    from colibri.engine import layers

    layers.init()


def test_the_indexer_chooses_and_the_cache_keeps_what_its_layout_says(tmp_path):
    """Past index_topk closed entries the indexer's choice changes the logits; a sequence
    keeps a piece of each closed entry per token and a fixed state."""
    build("deepseek_v4", "all_types_hash_first", tmp_path, seed=3)
    model = load_model(str(tmp_path))
    a = model.args
    hd, ihd = a.head_dim, a.index_head_dim
    n_csa, n_hca = a.layer_types.count(deepseek_v4.CSA), a.layer_types.count(deepseek_v4.HCA)
    rc, rh = a.compress_rates[deepseek_v4.CSA], a.compress_rates[deepseek_v4.HCA]
    # per token only a piece of each compressed entry (head_dim / rate, rounded up); the
    # window's keys and the projections of unfinished windows are a fixed state
    assert model.kv_bytes_per_token() == 4 * (n_csa * (-(-hd // rc) + -(-ihd // rc)) + n_hca * -(-hd // rh))
    assert model.state_bytes_per_sequence() == 4 * (
        a.num_hidden_layers * a.sliding_window * hd + n_csa * (2 * rc * 4 * hd + 2 * rc * 4 * ihd + hd + ihd)
        + n_hca * (rh * 2 * hd + hd))
    ids = np.random.default_rng(4).integers(0, a.vocab_size, 30)  # 10 CSA entries at rate 3: past index_topk = 3
    sparse = model.forward(ids, model.new_cache(40), all_logits=True)
    model.args.index_topk = 64  # every closed entry chosen
    dense = model.forward(ids, model.new_cache(40), all_logits=True)
    first_pick = 3 * (3 + 1) - 1  # the first position with more closed entries than index_topk
    np.testing.assert_array_equal(sparse[:first_pick], dense[:first_pick])
    assert np.abs(sparse[first_pick:] - dense[first_pick:]).max() > 1e-4


def test_deepseeks_own_tensor_names_load_the_same(tmp_path):
    """The release names its tensors without transformers' `model.` prefix (embed.weight,
    layers.N.attn.wq_a.weight, hc_head_fn, ...): spell() takes them."""
    build("deepseek_v4", "odd_sigmoid_hc3_yarn", tmp_path / "a", seed=5)
    build("deepseek_v4", "odd_sigmoid_hc3_yarn", tmp_path / "b", seed=5)
    hub = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    for f in (tmp_path / "b").glob("*.safetensors"):
        tensors = load_file(f)
        save_file({hub.get(n, n.removeprefix("model.")): t for n, t in tensors.items()}, f, metadata={"format": "pt"})
    a, b = load_model(str(tmp_path / "a")), load_model(str(tmp_path / "b"))
    assert b.NAMES["q_a"] == "layers.{il}.attn.wq_a.weight"
    ids = np.arange(3, 20)
    np.testing.assert_array_equal(a.forward(ids, a.new_cache(32), all_logits=True),
                                  b.forward(ids, b.new_cache(32), all_logits=True))


def test_softmax_scoring_weighs_the_top_k_by_their_renormalised_softmax():
    rng = np.random.default_rng(0)
    logits, bias = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    ids, w = deepseek_v4.route(logits, bias, None, 3, "softmax", 2.0)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want = np.argsort(-(p + bias), axis=-1)[:, :3]
    assert np.array_equal(ids, want)
    chosen = np.take_along_axis(p, want, -1)
    np.testing.assert_allclose(w, 2.0 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    fixed = np.array([[1, 4, 0]] * 5)  # a hash layer: the table's experts, weighed the same way
    ids, w = deepseek_v4.route(logits, None, fixed, 3, "sigmoid", 1.0)
    s = np.take_along_axis(1 / (1 + np.exp(-logits)), fixed, -1)
    assert np.array_equal(ids, fixed)
    np.testing.assert_allclose(w, s / s.sum(-1, keepdims=True), rtol=1e-6)


def test_a_token_table_that_is_not_integers_is_refused(tmp_path):
    build("deepseek_v4", "hc1_legacy_spellings", tmp_path, seed=1)
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(n for n in tensors if n.endswith("tid2eid"))
    tensors[name] = tensors[name].float()
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(UnsupportedDtype, match="integer table"):
        load_model(str(tmp_path))


def test_fp4_experts_that_do_not_say_so_or_miss_their_scales_are_refused(tmp_path):
    from colibri.storage.errors import QuantizationUnsupported, ScalesMismatch

    from hf_models import build_fp4, rewrite_config

    build_fp4("deepseek_v4", "hc1_legacy_spellings", tmp_path, seed=2, hidden_size=64, moe_intermediate_size=32)
    assert load_model(str(tmp_path)).precision()["experts"] == "mxfp4"
    rewrite_config(tmp_path, lambda c: c["quantization_config"].pop("expert_dtype"))
    with pytest.raises(QuantizationUnsupported, match="expert_dtype: fp4"):
        load_model(str(tmp_path))
    rewrite_config(tmp_path, lambda c: c["quantization_config"].update(expert_dtype="fp4"))
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(n for n in tensors if n.endswith("experts.0.w1.weight_scale_inv"))
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ScalesMismatch, match="F8_E8M0"):
        load_model(str(tmp_path))


def test_the_hash_layers_experts_are_read_ahead_exactly(tmp_path):
    """A hash layer's experts follow from the token ids: with every MoE layer hashed, the
    lookahead reads exactly what the layers then use (nothing wasted), and the tokens are
    those of a run without it."""
    from hf_models import build_container

    build_container(tmp_path, "deepseek_v4", "hc1_legacy_spellings", seed=3, num_hash_layers=2)
    path = str(tmp_path / "c")
    ids = np.random.default_rng(1).integers(0, 64, 6)
    plain = load_model(path, budget="min", prefetch=0)
    ahead = load_model(path, budget="min", prefetch=4)
    assert ahead.args.mlp_layer_types == ["hash_moe", "hash_moe"]
    caches = plain.new_cache(32), ahead.new_cache(32)
    outs = [m.forward(ids, c, all_logits=True) for m, c in zip((plain, ahead), caches)]
    for t in np.random.default_rng(2).integers(0, 64, 8):
        outs += [m.forward(np.array([t]), c) for m, c in zip((plain, ahead), caches)]
    assert all(np.array_equal(a, b) for a, b in zip(outs[::2], outs[1::2]))
    st = ahead.experts.stats
    assert st.prefetch_issued > 0 and st.prefetch_wasted == 0


@pytest.mark.parametrize("legacy", [
    {"compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 2, "qk_rope_head_dim": 16},  # (+ the MTP layer's ratio)
    {"compress_rate_csa": 8, "compress_rate_hca": 64, "layer_types": None},
    {"num_hash_layers": 0, "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}},
])
def test_the_older_config_spellings_mean_what_transformers_reads(legacy):
    from transformers import DeepseekV4Config

    from colibri.engine.registry import build_model

    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 32,
            "max_position_embeddings": 256}
    cfg = {k: v for k, v in (base | legacy).items() if v is not None}
    theirs = DeepseekV4Config(**cfg)
    ours = build_model("legacy", {"model_type": "deepseek_v4", **cfg})
    a = ours.args
    assert a.layer_types == theirs.layer_types and a.mlp_layer_types == theirs.mlp_layer_types
    assert a.compress_rates == theirs.compress_rates and a.rope_dim == theirs.qk_rope_head_dim
    want = {k: {n: v for n, v in p.items() if n != "type"} for k, p in theirs.rope_parameters.items()}
    assert dict(zip(("main", "compress"), deepseek_v4.rope_settings(cfg, a))) == want  # ("type": its older name)


def test_a_long_context_in_chunks_matches_transformers(tmp_path):
    """150 positions: the window's ring wraps 30 times, dozens of entries close and are cut
    into pieces across the pool's rows; taken in chunks of 37 and then one at a time, the
    logits are transformers' on the whole, and the chunks' bits those of one step."""
    import torch

    ref = build("deepseek_v4", "all_types_hash_first", tmp_path, seed=6, max_position_embeddings=512)
    ours = load_model(str(tmp_path))
    ids = np.random.default_rng(9).integers(0, ours.args.vocab_size, 150)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    whole = ours.forward(ids, ours.new_cache(160), all_logits=True)
    assert np.abs(whole - want).max() <= 2e-4
    cache = ours.new_cache(160)
    parts = [ours.forward(ids[i : i + 37], cache, all_logits=True) for i in range(0, 111, 37)]
    parts += [ours.forward(ids[i : i + 1], cache, all_logits=True) for i in range(111, 150)]
    assert np.array_equal(np.concatenate(parts)[:111], whole[:111])
    assert np.abs(np.concatenate(parts) - whole).max() <= 2e-5
