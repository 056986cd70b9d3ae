"""Warm context through the daemon (issue 23): a shared prefix computed once, a chat kept
as a session, a long prompt beside a running stream.

    python bench/prefix.py [--expert-gb 2] [--budget 0.25] [--prefix-tokens 1500] [--parts a,b,c]
                           [--family qwen3_moe]

On the decode benchmark's synthetic model (bench/synthetic.py; the byte-level tokenizer:
one token a character), with the expert cache at --budget of the expert bytes:

(a) 20 requests that share a --prefix-tokens prefix, each with its own 20-token question,
    one token each, one after another: time to first token and expert bytes read per
    request, on a daemon with the prefix cache off (cold: every request computes the
    prefix; the first three are timed) and on one with it on (the first computes it, the
    others reuse its blocks). The target: cached TTFT at least 10x faster than cold.
(b) a 10-turn conversation (raw text turns of 100 tokens, 16 sampled tokens a reply):
    resent whole each turn with the prefix cache off, resent whole with it on, and as a
    session (each turn sends its new text only): prompt tokens computed and wall time.
(c) bench/prefill_gap.py's measurement at --gap-tokens: a running stream's largest gap
    between tokens while a long prompt arrives, whole (prefill_chunk 0) and in chunks of
    64, with the stream's own jitter alone as the floor (`auto` takes a step per token
    here: the stream would outrun the model's 4,096-token context; bench/prefill_gap.py
    measures it at 1,900 tokens).
(d) in-process, the model's attention shape: the paged kernel (a sequence's KV in the
    pool's blocks, in shuffled order) against the same positions as one block, at decode
    and at a 64-token prompt chunk, 512 and 2048 positions (the same bits, asserted); and
    the KV pool's bytes for 8 requests that share a --prefix-tokens prefix, against what
    8 private copies would take.
(e) a hybrid's state snapshots, in-process with every expert in RAM: a --long-tokens prompt
    computed once, then requests that share a part of it (random lengths, the same for
    every setting) and diverge, each the first to: per `state_snapshot_tokens` setting
    (--intervals; auto: engine/prefix.snapshot_interval), the prompt tokens each computed
    again and its time to first token, against the snapshots' bytes and the KV bytes of
    the prompt.

Prints one JSON object; the machine's memory bandwidth and the KV bytes per token are in
it.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from control_plane import start_daemon  # noqa: E402
from prefill_gap import one_run as gap_run  # noqa: E402
from synthetic import SHAPES, build, load_model  # noqa: E402

from colibri.ctl.client import Client  # noqa: E402

LETTERS = list("abcdefghijklmnopqrstuvwxyz ")


def text(rng, n: int) -> str:
    return "".join(rng.choice(LETTERS, n))


def daemon(path: str, budget: int, tmp: str, name: str, **cfg):
    conf = os.path.join(tmp, f"{name}.yaml")
    cfg = {"state_dir": os.path.join(tmp, f"state-{name}")} | cfg  # sessions and history start empty
    with open(conf, "w") as f:
        f.write("".join(f"{k}: {v}\n" for k, v in cfg.items()))
    return start_daemon(path, budget, tmp, "--config", conf, name=name)


def stop(sock: str, proc) -> None:
    try:
        Client(sock, operator=True).connect().call("shutdown")
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()


def timed(c: Client, **fields) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = c.call("generate", timeout_ms=None, **fields)
    return time.perf_counter() - t0, r


def shared_prefix(sock: str, prefix: str, questions: list[str]) -> list[dict]:
    c = Client(sock).connect()
    out = []
    for q in questions:
        s, r = timed(c, prompt=prefix + q, max_tokens=1)
        st = r["stats"]
        out.append({"ttft_s": round(s, 4), "cached_prompt_tokens": st["cached_prompt_tokens"],
                    "expert_bytes_read": st["experts"]["bytes_read"]})
    return out


def conversation(sock: str, turns: list[str], session: str | None) -> dict:
    c = Client(sock).connect()
    history, computed, t0 = "", 0, time.perf_counter()
    for i, turn in enumerate(turns):
        fields = {"prompt": turn, "session": session} if session else {"prompt": history + turn}
        r = c.call("generate", timeout_ms=None, max_tokens=16, temperature=1.0, seed=i, **fields)
        st = r["stats"]
        computed += st["n_prompt_tokens"] - st["cached_prompt_tokens"]
        history += turn + r["text"]
    return {"prompt_tokens_computed": computed, "wall_s": round(time.perf_counter() - t0, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--expert-gb", type=float, default=2.0)
    ap.add_argument("--budget", type=float, default=0.25, help="expert cache, a fraction of the expert bytes")
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--gap-tokens", type=int, default=4000)
    ap.add_argument("--parts", default="a,b,c,d", help="a,b,c,d; e: a hybrid's snapshot interval")
    ap.add_argument("--long-tokens", type=int, default=3000, help="(e) the prompt the others share parts of")
    ap.add_argument("--intervals", default="256,1024,auto,4096", help="(e) the state_snapshot_tokens settings")
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(SHAPES),
                    help="the layers' shape (bench/synthetic.py SHAPES); qwen3_5_moe: a hybrid, whose prefix "
                         "cache keeps state snapshots")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    path = build(a.workdir, a.expert_gb, family=a.family)
    probe = load_model(path, budget="min")
    budget = int(probe.experts.c.expert_bytes * a.budget)
    kv_per_token, state_bytes = probe.kv_bytes_per_token(), probe.state_bytes_per_sequence()
    del probe
    from decode import memory_gbs

    tmp = tempfile.mkdtemp(prefix="colibri-prefix-")
    rng = np.random.default_rng(11)
    out = {"benchmark": "prefix", "family": a.family, "container": path, "budget_fraction": a.budget,
           "budget_bytes": budget, "kv_bytes_per_token": kv_per_token, "state_bytes_per_sequence": state_bytes,
           "memory_gbs": round(memory_gbs(), 2)}
    parts = a.parts.split(",")
    if "a" in parts:
        prefix = text(rng, a.prefix_tokens)
        questions = [text(rng, 20) for _ in range(20)]
        sock, proc = daemon(path, budget, tmp, "kv-off", kv_cache=0)
        try:
            cold = shared_prefix(sock, prefix, questions[:3])
        finally:
            stop(sock, proc)
        sock, proc = daemon(path, budget, tmp, "kv-on", kv_cache="2GiB")
        try:
            warm = shared_prefix(sock, prefix, questions)
            kv_stats = Client(sock).connect().call("stats").get("kv") or {}
        finally:
            stop(sock, proc)
        cold_s = statistics.median(r["ttft_s"] for r in cold)
        warm_s = statistics.median(r["ttft_s"] for r in warm[1:])
        out["a_shared_prefix"] = {
            "cold_ttft_s": cold_s, "cached_ttft_s": warm_s, "ttft_ratio": round(cold_s / warm_s, 2),
            "cold_expert_bytes_per_request": statistics.median(r["expert_bytes_read"] for r in cold),
            "cached_expert_bytes_per_request": statistics.median(r["expert_bytes_read"] for r in warm[1:]),
            "cached_prompt_tokens": warm[1]["cached_prompt_tokens"],
            "prefix_cache_bytes": kv_stats.get("bytes"), "state_snapshots": kv_stats.get("state_snapshots"),
            "prefix_copy_s_at_memory_bandwidth": round(
                warm[1]["cached_prompt_tokens"] * kv_per_token / (out["memory_gbs"] * 1e9), 5),
            "cold": cold, "cached": warm}
        print(json.dumps(out["a_shared_prefix"]["ttft_ratio"]), file=sys.stderr)
    if "b" in parts:
        turns = [text(rng, 100) for _ in range(10)]
        res = {}
        for name, kv, session in (("resent_kv_off", 0, None), ("resent_prefix_cache", "2GiB", None),
                                  ("session", 0, "bench")):
            sock, proc = daemon(path, budget, tmp, f"chat-{name}", kv_cache=kv)
            try:
                res[name] = conversation(sock, turns, session)
            finally:
                stop(sock, proc)
            print(json.dumps({name: res[name]}), file=sys.stderr)
        out["b_conversation"] = res
    if "c" in parts:
        res = []
        for chunk in ("0", "64"):
            sock, proc = daemon(path, budget, tmp, f"gap-{chunk}", prefill_chunk=chunk)
            try:
                run = gap_run(sock, a.gap_tokens, np.random.default_rng(5))
            finally:
                stop(sock, proc)
            res.append(run | {"prefill_chunk": chunk})
            print(json.dumps(res[-1]), file=sys.stderr)
        out["c_prefill_gap"] = res
    if "d" in parts:
        out["d_paged"] = paged(path, a.prefix_tokens)
        print(json.dumps(out["d_paged"]), file=sys.stderr)
    if "e" in parts:
        out["e_snapshot_interval"] = snapshot_intervals(path, a.long_tokens, a.intervals.split(","))
    print(provenance.dumps(out, indent=2))


def snapshot_intervals(path: str, n_long: int, settings: list[str], n_sharers: int = 6) -> dict:
    from colibri.engine import layers
    from colibri.engine.generate import Batcher, Request, SamplingParams
    from colibri.engine.prefix import PrefixCache, snapshot_interval

    layers.init()  # every CPU, as the daemon's engine
    model = load_model(path, budget="all")
    rng = np.random.default_rng(4)
    V = model.args.vocab_size
    long = rng.integers(0, V, n_long).tolist()
    shares = rng.integers(n_long // 4, n_long, n_sharers).tolist()  # (in arrival order: a later one may
    # resume where an earlier one left the cached blocks)
    sharers = [long[:n] + rng.integers(0, V, 20).tolist() for n in shares]
    state, kv = model.state_bytes_per_sequence(), model.kv_bytes_per_token()

    def first_token(batcher, ids) -> tuple[float, int]:
        req = Request(model, ids, SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        batcher.add(req)
        while batcher.active:
            batcher.step()
        return time.perf_counter() - t0, req.cached

    first_token(Batcher(model), long[:64])  # kernels warm
    rows = []
    for setting in settings:
        every = snapshot_interval(int(setting) if setting != "auto" else setting, model)
        prefix = PrefixCache(1 << 40, every)
        batcher = Batcher(model, prefix=prefix)
        long_s, _ = first_token(batcher, long)
        snaps = prefix.counters["state_snapshots"]
        got = [first_token(batcher, ids) for ids in sharers]
        recomputed = [len(ids) - c for ids, (_, c) in zip(sharers, got)]
        rows.append({"setting": setting, "snapshot_tokens": every, "long_prompt_s": round(long_s, 3),
                     "snapshots_of_long_prompt": snaps, "snapshot_bytes": snaps * state,
                     "snapshot_bytes_to_prompt_kv": round(snaps * state / (n_long * kv), 3),
                     "recomputed_tokens": recomputed, "mean_recomputed": round(statistics.mean(recomputed), 1),
                     "ttft_s": [round(t, 3) for t, _ in got],
                     "mean_ttft_s": round(statistics.mean(t for t, _ in got), 3)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {"long_prompt_tokens": n_long, "shared_tokens": shares, "state_bytes": state, "kv_bytes_per_token": kv,
            "rows": rows}


def best_of(f, *args, n: int = 15) -> float:
    f(*args)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def paged(path: str, prefix_tokens: int) -> dict:
    from colibri.engine import attention, kernels, layers
    from colibri.engine.generate import Batcher, Request, SamplingParams
    from colibri.engine.prefix import PrefixCache
    from colibri.engine.sequence import KV_BLOCK, KVPool

    layers.init()
    model = load_model(path, budget="all")
    sp = model.attn_spec
    Hq, Hkv, hd, hv = sp.n_head, sp.n_kv_head, sp.head_dim, sp.hv
    rng = np.random.default_rng(2)
    rows = []
    for S in (512, 2048):
        pool = KVPool({"k": (1, Hkv, hd), "v": (1, Hkv, hv)}, reserve=(S // KV_BLOCK + 8) * KV_BLOCK * Hkv * (hd + hv) * 4)
        table = rng.permutation(pool.n_blocks)[: S // KV_BLOCK].astype(np.int64)
        pool.arrays["k"][table] = rng.standard_normal(pool.arrays["k"][table].shape).astype(np.float32)
        pool.arrays["v"][table] = rng.standard_normal(pool.arrays["v"][table].shape).astype(np.float32)
        k = np.ascontiguousarray(pool.arrays["k"][table, 0].transpose(1, 0, 2, 3).reshape(Hkv, S, hd))
        v = np.ascontiguousarray(pool.arrays["v"][table, 0].transpose(1, 0, 2, 3).reshape(Hkv, S, hv))
        for T in (1, 64):
            q = rng.standard_normal((T, Hq, hd)).astype(np.float32)
            one, blocks = np.empty((T, Hq, hv), np.float32), np.empty((T, Hq, hv), np.float32)
            scale = np.float32(hd**-0.5)

            a = best_of(kernels.attention, q, k, v, S - T, 0, scale, attention.NO_SINKS, one)
            b = best_of(kernels.attention_paged, q, pool.arrays["k"], pool.arrays["v"], 0, table, KV_BLOCK, S - T, 0,
                        scale, attention.NO_SINKS, blocks)
            assert np.array_equal(one, blocks)
            rows.append({"positions": S, "tokens": T, "one_block_ms": round(a * 1e3, 3),
                         "blocks_ms": round(b * 1e3, 3), "ratio": round(b / a, 3)})
    ids = rng.integers(0, model.args.vocab_size, prefix_tokens).tolist()
    prefix = PrefixCache(1 << 34)
    batcher = Batcher(model, prefix=prefix)
    first = Request(model, ids + [1], SamplingParams(max_tokens=1), rid=0)
    batcher.add(first)
    while batcher.active:
        batcher.step()
    del first
    reqs = [Request(model, ids + rng.integers(0, model.args.vocab_size, 20).tolist(), SamplingParams(max_tokens=1),
                    rid=i) for i in range(8)]
    for r in reqs:
        batcher.add(r)
    batcher.step()  # each computes its own 20 tokens beside the shared blocks
    used = model.kv_pool.used * model.kv_pool.block_bytes
    private = 8 * -(-(prefix_tokens + 20) // KV_BLOCK) * model.kv_pool.block_bytes
    return {"attention": rows, "requests": 8, "shared_prefix_tokens": prefix_tokens,
            "pool_bytes_in_use": used, "private_copies_bytes": private, "bytes_ratio": round(used / private, 3)}


if __name__ == "__main__":
    main()
