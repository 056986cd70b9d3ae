"""FP8 weights' kernels (e4m3, e5m2; storage/formats/fp8.py's layout: one byte a weight, one
float32 scale per bn x bk block), computed on as stored. The decode path decodes the codes
in registers (f8_matmul: a few integer operations put a code's bits in a float32's places,
value * 2 ** -rebias; the block's scale and the power of two multiply a block's sum once);
the prompt path widens ROW_BLOCK rows exactly (f8_rows: a code's value times its scale, one
rounding) and tiles them with every token. Activations stay float32.
"""

import math

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...storage.experts import QuantWeight, fp8
from ..ir import (
    CODE_TOKENS,
    F32,
    float_ty,
    has_feature,
    hsum,
    prefetch,
    row_at,
    splat_i32,
    splat_lanes,
    to8,
    token_blocks,
    vload,
)
from ..jit import JIT
from ..kernels import ROW_BLOCK, rows_aligned, tiles

KINDS = tuple(f.name for f in fp8.FORMATS)  # the storage formats these kernels compute on


# The decoder takes the raw codes and gives float32 lanes holding exactly the value each code
# stands for times a fixed power of two, with a few integer operations (no table gather, which
# runs at ~1 GB/s here, and no half-precision conversion, which not every target has).
# fmt: the format's code (storage/formats), -> (mantissa bits, float32 exponent bias - the code's)
_FP_FORMATS = {f.code: (fp8.BITS[f.name][0], 127 - fp8.BITS[f.name][1]) for f in fp8.FORMATS}
F8_REBIAS = {f: rebias for f, (_, rebias) in _FP_FORMATS.items()}


def _decode_fp8(builder, b, fmt):
    # b: i8 lanes, one FP8 code each -> float32 lanes of value(code) * 2 ** -rebias, exactly:
    # the code's sign, exponent and mantissa shifted into a float32's places as they are
    # (sign-extending the byte puts its sign in bit 31): a normal float32 for a normal code,
    # a subnormal one for a subnormal code. Four instructions per 8 weights with the multiply
    # by x; the block's scale and 2 ** rebias multiply the block's sum once (f8_rows_dot).
    # NaN and infinity codes would read as finite values: the reader refuses weights holding
    # them (storage/fpformats.py), so none reaches a kernel.
    mb, _ = _FP_FORMATS[fmt]
    ity = ir.VectorType(ir.IntType(32), b.type.count) if isinstance(b.type, ir.VectorType) else ir.IntType(32)
    c = lambda v: splat_i32(ity, v)  # noqa: E731
    bits = builder.and_(builder.shl(builder.sext(b, ity), c(23 - mb)), c(0x80000000 | (0x7F << (23 - mb))))
    return builder.bitcast(bits, float_ty(ity))


_CHAINS = 4  # independent vector sums per token inside a scale block (a dependent chain waits on FMA latency)


