"""Integer dot products: int8 and int4 weights times activations quantised to int8, the lossy
`activations: int8` path (named, labelled on every output; off unless asked for).

Each activation row is quantised on its own, per block of BLOCK (32) columns: d = max|x| /
127, q = rint(x / d) (quantize_rows); a row's result never depends on the rows beside it. A
weight row is dotted with it a block at a time in integers, exactly: eight int32 lanes per
block, lane l the sum of four products (for int8 weights columns 4l .. 4l + 3; for int4 the
block's columns are taken even ones first, then odd ones, the order the packed nibbles come
apart in, and the activations are stored in that order). Then in float32, in this order and
no other: each lane times s_k = d_k * (the weight group's scale), added into one of two
eight-lane sums, the even blocks' and the odd blocks', the two added, the eight lanes summed
left to right. Every instruction path gives these bits (tests/engine/test_intdot.py checks
each against the numpy reference here):

- PATH_VNNI512 (AVX-512 VNNI): `vpdpbusd` on 64 bytes, two blocks at once;
- PATH_VNNI256 (AVX-VNNI, or AVX-512 VNNI on 32 bytes): `vpdpbusd` a block at a time;
- PATH_AVX2: `vpmaddubsw` + `vpmaddwd` (the signs moved onto the weights for int8, so the
  16-bit pair sums cannot saturate: |x| <= 127 and |w| <= 127);
- PATH_GENERIC: widened integer multiplies LLVM lowers for any CPU.

`vpdpbusd` multiplies unsigned bytes by signed ones: int4 weights are unsigned as stored (v +
8), int8 ones made so by + 128; the lane's excess, 8 or 128 times the sum of its four
activations, is what the accumulator starts from (xc, made with the activations).
COLIBRI_INT8_PATH (vnni512, vnni256, avx2, generic) forces a path for the process.
"""

import os
import warnings

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..ir import F32, host_features, prefetch, row_at, token_blocks
from ..jit import JIT
from ..kernels import f16_lut

BLOCK = 32  # activation columns per scale
EXCESS = {4: 8, 8: 128}  # weight bits -> what vpdpbusd's unsigned weight adds to the true one
PATH_GENERIC, PATH_AVX2, PATH_VNNI256, PATH_VNNI512 = 0, 1, 2, 3
PATH_NAMES = {"generic": PATH_GENERIC, "avx2": PATH_AVX2, "vnni256": PATH_VNNI256, "vnni512": PATH_VNNI512}
ROWS = 72  # weight rows linear takes through every token at a time (crew.MOE_IN_ROWS)
NT = 4  # tokens a row is taken through at once (its weight bytes unpacked once for them)


def host_paths() -> list[int]:
    """The instruction paths this CPU runs, slowest first (numba compiles for the host)."""
    f = host_features()
    paths = [PATH_GENERIC]
    if "+avx2" in f:
        paths.append(PATH_AVX2)
    if "+avxvnni" in f or ("+avx512vnni" in f and "+avx512vl" in f):
        paths.append(PATH_VNNI256)
    if "+avx512vnni" in f and "+avx512bw" in f and "+avx512vl" in f:
        paths.append(PATH_VNNI512)
    return paths


def chosen_path() -> int:
    """The fastest path the host runs, or the one COLIBRI_INT8_PATH names (one it cannot run,
    or no path's name: the fastest, with a warning)."""
    name = os.environ.get("COLIBRI_INT8_PATH", "").strip().lower()
    if name and PATH_NAMES.get(name) in host_paths():
        return PATH_NAMES[name]
    if name:
        warnings.warn(f"COLIBRI_INT8_PATH={name}: not a path this CPU runs ({', '.join(PATH_NAMES)}); using the fastest",
                      stacklevel=2)
    return host_paths()[-1]


PATH = chosen_path()


