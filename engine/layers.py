"""Blocks every family shares: linear, RMSNorm, RoPE, GQA attention with a KV cache,
SwiGLU, the MoE dispatch. Numpy glue around the numba kernels; activations f32.
"""

import ctypes
import functools
import math
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ..storage.experts import ExpertSource, QuantWeight, bf16_to_f32, dequantize, int4_of
from . import crew, fpkernels, kernels, qkernels
from .kernels import f16_lut

NO_SINKS = np.zeros(0, np.float32)  # attention without sinks
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
KEEP_FREED = 1 << 30  # bytes of freed memory malloc keeps for the next step rather than hand back


def reuse_freed_memory() -> None:
    """Have malloc keep a forward step's freed temporaries for the next one. The activations of
    a prompt step are megabytes each (8 MiB for a 512-token layer's queries), freed as soon as
    the layer is done; by default glibc maps each afresh and hands it back to the system after,
    so every page of it is faulted in and zeroed again: 40,000 faults and 0.8 s of system time
    in a 512-token prompt of 3.6 s (3.1-3.2 s with this). Mapped only from 32 MiB (the most
    glibc allows), the top of the heap handed back only past KEEP_FREED (at 256 MiB it still
    was, now and then). The cost: the process keeps its largest step's temporaries (~0.5 GB
    for 512 tokens of a 2048-wide model), which that step needed anyway. Elsewhere than
    glibc: nothing."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED)
    except (OSError, AttributeError):
        pass


def init(n_threads: int | None = None, progress=None) -> None:
    """Start-up work for the kernels: the f16 table, the compute threads (default: the CPUs
    this process may run on), and one call of each kernel on tiny arrays so that compiling
    (or loading the compiled cache) happens here, not in the first request's timings.
    `progress(phase, done, total)` hears each kernel group. Call once before forward."""
    if n_threads is not None or not crew.threads_set():
        crew.set_threads(n_threads or len(os.sched_getaffinity(0)))
    if init.done:
        return
    reuse_freed_memory()
    x = np.ones((1, 4), np.float32)
    x64 = np.ones((1, 128), np.float32)
    q, kv = np.ones((1, 1, 4), np.float32), np.ones((1, 1, 1, 4), np.float32)

    def dense():
        for u16 in (np.ones((2, 4), np.uint16), np.ones((2, 4), np.float16)):
            kernels.matmul_u16_par(x, u16.view(np.uint16), u16.dtype == np.uint16, f16_lut(), np.empty((1, 2), np.float32))
        kernels.matmul_f32_par(x, np.ones((2, 4), np.float32), np.empty((1, 2), np.float32))
        for w in (np.ones((2, 4), np.float32), np.ones((2, 4), np.uint16), np.ones((2, 4), np.float16),
                  QuantWeight("int8", np.ones((2, 4), np.int8), np.ones((2, 2), np.float16), 2)):
            linear(x, w)
        qlinear(x, QuantWeight("int8", np.ones((2, 4), np.int8), np.ones((2, 2), np.float16), 2), prompt=True)

    def experts(g):
        q4 = QuantWeight("int4", np.ones((128, 64), np.uint8), np.ones((128, 128 // g), np.float16), g)
        swiglu(x64, q4, q4, q4)  # the crew's kernel (one function for every kind of job)
        swiglu(x64, q4, q4, q4, prompt=True)

    def published():  # FP8 and MXFP4, the decode and the prompt path
        weights = [QuantWeight(kind, np.ones((2, 64), np.uint8), np.ones((1, 1), np.float32), 64, 2)
                   for kind in fpkernels.FP8_FORMATS]
        weights.append(QuantWeight("mxfp4", np.ones((2, 32), np.uint8), np.full((2, 2), 127, np.uint8), 32))
        for w in weights:
            for prompt in (False, True):
                qlinear(np.ones((1, 64), np.float32), w, prompt)

    def attention():
        for norm in (kernels.rmsnorm, kernels.rmsnorm_par):
            norm(x, np.ones(4, np.float32), 1e-6, np.empty_like(x))
        for slots in (kernels.sum_slots, kernels.sum_slots_par):
            slots(np.ones((2, 4), np.float32), 2, np.empty((1, 4), np.float32))
        kernels.rope(q, np.ones((1, 2), np.float32), np.ones((1, 2), np.float32))
        for kernel in (kernels.attention, kernels.attention_par):
            kernel(q, kv[0], kv[0], 0, 0, np.float32(1.0), NO_SINKS, np.empty_like(q))
        pool = KVPool({"k": (1, 1, 4)}, {"v": ("k", 2)}, reserve=1)  # paged: values their own array, or a view (MLA)
        table = np.zeros(1, np.int64)
        for kernel in (kernels.attention_paged, kernels.attention_paged_par):
            for v, hv in ((pool.arrays["k"], 4), (pool.arrays["v"], 2)):
                kernel(q, pool.arrays["k"], v, 0, table, KV_BLOCK, 0, 0, np.float32(1.0), NO_SINKS,
                       np.empty((1, 1, hv), np.float32))
        kernels.silu_mul(x, x, np.empty_like(x))

    steps = [dense, *(functools.partial(experts, g) for g in qkernels.LINEAR_Q4), published, attention]
    assert len(steps) == len(COMPILE_SHARES)
    for i, step in enumerate(steps):
        if progress:
            progress("compiling kernels", i, len(steps))
        step()
    init.done = True


init.done = False
# each kernel group's part of a first compile (seconds measured on the 2-core box: dense 12,
# int4 experts 9, 5, 5, published formats 4, attention 64), for an estimate while it runs
COMPILE_SHARES = (0.12, 0.09, 0.05, 0.05, 0.04, 0.65)


def to_f32(a) -> np.ndarray:
    """Widen a storage-precision array (f32, f16, bf16 as uint16) to float32, exactly; a
    published FP8 or MXFP4 weight to the float32 values it stands for (exact too)."""
    if isinstance(a, QuantWeight):
        return dequantize(a)
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def qlinear(x: np.ndarray, w: QuantWeight, prompt: bool = False) -> np.ndarray:
    # x [T, D] f32 C-contiguous, w a QuantWeight [N, D] -> [T, N] f32. prompt: the rows are a
    # prompt's, taken by the prompt-token kernel where the format has one (each row's result
    # the same alone or batched on either path; the two differ in rounding only)
    y = np.empty((x.shape[0], w.q.shape[0]), np.float32)
    if w.kind in fpkernels.FP8_FORMATS:
        fmt = fpkernels.FP8_FORMATS[w.kind]
        if prompt:
            fpkernels.LINEAR_F8_TOK[fmt](x, w.q, w.scales, w.row_block, w.group_size, fpkernels.FP8_VALUES[w.kind], y)
        else:
            fpkernels.LINEAR_F8[fmt](x, w.q, w.scales, w.row_block, w.group_size, y)
    elif w.kind == "mxfp4":
        if prompt:
            fpkernels.linear_mx4_tok(x, w.q, w.scales, fpkernels.E8M0_VALUES, fpkernels.E2M1_VALUES, y)
        else:
            fpkernels.linear_mx4(x, w.q, w.scales, fpkernels.E8M0_VALUES, y)
    elif w.kind == "int8" and prompt:
        qkernels.linear_q8_tok(x, w.q, w.scales.view(np.uint16), w.group_size, f16_lut(), y)
    elif w.kind == "int8":
        qkernels.matmul_q8(x, w.q, w.scales.view(np.uint16), w.group_size, f16_lut(), y)
    elif prompt:
        qkernels.LINEAR_Q4_TOK[w.group_size](x, w.q, w.scales.view(np.uint16), f16_lut(), y)
    else:
        qkernels.LINEAR_Q4[w.group_size](x, w.q, w.scales.view(np.uint16), f16_lut(), y)
    return y


def linear(x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
    # x [T, D] f32, w [N, D] in storage precision or a QuantWeight -> [T, N] f32
    x = np.ascontiguousarray(x, dtype=np.float32)
    if isinstance(w, QuantWeight):
        y = qlinear(x, w)
    elif w.size >= crew.CREW_MIN_ELEMENTS and w.flags.c_contiguous and crew.session() is not None:
        y = kernels.empty_aligned((x.shape[0], w.shape[0]))  # on the step's crew, as matmul_f32 / matmul_u16 below
        crew.session().matmul(x, w, y)
    elif w.dtype == np.float32:
        # not BLAS: its result for a row depends on how many rows share the call (gemv vs gemm
        # blocking), and a request's tokens must not change when others share its step
        y = kernels.empty_aligned((x.shape[0], w.shape[0]))
        kernel = kernels.matmul_f32_par if w.size >= kernels.PARALLEL_MIN_ELEMENTS else kernels.matmul_f32
        kernel(x, w, y)
    else:
        y = kernels.empty_aligned((x.shape[0], w.shape[0]))
        kernel = kernels.matmul_u16_par if w.size >= kernels.PARALLEL_MIN_ELEMENTS else kernels.matmul_u16
        kernel(x, w.view(np.uint16), w.dtype == np.uint16, f16_lut(), y)
    if bias is not None:
        y += bias
    return y


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # x [..., D] f32, w [D] f32
    shape = x.shape
    x2 = np.ascontiguousarray(x.reshape(-1, shape[-1]), dtype=np.float32)  # [T*, D]
    out = kernels.empty_aligned(x2.shape)  # (the tiles read it: see kernels.ALIGN)
    (kernels.rmsnorm_par if x2.size >= kernels.ROWS_PAR_MIN else kernels.rmsnorm)(x2, w, eps, out)
    return out.reshape(shape)


def swiglu(x: np.ndarray, gate, up, down, prompt: bool = False) -> np.ndarray:
    # x [T, D]; gate, up [I, D]; down [D, I] -> [T, D]. Quantized experts: by the prompt-token
    # kernels when the rows are a prompt's; int4 on the decode path in one call (a one-job
    # crew.Crew), every row its own with weight 1 (exact)
    if int4_of((gate, up, down)) is not None and not prompt:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], down.q.shape[0]), np.float32)
        one = crew.Crew(gate.group_size, share=False, max_jobs=1)
        one.experts(x, np.arange(x.shape[0]), np.array([0, x.shape[0]]), 1, np.ones(x.shape[0], np.float32),
                    [(gate, up, down)], out)
        return out
    if prompt and isinstance(gate, QuantWeight):  # the prompt-token kernels (int4, fp8, mxfp4)
        x = np.ascontiguousarray(x, dtype=np.float32)
        h, u = qlinear(x, gate, True), qlinear(x, up, True)
        kernels.silu_mul(h, u, h)
        return qlinear(h, down, True)
    g = linear(x, gate)  # [T, I]
    u = linear(x, up)  # [T, I]
    kernels.silu_mul(g, u, g)
    return linear(g, down)


# ---- RoPE ----------------------------------------------------------------------------------

ROPE_TYPES = ("default", "linear", "yarn")


def rope_parameters(cfg: dict, defaults: dict) -> dict:
    """The RoPE settings of a config in either spelling: transformers 5's `rope_parameters`
    or the hub's top-level `rope_theta` plus `rope_scaling`; a config with neither takes
    the family's `defaults` (its transformers config class's: gpt-oss's is yarn, GLM-4.5's
    rotates half the head). Returns a dict with at least rope_type and rope_theta."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        if not params:
            params = {k: v for k, v in defaults.items() if k != "rope_theta"}
        params.setdefault("rope_theta", cfg.get("rope_theta", defaults["rope_theta"]))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", defaults["rope_theta"]))
    if "partial_rotary_factor" in cfg:  # the hub's spelling (GLM-4.5): at the top level
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if "partial_rotary_factor" in defaults:
        params.setdefault("partial_rotary_factor", defaults["partial_rotary_factor"])
    return params


