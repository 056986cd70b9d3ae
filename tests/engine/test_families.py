"""Every family against transformers on tiny random checkpoints the test builds itself:
prompt logits, greedy tokens, KV-cache decode = full forward, both config spellings."""

import numpy as np
import pytest
import torch

from colibri.engine import layers
from colibri.engine.generate import SamplingParams, generate

from hf_models import ALL_CASES, build, hub_spelling, load_model, logits_atol, rewrite_config

N_NEW = 32


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def prompt(vocab: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


def hf_greedy(model, ids: np.ndarray, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor(ids)[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def our_greedy(model, ids: np.ndarray, n: int) -> list[int]:
    events = generate(model, ids, SamplingParams(max_tokens=n))
    return [e.token_id for e in events if e.kind == "token"]


@pytest.mark.parametrize("family,case", ALL_CASES)
def test_matches_transformers(tmp_path, family, case):
    ref = build(family, case, tmp_path, seed=7)
    ours = load_model(str(tmp_path))
    vocab = ours.args.vocab_size
    ids = prompt(vocab, 11, seed=3)

    with torch.no_grad():
        ref_logits = ref(torch.tensor(ids)[None]).logits[0].numpy()
    logits = ours.forward(ids, ours.new_cache(64), all_logits=True)
    assert logits.shape == ref_logits.shape
    assert np.abs(logits - ref_logits).max() <= logits_atol(family)

    assert our_greedy(ours, ids, N_NEW) == hf_greedy(ref, ids, N_NEW)


@pytest.mark.parametrize("family,case", ALL_CASES)
def test_kv_cache_decode_equals_full_forward(tmp_path, family, case):
    build(family, case, tmp_path, seed=11)
    model = load_model(str(tmp_path))
    ids = prompt(model.args.vocab_size, 20, seed=5)
    full = model.forward(ids, model.new_cache(32), all_logits=True)
    cache = model.new_cache(32)
    prefill = model.forward(ids[:6], cache, all_logits=True)
    steps = [model.forward(ids[i : i + 1], cache) for i in range(6, 20)]
    stepped = np.concatenate([prefill, *steps])
    np.testing.assert_allclose(stepped, full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("family,case", [c for c in ALL_CASES if c[1] != "basic"])
def test_hub_config_spelling_loads_the_same(tmp_path, family, case):
    build(family, case, tmp_path / "v5", seed=2)
    build(family, case, tmp_path / "hub", seed=2)
    rewrite_config(tmp_path / "hub", hub_spelling)
    ids = prompt(64, 9, seed=1)
    a, b = (load_model(str(tmp_path / d)) for d in ("v5", "hub"))
    np.testing.assert_array_equal(
        a.forward(ids, a.new_cache(16), all_logits=True), b.forward(ids, b.new_cache(16), all_logits=True)
    )


@pytest.mark.parametrize("family,case", [("mixtral", "basic"), ("qwen3_moe", "basic"),
                                         ("deepseek_v4", "all_types_hash_first")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint(tmp_path, family, case, dtype):
    """A bf16/f16 checkpoint is computed on its own weights: transformers given the same
    weights widened to float32 is the reference."""
    build(family, case, tmp_path, seed=4, dtype=dtype)
    import transformers

    from hf_models import CLASSES, REFERENCE

    ref = getattr(transformers, CLASSES[family][1]).from_pretrained(tmp_path, dtype=torch.float32, **REFERENCE).eval()
    ours = load_model(str(tmp_path))
    key = "q_b" if family == "deepseek_v4" else "q"
    assert ours.layers[0][key].dtype == (np.uint16 if dtype == torch.bfloat16 else np.float16)
    ids = prompt(ours.args.vocab_size, 10, seed=9)
    with torch.no_grad():
        ref_logits = ref(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(ours.forward(ids, ours.new_cache(16), all_logits=True), ref_logits, atol=1e-4)
    assert our_greedy(ours, ids, 16) == hf_greedy(ref, ids, 16)


def test_a_family_module_in_the_folder_is_found_with_no_edit_elsewhere(tmp_path, monkeypatch):
    """The registry is the families folder: a module dropped into it (here a folder added
    to the package's path) is a supported model_type at once."""
    import json
    import sys

    import colibri.engine.models as models
    from colibri.engine.registry import build_model, supported

    (tmp_path / "tinyfam.py").write_text(
        "from colibri.engine.models.qwen3_moe import Model as _Base, ModelArgs  # noqa: F401\n"
        "class Model(_Base):\n    MODEL_TYPE = 'tinyfam'\n")
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "colibri.engine.models.tinyfam", raising=False)
    assert "tinyfam" in supported() and {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"} <= set(supported())
    build("qwen3_moe", "basic", tmp_path / "m", seed=1)
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    model = build_model(str(tmp_path / "m"), cfg | {"model_type": "tinyfam"})
    assert model.MODEL_TYPE == "tinyfam"
