"""FP8 (e4m3 and e5m2), a published format kept exactly as the checkpoint stores it (DeepSeek's
`weight_scale_inv`, storage/fpformats.py reads it): one byte a weight, one float32 scale per
`row_block` x `group_size` block (the last blocks of a row or column may be partial);
w = value(code) * scale, exactly. Kernels: engine/formats/fp8.py."""

import functools

import numpy as np

from .spec import Format

# the scales colibri computes with: below 2 ** (128 - the format's float32 rebias), so the
# decode kernel's scale times up to 2 ** rebias is a finite float32, exact (engine/formats/
# fp8.py prescale); real ones are ~1e-4
SCALE_LIMIT = {"fp8_e4m3": 2.0 ** 8, "fp8_e5m2": 2.0 ** 16}
BITS = {"fp8_e4m3": (3, 7), "fp8_e5m2": (2, 15)}  # kind -> (mantissa bits, exponent bias)


def code_values(kind: str) -> np.ndarray:
    """[256] float32: the value of each code, as torch's float8 types decode it."""
    b = np.arange(256)
    mb, bias = BITS[kind]
    e, m = (b & 0x7F) >> mb, b & ((1 << mb) - 1)
    v = np.where(e == 0, m * 2.0 ** (1 - bias - mb), (1 + m / (1 << mb)) * 2.0 ** (e.astype(np.float64) - bias))
    if kind == "fp8_e4m3":  # "fn": no infinity, all ones is NaN
        v[(b & 0x7F) == 0x7F] = np.nan
    else:
        v[e == 31] = np.where(m[e == 31] == 0, np.inf, np.nan)
    return np.where(b & 0x80, -v, v).astype(np.float32)


def dequantize(values: np.ndarray, q: np.ndarray, scales: np.ndarray, group_size: int, row_block: int) -> np.ndarray:
    n, k = q.shape
    s = np.repeat(np.repeat(scales, row_block, axis=0), group_size, axis=1)[:n, :k]
    return values[q] * s


def _format(name: str, code: int, code_dtype: str) -> Format:
    values = code_values(name)
    return Format(name, code, published=True, per_byte=1, code_dtype=code_dtype,
                  dequantize=functools.partial(dequantize, values), values=values)


E4M3, E5M2 = _format("fp8_e4m3", 5, "F8_E4M3"), _format("fp8_e5m2", 6, "F8_E5M2")
FORMATS = (E4M3, E5M2)
