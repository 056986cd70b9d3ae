"""The checkpoint reader: sharded = single file, and one malformed checkpoint per error
class, each raising its named error with a message naming the file (and tensor)."""

import json
import os
import shutil

import numpy as np
import pytest

from colibri.storage import errors
from colibri.storage.checkpoint import open_checkpoint
from colibri.storage.safetensors import SafetensorsFile, write_safetensors

from hf_models import build, load_model, rewrite_config

TENSOR = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    build("mixtral", "basic", path, seed=1)
    return path


@pytest.fixture
def ckpt(good, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(good, dst)
    return dst


def header(path):
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path, hdr, data, pad=True):
    raw = json.dumps(hdr).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


def edit_header(path, fn):
    hdr, data = header(path)
    fn(hdr)
    write_raw(path, hdr, data)


def expect(exc, path, *words):
    with pytest.raises(exc) as info:
        load_model(str(path))
    for w in words:
        assert w in str(info.value), str(info.value)
    return info.value


def test_sharded_loads_the_same_as_single_file(tmp_path):
    ref = build("qwen2_moe", "basic", tmp_path / "one", seed=3)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="30KB")
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    assert len([n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors")]) > 2
    ids = np.arange(7)
    a, b = (load_model(str(tmp_path / d)) for d in ("one", "sharded"))
    np.testing.assert_array_equal(a.forward(ids, a.new_cache(8)), b.forward(ids, b.new_cache(8)))


def test_missing_directory(tmp_path):
    expect(errors.ModelNotFound, tmp_path / "nope", "nope")
    (tmp_path / "file").write_text("x")
    expect(errors.ModelNotFound, tmp_path / "file", "not a directory")


def test_no_config(ckpt):
    os.remove(ckpt / "config.json")
    expect(errors.ConfigMissing, ckpt, "config.json")


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    expect(errors.ConfigInvalid, ckpt, "config.json")


def test_config_wrong_type(ckpt):
    rewrite_config(ckpt, lambda c: c.update(hidden_size="48"))
    expect(errors.ConfigInvalid, ckpt, "hidden_size")


def test_config_missing_field(ckpt):
    rewrite_config(ckpt, lambda c: c.pop("num_hidden_layers"))
    expect(errors.ConfigInvalid, ckpt, "num_hidden_layers")


def test_unknown_model_type_lists_supported(ckpt):
    rewrite_config(ckpt, lambda c: c.update(model_type="llama"))
    e = expect(errors.UnsupportedModelType, ckpt, "llama")
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        assert fam in str(e)


def test_pickle_weights_refused(ckpt):
    os.remove(ckpt / "model.safetensors")
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    expect(errors.PickleCheckpointRefused, ckpt, "pytorch_model.bin", "safetensors")


def test_no_weights(ckpt):
    os.remove(ckpt / "model.safetensors")
    expect(errors.WeightsMissing, ckpt, "safetensors")


def test_index_points_at_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {TENSOR: "gone.safetensors"}}))
    expect(errors.IndexInvalid, ckpt, "gone.safetensors")


def test_index_maps_tensor_to_wrong_shard(ckpt):
    hdr, _ = header(ckpt / "model.safetensors")
    wm = {k: "model.safetensors" for k in hdr if k != "__metadata__"}
    wm["model.extra.weight"] = "model.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    expect(errors.IndexInvalid, ckpt, "model.extra.weight")


def test_index_not_json(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("[1, 2")
    expect(errors.IndexInvalid, ckpt, "index")


def test_file_shorter_than_header_prefix(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x01\x02")
    expect(errors.HeaderTooSmall, ckpt, "model.safetensors")


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:200])
    expect(errors.HeaderTruncated, ckpt, "model.safetensors")


def test_truncated_data_section(ckpt):
    f = ckpt / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:-100])
    expect(errors.TensorOutOfBounds, ckpt, "model.safetensors", "data_offsets")


def test_header_garbage(ckpt):
    f = ckpt / "model.safetensors"
    _, data = header(f)
    junk = b"\xff\xfe{garbage"
    f.write_bytes(len(junk).to_bytes(8, "little") + junk + data)
    expect(errors.HeaderInvalid, ckpt, "model.safetensors")


