"""Integer dot products: int8 and int4 weights times activations quantised to int8, the lossy
`activations: int8` path (named, labelled on every output; off unless asked for).

A vector lane is a weight row. The weights are computed on in tiles of TILE (16) rows
(tile(): MoEModel.set_activations lays the dense matrices and the expert cache's records out
so, in RAM; containers keep rows): a tile's bytes block by block (32 columns), a block as
chunks of 64 bytes, chunk c holding four bytes of each of the sixteen rows (row j at 4 j): int8
columns 4c .. 4c + 3, int4 packed bytes 4c .. 4c + 3 (columns 8c .. 8c + 7, low nibbles the even
ones); then per tile and weight group the sixteen rows' f16 scales.

Each token's activations are quantised on their own, per block of 32 columns: d = max|x| /
127, q = rint(x / d) (int4 weights: per eight columns the four even ones, then the four odd
ones, the order the nibbles come apart in), and the block's sum of q (quantize_row: one record
a token). A row's result never depends on the rows beside it.

One `vpdpbusd` multiplies a chunk by four activations broadcast to every lane, so a block's
integer dot is complete in its lane after four (int4: eight) of them, exact in int32; then
one float step a block for sixteen rows: out[t, n] = the sum over blocks k, in order, in
float32, of float(dot_k) * (d_k * s_k(n)), each product and each sum rounded. Every
instruction path gives these bits (tests/engine/test_intdot.py checks each against the numpy
reference here):

- PATH_VNNI512 (AVX-512 VNNI): `vpdpbusd` on a whole tile;
- PATH_VNNI256 (AVX-VNNI, or AVX-512 VNNI on 32 bytes): a tile as two halves;
- PATH_AVX2: `vpmaddubsw` + `vpmaddwd` (int8: the activations' signs moved onto the weights,
  so the 16-bit pair sums cannot saturate: |x| <= 127 and |w| <= 127);
- PATH_GENERIC: widened integer multiplies LLVM lowers for any CPU.

`vpdpbusd` multiplies unsigned bytes by signed ones: int4 weights are unsigned as stored (v +
8), int8 ones made so by + 128; the excess, 8 or 128 times the block's sum of activations, is
what a block's accumulator starts from. COLIBRI_INT8_PATH (vnni512, vnni256, avx2, generic)
forces a path for the process.

The row-major kernel this replaced (eight lanes of one row a block, a float multiply, convert
and add for every 64 columns of every row) ran 1.4 ns per row, 64 columns and token at one
token and 0.9-1.1 at 2-40; this one 1.0 and 0.25-0.55 (int4 g32, one thread, AMD EPYC Zen 5).
"""

import dataclasses
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

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
TILE = 16  # weight rows a tile (a 512-bit vector's int32 lanes)
BLOCK = 32  # activation columns a scale
PATH_GENERIC, PATH_AVX2, PATH_VNNI256, PATH_VNNI512 = 0, 1, 2, 3
PATH_NAMES = {"generic": PATH_GENERIC, "avx2": PATH_AVX2, "vnni256": PATH_VNNI256, "vnni512": PATH_VNNI512}
# tokens through a tile at once: on the AMD EPYC (Zen 5), one thread, int4 768 x 2048 from DRAM,
# the 512-bit path with 2 or 3 ran a third faster at 2-8 tokens than with 4 or 6 (the same at 40)
NT = {PATH_VNNI512: 3, PATH_VNNI256: 2, PATH_AVX2: 2, PATH_GENERIC: 2}
TILE_ROWS = 64  # weight rows (four tiles) linear takes through every token at a time: they stay in L2


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
def record_len(D):
    # bytes of a token's quantised activations: D values, then D/32 int32 sums, D/32 f32 scales
    return D + D // 4


