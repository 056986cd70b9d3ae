"""What DeepSeek-V3 (and Kimi K2) add beyond the shared family tests (test_families.py and
test_streaming.py run every case of hf_models.CASES["deepseek_v3"] against transformers):
the latent KV cache's size, the router against transformers' own, the checkpoints' MTP
layers, and the kimi_k2 name."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from colibri.engine.models import deepseek_v3
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config
from colibri.storage.safetensors import SafetensorsFile

from hf_models import build, load_model, rewrite_config


@pytest.fixture(autouse=True)
def _init():
    from colibri.engine import layers

    layers.init()


def greedy(model, ids, n):
    cache, out = model.new_cache(len(ids) + n), []
    logits = model.forward(np.asarray(ids), cache)
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = model.forward(np.array(out[-1:]), cache)
    return out


def test_the_kv_cache_holds_the_latent_and_the_rotary_key_only(tmp_path):
    build("deepseek_v3", "q_lora_groups_interleaved", tmp_path / "hf", seed=2)
    model = load_model(tmp_path / "hf")
    a = model.args
    pool = model.new_cache(32).pool
    assert list(pool.shapes) == ["k"] and pool.shapes["k"] == (model.n_layer, 1, a.kv_lora_rank + a.qk_rope_head_dim)
    assert pool.arrays["v"].base is pool.arrays["k"].base  # the values are the latent itself: no second array
    per_token = model.n_layer * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    assert model.kv_bytes_per_token() == per_token == model.describe()["kv_bytes_per_token"]
    # full heads would be n_layer * H * (qk_head_dim + v_head_dim) floats
    assert per_token < model.n_layer * a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * 4
    assert model.describe()["attention"] == "MLA"


@pytest.mark.parametrize("n_group,topk_group,norm", [(4, 2, True), (1, 1, False), (8, 3, True)])
def test_route_is_transformers_router(n_group, topk_group, norm):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    E, D, T, A = 16, 12, 9, 4
    cfg = transformers.DeepseekV3Config(hidden_size=D, n_routed_experts=E, num_experts_per_tok=A, n_group=n_group,
                                        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=1.7)
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=gen))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(E, generator=gen))
        x = torch.randn(T, D, generator=gen)
        _, want_w, want_ids = router(x)
    logits = x.numpy() @ router.weight.detach().numpy().T
    ids, w = deepseek_v3.route(logits.astype(np.float32), router.e_score_correction_bias.numpy(), A, n_group,
                               topk_group, norm, 1.7)
    for t in range(T):  # the same experts with the same weights (transformers' order is unsorted)
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        want = dict(zip(want_ids[t].tolist(), want_w[t].tolist()))
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5)


def add_mtp_layer(path):
    """Add what DeepSeek's checkpoints carry after the last layer: a multi-token-prediction
    layer, model.layers.{num_hidden_layers}.*"""
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    n = load_config(str(path))["num_hidden_layers"]
    extra = {f"model.layers.{n}.eh_proj.weight": np.ones((4, 8), np.float32),
             f"model.layers.{n}.mlp.experts.0.gate_proj.weight": np.ones((4, 8), np.float32),
             f"model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight": np.ones((4, 8), np.float32)}
    save_file(tensors | extra, file)
    return extra


def test_mtp_layers_are_skipped_at_load_and_left_out_of_a_container(tmp_path):
    ref = build("deepseek_v3", "no_q_lora_yarn_bias_odd", tmp_path / "hf", seed=5)
    extra = add_mtp_layer(tmp_path / "hf")
    ids = [3, 17, 40, 8, 61]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    assert greedy(load_model(tmp_path / "hf"), ids, 12) == want
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", str(tmp_path / "hf"), str(tmp_path / "c")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    dense = SafetensorsFile(str(tmp_path / "c" / "dense.safetensors"))
    assert not set(extra) & set(dense.entries)
    assert greedy(load_model(tmp_path / "c", budget="min"), ids, 12) == want


def test_kimi_k2_is_deepseek_v3(tmp_path):
    build("deepseek_v3", "one_group_two_dense_tied", tmp_path / "hf", seed=1)
    rewrite_config(tmp_path / "hf", lambda c: c.update(model_type="kimi_k2"))
    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    assert isinstance(model, deepseek_v3.Model) and model.ATTENTION == "MLA"
