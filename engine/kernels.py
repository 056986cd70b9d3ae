"""Numba kernels for the hot loops, each over preallocated numpy arrays.

Activations are float32. Weights stay in their storage precision: float32, float16,
or bf16 held as raw uint16 bits (see storage.safetensors); the 16-bit kernels widen
a block of rows at a time into a small float32 buffer (bf16 for a few tokens in
registers) and never make a float32 copy of a matrix. Every kernel is `nogil`, so reads of the next experts can run while it
computes, and `cache=True`, so a process compiles it once per machine (jit.py says where).

This file holds the dense kernels (float32, float16 and bf16 weights, norms, RoPE,
attention); formats/ a module per number format (int8, int4, FP8, MXFP4); ir.py,
ir_rows.py and atomics.py the pieces written in LLVM IR; crew.py the thread crew that
shares a forward step's parallel work.

The numpy references these are tested against live in tests/engine/test_kernels.py.
"""

import functools
import math

import numba as nb
import numpy as np

from .ir import TILE_LANES, f32_tile
from .ir_rows import exp_sum, pv_tile, scaled_max, silu_mul_rows
from .jit import JIT, JIT_FAST

NO_SINKS = np.zeros(0, np.float32)  # attention without sinks (kernels take an empty array)


def f16_table() -> np.ndarray:
    """float32 value of every float16 bit pattern, for the f16 matmul kernel."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@functools.cache
def f16_lut() -> np.ndarray:
    """f16_table(), made once, on first use: the table every kernel with f16 bits takes."""
    return f16_table()


ALIGN = 64  # bytes: a cache line and one AVX-512 vector. A tile's loads that straddle two lines
# (numpy's large arrays start 16 bytes past a page) took the 4 x 6 tile on the Intel box from 151
# to 113 GFLOPS a thread, 512 tokens x 72 rows x 2048
ALIGN_FLOATS = ALIGN // 4


def empty_aligned(shape, dtype=np.float32) -> np.ndarray:
    """np.empty(shape, dtype) whose data starts on an ALIGN-byte line."""
    # math.prod, not np.prod: this is on every decode step's path, and np.prod costs ~4 us a call
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    n = math.prod(shape) * np.dtype(dtype).itemsize
    buf = np.empty(n + ALIGN, np.uint8)
    o = -buf.ctypes.data % ALIGN
    return buf[o : o + n].view(dtype).reshape(shape)


def aligned(x: np.ndarray) -> np.ndarray:
    """x itself when its data starts on an ALIGN-byte line, else a C-contiguous copy that does."""
    if x.ctypes.data % ALIGN == 0 and x.flags.c_contiguous:
        return x
    out = empty_aligned(x.shape, x.dtype)
    out[...] = x
    return out


@nb.njit(inline="always", **JIT)
def rows_aligned(n, m):
    # np.empty((n, m), np.float32) starting on an ALIGN-byte line (numba's own allocations
    # start on 16 or 32 bytes): the buffer a kernel widens rows into for tiles. Inlined: its
    # callers pass ROW_BLOCK, a literal, and a function of its own compiled again in every process
    buf = np.empty(n * m + ALIGN_FLOATS, np.float32)
    o = (ALIGN_FLOATS - (buf.ctypes.data // 4) % ALIGN_FLOATS) % ALIGN_FLOATS
    return buf[o : o + n * m].reshape(n, m)


ROWS_PER_TASK = 72  # rows a parallel kernel's thread takes at a time: three ROW_BLOCKs
# tokens up to which tiles read bf16 rows as they are, widening them in registers once per four
# tokens, rather than from a widened float32 copy: one thread, 2304 x 2048 rows (Intel, AVX-512),
# 8 tokens 0.62 ms against 0.91, 16 tokens 1.15 against 1.32, 32 tokens 2.36 against 2.19
BF16_DIRECT_TOKENS = 16
ROW_BLOCK = 24  # rows a kernel widens or dequantizes at a time for tiles: four tile rows (24 x 2048 f32: 192 KiB, in L2)


_TILE_TOKENS, _TILE_ROWS = 4, 6  # the float32 tile: 24 independent sums, 10 loads per 24 FMAs


_X_BLOCK_BYTES = 192 * 1024  # activations tiles keeps in L2 while it goes through the rows
_K_BLOCK = 512  # columns a tile goes through at a time: its rows' 2 KiB each stay in L1


def _make_row_tiles(nr: int):
    @nb.njit(**JIT)
    def row_tiles(x, w, out, acc, t0, t1, r, n0, k0, k1):
        # tokens t0 .. t1 (a block of tiles) through rows r .. r + nr, columns k0 .. k1 (see
        # f32_tile): _TILE_TOKENS at a time, the last ones (with a whole row group) two then
        # one at a time. A token's parked sums sit at its place in the block, _TILE_ROWS
        # vectors apart
        a = _TILE_ROWS * TILE_LANES
        t = t0
        while t + _TILE_TOKENS <= t1:
            f32_tile(x, w, out, acc, (t - t0) * a, t, r, n0, k0, k1, _TILE_TOKENS, nr)
            t += _TILE_TOKENS
        if nr == _TILE_ROWS and t + 2 <= t1:
            f32_tile(x, w, out, acc, (t - t0) * a, t, r, n0, k0, k1, 2, nr)
            t += 2
        while t < t1:
            f32_tile(x, w, out, acc, (t - t0) * a, t, r, n0, k0, k1, 1, nr)
            t += 1

    return row_tiles


# the tile shapes compiled: every kernel that calls tiles carries a copy of each (numba links
# a callee's code into every caller), and twelve shapes (tokens 4, 2, 1 by rows 6, 4, 2, 1)
# made a process 36 MB larger than three did (`colictl run` on a small model, peak RSS: 300
# against 264 MB); these five 268 MB, with rows 4 at a time too 285 MB. The rows a range
# leaves over are few
_rows6, _rows1 = _make_row_tiles(_TILE_ROWS), _make_row_tiles(1)


@nb.njit(**JIT)
def tiles(x, w, r_lo, r_hi, out, n0):
    # out[:, n0 + r] = x @ w[r] for r_lo <= r < r_hi: x [T, D], w [R, D] float32 or bf16 bits, C-contiguous;
    # in tiles of _TILE_TOKENS x _TILE_ROWS, the rows left over one at a time (a tile's result
    # does not depend on its shape: f32_tile). On the Zen 5, one thread, 64
    # tokens by 16 rows of 2048: 4 x 6 tiles 150-180 GFLOPS, 2 x 4 tiles (the shape before)
    # 120-140, 6 x 4 135-155, 3 x 8 75-85 (it spills). Tokens a block at a time (as many as
    # fit _X_BLOCK_BYTES), each block through all the rows: a long prompt's activations (16
    # MiB at 2048 x 2048) streamed from memory once per call, not once per row group. A
    # block's tiles of the same rows go through the columns _K_BLOCK at a time (f32_tile
    # parks their sums in acc between): whole rows of 2048 floats did not stay in L1 through
    # a tile, which then waited on L2 (0.59 of the FMA peak on the Zen 5)
    T, D = x.shape
    tb = max(_TILE_TOKENS, _X_BLOCK_BYTES // (4 * max(D, 1)))
    Dv = D - D % TILE_LANES
    # the parked sums, only where the columns take more than one block (attention's 128-column
    # query-key tiles allocated 147 KiB a call for nothing)
    acc = np.empty(min(tb, T) * _TILE_ROWS * TILE_LANES if Dv > _K_BLOCK else 0, np.float32)
    for t0 in range(0, T, tb):
        t1 = min(T, t0 + tb)
        r = r_lo
        while r < r_hi:
            nr = _TILE_ROWS if r_hi - r >= _TILE_ROWS else 1
            k0 = 0
            while True:
                k1 = min(Dv, k0 + _K_BLOCK)
                if nr == _TILE_ROWS:
                    _rows6(x, w, out, acc, t0, t1, r, n0, k0, k1)
                else:
                    _rows1(x, w, out, acc, t0, t1, r, n0, k0, k1)
                if k1 >= Dv:
                    break
                k0 = k1
            r += nr


@nb.njit(**JIT)
def matmul_u16_rows(x, w, is_bf16, f16_lut, out, r_lo, r_hi):
    # out[:, r] = x @ w[r] for r_lo <= r < r_hi: x [T, D] f32, w [N, D] u16 (bf16 or f16 bits),
    # out [T, N] f32; the caller checks shapes. ROW_BLOCK rows at a time widened into float32
    # (exact) and taken through tiles with every token; bf16 for up to BF16_DIRECT_TOKENS goes
    # through tiles directly, widened in registers. A (token, row) result is the same
    # whatever else shares the call
    T, D = x.shape
    if is_bf16 and T <= BF16_DIRECT_TOKENS:  # a few tokens: the tile widens bf16 in registers
        tiles(x, w, r_lo, r_hi, out, 0)
        return
    wb = rows_aligned(ROW_BLOCK, D)  # [ROW_BLOCK, D] widened rows: one buffer per call, not per row
    for n0 in range(r_lo, r_hi, ROW_BLOCK):
        nr = min(ROW_BLOCK, r_hi - n0)
        u16_rows(w, is_bf16, f16_lut, n0, nr, wb)
        tiles(x, wb, 0, nr, out, n0)


@nb.njit(**JIT)
def u16_rows(w, is_bf16, f16_lut, n0, nr, wb):
    # wb[:nr] = rows n0 .. n0 + nr of w [N, D] (bf16 or f16 bits) as float32 (exact)
    D = w.shape[1]
    bits = wb.view(np.uint32)
    for r in range(nr):
        if is_bf16:
            for d in range(D):
                bits[r, d] = np.uint32(w[n0 + r, d]) << 16
        else:
            for d in range(D):
                wb[r, d] = f16_lut[w[n0 + r, d]]


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


def _make_matmul_f32(parallel: bool):
    @nb.njit(parallel=parallel, **JIT)
    def matmul_f32(x, w, out):
        # x [T, D] f32, w [N, D] f32, out [T, N]: out = x @ w.T through tiles, ROWS_PER_TASK
        # rows a task
        T, D = x.shape
        N = w.shape[0]
        if out.shape[0] != T or out.shape[1] != N or w.shape[1] != D:
            raise ValueError("matmul: weight, activation and output shapes do not match")
        assert parallel or not parallel  # part of the cache key, as in matmul_u16
        for c in nb.prange((N + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
            tiles(x, w, c * ROWS_PER_TASK, min(N, (c + 1) * ROWS_PER_TASK), out, 0)

    return matmul_f32


matmul_f32 = _make_matmul_f32(parallel=False)
matmul_f32_par = _make_matmul_f32(parallel=True)


@nb.njit(**JIT)
def rmsnorm_row(x, w, eps, out, t):
    # row t of x [T, D] f32 normalised into out[t], times w [D] f32
    D = x.shape[1]
    ss = 0.0
    for d in range(D):
        ss += np.float64(x[t, d]) * x[t, d]
    inv = np.float32(1.0 / np.sqrt(ss / D + eps))
    for d in range(D):
        out[t, d] = w[d] * (x[t, d] * inv)


@nb.njit(**JIT)
def rmsnorm(x, w, eps, out):
    # x [T, D] f32, w [D] f32, out [T, D]
    for t in range(x.shape[0]):
        rmsnorm_row(x, w, eps, out, t)


@nb.njit(parallel=True, **JIT)
def rmsnorm_par(x, w, eps, out):
    # rmsnorm (the same bits: a row is one thread's) with the rows shared among numba's threads
    for t in nb.prange(x.shape[0]):
        rmsnorm_row(x, w, eps, out, t)


ROWS_PAR_MIN = 2**18  # elements from which a row-by-row kernel (norms, slot sums) runs on every thread: 128 tokens of 2048


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


@nb.njit(**JIT)
def attend_block(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, t0, t1, g, qg, scores):
    # tokens t0 .. t1 of q [T, Hq, hd], the query heads of kv head g, against the keys each sees
    # (see attention_paged), into out[t0:t1]; qg [(t1 - t0) n_rep, hd], scores [(t1 - t0) n_rep, S]
    # f32 scratch. The block's query heads, token after token, against each KV block's keys as
    # one float32 tile product (tiles: the same operations for a (head, key) pair whatever else
    # is in the call; the keys past a token's own position are computed and not used), then per
    # token and head a softmax and the values summed in key order, the sums carried from one
    # block to the next (pv_tile's cont): the bits of one token alone against one contiguous
    # cache. A token at a time, the query-key products had been 8 x 16 tiles, and set-up took
    # most of a 512-token prompt's attention
    n_rep = q.shape[1] // k_pool.shape[2]
    n = t1 - t0
    for i in range(n):
        qg[i * n_rep : (i + 1) * n_rep] = q[t0 + i, g * n_rep : (g + 1) * n_rep]
    p_last = pos0 + t1 - 1
    first_lo = 0  # the first key the block's first token sees
    if window > 0 and pos0 + t0 - window + 1 > 0:
        first_lo = pos0 + t0 - window + 1
    for bi in range(first_lo // B, p_last // B + 1):
        j0, j1 = max(first_lo, bi * B), min(p_last + 1, (bi + 1) * B)
        tiles(qg[: n * n_rep], k_pool[table[bi], il, g], j0 - bi * B, j1 - bi * B, scores[: n * n_rep],
              bi * B)  # [n n_rep, j0:j1]
    for i in range(n):
        p = pos0 + t0 + i
        lo = 0
        if window > 0 and p - window + 1 > 0:
            lo = p - window + 1
        a = scores[i * n_rep : (i + 1) * n_rep]
        for r in range(n_rep):
            h = g * n_rep + r
            m = scaled_max(a, r, lo, p + 1, scale)
            if sinks.shape[0] > 0 and sinks[h] > m:
                m = sinks[h]
            z = exp_sum(a, r, lo, p + 1, m)
            if sinks.shape[0] > 0:
                z += np.exp(sinks[h] - m)
            for j in range(lo, p + 1):
                a[r, j] = a[r, j] / z
        first = lo // B
        for bi in range(first, p // B + 1):
            j0, j1 = max(lo, bi * B), min(p + 1, (bi + 1) * B)
            if bi == first:
                values(a, v_pool[table[bi], il, g], out[t0 + i], g * n_rep, n_rep, j0, j1, bi * B, False)
            else:
                values(a, v_pool[table[bi], il, g], out[t0 + i], g * n_rep, n_rep, j0, j1, bi * B, True)


@nb.njit(**JIT)
def values(a, v, out, h0, n_rep, lo, hi, voff, cont):
    # out[h0 + r] = sum over lo <= j < hi, in key order, of a[r, j] * v[j - voff] for r < n_rep
    # (with cont, added on to the sums out holds, as the same chain): a kv head's query
    # heads' weighted sums of its values (a [n_rep, S], v [rows, hv], out [Hq, hv]), by
    # pv_tile four heads and 32 columns at a time, the rest the same way in smaller blocks
    nb.literally(cont)  # a compile-time constant for pv_tile: values is compiled once for each
    hv = v.shape[1]
    if hv > 1 and v.strides[1] != 4:
        raise ValueError("attention: a value row's columns must be adjacent")
    d32, d8 = hv - hv % 32, hv - hv % 8
    for r in range(0, n_rep - n_rep % 4, 4):
        for d0 in range(0, d32, 32):
            pv_tile(a, v, out, r, h0 + r, d0, lo, hi, voff, 4, 4, cont)
    for r in range(n_rep - n_rep % 4, n_rep):
        for d0 in range(0, d32, 32):
            pv_tile(a, v, out, r, h0 + r, d0, lo, hi, voff, 1, 4, cont)
    for r in range(n_rep):
        for d0 in range(d32, d8, 8):
            pv_tile(a, v, out, r, h0 + r, d0, lo, hi, voff, 1, 1, cont)
        for d in range(d8, hv):  # the last hv % 8 columns: a chain of their own, one lane
            if not cont:
                out[h0 + r, d] = 0.0
            for j in range(lo, hi):
                out[h0 + r, d] += a[r, j] * v[j - voff, d]


_Q_BLOCK = 16  # query tokens attention takes through a kv head's keys at once (16 x 8 heads x 128: 64 KiB)
# query tokens from which a prompt's keys and values are first copied into one contiguous run:
# a KV block's 16 keys are two 6-row tile groups and four single rows, and its values a chain
# stored and taken up again at every block. One thread, 32 heads of 128 over 512 positions:
# 512 new tokens 38.6 ms with the blocks as they are, 32.6 copied; 64 tokens 8.7 / 7.9; 32
# tokens 4.5 / 4.4; 16 tokens 2.2 / 2.5 (the copy's fresh pages cost ~0.5 ms)
_GATHER_MIN = 32


@nb.njit(**JIT)
def gathered(pool, il, table, B, lo, S):
    # [1, 1, Hkv, S, d] f32: positions lo .. S of a sequence's keys (or values) in the pool
    # [blocks, L, Hkv, B, d] as one contiguous block (the positions before lo left unset)
    Hkv, d = pool.shape[2], pool.shape[4]
    c = np.empty((1, 1, Hkv, S, d), np.float32)
    for bi in range(lo // B, (S + B - 1) // B):
        j0, j1 = max(lo, bi * B), min(S, (bi + 1) * B)
        c[0, 0, :, j0:j1] = pool[table[bi], il, :, j0 - bi * B : j1 - bi * B]
    return c


@nb.njit(**JIT)
def attend_blocks(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out):
    # attention_paged's work, _Q_BLOCK tokens and one kv head at a time (attend_block)
    T, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    n_rep, nq = Hq // Hkv, min(T, _Q_BLOCK)
    qg, scores = rows_aligned(nq * n_rep, hd), np.empty((nq * n_rep, pos0 + T), np.float32)
    for t0 in range(0, T, _Q_BLOCK):
        for g in range(Hkv):
            attend_block(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, t0, min(T, t0 + _Q_BLOCK),
                         g, qg, scores)


@nb.njit(parallel=True, **JIT)
def attend_blocks_par(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out):
    # attend_blocks (the same bits) with the (token block, kv head) pairs shared among numba's
    # threads, the blocks taken first, last, second, second last ..: a thread's contiguous
    # share of them has its part of the short and of the long ones
    T, Hq, hd = q.shape
    Hkv = k_pool.shape[2]
    n_rep, nq, nblk = Hq // Hkv, min(T, _Q_BLOCK), (T + _Q_BLOCK - 1) // _Q_BLOCK
    for k in nb.prange(nblk * Hkv):
        i, g = k // Hkv, k % Hkv
        b = i // 2 if i % 2 == 0 else nblk - 1 - i // 2
        attend_block(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, b * _Q_BLOCK,
                     min(T, (b + 1) * _Q_BLOCK), g, rows_aligned(nq * n_rep, hd),
                     np.empty((nq * n_rep, pos0 + T), np.float32))


@nb.njit(**JIT)
def attend_on(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, par):
    # attend_blocks, or with par attend_blocks_par (the same bits)
    if par:
        attend_blocks_par(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out)
    else:
        attend_blocks(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out)


@nb.njit(**JIT)
def attention_paged_on(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, par):
    # q [T, Hq, hd] f32 for absolute positions pos0..pos0+T-1 of one sequence whose keys and
    # values are in blocks of B positions: k_pool [blocks, L, Hkv, B, hd], v_pool [blocks, L,
    # Hkv, B, hv] (hv, the value head size, may differ from hd), table [n] the sequence's
    # blocks in position order (block table[i] holds positions i*B..), il the layer; out [T,
    # Hq, hv]. Causal; with window > 0 a query at p sees keys at j with p - window < j <= p.
    # sinks [Hq] f32 (gpt-oss), or empty: a logit per head that joins the softmax's
    # denominator and nothing else (attention may go nowhere). No T x T matrix: _Q_BLOCK
    # tokens' scores at a time (attend_block); with par on every thread. From _GATHER_MIN
    # tokens the keys and values they see are copied into one contiguous block first: the
    # same operations on each (head, key), in longer runs
    S = pos0 + q.shape[0]
    if q.shape[0] < _GATHER_MIN or S <= B:
        attend_on(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, par)
        return
    lo = max(0, pos0 - window + 1) if window > 0 else 0
    attend_on(q, gathered(k_pool, il, table, B, lo, S), gathered(v_pool, il, table, B, lo, S), 0,
              np.zeros(1, np.int64), S, pos0, window, scale, sinks, out, par)


@nb.njit(**JIT)
def attention_paged(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out):
    # attention_paged_on on this thread
    attention_paged_on(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, False)


@nb.njit(**JIT)
def attention_paged_par(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out):
    # attention_paged_on on every thread (the same bits)
    attention_paged_on(q, k_pool, v_pool, il, table, B, pos0, window, scale, sinks, out, True)


@nb.njit(**JIT)
def attention(q, k_cache, v_cache, pos0, window, scale, sinks, out):
    # attention_paged over one contiguous cache: k_cache [Hkv, S, hd], v_cache [Hkv, S, hv],
    # C-contiguous (one block of S positions)
    Hkv, S = k_cache.shape[:2]
    attention_paged(q, k_cache.reshape((1, 1, Hkv, S, k_cache.shape[2])),
                    v_cache.reshape((1, 1, Hkv, S, v_cache.shape[2])), 0, np.zeros(1, np.int64), S, pos0, window,
                    scale, sinks, out)


@nb.njit(**JIT)
def attention_par(q, k_cache, v_cache, pos0, window, scale, sinks, out):
    # attention_paged_par over one contiguous cache (see attention)
    Hkv, S = k_cache.shape[:2]
    attention_paged_par(q, k_cache.reshape((1, 1, Hkv, S, k_cache.shape[2])),
                        v_cache.reshape((1, 1, Hkv, S, v_cache.shape[2])), 0, np.zeros(1, np.int64), S, pos0,
                        window, scale, sinks, out)


ATTENTION_PAR_MIN = 2**22  # query x key pairs x head dims from which a prompt's attention runs on every thread


@nb.njit(**JIT)
def carve(work, o, n, m):
    # work[o' : o' + n m] (1-D) as [n, m], o' the first multiple of ALIGN_FLOATS from o (so an
    # aligned work gives aligned arrays: CARVE_SLACK floats a carve), and the offset after it
    o = (o + ALIGN_FLOATS - 1) // ALIGN_FLOATS * ALIGN_FLOATS
    return work[o : o + n * m].reshape(n, m), o + n * m


CARVE_SLACK = ALIGN_FLOATS


@nb.njit(**JIT)
def silu_mul(gate, up, out):
    # gate, up, out [T, I] f32 (C-contiguous; out may be gate): out = silu(gate) * up (silu_mul_rows)
    T, I = gate.shape
    if up.shape != gate.shape or out.shape != gate.shape:
        raise ValueError("silu_mul: gate, up and output shapes do not match")
    silu_mul_rows(gate, up, out, 0, T, 0, I)


@nb.njit(**JIT)
def sum_slots_row(ys, A, out, t):
    # out[t] = ys[t*A] + ys[t*A + 1] + ... in that order (ys [T * A, D] f32, out [T, D])
    D = out.shape[1]
    for d in range(D):
        out[t, d] = ys[t * A, d]
    for a in range(1, A):
        for d in range(D):
            out[t, d] += ys[t * A + a, d]


@nb.njit(**JIT)
def sum_slots(ys, A, out):
    # every token's expert outputs summed slot by slot (sum_slots_row)
    for t in range(out.shape[0]):
        sum_slots_row(ys, A, out, t)


@nb.njit(parallel=True, **JIT)
def sum_slots_par(ys, A, out):
    # sum_slots (the same bits: a row is one thread's) with the tokens shared among numba's threads
    for t in nb.prange(out.shape[0]):
        sum_slots_row(ys, A, out, t)


@nb.njit(**JIT_FAST)
def read_bandwidth(buf, n_rep):
    # sum of a large uint64 buffer n_rep times: the memory-read roofline for the benchmarks
    s = np.uint64(0)
    for _ in range(n_rep):
        for i in range(buf.shape[0]):
            s += buf[i]
    return s
