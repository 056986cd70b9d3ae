"""int8, colibri's 8-bit quantization (lossy, on request): int8 values in [-127, 127], one
float16 scale per group of `group_size` columns; w ~ q * scale. Kernels: engine/formats/int8.py."""

import numpy as np

from .spec import Format, grouped, symmetric


def quantize(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    return symmetric(w, group_size, 127, -127)


def dequantize(q: np.ndarray, scales: np.ndarray, group_size: int, row_block: int = 1) -> np.ndarray:
    return grouped(q.astype(np.float32), scales, group_size)


FORMAT = Format("int8", 3, published=False, per_byte=1, code_dtype="I8", dequantize=dequantize, quantize=quantize)
