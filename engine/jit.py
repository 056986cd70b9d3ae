"""numba options for every kernel module, and where their compiled code is cached.

numba keys a cached kernel on its own file's timestamp only, never on the kernels and
intrinsics it inlines from other files; the kernels live in several files (ir.py,
ir_rows.py, atomics.py, kernels.py, jobs.py, crew.py, a module per number format in formats/ and
its integer dot products), so their cache sits in a directory named after a hash
of all of them: an edit of any one recompiles every kernel that may have inlined it.
NUMBA_CACHE_DIR, when set, is used as is.
"""

import hashlib
import os

import numba

JIT = dict(cache=True, nogil=True)
# reassociating the dot-product sum lets LLVM vectorise it; results differ from a
# sequential sum only in rounding (~1e-7 relative), as any BLAS does
JIT_FAST = dict(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
KERNEL_FILES = ("jit.py", "ir.py", "ir_rows.py", "atomics.py", "kernels.py", "jobs.py", "crew.py", "formats/__init__.py",
                "formats/int8.py", "formats/int4.py", "formats/fp8.py", "formats/mxfp4.py", "formats/intdot.py",
                "formats/ggml.py", "formats/ggml_ir.py")


def _cache_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in KERNEL_FILES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    name = f"numba-{h.hexdigest()[:16]}"
    local = os.path.join(here, "__pycache__")
    if os.access(local if os.path.isdir(local) else here, os.W_OK):
        return os.path.join(local, name)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "colibri", name)


if not os.environ.get("NUMBA_CACHE_DIR"):
    numba.config.CACHE_DIR = _cache_dir()  # read when a kernel is decorated: before any kernel module's body
