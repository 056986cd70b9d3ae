"""Experts on another box through Ray (daemon/scaleout.py, docs/scale-out.md): a local
Ray cluster of a head and a second node process, each with its own directory as its
disk; tokens identical to the single box at the minimum budget; the second node killed
mid-request loses no request and changes no token, and its node back, the box rejoins; a
box of another CPU target is kept out; the assignment follows capacity on a skewed
routing, measured capacities balance the boxes' time."""

import shutil

import numpy as np
import pytest

from colibri.daemon import scaleout
from colibri.daemon.scaleout import RayExperts, assign, box_seconds, describe_host, differs
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.placement import Placement, open_model

from hf_models import CASES, build_container

ray = pytest.importorskip("ray")


def zipf_shares(seed=3):
    shares = np.random.default_rng(seed).permutation(np.arange(1, 513) ** -0.8).reshape(8, 64)
    return shares / shares.sum()  # Zipf-like: the top 5 % of the experts take 40 % of the traffic


def test_the_assignment_follows_capacity_on_skewed_routing():
    shares = zipf_shares()
    owner = assign(shares, [1.0, 2.0, 1.0])
    traffic = [shares[owner == b].sum() for b in range(3)]
    assert np.allclose(traffic, [0.25, 0.5, 0.25], atol=0.05), traffic  # the stated tolerance: 5 points
    assert set(np.unique(owner)) == {0, 1, 2}
    # box 1 leaves: only its experts move, onto the others in proportion
    after = assign(shares, [1.0, 0.0, 1.0], owner)
    assert not np.any(after == 1) and np.all(after[owner != 1] == owner[owner != 1])
    traffic = [shares[after == b].sum() for b in (0, 2)]
    assert np.allclose(traffic, [0.5, 0.5], atol=0.05), traffic


def test_measured_capacities_balance_the_boxes_time():
    shares = zipf_shares()
    box = {"disk_gbs": 1.0, "memory_gbs": 10.0, "threads": 2, "slots": 4}
    figures = [box, box | {"disk_gbs": 3.0}, box | {"slots": 32}, None]  # a faster drive; more RAM; a box out
    owner = assign(shares, figures)
    assert not np.any(owner == 3)
    experts = [int(np.sum(owner == b)) for b in range(3)]  # a faster drive's misses are cheaper; more RAM: more hits
    assert experts[1] > 1.5 * experts[0] and experts[2] > 1.5 * experts[1], experts
    seconds = box_seconds(shares, figures, owner)[:3]  # its misses from its drive, everything through its memory
    assert seconds.max() / seconds.min() < 1.15, seconds
    even = box_seconds(shares, figures, assign(shares, [1.0, 1.0, 1.0, None]))[:3]  # what equal weights would do
    assert seconds.max() < 0.8 * even.max(), (seconds, even)


def test_a_box_of_another_cpu_target_is_named():
    head = describe_host()
    assert differs(head, dict(head)) is None
    assert "CPU target" in differs(head, head | {"cpu": "generic"})
    other = head | {"features": head["features"].replace("+avx2", "-avx2").replace("+sse2", "-sse2")}
    assert "NUMBA_CPU_NAME" in differs(head, other) and "colibri" in differs(head, head | {"colibri": "0.0.1"})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    node = c.add_node(num_cpus=1, resources={"box1": 1})
    ray.init(address=c.address, log_to_driver=False)
    yield c, node
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    import subprocess
    import sys

    from colibri.storage.demo import write_demo_model

    root = tmp_path_factory.mktemp("scaleout")
    demo = write_demo_model(root / "demo")
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", str(demo), str(root / "head")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    shutil.copytree(root / "head", root / "box1")  # the second box's own disk
    return root


def greedy(model, tokens=16, after=None):
    out = []
    for e in generate(model, list(range(3, 30)), SamplingParams(max_tokens=tokens)):
        if e.kind == "token":
            out.append(e.token_id)
            if after is not None and len(out) == 2:
                after()
    return out


def placed_on_two_boxes(container, **box):
    placed = open_model(str(container / "head"), Placement(budget="min"), build_model)
    model = placed.model
    spec = {"path": str(container / "box1"), "resources": {"box1": 0.5}, "threads": 1} | box
    shares = np.ones((len(model.moe_layers), model.n_expert))
    model.experts = RayExperts(placed.control, [spec], model.moe_layers, shares, "min", weights=[1.0, 1.0])
    return model


def test_two_boxes_give_the_single_boxs_tokens(cluster, container):
    alone = open_model(str(container / "head"), Placement(budget="min"), build_model).model
    want = greedy(alone)
    model = placed_on_two_boxes(container)
    assert greedy(model) == want
    boxes = model.experts.describe_boxes()
    assert boxes[1]["rows_sent"] > 0 and boxes[1]["in_use"] and boxes[1]["latency_ms_p50"] > 0
    assert 0.3 < boxes[1]["experts_share"] < 0.7 and boxes[1]["bytes_read"] > 0 and boxes[1]["disk_gbs"] > 0


