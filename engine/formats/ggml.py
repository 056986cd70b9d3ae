"""The kernels of GGUF's block formats (storage/formats/ggml.py: a row is a run of blocks
that carry their own scales), computed on as the file stores them. Each format has a block
decoder: the float32 value of each of a block's weights, bit for bit what the `gguf`
package's numpy dequantisation gives (the same float32 operations in the same order, none
fused: these functions are compiled without fast-math). Around it, the prompt path of every
format (`ggml_matmul`): ROW_BLOCK rows decoded, then tiled with every token (kernels.tiles).
The decode path of Q4_K, Q6_K and Q8_0 (what Q4_K_M, Q5_K_M's dense part and Q8_0 files are
made of) decodes each block in registers into the tokens' sums (`ggml_dot`, the IR of
ggml_ir.py, the same weights' values); the other formats' decode path is the prompt path.
A row's result is the same alone or batched on either path; the two differ in rounding
only. A dense matrix takes each row of a step by its sequence's path (`linear` with a row
mask): re-decoding the matrix every two tokens of a prompt would cost its prefill several
times over. Large matrices (a dense projection, the output head) take their rows in parallel.

Measured one thread on the Zen 5, a 768 x 2048 matrix, one token, GB/s of blocks: Q4_K 4.5
(rows then tiles) -> 10.4-11.0 (row dot), Q6_K 7.3 -> 14.0, Q8_0 11.4 -> 26-32. In numba's
loops, summing a decoded block into each token straight away had been no faster (the lanes
went through memory).
"""

import numba as nb
import numpy as np

from ...storage.experts import FORMATS, QuantWeight, ggml
from ..jit import JIT
from ..kernels import PARALLEL_MIN_ELEMENTS, ROW_BLOCK, f16_lut, rows_aligned, silu_mul, tiles
from .ggml_ir import (
    LANES,
    dot_mxfp4,
    dot_mxfp4_8,
    dot_q4_0,
    dot_q4_0_8,
    dot_q4_k,
    dot_q4_k_8,
    dot_q5_k,
    dot_q5_k_8,
    dot_q6_k,
    dot_q6_k_8,
    dot_q8_0,
    dot_q8_0_8,
)

KINDS = tuple(ggml.TYPES)  # the storage formats these kernels compute on
MXFP4_VALUES, IQ4_VALUES, E8M0_HALF = ggml.MXFP4_VALUES, ggml.IQ4_VALUES, ggml.e8m0_half()
CODE = {kind: FORMATS[kind].code for kind in KINDS}


@nb.njit(inline="always", **JIT)
def _f16(b, o, lut):
    # the little-endian float16 at bytes o, o + 1 of b, as float32 (exact)
    return lut[np.int64(b[o]) | (np.int64(b[o + 1]) << 8)]


@nb.njit(inline="always", **JIT)
def _f(v):
    # an integer code as float32, converted from 32 bits: numba's integer arithmetic widens to
    # 64, and LLVM left loops converting from 64-bit integers scalar (Q4_K's decoder at a
    # third of the speed)
    return np.float32(np.int32(v))


@nb.njit(inline="always", **JIT)
def _i8(v):
    # a byte read as a signed int8
    return (np.int32(v) ^ 128) - 128


# ---- one block each: b a row's bytes, o the block's first byte, w[c : c + block weights] out.
# n32 is 32, known only at run time: loops of a constant 16 or 32 were unrolled whole, and
# LLVM then left them scalar (Q4_K's rows: 3.2 -> 9.9 G weights/s with n32, one thread) ----

