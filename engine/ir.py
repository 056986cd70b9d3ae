"""The kernels' pieces written in LLVM IR through numba's `intrinsic`, where numba's loops
could not say what the vector code should be: the float32 tile of the dense and int4
prompt-path matmuls, the int4 decode-path row dot, and the atomics, yield and typed
pointers the thread crew (crew.py) shares work with.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F32 = ir.FloatType()
_V8, _V8I8 = ir.VectorType(_F32, 8), ir.VectorType(ir.IntType(8), 8)
_V8I16, _V8I32 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(ir.IntType(32), 8)


def _row(context, builder, aty, aval, i):
    # pointer to element [i, 0] of a 2-D array value
    a = context.make_array(aty)(context, builder, aval)
    return cgutils.get_item_pointer2(context, builder, a.data, cgutils.unpack_tuple(builder, a.shape),
                                     cgutils.unpack_tuple(builder, a.strides), aty.layout,
                                     [i, ir.Constant(ir.IntType(64), 0)])


def _hsum(builder, v):
    # float32: the 8 lanes of v added in a fixed order
    i32 = ir.IntType(32)
    total = builder.extract_element(v, ir.Constant(i32, 0))
    for lane in range(1, 8):
        total = builder.fadd(total, builder.extract_element(v, ir.Constant(i32, lane)))
    return total


def _hsums(builder, vs):
    # [float32]: _hsum of each <8 x float> of vs, the same bits, eight at a time as vectors: the
    # eight transposed (three rounds of shuffles), then lane 0's vector plus lane 1's and on in
    # _hsum's order, each lane one of the eight sums. A tile's 24 sums one by one were a
    # third of its time over 512 columns (a chain of eight dependent adds each); attention's
    # 128-column query-key tiles spent longer summing than multiplying
    if len(vs) < 4:
        return [_hsum(builder, v) for v in vs]
    i32 = ir.IntType(32)
    sums = []
    for g0 in range(0, len(vs), 8):
        rows = vs[g0 : g0 + 8]
        rows = rows + [ir.Constant(_V8, [0.0] * 8)] * (8 - len(rows))

        def mix(a, b, mask):
            return builder.shuffle_vector(a, b, ir.Constant(_V8I32, mask))

        # round 1: rows 2p, 2p + 1 -> their lanes 0, 2, 4, 6 interleaved, and 1, 3, 5, 7
        r1 = []
        for p in range(0, 8, 2):
            r1 += [mix(rows[p], rows[p + 1], [0, 8, 2, 10, 4, 12, 6, 14]),
                   mix(rows[p], rows[p + 1], [1, 9, 3, 11, 5, 13, 7, 15])]
        # round 2: within each four rows, lane l of the four in a run (lanes 0-3: l, 4-7: l + 4)
        r2 = [None] * 8
        for b in (0, 4):
            for odd in (0, 1):
                a, c = r1[b + odd], r1[b + 2 + odd]
                r2[b + odd] = mix(a, c, [0, 1, 8, 9, 4, 5, 12, 13])  # lanes odd, odd + 4
                r2[b + 2 + odd] = mix(a, c, [2, 3, 10, 11, 6, 7, 14, 15])  # lanes odd + 2, odd + 6
        # round 3: lane l of all eight rows
        cols = [None] * 8
        for l in range(4):
            cols[l] = mix(r2[l], r2[4 + l], [0, 1, 2, 3, 8, 9, 10, 11])
            cols[l + 4] = mix(r2[l], r2[4 + l], [4, 5, 6, 7, 12, 13, 14, 15])
        total = cols[0]
        for lane in range(1, 8):
            total = builder.fadd(total, cols[lane])
        sums += [builder.extract_element(total, ir.Constant(i32, k)) for k in range(len(vs[g0 : g0 + 8]))]
    return sums


PREFETCH_AHEAD = 4096  # bytes of a weight row asked for ahead of the decode-path kernels' reads


def _prefetch(builder, row, off):
    # ask for the weight bytes PREFETCH_AHEAD past row[off] (into the next rows: a matrix is one
    # block; past its end a prefetch is only a hint, never a fault). The hardware prefetcher
    # alone keeps too few lines in flight for one core's stream: on the AMD EPYC, one thread,
    # the FP8 decode kernel read 8.5-9.5 GB/s without it and 11-12.7 with it 4 KiB ahead
    # (16 KiB: 7-9), a plain read of the same bytes 12-14; int4 and MXFP4, bound by their
    # arithmetic, gained 5-15 %. It costs a load slot per 32 bytes, which the kernels have spare
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    at = builder.gep(builder.bitcast(row, i8p), [builder.add(off, ir.Constant(off.type, PREFETCH_AHEAD))])
    builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data


def _lanes(context, nbytes: int) -> int:
    # float32 lanes of the decode kernels' vectors: 16 where the CPU has 512-bit registers
    # (AVX-512F) and the unit divides by 16, else 8. On the AMD EPYC of family 26 (Zen 5) the
    # 8-lane loops were bound by their instruction count at a third to a half of one thread's
    # memory read; 16 lanes do the same work in half the instructions
    return 16 if _has_feature(context, "avx512f") and nbytes % 16 == 0 else 8


def _splat_lanes(builder, v, lanes: int):
    # <lanes x float> of the float v in every lane
    vf = ir.VectorType(_F32, lanes)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), v, ir.Constant(ir.IntType(32), 0)),
                                  ir.Constant(vf, None), ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def _to8(builder, v):
    # <8 x float>: a 16-lane vector's halves added (an 8-lane one as it is)
    if v.type.count == 8:
        return v
    return builder.fadd(*(builder.shuffle_vector(v, v, ir.Constant(_V8I32, list(range(h, h + 8)))) for h in (0, 8)))


def _splat8(builder, v):
    return _splat_lanes(builder, v, 8)


@intrinsic
def f32_tile(typingctx, x, w, out, acc, a0, t0, r0, n0, k0, k1, nt, nr):
    """out[t0 + i, n0 + r0 + j] = x[t0 + i] . w[r0 + j] for i < nt, j < nr (compile-time
    constants); x [T, D] float32, w [R, D] float32 or bf16 bits (uint16, widened in registers:
    exact, so the same bits as from a widened copy); every 2-D array C-contiguous; the caller
    checks shapes. Each pair is one chain of multiply-adds in L lanes (TILE_LANES: 16 where
    the CPU has AVX-512F, else 8) over D's multiple of L, a horizontal sum in a fixed order,
    then the last D % L products one by one: the same operations whatever tile it is computed
    in, so a (token, row) result does not depend on the tokens or rows beside it, nor on the
    process (no fast-math).

    A call takes the chains through columns k0 .. k1 (multiples of L) only: from zero when k0
    is 0, else from the L-lane sums it left in acc [a0 + (i nr + j) L ...] (1-D float32); to
    the result when k1 reaches D's multiple of L, else back into acc. Storing a chain's sum
    and going on with it later changes no bit, and the caller (kernels.tiles) can take a tile
    through the columns a block at a time while that block of its rows sits in L1."""
    if not (isinstance(nt, types.IntegerLiteral) and isinstance(nr, types.IntegerLiteral)
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (x, w, out))
            and isinstance(acc, types.Array) and acc.ndim == 1 and acc.dtype == types.float32
            and w.dtype in (types.float32, types.uint16)):
        return None
    NT, NR = nt.literal_value, nr.literal_value
    bf16 = w.dtype == types.uint16
    sig = types.void(x, w, out, acc, a0, t0, r0, n0, k0, k1, nt, nr)

    def codegen(context, builder, sig, args):
        x_v, w_v, out_v, acc_v = args[:4]
        i64 = ir.IntType(64)
        a0_v, t0_v, r0_v, n0_v, k0_v, k1_v = (context.cast(builder, v, ty, types.int64)
                                              for v, ty in zip(args[4:10], sig.args[4:10]))
        xrows = [_row(context, builder, sig.args[0], x_v, builder.add(t0_v, ir.Constant(i64, i))) for i in range(NT)]
        wrows = [_row(context, builder, sig.args[1], w_v, builder.add(r0_v, ir.Constant(i64, j))) for j in range(NR)]
        D = builder.extract_value(context.make_array(sig.args[0])(context, builder, x_v).shape, 1)
        L = _lanes(context, 16)
        Dv = builder.sub(D, builder.srem(D, ir.Constant(i64, L)))
        vf, vi16, vi32 = (ir.VectorType(t, L) for t in (_F32, ir.IntType(16), ir.IntType(32)))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
        parked = context.make_array(sig.args[3])(context, builder, acc_v).data
        slots = [[builder.add(a0_v, ir.Constant(i64, (i * NR + j) * L)) for j in range(NR)] for i in range(NT)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * L)) for _ in range(NR)] for _ in range(NT)]
        with builder.if_then(builder.icmp_signed("!=", k0_v, ir.Constant(i64, 0))):
            for i in range(NT):
                for j in range(NR):
                    builder.store(_vload(builder, parked, slots[i][j], vf, 4), accs[i][j])
        with cgutils.for_range(builder, builder.sdiv(builder.sub(k1_v, k0_v), ir.Constant(i64, L))) as loop:
            off = builder.add(k0_v, builder.mul(loop.index, ir.Constant(i64, L)))
            xs = [_vload(builder, r, off, vf, 4) for r in xrows]
            if bf16:  # [L] bf16 bits -> float32: the bits shifted into the high half
                ws = [builder.bitcast(builder.shl(builder.zext(_vload(builder, r, off, vi16, 2), vi32),
                                                  ir.Constant(vi32, [16] * L)), vf) for r in wrows]
            else:
                ws = [_vload(builder, r, off, vf, 4) for r in wrows]
            for i in range(NT):
                for j in range(NR):
                    builder.store(builder.call(fma, [xs[i], ws[j], builder.load(accs[i][j])]), accs[i][j])
        with builder.if_else(builder.icmp_signed("<", k1_v, Dv)) as (park, finish):
            with park:
                for i in range(NT):
                    for j in range(NR):
                        at = builder.bitcast(builder.gep(parked, [slots[i][j]]), vf.as_pointer())
                        builder.store(builder.load(accs[i][j]), at, align=4)
            with finish:
                flat = _hsums(builder, [_to8(builder, builder.load(accs[i][j])) for i in range(NT) for j in range(NR)])
                sums = [[cgutils.alloca_once_value(builder, flat[i * NR + j]) for j in range(NR)] for i in range(NT)]
                fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3),
                                                      "llvm.fmuladd.f32")
                with cgutils.for_range(builder, builder.sub(D, Dv)) as tail:  # D % L products
                    d = builder.add(Dv, tail.index)
                    for i in range(NT):
                        for j in range(NR):
                            xd, wd = (builder.load(builder.gep(r, [d])) for r in (xrows[i], wrows[j]))
                            if bf16:
                                wd = builder.bitcast(builder.shl(builder.zext(wd, ir.IntType(32)),
                                                                 ir.Constant(ir.IntType(32), 16)), _F32)
                            builder.store(builder.call(fma1, [xd, wd, builder.load(sums[i][j])]), sums[i][j])
                for i in range(NT):
                    orow = _row(context, builder, sig.args[2], out_v, builder.add(t0_v, ir.Constant(i64, i)))
                    for j in range(NR):
                        n = builder.add(n0_v, builder.add(r0_v, ir.Constant(i64, j)))
                        builder.store(builder.load(sums[i][j]), builder.gep(orow, [n]))
        return context.get_dummy_value()

    return sig, codegen


def q4_rows_dot(context, builder, sig, args, t0, n, nt: int, nblk: int):
    # emits out[t0 + i, n] = token t0+i's dot with int4 row n for i < nt (see linear_q4_g for
    # the algebra). The bytes of a group are widened once for the nt tokens; each token's
    # floats go through exactly the operations they would alone, so a token's result does not
    # depend on the tokens beside it
    xe_v, xd_v, xs_v, q_v, sc_v, lut_v, out_v = args[:7]
    i64 = ir.IntType(64)
    L = _lanes(context, 8 * nblk)  # bytes a vector; a group is nblk * 8
    nvec = 8 * nblk // L
    vf, vi8 = ir.VectorType(_F32, L), ir.VectorType(ir.IntType(8), L)
    ts = [builder.add(t0, ir.Constant(i64, i)) for i in range(nt)]
    erows, drows, srows = ([_row(context, builder, sig.args[k], args[k], t) for t in ts] for k in range(3))
    qrow, scrow = (_row(context, builder, sig.args[k], args[k], n) for k in (3, 4))
    lut = context.make_array(sig.args[5])(context, builder, lut_v).data
    n_groups = builder.sdiv(builder.extract_value(context.make_array(sig.args[0])(context, builder, xe_v).shape, 1),
                            ir.Constant(i64, nblk * 8))
    # multiply-add, fused where the CPU has FMA
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.floor.v{L}f32")
    sixteenth = ir.Constant(vf, [0.0625] * L)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * L)) for _ in range(nt)]  # sum of scale * part
    corrs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(nt)]  # sum of scale * xsum8
    with cgutils.for_range(builder, n_groups) as loop:
        gi = loop.index
        s = builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(scrow, [gi])), i64)]))
        splat = _splat_lanes(builder, s, L)
        offs = [builder.add(builder.mul(gi, ir.Constant(i64, nblk * 8)), ir.Constant(i64, L * c)) for c in range(nvec)]
        _prefetch(builder, qrow, offs[0])
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
        orow = _row(context, builder, sig.args[6], out_v, ts[i])
        total = _hsum(builder, _to8(builder, builder.load(accs[i])))
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
                                                                         (ir.IntType(32), 32), (_F32, 32)))
        interleave = ir.Constant(ir.VectorType(ir.IntType(32), 32), [k // 2 + 16 * (k % 2) for k in range(32)])
        n_groups = builder.sdiv(builder.extract_value(context.make_array(sig.args[0])(context, builder, q_v).shape, 1),
                                ir.Constant(i64, H))
        with cgutils.for_range(builder, nr_v) as rows:
            n = builder.add(n0_v, rows.index)
            qrow, srow, wrow = (_row(context, builder, sig.args[k], a, rr) for k, a, rr in
                                ((0, q_v, n), (1, sc_v, n), (5, wb_v, rows.index)))
            with cgutils.for_range(builder, n_groups) as groups:
                gi = groups.index
                s = builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(srow, [gi])), i64)]))
                splat = _splat_lanes(builder, s, 32)
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
    lanes (16 with AVX-512F where the group divides, else 8; _lanes).
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
        i64 = ir.IntType(64)
        t_lo, t_hi, n_lo, n_hi = (context.cast(builder, v, ty, types.int64) for v, ty in zip(args[8:12], sig.args[8:12]))

        def rows(t, nt):  # the block of nt tokens from t through rows n_lo .. n_hi
            with cgutils.for_range(builder, builder.sub(n_hi, n_lo)) as row:
                q4_rows_dot(context, builder, sig, args, t, builder.add(n_lo, row.index), nt, nblk)

        full = builder.sdiv(builder.sub(t_hi, t_lo), ir.Constant(i64, Q4_TOKENS))
        with cgutils.for_range(builder, full) as tb:
            rows(builder.add(t_lo, builder.mul(tb.index, ir.Constant(i64, Q4_TOKENS))), Q4_TOKENS)
        rest = builder.sub(builder.sub(t_hi, t_lo), builder.mul(full, ir.Constant(i64, Q4_TOKENS)))
        for nt in (2, 1):  # the last tokens: a block of 2, then 1, as many as there are
            nt_c = ir.Constant(i64, nt)
            with builder.if_then(builder.icmp_signed(">=", rest, nt_c)):
                rows(builder.sub(t_hi, rest), nt)
            rest = builder.select(builder.icmp_signed(">=", rest, nt_c), builder.sub(rest, nt_c), rest)
        return context.get_dummy_value()

    return sig, codegen


def _splat(v: float):
    return ir.Constant(_V8, [v] * 8)


def _vexp(builder, x):
    # [8] float32: exp(x) lane by lane, Cephes' expf (a degree-6 polynomial after reducing by
    # ln 2, within ~1 ulp); 0 below -87.34 (where exp is below the smallest normal). Plain
    # multiplies and adds, no fused ones: the same bits on every CPU and in every lane
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8]), "llvm.floor.v8f32")
    low = builder.fcmp_ordered("<", x, _splat(-87.33654))
    x = builder.select(low, _splat(-87.33654), x)
    x = builder.select(builder.fcmp_ordered(">", x, _splat(88.3)), _splat(88.3), x)
    n = builder.call(floor, [builder.fadd(builder.fmul(x, _splat(1.44269504088896341)), _splat(0.5))])
    r = builder.fsub(builder.fsub(x, builder.fmul(n, _splat(0.693359375))), builder.fmul(n, _splat(-2.12194440e-4)))
    p = _splat(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.fadd(builder.fmul(p, r), _splat(c))
    y = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), _splat(1.0))
    bits = builder.shl(builder.add(builder.fptosi(n, _V8I32), ir.Constant(_V8I32, [127] * 8)), ir.Constant(_V8I32, [23] * 8))
    y = builder.fmul(y, builder.bitcast(bits, _V8))  # times 2 ** n
    return builder.select(low, _splat(0.0), y)


def _by_eights(builder, n, step):
    # step(j, lanes) for j = 0, 8, 16 .. with lanes 8 while 8 are left, then for each of the
    # last n % 8 with lanes 1: step loads that one element into lane 0 of an 8-lane vector and
    # takes it through the same vector code, so an element's value does not depend on where
    # it sits in the range
    i64 = ir.IntType(64)
    full = builder.sdiv(n, ir.Constant(i64, 8))
    with cgutils.for_range(builder, full) as loop:
        step(builder.mul(loop.index, ir.Constant(i64, 8)), 8)
    with cgutils.for_range(builder, builder.sub(n, builder.mul(full, ir.Constant(i64, 8)))) as tail:
        step(builder.add(builder.mul(full, ir.Constant(i64, 8)), tail.index), 1)


def _lanes_at(builder, row, j, lanes, fill):
    # [8] float32: row[j .. j + 8], or (lanes 1) row[j] in lane 0 and fill's other lanes
    if lanes == 8:
        return builder.load(builder.bitcast(builder.gep(row, [j]), _V8.as_pointer()), align=4)
    return builder.insert_element(fill, builder.load(builder.gep(row, [j])), ir.Constant(ir.IntType(32), 0))


def _store_lanes(builder, v, row, j, lanes):
    if lanes == 8:
        builder.store(v, builder.bitcast(builder.gep(row, [j]), _V8.as_pointer()), align=4)
    else:
        builder.store(builder.extract_element(v, ir.Constant(ir.IntType(32), 0)), builder.gep(row, [j]))


def _row_args_ok(a, ints, floats=()):
    return (isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
            and all(isinstance(v, types.Integer) for v in ints) and all(isinstance(v, types.Float) for v in floats))


def _lane_max(builder, v):
    # float32: the largest of v's 8 lanes (which lane wins a tie does not change the value)
    i32 = ir.IntType(32)
    best = builder.extract_element(v, ir.Constant(i32, 0))
    for lane in range(1, 8):
        e = builder.extract_element(v, ir.Constant(i32, lane))
        best = builder.select(builder.fcmp_ordered(">", e, best), e, best)
    return best


@intrinsic
def scaled_max(typingctx, a, r, lo, hi, scale):
    """a[r, j] *= scale for lo <= j < hi, and the largest of the products (-inf for none): a
    row of attention scores before its softmax. Eight lanes at a time, the last ones through
    the same vector code one lane at a time (_by_eights); a 2-D float32 C-contiguous, the
    caller checks the range. One compare after another through the row had waited on each."""
    if not _row_args_ok(a, (r, lo, hi), (scale,)):
        return None
    sig = types.float32(a, r, lo, hi, scale)

    def codegen(context, builder, sig, args):
        r_v, lo_v, hi_v = (context.cast(builder, v, ty, types.int64) for v, ty in zip(args[1:4], sig.args[1:4]))
        ssplat = _splat8(builder, context.cast(builder, args[4], sig.args[4], types.float32))
        row = builder.gep(_row(context, builder, sig.args[0], args[0], r_v), [lo_v])
        low = _splat(float("-inf"))
        best = cgutils.alloca_once_value(builder, low)

        def step(j, lanes):
            s = builder.fmul(_lanes_at(builder, row, j, lanes, low), ssplat)
            _store_lanes(builder, s, row, j, lanes)
            b = builder.load(best)
            builder.store(builder.select(builder.fcmp_ordered(">", s, b), s, b), best)

        _by_eights(builder, builder.sub(hi_v, lo_v), step)
        return _lane_max(builder, builder.load(best))

    return sig, codegen


@intrinsic
def exp_sum(typingctx, a, r, lo, hi, m):
    """a[r, j] = exp(a[r, j] - m) for lo <= j < hi, and their sum: eight lanes at a time by
    _vexp, the last ones through the same vector code one lane at a time (_by_eights), each
    lane's sum in order and the lanes added in a fixed order (_hsum), so a row's sum is the
    same whatever else is computed with it (a 2-D float32 C-contiguous; the caller checks the
    range). numba's np.exp called expf one element at a time (a third of a long prompt's
    attention), and one sum through the row waited on each add."""
    if not _row_args_ok(a, (r, lo, hi), (m,)):
        return None
    sig = types.float32(a, r, lo, hi, m)

    def codegen(context, builder, sig, args):
        r_v, lo_v, hi_v = (context.cast(builder, v, ty, types.int64) for v, ty in zip(args[1:4], sig.args[1:4]))
        msplat = _splat8(builder, context.cast(builder, args[4], sig.args[4], types.float32))
        row = builder.gep(_row(context, builder, sig.args[0], args[0], r_v), [lo_v])
        total = cgutils.alloca_once_value(builder, _splat(0.0))
        one_lane = ir.Constant(_V8, [1.0] + [0.0] * 7)

        def step(j, lanes):
            e = _vexp(builder, builder.fsub(_lanes_at(builder, row, j, lanes, msplat), msplat))
            _store_lanes(builder, e, row, j, lanes)
            if lanes == 1:  # only lane 0 holds an element (the fill's lanes are exp(0))
                e = builder.fmul(e, one_lane)
            builder.store(builder.fadd(builder.load(total), e), total)

        _by_eights(builder, builder.sub(hi_v, lo_v), step)
        return _hsum(builder, builder.load(total))

    return sig, codegen


@intrinsic
def silu_mul_rows(typingctx, g, u, out, i_lo, i_hi, n_lo, n_hi):
    """out[i, n] = silu(g[i, n]) * u[i, n] = g / (1 + exp(-g)) * u for i_lo <= i < i_hi, n_lo
    <= n < n_hi (2-D float32 C-contiguous arrays of one shape; out may be g; the caller checks
    the ranges): exp by _vexp eight lanes at a time (_by_eights), so an element's value is the
    same in every range and on every path that takes it here. numba's np.exp called expf one
    element at a time: an eighth of a 512-token prompt's expert time."""
    if not (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
                for a in (g, u, out)) and all(isinstance(v, types.Integer) for v in (i_lo, i_hi, n_lo, n_hi))):
        return None
    sig = types.void(g, u, out, i_lo, i_hi, n_lo, n_hi)

    def codegen(context, builder, sig, args):
        i_lo_v, i_hi_v, n_lo_v, n_hi_v = (context.cast(builder, v, ty, types.int64)
                                          for v, ty in zip(args[3:7], sig.args[3:7]))
        one, zero = _splat(1.0), _splat(0.0)
        with cgutils.for_range(builder, builder.sub(i_hi_v, i_lo_v)) as rows:
            i = builder.add(i_lo_v, rows.index)
            gr, ur, outr = (builder.gep(_row(context, builder, sig.args[k], args[k], i), [n_lo_v]) for k in range(3))

            def step(j, lanes):
                x = _lanes_at(builder, gr, j, lanes, zero)
                s = builder.fdiv(x, builder.fadd(one, _vexp(builder, builder.fsub(zero, x))))
                _store_lanes(builder, builder.fmul(s, _lanes_at(builder, ur, j, lanes, zero)), outr, j, lanes)

            _by_eights(builder, builder.sub(n_hi_v, n_lo_v), step)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def clamped_rows(typingctx, h, u, gb, ub, alpha, limit, i_lo, i_hi, n_lo, n_hi):
    """gpt-oss's expert activation on rows i_lo .. i_hi, columns n_lo .. n_hi of h (gate x) and
    u (up x), into h: g = min(h + gb, limit), v = min(max(u + ub, -limit), limit), h = (v + 1)
    * (g / (1 + exp(-g alpha))); h, u [R, I] and gb, ub [I] float32 C-contiguous (the caller
    checks the ranges). min and max as numba's (the second operand when it compares below /
    above), exp by _vexp eight lanes at a time (_by_eights), as silu_mul_rows."""
    if not (all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32
                and a.ndim == nd for a, nd in ((h, 2), (u, 2), (gb, 1), (ub, 1)))
            and all(isinstance(v, types.Float) for v in (alpha, limit))
            and all(isinstance(v, types.Integer) for v in (i_lo, i_hi, n_lo, n_hi))):
        return None
    sig = types.void(h, u, gb, ub, alpha, limit, i_lo, i_hi, n_lo, n_hi)

    def codegen(context, builder, sig, args):
        alpha_v, limit_v = (_splat8(builder, context.cast(builder, v, ty, types.float32))
                            for v, ty in zip(args[4:6], sig.args[4:6]))
        neg_limit = builder.fsub(_splat(0.0), limit_v)
        i_lo_v, i_hi_v, n_lo_v, n_hi_v = (context.cast(builder, v, ty, types.int64)
                                          for v, ty in zip(args[6:10], sig.args[6:10]))
        gbr, ubr = (builder.gep(context.make_array(sig.args[k])(context, builder, args[k]).data, [n_lo_v]) for k in (2, 3))
        one, zero = _splat(1.0), _splat(0.0)
        with cgutils.for_range(builder, builder.sub(i_hi_v, i_lo_v)) as rows:
            i = builder.add(i_lo_v, rows.index)
            hr, ur = (builder.gep(_row(context, builder, sig.args[k], args[k], i), [n_lo_v]) for k in range(2))

            def step(j, lanes):
                g = builder.fadd(_lanes_at(builder, hr, j, lanes, zero), _lanes_at(builder, gbr, j, lanes, zero))
                g = builder.select(builder.fcmp_ordered("<", limit_v, g), limit_v, g)
                v = builder.fadd(_lanes_at(builder, ur, j, lanes, zero), _lanes_at(builder, ubr, j, lanes, zero))
                v = builder.select(builder.fcmp_ordered(">", neg_limit, v), neg_limit, v)
                v = builder.select(builder.fcmp_ordered("<", limit_v, v), limit_v, v)
                e = _vexp(builder, builder.fmul(builder.fneg(g), alpha_v))
                out = builder.fmul(builder.fadd(v, one), builder.fdiv(g, builder.fadd(one, e)))
                _store_lanes(builder, out, hr, j, lanes)

            _by_eights(builder, builder.sub(n_hi_v, n_lo_v), step)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def pv_tile(typingctx, a, v, out, r0, h0, d0, lo, hi, voff, nh, nv, cont):
    """out[h0 + i, d0 + d] = sum over lo <= j < hi, in order, of a[r0 + i, j] * v[j - voff, d0 + d]
    for i < nh, d < 8 nv (compile-time constants): attention's weighted sum of values for nh
    heads at once; a [n, S], v [rows, hv], out [H, hv] float32, C-contiguous (v's rows may be
    strided: MLA's values are a slice of its latent cache; the caller checks that its
    columns are adjacent, and the ranges). Each (head, column) is one chain of fused
    multiply-adds in key order, from 0, or with `cont` (a compile-time bool) from what out
    holds: the chain of the keys before, continued over a sequence's next KV block. The sums
    stay in registers for the whole key range, in vectors of 16 lanes where the CPU has
    AVX-512F and 8 nv divides by 16, else 8 (a column's chain is the same either way). Separate
    multiplies and adds in 8 lanes had been half of a 512-token prompt's attention."""
    if not (isinstance(nh, types.IntegerLiteral) and isinstance(nv, types.IntegerLiteral)
            and isinstance(cont, types.BooleanLiteral)
            and all(isinstance(x, types.Array) and x.ndim == 2 and x.layout in ("C", "A") and x.dtype == types.float32
                    for x in (a, v, out)) and a.layout == out.layout == "C"):
        return None
    NH, NV, CONT = nh.literal_value, nv.literal_value, cont.literal_value
    sig = types.void(a, v, out, r0, h0, d0, lo, hi, voff, nh, nv, cont)

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        a_v, v_v, out_v = args[:3]
        r0_v, h0_v, d0_v, lo_v, hi_v, voff_v = (context.cast(builder, x, ty, types.int64)
                                                for x, ty in zip(args[3:9], sig.args[3:9]))
        L = _lanes(context, 8 * NV)
        nvec = 8 * NV // L
        vf = ir.VectorType(_F32, L)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
        arows = [_row(context, builder, sig.args[0], a_v, builder.add(r0_v, ir.Constant(i64, i))) for i in range(NH)]
        optrs = [[builder.bitcast(builder.gep(_row(context, builder, sig.args[2], out_v,
                                                   builder.add(h0_v, ir.Constant(i64, i))),
                                              [builder.add(d0_v, ir.Constant(i64, L * k))]), vf.as_pointer())
                  for k in range(nvec)] for i in range(NH)]
        accs = [[cgutils.alloca_once_value(builder, builder.load(optrs[i][k], align=4) if CONT
                                           else ir.Constant(vf, [0.0] * L)) for k in range(nvec)] for i in range(NH)]
        with cgutils.for_range(builder, builder.sub(hi_v, lo_v)) as loop:
            j = builder.add(lo_v, loop.index)
            vrow = _row(context, builder, sig.args[1], v_v, builder.sub(j, voff_v))
            vs = [builder.load(builder.bitcast(builder.gep(vrow, [builder.add(d0_v, ir.Constant(i64, L * k))]),
                                               vf.as_pointer()), align=4) for k in range(nvec)]
            for i in range(NH):
                splat = _splat_lanes(builder, builder.load(builder.gep(arows[i], [j])), L)
                for k in range(nvec):
                    builder.store(builder.call(fma, [splat, vs[k], builder.load(accs[i][k])]), accs[i][k])
        for i in range(NH):
            for k in range(nvec):
                builder.store(builder.load(accs[i][k]), optrs[i][k], align=4)
        return context.get_dummy_value()

    return sig, codegen