@nb.njit(**JIT)
def quantize_row(x, t, bits, rec, i):
    # row t of x [T, D] f32 -> record i of rec [., D + D/4] int8 (the module's doc)
    D = x.shape[1]
    row = rec[i]
    tail = row[D:]
    sums, scales = tail.view(np.int32)[: D // 32], tail.view(np.float32)[D // 32 :]
    for k in range(D // 32):
        amax = np.float32(0.0)
        for j in range(32 * k, 32 * k + 32):
            a = abs(x[t, j])
            if a > amax:
                amax = a
        d = amax / np.float32(127.0)
        scales[k] = d
        s = 0
        for p in range(32):
            col = 32 * k + p
            if bits == 4:  # position p of eight: 0-3 the even columns, 4-7 the odd ones
                e = p % 8
                col = 32 * k + 8 * (p // 8) + (2 * e if e < 4 else 2 * (e - 4) + 1)
            v = np.float32(0.0)
            if d > 0:
                v = np.rint(x[t, col] / d)
            v = min(max(v, np.float32(-127.0)), np.float32(127.0))
            row[32 * k + p] = np.int8(v)
            s += np.int32(v)
        sums[k] = s


@nb.njit(**JIT)
def quantize_rows(x, bits, rec):
    for t in range(x.shape[0]):
        quantize_row(x, t, bits, rec, t)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _vec(t, n):
    return ir.VectorType(t, n)


def _load(builder, ptr, off, ty):
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer()), align=1)


def _splat(builder, v, n):
    vt = _vec(v.type, n)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vt, None), v, ir.Constant(I32, 0)),
                                  ir.Constant(vt, None), ir.Constant(_vec(I32, n), [0] * n))


def _madd(builder, acc, w, x4, bits, path, lanes):
    # acc <lanes x i32> + each lane's four weight bytes (w <4 lanes x i8>: int4 unsigned nibbles,
    # int8 signed) times the four activations x4 (i32: four int8) broadcast to every lane
    vw, vi = _vec(I8, 4 * lanes), _vec(I32, lanes)
    xb = builder.bitcast(_splat(builder, x4, lanes), vw)
    if path in (PATH_VNNI512, PATH_VNNI256):
        u = w if bits == 4 else builder.xor(w, ir.Constant(vw, [-128] * 4 * lanes))
        f = _fn(builder, f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", vi, [vi] * 3)
        return builder.call(f, [acc, builder.bitcast(u, vi), builder.bitcast(xb, vi)])
    if path == PATH_AVX2:
        v32 = _vec(I8, 32)
        maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(I16, 16), [v32, v32])
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", _vec(I32, 8), [_vec(I16, 16)] * 2)
        ones = ir.Constant(_vec(I16, 16), [1] * 16)
        if bits == 4:  # unsigned nibbles by signed activations: the excess is in acc's start
            return builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [w, xb]), ones]))
        absx = builder.call(_fn(builder, "llvm.abs.v32i8", v32, [v32, ir.IntType(1)]), [xb, ir.Constant(ir.IntType(1), 0)])
        signed = builder.call(_fn(builder, "llvm.x86.avx2.psign.b", v32, [v32, v32]), [w, xb])
        return builder.add(acc, builder.call(maddwd, [builder.call(maddubs, [absx, signed]), ones]))
    vw32 = _vec(I32, 4 * lanes)
    wv = builder.zext(w, vw32) if bits == 4 else builder.sext(w, vw32)
    prod = builder.mul(wv, builder.sext(xb, vw32))
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(vi, [4 * lane + i for lane in range(lanes)]))
             for i in range(4)]
    return builder.add(acc, builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3])))


F16C = "+f16c" in host_features()


def _widen(builder, h, f16c: bool = F16C):
    # <n x i16> f16 bits -> <n x float>, exactly: vcvtph2ps where the CPU has F16C (every AVX2
    # one), else by the bits (LLVM's f16 conversion without F16C is a library call numba lacks)
    n = h.type.count
    vf, vi = _vec(F32, n), _vec(I32, n)
    if f16c:
        return builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), n)), vf)

    def c(v):
        return ir.Constant(vi, [v] * n)

    x = builder.zext(h, vi)
    sign = builder.shl(builder.and_(x, c(0x8000)), c(16))
    e, m = builder.and_(builder.lshr(x, c(10)), c(0x1F)), builder.and_(x, c(0x3FF))
    normal = builder.or_(builder.shl(builder.add(e, c(112)), c(23)), builder.shl(m, c(13)))
    quiet = builder.select(builder.icmp_unsigned("!=", m, c(0)), c(1 << 22), c(0))  # (a NaN comes out quiet, as from vcvtph2ps)
    special = builder.or_(builder.or_(c(255 << 23), builder.shl(m, c(13))), quiet)  # inf, nan
    bits = builder.select(builder.icmp_unsigned("==", e, c(31)), special, normal)
    tiny = builder.fmul(builder.sitofp(m, vf), ir.Constant(vf, [2.0 ** -24] * n))  # zero and subnormals: m 2^-24
    v = builder.select(builder.icmp_unsigned("==", e, c(0)), builder.bitcast(tiny, vi), bits)
    return builder.bitcast(builder.or_(v, sign), vf)


