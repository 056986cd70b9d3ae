"""int8 activations (engine/formats/intdot.py): the integer kernels against their numpy
reference, bit for bit, on every instruction path this CPU runs (AVX2 forced on an AVX-512
machine too); the crew's integer job equal to the kernels; a model's rows the same alone,
batched, chunked and streamed; the label on every precision it is on in, and only there."""

import os
import subprocess
import sys

import numpy as np
import pytest

from colibri.engine import crew, kernels, layers
from colibri.engine.formats import intdot
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.convert import ExpertPlan, convert, plan_for
from colibri.storage.experts import QuantWeight
from colibri.storage.formats import int4 as s4
from colibri.storage.formats import int8 as s8

from hf_models import build, load_model

PATHS = intdot.host_paths()
QUANT = {"int4": s4, "int8": s8}


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def weight(kind, N, D, g, rng, scale=1.0):
    q, s = QUANT[kind].quantize((rng.standard_normal((N, D)) * scale).astype(np.float32), g)
    return QuantWeight(kind, q, s, g)


def reference(x, w):
    # w in rows
    values, scales = intdot.values_reference(w)
    return intdot.reference(x, values, scales, w.group_size)


def test_the_host_runs_the_paths_it_has():
    assert PATHS[0] == intdot.PATH_GENERIC
    feats = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2" in feats:
        assert intdot.PATH_AVX2 in PATHS
    if " avx512_vnni" in feats and " avx512bw" in feats:
        assert intdot.PATH_VNNI512 in PATHS and intdot.PATH_VNNI256 in PATHS


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_rows_matches_numpy(bits):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 96)).astype(np.float32) * np.float32(3.0)
    x[1, :32] = 0  # a block of zeros: scale 0, values 0
    x[2, 40] = 1e4  # one outlier takes its block's scale
    x[3] = -x[3]
    x[4, 64:] = np.float32(127.0) * np.float32(0.5)  # exact halves: rint rounds to even
    rec = np.empty((5, intdot.record_len(96)), np.int8)
    intdot.quantize_rows(x, bits, rec)
    np.testing.assert_array_equal(rec, intdot.record_reference(x, bits))
    assert rec.shape == (5, 120) and (rec[1, :32] == 0).all() and np.abs(rec[:, :96]).max() <= 127
    assert rec[2, 108:120].copy().view(np.float32)[1] == np.float32(1e4) / np.float32(127)  # the outlier's block
    sums = rec[:, 96:108].copy().view(np.int32)
    np.testing.assert_array_equal(sums, rec[:, :96].astype(np.int32).reshape(5, 3, 32).sum(-1))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_tiles_and_back(kind):
    """arrange(on) lays sixteen rows out as the module's doc says (against numpy's transpose),
    arrange(off) gives the rows back; a matrix the kernels cannot take is not taken."""
    rng = np.random.default_rng(4)
    w = weight(kind, 48, 128, 64, rng)
    t = intdot.arranged(w, True)
    assert t.integer and t.shape == w.shape and not np.shares_memory(t.q, w.q)
    want_q, want_s = intdot.tile(w.q, w.scales, 8 if kind == "int8" else 4)
    np.testing.assert_array_equal(t.q.view(np.uint8).reshape(-1), want_q.reshape(-1))
    np.testing.assert_array_equal(t.scales.view(np.uint16).reshape(-1), want_s.reshape(-1))
    # chunk 1 of block 0 of tile 0: rows 0..15, four bytes each (int8 columns 4..7, int4 bytes 4..7)
    np.testing.assert_array_equal(t.q.view(np.uint8).reshape(-1)[64:128].reshape(16, 4), w.q.view(np.uint8)[:16, 4:8])
    back = intdot.arranged(t, False)
    assert not back.integer
    np.testing.assert_array_equal(back.q, w.q)
    np.testing.assert_array_equal(back.scales, w.scales)
    assert intdot.takes(w) and not intdot.takes(weight(kind, 40, 128, 64, rng))  # 40 rows: not whole tiles
    assert not intdot.takes(weight(kind, 32, 80, 80, rng))  # 80 columns: not whole blocks


