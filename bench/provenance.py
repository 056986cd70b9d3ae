"""Where a benchmark's figures come from, written into its JSON: the date, the commit (and
whether the tree had changes beyond it), the CPU's model and the instruction sets the
kernels may use, the cores the process could run on, the threads it was told to use, and
the exact command. A figure in docs/benchmarks.md or the README is traced to its JSON
and, through this, to the machine and code that made it.

    print(provenance.dumps(result, indent=2))   # instead of json.dumps(result, indent=2)
"""

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else ""


def cpu() -> dict:
    """The CPU's model name and which of FLAGS it reports."""
    model, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "?":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "flags": [f for f in FLAGS if f in flags]}


def provenance() -> dict:
    """This run's provenance (see the module's text)."""
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    threads = {k: os.environ[k] for k in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
               if k in os.environ}
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit + ("+changes" if dirty else ""),
            "cpu": cpu(), "cores": len(os.sched_getaffinity(0)), "threads_env": threads,
            "command": " ".join(["python", *sys.argv])}


def stamped(result: dict) -> dict:
    """`result` with its provenance (a benchmark's own measured limits stay in its fields)."""
    return result | {"provenance": provenance()}


def dumps(result: dict, **kw) -> str:
    """json.dumps of the stamped result."""
    return json.dumps(stamped(result), **kw)
