"""Peak RSS of `colictl run` on a container stays below dense bytes + expert budget + a
fixed overhead, on a model whose experts are many times the budget."""

import json
import os
import subprocess
import sys
import time

import psutil

from colibri.engine import layers
from colibri.engine.registry import build_model
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.container import open_container
from colibri.storage.convert import ExpertPlan, convert
from colibri.storage.demo import write_random_model

OVERHEAD_BYTES = 256 * 2**20  # Python, numpy, the compiled kernels, tokenizer, a short KV cache (README)
BUDGET = 16 * 2**20


def test_peak_rss_bound(tmp_path):
    layers.init()  # compile (and cache) the kernels here: the child must measure running, not compiling
    # 4 MoE layers x 64 experts of 1.5 MiB (bf16): 384 MiB of experts, 24x the budget
    src = write_random_model(tmp_path / "hf", hidden_size=512, moe_intermediate_size=512, num_experts=64,
                           head_dim=64, num_hidden_layers=4)
    model = build_model(src, load_config(src))
    convert(open_checkpoint(src), tmp_path / "c", ExpertPlan(model.moe_layers, model.n_expert, model.expert_names))
    c = open_container(str(tmp_path / "c"))
    dense_bytes = os.path.getsize(tmp_path / "c" / "dense.safetensors")
    assert c.expert_bytes >= 20 * BUDGET

    proc = subprocess.Popen([sys.executable, "-m", "colibri.ctl", "run", "--model", str(tmp_path / "c"),
                             "--expert-cache", str(BUDGET), "--max-tokens", "24", "--json", "a prompt of some length"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    child = psutil.Process(proc.pid)
    while proc.poll() is None:
        # VmHWM: the peak RSS of the program since exec (ru_maxrss would count the forked test
        # process, torch and all); read until the child exits
        try:
            peak = max(peak, vm_hwm(child.pid), child.memory_info().rss)
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.005)
    out, err = proc.communicate()
    assert proc.returncode == 0, err.decode()
    stats = json.loads(out)["stats"]
    assert stats["experts"]["bytes_read"] > 4 * BUDGET  # it streamed far more than it kept
    assert peak > 50 * 2**20  # the measurement saw the running program
    assert peak < dense_bytes + BUDGET + OVERHEAD_BYTES, (peak / 2**20, dense_bytes / 2**20)


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
