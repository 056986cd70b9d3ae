"""int4 weights' kernels (storage/formats/int4.py's layout): values + 8 as nibbles, two a byte,
one float16 scale per group of 32, 64 or 128; computed on as stored. The decode path
(LINEAR_Q4, and the crew's JOB_MOE_Q4 through q4_matmul) splits each activation row once
(q4_split_row) and multiplies the packed bytes with it in LLVM IR (q4_rows_dot); the prompt
path (LINEAR_Q4_TOK) widens ROW_BLOCK rows exactly (q4_widen) and tiles them with every
token. The kernels exist per group size: the group's length is a compile-time constant.
"""

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...storage.experts import FORMATS, QuantWeight
from ..ir import F32, hsum, lanes_for, prefetch, row_at, splat_lanes, to8, token_blocks
from ..jit import JIT
from ..kernels import ROW_BLOCK, f16_lut, rows_aligned, tiles

KINDS = ("int4",)  # the storage formats these kernels compute on
GROUPS = FORMATS["int4"].groups


def q4_rows_dot(context, builder, sig, args, t0, n, nt: int, nblk: int):
    # emits out[t0 + i, n] = token t0+i's dot with int4 row n for i < nt (see linear_q4_g for
    # the algebra). The bytes of a group are widened once for the nt tokens; each token's
    # floats go through exactly the operations they would alone, so a token's result does not
    # depend on the tokens beside it
    xe_v, xd_v, xs_v, q_v, sc_v, lut_v, out_v = args[:7]
    i64 = ir.IntType(64)
    L = lanes_for(context, 8 * nblk)  # bytes a vector; a group is nblk * 8
    nvec = 8 * nblk // L
    vf, vi8 = ir.VectorType(F32, L), ir.VectorType(ir.IntType(8), L)
    ts = [builder.add(t0, ir.Constant(i64, i)) for i in range(nt)]
    erows, drows, srows = ([row_at(context, builder, sig.args[k], args[k], t) for t in ts] for k in range(3))
    qrow, scrow = (row_at(context, builder, sig.args[k], args[k], n) for k in (3, 4))
    lut = context.make_array(sig.args[5])(context, builder, lut_v).data
    n_groups = builder.sdiv(builder.extract_value(context.make_array(sig.args[0])(context, builder, xe_v).shape, 1),
                            ir.Constant(i64, nblk * 8))
    # multiply-add, fused where the CPU has FMA
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.floor.v{L}f32")
    sixteenth = ir.Constant(vf, [0.0625] * L)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * L)) for _ in range(nt)]  # sum of scale * part
    corrs = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(nt)]  # sum of scale * xsum8
    with cgutils.for_range(builder, n_groups) as loop:
        gi = loop.index
        s = builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(scrow, [gi])), i64)]))
        splat = splat_lanes(builder, s, L)
        offs = [builder.add(builder.mul(gi, ir.Constant(i64, nblk * 8)), ir.Constant(i64, L * c)) for c in range(nvec)]
        prefetch(builder, qrow, offs[0])
        bs = [builder.uitofp(builder.load(builder.bitcast(builder.gep(qrow, [off]), vi8.as_pointer()), align=1), vf)
              for off in offs]  # [L] bytes b of each vector
        his = [builder.call(floor, [builder.fmul(b, sixteenth)]) for b in bs]  # [L] floor(b / 16)
        for i in range(nt):
            builder.store(builder.fadd(builder.load(corrs[i]), builder.fmul(builder.load(builder.gep(srows[i], [gi])), s)),
                          corrs[i])
            parts = []
            for off, b, hi in zip(offs, bs, his):  # [L] e * b + d * floor(b / 16) for each vector of L bytes
                e, d = (builder.load(builder.bitcast(builder.gep(row, [off]), vf.as_pointer()), align=4)
                        for row in (erows[i], drows[i]))
                parts.append(builder.call(fma, [e, b, builder.fmul(d, hi)]))
            while len(parts) > 1:  # pairwise: independent adds, not a chain
                parts = [builder.fadd(parts[k], parts[k + 1]) for k in range(0, len(parts) - 1, 2)] + parts[len(parts) & ~1:]
            builder.store(builder.call(fma, [parts[0], splat, builder.load(accs[i])]), accs[i])
    for i in range(nt):
        orow = row_at(context, builder, sig.args[6], out_v, ts[i])
        total = hsum(builder, to8(builder, builder.load(accs[i])))
        builder.store(builder.fsub(total, builder.load(corrs[i])), builder.gep(orow, [n]))