def test_header_not_an_object(ckpt):
    write_raw(ckpt / "model.safetensors", [1, 2, 3], b"")
    expect(errors.HeaderInvalid, ckpt, "not an object")


def test_entry_missing_fields(ckpt):
    edit_header(ckpt / "model.safetensors", lambda h: h[TENSOR].pop("shape"))
    expect(errors.HeaderInvalid, ckpt, TENSOR)


def test_unknown_dtype(ckpt):
    edit_header(ckpt / "model.safetensors", lambda h: h[TENSOR].update(dtype="C64"))
    expect(errors.UnsupportedDtype, ckpt, TENSOR, "C64")


def test_integer_weight_dtype(ckpt):
    def to_i32(h):  # same byte length, a dtype no weight may have
        h[TENSOR]["dtype"] = "I32"
    edit_header(ckpt / "model.safetensors", to_i32)
    expect(errors.UnsupportedDtype, ckpt, TENSOR, "I32")


def test_offsets_out_of_bounds(ckpt):
    edit_header(ckpt / "model.safetensors", lambda h: h[TENSOR].update(data_offsets=[10**9, 10**9 + 6144]))
    expect(errors.TensorOutOfBounds, ckpt, TENSOR)


def test_overlapping_tensors(ckpt):
    def overlap(h):
        h[TENSOR.replace("q_proj", "o_proj")]["data_offsets"] = list(h[TENSOR]["data_offsets"])  # same size
    edit_header(ckpt / "model.safetensors", overlap)
    expect(errors.TensorOverlap, ckpt, "overlap")


def test_size_mismatch(ckpt):
    edit_header(ckpt / "model.safetensors", lambda h: h[TENSOR].update(shape=[48, 47]))
    expect(errors.TensorSizeMismatch, ckpt, TENSOR)


def test_missing_tensor(ckpt):
    def drop(h):
        del h["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    edit_header(ckpt / "model.safetensors", drop)
    expect(errors.TensorMissing, ckpt, "experts.3.w2")


def test_wrong_shape_for_config(ckpt):
    rewrite_config(ckpt, lambda c: c.update(intermediate_size=41))
    expect(errors.TensorShapeMismatch, ckpt, "model.safetensors", "w1", "[40, 48]", "[41, 48]")


def test_writer_roundtrip_and_alignment(tmp_path):
    t = {"a": np.arange(5, dtype=np.float32), "b": np.arange(6, dtype=np.uint16).reshape(2, 3),
         "c": np.ones((3,), np.float16)}
    write_safetensors(tmp_path / "x.safetensors", t, {"k": "v"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.data_begin % 8 == 0 and f.metadata == {"k": "v"}
    assert f.entries["b"].dtype == "BF16"
    for k, v in t.items():
        np.testing.assert_array_equal(f.read(k), v)
    with pytest.raises(errors.TensorMissing):
        f.read("zzz")


def test_never_unpickles_even_beside_safetensors(ckpt):
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04garbage that would crash pickle")
    assert open_checkpoint(str(ckpt)).has(TENSOR)


def test_our_files_and_the_reference_librarys_read_each_other(tmp_path):
    """The safetensors library (a test dependency) and storage/safetensors.py agree on the
    format, both ways, for every dtype colibri writes."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from colibri.storage.safetensors import SafetensorsFile, write_safetensors

    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal(7).astype(np.float16),
               "i8": rng.integers(-128, 127, (4, 4)).astype(np.int8), "u8": rng.integers(0, 255, 9).astype(np.uint8),
               "empty": np.zeros((0, 4), np.float32)}  # a zero in the shape (e.g. no shared experts): no bytes
    write_safetensors(str(tmp_path / "ours.safetensors"), tensors)
    theirs = load_file(str(tmp_path / "ours.safetensors"))
    assert set(theirs) == set(tensors) and all(np.array_equal(theirs[k], v) for k, v in tensors.items())
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    f = SafetensorsFile(str(tmp_path / "theirs.safetensors"))
    assert all(np.array_equal(f.read(k), v) for k, v in tensors.items())
