"""Inkling-2 (engine/models/inkling2.py) beyond the shared family suites: the image-text
checkpoint as the hub ships it runs its text model and never reads the vision tower, and
the hub's stacked experts are shown one expert at a time with gate and up taken apart."""

import numpy as np

from hf_models import CASES, build, image_text, load_model, runs_its_text_model


def test_the_image_text_checkpoint_runs_its_text_model_and_never_reads_the_vision_tower(tmp_path):
    """Inkling2ForConditionalGeneration saved by transformers: the text weights under
    model.llm.* as the text model's, the vision tower under model.visual.*. colibri's logits
    are the image-text model's on text; loading reads far less than the vision tower's bytes;
    a container keeps only the text model and gives the same bits."""
    import transformers

    from colibri.engine.registry import build_model
    from colibri.storage.checkpoint import load_config, open_checkpoint
    from colibri.storage.container import open_container
    from colibri.storage.convert import ExpertPlan, convert

    text = dict(dict(CASES["inkling2"])["sliding_full_blocks"], eos_token_id=None, bos_token_id=None,
                pad_token_id=None)
    vision = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, patch_size=4,
                  posemb_grid_size=4, projection_hidden_dim=64, text_hidden_size=text["hidden_size"])
    ref = image_text("Inkling2ForConditionalGeneration", transformers.Inkling2Config(
        text_config=text, vision_config=vision), tmp_path / "hf")
    ids = np.random.default_rng(2).integers(1, 97, 19)
    got = runs_its_text_model(ref, tmp_path / "hf", "inkling2", "vision_tower", 5 << 20, ids)
    assert got.shape == (19, 97)

    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(model.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "c",
            ExpertPlan(model.moe_layers, model.n_expert, model.expert_names, model.dense_names()))
    names = list(open_container(str(tmp_path / "c")).dense.where)
    assert names and all(n.startswith("model.llm.") for n in names) and not any("visual" in n for n in names)
    placed = load_model(str(tmp_path / "c"), budget="min")
    assert np.array_equal(placed.forward(ids, placed.new_cache(32), all_logits=True), got)


def test_an_expert_is_its_rows_of_the_stacked_tensors(tmp_path):
    """The hub's w13 [E, 2I, D] interleaves each expert's gate and up rows (transformers
    de-interleaves them as it loads): expert e's gate is rows 0, 2, ... of w13[e], its up
    rows 1, 3, ..., its down w2[e]."""
    from colibri.engine.registry import build_model
    from colibri.storage.checkpoint import load_config, open_checkpoint

    ref = build("inkling2", "sliding_full_blocks", tmp_path, seed=3)
    model = build_model(str(tmp_path), load_config(str(tmp_path)))
    src = model.source(open_checkpoint(str(tmp_path)))
    gate_up, down = ref.model.layers[2].mlp.experts.gate_up_proj[3], ref.model.layers[2].mlp.experts.down_proj[3]
    I = model.args.moe_intermediate_size
    gate, up, dn = (src.read(n) for n in model.expert_names(2, 3))
    np.testing.assert_array_equal(gate, gate_up[:I].detach().numpy())
    np.testing.assert_array_equal(up, gate_up[I:].detach().numpy())
    np.testing.assert_array_equal(dn, down.detach().numpy())
    assert src.entry(model.expert_names(2, 3)[0]).shape == (I, model.args.hidden_size)

