"""Numba kernels for the hot loops, each over preallocated numpy arrays.

Activations are float32. Weights stay in their storage precision: float32, float16,
or bf16 held as raw uint16 bits (see storage.safetensors); the 16-bit kernels widen
one weight row at a time into a small float32 buffer and never make a float32 copy
of a matrix. Every kernel is `nogil`, so reads of the next experts can run while it
computes, and `cache=True`, so a process compiles it once per machine.

The numpy references these are tested against live in tests/engine/test_kernels.py.
"""

import numba as nb
import numpy as np

JIT = dict(cache=True, nogil=True)
# reassociating the dot-product sum lets LLVM vectorise it; results differ from a
# sequential sum only in rounding (~1e-7 relative), as any BLAS does
JIT_FAST = dict(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})


def f16_table() -> np.ndarray:
    """float32 value of every float16 bit pattern, for the f16 matmul kernel."""
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@nb.njit(**JIT_FAST)
def matmul_u16(x, w, is_bf16, f16_lut, out):
    # x [T, D] f32, w [N, D] u16 (bf16 bits or f16 bits), out [T, N] f32: out = x @ w.T
    T, D = x.shape
    N = w.shape[0]
    bits = np.empty(D, np.uint32)
    row = bits.view(np.float32)  # [D]
    for n in range(N):
        if is_bf16:
            for d in range(D):
                bits[d] = np.uint32(w[n, d]) << 16
        else:
            for d in range(D):
                row[d] = f16_lut[w[n, d]]
        for t in range(T):
            acc = np.float32(0.0)
            for d in range(D):
                acc += x[t, d] * row[d]
            out[t, n] = acc


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
    # x [T, D] f32, q [N, D] int8, scales [N, D/g] f16 bits (uint16), out [T, N]: out = x @ dequant(q).T
    T, D = x.shape
    N = q.shape[0]
    row = np.empty(D, np.float32)  # one dequantized row, never a whole matrix
    for n in range(N):
        for gi in range(D // g):
            s = f16_lut[scales[n, gi]]
            for j in range(gi * g, gi * g + g):
                row[j] = np.float32(q[n, j]) * s
        for t in range(T):
            acc = np.float32(0.0)
            for d in range(D):
                acc += x[t, d] * row[d]
            out[t, n] = acc


@nb.njit(**JIT_FAST)
def matmul_q4(x, q, scales, g, f16_lut, out):
    # x [T, D] f32, q [N, D/2] uint8 (even column in the low nibble, value + 8), scales [N, D/g]
    # f16 bits, out [T, N]: out = x @ dequant(q).T
    T, D = x.shape
    N = q.shape[0]
    half = g // 2
    row = np.empty(D, np.float32)
    for n in range(N):
        for gi in range(D // g):
            s = f16_lut[scales[n, gi]]
            for j in range(gi * half, gi * half + half):
                b = q[n, j]
                row[2 * j] = np.float32(np.int32(b & 15) - 8) * s
                row[2 * j + 1] = np.float32(np.int32(b >> 4) - 8) * s
        for t in range(T):
            acc = np.float32(0.0)
            for d in range(D):
                acc += x[t, d] * row[d]
            out[t, n] = acc
