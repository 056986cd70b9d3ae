"""Control-plane benchmark: what the daemon costs and what sharing it buys.

    python bench/control_plane.py [--expert-gb 16] [--budgets 0.1,min] [--clients 1,2,4,8] [--tokens 16]

Starts colibrid on the decode benchmark's synthetic model (bench/decode.py builds it), once
per expert budget (a fraction of its expert bytes, or `min`: one layer's top-k, so nearly
every routed expert is read from disk: the disk-bound configuration), and prints one JSON
object:
- ping round trip p50/p99 (ms), while idle;
- the extra time to first token through the daemon, against the same request in process;
- for each budget and client count N: N clients send a generate request of the same
  prompt length at once (the text sampled at temperature 1 with a fixed seed per client, as
  in bench/decode.py); aggregate tokens/s, expert bytes read per generated token, the
  union saving (the experts each request routed to, summed over requests, per layer and
  step, divided by the unique experts the batch asked for: the daemon counts both, see
  `routed` in `colictl stats --json`), the read saving (bytes per token alone over bytes
  per token with N clients), the throughput gain over one client, and gain / union saving
  (the target: >= 0.8 where the disk is the bottleneck).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from synthetic import build  # noqa: E402

from colibri.ctl.client import Client  # noqa: E402


def wait_ready(sock: str, proc, timeout=900) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit("colibrid exited")
        try:  # the socket answers while the model loads: ready is the phase "serving"
            if Client(sock, timeout_s=1).connect().call("status").get("phase", "serving") == "serving":
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit("colibrid did not start")


def start_daemon(path: str, budget, tmp: str, *extra: str, name: str = ""):
    sock = os.path.join(tmp, f"c-{name or budget}.sock")
    log = open(os.path.join(tmp, f"colibrid-{name or budget}.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--model", path, "--socket", sock,
                             "--expert-cache", str(budget), *extra], stderr=log)
    wait_ready(sock, proc)
    return sock, proc


def clients_run(sock: str, prompts: list[str], tokens: int, budget) -> dict:
    """One client per prompt, all at once, one generate request each, from an emptied
    cache (shrunk to min and grown back: every run starts alike; the usage history stays);
    what the daemon's counters say about it."""
    op = Client(sock, operator=True).connect()
    op.call("cache", timeout_ms=None, action="set", experts="min")
    op.call("cache", timeout_ms=None, action="set", experts=str(budget))
    c = Client(sock).connect()
    st0 = c.call("stats")["experts"]
    results, t0 = {}, time.perf_counter()

    def one(i):
        # sampled (temperature 1, a fixed seed per client), as bench/decode.py does: greedy text
        # from random weights falls into one repeated token, the same for every prompt, and
        # the requests would then route alike, which real text does not
        results[i] = Client(sock).connect().call("generate", timeout_ms=None, prompt=prompts[i], max_tokens=tokens,
                                                 temperature=1.0, seed=100 + i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    st1 = c.call("stats")["experts"]
    d = {k: st1[k] - st0[k] for k in ("bytes_read", "experts", "routed", "hits", "steps")}
    n_tok = sum(len(r["token_ids"]) for r in results.values())
    return {"clients": len(prompts), "aggregate_tok_s": round(n_tok / wall, 3), "wall_s": round(wall, 3),
            "steps": d["steps"], "expert_bytes_per_token": int(d["bytes_read"] / n_tok),
            "hit_rate": round(d["hits"] / d["experts"], 4), "union_saving": round(d["routed"] / d["experts"], 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--expert-gb", type=float, default=16.0)
    ap.add_argument("--budgets", default="0.1,min", help="fractions of the expert bytes, or min")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    path = build(a.workdir, a.expert_gb)
    from colibri.storage.container import open_container

    expert_bytes = open_container(path).expert_bytes
    tmp = tempfile.mkdtemp(prefix="colibri-cp-")
    rng = np.random.default_rng(3)
    vocab = [chr(c) for c in range(97, 123)]

    def prompts(n):  # fresh ones for every run: no run finds its experts cached by an earlier one
        return ["".join(rng.choice(vocab, 24)) for _ in range(n)]

    probe = prompts(1)[0]  # for the time to first token
    out = {"benchmark": "control_plane", "container": path, "tokens_per_request": a.tokens, "configs": []}
    for b in a.budgets.split(","):
        budget = b if b == "min" else int(expert_bytes * float(b))
        sock, proc = start_daemon(path, budget, tmp)
        try:
            if not out["configs"]:  # the daemon's own costs, measured once
                c = Client(sock).connect()
                rtts = []
                for _ in range(500):
                    t0 = time.perf_counter()
                    c.call("ping")
                    rtts.append((time.perf_counter() - t0) * 1e3)
                out["ping_ms_p50"] = round(float(np.percentile(rtts, 50)), 3)
                out["ping_ms_p99"] = round(float(np.percentile(rtts, 99)), 3)
                ttft_daemon(sock, probe)  # warms the experts this prompt uses
                out["ttft_daemon_s"] = round(ttft_daemon(sock, probe), 3)
                ttft_budget = budget
            runs = [clients_run(sock, prompts(int(n)), a.tokens, budget) for n in a.clients.split(",")]
            Client(sock, operator=True).connect().call("shutdown")
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
        base = runs[0]
        for run in runs:
            run["read_saving"] = round(base["expert_bytes_per_token"] / max(run["expert_bytes_per_token"], 1), 3)
            run["throughput_gain"] = round(run["aggregate_tok_s"] / base["aggregate_tok_s"], 3)
            run["gain_over_union_saving"] = round(run["throughput_gain"] / run["union_saving"], 3)
        out["configs"].append({"budget": b, "budget_bytes": budget if b != "min" else None, "runs": runs})
        print(json.dumps(out["configs"][-1]), file=sys.stderr)

    # time to first token in process, same prompt, warm, as the daemon's was
    from synthetic import load_model

    from colibri.engine import layers
    from colibri.engine.generate import Batcher, Request, SamplingParams
    from colibri.engine.tokenizer import Tokenizer

    layers.init()
    m = load_model(path, budget=ttft_budget)
    ids = Tokenizer(path).encode(probe)
    for _ in range(2):
        b = Batcher(m)
        t0 = time.perf_counter()
        b.add(Request(m, ids, SamplingParams(max_tokens=1)))
        b.step()
        ttft_p = time.perf_counter() - t0
    out["ttft_in_process_s"] = round(ttft_p, 3)
    out["ttft_extra_ms"] = round((out["ttft_daemon_s"] - ttft_p) * 1e3, 3)
    print(provenance.dumps(out, indent=2))


def ttft_daemon(sock: str, prompt: str) -> float:
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


if __name__ == "__main__":
    main()
