"""What a model will do on this box: `colictl plan` and `colictl tune`.

The box is measured, not looked up: each drive's O_DIRECT bandwidth and latency on the
model's own files at 1, 2 and 4 threads; the memory's read bandwidth; and the time of a
decode step of this very model with every expert at hand (the dense weights loaded, a
sample of expert records in each precision standing in for the rest, so the step runs the
real kernels on the real shapes: SampleExperts). The routing decides how much a budget
saves: replayed from a routing trace or the usage history when there is one (the better
of an LRU pool and the most used experts pinned, which the `learned` policy combines),
else uniform (a budget of a fraction f of the experts hits f of the time).

Decode reads (1 - hit) of the k experts each MoE layer routes to, and of the router
lookahead's reads that the router then does not choose (`waste` a layer, from the trace's
predictions, else PREFETCH_WASTE), so per token

    bytes   = moe_layers * (k + waste) * (1 - hit) * record_bytes
    disk_s  = bytes / the drives' bandwidth
    t       = max(compute_s, disk_s) + OVERLAP * min(compute_s, disk_s) + DAEMON_STEP_S
    tok/s   = 1 / t

Disk and compute overlap (reads start before the resident experts compute, the lookahead
reads a layer ahead), but not wholly: a missed expert's compute waits for its bytes, so a
part of the shorter side adds (OVERLAP, fitted on the decode benchmark's model at 10, 25
and 100 % budgets; docs/benchmarks.md). A prediction never touches the model's output:
planning serves no request.
"""

import math
import mmap
import os
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..storage.container import ALIGN, round_up
from ..storage.errors import BudgetInvalid, ColibriError
from ..storage.experts import ExpertStats, LocalSource, QuantWeight, int4_of
from ..storage.memory import PROCESS_BYTES
from ..storage.placement import (
    fit_of,
    quant_group,
    resident_cache,
    room_for,
    sample_experts,
    streamed_table_bytes,
)
from ..storage.sizes import fmt_bytes, parse_size
from ..storage.slots import min_budget_bytes

FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)  # expert budgets the table shows, as fractions of the experts
THREADS = (1, 2, 4)  # read threads tried
SAMPLE_BYTES = 512 << 20  # expert bytes a compute sample holds at most (more than any CPU cache)
PLAN_VERSION = 1
OVERLAP = 0.5  # the part of the shorter of compute and disk time that does not overlap the other
PREFETCH_WASTE = 1.0  # lookahead reads a layer-step the router does not use, when no trace says (measured 1.3 of 8)
PREFETCH_READS = 8  # the lookahead's reads a layer (the default prefetch_reads)
# what a step costs in the daemon beyond the engine's own step (the token's message through
# the socket, the I/O thread, the client's process beside the compute threads on the same
# cores): 0.25 ms, fitted on bench/plan_demo.py (1/measured - 1/predicted, two runs alike);
# it matters only where a step is short (the demo's: about 1 ms)
DAEMON_STEP_S = 0.25e-3
CONTEXT_TOKENS = 128  # the context a timed decode step attends to: a request's midway, for replies of ~256 tokens


# ---- the box ---------------------------------------------------------------------------------

def _aligned(n: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, max(n, mmap.PAGESIZE)), np.uint8)[:n]


