"""GGUF files (storage/gguf.py): tiny ones written by the tests from tiny transformers
checkpoints (tests/gguf_models.py, the `gguf` package's writer in llama.cpp's layout) run
with transformers' logits and greedy tokens, alone or as a split set; each way a file can be
wrong gives its named error before a weight is read."""

import os
import struct

import numpy as np
import pytest
import torch
from gguf_models import write_gguf

from colibri.storage.checkpoint import open_checkpoint
from colibri.storage.errors import (
    ArchitectureUnsupported,
    GGUFInvalid,
    TensorShapeMismatch,
    UnsupportedDtype,
)
from colibri.storage.formats import ggml
from colibri.storage.quant import dequantize

from hf_models import build, load_model

SHAPE = dict(seed=3, norm_topk_prob=True, hidden_size=64)  # (rows of 64: a multiple of Q8_0's block of 32)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    ref = build("qwen3_moe", "basic", tmp / "hf", **SHAPE)
    return tmp, ref, write_gguf(tmp / "hf", tmp / "m.gguf")


def greedy(model, ids, n):
    from colibri.engine.generate import SamplingParams, generate

    return [e.token_id for e in generate(model, ids, SamplingParams(max_tokens=n)) if e.kind == "token"]


def logits_of(model, ids):
    return model.forward(ids, model.new_cache(len(ids) + 32), all_logits=True)


