"""The quantized kernels: int8 and int4 weights (storage/quant.py's layout) computed on as
they are, one float16 scale per group; nothing is dequantized but a few rows at a time.
The int4 kernels exist per group size (32, 64, 128): LINEAR_Q4 is the decode path (few
tokens, the bytes unpacked for each), LINEAR_Q4_TOK the prompt path (rows dequantized once
and tiled with every token); crew.py runs the decode path of a step's experts on threads.
"""

import numba as nb
import numpy as np

from .ir import q4_matmul, q4_widen
from .jit import JIT, JIT_FAST
from .kernels import ROW_BLOCK, rows_aligned, tiles


@nb.njit(**JIT_FAST)
def matmul_q8(x, q, scales, g, f16_lut, out):
    # x [T, D] f32, q [N, D] int8, scales [N, D/g] f16 bits (uint16), out [T, N]: out = x @ dequant(q).T,
    # a group at a time (sum of x*q, times the group's scale), in tiles of a constant 32 columns,
    # which LLVM vectorises; nothing is dequantized
    T, D = x.shape
    N = q.shape[0]
    G = D // g
    nc = g // 32
    for n in range(N):
        for t in range(T):
            acc = np.float32(0.0)
            for gi in range(G):
                part = np.float32(0.0)
                for c in range(nc):
                    base = gi * g + c * 32
                    for j in range(32):
                        part += x[t, base + j] * np.float32(q[n, base + j])
                for j in range(gi * g + nc * 32, gi * g + g):
                    part += x[t, j] * np.float32(q[n, j])
                acc += part * f16_lut[scales[n, gi]]
            out[t, n] = acc


