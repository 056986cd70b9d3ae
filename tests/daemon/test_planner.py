"""colictl plan and tune (daemon/planner.py): the box measured, the routing's hit rates,
the prediction's arithmetic, a plan of a container and of a checkpoint before conversion,
tune's configuration fragment, and the daemon's predicted-against-measured stats."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri.daemon.config import ConfigError, load
from colibri.daemon.planner import (
    DAEMON_STEP_S,
    OVERLAP,
    SAMPLE_BYTES,
    SampleExperts,
    Shape,
    hit_at,
    hit_curve,
    lru_hits,
    make_plan,
    measure_drive,
    pinned_hits,
    plan_path,
    predict,
    predicted_now,
    split_memory,
    trace_accesses,
)
from colibri.engine import moe
from colibri.engine.registry import build_model
from colibri.storage.experts import int4_of
from colibri.storage.layout import TraceInvalid
from colibri.storage.memory import PROCESS_BYTES
from colibri.storage.placement import sample_experts
from colibri.storage.sizes import parse_size
from colibri.storage.slots import min_budget_bytes

from hf_models import build, build_container

TINY = dict(num_experts=16, num_hidden_layers=3, hidden_size=64, moe_intermediate_size=64, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return build_container(tmp_path_factory.mktemp("plan"), "qwen3_moe", "basic", seed=8, **TINY)


def test_the_routing_decides_the_hit_rates():
    assert hit_curve(100, (0.1, 0.5, 1.0))["hits"] == {0.1: 0.1, 0.5: 0.5, 1.0: 1.0}  # uniform
    cyc = [(0, [i % 4], None) for i in range(40)]  # four experts in turn
    assert lru_hits(cyc, 3) == 0.0 and lru_hits(cyc, 4) == 0.9  # LRU thrashes below the loop, then hits
    assert pinned_hits(np.array([6.0, 3.0, 1.0]), 1) == 0.6
    curve = hit_curve(8, (0.375, 0.5), accesses=cyc)  # 3 slots: pinning three of four beats LRU's nothing
    assert curve["source"] == "trace" and curve["hits"] == {0.375: 0.75, 0.5: 1.0}  # (the steady state)
    counts = np.zeros((2, 4))
    counts[0, 0], counts[1, 3] = 9, 1
    assert hit_curve(8, (0.125,), counts=counts)["hits"] == {0.125: 0.9}  # the history's hottest expert
    ahead = [(0, [1, 2], [1, 3, 4]), (1, [5, 6], [5, 6]), (0, [1], None)]
    assert hit_curve(8, (0.5,), accesses=ahead)["waste"] == 1.0  # (2 + 0) / 2 predicted reads not used
    assert hit_at({"hits": {"0.1": 0.3, "0.5": 0.7}}, 0.3) == pytest.approx(0.5)


def test_an_int4_sample_takes_the_warm_caches_path(tmp_path):
    """A plan times a decode step on the path a warm cache's step takes (int4_hits: the
    experts' addresses, no views), and that path computes what the views' path computes."""
    q4 = build_container(tmp_path, "qwen3_moe", "basic", seed=5, convert_kw={"expert_dtype": "int4", "group_size": 32},
                         hidden_size=64, moe_intermediate_size=32)
    sample = SampleExperts(*sample_experts(q4, None, 3, SAMPLE_BYTES))  # (a container needs no model)
    il, ids = q4.moe_layers[1], [0, 4, 5]  # 4 and 5 wrap onto the sample's experts 1 and 2
    g, layouts, addrs = sample.int4_hits(il, ids)
    (batch,) = list(sample.stream(il, ids))
    assert g == 32 and [ie for ie, _ in batch] == ids
    assert addrs.tolist() == [np.frombuffer(int4_of(ew)[2], np.int64).tolist() for _, ew in batch]

    class ViewsOnly:  # the same sample declining int4_hits: every step through stream()'s views
        int4_group = sample.int4_group

        def __getattr__(self, name):
            return getattr(sample, name)

        def int4_hits(self, il, ids):
            return None

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    chosen, weights = np.array([ids]), rng.random((1, 3)).astype(np.float32)
    fast = moe.moe(x, chosen, weights, sample, il)
    assert np.array_equal(fast, moe.moe(x, chosen, weights, ViewsOnly(), il))
    assert not np.array_equal(fast, moe.moe(x, np.array([[0, 1, 3]]), weights, sample, il))


def test_the_prediction_is_the_slower_side_plus_part_of_the_other():
    shape = Shape(moe_layers=10, top_k=4, n_expert=64, record_bytes=1 << 20)
    p = predict(shape, compute_s=0.01, disk_gbs=1.0, hit=0.5, waste=1.0)
    assert p["bytes_read_per_token"] == 10 * 5 * 0.5 * (1 << 20)
    disk = p["bytes_read_per_token"] / 1e9  # 0.026 s
    assert p["bound"] == "disk"
    assert p["tok_s"] == pytest.approx(1 / (disk + OVERLAP * 0.01 + DAEMON_STEP_S), rel=1e-3)
    assert predict(shape, 0.05, 1.0, 1.0)["bound"] == "compute"
    assert predict(shape, 0.05, 1.0, 1.0)["tok_s"] == pytest.approx(1 / (0.05 + DAEMON_STEP_S), rel=1e-3)


def test_a_drive_is_measured_with_direct_reads(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(os.urandom(4 << 20))
    m = measure_drive([str(f)], 256 << 10, 2, 0.2)
    assert m["gbs"] > 0 and m["threads"] == 2 and m["latency_ms_p99"] >= m["latency_ms_p50"] > 0
    try:  # O_DIRECT as the file system allows it: the measure must say which reads it made
        os.close(os.open(f, os.O_RDONLY | os.O_DIRECT))
        direct = True
    except OSError:
        direct = False
    assert m["block_bytes"] == 256 << 10 and m["o_direct"] is direct


def test_a_plan_of_a_container_predicts_every_budget_and_recommends(container, tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"step": s, "layer": il, "experts": [s % 3, 5]}) + "\n"
                             for s in range(20) for il in container.moe_layers))
    p = make_plan(container.path, build_model, trace=str(trace), memory=4 << 30, seconds=0.2)
    assert p["precision"] == "f32" and list(p["precisions"]) == ["f32"] and p["container"] == container.fingerprint
    row = p["precisions"]["f32"]
    assert row["record_bytes"] == container.record_bytes and row["compute_s"] > 0 and row["fit_fraction"] == 1.0
    # 5 % of 3 x 16 experts is 2.4 slots, below one a layer: not a budget that runs, not shown
    assert [t["budget_fraction"] for t in row["table"]] == [0.1, 0.25, 0.5, 1.0]
    assert p["routing"]["source"] == "trace" and p["routing"]["hits"]["0.1"] > 0.1  # 4 hot experts of 48
    tok = [t["tok_s"] for t in row["table"]]
    assert tok == sorted(tok) and row["table"][-1]["bytes_read_per_token"] == 0
    rec = p["recommend"]
    drive = p["drives"][0]  # the fewest read threads that reach 95 % of the drive's best
    best = max(drive["by_threads"].values())
    assert rec["io_threads"] == min(int(n) for n, gbs in drive["by_threads"].items() if gbs >= 0.95 * best)
    assert rec["expert_cache"] == "all" and rec["reader"] in ("preadv", "io_uring") and rec["reader_note"]
    small = make_plan(container.path, build_model, memory=p["dense_bytes"] + PROCESS_BYTES + container.expert_bytes // 4,
                      seconds=0.2)
    assert small["precisions"]["f32"]["fit_fraction"] == pytest.approx(0.25, abs=0.01)
    assert small["recommend"]["expert_cache"].endswith("iB")
    with pytest.raises(TraceInvalid, match="not a routing trace line"):
        trace.write_text("{}\n")
        trace_accesses(str(trace), container.moe_layers, 16)


def test_the_plan_never_shows_or_recommends_a_budget_below_the_minimum(container):
    least = min_budget_bytes(len(container.moe_layers), container.record_bytes)
    for extra in (0, least // 2, container.expert_bytes // 40, container.expert_bytes // 3):
        p = make_plan(container.path, build_model, memory=PROCESS_BYTES + extra, seconds=0.1, kv_bytes=64 << 20)
        row, rec = p["precisions"]["f32"], p["recommend"]
        assert all(t["budget_bytes"] >= least for t in row["table"]), row["table"]
        if rec["fits"]:
            assert parse_size(rec["expert_cache"]) >= least and rec["kv_cache"] != "", rec
        else:  # the dense weights and the minimum do not fit: said, with what is missing
            assert "short" in rec["why"] and extra < least + p["dense_bytes"]
    assert split_memory(1 << 30, 0, 64 << 20, 100, 1 << 40)["kv"] == 64 << 20  # a quarter of the rest at most
    assert split_memory(PROCESS_BYTES + 1000, 0, 64 << 20, 100, 500) == {"experts": 500, "kv": 500, "tables": 0,
                                                                          "short": 0}
    # streamed tables: a quarter of what the experts' minimum leaves at most, before the others
    assert split_memory(PROCESS_BYTES + 1100, 0, 0, 100, 1 << 40, 1 << 40) == {"experts": 850, "kv": 0,
                                                                              "tables": 250, "short": 0}
    assert split_memory(PROCESS_BYTES + 1100, 0, 0, 100, 1 << 40, 40)["tables"] == 40


def test_a_model_with_streamed_tables_is_planned_with_them_streamed(tmp_path):
    """A Qwen4-Exp container's n-gram tables are not read in to plan it: the plan's dense
    bytes leave them out, their bytes are said apart, and the recommendation gives them a
    table_cache (all their bytes when memory is plenty, a quarter of what is left when not)."""
    from colibri.storage.placement import streamed_table_bytes

    c = build_container(tmp_path, "qwen4_exp", "ple_qsa_hc2", seed=5, vocab_size=101, ngram_vocab_size_base=5000,
                        ple_embed_dim=64)
    tables = streamed_table_bytes(c)
    p = make_plan(c.path, build_model, memory=4 << 30, seconds=0.1)
    assert p["table_bytes"] == tables and p["dense_bytes"] < c.dense_bytes - tables + 4096
    assert parse_size(p["recommend"]["table_cache"]) >= tables // 2**10 * 2**10
    least = min_budget_bytes(len(c.moe_layers), c.record_bytes)
    tight = make_plan(c.path, build_model, memory=p["dense_bytes"] + PROCESS_BYTES + least + tables, seconds=0.1)
    assert parse_size(tight["recommend"]["table_cache"]) <= tables // 4 + 1024


def test_a_checkpoint_is_planned_before_it_is_converted(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=9, **TINY)
    p = make_plan(str(tmp_path / "hf"), build_model, memory=4 << 30, seconds=0.2)
    assert p["container"] is None and p["precision"] == "f32"
    rows = p["precisions"]
    assert list(rows) == ["f32", "int8", "int4"] and [r["lossy"] for r in rows.values()] == [False, True, True]
    assert rows["f32"]["record_bytes"] > rows["int8"]["record_bytes"] > rows["int4"]["record_bytes"]
    assert "reader" not in p["recommend"] and p["recommend"]["precision"] == "f32"


def test_tune_writes_a_fragment_the_daemon_reads_and_keeps_the_plan(container, tmp_path, caplog):
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nio_threads: 7\nexpert_cache: min\n")
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "tune", "--model", container.path, "--config", str(cfg)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    frag = tmp_path / "colibri.yaml.d" / "50-tune.yaml"
    assert frag.exists() and "predicted" in frag.read_text()
    tuned = load(str(cfg))
    assert tuned.io_threads in (1, 2, 4) and tuned.expert_cache == "all"  # the fragment overrides the file
    plan = json.loads(open(plan_path(str(tmp_path / "state"), container.fingerprint)).read())
    now = predicted_now(plan, container.expert_bytes // 10)
    assert now["budget_fraction"] == pytest.approx(0.1, abs=0.01) and now["tok_s"] > 0
    (tmp_path / "colibri.yaml.d" / "60-bad.yaml").write_text("io_thread: 3\nmax_queue: 9\n")
    with caplog.at_level(logging.ERROR, "colibri"):
        again = load(str(cfg))  # a fragment's bad key is named and left out; its other keys apply
    assert again.io_threads == tuned.io_threads and again.max_queue == 9
    assert "60-bad.yaml: unknown key 'io_thread' (did you mean 'io_threads'?)" in caplog.text
    (tmp_path / "colibri.yaml").write_text("io_thread: 3\n")
    with pytest.raises(ConfigError, match="colibri.yaml: unknown key 'io_thread'"):  # the main file: strictly
        load(str(cfg))
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nio_threads: 7\nexpert_cache: min\n")
    shown = subprocess.run([sys.executable, "-m", "colibri.ctl", "plan", "--model", container.path],
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "recommended: expert_cache: all" in shown.stdout and "f32" in shown.stdout
