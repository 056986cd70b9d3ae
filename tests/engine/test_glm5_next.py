"""GLM-5.3-Flash (engine/models/glm5_next.py) beyond the shared family suites: the hub's
image-text checkpoint runs its text model and never reads the vision tower; the text model
saved alone loads the same; and without the tail pool a query that sees no complete pool
yet attends as transformers' mask makes it (every cached latent alike)."""

import numpy as np
import torch
from test_families import hf_greedy, our_greedy

from hf_models import build, load_model, runs_its_text_model


def test_the_image_text_checkpoint_runs_its_text_model_and_never_reads_the_vision_tower(tmp_path):
    from test_published import to_container

    from colibri.storage.container import open_container

    vision = dict(depth=2, hidden_size=256, num_heads=4, projection_intermediate_size=512, patch_size=4,
                  image_size=8, spatial_merge_size=1)
    ref = build("glm5_next", "kda_pools_shared_hc2", tmp_path / "hf", seed=2, vision=vision)
    ids = np.random.default_rng(2).integers(1, 101, 19)
    got = runs_its_text_model(ref, tmp_path / "hf", "glm5_next", "visual", 4 << 20, ids)
    to_container(tmp_path / "hf", tmp_path / "c")
    names = list(open_container(str(tmp_path / "c")).dense.where)
    assert names and not any("visual" in n for n in names)
    placed = load_model(str(tmp_path / "c"), budget="min")
    assert np.array_equal(placed.forward(ids, placed.new_cache(32), all_logits=True), got)


def test_the_text_model_saved_alone_loads_the_same(tmp_path):
    """Glm5NextTextModel's own names (model.layers.*, no language_model) with an output head
    beside them, as a text-only export would have them."""
    import json
    import os

    from safetensors.numpy import load_file, save_file

    build("glm5_next", "one_stream_groups_no_bound", tmp_path / "a", seed=4)
    (tmp_path / "b").mkdir()
    cfg = json.load(open(tmp_path / "a" / "config.json"))
    json.dump(cfg["text_config"] | {"tie_word_embeddings": False}, open(tmp_path / "b" / "config.json", "w"))
    tensors = {n.replace("model.language_model.", "model."): t for f in os.listdir(tmp_path / "a")
               if f.endswith(".safetensors") for n, t in load_file(str(tmp_path / "a" / f)).items() if "visual" not in n}
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"), metadata={"format": "pt"})
    ids = np.random.default_rng(3).integers(1, 64, 13)
    a, b = load_model(str(tmp_path / "a")), load_model(str(tmp_path / "b"))
    assert b.MODEL_TYPE == "glm5_next"
    np.testing.assert_array_equal(a.forward(ids, a.new_cache(16), all_logits=True),
                                  b.forward(ids, b.new_cache(16), all_logits=True))


def test_without_the_tail_a_query_before_its_first_pool_attends_as_transformers(tmp_path):
    ref = build("glm5_next", "one_stream_groups_no_bound", tmp_path, seed=6, index_kpool_always_select_tail=False)
    ours = load_model(str(tmp_path))
    assert not ours.args.index_kpool_always_select_tail
    ids = np.random.default_rng(6).integers(1, 64, 14)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(ours.forward(ids, ours.new_cache(48), all_logits=True) - want).max() <= 1e-4
    assert our_greedy(ours, ids, 16) == hf_greedy(ref, ids, 16)
