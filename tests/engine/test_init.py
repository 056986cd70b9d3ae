"""layers.init compiles (loads) the kernels of the number formats a model computes in, and
no others: each format's kernels are megabytes of every process's memory once loaded."""

import subprocess
import sys

from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.convert import ExpertPlan, convert

from hf_models import build, load_model

PROBE = """
from colibri.engine import layers
from colibri.engine.formats import ggml, int4
kernels = {"int4/32": int4.LINEAR_Q4_TOK[32], "int4/64": int4.LINEAR_Q4_TOK[64], "ggml": ggml.ggml_matmul}
loaded = lambda: {name: len(f.overloads) > 0 for name, f in kernels.items()}
layers.init(1, kinds={("bf16", None)})
print(sorted(map(str, layers.init.done)), loaded())
layers.init(1, kinds={("bf16", None), ("int4", 64), ("q4_k", None)})
print(sorted(map(str, layers.init.done)), loaded())
"""


def test_init_loads_only_the_kinds_asked():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == ("[\"('paths', 'bf16', None)\", \"('paths', 'f32', None)\", 'attention', 'dense', 'experts'] "
                     "{'int4/32': False, 'int4/64': False, 'ggml': False}")
    # asked again with more: only what was missing, an int4 group's alone
    assert second == ("[\"('formats', ('q4_k',))\", \"('int4', 64)\", \"('paths', 'bf16', None)\", "
                      "\"('paths', 'f32', None)\", \"('paths', 'int4', 64)\", \"('paths', 'q4_k', None)\", 'attention', "
                      "'dense', 'experts'] "
                      "{'int4/32': False, 'int4/64': True, 'ggml': True}")


def kinds_of(path, **placement):
    return load_model(path, **placement).kernel_kinds()


def test_kernel_kinds_of_a_model(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=3, hidden_size=128, moe_intermediate_size=64)
    assert kinds_of(tmp_path / "hf") == {("f32", None)}  # (the tests write float32)
    model = build_model(str(tmp_path / "hf"), load_config(str(tmp_path / "hf")))
    plan = ExpertPlan(model.moe_layers, model.n_expert, model.expert_names, model.dense_names())
    convert(model.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "c4", plan, expert_dtype="int4",
            group_size=32)
    # (int8 and int4 experts are converted for int8 activations unless asked otherwise: their integer path too)
    assert kinds_of(tmp_path / "c4", budget="min") == {("int4", 32), ("int8-activations", None)}
    convert(model.source(open_checkpoint(str(tmp_path / "hf"))), tmp_path / "c8", plan, expert_dtype="int8")
    assert kinds_of(tmp_path / "c8", budget="min") == {("int8", None), ("int8-activations", None)}
