"""Experts on other boxes, on Ray (docs/scale-out.md).

Each expert box runs one ExpertWorker actor: an expert cache (storage/cache.py, the
daemon's own) over the box's copy of the container, computing the rows of a layer-step
it is sent with engine/layers.worker_rows (the same crew jobs as the head's moe(), each
row times its routing weight). The head's RayExperts is the model's expert source: it
streams the experts the head owns from its own cache, and its compute_into() (which moe()
calls instead of streaming everything) sends each box one call per layer-step with the
rows routed to its experts, computes its own meanwhile, and writes the boxes' rows into
the step's slots; moe() then sums the slots in its fixed order, so the tokens are a single
box's. A call that fails or times out is computed on the head from its own container and
the box leaves the assignment (its experts come home).

Ray is optional (`pip install 'colibri[ray]'`); nothing here imports it before a Ray
placement is asked for.
"""

import logging
import time
from collections import deque

import numpy as np

log = logging.getLogger("colibri.daemon")
CALL_TIMEOUT_S = 30.0  # a box that has not answered a layer-step by then is taken as failed


class ExpertWorker:
    """One box's experts (made remote by ray.remote in start_workers)."""

    def __init__(self, path: str, budget, io_threads: int = 2, threads: int = 0):
        from ..engine import layers
        from ..storage.cache import ExpertCache
        from ..storage.container import open_container

        self.c = open_container(path)
        self.cache = ExpertCache(self.c, budget, io_threads, top_k=1)
        layers.init(threads or None)
        self.calls = self.rows = 0

    def compute(self, il: int, parts: list, x: np.ndarray, w_flat: np.ndarray, prompt_rows: np.ndarray, A: int,
                clamped) -> tuple[np.ndarray, np.ndarray]:
        """parts [(expert, rows)] of layer il -> (rows, their outputs [n, D]) (see moe())."""
        from ..engine.layers import worker_rows

        rows_of = {ie: np.asarray(r) for ie, r in parts}
        self.cache.begin_step()
        ys = worker_rows(self.cache.stream(il, list(rows_of)), rows_of, x, A, w_flat, prompt_rows,
                         self.cache.int4_group, clamped)
        rows = np.concatenate(list(rows_of.values()))
        self.calls += 1
        self.rows += len(rows)
        return rows, ys[rows]

    def prefetch(self, il: int, ids: list) -> int:
        return self.cache.prefetch(il, ids)

    def stats(self) -> dict:
        st = self.cache.stats
        return {"bytes_read": st.bytes_read, "hits": st.hits, "misses": st.misses, "calls": self.calls,
                "rows": self.rows, "hit_rate": round(st.hits / st.experts, 4) if st.experts else None}


def assign(shares: np.ndarray, capacities: list[float]) -> np.ndarray:
    """Which box serves each expert: shares [L, E] (each expert's routed traffic), box
    capacities (bytes/s or any weight) -> owner [L, E]. Largest share first, each onto the
    box with the least load over capacity, so each box's traffic follows its capacity."""
    owner = np.zeros(shares.shape, np.int64)
    load = np.zeros(len(capacities))
    cap = np.asarray(capacities, float)
    for flat in np.argsort(-shares, axis=None, kind="stable"):
        b = int(np.argmin((load + shares.flat[flat]) / cap))
        owner.flat[flat] = b
        load[b] += shares.flat[flat]
    return owner