def _excess(bits: int, path: int) -> int:
    # what the weights as the instructions take them add per unit of an activation: int4's
    # nibbles are v + 8 on every path; int8 is made unsigned (+ 128) for vpdpbusd only
    return 8 if bits == 4 else (128 if path in (PATH_VNNI512, PATH_VNNI256) else 0)


def _tile_dot(context, builder, sig, args, t0, n16, nt: int, bits: int, path: int):
    # out[t0 + i, 16 n16 .. 16 n16 + 16] for i < nt (the module's doc)
    rec_v, w_v, s_v, out_v, g_v, D = args
    ts = [builder.add(t0, ir.Constant(I64, i)) for i in range(nt)]
    recs = [row_at(context, builder, sig.args[0], rec_v, t) for t in ts]
    wrow, srow = row_at(context, builder, sig.args[1], w_v, n16), row_at(context, builder, sig.args[2], s_v, n16)
    lanes = 16 if path == PATH_VNNI512 else 8  # a vector's rows; 256-bit paths take a tile in two halves
    halves = TILE // lanes
    chunks = 4 if bits == 4 else 8
    nblk = builder.sdiv(D, ir.Constant(I64, 32))
    per_group = builder.lshr(g_v, ir.Constant(I64, 5))
    ngroup = builder.sdiv(nblk, per_group)
    vf = _vec(F32, lanes)
    excess = _excess(bits, path)
    facc = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(halves)]
            for _ in range(nt)]
    with cgutils.for_range(builder, ngroup) as gl:
        gi = gl.index
        sw = [_widen(builder, _load(builder, srow, builder.add(builder.mul(gi, ir.Constant(I64, TILE)),
                                                             ir.Constant(I64, lanes * h)), _vec(I16, lanes)))
              for h in range(halves)]
        with cgutils.for_range(builder, per_group) as bl:
            k = builder.add(builder.mul(gi, per_group), bl.index)
            wblk = builder.mul(k, ir.Constant(I64, 64 * chunks))
            prefetch(builder, wrow, wblk)
            iacc = []
            for i in range(nt):
                s = builder.load(builder.gep(builder.bitcast(builder.gep(recs[i], [D]), I32.as_pointer()), [k]))
                iacc.append([_splat(builder, builder.mul(s, ir.Constant(I32, -excess)), lanes)] * halves)
            for c in range(chunks):
                for h in range(halves):
                    w = _load(builder, wrow, builder.add(wblk, ir.Constant(I64, 64 * c + 4 * lanes * h)), _vec(I8, 4 * lanes))
                    parts = (w,) if bits == 8 else (builder.and_(w, ir.Constant(w.type, [15] * 4 * lanes)),
                                                     builder.lshr(w, ir.Constant(w.type, [4] * 4 * lanes)))
                    for p, wp in enumerate(parts):
                        col = builder.add(builder.mul(k, ir.Constant(I64, 32)), ir.Constant(I64, 8 * c + 4 * p if bits == 4 else 4 * c))
                        for i in range(nt):
                            x4 = _load(builder, recs[i], col, I32)
                            iacc[i][h] = _madd(builder, iacc[i][h], wp, x4, bits, path, lanes)
            for i in range(nt):
                dptr = builder.bitcast(builder.gep(recs[i], [builder.add(D, builder.sdiv(D, ir.Constant(I64, 8)))]),
                                       F32.as_pointer())
                dv = _splat(builder, builder.load(builder.gep(dptr, [k])), lanes)
                for h in range(halves):
                    s = builder.fmul(dv, sw[h])  # d_k * each row's scale, one rounding
                    acc = facc[i][h]
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(iacc[i][h], vf), s)), acc)
    N = builder.extract_value(context.make_array(sig.args[3])(context, builder, out_v).shape, 1)
    n0 = builder.mul(n16, ir.Constant(I64, TILE))
    whole = builder.icmp_signed("<=", builder.add(n0, ir.Constant(I64, TILE)), N)
    for i in range(nt):
        orow = row_at(context, builder, sig.args[3], out_v, ts[i])
        for h in range(halves):
            first = builder.add(n0, ir.Constant(I64, lanes * h))
            v = builder.load(facc[i][h])
            with builder.if_else(whole) as (then, otherwise):
                with then:
                    builder.store(v, builder.bitcast(builder.gep(orow, [first]), vf.as_pointer()), align=4)
                with otherwise:  # the last tile of a matrix padded to whole tiles (arranged): its rows only
                    for lane in range(lanes):
                        n = builder.add(first, ir.Constant(I64, lane))
                        with builder.if_then(builder.icmp_signed("<", n, N)):
                            builder.store(builder.extract_element(v, ir.Constant(I32, lane)), builder.gep(orow, [n]))