def f8_rows_dot(context, builder, sig, args, t0, n, nt: int, fmt: int):
    # emits out[t0 + i, n] = x[t0 + i] . dequant(q[n]) for i < nt, x prescaled (
    # f8_prescale: x times 2 ** k_t, xf[t] = 2 ** (rebias - k_t)). Per block of bk columns:
    # L-byte chunks (L: 16 lanes with AVX-512F, else 8) decoded (_decode_fp8, value * 2 **
    # -rebias) once for the nt tokens and multiplied with x into _CHAINS sums per token (chunk c
    # of a block's groups of _CHAINS chunks into sum c; a block's last chunks into sums 0, 1,
    # ..), its last bk % L columns one
    # by one into a scalar sum; the sums added pairwise and times the block's scale times xf[t]
    # into the token's total. A token's floats go through the same operations whatever tokens
    # are beside it.
    x_v, xf_v, q_v, s_v, bn_v, bk_v, out_v = args[:7]
    i64 = ir.IntType(64)
    ts = [builder.add(t0, ir.Constant(i64, i)) for i in range(nt)]
    xrows = [row_at(context, builder, sig.args[0], x_v, t) for t in ts]
    xfs = [builder.load(builder.gep(context.make_array(sig.args[1])(context, builder, xf_v).data, [t])) for t in ts]
    qrow = row_at(context, builder, sig.args[2], q_v, n)
    srow = row_at(context, builder, sig.args[3], s_v, builder.sdiv(n, bn_v))
    K = builder.extract_value(context.make_array(sig.args[2])(context, builder, q_v).shape, 1)
    n_blocks = builder.sdiv(builder.add(K, builder.sub(bk_v, ir.Constant(i64, 1))), bk_v)
    L = 16 if has_feature(context, "avx512f") else 8  # lanes (lanes_for)
    vf, vi8 = ir.VectorType(F32, L), ir.VectorType(ir.IntType(8), L)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
    fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32] * 3), "llvm.fmuladd.f32")
    zerov, zero1 = ir.Constant(vf, [0.0] * L), ir.Constant(F32, 0.0)
    chains = [[cgutils.alloca_once_value(builder, zerov) for _ in range(_CHAINS)] for _ in range(nt)]
    tails = [cgutils.alloca_once_value(builder, zero1) for _ in range(nt)]
    totals = [cgutils.alloca_once_value(builder, zerov) for _ in range(nt)]
    tail_totals = [cgutils.alloca_once_value(builder, zero1) for _ in range(nt)]

    def chunk(off, which):  # L columns from `off` into sum `which` of every token
        w = _decode_fp8(builder, vload(builder, qrow, off, vi8, 1), fmt)
        for i in range(nt):
            xv = vload(builder, xrows[i], off, vf, 4)
            builder.store(builder.call(fma, [xv, w, builder.load(chains[i][which])]), chains[i][which])

    with cgutils.for_range(builder, n_blocks) as blk:
        for i in range(nt):
            for p in chains[i]:
                builder.store(zerov, p)
            builder.store(zero1, tails[i])
        k0 = builder.mul(blk.index, bk_v)
        k1 = builder.select(builder.icmp_signed("<", builder.add(k0, bk_v), K), builder.add(k0, bk_v), K)
        width = builder.sub(k1, k0)
        step = L * _CHAINS
        groups = builder.sdiv(width, ir.Constant(i64, step))
        with cgutils.for_range(builder, groups) as grp:
            base = builder.add(k0, builder.mul(grp.index, ir.Constant(i64, step)))
            prefetch(builder, qrow, base)
            for c in range(_CHAINS):
                chunk(builder.add(base, ir.Constant(i64, L * c)), c)
        done = builder.mul(groups, ir.Constant(i64, step))
        left = builder.sdiv(builder.sub(width, done), ir.Constant(i64, L))  # 0 .. _CHAINS - 1 chunks
        for c in range(_CHAINS - 1):
            with builder.if_then(builder.icmp_signed(">", left, ir.Constant(i64, c))):
                chunk(builder.add(builder.add(k0, done), ir.Constant(i64, L * c)), c)
        k_tail = builder.add(k0, builder.add(done, builder.mul(left, ir.Constant(i64, L))))
        with cgutils.for_range(builder, builder.sub(k1, k_tail)) as tl:
            k = builder.add(k_tail, tl.index)
            w = _decode_fp8(builder, builder.load(builder.gep(qrow, [k])), fmt)
            for i in range(nt):
                builder.store(builder.call(fma1, [builder.load(builder.gep(xrows[i], [k])), w, builder.load(tails[i])]),
                              tails[i])
        s = builder.load(builder.gep(srow, [blk.index]))
        for i in range(nt):
            f = builder.fmul(s, xfs[i])  # exact: a power of two times the scale, in range (f8_prescale)
            cs = [builder.load(p) for p in chains[i]]
            block = builder.fadd(builder.fadd(cs[0], cs[1]), builder.fadd(cs[2], cs[3]))
            builder.store(builder.call(fma, [block, splat_lanes(builder, f, L), builder.load(totals[i])]), totals[i])
            builder.store(builder.call(fma1, [builder.load(tails[i]), f, builder.load(tail_totals[i])]), tail_totals[i])
    for i in range(nt):
        orow = row_at(context, builder, sig.args[6], out_v, ts[i])
        builder.store(builder.fadd(hsum(builder, to8(builder, builder.load(totals[i]))), builder.load(tail_totals[i])),
                      builder.gep(orow, [n]))