def test_scales_widen_exactly_with_and_without_f16c():
    """The scales' f16 -> f32 on both ways the kernels have: every one of the 65,536 bit
    patterns as numpy widens it (a signalling NaN comes out quiet on both)."""
    import numba as nb

    @nb.njit
    def bits_way(src, dst):
        intdot.widen_f16(src, dst, False)

    @nb.njit
    def f16c_way(src, dst):
        intdot.widen_f16(src, dst, True)

    src = np.arange(65536, dtype=np.uint16)
    a, b = np.empty(65536, np.float32), np.empty(65536, np.float32)
    bits_way(src, a)
    if intdot.F16C:
        f16c_way(src, b)
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    want = src.view(np.float16).astype(np.float32)
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(a[ok].view(np.uint32), want[ok].view(np.uint32))
    assert np.isnan(a[~ok]).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind,g", [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 32), ("int8", 64),
                                    ("int8", 128), ("int8", 96)])
def test_integer_kernel_equals_its_reference_bit_for_bit(path, kind, g):
    """Every token count around each path's token block (2, 3), tiles around linear's
    TILE_ROWS (64 rows), rows that are not whole tiles (padded), row lengths of one block, one
    group and many."""
    rng = np.random.default_rng(g + len(kind))
    for D in sorted({g, 3 * g if g in (32, 96) else g + 128, 256, 7 * g}):  # (int8's one scale a row: g = D)
        if D % g:
            continue
        for T, N in ((1, 16), (2, 16), (3, 48), (4, 64), (5, 80), (7, 144), (9, 32), (3, 40), (2, 101)):
            w = weight(kind, N, D, g, rng)
            x = (rng.standard_normal((T, D)) * rng.uniform(0.01, 10, (T, 1))).astype(np.float32)
            x[0, :32] = 0
            out = np.empty((T, N), np.float32)
            intdot.linear(x, intdot.arranged(w, True), out, path)
            np.testing.assert_array_equal(out, reference(x, w), err_msg=f"{kind} g{g} D{D} T{T} N{N} path {path}")


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_row_is_the_same_alone_and_with_others(kind):
    rng = np.random.default_rng(7)
    w = intdot.arranged(weight(kind, 48, 128, 32, rng), True)
    x = rng.standard_normal((11, 128)).astype(np.float32)
    whole = np.empty((11, 48), np.float32)
    intdot.linear(x, w, whole)
    for t in range(11):
        one = np.empty((1, 48), np.float32)
        intdot.linear(x[t : t + 1], w, one)
        np.testing.assert_array_equal(one[0], whole[t])


def test_the_integer_dot_is_close_to_the_float_one():
    """Not a quantisation-free result, but within what 8-bit activations cost: a bug in the
    layout (a permuted chunk, a lost excess) is off by the whole size of the result."""
    rng = np.random.default_rng(3)
    for kind in ("int4", "int8"):
        w = weight(kind, 64, 256, 64, rng)
        x = rng.standard_normal((6, 256)).astype(np.float32)
        out = np.empty((6, 64), np.float32)
        intdot.linear(x, intdot.arranged(w, True), out)
        exact = x @ QUANT[kind].dequantize(w.q, w.scales, 64).T
        assert np.abs(out - exact).max() < 0.02 * np.abs(exact).max()


