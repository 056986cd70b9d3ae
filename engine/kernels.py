"""Numba kernels for the hot loops, each over preallocated numpy arrays.

Activations are float32. Weights stay in their storage precision: float32, float16,
or bf16 held as raw uint16 bits (see storage.safetensors); the 16-bit kernels widen
a block of rows at a time into a small float32 buffer (bf16 for a few tokens in
registers) and never make a float32 copy of a matrix. Every kernel is `nogil`, so reads of the next experts can run while it
computes, and `cache=True`, so a process compiles it once per machine. Two pieces, the
int4 decode matmul (_q4_matmul) and the float32 tile (_f32_tile) of the dense and int4
prompt-path matmuls, are written in
LLVM IR through numba's `intrinsic`, where numba's loops could not say what the vector code
should be.

The numpy references these are tested against live in tests/engine/test_kernels.py.
"""

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

JIT = dict(cache=True, nogil=True)
# reassociating the dot-product sum lets LLVM vectorise it; results differ from a
# sequential sum only in rounding (~1e-7 relative), as any BLAS does
JIT_FAST = dict(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})


def f16_table() -> np.ndarray:
    """float32 value of every float16 bit pattern, for the f16 matmul kernel."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


ROWS_PER_TASK = 64  # rows a parallel kernel's thread takes at a time
ROW_BLOCK = 16  # rows a kernel widens or dequantizes at a time for _tiles (16 x 2048 f32: 128 KiB, in L2)


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


_TILE_TOKENS, _TILE_ROWS = 2, 4  # the float32 tile: 8 independent sums, 6 loads per 8 FMAs


@intrinsic
def _f32_tile(typingctx, x, w, out, t0, r0, n0, nt, nr):
    """out[t0 + i, n0 + r0 + j] = x[t0 + i] . w[r0 + j] for i < nt, j < nr (compile-time
    constants); x [T, D] float32, w [R, D] float32 or bf16 bits (uint16, widened in registers:
    exact, so the same bits as from a widened copy); every array 2-D C-contiguous; the caller
    checks shapes. Each pair is one 8-lane chain of multiply-adds over D's multiple of 8, a horizontal
    sum in a fixed order, then the last D % 8 products one by one: the same operations whatever
    tile it is computed in, so a (token, row) result does not depend on the tokens or rows
    beside it, nor on the process (no fast-math)."""
    if not (isinstance(nt, types.IntegerLiteral) and isinstance(nr, types.IntegerLiteral)
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (x, w, out))
            and w.dtype in (types.float32, types.uint16)):
        return None
    NT, NR = nt.literal_value, nr.literal_value
    bf16 = w.dtype == types.uint16
    sig = types.void(x, w, out, t0, r0, n0, nt, nr)

    def codegen(context, builder, sig, args):
        x_v, w_v, out_v, t0_v, r0_v, n0_v = args[:6]
        i64 = ir.IntType(64)
        xrows = [_row(context, builder, sig.args[0], x_v, builder.add(t0_v, ir.Constant(i64, i))) for i in range(NT)]
        wrows = [_row(context, builder, sig.args[1], w_v, builder.add(r0_v, ir.Constant(i64, j))) for j in range(NR)]
        D = builder.extract_value(context.make_array(sig.args[0])(context, builder, x_v).shape, 1)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3), "llvm.fmuladd.v8f32")
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V8, [0.0] * 8)) for _ in range(NR)] for _ in range(NT)]
        with cgutils.for_range(builder, builder.sdiv(D, ir.Constant(i64, 8))) as loop:
            off = builder.mul(loop.index, ir.Constant(i64, 8))
            xs = [builder.load(builder.bitcast(builder.gep(r, [off]), _V8.as_pointer()), align=4) for r in xrows]
            if bf16:  # [8] bf16 bits -> float32: the bits shifted into the high half
                ws = [builder.bitcast(builder.shl(builder.zext(builder.load(builder.bitcast(
                      builder.gep(r, [off]), _V8I16.as_pointer()), align=2), _V8I32), ir.Constant(_V8I32, [16] * 8)), _V8)
                      for r in wrows]
            else:
                ws = [builder.load(builder.bitcast(builder.gep(r, [off]), _V8.as_pointer()), align=4) for r in wrows]
            for i in range(NT):
                for j in range(NR):
                    builder.store(builder.call(fma, [xs[i], ws[j], builder.load(accs[i][j])]), accs[i][j])
        sums = [[cgutils.alloca_once_value(builder, _hsum(builder, builder.load(accs[i][j]))) for j in range(NR)]
                 for i in range(NT)]
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fmuladd.f32")
        with cgutils.for_range(builder, builder.srem(D, ir.Constant(i64, 8))) as tail:  # D % 8 products
            d = builder.add(builder.sub(D, builder.srem(D, ir.Constant(i64, 8))), tail.index)
            for i in range(NT):
                for j in range(NR):
                    xd, wd = (builder.load(builder.gep(r, [d])) for r in (xrows[i], wrows[j]))
                    if bf16:
                        wd = builder.bitcast(builder.shl(builder.zext(wd, ir.IntType(32)), ir.Constant(ir.IntType(32), 16)), _F32)
                    builder.store(builder.call(fma1, [xd, wd, builder.load(sums[i][j])]), sums[i][j])
        for i in range(NT):
            orow = _row(context, builder, sig.args[2], out_v, builder.add(t0_v, ir.Constant(i64, i)))
            for j in range(NR):
                n = builder.add(n0_v, builder.add(r0_v, ir.Constant(i64, j)))
                builder.store(builder.load(sums[i][j]), builder.gep(orow, [n]))
        return context.get_dummy_value()

    return sig, codegen


@nb.njit(**JIT)
def _tiles(x, w, r_lo, r_hi, out, n0):
    # out[:, n0 + r] = x @ w[r] for r_lo <= r < r_hi: x [T, D], w [R, D] float32 or bf16 bits, C-contiguous;
    # in tiles of _TILE_TOKENS x _TILE_ROWS, the rows and tokens left over in smaller ones
    T = x.shape[0]
    t_end = T - T % _TILE_TOKENS
    r_end = r_hi - (r_hi - r_lo) % _TILE_ROWS
    for r in range(r_lo, r_end, _TILE_ROWS):
        for t in range(0, t_end, _TILE_TOKENS):
            _f32_tile(x, w, out, t, r, n0, _TILE_TOKENS, _TILE_ROWS)
        for t in range(t_end, T):
            _f32_tile(x, w, out, t, r, n0, 1, _TILE_ROWS)
    for r in range(r_end, r_hi):
        for t in range(T):
            _f32_tile(x, w, out, t, r, n0, 1, 1)


def _make_matmul_u16(parallel: bool):
    @nb.njit(parallel=parallel, **JIT)
    def matmul_u16(x, w, is_bf16, f16_lut, out):
        # x [T, D] f32, w [N, D] u16 (bf16 bits or f16 bits), out [T, N] f32: out = x @ w.T.
        # A task of ROWS_PER_TASK rows widens ROW_BLOCK of them at a time into float32 (exact)
        # and takes them through _tiles with every token; bf16 for up to four tokens goes
        # through _tiles directly, widened in registers. A (token, row) result is the same
        # whatever else shares the call
        T, D = x.shape
        N = w.shape[0]
        if out.shape[0] != T or out.shape[1] != N or w.shape[1] != D:
            raise ValueError("matmul: weight, activation and output shapes do not match")  # the tile does not check
        # `parallel` is read here so that it is part of the closure numba's cache keys on: the
        # serial and the parallel build of this function must not share a cache entry
        assert parallel or not parallel
        for c in nb.prange((N + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            if is_bf16 and T <= 4:  # a few tokens: the tile widens bf16 in registers (a copy would be read few times)
                _tiles(x, w, c * ROWS_PER_TASK, min(N, (c + 1) * ROWS_PER_TASK), out, 0)
                continue
            bits = np.empty((ROW_BLOCK, D), np.uint32)  # one buffer per task, not per row
            wb = bits.view(np.float32)  # [ROW_BLOCK, D] widened rows
            for n0 in range(c * ROWS_PER_TASK, min(N, (c + 1) * ROWS_PER_TASK), ROW_BLOCK):
                nr = min(ROW_BLOCK, N - n0)
                for r in range(nr):
                    if is_bf16:
                        for d in range(D):
                            bits[r, d] = np.uint32(w[n0 + r, d]) << 16
                    else:
                        for d in range(D):
                            wb[r, d] = f16_lut[w[n0 + r, d]]
                _tiles(x, wb, 0, nr, out, n0)

    return matmul_u16


# a parallel region costs tens of microseconds to start: worth it for the big dense matrices
# (attention, LM head), not for one expert's
matmul_u16 = _make_matmul_u16(parallel=False)
matmul_u16_par = _make_matmul_u16(parallel=True)
PARALLEL_MIN_ELEMENTS = 4 * 2**20


def _make_matmul_f32(parallel: bool):
    @nb.njit(parallel=parallel, **JIT)
    def matmul_f32(x, w, out):
        # x [T, D] f32, w [N, D] f32, out [T, N]: out = x @ w.T through _tiles, ROWS_PER_TASK
        # rows a task
        T, D = x.shape
        N = w.shape[0]
        if out.shape[0] != T or out.shape[1] != N or w.shape[1] != D:
            raise ValueError("matmul: weight, activation and output shapes do not match")
        assert parallel or not parallel  # part of the cache key, as in matmul_u16
        for c in nb.prange((N + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            _tiles(x, w, c * ROWS_PER_TASK, min(N, (c + 1) * ROWS_PER_TASK), out, 0)

    return matmul_f32


matmul_f32 = _make_matmul_f32(parallel=False)
matmul_f32_par = _make_matmul_f32(parallel=True)


@nb.njit(**JIT)
def rmsnorm(x, w, eps, out):
    # x [T, D] f32, w [D] f32, out [T, D]
    T, D = x.shape
    for t in range(T):
        ss = 0.0
        for d in range(D):
            ss += np.float64(x[t, d]) * x[t, d]
        inv = np.float32(1.0 / np.sqrt(ss / D + eps))
        for d in range(D):
            out[t, d] = w[d] * (x[t, d] * inv)


@nb.njit(**JIT)
def rope(x, cos, sin):
    # x [T, H, hd] f32 rotated in place (rotate-half convention); cos, sin [T, hd/2]
    T, H, hd = x.shape
    half = hd // 2
    for t in range(T):
        for h in range(H):
            for i in range(half):
                a = x[t, h, i]
                b = x[t, h, i + half]
                x[t, h, i] = a * cos[t, i] - b * sin[t, i]
                x[t, h, i + half] = b * cos[t, i] + a * sin[t, i]


@nb.njit(**JIT_FAST)
def attention(q, k_cache, v_cache, pos0, window, scale, out):
    # q [T, Hq, hd] f32 for absolute positions pos0..pos0+T-1; k_cache, v_cache [Hkv, S, hd]
    # holding positions 0..pos0+T-1; out [T, Hq, hd]. Causal; with window > 0 a query at p
    # sees keys at j with p - window < j <= p.
    T, Hq, hd = q.shape
    Hkv = k_cache.shape[0]
    n_rep = Hq // Hkv
    scores = np.empty(pos0 + T, np.float32)
    for t in range(T):
        p = pos0 + t
        lo = 0
        if window > 0 and p - window + 1 > 0:
            lo = p - window + 1
        for h in range(Hq):
            g = h // n_rep
            m = np.float32(-np.inf)
            for j in range(lo, p + 1):
                s = np.float32(0.0)
                for d in range(hd):
                    s += q[t, h, d] * k_cache[g, j, d]
                s *= scale
                scores[j] = s
                if s > m:
                    m = s
            z = np.float32(0.0)
            for j in range(lo, p + 1):
                e = np.exp(scores[j] - m)
                scores[j] = e
                z += e
            for d in range(hd):
                out[t, h, d] = 0.0
            for j in range(lo, p + 1):
                a = scores[j] / z
                for d in range(hd):
                    out[t, h, d] += a * v_cache[g, j, d]


@nb.njit(**JIT)
def silu_mul(gate, up, out):
    # gate, up, out [T, I] f32: out = silu(gate) * up
    T, I = gate.shape
    for t in range(T):
        for i in range(I):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]


@nb.njit(**JIT_FAST)
def read_bandwidth(buf, n_rep):
    # sum of a large uint64 buffer n_rep times: the memory-read roofline for the benchmarks
    s = np.uint64(0)
    for _ in range(n_rep):
        for i in range(buf.shape[0]):
            s += buf[i]
    return s


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
def q4_split(x, g, xe, xd, xsum8):
    # x [T, D] -> xe [T, D/2] (even columns), xd [T, D/2] (odd columns - 16 * even ones),
    # xsum8 [T, D/g] = 8 * each group's sum: what the int4 row dot takes instead of x. Strict
    # float order (no fast-math): the int4 kernels inline it, and a reassociated sum was rounded
    # one way when compiled fresh and another when loaded from numba's cache
    T, D = x.shape
    for t in range(T):
        for j in range(D // 2):
            xe[t, j] = x[t, 2 * j]
            xd[t, j] = x[t, 2 * j + 1] - np.float32(16.0) * x[t, 2 * j]
        for gi in range(D // g):
            s = np.float32(0.0)
            for j in range(gi * g, gi * g + g):
                s += x[t, j]
            xsum8[t, gi] = np.float32(8.0) * s


def _q4_rows_dot(context, builder, sig, args, t0, n, nt: int, nblk: int):
    # emits out[t0 + i, n] = token t0+i's dot with int4 row n for i < nt (see linear_q4_g for
    # the algebra). The bytes of a group are widened once for the nt tokens; each token's
    # floats go through exactly the operations they would alone, so a token's result does not
    # depend on the tokens beside it
    xe_v, xd_v, xs_v, q_v, sc_v, lut_v, out_v = args[:7]
    i64, i32 = ir.IntType(64), ir.IntType(32)
    ts = [builder.add(t0, ir.Constant(i64, i)) for i in range(nt)]
    erows, drows, srows = ([_row(context, builder, sig.args[k], args[k], t) for t in ts] for k in range(3))
    qrow, scrow = (_row(context, builder, sig.args[k], args[k], n) for k in (3, 4))
    lut = context.make_array(sig.args[5])(context, builder, lut_v).data
    n_groups = builder.sdiv(builder.extract_value(context.make_array(sig.args[0])(context, builder, xe_v).shape, 1),
                            ir.Constant(i64, nblk * 8))
    # multiply-add, fused where the CPU has FMA
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3), "llvm.fmuladd.v8f32")
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8]), "llvm.floor.v8f32")
    sixteenth = ir.Constant(_V8, [0.0625] * 8)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8, [0.0] * 8)) for _ in range(nt)]  # sum of scale * part
    corrs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(nt)]  # sum of scale * xsum8
    with cgutils.for_range(builder, n_groups) as loop:
        gi = loop.index
        s = builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(scrow, [gi])), i64)]))
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(_V8, None), s, ir.Constant(i32, 0)),
                                       ir.Constant(_V8, None), ir.Constant(ir.VectorType(i32, 8), [0] * 8))
        offs = [builder.add(builder.mul(gi, ir.Constant(i64, nblk * 8)), ir.Constant(i64, 8 * c)) for c in range(nblk)]
        bs = [builder.uitofp(builder.load(builder.bitcast(builder.gep(qrow, [off]), _V8I8.as_pointer()), align=1), _V8)
              for off in offs]  # [8] bytes b of each block
        his = [builder.call(floor, [builder.fmul(b, sixteenth)]) for b in bs]  # [8] floor(b / 16)
        for i in range(nt):
            builder.store(builder.fadd(builder.load(corrs[i]), builder.fmul(builder.load(builder.gep(srows[i], [gi])), s)),
                          corrs[i])
            parts = []
            for off, b, hi in zip(offs, bs, his):  # [8] e * b + d * floor(b / 16) for each block of 8 bytes
                e, d = (builder.load(builder.bitcast(builder.gep(row, [off]), _V8.as_pointer()), align=4)
                        for row in (erows[i], drows[i]))
                parts.append(builder.call(fma, [e, b, builder.fmul(d, hi)]))
            while len(parts) > 1:  # pairwise: independent adds, not a chain
                parts = [builder.fadd(parts[k], parts[k + 1]) for k in range(0, len(parts) - 1, 2)] + parts[len(parts) & ~1:]
            builder.store(builder.call(fma, [parts[0], splat, builder.load(accs[i])]), accs[i])
    for i in range(nt):
        orow = _row(context, builder, sig.args[6], out_v, ts[i])
        builder.store(builder.fsub(_hsum(builder, builder.load(accs[i])), builder.load(corrs[i])), builder.gep(orow, [n]))


Q4_TOKENS = 4  # tokens the int4 decode path takes through a row at a time


@intrinsic
def _q4_matmul(typingctx, xe, xd, xsum8, q, scales, f16_lut, out, half):
    """out [T, N] = the int4 decode path's x @ dequant(q).T, from q4_split's xe, xd, xsum8
    (see linear_q4_g for the algebra), in explicit 8-lane vectors. `half` (bytes per group)
    must be a compile-time constant; every 2-D array C-contiguous; the caller checks shapes.

    Written in LLVM IR because numba's loops give LLVM a single chain of dependent FMAs through
    each group and a horizontal sum per group: the kernel then waits on latency at ~5 GB/s of
    weights. Here each 8-byte block of a group is independent, the blocks are summed pairwise,
    and the group's scale multiplies that vector into an 8-lane accumulator: one horizontal sum
    per row, ~7.5-8.7 GB/s on one core (bench/kernels.py). Tokens go through in blocks of
    Q4_TOKENS, the blocks the outer loop (a block's activations stay in L1 while the weights
    stream past), and a block widens each weight byte once for all its tokens: 1.5x for 4-12
    tokens. The order of the float operations is fixed by this code (no fast-math on it), and
    each (token, row) goes through the same operations however many tokens are in the call,
    so the result is the same in every process and alone or batched."""
    arrays = (xe, xd, xsum8, q, scales, out)
    if not (isinstance(half, types.IntegerLiteral) and half.literal_value % 8 == 0
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)):
        return None  # numba reports the call as not typeable
    nblk = half.literal_value // 8
    sig = types.void(xe, xd, xsum8, q, scales, f16_lut, out, half)

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        T = builder.extract_value(context.make_array(sig.args[0])(context, builder, args[0]).shape, 0)
        N = builder.extract_value(context.make_array(sig.args[3])(context, builder, args[3]).shape, 0)
        full = builder.sdiv(T, ir.Constant(i64, Q4_TOKENS))
        with cgutils.for_range(builder, full) as tb:
            t0 = builder.mul(tb.index, ir.Constant(i64, Q4_TOKENS))
            with cgutils.for_range(builder, N) as row:
                _q4_rows_dot(context, builder, sig, args, t0, row.index, Q4_TOKENS, nblk)
        t0 = builder.mul(full, ir.Constant(i64, Q4_TOKENS))
        rest = builder.sub(T, t0)
        for nt in (2, 1):  # the last tokens: a block of 2, then 1, as many as there are
            nt_c = ir.Constant(i64, nt)
            with builder.if_then(builder.icmp_signed(">=", rest, nt_c)):
                t = builder.sub(T, rest)
                with cgutils.for_range(builder, N) as row:
                    _q4_rows_dot(context, builder, sig, args, t, row.index, nt, nblk)
            rest = builder.select(builder.icmp_signed(">=", rest, nt_c), builder.sub(rest, nt_c), rest)
        return context.get_dummy_value()

    return sig, codegen


def _make_q4(g: int):
    # the int4 kernels of one group size (linear, whole expert, prompt-token linear): the group's length must be a constant (LLVM
    # vectorises the prompt path's group loop only then; the decode path's vector code is
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
        if q.shape[1] * 2 != D or scales.shape[1] * g != D or out.shape[1] != q.shape[0] or f16_lut.shape[0] != 65536:
            raise ValueError("int4 kernel: weight, activation and output shapes do not match")  # the row dot does not check
        xe, xd, xs = np.empty((T, D // 2), np.float32), np.empty((T, D // 2), np.float32), np.empty((T, D // g), np.float32)
        q4_split(x, g, xe, xd, xs)
        _q4_matmul(xe, xd, xs, q, scales, f16_lut, out, half)

    @nb.njit(**JIT)
    def swiglu_q4_g(x_all, rows, A, wts, gq, gs, uq, us, dq, ds, f16_lut, ys):
        # a whole int4 expert on the decode path in one call, for the rows of a MoE step that
        # chose it: x_all [T_all, D] f32; rows [T] int64, flat positions token * A + slot;
        # wts [T_all * A] f32 routing weights; gate, up: q [I, D/2], scales [I, D/g]; down:
        # q [D, I/2], scales [D, I/g]; ys [T_all * A, D]: ys[r] = wts[r] * down(silu(gate x) * up x)
        # for x = x_all[r // A], r in rows. The operations of linear_q4_g, silu_mul, linear_q4_g
        # one by one, and the gather and the weighting, without a trip through Python between
        # them (the glue cost as much as the kernels); the inlined helpers may round differently
        # from the separate calls
        D = x_all.shape[1]
        T = rows.shape[0]
        I = gq.shape[0]
        if (gq.shape[1] * 2 != D or uq.shape != gq.shape or dq.shape[0] != D or dq.shape[1] * 2 != I
                or gs.shape[1] * g != D or us.shape != gs.shape or ds.shape[1] * g != I or ys.shape[1] != D
                or f16_lut.shape[0] != 65536 or wts.shape[0] != ys.shape[0] or x_all.shape[0] * A != ys.shape[0]):
            raise ValueError("int4 expert: weight, activation and output shapes do not match")
        x = np.empty((T, D), np.float32)
        for i in range(T):
            if rows[i] < 0 or rows[i] >= ys.shape[0]:
                raise ValueError("int4 expert: a row outside the step")
            x[i] = x_all[rows[i] // A]
        out = np.empty((T, D), np.float32)
        xe, xd, xs = np.empty((T, D // 2), np.float32), np.empty((T, D // 2), np.float32), np.empty((T, D // g), np.float32)
        q4_split(x, g, xe, xd, xs)
        h, u = np.empty((T, I), np.float32), np.empty((T, I), np.float32)
        _q4_matmul(xe, xd, xs, gq, gs, f16_lut, h, half)
        _q4_matmul(xe, xd, xs, uq, us, f16_lut, u, half)
        silu_mul(h, u, h)
        he, hd, hs = np.empty((T, I // 2), np.float32), np.empty((T, I // 2), np.float32), np.empty((T, I // g), np.float32)
        q4_split(h, g, he, hd, hs)
        _q4_matmul(he, hd, hs, dq, ds, f16_lut, out, half)
        for i in range(T):
            for d in range(D):
                ys[rows[i], d] = out[i, d] * wts[rows[i]]

    @nb.njit(**JIT)
    def linear_q4_tok_g(x, q, scales, f16_lut, out):
        # the prompt-token path: x [T, D] f32, q [N, D/2] uint8, scales [N, D/g] f16 bits,
        # out [T, N] = x @ dequant(q).T. It dequantizes a block of ROW_BLOCK rows once
        # ((v - 8) * scale is exact in float32) and dots it with every token in tiles of
        # _TILE_TOKENS x _TILE_ROWS (_tiles) while it sits in L2; the decode path unpacks every
        # weight again for every few tokens. A (token, row) result is the same whatever tile
        # computes it, so it does not depend on the tokens beside it; it differs from the
        # decode path's in rounding only.
        T, D = x.shape
        N = q.shape[0]
        if q.shape[1] * 2 != D or scales.shape[1] * g != D or out.shape[0] != T or out.shape[1] != N:
            raise ValueError("int4 kernel: weight, activation and output shapes do not match")  # the tile does not check
        wb = np.empty((ROW_BLOCK, D), np.float32)  # [rows, D] dequantized
        for n0 in range(0, N, ROW_BLOCK):
            nr = min(ROW_BLOCK, N - n0)
            for r in range(nr):
                for gi in range(D // g):
                    s = f16_lut[scales[n0 + r, gi]]
                    for j in range(gi * half, gi * half + half):
                        b = np.float32(q[n0 + r, j])
                        hi = np.floor(b * np.float32(0.0625))
                        wb[r, 2 * j] = (b - np.float32(16.0) * hi - np.float32(8.0)) * s
                        wb[r, 2 * j + 1] = (hi - np.float32(8.0)) * s
            _tiles(x, wb, 0, nr, out, n0)

    return linear_q4_g, swiglu_q4_g, linear_q4_tok_g


# group size -> kernel (storage/quant.py INT4_GROUPS); _TOK: the prompt-token path
LINEAR_Q4, SWIGLU_Q4, LINEAR_Q4_TOK = {}, {}, {}
for _g in (32, 64, 128):
    LINEAR_Q4[_g], SWIGLU_Q4[_g], LINEAR_Q4_TOK[_g] = _make_q4(_g)
