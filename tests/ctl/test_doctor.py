"""`colictl doctor`: read-only checks, one line each, exit 7 on any failure."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from colibri.ctl import exitcodes
from colibri.storage.container import open_container
from colibri.storage.demo import write_demo_model

from hf_models import flip


def colictl(*args, env=None):
    return subprocess.run([sys.executable, "-m", "colibri.ctl", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    demo = write_demo_model(root / "demo")
    assert colictl("convert", demo, root / "c").returncode == 0
    return root / "c"


def snapshot(path):
    return {p: (os.stat(os.path.join(path, p)).st_mtime_ns, os.path.getsize(os.path.join(path, p)))
            for p in sorted(os.listdir(path))}


def test_a_healthy_container_passes_and_nothing_changes(container, tmp_path):
    env = {"STATE_DIRECTORY": str(tmp_path / "state")}
    before = snapshot(container)
    r = colictl("doctor", "--model", container, "--deep", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    names = [ln.split()[1] for ln in lines]
    for check in ("model", "container", "index", "dense", "checksums", "dense_checksums", "o_direct", "drive",
                  "memory", "hugepages", "memlock", "socket", "state"):
        assert check in names, check
    assert all(ln.startswith(("ok ", "warn ")) for ln in lines)
    assert "all 64 expert records match" in r.stdout
    out = json.loads(colictl("doctor", "--model", container, "--json", env=env).stdout)
    assert out["ok"] and {c["check"] for c in out["checks"]} >= {"container", "index", "o_direct"}
    assert snapshot(container) == before and not os.path.exists(tmp_path / "state")  # read-only


def test_a_corrupted_record_is_found_by_the_deep_check(container, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(container, bad)
    rec = open_container(str(bad)).records[(2, 9)]
    with open(rec.file, "r+b") as f:
        f.seek(rec.offset + 100)
        byte = f.read(1)
        f.seek(rec.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert colictl("doctor", "--model", bad).returncode == 0  # the index alone is fine
    r = colictl("doctor", "--model", bad, "--deep")
    assert r.returncode == exitcodes.CHECK_FAILED
    line = next(ln for ln in r.stdout.splitlines() if "checksums" in ln)
    assert line.startswith("FAIL") and "1 of 64" in line and "2:9 (experts-0002.safetensors" in line


def test_a_flipped_byte_in_the_dense_file_is_caught_by_doctor_and_at_load(container, tmp_path):
    """Every byte of a container is checksummed: a dense tensor's by the deep check and
    whenever it is loaded (colictl run and the daemon refuse it, naming the tensor); the
    dense header's as the container opens."""
    dense = open_container(str(container)).dense
    name = "model.layers.1.self_attn.o_proj.weight"
    e = dense.entry(name)
    bad = tmp_path / "bad"
    shutil.copytree(container, bad)
    flip(bad / "dense.safetensors", e.begin + e.n_bytes // 2)
    r = colictl("doctor", "--model", bad, "--deep")
    assert r.returncode == exitcodes.CHECK_FAILED
    line = next(ln for ln in r.stdout.splitlines() if "dense_checksums" in ln)
    assert line.startswith("FAIL") and f"1 of {len(dense.where)}" in line and name in line
    r = colictl("run", "--model", bad, "--max-tokens", 2, "Hello")
    assert r.returncode == exitcodes.MODEL and name in r.stderr and "checksum" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    head = tmp_path / "head"
    shutil.copytree(container, head)
    raw = (head / "dense.safetensors").read_bytes()
    at = raw.index(b'"shape"') + 2  # inside the header's JSON: still valid JSON, another key
    flip(head / "dense.safetensors", at)
    r = colictl("run", "--model", head, "--max-tokens", 2, "Hello")
    assert r.returncode == exitcodes.MODEL and "header fails its checksum" in r.stderr


def test_missing_files_and_models_fail(container, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(container, broken)
    os.unlink(broken / "experts-0001.safetensors")
    r = colictl("doctor", "--model", broken)
    assert r.returncode == exitcodes.CHECK_FAILED and "FAIL container" in r.stdout and "missing" in r.stdout
    r = colictl("doctor", "--model", tmp_path / "nothing")
    assert r.returncode == exitcodes.CHECK_FAILED and "no such directory" in r.stdout
    conf = tmp_path / "bad.yaml"
    conf.write_text("expert_cache: lots\n")
    r = colictl("doctor", "--config", conf, "--model", container)
    assert r.returncode == exitcodes.USAGE and r.stderr.count("\n") == 1 and "expert_cache" in r.stderr


def test_the_memory_check_counts_streamed_tables_by_their_cache_not_their_size(tmp_path):
    """A Qwen4-Exp container's n-gram tables are streamed: the memory line counts the dense
    weights without them and the table cache the configuration gives them."""
    from colibri.storage.demo import _tokenizer_json
    from colibri.storage.placement import streamed_table_bytes
    from colibri.storage.sizes import fmt_bytes

    from hf_models import build_container

    c = build_container(tmp_path, "qwen4_exp", "ple_qsa_hc2", seed=5, vocab_size=101, ngram_vocab_size_base=5000,
                        ple_embed_dim=64)
    (tmp_path / "c" / "tokenizer.json").write_text(_tokenizer_json())
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\ntable_cache: 64KiB\n")
    r = colictl("doctor", "--model", c.path, "--config", cfg, "--deep")
    line = next((ln for ln in r.stdout.splitlines() if ln.split()[1] == "memory"), r.stdout)
    assert f"(dense {fmt_bytes(c.dense_bytes - streamed_table_bytes(c))}," in line, line
    assert "embedding tables 64.0 KiB," in line and "the process 320.0 MiB" in line, line
    assert "dense tensors match" in r.stdout  # (--deep: the tables' bytes checked as dense tensors)
