"""The kernels for published low-precision float weights, computed on as they are stored:

- FP8 (e4m3 or e5m2): one byte a weight, one float32 scale per bn x bk block (DeepSeek's
  `weight_scale_inv`; the last blocks of a row or column may be partial);
- MXFP4 (gpt-oss): two e2m1 codes a byte (the even column in the low nibble), one e8m0
  power-of-two scale per 32 weights of a row.

The decode path (few tokens) decodes the codes in registers (ir.f8_matmul, ir.mx4_matmul); the
prompt path dequantizes ROW_BLOCK rows at a time (exact: a code's value times its scale is one
float32 rounding, none for MXFP4's power of two) and takes them through the float32 tiles with
every token. Activations stay float32; nothing is dequantized but a few rows at a time.
"""

import math

import numba as nb
import numpy as np

from ..storage.experts import E2M1_VALUES, E8M0_VALUES, FP8_SCALE_LIMIT, FP8_VALUES  # noqa: F401 (for callers too)
from .ir import F8_E4M3, F8_E5M2, F8_REBIAS, MX4_GROUP, f8_matmul, mx4_matmul
from .jit import JIT
from .kernels import ROW_BLOCK, rows_aligned, tiles

FP8_FORMATS = {"fp8_e4m3": F8_E4M3, "fp8_e5m2": F8_E5M2}  # QuantWeight kind -> f8_matmul's fmt