@nb.njit(**JIT)
def quantize_row(x, t, bits, xq, xc, xd, i):
    # row t of x [T, D] f32 -> row i of xq [., D] int8 (int4 weights: each block's even columns,
    # then its odd ones), xc [., D/4] int32 (-EXCESS[bits] * each lane's four activations),
    # xd [., D/32] f32 (each block's scale): d = max|x| / 127, q = rint(x / d)
    D = x.shape[1]
    excess = 8 if bits == 4 else 128
    for k in range(D // 32):
        amax = np.float32(0.0)
        for j in range(32 * k, 32 * k + 32):
            a = abs(x[t, j])
            if a > amax:
                amax = a
        d = amax / np.float32(127.0)
        xd[i, k] = d
        for p in range(32):
            col = 32 * k + (p if bits == 8 else (2 * p if p < 16 else 2 * (p - 16) + 1))
            v = np.float32(0.0)
            if d > 0:
                v = np.rint(x[t, col] / d)
            v = min(max(v, np.float32(-127.0)), np.float32(127.0))
            xq[i, 32 * k + p] = np.int8(v)
        for lane in range(8):
            s = 0
            for p in range(4 * lane, 4 * lane + 4):
                s += np.int32(xq[i, 32 * k + p])
            xc[i, 8 * k + lane] = -excess * s


@nb.njit(**JIT)
def quantize_rows(x, bits, xq, xc, xd):
    # every row of x through quantize_row
    for t in range(x.shape[0]):
        quantize_row(x, t, bits, xq, xc, xd, t)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def _vec(t, n):
    return ir.VectorType(t, n)


def _load(builder, row, off, ty):
    return builder.load(builder.bitcast(builder.gep(row, [off]), ty.as_pointer()), align=1)


def _block_weights(builder, qrow, k, bits, nblk: int):
    # the weight bytes of nblk (1 or 2) blocks from block k: <32 nblk x i8>, int4's nibbles
    # unsigned (each block's low nibbles, then its high ones), int8's signed as stored
    if bits == 8:
        return _load(builder, qrow, builder.mul(k, ir.Constant(I64, 32)), _vec(I8, 32 * nblk))
    b = _load(builder, qrow, builder.mul(k, ir.Constant(I64, 16)), _vec(I8, 16 * nblk))
    lo = builder.and_(b, ir.Constant(_vec(I8, 16 * nblk), [15] * 16 * nblk))
    hi = builder.lshr(b, ir.Constant(_vec(I8, 16 * nblk), [4] * 16 * nblk))
    order = [j for h in range(nblk) for j in list(range(16 * h, 16 * h + 16)) + list(range(16 * nblk + 16 * h,
                                                                                              16 * nblk + 16 * h + 16))]
    return builder.shuffle_vector(lo, hi, ir.Constant(_vec(I32, 32 * nblk), order))


def _lanes8(builder, w, x, xc, bits, path):
    # <8 x i32>: one block's lanes (the module's doc) from its weight bytes w <32 x i8>, its
    # activations x <32 x i8> and their excess xc <8 x i32>, on a 256-bit path
    v8i32, v32i8 = _vec(I32, 8), _vec(I8, 32)
    if path == PATH_VNNI256:
        u = w if bits == 4 else builder.xor(w, ir.Constant(v32i8, [-128] * 32))
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", v8i32, [v8i32] * 3)
        return builder.call(f, [xc, builder.bitcast(u, v8i32), builder.bitcast(x, v8i32)])
    if path == PATH_AVX2:
        maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [v32i8, v32i8])
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [_vec(I16, 16)] * 2)
        ones = ir.Constant(_vec(I16, 16), [1] * 16)
        if bits == 4:  # unsigned nibbles by signed activations, the excess taken off after
            return builder.add(builder.call(maddwd, [builder.call(maddubs, [w, x]), ones]), xc)
        absx = builder.call(_fn(builder, "llvm.abs.v32i8", v32i8, [v32i8, ir.IntType(1)]), [x, ir.Constant(ir.IntType(1), 0)])
        signed = builder.call(_fn(builder, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8]), [w, x])
        return builder.call(maddwd, [builder.call(maddubs, [absx, signed]), ones])
    v32i32 = _vec(I32, 32)
    wv = builder.sub(builder.zext(w, v32i32), ir.Constant(v32i32, [8] * 32)) if bits == 4 else builder.sext(w, v32i32)
    prod = builder.mul(wv, builder.sext(x, v32i32))
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(v8i32, [4 * lane + i for lane in range(8)])) for i in range(4)]
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _splat(builder, v, n):
    vf = _vec(F32, n)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vf, None), v, ir.Constant(I32, 0)),
                                  ir.Constant(vf, None), ir.Constant(_vec(I32, n), [0] * n))


