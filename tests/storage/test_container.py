"""Containers written by the converter: aligned, checksummed records that one read
fetches; valid safetensors for other tools; nothing half-written ever opens."""

import json
import os
import zlib

import numpy as np
import pytest
import torch
from safetensors import safe_open

from colibri.engine.registry import build_model
from colibri.storage import convert as convert_mod
from colibri.storage.checkpoint import load_config, open_checkpoint
from colibri.storage.container import ALIGN, ContainerInvalid, open_container
from colibri.storage.convert import ConvertError, ExpertPlan, convert
from colibri.storage.quant import dequantize
from colibri.storage.safetensors import SafetensorsFile, bf16_to_f32

from hf_models import build


def plan_for(path):
    model = build_model(str(path), load_config(str(path)))
    return ExpertPlan(model.moe_layers, model.n_expert, model.expert_names), model


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "qwen2"
    build("qwen2_moe", "sparse_step_tied_window", path, seed=5, dtype=torch.bfloat16)
    return path


def test_records_aligned_checksummed_and_exact(src, tmp_path):
    plan, _ = plan_for(src)
    ckpt = open_checkpoint(str(src))
    convert(ckpt, tmp_path / "c", plan)
    c = open_container(str(tmp_path / "c"))
    assert c.expert_dtype == "bf16" and c.record_bytes % ALIGN == 0
    assert sorted({il for il, _ in c.records}) == plan.moe_layers == c.moe_layers
    for (il, ie), rec in c.records.items():
        assert rec.offset % ALIGN == 0 and rec.length == c.record_bytes
        with open(rec.file, "rb") as f:
            f.seek(rec.offset)
            raw = f.read(rec.length)
        assert zlib.crc32(raw) == rec.crc32
        gate, up, down = c.expert_views(np.frombuffer(raw, np.uint8))
        for got, name in zip((gate, up, down), plan.names(il, ie)):
            np.testing.assert_array_equal(got, ckpt.read(name))  # bit-exact, one read per expert
    # the container's data sections start on 4 KiB, and every tool can open the files
    for name in os.listdir(tmp_path / "c"):
        if name.startswith("experts-"):
            assert SafetensorsFile(tmp_path / "c" / name).data_begin % ALIGN == 0
            with safe_open(tmp_path / "c" / name, "pt") as f:
                key = next(k for k in f.keys() if k.endswith("down_proj.weight"))
                ref = torch.from_numpy(bf16_to_f32(ckpt.read(key)))
                assert torch.equal(f.get_tensor(key).float(), ref)
    dense = SafetensorsFile(tmp_path / "c" / "dense.safetensors")
    assert not any(".experts." in n for n in dense.entries)
    assert "model.layers.1.mlp.shared_expert.up_proj.weight" in dense.entries
    m = json.loads((tmp_path / "c" / "colibri.json").read_text())
    assert m["version"] == 1 and m["source"]["fingerprint"].startswith("sha256:")
    assert m["tensor_classes"]["experts"] == {"dtype": "bf16", "group_size": None}


@pytest.fixture(scope="module")
def src_wide(tmp_path_factory):
    """Rows of 128 and 64 values, which the usual group sizes divide."""
    path = tmp_path_factory.mktemp("src") / "mixtral"
    build("mixtral", "basic", path, seed=6, dtype=torch.bfloat16, hidden_size=128, intermediate_size=64)
    return path


