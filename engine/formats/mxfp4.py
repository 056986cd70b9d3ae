"""MXFP4 weights' kernels (gpt-oss; storage/formats/mxfp4.py's layout: two e2m1 codes a byte,
one e8m0 power-of-two scale per 32 weights of a row), computed on as stored. The decode path
decodes groups of blocks in registers by a byte-table shuffle where the CPU has one
(mx4_matmul, x laid out to match by mx4_layout); the prompt path widens ROW_BLOCK rows
exactly (mx4_rows: a code's value times a power of two) and tiles them with every token.
"""

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from ...storage.experts import QuantWeight, mxfp4
from ..ir import (
    F32,
    float_ty,
    has_feature,
    host_features,
    hsum,
    prefetch,
    row_at,
    rows_kernel,
    splat_i32,
    splat_lanes,
    to8,
    vload,
)
from ..jit import JIT
from ..kernels import ROW_BLOCK, rows_aligned, tiles

KINDS = ("mxfp4",)  # the storage formats these kernels compute on


def _decode_e2m1(builder, n):
    # n: i32 lanes holding one FP4 (e2m1) code each (0..15) -> float32 lanes of its value:
    # 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    ty, fty = n.type, float_ty(n.type)
    c = lambda v: splat_i32(ty, v)  # noqa: E731
    mag = builder.and_(n, c(7))
    sign = builder.shl(builder.and_(n, c(8)), c(28))
    normal = builder.add(builder.shl(mag, c(22)), c(126 << 23))  # exponent e - 1, one mantissa bit
    sub = builder.bitcast(builder.fmul(builder.uitofp(mag, fty), ir.Constant(fty, [0.5] * ty.count)), ty)  # 0, 0.5
    bits = builder.select(builder.icmp_unsigned("<", mag, c(2)), sub, normal)
    return builder.bitcast(builder.or_(bits, sign), fty)


# e2m1 codes -> twice their value, an int8 each: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives
_E2M1_TWICE = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


# MXFP4 blocks of 32 codes the decode path decodes at once: four (64 bytes, 16 lanes) where the
# CPU has 512-bit byte shuffles (AVX-512BW), else two (32 bytes, 8 lanes). On the AMD EPYC of
# family 26 (Zen 5) one thread decoded 8-lane pairs at 11-12 GB/s of MXFP4, a third of its
# 36 GB/s memory read: the loop is bound by its instructions, and a 16-lane one does the same
# work in half of them. mx4_layout lays x out for the same grouping.
MX4_GROUP = 4 if "+avx512bw" in host_features() else 2


def _e2m1_block(context, builder, b, scale):
    # b: <16 x i8> bytes of 32 codes; scale: <16 x float> of the block's scale -> (low codes'
    # weights, high codes' weights), <16 x float> each: value(code) * scale, exact (a power of
    # two times a value of two significant bits). By a byte-table lookup where the CPU has one
    # (x86's pshufb, SSSE3: the values doubled are small integers: a shuffle, a widening, a
    # conversion, and the scale halved), else in registers (_decode_e2m1)
    v16i8, v16 = ir.VectorType(ir.IntType(8), 16), ir.VectorType(F32, 16)
    lo = builder.and_(b, ir.Constant(v16i8, [15] * 16))
    hi = builder.lshr(b, ir.Constant(v16i8, [4] * 16))
    if has_feature(context, "ssse3"):
        shuf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i8, [v16i8, v16i8]),
                                              "llvm.x86.ssse3.pshuf.b.128")
        table = ir.Constant(v16i8, [v & 0xFF for v in _E2M1_TWICE])
        half = builder.fmul(scale, ir.Constant(v16, [0.5] * 16))
        return tuple(builder.fmul(builder.sitofp(builder.call(shuf, [table, c]), v16), half) for c in (lo, hi))
    v16i32 = ir.VectorType(ir.IntType(32), 16)
    return tuple(builder.fmul(_decode_e2m1(builder, builder.zext(c, v16i32)), scale) for c in (lo, hi))


MX4_PAIR_SHIFT = 25  # a group's codes decode to value * 2 ** 25 (below); the row's sum is scaled back once
_PSHUFB = {8: ("avx2", "llvm.x86.avx2.pshuf.b"), 16: ("avx512bw", "llvm.x86.avx512.pshuf.b.512")}  # lanes ->


def _top_byte(builder, w, j: int):
    # i32 lanes: byte j of each lane moved to the top (bits 24-31), the bytes below it under it
    return w if j == 3 else builder.shl(w, splat_i32(w.type, 24 - 8 * j))


