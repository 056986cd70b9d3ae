"""Experts on other boxes, on Ray (docs/scale-out.md).

Each expert box runs one ExpertWorker actor: an expert cache (storage/cache.py, the
daemon's own) over the box's copy of the container, computing the rows of a layer-step
it is sent with engine/moe.worker_rows (the same crew jobs as the head's moe(), each
row times its routing weight). The head's RayExperts is the model's expert source: it
streams the experts the head owns from its own cache, and its compute_into() (which moe()
calls instead of streaming everything) sends each box one call per layer-step with the
rows routed to its experts, computes its own meanwhile, and writes the boxes' rows into
the step's slots; moe() then sums the slots in its fixed order, so the tokens are a single
box's.

Every box (the head too) measures itself at start: its drive's O_DIRECT bandwidth, its
memory bandwidth and threads, its cache's slots; the experts are assigned so each box's
share of the routed traffic follows what it can deliver (assign). A box whose CPU
target, numba or colibri differs from the head's would compute other bits: it is kept
out. A call that fails or times out is computed on the head from its own container in
the same step, the box's experts are spread over the boxes still in (assign with the
box's capacity at 0), and the box is started again in the background until it answers
(its node back): then the experts are assigned afresh.

Ray is optional (`pip install 'colibri[ray]'`); nothing here imports it before a Ray
placement is asked for.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..storage.errors import ColibriError
from ..storage.experts import LocalSource

log = logging.getLogger("colibri.daemon")
CALL_TIMEOUT_S = 30.0  # a box that has not answered a layer-step by then is taken as failed
START_TIMEOUT_S = 300.0  # a box's start: its container opened, kernels loaded (compiled on a fresh box), measured
REJOIN_S = (10.0, 300.0)  # a box that left is started again after 10 s, then doubling to 5 min


def describe_host() -> dict:
    """What decides the bits a box's kernels compute: numba compiles for this CPU name and
    feature set (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES override the host's), with this numba,
    colibri's kernels of this version."""
    import llvmlite.binding as llb
    import numba
    from numba.core import config

    from .. import __version__

    return {"cpu": config.CPU_NAME or llb.get_host_cpu_name(),
            "features": config.CPU_FEATURES or llb.get_host_cpu_features().flatten(),
            "numba": numba.__version__, "colibri": __version__}


def differs(head: dict, box: dict) -> str | None:
    """Why a box would compute other bits than the head (describe_host of both), or None."""
    for key, what in (("colibri", "colibri"), ("numba", "numba"), ("cpu", "CPU target")):
        if head[key] != box[key]:
            return f"its {what} is {box[key]}, the head's {head[key]}"
    if head["features"] != box["features"]:
        a, b = set(head["features"].split(",")), set(box["features"].split(","))
        return f"its CPU features differ from the head's ({', '.join(sorted(b - a)[:4])} against " \
               f"{', '.join(sorted(a - b)[:4])}): set NUMBA_CPU_NAME and NUMBA_CPU_FEATURES alike on every box"
    return None


def measure_box(cache) -> dict:
    """A box's figures for the assignment (the head's too): its drive's O_DIRECT GB/s, one
    core's memory GB/s and the kernels' threads, its cache's slots per MoE layer."""
    import numba

    from .planner import memory_gbs

    gbs, _ = cache.reader.measure(0, min_s=0.3)
    return {"disk_gbs": round(max(gbs, 1e-3), 3), "memory_gbs": memory_gbs(64), "threads": numba.get_num_threads(),
            "slots": cache.n_slots // max(1, len(cache.row)), "budget_bytes": cache.budget_bytes} | describe_host()


class ExpertWorker:
    """One box's experts (made remote by ray.remote in start_worker)."""

    def __init__(self, path: str, budget, io_threads: int = 2, threads: int = 0):
        from ..engine import layers
        from ..storage.cache import ExpertCache
        from ..storage.container import open_container

        self.c = open_container(path)
        self.cache = ExpertCache(self.c, budget, io_threads, top_k=1)
        layers.init(threads or None)
        self.calls = self.rows = 0

    def describe(self) -> dict:
        return measure_box(self.cache)

    def compute(self, il: int, parts: list, x: np.ndarray, w_flat: np.ndarray, prompt_rows: np.ndarray, A: int,
                ffn=None, clamped=None, integer=False) -> tuple[np.ndarray, np.ndarray, dict]:
        """parts [(expert, rows)] of layer il -> (rows, their outputs [n, D], the box's
        counters) (see moe(): ffn, clamped a family's own expert; integer: activations int8)."""
        from ..engine.formats.intdot import arrange_expert
        from ..engine.moe import worker_rows

        self.cache.arrange(arrange_expert if integer else None)  # (the integer kernels take tiles of rows)
        rows_of = {ie: np.asarray(r) for ie, r in parts}
        self.cache.begin_step()
        ys = worker_rows(self.cache.stream(il, list(rows_of)), rows_of, x, A, w_flat, prompt_rows,
                         self.cache.int4_group, ffn, clamped, integer)
        rows = np.concatenate(list(rows_of.values()))
        self.calls += 1
        self.rows += len(rows)
        return rows, ys[rows], self.stats()  # the counters ride on every answer: stats never waits on a box

    def prefetch(self, il: int, ids: list, tokens: int = 1) -> int:
        return self.cache.prefetch(il, ids, tokens=tokens)

    def stats(self) -> dict:
        st = self.cache.stats
        return {"bytes_read": st.bytes_read, "hits": st.hits, "misses": st.misses, "calls": self.calls,
                "rows": self.rows, "hit_rate": round(st.hits / st.experts, 4) if st.experts else None}


def costs(box) -> tuple[float, float, int] | None:
    """A box's seconds per unit of routed traffic for an expert its cache holds and one it
    must read, and how many experts a layer its cache holds: from measure_box's figures
    (every expert read from memory by the kernels, threads x one core's bandwidth; a miss
    from the drive first), or from a fixed weight (hits and misses alike). None or 0: out."""
    if not box:
        return None
    if not isinstance(box, dict):
        return 1 / box, 1 / box, 0
    hit = 1 / (box["memory_gbs"] * box["threads"])
    return hit, hit + 1 / box["disk_gbs"], box["slots"]


def assign(shares: np.ndarray, boxes: list, owner: np.ndarray | None = None) -> np.ndarray:
    """Which box serves each expert: shares [L, E] (each expert's routed traffic), boxes
    (measure_box's figures, or weights; None or 0: the box takes nothing) -> owner [L, E].
    Layer by layer (a layer waits for its slowest box), largest share first, each expert
    onto the box whose time for the layer grows least: a box's first `slots` experts of a
    layer are the ones its cache holds (the most routed), the rest cost a read. With
    `owner`, only the experts of boxes now out move: the others stay where they are cached."""
    cost = [costs(b) for b in boxes]
    live = [b for b, c in enumerate(cost) if c is not None]
    owner = np.full(shares.shape, -1, np.int64) if owner is None else np.where(np.isin(owner, live), owner, -1)
    for il in range(shares.shape[0]):
        t, n = np.zeros(len(boxes)), np.zeros(len(boxes), np.int64)  # the layer's time and experts per box
        order = np.argsort(-shares[il], kind="stable")
        for ie in [ie for ie in order if owner[il, ie] >= 0]:
            b = owner[il, ie]
            t[b], n[b] = _with(t, n, cost, b, shares[il, ie]), n[b] + 1
        for ie in [ie for ie in order if owner[il, ie] < 0]:
            b = min(live, key=lambda b, s=shares[il, ie]: _with(t, n, cost, b, s))
            owner[il, ie] = b
            t[b], n[b] = _with(t, n, cost, b, shares[il, ie]), n[b] + 1
    return owner


def _with(t, n, cost, b: int, share: float) -> float:
    """Box b's time for the layer with one more expert of this share: held by its cache
    while it has fewer than `slots` of the layer (they come most routed first), else read."""
    hit, miss, slots = cost[b]
    return t[b] + share * (hit if n[b] < slots else miss)


def box_seconds(shares: np.ndarray, boxes: list, owner: np.ndarray) -> np.ndarray:
    """Each box's time for its share of the traffic under `owner`, summed over the layers
    (costs()' units) -> [boxes]: what the assignment balances."""
    out = np.zeros(len(boxes))
    for b, box in enumerate(boxes):
        if costs(box) is None:
            continue
        hit, miss, slots = costs(box)
        mine = -np.sort(-np.where(owner == b, shares, 0.0), axis=1)  # [L, E] its experts, most routed first
        out[b] = hit * mine[:, :slots].sum() + miss * mine[:, slots:].sum()
    return out


@dataclass
class Box:
    """An expert box as the head sees it: its ray_boxes entry, its actor and figures, the
    calls' latency and rows, and while out, why and when it is tried again."""
    spec: dict
    actor: object = None
    desc: dict | None = None
    out_why: str | None = None
    final: bool = False  # out for good: it would compute other bits
    starting: tuple | None = None  # (actor, its describe() ref) while it starts again
    retry_at: float = 0.0
    backoff: float = REJOIN_S[0]
    latency: deque = field(default_factory=lambda: deque(maxlen=1024))
    rows_sent: int = 0
    counters: dict = field(default_factory=dict)


class RayExperts(LocalSource):
    """The head's expert source when boxes share the experts. `local`: the head's expert
    cache (box 0; it also computes what a failing box was sent); `specs`: the other boxes
    (colibri.yaml's ray_boxes), started here; `shares` [L, E]: the routed traffic per expert;
    `weights` (head first): fixed capacities instead of measured ones. A box that does not
    start is out (status says why) and is tried again; the head serves its experts."""

    def __init__(self, local, specs: list[dict], moe_layers: list[int], shares: np.ndarray, budget,
                 io_threads: int = 2, weights: list[float] | None = None):
        import ray

        self.local, self.budget, self.io_threads = local, budget, io_threads
        self.row = {il: i for i, il in enumerate(moe_layers)}
        self.shares, self.weights = shares, weights
        self.head = measure_box(local)
        self.boxes = {b: Box(spec) for b, spec in enumerate(specs, 1)}
        refs = {}
        for b, box in self.boxes.items():
            try:
                box.actor = start_worker(box.spec, budget, io_threads)
                refs[b] = box.actor.describe.remote()
            except ColibriError as e:
                self._out(b, str(e))
        for b, ref in refs.items():
            try:
                self._admit(b, self.boxes[b].actor, ray.get(ref, timeout=START_TIMEOUT_S))
            except (ray.exceptions.RayError, TimeoutError) as e:
                self._out(b, f"did not start: {_why(e)}")
        self.owner = assign(self.shares, self._figures())

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
        self._tend()

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        self.local.layer_done(il, routed, moe_s)

    def stream(self, il: int, ids: list[int]):
        return self.local.stream(il, ids)

    def box_of(self, il: int, ie: int) -> int:
        return int(self.owner[self.row[il], ie])

    def prefetch(self, il: int, ids: list[int], tokens: int = 1) -> int:
        mine = [ie for ie in ids if self.box_of(il, ie) == 0]
        for b, box in self.boxes.items():
            theirs = [ie for ie in ids if self.box_of(il, ie) == b]
            if theirs:
                box.actor.prefetch.remote(il, theirs, tokens)  # one way: the box reads ahead while the head attends
        return self.local.prefetch(il, mine, tokens) if mine else 0

    def arrange(self, fn) -> None:
        self.local.arrange(fn)  # (the boxes arrange their own as the calls say: ExpertWorker.compute)

    def compute_into(self, il, rows_of, x, w_flat, prompt_rows, A, ys, compute, ffn=None, clamped=None) -> bool:
        """The step's experts of layer il: each box's by one call, the head's own meanwhile
        (`compute`: moe()'s own path), the boxes' rows written into ys. What a failing box
        was sent is computed here instead, and its experts go to the boxes still in."""
        import ray

        by_box: dict[int, list] = {}
        for ie, rows in rows_of:
            by_box.setdefault(self.box_of(il, ie), []).append((ie, rows))
        integer = getattr(self, "activations", "float32") == "int8"  # (MoEModel.set_activations sets it)
        calls = {b: (self.boxes[b].actor.compute.remote(il, parts, x, w_flat, prompt_rows, A, ffn, clamped, integer),
                     time.perf_counter()) for b, parts in by_box.items() if b}
        if by_box.get(0):
            self._local(il, by_box[0], compute)
        for b, (ref, t0) in calls.items():
            box = self.boxes[b]
            try:
                rows, vals, box.counters = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning("expert box %d failed a call (%s): its experts go to the boxes still in", b, _why(e))
                self._out(b, _why(e))
                self.owner = assign(self.shares, self._figures(), self.owner)
                self._local(il, by_box[b], compute)
                continue
            ys[rows] = vals
            box.latency.append(time.perf_counter() - t0)
            box.rows_sent += len(rows)
        return True

    def _local(self, il: int, parts: list, compute) -> None:
        rows_of = dict(parts)
        for batch in self.local.stream(il, list(rows_of)):
            compute([(rows_of[ie], ew) for ie, ew in batch])

    # ---- boxes leaving and coming back ------------------------------------------------------
    def _admit(self, b: int, actor, desc: dict) -> bool:
        box = self.boxes[b]
        why = differs(self.head, desc)
        if why:
            log.error("expert box %d is kept out: %s (its tokens would not be the head's)", b, why)
            _kill(actor)
            box.actor, box.final = None, True
            self._out(b, why)
            return False
        box.actor, box.desc, box.out_why, box.backoff = actor, desc, None, REJOIN_S[0]
        log.info("expert box %d in: drive %.2f GB/s, %d cache slots a layer", b, desc["disk_gbs"], desc["slots"])
        return True

    def _out(self, b: int, why: str) -> None:
        box = self.boxes[b]
        if box.actor is not None:
            _kill(box.actor)
        box.actor, box.desc, box.out_why = None, None, why
        box.retry_at, box.backoff = time.monotonic() + box.backoff, min(2 * box.backoff, REJOIN_S[1])

    def _figures(self) -> list:
        """What assign() balances: each box's measured figures (None while out), or its weight."""
        figures = [self.head] + [self.boxes[b].desc for b in sorted(self.boxes)]
        if self.weights is not None:
            return [w if d is not None else None for w, d in zip(self.weights, figures)]
        return figures

    def _tend(self) -> None:
        """Between steps: a box that left is started again when its time comes (in the
        background: its describe() answered means it is up), then the experts are assigned
        afresh (a moved expert costs one cold read on its new box)."""
        import ray

        now = time.monotonic()
        for b, box in self.boxes.items():
            if box.out_why is None or box.final:
                continue
            if box.starting is None:
                if now >= box.retry_at:
                    try:
                        actor = start_worker(box.spec, self.budget, self.io_threads)
                        box.starting = (actor, actor.describe.remote())
                    except ColibriError as e:
                        self._out(b, str(e))
                continue
            actor, ref = box.starting
            if not ray.wait([ref], timeout=0)[0]:
                continue
            box.starting = None
            try:
                desc = ray.get(ref)
            except ray.exceptions.RayError as e:
                _kill(actor)
                self._out(b, f"did not start again: {_why(e)}")
                continue
            if self._admit(b, actor, desc):
                self.owner = assign(self.shares, self._figures())
                log.info("expert box %d is back: shares %s", b, self.shares_now())

    # ---- what status and stats show ---------------------------------------------------------
    def shares_now(self) -> list[float]:
        return [round(float(np.mean(self.owner == b)), 3) for b in range(len(self.boxes) + 1)]

    def describe(self) -> dict:
        return self.local.describe() | {"boxes": self.describe_boxes()}

    def layer_stats(self) -> list[dict]:  # (the head's own experts: the boxes count theirs, in describe_boxes)
        return self.local.layer_stats()

    def expert_map(self) -> dict:
        return self.local.expert_map()

    def describe_boxes(self) -> list[dict]:
        """Per box: its share of the experts and of the routed traffic, what it measured,
        state, rows sent and call latency, and its own counters as of its last answer (no
        box is asked: a hung box never delays stats)."""
        st = self.local.stats
        out = []
        for b in range(len(self.boxes) + 1):
            box = self.boxes.get(b)
            d = self.head if b == 0 else box.desc
            row = {"box": b, "experts_share": round(float(np.mean(self.owner == b)), 4),
                   "traffic_share": round(float(self.shares[self.owner == b].sum() / self.shares.sum()), 4),
                   "in_use": b == 0 or box.out_why is None,
                   "disk_gbs": d and d["disk_gbs"], "cache_slots": d and d["slots"]}
            if b == 0:
                row |= {"bytes_read": st.bytes_read, "hit_rate": round(st.hits / st.experts, 4) if st.experts else None}
            else:
                lat = sorted(box.latency)
                row |= {"rows_sent": box.rows_sent, "out_why": box.out_why,
                        "latency_ms_p50": round(1e3 * lat[len(lat) // 2], 3) if lat else None,
                        "latency_ms_p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)
                        if lat else None}
                row |= {k: box.counters.get(k) for k in ("bytes_read", "hit_rate", "calls")}
            out.append(row)
        return out

    def close(self) -> None:
        for box in self.boxes.values():
            for actor in (box.actor, box.starting and box.starting[0]):
                if actor is not None:
                    _kill(actor)
        self.local.close()


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except (ray.exceptions.RayError, ValueError):  # already gone
        pass


def start_worker(spec: dict, budget, io_threads: int = 2):
    """One ExpertWorker for a box: {"path": its container copy, "node" (the node's IP) or
    "resources" ({name: amount} only that node has) to pin the actor there, "expert_cache"
    (its own budget; default the head's), "threads" (its kernels'; default all its CPUs),
    "env" (variables for its process, e.g. NUMBA_CPU_NAME)}. Ray must be initialised (ray.init). Raises ColibriError for a node the
    cluster does not have (now)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..storage.sizes import parse_size

    opts = {"max_restarts": 0}
    if spec.get("node"):
        nodes = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if spec["node"] not in nodes:
            raise ColibriError(f"ray_boxes: no live Ray node at {spec['node']} (the cluster has "
                               f"{', '.join(sorted(nodes)) or 'none'})")
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[spec["node"]], soft=False)
    elif spec.get("resources"):
        opts["resources"] = spec["resources"]
    if spec.get("env"):
        opts["runtime_env"] = {"env_vars": {k: str(v) for k, v in spec["env"].items()}}
    own = spec.get("expert_cache")
    return ray.remote(ExpertWorker).options(**opts).remote(
        spec["path"], budget if own is None else parse_size(str(own)), io_threads, spec.get("threads", 0))


def place_on_ray(model, control, history, address: str, boxes: list[dict], head_weight: float | None, budget,
                 io_threads: int = 2) -> RayExperts:
    """The model's experts over the head and `boxes` (colibri.yaml's ray_boxes): the
    workers started and measured, the experts assigned by the usage history's routed
    traffic (uniform without one) in proportion to what each box delivers (or to the
    configured weights, when the head's or any box's is set). Raises ColibriError when Ray
    is missing."""
    try:
        import ray
    except ImportError:
        raise ColibriError("placement: ray needs Ray: pip install 'colibri[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    shares = history.values() if history is not None else None
    if shares is None or not shares.sum():
        shares = np.ones((len(model.moe_layers), model.n_expert))
    weights = None
    if head_weight is not None or any("weight" in b for b in boxes):
        weights = [head_weight or 1.0] + [float(b.get("weight", 1.0)) for b in boxes]
    experts = RayExperts(control, boxes, model.moe_layers, shares + 1e-9, budget, io_threads, weights)
    log.info("experts on %d boxes of Ray cluster %s (%s): shares %s", len(boxes) + 1, address,
             "configured weights" if weights else "measured capacities", experts.shares_now())
    return experts