def _rows_dot(context, builder, sig, args, t0, n, nt: int, bits: int, path: int):
    # out[t0 + i, n] for i < nt: the tokens' dots with weight row n (the module's doc)
    xq_v, xc_v, xd_v, q_v, sc_v, lut_v, out_v, g_v = args[:8]
    ts = [builder.add(t0, ir.Constant(I64, i)) for i in range(nt)]
    xrows, crows, drows = ([row_at(context, builder, sig.args[k], args[k], t) for t in ts] for k in range(3))
    qrow, srow = (row_at(context, builder, sig.args[k], args[k], n) for k in (3, 4))
    lut = context.make_array(sig.args[5])(context, builder, lut_v).data
    D = builder.extract_value(context.make_array(sig.args[0])(context, builder, xq_v).shape, 1)
    nblk = builder.sdiv(D, ir.Constant(I64, 32))
    npair = builder.sdiv(nblk, ir.Constant(I64, 2))
    v8f, v16f = _vec(F32, 8), _vec(F32, 16)

    # a block's weight group k // (g / 32) as (k * m) >> 32, m = 2^32 // (g / 32) + 1: exact while
    # k * g / 32 < 2^32 (a division per block had halved the kernel's speed)
    m = builder.add(builder.udiv(ir.Constant(I64, 1 << 32), builder.lshr(g_v, ir.Constant(I64, 5))), ir.Constant(I64, 1))

    def wscale(k):  # the weight group's scale of block k
        gi = builder.lshr(builder.mul(k, m), ir.Constant(I64, 32))
        return builder.load(builder.gep(lut, [builder.zext(builder.load(builder.gep(srow, [gi])), I64)]))

    def scale(i, k, sw):  # d_k * the weight's scale, one rounding
        return builder.fmul(builder.load(builder.gep(drows[i], [k])), sw)

    def lanes(i, w, k):  # a 256-bit block's lanes of token i
        x = _load(builder, xrows[i], builder.mul(k, ir.Constant(I64, 32)), _vec(I8, 32))
        xc = _load(builder, crows[i], builder.mul(k, ir.Constant(I64, 8)), _vec(I32, 8))
        return _lanes8(builder, w, x, xc, bits, path)

    if path == PATH_VNNI512:
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for _ in range(nt)]
        dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", _vec(I32, 16), [_vec(I32, 16)] * 3)
        with cgutils.for_range(builder, npair) as loop:
            k = builder.mul(loop.index, ir.Constant(I64, 2))
            k1 = builder.add(k, ir.Constant(I64, 1))
            prefetch(builder, qrow, builder.mul(k, ir.Constant(I64, 4 * bits)))
            w = _block_weights(builder, qrow, k, bits, 2)
            u = w if bits == 4 else builder.xor(w, ir.Constant(_vec(I8, 64), [-128] * 64))
            sw2 = builder.insert_element(builder.insert_element(ir.Constant(_vec(F32, 2), None), wscale(k),
                                                                ir.Constant(I32, 0)), wscale(k1), ir.Constant(I32, 1))
            for i in range(nt):
                x = _load(builder, xrows[i], builder.mul(k, ir.Constant(I64, 32)), _vec(I32, 16))
                xc = _load(builder, crows[i], builder.mul(k, ir.Constant(I64, 8)), _vec(I32, 16))
                li = builder.call(dp, [xc, builder.bitcast(u, _vec(I32, 16)), x])
                s2 = builder.fmul(_load(builder, drows[i], k, _vec(F32, 2)), sw2)  # [d_k, d_k+1] * their weights' scales
                sv = builder.shuffle_vector(s2, s2, ir.Constant(_vec(I32, 16), [0] * 8 + [1] * 8))
                builder.store(builder.fadd(builder.load(accs[i]), builder.fmul(builder.sitofp(li, v16f), sv)), accs[i])
        evens = [builder.shuffle_vector(builder.load(a), builder.load(a), ir.Constant(_vec(I32, 8), list(range(8))))
                 for a in accs]
        odds = [builder.shuffle_vector(builder.load(a), builder.load(a), ir.Constant(_vec(I32, 8), list(range(8, 16))))
                for a in accs]
        tail_path = PATH_VNNI256
    else:
        ev = [cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8)) for _ in range(nt)]
        od = [cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8)) for _ in range(nt)]
        with cgutils.for_range(builder, npair) as loop:
            k = builder.mul(loop.index, ir.Constant(I64, 2))
            prefetch(builder, qrow, builder.mul(k, ir.Constant(I64, 4 * bits)))
            for kk, accs in ((k, ev), (builder.add(k, ir.Constant(I64, 1)), od)):
                w = _block_weights(builder, qrow, kk, bits, 1)
                sw = wscale(kk)
                for i in range(nt):
                    f = builder.sitofp(lanes(i, w, kk), v8f)
                    builder.store(builder.fadd(builder.load(accs[i]), builder.fmul(f, _splat(builder, scale(i, kk, sw), 8))),
                                  accs[i])
        evens, odds = [builder.load(a) for a in ev], [builder.load(a) for a in od]
        tail_path = path
    # an odd count of blocks: the last one into the even sums
    evens = [cgutils.alloca_once_value(builder, e) for e in evens]
    with builder.if_then(builder.icmp_signed("!=", builder.mul(npair, ir.Constant(I64, 2)), nblk)):
        k = builder.sub(nblk, ir.Constant(I64, 1))
        w = _block_weights(builder, qrow, k, bits, 1)
        sw = wscale(k)
        for i in range(nt):
            x = _load(builder, xrows[i], builder.mul(k, ir.Constant(I64, 32)), _vec(I8, 32))
            xc = _load(builder, crows[i], builder.mul(k, ir.Constant(I64, 8)), _vec(I32, 8))
            f = builder.sitofp(_lanes8(builder, w, x, xc, bits, tail_path), v8f)
            builder.store(builder.fadd(builder.load(evens[i]), builder.fmul(f, _splat(builder, scale(i, k, sw), 8))),
                          evens[i])
    for i in range(nt):
        v = builder.fadd(builder.load(evens[i]), odds[i])
        total = builder.extract_element(v, ir.Constant(I32, 0))
        for lane in range(1, 8):
            total = builder.fadd(total, builder.extract_element(v, ir.Constant(I32, lane)))
        builder.store(total, builder.gep(row_at(context, builder, sig.args[6], out_v, ts[i]), [n]))


