"""Cache policies against the optimum on a routing trace.

    python bench/cache_policy.py --trace PATH [--budgets 0.05,0.1,0.25,0.5] [--warmup PATH]
                                 [--top-k K] [--json]
    python bench/cache_policy.py --make-traces DIR [--tokens 256]

Replays a trace written by `colictl run --routing-trace` (one JSON line per forward step
per MoE layer: {"step", "layer", "experts"[, "predicted"]}; a line's experts must be
resident together) against caches of each budget — a fraction of all experts of all
layers — and prints {"results": [{"budget", "policy", "hit_rate", ...}], ...}:

- `lru`: the expert cache's per-layer LRU, each layer an equal share;
- `lru+pinned`: the learned hot set of storage/policy.py over the same LRU, learning
  only from the part of the trace already replayed (or from a --warmup trace first);
- `belady`: the optimum: one pool for all layers, evicting the expert whose next use is
  farthest in the future (it alone sees the future).

It also prints the trace's structure (the share of routings that go to each layer's
most popular quarter of experts; the share of a step's experts the previous step of the
same layer also used) and, where the lines carry the router lookahead's "predicted"
experts, the prefetch precision (predicted experts that were used) and recall (used
experts that were predicted).

--make-traces DIR writes the traces this benchmark is run on: the decode benchmark's
synthetic model (bench/synthetic.py; its router is built with structure) and the tiny
test checkpoints' families, each decoding sampled text from prompts of its own.
"""

import argparse
import heapq
import json
import os
import sys
from collections import OrderedDict, defaultdict

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)

from colibri.storage.history import UsageHistory  # noqa: E402
from colibri.storage.policy import POLICIES, Policy, learned_slots, plan_repin, victim  # noqa: E402


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


