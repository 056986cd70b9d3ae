"""Quantized weights: what a quantized matrix is in memory, and how the converter makes
one. colibri's own quantizations are symmetric, one float16 scale per group of
`group_size` values along a row (the input dimension):

- int8: int8 values in [-127, 127], w ~ q * scale;
- int4: values in [-8, 7] stored +8 as unsigned nibbles, two per byte (the even
  column in the low nibble), w ~ (nibble - 8) * scale.

The published formats are kept exactly as the checkpoint has them (storage/fpformats.py
reads them): w = value(code) * scale, exactly, with

- fp8_e4m3, fp8_e5m2: one byte a weight, one float32 scale per `row_block` x
  `group_size` block (the last blocks may be partial);
- mxfp4: two e2m1 codes a byte (the even column in the low nibble), one e8m0 scale
  (a power of two, stored as its biased exponent) per 32 weights of a row.

The engine computes on these directly (engine/qkernels.py, engine/fpkernels.py);
nothing here dequantizes a whole matrix except `dequantize`, the reference the tests
and benchmarks use (and the converter, when asked for another precision).
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

QUANT_DTYPES = ("int8", "int4")  # colibri's own quantizations (lossy, on request)
PUBLISHED_DTYPES = ("fp8_e4m3", "fp8_e5m2", "mxfp4")  # a checkpoint's own formats, kept as they are
FP8_KINDS = ("fp8_e4m3", "fp8_e5m2")
MX_GROUP = 32  # MXFP4: weights per e8m0 scale
# FP8 scales colibri computes with: below 2 ** (128 - the format's float32 rebias), so the
# decode kernel's scale times up to 2 ** rebias is a finite float32, exact (engine/fpkernels.py
# f8_prescale); real ones are ~1e-4
FP8_SCALE_LIMIT = {"fp8_e4m3": 2.0 ** 8, "fp8_e5m2": 2.0 ** 16}


def _fp8_values(kind: str) -> np.ndarray:
    # [256] float32: the value of each code, as torch's float8 types decode it
    b = np.arange(256)
    mb, bias = (3, 7) if kind == "fp8_e4m3" else (2, 15)
    e, m = (b & 0x7F) >> mb, b & ((1 << mb) - 1)
    v = np.where(e == 0, m * 2.0 ** (1 - bias - mb), (1 + m / (1 << mb)) * 2.0 ** (e.astype(np.float64) - bias))
    if kind == "fp8_e4m3":  # "fn": no infinity, all ones is NaN
        v[(b & 0x7F) == 0x7F] = np.nan
    else:
        v[e == 31] = np.where(m[e == 31] == 0, np.inf, np.nan)
    return np.where(b & 0x80, -v, v).astype(np.float32)


FP8_VALUES = {kind: _fp8_values(kind) for kind in FP8_KINDS}  # kind -> [256] f32
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
with np.errstate(over="ignore"):
    E8M0_VALUES = np.ldexp(1.0, np.arange(256) - 127).astype(np.float32)  # 2 ** (e - 127); 255: inf, as torch.ldexp
INT4_GROUPS = (32, 64, 128)  # the group sizes the int4 kernels are built for
QMAX = {"int8": 127, "int4": 7}


@dataclass(frozen=True)
class QuantWeight:
    kind: str  # "int8", "int4", "fp8_e4m3", "fp8_e5m2" or "mxfp4"
    q: np.ndarray  # int8 [N, D], uint8 [N, D/2] (int4, mxfp4) or uint8 FP8 codes [N, D]
    scales: np.ndarray  # float16 [N, D/g] (int8, int4), float32 [ceil(N/row_block), ceil(D/g)] (fp8), uint8 e8m0 [N, D/32] (mxfp4)
    group_size: int  # g: the columns one scale covers
    row_block: int = 1  # the rows one scale covers (fp8's block height)

    @property
    def shape(self) -> tuple[int, int]:
        n, d = self.q.shape
        return (n, d * 2) if self.kind in ("int4", "mxfp4") else (n, d)

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
    """Shapes of (values, scales) for a [N, D] matrix."""
    n, d = shape
    return ((n, d // 2) if kind == "int4" else (n, d)), (n, d // group_size)


def check_group(kind: str, shape: tuple[int, int], group_size: int) -> str | None:
    """Why a matrix cannot be quantized with this group size, or None if it can."""
    d = shape[1]
    if group_size <= 0 or d % group_size:
        return f"group size {group_size} does not divide the row length {d}"
    if kind == "int4" and group_size not in INT4_GROUPS:
        return f"int4 group size must be one of {', '.join(map(str, INT4_GROUPS))}, not {group_size}"
    return None


def quantize(w: np.ndarray, kind: str, group_size: int) -> QuantWeight:
    """Quantize a float32 [N, D] matrix (D divisible by group_size; see check_group)."""
    n, d = w.shape
    g = w.astype(np.float32).reshape(n, d // group_size, group_size)  # [N, G, g]
    amax = np.abs(g).max(axis=-1)  # [N, G]
    scales = (amax / QMAX[kind]).astype(np.float16)
    s = scales.astype(np.float32)
    s[s == 0] = 1.0  # an all-zero group: any scale gives q = 0
    lo = -8 if kind == "int4" else -127
    q = np.clip(np.rint(g / s[..., None]), lo, QMAX[kind]).astype(np.int8).reshape(n, d)
    if kind == "int4":
        u = (q + 8).astype(np.uint8)
        q = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)  # [N, D/2]
    return QuantWeight(kind, np.ascontiguousarray(q), scales, group_size)


def dequantize(w: QuantWeight) -> np.ndarray:
    """The float32 matrix a quantized weight stands for (a reference, not for the hot path;
    exact for the published formats: a code's value times its scale, rounded once)."""
    if w.kind in PUBLISHED_DTYPES:
        return _dequantize_published(w)
    if w.kind == "int4":
        n, half = w.q.shape
        vals = np.empty((n, half * 2), np.float32)
        vals[:, 0::2] = (w.q & 15).astype(np.float32) - 8
        vals[:, 1::2] = (w.q >> 4).astype(np.float32) - 8
    else:
        vals = w.q.astype(np.float32)
    n, d = vals.shape
    s = w.scales.astype(np.float32)
    return (vals.reshape(n, d // w.group_size, w.group_size) * s[..., None]).reshape(n, d)


def _dequantize_published(w: QuantWeight) -> np.ndarray:
    """The float32 matrix an FP8 or MXFP4 weight stands for, exactly as transformers
    dequantizes it (value times scale, one rounding)."""
    if w.kind == "mxfp4":
        n, half = w.q.shape
        vals = np.empty((n, half * 2), np.float32)
        vals[:, 0::2], vals[:, 1::2] = E2M1_VALUES[w.q & 15], E2M1_VALUES[w.q >> 4]
        return vals * np.repeat(E8M0_VALUES[w.scales], MX_GROUP, axis=1)
    n, k = w.q.shape
    s = np.repeat(np.repeat(w.scales, w.row_block, axis=0), w.group_size, axis=1)[:n, :k]
    return FP8_VALUES[w.kind][w.q] * s