@intrinsic
def idot(typingctx, rec, w, scales, out, g, D, bits, path, t_lo, t_hi, n_lo, n_hi):
    """out[t, 16 n : 16 n + 16] for t_lo <= t < t_hi, n_lo <= n < n_hi (tiles) = token t's
    quantised activations (rec [T, record_len(D)] int8: quantize_rows) dotted with tile n's
    sixteen rows (w [N/16, 16 D/2 or 16 D] uint8, scales [N/16, 16 D/g] f16 bits, in tiles:
    retile). `bits` (4 or 8) and `path` compile-time constants; g a multiple of 32 dividing D;
    every 2-D array C-contiguous; the caller checks shapes and ranges. Tokens NT[path] at a
    time, the tiles the inner loop (a block of tokens' activations stay in L1 while the weights
    go past)."""
    if not (isinstance(bits, types.IntegerLiteral) and bits.literal_value in (4, 8)
            and isinstance(path, types.IntegerLiteral) and path.literal_value in PATH_NAMES.values()
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (rec, w, scales, out))
            and all(isinstance(v, types.Integer) for v in (g, D, t_lo, t_hi, n_lo, n_hi))):
        return None
    b, p = bits.literal_value, path.literal_value
    sig = types.void(rec, w, scales, out, g, D, bits, path, t_lo, t_hi, n_lo, n_hi)

    def codegen(context, builder, sig, args):
        ints = [context.cast(builder, v, ty, types.int64) for v, ty in zip(args, sig.args)]
        t_lo, t_hi, n_lo, n_hi = ints[8:12]
        targs = list(args[:4]) + ints[4:6]
        token_blocks(builder, t_lo, t_hi, n_lo, n_hi,
                     lambda t, n, nt: _tile_dot(context, builder, sig, targs, t, n, nt, b, p), NT[p])
        return context.get_dummy_value()

    return sig, codegen


# ---- layout and the numpy reference ----

