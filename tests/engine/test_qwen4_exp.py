"""Qwen4-Exp (engine/models/qwen4_exp.py) beyond the shared family suites: its n-grams are
transformers' own (hashed alike, never across an end of sequence), prompts full of ends of
sequence run as transformers runs them, and the sharded tables read as one table each."""

import numpy as np
import pytest
import torch
from test_families import hf_greedy, our_greedy

from hf_models import build, load_model, logits_atol


@pytest.mark.parametrize("case", ["ple_qsa_hc2", "hc3_sigmoid_gate_ngram4"])
def test_the_ngram_rows_are_transformers_own(tmp_path, case):
    """Layer by layer, the table rows colibri's hash picks hold the embeddings transformers'
    NGramEmbedding returns, for a prompt with ends of sequence at its start, inside, twice in
    a row and at its end, whole and then a token at a time."""
    from colibri.engine.models.qwen4_exp import NGramHash

    ref = build("qwen4_exp", case, tmp_path, seed=3)
    ours = load_model(str(tmp_path))
    eos = ours.args.eos
    ids = np.array([eos, 7, 9, 11, eos, 13, 17, eos, eos, 19, 23, 29, 31, eos], np.int64)
    for il, k in ours.ple_rows.items():
        module = ref.model.layers[il].ple.ple_embedding
        with torch.no_grad():
            want = module(torch.tensor(ids)[None], None)[0].numpy()  # [T, E]
        h = NGramHash(ours.args, k)
        rows = h.ids(np.concatenate([[eos] * (ours.args.ngram_size - 1), ids]), eos, len(ids))
        np.testing.assert_array_equal(ours.layers[il]["ple_table"][rows].reshape(len(ids), -1), want)
        assert h.rows == module.ngram_embedding.weight.shape[0]


@pytest.mark.parametrize("case", ["ple_qsa_hc2", "hc3_sigmoid_gate_ngram4"])
def test_a_prompt_of_several_documents_runs_as_transformers(tmp_path, case):
    ref = build("qwen4_exp", case, tmp_path, seed=8)
    ours = load_model(str(tmp_path))
    eos = ours.args.eos
    rng = np.random.default_rng(8)
    ids = np.concatenate([rng.integers(7, 60, 9), [eos], rng.integers(7, 60, 4), [eos, eos], rng.integers(7, 60, 6)])
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    assert np.abs(ours.forward(ids, ours.new_cache(64), all_logits=True) - want).max() <= logits_atol("qwen4_exp")
    assert our_greedy(ours, ids, 24) == hf_greedy(ref, ids, 24)


def test_shards_of_the_wrong_size_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from colibri.storage.errors import TensorShapeMismatch

    build("qwen4_exp", "ple_qsa_hc2", tmp_path, seed=1)
    f = str(tmp_path / "model.safetensors")
    t = load_file(f)
    name = "model.layers.2.ple.ple_embedding.ngram_embedding.shard_3.weight"
    t[name] = t[name][:-1].contiguous()
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(TensorShapeMismatch, match="shards of 'model.layers.2.ple.ple_embedding.ngram_embedding.weight' "
                                                  "hold 311 rows; the config implies 312"):
        load_model(str(tmp_path))


def test_the_ngram_tables_streamed_under_a_budget_of_a_few_rows_give_the_same_bits(tmp_path):
    """A container keeps each n-gram table in its dense file with a crc32 per 4 KiB page;
    placed with a table budget of one page, the tables are never read in: each step reads
    the pages its tokens' n-grams index (a step ahead of the layers that take them), and the
    logits and tokens are the resident tables' bits. The bytes read per token are reported."""
    from test_published import to_container

    from colibri.storage.tables import PAGE, StreamedTable

    build("qwen4_exp", "ple_qsa_hc2", tmp_path / "hf", seed=5, vocab_size=101, ngram_vocab_size_base=5000,
          ple_embed_dim=64)  # (tables of 20,000 rows x 16 floats: 80 pages each)
    to_container(tmp_path / "hf", tmp_path / "c")
    ids = np.random.default_rng(5).integers(4, 101, 21)
    resident = load_model(str(tmp_path / "c"), budget="min", table_budget="all")
    streamed = load_model(str(tmp_path / "c"), budget="min", table_budget=PAGE)
    assert isinstance(streamed.layers[0]["ple_table"], StreamedTable) and streamed.tables.budget_pages == 1
    want = resident.forward(ids, resident.new_cache(64), all_logits=True)
    np.testing.assert_array_equal(streamed.forward(ids, streamed.new_cache(64), all_logits=True), want)
    assert our_greedy(streamed, ids, 16) == our_greedy(resident, ids, 16)
    st = streamed.tables.stats()
    assert st["resident_bytes"] <= PAGE and st["bytes_read"] > 0
    per_token = st["bytes_read"] / (2 * len(ids) + 16)
    assert per_token <= len(streamed.ple_rows) * 4 * 2 * PAGE  # (4 rows a layer: at most two pages each)
    print(f"table bytes read per token: {per_token:.0f}, hit rate {st['hit_rate']}")


