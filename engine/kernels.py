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

The parallel work of a forward step (int4 experts, the big dense matrices) runs in one
kernel shared by threads, crew_g (layers.Crew): jobs on an int64 board, units taken from
atomic counters.

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


@nb.njit(**JIT)
def matmul_u16_rows(x, w, is_bf16, f16_lut, out, r_lo, r_hi):
    # out[:, r] = x @ w[r] for r_lo <= r < r_hi: x [T, D] f32, w [N, D] u16 (bf16 or f16 bits),
    # out [T, N] f32; the caller checks shapes. ROW_BLOCK rows at a time widened into float32
    # (exact) and taken through _tiles with every token; bf16 for up to four tokens goes
    # through _tiles directly, widened in registers. A (token, row) result is the same
    # whatever else shares the call
    T, D = x.shape
    if is_bf16 and T <= 4:  # a few tokens: the tile widens bf16 in registers (a copy would be read few times)
        _tiles(x, w, r_lo, r_hi, out, 0)
        return
    bits = np.empty((ROW_BLOCK, D), np.uint32)  # one buffer per call, not per row
    wb = bits.view(np.float32)  # [ROW_BLOCK, D] widened rows
    for n0 in range(r_lo, r_hi, ROW_BLOCK):
        nr = min(ROW_BLOCK, r_hi - n0)
        for r in range(nr):
            if is_bf16:
                for d in range(D):
                    bits[r, d] = np.uint32(w[n0 + r, d]) << 16
            else:
                for d in range(D):
                    wb[r, d] = f16_lut[w[n0 + r, d]]
        _tiles(x, wb, 0, nr, out, n0)


