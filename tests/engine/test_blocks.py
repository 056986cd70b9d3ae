"""The shared blocks a family builds from, parameterised by what differs between families
(value head size, rotary dims and their interleaving, the softmax scale), against numpy
references written from transformers' formulas; and the router lookahead predicting with
the family's own router."""

import io
import json

import numpy as np
import pytest

from colibri.engine import attention, rope, sequence
from colibri.storage.experts import TracedSource

from hf_models import build, load_model

rng = np.random.default_rng(7)


def rand(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def rotate(a, cos, sin, interleaved):
    # transformers: the first 2 * half dims of each head turn (taken apart first when the
    # pairs are interleaved: evens, then odds), the rest pass; a [T, H, hd]
    half = cos.shape[1]
    r = a[..., : 2 * half]
    if interleaved:
        r = r.reshape(*a.shape[:2], half, 2).transpose(0, 1, 3, 2).reshape(*a.shape[:2], 2 * half)
    x1, x2 = r[..., :half], r[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, a[..., 2 * half :]], axis=-1)


@pytest.mark.parametrize("hd,hv,rot,interleaved,scale", [(16, 16, 16, False, None), (24, 16, 8, True, 0.3),
                                                          (16, 32, 12, True, None), (32, 16, 32, False, 0.11)])
def test_attention_block_follows_the_spec(hd, hv, rot, interleaved, scale):
    T, D, Hq, Hkv = 5, 48, 4, 2
    spec = attention.AttnSpec(Hq, Hkv, hd, 1e-6, v_head_dim=hv, rope_interleaved=interleaved, scale=scale)
    w = {"q": rand(Hq * hd, D), "k": rand(Hkv * hd, D), "v": rand(Hkv * hv, D), "o": rand(D, Hq * hv)}
    table = rope.Rope((1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32), 1.0)
    cos, sin = table.table(0, T)
    cache = sequence.KVCache(sequence.KVPool({"k": (1, Hkv, hd), "v": (1, Hkv, hv)}), 8)
    x = rand(T, D)
    got = attention.attention(spec, w, x, sequence.Step([sequence.Segment(cache, 0, T)], cos, sin), 0)

    q = rotate((x @ w["q"].T).reshape(T, Hq, hd), cos, sin, interleaved)
    k = rotate((x @ w["k"].T).reshape(T, Hkv, hd), cos, sin, interleaved)
    v = (x @ w["v"].T).reshape(T, Hkv, hv)
    out = np.zeros((T, Hq, hv))
    for h in range(Hq):
        g = h // (Hq // Hkv)
        s = q[:, h] @ k[:, g].T * (scale if scale is not None else hd**-0.5)  # [T, T]
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (a / a.sum(-1, keepdims=True)) @ v[:, g]
    np.testing.assert_allclose(got, out.reshape(T, Hq * hv) @ w["o"].T, rtol=2e-4, atol=2e-4)
    assert cache.take(0, T)["v"].shape == (1, Hkv, T, hv)  # the values kept at their own size


def test_the_lookahead_predicts_with_the_family_router(tmp_path):
    """The lookahead asks the family's router, not a softmax of its own: a router that picks
    experts 1 and 3 whatever the logits say is what the trace shows as predicted."""
    build("qwen3_moe", "basic", tmp_path / "hf", seed=3)
    model = load_model(tmp_path / "hf")
    A = model.n_expert_used

    def fixed(il, x):  # [T, D] -> ids, weights [T, A]
        return np.tile([1, 3, 0, 2][:A], (len(x), 1)), np.full((len(x), A), 1.0 / A, np.float32)

    model.router = fixed
    out = io.StringIO()
    model.experts = TracedSource(model.experts, out)
    model.forward(np.array([5, 6, 7]), model.new_cache(8))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines and all(line["predicted"] == sorted([1, 3, 0, 2][:A]) == line["experts"] for line in lines)