@intrinsic
def f8_matmul(typingctx, x, xf, q, scales, bn, bk, out, fmt, t_lo, t_hi, n_lo, n_hi):
    """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = x[t] . dequant(q[n]) * xf[t] * 2 **
    -rebias, which with f8_prescale's x [T, K] f32 and xf [T] f32 is the original
    activations' product with the weights; q [N, K] uint8 FP8 codes
    of format `fmt` (the format's code in storage/formats, a compile-time constant), scales [ceil(N / bn),
    ceil(K / bk)] f32, one per bn x bk block (the last ones may be partial), out [T, N] f32;
    every array C-contiguous; the caller checks shapes and ranges. The codes are decoded in
    registers (_decode_fp8, f8_rows_dot); a (token, row) result is the same alone or batched,
    in every process."""
    arrays = (x, q, scales, out)
    if not (isinstance(fmt, types.IntegerLiteral) and fmt.literal_value in _FP_FORMATS
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)
            and isinstance(xf, types.Array) and xf.ndim == 1 and xf.dtype == types.float32
            and all(isinstance(v, types.Integer) for v in (bn, bk, t_lo, t_hi, n_lo, n_hi))):
        return None
    f = fmt.literal_value
    sig = types.void(x, xf, q, scales, bn, bk, out, fmt, t_lo, t_hi, n_lo, n_hi)

    def codegen(context, builder, sig, args):
        v = [context.cast(builder, a, ty, types.int64) for a, ty in zip(args, sig.args)]
        args = list(args[:4]) + [v[4], v[5]] + [args[6]]
        token_blocks(builder, v[8], v[9], v[10], v[11],
                      lambda t, n, nt: f8_rows_dot(context, builder, sig, args, t, n, nt, f), CODE_TOKENS)
        return context.get_dummy_value()

    return sig, codegen


@nb.njit(**JIT)
def f8_rows(q, scales, bn, bk, values, n0, nr, wb):
    # wb[:nr] = the float32 values of rows n0 .. n0 + nr of an FP8 matrix
    K = q.shape[1]
    for r in range(nr):
        srow = scales[(n0 + r) // bn]
        for k in range(K):
            wb[r, k] = values[q[n0 + r, k]] * srow[k // bk]


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
    limit = np.float32(fp8.SCALE_LIMIT[next(f.name for f in fp8.FORMATS if f.code == fmt)])
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


LINEAR_F8, LINEAR_F8_TOK = {}, {}  # the format's code -> kernel
for _f in _FP_FORMATS:
    LINEAR_F8[_f], LINEAR_F8_TOK[_f] = _make_f8(_f)



def linear(x: np.ndarray, w, out: np.ndarray, prompt: bool = False) -> None:
    # x [T, D] f32 C-contiguous, w an FP8 QuantWeight [N, D], out [T, N] f32
    fmt = fp8.FORMATS[KINDS.index(w.kind)]
    if prompt:
        LINEAR_F8_TOK[fmt.code](x, w.q, w.scales, w.row_block, w.group_size, fmt.values, out)
    else:
        LINEAR_F8[fmt.code](x, w.q, w.scales, w.row_block, w.group_size, out)


def warm(kinds=KINDS) -> None:
    # one call of each format's two paths on tiny arrays: the compile happens at start
    for kind in kinds:
        w = QuantWeight(kind, np.ones((2, 64), np.uint8), np.ones((1, 1), np.float32), 64, 2)
        for prompt in (False, True):
            linear(np.ones((1, 64), np.float32), w, np.empty((1, 2), np.float32), prompt)