@intrinsic
def q4_widen(typingctx, q, scales, f16_lut, n0, nr, wb, half):
    """wb[r] = row n0 + r of the int4 matrix q [N, D/2] uint8 (even column in the low nibble,
    value + 8; scales [N, D/g] f16 bits, g = 2 half) as float32 for r < nr: (v - 8) * scale,
    exact but for the one rounding of the product (the same bits as any other widening).
    `half` (bytes per group, a multiple of 16) a compile-time constant; the caller checks
    shapes. 16 bytes at a time: the nibbles split by integer masks and shifts, interleaved
    by one shuffle into 32 values in column order, converted and scaled as one vector: 3x
    numba's loop over the bytes (its stores of alternate columns did not vectorise), which
    had been a tenth of a prompt's int4 expert time."""
    if not (isinstance(half, types.IntegerLiteral) and half.literal_value % 16 == 0
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (q, scales, wb))
            and isinstance(n0, types.Integer) and isinstance(nr, types.Integer)):
        return None
    H = half.literal_value
    sig = types.void(q, scales, f16_lut, n0, nr, wb, half)

    def codegen(context, builder, sig, args):
        q_v, sc_v, lut_v, n0_v, nr_v, wb_v = args[:6]
        i64 = ir.IntType(64)
        n0_v, nr_v = (context.cast(builder, v, ty, types.int64) for v, ty in zip((n0_v, nr_v), sig.args[3:5]))
        lut = context.make_array(sig.args[2])(context, builder, lut_v).data
        v16i8, v16i32, v32i32, v32f = (ir.VectorType(t, n) for t, n in ((ir.IntType(8), 16), (ir.IntType(32), 16),
                                                                         (ir.IntType(32), 32), (F32, 32)))
        interleave = ir.Constant(ir.VectorType(ir.IntType(32), 32), [k // 2 + 16 * (k % 2) for k in range(32)])
        n_groups = builder.sdiv(builder.extract_value(context.make_array(sig.args[0])(context, builder, q_v).shape, 1),
                                ir.Constant(i64, H))
        with cgutils.for_range(builder, nr_v) as rows:
            n = builder.add(n0_v, rows.index)
            qrow, srow, wrow = (row_at(context, builder, sig.args[k], a, rr) for k, a, rr in
                                ((0, q_v, n), (1, sc_v, n), (5, wb_v, rows.index)))
            with cgutils.for_range(builder, n_groups) as groups:
                gi = groups.index
                s = builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(srow, [gi])), i64)]))
                splat = splat_lanes(builder, s, 32)
                for c in range(H // 16):
                    off = builder.add(builder.mul(gi, ir.Constant(i64, H)), ir.Constant(i64, 16 * c))
                    b = builder.zext(builder.load(builder.bitcast(builder.gep(qrow, [off]), v16i8.as_pointer()), align=1),
                                     v16i32)
                    lo = builder.and_(b, ir.Constant(v16i32, [15] * 16))
                    hi = builder.lshr(b, ir.Constant(v16i32, [4] * 16))
                    v = builder.sub(builder.shuffle_vector(lo, hi, interleave), ir.Constant(v32i32, [8] * 32))
                    at = builder.bitcast(builder.gep(wrow, [builder.mul(off, ir.Constant(i64, 2))]), v32f.as_pointer())
                    builder.store(builder.fmul(builder.sitofp(v, v32f), splat), at, align=4)
        return context.get_dummy_value()

    return sig, codegen


Q4_TOKENS = 4  # tokens the int4 decode path takes through a row at a time


@intrinsic
def q4_matmul(typingctx, xe, xd, xsum8, q, scales, f16_lut, out, half, t_lo, t_hi, n_lo, n_hi):
    """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = the int4 decode path's x[t] . dequant(q[n]),
    from q4_split's xe, xd, xsum8 (see linear_q4_g for the algebra), in explicit vectors of L
    lanes (16 with AVX-512F where the group divides, else 8; lanes_for).
    `half` (bytes per group) must be a compile-time constant; every 2-D array C-contiguous; the
    caller checks shapes and ranges.

    Written in LLVM IR because numba's loops give LLVM a single chain of dependent FMAs through
    each group and a horizontal sum per group: the kernel then waits on latency at ~5 GB/s of
    weights. Here each L-byte block of a group is independent, the blocks are summed pairwise,
    and the group's scale multiplies that vector into an L-lane accumulator: one horizontal sum
    per row, ~7.5-8.7 GB/s on one AVX2 core, 18-21 on a Zen 5 core in 16 lanes (bench/kernels.py). Tokens go through in blocks of
    Q4_TOKENS, the blocks the outer loop (a block's activations stay in L1 while the weights
    stream past), and a block widens each weight byte once for all its tokens: 1.5x for 4-12
    tokens. The order of the float operations is fixed by this code (no fast-math on it), and
    each (token, row) goes through the same operations however many tokens or rows are in the
    call, so the result is the same in every process, alone or batched, whatever range computes it."""
    arrays = (xe, xd, xsum8, q, scales, out)
    if not (isinstance(half, types.IntegerLiteral) and half.literal_value % 8 == 0
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)
            and all(isinstance(v, types.Integer) for v in (t_lo, t_hi, n_lo, n_hi))):
        return None  # numba reports the call as not typeable
    nblk = half.literal_value // 8
    sig = types.void(xe, xd, xsum8, q, scales, f16_lut, out, half, t_lo, t_hi, n_lo, n_hi)

    def codegen(context, builder, sig, args):
        t_lo, t_hi, n_lo, n_hi = (context.cast(builder, v, ty, types.int64) for v, ty in zip(args[8:12], sig.args[8:12]))
        token_blocks(builder, t_lo, t_hi, n_lo, n_hi,
                     lambda t, n, nt: q4_rows_dot(context, builder, sig, args, t, n, nt, nblk), Q4_TOKENS)
        return context.get_dummy_value()

    return sig, codegen


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


