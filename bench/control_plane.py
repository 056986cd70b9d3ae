"""Control-plane benchmark: what the daemon costs and what sharing it buys.

    python bench/control_plane.py [--expert-gb 16] [--budget 0.1] [--clients 1,2,4,8] [--tokens 32]

Starts colibrid on the decode benchmark's synthetic model (bench/decode.py builds it) at
an expert budget of --budget of its expert bytes, and prints one JSON object:
- ping round trip p50/p99 (ms), while idle;
- the extra time to first token through the daemon, against the same request in process;
- for each client count N: N clients send a generate request of the same prompt length at
  once; aggregate tokens/s, expert bytes read per generated token, and the union saving
  (the experts each request routed to, summed over requests, per layer and step, divided
  by the unique experts the batch asked for), from routing traces of each prompt alone
  and of the batch.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic import build  # noqa: E402

from colibri.ctl.client import Client  # noqa: E402


def wait_ready(sock: str, proc, timeout=900) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit("colibrid exited")
        try:
            Client(sock, timeout_s=1).connect().call("ping")
            return
        except Exception:
            time.sleep(0.5)
    raise SystemExit("colibrid did not start")


def trace_sets(path: str) -> dict:
    """(step, layer) -> experts, from a routing trace."""
    out = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out[(r["step"], r["layer"])] = set(r["experts"])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--expert-gb", type=float, default=16.0)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    path = build(a.workdir, a.expert_gb)
    from colibri.storage.container import open_container

    budget = int(open_container(path).expert_bytes * a.budget)
    tmp = tempfile.mkdtemp(prefix="colibri-cp-")
    sock = os.path.join(tmp, "c.sock")
    log = open(os.path.join(tmp, "colibrid.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--model", path, "--socket", sock,
                             "--expert-cache", str(budget)], stderr=log)
    try:
        wait_ready(sock, proc)
        c = Client(sock).connect()
        rtts = []
        for _ in range(500):
            t0 = time.perf_counter()
            c.call("ping")
            rtts.append((time.perf_counter() - t0) * 1e3)
        rng = np.random.default_rng(3)
        vocab = [chr(c) for c in range(97, 123)]
        prompts = ["".join(rng.choice(vocab, 24)) for _ in range(max(int(x) for x in a.clients.split(",")))]

        # time to first token through the daemon vs in process (same prompt, warm cache both)
        def ttft_daemon(prompt):
            cl = Client(sock).connect()
            t0 = time.perf_counter()
            cl.send("generate", prompt=prompt, max_tokens=2)
            while cl.recv(None)["type"] != "generate_stream":
                pass
            dt = time.perf_counter() - t0
            while not cl.recv(None)["type"].endswith("_reply"):
                pass
            cl.close()
            return dt

        ttft_daemon(prompts[0])  # warms the experts this prompt uses
        ttft_d = ttft_daemon(prompts[0])
        runs = []
        for n in [int(x) for x in a.clients.split(",")]:
            st0 = c.call("stats")
            results, t0 = {}, time.perf_counter()

            def one(i, results):
                cl = Client(sock).connect()
                results[i] = cl.call("generate", timeout_ms=None, prompt=prompts[i], max_tokens=a.tokens)

            threads = [threading.Thread(target=one, args=(i, results)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            st1 = c.call("stats")
            tokens = sum(len(r["token_ids"]) for r in results.values())
            read = st1["experts"]["bytes_read"] - st0["experts"]["bytes_read"]
            unique = st1["experts"]["experts"] - st0["experts"]["experts"]
            runs.append({"clients": n, "aggregate_tok_s": round(tokens / wall, 3), "wall_s": round(wall, 3),
                         "expert_bytes_per_token": int(read / tokens), "unique_experts_served": unique})
        Client(sock, operator=True).connect().call("shutdown")
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()

    # union saving from traces: each prompt alone, and all of them in one batch (in process)
    from colibri.engine import layers
    from colibri.engine.generate import Batcher, Request, SamplingParams
    from colibri.engine.registry import load_model
    from colibri.engine.tokenizer import Tokenizer

    layers.init()
    tok = Tokenizer(path)
    ids = [tok.encode(p) for p in prompts]
    m = load_model(path, budget=budget)
    for _ in range(2):  # the second, warm, as the daemon's was
        b = Batcher(m)
        t0 = time.perf_counter()
        b.add(Request(m, ids[0], SamplingParams(max_tokens=1)))
        b.step()
        ttft_p = time.perf_counter() - t0
    del m, b
    alone = []
    for i in ids:
        tr = os.path.join(tmp, "alone.jsonl")
        with open(tr, "w") as f:
            m = load_model(path, budget="min", trace=f)
            b = Batcher(m)
            b.add(Request(m, i, SamplingParams(max_tokens=a.tokens)))
            while b.active:
                b.step()
        alone.append(trace_sets(tr))
    for run in runs:
        n = run["clients"]
        tr = os.path.join(tmp, "batch.jsonl")
        with open(tr, "w") as f:
            m = load_model(path, budget="min", trace=f)
            b = Batcher(m)
            for i in ids[:n]:
                b.add(Request(m, i, SamplingParams(max_tokens=a.tokens)))
            while b.active:
                b.step()
        batch = trace_sets(tr)
        summed = defaultdict(int)
        for sets in alone[:n]:
            for k, e in sets.items():
                summed[k] += len(e)
        run["union_saving"] = round(sum(summed.values()) / sum(len(e) for e in batch.values()), 3)
    base = runs[0]["aggregate_tok_s"]
    for run in runs:
        run["throughput_gain"] = round(run["aggregate_tok_s"] / base, 3)
    print(json.dumps({"benchmark": "control_plane", "container": path, "budget_fraction": a.budget,
                      "ping_ms_p50": round(float(np.percentile(rtts, 50)), 3),
                      "ping_ms_p99": round(float(np.percentile(rtts, 99)), 3),
                      "ttft_daemon_s": round(ttft_d, 3), "ttft_in_process_s": round(ttft_p, 3),
                      "ttft_extra_ms": round((ttft_d - ttft_p) * 1e3, 3), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
