"""Two Ray boxes against one (issue 26): the decode benchmark's model at a disk-bound expert
budget, from one box and from a local Ray cluster of two nodes (each with its own copy of
the container), with the design's arithmetic (docs/scale-out.md) recomputed from the
measured call latency for real networks.

    python bench/scale_out.py [--expert-gb 2] [--budget 0.1] [--tokens 24] [--prompt-tokens 16]

Both nodes run on this machine and share its disk and cores, so the two-box figure here
measures what scale-out costs (calls, serialisation), not what a second disk and RAM give;
the predicted rows say what separate boxes on 1, 10 and 25 GbE would give. JSON: per setup
tok/s, bytes read per box, rows sent, per-layer call latency p50/p99 (the box's reads and
compute included), and a bare call's latency (the predicted rows use it).
"""

import argparse
import os
import shutil
import sys
import tempfile

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)  # before numpy loads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import provenance  # noqa: E402
from decode import drop_caches, run  # noqa: E402
from synthetic import build, prompt  # noqa: E402

from colibri.daemon.scaleout import RayExperts  # noqa: E402
from colibri.engine import layers  # noqa: E402
from colibri.engine.registry import build_model  # noqa: E402
from colibri.storage.container import open_container  # noqa: E402
from colibri.storage.placement import Placement, open_model  # noqa: E402

LINKS_GBS = {"1 GbE": 0.125, "10 GbE": 1.25, "25 GbE": 3.125}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--expert-gb", type=float, default=2.0)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    a = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    path = build(a.workdir, a.expert_gb)
    layers.init()
    ids = prompt(np.random.default_rng(7), a.prompt_tokens)
    copy = tempfile.mkdtemp(prefix="colibri-box1-")
    shutil.rmtree(copy)
    shutil.copytree(path, copy)
    rows = []
    try:
        c = open_container(path)
        budget = int(c.expert_bytes * a.budget)  # each box's own RAM: two boxes pool twice as much
        drop_caches()
        one = open_model(path, Placement(budget=budget), build_model)
        r = run(one.model, ids, a.tokens, seed=1)
        rows.append({"setup": "one box", "tok_s": round((r["n"] - 1) / r["stats"]["decode_s"], 3),
                     "bytes_read_per_token": int(r["decode_st"].bytes_read / max(1, r["n"] - 1))})
        one.control.close()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1, resources={"box1": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            drop_caches()
            two = open_model(path, Placement(budget=budget), build_model)
            m = two.model
            spec = {"path": copy, "resources": {"box1": 0.5}, "threads": 1}  # the machine's 2 cores: one each
            m.experts = RayExperts(two.control, [spec], m.moe_layers, np.ones((len(m.moe_layers), m.n_expert)),
                                   budget)  # capacities measured
            r = run(m, ids, a.tokens, seed=1)
            boxes = m.experts.describe_boxes()
            st = r["decode_st"]
            rows.append({"setup": "two boxes (one machine)", "tok_s": round((r["n"] - 1) / r["stats"]["decode_s"], 3),
                         "head_bytes_read_per_token": int(st.bytes_read / max(1, r["n"] - 1)), "boxes": boxes})
            import time

            bare = []
            for _ in range(50):  # a call's own cost: the box's counters, no read or compute
                t = time.perf_counter()
                ray.get(m.experts.boxes[1].actor.stats.remote())
                bare.append(time.perf_counter() - t)
            lat = float(np.median(bare))
        finally:
            ray.shutdown()
            cluster.shutdown()
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    d = m.args.hidden_size
    k = m.n_expert_used
    net_bytes = len(m.moe_layers) * (k + 1) * d * 4
    predicted = {link: {"network_s_per_token": round(net_bytes / (gbs * 1e9) + len(m.moe_layers) * lat, 5)}
                 for link, gbs in LINKS_GBS.items()}
    print(provenance.dumps({"benchmark": "scale_out", "container": path, "record_bytes": c.record_bytes,
                      "budget_fraction": a.budget, "tokens": a.tokens, "bare_call_latency_s_p50": round(lat, 5),
                      "network_bytes_per_token": net_bytes, "predicted_network_cost": predicted, "results": rows},
                     indent=2))


if __name__ == "__main__":
    main()
