"""What gpt-oss adds beyond the shared family tests (which check its tokens against
transformers, resident and streamed at every budget): the fused expert tensors seen one
expert at a time, biases kept in the records, and a quantized container."""

import json

import numpy as np
import pytest
import torch

from colibri.engine.registry import build_model
from colibri.storage import errors
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.convert import ExpertPlan, convert

from hf_models import build, load_model


@pytest.fixture(autouse=True)
def _init():
    from colibri.engine import layers

    layers.init()


def test_the_fused_experts_are_seen_one_expert_at_a_time(tmp_path):
    ref = build("gpt_oss", "sinks_sliding_clamped", tmp_path / "hf", seed=4)
    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    view = model.source(open_checkpoint(str(tmp_path / "hf")))
    mlp = ref.model.layers[1].mlp.experts
    gate, up, down, gb, ub, db = (view.read(n) for n in model.expert_names(1, 5))
    with torch.no_grad():
        np.testing.assert_array_equal(gate, mlp.gate_up_proj[5][:, ::2].T.numpy())
        np.testing.assert_array_equal(up, mlp.gate_up_proj[5][:, 1::2].T.numpy())
        np.testing.assert_array_equal(down, mlp.down_proj[5].T.numpy())
        np.testing.assert_array_equal(gb, mlp.gate_up_proj_bias[5][::2].numpy())
        np.testing.assert_array_equal(ub, mlp.gate_up_proj_bias[5][1::2].numpy())
        np.testing.assert_array_equal(db, mlp.down_proj_bias[5].numpy())
    assert view.entry(model.expert_names(0, 0)[0]).shape == (24, 48)


def test_a_fused_tensor_of_the_wrong_shape_is_named(tmp_path):
    build("gpt_oss", "sinks_sliding_clamped", tmp_path / "hf", seed=4, intermediate_size=24)
    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")) | {"intermediate_size": 20})
    with pytest.raises(errors.TensorShapeMismatch, match="gate_up_proj"):
        model.check(model.source(open_checkpoint(str(tmp_path / "hf"))))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_quantized_container_keeps_the_biases_float(tmp_path, dtype):
    build("gpt_oss", "sinks_sliding_clamped", tmp_path / "hf", seed=6, hidden_size=64, intermediate_size=32)
    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(model.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "q",
            ExpertPlan(model.moe_layers, model.n_expert, model.expert_names, model.dense_names()),
            expert_dtype=dtype, group_size=32)
    with open(tmp_path / "q" / "colibri.json") as f:
        layout = {(p["part"], p["tensor"]): p["dtype"] for p in json.load(f)["experts"]["layout"]}
    assert layout[("gate_bias", "weight")] == layout[("down_bias", "weight")] == "F32"
    assert layout[("gate", "weight")] == ("I8" if dtype == "int8" else "U8")
    ids = np.array([3, 9, 27, 4, 11])
    full = load_model(tmp_path / "hf").forward(ids, load_model(tmp_path / "hf").new_cache(8), all_logits=True)
    q = load_model(tmp_path / "q", budget="min")
    got = q.forward(ids, q.new_cache(8), all_logits=True)
    rel = np.abs(got - full).max() / np.abs(full).max()
    assert rel < (0.4 if dtype == "int4" else 0.1), rel  # lossy by name, not broken


def test_the_crew_computes_the_clamped_experts_as_the_family_does(tmp_path, monkeypatch):
    # int4 experts on the decode path go to the crew's kernel with gpt-oss's biases and
    # clamped activation (crew.ACT_CLAMPED): the same values as the family's own expert
    # function, to float32 rounding; and, as every path, the same bits at every budget and
    # alone or batched
    from colibri.engine.models import gpt_oss

    build("gpt_oss", "sinks_sliding_clamped", tmp_path / "hf", seed=6, hidden_size=64, intermediate_size=64)
    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(model.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "q",
            ExpertPlan(model.moe_layers, model.n_expert, model.expert_names, model.dense_names()),
            expert_dtype="int4", group_size=32, activations="float32")
    ids = [np.array([t]) for t in (3, 9, 27, 4, 11)]  # one token a step: the decode path

    def decode(m):
        cache = m.new_cache(8)
        return np.concatenate([m.forward(t, cache) for t in ids])

    want = decode(load_model(tmp_path / "q", budget="all"))
    for budget in ("min", "all"):
        m = load_model(tmp_path / "q", budget=budget)
        np.testing.assert_array_equal(decode(m), want)
    m = load_model(tmp_path / "q", budget="all")
    caches = [m.new_cache(8), m.new_cache(8)]
    both = m.forward_batch([(ids[0], caches[0]), (ids[1], caches[1])])
    np.testing.assert_array_equal(both[0], want[0:1])

    calls = []
    real_moe = gpt_oss.moe

    def own_expert_only(*a, clamped=None, **k):  # the family's expert function for every expert
        calls.append(clamped)
        return real_moe(*a, **k)

    monkeypatch.setattr(gpt_oss, "moe", own_expert_only)
    theirs = decode(load_model(tmp_path / "q", budget="all"))
    assert calls and all(c is not None for c in calls)  # the crew was offered the experts before
    np.testing.assert_allclose(want, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())
    assert not np.array_equal(want, theirs)  # (two computations: not the same bits)