def measure_drive(files: list[str], block: int, threads: int, seconds: float = 1.0) -> dict:
    """O_DIRECT reads of `block` bytes (4 KiB aligned) at random places of `files`,
    `threads` at a time for about `seconds`: {"gbs", "latency_ms_p50", "latency_ms_p99",
    "o_direct"}. Buffered where the file system refuses O_DIRECT (then the page cache may
    flatter it, and "o_direct" says so)."""
    block = round_up(max(block, ALIGN), ALIGN)
    spans = [(f, os.path.getsize(f) // ALIGN * ALIGN) for f in files]
    spans = [(f, n) for f, n in spans if n >= block] or spans
    direct = True
    fds = {}
    for f, _ in spans:
        try:
            fds[f] = os.open(f, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            direct, fds[f] = False, os.open(f, os.O_RDONLY)
    rng = np.random.default_rng(len(files) * 7919 + block)
    weights = np.array([max(n - block, 0) + 1 for _, n in spans], float)
    picks = rng.choice(len(spans), 4096, p=weights / weights.sum())
    offsets = [int(rng.integers(0, max(spans[i][1] - block, 0) // ALIGN + 1)) * ALIGN for i in picks]
    stop = time.perf_counter() + seconds

    def worker(i: int) -> tuple[int, list[float]]:
        buf, got, lat, k = _aligned(block), 0, [], i
        while time.perf_counter() < stop:
            f = spans[picks[k % len(picks)]][0]
            t = time.perf_counter()
            got += os.preadv(fds[f], [buf], offsets[k % len(offsets)])
            lat.append(time.perf_counter() - t)
            k += threads
        return got, lat

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            done = list(pool.map(worker, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)
    elapsed = time.perf_counter() - t0
    lat = sorted(x for _, ls in done for x in ls) or [0.0]
    return {"gbs": round(sum(n for n, _ in done) / elapsed / 1e9, 3), "threads": threads, "block_bytes": block,
            "latency_ms_p50": round(1e3 * lat[len(lat) // 2], 3),
            "latency_ms_p99": round(1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3), "o_direct": direct}


def measure_drives(roots: dict[str, list[str]], block: int, seconds: float = 1.0) -> list[dict]:
    """Each drive (name -> its files) at each of THREADS; its best figure, and the fewest
    threads that reach 95 % of it."""
    out = []
    for name, files in roots.items():
        tries = [measure_drive(files, block, n, seconds) for n in THREADS]
        best = max(tries, key=lambda t: t["gbs"])
        enough = next(t for t in tries if t["gbs"] >= 0.95 * best["gbs"])
        out.append({"drive": name, **best, "io_threads": enough["threads"], "by_threads": {
            str(t["threads"]): t["gbs"] for t in tries}})
    return out


def memory_gbs(mib: int = 256) -> float:
    """One core's read bandwidth of memory (the best of three passes over `mib` MiB)."""
    from ..engine import kernels

    buf = np.ones(mib * 2**20 // 8, np.uint64)
    kernels.read_bandwidth(buf, 1)
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        kernels.read_bandwidth(buf, 1)
        best = min(best, time.perf_counter() - t)
    return round(buf.nbytes / best / 1e9, 3)


# ---- a decode step of the model, every expert at hand -----------------------------------------

class SampleExperts(LocalSource):
    """An ExpertSource that hands out a small resident sample of expert records for any
    expert asked for: the same shapes, precision and kernels as the real ones, so a step
    costs what a step with every expert cached costs. For timing only: the values are not
    the asked experts' (a plan never serves a request)."""

    lookahead = False

    def __init__(self, layers: list[list[tuple]], int4_group: int | None):
        self.layers, self.int4_group = layers, int4_group  # layers[j][i]: sample expert i of sample layer j
        self.stats = ExpertStats()
        self.record_bytes = round_up(sum(_nbytes(w) for w in layers[0][0]), ALIGN)
        self.position: dict[int, int] = {}
        # int4 experts without biases: each sample layer's [k, 6] addresses, so a decode step
        # takes the path a warm cache's step takes (int4_hits), not the views' slower one
        facts = [[int4_of(e) if len(e) == 3 else None for e in layer] for layer in layers]
        first = facts[0][0]
        self.int4 = None
        if first is not None and all(f is not None and f[1] == first[1] for layer in facts for f in layer):
            self.int4 = [np.frombuffer(b"".join(f[2] for f in layer), np.int64).reshape(len(layer), 6)
                         for layer in facts]
            self.int4_layouts = first[0], first[1]

    def begin_step(self) -> None:
        self.stats.steps += 1

    def prefetch(self, il: int, ids: list[int], tokens: int = 1) -> int:
        return 0

    def layer_done(self, il: int, routed: int, moe_s: float) -> None:
        self.stats.moe_s += moe_s

    def _layer(self, il: int) -> int:
        return self.position.setdefault(il, len(self.position)) % len(self.layers)

    def stream(self, il: int, ids: list[int]):
        sample = self.layers[self._layer(il)]
        yield [(ie, sample[ie % len(sample)]) for ie in ids]

    def int4_hits(self, il: int, ids: list[int]) -> tuple | None:
        # as ExpertCache.int4_hits: (group, layouts, [len(ids), 6] addresses) of the experts
        # stream() would hand out, or None when they are not int4 without biases
        if self.int4 is None:
            return None
        table = self.int4[self._layer(il)]
        return (*self.int4_layouts, table[np.asarray(ids) % len(table)])

    def describe(self) -> dict:
        return {"placement": "planning sample"}


def _nbytes(w) -> int:
    return w.nbytes if isinstance(w, QuantWeight | np.ndarray) else 0


def decode_seconds(model, sample, tokens: int = 32, tokenizer=None, context: int = CONTEXT_TOKENS) -> float:
    """The median time of a decode step of `model` with `sample` (an ExpertSource) as its
    experts, taken as the daemon takes it: a Batcher step of one request (sampling, and
    its text with `tokenizer`), after a prompt of `context` tokens (at most a quarter of
    the model's context), where attention costs what it costs a request midway (the first
    steps compile and warm up; they are not counted)."""
    from ..engine.generate import Batcher, Request, SamplingParams

    model.experts = sample
    batch = Batcher(model)
    prompt = [3 + i % 64 for i in range(max(8, min(context, model.n_ctx // 4)))]
    batch.add(Request(model, prompt, SamplingParams(max_tokens=tokens + 3), (), tokenizer))
    times = []
    while batch.active:
        t = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times[3:]))


# ---- the routing ------------------------------------------------------------------------------

def trace_accesses(path: str, moe_layers: list[int], n_expert: int) -> list[tuple[int, list[int], list[int] | None]]:
    """(layer, experts, the lookahead's prediction or None) of each layer of each step of a
    routing trace (colictl run --routing-trace), in order. Raises TraceInvalid, OSError."""
    from ..storage.layout import trace_steps

    return list(trace_steps(path, moe_layers, n_expert))


def lru_hits(accesses, slots: int) -> float:
    """The hit rate of one LRU pool of `slots` experts over the accesses."""
    pool: OrderedDict = OrderedDict()
    hits = total = 0
    for il, ids, *_ in accesses:
        for ie in ids:
            key = (il, ie)
            total += 1
            if key in pool:
                hits += 1
                pool.move_to_end(key)
            else:
                pool[key] = None
                if len(pool) > slots:
                    pool.popitem(last=False)
    return hits / total if total else 0.0


def pinned_hits(counts: np.ndarray, slots: int) -> float:
    """The hit rate of the `slots` most used experts pinned (counts: uses per expert)."""
    v = np.sort(counts.reshape(-1))[::-1]
    return float(v[:slots].sum() / v.sum()) if v.sum() > 0 else 0.0


def hit_curve(n_total: int, fractions=FRACTIONS, accesses=None, counts: np.ndarray | None = None) -> dict:
    """{"source": trace | history | uniform, "hits": {fraction: hit rate}, "waste": the
    lookahead's unused reads a layer-step}."""
    hits = {}
    tally: dict = {}
    wasted = [len(set(ahead[:PREFETCH_READS]) - set(ids)) for _, ids, ahead in accesses or [] if ahead is not None]
    for il, ids, _ in accesses or []:
        for ie in ids:
            tally[(il, ie)] = tally.get((il, ie), 0) + 1
    uses = np.array(list(tally.values()), float)
    for f in fractions:
        slots = int(f * n_total)
        if accesses:
            hits[f] = max(lru_hits(accesses, slots), pinned_hits(uses, slots))
        elif counts is not None and counts.sum() > 0:
            hits[f] = pinned_hits(counts, slots)
        else:
            hits[f] = min(1.0, f)
        hits[f] = 1.0 if f >= 1.0 else round(hits[f], 4)
    return {"source": "trace" if accesses else "history" if counts is not None and counts.sum() > 0 else "uniform",
            "hits": hits, "waste": round(float(np.mean(wasted)), 3) if wasted else PREFETCH_WASTE}


# ---- the prediction ---------------------------------------------------------------------------

@dataclass
class Shape:
    moe_layers: int
    top_k: int
    n_expert: int
    record_bytes: int

    @property
    def expert_bytes(self) -> int:
        return self.moe_layers * self.n_expert * self.record_bytes


def predict(shape: Shape, compute_s: float, disk_gbs: float, hit: float, waste: float = PREFETCH_WASTE) -> dict:
    """Bytes read per token and tok/s at a hit rate (see the module's formula)."""
    read = shape.moe_layers * (shape.top_k + waste) * (1.0 - hit) * shape.record_bytes
    disk_s = read / (disk_gbs * 1e9) if disk_gbs > 0 else math.inf
    t = max(compute_s, disk_s) + OVERLAP * min(compute_s, disk_s) + DAEMON_STEP_S
    return {"hit_rate": round(hit, 4), "bytes_read_per_token": int(read), "disk_s": round(disk_s, 5),
            "compute_s": round(compute_s, 5), "tok_s": round(1.0 / t, 3) if t > 0 else None,
            "bound": "disk" if disk_s > compute_s else "compute"}


def hit_at(curve: dict, fraction: float) -> float:
    """The hit rate at a budget fraction, linear between the curve's points."""
    pts = sorted((float(f), h) for f, h in curve["hits"].items())
    if fraction <= pts[0][0]:
        return pts[0][1] * fraction / pts[0][0] if pts[0][0] else pts[0][1]
    for (f0, h0), (f1, h1) in zip(pts, pts[1:]):
        if fraction <= f1:
            return h0 + (h1 - h0) * (fraction - f0) / (f1 - f0)
    return pts[-1][1]


def plan_path(state_dir: str, fingerprint: str) -> str:
    """Where `tune` keeps the plan of a container for the daemon (stats: predicted vs measured)."""
    return os.path.join(state_dir, "plans", fingerprint.replace(":", "-") + ".json")


def predicted_now(plan: dict, budget_bytes: int) -> dict | None:
    """The plan's prediction at the budget the daemon has now, for its container's own precision."""
    row = plan.get("precisions", {}).get(plan.get("precision"))
    if not row:
        return None
    shape = Shape(**plan["shape"] | {"record_bytes": row["record_bytes"]})
    frac = min(1.0, budget_bytes / shape.expert_bytes) if shape.expert_bytes else 1.0
    got = predict(shape, row["compute_s"], plan["disk_gbs"], hit_at(plan["routing"], frac), plan["routing"]["waste"])
    return {"budget_fraction": round(frac, 4), **got}


# ---- the whole plan ---------------------------------------------------------------------------

def own_precision(src, model) -> str:
    """The checkpoint's expert precision as published: bf16, f16, f32, fp8_e4m3/e5m2, mxfp4."""
    from ..storage.convert import OUR_NAME

    w = src.read_weight(model.expert_names(model.moe_layers[0], 0)[0])
    if isinstance(w, QuantWeight):
        return w.kind
    return OUR_NAME.get(src.entry(model.expert_names(model.moe_layers[0], 0)[0]).dtype, "bf16")


def make_plan(path: str, build, memory: int | None = None, trace: str | None = None, drives=(),
              state_dir: str | None = None, precisions: tuple[str, ...] | None = None, seconds: float = 1.0,
              threads: int | None = None, kv_bytes: int = 0, say=lambda msg: None) -> dict:
    """Measure the box for the model at `path` (a container or a Hugging Face checkpoint)
    and predict its decode speed per precision and expert budget. `memory`: the RAM it may
    use (None: what is available now); `trace`: a routing trace for the hit rates (else the
    usage history in `state_dir`, else uniform); `drives`: directories with copies of the
    expert files; `precisions`: of a checkpoint, those to try (default its own and, for a
    float checkpoint, int8 and int4); `kv_bytes`: the daemon's prefix cache budget, which
    shares the memory; `say` hears each phase. Raises the storage errors of opening the
    model, TraceInvalid for a bad trace."""
    import psutil

    from ..engine import layers
    from ..storage.checkpoint import load_config, open_checkpoint
    from ..storage.container import is_container, open_container
    from ..storage.history import UsageHistory, history_path

    t_start = time.perf_counter()
    model = build(path, load_config(path))
    k, n_moe = model.n_expert_used, len(model.moe_layers)
    say("opening the model")
    if is_container(path):
        c = open_container(path)
        dense_src, files, fingerprint, own = c.dense, sorted({r.file for r in c.records.values()}), c.fingerprint, \
            c.expert_dtype
        # a container whose experts all fit in a sample is timed on the real cache, warm: its
        # own work a step (the lookahead's router, the bookkeeping) is then in the figure
        samples = {own: (lambda: resident_cache(c, k)) if c.expert_bytes <= SAMPLE_BYTES
                   else lambda: SampleExperts(*sample_experts(c, model, k, SAMPLE_BYTES))}
        precision = c.precision()
    else:
        c, fingerprint, precision = None, None, None
        dense_src = model.source(open_checkpoint(path))
        model.check(dense_src)
        files = sorted(f.path for f in dense_src.files.values())  # (a directory's files, or a GGUF set's parts)
        own = own_precision(dense_src, model)
        wanted = precisions or ((own, "int8", "int4") if own in ("bf16", "f16", "f32") else (own,))
        if "int4" in wanted and quant_group(dense_src, model.expert_names(model.moe_layers[0], 0)[:3]) is None:
            wanted = tuple(p for p in wanted if p != "int4")  # (no group size divides the matrices)
        samples = {p: (lambda p=p: SampleExperts(*sample_experts(dense_src, model, k, SAMPLE_BYTES,
                                                                 None if p == own else p)))
                   for p in wanted}
    say("reading a sample of experts")
    first = next(iter(samples))
    sample = samples[first]()
    say("loading the dense weights")
    table_bytes, tables = streamed_table_bytes(c) if c is not None else 0, None
    if table_bytes:  # (streamed, never read in: a step's pages read as the daemon reads them)
        from ..storage.reader import ExpertReader
        from ..storage.tables import TableCache

        tables = TableCache(c, table_bytes, ExpertReader(c, ExpertStats()))
    model.load(dense_src, sample, precision=precision, tables=tables)
    layers.init(threads)
    # a container's dense bytes as colibrid counts them when it checks a budget (fit_of), so
    # that the plan's floor is the daemon's; a checkpoint's as loaded
    dense_bytes = room_for(c).dense_bytes if c is not None else \
        sum(_nbytes(a) for a in model.glob.values()) + sum(_nbytes(a) for L in model.layers for a in L.values())
    try:
        from ..engine.tokenizer import Tokenizer
        from ..storage.gguf import tokenizer_spec

        tokenizer = Tokenizer(path, tokenizer_spec(path))
    except ColibriError:  # (a plan needs no text; a step then times without its detokenising)
        tokenizer = None
    say("measuring the drives")
    roots = {path: files}
    for d in drives:
        there = [os.path.join(d, os.path.basename(f)) for f in files]
        there = [f for f in there if os.path.exists(f)]
        if there:
            roots[d] = there
    disks = measure_drives(roots, sample.record_bytes, seconds)
    disk = sum(d["gbs"] for d in disks)
    say("measuring memory")
    mem = memory_gbs()
    routing = None
    if trace:
        routing = hit_curve(n_moe * model.n_expert, accesses=trace_accesses(trace, model.moe_layers, model.n_expert))
    elif c is not None and state_dir:
        h = UsageHistory(c.moe_layers, c.n_expert, c.fingerprint, history_path(state_dir, c.fingerprint),
                         read_only=True)
        routing = hit_curve(n_moe * model.n_expert, counts=h.values())
    routing = routing or hit_curve(n_moe * model.n_expert)
    avail = memory if memory is not None else psutil.virtual_memory().available
    rows = {}
    for p, make in samples.items():
        say(f"timing decode steps, {p} experts")
        s = sample if p == first else make()
        compute_s = decode_seconds(model, s, tokenizer=tokenizer)
        if hasattr(s, "close"):
            s.close()  # (the real cache's reader threads)
        shape = Shape(n_moe, k, model.n_expert, s.record_bytes)
        least = min_budget_bytes(n_moe, s.record_bytes)
        split = split_memory(avail, dense_bytes, kv_bytes, least, shape.expert_bytes, table_bytes)
        fit = split["experts"] / shape.expert_bytes if shape.expert_bytes else 1.0
        table = [{"budget_fraction": f, "budget_bytes": int(f * shape.expert_bytes),
                  **predict(shape, compute_s, disk, hit_at(routing, f), routing["waste"])}
                 for f in FRACTIONS if least <= f * shape.expert_bytes and f <= max(fit, 0.05)]
        rows[p] = {"record_bytes": s.record_bytes, "expert_bytes": shape.expert_bytes, "compute_s": round(compute_s, 5),
                   "min_budget_bytes": least, "memory": split,
                   "fit_fraction": round(fit, 4), "at_fit": {"budget_bytes": split["experts"],
                                                             **predict(shape, compute_s, disk, hit_at(routing, fit),
                                                                       routing["waste"])},
                   "table": table, "lossy": p != own}
    plan = {"version": PLAN_VERSION, "model": os.path.abspath(path), "container": fingerprint,
            "model_type": model.MODEL_TYPE, "precision": own if own in rows else next(iter(rows)), "made": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "shape": {"moe_layers": n_moe, "top_k": k, "n_expert": model.n_expert},
            "dense_bytes": dense_bytes, "table_bytes": table_bytes, "memory_bytes": int(avail), "kv_bytes": kv_bytes,
            "memory_gbs": mem, "drives": disks,
            "disk_gbs": round(disk, 3), "threads": threads or len(os.sched_getaffinity(0)),
            "routing": routing | {"hits": {str(f): h for f, h in routing["hits"].items()}},
            "precisions": rows}
    if tables is not None:
        tables.reader.close()
    plan["recommend"] = recommend(plan, c, disks)
    plan["seconds"] = round(time.perf_counter() - t_start, 2)
    return plan


def split_memory(memory: int, dense_bytes: int, kv_bytes: int, least: int, expert_bytes: int,
                 table_bytes: int = 0) -> dict:
    """How `memory` bytes are shared out: the dense weights and the process (PROCESS_BYTES)
    first, the experts' minimum budget (`least`) next; of the rest streamed embedding
    tables take at most a quarter (up to all their `table_bytes`), then of what remains the
    prefix cache at most a quarter (up to its budget, `kv_bytes`), the experts what they
    can use (at most all of them, `expert_bytes`), and the prefix cache what the experts
    leave. {"experts", "kv", "tables", "short"}: the budgets, and the bytes missing for
    the minimum (0 when it fits)."""
    free = memory - dense_bytes - PROCESS_BYTES
    if free < least:
        return {"experts": least, "kv": 0, "tables": 0, "short": least - free}
    tables = min(table_bytes, (free - least) // 4)
    free -= tables
    experts = max(least, min(expert_bytes, free - min(kv_bytes, (free - least) // 4)))
    return {"experts": experts, "kv": min(kv_bytes, free - experts), "tables": tables, "short": 0}


def budget_text(n: int, least: int) -> str:
    """A budget as the configuration writes it, rounded down to a MiB (a KiB below 16 MiB)
    but never below the minimum `least`."""
    unit, name = (2**20, "MiB") if n >= 16 << 20 else (1024, "KiB")
    n = max(n // unit, -(-least // unit))
    return f"{n}{name}"


def recommend(plan: dict, container, disks: list[dict]) -> dict:
    """The settings for this box: the expert budget that fits, the read threads that reach
    the drive's bandwidth, the reader that reads faster here (containers: measured as the
    daemon's `reader: auto` does), and the precision (the model's own; a lossy one is only
    mentioned, with its figure)."""
    own = plan["precisions"][plan["precision"]]
    fit, split = own["fit_fraction"], own["memory"]
    if split["short"]:
        out = {"fits": False, "why": f"the model needs {fmt_bytes(plan['memory_bytes'] + split['short'])} at its "
                                     f"smallest expert budget ({fmt_bytes(own['min_budget_bytes'])}): "
                                     f"{fmt_bytes(plan['dense_bytes'])} of dense weights and "
                                     f"{fmt_bytes(PROCESS_BYTES)} for the process besides; "
                                     f"{fmt_bytes(plan['memory_bytes'])} is {fmt_bytes(split['short'])} short"}
    else:
        out = {"fits": True}
    out |= {"precision": plan["precision"],
            "expert_cache": "all" if fit >= 1.0 else budget_text(own["at_fit"]["budget_bytes"], own["min_budget_bytes"]),
            "io_threads": max(d["io_threads"] for d in disks), "predicted_tok_s": own["at_fit"]["tok_s"],
            "bound": own["at_fit"]["bound"]}
    if plan.get("table_bytes"):  # a page's worth at least: one step's pages are held while it takes them
        out["table_cache"] = budget_text(split["tables"], 4096) if split["tables"] else "min"
    if split["kv"] < plan["kv_bytes"]:  # the prefix cache gives up what the experts' minimum needs
        out["kv_cache"] = budget_text(split["kv"], 0) if split["kv"] else "0"
    faster = [(p, r) for p, r in plan["precisions"].items() if r["lossy"] and r["at_fit"]["tok_s"]
              and own["at_fit"]["tok_s"] and r["at_fit"]["tok_s"] >= 1.2 * own["at_fit"]["tok_s"]]
    if faster:
        p, r = max(faster, key=lambda x: x[1]["at_fit"]["tok_s"])
        out["lossy_option"] = {"precision": p, "predicted_tok_s": r["at_fit"]["tok_s"],
                               "how": f"colictl convert --dtype {p} (lossy: the tokens change)"}
    if container is not None and out["fits"]:  # the settings as colibrid will check them (fit_of)
        try:
            fit_of(container, parse_size(out["expert_cache"]), parse_size(out.get("kv_cache", plan["kv_bytes"])),
                   parse_size(out["table_cache"]) if "table_cache" in out else None, ram=plan["memory_bytes"])
        except BudgetInvalid as e:
            out |= {"fits": False, "why": str(e)}
    if container is not None:
        from ..storage.reader import ExpertReader

        r = ExpertReader(container, ExpertStats(), out["io_threads"], reader="auto")
        out["reader"], out["reader_note"] = r.kind if r.kind_why else "preadv", r.kind_why
        r.close()
    return out
