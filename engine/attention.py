"""Grouped-query attention over each sequence's KV cache: the layer's projections, q/k
norms, RoPE and the paged kernels (kernels.attention_paged, _par), with sinks and sliding
windows as the family asks."""

from dataclasses import dataclass

import numba as nb
import numpy as np

from . import crew, kernels
from .jit import JIT, family_warm
from .kernels import NO_SINKS
from .layers import linear, rmsnorm
from .sequence import KV_BLOCK, KVCache, Step


@dataclass
class AttnSpec:
    n_head: int
    n_kv_head: int
    head_dim: int
    eps: float
    qk_norm: str = "none"  # "none", "head" (per head, qwen3) or "full" (whole projection, olmoe)
    clip_qkv: float | None = None
    v_head_dim: int | None = None  # the value head size, when it is not head_dim
    rope_interleaved: bool = False  # rotary pairs (2i, 2i+1), taken apart before the rotation, as transformers does
    scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    output_gate: bool = False  # q's projection also gives, per head, a gate: the output times its sigmoid (Qwen3-Next)

    @property
    def hv(self) -> int:
        return self.v_head_dim or self.head_dim


def deinterleave(x: np.ndarray, half: int) -> np.ndarray:
    # x [T, H, hd]: the first 2 * half dims, rotary pairs (2i, 2i+1), reordered as the evens
    # then the odds, so that the rotate-half kernel turns them (transformers' interleaved RoPE)
    out = np.array(x)  # [T, H, hd]
    T, H = x.shape[:2]
    out[..., : 2 * half] = x[..., : 2 * half].reshape(T, H, half, 2).transpose(0, 1, 3, 2).reshape(T, H, 2 * half)
    return out


def attention(spec: AttnSpec, w: dict, x: np.ndarray, step: Step, il: int, window: int = 0):
    # x [T, D] (normed) -> [T, D]; w: a layer's weights by key (q, k, v, o; optional q_bias,
    # k_bias, v_bias, o_bias, q_norm, k_norm); writes each sequence's keys/values at its
    # cache.n_pos, as layer `il` of the cache's arrays
    T = x.shape[0]
    Hq, Hkv, hd, hv = spec.n_head, spec.n_kv_head, spec.head_dim, spec.hv
    q = linear(x, w["q"], w.get("q_bias"))  # [T, Hq*hd] ([T, Hq*2hd] with an output gate)
    gate = None
    if spec.output_gate:  # per head: its query, then its gate
        qg = q.reshape(T, Hq, 2 * hd)
        q, gate = qg[..., :hd].reshape(T, Hq * hd), qg[..., hd:].reshape(T, Hq * hd)
    k = linear(x, w["k"], w.get("k_bias"))  # [T, Hkv*hd]
    v = linear(x, w["v"], w.get("v_bias"))  # [T, Hkv*hv]
    if spec.qk_norm == "full":
        q, k = rmsnorm(q, w["q_norm"], spec.eps), rmsnorm(k, w["k_norm"], spec.eps)
    if spec.clip_qkv is not None:
        c = spec.clip_qkv
        q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
    q = np.ascontiguousarray(q.reshape(T, Hq, hd))  # [T, Hq, hd]
    k = np.ascontiguousarray(k.reshape(T, Hkv, hd))  # [T, Hkv, hd]
    if spec.qk_norm == "head":
        q, k = rmsnorm(q, w["q_norm"], spec.eps), rmsnorm(k, w["k_norm"], spec.eps)
    if spec.rope_interleaved:
        q, k = deinterleave(q, step.cos.shape[1]), deinterleave(k, step.cos.shape[1])
    kernels.rope(q, step.cos, step.sin)
    kernels.rope(k, step.cos, step.sin)
    v = v.reshape(T, Hkv, hv)  # [T, Hkv, hv]
    out = kernels.empty_aligned((T, Hq, hv))  # [T, Hq, hv] (the o projection's tiles read it)
    scale = np.float32(spec.scale if spec.scale is not None else hd**-0.5)
    sinks = w.get("sinks", NO_SINKS)  # [Hq] f32: a family's attention sinks
    for sg in step.segments:
        rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
        cache.write("k", il, pos0, k[rows])  # [n, Hkv, hd]
        cache.write("v", il, pos0, v[rows])
        attend(q[rows], cache, il, "k", "v", window, scale, sinks, out[rows])
    out = out.reshape(T, Hq * hv)
    if gate is not None:
        out = out * (1.0 / (1.0 + np.exp(-gate)))  # [T, Hq*hv]
    return linear(out, w["o"], w.get("o_bias"))


def attend(q, cache: KVCache, il: int, k: str, v: str, window: int, scale, sinks, out) -> None:
    # kernels.attention_paged for one sequence's rows (positions cache.n_pos..), its keys and
    # values the pool's arrays k and v; a long prompt's on every thread (the same bits), the
    # step's crew parked first: its spinning helpers would hold the CPUs
    T, Hq, hd = q.shape
    pos0, arrays = cache.n_pos, cache.pool.arrays
    args = (q, arrays[k], arrays[v], il, cache.table, KV_BLOCK, pos0, window, scale, sinks, out)
    if T > 1 and T * (pos0 + T) * Hq * hd >= kernels.ATTENTION_PAR_MIN:
        if crew.session() is not None:
            crew.session().close()
        kernels.attention_paged_par(*args)
    else:
        kernels.attention_paged(*args)


@nb.njit(**JIT)
def chosen_attention(q, k, v, allowed, scale, out):
    # one sequence's rows: q [n, H, d], keys k [S, Hkv, d] and values v [S, Hkv, dv], allowed
    # [n, S] bool (the keys a sparse-attention indexer chose for each row) -> out [n, H, dv]:
    # each row's softmax over its allowed keys, in position order (its bits the same whichever
    # rows share its step). A row with none averages every value, as transformers' additive
    # mask gives it (its minimum added to every score: all equal)
    n, H, d = q.shape
    S, G, dv = k.shape[0], H // k.shape[1], v.shape[2]
    p = np.empty(S, np.float32)
    for t in range(n):
        for h in range(H):
            g = h // G
            m = -np.inf
            for s in range(S):
                if allowed[t, s]:
                    acc = np.float32(0.0)
                    for j in range(d):
                        acc += q[t, h, j] * k[s, g, j]
                    p[s] = acc * scale
                    m = max(m, p[s])
            den = np.float32(0.0)
            for s in range(S):
                if m == -np.inf:  # (none allowed)
                    p[s] = np.float32(1.0)
                    den += p[s]
                elif allowed[t, s]:
                    p[s] = np.float32(np.exp(p[s] - m))
                    den += p[s]
            for j in range(dv):
                acc = np.float32(0.0)
                for s in range(S):
                    if m == -np.inf or allowed[t, s]:
                        acc += p[s] * v[s, g, j]
                out[t, h, j] = acc / den


@family_warm("chosen")
def warm_chosen() -> None:
    # the sparse-attention families' kernel (GLM-5.3-Flash's MLA, Qwen4-Exp's GQA), on tiny C arrays
    q, k = np.ones((2, 2, 4), np.float32), np.ones((3, 1, 4), np.float32)
    chosen_attention(q, k, k, np.ones((2, 3), np.bool_), np.float32(0.5), np.empty_like(q))