@intrinsic
def idot(typingctx, xq, xc, xd, q, scales, f16_lut, out, g, bits, path, t_lo, t_hi, n_lo, n_hi):
    """out[t, n] for t_lo <= t < t_hi, n_lo <= n < n_hi = token t's quantised activations (xq
    [T, D] int8, xc [T, D/4] int32, xd [T, D/32] f32: quantize_rows) dotted with weight row n
    (q: int4 [N, D/2] uint8 or int8 [N, D] int8, scales [N, D/g] f16 bits), as the module's doc
    says. `bits` (4 or 8) and `path` compile-time constants; g a multiple of 32, D of g; every
    2-D array C-contiguous; the caller checks shapes and ranges. Tokens NT at a time, the rows
    the inner loop (a block of tokens' activations stay in L1 while the rows go past)."""
    arrays = (xq, xc, xd, q, scales, out)
    if not (isinstance(bits, types.IntegerLiteral) and bits.literal_value in (4, 8)
            and isinstance(path, types.IntegerLiteral) and path.literal_value in PATH_NAMES.values()
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)
            and all(isinstance(v, types.Integer) for v in (g, t_lo, t_hi, n_lo, n_hi))):
        return None
    b, p = bits.literal_value, path.literal_value
    sig = types.void(xq, xc, xd, q, scales, f16_lut, out, g, bits, path, t_lo, t_hi, n_lo, n_hi)

    def codegen(context, builder, sig, args):
        ints = [context.cast(builder, v, ty, types.int64) for v, ty in zip(args[10:14], sig.args[10:14])]
        t_lo, t_hi, n_lo, n_hi = ints
        args = list(args[:7]) + [context.cast(builder, args[7], sig.args[7], types.int64)]

        token_blocks(builder, t_lo, t_hi, n_lo, n_hi,
                     lambda t, n, nt: _rows_dot(context, builder, sig, args, t, n, nt, b, p), NT)
        return context.get_dummy_value()

    return sig, codegen


