"""Blocks every family shares, and the kernels' start-up: linear (float and quantized),
RMSNorm, SwiGLU; malloc's settings for a step's temporaries; init() compiles every kernel.
RoPE, attention, the sequence cache and the MoE dispatch have modules of their own
(rope.py, attention.py, sequence.py, moe.py). Numpy glue around the numba kernels;
activations f32.
"""

import ctypes
import functools
import os

import numpy as np

from ..storage.experts import QuantWeight, bf16_to_f32, dequantize, int4_of, take_rows
from . import crew, kernels
from .formats import KERNELS, ggml, int4, intdot
from .jit import FAMILY_WARMS, Ticker, watch_compiles
from .kernels import NO_SINKS, f16_lut
from .sequence import KV_BLOCK, KVPool

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


def init(n_threads: int | None = None, progress=None, kinds=None) -> None:
    """Start-up work for the kernels: the f16 table, the compute threads (default: the CPUs
    this process may run on), and one call of each kernel on tiny arrays so that compiling
    (or loading the compiled cache) happens here, not in the first request's timings.
    kinds: the number formats to compile for, {(kind, int4 group size or None)} (a model's
    own: MoEModel.kernel_kinds()); None: every format (the compile-ahead of `colibrid
    --compile`, a benchmark trying several). Each format's kernels are tens of MB of a
    process's memory once loaded (an int4 group's 14 MB, the others' 9 MB on Zen 5), so a
    process loads only those it computes with. `progress(phase, done, total)` hears each
    kernel group. Call before forward; again with other kinds compiles what is missing."""
    watch_compiles(False)  # (what init compiles is not at first use)
    if n_threads is not None or not crew.threads_set():
        crew.set_threads(n_threads or len(os.sched_getaffinity(0)))
    if kinds is None:
        kinds = {*((k, None) for k in [*KERNELS, *PLAIN] if k != "int4"), *(("int4", g) for g in int4.GROUPS),
                 (INT8_ACTIVATIONS, None)}
    reuse_freed_memory()
    x = np.ones((1, 4), np.float32)
    x64 = np.ones((1, 128), np.float32)
    q, kv = np.ones((1, 1, 4), np.float32), np.ones((1, 1, 1, 4), np.float32)

    def dense():
        for u16 in (np.ones((2, 4), np.uint16), np.ones((2, 4), np.float16)):
            kernels.matmul_u16_par(x, u16.view(np.uint16), u16.dtype == np.uint16, f16_lut(), np.empty((1, 2), np.float32))
        kernels.matmul_f32_par(x, np.ones((2, 4), np.float32), np.empty((1, 2), np.float32))
        for w in (np.ones((2, 4), np.float32), np.ones((2, 4), np.uint16), np.ones((2, 4), np.float16)):
            linear(x, w)

    def experts(w):  # the crew's kernel (one function for every kind of job) and its job for w's format
        swiglu(x64, w, w, w)
        swiglu(x64, w, w, w, prompt=True)

    def int4_group(g):  # an int4 group size's crew job and its dense prompt path
        experts(QuantWeight("int4", np.ones((128, 64), np.uint8), np.ones((128, 128 // g), np.float16), g))
        int4.warm(g)

    def formats(names):  # the decode and prompt paths of the other number formats
        for module in dict.fromkeys(KERNELS[k] for k in names):
            module.warm(tuple(k for k in names if k in module.KINDS))

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

    def paths(kind, g):  # a format's whole step paths (engine/warm.py): experts, dense, int8 activations
        from . import warm

        if kind == INT8_ACTIVATIONS:  # the integer path of the model's int8 / int4 weights
            for k, kg in sorted({(k, kg) for k, kg in kinds if k in ("int8", "int4")}, key=str):
                warm.experts(k, kg, "int8")
                warm.dense_integer(k, kg)
            return
        if kind.startswith(FAMILY):
            FAMILY_WARMS[kind.removeprefix(FAMILY)]()
        elif kind in PLAIN or kind in KERNELS:
            warm.experts(kind, g)
            warm.dense(kind, g)

    others = tuple(sorted(k for k, _ in kinds if k in KERNELS and k != "int4"))
    steps = [("dense", dense), ("experts", functools.partial(experts, np.ones((128, 128), np.uint16))),
             *((("int4", g), functools.partial(int4_group, g)) for g in sorted({g for k, g in kinds if k == "int4"})),
             *((("formats", others), functools.partial(formats, others)) for _ in others[:1]), ("attention", attention),
             *((("paths", kind, g), functools.partial(paths, kind, g))
               for kind, g in sorted({*kinds, ("bf16", None), ("f32", None)}, key=str))]
    steps = [(key, step) for key, step in steps if key not in init.done]
    shares = [COMPILE_SHARES[key if isinstance(key, str) else key[0]] for key, _ in steps]
    if progress:
        progress = Ticker(progress, shares)
    try:
        for i, (key, step) in enumerate(steps):
            if progress:
                progress.enter(i)
            step()
            init.done.add(key)
    finally:
        if progress:
            progress.stop()
    watch_compiles()  # from here on, a kernel compiled at first use is said on stderr and timed apart


init.done = set()  # the kernel groups compiled (or loaded) in this process
# each kernel group's seconds in a first compile on the 2-core box (measured: dense 23, the
# crew's experts 0.2, an int4 group 16-26, the other formats 54, attention 133, a format's
# paths 0-5), for the progress's estimate (jit.Ticker)
COMPILE_SHARES = {"dense": 23.0, "experts": 1.0, "int4": 20.0, "formats": 50.0, "attention": 130.0, "paths": 0.6}
PLAIN = ("bf16", "f16", "f32")  # float weights' kinds, as a model's kernel_kinds() names them
INT8_ACTIVATIONS = "int8-activations"  # a kernel kind: the integer path of the int8 and int4 kinds asked (lossy)
FAMILY = "family:"  # a kernel kind "family:NAME": a family's own kernels, warmed by jit.FAMILY_WARMS[NAME]


def to_f32(a) -> np.ndarray:
    """Widen a storage-precision array (f32, f16, bf16 as uint16) to float32, exactly; a
    published FP8 or MXFP4 weight to the float32 values it stands for (exact too)."""
    if isinstance(a, QuantWeight):
        return dequantize(a)
    return bf16_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def embed_rows(table, ids: np.ndarray) -> np.ndarray:
    """ids [T] -> rows of an embedding table [V, D] in float32: a storage-precision array's
    widened, a quantized table's (a GGUF file's Q4_K ...) dequantized, only those rows."""
    if isinstance(table, QuantWeight):
        return take_rows(table, ids)
    return to_f32(table[ids])


def qlinear(x: np.ndarray, w: QuantWeight, prompt: bool = False) -> np.ndarray:
    # x [T, D] f32 C-contiguous, w a QuantWeight [N, D] -> [T, N] f32. prompt: the rows are a
    # prompt's, taken by the prompt-token kernel where the format has one (each row's result
    # the same alone or batched on either path; the two differ in rounding only)
    y = np.empty((x.shape[0], w.q.shape[0]), np.float32)
    KERNELS[w.kind].linear(x, w, y, prompt)
    return y


def linear(x: np.ndarray, w, bias: np.ndarray | None = None) -> np.ndarray:
    # x [T, D] f32, w [N, D] in storage precision or a QuantWeight -> [T, N] f32
    x = np.ascontiguousarray(x, dtype=np.float32)
    if isinstance(w, QuantWeight) and getattr(w, "integer", False):  # a dense int8/int4 matrix on int8 activations
        y = kernels.empty_aligned((x.shape[0], w.q.shape[0]))  # (MoEModel.set_activations marks it)
        if w.q.size >= crew.CREW_MIN_ELEMENTS and crew.session() is not None:
            crew.session().matmul_i8(x, w, y)
        else:
            intdot.linear(x, w, y)
    elif isinstance(w, QuantWeight) and w.kind in ggml.KINDS:  # each row by its sequence (ggml.linear)
        y = qlinear(x, w, crew.prompt_rows(x.shape[0]))
    elif isinstance(w, QuantWeight):
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
    quant = [isinstance(w, QuantWeight) for w in (gate, up, down)]
    if all(quant) and all(w.kind in ggml.KINDS for w in (gate, up, down)):  # a GGUF file's: the path asked
        return ggml.swiglu(np.ascontiguousarray(x, dtype=np.float32), gate, up, down, prompt)
    if prompt and all(quant) and gate.kind not in ggml.KINDS:  # the prompt-token kernels (int4, fp8, mxfp4)
        x = np.ascontiguousarray(x, dtype=np.float32)
        h, u = qlinear(x, gate, True), qlinear(x, up, True)
        kernels.silu_mul(h, u, h)
        return qlinear(h, down, True)
    g = linear(x, gate)  # [T, I]
    u = linear(x, up)  # [T, I]
    kernels.silu_mul(g, u, g)
    return linear(g, down)
