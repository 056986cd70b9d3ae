"""int4, colibri's 4-bit quantization (lossy, on request): values in [-8, 7] stored + 8 as
unsigned nibbles, two a byte (the even column in the low nibble), one float16 scale per
group of `group_size` columns; w ~ (nibble - 8) * scale. Kernels: engine/formats/int4.py,
built per group size (GROUPS)."""

import numpy as np

from .spec import Format, grouped, symmetric

GROUPS = (32, 64, 128)  # the group sizes the int4 kernels are built for


def quantize(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    q, scales = symmetric(w, group_size, 7, -8)
    u = (q + 8).astype(np.uint8)
    return np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4)), scales  # [N, D/2]


def unpack(q: np.ndarray) -> np.ndarray:
    """q uint8 [N, D/2] -> the values [N, D] as float32, in [-8, 7]."""
    n, half = q.shape
    vals = np.empty((n, half * 2), np.float32)
    vals[:, 0::2] = (q & 15).astype(np.float32) - 8
    vals[:, 1::2] = (q >> 4).astype(np.float32) - 8
    return vals


def dequantize(q: np.ndarray, scales: np.ndarray, group_size: int, row_block: int = 1) -> np.ndarray:
    return grouped(unpack(q), scales, group_size)


FORMAT = Format("int4", 4, published=False, per_byte=2, code_dtype="U8", dequantize=dequantize, quantize=quantize,
                groups=GROUPS, default_group=64)
