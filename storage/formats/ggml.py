"""The block formats of GGUF files (llama.cpp's ggml types), kept exactly as the file stores
them: a row of a matrix is a run of self-contained blocks, each with its scales inside it
(Q8_0: a float16 scale then 32 int8 codes, 34 bytes; Q4_K: a float16 scale and minimum,
twelve bytes of 6-bit sub-block scales and minimums, then 256 4-bit codes, 144 bytes; ...).
A QuantWeight of one of these kinds holds the blocks as `q` (uint8 [N, blocks a row x
block bytes]) and no separate scales (`scales` uint8 [N, 0]); its group size is the block's
weights (32 or 256).

The reference dequantisation is the `gguf` package's own (llama.cpp's Python library,
numpy): the float32 value of each weight, which the kernels (engine/formats/ggml.py)
reproduce bit for bit, and what colibri computes with: activations stay float32 (llama.cpp
quantises them to 8 bits for its integer dot products, so its tokens may differ).
"""

import numpy as np

from .spec import Format

# name -> (ggml type id, weights a block, bytes a block); the ids are the GGUF file's
# tensor types (gguf.GGMLQuantizationType), the sizes ggml's (gguf.GGML_QUANT_SIZES)
TYPES = {
    "q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24), "q8_0": (8, 32, 34),
    "q2_k": (10, 256, 84), "q3_k": (11, 256, 110), "q4_k": (12, 256, 144), "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210), "iq4_nl": (20, 32, 18), "iq4_xs": (23, 256, 136), "gguf_mxfp4": (39, 32, 17),
}
CODE_BASE = 32  # a block format's code is CODE_BASE + its ggml type id (engine/jobs.py widens by it)
BY_TYPE_NAME = {("MXFP4" if n == "gguf_mxfp4" else n.upper()): n for n in TYPES}  # GGUF type name -> kind

# the 4-bit codes' values of MXFP4 (e2m1, doubled: the block's scale is halved to match) and
# of IQ4_NL / IQ4_XS (a non-uniform table), as ggml defines them
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def e8m0_half() -> np.ndarray:
    """[256] float32: half the power of two each e8m0 scale byte stands for (ggml's
    e8m0_to_fp32_half: 2 ** (e - 128), the two smallest as subnormals)."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def dequantize(kind: str, q: np.ndarray, scales: np.ndarray = None, group_size: int = 0, row_block: int = 1) -> np.ndarray:
    """The blocks q uint8 [N, row bytes] -> float32 [N, D], by the `gguf` package."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(np.ascontiguousarray(q), GGMLQuantizationType(TYPES[kind][0])).astype(np.float32)


def _format(name: str) -> Format:
    type_id, weights, nbytes = TYPES[name]
    return Format(name, CODE_BASE + type_id, published=True, per_byte=0, code_dtype="U8",
                  dequantize=lambda q, scales=None, g=0, rb=1: dequantize(name, q), block=(weights, nbytes))


FORMATS = tuple(_format(n) for n in TYPES)
