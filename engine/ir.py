"""The kernels' shared pieces in LLVM IR, written through numba's `intrinsic` where numba's
loops could not say what the vector code should be: typed row pointers, fixed-order
horizontal sums, prefetch, lane counts by the CPU's features, the token-block loop of the
decode kernels, and the float32 tile of the dense and prompt-path matmuls. Each number
format's own pieces (its decoder, its row dot) live with its kernels in engine/formats/;
attention's and the activations' row pieces in ir_rows.py; the crew's atomics in atomics.py.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

F32 = ir.FloatType()
V8, V8I8 = ir.VectorType(F32, 8), ir.VectorType(ir.IntType(8), 8)
V8I16, V8I32 = ir.VectorType(ir.IntType(16), 8), ir.VectorType(ir.IntType(32), 8)


def row_at(context, builder, aty, aval, i):
    # pointer to element [i, 0] of a 2-D array value
    a = context.make_array(aty)(context, builder, aval)
    return cgutils.get_item_pointer2(context, builder, a.data, cgutils.unpack_tuple(builder, a.shape),
                                     cgutils.unpack_tuple(builder, a.strides), aty.layout,
                                     [i, ir.Constant(ir.IntType(64), 0)])


def hsum(builder, v):
    # float32: the 8 lanes of v added in a fixed order
    i32 = ir.IntType(32)
    total = builder.extract_element(v, ir.Constant(i32, 0))
    for lane in range(1, 8):
        total = builder.fadd(total, builder.extract_element(v, ir.Constant(i32, lane)))
    return total


def hsums(builder, vs):
    # [float32]: hsum of each <8 x float> of vs, the same bits, eight at a time as vectors: the
    # eight transposed (three rounds of shuffles), then lane 0's vector plus lane 1's and on in
    # hsum's order, each lane one of the eight sums. A tile's 24 sums one by one were a
    # third of its time over 512 columns (a chain of eight dependent adds each); attention's
    # 128-column query-key tiles spent longer summing than multiplying
    if len(vs) < 4:
        return [hsum(builder, v) for v in vs]
    i32 = ir.IntType(32)
    sums = []
    for g0 in range(0, len(vs), 8):
        rows = vs[g0 : g0 + 8]
        rows = rows + [ir.Constant(V8, [0.0] * 8)] * (8 - len(rows))

        def mix(a, b, mask):
            return builder.shuffle_vector(a, b, ir.Constant(V8I32, mask))

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


def prefetch(builder, row, off):
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


def lanes_for(context, nbytes: int) -> int:
    # float32 lanes of the decode kernels' vectors: 16 where the CPU has 512-bit registers
    # (AVX-512F) and the unit divides by 16, else 8. On the AMD EPYC of family 26 (Zen 5) the
    # 8-lane loops were bound by their instruction count at a third to a half of one thread's
    # memory read; 16 lanes do the same work in half the instructions
    return 16 if has_feature(context, "avx512f") and nbytes % 16 == 0 else 8


def splat_lanes(builder, v, lanes: int):
    # <lanes x float> of the float v in every lane
    vf = ir.VectorType(F32, lanes)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), v, ir.Constant(ir.IntType(32), 0)),
                                  ir.Constant(vf, None), ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def to8(builder, v):
    # <8 x float>: a 16-lane vector's halves added (an 8-lane one as it is)
    if v.type.count == 8:
        return v
    return builder.fadd(*(builder.shuffle_vector(v, v, ir.Constant(V8I32, list(range(h, h + 8)))) for h in (0, 8)))


def splat8(builder, v):
    return splat_lanes(builder, v, 8)



def splat_i32(ty, v):
    return ir.Constant(ty, [v] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, v)


def float_ty(ty):
    return ir.VectorType(F32, ty.count) if isinstance(ty, ir.VectorType) else F32



def token_blocks(builder, t_lo, t_hi, n_lo, n_hi, emit, size):
    # emit(t, n, nt) for each row n_lo <= n < n_hi and token block [t, t + nt): tokens in blocks
    # of `size`, then the rest in one block of its own (the outer loop: a block's activations stay
    # in L1 while the weights stream past; a rest of 3 as 2 + 1 had read its weights twice, and
    # a prompt's expert has two or three tokens: the int8 path's 40-token prompt ran 10 % slower)
    i64 = ir.IntType(64)

    def rows(t, nt):
        with cgutils.for_range(builder, builder.sub(n_hi, n_lo)) as row:
            emit(t, builder.add(n_lo, row.index), nt)

    full = builder.sdiv(builder.sub(t_hi, t_lo), ir.Constant(i64, size))
    with cgutils.for_range(builder, full) as tb:
        rows(builder.add(t_lo, builder.mul(tb.index, ir.Constant(i64, size))), size)
    rest = builder.sub(builder.sub(t_hi, t_lo), builder.mul(full, ir.Constant(i64, size)))
    for nt in range(size - 1, 0, -1):
        with builder.if_then(builder.icmp_signed("==", rest, ir.Constant(i64, nt))):
            rows(builder.sub(t_hi, rest), nt)


def rows_kernel(args: tuple, arrays: tuple, emit):
    """(signature, codegen) of a decode-path intrinsic over its typing arguments `args`, the
    last four t_lo, t_hi, n_lo, n_hi: emit(context, builder, sig, values, t, n, nt) for every
    row and block of CODE_TOKENS tokens (token_blocks); None (not this intrinsic) unless
    `arrays` are 2-D C-contiguous and the bounds integers."""
    if not (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)
            and all(isinstance(v, types.Integer) for v in args[-4:])):
        return None

    def codegen(context, builder, sig, values):
        bounds = (context.cast(builder, v, ty, types.int64) for v, ty in zip(values[-4:], sig.args[-4:]))
        token_blocks(builder, *bounds, lambda t, n, nt: emit(context, builder, sig, values, t, n, nt), CODE_TOKENS)
        return context.get_dummy_value()

    return types.void(*args), codegen


def vload(builder, row, off, ty, align):
    return builder.load(builder.bitcast(builder.gep(row, [off]), ty.as_pointer()), align=align)


CODE_TOKENS = 2  # tokens the FP8 and MXFP4 decode paths take through a row at a time


def host_features() -> str:
    # the features numba compiles for (the host's); its cache keys code on them
    from numba.core.registry import cpu_target
    return getattr(cpu_target.target_context.codegen(), "_tm_features", "")


def has_feature(context, feature: str) -> bool:
    return f"+{feature}" in getattr(context.codegen(), "_tm_features", "")


TILE_LANES = 16 if "+avx512f" in host_features() else 8  # f32_tile's lanes (lanes_for)


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
        xrows = [row_at(context, builder, sig.args[0], x_v, builder.add(t0_v, ir.Constant(i64, i))) for i in range(NT)]
        wrows = [row_at(context, builder, sig.args[1], w_v, builder.add(r0_v, ir.Constant(i64, j))) for j in range(NR)]
        D = builder.extract_value(context.make_array(sig.args[0])(context, builder, x_v).shape, 1)
        L = lanes_for(context, 16)
        Dv = builder.sub(D, builder.srem(D, ir.Constant(i64, L)))
        vf, vi16, vi32 = (ir.VectorType(t, L) for t in (F32, ir.IntType(16), ir.IntType(32)))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
        parked = context.make_array(sig.args[3])(context, builder, acc_v).data
        slots = [[builder.add(a0_v, ir.Constant(i64, (i * NR + j) * L)) for j in range(NR)] for i in range(NT)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * L)) for _ in range(NR)] for _ in range(NT)]
        with builder.if_then(builder.icmp_signed("!=", k0_v, ir.Constant(i64, 0))):
            for i in range(NT):
                for j in range(NR):
                    builder.store(vload(builder, parked, slots[i][j], vf, 4), accs[i][j])
        with cgutils.for_range(builder, builder.sdiv(builder.sub(k1_v, k0_v), ir.Constant(i64, L))) as loop:
            off = builder.add(k0_v, builder.mul(loop.index, ir.Constant(i64, L)))
            xs = [vload(builder, r, off, vf, 4) for r in xrows]
            if bf16:  # [L] bf16 bits -> float32: the bits shifted into the high half
                ws = [builder.bitcast(builder.shl(builder.zext(vload(builder, r, off, vi16, 2), vi32),
                                                  ir.Constant(vi32, [16] * L)), vf) for r in wrows]
            else:
                ws = [vload(builder, r, off, vf, 4) for r in wrows]
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
                flat = hsums(builder, [to8(builder, builder.load(accs[i][j])) for i in range(NT) for j in range(NR)])
                sums = [[cgutils.alloca_once_value(builder, flat[i * NR + j]) for j in range(NR)] for i in range(NT)]
                fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32] * 3),
                                                      "llvm.fmuladd.f32")
                with cgutils.for_range(builder, builder.sub(D, Dv)) as tail:  # D % L products
                    d = builder.add(Dv, tail.index)
                    for i in range(NT):
                        for j in range(NR):
                            xd, wd = (builder.load(builder.gep(r, [d])) for r in (xrows[i], wrows[j]))
                            if bf16:
                                wd = builder.bitcast(builder.shl(builder.zext(wd, ir.IntType(32)),
                                                                 ir.Constant(ir.IntType(32), 16)), F32)
                            builder.store(builder.call(fma1, [xd, wd, builder.load(sums[i][j])]), sums[i][j])
                for i in range(NT):
                    orow = row_at(context, builder, sig.args[2], out_v, builder.add(t0_v, ir.Constant(i64, i)))
                    for j in range(NR):
                        n = builder.add(n0_v, builder.add(r0_v, ir.Constant(i64, j)))
                        builder.store(builder.load(sums[i][j]), builder.gep(orow, [n]))
        return context.get_dummy_value()

    return sig, codegen
