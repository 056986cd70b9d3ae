"""Shared test set-up: thread settings for this 2-core box, and tiny checkpoints made
with transformers' own classes (the reference the engine is checked against)."""

import os
import sys

# one BLAS thread and passive OpenMP waiting, before numpy/torch load (shared 2-core machine)
for var, val in {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                 "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(var, val)

sys.path.insert(0, os.path.dirname(__file__))  # for `import hf_models`
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gateway"))  # the map test reuses the gateway's fixtures
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))  # loopdrives