def _int64_slot(context, builder, sig, args):
    # pointer to a[i] of a 1-D int64 array (args[0], args[1])
    a = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(a.data, [context.cast(builder, args[1], sig.args[1], types.int64)])


def _is_int64_vector(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1 and a.layout == "C"


@intrinsic
def atomic_add(typingctx, a, i, v):
    """a[i] += v in one atomic step (sequentially consistent); returns the value before. a: 1-D
    int64, C-contiguous: the counters threads share a piece of work by."""
    if not (_is_int64_vector(a) and isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _int64_slot(context, builder, sig, args),
                                  context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

    return types.int64(a, i, v), codegen


@intrinsic
def atomic_load(typingctx, a, i):
    """a[i], read atomically with acquire order (what another thread wrote before its
    atomic_add of it is visible after)."""
    if not (_is_int64_vector(a) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_int64_slot(context, builder, sig, args), "acquire", 8)

    return types.int64(a, i), codegen


@intrinsic
def yield_cpu(typingctx):
    """sched_yield(2): let another runnable thread have this CPU, if there is one (an I/O
    thread, the daemon's socket thread); returns at once otherwise."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


def _pointer_from(dtype):
    @intrinsic
    def pointer(typingctx, addr):
        # an address (int64) as a typed pointer, for nb.carray
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            return builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.int64),
                                    context.get_value_type(types.CPointer(dtype)))

        return types.CPointer(dtype)(addr), codegen

    return pointer


i8_at, u8_at, u16_at, i64_at, f32_at = (_pointer_from(t) for t in (types.int8, types.uint8, types.uint16, types.int64, types.float32))


# ---- float-format weights: FP8 (e4m3, e5m2) and MXFP4 (e2m1), decoded in registers ----------
# A decoder takes the raw codes and gives float32 lanes holding exactly the value each code stands
# for times a fixed power of two, with a few integer operations (no table gather, which runs at
# ~1 GB/s here, and no half-precision conversion, which not every target has); the power of two
# and the block's scale multiply a block's sum once.
F8_E4M3, F8_E5M2 = 0, 1  # fmt of f8_matmul
_FP_FORMATS = {F8_E4M3: (3, 120), F8_E5M2: (2, 112)}  # fmt -> (mantissa bits, float32 exponent bias - the code's)
F8_REBIAS = {f: rebias for f, (_, rebias) in _FP_FORMATS.items()}


def _splat_i32(ty, v):
    return ir.Constant(ty, [v] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, v)


def _float_ty(ty):
    return ir.VectorType(_F32, ty.count) if isinstance(ty, ir.VectorType) else _F32


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
    c = lambda v: _splat_i32(ity, v)  # noqa: E731
    bits = builder.and_(builder.shl(builder.sext(b, ity), c(23 - mb)), c(0x80000000 | (0x7F << (23 - mb))))
    return builder.bitcast(bits, _float_ty(ity))


def _decode_e2m1(builder, n):
    # n: i32 lanes holding one FP4 (e2m1) code each (0..15) -> float32 lanes of its value:
    # 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
    ty, fty = n.type, _float_ty(n.type)
    c = lambda v: _splat_i32(ty, v)  # noqa: E731
    mag = builder.and_(n, c(7))
    sign = builder.shl(builder.and_(n, c(8)), c(28))
    normal = builder.add(builder.shl(mag, c(22)), c(126 << 23))  # exponent e - 1, one mantissa bit
    sub = builder.bitcast(builder.fmul(builder.uitofp(mag, fty), ir.Constant(fty, [0.5] * ty.count)), ty)  # 0, 0.5
    bits = builder.select(builder.icmp_unsigned("<", mag, c(2)), sub, normal)
    return builder.bitcast(builder.or_(bits, sign), fty)


def _token_blocks(builder, t_lo, t_hi, n_lo, n_hi, emit, size):
    # emit(t, n, nt) for each row n_lo <= n < n_hi and token block [t, t + nt): tokens in blocks
    # of `size`, then the rest in blocks of 2 and 1 (the outer loop: a block's activations stay in
    # L1 while the weights stream past)
    i64 = ir.IntType(64)

    def rows(t, nt):
        with cgutils.for_range(builder, builder.sub(n_hi, n_lo)) as row:
            emit(t, builder.add(n_lo, row.index), nt)

    full = builder.sdiv(builder.sub(t_hi, t_lo), ir.Constant(i64, size))
    with cgutils.for_range(builder, full) as tb:
        rows(builder.add(t_lo, builder.mul(tb.index, ir.Constant(i64, size))), size)
    rest = builder.sub(builder.sub(t_hi, t_lo), builder.mul(full, ir.Constant(i64, size)))
    for nt in (2, 1):
        if nt >= size:
            continue
        nt_c = ir.Constant(i64, nt)
        with builder.if_then(builder.icmp_signed(">=", rest, nt_c)):
            rows(builder.sub(t_hi, rest), nt)
        rest = builder.select(builder.icmp_signed(">=", rest, nt_c), builder.sub(rest, nt_c), rest)


def _vload(builder, row, off, ty, align):
    return builder.load(builder.bitcast(builder.gep(row, [off]), ty.as_pointer()), align=align)


F8_TOKENS = 2  # tokens the FP8 and MXFP4 decode paths take through a row at a time
_CHAINS = 4  # independent vector sums per token inside a scale block (a dependent chain waits on FMA latency)


def f8_rows_dot(context, builder, sig, args, t0, n, nt: int, fmt: int):
    # emits out[t0 + i, n] = x[t0 + i] . dequant(q[n]) for i < nt, x prescaled (fpkernels.
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
    xrows = [_row(context, builder, sig.args[0], x_v, t) for t in ts]
    xfs = [builder.load(builder.gep(context.make_array(sig.args[1])(context, builder, xf_v).data, [t])) for t in ts]
    qrow = _row(context, builder, sig.args[2], q_v, n)
    srow = _row(context, builder, sig.args[3], s_v, builder.sdiv(n, bn_v))
    K = builder.extract_value(context.make_array(sig.args[2])(context, builder, q_v).shape, 1)
    n_blocks = builder.sdiv(builder.add(K, builder.sub(bk_v, ir.Constant(i64, 1))), bk_v)
    L = 16 if _has_feature(context, "avx512f") else 8  # lanes (_lanes)
    vf, vi8 = ir.VectorType(_F32, L), ir.VectorType(ir.IntType(8), L)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
    fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fmuladd.f32")
    zerov, zero1 = ir.Constant(vf, [0.0] * L), ir.Constant(_F32, 0.0)
    chains = [[cgutils.alloca_once_value(builder, zerov) for _ in range(_CHAINS)] for _ in range(nt)]
    tails = [cgutils.alloca_once_value(builder, zero1) for _ in range(nt)]
    totals = [cgutils.alloca_once_value(builder, zerov) for _ in range(nt)]
    tail_totals = [cgutils.alloca_once_value(builder, zero1) for _ in range(nt)]

    def chunk(off, which):  # L columns from `off` into sum `which` of every token
        w = _decode_fp8(builder, _vload(builder, qrow, off, vi8, 1), fmt)
        for i in range(nt):
            xv = _vload(builder, xrows[i], off, vf, 4)
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
            _prefetch(builder, qrow, base)
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
            builder.store(builder.call(fma, [block, _splat_lanes(builder, f, L), builder.load(totals[i])]), totals[i])
            builder.store(builder.call(fma1, [builder.load(tails[i]), f, builder.load(tail_totals[i])]), tail_totals[i])
    for i in range(nt):
        orow = _row(context, builder, sig.args[6], out_v, ts[i])
        builder.store(builder.fadd(_hsum(builder, _to8(builder, builder.load(totals[i]))), builder.load(tail_totals[i])),
                      builder.gep(orow, [n]))


@intrinsic
def f8_matmul(typingctx, x, xf, q, scales, bn, bk, out, fmt, t_lo, t_hi, n_lo, n_hi):
    """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = x[t] . dequant(q[n]) * xf[t] * 2 **
    -rebias, which with fpkernels.f8_prescale's x [T, K] f32 and xf [T] f32 is the original
    activations' product with the weights; q [N, K] uint8 FP8 codes
    of format `fmt` (F8_E4M3 or F8_E5M2, a compile-time constant), scales [ceil(N / bn),
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
        _token_blocks(builder, v[8], v[9], v[10], v[11],
                      lambda t, n, nt: f8_rows_dot(context, builder, sig, args, t, n, nt, f), F8_TOKENS)
        return context.get_dummy_value()

    return sig, codegen


# e2m1 codes -> twice their value, an int8 each: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives
_E2M1_TWICE = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def host_features() -> str:
    # the features numba compiles for (the host's); its cache keys code on them
    from numba.core.registry import cpu_target
    return getattr(cpu_target.target_context.codegen(), "_tm_features", "")


def _has_feature(context, feature: str) -> bool:
    return f"+{feature}" in getattr(context.codegen(), "_tm_features", "")


# MXFP4 blocks of 32 codes the decode path decodes at once: four (64 bytes, 16 lanes) where the
# CPU has 512-bit byte shuffles (AVX-512BW), else two (32 bytes, 8 lanes). On the AMD EPYC of
# family 26 (Zen 5) one thread decoded 8-lane pairs at 11-12 GB/s of MXFP4, a third of its
# 36 GB/s memory read: the loop is bound by its instructions, and a 16-lane one does the same
# work in half of them. fpkernels.mx4_layout lays x out for the same grouping.
MX4_GROUP = 4 if "+avx512bw" in host_features() else 2
TILE_LANES = 16 if "+avx512f" in host_features() else 8  # f32_tile's lanes (_lanes)


def _e2m1_block(context, builder, b, scale):
    # b: <16 x i8> bytes of 32 codes; scale: <16 x float> of the block's scale -> (low codes'
    # weights, high codes' weights), <16 x float> each: value(code) * scale, exact (a power of
    # two times a value of two significant bits). By a byte-table lookup where the CPU has one
    # (x86's pshufb, SSSE3: the values doubled are small integers: a shuffle, a widening, a
    # conversion, and the scale halved), else in registers (_decode_e2m1)
    v16i8, v16 = ir.VectorType(ir.IntType(8), 16), ir.VectorType(_F32, 16)
    lo = builder.and_(b, ir.Constant(v16i8, [15] * 16))
    hi = builder.lshr(b, ir.Constant(v16i8, [4] * 16))
    if _has_feature(context, "ssse3"):
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
    return w if j == 3 else builder.shl(w, _splat_i32(w.type, 24 - 8 * j))


def _e2m1_group(context, builder, w):
    # w: <L x i32>, the 4L bytes of L / 4 MXFP4 blocks (lanes 4b .. 4b + 3 block b) ->
    # [(h, j) -> <L x float>] for h = 0 (low nibbles), 1 (high) and byte j of every lane, in
    # the order 4h + j: value(code) * 2 ** 25, exact. Where the CPU has the byte shuffle of
    # that width (AVX2 for 8 lanes, AVX-512BW for 16), one table lookup per nibble gives twice
    # each value as a byte, and a byte moved to the top of its lane (shifts and a mask, no
    # widening shuffle: the widening is what bound the kernel) converts to 2 * value * 2 ** 24;
    # elsewhere the nibble is decoded in registers.
    lanes = w.type.count
    vi8, vf = ir.VectorType(ir.IntType(8), 4 * lanes), ir.VectorType(_F32, lanes)
    c = lambda v: _splat_i32(w.type, v)  # noqa: E731
    feature, name = _PSHUFB.get(lanes, ("", ""))
    if feature and _has_feature(context, feature):
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
    # column's code in its low nibble, the odd one's in the high), x in fpkernels.mx4_layout's
    # order. Blocks in groups of MX4_GROUP (4 L bytes as L lanes, decoded once for the nt
    # tokens, _e2m1_group): per token and nibble the four products with x summed, then times
    # the group's scales (lanes 4b .. 4b + 3 block b's) into that nibble's sum; with groups of
    # four, a pair of blocks left over is one 8-lane group into sums of its own; the sums
    # times 2 ** -25 at the end. An odd last block decoded alone (_e2m1_block, its scale in the
    # weights) into 16-lane sums of its own. A token's floats go through the same operations
    # whatever tokens are beside it.
    x_v, q_v, s_v, lut_v, out_v = args[:5]
    i64, i32 = ir.IntType(64), ir.IntType(32)
    v16, v16i8 = ir.VectorType(_F32, 16), ir.VectorType(ir.IntType(8), 16)
    ts = [builder.add(t0, ir.Constant(i64, i)) for i in range(nt)]
    xrows = [_row(context, builder, sig.args[0], x_v, t) for t in ts]
    qrow = _row(context, builder, sig.args[1], q_v, n)
    srow = _row(context, builder, sig.args[2], s_v, n)
    lut = context.make_array(sig.args[3])(context, builder, lut_v).data
    n_blocks = builder.extract_value(context.make_array(sig.args[2])(context, builder, s_v).shape, 1)
    fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3), "llvm.fmuladd.v16f32")
    tails = [[cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(2)] for _ in range(nt)]

    def scale(bi):
        return builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(srow, [bi])), i64)]))

    def group(first, blocks: int, sums):  # blocks first .. first + blocks - 1 into sums[token][nibble]
        lanes = 4 * blocks
        vf = ir.VectorType(_F32, lanes)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{lanes}f32")
        some = ir.Constant(vf, None)
        for b in range(blocks):
            some = builder.insert_element(some, scale(builder.add(first, ir.Constant(i64, b))), ir.Constant(i32, b))
        svec = builder.shuffle_vector(some, ir.Constant(vf, None), ir.Constant(ir.VectorType(i32, lanes),
                                                                               [lane // 4 for lane in range(lanes)]))
        col, byte = builder.mul(first, ir.Constant(i64, 32)), builder.mul(first, ir.Constant(i64, 16))
        _prefetch(builder, qrow, byte)
        ws = _e2m1_group(context, builder, _vload(builder, qrow, byte, ir.VectorType(i32, lanes), 1))
        for i in range(nt):
            for h in range(2):
                part = None
                for j in range(4):
                    xv = _vload(builder, xrows[i], builder.add(col, ir.Constant(i64, lanes * (4 * h + j))), vf, 4)
                    part = builder.fmul(xv, ws[4 * h + j]) if part is None else builder.call(fma, [xv, ws[4 * h + j], part])
                builder.store(builder.call(fma, [part, svec, builder.load(sums[i][h])]), sums[i][h])

    def zeros(lanes):
        return [[cgutils.alloca_once_value(builder, ir.Constant(ir.VectorType(_F32, lanes), [0.0] * lanes))
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
        splat = _splat_lanes(builder, scale(last), 16)
        col = builder.mul(last, ir.Constant(i64, 32))
        lo, hi = _e2m1_block(context, builder, _vload(builder, qrow, builder.mul(last, ir.Constant(i64, 16)), v16i8, 1),
                             splat)
        for i in range(nt):
            for h, w in enumerate((lo, hi)):
                xv = _vload(builder, xrows[i], builder.add(col, ir.Constant(i64, 16 * h)), v16, 4)
                builder.store(builder.call(fma16, [xv, w, builder.load(tails[i][h])]), tails[i][h])

    for i in range(nt):
        grouped = _to8(builder, builder.fadd(builder.load(sums[i][0]), builder.load(sums[i][1])))
        if pairs is not None:
            grouped = builder.fadd(grouped, builder.fadd(builder.load(pairs[i][0]), builder.load(pairs[i][1])))
        tail = _to8(builder, builder.fadd(builder.load(tails[i][0]), builder.load(tails[i][1])))
        total = builder.fadd(builder.fmul(_hsum(builder, grouped), ir.Constant(_F32, 2.0 ** -MX4_PAIR_SHIFT)),
                             _hsum(builder, tail))
        orow = _row(context, builder, sig.args[4], out_v, ts[i])
        builder.store(total, builder.gep(orow, [n]))


@intrinsic
def mx4_matmul(typingctx, x, q, scales, e8m0_lut, out, t_lo, t_hi, n_lo, n_hi):
    """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = x[t] . dequant(q[n]), MXFP4: x [T, K] f32
    in mx4_rows_dot's order (fpkernels.mx4_layout), q [N, K/2] uint8 (two e2m1 codes a byte, the
    even column's low), scales [N, K/32] uint8 (e8m0 exponents), e8m0_lut [256] f32 (2 ** (e -
    127)), out [T, N] f32; every array 2-D C-contiguous, K a multiple of 32; the caller checks."""
    arrays = (x, q, scales, out)
    if not (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)
            and all(isinstance(v, types.Integer) for v in (t_lo, t_hi, n_lo, n_hi))):
        return None
    sig = types.void(x, q, scales, e8m0_lut, out, t_lo, t_hi, n_lo, n_hi)

    def codegen(context, builder, sig, args):
        t_lo, t_hi, n_lo, n_hi = (context.cast(builder, v, ty, types.int64) for v, ty in zip(args[5:9], sig.args[5:9]))
        _token_blocks(builder, t_lo, t_hi, n_lo, n_hi,
                      lambda t, n, nt: mx4_rows_dot(context, builder, sig, args, t, n, nt), F8_TOKENS)
        return context.get_dummy_value()

    return sig, codegen