def test_by_default_the_tables_stream_and_a_table_budget_must_fit_the_box(tmp_path):
    """Without a table budget the tables are never read in at start: their cache may grow
    to all their pages (these fit in a quarter of the available memory), read as tokens
    index them; `all` reads them in. A table budget above this box's RAM is refused naming
    the tables, and an expert budget that does not fit beside the table cache says that it
    is the tables that take the room."""
    from test_published import to_container

    from colibri.storage.container import open_container
    from colibri.storage.errors import BudgetInvalid
    from colibri.storage.memory import ram_bytes
    from colibri.storage.placement import streamed_table_bytes
    from colibri.storage.tables import StreamedTable

    build("qwen4_exp", "ple_qsa_hc2", tmp_path / "hf", seed=5, vocab_size=101, ngram_vocab_size_base=5000,
          ple_embed_dim=64)
    to_container(tmp_path / "hf", tmp_path / "c")
    total = streamed_table_bytes(open_container(str(tmp_path / "c")))
    assert total >= 2 * 20000 * 16 * 2
    model = load_model(str(tmp_path / "c"), budget="min")
    assert isinstance(model.layers[0]["ple_table"], StreamedTable)
    st = model.tables.stats()
    assert st["budget_bytes"] == total // 4096 * 4096 and st["bytes_read"] == 0
    ids = np.random.default_rng(6).integers(4, 101, 9)
    resident = load_model(str(tmp_path / "c"), budget="min", table_budget="all")
    assert resident.tables is None and not isinstance(resident.layers[0]["ple_table"], StreamedTable)
    assert our_greedy(model, ids, 8) == our_greedy(resident, ids, 8)
    assert 0 < model.tables.stats()["bytes_read"] <= total + 4096 * len(model.tables.tables)
    with pytest.raises(BudgetInvalid, match="the embedding tables' cache"):
        load_model(str(tmp_path / "c"), budget="min", table_budget=2 * ram_bytes())
    big = int(0.6 * ram_bytes())  # (fits the box alone: a budget, not memory taken at start)
    assert load_model(str(tmp_path / "c"), budget="min", table_budget=big).tables.stats()["budget_bytes"] > 0
    with pytest.raises(BudgetInvalid, match="for the embedding tables"):
        load_model(str(tmp_path / "c"), budget=ram_bytes() // 2, table_budget=big)


def test_a_table_page_that_does_not_match_its_checksum_is_named(tmp_path):
    import json

    from test_published import to_container

    from colibri.storage.errors import ExpertReadError
    from colibri.storage.tables import PAGE

    build("qwen4_exp", "ple_qsa_hc2", tmp_path / "hf", seed=5, ngram_vocab_size_base=5000, ple_embed_dim=64)
    to_container(tmp_path / "hf", tmp_path / "c")
    spec = json.load(open(tmp_path / "c" / "colibri.json"))["tables"]
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    with open(tmp_path / "c" / "dense.safetensors", "r+b") as f:  # every byte of the table's pages flipped
        f.seek(spec[name]["begin"])
        data = bytearray(f.read(spec[name]["end"] - spec[name]["begin"]))
        f.seek(spec[name]["begin"])
        f.write(bytes(b ^ 0xFF for b in data))
    model = load_model(str(tmp_path / "c"), budget="min", table_budget=4 * PAGE, verify="off")
    with pytest.raises(ExpertReadError, match="of table 'model.layers.0.ple.ple_embedding.ngram_embedding.weight' "
                                              r"cannot be read: primary: checksum mismatch \(2 tries\)"):
        model.forward(np.array([5, 6, 7]), model.new_cache(8))


def test_the_tables_share_the_experts_drives_and_a_damaged_page_is_read_from_the_copy(tmp_path, monkeypatch):
    """`colictl drives stage` copies the dense file's header and table pages too (the dense
    weights between stay holes) and `drives verify` reads them back; with the copy as a
    second drive, the table pages are read by the experts' reader, each page from the drive
    its unit hashes to (both drives get some), and pages damaged on the container's own
    drive are read from the copy: the resident tables' bits. A damaged page on the copy is
    what verify names."""
    import os

    from test_published import to_container

    from colibri.storage import drives as drives_module
    from colibri.storage.container import ExpertRecord, open_container
    from colibri.storage.reader import TABLE_LAYER
    from colibri.storage.staging import stage, verify
    from colibri.storage.tables import PAGE, TablePages

    monkeypatch.setattr(drives_module, "STRIPE_BYTES", 1)  # (a unit of one record: the table pages spread)
    build("qwen4_exp", "ple_qsa_hc2", tmp_path / "hf", seed=5, vocab_size=101, ngram_vocab_size_base=5000,
          ple_embed_dim=64)
    to_container(tmp_path / "hf", tmp_path / "c")
    c = open_container(str(tmp_path / "c"))
    assert "dense.safetensors" in stage(c, str(tmp_path / "d1"))["copied"]
    assert verify(c, str(tmp_path / "d1"))["bad"] == 0
    source, copy = tmp_path / "c" / "dense.safetensors", tmp_path / "d1" / "dense.safetensors"
    spans = TablePages(c).spans()
    with open(source, "rb") as a, open(copy, "rb") as b:  # the tables' pages copied, a weight between not
        for begin, end in spans:
            a.seek(begin), b.seek(begin)
            assert a.read(end - begin) == b.read(end - begin)
        gap = spans[0][0] - PAGE
        a.seek(gap), b.seek(gap)
        assert b.read(PAGE) == bytes(PAGE) != a.read(PAGE)

    ids = np.random.default_rng(5).integers(4, 101, 21)
    resident = load_model(str(tmp_path / "c"), budget="min", table_budget="all")
    want = resident.forward(ids, resident.new_cache(64), all_logits=True)
    streamed = load_model(str(tmp_path / "c"), budget="min", table_budget=PAGE, drives=(str(tmp_path / "d1"),))
    reader = streamed.tables.reader
    assert reader is streamed.experts.reader  # (one reader: the experts' drives and threads)
    pages = [p for begin, end in spans for p in range(begin // PAGE, end // PAGE)]
    firsts = {reader.drives.first(ExpertRecord(TABLE_LAYER, p, str(source), p * PAGE, PAGE, 0)).index for p in pages}
    assert firsts == {0, 1}
    with open(source, "r+b") as f:  # every table page on the container's own drive damaged
        for begin, end in spans:
            f.seek(begin)
            data = f.read(end - begin)
            f.seek(begin)
            f.write(bytes(x ^ 0x5A for x in data))
    np.testing.assert_array_equal(streamed.forward(ids, streamed.new_cache(64), all_logits=True), want)
    d0, d1 = reader.drives.describe()
    assert d0["errors"] > 0 and d1["bytes"] > 0 and d1["errors"] == 0

    with open(copy, "r+b") as f:  # a page damaged on the copy: verify names it
        f.seek(spans[-1][0])
        f.write(b"\xff" * 16)
    got = verify(c, str(tmp_path / "d1"))
    assert got["bad"] == 1 and "does not match its checksum" in got["files"]["dense.safetensors"][0]
    os.remove(copy)
    assert verify(c, str(tmp_path / "d1"))["files"]["dense.safetensors"] == "missing"


def test_the_image_text_checkpoint_runs_its_text_model_and_never_reads_the_vision_tower(tmp_path):
    """Qwen4ExpForConditionalGeneration saved by transformers: the text model under
    model.language_model.* (its tables sharded there too), the vision tower under
    model.visual.*: colibri's logits are the image-text model's on text, reading far less
    than the vision tower's bytes."""
    import transformers

    from hf_models import CASES, image_text, runs_its_text_model

    text = dict(dict(CASES["qwen4_exp"])["ple_qsa_hc2"], bos_token_id=None, pad_token_id=None)
    vision = dict(depth=2, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=16, patch_size=4, temporal_patch_size=2)
    ref = image_text("Qwen4ExpForConditionalGeneration", transformers.Qwen4ExpConfig(
        text_config=text, vision_config=vision), tmp_path / "hf")
    runs_its_text_model(ref, tmp_path / "hf", "qwen4_exp", "visual", 5 << 20,
                        np.random.default_rng(2).integers(4, 101, 19))