@nb.njit(**JIT)
def retile(q, scales, back):
    # q [N, B/4] uint32 (a row's bytes four at a time: a chunk's unit) and scales [N, G] uint16,
    # C-contiguous, in place: rows -> tiles (the module's doc: a tile is its sixteen rows' units
    # transposed), or tiles -> rows when `back`. (Byte by byte it ran 0.7 GB/s: slower than the
    # disk an expert comes from.)
    N, U = q.shape
    G = scales.shape[1]
    qf, sf = q.reshape(-1), scales.reshape(-1)
    tq, ts = np.empty(TILE * U, np.uint32), np.empty(TILE * G, np.uint16)
    for t in range(N // TILE):
        q0, s0 = t * TILE * U, t * TILE * G
        if back:
            for j in range(TILE):
                for u in range(U):
                    tq[j * U + u] = qf[q0 + u * TILE + j]
                for gi in range(G):
                    ts[j * G + gi] = sf[s0 + gi * TILE + j]
        else:
            for u in range(U):
                for j in range(TILE):
                    tq[u * TILE + j] = qf[q0 + j * U + u]
            for gi in range(G):
                for j in range(TILE):
                    ts[gi * TILE + j] = sf[s0 + j * G + gi]
        qf[q0 : q0 + TILE * U] = tq
        sf[s0 : s0 + TILE * G] = ts


def takes(w) -> bool:
    """Whether this path computes on QuantWeight w: int8 or int4, whole tiles of rows, rows and
    groups of whole blocks."""
    N, D = w.shape
    g = w.group_size
    return w.kind in ("int8", "int4") and N % TILE == 0 and D % BLOCK == 0 and g % BLOCK == 0 and D % g == 0


def arrange(w, on: bool) -> None:
    """QuantWeight w's bytes (takes(w): whole tiles) in place: to tiles (`on`) or back to rows."""
    retile(w.q.view(np.uint32), w.scales.view(np.uint16), not on)


def arrange_expert(ew, on: bool) -> None:
    """An expert's gate, up and down (int8 or int4 QuantWeights, takes() each) in place: to
    tiles (`on`) or back to rows; what an expert source's arrange() is given."""
    for w in ew[:3]:
        arrange(w, on)


def arranged(w, on: bool):
    """A copy of QuantWeight w, its bytes in tiles and `integer` set (`on`), or back in rows. A
    matrix whose rows are not whole tiles is padded with zero rows: its q and scales are views
    of the first rows of the padded arrays (tiles() finds them)."""
    N = w.shape[0]
    n_pad = -(-N // TILE) * TILE
    if on:
        q, s = np.zeros((n_pad, w.q.shape[1]), w.q.dtype), np.zeros((n_pad, w.scales.shape[1]), w.scales.dtype)
        q[:N], s[:N] = w.q, w.scales
    else:
        q, s = (a.copy() for a in tiles(w))
        q, s = q.view(w.q.dtype).reshape(n_pad, -1), s.view(w.scales.dtype).reshape(n_pad, -1)
    retile(q.view(np.uint32), s.view(np.uint16), not on)
    if not on:  # rows again: just the matrix's own, without the padding
        q, s = q[:N].copy(), s[:N].copy()
    return dataclasses.replace(w, q=q[:N], scales=s[:N], integer=on)


def tiles(w) -> tuple[np.ndarray, np.ndarray]:
    """(q [N/16, 16 B] uint8, scales [N/16, 16 G] uint16): views of an arranged QuantWeight's
    tiles, the padding included."""
    n_tiles = -(-w.shape[0] // TILE)
    q, s = w.q, w.scales
    if q.shape[0] % TILE:  # a view of a padded array's first rows (arranged)
        q, s = q.base, s.base
    return q.view(np.uint8).reshape(n_tiles, -1), s.view(np.uint16).reshape(n_tiles, -1)


def _make_linear(bits: int, path: int):
    # out [T, N] = x [T, D] @ w.T on integer activations, w in tiles (q [ceil(N/16), 16 B], scales
    # [ceil(N/16), 16 D/g]: tiles()), for one weight width and path (closes over integers only:
    # numba caches it on disk, see formats/int4.py _make_q4)
    @nb.njit(**JIT)
    def linear_i8(x, q, scales, g, out):
        T, D = x.shape
        N = out.shape[1]
        n_tiles = q.shape[0]
        if (D % 32 or g < 32 or g % 32 or D % g or q.shape[1] * (8 // bits) != TILE * D or n_tiles != (N + TILE - 1) // TILE
                or scales.shape[0] != n_tiles or scales.shape[1] * g != TILE * D or out.shape[0] != T):
            raise ValueError("int8 activations: weight, activation and output shapes do not match")
        rec = np.empty((T, record_len(D)), np.int8)
        quantize_rows(x, bits, rec)
        for n0 in range(0, n_tiles, TILE_ROWS // TILE):  # a few tiles at a time through every token
            idot(rec, q, scales, out, g, D, bits, path, 0, T, n0, min(n_tiles, n0 + TILE_ROWS // TILE))

    return linear_i8


_LINEAR: dict = {}


def kernel(bits: int, path: int = PATH):
    """The integer-activation linear kernel for weights of `bits` (4, 8) on `path`."""
    if (bits, path) not in _LINEAR:
        _LINEAR[bits, path] = _make_linear(bits, path)
    return _LINEAR[bits, path]


def linear(x: np.ndarray, w, out: np.ndarray, path: int = PATH) -> None:
    # x [T, D] f32 C-contiguous, w an int8 or int4 QuantWeight [N, D] in tiles (arranged(w,
    # True)), out [T, N] f32
    q, s = tiles(w)
    kernel(8 if w.kind == "int8" else 4, path)(x, q, s, w.group_size, out)


# ---- the numpy reference (tests/engine/test_intdot.py) ----

@intrinsic
def widen_f16(typingctx, src, dst, f16c):
    """dst [n] f32 = src [n] uint16 f16 bits, eight at a time (n a multiple of 8), as the
    kernels widen the scales (f16c False: by the bits, the path of CPUs without F16C)."""
    if not isinstance(f16c, types.BooleanLiteral):
        return None
    on = f16c.literal_value
    sig = types.void(src, dst, f16c)

    def codegen(context, builder, sig, args):
        a, b = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[:2], args[:2]))
        n = builder.extract_value(a.shape, 0)
        with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(I64, 8))) as loop:
            at = builder.mul(loop.index, ir.Constant(I64, 8))
            v = _widen(builder, _load(builder, a.data, at, _vec(I16, 8)), on)
            builder.store(v, builder.bitcast(builder.gep(b.data, [at]), _vec(F32, 8).as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _blocks_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # x [T, D] f32 -> (q [T, D/32, 32] int64 in natural column order, d [T, D/32] f32): quantize_row's values
    T, D = x.shape
    xb = x.reshape(T, D // 32, 32).astype(np.float32)
    d = (np.abs(xb).max(-1) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[..., None] > 0, np.rint(xb / d[..., None]), 0).clip(-127, 127).astype(np.int64)
    return q, d


def record_reference(x: np.ndarray, bits: int) -> np.ndarray:
    """quantize_rows in numpy: the records [T, record_len(D)] int8."""
    T, D = x.shape
    K = D // 32
    q, d = _blocks_reference(x)
    q = q.astype(np.int8)
    if bits == 4:  # per eight columns the even ones, then the odd ones
        q8 = q.reshape(T, K, 4, 8)
        q = np.concatenate([q8[..., 0::2], q8[..., 1::2]], axis=-1).reshape(T, K, 32)
    sums = q.astype(np.int32).sum(-1).astype("<i4")
    return np.concatenate([q.reshape(T, D), sums.view(np.int8).reshape(T, -1),
                           d.astype("<f4").view(np.int8).reshape(T, -1)], axis=1)


def tile(q: np.ndarray, scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(w [N/16, .] uint8, s [N/16, .] uint16 f16 bits) from a row-major int8 [N, D] or int4 [N,
    D/2] matrix and its scales [N, D/g] f16 (N a multiple of 16)."""
    N, nbytes = q.shape
    per_block = 32 if bits == 8 else 16
    K = nbytes // per_block
    qb = q.view(np.uint8).reshape(N // TILE, TILE, K, per_block // 4, 4)  # tile, row, block, chunk, byte
    w = np.ascontiguousarray(qb.transpose(0, 2, 3, 1, 4)).reshape(N // TILE, -1)
    s = np.ascontiguousarray(scales.view(np.uint16).reshape(N // TILE, TILE, -1).transpose(0, 2, 1)).reshape(N // TILE, -1)
    return w, s


def values_reference(w) -> tuple[np.ndarray, np.ndarray]:
    """(true integers [N, D] int64, scales [N, D/g] f32) of an int8 or int4 QuantWeight in rows."""
    if w.kind == "int8":
        return w.q.astype(np.int64), w.scales.astype(np.float32)
    v = np.empty((w.q.shape[0], w.q.shape[1] * 2), np.int64)
    v[:, 0::2] = (w.q & 15).astype(np.int64) - 8
    v[:, 1::2] = (w.q >> 4).astype(np.int64) - 8
    return v, w.scales.astype(np.float32)


def reference(x: np.ndarray, values: np.ndarray, wscale: np.ndarray, g: int) -> np.ndarray:
    """out [T, N] as idot computes it from x [T, D] f32 and the weights' true integers values
    [N, D] (natural column order) with their scales wscale [N, D/g] f32."""
    T, D = x.shape
    K = D // 32
    q, d = _blocks_reference(x)
    dots = np.einsum("tkc,nkc->tnk", q, values.reshape(-1, K, 32).astype(np.int64)).astype(np.float32)  # exact
    sw = wscale[:, (np.arange(K) * 32) // g].astype(np.float32)  # [N, K]
    out = np.zeros((T, values.shape[0]), np.float32)
    for k in range(K):
        s = (d[:, k : k + 1] * sw[None, :, k]).astype(np.float32)
        out = (out + (dots[:, :, k] * s).astype(np.float32)).astype(np.float32)
    return out
