"""Weights in a number format as they sit in memory: a QuantWeight (codes, scales and what
they cover), an Expert (its matrices as the cache hands them out), and the format-generic
operations the converter, the tests and the benchmarks use (quantize, dequantize, the
shapes a record holds). What each format is lives in storage/formats/, one module each;
the engine computes on the codes as they are (engine/formats/), nothing here is on the
hot path.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .formats import FORMATS


@dataclass(frozen=True)
class QuantWeight:
    kind: str  # "int8", "int4", "fp8_e4m3", "fp8_e5m2", "mxfp4", or a GGUF block format ("q4_k", ...)
    q: np.ndarray  # int8 [N, D], uint8 [N, D/2] (int4, mxfp4), uint8 FP8 codes [N, D], GGUF blocks uint8 [N, row bytes]
    # float16 [N, D/g] (int8, int4), float32 [ceil(N/row_block), ceil(D/g)] (fp8), uint8 e8m0
    # [N, D/32] (mxfp4), uint8 [N, 0] (GGUF blocks: their scales are inside them)
    scales: np.ndarray
    group_size: int  # g: the columns one scale covers
    row_block: int = 1  # the rows one scale covers (fp8's block height)
    integer: bool = False  # a dense int8 / int4 matrix on int8 activations (engine: MoEModel.set_activations)

    @property
    def shape(self) -> tuple[int, int]:
        n, d = self.q.shape
        return n, FORMATS[self.kind].columns(d)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    @cached_property
    def layout(self) -> tuple:
        # what a kernel that takes weights by address must know of them (kept, as `addresses`)
        return self.kind, self.group_size, self.q.shape, self.scales.shape

    @cached_property
    def addresses(self) -> tuple[int, int]:
        # where q and scales start in memory, for kernels that take a batch of experts by
        # address (the crew's expert jobs, engine/crew.py); kept, since the cache hands out the same views per slot
        return self.q.__array_interface__["data"][0], self.scales.__array_interface__["data"][0]

    def __getstate__(self):  # pickled: the arrays, never the kept addresses (they mean nothing in another process)
        return {k: v for k, v in self.__dict__.items() if k != "addresses"}


class Expert(tuple):
    """An expert's (gate, up, down), then its biases if it has any, as the cache hands them out:
    the same object for as long as the expert stays in its slot, so what the int4 decode job
    needs of it is worked out once, not at every layer step (in a warm decode that Python ran
    from memory the expert's weights had just pushed out of the caches, ~10 us per expert)."""

    @cached_property
    def int4(self) -> tuple | None:
        """(group size, the three matrices' layouts, their six addresses as int64 bytes: gate q,
        scales, up q, scales, down q, scales) when gate, up and down are int4 of one group size; else None."""
        return int4_facts(self)

    def __reduce__(self):  # the matrices, never the kept addresses: they mean nothing in another process
        return Expert, (tuple(self),)


def int4_facts(ew: tuple) -> tuple | None:
    """Expert.int4 of any (gate, up, down, ...) tuple."""
    gate, up, down = ew[:3]
    if not (isinstance(gate, QuantWeight) and isinstance(up, QuantWeight) and isinstance(down, QuantWeight)
            and gate.kind == up.kind == down.kind == "int4" and gate.group_size == up.group_size == down.group_size):
        return None
    layouts = (gate.layout, up.layout, down.layout)
    layouts = _LAYOUTS.setdefault(layouts, layouts)  # one object per distinct layout: `is` compares them
    return gate.group_size, layouts, np.array(gate.addresses + up.addresses + down.addresses, np.int64).tobytes()


_LAYOUTS: dict = {}  # int4_facts' layouts, each once


def int4_of(ew: tuple) -> tuple | None:
    """Expert.int4, kept when ew is an Expert, else worked out now."""
    return ew.int4 if isinstance(ew, Expert) else int4_facts(ew)


def quantized_shapes(kind: str, shape: tuple[int, int], group_size: int) -> tuple[tuple, tuple]:
    """Shapes of (values, scales) for a [N, D] matrix in one of colibri's own formats."""
    return FORMATS[kind].shapes(shape, group_size)


def check_group(kind: str, shape: tuple[int, int], group_size: int) -> str | None:
    """Why a matrix cannot be quantized with this group size, or None if it can."""
    d = shape[1]
    if group_size <= 0 or d % group_size:
        return f"group size {group_size} does not divide the row length {d}"
    groups = FORMATS[kind].groups
    if groups and group_size not in groups:
        return f"{kind} group size must be one of {', '.join(map(str, groups))}, not {group_size}"
    return None


def quantize(w: np.ndarray, kind: str, group_size: int) -> QuantWeight:
    """Quantize a float32 [N, D] matrix into one of colibri's own formats (D divisible by
    group_size; see check_group)."""
    q, scales = FORMATS[kind].quantize(w, group_size)
    return QuantWeight(kind, q, scales, group_size)


def dequantize(w: QuantWeight) -> np.ndarray:
    """The float32 matrix a quantized weight stands for (a reference, not for the hot path;
    exact for the published formats: a code's value times its scale, rounded once)."""
    return FORMATS[w.kind].dequantize(w.q, w.scales, w.group_size, w.row_block)


def take_rows(w: QuantWeight, ids: np.ndarray) -> np.ndarray:
    """float32 [len(ids), D]: rows `ids` of a quantized matrix, exactly as dequantize gives
    them (an embedding table in a GGUF block format: a step's rows, never the whole table)."""
    ids = np.asarray(ids, dtype=np.int64)
    return dequantize(QuantWeight(w.kind, w.q[ids], w.scales[ids // w.row_block], w.group_size, 1))


def from_record(kind: str, q: np.ndarray, scales: np.ndarray, block: tuple | None = None) -> QuantWeight:
    """The QuantWeight over a record's codes and scales. Own formats: the group size follows
    from the shapes; published ones: `block` (rows, columns) a scale covers, None for one
    scale per matrix."""
    fmt = FORMATS[kind]
    if fmt.published:
        rows, cols = block or (q.shape[0], fmt.block[0] if fmt.block else fmt.columns(q.shape[1]))
        return QuantWeight(kind, q, scales, cols, rows)
    return QuantWeight(kind, q, scales, q.shape[1] * fmt.per_byte // scales.shape[1])

