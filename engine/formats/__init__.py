"""The kernels of each number format, one module per format (int8, int4, fp8, mxfp4, and GGUF's block formats in ggml), the
format's layout and reference in the storage module of the same name (storage/formats/).
Each module says which formats it computes on (KINDS) and has

- `linear(x, w, out, prompt)`: out [T, N] = x [T, D] @ w.T for a QuantWeight w, by the
  decode-path kernel, or with prompt the prompt-path one (each row's result the same alone
  or batched on either path; the two differ in rounding only);
- `warm(kinds)`: one call of each kernel those of its formats need on tiny arrays, so that
  compiling happens at start (int4's: `warm(group_size)`, the prompt path of that group);
- the row widening the thread crew's prompt-path expert job calls for that format
  (engine/jobs.py widen_rows, by the format's code).

KERNELS registers each module once, by format name.
"""

from ...storage.experts import FORMATS
from . import fp8, ggml, int4, int8, mxfp4

KERNELS = {kind: module for module in (int8, int4, fp8, mxfp4, ggml) for kind in module.KINDS}
assert set(KERNELS) == set(FORMATS), "every number format has its kernels, registered once"

__all__ = ["KERNELS", "fp8", "ggml", "int4", "int8", "mxfp4"]
