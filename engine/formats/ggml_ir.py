"""The decode path of the GGUF block formats most files are made of (Q4_K, Q5_K and Q6_K in
a Q4_K_M or Q5_K_M file, Q8_0, Q4_0, gpt-oss's MXFP4), in LLVM IR: each block decoded in registers, once for the
few tokens of a token block, into vectors of its weights' float32 values (the same values,
bit for bit, as engine/formats/ggml.py's decoders: the same float32 operations, none fused)
multiplied into each token's sums straight away. The rows-then-tiles path writes each
weight out as 4 bytes and reads it back; on one Zen 5 thread that bounded a one-token
Q4_K product at 4.5 GB/s of blocks.

Per token, four vector sums taken in turn (one sum's chain of fused multiply-adds would wait
on each add), added in a fixed order at the end: a token's result never depends on the
tokens beside it. Each kernel is built for vectors of 16 lanes (what CPUs with AVX-512 take
in one register) and of 8 (AVX2's); the caller picks by the CPU (LANES), and a test runs
both on any CPU: LLVM splits a vector wider than the CPU's registers, the results the same.
"""

from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

from ..ir import (
    F32,
    host_features,
    hsum,
    prefetch,
    row_at,
    rows_kernel,
    splat_lanes,
    to8,
    vload,
)

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
N_SUMS = 4  # vector sums a token keeps
LANES = 16 if "+avx512f" in host_features() else 8  # the kernels this CPU runs best


def _const(ty, v):
    return ir.Constant(ty, [v] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, v)


class _Block:
    """What a block decoder emits with: the row, the lookup of float16 bits, the lanes."""

    def __init__(self, context, builder, qrow, lut, lanes):
        self.b, self.qrow, self.lut, self.L = builder, qrow, lut, lanes
        self.vi8 = ir.VectorType(I8, lanes)
        self.vi32 = ir.VectorType(I32, lanes)
        self.vf = ir.VectorType(F32, lanes)

    def byte(self, off):  # the byte at off, as i32
        return self.b.zext(self.b.load(self.b.gep(self.qrow, [off])), I32)

    def sbyte(self, off):  # the byte at off read as int8, as float32
        return self.b.sitofp(self.b.load(self.b.gep(self.qrow, [off])), F32)

    def f16(self, off):  # the little-endian float16 at off, as float32 (exact, by the table)
        b = self.b
        bits = b.or_(b.zext(b.load(b.gep(self.qrow, [off])), I64),
                     b.shl(b.zext(b.load(b.gep(self.qrow, [b.add(off, _const(I64, 1))])), I64), _const(I64, 8)))
        return b.load(b.gep(self.lut, [bits]))

    def bytes(self, off):  # <L x i8> from off
        return vload(self.b, self.qrow, off, self.vi8, 1)

    def at(self, base, k):
        return self.b.add(base, _const(I64, k))

    def u_to_f(self, v):  # <L x i8> of small unsigned codes -> <L x float>
        return self.b.uitofp(self.b.zext(v, self.vi32), self.vf)

    def s_to_f(self, v):  # <L x i8> read as int8 -> <L x float>
        return self.b.sitofp(self.b.sext(v, self.vi32), self.vf)

    def splat(self, v):
        return splat_lanes(self.b, v, self.L)