# group size -> kernel (storage/formats/int4.py GROUPS); _TOK: the prompt-token path
LINEAR_Q4, LINEAR_Q4_TOK, Q4_ROWS = {}, {}, {}
for _g in GROUPS:
    LINEAR_Q4[_g], LINEAR_Q4_TOK[_g], Q4_ROWS[_g] = _make_q4(_g)
q4_rows_32, q4_rows_64, q4_rows_128 = Q4_ROWS[32], Q4_ROWS[64], Q4_ROWS[128]  # for the crew's widen_rows


def linear(x: np.ndarray, w, out: np.ndarray, prompt: bool = False) -> None:
    # x [T, D] f32 C-contiguous, w an int4 QuantWeight [N, D], out [T, N] f32
    kernel = (LINEAR_Q4_TOK if prompt else LINEAR_Q4)[w.group_size]
    kernel(x, w.q, w.scales.view(np.uint16), f16_lut(), out)


def warm(g: int) -> None:
    # the prompt path of a group size (the decode path's experts go through the crew, which
    # engine/layers.init compiles with them)
    w = QuantWeight("int4", np.ones((2, 64), np.uint8), np.ones((2, 128 // g), np.float16), g)
    linear(np.ones((1, 128), np.float32), w, np.empty((1, 2), np.float32), True)
