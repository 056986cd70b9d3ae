"""Cache policies against the optimum on a routing trace.

    python bench/cache_policy.py --trace PATH [--budgets 0.05,0.1,0.25,0.5] [--warmup PATH]
                                 [--top-k K] [--json]
    python bench/cache_policy.py --make-traces DIR [--tokens 256]
    python bench/cache_policy.py --library DIR [--budgets 0.1,0.25,0.5] [--json]

Replays a trace written by `colictl run --routing-trace` (one JSON line per forward step
per MoE layer: {"step", "layer", "experts"[, "predicted"]}; a line's experts must be
resident together) against caches of each budget — a fraction of all experts of all
layers — and prints {"results": [{"budget", "policy", "hit_rate", ...}], ...}:

- `lru`, `lru+pinned`, `learned` (storage/policy.py): the expert cache itself
  (storage/cache.py), run on a container of the trace's shape with tiny records
  (replay_cache), learning only from the part of the trace already replayed (or from a
  --warmup trace first, then starting warm as the daemon does); what it counts is what
  the daemon would;
- `next-use (replay only)`: a candidate studied here, not in the cache (next_use.py), and
  the same told every expert's next use within the coming step exactly: a bound on what
  foresight of one step (the lookahead sees one layer) could give an online policy;
- `belady`: the optimum: one pool for all layers, evicting the expert whose next use is
  farthest in the future (it alone sees the future), a read expert needed later than every
  resident one streaming through without being kept (bypass); `belady-no-bypass` keeps
  every expert it reads. Each policy's hit rate is given as a fraction of both.

It also prints the trace's structure (the share of routings that go to each layer's
most popular quarter of experts; the share of a step's experts the previous step of the
same layer also used) and, where the lines carry the router lookahead's "predicted"
experts, the prefetch precision (predicted experts that were used) and recall (used
experts that were predicted).

--make-traces DIR writes the traces this benchmark is run on: the decode benchmark's
synthetic model (bench/synthetic.py; its router is built with structure) and the tiny
test checkpoints' families, each decoding sampled text from prompts of its own.
--library DIR writes the trace library (bench/traces.py: a model of each family's routing
serving chat-like requests, and the demo model) and replays every policy at every budget
on every trace; "worst_of_belady" is each policy's smallest fraction of Belady over the
library, the figure its targets are stated in.
"""

import argparse
import heapq
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import replace

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)

import provenance  # noqa: E402
from next_use import NextUse, next_use_split  # noqa: E402

from colibri.storage.policy import POLICIES, Policy  # noqa: E402