@pytest.mark.parametrize("family", list(CASES))
def test_every_family_is_token_exact_on_two_boxes(cluster, tmp_path, family):
    c = build_container(tmp_path, family, CASES[family][0][0], seed=11)  # the family's first case
    shutil.copytree(tmp_path / "c", tmp_path / "box1")
    root = tmp_path / "two"
    root.mkdir()
    (root / "head").symlink_to(tmp_path / "c")
    (root / "box1").symlink_to(tmp_path / "box1")
    ids = list(range(3, 20))

    def tokens(model):
        return [e.token_id for e in generate(model, ids, SamplingParams(max_tokens=10)) if e.kind == "token"]

    want = tokens(open_model(c.path, Placement(budget="min"), build_model).model)
    model = placed_on_two_boxes(root)
    assert tokens(model) == want and model.experts.describe_boxes()[1]["rows_sent"] > 0


def test_a_box_that_dies_mid_request_loses_nothing_and_rejoins(cluster, container, monkeypatch):
    import time

    c, node = cluster
    monkeypatch.setattr(scaleout, "REJOIN_S", (0.5, 1.0))
    alone = open_model(str(container / "head"), Placement(budget="min"), build_model).model
    want = greedy(alone, 24)
    model = placed_on_two_boxes(container)
    got = greedy(model, 24, after=lambda: c.remove_node(node))  # the second box dies after two tokens
    assert got == want
    boxes = model.experts.describe_boxes()
    assert not boxes[1]["in_use"] and boxes[1]["out_why"] and boxes[1]["experts_share"] == 0
    assert greedy(model, 24) == want  # out: all on the head, while the box is started again in vain
    c.add_node(num_cpus=1, resources={"box1": 1})  # its node is back
    deadline = time.monotonic() + 120
    while not model.experts.describe_boxes()[1]["in_use"] and time.monotonic() < deadline:
        greedy(model, 2)  # steps tend the boxes
        time.sleep(0.2)
    sent = model.experts.describe_boxes()[1]["rows_sent"]
    assert greedy(model, 24) == want
    boxes = model.experts.describe_boxes()
    assert boxes[1]["in_use"] and boxes[1]["experts_share"] > 0.3 and boxes[1]["rows_sent"] > sent


def test_a_box_of_another_cpu_target_is_kept_out(cluster, container):
    c, _ = cluster
    if not any(n["Alive"] and n["Resources"].get("box1") for n in ray.nodes()):
        c.add_node(num_cpus=1, resources={"box1": 1})
    alone = open_model(str(container / "head"), Placement(budget="min"), build_model).model
    model = placed_on_two_boxes(container, env={"NUMBA_CPU_NAME": "generic"})  # its kernels: other bits
    boxes = model.experts.describe_boxes()
    assert not boxes[1]["in_use"] and "CPU target is generic" in boxes[1]["out_why"]
    assert boxes[0]["experts_share"] == 1.0
    assert greedy(model, 8) == greedy(alone, 8)
    model.experts.close()


def test_the_daemon_places_experts_on_ray_and_reports_the_boxes(cluster, container, tmp_path):
    import json
    import subprocess
    import sys

    from daemons import colibrid

    c, _ = cluster
    if not any(n["Alive"] and n["Resources"].get("box1") for n in ray.nodes()):
        c.add_node(num_cpus=1, resources={"box1": 1})  # (a test before may have killed it)
    cfg = tmp_path / "ray.yaml"
    cfg.write_text(f"expert_cache: min\nplacement: ray\nray_address: {c.address}\n"
                   f"ray_boxes: [{{path: {container / 'box1'}, resources: {{box1: 0.5}}, threads: 1}}]\n")
    with colibrid(tmp_path, container / "head", cfg.read_text()) as sock:
        run = [sys.executable, "-m", "colibri.ctl", "--socket", sock]
        r = subprocess.run(run + ["generate", "--json", "--max-tokens", "12", "Once upon a time"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        status = json.loads(subprocess.run(run + ["status", "--json"], capture_output=True, text=True).stdout)
        boxes = status["boot"]["boxes"]
        assert [b["box"] for b in boxes] == [0, 1] and all(b["disk_gbs"] > 0 and b["in_use"] for b in boxes)
        assert abs(sum(b["traffic_share"] for b in boxes) - 1) < 1e-3  # measured capacities, no weights
        text = subprocess.run(run + ["status"], capture_output=True, text=True).stdout
        assert "box 1 " in text and "% of the traffic" in text, text
        stats = json.loads(subprocess.run(run + ["stats", "--json"], capture_output=True, text=True).stdout)
        assert stats["boxes"][1]["rows_sent"] > 0 and stats["boxes"][1]["bytes_read"] > 0
