"""Decode benchmark: a model shaped like Qwen3-30B-A3B streamed from disk under expert
budgets of 10 %, 25 %, 50 % and 100 % of its expert bytes.

    python bench/decode.py [--workdir DIR] [--tokens 64] [--budgets 0.1,0.25,0.5,1.0]
                           [--expert-gb 16] [--io-threads 2] [--policy learned] [--prefetch N]
                           [--verify first|always|off]
    python bench/decode.py --ab [--budgets 0.1,0.25] [--tokens 32]

The container is built once and kept in --workdir (bench/synthetic.py: hidden 2048, 32
query / 4 KV heads of 128, expert intermediate 768, 128 experts, top-8, experts int4
g64, dense bf16, vocabulary 32000, random weights with a router built to route like a
real one); as many layers as give --expert-gb of experts and fit in half the free disk.
Prompts come from the model's own topic process and the text is sampled (temperature 1,
fixed seeds), so every run of a comparison decodes the same tokens. Each budget runs cold (page cache dropped where permitted;
expert reads are O_DIRECT regardless) and prints, per run: tok/s, time to first token,
hit rate, bytes read per token, the disk's O_DIRECT bandwidth measured in the same run,
and io_floor_ratio = (bytes read / measured bandwidth) / wall time (1.0: the disk is the
only limit; io_floor_ratio_used leaves out the lookahead's reads of experts the router then
did not choose). The 100 % budget also runs warm (no reads): three decodes of the same
tokens, the best expert kernels' GB/s of them next to the best of the memory bandwidth
measurements around them (and each run's figures), and the whole token's weight bytes
(dense tensors, the embedding's row left out, and the step's experts) times tok/s against
the same memory figure: how close the decode as a whole comes to the memory's limit.

--ab compares the cache policies end to end: for each budget, each policy (lru,
lru+pinned, learned) with prefetch off and on, cold (empty usage history) and warm
(the history of a separate warm-up run over other prompts, read-only so every run
starts from the same one): tok/s, hit rate, I/O wait, and for prefetch the fraction of
the miss latency it hid: 1 - (I/O wait with prefetch) / (I/O wait without).
"""

import argparse
import json
import os
import sys
import time

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)

import numpy as np  # noqa: E402
import psutil  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import provenance  # noqa: E402
from synthetic import PRECISIONS, SHAPES, build, load_model, prompt  # noqa: E402