def replay_lru(trace, capacity: int, layers: list[int], n_expert: int, top_k: int, policy: Policy,
               warmup=None) -> dict:
    """The expert cache's own structure: per-layer LRU shares, and with a learning policy
    the hot set across layers, revised every repin_every steps from the past only."""
    n_learn = learned_slots(policy, capacity, len(layers), top_k, n_expert)
    per_layer = max((capacity - n_learn) // len(layers), 1)
    main: dict = {}  # `learned`: the main region, (layer, expert) kept by usage
    n_main = 0
    if policy.windowed:  # as ExpertCache._place: a recency window per layer, the rest the main region
        window = max(1, min(top_k, per_layer, per_layer // 4))
        n_main, per_layer = (per_layer - window) * len(layers), window
    heap: list = []  # `learned`: (usage, key) of the main region, stale entries skipped
    lru = {il: OrderedDict() for il in layers}
    pinned: set = set()
    hist = UsageHistory(layers, n_expert)
    warm_reads = 0
    if warmup:
        last = None
        for step, il, experts, _ in warmup:
            if step != last:
                hist.step()
                last = step
            hist.record(il, experts)
        for key in hist.hottest(n_learn):
            pinned.add(key)
            warm_reads += 1
        for key in hist.hottest(n_main):
            main[key] = True
            heapq.heappush(heap, (raw(hist, key), key))
            warm_reads += 1
    hits = misses = steps = repins = 0
    last = None
    for step, il, experts, _ in trace:
        if step != last:
            last = step
            hist.step()
            steps += 1
            if policy.learns and policy.repin_every and steps % policy.repin_every == 0:
                challengers = [(l2, e) for l2, d in lru.items() for e in d]
                for add, drop in plan_repin(hist.value, list(pinned), challengers, n_learn - len(pinned),
                                            policy.repin_margin):
                    del lru[add[0]][add[1]]
                    pinned.add(add)
                    if drop is not None:
                        pinned.discard(drop)
                        if drop[0] == add[0]:  # the same layer: it takes the freed slot, oldest first
                            lru[il2 := drop[0]][drop[1]] = True
                            lru[il2].move_to_end(drop[1], last=False)
                    repins += 1
        d, now = lru[il], set(experts)
        hist.record(il, experts)  # as ExpertCache.stream: the step's routing is known when it is served
        for ie in experts:
            if (il, ie) in pinned or (il, ie) in main:
                hits += 1
            elif ie in d:
                hits += 1
                d.move_to_end(ie)
            else:
                misses += 1
                if len(d) >= per_layer:
                    out = victim(d, now)
                    if out is None and n_main:  # as ExpertCache._borrow: a slot of the main region
                        room = len(main) + len(d) - per_layer < n_main
                        low = None if room else least_used(heap, main, hist, il, now)
                        if low is not None:
                            heapq.heappush(heap, (raw(hist, low), low))  # looked at; taken below or kept
                        if room or (low is not None and raw(hist, low) < raw(hist, (il, ie))):
                            main.pop(low, None)
                            d[ie] = True
                            continue
                    if out is None:
                        continue  # the step's own experts fill the share: this one streams through
                    del d[out]
                    if n_main:  # as ExpertCache._take_slot: into the main region if room or used more
                        key = (il, out)
                        low = None if len(main) < n_main else least_used(heap, main, hist, il, now)
                        if len(main) < n_main or (low is not None and raw(hist, key) > raw(hist, low)):
                            main.pop(low, None)
                            main[key] = True
                            heapq.heappush(heap, (raw(hist, key), key))
                        elif low is not None:
                            heapq.heappush(heap, (raw(hist, low), low))  # it stays
                d[ie] = True
        while n_main and len(d) > per_layer:  # as ExpertCache._trim_window
            out = next(iter(d))
            del d[out]
            low = least_used(heap, main, hist, il, set())
            if low is not None:
                heapq.heappush(heap, (raw(hist, low), low))  # only looked at
            if low is None or raw(hist, (il, out)) >= raw(hist, low):
                main[(il, out)] = True
                heapq.heappush(heap, (raw(hist, (il, out)), (il, out)))
        for ie in experts:
            if (il, ie) in main:
                heapq.heappush(heap, (raw(hist, (il, ie)), (il, ie)))

    return {"hits": hits, "misses": misses, "pinned_slots": n_learn, "lru_slots_per_layer": per_layer,
            "main_slots": n_main,
            "repins": repins, "warm_reads": warm_reads}


def raw(hist, key) -> float:
    """An expert's count in the history's own units (comparable across a replay, since
    the lazy decay scales every count alike)."""
    return float(hist.counts[hist.row[key[0]], key[1]])


def least_used(heap: list, pool: dict, hist, il: int, now: set):
    """The pool's expert with the lowest usage count that this line (layer il) does not
    need, taken off the heap (decay scales every count alike, so a count only changes
    when its expert is used, and a heap with stale entries skipped stays ordered)."""
    held, out = [], None
    while heap:
        v, key = heapq.heappop(heap)
        if key not in pool or v != raw(hist, key):
            continue  # evicted or used since: a newer entry is in the heap
        if key[0] == il and key[1] in now:
            held.append((v, key))
            continue
        out = key
        break
    for h in held:
        heapq.heappush(heap, h)
    return out


def replay_belady(trace, capacity: int) -> dict:
    """Belady's optimum over one pool (with bypass): on a miss with the pool full, of the
    resident experts not needed by this line and the newcomer itself, the one whose next
    use is farthest away goes (the newcomer then only streams through)."""
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
                if out is None or -out[0] <= use:  # nothing to give up, or the newcomer is needed last
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


def evaluate(trace, budgets, top_k, warmup=None, policies=None) -> dict:
    layers, n_expert = shape_of(trace)
    policies = policies or [Policy(name=n) for n in POLICIES]
    results = []
    for b in budgets:
        cap = max(int(round(b * len(layers) * n_expert)), len(layers))
        opt = replay_belady(trace, cap)
        best = opt["hits"] / (opt["hits"] + opt["misses"])
        results.append({"budget": b, "policy": "belady", "slots": cap, "hit_rate": round(best, 4)})
        for p in policies:
            r = replay_lru(trace, cap, layers, n_expert, top_k, p, warmup)
            rate = r["hits"] / (r["hits"] + r["misses"])
            results.append({"budget": b, "policy": p.name + ("+warmup" if warmup else ""), "slots": cap,
                            "hit_rate": round(rate, 4), "of_belady": round(rate / best, 4) if best else None,
                            **{k: v for k, v in r.items() if k not in ("hits", "misses")}})
    return {"trace": trace_stats(trace, layers, n_expert), "results": results}


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
    a = ap.parse_args()
    budgets = [float(x) for x in a.budgets.split(",")]
    if a.make_traces:
        from traces import make_traces

        paths = make_traces(a.make_traces, a.tokens, only=a.only)
        out = {}
        for name, (trace_path, warm_path, top_k) in paths.items():
            out[name] = evaluate(read_trace(trace_path), budgets, top_k)
            out[name + "+warmup"] = evaluate(read_trace(trace_path), budgets, top_k, read_trace(warm_path),
                                             [Policy(name=n) for n in POLICIES if n != "lru"])
        print(json.dumps(out, indent=None if a.json else 2))
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
    print(json.dumps(out, indent=None if a.json else 2), file=sys.stdout)


if __name__ == "__main__":
    main()