def matches_transformers(model, ref, ids, atol=1e-4):
    # prompt logits within atol, then 32 greedy tokens the same
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(logits_of(model, ids) - want).max() <= atol
    with torch.no_grad():
        out = ref.generate(torch.tensor(ids)[None], max_new_tokens=32, min_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert greedy(model, ids, 32) == out[0, len(ids):].tolist()


def test_a_gguf_file_runs_with_transformers_tokens(qwen):
    tmp, ref, path = qwen
    model = load_model(path)
    assert model.MODEL_TYPE == "qwen3_moe" and model.args.norm_topk_prob and model.n_expert == 8
    ids = np.random.default_rng(5).integers(0, 101, 11)
    matches_transformers(model, ref, ids)


def test_qwen2moe_with_its_shared_expert(tmp_path):
    """qwen2moe: the shared expert and its sigmoid gate, q/k/v biases, the top-k weights not
    renormalised (llama.cpp's graph)."""
    ref = build("qwen2_moe", "basic", tmp_path / "hf", seed=8, hidden_size=64)
    path = write_gguf(tmp_path / "hf", tmp_path / "q2.gguf")
    model = load_model(path)
    assert model.MODEL_TYPE == "qwen2_moe" and not model.args.norm_topk_prob and model.args.qkv_bias
    ids = np.random.default_rng(2).integers(0, 101, 9)
    matches_transformers(model, ref, ids)


def test_olmoe_in_k_quants_streamed(tmp_path):
    """olmoe (llama.cpp's architecture of that name): q and k normed over the whole projection,
    the top-k weights not renormalised; a Q4_K_M-like file whose experts stream at one slot a
    layer: transformers' logits and tokens on the weights the package dequantises."""
    from gguf_models import dequantized_reference

    build("olmoe", "basic", tmp_path / "hf", seed=6, hidden_size=256, intermediate_size=256)
    path = write_gguf(tmp_path / "hf", tmp_path / "olmoe-Q4_K_M.gguf", quant=k_quants)
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == "olmoe" and not model.args.norm_topk_prob
    assert model.experts.c.expert_dtype == "iq4_xs+q2_k+q3_k+q4_k+q6_k"
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    matches_transformers(model, ref, np.random.default_rng(6).integers(0, 101, 11))


def test_mixtral_as_llama_with_its_q_k_rows_permuted_back(tmp_path):
    """llama.cpp's llama architecture with experts (Mixtral): its converter permutes the rows of
    q and k for its rotary. An F32 file: the original checkpoint's logits and tokens; in
    K-quants' blocks, whole rows of blocks put back (the rows the package dequantises, in the
    checkpoint's order), transformers' tokens on those weights, the experts streamed at one
    slot a layer."""
    import gguf
    from gguf_models import dequantized_reference

    ref = build("mixtral", "basic", tmp_path / "hf", seed=9, hidden_size=256, intermediate_size=256)
    ids = np.random.default_rng(9).integers(0, 101, 11)
    matches_transformers(load_model(write_gguf(tmp_path / "hf", tmp_path / "mixtral.gguf"), budget="min"), ref, ids)
    path = write_gguf(tmp_path / "hf", tmp_path / "mixtral-Q4_K_M.gguf", quant=k_quants)
    ck = open_checkpoint(path)
    t = ck.tensors["blk.0.attn_k.weight"]
    assert t.dtype == "Q4_K"
    stored = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_K)  # rows in llama.cpp's order
    kv, hd = ref.config.num_key_value_heads, 256 // ref.config.num_attention_heads
    got = dequantize(ck.read_weight("model.layers.0.self_attn.k_proj.weight"))
    np.testing.assert_array_equal(got.reshape(kv, 2, hd // 2, -1), stored.reshape(kv, hd // 2, 2, -1).swapaxes(1, 2))
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == "mixtral"
    matches_transformers(model, dequantized_reference(path, tmp_path / "hf", tmp_path / "deq"), ids)


def test_glm4moe_with_its_dense_layer_shared_expert_and_biased_router(tmp_path):
    """glm4moe (GLM-4.5-4.7): a leading dense layer, a shared expert, the sigmoid router with
    its score correction bias and scaling, partial rotary, q/k norms and q/k/v biases, in
    K-quants, the experts streamed at one slot a layer: transformers' logits and tokens on
    the weights the package dequantises."""
    from gguf_models import dequantized_reference

    build("glm4_moe", "partial_rotary_qk_norm_groups", tmp_path / "hf", seed=4, n_group=1, topk_group=1,
          norm_topk_prob=True, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64)
    path = write_gguf(tmp_path / "hf", tmp_path / "glm-Q4_K_M.gguf", quant=k_quants)
    model = load_model(path, budget="min")
    a = model.args
    assert (model.MODEL_TYPE, a.first_k_dense_replace, a.n_shared_experts, a.routed_scaling_factor,
            a.use_qk_norm, a.attention_bias) == ("glm4_moe", 1, 1, 2.5, True, True)
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    matches_transformers(model, ref, np.random.default_rng(4).integers(0, 101, 11))


def test_minimax_m2_with_its_biased_sigmoid_router_and_partial_rotary(tmp_path):
    """minimax-m2: q and k normed over the whole projection, the sigmoid router with its score
    correction bias, a rotary of half the head, in K-quants, the experts streamed at one slot a
    layer: transformers' logits and tokens on the weights the package dequantises."""
    from gguf_models import dequantized_reference

    build("minimax_m2", "rotary_dim_half", tmp_path / "hf", seed=5, hidden_size=256, intermediate_size=256,
          head_dim=64, rotary_dim=32)
    path = write_gguf(tmp_path / "hf", tmp_path / "minimax-Q4_K_M.gguf", quant=k_quants)
    model = load_model(path, budget="min")
    assert (model.MODEL_TYPE, model.args.rotary_dim) == ("minimax_m2", 32)
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    matches_transformers(model, ref, np.random.default_rng(5).integers(0, 101, 11))


def test_gpt_oss_with_mxfp4_experts_sinks_and_yarn(tmp_path):
    """gpt-oss (llama.cpp's gpt-oss): its experts in GGUF's MXFP4 with their biases, gate and
    up apart, attention sinks, sliding and full layers in turn, the router's bias, YaRN
    rotary; the experts streamed at one slot a layer: transformers' logits and tokens on the
    weights the package dequantises."""
    from gguf_models import dequantized_reference

    build("gpt_oss", "sinks_sliding_clamped", tmp_path / "hf", seed=7, hidden_size=64, intermediate_size=64,
          swiglu_limit=7.0)  # (llama.cpp's SwiGLU clamp is its constant: the published checkpoints')
    path = write_gguf(tmp_path / "hf", tmp_path / "gpt-oss-mxfp4.gguf",
                      quant=lambda name, a: "MXFP4" if name.endswith("_exps.weight") else None)
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == "gpt_oss" and model.experts.c.expert_dtype == "f32+gguf_mxfp4"
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    ids = np.random.default_rng(7).integers(0, 101, 11)
    matches_transformers(model, ref, ids)
    # converted, the blocks and biases kept: the same logits at one slot a layer
    from colibri.storage.checkpoint import open_checkpoint
    from colibri.storage.convert import ExpertPlan, convert

    src = model.source(open_checkpoint(path))
    convert(src, str(tmp_path / "c"), ExpertPlan(model.moe_layers, model.n_expert, model.expert_names,
                                                 model.dense_names()))
    box = load_model(str(tmp_path / "c"), budget="min")
    assert box.experts.c.expert_dtype == "f32+gguf_mxfp4" and box.experts.c.layouts[0][-1].part == "down_bias"
    np.testing.assert_array_equal(logits_of(box, ids), logits_of(model, ids))


def test_f16_tensors_are_computed_as_stored(qwen, tmp_path):
    """An F16 GGUF: its matrices stay f16 and are widened exactly in the kernels: transformers
    given the same f16-rounded weights gives the same logits."""
    tmp, ref, _ = qwen
    path = write_gguf(tmp / "hf", tmp_path / "h.gguf", dtype="F16")
    ck = open_checkpoint(path)
    assert ck.entry("model.layers.0.self_attn.q_proj.weight").dtype == "F16"
    assert ck.read("model.layers.1.mlp.experts.5.down_proj.weight").dtype == np.float16
    model = load_model(path)
    rounded = build("qwen3_moe", "basic", tmp_path / "hf16", **SHAPE)
    with torch.no_grad():
        for p in rounded.parameters():
            if p.ndim >= 2:  # the matrices (the experts stacked); norms stay F32 in the file
                p.copy_(p.half().float())
    ids = np.arange(3, 14)
    with torch.no_grad():
        want = rounded(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(logits_of(model, ids) - want).max() <= 1e-4


def test_a_gguf_experts_failed_read_is_retried_then_named(qwen):
    """A GGUF file's expert reads fail as a container's do: once, read again (the same
    logits); always, an ExpertReadError naming the file and the offset, never wrong numbers."""
    from colibri.storage.errors import ExpertReadError

    _, _, path = qwen
    ids = np.arange(5, 18)
    want = logits_of(load_model(path), ids)
    once = load_model(path, budget="min", faults=",".join(f"eio@0:{e}x1" for e in range(8)))
    np.testing.assert_array_equal(logits_of(once, ids), want)
    assert once.experts.stats.read_errors >= 1
    broken = load_model(path, budget="min", faults=",".join(f"short@1:{e}" for e in range(8)))
    with pytest.raises(ExpertReadError, match=r"cannot read layer 1 expert \d from .*m\.gguf at offset \d+: .*short read"):
        logits_of(broken, ids)


def test_a_split_set_reads_as_one_file(qwen, tmp_path):
    tmp, _, whole = qwen
    first = write_gguf(tmp / "hf", tmp_path / "s.gguf", split_max_tensors=7)
    parts = sorted(p for p in os.listdir(tmp_path) if p.startswith("s-"))
    assert len(parts) >= 3 and first.endswith(f"-00001-of-{len(parts):05d}.gguf")
    ids = np.arange(20, 31)
    np.testing.assert_array_equal(logits_of(load_model(first), ids), logits_of(load_model(whole), ids))
    os.remove(tmp_path / parts[-1])
    with pytest.raises(GGUFInvalid, match="is missing"):
        open_checkpoint(first)


def test_a_truncated_file_is_refused_naming_the_tensor(qwen, tmp_path):
    _, _, path = qwen
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFInvalid, match="truncated"):
        open_checkpoint(str(cut))
    (tmp_path / "head.gguf").write_bytes(data[:40])
    with pytest.raises(GGUFInvalid):
        open_checkpoint(str(tmp_path / "head.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFInvalid, match="not a GGUF file"):
        open_checkpoint(str(tmp_path / "junk.gguf"))


def test_an_unknown_tensor_type_is_refused(qwen, tmp_path):
    """A tensor type id no GGML type has (patched into the first tensor's header entry)."""
    _, _, path = qwen
    from gguf import GGUFReader

    r = GGUFReader(path)
    t = r.tensors[0]
    type_at = int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:4])  # name len, name, n_dims, dims
    data = bytearray(open(path, "rb").read())
    assert struct.unpack_from("<I", data, type_at)[0] == int(t.tensor_type)
    struct.pack_into("<I", data, type_at, 250)
    bad = tmp_path / "t.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFInvalid, match="unknown tensor type 250"):
        open_checkpoint(str(bad))


def k_quants(name, a):
    # llama.cpp's Q4_K_M, roughly (Q4_K, Q6_K for the down and output matrices, Q8_0 for V),
    # with layer 1's experts in the smaller K-quants and IQ4_XS; rows not of whole 256-weight
    # blocks in Q8_0, as llama.cpp's quantizer falls back
    layer1 = name.startswith("blk.1.")
    if a.shape[-1] % 256:
        return "Q8_0"
    if "_exps" in name:
        return {"gate": "Q2_K", "up": "Q3_K", "down": "IQ4_XS"}[name.split("_")[1]] if layer1 else \
            "Q6_K" if "down" in name else "Q4_K"
    return "Q8_0" if "attn_v" in name else "Q6_K" if name.startswith("output") else "Q5_K" if layer1 else "Q4_K"


def blocks_of_32(name, a):
    # the 32-weight blocks, the `gguf` package's quantisers where it has them
    kinds = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"]
    return kinds[sum(map(ord, name)) % len(kinds)]


@pytest.mark.parametrize("mix,hidden,parts", [(k_quants, 256, 3), (blocks_of_32, 64, 1)])
def test_a_quantized_gguf_computes_its_dequantised_weights(tmp_path, mix, hidden, parts):
    """Every GGUF block type colibri reads, in the matrices (experts, attention, embeddings,
    output) of a file of `parts` parts: the logits and 32 greedy tokens of transformers run on
    the weights the `gguf` package dequantises from the file, its experts streamed from the
    file under every budget from one slot per layer to all of them; then converted to a
    container that keeps the blocks, streamed at one slot per layer."""
    import subprocess
    import sys

    from gguf_models import dequantized_reference

    build("qwen3_moe", "basic", tmp_path / "hf", **(SHAPE | dict(hidden_size=hidden, intermediate_size=hidden,
                                                                  moe_intermediate_size=hidden)))
    path = write_gguf(tmp_path / "hf", tmp_path / "m-Q4_K_M.gguf", quant=mix, split_max_tensors=0 if parts == 1 else 12)
    if parts > 1:
        assert path.endswith(f"-00001-of-{parts:05d}.gguf")
    ck = open_checkpoint(path)
    model = load_model(path)
    kinds = {t.dtype for t in ck.tensors.values()}
    assert kinds - {"F32"} == ({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS"} if mix is k_quants
                               else {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4"})
    assert model.precision()["lossy"] is False
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    ids = np.random.default_rng(hidden).integers(0, 101, 13)
    matches_transformers(model, ref, ids)
    c = model.experts.c  # the experts are the file's, each its three slices' pages
    assert model.precision()["experts"] == c.expert_dtype == "+".join(sorted(
        {ggml.BY_TYPE_NAME[t.dtype] for t in ck.tensors.values() if "_exps" in t.name}))
    if mix is k_quants:
        assert c.expert_dtype == "iq4_xs+q2_k+q3_k+q4_k+q6_k"
    assert {x.file for r in c.records.values() for x in r.extents} <= {p.path for p in ck.files.values()}
    assert any(at % 4096 for parts in c.parts.values() for at, _, _ in parts)  # views inside their pages
    assert any(x.need < x.length for r in c.records.values() for x in r.extents)  # a page past its file's end
    for budget in ("min", c.record_bytes * len(model.moe_layers) * 3):
        streamed = load_model(path, budget=budget)
        assert streamed.experts.describe()["o_direct"] and streamed.experts.describe()["checksums"] is False
        np.testing.assert_array_equal(logits_of(streamed, ids), logits_of(model, ids))
        assert greedy(streamed, ids, 32) == greedy(model, ids, 32)
        st = streamed.experts.stats
        assert st.evictions > 0 and st.bytes_read >= st.misses * min(r.length for r in c.records.values())
    # a step of a prompt beside a decode row: each row by its own sequence's path (a prompt's
    # rows through the tiles, a decode row through the row dots), the same bits as alone
    a, b = ids[:6], ids[6:]
    alone_a = model.forward(a, model.new_cache(32), all_logits=True)
    cache_b = model.new_cache(32)
    model.forward(b[:-1], cache_b)
    alone_b = model.forward(b[-1:], cache_b, all_logits=True)
    cache_b2 = model.new_cache(32)
    model.forward(b[:-1], cache_b2)
    got_a, got_b = model.forward_batch([(a, model.new_cache(32)), (b[-1:], cache_b2)], all_logits=True)
    np.testing.assert_array_equal(got_a, alone_a)
    np.testing.assert_array_equal(got_b, alone_b)
    # `colictl convert`: a container keeping every block as stored (a layout a layer: layer
    # 1's experts are other types), checksummed; at one slot a layer the same logits and tokens
    from colibri.storage.container import open_container
    from colibri.storage.convert import ConvertError

    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", path, str(tmp_path / "c")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    box = open_container(str(tmp_path / "c"))
    assert box.checksums and box.expert_dtype == c.expert_dtype and box.precision()["lossy"] is False
    assert box.dense.ggml and set(box.dense.ggml.values()) == {t.dtype for t in ck.tensors.values()
                                                              if "_exps" not in t.name} - {"F32"}
    assert {il: tuple(p.ggml for p in x) for il, x in box.layouts.items()} == {
        il: tuple(ck.entry(n).dtype for n in model.expert_names(il, 0)) for il in model.moe_layers}
    slim = load_model(str(tmp_path / "c"), budget="min")
    assert slim.experts.describe()["checksums"] is True and slim.precision()["experts"] == c.expert_dtype
    np.testing.assert_array_equal(logits_of(slim, ids), logits_of(model, ids))
    assert greedy(slim, ids, 32) == greedy(model, ids, 32)
    assert slim.experts.stats.evictions > 0
    with pytest.raises(ConvertError, match="kept as stored"):
        from colibri.storage.convert import ExpertPlan, convert

        convert(model.source(ck), str(tmp_path / "c2"), ExpertPlan(model.moe_layers, model.n_expert, model.expert_names),
                expert_dtype="int4")
    assert not os.path.exists(tmp_path / "c2")


def test_an_unknown_block_type_is_named_and_a_wrong_shape_refused(qwen, tmp_path):
    import gguf

    tmp, _, _ = qwen
    path = write_gguf(tmp / "hf", tmp_path / "q.gguf")
    r = gguf.GGUFReader(path)
    # the same file with one expert stack in Q8_1 (llama.cpp's activations' type): named, refused
    w = gguf.GGUFWriter(str(tmp_path / "q8.gguf"), "qwen3moe")
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            _copy_field(w, k, f)
    for t in r.tensors:
        a = np.array(t.data).reshape(tuple(reversed(t.shape.tolist())))
        if t.name == "blk.0.ffn_up_exps.weight":
            q8_1 = np.zeros((*a.shape[:-1], a.shape[-1] // 32 * 40), np.uint8)
            w.add_tensor(t.name, q8_1, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(t.name, a)
    _finish(w)
    with pytest.raises(UnsupportedDtype, match="blk.0.ffn_up_exps.weight.*Q8_1"):
        load_model(str(tmp_path / "q8.gguf"))
    # metadata that says other shapes than the tensors have
    w = gguf.GGUFWriter(str(tmp_path / "shape.gguf"), "qwen3moe")
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            if k == "qwen3moe.expert_feed_forward_length":
                w.add_expert_feed_forward_length(32)
            else:
                _copy_field(w, k, f)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    _finish(w)
    with pytest.raises(TensorShapeMismatch, match="ffn_.*_exps"):
        load_model(str(tmp_path / "shape.gguf"))


def test_an_architecture_colibri_does_not_read_is_named(tmp_path):
    import gguf

    for arch, want in (("gemma3", "'gemma3' is not one colibri reads from GGUF \\(it reads deepseek2, .*, qwen3moe"),
                       ("llama", "l.gguf: llama without experts: a dense model"),
                       ("deepseek2", "l.gguf: deepseek2 with expert gating None \\(DeepSeek-V2's softmax\\)"),
                       ("deepseek4", "l.gguf: deepseek4 with swiglu_clamp_exp \\[10.0, 7.0\\]: colibri reads one for"),
                       ("deepseek4", "l.gguf: deepseek4 with expert gating 3: colibri reads sqrtsoftplus")):
        w = gguf.GGUFWriter(str(tmp_path / "l.gguf"), arch)
        w.add_block_count(1)
        if arch == "deepseek4":  # a clamp a layer, unlike each other; an unknown gating function
            w.add_uint32("deepseek4.expert_gating_func", 4 if "clamp" in want else 3)
            w.add_swiglu_clamp_exp([10.0, 7.0])
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        _finish(w)
        with pytest.raises(ArchitectureUnsupported, match=want):
            open_checkpoint(str(tmp_path / "l.gguf"))


def _copy_field(w, key, field):
    import gguf

    vtype = field.types[0]
    value = field.contents()
    if vtype == gguf.GGUFValueType.ARRAY:
        w.add_array(key, value)
    else:
        w.add_key_value(key, value, vtype)


def _finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "storage", "demo_model")
CORPUS = ["Once upon a time, in a land far away, there lived 1234 cats.", "It's 3:15 -- don't panic!\n\n  Indented\tline",
          "Ünïcödé: naïve café, 日本語, emoji 🙂 and <|im_start|>user\nhi<|im_end|>", "   ", "", "a" * 300,
          "You will be hungry again in one hour.  Q: What's the difference?"]


def test_the_tokenizer_is_read_from_the_file(qwen, tmp_path):
    """The demo model's byte-level BPE written into a GGUF file as llama.cpp's converter
    writes one: the same ids and text as its tokenizer.json on a corpus (special tokens,
    whitespace runs, numbers, non-Latin text), the same chat rendering and EOS."""
    from colibri.engine.tokenizer import Tokenizer, eos_ids
    from colibri.storage.checkpoint import load_config
    from colibri.storage.gguf import tokenizer_spec

    tmp, _, _ = qwen
    path = write_gguf(tmp / "hf", tmp_path / "t.gguf", tokenizer=DEMO)
    ours, want = Tokenizer(path, tokenizer_spec(path)), Tokenizer(DEMO)
    for text in CORPUS:
        assert ours.encode(text) == want.encode(text), text
        assert ours.decode(ours.encode(text)) == want.decode(want.encode(text))
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    assert ours.apply_chat_template(msgs) == want.apply_chat_template(msgs)
    assert eos_ids(path, load_config(path), ours) == [want.token_id(want.eos_token)]  # (a GGUF has no generation_config)
    assert tokenizer_spec(str(DEMO)) is None
    bare = write_gguf(tmp / "hf", tmp_path / "bare.gguf")
    from colibri.storage.errors import TokenizerUnsupported

    with pytest.raises(TokenizerUnsupported, match="no tokenizer"):
        tokenizer_spec(bare)
    odd = write_gguf(tmp / "hf", tmp_path / "odd.gguf", tokenizer=DEMO, pre="deepseek-coder")
    with pytest.raises(TokenizerUnsupported, match="deepseek-coder"):
        tokenizer_spec(odd)


def test_colictl_runs_a_gguf_file_alone_and_converts_it(tmp_path):
    """`colictl run --model FILE.gguf`: no other file, the tokens transformers gives; colibrid
    serves it streaming its experts from the file; `colictl doctor` checks it; `colictl convert FILE.gguf DIR`: a container (config and tokenizer from
    the file) whose experts stream at the minimum budget with the same logits and tokens."""
    import json
    import subprocess
    import sys

    ref = build("qwen3_moe", "basic", tmp_path / "hf", **(SHAPE | {"vocab_size": 2048}))
    (tmp_path / "alone").mkdir()
    path = write_gguf(tmp_path / "hf", tmp_path / "alone" / "m.gguf", tokenizer=DEMO)
    assert os.listdir(tmp_path / "alone") == ["m.gguf"]

    def colictl(*args):
        r = subprocess.run([sys.executable, "-m", "colibri.ctl", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = json.loads(colictl("run", "--model", path, "--max-tokens", "12", "--json", "Once upon a time"))
    ids = out["prompt_token_ids"]
    with torch.no_grad():
        g = ref.generate(torch.tensor(ids)[None], max_new_tokens=12, do_sample=False, pad_token_id=0,
                         eos_token_id=load_eos(path))
    assert out["token_ids"] == g[0, len(ids):].tolist()
    from daemons import colibrid

    # the daemon streams the file's experts at one slot per layer: the same tokens
    with colibrid(tmp_path, path, "expert_cache: min\n") as sock:
        served = json.loads(colictl("--socket", sock, "generate", "--json", "--max-tokens", "12", "Once upon a time"))
        status = colictl("--socket", sock, "status")
    assert served["token_ids"] == out["token_ids"] and served["stats"]["experts"]["bytes_read"] > 0
    assert "1 slot per layer" in status and "no checksums" in status, status
    doctor = subprocess.run([sys.executable, "-m", "colibri.ctl", "doctor", "--model", path], capture_output=True,
                            text=True, timeout=300).stdout  # (its box checks may fail on a test box: not asserted)
    assert "1 GGUF file(s)" in doctor and "the file's tokenizer builds" in doctor, doctor
    colictl("convert", path, str(tmp_path / "c"))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "c"))
    probe = np.arange(40, 60)
    np.testing.assert_array_equal(logits_of(load_model(str(tmp_path / "c"), budget="min"), probe),
                                  logits_of(load_model(path), probe))
    again = json.loads(colictl("run", "--model", str(tmp_path / "c"), "--expert-cache", "min", "--max-tokens", "12",
                               "--json", "Once upon a time"))
    assert again["prompt_token_ids"] == ids and again["token_ids"] == out["token_ids"]


def load_eos(path):
    from colibri.storage.checkpoint import load_config

    return load_config(path).get("eos_token_id")


@pytest.mark.parametrize("case", ["q_lora_groups_interleaved", "one_group_two_dense_tied"])
def test_deepseek2_with_mla_split_kv_b_groups_and_yarn(tmp_path, case):
    """deepseek2 (DeepSeek-V3/R1, Kimi K2): llama.cpp's converter splits MLA's kv_b into k_b
    (transposed) and v_b, writes one KV head, the expert groups, leading dense layers and
    shared experts; YaRN with its log multiplier. Its experts in K-quants streamed at one slot
    a layer, the rest as blocks and F32: transformers' logits and tokens on the weights the
    package dequantises, and a converted container the same."""
    from gguf_models import dequantized_reference

    from colibri.storage.convert import ExpertPlan, convert

    yarn = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.7,
                                "mscale_all_dim": 0.7, "original_max_position_embeddings": 16}} \
        if case.startswith("q_lora") else {}
    build("deepseek_v3", case, tmp_path / "hf", seed=5, hidden_size=64, max_position_embeddings=64,
          qk_nope_head_dim=32, kv_lora_rank=32, **yarn)
    path = write_gguf(tmp_path / "hf", tmp_path / "ds.gguf",
                      quant=lambda name, a: "Q8_0" if a.shape[-1] % 32 == 0 else None)
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == "deepseek_v3" and model.args.rope_interleave
    ck = open_checkpoint(path)
    assert "blk.1.attn_kv_b.weight" not in ck.tensors and ck.tensors["blk.1.attn_k_b.weight"].dtype == "Q8_0"
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    ids = np.random.default_rng(5).integers(1, 60, 24)  # (past the YaRN original context of 16; no 0: the
    # reference's generate takes 0 for padding)
    matches_transformers(model, ref, ids)
    src = model.source(ck)
    convert(src, str(tmp_path / "c"), ExpertPlan(model.moe_layers, model.n_expert, model.expert_names,
                                                 model.dense_names()))
    np.testing.assert_array_equal(logits_of(load_model(str(tmp_path / "c"), budget="min"), ids), logits_of(model, ids))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_qwen3next_and_qwen35moe_hybrids_in_llama_cpps_layout(tmp_path, family):
    """qwen3next (Qwen3-Next) and qwen35moe (Qwen3.5/3.6): Gated DeltaNet layers between full
    ones, as llama.cpp's converter writes them (in_proj_qkvz split into qkv and z, the (1 + w)
    norms stored as 1 + w, A_log as -exp(A_log), the convolution squeezed, and Qwen3.5's value
    heads reordered from grouped to tiled: two value heads a key head here, so the order
    matters); Q8_0 matrices, experts streamed at one slot a layer: transformers' logits and
    tokens on the weights the package dequantises."""
    from gguf_models import dequantized_reference

    build(family, "basic_three_to_one", tmp_path / "hf", seed=9, hidden_size=64, linear_value_head_dim=8)
    path = write_gguf(tmp_path / "hf", tmp_path / "h.gguf",
                      quant=lambda name, a: "Q8_0" if a.shape[-1] % 32 == 0 and "ssm_conv" not in name else None)
    ck = open_checkpoint(path)
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_a"} <= set(ck.tensors)
    assert ck.tensors["blk.0.ssm_conv1d.weight"].shape == (2 * 2 * 8 + 4 * 8, 4)  # q, k, v channels; kernel
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == family and model.args.gguf_layout
    assert model.args.v_heads_tiled == (family == "qwen3_5_moe") and model.args.layer_types[3] == "full_attention"
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    # (5e-4: at this shape the family differs from transformers by 1.4e-4 on the plain checkpoint
    # too, logits up to 10: float32 sums in another order through the recurrent layers)
    matches_transformers(model, ref, np.random.default_rng(9).integers(1, 101, 19), atol=5e-4)


def test_kimi_linear_with_kda_and_mla_layers(tmp_path):
    """kimi-linear (Kimi Linear): KDA layers (a KV head count of 0) between MLA ones without
    rotary, as llama.cpp's converter writes them (A_log as -exp(A_log), the convolutions [1,
    channels, 1, kernel], dt_bias as ssm_dt.bias, kv_b split), a leading dense layer, shared
    experts; Q8_0 matrices, experts at one slot a layer: transformers' logits and tokens on the
    weights the package dequantises."""
    from gguf_models import dequantized_reference

    build("kimi_linear", "q_lora_groups_mixed", tmp_path / "hf", seed=4, hidden_size=64, n_group=1,
          linear_num_heads=4, mlp_layer_types=["dense", "sparse", "sparse", "sparse"])
    path = write_gguf(tmp_path / "hf", tmp_path / "k.gguf", quant=lambda name, a: "Q8_0" if a.shape[-1] % 32 == 0
                      and "ssm_conv" not in name else None)
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == "kimi_linear" and model.args.layer_types[:2] == ["linear_attention", "full_attention"]
    assert model.args.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    matches_transformers(model, ref, np.random.default_rng(4).integers(1, 101, 17))


def test_glm_dsa_with_its_indexer_full_and_shared(tmp_path):
    """glm-dsa (GLM-5): deepseek2's MLA (kv_b split) and grouped sigmoid router with DeepSeek
    Sparse Attention's indexer, full on some layers and shared on others (indexer.types), a
    top-k below the prompt's length so the selection matters; Q8_0 matrices, experts at one
    slot a layer: transformers' logits and tokens on the weights the package dequantises."""
    from gguf_models import dequantized_reference

    build("glm_moe_dsa", "full_shared_topk4", tmp_path / "hf", seed=6, hidden_size=64, kv_lora_rank=32)
    path = write_gguf(tmp_path / "hf", tmp_path / "g.gguf", quant=lambda name, a: "Q8_0" if a.shape[-1] % 32 == 0
                      else None)
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == "glm_moe_dsa" and model.args.indexer_types == ["full", "shared", "full"]
    assert model.args.index_topk == 4 and model.args.n_group == 2
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    matches_transformers(model, ref, np.random.default_rng(6).integers(1, 101, 15))


def test_deepseek4_with_mxfp4_experts_hash_layers_and_compressed_attention(tmp_path):
    """deepseek4 (DeepSeek-V4), named by colibri's own table (the gguf package has none): the
    routed experts in MXFP4 stacked per projection, the rest Q8_0 and F32 as llama.cpp's
    converter writes the release, tid2eid as I32, hyper-connections of 4, sliding, CSA (rate
    4, its indexer's top-k below the entries) and HCA (rate 128, a prompt past it) layers,
    the compressed layers' YaRN: transformers' logits and tokens on the weights the package
    dequantises, from the file at one slot a layer and from a converted container."""
    from gguf_models import dequantized_reference, write_deepseek4

    from colibri.storage.convert import ExpertPlan, convert

    csa, hca = "compressed_sparse_attention", "heavily_compressed_attention"
    # (8 indexer heads: with 4, entries' ReLU scores tie at 0 and torch's topk breaks ties its own way)
    build("deepseek_v4", "all_types_hash_first", tmp_path / "hf", seed=8, hidden_size=64, moe_intermediate_size=32,
          head_dim=32, q_lora_rank=32, hc_mult=4, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8,
          index_head_dim=16, index_topk=3, max_position_embeddings=512, compress_rates={csa: 4, hca: 128},
          rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    path = write_deepseek4(tmp_path / "hf", tmp_path / "v4.gguf", quant=lambda name, a: "Q8_0" if a.shape[-1] % 32 == 0
                           else None)
    ck = open_checkpoint(path)
    assert ck.tensors["blk.2.ffn_gate_exps.weight"].dtype == "MXFP4" and ck.tensors["blk.1.attn_kv.weight"].dtype == "Q8_0"
    assert ck.tensors["blk.0.ffn_gate_tid2eid.weight"].dtype == "I32" and "blk.0.exp_probs_b.bias" not in ck.tensors
    model = load_model(path, budget="min")
    assert model.MODEL_TYPE == "deepseek_v4" and model.args.layer_types == ["sliding_attention", csa, hca, csa]
    assert model.args.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"] and model.args.hc_mult == 4
    ref = dequantized_reference(path, tmp_path / "hf", tmp_path / "deq")
    ids = np.random.default_rng(8).integers(1, 101, 131)  # (past an HCA entry of 128 and YaRN's 64)
    matches_transformers(model, ref, ids)
    convert(model.source(ck), str(tmp_path / "c"), ExpertPlan(model.moe_layers, model.n_expert, model.expert_names,
                                                              model.dense_names()))
    np.testing.assert_array_equal(logits_of(load_model(str(tmp_path / "c"), budget="min"), ids), logits_of(model, ids))


def test_every_truncation_and_damaged_header_byte_is_a_named_error(qwen, tmp_path):
    """A GGUF file cut at every byte of its header and tensor table (and at points of its
    data), and with single bits flipped in them, is GGUFInvalid (or another named error of
    the storage floor) with one line that names the file: never numpy's or the gguf
    package's text, never a traceback."""
    import random

    from gguf import GGUFReader

    from colibri.storage.checkpoint import load_config
    from colibri.storage.errors import ColibriError

    _, _, path = qwen
    data = open(path, "rb").read()
    begin = int(GGUFReader(path).data_offset)
    bad = tmp_path / "bad.gguf"

    def named(blob: bytes) -> str | None:
        bad.write_bytes(blob)
        try:
            open_checkpoint(str(bad))
            load_config(str(bad))
        except ColibriError as e:
            text = str(e)
            assert text.startswith(str(bad)) and "\n" not in text, text
            assert not any(w in text for w in ("reshape", "dtype", "buffer", "codec", "numpy")), text
            return text
        return None  # (a flipped bit inside a string, or the padding after the last tensor: still a file)

    for n in [*range(0, min(begin, 1024)), *range(1024, begin, 7)]:
        assert named(data[:n]), n  # cut inside the header or the tensor table
    for n in range(begin, len(data) - 32, (len(data) - begin) // 40):
        assert "truncated" in named(data[:n]), n  # cut inside a tensor's data
    assert "truncated" in named(data[: begin - 3]) and "GGUF" in named(data[:3])
    rng = random.Random(7)
    for _ in range(1000):
        blob = bytearray(data)
        blob[rng.randrange(begin)] ^= 1 << rng.randrange(8)
        named(bytes(blob))
