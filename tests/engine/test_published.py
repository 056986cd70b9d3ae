"""Checkpoints in their published precisions, FP8 block-scaled, MXFP8 and MXFP4, against
transformers on the same values dequantized to float32: from the checkpoint and from a
container at the minimum expert budget, with the codes computed on as stored."""

import json

import numpy as np
import pytest
import torch

from colibri.engine import layers
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.container import open_container
from colibri.storage.convert import convert, plan_for
from colibri.storage.errors import NonFiniteWeights, QuantizationUnsupported, ScalesMismatch
from colibri.storage.policy import POLICIES, Policy
from colibri.storage.safetensors import SafetensorsFile

from hf_models import build_fp4, build_fp8, build_mxfp4, build_mxfp8, load_model, logits_atol, rewrite_config

N_NEW = 24
MX_SHAPE = dict(hidden_size=64, intermediate_size=32)  # MXFP4 needs rows of whole 32-value blocks

# (family, case, how): FP8 blocks that divide the matrices and blocks that do not, e5m2, one
# scale per matrix, the hybrids' small projections left in bf16 as Qwen's releases do; MXFP4 for gpt-oss,
# MXFP8 (FP8 with e8m0 bytes per 32 values, the experts stacked) for Inkling-2
CASES = [
    ("deepseek_v3", "q_lora_groups_interleaved", dict(block=(16, 16))),
    ("deepseek_v3", "no_q_lora_yarn_bias_odd", dict(block=(7, 10))),
    ("deepseek_v32", "topk4_dense_first", dict(block=(16, 16))),
    ("glm4_moe", "partial_rotary_qk_norm_groups", dict(block=(16, 24), fmt="e5m2")),
    ("minimax_m2", "rotary_dim_half", dict(block=(5, 13))),
    ("minimax_m2", "odd_full_rotary_tied", dict(block=None)),
    ("qwen3_next", "basic_three_to_one", dict(block=(16, 16))),
    ("qwen3_next", "odd_mix_sparse_tied", dict(block=(7, 10), keep=("in_proj_ba", "shared_expert_gate"))),
    ("qwen3_5_moe", "basic_three_to_one", dict(block=(16, 16), keep=("in_proj_a", "in_proj_b", "shared_expert_gate"))),
    ("qwen3_5_moe", "odd_mix_tied", dict(block=(5, 13), fmt="e5m2")),
    ("kimi_linear", "q_lora_groups_mixed", dict(block=(16, 16))),
    ("deepseek_v4", "all_types_hash_first", dict(fp4=True)),
    ("deepseek_v4", "odd_sigmoid_hc3_yarn", dict(fp4=True, hub_names=True)),
    ("gpt_oss", "sinks_sliding_clamped", dict(mxfp4=True)),
    ("gpt_oss", "odd_full_and_sliding_tied", dict(mxfp4=True)),
    ("inkling2", "sliding_full_blocks", dict(mxfp8=True)),
    ("glm5_next", "kda_pools_shared_hc2", dict(block=(16, 16))),
    ("qwen4_exp", "ple_qsa_hc2", dict(block=(16, 16))),
]
IDS = [f"{f}-{c}" for f, c, _ in CASES]


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def build_published(family, case, path, how, seed=7):
    how = dict(how)
    if how.pop("mxfp8", False):  # Inkling-2: e4m3 codes, an e8m0 byte per 32 values of a row
        return build_mxfp8(family, case, path, seed=seed, hidden_size=64, moe_intermediate_size=32, head_dim=16,
                           swa_head_dim=16)
    if how.pop("mxfp4", False):
        return build_mxfp4(family, case, path, seed=seed, **MX_SHAPE)
    if how.pop("fp4", False):  # DeepSeek-V4: FP4 experts (rows of whole 32-code blocks), FP8 the rest
        return build_fp4(family, case, path, seed=seed, hidden_size=64, moe_intermediate_size=32, **how)
    return build_fp8(family, case, path, seed=seed, **how)


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor(ids)[None], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def our_greedy(model, ids, n):
    return [e.token_id for e in generate(model, ids, SamplingParams(max_tokens=n)) if e.kind == "token"]


def to_container(hf, dst, **kw):
    model = build_model(str(hf), load_config(str(hf)))
    return convert(model.source(open_checkpoint(str(hf))), dst,
                   plan_for(model), **kw)