@pytest.mark.parametrize("dtype,group", [("int8", None), ("int8", 32), ("int4", None), ("int4", 32)])
def test_quantized_records(src_wide, tmp_path, dtype, group):
    plan, _ = plan_for(src_wide)
    ckpt = open_checkpoint(str(src_wide))
    m = convert(ckpt, tmp_path / "q", plan, expert_dtype=dtype, group_size=group)
    c = open_container(str(tmp_path / "q"))
    assert m["tensor_classes"]["experts"]["dtype"] == dtype and c.precision()["lossy"]
    il = plan.moe_layers[0]
    rec = c.records[(il, 3)]
    with open(rec.file, "rb") as f:
        f.seek(rec.offset)
        raw = np.frombuffer(f.read(rec.length), np.uint8)
    for qw, name in zip(c.expert_views(raw), plan.names(il, 3)):
        w = bf16_to_f32(ckpt.read(name))
        assert qw.group_size == (group or (64 if dtype == "int4" else w.shape[1]))
        err = np.abs(dequantize(qw) - w).max() / np.abs(w).max()
        assert err < (0.1 if dtype == "int4" else 0.01)


def test_bad_group_size(src, tmp_path):
    plan, _ = plan_for(src)
    with pytest.raises(ConvertError, match="group size 32 does not divide the row length 40"):
        convert(open_checkpoint(str(src)), tmp_path / "g", plan, expert_dtype="int4", group_size=32)
    assert not os.path.exists(tmp_path / "g")


def test_refuses_to_overwrite_unless_forced(src, tmp_path):
    plan, _ = plan_for(src)
    ckpt = open_checkpoint(str(src))
    convert(ckpt, tmp_path / "c", plan)
    with pytest.raises(ConvertError, match="exists"):
        convert(ckpt, tmp_path / "c", plan)
    convert(ckpt, tmp_path / "c", plan, expert_dtype="int8", force=True)
    assert open_container(str(tmp_path / "c")).expert_dtype == "int8"
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temporary or old directories left


@pytest.mark.parametrize("fail_at", [1, 3, 8, -1])
def test_interrupted_convert_leaves_nothing_that_opens(src, tmp_path, monkeypatch, fail_at):
    plan, _ = plan_for(src)
    real_write, calls = convert_mod.SafetensorsWriter.write, []

    def write(self, data):
        calls.append(1)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return real_write(self, data)

    real_manifest = convert_mod.write_manifest

    def manifest(path, m):
        if fail_at == -1:
            raise KeyboardInterrupt  # everything written but the manifest
        return real_manifest(path, m)

    monkeypatch.setattr(convert_mod.SafetensorsWriter, "write", write)
    monkeypatch.setattr(convert_mod, "write_manifest", manifest)
    with pytest.raises(KeyboardInterrupt):
        convert(open_checkpoint(str(src)), tmp_path / "c", plan, expert_dtype="int8", group_size=2)
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        open_container(str(tmp_path / "c"))


def test_manifest_checks(src, tmp_path):
    plan, _ = plan_for(src)
    convert(open_checkpoint(str(src)), tmp_path / "c", plan)
    mf = tmp_path / "c" / "colibri.json"
    m = json.loads(mf.read_text())
    mf.write_text(json.dumps(m | {"version": 99}))
    with pytest.raises(ContainerInvalid, match="version 99"):
        open_container(str(tmp_path / "c"))
    bad = json.loads(json.dumps(m))
    bad["experts"]["index"][0]["offset"] += 512
    mf.write_text(json.dumps(bad))
    with pytest.raises(ContainerInvalid, match="misaligned"):
        open_container(str(tmp_path / "c"))
    os.truncate(tmp_path / "c" / m["experts"]["index"][-1]["file"], 100)
    mf.write_text(json.dumps(m))
    with pytest.raises(Exception, match="truncated|outside"):
        open_container(str(tmp_path / "c"))


def test_record_checksum_is_zlibs_crc32():
    """The fast CRC-32 (ISA-L) the cache and converter use gives zlib's values: containers
    stay readable by any tool, and by colibri where isal is missing."""
    import zlib

    from colibri.storage.container import crc32

    rng = np.random.default_rng(2)
    for n in (0, 1, 4095, 4096 * 3 + 7):
        buf = rng.integers(0, 256, n, dtype=np.uint8)
        assert crc32(buf) == zlib.crc32(buf) == crc32(memoryview(buf))