def rope_inv_freq(params: dict, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim/2] and attention scaling, as transformers computes them
    (float32 arithmetic) for the default, linear and yarn RoPE types."""
    base = float(params["rope_theta"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exps).astype(np.float32)  # [dim/2]
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    factor = params.get("factor")
    if kind == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32), 1.0
    # yarn
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / original

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = params.get("attention_factor")
    if attn is None:
        ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
        attn = mscale_of(factor, ms) / mscale_of(factor, ms_all) if ms and ms_all else mscale_of(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(n_rot):
        return (dim * math.log(original / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = np.float32(1) - ramp
    inv_interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_interp * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq.astype(np.float32), float(attn)


@dataclass
class Rope:
    inv_freq: np.ndarray  # [hd/2] f32
    scaling: float

    def table(self, pos0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        # -> cos, sin [n, hd/2] for positions pos0 .. pos0+n-1
        freqs = np.arange(pos0, pos0 + n, dtype=np.float32)[:, None] * self.inv_freq[None, :]
        cos = (np.cos(freqs) * np.float32(self.scaling)).astype(np.float32)
        sin = (np.sin(freqs) * np.float32(self.scaling)).astype(np.float32)
        return cos, sin


# ---- attention -----------------------------------------------------------------------------


KV_BLOCK = 16  # positions a KV block holds (the prefix cache shares whole blocks)


class KVExhausted(MemoryError):
    """The KV pool has no free block: every block of RAM it may use holds a running
    sequence's positions or a cached prefix."""


