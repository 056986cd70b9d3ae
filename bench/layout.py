"""The co-activation layout against the expert-id order (issue 24, 4b): read requests per
token on the trace library's routing, with the real expert cache and reader.

    python bench/layout.py --library DIR [--budgets 0.1,0.25]

DIR is a trace library (`python bench/cache_policy.py --library DIR` writes one: a model
of each family's routing, each with a test trace and a warm-up trace). Per trace: the
co-activation order is learned from the warm-up trace (storage/layout.py, as `colictl
convert --layout coactivation --trace` does), then the test trace is replayed through the
real expert cache (bench/cache_policy.replay_cache) on a tiny container whose records are
in expert-id order, and on the same container with its index permuted into that order
(the same record bytes at other offsets: only adjacency changes); the reader coalesces
adjacent misses as it does in the daemon. Prints misses, read requests and requests per
token (the target: 30 % fewer with the co-activation layout).
"""

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from cache_policy import read_trace, replay_cache, shape_container  # noqa: E402

from colibri.storage.container import MANIFEST, open_container  # noqa: E402
from colibri.storage.layout import coactivation_order  # noqa: E402
from colibri.storage.policy import Policy  # noqa: E402


def reordered(container, order: dict[int, list[int]], out: str):
    """The container with each layer's experts at the offsets `order` gives them: the
    record at position p is the one expert p had, so its bytes and crc32 go with it."""
    os.makedirs(out)
    for name in os.listdir(container.path):
        if name != MANIFEST:
            os.symlink(os.path.join(container.path, name), os.path.join(out, name))
    m = json.load(open(os.path.join(container.path, MANIFEST)))
    by_key = {(r["layer"], r["expert"]): r for r in m["experts"]["index"]}
    index = []
    for il, ids in order.items():
        for pos, ie in enumerate(ids):
            index.append(by_key[(il, pos)] | {"expert": ie})
    m["experts"]["index"] = index
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(m, f)
    return open_container(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library", required=True, metavar="DIR")
    ap.add_argument("--budgets", default="0.1,0.25")
    a = ap.parse_args()
    rows = []
    tmp = tempfile.mkdtemp(prefix="colibri-layout-")
    names = sorted(n.removesuffix(".jsonl") for n in os.listdir(a.library)
                   if n.endswith(".jsonl") and not n.endswith("-warmup.jsonl"))
    for name in names:
        trace = read_trace(os.path.join(a.library, f"{name}.jsonl"))
        warm_path = os.path.join(a.library, f"{name}-warmup.jsonl")
        layers = sorted({il for _, il, _, _ in trace})
        n_expert = 1 + max(e for _, _, ex, _ in trace for e in ex)
        lengths = [len(ex) for _, _, ex, _ in trace]
        top_k = max(set(lengths), key=lengths.count)  # a decode step's (the prompt steps list their union)
        base = shape_container(len(layers), n_expert, top_k)
        # the warm-up trace's layers, as the container's (the replay maps them the same way)
        where = dict(zip(layers, base.moe_layers))
        mapped = os.path.join(tmp, f"{name}-warmup.jsonl")
        with open(warm_path) as src, open(mapped, "w") as dst:
            for line in src:
                d = json.loads(line)
                if d["layer"] in where:
                    dst.write(json.dumps({"layer": where[d["layer"]], "experts": d["experts"]}) + "\n")
        order, _ = coactivation_order(mapped, base.moe_layers, base.n_expert)
        coact = reordered(base, order, os.path.join(tmp, name))
        steps = len({s for s, _, _, _ in trace})
        for frac in map(float, a.budgets.split(",")):
            capacity = max(len(layers) * top_k, int(frac * len(layers) * n_expert))
            row = {"trace": name, "budget_fraction": frac, "steps": steps}
            for label, c in (("expert_id", base), ("coactivation", coact)):
                st = replay_cache(trace, capacity, c, top_k, Policy())
                row[label] = {"misses": st["misses"], "read_requests": st["read_requests"],
                              "requests_per_step": round(st["read_requests"] / steps, 2)}
            row["request_saving"] = round(1 - row["coactivation"]["read_requests"] / row["expert_id"]["read_requests"],
                                          3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    print(provenance.dumps({"benchmark": "layout", "library": os.path.abspath(a.library), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
