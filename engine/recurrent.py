"""Linear attention with a recurrent state, as hybrid families' linear layers compute it: the
causal depthwise short convolution (its last inputs kept per sequence), and the gated delta
rule, a fixed-size state per value head that decays, is corrected toward each token's value
and read by its query: Gated DeltaNet (Qwen3-Next, Qwen3.5) decays a head's state by one
rate, Kimi Delta Attention (Kimi Linear) each key channel's row by its own.

Both run token by token (the sequential form), for a prompt as for a decode step: a token's
outputs and the state after it are the same bits whether the prompt comes in one step or in
chunks of any size, alone or batched (each sequence's rows are computed on their own, in
order). transformers computes a prompt in chunks of 64 (a different order of the same sums:
rounding apart) and a decode step this way. The state is float32 throughout."""

import math

import numba as nb
import numpy as np

from . import crew
from .jit import JIT, family_warm


@nb.njit(**JIT)
def short_conv(x, w, state, out):
    # x [T, C] f32, w [C, K] f32 (channel c's taps, oldest first), state [C, K-1] f32 (the
    # sequence's last K-1 inputs, oldest first; updated), out [T, C] = silu(conv(x)):
    # out[t, c] = silu(sum_j w[c, j] * x_ext[t + j, c]), x_ext = the state's inputs, then x
    T, C = x.shape
    K = w.shape[1]
    for t in range(T):
        for c in range(C):
            acc = np.float32(0.0)
            for j in range(K):
                src = t + j - (K - 1)
                xv = x[src, c] if src >= 0 else state[c, K - 1 + src]
                acc += w[c, j] * xv
            out[t, c] = acc / (np.float32(1.0) + np.float32(math.exp(-acc)))
    for c in range(C):  # the last K-1 inputs of x_ext
        for j in range(K - 1):
            src = T - (K - 1) + j
            state[c, j] = x[src, c] if src >= 0 else state[c, j + T]


@nb.njit(**JIT)
def _delta_head(q, k, v, g, beta, state, out, h, r, kv):
    # value head h of gated_delta_rule through every token (its state and outputs only: the
    # heads are independent, so any order or thread gives the same bits)
    T, dk, dv = q.shape[0], q.shape[2], v.shape[2]
    S, hk = state[h], h // r
    for t in range(T):
        decay = np.float32(math.exp(g[t, h, 0]))
        for j in range(dv):
            kv[j] = 0.0
        for i in range(dk):
            ki = k[t, hk, i]
            if g.shape[2] > 1:
                decay = np.float32(math.exp(g[t, h, i]))
            for j in range(dv):
                S[i, j] *= decay
                kv[j] += S[i, j] * ki
        b = beta[t, h]
        for j in range(dv):
            kv[j] = (v[t, h, j] - kv[j]) * b  # delta
            out[t, h, j] = 0.0
        for i in range(dk):
            ki, qi = k[t, hk, i], q[t, hk, i]
            for j in range(dv):
                S[i, j] += ki * kv[j]
                out[t, h, j] += S[i, j] * qi


@nb.njit(**JIT)
def gated_delta_rule(q, k, v, g, beta, state, out):
    # q, k [T, Hk, dk] f32 (q/k L2-normed, q scaled), v [T, Hv, dv], g [T, Hv, 1] (the log
    # decay of a head) or [T, Hv, dk] (of each key channel), beta [T, Hv] (the write
    # strength), state [Hv, dk, dv] f32 (updated), out [T, Hv, dv]. Value head h reads key
    # head h // (Hv / Hk). Per token and head, as transformers' recurrent forms: S *= exp(g)
    # (row i by channel i's); delta = (v - S^T k) * beta; S += k delta^T; out = S^T q
    kv = np.empty(v.shape[2], np.float32)
    for h in range(v.shape[1]):
        _delta_head(q, k, v, g, beta, state, out, h, v.shape[1] // q.shape[1], kv)


@nb.njit(parallel=True, **JIT)
def gated_delta_rule_par(q, k, v, g, beta, state, out):
    # gated_delta_rule with the value heads on every thread (a prompt's): the same bits
    for h in nb.prange(v.shape[1]):
        _delta_head(q, k, v, g, beta, state, out, h, v.shape[1] // q.shape[1], np.empty(v.shape[2], np.float32))


PAR_MIN = 1 << 22  # state updates (tokens x heads x dk x dv) from which a step's delta rule runs on every thread


def delta_rule(q, k, v, g, beta, state, out) -> None:
    """gated_delta_rule, a long prompt's on every thread (the step's crew parked first: its
    spinning helpers would hold the CPUs), a short one's on this thread."""
    if q.shape[0] * v.shape[1] * q.shape[2] * v.shape[2] >= PAR_MIN and v.shape[1] > 1:
        if crew.session() is not None:
            crew.session().close()
        gated_delta_rule_par(q, k, v, g, beta, state, out)
    else:
        gated_delta_rule(q, k, v, g, beta, state, out)


@family_warm("recurrent")
def warm() -> None:
    # each kernel on tiny C arrays, as the hybrids call them: a head's decay and a channel's
    x, w, st = np.ones((3, 4), np.float32), np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)
    short_conv(x, w, st, np.empty_like(x))
    q, v = np.ones((3, 1, 4), np.float32), np.ones((3, 2, 4), np.float32)
    for g in (np.zeros((3, 2, 1), np.float32), np.zeros((3, 2, 4), np.float32)):
        for kernel in (gated_delta_rule, gated_delta_rule_par):
            kernel(q, q, v, g, np.ones((3, 2), np.float32), np.zeros((2, 4, 4), np.float32), np.empty_like(v))


def layer_slots(layer_types: list[str]) -> tuple[dict[int, int], int, int]:
    """A hybrid's layers' rows in a sequence's cache: full-attention layers in the KV pool,
    linear ones in the recurrent state, each kind numbered apart. Returns (layer -> its row,
    full layers, linear layers)."""
    full = [il for il, t in enumerate(layer_types) if t == "full_attention"]
    lin = [il for il, t in enumerate(layer_types) if t == "linear_attention"]
    return {il: i for i, il in enumerate(full)} | {il: i for i, il in enumerate(lin)}, len(full), len(lin)


def l2norm(x: np.ndarray, eps: float = 1e-6, divide: bool = False) -> np.ndarray:
    # x [..., d] f32 -> x / sqrt(sum(x * x) + eps) along the last axis: times the reciprocal
    # (Qwen's l2norm), or divided by the root (`divide`: Kimi Linear's, as its Triton kernel)
    root = np.sqrt((x * x).sum(axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return x / root if divide else x * (np.float32(1.0) / root)


def softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + exp(x)), x itself above 20 (torch's threshold)
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)
