"""Kernels compiled before they are needed (issue 66): every kernel has a compiled signature
once start-up has run (a kernel added without a warm-up fails here), and a first step of
every family, of GGUF files and of int8-activation containers compiles nothing: numba's
cache is not written to, nothing is said on stderr."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_USE = os.path.join(HERE, "first_use.py")
# kernels no step of a model calls, with why
NOT_IN_A_STEP = {
    "colibri.engine.kernels.read_bandwidth": "colictl plan's memory measurement, compiled when plan runs",
}

COVERAGE = """
import importlib, json, pkgutil, sys
import numba.core.dispatcher as D
import colibri.engine as E
from colibri.engine import jit, layers, registry
for m in pkgutil.walk_packages(E.__path__, "colibri.engine."):
    importlib.import_module(m.name)
layers.init(1)
layers.init(1, kinds={(layers.FAMILY + name, None) for name in jit.FAMILY_WARMS})
kernels = {(mod, name): obj for mod, m in list(sys.modules.items()) if mod.startswith("colibri.engine")
           for name, obj in vars(m).items() if isinstance(obj, D.Dispatcher) and obj.__module__ == mod}
def names(code):  # every name a kernel's code (and the code it nests) refers to
    out = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            out |= names(c)
    return out
# a kernel only other kernels call is compiled into them (and loaded with them from numba's
# cache): it has no signature of its own to check
inner = set().union(*(names(k.py_func.__code__) for k in kernels.values()))
for mod, m in list(sys.modules.items()):  # and the kernels a factory makes (a closure per group size, ...)
    if mod.startswith("colibri.engine"):
        for f in vars(m).values():
            if callable(f) and getattr(f, "__module__", None) == mod and hasattr(f, "__code__"):
                inner |= set().union(set(), *(names(c) for c in f.__code__.co_consts if hasattr(c, "co_names")))
missing = sorted(f"{mod}.{name}" for (mod, name), k in kernels.items() if not k.overloads and name not in inner
                 and k.targetoptions.get("inline") != "always")  # (always inlined: never compiled on its own)
print(json.dumps({"missing": missing, "groups": sorted(jit.FAMILY_WARMS)}))
"""


def last_json(r) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_kernel_has_a_compiled_signature_after_init():
    r = subprocess.run([sys.executable, "-c", COVERAGE], capture_output=True, text=True, timeout=1800)
    got = last_json(r)
    assert {"recurrent", "chosen", "inkling2", "glm5_next", "qwen4_exp"} <= set(got["groups"])
    missing = [k for k in got["missing"] if k not in NOT_IN_A_STEP]
    assert not missing, f"kernels no warm-up compiles (engine/warm.py, or jit.family_warm for a family's own): {missing}"


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "minimax_m2", "glm_moe_dsa",
            "deepseek_v32", "deepseek_v4", "inkling2", "glm5_next", "qwen4_exp", "gpt_oss", "qwen3_next",
            "qwen3_5_moe", "kimi_linear"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_familys_first_steps_compile_nothing(tmp_path, family):
    """In a fresh process (compiled signatures live as long as the process): init for the
    model's kinds, then a prompt, a decode step, a batch of both and a batch of decode steps."""
    r = subprocess.run([sys.executable, FIRST_USE, "family", str(tmp_path), family], capture_output=True, text=True,
                       timeout=900, cwd=HERE)
    assert last_json(r)[family] == [], f"{family}'s first steps compiled kernels the warm-up does not reach"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A GGUF file in the K-quants, one in the 32-weight blocks, and int8 / int4 containers
    converted for int8 activations."""
    sys.path.insert(0, os.path.join(HERE, "storage"))
    from gguf_models import write_gguf
    from test_gguf import blocks_of_32, k_quants

    from colibri.storage.demo import write_demo_model, write_random_model

    root = tmp_path_factory.mktemp("first")
    demo = write_demo_model(root / "demo")
    out = {}
    for name, mix, width in (("Q4_K_M", k_quants, 256), ("blocks32", blocks_of_32, 64)):
        src = write_random_model(root / f"hf{width}", hidden_size=width, intermediate_size=width,
                                 moe_intermediate_size=width, head_dim=width // 4, vocab_size=2048)
        out[name] = write_gguf(src, root / f"m-{name}.gguf", quant=mix, tokenizer=demo)
    for dtype in ("int8", "int4"):
        r = subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", demo, root / dtype, "--dtype", dtype,
                            "--dense-dtype", dtype, "--activations", "int8"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out[f"{dtype}-activations-int8"] = str(root / dtype)
    # what setup.sh does: every format's kernels into numba's cache (loaded from it when it already holds them)
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--compile-only"], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr
    return out


def cache_files() -> dict:
    import numba

    from colibri.engine import jit  # noqa: F401 (sets numba's cache directory)

    root = numba.config.CACHE_DIR
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(root) for f in fs}


@pytest.mark.parametrize("name", ["Q4_K_M", "blocks32", "int8-activations-int8", "int4-activations-int8"])
def test_a_first_run_compiles_nothing(files, name):
    """colictl run in a fresh process: init (the model's kinds, compiled by setup.sh's
    colibrid --compile-only, so loaded from numba's cache), then a prompt and its decode
    steps add no signature to any kernel, write nothing to numba's cache and say nothing of
    compiling on stderr."""
    before = cache_files()
    r = subprocess.run([sys.executable, FIRST_USE, "run", "--model", files[name], "--max-tokens", "6",
                        "Once upon a time there was"], capture_output=True, text=True, timeout=600, cwd=HERE)
    assert last_json(r)["run"] == [], "the first run compiled kernels the warm-up does not reach"
    assert "at first use" not in r.stderr, r.stderr
    assert cache_files() == before, "numba's cache was written to: compiled at first use"


LATE = """
import logging, sys
import numba, numpy as np
from colibri.engine import jit, layers
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")
layers.init(1, kinds={("bf16", None)})
assert jit.compile_seconds() == 0.0
@numba.njit(cache=False)
def late(x):
    return x * 2
late(np.ones(3))
print(jit.compile_seconds())
"""


def test_a_kernel_compiled_at_first_use_is_said_and_timed_apart():
    """A kernel no warm-up reached: one line on stderr naming it and its time, and the
    seconds counted apart (requests' stats leave them out of their tok/s)."""
    r = subprocess.run([sys.executable, "-c", LATE], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[-1]) > 0
    said = [line for line in r.stderr.splitlines() if "at first use" in line]
    assert len(said) == 1 and "late" in said[0] and " s (" in said[0], r.stderr
