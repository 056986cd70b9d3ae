"""Kimi K2.5 / K2.6 as the hub ships them: an image-text model (Kimi_K25ForConditionalGeneration)
around a DeepSeek-V3 text model. colibri runs the text model from either spelling of the
weights (transformers' and the hub's), never reads the vision tower, and follows the
image-text config on tying the output head."""

import json

import numpy as np
import pytest
import torch

from colibri.engine import layers
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.container import open_container
from colibri.storage.convert import ExpertPlan, convert

from hf_models import build_k25, k25_hub_names, load_model, read_bytes


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


@pytest.mark.parametrize("case,tie", [("q_lora_groups_interleaved", None), ("one_group_two_dense_tied", False)])
def test_the_text_model_of_a_kimi_k25_checkpoint_matches_transformers(tmp_path, case, tie):
    """Logits of the image-text model on text, 24 greedy tokens, from the hub's spelling of
    the names; the vision tower's bytes never read (the kernel's count of this process's
    reads); the same from what save_pretrained wrote and from a container, which keeps only
    the text model. The second case's text config ties its head, the image-text config does
    not: transformers follows the latter."""
    ref = build_k25(tmp_path / "hf", case, tie)
    visual = sum(p.numel() * 4 for n, p in ref.named_parameters() if "vision_tower" in n or "mm_projector" in n)
    assert visual > 4 << 20
    saved = load_model(str(tmp_path / "hf"))
    k25_hub_names(tmp_path / "hf")
    before = read_bytes()
    ours = load_model(str(tmp_path / "hf"))
    assert read_bytes() - before < visual // 4
    assert ours.NAMES["in_norm"] == "language_model.model.layers.{il}.input_layernorm.weight"
    assert ours.args.tie_word_embeddings is (tie is None)  # the image-text config's own (default: tied)
    ids = np.random.default_rng(2).integers(0, ref.config.text_config.vocab_size, 11)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids)[None]).logits[0].numpy()
        want_tokens = ref.generate(torch.tensor(ids)[None], max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    got = ours.forward(ids, ours.new_cache(48), all_logits=True)
    assert np.abs(got - want).max() <= 1e-4
    assert [e.token_id for e in generate(ours, ids, SamplingParams(max_tokens=24)) if e.kind == "token"] == want_tokens

    assert saved.NAMES["in_norm"] == "language_model.model.blocks.{il}.input_layernorm.weight"
    assert np.array_equal(saved.forward(ids, saved.new_cache(48), all_logits=True), got)

    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(model.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "c",
            ExpertPlan(model.moe_layers, model.n_expert, model.expert_names, model.dense_names()))
    names = list(open_container(str(tmp_path / "c")).dense.where)
    assert names and all(n.startswith("language_model.") for n in names)
    assert ("language_model.lm_head.weight" in names) is (tie is False)
    streamed = load_model(str(tmp_path / "c"), budget="min")
    assert np.array_equal(streamed.forward(ids, streamed.new_cache(48), all_logits=True), got)


def test_a_kimi_k25_config_without_its_text_model_is_refused(tmp_path):
    from colibri.storage.errors import ConfigInvalid

    build_k25(tmp_path, "q_lora_groups_interleaved", None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["text_config"]["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigInvalid, match="hidden_size"):
        load_model(str(tmp_path))
