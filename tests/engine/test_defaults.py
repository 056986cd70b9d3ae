"""A config.json that leaves a field out means what transformers reads into it: for every
family, a config of only the fields colibri requires is read by colibri and by the
family's transformers config class, and every field both know, and the RoPE settings,
must agree. (A GLM-4.5 config without `partial_rotary_factor` rotated the whole head in
colibri and half of it in transformers: the tokens differed from the first one.)"""

import dataclasses

import pytest
from transformers import CONFIG_MAPPING

from colibri.engine.registry import build_model, family, supported
from colibri.engine.rope import rope_parameters

# small values for the fields colibri requires; 16 heads: a multiple of every family's
# default number of key/value heads
REQUIRED = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 16, "vocab_size": 128}

# fields a family keeps apart from transformers on purpose, and why
APART = {
    ("deepseek_v3", "num_key_value_heads"): "MLA has no key/value heads (transformers' 128 is never read)",
    ("glm_moe_dsa", "num_key_value_heads"): "MLA has no key/value heads (transformers' 64 is never read)",
    ("kimi_linear", "num_key_value_heads"): "MLA has no key/value heads (transformers' 32 is never read)",
    ("kimi_k25", "num_key_value_heads"): "MLA has no key/value heads (transformers' 128 is never read)",
    ("deepseek_v32", "num_key_value_heads"): "MLA has no key/value heads (transformers' 128 is never read)",
    ("kimi_linear", "rope"): "no rotary anywhere (NoPE): colibri's rotary table is never read, transformers has none",
    **{(mt, "rope"): "no rotary anywhere (a relative position bias): colibri's rotary table is never read"
       for mt in ("inkling2", "inkling2_text")},
    **{(mt, "rope"): "no rotary anywhere (NoPE MLA): colibri's rotary table is never read"
       for mt in ("glm5_next", "glm5_next_text")},
    **{(mt, "layer_types"): "colibri's hybrid code names an indexed_attention layer full_attention (Qwen3.5's "
       "attention, with QSA)" for mt in ("qwen4_exp", "qwen4_exp_text")},
    **{(mt, "unpadded_vocab_size"): "left out, transformers' 200058 is the published vocabulary's; colibri takes "
       "vocab_size (a head of more rows than the file's table cannot load)" for mt in ("inkling2", "inkling2_text")},
    ("qwen2_moe", "sliding_window"): "read only with use_sliding_window (off), which transformers nulls it for",
    ("qwen3_moe", "sliding_window"): "read only with use_sliding_window (off), which transformers nulls it for",
}


# what a family's transformers config needs beside REQUIRED to pass its own validation
VALID = {**{mt: {"num_key_value_heads": 16} for mt in ("glm5_next", "glm5_next_text")},  # (MLA: as many as the heads)
         **{mt: {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 256, "indexer_budget": 64,
                 "indexer_compress_ratio": 4} for mt in ("qwen4_exp", "qwen4_exp_text")}}  # (its QSA, unset by default)


def families() -> list[str]:
    return [mt for mt in supported() if mt in CONFIG_MAPPING]


@pytest.mark.parametrize("model_type", families())
def test_a_config_of_the_required_fields_means_what_transformers_reads(model_type):
    fam = family(model_type)
    required = [f.name for f in dataclasses.fields(fam.ModelArgs)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    config = {"model_type": model_type, **{k: REQUIRED[k] for k in required}, **VALID.get(model_type, {})}
    cls = CONFIG_MAPPING[model_type]
    wrapper = None
    if hasattr(fam, "text_config"):  # an image-text model: colibri runs its text model, configured by its class
        wrapper = cls()
        cls = type(wrapper.get_text_config())
    theirs = cls(**{k: v for k, v in config.items() if k != "model_type"})
    ours = build_model("minimal", config)
    differ = []
    for f in dataclasses.fields(fam.ModelArgs):
        names = (f.name, *getattr(fam, "ALIASES", {}).get(f.name, ()))
        name = next((n for n in names if hasattr(theirs, n)), None)
        if name is None or (model_type, f.name) in APART:
            continue
        mine, want = getattr(ours.args, f.name), getattr(theirs, name)
        if wrapper is not None and f.name == "tie_word_embeddings":
            want = wrapper.tie_word_embeddings  # the image-text config's own: transformers ties by it
        if mine != want and not (mine is not None and want is None and f.name == "head_dim"):  # (derived alike)
            differ.append(f"{f.name}: colibri {mine!r}, transformers {want!r}")
    if (model_type, "rope") in APART:
        assert not ours.ROTARY
    else:
        rope = rope_parameters(config, fam.Model.ROPE_DEFAULTS)
        want_rope = dict(getattr(theirs, "rope_parameters", None) or {})
        if hasattr(fam, "rope_settings"):  # DeepSeek-V4: a `main` and a `compress` RoPE
            rope = dict(zip(("main", "compress"), fam.rope_settings(config, ours.args)))
        for key in sorted(set(rope) | set(want_rope)):
            if rope.get(key) != want_rope.get(key):
                differ.append(f"rope {key}: colibri {rope.get(key)!r}, transformers {want_rope.get(key)!r}")
    assert not differ, differ


def test_glm4_moe_without_partial_rotary_factor_rotates_half_the_head():
    config = {"model_type": "glm4_moe", **REQUIRED, "num_key_value_heads": 4}
    model = build_model("minimal", config)
    assert 2 * len(model.rope.inv_freq) == model.head_dim // 2, (model.rope.inv_freq.shape, model.head_dim)


@pytest.mark.parametrize("model_type,extra", [
    ("gpt_oss", {"rope_theta": 20000.0}),  # a theta alone keeps the family's yarn
    ("glm4_moe", {"rope_theta": 20000.0}),
    ("glm4_moe", {"rope_theta": 20000.0, "partial_rotary_factor": 0.75}),  # the hub's top-level spelling wins
    ("glm4_moe", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("mixtral", {"rope_theta": 5e5}),
])
def test_a_hub_configs_rope_means_what_transformers_reads(model_type, extra):
    fam = family(model_type)
    config = {"model_type": model_type, **REQUIRED, **extra}
    cls = CONFIG_MAPPING[model_type]
    if hasattr(fam, "text_config"):  # an image-text model: colibri runs its text model, configured by its class
        cls = type(cls().get_text_config())
    theirs = cls(**{k: v for k, v in config.items() if k != "model_type"})
    want = dict(theirs.rope_parameters)
    want.pop("type", None)
    got = rope_parameters(config, fam.Model.ROPE_DEFAULTS)
    got.pop("type", None)
    assert got == want, (got, want)
