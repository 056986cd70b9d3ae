"""MXFP4 (gpt-oss), a published format kept exactly as the checkpoint stores it: two e2m1
codes a byte (the even column in the low nibble), one e8m0 scale (a power of two, stored as
its biased exponent) per GROUP weights of a row; w = value(code) * scale, exactly.
Kernels: engine/formats/mxfp4.py."""

import numpy as np

from .spec import Format

GROUP = 32  # weights per e8m0 scale
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
with np.errstate(over="ignore"):
    E8M0_VALUES = np.ldexp(1.0, np.arange(256) - 127).astype(np.float32)  # 2 ** (e - 127); 255: inf, as torch.ldexp


def dequantize(q: np.ndarray, scales: np.ndarray, group_size: int = GROUP, row_block: int = 1) -> np.ndarray:
    n, half = q.shape
    vals = np.empty((n, half * 2), np.float32)
    vals[:, 0::2], vals[:, 1::2] = E2M1_VALUES[q & 15], E2M1_VALUES[q >> 4]
    return vals * np.repeat(E8M0_VALUES[scales], GROUP, axis=1)


FORMAT = Format("mxfp4", 7, published=True, per_byte=2, code_dtype="U8", dequantize=dequantize,
                values=E2M1_VALUES, scale_values=E8M0_VALUES)