@nb.njit(**JIT)
def f8_rows(q, scales, bn, bk, values, n0, nr, wb):
    # wb[:nr] = the float32 values of rows n0 .. n0 + nr of an FP8 matrix
    K = q.shape[1]
    for r in range(nr):
        srow = scales[(n0 + r) // bn]
        for k in range(K):
            wb[r, k] = values[q[n0 + r, k]] * srow[k // bk]


@nb.njit(**JIT)
def mx4_rows(q, scales, e8m0, values, n0, nr, wb):
    # wb[:nr] = the float32 values of rows n0 .. n0 + nr of an MXFP4 matrix
    half = q.shape[1]
    for r in range(nr):
        for j in range(half):
            b = q[n0 + r, j]
            s = e8m0[scales[n0 + r, j // 16]]
            wb[r, 2 * j] = values[b & 15] * s
            wb[r, 2 * j + 1] = values[b >> 4] * s


F8_X_TOP = 60  # f8_prescale puts each token's largest |x| in [2 ** 60, 2 ** 61)


@nb.njit(**JIT)
def f8_prescale(x, rebias):
    # x [T, K] -> (xs [T, K], xf [T]): xs[t] = x[t] * 2 ** k_t, xf[t] = 2 ** (rebias - k_t),
    # both exact. The decode kernel multiplies x with the codes read as value * 2 ** -rebias
    # and scales a block's sum once; k_t (0 .. 100, from the token's own largest |x|, so a
    # token's bits do not depend on the tokens beside it) keeps every product of a code and an
    # activation far inside float32's normal range, where it has its full 24 bits: the largest
    # 448 * 2 ** 61 * 2 ** -120, the smallest that matters some 2 ** 70 below it
    T, K = x.shape
    xs = np.empty((T, K), np.float32)
    xf = np.empty(T, np.float32)
    for t in range(T):
        m = np.float32(0.0)
        for k in range(K):
            m = max(m, abs(x[t, k]))
        k_t = 0
        if m > 0 and np.isfinite(m):
            k_t = min(100, max(0, F8_X_TOP + 1 - math.frexp(m)[1]))
        up = np.float32(2.0 ** k_t)
        for k in range(K):
            xs[t, k] = x[t, k] * up
        xf[t] = np.float32(2.0 ** (rebias - k_t))
    return xs, xf


def _make_f8(fmt: int):
    # the FP8 kernels of one format (a constant, so the decoder is compiled in)
    limit = np.float32(FP8_SCALE_LIMIT["fp8_e4m3" if fmt == F8_E4M3 else "fp8_e5m2"])
    rebias = F8_REBIAS[fmt]

    @nb.njit(**JIT)
    def linear_f8(x, q, scales, bn, bk, out):
        # the decode path: x [T, K] f32, q [N, K] uint8 codes, scales [ceil(N/bn), ceil(K/bk)] f32,
        # out [T, N] = x @ dequant(q).T
        T, K = x.shape
        N = q.shape[0]
        if (q.shape[1] != K or out.shape[0] != T or out.shape[1] != N or bn < 1 or bk < 1
                or scales.shape[0] != (N + bn - 1) // bn or scales.shape[1] != (K + bk - 1) // bk):
            raise ValueError("fp8 kernel: weight, scale, activation and output shapes do not match")
        for v in scales.ravel():
            if not abs(v) < limit:
                raise ValueError("fp8 kernel: a scale out of range")
        xs, xf = f8_prescale(x, rebias)
        f8_matmul(xs, xf, q, scales, bn, bk, out, fmt, 0, T, 0, N)

    @nb.njit(**JIT)
    def linear_f8_tok(x, q, scales, bn, bk, values, out):
        # the prompt-token path: ROW_BLOCK rows dequantized, then tiled with every token
        T, K = x.shape
        N = q.shape[0]
        if (q.shape[1] != K or out.shape[0] != T or out.shape[1] != N or bn < 1 or bk < 1
                or scales.shape[0] != (N + bn - 1) // bn or scales.shape[1] != (K + bk - 1) // bk):
            raise ValueError("fp8 kernel: weight, scale, activation and output shapes do not match")
        wb = rows_aligned(ROW_BLOCK, K)
        for n0 in range(0, N, ROW_BLOCK):
            nr = min(ROW_BLOCK, N - n0)
            f8_rows(q, scales, bn, bk, values, n0, nr, wb)
            tiles(x, wb, 0, nr, out, n0)

    return linear_f8, linear_f8_tok


LINEAR_F8, LINEAR_F8_TOK = {}, {}  # fmt -> kernel
for _f in (F8_E4M3, F8_E5M2):
    LINEAR_F8[_f], LINEAR_F8_TOK[_f] = _make_f8(_f)


@nb.njit(**JIT)
def _mx4_place(x, xp, t, c0, lanes):
    # the 8 * lanes columns from c0 of token t, one group of lanes / 4 blocks: the column of
    # nibble h of byte j of lane k at lanes (4h + j) + k
    for h in range(2):
        for j in range(4):
            for k in range(lanes):
                xp[t, c0 + lanes * (4 * h + j) + k] = x[t, c0 + 2 * (4 * k + j) + h]


@nb.njit(**JIT)
def mx4_layout(x):
    # x [T, K] in the order mx4_matmul reads it: groups of MX4_GROUP 32-column blocks (each
    # read as 4 MX4_GROUP lanes of 4 bytes of codes), a pair of blocks left over as a group of
    # 8 lanes, an odd last block's even columns, then its odd ones
    T, K = x.shape
    xp = np.empty((T, K), np.float32)
    blocks = K // 32
    for t in range(T):
        c0 = 0
        for _ in range(blocks // MX4_GROUP):
            _mx4_place(x, xp, t, c0, 4 * MX4_GROUP)
            c0 += 32 * MX4_GROUP
        if blocks % MX4_GROUP >= 2:
            _mx4_place(x, xp, t, c0, 8)
        if blocks % 2:
            c0 = K - 32
            for i in range(16):
                xp[t, c0 + i] = x[t, c0 + 2 * i]
                xp[t, c0 + 16 + i] = x[t, c0 + 2 * i + 1]
    return xp


@nb.njit(**JIT)
def linear_mx4(x, q, scales, e8m0, out):
    # the decode path: x [T, K] f32, q [N, K/2] uint8, scales [N, K/32] uint8 e8m0, out [T, N]
    T, K = x.shape
    N = q.shape[0]
    if K % 32 or q.shape[1] * 2 != K or scales.shape[0] != N or scales.shape[1] * 32 != K or out.shape[0] != T \
            or out.shape[1] != N or e8m0.shape[0] != 256:
        raise ValueError("mxfp4 kernel: weight, scale, activation and output shapes do not match")
    mx4_matmul(mx4_layout(x), q, scales, e8m0, out, 0, T, 0, N)


@nb.njit(**JIT)
def linear_mx4_tok(x, q, scales, e8m0, values, out):
    # the prompt-token path of MXFP4: ROW_BLOCK rows dequantized, then tiled with every token
    T, K = x.shape
    N = q.shape[0]
    if K % 32 or q.shape[1] * 2 != K or scales.shape[0] != N or scales.shape[1] * 32 != K or out.shape[0] != T \
            or out.shape[1] != N or e8m0.shape[0] != 256:
        raise ValueError("mxfp4 kernel: weight, scale, activation and output shapes do not match")
    wb = rows_aligned(ROW_BLOCK, K)
    for n0 in range(0, N, ROW_BLOCK):
        nr = min(ROW_BLOCK, N - n0)
        mx4_rows(q, scales, e8m0, values, n0, nr, wb)
        tiles(x, wb, 0, nr, out, n0)