@pytest.mark.parametrize("family,case,how", CASES, ids=IDS)
def test_matches_transformers_at_published_precision(tmp_path, family, case, how):
    ref = build_published(family, case, tmp_path / "hf", how)
    ids = np.random.default_rng(3).integers(0, ref.config.get_text_config().vocab_size, 9)
    want = hf_greedy(ref, ids, N_NEW)
    kind = "mxfp4" if how.get("mxfp4") or how.get("fp4") else "fp8_" + how.get("fmt", "e4m3")

    ours = load_model(tmp_path / "hf")
    assert ours.precision()["experts"] == kind  # computed on the codes, not widened
    with torch.no_grad():
        ref_logits = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(ours.forward(ids, ours.new_cache(64), all_logits=True) - ref_logits).max() <= logits_atol(family)
    assert our_greedy(ours, ids, N_NEW) == want

    manifest = to_container(tmp_path / "hf", tmp_path / "c")
    classes = manifest["tensor_classes"]
    assert classes["experts"]["dtype"] == kind  # kept as published by default
    if kind.startswith("fp8") or how.get("fp4"):  # the dense matrices stay FP8, scales beside them
        assert classes["dense"]["fp8"] == [kind if kind.startswith("fp8") else "fp8_e4m3"]
    c = open_container(str(tmp_path / "c"))
    assert c.precision()["lossy"] is False
    streamed = load_model(tmp_path / "c", budget="min")
    assert our_greedy(streamed, ids, N_NEW) == want


def test_expert_records_hold_the_published_bytes(tmp_path):
    # the container's FP8 record is the checkpoint's codes and scales, byte for byte, 4 KiB aligned
    build_fp8("deepseek_v3", "q_lora_groups_interleaved", tmp_path / "hf", block=(16, 16))
    to_container(tmp_path / "hf", tmp_path / "c")
    c = open_container(str(tmp_path / "c"))
    ckpt = open_checkpoint(str(tmp_path / "hf"))
    rec = c.records[(1, 3)]
    assert rec.offset % 4096 == 0 and c.record_bytes % 4096 == 0
    with open(rec.file, "rb") as f:
        f.seek(rec.offset)
        record = np.frombuffer(f.read(rec.length), np.uint8)
    gate, up, down = c.expert_views(record)
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert np.array_equal(gate.q, ckpt.read(name))
    assert np.array_equal(gate.scales, ckpt.read(name + "_scale_inv"))
    assert (gate.row_block, gate.group_size) == (16, 16)
    header = SafetensorsFile(rec.file).entries
    assert {e.dtype for n, e in header.items() if n.endswith(".qweight")} == {"F8_E4M3"}


@pytest.mark.parametrize("target", ["bf16", "int8"])
def test_other_precisions_only_when_asked_and_labelled_lossy(tmp_path, target):
    ref = build_fp8("deepseek_v3", "q_lora_groups_interleaved", tmp_path / "hf", block=(16, 16))
    to_container(tmp_path / "hf", tmp_path / "c", expert_dtype=target, group_size=8 if target == "int8" else None)
    c = open_container(str(tmp_path / "c"))
    p = c.precision()
    assert p["experts"] == target and p["source"]["experts"] == "fp8_e4m3" and p["lossy"] is True
    if target == "bf16":  # bf16 of FP8 values: close to the reference, not exact
        model = load_model(tmp_path / "c", budget="min")
        ids = np.arange(5)
        with torch.no_grad():
            ref_logits = ref(torch.tensor(ids)[None]).logits[0].numpy()
        assert np.abs(model.forward(ids, model.new_cache(16), all_logits=True) - ref_logits).max() < 0.5


def _edit_tensor(path, name, fn):
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        t = load_file(f)
        if name in t:
            t[name] = fn(t[name])
            save_file(t, f, metadata={"format": "pt"})
            return
    raise KeyError(name)


def test_scales_that_do_not_match_the_blocks_are_named(tmp_path):
    build_fp8("deepseek_v3", "q_lora_groups_interleaved", tmp_path, block=(16, 16))
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _edit_tensor(tmp_path, name, lambda s: s[:, :-1].contiguous())
    with pytest.raises(ScalesMismatch, match="o_proj.weight_scale_inv"):
        load_model(tmp_path)


def test_stacked_mxfp8_experts_with_scales_of_the_wrong_shape_are_named(tmp_path):
    build_mxfp8("inkling2", "sliding_full_blocks", tmp_path, hidden_size=64, moe_intermediate_size=32, head_dim=16,
                swa_head_dim=16)
    name = "model.llm.layers.2.mlp.experts.w13_weight_scale"
    _edit_tensor(tmp_path, name, lambda s: s[:, :, :-1].contiguous())
    with pytest.raises(ScalesMismatch, match=r"w13_weight_scale. is U8 \[5, 64, 1\].*needs \[5, 64, 2\]"):
        load_model(tmp_path)


