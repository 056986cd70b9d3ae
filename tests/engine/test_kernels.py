"""Each numba kernel against a plain numpy reference, on odd shapes."""

import os
import pickle
import platform
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri.engine import attention, crew, kernels, layers, moe
from colibri.engine.formats import int4
from colibri.storage.experts import ExpertStats, ResidentExperts
from colibri.storage.quant import Expert, int4_facts
from colibri.storage.safetensors import bf16_to_f32, f32_to_bf16

rng = np.random.default_rng(0)


def rand(*shape):
    return rng.standard_normal(shape, dtype=np.float32)


# ---- numpy references ----

def ref_rmsnorm(x, w, eps):
    x64 = x.astype(np.float64)
    return (w * (x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps))).astype(np.float32)


def ref_rope(x, cos, sin):
    # transformers' rotate-half, partial when the table is narrower than the head
    rot = 2 * cos.shape[-1]
    half = rot // 2
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)


def ref_attention(q, k, v, pos0, window, scale, sinks=None):
    # q [T, Hq, hd]; k [Hkv, S, hd], v [Hkv, S, hv]; sinks [Hq]: transformers' gpt-oss softmax
    # over [scores, sink] with the sink's column dropped
    T, Hq, hd = q.shape
    n_rep = Hq // k.shape[0]
    out = np.zeros((T, Hq, v.shape[2]), np.float32)
    for t in range(T):
        p = pos0 + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(Hq):
            s = (k[h // n_rep, lo : p + 1] @ q[t, h]).astype(np.float64) * scale
            s = np.append(s, sinks[h]) if sinks is not None else s
            a = np.exp(s - s.max())
            a = a / a.sum()
            out[t, h] = (a[: p + 1 - lo]) @ v[h // n_rep, lo : p + 1]
    return out


@pytest.mark.parametrize("T,N,D", [(1, 7, 33), (5, 64, 128), (3, 1, 1), (17, 31, 250), (2, 2049, 2048)])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_matmul_u16(T, N, D, dtype):
    layers.init()
    x, w32 = rand(T, D), rand(N, D)
    w = f32_to_bf16(w32) if dtype == "bf16" else w32.astype(np.float16)
    wf = bf16_to_f32(w) if dtype == "bf16" else w.astype(np.float32)
    out = layers.linear(x, w)  # the last shape takes the parallel kernel
    np.testing.assert_allclose(out, x.astype(np.float64) @ wf.T.astype(np.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("D", [33, 256])
def test_dense_rows_are_the_same_alone_or_batched(D):
    """A token's row of a dense matmul has the same bits whatever tokens share the call: bf16
    is widened in registers for up to BF16_DIRECT_TOKENS and into a buffer for more (the
    batch here is past it, each token alone is not), float32 and f16 through the same tiles
    (a request's tokens must not change when others join it)."""
    layers.init()
    T = kernels.BF16_DIRECT_TOKENS + 5
    x, w32 = rand(T, D), rand(70, D)
    for w in (f32_to_bf16(w32), w32.astype(np.float16), w32):
        many = layers.linear(x, w)
        for t in range(T):
            np.testing.assert_array_equal(layers.linear(x[t : t + 1], w)[0], many[t])
        np.testing.assert_array_equal(layers.linear(x[:3], w), many[:3])


@pytest.mark.parametrize("D", [7, 37, 1030])
@pytest.mark.parametrize("wtype", ["f32", "bf16"])
def test_tiles_around_every_tile_size(D, wtype):
    """kernels.tiles takes tokens 4, 2, 1 and rows 6 or 1 at a time and the columns 512 at
    a time (1030: two parked blocks and a tail): for every token and row count around those
    sizes each (token, row) matches numpy and has the bits it has computed alone."""
    T_max, R_max = 10, 14
    x, w32 = rand(T_max, D), rand(R_max, D)
    w = f32_to_bf16(w32) if wtype == "bf16" else w32
    wf = bf16_to_f32(w) if wtype == "bf16" else w32
    alone = np.empty((T_max, R_max), np.float32)
    for t in range(T_max):
        for r in range(R_max):
            one = np.zeros((1, 1), np.float32)
            kernels.tiles(x[t : t + 1], w, r, r + 1, one, -r)
            alone[t, r] = one[0, 0]
    np.testing.assert_allclose(alone, x.astype(np.float64) @ wf.T.astype(np.float64), rtol=1e-4, atol=1e-3)
    for T in range(1, T_max + 1):
        for r_lo, r_hi in [(0, R) for R in range(1, R_max + 1)] + [(3, 14), (5, 12)]:
            out = np.full((T, R_max + 2), np.nan, np.float32)
            kernels.tiles(x[:T], w, r_lo, r_hi, out, 2)
            np.testing.assert_array_equal(out[:, 2 + r_lo : 2 + r_hi], alone[:T, r_lo:r_hi])
            assert np.isnan(out[:, : 2 + r_lo]).all() and np.isnan(out[:, 2 + r_hi :]).all()  # nothing else written


def test_buffers_start_on_a_line_and_the_bits_do_not_depend_on_it():
    """The tiles read their activations and widened rows from 64-byte lines (loads that
    straddle two lines cost a third of their rate): the engine's buffers start on one, and a
    (token, row) result is the same bits from any address."""
    for shape in [(3,), (5, 7), (24, 2048), (1, 1000)]:
        assert kernels.empty_aligned(shape).ctypes.data % kernels.ALIGN == 0
        assert kernels.empty_aligned(shape, np.uint16).shape == shape
    for n, m in [(24, 768), (24, 2048), (3, 5)]:
        assert kernels.rows_aligned(n, m).ctypes.data % kernels.ALIGN == 0
        assert kernels.rows_aligned(n, m).shape == (n, m)
    assert layers.rmsnorm(rand(9, 64), np.ones(64, np.float32), 1e-6).ctypes.data % kernels.ALIGN == 0
    x, w = rand(9, 1030), rand(13, 1030)
    lined = np.empty((9, 13), np.float32)
    kernels.tiles(kernels.aligned(x), kernels.aligned(w), 0, 13, lined, 0)
    for off in (4, 16, 36):  # bytes past a line
        xs, ws = (np.frombuffer(bytearray(a.nbytes + 64), np.uint8) for a in (x, w))
        xo, wo = ((b[(-b.ctypes.data + off) % 64 :][: a.nbytes].view(np.float32).reshape(a.shape)) for b, a in ((xs, x), (ws, w)))
        xo[...], wo[...] = x, w
        assert xo.ctypes.data % 64 == off % 64
        out = np.empty((9, 13), np.float32)
        kernels.tiles(xo, wo, 0, 13, out, 0)
        np.testing.assert_array_equal(out, lined)
        assert kernels.aligned(xo).ctypes.data % kernels.ALIGN == 0
        np.testing.assert_array_equal(kernels.aligned(xo), x)


def test_f16_table_is_exact():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    table = kernels.f16_table()
    ref = bits.view(np.float16).astype(np.float32)
    same = (table == ref) | (np.isnan(table) & np.isnan(ref))
    assert same.all()


@pytest.mark.parametrize("T,D", [(1, 1), (4, 37), (9, 256)])
def test_rmsnorm(T, D):
    x, w = rand(T, D) * 3, rand(D)
    out = np.empty_like(x)
    kernels.rmsnorm(x, w, 1e-6, out)
    np.testing.assert_allclose(out, ref_rmsnorm(x, w, 1e-6), rtol=2e-6, atol=2e-6)
    par = np.empty_like(x)
    kernels.rmsnorm_par(x, w, 1e-6, par)  # a prompt's rows on every thread: the same bits
    np.testing.assert_array_equal(par, out)


def test_clamped_activation():
    """gpt-oss's clamped SwiGLU (ir.clamped_rows, the crew's ACT_CLAMPED) against float64 on
    values inside and beyond the limit, on a sub-range of rows and columns only, and an
    element's bits the same in a lane or in the tail."""
    import numba as nb

    from colibri.engine.ir_rows import clamped_rows

    @nb.njit
    def act(h, u, gb, ub, alpha, limit, i_lo, i_hi, n_lo, n_hi):
        clamped_rows(h, u, gb, ub, alpha, limit, i_lo, i_hi, n_lo, n_hi)

    h, u, gb, ub = rand(4, 29) * 6, rand(4, 29) * 6, rand(29), rand(29)
    h[1, :4] = [-100.0, 100.0, 0.0, 7.5]
    alpha, limit = np.float32(1.702), np.float32(7.0)
    g = np.minimum(h.astype(np.float64) + gb, limit)
    v = np.clip(u.astype(np.float64) + ub, -limit, limit)
    want = (v + 1) * g / (1 + np.exp(-g * alpha))
    out = h.copy()
    act(out, u, gb, ub, alpha, limit, 1, 3, 2, 29)
    np.testing.assert_allclose(out[1:3, 2:], want[1:3, 2:], rtol=1e-5, atol=1e-30)
    np.testing.assert_array_equal(out[[0, 3]], h[[0, 3]])  # outside the range: untouched
    np.testing.assert_array_equal(out[1:3, :2], h[1:3, :2])
    shifted = h.copy()
    act(shifted, u, gb, ub, alpha, limit, 1, 3, 5, 29)  # the same elements in other lanes or the tail
    np.testing.assert_array_equal(shifted[1:3, 5:], out[1:3, 5:])


def test_sum_slots_in_slot_order_on_one_thread_or_all():
    T, A, D = 37, 8, 100
    ys, out, par = rand(T * A, D), np.empty((T, D), np.float32), np.empty((T, D), np.float32)
    kernels.sum_slots(ys, A, out)
    want = ys[0::A].copy()
    for a in range(1, A):  # slot by slot, in order: the same float32 roundings
        want += ys[a::A]
    np.testing.assert_array_equal(out, want)
    kernels.sum_slots_par(ys, A, par)
    np.testing.assert_array_equal(par, out)


@pytest.mark.parametrize("T,H,hd", [(1, 1, 2), (6, 3, 10), (4, 8, 64)])
def test_rope(T, H, hd):
    x = rand(T, H, hd)
    ang = rand(T, hd // 2) * 5
    cos, sin = np.cos(ang), np.sin(ang)
    want = ref_rope(x, cos, sin)
    kernels.rope(x, cos, sin)
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factor", [0.5, 0.25])
def test_partial_rope_turns_only_the_tables_width(factor):
    """partial_rotary_factor: rope_inv_freq makes a narrower table; the kernel must turn
    that many dims and pass the rest (it used to read past the table's end)."""
    from colibri.engine.rope import rope_inv_freq

    hd, T = 64, 5
    inv_freq, _ = rope_inv_freq({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": factor}, hd, 128)
    assert 2 * len(inv_freq) == int(hd * factor)
    ang = np.arange(T, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)  # [T, rot/2]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x = rand(T, 3, hd)
    want = ref_rope(x, cos, sin)
    kernels.rope(x, cos, sin)
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError):
        kernels.rope(rand(T, 3, 8), cos, sin)  # a table wider than the head


@pytest.mark.parametrize("T,pos0,Hq,Hkv,hd,window", [(1, 0, 2, 1, 8, 0), (7, 0, 4, 2, 16, 0), (1, 12, 6, 3, 10, 0),
                                                      (5, 9, 4, 4, 8, 4), (9, 0, 3, 1, 12, 3)])
def test_attention(T, pos0, Hq, Hkv, hd, window):
    S = pos0 + T
    q, k, v = rand(T, Hq, hd), rand(Hkv, S, hd), rand(Hkv, S, hd)
    out = np.empty_like(q)
    kernels.attention(q, k, v, pos0, window, np.float32(hd**-0.5), attention.NO_SINKS, out)
    np.testing.assert_allclose(out, ref_attention(q, k, v, pos0, window, hd**-0.5), rtol=1e-5, atol=1e-5)
    sinks = rand(Hq) * 2  # some above every score, some below
    kernels.attention(q, k, v, pos0, window, np.float32(hd**-0.5), sinks, out)
    np.testing.assert_allclose(out, ref_attention(q, k, v, pos0, window, hd**-0.5, sinks), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,sinks", [(0, False), (5, True)])
def test_attention_is_the_same_bits_parallel_chunked_and_alone(window, sinks):
    # a long prompt's attention runs on every thread (attention_par); a token's output is the
    # same bits there, in the serial kernel, and whether its prompt came in one step or in
    # chunks (the key cache then holding the earlier chunks)
    T, Hq, Hkv, hd = 37, 6, 2, 24
    q, k, v = rand(T, Hq, hd), rand(Hkv, T, hd), rand(Hkv, T, hd)
    s = rand(Hq) * 2 if sinks else attention.NO_SINKS
    one, par = np.empty_like(q), np.empty_like(q)
    kernels.attention(q, k, v, 0, window, np.float32(0.2), s, one)
    kernels.attention_par(q, k, v, 0, window, np.float32(0.2), s, par)
    np.testing.assert_array_equal(par, one)
    np.testing.assert_allclose(one, ref_attention(q, k, v, 0, window, 0.2, s if sinks else None), rtol=1e-5, atol=1e-5)
    for cut in (1, 16, 36):  # a prompt in two chunks
        a, b = np.empty((cut, Hq, hd), np.float32), np.empty((T - cut, Hq, hd), np.float32)
        kernels.attention(np.ascontiguousarray(q[:cut]), k, v, 0, window, np.float32(0.2), s, a)
        kernels.attention_par(np.ascontiguousarray(q[cut:]), k, v, cut, window, np.float32(0.2), s, b)
        np.testing.assert_array_equal(np.concatenate([a, b]), one)


@pytest.mark.parametrize("window,sinks,hv", [(0, False, 24), (5, True, 24), (0, False, 40)])
def test_attention_over_kv_blocks_in_any_order_is_the_contiguous_bits(window, sinks, hv):
    # a sequence's keys and values in blocks of the pool, in a shuffled order (its table),
    # some shared with another sequence: the same bits as one contiguous cache
    from colibri.engine.sequence import KV_BLOCK, KVPool

    T, Hq, Hkv, hd, L = 45, 6, 2, 24, 2
    q, k, v = rand(T, Hq, hd), rand(Hkv, T, hd), rand(Hkv, T, hv)
    s = rand(Hq) * 2 if sinks else attention.NO_SINKS
    pool = KVPool({"k": (L, Hkv, hd), "v": (L, Hkv, hv)}, reserve=64 * KV_BLOCK * L * Hkv * (hd + hv) * 4)
    n = -(-T // KV_BLOCK)
    table = np.random.default_rng(1).permutation(pool.n_blocks)[:n].astype(np.int64)
    for i, b in enumerate(table):
        lo, hi = i * KV_BLOCK, min(T, (i + 1) * KV_BLOCK)
        pool.arrays["k"][b, 1, :, : hi - lo] = k[:, lo:hi]
        pool.arrays["v"][b, 1, :, : hi - lo] = v[:, lo:hi]
    want, got = np.empty((T, Hq, hv), np.float32), np.empty((T, Hq, hv), np.float32)
    kernels.attention(q, k, v, 0, window, np.float32(0.2), s, want)
    kernels.attention_paged(q, pool.arrays["k"], pool.arrays["v"], 1, table, KV_BLOCK, 0, window, np.float32(0.2), s,
                            got)
    np.testing.assert_array_equal(got, want)
    for cut in (1, 16, 44):  # a prompt in two chunks, the second on every thread
        b2 = np.empty((T - cut, Hq, hv), np.float32)
        kernels.attention_paged_par(np.ascontiguousarray(q[cut:]), pool.arrays["k"], pool.arrays["v"], 1, table,
                                    KV_BLOCK, cut, window, np.float32(0.2), s, b2)
        np.testing.assert_array_equal(b2, want[cut:])


@pytest.mark.parametrize("hd,hv", [(24, 16), (16, 40)])
def test_attention_with_a_value_head_of_its_own_size(hd, hv):
    # MLA-style heads: keys and queries of one size, values of another (the output is the values')
    T, pos0, Hq, Hkv = 3, 4, 4, 2
    q, k, v = rand(T, Hq, hd), rand(Hkv, pos0 + T, hd), rand(Hkv, pos0 + T, hv)
    out = np.empty((T, Hq, hv), np.float32)
    kernels.attention(q, k, v, pos0, 0, np.float32(0.3), attention.NO_SINKS, out)
    np.testing.assert_allclose(out, ref_attention(q, k, v, pos0, 0, 0.3), rtol=1e-5, atol=1e-5)


def test_silu_mul():
    """silu(g) * u eight lanes at a time, the last columns through the same vector code: within
    a few ulp of float64 from -100 to 100, and an element's bits the same wherever it sits."""
    g, u = rand(3, 50) * 4, rand(3, 50)
    g[0, :6] = [-100.0, -88.5, -20.0, 0.0, 30.0, 100.0]
    out = np.empty_like(g)
    kernels.silu_mul(g, u, out)
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-30)
    for k in range(1, 9):  # the same elements in other lanes, or in the tail
        part = np.empty_like(g[:, k:])
        kernels.silu_mul(np.ascontiguousarray(g[:, k:]), np.ascontiguousarray(u[:, k:]), part)
        np.testing.assert_array_equal(part, out[:, k:])
    kernels.silu_mul(g, u, g)  # in place
    np.testing.assert_array_equal(g, out)


def test_moe_dispatch_matches_dense_loop():
    """The batch-union dispatch equals summing each token's experts one by one."""

    class Source(ResidentExperts):  # the experts of a list, handed out one by one, in either order
        def __init__(self, experts, reverse=False):
            self.experts, self.calls, self.reverse = experts, [], reverse
            self.stats = ExpertStats()

        def stream(self, il, ids):
            self.calls.append(list(ids))
            for i in (reversed(ids) if self.reverse else ids):
                yield [(i, self.experts[i])]

    D, I, E, T, A = 12, 8, 5, 6, 2
    experts = [(rand(I, D), rand(I, D), rand(D, I)) for _ in range(E)]
    x = rand(T, D)
    ids, w = moe.softmax_top_k(rand(T, E), A, renormalise=False)
    src = Source(experts)
    out = moe.moe(x, ids, w, src, il=0)
    assert src.calls == [sorted(set(ids.ravel().tolist()))]  # one request, each expert once
    # the order experts arrive in (cache hits first, reads as they land) changes no bit
    np.testing.assert_array_equal(moe.moe(x, ids, w, Source(experts, reverse=True), il=0), out)
    ref = np.zeros_like(x)
    for t in range(T):
        for a in range(A):
            g, u, d = experts[ids[t, a]]
            hg, hu = g @ x[t], u @ x[t]
            ref[t] += w[t, a] * (d @ (hg / (1 + np.exp(-hg)) * hu))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_top_k_order_and_ties():
    probs = np.array([[0.1, 0.3, 0.3, 0.2, 0.1]], np.float32)
    ids, vals = moe.top_k(probs, 3)
    assert ids.tolist() == [[1, 2, 3]]
    np.testing.assert_allclose(vals, [[0.3, 0.3, 0.2]])


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("T,N,D,g", [(1, 5, 64, 32), (4, 33, 256, 64), (2, 7, 384, 128), (3, 9, 96, 96)])
def test_quantized_matmul(kind, T, N, D, g):
    from colibri.storage.formats.int4 import GROUPS as INT4_GROUPS
    from colibri.storage.quant import check_group, dequantize, quantize

    if kind == "int4" and g not in INT4_GROUPS:  # no int4 kernel for it: the converter refuses it by name
        assert "int4 group size must be one of 32, 64, 128" in check_group(kind, (N, D), g)
        return
    layers.init()
    w = rand(N, D)
    qw = quantize(w, kind, g)
    assert qw.shape == (N, D) and qw.scales.dtype == np.float16
    x = rand(T, D)
    ref = x.astype(np.float64) @ dequantize(qw).T.astype(np.float64)
    np.testing.assert_allclose(layers.linear(x, qw), ref, rtol=1e-4, atol=1e-4)
    # and the quantization itself is close to the matrix (int4 coarser than int8)
    err = np.abs(dequantize(qw) - w).max() / np.abs(w).max()
    assert err < (0.08 if kind == "int4" else 0.005)


def test_int4_packing_layout():
    from colibri.storage.quant import dequantize, quantize

    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [7, -7, 1, 0]  # scale 7 / 7 = 1
    qw = quantize(w, "int4", 32)
    assert qw.q[0, :2].tolist() == [(7 + 8) | ((-7 + 8) << 4), (1 + 8) | ((0 + 8) << 4)]
    np.testing.assert_array_equal(dequantize(qw), w)


@pytest.mark.parametrize("T,D,I,g", [(1, 128, 64, 32), (3, 256, 192, 64), (2, 256, 128, 128), (7, 128, 192, 64), (40, 128, 96, 32)])
def test_int4_expert_both_paths(T, D, I, g):
    """An int4 expert (gate, up, silu, down) by the decode kernels and by the prompt-token
    kernels, against numpy on the dequantized matrices."""
    from colibri.storage.quant import dequantize, quantize

    layers.init()
    gate, up, down = quantize(rand(I, D), "int4", g), quantize(rand(I, D), "int4", g), quantize(rand(D, I), "int4", g)
    x = rand(T, D)
    hg, hu = (x.astype(np.float64) @ dequantize(w).T.astype(np.float64) for w in (gate, up))
    ref = (hg / (1 + np.exp(-hg)) * hu) @ dequantize(down).T.astype(np.float64)
    out = layers.swiglu(x, gate, up, down)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()  # float32 sums of float64 products
    # the decode path's one-call expert does what linear, silu_mul, linear do one by one (its
    # inlined helpers round differently, within the float32 error both have against float64)
    h = layers.linear(x, gate)
    kernels.silu_mul(h, layers.linear(x, up), h)
    assert np.abs(out - layers.linear(h, down)).max() <= 1e-5 * np.abs(ref).max()
    # the prompt-token path (dequantize rows once, dot with every token): as close to the
    # reference, and each row's result the same whatever rows share the call
    tok = layers.swiglu(x, gate, up, down, prompt=True)
    assert np.abs(tok - ref).max() <= 1e-5 * np.abs(ref).max()
    for t in range(T):
        np.testing.assert_array_equal(layers.swiglu(x[t : t + 1], gate, up, down, prompt=True)[0], tok[t])
        np.testing.assert_array_equal(layers.swiglu(x[t : t + 1], gate, up, down)[0], out[t])
    with pytest.raises(ValueError, match="shapes do not match"):  # the vector code reads without bounds checks
        layers.swiglu(x[:, : D // 2], gate, up, down)
    with pytest.raises(ValueError, match="shapes do not match"):
        layers.linear(x, down)
    odd = quantize(rand(kernels.ROW_BLOCK + 7, D), "int4", g)  # a last block of rows that is not full
    y = np.empty((T, odd.q.shape[0]), np.float32)
    int4.LINEAR_Q4_TOK[g](x, odd.q, odd.scales.view(np.uint16), kernels.f16_lut(), y)
    np.testing.assert_allclose(y, x.astype(np.float64) @ dequantize(odd).T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_experts_of_a_batch_use_every_compute_thread():
    """run_shared hands items to the helper threads too: two items that each wait for the
    other can only finish if two threads run them at once."""
    import threading

    crew.set_threads(2)
    try:
        meet = threading.Barrier(2, timeout=10)
        seen = set()

        def item(_):
            seen.add(threading.get_ident())
            meet.wait()

        crew.run_shared([0, 1], item)
        assert len(seen) == 2
    finally:
        layers.init()


def test_kernels_loaded_from_the_cache_compute_what_fresh_ones_do(tmp_path):
    """numba compiles a kernel in the first process and later ones load it from its disk
    cache: both must give the same bits (the daemon and `colictl run` must agree), for every
    int4 group size and both int4 paths; and the later one compiles nothing (a kernel numba
    cannot cache, e.g. a closure calling another closure, costs every process its compile)."""
    import subprocess
    import sys

    code = """
import hashlib, numpy as np
from colibri.engine import layers
from colibri.storage.quant import quantize
layers.init()
rng, h = np.random.default_rng(0), hashlib.sha256()
for g in (32, 64, 128):
    w = [quantize(rng.standard_normal(s).astype(np.float32), "int4", g) for s in ((128, 256), (128, 256), (256, 128))]
    x = rng.standard_normal((3, 256)).astype(np.float32)
    for prompt in (False, True):
        h.update(layers.swiglu(x, *w, prompt=prompt).tobytes())
print(h.hexdigest())
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "NUMBA_DEBUG_CACHE": "1"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    first, second = (r.stdout.splitlines() for r in runs)
    assert first[-1] == second[-1]  # the first compiled, the second loaded
    assert any("data saved" in line for line in first)
    assert not [line for line in second if "data saved" in line]


def int4_experts(n, D, I, g):
    from colibri.storage.quant import quantize

    return [tuple(quantize(rand(*s) * 0.1, "int4", g) for s in ((I, D), (I, D), (D, I))) for _ in range(n)]


def wait_for_helper(team):
    import time

    deadline = time.monotonic() + 30
    while team.board[2] == 0:  # a helper in the kernel, spinning for jobs
        assert time.monotonic() < deadline, "no crew thread came"
        time.sleep(0.001)


def test_crew_jobs_give_the_bits_of_one_thread():
    """The crew's jobs (int4 experts cut into units, dense matrices in row blocks) shared by
    two threads give the same bits as one thread, and as the per-expert decode path; the
    helper really did some of the units."""
    layers.init(2)
    try:
        D, I, g, T, A, E = 256, 192, 64, 3, 4, 12
        experts = int4_experts(E, D, I, g)
        x = rand(T, D)
        rows = rng.permutation(T * A)  # each expert takes one row, all the others none
        starts = np.array([0, *range(1, E), T * A], np.int64)  # the last expert takes the rest
        wts = rand(T * A)
        alone = np.zeros((T * A, D), np.float32)
        crew.Crew(g, share=False).experts(x, rows, starts, A, wts, experts, alone)
        for e in range(E):
            for r in rows[starts[e] : starts[e + 1]]:
                one = layers.swiglu(x[r // A : r // A + 1], *experts[e])[0]
                np.testing.assert_array_equal(alone[r], one * wts[r])
        big = int4_experts(24, 1024, 512, g)  # many units: the helper cannot miss them all
        xb, wb = rand(2, 1024), rand(2 * 8)
        rb, sb = np.arange(16), np.minimum(np.arange(25), 16)  # experts 0-15 a row each, 16-23 none
        want = np.zeros((16, 1024), np.float32)
        crew.Crew(g, share=False).experts(xb, rb, sb, 8, wb, big, want)
        dense = [f32_to_bf16(rand(300, 1024)), rand(300, 1024).astype(np.float16), rand(300, 1024)]
        team = crew.Crew(g, share=True)
        try:
            wait_for_helper(team)
            shared = np.zeros((T * A, D), np.float32)
            team.experts(x, rows, starts, A, wts, experts, shared)
            got = np.zeros((16, 1024), np.float32)
            team.experts(xb, rb, sb, 8, wb, big, got)
            again = np.zeros((T * A, D), np.float32)  # in the scratch the bigger job left behind
            team.experts(x, rows, starts, A, wts, experts, again)
            for w in dense:
                y = np.empty((2, 300), np.float32)
                team.matmul(xb, w, y)
                ref = np.empty_like(y)
                if w.dtype == np.float32:
                    kernels.matmul_f32(xb, w, ref)
                else:
                    kernels.matmul_u16(xb, w.view(np.uint16), w.dtype == np.uint16, kernels.f16_lut(), ref)
                np.testing.assert_array_equal(y, ref)
            for _ in range(200):  # on a loaded machine the helper may miss a job: give it more, each checked
                if team.board[3] > 0:
                    break
                time.sleep(0.01)
                more = np.zeros((16, 1024), np.float32)
                team.experts(xb, rb, sb, 8, wb, big, more)
                np.testing.assert_array_equal(more, want)
            assert team.board[3] > 0  # units the helper did
        finally:
            team.close()
        np.testing.assert_array_equal(shared, alone)
        np.testing.assert_array_equal(again, alone)
        np.testing.assert_array_equal(got, want)
    finally:
        layers.init()


def test_crew_bad_jobs_and_a_full_board():
    layers.init()
    D, I, g = 128, 64, 32
    experts = int4_experts(3, D, I, g)
    x, wts = rand(1, D), rand(2)
    ys = np.zeros((2, D), np.float32)
    team = crew.Crew(g, share=False)
    team.MAX_JOBS = 1  # the second job finds the board full and runs on a board of its own
    one, two = np.zeros_like(ys), np.zeros_like(ys)
    team.experts(x, np.arange(2), np.array([0, 1, 2]), 2, wts, experts[:2], one)
    team.experts(x, np.arange(2), np.array([0, 1, 2]), 2, wts, experts[:2], two)
    np.testing.assert_array_equal(one, two)
    with pytest.raises(ValueError, match="shapes do not match"):  # experts of another shape in one job
        team.experts(x, np.arange(2), np.array([0, 1, 2]), 2, wts, [experts[0], int4_experts(1, D, 2 * I, g)[0]], ys)
    with pytest.raises(ValueError, match="shapes do not match"):  # a group size the crew is not built for
        crew.Crew(64, share=False).experts(x, np.arange(2), np.array([0, 1, 2]), 2, wts, experts[:2], ys)
    gate, up, down = experts[0]  # every expert alike, but the scales of another group count
    short = type(gate)("int4", gate.q, gate.scales[:, :-1].copy(), g)
    with pytest.raises(ValueError, match="shapes do not match"):
        team.experts(x, np.arange(2), np.array([0, 2]), 2, wts, [(short, short, down)], ys)
    with pytest.raises(ValueError, match="a row outside the step"):
        crew.Crew(g, share=False).experts(x, np.array([0, 5]), np.array([0, 1, 2]), 2, wts, experts[:2], ys)
    with pytest.raises(ValueError, match="shapes do not match"):
        team.matmul(x, rand(5, D + 1), np.empty((1, 5), np.float32))
    # as the cache hands them out (Expert: layouts and addresses kept on the expert): the same
    # bits, and the same checks
    kept = [Expert(e) for e in experts[:2]]
    three = np.zeros_like(ys)
    team.experts(x, np.arange(2), np.array([0, 1, 2]), 2, wts, kept, three)
    np.testing.assert_array_equal(three, one)
    with pytest.raises(ValueError, match="shapes do not match"):
        team.experts(x, np.arange(2), np.array([0, 1, 2]), 2, wts, [kept[0], Expert(int4_experts(1, D, 2 * I, g)[0])], ys)
    with pytest.raises(ValueError, match="shapes do not match"):
        team.experts(x, np.arange(2), np.array([0, 2]), 2, wts, [Expert((short, short, down))], ys)
    copy = pickle.loads(pickle.dumps(kept[0]))  # another process: the matrices, never the addresses
    assert "int4" not in vars(copy) and copy.int4[2] == int4_facts(tuple(copy))[2] != kept[0].int4[2]


def expert_mats(kind, n, D, I, **kw):
    """n experts' (gate, up, down) of one kind: float (bf16 bits, f16, f32), int8/int4 by
    quantize, FP8 codes (no NaN) with float32 block scales, MXFP4 nibbles with e8m0 scales."""
    from colibri.storage.quant import QuantWeight, quantize

    def one(N, K):
        w = rand(N, K) * 0.1
        if kind == "bf16":
            return f32_to_bf16(w)
        if kind in ("f16", "f32"):
            return w.astype(kind.replace("f", "float"))
        if kind in ("int8", "int4"):
            return quantize(w, kind, kw["g"])
        if kind.startswith("fp8"):
            bn, bk = kw["block"] or (N, K)
            q = rng.integers(0, 256, (N, K), dtype=np.uint8)
            q[(q & 0x7F) >= 0x7C] = 0x38  # no NaN / inf code in either format
            return QuantWeight(kind, q, rand(-(-N // bn), -(-K // bk)) * 0.01, bk, bn)
        return QuantWeight("mxfp4", rng.integers(0, 256, (N, K // 2), dtype=np.uint8),
                           rng.integers(118, 130, (N, K // 32), dtype=np.uint8), 32)

    return [(one(I, D), one(I, D), one(D, I)) for _ in range(n)]


TOK_CASES = [("bf16", 48, 40, {}), ("f16", 48, 40, {}), ("f32", 44, 18, {}), ("int8", 96, 64, dict(g=32)),
             ("int4", 128, 64, dict(g=32)), ("int4", 128, 128, dict(g=64)), ("fp8_e4m3", 44, 18, dict(block=(5, 13))),
             ("fp8_e5m2", 40, 24, dict(block=None)), ("mxfp4", 64, 32, {})]


@pytest.mark.parametrize("kind,D,I,kw", TOK_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in TOK_CASES])
def test_prompt_path_job_gives_each_kinds_bits(kind, D, I, kw):
    """The crew's prompt-path job (a step's experts as (expert, row block) units, on two
    threads) gives every row the bits of the kind's prompt-token kernels run on that expert
    alone, for experts with 0 to 7 rows (around the 2 x 4 tile), and the same bits whichever
    other experts and rows share the job."""
    layers.init(2)
    try:
        E, A, T = 6, 3, 9
        experts = expert_mats(kind, E, D, I, **kw)
        x, wts = rand(T, D), rand(T * A)
        rows = rng.permutation(T * A)[: 0 + 1 + 2 + 3 + 5 + 7]
        starts = np.array([0, 0, 1, 3, 6, 11, 18], np.int64)  # expert 0 takes no row
        ys = np.zeros((T * A, D), np.float32)
        team = crew.Crew(64, share=True)
        try:
            team.experts_tok(x, rows, starts, A, wts, experts, ys)
            split = np.zeros_like(ys)  # the same rows in two jobs, the experts in another order
            team.experts_tok(x, rows[3:], starts[3:] - 3, A, wts, experts[3:], split)
            team.experts_tok(x, rows[:3], starts[:4], A, wts, experts[:3], split)
        finally:
            team.close()
        for e in range(E):
            r = rows[starts[e] : starts[e + 1]]
            if len(r):
                want = layers.swiglu(x[r // A], *experts[e], prompt=True) * wts[r][:, None]
                np.testing.assert_array_equal(ys[r], want)
        np.testing.assert_array_equal(split, ys)
        untouched = np.setdiff1d(np.arange(T * A), rows)
        assert not ys[untouched].any()
    finally:
        layers.init()


def test_prompt_path_job_refuses_what_it_cannot_take():
    layers.init()
    D, I = 128, 64
    bf16, int4 = expert_mats("bf16", 1, D, I), expert_mats("int4", 1, D, I, g=32)
    x, wts, ys = rand(1, D), rand(2), np.zeros((2, D), np.float32)
    team = crew.Crew(64, share=False)
    assert crew.tok_kind(bf16[0][0], int4[0][1], bf16[0][2]) is None  # kinds that differ in one expert
    with pytest.raises(ValueError, match="shapes do not match"):  # experts of two kinds in one job
        team.experts_tok(x, np.arange(2), np.array([0, 1, 2]), 2, wts, [bf16[0], int4[0]], ys)
    with pytest.raises(ValueError, match="shapes do not match"):  # another expert shape
        team.experts_tok(x, np.arange(2), np.array([0, 1, 2]), 2, wts, [bf16[0], expert_mats("bf16", 1, D, 2 * I)[0]], ys)
    with pytest.raises(ValueError, match="a row outside the step"):
        team.experts_tok(x, np.array([0, 5]), np.array([0, 1, 2]), 2, wts, bf16 * 2, ys)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc's settings are glibc's")
def test_a_steps_freed_temporaries_are_reused_without_faulting_pages_in():
    # a layer's temporaries (here 8 x 12 MiB), allocated and freed step after step: after
    # reuse_freed_memory malloc hands them out again from what it kept (by default glibc gave
    # them back to the system and faulted each page in again: ~4,000 faults a step)
    code = """
import resource, numpy as np
from colibri.engine import layers
layers.reuse_freed_memory()
def step():
    arrs = [np.ones(3 << 20, np.float32) for _ in range(8)]
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) < 3 * 100  # 8 x 3,072 pages a step