from colibri.engine import kernels, layers  # noqa: E402
from colibri.engine.generate import SamplingParams, generate  # noqa: E402
from colibri.storage.policy import POLICIES, Policy  # noqa: E402


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def disk_gbs(container, threads: int, seconds: float = 3.0) -> float:
    """O_DIRECT reads of whole expert records at random, `threads` at a time."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    recs = list(container.records.values())
    rng = np.random.default_rng(1)
    bufs = [mmap.mmap(-1, container.record_bytes) for _ in range(threads)]
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in {r.file for r in recs}}
    stop = time.perf_counter() + seconds
    picks = rng.integers(0, len(recs), 1 << 20)

    def worker(i):
        n, k = 0, i
        while time.perf_counter() < stop:
            r = recs[picks[k % len(picks)]]
            n += os.preadv(fds[r.file], [bufs[i]], r.offset)
            k += threads
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(worker, range(threads)))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total / dt / 1e9


def memory_gbs() -> float:
    buf = np.ones(256 * 2**20 // 8, np.uint64)
    kernels.read_bandwidth(buf, 1)
    t0 = time.perf_counter()
    kernels.read_bandwidth(buf, 2)
    return 2 * buf.nbytes / (time.perf_counter() - t0) / 1e9


def run(model, ids, tokens: int, seed: int = 0) -> dict:
    st0 = model.experts.stats.copy()
    t0 = time.perf_counter()
    ttft, n = None, 0
    for ev in generate(model, ids, SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed)):
        if ev.kind == "token":
            n += 1
            if ttft is None:  # the prompt is in: what follows is decode
                ttft, st1 = time.perf_counter() - t0, model.experts.stats.copy()
        else:
            stats = ev.stats
    wall = time.perf_counter() - t0
    st = model.experts.stats.minus(st0)
    return {"wall_s": wall, "ttft_s": ttft, "n": n, "st": st, "decode_st": model.experts.stats.minus(st1), "stats": stats}


def ab(a, path: str) -> dict:
    """Each policy, prefetch off and on, cold and warm, at each budget, on the same prompts."""
    import tempfile

    prompts = [prompt(np.random.default_rng(300 + i), a.prompt_tokens) for i in range(2)]
    warm_dir = tempfile.mkdtemp(prefix="colibri-ab-history-")
    probe = load_model(path, budget="min", state_dir=warm_dir)
    c = probe.experts.c
    for i in range(2):  # the warm-up: other prompts of the same process, recorded into the history
        run(probe, prompt(np.random.default_rng(400 + i), a.prompt_tokens), a.tokens, seed=50 + i)
    probe.experts.history.save()
    probe.experts.close()
    del probe
    rows = []
    for frac in [float(x) for x in a.budgets.split(",")]:
        budget = int(c.expert_bytes * frac)
        for name in a.policies.split(","):
            for start in ("cold", "warm"):
                by_prefetch = {}
                for reads in (0, a.prefetch or 8):
                    cold = drop_caches()
                    t0 = time.perf_counter()
                    model = load_model(path, budget=budget, io_threads=a.io_threads,
                                       policy=Policy(name=name, prefetch_reads=reads),
                                       state_dir=warm_dir if start == "warm" else None, history_read_only=True)
                    load_s = time.perf_counter() - t0
                    warm_reads = model.experts.stats.bytes_read // c.record_bytes
                    st0 = model.experts.stats.copy()
                    runs = [run(model, p, a.tokens, seed=i) for i, p in enumerate(prompts)]
                    st = model.experts.stats.minus(st0)
                    tokens = sum(r["n"] - 1 for r in runs)
                    decode_s = sum(r["stats"]["decode_s"] for r in runs)
                    row = {"budget_fraction": frac, "policy": name, "start": start, "prefetch_reads": reads,
                           "page_cache_dropped": cold, "load_s": round(load_s, 2),
                           "warm_start_reads": warm_reads, "tok_s": round(tokens / decode_s, 3), "hit_rate": round(st.hits / st.experts, 4),
                           "io_wait_s": round(st.io_wait_s, 3), "bytes_read": st.bytes_read,
                           "prefetch_precision": round(st.prefetch_used / max(st.prefetch_used + st.prefetch_wasted, 1), 4)
                           if reads else None}
                    by_prefetch[reads] = row
                    model.experts.close()
                    del model
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
                off, on = by_prefetch[0], by_prefetch[a.prefetch or 8]
                on["miss_latency_hidden"] = round(1 - on["io_wait_s"] / off["io_wait_s"], 3) if off["io_wait_s"] else None
    return {"benchmark": "decode-policies", "container": path, "tokens_per_prompt": a.tokens, "prompts": len(prompts),
            "warm_history": os.path.join(warm_dir, "history"), "results": rows}


def context_bytes(model, lengths=(4096, 65536, 1 << 20)) -> dict:
    """A sequence's cache at each context length: from the cache's layout (KV bytes a
    token, the recurrent state), checked against the arrays a sequence of the first length
    really takes (its blocks in the KV pool, its state); and for DeepSeek-V4 what its own
    compact cache would hold (each layer's window of keys, the closed compressed entries and
    indexer keys), the bytes colibri's rows of every position are measured against."""
    per_token, state = model.kv_bytes_per_token(), model.state_bytes_per_sequence()
    out = {"layout": {str(n): n * per_token + state for n in lengths}}
    cache = model.new_cache(lengths[0])
    cache.cover(lengths[0])
    allocated = len(cache.blocks) * cache.pool.block_bytes + cache.state_bytes
    assert allocated == out["layout"][str(lengths[0])], (allocated, out["layout"])
    out[f"allocated_at_{lengths[0]}"] = allocated
    cache.pool.drop(cache.blocks)
    if model.MODEL_TYPE == "deepseek_v4":
        a = model.args
        rate = a.compress_rates

        def compact(n):
            total = 0
            for kind in a.layer_types:
                total += min(n, a.sliding_window) * a.head_dim
                if kind == "compressed_sparse_attention":
                    total += n // rate[kind] * (a.head_dim + a.index_head_dim)
                elif kind == "heavily_compressed_attention":
                    total += n // rate[kind] * a.head_dim
            return 4 * total

        out["deepseek_v4_compact"] = {str(n): compact(n) for n in lengths}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--budgets", default="0.1,0.25,0.5,1.0")
    ap.add_argument("--expert-gb", type=float, default=16.0)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=8, help="router lookahead: reads started ahead per layer (0: off)")
    ap.add_argument("--policy", default="learned", choices=POLICIES)
    ap.add_argument("--verify", default="first", choices=("first", "always", "off"),
                    help="checksums of expert reads (colibri's default: each expert's first read)")
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(SHAPES),
                    help="the layers' shape (bench/synthetic.py SHAPES): Qwen3-30B-A3B, DeepSeek-V3, GLM-4.5, gpt-oss-120b, "
                         "Qwen3.5, DeepSeek-V4-Flash, Qwen3.8-Flash-Next (qwen4_exp, its n-gram tables streamed)")
    ap.add_argument("--precision", default="int4", choices=PRECISIONS,
                    help="the experts' precision: int4 g64, or kept as published (FP8 128 x 128 blocks, MXFP4)")
    ap.add_argument("--table-budget", type=float, default=None, metavar="FRACTION",
                    help="Qwen4-Exp's n-gram tables streamed under this fraction of their bytes (default: the "
                         "expert budget's fraction; 1.0 and more: resident)")
    ap.add_argument("--dense-dtype", choices=("int8", "int4"), default=None,
                    help="the dense matrices computed by linear() quantized (convert --dense-dtype; lossy, on int8 "
                         "activations; default: bf16 as built)")
    ap.add_argument("--throttle-mbs", type=float, default=None, metavar="MB/S",
                    help="read the workdir's disk at most this fast (a cgroup v1 blkio throttle, as root): a slower "
                         "drive, where the disk is the limit")
    ap.add_argument("--ab", action="store_true", help="compare the cache policies instead (see above)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="with --ab: the policies to compare")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    layers.init()
    path = build(a.workdir, a.expert_gb, family=a.family, precision=a.precision, dense_dtype=a.dense_dtype)
    if a.ab:
        print(provenance.dumps(ab(a, path), indent=2))
        return
    if a.throttle_mbs:  # a slower drive: the disk the workdir is on, read at most this fast by this process
        from loopdrives import disk_of, throttled

        with throttled({disk_of(a.workdir): int(a.throttle_mbs * 1e6)}):
            out = measure(a, path)
        out["throttle_mbs"] = a.throttle_mbs
    else:
        out = measure(a, path)
    print(provenance.dumps(out, indent=2))


def measure(a, path: str) -> dict:
    """The runs at each budget of a.budgets on the container at `path`: the benchmark's JSON."""
    results = []
    ids = prompt(np.random.default_rng(7), a.prompt_tokens)
    mem = memory_gbs()
    # compile every kernel a run takes (the prompt's and the decode's), so no run's time to
    # first token is numba's: after an edit of a kernel file its cache starts empty
    warm = load_model(path, budget="min")
    run(warm, ids[:4], 2)
    warm.experts.close()
    del warm
    for frac in [float(x) for x in a.budgets.split(",")]:
        cold = drop_caches()
        probe = load_model(path, budget="min")
        c = probe.experts.c
        budget = int(c.expert_bytes * frac)
        kv_bytes, attention = probe.kv_bytes_per_token(), probe.ATTENTION
        state_bytes = probe.state_bytes_per_sequence()
        context = context_bytes(probe)
        del probe
        if budget + 3e9 > psutil.virtual_memory().available:
            results.append({"budget_fraction": frac, "skipped": "not enough free memory for this budget"})
            continue
        # the shared disk is noisy: its best of a few measurements, at the run's thread count and at 4
        disk = max(disk_gbs(c, a.io_threads), disk_gbs(c, 4), disk_gbs(c, a.io_threads))
        t0 = time.perf_counter()
        table_frac = a.table_budget if a.table_budget is not None else frac
        table_bytes = sum(t["end"] - t["begin"] for t in c.tables.values())
        table_budget = int(table_bytes * table_frac) if table_bytes and table_frac < 1.0 else "all"
        model = load_model(path, budget=budget, io_threads=a.io_threads, table_budget=table_budget,
                           policy=Policy(name=a.policy, prefetch_reads=a.prefetch), verify=a.verify)
        load_s = time.perf_counter() - t0
        tables0 = model.tables.stats() if model.tables is not None else None
        r = run(model, ids, a.tokens)
        st = r["st"]
        tables1 = model.tables.stats() if model.tables is not None else None
        table_read = tables1["bytes_read"] - tables0["bytes_read"] if tables0 else 0
        # the disk's limit: the best of the measurements around the run and of what the run
        # itself got (a noisy shared disk makes any one measurement low)
        achieved = st.bytes_read / st.io_wall_s / 1e9 if st.io_wall_s else 0.0
        disk = max(disk, disk_gbs(c, a.io_threads), disk_gbs(c, 4), achieved)
        n_tok = a.prompt_tokens + r["n"] - 1
        decode_s = r["stats"]["decode_s"]
        row = {
            "budget_fraction": frac, "budget_bytes": budget, "cold": cold, "load_s": round(load_s, 2),
            "tok_s": round((r["n"] - 1) / decode_s, 3), "ttft_s": round(r["ttft_s"], 3),
            "hit_rate": round(st.hits / st.experts, 4), "bytes_read_per_token": int(st.bytes_read / n_tok),
            "disk_odirect_gbs": round(disk, 3), "read_gbs": round(st.bytes_read / st.io_wall_s / 1e9, 3)
            if st.io_wall_s else None,
            "io_wait_s": round(st.io_wait_s, 3), "wall_s": round(r["wall_s"], 3),
            "verify": a.verify, "verified": st.verified, "verify_s": round(st.verify_s, 3),
            "io_floor_ratio": round(st.bytes_read / (disk * 1e9) / r["wall_s"], 3) if st.bytes_read else None,
            # the same for the bytes the steps used: without the lookahead's reads of experts not chosen
            "io_floor_ratio_used": round((st.bytes_read - st.prefetch_wasted * c.record_bytes) / (disk * 1e9)
                                         / r["wall_s"], 3) if st.bytes_read else None,
            "prefetch": {"reads_per_layer": a.prefetch, "issued": st.prefetch_issued, "used": st.prefetch_used,
                         "wasted": st.prefetch_wasted},
        }
        if table_bytes:  # the n-gram tables: their own budget, reads and hit rate; the disk floor of both reads
            row["tables"] = {"table_bytes": table_bytes, "budget_bytes": table_budget, "budget_fraction": table_frac,
                             "bytes_read_per_token": int(table_read / n_tok),
                             "expert_bytes_read_per_token": int(st.bytes_read / n_tok),
                             "hit_rate": tables1["hit_rate"] if tables1 else None,
                             "io_floor_ratio_with_tables": round((st.bytes_read + table_read) / (disk * 1e9)
                                                                 / r["wall_s"], 3)}
        if frac >= 1.0:  # warm: everything resident, no reads; how fast do the expert kernels go?
            for il in model.moe_layers:
                for _ in model.experts.stream(il, list(range(model.n_expert))):
                    pass
            mem_run = max(memory_gbs() for _ in range(3))
            # three decodes of the same tokens: the best of them, as memory's best of its
            # measurements (a neighbour on this shared box slows either at any moment)
            expert_bytes, warm = sum(p.n_bytes for p in c.layout), []
            # the whole token's weight bytes: every dense tensor but the embedding (one row of it
            # is read; unless it is also the LM head), and the experts a decode step computes
            tied = c.config.get("tie_word_embeddings", False)
            dense_bytes = sum(c.dense.entry(n).n_bytes for n in c.dense.where if tied or "embed_tokens" not in n)
            for _ in range(3):
                w = run(model, prompt(np.random.default_rng(8), a.prompt_tokens), a.tokens, seed=1)
                wst = w["decode_st"]  # the decode steps' (the prompt's step runs the prompt-token kernels)
                tok_s = (w["n"] - 1) / w["stats"]["decode_s"]
                token_bytes = dense_bytes + wst.experts / (w["n"] - 1) * expert_bytes
                warm.append((tok_s, wst.experts * expert_bytes / (wst.moe_s - wst.io_wait_s) / 1e9,
                             wst.misses, tok_s * token_bytes / 1e9))
            # the memory's limit: the best of the measurements around the runs (a neighbour on
            # this shared box can make any one of them several times too low)
            mem_run = max([mem_run, mem] + [memory_gbs() for _ in range(3)])
            tok_s, gbs, misses, _ = max(warm, key=lambda r: r[1])
            token_gbs = max(r[3] for r in warm)  # the whole decode (dense, attention, experts, Python) as weight bytes a second
            row["warm"] = {"tok_s": round(tok_s, 3), "misses": misses, "expert_kernel_gbs": round(gbs, 3),
                           "memory_gbs": round(mem_run, 3), "expert_kernel_ratio_to_memory": round(gbs / mem_run, 3),
                           "token_weight_gbs": round(token_gbs, 3), "token_ratio_to_memory": round(token_gbs / mem_run, 3),
                           "runs": [{"tok_s": round(t, 3), "expert_kernel_gbs": round(k, 3), "ratio": round(k / mem_run, 3),
                                     "token_ratio": round(tg / mem_run, 3)} for t, k, _, tg in warm]}
        model.experts.close()
        del model
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    return {"benchmark": "decode", "family": a.family, "precision": a.precision, "dense_dtype": a.dense_dtype or "bf16",
            "container": path, "n_layer": len(c.moe_layers),
            "kv_bytes_per_token": kv_bytes, "state_bytes_per_sequence": state_bytes, "attention": attention,
            "context_bytes": context, "expert_bytes": c.expert_bytes, "record_bytes": c.record_bytes,
            "io_threads": a.io_threads, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens,
            "memory_gbs": round(mem, 3), "results": results}


if __name__ == "__main__":
    main()