def test_a_block_size_the_scales_do_not_have_is_named(tmp_path):
    build_fp8("minimax_m2", "rotary_dim_half", tmp_path, block=(16, 16))
    rewrite_config(tmp_path, lambda c: c["quantization_config"].update(weight_block_size=[8, 8]))
    with pytest.raises(ScalesMismatch, match=r"blocks of \[8, 8\]"):
        load_model(tmp_path)


def test_missing_scales_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    build_fp8("minimax_m2", "rotary_dim_half", tmp_path, block=(16, 16))
    name = "model.layers.1.self_attn.q_proj.weight_scale_inv"
    for f in tmp_path.glob("*.safetensors"):
        t = load_file(f)
        t.pop(name, None)
        save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(ScalesMismatch, match="has no scales"):
        load_model(tmp_path)


def test_mxfp4_scales_of_the_wrong_shape_are_named(tmp_path):
    build_mxfp4("gpt_oss", "sinks_sliding_clamped", tmp_path, **MX_SHAPE)
    _edit_tensor(tmp_path, "model.layers.0.mlp.experts.down_proj_scales", lambda s: s[:, :-1].contiguous())
    with pytest.raises(ScalesMismatch, match="down_proj_scales"):
        load_model(tmp_path)


def test_nan_codes_are_refused(tmp_path):
    build_fp8("deepseek_v3", "q_lora_groups_interleaved", tmp_path, block=(16, 16))
    name = "model.layers.0.self_attn.o_proj.weight"

    def poison(q):
        q = q.view(torch.uint8).clone()
        q[0, 0] = 0x7F  # e4m3's NaN
        return q.view(torch.float8_e4m3fn)

    _edit_tensor(tmp_path, name, poison)
    with pytest.raises(NonFiniteWeights, match="o_proj"):
        load_model(tmp_path)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_an_unsupported_quantization_method_is_named(tmp_path, method):
    build_fp8("minimax_m2", "rotary_dim_half", tmp_path, block=(16, 16))
    rewrite_config(tmp_path, lambda c: c.update(quantization_config={"quant_method": method, "bits": 4}))
    with pytest.raises(QuantizationUnsupported, match=repr(method)):
        open_checkpoint(str(tmp_path))


def test_fp8_weights_without_a_quantization_config_are_refused(tmp_path):
    build_fp8("minimax_m2", "rotary_dim_half", tmp_path, block=(16, 16))
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["quantization_config"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(QuantizationUnsupported, match="no fp8 quantization_config"):
        load_model(tmp_path)


def test_scales_out_of_range_are_refused(tmp_path):
    # the kernels fold the scale into an exact power-of-two product; a scale that would
    # overflow it is refused, not computed wrong
    build_fp8("deepseek_v3", "q_lora_groups_interleaved", tmp_path, block=(16, 16))
    _edit_tensor(tmp_path, "model.layers.0.self_attn.o_proj.weight_scale_inv", lambda s: s * 0 + 1e6)
    with pytest.raises(ScalesMismatch, match="below 256"):
        load_model(tmp_path)


@pytest.mark.parametrize("family,case,how", [CASES[1], CASES[5]], ids=[IDS[1], IDS[5]])
def test_bit_identical_at_every_budget_and_alone_or_batched(tmp_path, family, case, how):
    # the codes are the container's own weights: whatever the budget and cache policy, and
    # whatever shares a step, a token's logits are the same bits as all-resident and alone
    build_published(family, case, tmp_path / "hf", how)
    to_container(tmp_path / "hf", tmp_path / "c")
    probe = load_model(tmp_path / "c", budget="min")
    rb, n_moe, n_exp = probe.experts.c.record_bytes, len(probe.moe_layers), probe.n_expert
    ids = np.random.default_rng(5).integers(0, probe.args.vocab_size, 9)
    resident = load_model(tmp_path / "c", budget="all")
    want = resident.forward(ids, resident.new_cache(16), all_logits=True)
    for budget in ("min", rb * n_moe * max(n_exp // 2, 1)):
        for policy in POLICIES:
            model = load_model(tmp_path / "c", budget=budget, policy=Policy(name=policy, prefetch_reads=2))
            np.testing.assert_array_equal(model.forward(ids, model.new_cache(16), all_logits=True), want)
    seqs = [ids, np.arange(3), np.array([7])]
    batched = resident.forward_batch([(s, resident.new_cache(16)) for s in seqs], all_logits=True)
    for s, got in zip(seqs, batched):
        np.testing.assert_array_equal(got, resident.forward(s, resident.new_cache(16), all_logits=True))
