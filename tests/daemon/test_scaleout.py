"""Experts on another box through Ray (daemon/scaleout.py, docs/scale-out.md): a local
Ray cluster of a head and a second node process, each with its own directory as its
disk; tokens identical to the single box at the minimum budget; the second node killed
mid-request loses no request and changes no token; the assignment follows capacity on a
skewed routing."""

import shutil

import numpy as np
import pytest

from colibri.daemon.scaleout import RayExperts, assign, start_workers
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.storage.placement import Placement, open_model

ray = pytest.importorskip("ray")


def test_the_assignment_follows_capacity_on_skewed_routing():
    rng = np.random.default_rng(3)
    shares = rng.permutation(np.arange(1, 513) ** -0.8).reshape(8, 64)  # Zipf-like: the top 5 % take 40 %
    shares /= shares.sum()
    owner = assign(shares, [1.0, 2.0, 1.0])
    traffic = [shares[owner == b].sum() for b in range(3)]
    assert np.allclose(traffic, [0.25, 0.5, 0.25], atol=0.05), traffic  # the stated tolerance: 5 points
    assert set(np.unique(owner)) == {0, 1, 2}


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


def placed_on_two_boxes(container):
    placed = open_model(str(container / "head"), Placement(budget="min"), build_model)
    model = placed.model
    workers = start_workers([{"path": str(container / "box1"), "resources": {"box1": 0.5}}], "min")
    owner = assign(np.ones((len(model.moe_layers), model.n_expert)), [1.0, 1.0])
    model.experts = RayExperts(placed.control, workers, owner, model.moe_layers)
    return model


def test_two_boxes_give_the_single_boxs_tokens(cluster, container):
    alone = open_model(str(container / "head"), Placement(budget="min"), build_model).model
    want = greedy(alone)
    model = placed_on_two_boxes(container)
    assert greedy(model) == want
    boxes = model.experts.boxes()
    assert boxes[1]["rows_sent"] > 0 and boxes[1]["in_use"] and boxes[1]["latency_ms_p50"] > 0
    assert 0.3 < boxes[1]["experts_share"] < 0.7


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "glm4_moe"])
def test_other_families_are_token_exact_on_two_boxes(cluster, tmp_path, family):
    from hf_models import CASES, build_container

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
    assert tokens(model) == want and model.experts.boxes()[1]["rows_sent"] > 0


def test_a_box_that_dies_mid_request_loses_nothing(cluster, container):
    c, node = cluster
    alone = open_model(str(container / "head"), Placement(budget="min"), build_model).model
    want = greedy(alone, 24)
    model = placed_on_two_boxes(container)
    got = greedy(model, 24, after=lambda: c.remove_node(node))  # the second box dies after two tokens
    assert got == want
    boxes = model.experts.boxes()
    assert not boxes[1]["in_use"] and boxes[1]["out_why"]


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
                   f"ray_boxes: [{{path: {container / 'box1'}, resources: {{box1: 0.5}}}}]\n")
    with colibrid(tmp_path, container / "head", cfg.read_text()) as sock:
        run = [sys.executable, "-m", "colibri.ctl", "--socket", sock]
        r = subprocess.run(run + ["generate", "--json", "--max-tokens", "12", "Once upon a time"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        status = json.loads(subprocess.run(run + ["status", "--json"], capture_output=True, text=True).stdout)
        assert [b["box"] for b in status["boot"]["boxes"]] == [0, 1]
        stats = json.loads(subprocess.run(run + ["stats", "--json"], capture_output=True, text=True).stdout)
        assert stats["boxes"][1]["rows_sent"] > 0 and stats["boxes"][1]["bytes_read"] > 0