@nb.njit(inline="always", **JIT)
def _q4_0(b, o, lut, w, c, n32):
    d = _f16(b, o, lut)
    for j in range(n32 // 2):
        v = np.int32(b[o + 2 + j])
        w[c + j] = d * _f((v & 15) - 8)
        w[c + 16 + j] = d * _f((v >> 4) - 8)


@nb.njit(inline="always", **JIT)
def _q4_1(b, o, lut, w, c, n32):
    d, m = _f16(b, o, lut), _f16(b, o + 2, lut)
    for j in range(n32 // 2):
        v = np.int32(b[o + 4 + j])
        w[c + j] = d * _f(v & 15) + m
        w[c + 16 + j] = d * _f(v >> 4) + m


@nb.njit(inline="always", **JIT)
def _qh32(b, o):
    return np.int64(b[o]) | (np.int64(b[o + 1]) << 8) | (np.int64(b[o + 2]) << 16) | (np.int64(b[o + 3]) << 24)


@nb.njit(inline="always", **JIT)
def _q5_0(b, o, lut, w, c, n32):
    d, qh = _f16(b, o, lut), _qh32(b, o + 2)
    for j in range(n32 // 2):
        v = np.int64(b[o + 6 + j])
        w[c + j] = d * _f(((v & 15) | (((qh >> j) & 1) << 4)) - 16)
        w[c + 16 + j] = d * _f(((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16)


@nb.njit(inline="always", **JIT)
def _q5_1(b, o, lut, w, c, n32):
    d, m, qh = _f16(b, o, lut), _f16(b, o + 2, lut), _qh32(b, o + 4)
    for j in range(n32 // 2):
        v = np.int64(b[o + 8 + j])
        w[c + j] = d * _f((v & 15) | (((qh >> j) & 1) << 4)) + m
        w[c + 16 + j] = d * _f((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m


@nb.njit(inline="always", **JIT)
def _q8_0(b, o, lut, w, c, n32):
    d = _f16(b, o, lut)
    for j in range(n32):
        w[c + j] = _f(_i8(b[o + 2 + j])) * d


@nb.njit(inline="always", **JIT)
def _q2_k(b, o, lut, w, c, n32):
    # scales [16] (low nibble scale, high nibble minimum, per 16 weights), qs [64] (2 bits a
    # weight: weight 128 h + 32 s + i in bits 2 s of byte 32 h + i), d, dmin
    d, dmin = _f16(b, o + 80, lut), _f16(b, o + 82, lut)
    for h in range(2):
        for s in range(4):
            sc0, sc1 = np.int32(b[o + 8 * h + 2 * s]), np.int32(b[o + 8 * h + 2 * s + 1])
            dl0, ml0, dl1, ml1 = d * _f(sc0 & 15), dmin * _f(sc0 >> 4), d * _f(sc1 & 15), dmin * _f(sc1 >> 4)
            for i in range(n32):
                q = _f((np.int32(b[o + 16 + 32 * h + i]) >> (2 * s)) & 3)
                w[c + 128 * h + 32 * s + i] = (dl0 * q - ml0) if i < 16 else (dl1 * q - ml1)


@nb.njit(inline="always", **JIT)
def _q3_k(b, o, lut, w, c, n32):
    # hmask [32] (weight 32 j + i's high bit, set meaning no -4, at bit j of byte i), qs [64]
    # (2 bits, as Q2_K), scales [12] (sixteen 6-bit scales, biased by 32), d
    d = _f16(b, o + 108, lut)
    for h in range(2):
        for s in range(4):
            dl0, dl1 = d * _f(_q3_scale(b, o, 8 * h + 2 * s)), d * _f(_q3_scale(b, o, 8 * h + 2 * s + 1))
            for i in range(n32):
                q = (np.int32(b[o + 32 + 32 * h + i]) >> (2 * s)) & 3
                hb = (np.int32(b[o + i]) >> (4 * h + s)) & 1
                w[c + 128 * h + 32 * s + i] = (dl0 if i < 16 else dl1) * _f(q - ((hb ^ 1) << 2))


@nb.njit(inline="always", **JIT)
def _q3_scale(b, o, k):
    # Q3_K's sub-block k's scale: 4 low bits from scales[k] (k < 8) or its high nibble
    # (scales[k - 8]), 2 high bits from scales[8 + k % 4], biased by 32
    lo = (np.int32(b[o + 96 + k]) & 15) if k < 8 else (np.int32(b[o + 96 + k - 8]) >> 4)
    hi = (np.int32(b[o + 104 + k % 4]) >> (2 * (k // 4))) & 3
    return (lo | (hi << 4)) - 32


@nb.njit(inline="always", **JIT)
def _scale_min_k4(b, o, j):
    # the 6-bit scale and minimum of sub-block j (of 8) from the 12 bytes at o (ggml's get_scale_min_k4)
    if j < 4:
        return np.int32(b[o + j]) & 63, np.int32(b[o + j + 4]) & 63
    return ((np.int32(b[o + j + 4]) & 15) | ((np.int32(b[o + j - 4]) >> 6) << 4),
            (np.int32(b[o + j + 4]) >> 4) | ((np.int32(b[o + j]) >> 6) << 4))


@nb.njit(inline="always", **JIT)
def _k4(b, o, lut, w, c, n32, high):
    # Q4_K (high False): d, dmin, scales [12], qs [128] (weight 64 k + i: low nibble of byte
    # 32 k + i, 64 k + 32 + i: its high); Q5_K (high): qh [32] before qs, weight 32 j + i's
    # fifth bit at bit j of byte i
    d, dmin = _f16(b, o, lut), _f16(b, o + 2, lut)
    qs = o + 48 if high else o + 16
    for j in range(8):
        sc, m = _scale_min_k4(b, o + 4, j)
        d1, m1 = d * _f(sc), dmin * _f(m)
        base, shift = qs + 32 * (j // 2), 4 * (j % 2)
        for i in range(n32):
            q = (np.int32(b[base + i]) >> shift) & 15
            if high:
                q |= ((np.int32(b[o + 16 + i]) >> j) & 1) << 4
            w[c + 32 * j + i] = d1 * _f(q) - m1


@nb.njit(inline="always", **JIT)
def _q4_k(b, o, lut, w, c, n32):
    _k4(b, o, lut, w, c, n32, False)


@nb.njit(inline="always", **JIT)
def _q5_k(b, o, lut, w, c, n32):
    _k4(b, o, lut, w, c, n32, True)


@nb.njit(inline="always", **JIT)
def _q6_k(b, o, lut, w, c, n32):
    # ql [128], qh [64], scales int8 [16] (per 16 weights), d; weight 128 h + 32 s + i: low
    # nibble (s < 2) or high (s >= 2) of ql[64 h + 32 (s % 2) + i], two high bits at 2 s of qh[32 h + i]
    d = _f16(b, o + 208, lut)
    for h in range(2):
        for s in range(4):
            e0 = 128 * h + 32 * s  # two sub-blocks of 16, their scales chosen lane by lane
            ds0, ds1 = d * _f(_i8(b[o + 192 + e0 // 16])), d * _f(_i8(b[o + 193 + e0 // 16]))
            lo_at, lo_shift, hi_at = o + 64 * h + 32 * (s % 2), 4 * (s // 2), o + 128 + 32 * h
            for i in range(n32):
                lo = (np.int32(b[lo_at + i]) >> lo_shift) & 15
                hi = (np.int32(b[hi_at + i]) >> (2 * s)) & 3
                w[c + e0 + i] = (ds0 if i < 16 else ds1) * _f((lo | (hi << 4)) - 32)


@nb.njit(inline="always", **JIT)
def _iq4_nl(b, o, lut, w, c, n32):
    d = _f16(b, o, lut)
    for j in range(n32 // 2):
        v = np.int32(b[o + 2 + j])
        w[c + j] = d * IQ4_VALUES[v & 15]
        w[c + 16 + j] = d * IQ4_VALUES[v >> 4]


@nb.njit(inline="always", **JIT)
def _iq4_xs(b, o, lut, w, c, n32):
    # d, scales_h (u16: 2 high bits a sub-block), scales_l [4] (a nibble a sub-block), qs [128]
    # (sub-block j: bytes 16 j .. 16 j + 16, low nibbles its first 16 weights)
    d = _f16(b, o, lut)
    sh = np.int32(b[o + 2]) | (np.int32(b[o + 3]) << 8)
    for j in range(8):
        ls = ((np.int32(b[o + 4 + j // 2]) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
        dl = d * _f(ls - 32)
        for i in range(n32 // 2):
            v = np.int32(b[o + 8 + 16 * j + i])
            w[c + 32 * j + i] = dl * IQ4_VALUES[v & 15]
            w[c + 32 * j + 16 + i] = dl * IQ4_VALUES[v >> 4]


@nb.njit(inline="always", **JIT)
def _gguf_mxfp4(b, o, lut, w, c, n32):
    d = E8M0_HALF[b[o]]
    for j in range(n32 // 2):
        v = np.int32(b[o + 1 + j])
        w[c + j] = d * MXFP4_VALUES[v & 15]
        w[c + 16 + j] = d * MXFP4_VALUES[v >> 4]


# ---- around a block decoder: rows for tiles, and the decode path's dot products ----

def _make(block, qk: int, nbytes: int):
    @nb.njit(**JIT)
    def rows(q, lut, n0, nr, wb):
        # wb[:nr] = the float32 values of rows n0 .. n0 + nr (q uint8 [N, K / qk * nbytes])
        nblk = q.shape[1] // nbytes
        n32 = min(32, wb.shape[1])  # (32: a row holds a block at least)
        for r in range(nr):
            row, out = q[n0 + r], wb[r]
            for bi in range(nblk):
                block(row, bi * nbytes, lut, out, bi * qk, n32)

    return rows


_BLOCKS = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0, "q2_k": _q2_k, "q3_k": _q3_k,
           "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "iq4_nl": _iq4_nl, "iq4_xs": _iq4_xs, "gguf_mxfp4": _gguf_mxfp4}
assert set(_BLOCKS) == set(KINDS), "every GGUF block format has its decoder"
ROWS = {kind: _make(_BLOCKS[kind], *ggml.TYPES[kind][1:]) for kind in KINDS}
(_R_Q4_0, _R_Q4_1, _R_Q5_0, _R_Q5_1, _R_Q8_0, _R_Q2_K, _R_Q3_K, _R_Q4_K, _R_Q5_K, _R_Q6_K, _R_IQ4_NL, _R_IQ4_XS,
 _R_MXFP4) = (ROWS[k] for k in KINDS)
(C_Q4_0, C_Q4_1, C_Q5_0, C_Q5_1, C_Q8_0, C_Q2_K, C_Q3_K, C_Q4_K, C_Q5_K, C_Q6_K, C_IQ4_NL, C_IQ4_XS,
 C_MXFP4) = (CODE[k] for k in KINDS)


@nb.njit(**JIT)
def ggml_rows(code, q, lut, n0, nr, wb):
    # wb[:nr] = rows n0 .. n0 + nr of a matrix in the block format of code `code`, as float32
    # (the crew's prompt-path expert job widens by it: engine/jobs.py)
    if code == C_Q4_K:
        _R_Q4_K(q, lut, n0, nr, wb)
    elif code == C_Q6_K:
        _R_Q6_K(q, lut, n0, nr, wb)
    elif code == C_Q8_0:
        _R_Q8_0(q, lut, n0, nr, wb)
    elif code == C_Q5_K:
        _R_Q5_K(q, lut, n0, nr, wb)
    elif code == C_Q4_0:
        _R_Q4_0(q, lut, n0, nr, wb)
    elif code == C_Q4_1:
        _R_Q4_1(q, lut, n0, nr, wb)
    elif code == C_Q5_0:
        _R_Q5_0(q, lut, n0, nr, wb)
    elif code == C_Q5_1:
        _R_Q5_1(q, lut, n0, nr, wb)
    elif code == C_Q2_K:
        _R_Q2_K(q, lut, n0, nr, wb)
    elif code == C_Q3_K:
        _R_Q3_K(q, lut, n0, nr, wb)
    elif code == C_IQ4_NL:
        _R_IQ4_NL(q, lut, n0, nr, wb)
    elif code == C_IQ4_XS:
        _R_IQ4_XS(q, lut, n0, nr, wb)
    elif code == C_MXFP4:
        _R_MXFP4(q, lut, n0, nr, wb)


# One matmul for every format, which widens by code: every kernel that calls tiles carries
# its own copy of them (numba links a callee's code into each caller), and a matmul per format
# made a process that compiled them in 140 MB larger (colictl run's peak RSS)
@nb.njit(**JIT)
def ggml_matmul(code, x, q, lut, out, n_lo, n_hi):
    # out[:, n] = x @ row n for n_lo <= n < n_hi: ROW_BLOCK rows decoded, then tiled with every token
    wb = rows_aligned(ROW_BLOCK, x.shape[1])
    for n0 in range(n_lo, n_hi, ROW_BLOCK):
        nr = min(ROW_BLOCK, n_hi - n0)
        ggml_rows(code, q, lut, n0, nr, wb)
        tiles(x, wb, 0, nr, out, n0)


@nb.njit(parallel=True, **JIT)
def ggml_matmul_par(code, x, q, lut, out):
    N = q.shape[0]
    step = 3 * ROW_BLOCK
    for k in nb.prange((N + step - 1) // step):
        ggml_matmul(code, x, q, lut, out, step * k, min(N, step * k + step))


# the decode path where a format has its IR row dot (engine/formats/ggml_ir.py): a kernel of its
# own, not a branch of ggml_matmul (which would then carry a copy of tiles more)
DOT_KINDS = ("q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "gguf_mxfp4")


@nb.njit(**JIT)
def run_sums(x):
    # [T, K / 32] the sums of x's runs of 32 columns, in column order
    T, K = x.shape
    xs = np.zeros((T, K // 32), np.float32)
    for t in range(T):
        for j in range(K // 32):
            acc = np.float32(0.0)
            for c in range(32 * j, 32 * j + 32):
                acc += x[t, c]
            xs[t, j] = acc
    return xs


@nb.njit(**JIT)
def ggml_dot(code, lanes, x, q, lut, out, n_lo, n_hi):
    # out[:, n] = x @ row n for n_lo <= n < n_hi, each block decoded in registers for a few
    # tokens, in vectors of `lanes` (16 or 8: ggml_ir.LANES)
    T = x.shape[0]
    xs = run_sums(x) if code == C_Q4_K or code == C_Q5_K else np.empty((T, 0), np.float32)
    if code == C_Q4_K:
        if lanes == 16:
            dot_q4_k(x, xs, q, lut, out, 0, T, n_lo, n_hi)
        else:
            dot_q4_k_8(x, xs, q, lut, out, 0, T, n_lo, n_hi)
    elif code == C_Q5_K:
        if lanes == 16:
            dot_q5_k(x, xs, q, lut, out, 0, T, n_lo, n_hi)
        else:
            dot_q5_k_8(x, xs, q, lut, out, 0, T, n_lo, n_hi)
    elif code == C_Q6_K:
        if lanes == 16:
            dot_q6_k(x, xs, q, lut, out, 0, T, n_lo, n_hi)
        else:
            dot_q6_k_8(x, xs, q, lut, out, 0, T, n_lo, n_hi)
    elif code == C_Q8_0:
        if lanes == 16:
            dot_q8_0(x, xs, q, lut, out, 0, T, n_lo, n_hi)
        else:
            dot_q8_0_8(x, xs, q, lut, out, 0, T, n_lo, n_hi)
    elif code == C_Q4_0:
        if lanes == 16:
            dot_q4_0(x, xs, q, lut, out, 0, T, n_lo, n_hi)
        else:
            dot_q4_0_8(x, xs, q, lut, out, 0, T, n_lo, n_hi)
    elif code == C_MXFP4:
        if lanes == 16:
            dot_mxfp4(x, xs, q, lut, out, 0, T, n_lo, n_hi)
        else:
            dot_mxfp4_8(x, xs, q, lut, out, 0, T, n_lo, n_hi)


@nb.njit(parallel=True, **JIT)
def ggml_dot_par(code, lanes, x, q, lut, out):
    N = q.shape[0]
    step = 3 * ROW_BLOCK
    for k in nb.prange((N + step - 1) // step):
        ggml_dot(code, lanes, x, q, lut, out, step * k, min(N, step * k + step))


@nb.njit(**JIT)
def ggml_ffn(codes, lanes, x, gq, uq, dq, lut, out):
    # out [T, D] = down(silu(gate x) * up x) for x [T, D], each matrix by its IR row dot (codes:
    # gate's, up's, down's): an expert's decode rows in one call (its three products, and the
    # activation between them, were six calls and their Python for each expert of a step)
    T, I, D = x.shape[0], gq.shape[0], dq.shape[0]
    g, u = np.empty((T, I), np.float32), np.empty((T, I), np.float32)
    ggml_dot(codes[0], lanes, x, gq, lut, g, 0, I)
    ggml_dot(codes[1], lanes, x, uq, lut, u, 0, I)
    silu_mul(g, u, g)
    ggml_dot(codes[2], lanes, g, dq, lut, out, 0, D)


def swiglu(x: np.ndarray, gate, up, down, prompt: bool) -> np.ndarray:
    # x [T, D] f32 C-contiguous; gate, up [I, D], down [D, I] QuantWeights in GGUF block
    # formats -> [T, D]: an expert's rows, all a prompt's (prompt) or all decode rows
    T, D = x.shape
    I = gate.q.shape[0]
    fits = (up.q.shape[0] == I and down.q.shape[0] == D and gate.q.shape[1] == row_bytes(gate.kind, D)
            and up.q.shape[1] == row_bytes(up.kind, D) and down.q.shape[1] == row_bytes(down.kind, I))
    if not prompt and fits and all(w.kind in DOT_KINDS and w.q.flags.c_contiguous for w in (gate, up, down)):
        out = np.empty((T, D), np.float32)
        codes = np.array([CODE[w.kind] for w in (gate, up, down)], np.int64)
        ggml_ffn(codes, LANES, x, gate.q, up.q, down.q, f16_lut(), out)
        return out
    g, u = (np.empty((T, I), np.float32) for _ in range(2))
    linear(x, gate, g, prompt)
    linear(x, up, u, prompt)
    silu_mul(g, u, g)
    out = np.empty((T, D), np.float32)
    linear(g, down, out, prompt)
    return out


def row_bytes(kind: str, K: int) -> int:
    _, qk, nbytes = ggml.TYPES[kind]
    return K // qk * nbytes


def linear(x: np.ndarray, w, out: np.ndarray, prompt=False) -> None:
    # x [T, D] f32 C-contiguous, w a QuantWeight [N, D] in a GGUF block format, out [T, N] f32.
    # prompt: the rows are a prompt's (rows then tiles), or not (each block decoded in registers
    # where the format has an IR row dot: DOT_KINDS), or a bool a row (None: not known, the
    # decode path): a dense matrix's rows of a step, each row by its sequence, as alone. The
    # decode path alone for a prompt's dense rows re-decodes the matrix every two tokens
    if prompt is None:
        prompt = False
    elif isinstance(prompt, np.ndarray):
        if prompt.all() or not prompt.any():
            prompt = bool(prompt[0]) if len(prompt) else False
        else:
            for rows, path in ((np.flatnonzero(prompt), True), (np.flatnonzero(~prompt), False)):
                part = np.empty((len(rows), out.shape[1]), np.float32)
                linear(np.ascontiguousarray(x[rows]), w, part, path)
                out[rows] = part
            return
    T, K = x.shape
    N = w.q.shape[0]
    _, qk, _ = ggml.TYPES[w.kind]
    if (K % qk or w.q.dtype != np.uint8 or w.q.shape[1] != row_bytes(w.kind, K) or out.shape != (T, N)
            or not (w.q.flags.c_contiguous and out.flags.c_contiguous and x.flags.c_contiguous)):
        raise ValueError("gguf kernel: weight, activation and output shapes do not match")
    par = N * K >= PARALLEL_MIN_ELEMENTS
    if not prompt and w.kind in DOT_KINDS:
        (ggml_dot_par(CODE[w.kind], LANES, x, w.q, f16_lut(), out) if par
         else ggml_dot(CODE[w.kind], LANES, x, w.q, f16_lut(), out, 0, N))
    elif par:
        ggml_matmul_par(CODE[w.kind], x, w.q, f16_lut(), out)
    else:
        ggml_matmul(CODE[w.kind], x, w.q, f16_lut(), out, 0, N)


def warm(kinds=KINDS) -> None:
    # one call of each kernel on tiny arrays, both paths: every format's decoder is in them,
    # whichever of kinds is asked (engine/layers.init asks only for a GGUF model's)
    for rows in (2, PARALLEL_MIN_ELEMENTS // 32):  # (then the parallel kernels)
        w = QuantWeight("q8_0", np.zeros((rows, 34), np.uint8), np.zeros((rows, 0), np.uint8), 32)
        for prompt in (False, True):
            linear(np.ones((1, 32), np.float32), w, np.empty((1, rows), np.float32), prompt)
