"""What GLM-5's and DeepSeek-V3.2's sparse attention adds beyond the shared family tests
(which check their tokens against transformers on contexts longer than index_topk): the
indexer's choice is really made past index_topk and changes the result, GLM-5's shared
layers reuse it, and the cache keeps the indexer's key only for the layers that run one."""

import numpy as np
import pytest

from hf_models import build, load_model


@pytest.fixture(autouse=True)
def _init():
    from colibri.engine import layers

    layers.init()


def test_the_indexer_chooses_past_index_topk_and_shared_layers_reuse_it(tmp_path):
    build("glm_moe_dsa", "full_shared_topk4", tmp_path / "hf", seed=9)
    model = load_model(tmp_path / "hf")
    a = model.args
    cache = model.new_cache(32)
    assert model.full == [0, 2] and cache.pool.shapes["ik"] == (2, 1, a.index_head_dim)
    # per token: the latent and rotary key of every layer, the indexer's key of the full ones
    assert model.kv_bytes_per_token() == 4 * (3 * (a.kv_lora_rank + a.qk_rope_head_dim) + 2 * a.index_head_dim)
    seen = []
    choose = model.choose

    def spy(il, x, q_resid, step):
        chosen = choose(il, x, q_resid, step)
        seen.append((il, chosen))
        return chosen

    model.choose = spy
    ids = np.arange(3, 15)  # 12 tokens: past index_topk = 4
    sparse = model.forward(ids, cache, all_logits=True)
    assert [il for il, _ in seen] == [0, 2]  # layer 1 is shared: it ran no indexer of its own
    allowed = seen[0][1][0]  # [12, 12]
    assert allowed.sum(1).tolist() == [1, 2, 3, 4] + [4] * 8  # every query: its causal tokens, at most 4
    assert not np.triu(allowed, 1).any()  # never a future token
    model.choose = choose
    model.args.index_topk = 64  # every token chosen: dense attention
    dense = model.forward(ids, model.new_cache(32), all_logits=True)
    np.testing.assert_allclose(sparse[:4], dense[:4], rtol=1e-4, atol=1e-4)  # the same while all are chosen
    assert np.abs(sparse[4:] - dense[4:]).max() > 1e-3  # and not after: the choice matters


def test_deepseek_v32_runs_an_indexer_on_every_layer(tmp_path):
    """DeepSeek-V3.2 has no shared layers: each layer chooses its own keys past index_topk
    and the cache keeps the indexer's key for every layer."""
    build("deepseek_v32", "topk4_dense_first", tmp_path / "hf", seed=9)
    model = load_model(tmp_path / "hf")
    a = model.args
    assert model.full == [0, 1, 2] and model.new_cache(32).pool.shapes["ik"] == (3, 1, a.index_head_dim)
    assert model.kv_bytes_per_token() == 4 * 3 * (a.kv_lora_rank + a.qk_rope_head_dim + a.index_head_dim)
    seen = []
    choose = model.choose
    model.choose = lambda il, *rest: seen.append(il) or choose(il, *rest)
    model.forward(np.arange(3, 15), model.new_cache(32))
    assert seen == [0, 1, 2]
