"""int8 weights' kernels (storage/formats/int8.py's layout), computed on as they are stored,
one float16 scale per group; nothing is dequantized but a few rows at a time. The decode
path (matmul_q8) sums x * q a group at a time; the prompt path widens ROW_BLOCK rows exactly
(q8_rows, which the crew's prompt-path expert job calls too) and tiles them with every token.
"""

import numba as nb
import numpy as np

from ...storage.experts import QuantWeight
from ..jit import JIT, JIT_FAST
from ..kernels import ROW_BLOCK, f16_lut, rows_aligned, tiles

KINDS = ("int8",)  # the storage formats these kernels compute on


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


def linear(x: np.ndarray, w, out: np.ndarray, prompt: bool = False) -> None:
    # x [T, D] f32 C-contiguous, w an int8 QuantWeight [N, D], out [T, N] f32
    kernel = linear_q8_tok if prompt else matmul_q8
    kernel(x, w.q, w.scales.view(np.uint16), w.group_size, f16_lut(), out)


def warm(kinds=KINDS) -> None:
    # one call of each path on tiny arrays: the compile happens at start (engine/layers.init)
    w = QuantWeight("int8", np.ones((2, 4), np.int8), np.ones((2, 2), np.float16), 2)
    for prompt in (False, True):
        linear(np.ones((1, 4), np.float32), w, np.empty((1, 2), np.float32), prompt)
