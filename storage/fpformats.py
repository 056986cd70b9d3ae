"""The published low-precision formats a checkpoint may hold, read as they are:

- FP8 block-scaled (DeepSeek-V3/R1, Kimi K2, GLM-4.5+, MiniMax-M2, Qwen-FP8):
  `quantization_config = {"quant_method": "fp8", "weight_block_size": [bn, bk]}`; a weight
  `X.weight` of dtype F8_E4M3 or F8_E5M2 [N, K] has `X.weight_scale_inv` [ceil(N/bn),
  ceil(K/bk)] (float32, bf16 or e8m0), and w = value(code) * scale. Without a block size,
  one scale for the whole matrix.
  DeepSeek's own releases name the scales `X.scale` (`X.weight` -> `X.scale`), e8m0 with
  `scale_fmt: ue8m0`.
- MXFP8 (Inkling-2): `quant_method: mxfp8`, FP8 E4M3 codes with an e8m0 scale per 32
  values of a row (`weight_block_size` [1, 32]), the scales stored as uint8 bytes: read as
  FP8 block-scaled.
- FP4 experts in an FP8 checkpoint (DeepSeek-V4: `expert_dtype: fp4`): a weight I8 [N, K/2]
  (two e2m1 codes a byte, the even column in the low nibble) with e8m0 scales [N, K/32]
  beside it as above: MXFP4's layout, read as an mxfp4 QuantWeight.
- MXFP4 (gpt-oss): `quantization_config = {"quant_method": "mxfp4"}`; a weight `X` is
  stored as `X_blocks` uint8 [..., N, K/32, 16] (two e2m1 codes a byte, the even column in
  the low nibble) and `X_scales` uint8 [..., N, K/32] (e8m0: the scale is 2 ** (e - 127)).

A weight read here is a QuantWeight of kind fp8_e4m3, fp8_e5m2 or mxfp4: the codes as
stored, the scales as float32 (FP8) or e8m0 bytes (MXFP4). Only the activations are float32:
colibri computes what `transformers` computes on CPU from the same checkpoint, the weights
dequantized to float32 (the models' own GPU code may also quantize activations to FP8;
colibri does not). NaN and infinity codes are refused when read (NonFiniteWeights): the
kernels decode every code as a finite value.
"""

from dataclasses import dataclass

import numpy as np

from .errors import ConfigInvalid, NonFiniteWeights, QuantizationUnsupported, ScalesMismatch
from .formats import FORMATS, fp8, mxfp4
from .quant import QuantWeight
from .safetensors import bf16_to_f32