class KVPool:
    """Every sequence's KV state of one model, in blocks of KV_BLOCK positions: per name
    (keys, values, a latent, an indexer's keys), one array [blocks, layers, heads, KV_BLOCK,
    width], and views into them (MLA's values are the first columns of its latent). A
    sequence holds a table of its blocks in position order; a block is held by every
    sequence whose table has it and by the prefix cache (engine/prefix.py), so a shared
    prefix exists once and is never copied, and it returns to the free list when nobody
    holds it. The arrays lie in one reservation of address space the size of RAM
    (MAP_NORESERVE): a block's pages are committed when first written, and given back
    (madvise) when it is freed, where a block's part of an array is whole pages."""

    def __init__(self, shapes: dict[str, tuple[int, int, int]], views: dict[str, tuple[str, int]] | None = None,
                 reserve: int | None = None):
        # shapes: name -> (layers, heads, width); views: name -> (the array it looks into, its first columns)
        self.shapes = shapes
        self.part_bytes = {n: L * H * KV_BLOCK * d * 4 for n, (L, H, d) in shapes.items()}  # a block, per array
        self.block_bytes = sum(self.part_bytes.values())
        reserve = reserve or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self.n_blocks = max(8, reserve // self.block_bytes)
        while True:
            try:  # (strict overcommit counts the reservation: ask for less until it is granted)
                self.maps = {n: mmap.mmap(-1, self.n_blocks * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                          | 0x4000) for n, size in self.part_bytes.items()}  # 0x4000: MAP_NORESERVE
                break
            except OSError:
                if self.n_blocks <= 8:
                    raise
                self.n_blocks //= 2
        self.arrays = {n: np.frombuffer(self.maps[n], np.float32).reshape(self.n_blocks, L, H, KV_BLOCK, d)
                       for n, (L, H, d) in shapes.items()}
        for n, (base, cols) in (views or {}).items():
            self.arrays[n] = self.arrays[base][..., :cols]
        self.refs = np.zeros(self.n_blocks, np.int32)  # (calloc'd: its pages too are committed as used)
        self.free: list[int] = []  # blocks given back, reused first; then the untouched ones from `fresh` on
        self.fresh = 0
        self.page = mmap.PAGESIZE

    @property
    def used(self) -> int:
        return self.fresh - len(self.free)

    def alloc(self) -> int:
        if self.free:
            b = self.free.pop()
        elif self.fresh < self.n_blocks:
            b, self.fresh = self.fresh, self.fresh + 1
        else:
            raise KVExhausted(f"the KV cache is full: {self.n_blocks} blocks of {KV_BLOCK} positions in use")
        self.refs[b] = 1
        return b

    def hold(self, b: int) -> None:
        self.refs[b] += 1

    def drop(self, blocks) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
                for n, m in self.maps.items():
                    size = self.part_bytes[n]
                    if size % self.page == 0:  # its pages back to the system
                        m.madvise(mmap.MADV_DONTNEED, b * size, size)


class KVCache:
    """One sequence's KV state, up to n_ctx positions: a table of the pool's blocks in
    position order (the attention kernels read the blocks through it). Positions are only
    ever appended, so a block once full never changes: the prefix cache can share it."""

    def __init__(self, pool: KVPool, n_ctx: int, flat: frozenset = frozenset()):
        # flat: names whose saved form has no heads axis (take/put; DSA's indexer keys)
        self.pool, self.n_ctx, self.flat = pool, n_ctx, flat
        self.n_pos = 0  # positions filled
        self.table = np.zeros(-(-n_ctx // KV_BLOCK), np.int64)  # its blocks, in position order
        self.blocks: list[int] = []  # the same, as held (released when the cache goes)
        weakref.finalize(self, pool.drop, self.blocks)

    def cover(self, n: int) -> None:
        """Blocks for the first n positions."""
        while len(self.blocks) * KV_BLOCK < n:
            b = self.pool.alloc()
            self.table[len(self.blocks)] = b
            self.blocks.append(b)

    def adopt(self, blocks: list[int]) -> None:
        """Start from shared blocks (a cached prefix): its first len(blocks) * KV_BLOCK
        positions, held, not copied."""
        assert not self.blocks
        for b in blocks:
            self.pool.hold(b)
            self.table[len(self.blocks)] = b
            self.blocks.append(b)
        self.n_pos = len(blocks) * KV_BLOCK

    def write(self, name: str, il: int, pos0: int, x: np.ndarray) -> None:
        """x [n, heads, width] at positions pos0.. of layer il of array `name`."""
        self.cover(pos0 + len(x))
        arr = self.pool.arrays[name]
        for j0 in range(pos0 - pos0 % KV_BLOCK, pos0 + len(x), KV_BLOCK):
            lo, hi = max(pos0, j0), min(pos0 + len(x), j0 + KV_BLOCK)
            b = self.table[j0 // KV_BLOCK]
            if self.pool.refs[b] > 1:
                raise AssertionError("a shared KV block written to")  # (positions are appended: never)
            arr[b, il, :, lo - j0 : hi - j0] = x[lo - pos0 : hi - pos0].transpose(1, 0, 2)

    def gather(self, name: str, il: int, head: int, n: int) -> np.ndarray:
        """A copy of positions 0..n-1 of one head of layer il: [n, width] (for numpy code
        that wants them in one array)."""
        arr = self.pool.arrays[name]
        nb = -(-n // KV_BLOCK)
        return arr[self.table[:nb], il, head].reshape(nb * KV_BLOCK, -1)[:n]

    def take(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Copies of positions start..stop-1 of every array: [layers, heads, n, width] (the
        names in `flat`: [layers, n, width]) (a session's snapshot)."""
        out = {}
        for name, (L, H, d) in self.pool.shapes.items():
            arr = self.pool.arrays[name]
            b0, b1 = start // KV_BLOCK, -(-stop // KV_BLOCK)
            got = arr[self.table[b0:b1]].transpose(1, 2, 0, 3, 4).reshape(L, H, (b1 - b0) * KV_BLOCK, d)
            got = np.ascontiguousarray(got[:, :, start - b0 * KV_BLOCK : stop - b0 * KV_BLOCK])
            out[name] = got[:, 0] if name in self.flat else got
        return out

    def put(self, state: dict[str, np.ndarray], start: int) -> None:
        """Write `state` (take()'s arrays, of any number of positions) at positions from
        `start` on."""
        for name, x in state.items():
            x = x[:, None] if name in self.flat else x  # [L, H, n, d]
            for il in range(x.shape[0]):
                self.write(name, il, start, x[il].transpose(1, 0, 2))

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the filled positions of every array (a session keeps them)."""
        return self.take(0, self.n_pos)

    def restore(self, state: dict[str, np.ndarray], n_pos: int | None = None) -> None:
        """Fill the first n_pos positions (None: all of them) of this fresh cache from a
        snapshot of a cache of the same model. Raises ValueError when its arrays do not fit
        this cache or hold fewer positions."""
        shapes = self.pool.shapes
        if set(state) != set(shapes):
            raise ValueError(f"the saved cache holds {sorted(state)}, this model's holds {sorted(shapes)}")
        axis = {name: 1 if name in self.flat else 2 for name in shapes}
        n = {state[name].shape[axis[name]] if state[name].ndim > axis[name] else -1 for name in shapes}
        if len(n) != 1:
            raise ValueError("the saved cache's arrays hold different numbers of positions")
        saved = n.pop()
        n_pos = saved if n_pos is None else n_pos
        if n_pos > saved:
            raise ValueError(f"the saved cache holds {saved} positions, fewer than the {n_pos} its tokens need")
        if n_pos > self.n_ctx:
            raise ValueError("the saved cache's positions do not fit this cache")
        for name, (L, H, d) in shapes.items():
            want = (L, saved, d) if name in self.flat else (L, H, saved, d)
            if state[name].shape != want or state[name].dtype != np.float32:
                raise ValueError(f"the saved {name} is {state[name].dtype}{list(state[name].shape)}, this model's "
                                 f"float32{list(want)}")
        self.put({name: along(state[name], axis[name], 0, n_pos) for name in shapes}, 0)
        self.n_pos = n_pos


def along(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    # a view of a's positions start..stop-1 on `axis`
    cut = [slice(None)] * a.ndim
    cut[axis] = slice(start, stop)
    return a[tuple(cut)]


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

    @property
    def hv(self) -> int:
        return self.v_head_dim or self.head_dim


@dataclass
class Segment:
    """One sequence's rows in a batched forward step."""

    cache: KVCache
    start: int  # first row in the batch
    n: int  # rows (tokens) of this sequence in the step


@dataclass
class Step:
    """A forward step over several sequences: their tokens are the rows of one batch (so
    every matrix is read once per step, and a layer's experts are the union over all of
    them); attention is per sequence, against its own KV cache."""

    segments: list[Segment]
    cos: np.ndarray  # [T, hd/2] at each row's position
    sin: np.ndarray


def deinterleave(x: np.ndarray, half: int) -> np.ndarray:
    # x [T, H, hd]: the first 2 * half dims, rotary pairs (2i, 2i+1), reordered as the evens
    # then the odds, so that the rotate-half kernel turns them (transformers' interleaved RoPE)
    out = np.array(x)  # [T, H, hd]
    T, H = x.shape[:2]
    out[..., : 2 * half] = x[..., : 2 * half].reshape(T, H, half, 2).transpose(0, 1, 3, 2).reshape(T, H, 2 * half)
    return out


def attention(spec: AttnSpec, w: dict, x: np.ndarray, step: Step, il: int, window: int = 0):
    # x [T, D] (normed) -> [T, D]; w: a layer's weights by key (q, k, v, o; optional q_bias,
    # k_bias, v_bias, o_bias, q_norm, k_norm); writes each sequence's keys/values at its cache.n_pos
    T = x.shape[0]
    Hq, Hkv, hd, hv = spec.n_head, spec.n_kv_head, spec.head_dim, spec.hv
    q = linear(x, w["q"], w.get("q_bias"))  # [T, Hq*hd]
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
    return linear(out.reshape(T, Hq * hv), w["o"], w.get("o_bias"))


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


# ---- MoE -----------------------------------------------------------------------------------


def softmax(logits: np.ndarray) -> np.ndarray:
    # [T, E] f32, along the last axis
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z, dtype=np.float32)
    return e / e.sum(axis=-1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    # probs [T, E] -> ids [T, k] (descending, ties to the lower index), values [T, k]
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    return ids, np.take_along_axis(probs, ids, axis=-1)


def sigmoid_top_k(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int, renormalise: bool,
                  scaling: float) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] f32 -> ids [T, k], weights [T, k] (DeepSeek-V3's router, and the families
    # that took it): sigmoid scores; the choice adds the bias, keeps the topk_group groups with
    # the best two-expert sums, then the top k; the weights are the scores without the bias,
    # renormalised if asked, times the scaling
    T, E = logits.shape
    scores = (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)  # [T, E]
    choice = scores + bias  # [T, E]
    groups = choice.reshape(T, n_group, E // n_group)  # [T, G, E/G]
    group_scores = np.sort(groups, axis=-1)[..., -2:].sum(-1)  # [T, G]
    kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]  # [T, topk_group]
    mask = np.zeros((T, n_group), bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    choice = np.where(np.repeat(mask, E // n_group, axis=-1), choice, -np.inf)  # [T, E]
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]  # [T, A]
    w = np.take_along_axis(scores, ids, axis=-1)  # [T, A]
    if renormalise:
        w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    return ids, (w * np.float32(scaling)).astype(np.float32)


def softmax_top_k(logits: np.ndarray, k: int, renormalise: bool) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids [T, k], weights [T, k]: softmax over all experts, then the top k,
    # optionally renormalised to sum to 1
    ids, w = top_k(softmax(logits), k)
    if renormalise:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w


def compute_rows(parts, x, A, w_flat, prompt_rows, ys, g, ffn=None, clamped=None, team=None, tok_team=None,
                 session=None) -> None:
    # parts: [(rows, expert weights)], rows (t * A + a) of x [T, D] that chose the expert, each
    # row's output times its weight w_flat[row] into ys [T * A, D]. Each expert's rows by path:
    # a quantized expert's prompt rows (prompt_rows[t]: a sequence with several tokens in this
    # step) take the prompt path, its other rows the decode path; float experts have one path.
    # int4 decode rows: the crew's int4 job (`team`, group g); prompt rows and float experts:
    # its prompt-path job (`tok_team`, one per kind and shape); the rest one expert at a time,
    # side by side. A row's result does not depend on the others computed with it, so a
    # worker computing some of a step's experts (daemon/scaleout.py) gives the same rows.
    crew_ffn = ffn is None or clamped is not None  # the crew's jobs compute this expert
    any_prompt = bool(prompt_rows.any())
    q4, tok, rest = [], {}, []
    for r, ew in parts:  # per expert per layer step: a decode step's int4 experts ask no more than they must
        quant = isinstance(ew[0], QuantWeight)
        facts = int4_of(ew) if quant else None
        q4_ok = crew_ffn and team is not None and facts is not None and facts[0] == g
        p = prompt_rows[r // A] if quant and any_prompt else None  # a quantized expert's prompt rows
        kind = crew.tok_kind(*ew[:3]) if crew_ffn and (p is not None or not q4_ok) else None
        for sub, prompt in ((r, False),) if p is None else ((r[p], True), (r[~p], False)):
            if not len(sub):
                continue
            if (prompt or not quant) and kind is not None:
                tok.setdefault((kind, crew._signature(ew[0])), []).append((sub, ew))
            elif not prompt and q4_ok:
                q4.append((sub, ew))
            else:
                rest.append((sub, ew, prompt))

    def expert(part):  # rows of an expert the crew does not take, on their own
        r, ew, prompt = part
        if ffn is not None:
            ys[r] = ffn(x[r // A], ew) * w_flat[r][:, None]
        else:
            ys[r] = swiglu(x[r // A], *ew, prompt) * w_flat[r][:, None]

    def run(job, parts):  # one crew job over (rows, expert weights) parts of one kind and shape
        rows = np.concatenate([r for r, _ in parts])
        starts = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(r) for r, _ in parts], out=starts[1:])
        job(x, rows, starts, A, w_flat, [ew for _, ew in parts], ys, clamped)

    if q4:
        run(team.experts, q4)
    for parts_ in tok.values():
        run(tok_team.experts_tok, parts_)
    if not crew.threads_set() or len(rest) <= 1:
        for part in rest:
            expert(part)
    else:  # the kernels release the GIL: the experts run side by side, the crews parked meanwhile
        for c in (team, tok_team, session):  # (their helpers would spin on the CPUs the pool's threads need)
            if c is not None:
                c.close()
        crew.run_shared(rest, expert)


def worker_rows(batches, rows_of: dict, x, A, w_flat, prompt_rows, g, ffn=None, clamped=None) -> np.ndarray:
    # what moe() computes for some of a step's experts, on crews of its own (a worker that holds
    # them: daemon/scaleout.py): batches of [(expert, weights)] as a source streams them,
    # rows_of[expert] its rows (t * A + a) -> ys [T * A, D], zero outside those rows
    ys = np.zeros((len(w_flat), x.shape[1]), np.float32)
    team = crew.Crew(g, share=True) if g and not bool(np.all(prompt_rows)) else None
    tok_team = team if team is not None else crew.Crew(64, share=True)
    try:
        for batch in batches:
            compute_rows([(rows_of[ie], ew) for ie, ew in batch], x, A, w_flat, prompt_rows, ys, g, ffn, clamped,
                         team, tok_team, None)
    finally:
        for c in {id(c): c for c in (team, tok_team) if c is not None}.values():
            c.close()
    return ys


_OUTPUTS = threading.local()  # a thread's buffer for a layer's expert outputs
OUTPUTS_KEEP = 64 << 20  # bytes of it a thread keeps from one layer step to the next


def expert_outputs(n: int, D: int) -> np.ndarray:
    """[n, D] float32 for a layer step's expert outputs, every row of which the step writes
    before it is read: this thread's buffer, kept from step to step up to OUTPUTS_KEEP. A
    512-token step's 32 MiB is past what malloc keeps (reuse_freed_memory), and zeroed fresh
    pages for it each layer were 3 ms of the layer."""
    if n * D * 4 > OUTPUTS_KEEP:
        return kernels.empty_aligned((n, D))
    buf = getattr(_OUTPUTS, "buf", None)
    if buf is None or buf.size < n * D:
        buf = _OUTPUTS.buf = kernels.empty_aligned(n * D)
    return buf[: n * D].reshape(n, D)


def moe(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, experts: ExpertSource, il: int, step: Step | None = None,
        ffn=None, clamped: tuple | None = None) -> np.ndarray:
    # x [T, D] normed; ids, weights [T, A] from the family's route() -> [T, D]. ffn(x [n, D],
    # expert weights) -> [n, D]: a family's own expert (biases, another activation); None:
    # SwiGLU of (gate, up, down), which the crew's jobs also compute. clamped: (alpha, limit)
    # when ffn is gpt-oss's biased, clamped SwiGLU, which the crew computes too
    # (crew.ACT_CLAMPED). A layer step's experts are one or two crew jobs over (expert, row
    # block) units, no Python per expert: the int4 decode rows, and the prompt rows of every
    # kind with the rows of float experts; only what the jobs cannot take runs expert by expert
    t0 = time.perf_counter()
    T, A = ids.shape
    # rows of a prompt (a sequence with several tokens in this step) take the int4 kernels'
    # prompt-token path, the others the decode path: a row takes the same path alone or batched
    segments = step.segments if step is not None else [Segment(None, 0, T)]
    prompt_rows = np.zeros(T, bool)
    for sg in segments:
        prompt_rows[sg.start : sg.start + sg.n] = sg.n > 1
    all_prompt = all(sg.n > 1 for sg in segments)
    any_prompt = any(sg.n > 1 for sg in segments)
    g = experts.int4_group
    session = crew.session()  # the forward step's crew, else one for this call
    # int4 decode rows: a crew of their group size; the prompt-path job: any crew
    team = session if session is not None and session.g == g else crew.Crew(g, share=True) if g and not all_prompt else None
    tok_team = session if session is not None else team if team is not None else crew.Crew(64, share=True)

    x = np.ascontiguousarray(x, dtype=np.float32)
    ys = expert_outputs(T * A, x.shape[1])  # [T * A, D] each token's expert outputs, row t * A + a
    w_flat = np.ascontiguousarray(weights, dtype=np.float32).reshape(T * A)
    # the rows (t * A + a) that chose each expert, from one sort: a token picks an expert at most
    # once; union[k]'s rows are order[bounds[k]:bounds[k + 1]]
    flat = ids.reshape(T * A)
    order = np.argsort(flat, kind="stable")
    by_expert = flat[order]
    if T == 1:  # one token (a decode step): each of its experts once
        bounds = np.arange(A + 1)
    else:
        bounds = np.concatenate(([0], np.flatnonzero(by_expert[1:] != by_expert[:-1]) + 1, [T * A]))
    union = by_expert[bounds[:-1]].tolist()  # each expert of the step once

    if step is not None and len(step.segments) > 1:  # what the sequences would have asked for alone
        routed = sum(len(np.unique(ids[sg.start : sg.start + sg.n])) for sg in step.segments)
    else:
        routed = len(union)

    def compute(parts):  # [(rows, expert weights)] of this step into ys
        compute_rows(parts, x, A, w_flat, prompt_rows, ys, g, ffn, clamped, team, tok_team, session)

    hits = None
    if ffn is None and team is not None and not any_prompt:
        hits = experts.int4_hits(il, union)  # every expert resident: their addresses, no views
    rows_of = [(ie, order[bounds[k] : bounds[k + 1]]) for k, ie in enumerate(union)] if hits is None else []
    rows_by = dict(rows_of)
    try:
        if hits is not None:  # one decode job straight from the cache's slots (the rows in union order)
            g4, layouts, addrs = hits
            team.experts_at(x, order, bounds, A, w_flat, addrs, g4, layouts, ys)
        elif experts.compute_into(il, rows_of, x, w_flat, prompt_rows, A, ys, compute, ffn, clamped):
            pass  # a source that computed some experts elsewhere (ffn went along)
        else:
            for batch in experts.stream(il, union):  # in any order
                compute([(rows_by[ie], ew) for ie, ew in batch])
    finally:
        for c in {id(c): c for c in (team, tok_team) if c is not None and c is not session}.values():
            c.close()
    out = np.empty_like(x)
    # slot by slot, a fixed order: the same sum whatever order the experts came in
    (kernels.sum_slots_par if out.size >= kernels.ROWS_PAR_MIN else kernels.sum_slots)(ys, A, out)
    experts.layer_done(il, routed, time.perf_counter() - t0)
    return out