@nb.njit(**JIT)
def q4_split_row(x, t, g, xe, xd, xsum8, i):
    # row t of x [T, D] -> row i of xe [., D/2] (even columns), xd [., D/2] (odd columns - 16 *
    # even ones), xsum8 [., D/g] = 8 * each group's sum: what the int4 row dot takes instead of
    # x. Strict float order (no fast-math): the int4 kernels inline it, and a reassociated sum
    # was rounded one way when compiled fresh and another when loaded from numba's cache
    D = x.shape[1]
    for j in range(D // 2):
        xe[i, j] = x[t, 2 * j]
        xd[i, j] = x[t, 2 * j + 1] - np.float32(16.0) * x[t, 2 * j]
    for gi in range(D // g):
        s = np.float32(0.0)
        for j in range(gi * g, gi * g + g):
            s += x[t, j]
        xsum8[i, gi] = np.float32(8.0) * s


@nb.njit(**JIT)
def q4_split(x, g, xe, xd, xsum8):
    # every row of x [T, D] through q4_split_row
    for t in range(x.shape[0]):
        q4_split_row(x, t, g, xe, xd, xsum8, t)


@nb.njit(**JIT)
def q8_rows(q, scales, g, f16_lut, n0, nr, wb):
    # wb[:nr] = rows n0 .. n0 + nr of an int8 matrix (q [N, D] int8, scales [N, D/g] f16 bits)
    # as float32: v * scale, exact
    D = q.shape[1]
    for r in range(nr):
        for j in range(D):  # widened first, then scaled: two loops LLVM vectorises (one does not)
            wb[r, j] = np.float32(q[n0 + r, j])
        for gi in range(D // g):
            s = f16_lut[scales[n0 + r, gi]]
            for j in range(gi * g, gi * g + g):
                wb[r, j] *= s


@nb.njit(**JIT)
def linear_q8_tok(x, q, scales, g, f16_lut, out):
    # the prompt-token path of int8: x [T, D] f32, q [N, D] int8, scales [N, D/g]
    # f16 bits, out [T, N] = x @ dequant(q).T: ROW_BLOCK rows dequantized (exact), then tiled
    # with every token, as the crew's prompt-path expert job computes them
    T, D = x.shape
    N = q.shape[0]
    if q.shape[1] != D or g < 1 or D % g or scales.shape[0] != N or scales.shape[1] * g != D or out.shape[0] != T \
            or out.shape[1] != N:
        raise ValueError("int8 kernel: weight, activation and output shapes do not match")
    wb = rows_aligned(ROW_BLOCK, D)
    for n0 in range(0, N, ROW_BLOCK):
        nr = min(ROW_BLOCK, N - n0)
        q8_rows(q, scales, g, f16_lut, n0, nr, wb)
        tiles(x, wb, 0, nr, out, n0)


def _make_q4(g: int):
    # the int4 kernels of one group size (decode and prompt-token linear): the group's
    # length must be a constant (LLVM vectorises the prompt path's group loop only then; the decode path's vector code is
    # unrolled over it). They close over integers only and call only module-level kernels: numba
    # caches such closures on disk (a closure over another kernel is compiled again in every
    # process) and gives the same code whether compiled now or loaded (an inline="always"
    # helper did not: its cached build rounded differently from its fresh one)
    half = g // 2

    @nb.njit(**JIT)
    def linear_q4_g(x, q, scales, f16_lut, out):
        # the decode path: x [T, D] f32; q [N, D/2] uint8 (even column in the low nibble, value
        # + 8); scales [N, D/g] f16 bits; out [T, N] = x @ dequant(q).T. With xe, xd, xsum8 from
        # q4_split: a byte b holds lo + 16 hi, so per group sum(xe*lo + xo*hi) = sum(xe*b + xd*hi);
        # minus 8*sum(x), times the scale (the high nibble by floor(b / 16) in float arithmetic,
        # exact for 0..255).
        T, D = x.shape
        if out.shape[0] != T or q.shape[1] * 2 != D or scales.shape[1] * g != D or out.shape[1] != q.shape[0] or f16_lut.shape[0] != 65536:
            raise ValueError("int4 kernel: weight, activation and output shapes do not match")  # the row dot does not check
        xe, xd, xs = np.empty((T, D // 2), np.float32), np.empty((T, D // 2), np.float32), np.empty((T, D // g), np.float32)
        q4_split(x, g, xe, xd, xs)
        q4_matmul(xe, xd, xs, q, scales, f16_lut, out, half, 0, T, 0, q.shape[0])

    @nb.njit(**JIT)
    def linear_q4_tok_g(x, q, scales, f16_lut, out):
        # the prompt-token path: x [T, D] f32, q [N, D/2] uint8, scales [N, D/g] f16 bits,
        # out [T, N] = x @ dequant(q).T. It dequantizes a block of ROW_BLOCK rows once
        # ((v - 8) * scale is exact in float32) and dots it with every token in tiles of
        # kernels.tiles while it sits in L2; the decode path unpacks every
        # weight again for every few tokens. A (token, row) result is the same whatever tile
        # computes it, so it does not depend on the tokens beside it; it differs from the
        # decode path's in rounding only.
        T, D = x.shape
        N = q.shape[0]
        if q.shape[1] * 2 != D or scales.shape[1] * g != D or out.shape[0] != T or out.shape[1] != N:
            raise ValueError("int4 kernel: weight, activation and output shapes do not match")  # the tile does not check
        wb = rows_aligned(ROW_BLOCK, D)  # [rows, D] dequantized
        for n0 in range(0, N, ROW_BLOCK):
            nr = min(ROW_BLOCK, N - n0)
            if g == 32:  # (the module's kernels, not the closure below: see above)
                q4_rows_32(q, scales, f16_lut, n0, nr, wb)
            elif g == 64:
                q4_rows_64(q, scales, f16_lut, n0, nr, wb)
            else:
                q4_rows_128(q, scales, f16_lut, n0, nr, wb)
            tiles(x, wb, 0, nr, out, n0)

    @nb.njit(**JIT)
    def q4_rows_g(q, scales, f16_lut, n0, nr, wb):
        # wb[:nr] = rows n0 .. n0 + nr of q [N, D/2] (scales [N, D/g] f16 bits) as float32:
        # (v - 8) * scale, exact (q4_widen)
        q4_widen(q, scales, f16_lut, n0, nr, wb, half)

    return linear_q4_g, linear_q4_tok_g, q4_rows_g


# group size -> kernel (storage/quant.py INT4_GROUPS); _TOK: the prompt-token path
LINEAR_Q4, LINEAR_Q4_TOK, Q4_ROWS = {}, {}, {}
for _g in (32, 64, 128):
    LINEAR_Q4[_g], LINEAR_Q4_TOK[_g], Q4_ROWS[_g] = _make_q4(_g)
q4_rows_32, q4_rows_64, q4_rows_128 = Q4_ROWS[32], Q4_ROWS[64], Q4_ROWS[128]  # for the crew's widen_rows