def _e2m1_group(context, builder, w):
    # w: <L x i32>, the 4L bytes of L / 4 MXFP4 blocks (lanes 4b .. 4b + 3 block b) ->
    # [(h, j) -> <L x float>] for h = 0 (low nibbles), 1 (high) and byte j of every lane, in
    # the order 4h + j: value(code) * 2 ** 25, exact. Where the CPU has the byte shuffle of
    # that width (AVX2 for 8 lanes, AVX-512BW for 16), one table lookup per nibble gives twice
    # each value as a byte, and a byte moved to the top of its lane (shifts and a mask, no
    # widening shuffle: the widening is what bound the kernel) converts to 2 * value * 2 ** 24;
    # elsewhere the nibble is decoded in registers.
    lanes = w.type.count
    vi8, vf = ir.VectorType(ir.IntType(8), 4 * lanes), ir.VectorType(F32, lanes)
    c = lambda v: splat_i32(w.type, v)  # noqa: E731
    feature, name = _PSHUFB.get(lanes, ("", ""))
    if feature and has_feature(context, feature):
        b = builder.bitcast(w, vi8)
        shuf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi8, [vi8, vi8]), name)
        table = ir.Constant(vi8, [v & 0xFF for v in _E2M1_TWICE] * (lanes // 4))
        nibbles = (builder.and_(b, ir.Constant(vi8, [15] * 4 * lanes)), builder.lshr(b, ir.Constant(vi8, [4] * 4 * lanes)))
        out = []
        for nib in nibbles:
            twice = builder.bitcast(builder.call(shuf, [table, nib]), w.type)
            out += [builder.sitofp(builder.and_(_top_byte(builder, twice, j), c(-0x1000000)), vf) for j in range(4)]
        return out
    k = ir.Constant(vf, [float(2 ** MX4_PAIR_SHIFT)] * lanes)
    return [builder.fmul(_decode_e2m1(builder, builder.and_(builder.lshr(w, c(8 * j + 4 * h)), c(15))), k)
            for h in range(2) for j in range(4)]


def mx4_rows_dot(context, builder, sig, args, t0, n, nt: int):
    # emits out[t0 + i, n] = x[t0 + i] . dequant(q[n]) for i < nt, MXFP4 (a byte holds the even
    # column's code in its low nibble, the odd one's in the high), x in mx4_layout's
    # order. Blocks in groups of MX4_GROUP (4 L bytes as L lanes, decoded once for the nt
    # tokens, _e2m1_group): per token and nibble the four products with x summed, then times
    # the group's scales (lanes 4b .. 4b + 3 block b's) into that nibble's sum; with groups of
    # four, a pair of blocks left over is one 8-lane group into sums of its own; the sums
    # times 2 ** -25 at the end. An odd last block decoded alone (_e2m1_block, its scale in the
    # weights) into 16-lane sums of its own. A token's floats go through the same operations
    # whatever tokens are beside it.
    x_v, q_v, s_v, lut_v, out_v = args[:5]
    i64, i32 = ir.IntType(64), ir.IntType(32)
    v16, v16i8 = ir.VectorType(F32, 16), ir.VectorType(ir.IntType(8), 16)
    ts = [builder.add(t0, ir.Constant(i64, i)) for i in range(nt)]
    xrows = [row_at(context, builder, sig.args[0], x_v, t) for t in ts]
    qrow = row_at(context, builder, sig.args[1], q_v, n)
    srow = row_at(context, builder, sig.args[2], s_v, n)
    lut = context.make_array(sig.args[3])(context, builder, lut_v).data
    n_blocks = builder.extract_value(context.make_array(sig.args[2])(context, builder, s_v).shape, 1)
    fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3), "llvm.fmuladd.v16f32")
    tails = [[cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(2)] for _ in range(nt)]

    def scale(bi):
        return builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(srow, [bi])), i64)]))

    def group(first, blocks: int, sums):  # blocks first .. first + blocks - 1 into sums[token][nibble]
        lanes = 4 * blocks
        vf = ir.VectorType(F32, lanes)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{lanes}f32")
        some = ir.Constant(vf, None)
        for b in range(blocks):
            some = builder.insert_element(some, scale(builder.add(first, ir.Constant(i64, b))), ir.Constant(i32, b))
        svec = builder.shuffle_vector(some, ir.Constant(vf, None), ir.Constant(ir.VectorType(i32, lanes),
                                                                               [lane // 4 for lane in range(lanes)]))
        col, byte = builder.mul(first, ir.Constant(i64, 32)), builder.mul(first, ir.Constant(i64, 16))
        prefetch(builder, qrow, byte)
        ws = _e2m1_group(context, builder, vload(builder, qrow, byte, ir.VectorType(i32, lanes), 1))
        for i in range(nt):
            for h in range(2):
                part = None
                for j in range(4):
                    xv = vload(builder, xrows[i], builder.add(col, ir.Constant(i64, lanes * (4 * h + j))), vf, 4)
                    part = builder.fmul(xv, ws[4 * h + j]) if part is None else builder.call(fma, [xv, ws[4 * h + j], part])
                builder.store(builder.call(fma, [part, svec, builder.load(sums[i][h])]), sums[i][h])

    def zeros(lanes):
        return [[cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(F32, lanes), [0.0] * lanes))
                 for _ in range(2)] for _ in range(nt)]

    G = MX4_GROUP
    sums = zeros(4 * G)
    with cgutils.for_range(builder, builder.sdiv(n_blocks, ir.Constant(i64, G))) as g:
        group(builder.mul(g.index, ir.Constant(i64, G)), G, sums)
    pairs = None
    if G > 2:
        pairs = zeros(8)
        left = builder.srem(n_blocks, ir.Constant(i64, G))
        with builder.if_then(builder.icmp_signed(">=", left, ir.Constant(i64, 2))):
            group(builder.sub(n_blocks, left), 2, pairs)
    with builder.if_then(builder.icmp_signed("!=", builder.srem(n_blocks, ir.Constant(i64, 2)), ir.Constant(i64, 0))):
        last = builder.sub(n_blocks, ir.Constant(i64, 1))
        splat = splat_lanes(builder, scale(last), 16)
        col = builder.mul(last, ir.Constant(i64, 32))
        lo, hi = _e2m1_block(context, builder, vload(builder, qrow, builder.mul(last, ir.Constant(i64, 16)), v16i8, 1),
                             splat)
        for i in range(nt):
            for h, w in enumerate((lo, hi)):
                xv = vload(builder, xrows[i], builder.add(col, ir.Constant(i64, 16 * h)), v16, 4)
                builder.store(builder.call(fma16, [xv, w, builder.load(tails[i][h])]), tails[i][h])

    for i in range(nt):
        grouped = to8(builder, builder.fadd(builder.load(sums[i][0]), builder.load(sums[i][1])))
        if pairs is not None:
            grouped = builder.fadd(grouped, builder.fadd(builder.load(pairs[i][0]), builder.load(pairs[i][1])))
        tail = to8(builder, builder.fadd(builder.load(tails[i][0]), builder.load(tails[i][1])))
        total = builder.fadd(builder.fmul(hsum(builder, grouped), ir.Constant(F32, 2.0 ** -MX4_PAIR_SHIFT)),
                             hsum(builder, tail))
        orow = row_at(context, builder, sig.args[4], out_v, ts[i])
        builder.store(total, builder.gep(orow, [n]))


@intrinsic
def mx4_matmul(typingctx, x, q, scales, e8m0_lut, out, t_lo, t_hi, n_lo, n_hi):
    """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = x[t] . dequant(q[n]), MXFP4: x [T, K] f32
    in mx4_rows_dot's order (mx4_layout), q [N, K/2] uint8 (two e2m1 codes a byte, the
    even column's low), scales [N, K/32] uint8 (e8m0 exponents), e8m0_lut [256] f32 (2 ** (e -
    127)), out [T, N] f32; every array 2-D C-contiguous, K a multiple of 32; the caller checks."""
    return rows_kernel((x, q, scales, e8m0_lut, out, t_lo, t_hi, n_lo, n_hi), (x, q, scales, out), mx4_rows_dot)


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


def linear(x: np.ndarray, w, out: np.ndarray, prompt: bool = False) -> None:
    # x [T, D] f32 C-contiguous, w an MXFP4 QuantWeight [N, D], out [T, N] f32
    if prompt:
        linear_mx4_tok(x, w.q, w.scales, mxfp4.E8M0_VALUES, mxfp4.E2M1_VALUES, out)
    else:
        linear_mx4(x, w.q, w.scales, mxfp4.E8M0_VALUES, out)


def warm(kinds=KINDS) -> None:
    # one call of each path on tiny arrays: the compile happens at start
    w = QuantWeight("mxfp4", np.ones((2, 32), np.uint8), np.full((2, 2), 127, np.uint8), 32)
    for prompt in (False, True):
        linear(np.ones((1, 64), np.float32), w, np.empty((1, 2), np.float32), prompt)
