"""The paths a forward step takes, run once on tiny inputs before a model serves, so that
numba compiles (or loads from its cache) every kernel signature they call then and not in a
request's first step: engine/layers.init runs them for a model's number formats.

A kernel's compiled code is per signature (the types of its arguments), and which kernels a
step calls depends on sizes (a crew job from CREW_MIN_ELEMENTS, the parallel kernels from
PARALLEL_MIN_ELEMENTS), on whether the rows are a prompt's or a decode step's, on the number
format and on the activations. So the warm-up calls the code a step calls: `moe.moe` with
experts of a format served as the expert cache serves them (int4 decode steps by address,
int8 activations on arranged tiles), `linear` on dense matrices of each size class, inside
a step's crew as `MoEModel.forward_batch` opens it, for a decode step, a prompt and a batch
of both. What a new kernel adds to those paths is compiled here without a list to keep up;
what this module does not reach (a family's own kernels) each family module registers with
jit.family_warm and names in its model's KERNEL_GROUPS; tests/engine/test_warm.py fails
when a kernel has no compiled signature after init, or when a first step compiles one.
"""

import numpy as np

from ..storage.experts import FORMATS, Expert, LocalSource, QuantWeight
from . import crew
from .moe import moe
from .sequence import Segment, Step

N = 256  # rows and columns of a warm-up matrix: whole blocks of every format (K-quants: 256)
def weight(kind: str, group: int | None, rows: int = N, cols: int = N):
    """A [rows, cols] matrix of `kind` (bf16/f16/f32 or a QuantWeight's), zeros and ones: its
    values do not matter, its types and layout do."""
    if kind in ("bf16", "f16", "f32"):
        return np.zeros((rows, cols), {"bf16": np.uint16, "f16": np.float16, "f32": np.float32}[kind])
    f = FORMATS[kind]
    if kind in ("int8", "int4"):
        return QuantWeight(kind, *f.quantize(np.ones((rows, cols), np.float32), group or cols), group or cols)
    q_shape, _ = f.shapes((rows, cols), f.block[0] if f.block else 32)
    q = np.zeros(q_shape, np.uint8)
    if f.block:  # GGUF: the scales are inside the blocks
        return QuantWeight(kind, q, np.zeros((rows, 0), np.uint8), f.block[0])
    if kind == "mxfp4":
        return QuantWeight(kind, q, np.full((rows, cols // 32), 127, np.uint8), 32)
    return QuantWeight(kind, q, np.ones((-(-rows // 128), -(-cols // 128)), np.float32), 128, 128)  # FP8 blocks


class WarmExperts(LocalSource):
    """Two experts of one format, resident, served as the expert cache serves them."""

    lookahead = False

    def __init__(self, kind: str, group: int | None, activations: str):
        self.experts = [Expert((weight(kind, group), weight(kind, group), weight(kind, group))) for _ in range(2)]
        if activations == "int8":
            from .formats import intdot

            for ew in self.experts:
                intdot.arrange_expert(ew, True)
        self.int4_group = group if kind == "int4" else None
        self.activations = activations

    def begin_step(self) -> None:
        pass

    def stream(self, il, ids):
        yield [(ie, self.experts[ie]) for ie in ids]

    def prefetch(self, il, ids, tokens: int = 1) -> int:
        return 0

    def layer_done(self, il, routed, moe_s) -> None:
        pass

    def int4_hits(self, il, ids):
        facts = [ew.int4 for ew in (self.experts[ie] for ie in ids)]
        if self.int4_group is None or any(f is None for f in facts):
            return None
        g, layouts, _ = facts[0]
        return g, layouts, np.stack([np.frombuffer(f[2], np.int64) for f in facts])


def steps(sizes: list[int]):
    """(x [T, N], ids [T, 2], weights [T, 2], Step) of one forward step whose sequences have
    `sizes` rows each: a decode step ([1]), a prompt ([3]), a batch of both ([3, 1])."""
    T = sum(sizes)
    segments, start = [], 0
    for n in sizes:
        segments.append(Segment(None, start, n))
        start += n
    rot = np.ones((T, 1), np.float32)
    return (np.ones((T, N), np.float32), np.tile(np.array([[0, 1]]), (T, 1)), np.full((T, 2), 0.5, np.float32),
            Step(segments, rot, rot), np.repeat(np.asarray(sizes) > 1, sizes))


STEPS = ([1], [3], [3, 1], [1, 1])


def experts(kind: str, group: int | None, activations: str = "float32") -> None:
    """The routed experts' paths for experts of `kind`: every step shape, in a step's crew."""
    src = WarmExperts(kind, group, activations)
    for sizes in STEPS:
        x, ids, w, step, rows = steps(sizes)
        with crew.crew_session(src.int4_group, rows):
            moe(x, ids, w, src, 0, step)


def dense(kind: str, group: int | None) -> None:
    """The dense matrices' paths (linear) for matrices of `kind`: below and above the crew's
    size, in a step's crew and outside one (a family's prologue), every step shape."""
    from .layers import linear

    for rows in (8, crew.CREW_MIN_ELEMENTS // N):
        w = weight(kind, group, rows)
        for sizes in STEPS:
            x, _, _, _, prompt_rows = steps(sizes)
            linear(x, w)
            with crew.crew_session(group if kind == "int4" else None, prompt_rows):
                linear(x, w)


def dense_integer(kind: str, group: int | None) -> None:
    """A dense int8 / int4 matrix on int8 activations (convert --dense-dtype with
    --activations int8): its arranged tiles, both sizes, in a crew and outside."""
    from .formats import intdot
    from .layers import linear

    for rows in (16, crew.CREW_MIN_ELEMENTS // N):
        w = intdot.arranged(weight(kind, group, rows), True)
        for sizes in STEPS:
            x, _, _, _, prompt_rows = steps(sizes)
            linear(x, w)
            with crew.crew_session(None, prompt_rows):
                linear(x, w)