class RayExperts:
    """The head's expert source when boxes share the experts. `local`: the head's expert
    cache (box 0; it also computes whatever a failed box owned); `workers`: the boxes'
    actors (box 1...); `owner` [L, E]: which box serves each expert."""

    def __init__(self, local, workers: list, owner: np.ndarray, moe_layers: list[int]):
        self.local, self.workers = local, workers
        self.owner = owner
        self.row = {il: i for i, il in enumerate(moe_layers)}
        self.out: dict[int, str] = {}  # box -> why it left
        self.latency: dict[int, deque] = {b: deque(maxlen=1024) for b in range(1, len(workers) + 1)}
        self.rows_sent = {b: 0 for b in range(1, len(workers) + 1)}

    # ---- what the engine asks of any source -------------------------------------------------
    @property
    def stats(self):
        return self.local.stats

    @property
    def int4_group(self):
        return self.local.int4_group

    @property
    def lookahead(self):
        return self.local.lookahead

    def begin_step(self) -> None:
        self.local.begin_step()

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        self.local.layer_done(il, routed, moe_s)

    def stream(self, il: int, ids: list[int]):
        return self.local.stream(il, ids)

    def box_of(self, il: int, ie: int) -> int:
        b = int(self.owner[self.row[il], ie])
        return 0 if b in self.out else b

    def prefetch(self, il: int, ids: list[int]) -> int:
        mine = [ie for ie in ids if self.box_of(il, ie) == 0]
        for b, w in enumerate(self.workers, 1):
            theirs = [ie for ie in ids if self.box_of(il, ie) == b]
            if theirs:
                w.prefetch.remote(il, theirs)  # one way: the box reads ahead while the head attends
        return self.local.prefetch(il, mine) if mine else 0

    def compute_into(self, il, rows_of, x, w_flat, prompt_rows, A, ys, compute) -> None:
        """The step's experts of layer il: each box's by one call, the head's own meanwhile
        (`compute`: moe()'s own path), the boxes' rows written into ys. A box that fails is
        computed here instead, and leaves the assignment."""
        import ray

        by_box: dict[int, list] = {}
        for ie, rows in rows_of:
            by_box.setdefault(self.box_of(il, ie), []).append((ie, rows))
        calls = {b: (self.workers[b - 1].compute.remote(il, parts, x, w_flat, prompt_rows, A, None),
                     time.perf_counter()) for b, parts in by_box.items() if b}
        mine = by_box.get(0, [])
        if mine:
            self._local(il, mine, compute)
        for b, (ref, t0) in calls.items():
            try:
                rows, vals = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError) as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("expert box %d failed a call (%s): its experts come back to the head", b, why)
                self.out[b] = why
                self._local(il, by_box[b], compute)
                continue
            ys[rows] = vals
            self.latency[b].append(time.perf_counter() - t0)
            self.rows_sent[b] += len(rows)

    def _local(self, il: int, parts: list, compute) -> None:
        rows_of = dict(parts)
        for batch in self.local.stream(il, list(rows_of)):
            compute([(rows_of[ie], ew) for ie, ew in batch])

    def describe(self) -> dict:
        return self.local.describe() | {"boxes": self.boxes()}

    def layer_stats(self) -> list[dict]:  # (the head's own experts: the boxes count theirs, boxes(remote=True))
        return self.local.layer_stats()

    def expert_map(self) -> dict:
        return self.local.expert_map()

    def boxes(self, remote: bool = False) -> list[dict]:
        """Per box: its share of the experts, state, rows sent and call latency; with
        `remote`, each box's own counters too (bytes read, hit rate: asked of the actors,
        2 s at most)."""
        counters: dict[int, dict] = {}
        if remote:
            import ray

            for b, w in enumerate(self.workers, 1):
                if b not in self.out:
                    try:
                        counters[b] = ray.get(w.stats.remote(), timeout=2.0)
                    except (ray.exceptions.RayError, TimeoutError):
                        counters[b] = {"unreachable": True}
            st = self.local.stats
            counters[0] = {"bytes_read": st.bytes_read, "hit_rate": round(st.hits / st.experts, 4) if st.experts
                           else None}
        out = []
        for b in range(len(self.workers) + 1):
            share = float(np.mean(self.owner == b))
            row = {"box": b, "experts_share": round(share, 4), "in_use": b not in self.out}
            if b:
                lat = sorted(self.latency[b])
                row |= {"rows_sent": self.rows_sent[b], "out_why": self.out.get(b),
                        "latency_ms_p50": round(1e3 * lat[len(lat) // 2], 3) if lat else None,
                        "latency_ms_p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)
                        if lat else None}
            out.append(row | counters.get(b, {}))
        return out

    def close(self) -> None:
        self.local.close()


def start_workers(boxes: list[dict], budget, io_threads: int = 2) -> list:
    """One ExpertWorker per box: {"path": its container copy, and "node" (the node's IP)
    or "resources" ({name: amount} only that node has) to pin the actor there}. Ray must be
    initialised (ray.init). Raises ColibriError for a node the cluster does not have."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..storage.errors import ColibriError

    actor = ray.remote(ExpertWorker)
    nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    out = []
    for b in boxes:
        opts = {"max_restarts": 0}
        if b.get("node"):
            if b["node"] not in nodes:
                raise ColibriError(f"ray_boxes: no live Ray node at {b['node']} (the cluster has "
                                   f"{', '.join(sorted(nodes)) or 'none'})")
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[b["node"]], soft=False)
        elif b.get("resources"):
            opts["resources"] = b["resources"]
        out.append(actor.options(**opts).remote(b["path"], budget, io_threads, b.get("threads", 1)))
    return out


def place_on_ray(model, control, history, address: str, boxes: list[dict], head_weight: float, budget,
                 io_threads: int = 2) -> RayExperts:
    """The model's experts over the head and `boxes` (colibri.yaml's ray_boxes): the
    workers started, the experts assigned by the usage history's routed traffic (uniform
    without one) in proportion to the weights. Raises ColibriError when Ray is missing."""
    from ..storage.errors import ColibriError

    try:
        import ray
    except ImportError:
        raise ColibriError("placement: ray needs Ray: pip install 'colibri[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    workers = start_workers(boxes, budget, io_threads)
    shares = history.values() if history is not None else None
    if shares is None or not shares.sum():
        shares = np.ones((len(model.moe_layers), model.n_expert))
    owner = assign(shares + 1e-9, [head_weight] + [float(b.get("weight", 1.0)) for b in boxes])
    log.info("experts on %d boxes of Ray cluster %s: shares %s", len(boxes) + 1, address,
             [round(float(np.mean(owner == b)), 3) for b in range(len(boxes) + 1)])
    return RayExperts(control, workers, owner, model.moe_layers)