def read_trace(path: str) -> list[tuple[int, int, list[int], list[int] | None]]:
    """[(step, layer, experts, predicted or None)] in file order."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                d = json.loads(line)
                try:
                    out.append((int(d["step"]), int(d["layer"]), [int(e) for e in d["experts"]], d.get("predicted")))
                except (KeyError, TypeError, ValueError):
                    raise SystemExit(f"{path}:{n}: not a routing trace line: {line.strip()[:80]}") from None
    return out


def shape_of(trace) -> tuple[list[int], int]:
    layers = sorted({il for _, il, _, _ in trace})
    n_expert = max(max(e) for _, _, e, _ in trace if e) + 1
    return layers, n_expert


def shape_container(n_layers: int, n_expert: int, top_k: int, workdir: str | None = None):
    """A container of n_layers MoE layers of n_expert tiny experts (one 4 KiB record each),
    built once into workdir (default: ~/.cache/colibri/bench/shapes): what the replay runs
    the real expert cache on. A policy decides from routing alone, never from the bytes."""
    from synthetic import build

    from colibri.storage.container import open_container

    workdir = workdir or os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench", "shapes")
    os.makedirs(workdir, exist_ok=True)
    tiny = {"hidden_size": 64, "moe_intermediate_size": 8, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256, "num_experts": n_expert,
            "num_experts_per_tok": min(top_k, n_expert)}
    return open_container(build(workdir, 0.0, n_layers, "qwen3_moe", "bf16", tiny))


def replay_cache(trace, capacity: int, container, top_k: int, policy: Policy, warmup=None) -> dict:
    """The expert cache itself (storage/cache.py) over the trace, on `container` (its MoE
    layers taken in order for the trace's), with `capacity` slots: each line one stream()
    of its experts, each new step begin_step(), as a forward step drives them. With
    `warmup`, the usage history learns that trace first and the cache starts warm, as the
    daemon starts. The lookahead's reads are off (the trace's steps are replayed, not the
    model's layers). The result is the cache's own counters."""
    from colibri.storage.cache import ExpertCache

    layers = sorted({il for _, il, _, _ in trace} | {il for _, il, _, _ in warmup or ()})
    where = dict(zip(layers, container.moe_layers))
    cache = ExpertCache(container, capacity * container.record_bytes, io_threads=2, direct=False, top_k=top_k,
                        policy=replace(policy, prefetch_reads=0))
    warm_reads = 0
    if warmup:
        last = None
        for step, il, experts, _ in warmup:
            if step != last:
                cache.history.step()
                last = step
            cache.history.record(where[il], experts)
        warm_reads = cache.warm_start()
    before = cache.stats.copy()
    last = None
    for step, il, experts, _ in trace:
        if step != last:
            cache.begin_step()
            last = step
        for _ in cache.stream(where[il], experts):
            pass
    st = cache.stats.minus(before)
    d = cache.describe()
    cache.close()
    return {"hits": st.hits, "misses": st.misses, "pinned_slots": len(cache.pinned), "slots": d["slots"],
            "window_slots_per_layer": d["window_slots_per_layer"], "main_slots": d["main_slots"],
            "repins": st.repins, "warm_reads": warm_reads, "read_requests": st.read_requests}


def replay_next_use(trace, capacity: int, layers: list[int], n_expert: int, top_k: int, foresight: int = 0) -> dict:
    """next_use.NextUse over the trace, its pool and window split from `capacity` slots as
    a cache would (next_use_split: the window is part of the budget). `foresight` lines: the
    next uses within that many lines are told to it exactly (an oracle: the bound on what
    knowing the near future, as the lookahead knows the next layer's, could gain)."""
    model = NextUse(len(layers), n_expert, *next_use_split(capacity, top_k))
    pos = {il: i for i, il in enumerate(layers)}
    keys = [[pos[il] * n_expert + e for e in experts] for _, il, experts, _ in trace]
    last = None
    for i, (step, il, experts, _) in enumerate(trace):
        if step != last:
            model.step()
            last = step
        known = {}
        for d in range(foresight, 0, -1):  # the nearest use wins
            if i + d < len(trace):
                known.update(dict.fromkeys(keys[i + d], float(d)))
        model.access(pos[il], experts, known)
    return {"hits": model.hits, "misses": model.misses,
            "half_life": model.half_lives[model.choice], "window_slots": model.win}


def replay_belady(trace, capacity: int, bypass: bool = True) -> dict:
    """Belady's optimum over one pool: on a miss with the pool full, of the resident
    experts not needed by this line and (with `bypass`) the newcomer itself, the one whose
    next use is farthest away goes (the newcomer then only streams through). Without
    bypass every read expert is admitted: the optimum of a cache that keeps what it reads."""
    INF = len(trace) + 1
    nxt: list[dict] = [dict() for _ in trace]  # line -> {expert: the next line that uses it}
    seen: dict = {}
    for i in range(len(trace) - 1, -1, -1):
        _, il, experts, _ = trace[i]
        for ie in experts:
            nxt[i][ie] = seen.get((il, ie), INF)
            seen[(il, ie)] = i
    resident: dict = {}  # key -> next use
    heap: list = []  # (-next use, key), stale entries skipped
    hits = misses = 0
    for i, (_, il, experts, _) in enumerate(trace):
        now = {(il, ie) for ie in experts}
        for ie in experts:
            key, use = (il, ie), nxt[i][ie]
            if key in resident:
                hits += 1
                resident[key] = use
                heapq.heappush(heap, (-use, key))
                continue
            misses += 1
            if len(resident) >= capacity:
                held, out = [], None
                while heap:
                    nu, k = heapq.heappop(heap)
                    if resident.get(k) != -nu:
                        continue  # stale
                    if k in now:
                        held.append((nu, k))
                        continue
                    out = (nu, k)
                    break
                for h in held:
                    heapq.heappush(heap, h)
                if out is None or (bypass and -out[0] <= use):  # nothing to give up, or the newcomer is needed last
                    if out is not None:
                        heapq.heappush(heap, out)
                    continue
                del resident[out[1]]
            resident[key] = use
            heapq.heappush(heap, (-use, key))
    return {"hits": hits, "misses": misses}


def trace_stats(trace, layers, n_expert) -> dict:
    """The structure a cache can learn from: popularity skew and reuse between steps."""
    counts = defaultdict(lambda: [0] * n_expert)
    prev: dict = {}
    shared = total = 0
    pred_used = pred_n = used_n = 0
    for _, il, experts, predicted in trace:
        for ie in experts:
            counts[il][ie] += 1
        if il in prev:
            shared += len(set(experts) & prev[il])
            total += len(experts)
        prev[il] = set(experts)
        if predicted is not None:
            pred_used += len(set(predicted) & set(experts))
            pred_n += len(predicted)
            used_n += len(experts)
    quarter = max(n_expert // 4, 1)
    top = [sum(sorted(c, reverse=True)[:quarter]) / max(sum(c), 1) for c in counts.values()]
    out = {"lines": len(trace), "steps": len({s for s, _, _, _ in trace}), "moe_layers": len(layers),
           "n_expert": n_expert, "top_quarter_share": round(sum(top) / len(top), 4),
           "uniform_top_quarter_share": 0.25,
           "reuse_from_previous_step": round(shared / total, 4) if total else None}
    if pred_n:
        out["prefetch_precision"] = round(pred_used / pred_n, 4)
        out["prefetch_recall"] = round(pred_used / used_n, 4)
    return out


def evaluate(trace, budgets, top_k, warmup=None, policies=None, container=None) -> dict:
    layers, n_expert = shape_of(trace)
    container = container or shape_container(len(layers), n_expert, top_k)
    policies = policies or [Policy(name=n) for n in POLICIES]
    accesses = sum(len(e) for _, _, e, _ in trace)
    results = []
    for b in budgets:
        cap = max(int(round(b * len(layers) * n_expert)), len(layers))
        opt, keep = replay_belady(trace, cap), replay_belady(trace, cap, bypass=False)
        best, best_kept = (r["hits"] / (r["hits"] + r["misses"]) for r in (opt, keep))
        results.append({"budget": b, "policy": "belady", "slots": cap, "hit_rate": round(best, 4)})
        results.append({"budget": b, "policy": "belady-no-bypass", "slots": cap, "hit_rate": round(best_kept, 4)})
        studied = [] if warmup else [(Policy(name="next-use"), 0), (Policy(name="next-use"), len(layers))]
        for p, foresight in [(p, 0) for p in policies] + studied:
            t0 = time.perf_counter()
            r = replay_next_use(trace, cap, layers, n_expert, top_k, foresight) if p.name == "next-use" else \
                replay_cache(trace, cap, container, top_k, p, warmup)
            cost = (time.perf_counter() - t0) / accesses
            rate = r["hits"] / (r["hits"] + r["misses"])
            name = p.name + ("+warmup" if warmup else "") + (" (replay only)" if p.name == "next-use" else "")
            name += " + the next step known (a bound)" if foresight else ""
            results.append({"budget": b, "policy": name, "slots": cap,
                            "hit_rate": round(rate, 4), "of_belady": round(rate / best, 4) if best else None,
                            "of_belady_no_bypass": round(rate / best_kept, 4) if best_kept else None,
                            "replay_us_per_access": round(cost * 1e6, 2),
                            **{k: v for k, v in r.items() if k not in ("hits", "misses")}})
    return {"trace": trace_stats(trace, layers, n_expert), "results": results}


def library_table(out: dict) -> dict:
    """{policy: {budget: the smallest fraction of Belady over the library's traces}}: a
    policy holds a target only if it holds on every trace."""
    worst: dict = defaultdict(dict)
    for res in out.values():
        for r in res["results"]:
            if "of_belady" in r:
                w = worst[r["policy"]]
                w[r["budget"]] = min(w.get(r["budget"], 1.0), r["of_belady"])
    return dict(worst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="routing trace (JSON lines) to replay")
    ap.add_argument("--warmup", help="a trace to learn the history from before replaying --trace")
    ap.add_argument("--budgets", default="0.05,0.1,0.25,0.5")
    ap.add_argument("--top-k", type=int, default=None, help="experts per token (default: the widest decode line)")
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--make-traces", metavar="DIR", help="write the benchmark's traces into DIR and replay them")
    ap.add_argument("--tokens", type=int, default=256, help="with --make-traces: tokens decoded per trace")
    ap.add_argument("--only", choices=["demo"], help="with --make-traces: trace the demo model alone")
    ap.add_argument("--library", metavar="DIR", help="write the trace library into DIR (bench/traces.py: one "
                    "model per family and the demo model) and replay every policy on every trace")
    a = ap.parse_args()
    budgets = [float(x) for x in a.budgets.split(",")]
    if a.library:
        from traces import make_traces

        paths = make_traces(a.library, a.tokens, library=True)
        out = {}
        for name, (trace_path, warm_path, top_k) in paths.items():
            print(f"replaying {name}", file=sys.stderr)
            out[name] = evaluate(read_trace(trace_path), budgets, top_k)
            out[name + "+warmup"] = evaluate(read_trace(trace_path), budgets, top_k, read_trace(warm_path),
                                             [Policy(name=n) for n in POLICIES if n != "lru"])
        print(provenance.dumps({"benchmark": "cache_policy", "library": out, "worst_of_belady": library_table(out)},
                         indent=None if a.json else 2))
        return
    if a.make_traces:
        from traces import make_traces

        paths = make_traces(a.make_traces, a.tokens, only=a.only)
        out = {}
        for name, (trace_path, warm_path, top_k) in paths.items():
            out[name] = evaluate(read_trace(trace_path), budgets, top_k)
            out[name + "+warmup"] = evaluate(read_trace(trace_path), budgets, top_k, read_trace(warm_path),
                                             [Policy(name=n) for n in POLICIES if n != "lru"])
        print(provenance.dumps(out, indent=None if a.json else 2))
        return
    if not a.trace:
        ap.error("--trace PATH or --make-traces DIR is needed")
    trace = read_trace(a.trace)
    if not trace:
        raise SystemExit(f"{a.trace}: empty trace")
    decode = [len(e) for s, _, e, _ in trace if s > 0]  # prefill is step 0; a decode step's experts: top-k
    top_k = a.top_k or (min(decode) if decode else 1)
    warm = read_trace(a.warmup) if a.warmup else None
    out = evaluate(trace, budgets, top_k, warm)
    print(provenance.dumps(out, indent=None if a.json else 2), file=sys.stdout)


if __name__ == "__main__":
    main()
