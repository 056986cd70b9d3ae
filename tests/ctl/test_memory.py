"""Peak RSS of `colictl run` on a container stays below dense bytes + expert budget + a
fixed overhead, on a model whose experts are many times the budget."""

import json
import os
import subprocess
import sys

from colibri.engine.demo import write_demo_model
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.container import open_container
from colibri.storage.convert import ExpertPlan, convert

OVERHEAD_BYTES = 256 * 2**20  # Python, numpy, the compiled kernels, tokenizer, a short KV cache (README)
BUDGET = 16 * 2**20


def test_peak_rss_bound(tmp_path):
    # 4 MoE layers x 64 experts of 1.5 MiB (bf16): 384 MiB of experts, 24x the budget
    src = write_demo_model(tmp_path / "hf", hidden_size=512, moe_intermediate_size=512, num_experts=64,
                           head_dim=64, num_hidden_layers=4)
    model = build_model(src, load_config(src))
    convert(open_checkpoint(src), tmp_path / "c", ExpertPlan(model.moe_layers, model.n_expert, model.expert_names))
    c = open_container(str(tmp_path / "c"))
    dense_bytes = os.path.getsize(tmp_path / "c" / "dense.safetensors")
    assert c.expert_bytes >= 20 * BUDGET

    proc = subprocess.Popen([sys.executable, "-m", "colibri.ctl", "run", "--model", str(tmp_path / "c"),
                             "--expert-cache", str(BUDGET), "--max-tokens", "24", "--json", "a prompt of some length"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.stdout.read(), proc.stderr.read()  # stderr is a few lines: no pipe deadlock
    _, status, usage = os.wait4(proc.pid, 0)  # reaps the child ourselves: its own peak RSS
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, err.decode()
    stats = json.loads(out)["stats"]
    assert stats["experts"]["bytes_read"] > 4 * BUDGET  # it streamed far more than it kept
    peak = usage.ru_maxrss * 1024
    assert peak < dense_bytes + BUDGET + OVERHEAD_BYTES, (peak / 2**20, dense_bytes / 2**20)
