"""Attention's and the activations' row pieces in LLVM IR (numba `intrinsic`): the scaled
row maximum and the exponential sum of a softmax, the SwiGLU and gpt-oss's clamped
activation over rows, and the probability-times-value tile. Each keeps a fixed order of
float operations, so a row's bits do not depend on its neighbours or the process.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir import F32, V8, V8I32, hsum, lanes_for, row_at, splat8, splat_lanes


def _splat(v: float):
    return ir.Constant(V8, [v] * 8)


def _vexp(builder, x):
    # [8] float32: exp(x) lane by lane, Cephes' expf (a degree-6 polynomial after reducing by
    # ln 2, within ~1 ulp); 0 below -87.34 (where exp is below the smallest normal). Plain
    # multiplies and adds, no fused ones: the same bits on every CPU and in every lane
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8, [V8]), "llvm.floor.v8f32")
    low = builder.fcmp_ordered("<", x, _splat(-87.33654))
    x = builder.select(low, _splat(-87.33654), x)
    x = builder.select(builder.fcmp_ordered(">", x, _splat(88.3)), _splat(88.3), x)
    n = builder.call(floor, [builder.fadd(builder.fmul(x, _splat(1.44269504088896341)), _splat(0.5))])
    r = builder.fsub(builder.fsub(x, builder.fmul(n, _splat(0.693359375))), builder.fmul(n, _splat(-2.12194440e-4)))
    p = _splat(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = builder.fadd(builder.fmul(p, r), _splat(c))
    y = builder.fadd(builder.fadd(builder.fmul(p, builder.fmul(r, r)), r), _splat(1.0))
    bits = builder.shl(builder.add(builder.fptosi(n, V8I32), ir.Constant(V8I32, [127] * 8)), ir.Constant(V8I32, [23] * 8))
    y = builder.fmul(y, builder.bitcast(bits, V8))  # times 2 ** n
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
        return builder.load(builder.bitcast(builder.gep(row, [j]), V8.as_pointer()), align=4)
    return builder.insert_element(fill, builder.load(builder.gep(row, [j])), ir.Constant(ir.IntType(32), 0))


def _store_lanes(builder, v, row, j, lanes):
    if lanes == 8:
        builder.store(v, builder.bitcast(builder.gep(row, [j]), V8.as_pointer()), align=4)
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
        ssplat = splat8(builder, context.cast(builder, args[4], sig.args[4], types.float32))
        row = builder.gep(row_at(context, builder, sig.args[0], args[0], r_v), [lo_v])
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
    lane's sum in order and the lanes added in a fixed order (hsum), so a row's sum is the
    same whatever else is computed with it (a 2-D float32 C-contiguous; the caller checks the
    range). numba's np.exp called expf one element at a time (a third of a long prompt's
    attention), and one sum through the row waited on each add."""
    if not _row_args_ok(a, (r, lo, hi), (m,)):
        return None
    sig = types.float32(a, r, lo, hi, m)

    def codegen(context, builder, sig, args):
        r_v, lo_v, hi_v = (context.cast(builder, v, ty, types.int64) for v, ty in zip(args[1:4], sig.args[1:4]))
        msplat = splat8(builder, context.cast(builder, args[4], sig.args[4], types.float32))
        row = builder.gep(row_at(context, builder, sig.args[0], args[0], r_v), [lo_v])
        total = cgutils.alloca_once_value(builder, _splat(0.0))
        one_lane = ir.Constant(V8, [1.0] + [0.0] * 7)

        def step(j, lanes):
            e = _vexp(builder, builder.fsub(_lanes_at(builder, row, j, lanes, msplat), msplat))
            _store_lanes(builder, e, row, j, lanes)
            if lanes == 1:  # only lane 0 holds an element (the fill's lanes are exp(0))
                e = builder.fmul(e, one_lane)
            builder.store(builder.fadd(builder.load(total), e), total)

        _by_eights(builder, builder.sub(hi_v, lo_v), step)
        return hsum(builder, builder.load(total))

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
            gr, ur, outr = (builder.gep(row_at(context, builder, sig.args[k], args[k], i), [n_lo_v]) for k in range(3))

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
        alpha_v, limit_v = (splat8(builder, context.cast(builder, v, ty, types.float32))
                            for v, ty in zip(args[4:6], sig.args[4:6]))
        neg_limit = builder.fsub(_splat(0.0), limit_v)
        i_lo_v, i_hi_v, n_lo_v, n_hi_v = (context.cast(builder, v, ty, types.int64)
                                          for v, ty in zip(args[6:10], sig.args[6:10]))
        gbr, ubr = (builder.gep(context.make_array(sig.args[k])(context, builder, args[k]).data, [n_lo_v]) for k in (2, 3))
        one, zero = _splat(1.0), _splat(0.0)
        with cgutils.for_range(builder, builder.sub(i_hi_v, i_lo_v)) as rows:
            i = builder.add(i_lo_v, rows.index)
            hr, ur = (builder.gep(row_at(context, builder, sig.args[k], args[k], i), [n_lo_v]) for k in range(2))

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
        L = lanes_for(context, 8 * NV)
        nvec = 8 * NV // L
        vf = ir.VectorType(F32, L)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fmuladd.v{L}f32")
        arows = [row_at(context, builder, sig.args[0], a_v, builder.add(r0_v, ir.Constant(i64, i))) for i in range(NH)]
        optrs = [[builder.bitcast(builder.gep(row_at(context, builder, sig.args[2], out_v,
                                                   builder.add(h0_v, ir.Constant(i64, i))),
                                              [builder.add(d0_v, ir.Constant(i64, L * k))]), vf.as_pointer())
                  for k in range(nvec)] for i in range(NH)]
        accs = [[cgutils.alloca_once_value(builder, builder.load(optrs[i][k], align=4) if CONT
                                           else ir.Constant(vf, [0.0] * L)) for k in range(nvec)] for i in range(NH)]
        with cgutils.for_range(builder, builder.sub(hi_v, lo_v)) as loop:
            j = builder.add(lo_v, loop.index)
            vrow = row_at(context, builder, sig.args[1], v_v, builder.sub(j, voff_v))
            vs = [builder.load(builder.bitcast(builder.gep(vrow, [builder.add(d0_v, ir.Constant(i64, L * k))]),
                                               vf.as_pointer()), align=4) for k in range(nvec)]
            for i in range(NH):
                splat = splat_lanes(builder, builder.load(builder.gep(arows[i], [j])), L)
                for k in range(nvec):
                    builder.store(builder.call(fma, [splat, vs[k], builder.load(accs[i][k])]), accs[i][k])
        for i in range(NH):
            for k in range(nvec):
                builder.store(builder.load(accs[i][k]), optrs[i][k], align=4)
        return context.get_dummy_value()

    return sig, codegen