def _make_linear(bits: int, path: int):
    # out [T, N] = x [T, D] @ dequant(w).T on integer activations, for one weight width and path
    # (closes over integers only: numba caches it on disk, see formats/int4.py _make_q4)
    @nb.njit(**JIT)
    def linear_i8(x, q, scales, g, f16_lut, out):
        T, D = x.shape
        N = q.shape[0]
        if (D % 32 or g < 32 or g % 32 or D % g or q.shape[1] * (8 // bits) != D or scales.shape[0] != N
                or scales.shape[1] * g != D or out.shape[0] != T or out.shape[1] != N or f16_lut.shape[0] != 65536):
            raise ValueError("int8 activations: weight, activation and output shapes do not match")
        xq, xc, xd = np.empty((T, D), np.int8), np.empty((T, D // 4), np.int32), np.empty((T, D // 32), np.float32)
        quantize_rows(x, bits, xq, xc, xd)
        for n0 in range(0, N, ROWS):  # a few rows at a time through every token: they stay in L2
            idot(xq, xc, xd, q, scales, f16_lut, out, g, bits, path, 0, T, n0, min(N, n0 + ROWS))

    return linear_i8


_LINEAR: dict = {}


def kernel(bits: int, path: int = PATH):
    """The integer-activation linear kernel for weights of `bits` (4, 8) on `path`."""
    if (bits, path) not in _LINEAR:
        _LINEAR[bits, path] = _make_linear(bits, path)
    return _LINEAR[bits, path]


def takes(w) -> bool:
    """Whether this path computes on QuantWeight w: int8 or int4 rows of whole blocks."""
    g = w.group_size
    return w.kind in ("int8", "int4") and w.shape[1] % BLOCK == 0 and g % BLOCK == 0 and w.shape[1] % g == 0


def linear(x: np.ndarray, w, out: np.ndarray, path: int = PATH) -> None:
    # x [T, D] f32 C-contiguous, w an int8 or int4 QuantWeight [N, D] (takes(w)), out [T, N] f32
    bits = 8 if w.kind == "int8" else 4
    q = w.q.view(np.uint8) if bits == 8 else w.q
    kernel(bits, path)(x, q, w.scales.view(np.uint16), w.group_size, f16_lut(), out)


# ---- the numpy reference (tests/engine/test_intdot.py) ----

def quantize_reference(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_rows in numpy: (xq, xc, xd)."""
    T, D = x.shape
    xb = x.reshape(T, D // 32, 32).astype(np.float32)
    d = (np.abs(xb).max(-1) / np.float32(127.0)).astype(np.float32)  # [T, K]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(xb / d[..., None]), 0).clip(-127, 127).astype(np.int8)
    if bits == 4:
        q = np.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    xc = (-EXCESS[bits] * q.reshape(T, D // 32, 8, 4).astype(np.int32).sum(-1)).reshape(T, D // 4)
    return q.reshape(T, D), xc.astype(np.int32), d


def dot_reference(xq: np.ndarray, xd: np.ndarray, w: np.ndarray, wscale: np.ndarray, g: int) -> np.ndarray:
    """out [T, N] as idot computes it, from xq, xd (quantize_reference) and the weights' true
    integers w [N, D] (int4: v in -8..7, column order) and scales wscale [N, D/g] f32."""
    T, D = xq.shape
    N, K = w.shape[0], D // 32
    wb = w.reshape(N, K, 32)
    out = np.empty((T, N), np.float32)
    xl = xq.reshape(T, K, 8, 4).astype(np.int64)
    for n in range(N):
        wl = wb[n].reshape(K, 8, 4).astype(np.int64)
        lanes = (xl * wl[None]).sum(-1).astype(np.float32)  # [T, K, 8] exact
        sw = wscale[n, (np.arange(K) * 32) // g].astype(np.float32)  # [K]
        s = (xd * sw[None]).astype(np.float32)  # [T, K]
        prods = (lanes * s[..., None]).astype(np.float32)
        ev = np.zeros((T, 8), np.float32)
        od = np.zeros((T, 8), np.float32)
        for k in range(0, K - K % 2, 2):
            ev = (ev + prods[:, k]).astype(np.float32)
            od = (od + prods[:, k + 1]).astype(np.float32)
        if K % 2:
            ev = (ev + prods[:, K - 1]).astype(np.float32)
        v = (ev + od).astype(np.float32)
        total = v[:, 0].copy()
        for lane in range(1, 8):
            total = (total + v[:, lane]).astype(np.float32)
        out[:, n] = total
    return out


def weights_reference(w) -> tuple[np.ndarray, np.ndarray]:
    """(true integers in idot's column order [N, D], scales f32 [N, D/g]) of an int8 or int4
    QuantWeight."""
    if w.kind == "int8":
        return w.q.astype(np.int64), w.scales.astype(np.float32)
    N = w.q.shape[0]
    v = np.empty((N, w.q.shape[1] * 2), np.int64)
    v[:, 0::2] = (w.q & 15).astype(np.int64) - 8
    v[:, 1::2] = (w.q >> 4).astype(np.int64) - 8
    K = v.shape[1] // 32
    vb = v.reshape(N, K, 32)
    v = np.concatenate([vb[..., 0::2], vb[..., 1::2]], axis=-1).reshape(N, K * 32)
    return v, w.scales.astype(np.float32)