def experts_job(kind, g, D, I, rng):
    # the crew's integer job over three experts, and the same rows through the kernels one by one
    # (g None: one scale a row, int8's default: gate and up's group D, down's I)
    E, T, A = 3, 5, 2
    ex = [tuple(intdot.arranged(weight(kind, *shape, g or shape[1], rng, 0.05), True)
                for shape in ((I, D), (I, D), (D, I))) for _ in range(E)]
    x = rng.standard_normal((T, D)).astype(np.float32)
    flat = np.array([0, 1, 2, 0, 1, 2, 0, 2, 1, 0])
    wts = rng.random(T * A).astype(np.float32)
    order = np.argsort(flat, kind="stable")
    starts = np.searchsorted(flat[order], np.arange(E + 1)).astype(np.int64)
    ys = np.zeros((T * A, D), np.float32)
    c = crew.Crew(64, share=True)
    try:
        c.experts_i8(x, order, starts, A, wts, ex, ys)
    finally:
        c.close()
    ref = np.zeros_like(ys)
    for r in range(T * A):
        gate, up, down = ex[flat[r]]
        h, u, o = np.empty((1, I), np.float32), np.empty((1, I), np.float32), np.empty((1, D), np.float32)
        intdot.linear(x[r // A : r // A + 1], gate, h)
        intdot.linear(x[r // A : r // A + 1], up, u)
        kernels.silu_mul(h, u, h)
        intdot.linear(h, down, o)
        ref[r] = o[0] * wts[r]
    return ys, ref


@pytest.mark.parametrize("kind,g", [("int4", 32), ("int4", 128), ("int8", 64), ("int8", None)])
def test_the_crew_job_equals_the_kernels(kind, g):
    ys, ref = experts_job(kind, g, 768, 384, np.random.default_rng(g or 1))
    np.testing.assert_array_equal(ys, ref)


def test_the_avx2_path_forced_gives_the_same_bits():
    """COLIBRI_INT8_PATH=avx2 (and generic) in a process of its own: the crew built on that
    path gives the bits this process's fastest path gives."""
    if intdot.PATH_AVX2 not in PATHS:
        pytest.skip("this CPU has no AVX2")
    code = ("import sys, numpy as np; sys.path.insert(0, 'tests'); sys.path.insert(0, 'tests/engine');"
            "from colibri.engine.formats import intdot; import test_intdot as t;"
            "ys, _ = t.experts_job('int4', 64, 128, 192, np.random.default_rng(5));"
            "sys.stdout.buffer.write(bytes([intdot.PATH]) + ys.tobytes())")
    here, _ = experts_job("int4", 64, 128, 192, np.random.default_rng(5))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name, path in (("avx2", intdot.PATH_AVX2), ("generic", intdot.PATH_GENERIC)):
        env = dict(os.environ, COLIBRI_INT8_PATH=name, OMP_WAIT_POLICY="PASSIVE")
        out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, check=True).stdout
        assert out[0] == path
        np.testing.assert_array_equal(np.frombuffer(out[1:], np.float32).reshape(here.shape), here)


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("intdot")
    build("qwen3_moe", "basic", tmp / "hf", seed=12, hidden_size=128, moe_intermediate_size=64)
    m = build_model(str(tmp / "hf"), load_config(str(tmp / "hf")))
    for kind in ("int4", "int8"):
        convert(open_checkpoint(str(tmp / "hf")), tmp / kind, ExpertPlan(m.moe_layers, m.n_expert, m.expert_names),
                expert_dtype=kind, group_size=32 if kind == "int4" else None,  # int8: a scale a row
                activations="float32")
    return tmp


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_rows_are_the_same_alone_batched_chunked_and_streamed(containers, kind):
    from test_batching import alone, together

    model = load_model(str(containers / kind), budget="all")
    seqs = [np.arange(3, 12), np.array([40]), np.arange(20, 26)]
    exact = [model.forward(s, model.new_cache(16), all_logits=True) for s in seqs]
    model.set_activations("int8")
    ref = [model.forward(s, model.new_cache(16), all_logits=True) for s in seqs]
    assert not any(np.array_equal(a, b) for a, b in zip(ref, exact))  # the integer path is the one taken
    batched = model.forward_batch([(s, model.new_cache(16)) for s in seqs], all_logits=True)
    for want, got in zip(ref, batched):
        np.testing.assert_array_equal(got, want)
    prompts = [s.tolist() for s in seqs]
    want = {i: alone(model, p, 10) for i, p in enumerate(prompts)}
    assert together(model, prompts, 10, join_at=[0, 2, 5]) == want
    assert together(model, prompts, 10, join_at=[0, 0, 1], prefill_chunk=3) == want
    streamed = load_model(str(containers / kind), budget="min")
    streamed.set_activations("int8")
    assert {i: alone(streamed, p, 10) for i, p in enumerate(prompts)} == want
    model.set_activations("float32")  # and back: the exact path again
    np.testing.assert_array_equal(model.forward(seqs[0], model.new_cache(16), all_logits=True), exact[0])


def test_the_label_is_on_exactly_when_the_path_is(containers):
    from colibri.engine.errors import ActivationsUnsupported

    model = load_model(str(containers / "int4"), budget="all")
    assert model.precision()["activations"] == "float32"
    model.set_activations("int8")
    p = model.precision()
    assert p["activations"] == "int8" and p["lossy"]
    assert model.describe()["precision"]["activations"] == "int8"
    with pytest.raises(ValueError):
        model.set_activations("int4")
    published = load_model(str(containers / "hf"))
    assert published.precision()["activations"] == "float32" and not published.precision()["lossy"]
    with pytest.raises(ActivationsUnsupported, match="int8 or int4 experts"):
        published.set_activations("int8")
    tokens = [e.token_id for e in generate(published, [1, 2, 3], SamplingParams(max_tokens=4)) if e.kind == "token"]
    assert len(tokens) == 4


def test_int4_containers_default_to_it_and_gpt_oss_clamped_experts_take_it(tmp_path):
    """convert's default for int4 records int8 activations; gpt-oss's biased, clamped experts
    take the integer job (its activation and biases): the same bits at every budget, alone or
    batched, and close to the float path."""
    from colibri.storage.container import open_container

    build("gpt_oss", "sinks_sliding_clamped", tmp_path / "hf", seed=6, hidden_size=64, intermediate_size=64)
    m = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    convert(m.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "q",
            ExpertPlan(m.moe_layers, m.n_expert, m.expert_names, m.dense_names()), expert_dtype="int4", group_size=32)
    assert open_container(str(tmp_path / "q")).manifest["activations"] == "int8"
    ids = [np.array([t]) for t in (3, 9, 27, 4, 11)]

    def decode(model):
        cache = model.new_cache(8)
        return np.concatenate([model.forward(t, cache) for t in ids])

    full = load_model(str(tmp_path / "q"), budget="all")
    assert full.precision()["activations"] == "int8"
    want = decode(full)
    np.testing.assert_array_equal(decode(load_model(str(tmp_path / "q"), budget="min")), want)
    both = full.forward_batch([(ids[0], full.new_cache(8)), (ids[1], full.new_cache(8))])
    np.testing.assert_array_equal(both[0], want[0:1])
    full.set_activations("float32")
    exact = decode(full)
    assert not np.array_equal(exact, want) and np.abs(exact - want).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_crews_dense_job_equals_the_kernel(kind):
    rng = np.random.default_rng(11)
    w = intdot.arranged(weight(kind, 600, 512, 32, rng), True)  # past crew.CREW_MIN_ELEMENTS; 37.5 tiles
    x = rng.standard_normal((5, 512)).astype(np.float32)
    want = np.empty((5, 600), np.float32)
    intdot.linear(x, w, want)
    with crew.crew_session(64) as c:
        got = np.empty((5, 600), np.float32)
        c.matmul_i8(x, w, got)
    np.testing.assert_array_equal(got, want)


def alone_batched_streamed(model, container, seqs, n_ctx):
    """Each sequence's logits alone; asserts they are the same batched together, and the
    first's the same at the minimum expert budget."""
    ref = [model.forward(s, model.new_cache(n_ctx), all_logits=True) for s in seqs]
    for want, got in zip(ref, model.forward_batch([(s, model.new_cache(n_ctx)) for s in seqs], all_logits=True)):
        np.testing.assert_array_equal(got, want)
    streamed = load_model(str(container), budget="min")
    np.testing.assert_array_equal(streamed.forward(seqs[0], streamed.new_cache(n_ctx), all_logits=True), ref[0])
    return ref


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_dense_matrices_in_int8_or_int4(tmp_path, dense, monkeypatch):
    """convert --dense-dtype int8/int4: the attention matrices and the untied LM head stored
    with their scales, computed on int8 activations (the crew's dense job for the large ones):
    rows the same alone, batched and streamed; exact float32 activations on request; the label
    names it; a family whose dense part is not computed that way is refused."""
    from colibri.daemon.protocol import precision_text
    from colibri.storage.container import open_container
    from colibri.storage.convert import ConvertError

    build("qwen3_moe", "basic", tmp_path / "hf", seed=12, hidden_size=128, moe_intermediate_size=64)
    m = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    plan = ExpertPlan(m.moe_layers, m.n_expert, m.expert_names, m.dense_names(), m.int_dense_names())
    convert(open_checkpoint(str(tmp_path / "hf")), tmp_path / "c", plan, expert_dtype="int4", group_size=32,
            dense_dtype=dense)
    q = open_container(str(tmp_path / "c")).manifest["tensor_classes"]["dense"]["int"]
    assert q["kind"] == dense and q["group_size"] == 32 and set(q["names"]) == set(m.int_dense_names())
    assert "lm_head.weight" in q["names"] and len(q["names"]) == 4 * m.n_layer + 1
    model = load_model(str(tmp_path / "c"), budget="all")
    p = model.precision()
    assert p["dense_int"] == f"{dense} g32" and p["activations"] == "int8" and p["lossy"]
    assert f"(matrices {dense} g32)" in precision_text(p)
    assert model.layers[0]["q"].integer and model.lm_head.integer and model.lm_head.kind == dense
    seqs = [np.arange(3, 12), np.array([40]), np.arange(20, 26)]
    ref = alone_batched_streamed(model, tmp_path / "c", seqs, 16)
    exact = load_model(str(tmp_path / "hf")).forward(seqs[0], load_model(str(tmp_path / "hf")).new_cache(16),
                                                       all_logits=True)
    corr = np.corrcoef(ref[0].ravel(), exact.ravel())[0, 1]  # lossy by name, not broken (a wrong layout: ~0)
    assert corr > (0.95 if dense == "int8" else 0.7), corr
    model.set_activations("float32")
    assert not model.layers[0]["q"].integer and not model.lm_head.integer
    f32 = model.forward(seqs[0], model.new_cache(16), all_logits=True)
    assert not np.array_equal(f32, ref[0]) and np.abs(f32 - ref[0]).max() < 0.1 * np.abs(f32).max()
    # each matrix is freed as its copy is made (a list of them once held every one beside its
    # copy: the dense int bytes twice over at a load's peak, 215 MB on the benchmark model)
    import weakref

    from colibri.engine.formats import intdot

    seen, most, arranged = [], 0, intdot.arranged

    def counting(w, on):
        nonlocal most
        seen.append(weakref.ref(w.q))
        most = max(most, sum(r() is not None for r in seen))
        return arranged(w, on)

    monkeypatch.setattr(intdot, "arranged", counting)
    model.set_activations("int8")
    assert len(seen) == 4 * m.n_layer + 1 and most == 1, (len(seen), most)
    build("deepseek_v3", "q_lora_groups_interleaved", tmp_path / "ds", seed=3)
    d = build_model(str(tmp_path / "ds"), load_config(str(tmp_path / "ds")))
    with pytest.raises(ConvertError, match="dense matrices are not computed"):
        convert(open_checkpoint(str(tmp_path / "ds")), tmp_path / "d",
                ExpertPlan(d.moe_layers, d.n_expert, d.expert_names, d.dense_names(), d.int_dense_names()),
                dense_dtype=dense)


@pytest.mark.parametrize("family,case", [("qwen3_next", "odd_mix_sparse_tied"), ("qwen4_exp", "ple_qsa_hc2")])
def test_hybrid_families_dense_matrices_in_int8(tmp_path, family, case):
    """--dense-dtype int8 on the hybrid families: the Gated DeltaNet's projections, the
    attention's, the dense and shared MLPs' (and Qwen4-Exp's mixers, per-layer embedding
    projections and QSA indexer) stored int8 and computed on int8 activations; batched =
    alone, streamed = resident, close to the exact model (lossy by name, not broken)."""
    from colibri.storage.container import open_container

    shape = dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, head_dim=16,
                 linear_num_value_heads=4, linear_value_head_dim=8, linear_key_head_dim=16)
    if family == "qwen3_next":
        shape |= dict(intermediate_size=32, num_attention_heads=4, linear_num_key_heads=2)
    else:
        shape |= dict(hc_lowrank=32, ple_embed_dim=32)
    build(family, case, tmp_path / "hf", seed=4, **shape)
    m = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    names = m.int_dense_names()
    assert any(".linear_attn.in_proj" in n for n in names) and any("shared_expert.down_proj" in n for n in names)
    if family == "qwen4_exp":
        assert any("input_mix_weight_down" in n for n in names) and any("indexer.index_qk_proj" in n for n in names)
    convert(m.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "c", plan_for(m), dense_dtype="int8")
    q = open_container(str(tmp_path / "c")).manifest["tensor_classes"]["dense"]["int"]
    assert q["kind"] == "int8" and set(q["names"]) == set(names)
    model = load_model(str(tmp_path / "c"), budget="all")
    assert model.precision()["dense_int"] == "int8 g32" and model.precision()["lossy"]
    seqs = [np.arange(3, 40), np.array([40]), np.arange(20, 26)]
    ref = alone_batched_streamed(model, tmp_path / "c", seqs, 64)
    exact = load_model(str(tmp_path / "hf"))
    want = exact.forward(seqs[0], exact.new_cache(64), all_logits=True)
    corr = np.corrcoef(ref[0].ravel(), want.ravel())[0, 1]  # (int8 activations on a tiny random model: ~0.92-0.97;
    assert corr > 0.9, corr  # a wrong layout or scale gives ~0)