METHODS = ("fp8", "mxfp8", "mxfp4")  # quantization_config.quant_method values colibri reads
FP8_DTYPES = {f.code_dtype: f.name for f in fp8.FORMATS}  # safetensors dtype -> kind
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")  # what an FP8 weight's scales may be stored as
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv (DeepSeek's name: the factor that undoes the quantization)
BLOCKS, SCALES = "_blocks", "_scales"  # MXFP4: X -> X_blocks, X_scales


@dataclass(frozen=True)
class QuantConfig:
    method: str  # fp8 or mxfp4
    block: tuple[int, int] | None = None  # fp8: (bn, bk); None: one scale per matrix
    fp4_experts: bool = False  # fp8 with expert_dtype fp4: I8 weights are e2m1 pairs, 32 a scale
    e8m0_bytes: bool = False  # fp8 scales may be uint8 bytes, each an e8m0 exponent (MXFP8's, scale_fmt ue8m0)


def quant_config(config: dict, where: str) -> QuantConfig | None:
    """The checkpoint's quantization_config, checked; None when it has none. Raises
    QuantizationUnsupported naming a method or format colibri does not read, ConfigInvalid."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigInvalid(f"{where}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise QuantizationUnsupported(f"{where}: quantization method {method!r} is not supported; colibri reads "
                                      "fp8 (block-scaled FP8 weights), mxfp8 and mxfp4 checkpoints, or bf16/f16/f32 ones")
    if method == "mxfp4":
        return QuantConfig("mxfp4")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "e5m2"):
        raise QuantizationUnsupported(f"{where}: fp8 format {fmt!r} is not supported (e4m3, e5m2)")
    experts = qc.get("expert_dtype", "fp8")
    if experts not in ("fp8", "fp4"):
        raise QuantizationUnsupported(f"{where}: expert_dtype {experts!r} is not supported (fp8, fp4)")
    e8m0 = method == "mxfp8" or qc.get("scale_fmt") == "ue8m0"
    block = qc.get("weight_block_size", [1, 32] if method == "mxfp8" else None)
    if block is None:
        return QuantConfig("fp8", None, experts == "fp4", e8m0)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigInvalid(f"{where}: quantization_config.weight_block_size must be two positive integers, not {block!r}")
    return QuantConfig("fp8", (block[0], block[1]), experts == "fp4", e8m0)


def scale_name(name: str, ckpt=None) -> str:
    """The scales of weight `name`: X.weight_scale_inv, or DeepSeek's X.scale where the
    checkpoint has that one instead."""
    if ckpt is not None and not ckpt.has(name + SCALE_SUFFIX) and name.endswith(".weight"):
        short = name.removesuffix(".weight") + ".scale"
        if ckpt.has(short):
            return short
    return name + SCALE_SUFFIX


def fp8_scale_shape(qc: QuantConfig | None, shape: tuple) -> tuple[int, int]:
    # the scales' shape for an FP8 matrix of `shape` [N, K]
    n, k = shape
    bn, bk = qc.block if qc is not None and qc.block else (n, k)
    return (-(-n // bn), -(-k // bk))


def check_fp8(ckpt, name: str, entry) -> None:
    """An FP8 weight has scales shaped as its blocks: raises ScalesMismatch, QuantizationUnsupported."""
    file = ckpt.file_of(name)
    if ckpt.quant is None or ckpt.quant.method != "fp8":
        raise QuantizationUnsupported(f"{file}: tensor {name!r} is {entry.dtype}, but config.json has no fp8 "
                                      "quantization_config saying how it is scaled")
    if len(entry.shape) != 2:
        raise ScalesMismatch(f"{file}: FP8 tensor {name!r} has shape {list(entry.shape)}; FP8 weights are matrices")
    sname = scale_name(name, ckpt)
    if not ckpt.has(sname):
        raise ScalesMismatch(f"{file}: FP8 tensor {name!r} has no scales ({sname!r} is missing)")
    check_fp8_scales(ckpt, sname, tuple(entry.shape), fp8_scale_shape(ckpt.quant, entry.shape))


def check_fp8_scales(ckpt, sname: str, shape: tuple, want: tuple) -> None:
    """FP8 scales `sname` for a weight of `shape` are `want`-shaped and of a scale dtype
    (uint8 e8m0 bytes where the config says so). Raises ScalesMismatch."""
    s = ckpt.entry(sname)
    dtypes = SCALE_DTYPES + (("U8",) if ckpt.quant.e8m0_bytes else ())
    if s.dtype not in dtypes or (tuple(s.shape) if s.shape else (1, 1)) != tuple(want):
        raise ScalesMismatch(f"{ckpt.file_of(sname)}: {sname!r} is {s.dtype} {list(s.shape)}; weight {list(shape)} "
                             f"in blocks of {list(ckpt.quant.block or shape[-2:])} needs {list(want)} scales "
                             f"({', '.join(dtypes)})")


def scales_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Scales as stored (F32, BF16 as uint16, F8_E8M0 and MXFP8's U8 as uint8) -> float32, exactly."""
    if dtype == "BF16":
        return bf16_to_f32(a)
    if dtype in ("F8_E8M0", "U8"):
        return mxfp4.E8M0_VALUES[a]
    return a.astype(np.float32)


def read_fp8(ckpt, name: str) -> QuantWeight:
    """An FP8 weight and its scales as a QuantWeight (codes as stored, scales float32).
    Raises ScalesMismatch, NonFiniteWeights."""
    e = ckpt.entry(name)
    check_fp8(ckpt, name, e)
    kind = FP8_DTYPES[e.dtype]
    q = ckpt.read(name)
    check_finite(q, kind, f"{ckpt.file_of(name)}: {name!r}")
    s_entry = ckpt.entry(scale_name(name, ckpt))
    s = scales_f32(ckpt.read(s_entry.name), s_entry.dtype)
    s = np.ascontiguousarray(s.reshape(fp8_scale_shape(ckpt.quant, e.shape)))
    if not np.all(np.abs(s) < fp8.SCALE_LIMIT[kind]):
        raise ScalesMismatch(f"{ckpt.file_of(s_entry.name)}: {s_entry.name!r} holds scales of {float(np.abs(s).max()):g}; "
                             f"{kind} scales must be finite and below {fp8.SCALE_LIMIT[kind]:g}")
    n, k = e.shape
    bn, bk = ckpt.quant.block or (n, k)
    return QuantWeight(kind, q, s, bk, bn)


def check_fp4(ckpt, name: str, entry, shape: tuple) -> None:
    """An FP4 expert weight of config shape [N, K]: I8 [N, K/2] with e8m0 scales [N, K/32].
    Raises QuantizationUnsupported, ScalesMismatch."""
    file = ckpt.file_of(name)
    if ckpt.quant is None or not ckpt.quant.fp4_experts:
        raise QuantizationUnsupported(f"{file}: tensor {name!r} is I8, but config.json's quantization_config does "
                                      "not say expert_dtype: fp4")
    n, k = shape
    if k % mxfp4.GROUP or tuple(entry.shape) != (n, k // 2):
        raise ScalesMismatch(f"{file}: FP4 tensor {name!r} is {list(entry.shape)}; a weight {list(shape)} needs "
                             f"[{n}, {k // 2}] (two codes a byte, rows of whole {mxfp4.GROUP}-code blocks)")
    sname = scale_name(name, ckpt)
    s = ckpt.entry(sname) if ckpt.has(sname) else None
    if s is None or s.dtype not in ("F8_E8M0", "U8", "F32") or tuple(s.shape) != (n, k // mxfp4.GROUP):
        got = f"{s.dtype} {list(s.shape)}" if s is not None else "missing"
        raise ScalesMismatch(f"{file}: the scales of FP4 tensor {name!r} ({sname!r}) are {got}; it needs "
                             f"F8_E8M0 [{n}, {k // mxfp4.GROUP}]")


def read_fp4(ckpt, name: str) -> QuantWeight:
    """An FP4 expert weight as an mxfp4 QuantWeight: its codes and e8m0 scales as stored."""
    q = np.ascontiguousarray(ckpt.read(name).view(np.uint8))
    sname = scale_name(name, ckpt)
    s = ckpt.read(sname)
    if ckpt.entry(sname).dtype == "F32":  # float scales: each must be a power of two, kept as its e8m0 byte
        m, e = np.frexp(s)
        if not (np.all(m == 0.5) and np.all((e - 1 >= -127) & (e - 1 <= 127))):
            raise ScalesMismatch(f"{ckpt.file_of(sname)}: {sname!r} holds scales that are not powers of two; "
                                 "FP4 experts are scaled by e8m0 powers of two")
        s = (e - 1 + 127).astype(np.uint8)
    return QuantWeight("mxfp4", q, np.ascontiguousarray(s.view(np.uint8)), mxfp4.GROUP)


def check_finite(codes: np.ndarray, kind: str, where: str) -> None:
    # FP8 codes that are NaN or infinity: a damaged checkpoint (the kernels decode every code
    # as a finite value, so they are refused here)
    bad = ~np.isfinite(FORMATS[kind].values)[codes]
    if bad.any():
        raise NonFiniteWeights(f"{where}: {int(bad.sum())} NaN or infinity codes in {kind} weights")


def mxfp4_pair(ckpt, base: str, shape: tuple) -> None:
    """MXFP4 `base_blocks` / `base_scales` for a weight of `shape` [..., N, K]: raises
    TensorMissing (through entry), ScalesMismatch."""
    blocks, scales = ckpt.entry(base + BLOCKS), ckpt.entry(base + SCALES)
    *lead, n, k = shape
    want_b, want_s = (*lead, n, k // mxfp4.GROUP, 16), (*lead, n, k // mxfp4.GROUP)
    if k % mxfp4.GROUP or blocks.dtype != "U8" or tuple(blocks.shape) != want_b:
        raise ScalesMismatch(f"{ckpt.file_of(blocks.name)}: {blocks.name!r} is {blocks.dtype} {list(blocks.shape)}; "
                             f"an MXFP4 weight {list(shape)} needs U8 {list(want_b)}")
    if scales.dtype not in ("U8", "F8_E8M0") or tuple(scales.shape) != want_s:
        raise ScalesMismatch(f"{ckpt.file_of(scales.name)}: {scales.name!r} is {scales.dtype} {list(scales.shape)}; "
                             f"the scales of {blocks.name!r} must be U8 {list(want_s)}")