def _make_matmul_u16(parallel: bool):
    @nb.njit(parallel=parallel, **JIT)
    def matmul_u16(x, w, is_bf16, f16_lut, out):
        # x [T, D] f32, w [N, D] u16 (bf16 bits or f16 bits), out [T, N] f32: out = x @ w.T,
        # ROWS_PER_TASK rows a task (matmul_u16_rows)
        T, D = x.shape
        N = w.shape[0]
        if out.shape[0] != T or out.shape[1] != N or w.shape[1] != D:
            raise ValueError("matmul: weight, activation and output shapes do not match")  # the tile does not check
        # `parallel` is read here so that it is part of the closure numba's cache keys on: the
        # serial and the parallel build of this function must not share a cache entry
        assert parallel or not parallel
        for c in nb.prange((N + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            matmul_u16_rows(x, w, is_bf16, f16_lut, out, c * ROWS_PER_TASK, min(N, (c + 1) * ROWS_PER_TASK))

    return matmul_u16


# a parallel region costs tens of microseconds to start: worth it for the big dense matrices
# (attention, LM head), not for one expert's
matmul_u16 = _make_matmul_u16(parallel=False)
matmul_u16_par = _make_matmul_u16(parallel=True)
PARALLEL_MIN_ELEMENTS = 4 * 2**20
CREW_MIN_ELEMENTS = 2**18  # a crew job costs ~10 us to publish, no thread to wake: worth it from 256 Ki weights


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
    # x [T, H, hd] f32 rotated in place (rotate-half convention); cos, sin [T, rot/2]. A
    # partial rotary (rot < hd, partial_rotary_factor) turns the first rot dims and passes
    # the rest, as transformers does; the table's width, not hd, bounds the loop.
    T, H, hd = x.shape
    half = cos.shape[1]
    if 2 * half > hd or cos.shape[0] < T or sin.shape[0] < T or sin.shape[1] != half:
        raise ValueError("rope: the cos/sin table does not fit the heads")
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
def _carve(work, o, n, m):
    # work[o : o + n m] (1-D) as [n, m], and the offset after it
    return work[o : o + n * m].reshape(n, m), o + n * m


@nb.njit(**JIT)
def _silu(g):
    return g / (np.float32(1.0) + np.exp(-g))


@nb.njit(**JIT)
def silu_mul(gate, up, out):
    # gate, up, out [T, I] f32: out = silu(gate) * up
    T, I = gate.shape
    for t in range(T):
        for i in range(I):
            out[t, i] = _silu(gate[t, i]) * up[t, i]


@nb.njit(**JIT)
def sum_slots(ys, A, out):
    # ys [T * A, D] f32 -> out [T, D]: out[t] = ys[t*A] + ys[t*A + 1] + ... in that order
    T, D = out.shape
    for t in range(T):
        for d in range(D):
            out[t, d] = ys[t * A, d]
        for a in range(1, A):
            for d in range(D):
                out[t, d] += ys[t * A + a, d]


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
# layers.Crew's board (crew_g): published jobs, the closed flag, helpers in, units the helpers
# did; then each job's descriptor
BOARD_HEAD, JOB_LEN = 4, 13
JOB_MOE_Q4, JOB_U16, JOB_F32 = 1, 2, 3  # a job's kind
SPIN_LIMIT = 20_000_000  # spins a helper waits for the next job before it leaves (~10-40 ms)
YIELD_EVERY = 4096  # spins between two offers of the CPU to other threads (a few microseconds)
MOE_IN_ROWS, MOE_OUT_ROWS = 64, 256  # gate/up rows, down rows a unit of crew_g takes (~128 KiB, ~96 KiB of int4 at 2048 x 768)


@intrinsic
def _q4_matmul(typingctx, xe, xd, xsum8, q, scales, f16_lut, out, half, t_lo, t_hi, n_lo, n_hi):
    """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = the int4 decode path's x[t] . dequant(q[n]),
    from q4_split's xe, xd, xsum8 (see linear_q4_g for the algebra), in explicit 8-lane vectors.
    `half` (bytes per group) must be a compile-time constant; every 2-D array C-contiguous; the
    caller checks shapes and ranges.

    Written in LLVM IR because numba's loops give LLVM a single chain of dependent FMAs through
    each group and a horizontal sum per group: the kernel then waits on latency at ~5 GB/s of
    weights. Here each 8-byte block of a group is independent, the blocks are summed pairwise,
    and the group's scale multiplies that vector into an 8-lane accumulator: one horizontal sum
    per row, ~7.5-8.7 GB/s on one core (bench/kernels.py). Tokens go through in blocks of
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
                _q4_rows_dot(context, builder, sig, args, t, builder.add(n_lo, row.index), nt, nblk)

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


def _int64_slot(context, builder, sig, args):
    # pointer to a[i] of a 1-D int64 array (args[0], args[1])
    a = context.make_array(sig.args[0])(context, builder, args[0])
    return builder.gep(a.data, [context.cast(builder, args[1], sig.args[1], types.int64)])


def _is_int64_vector(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1 and a.layout == "C"


@intrinsic
def _atomic_add(typingctx, a, i, v):
    """a[i] += v in one atomic step (sequentially consistent); returns the value before. a: 1-D
    int64, C-contiguous: the counters threads share a piece of work by."""
    if not (_is_int64_vector(a) and isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _int64_slot(context, builder, sig, args),
                                  context.cast(builder, args[2], sig.args[2], types.int64), "seq_cst")

    return types.int64(a, i, v), codegen


@intrinsic
def _atomic_load(typingctx, a, i):
    """a[i], read atomically with acquire order (what another thread wrote before its
    _atomic_add of it is visible after)."""
    if not (_is_int64_vector(a) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_int64_slot(context, builder, sig, args), "acquire", 8)

    return types.int64(a, i), codegen


@intrinsic
def _yield_cpu(typingctx):
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


_u8_at, _u16_at, _i64_at, _f32_at = (_pointer_from(t) for t in (types.uint8, types.uint16, types.int64, types.float32))


@nb.njit(**JIT)
def describe_moe_q4(board, job, x_all, ints, R, E, work, n_work, I, A, wts, ys):
    # job `job`'s JOB_MOE_Q4 descriptor (see crew_g) onto the board, from the arrays themselves
    d = board[BOARD_HEAD + job * JOB_LEN : BOARD_HEAD + (job + 1) * JOB_LEN]
    d[0], d[1], d[2], d[3] = JOB_MOE_Q4, x_all.ctypes.data, x_all.shape[0], x_all.shape[1]
    d[4], d[5], d[6], d[7], d[8] = ints.ctypes.data, R, E, work.ctypes.data, n_work
    d[9], d[10], d[11], d[12] = I, A, wts.ctypes.data, ys.ctypes.data


@nb.njit(**JIT)
def describe_matmul(board, job, kind, x, w, out, ctl, is_bf16):
    # job `job`'s JOB_U16 / JOB_F32 descriptor (see crew_g) onto the board
    d = board[BOARD_HEAD + job * JOB_LEN : BOARD_HEAD + (job + 1) * JOB_LEN]
    d[0], d[1], d[2], d[3] = kind, x.ctypes.data, x.shape[0], x.shape[1]
    d[4], d[5], d[6], d[7], d[8] = w.ctypes.data, w.shape[0], out.ctypes.data, ctl.ctypes.data, is_bf16


def _make_q4(g: int):
    # the int4 kernels of one group size (linear, the crew's, prompt-token linear): the group's
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
        _q4_matmul(xe, xd, xs, q, scales, f16_lut, out, half, 0, T, 0, q.shape[0])

    @nb.njit(**JIT)
    def crew_g(board, job, f16_lut, serve):
        # The parallel work of a forward step, shared by threads (layers.Crew). `board` (int64):
        # board[0] the jobs published, board[1] nonzero once closed, board[2] the helpers in the
        # kernel, board[3] the units they did; job j's descriptor at BOARD_HEAD + j * JOB_LEN, its kind first:
        # - JOB_MOE_Q4: the decode path of int4 experts of group g: addresses and sizes of
        #   x_all [T_all, D] f32; ints: rows [R], starts [E + 1], addrs [E, 6], ctl [2 + 3 E]
        #   (int64, one after the other); work f32 [n_work]; wts [T_all * A] f32; ys
        #   [T_all * A, D] f32; and I, A. Expert e's rows are rows[starts[e]:starts[e + 1]],
        #   the flat positions token * A + slot that chose it; addrs[e] the addresses of its
        #   gate q [I, D/2] uint8, gate scales [I, D/g] f16 bits, up q, up scales, down q
        #   [D, I/2], down scales [D, I/g] (C-contiguous, alive through the job: the caller
        #   vouches for them, the kernel cannot see their shapes); ys[r] = wts[r] * down(silu(
        #   gate x) * up x) for x = x_all[r // A]; work >= R * (2 D + D/g + 3 I + I/g) scratch;
        #   ctl zeros, the job's counters.
        # - JOB_U16, JOB_F32: addresses and sizes of x [T, D] f32, w [N, D] (bf16 or f16 bits,
        #   or f32), out [T, N] f32, ctl [2] int64 zeros, then is_bf16: out = x @ w.T,
        #   ROWS_PER_TASK rows a unit, as matmul_u16 and matmul_f32 compute it.
        # serve == 0: publish job `job` and do it with whoever joins, returning when it is
        # done. serve == 1 (a helper): do each job from `job` on as it is published, until the
        # board is closed or nothing comes for SPIN_LIMIT spins.
        # A job is cut into units taken in order from a shared counter (for the experts: each
        # one's rows split by q4_split_row, its gate and up rows MOE_IN_ROWS at a time, then
        # silu * up, the split of its h, its down rows MOE_OUT_ROWS at a time, then the
        # weighting). A unit waits for the units it needs, which a running thread has already
        # taken, so a thread never waits for one that has not started. Every (token, row) goes
        # through the same operations whatever thread or unit computes it. The waits are plain
        # spins: an x86 `pause` in a KVM guest exits to the host (pause-loop exiting) and the
        # waiter stalls.
        j, idle = job, 0
        if serve:
            _atomic_add(board, 2, 1)
        while True:
            if serve:
                if _atomic_load(board, 1) != 0:
                    break
                if _atomic_load(board, 0) <= j:
                    idle += 1
                    if idle > SPIN_LIMIT:
                        break
                    if idle % YIELD_EVERY == 0:
                        _yield_cpu()
                    continue  # a plain spin (see above)
                idle = 0
            else:
                _atomic_add(board, 0, 1)  # published: helpers may start on it
            job_d = board[BOARD_HEAD + j * JOB_LEN : BOARD_HEAD + (j + 1) * JOB_LEN]  # its descriptor
            if job_d[0] == JOB_MOE_Q4:
                T_all, D, R, E, n_work, I, A = job_d[2], job_d[3], job_d[5], job_d[6], job_d[8], job_d[9], job_d[10]
                x_all = nb.carray(_f32_at(job_d[1]), (T_all, D))
                ints = nb.carray(_i64_at(job_d[4]), (R + E + 1 + 6 * E + 2 + 3 * E,))
                rows, starts = ints[:R], ints[R : R + E + 1]
                addrs = ints[R + E + 1 : R + 7 * E + 1].reshape(E, 6)
                ctl = ints[R + 7 * E + 1 :]
                work = nb.carray(_f32_at(job_d[7]), (n_work,))
                wts = nb.carray(_f32_at(job_d[11]), (T_all * A,))
                ys = nb.carray(_f32_at(job_d[12]), (T_all * A, D))
                if (starts[0] != 0 or starts[E] != R or I % g or D % g or f16_lut.shape[0] != 65536
                        or n_work < R * (2 * D + D // g + 3 * I + I // g)):
                    raise ValueError("int4 experts: weight, activation and output shapes do not match")
                for e in range(E):
                    if starts[e + 1] < starts[e]:
                        raise ValueError("int4 experts: rows out of order")
                for i in range(R):
                    if rows[i] < 0 or rows[i] >= ys.shape[0]:
                        raise ValueError("int4 experts: a row outside the step")
                # work, carved: xe, xd [R, D/2], xs [R, D/g], h, u [R, I], he, hd [R, I/2], hs [R, I/g], out [R, D]
                xe, o = _carve(work, 0, R, D // 2)
                xd, o = _carve(work, o, R, D // 2)
                xs, o = _carve(work, o, R, D // g)
                h, o = _carve(work, o, R, I)
                u, o = _carve(work, o, R, I)
                he, o = _carve(work, o, R, I // 2)
                hd, o = _carve(work, o, R, I // 2)
                hs, o = _carve(work, o, R, I // g)
                out, o = _carve(work, o, R, D)
                n_in, n_out = (I + MOE_IN_ROWS - 1) // MOE_IN_ROWS, (D + MOE_OUT_ROWS - 1) // MOE_OUT_ROWS
                # units: [0, E) x split; then E * n_in gate/up; then E h split; then E * n_out down.
                # ctl[0]: next unit; ctl[1]: units done; ctl[2 + e]: e's x split; ctl[2 + E + e]: its
                # gate/up units done; ctl[2 + 2 E + e]: its h split
                u_in, u_h, u_out = E, E + E * n_in, 2 * E + E * n_in
                total = u_out + E * n_out
                while True:
                    k = _atomic_add(ctl, 0, 1)
                    if k >= total:
                        break
                    if k < u_in:
                        for i in range(starts[k], starts[k + 1]):
                            q4_split_row(x_all, rows[i] // A, g, xe, xd, xs, i)
                        _atomic_add(ctl, 2 + k, 1)
                    elif k < u_h:
                        e, c = (k - u_in) // n_in, (k - u_in) % n_in
                        while _atomic_load(ctl, 2 + e) == 0:
                            pass
                        n_lo, n_hi = c * MOE_IN_ROWS, min(I, (c + 1) * MOE_IN_ROWS)
                        gq, gs = nb.carray(_u8_at(addrs[e, 0]), (I, D // 2)), nb.carray(_u16_at(addrs[e, 1]), (I, D // g))
                        uq, us = nb.carray(_u8_at(addrs[e, 2]), (I, D // 2)), nb.carray(_u16_at(addrs[e, 3]), (I, D // g))
                        _q4_matmul(xe, xd, xs, gq, gs, f16_lut, h, half, starts[e], starts[e + 1], n_lo, n_hi)
                        _q4_matmul(xe, xd, xs, uq, us, f16_lut, u, half, starts[e], starts[e + 1], n_lo, n_hi)
                        for i in range(starts[e], starts[e + 1]):
                            for n in range(n_lo, n_hi):
                                h[i, n] = _silu(h[i, n]) * u[i, n]
                        _atomic_add(ctl, 2 + E + e, 1)
                    elif k < u_out:
                        e = k - u_h
                        while _atomic_load(ctl, 2 + E + e) < n_in:
                            pass
                        for i in range(starts[e], starts[e + 1]):
                            q4_split_row(h, i, g, he, hd, hs, i)
                        _atomic_add(ctl, 2 + 2 * E + e, 1)
                    else:
                        e, c = (k - u_out) // n_out, (k - u_out) % n_out
                        while _atomic_load(ctl, 2 + 2 * E + e) == 0:
                            pass
                        d_lo, d_hi = c * MOE_OUT_ROWS, min(D, (c + 1) * MOE_OUT_ROWS)
                        dq, ds = nb.carray(_u8_at(addrs[e, 4]), (D, I // 2)), nb.carray(_u16_at(addrs[e, 5]), (D, I // g))
                        _q4_matmul(he, hd, hs, dq, ds, f16_lut, out, half, starts[e], starts[e + 1], d_lo, d_hi)
                        for i in range(starts[e], starts[e + 1]):
                            w = wts[rows[i]]
                            for d in range(d_lo, d_hi):
                                ys[rows[i], d] = out[i, d] * w
                    _atomic_add(ctl, 1, 1)
                    if serve:
                        _atomic_add(board, 3, 1)
                while _atomic_load(ctl, 1) < total:  # the units the other threads are still on
                    pass
            else:
                T, D, N = job_d[2], job_d[3], job_d[5]
                x, ctl = nb.carray(_f32_at(job_d[1]), (T, D)), nb.carray(_i64_at(job_d[7]), (2,))
                out = nb.carray(_f32_at(job_d[6]), (T, N))
                total = (N + ROWS_PER_TASK - 1) // ROWS_PER_TASK
                while True:
                    c = _atomic_add(ctl, 0, 1)
                    if c >= total:
                        break
                    r_hi = min(N, (c + 1) * ROWS_PER_TASK)
                    if job_d[0] == JOB_U16:
                        matmul_u16_rows(x, nb.carray(_u16_at(job_d[4]), (N, D)), job_d[8] != 0, f16_lut, out, c * ROWS_PER_TASK, r_hi)
                    else:
                        _tiles(x, nb.carray(_f32_at(job_d[4]), (N, D)), c * ROWS_PER_TASK, r_hi, out, 0)
                    _atomic_add(ctl, 1, 1)
                    if serve:
                        _atomic_add(board, 3, 1)
                while _atomic_load(ctl, 1) < total:  # the units the other threads are still on
                    pass
            if not serve:
                return
            j += 1
        _atomic_add(board, 2, -1)

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

    return linear_q4_g, crew_g, linear_q4_tok_g


# group size -> kernel (storage/quant.py INT4_GROUPS); _TOK: the prompt-token path
LINEAR_Q4, CREW, LINEAR_Q4_TOK = {}, {}, {}
for _g in (32, 64, 128):
    LINEAR_Q4[_g], CREW[_g], LINEAR_Q4_TOK[_g] = _make_q4(_g)