def _q8_0(k: _Block, o, ops):
    # d (f16), qs int8 [32]: value d * q, as _q8_0 computes it (q * d)
    d = k.splat(k.f16(o))
    for p in range(32 // k.L):
        ops.emit(p * k.L, k.b.fmul(k.s_to_f(k.bytes(k.at(o, 2 + p * k.L))), d))


def _q4_0(k: _Block, o, ops):
    # d (f16), qs [16]: weight i the low nibble of qs[i] less 8, weight 16 + i its high one;
    # value d * (q - 8), as _q4_0 computes it
    b = k.b
    d = k.splat(k.f16(o))
    for c in range(16 // k.L):
        v = k.bytes(k.at(o, 2 + c * k.L))
        for h, nib in enumerate((b.and_(v, _const(k.vi8, 15)), b.lshr(v, _const(k.vi8, 4)))):
            ops.emit(16 * h + c * k.L, b.fmul(d, k.s_to_f(b.sub(nib, _const(k.vi8, 8)))))


def _gguf_mxfp4(k: _Block, o, ops):
    # e (e8m0), qs [16]: weight i the low nibble of qs[i], 16 + i its high one; value
    # e8m0_half(e) * the e2m1 code's doubled value (MXFP4_VALUES), as _gguf_mxfp4 computes it:
    # the scale's bits made from e (ggml's e8m0_to_fp32_half), the code's value from its bits
    # (magnitude m < 4: m; else (2 | m & 1) << (m >> 1) - 1; bit 3 the sign), both exact
    b = k.b
    e = k.byte(o)
    bits = b.select(b.icmp_unsigned("<", e, _const(I32, 2)), b.shl(_const(I32, 0x00200000), e),
                    b.shl(b.sub(e, _const(I32, 1)), _const(I32, 23)))
    d = k.splat(b.bitcast(bits, F32))
    for c in range(16 // k.L):
        v = k.bytes(k.at(o, 1 + c * k.L))
        for h, nib in enumerate((b.and_(v, _const(k.vi8, 15)), b.lshr(v, _const(k.vi8, 4)))):
            code = b.zext(nib, k.vi32)
            m = b.and_(code, _const(k.vi32, 7))
            small = b.icmp_unsigned("<", m, _const(k.vi32, 4))
            shift = b.select(small, _const(k.vi32, 0), b.sub(b.lshr(m, _const(k.vi32, 1)), _const(k.vi32, 1)))
            big = b.shl(b.or_(b.and_(m, _const(k.vi32, 1)), _const(k.vi32, 2)), shift)
            mag = b.select(small, m, big)
            neg = b.icmp_unsigned("!=", b.and_(code, _const(k.vi32, 8)), _const(k.vi32, 0))
            val = b.sitofp(b.select(neg, b.sub(_const(k.vi32, 0), mag), mag), k.vf)
            ops.emit(16 * h + c * k.L, b.fmul(d, val))


def _scale_min(k: _Block, s, j: int):
    # Q4_K's sub-block j: its 6-bit scale and minimum from the 12 bytes s (i32 each), as float32
    b = k.b
    if j < 4:
        sc, m = b.and_(s[j], _const(I32, 63)), b.and_(s[j + 4], _const(I32, 63))
    else:
        sc = b.or_(b.and_(s[j + 4], _const(I32, 15)), b.shl(b.lshr(s[j - 4], _const(I32, 6)), _const(I32, 4)))
        m = b.or_(b.lshr(s[j + 4], _const(I32, 4)), b.shl(b.lshr(s[j], _const(I32, 6)), _const(I32, 4)))
    return b.sitofp(sc, F32), b.sitofp(m, F32)


def _q4_k(k: _Block, o, ops):
    # d, dmin (f16), scales [12], qs [128]: weight 64 p + i is the low nibble of byte 32 p + i
    # of qs, 64 p + 32 + i its high one; value (d * sc) * q - dmin * m (_k4). Summed as
    # (d * sc) * (q . x) - (dmin * m) * sum(x) over each 32-weight sub-block: the same weights,
    # associated otherwise (two float operations a weight fewer: 10.4 -> 12.5+ GB/s, one thread)
    b = k.b
    d, dmin = k.f16(o), k.f16(k.at(o, 2))
    d1, m1 = _scales_mins(k, o, d, dmin)
    for p in range(4):
        v = [k.bytes(k.at(o, 16 + 32 * p + c * k.L)) for c in range(32 // k.L)]
        for h in range(2):
            j = ir.Constant(I32, 2 * p + h)
            nibs = [b.and_(x, _const(k.vi8, 15)) if h == 0 else b.lshr(x, _const(k.vi8, 4)) for x in v]
            ops.emit_codes(64 * p + 32 * h, [k.u_to_f(x) for x in nibs], k.splat(b.extract_element(d1, j)))
            ops.minus(2 * p + h, b.extract_element(m1, j))


def _q5_k(k: _Block, o, ops):
    # Q4_K's block with qh [32] before qs (d, dmin, scales [12], qh [32], qs [128]): weight
    # 32 j + i's fifth bit is bit j of qh[i] (_k4 with `high`); summed as Q4_K's
    b = k.b
    d, dmin = k.f16(o), k.f16(k.at(o, 2))
    d1, m1 = _scales_mins(k, o, d, dmin)
    qh = [k.bytes(k.at(o, 16 + c * k.L)) for c in range(32 // k.L)]
    for p in range(4):
        v = [k.bytes(k.at(o, 48 + 32 * p + c * k.L)) for c in range(32 // k.L)]
        for h in range(2):
            jj = 2 * p + h
            j = ir.Constant(I32, jj)
            nibs = [b.and_(x, _const(k.vi8, 15)) if h == 0 else b.lshr(x, _const(k.vi8, 4)) for x in v]
            fifth = [b.shl(b.and_(b.lshr(x, _const(k.vi8, jj)), _const(k.vi8, 1)), _const(k.vi8, 4)) for x in qh]
            codes = [b.or_(n, f) for n, f in zip(nibs, fifth)]
            ops.emit_codes(64 * p + 32 * h, [k.u_to_f(x) for x in codes], k.splat(b.extract_element(d1, j)))
            ops.minus(jj, b.extract_element(m1, j))


def _scales_mins(k: _Block, o, d, dmin):
    # Q4_K's eight (d * scale) and (dmin * minimum), <8 x float> each, from the 12 bytes at o + 4
    # in vectors (_scale_min's bits, all eight at once: the scalar unpacking had been the
    # largest part of a block's work): sub-block j < 4 takes scale s[j] & 63, minimum
    # s[j + 4] & 63; j >= 4 scale (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, minimum
    # (s[j + 4] >> 4) | (s[j] >> 6) << 4
    b = k.b
    v8i32, v8 = ir.VectorType(I32, 8), ir.VectorType(F32, 8)
    s = vload(b, k.qrow, k.at(o, 4), ir.VectorType(I8, 16), 1)  # (bytes 12-15 belong to qs: unused)

    def pick(idx):
        return b.zext(b.shuffle_vector(s, s, ir.Constant(v8i32, idx)), v8i32)

    lo4 = ir.Constant(v8i32, [1] * 4 + [0] * 4)
    a, m_src = pick([0, 1, 2, 3, 8, 9, 10, 11]), pick([4, 5, 6, 7, 8, 9, 10, 11])
    hi_sc = b.shl(b.lshr(pick([0, 1, 2, 3, 0, 1, 2, 3]), _const(v8i32, 6)), _const(v8i32, 4))
    hi_m = b.shl(b.lshr(pick([4, 5, 6, 7, 4, 5, 6, 7]), _const(v8i32, 6)), _const(v8i32, 4))
    first = b.icmp_unsigned("!=", lo4, _const(v8i32, 0))
    sc = b.select(first, b.and_(a, _const(v8i32, 63)), b.or_(b.and_(a, _const(v8i32, 15)), hi_sc))
    m = b.select(first, b.and_(m_src, _const(v8i32, 63)), b.or_(b.lshr(m_src, _const(v8i32, 4)), hi_m))
    return (b.fmul(splat_lanes(b, d, 8), b.sitofp(sc, v8)), b.fmul(splat_lanes(b, dmin, 8), b.sitofp(m, v8)))


def _q6_k(k: _Block, o, ops):
    # ql [128], qh [64], scales int8 [16] (a 16-weight run each), d (f16): weight 128 h + 32 s +
    # i: low nibble (s < 2) or high (s >= 2) of ql[64 h + 32 (s % 2) + i], two high bits at 2 s
    # of qh[32 h + i], minus 32; value (d * sc) * q, as _q6_k computes it
    b = k.b
    d = k.f16(k.at(o, 208))
    for h in range(2):
        for c in range(32 // k.L):
            qh = k.bytes(k.at(o, 128 + 32 * h + c * k.L))
            for s in range(4):
                ql = k.bytes(k.at(o, 64 * h + 32 * (s % 2) + c * k.L))
                lo = b.and_(b.lshr(ql, _const(k.vi8, 4 * (s // 2))), _const(k.vi8, 15))
                hi = b.and_(b.lshr(qh, _const(k.vi8, 2 * s)), _const(k.vi8, 3))
                q = b.sub(b.or_(lo, b.shl(hi, _const(k.vi8, 4))), _const(k.vi8, 32))
                first = 128 * h + 32 * s + c * k.L  # (L weights within one 16-weight run: one scale)
                ds = k.splat(b.fmul(d, k.sbyte(k.at(o, 192 + first // 16))))
                ops.emit(first, b.fmul(ds, k.s_to_f(q)))


# kind -> (block emitter, weights a block, bytes a block)
BLOCKS = {"q8_0": (_q8_0, 32, 34), "q4_k": (_q4_k, 256, 144), "q5_k": (_q5_k, 256, 176), "q6_k": (_q6_k, 256, 210),
          "q4_0": (_q4_0, 32, 18), "gguf_mxfp4": (_gguf_mxfp4, 32, 17)}


def _rows_dot(kind, lanes, context, builder, sig, args, t0, n, nt: int):
    # out[t0 + i, n] = x[t0 + i] . dequant(q[n]) for i < nt, in vectors of `lanes`
    emitter, qk, nbytes = BLOCKS[kind]
    x_v, xs_v, q_v, lut_v, out_v = args[:5]
    vf = ir.VectorType(F32, lanes)
    ts = [builder.add(t0, _const(I64, i)) for i in range(nt)]
    xrows = [row_at(context, builder, sig.args[0], x_v, t) for t in ts]
    xsrows = [row_at(context, builder, sig.args[1], xs_v, t) for t in ts]
    qrow = row_at(context, builder, sig.args[2], q_v, n)
    lut = context.make_array(sig.args[3])(context, builder, lut_v).data
    q_shape = cgutils.unpack_tuple(builder, context.make_array(sig.args[2])(context, builder, q_v).shape)
    n_blocks = builder.sdiv(q_shape[1], _const(I64, nbytes))
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{lanes}f32")
    fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32] * 3), "llvm.fmuladd.f32")
    sums = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(N_SUMS)]
            for _ in range(nt)]
    corr = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in range(nt)]
    k = _Block(context, builder, qrow, lut, lanes)
    with cgutils.for_range(builder, n_blocks) as blk:
        o = builder.mul(blk.index, _const(I64, nbytes))
        col = builder.mul(blk.index, _const(I64, qk))
        prefetch(builder, qrow, o)
        count = [0]

        class Ops:
            @staticmethod
            def emit(at: int, w):  # the weights of columns col + at .. + L: into each token's next sum
                which = count[0] % N_SUMS
                count[0] += 1
                for i in range(nt):
                    xv = vload(builder, xrows[i], builder.add(col, _const(I64, at)), vf, 4)
                    builder.store(builder.call(fma, [xv, w, builder.load(sums[i][which])]), sums[i][which])

            @staticmethod
            def emit_codes(at: int, codes, scale):  # scale * (codes . x[col + at ..]) into each token's next sum
                which = count[0] % N_SUMS
                count[0] += 1
                for i in range(nt):
                    part = None
                    for c, w in enumerate(codes):
                        xv = vload(builder, xrows[i], builder.add(col, _const(I64, at + c * lanes)), vf, 4)
                        part = builder.fmul(xv, w) if part is None else builder.call(fma, [xv, w, part])
                    builder.store(builder.call(fma, [part, scale, builder.load(sums[i][which])]), sums[i][which])

            @staticmethod
            def minus(j: int, m):  # m * (the sum of x over the block's 32 columns j) off each token's result
                for i in range(nt):
                    xsum = builder.load(builder.gep(xsrows[i], [builder.add(builder.mul(blk.index, _const(I64, qk // 32)),
                                                                            _const(I64, j))]))
                    builder.store(builder.call(fma1, [m, xsum, builder.load(corr[i])]), corr[i])

        emitter(k, o, Ops)
    for i in range(nt):
        total = builder.load(sums[i][0])
        for j in range(1, N_SUMS):
            total = builder.fadd(total, builder.load(sums[i][j]))
        orow = row_at(context, builder, sig.args[4], out_v, ts[i])
        builder.store(builder.fsub(hsum(builder, to8(builder, total)), builder.load(corr[i])), builder.gep(orow, [n]))


def _make_dot(kind: str, lanes: int):
    @intrinsic
    def dot(typingctx, x, xs, q, lut, out, t_lo, t_hi, n_lo, n_hi):
        """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = x[t] . dequant(q[n]) in `kind`:
        x [T, K] f32, xs [T, K / 32] f32 the sums of x's 32-column runs (read by Q4_K's and
        Q5_K's), q
        [N, K / block weights * block bytes] uint8, lut [65536] f32 (float16 bits -> value),
        out [T, N] f32; every 2-D array C-contiguous; the caller checks."""
        return rows_kernel((x, xs, q, lut, out, t_lo, t_hi, n_lo, n_hi), (x, xs, q, out),
                           lambda *a: _rows_dot(kind, lanes, *a))

    return dot


dot_q8_0, dot_q4_k, dot_q5_k, dot_q6_k, dot_q4_0, dot_mxfp4 = (_make_dot(kind, 16) for kind in BLOCKS)
dot_q8_0_8, dot_q4_k_8, dot_q5_k_8, dot_q6_k_8, dot_q4_0_8, dot_mxfp4_8 = (_make_dot(kind, 8) for kind in BLOCKS)
