"""What a number format declares, and the pieces colibri's own formats share.

A format is one module beside this one (int8.py, int4.py, fp8.py, mxfp4.py, ggml.py) that describes
itself as a `Format` and is registered once, in formats/__init__.py. Its `code` is the one
number by which the engine's kernels and the thread crew's job board know the weights they
read (engine/formats/, engine/crew.py); the plain float storage types have codes of their
own here.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BF16, F16, F32 = 0, 1, 2  # the codes of plain float weights (bf16 as uint16 bits, f16, f32)


@dataclass(frozen=True)
class Format:
    name: str  # a QuantWeight's kind and a container manifest's expert dtype
    code: int  # unique among FORMATS and the plain codes above
    published: bool  # a checkpoint's own format, kept exactly as stored; else colibri's (lossy, on request)
    per_byte: int  # weights one byte of codes holds
    code_dtype: str  # the codes' safetensors dtype in a container record
    # (q, scales, group_size, row_block) -> the float32 [N, D] matrix: the reference the tests,
    # the benchmarks and the converter use, never the hot path
    dequantize: Callable
    quantize: Callable | None = None  # (w f32 [N, D], group_size) -> (q, scales f16 [N, D/g]): colibri's own
    groups: tuple = ()  # group sizes its kernels are built for; () any that divides a row
    default_group: int | None = None  # own formats: convert's group size when none is asked (None: a row)
    values: np.ndarray | None = None  # the float32 value of each code, where a table gives it
    scale_values: np.ndarray | None = None  # the float32 value of each scale code (MXFP4's e8m0)
    # GGUF's block formats (ggml.py): (weights, bytes) of a block that holds its own scales;
    # the codes are whole blocks (per_byte 0) and there are no separate scales
    block: tuple[int, int] | None = None

    def shapes(self, shape: tuple[int, int], group_size: int) -> tuple[tuple, tuple]:
        """(codes, scales) shapes of an [N, D] matrix in this format."""
        n, d = shape
        if self.block:
            return (n, d // self.block[0] * self.block[1]), (n, 0)
        return (n, d // self.per_byte), (n, d // group_size)

    def columns(self, code_columns: int) -> int:
        """The columns D of a matrix whose rows hold `code_columns` bytes (or codes) of this format."""
        if self.block:
            return code_columns // self.block[1] * self.block[0]
        return code_columns * self.per_byte


def symmetric(w: np.ndarray, group_size: int, qmax: int, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [N, D] -> (q int8 [N, D] in [lo, qmax], scales f16 [N, D/g]): one float16 scale a
    group of `group_size` columns, |w| max / qmax, q the nearest integer to w / scale."""
    n, d = w.shape
    g = w.astype(np.float32).reshape(n, d // group_size, group_size)  # [N, G, g]
    scales = (np.abs(g).max(axis=-1) / qmax).astype(np.float16)  # [N, G]
    s = scales.astype(np.float32)
    s[s == 0] = 1.0  # an all-zero group: any scale gives q = 0
    return np.clip(np.rint(g / s[..., None]), lo, qmax).astype(np.int8).reshape(n, d), scales


def grouped(values: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """values f32 [N, D] times one scale per group of `group_size` columns (scales [N, D/g])."""
    n, d = values.shape
    s = scales.astype(np.float32)
    return (values.reshape(n, d // group_size, group_size) * s[..., None]).reshape(n, d)
