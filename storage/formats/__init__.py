"""Number formats of weights, one module each, registered here once: FORMATS maps a format's
name (a QuantWeight's kind, a manifest's expert dtype) to its Format (spec.py). Each module
holds the format's layout and reference dequantisation; its kernels are the module of the
same name in engine/formats/. To add a format: a module here, its line below, a kernel
module there (docs/architecture.md)."""

from . import fp8, ggml, int4, int8, mxfp4
from .spec import BF16, F16, F32, Format

FORMATS: dict[str, Format] = {f.name: f for f in (int8.FORMAT, int4.FORMAT, *fp8.FORMATS, mxfp4.FORMAT, *ggml.FORMATS)}
PLAIN_CODES = {"bf16": BF16, "f16": F16, "f32": F32}  # the plain float storage types' codes
QUANT_DTYPES = tuple(n for n, f in FORMATS.items() if not f.published)  # colibri's own (lossy, on request)
PUBLISHED_DTYPES = tuple(n for n, f in FORMATS.items() if f.published)  # a checkpoint's own, kept as they are

__all__ = ["FORMATS", "PLAIN_CODES", "PUBLISHED_DTYPES", "QUANT_DTYPES", "Format", "fp8", "ggml", "int4", "int8", "mxfp4"]
