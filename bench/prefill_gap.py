"""A running stream while a long prompt arrives: its largest gap between tokens, with the
prompt prefilled in chunks (prefill_chunk N or auto) and whole (0).

    python bench/prefill_gap.py [--expert-gb 2] [--budget all] [--prompt-tokens 2000] [--chunks 0,auto,64]

Starts colibrid on the decode benchmark's synthetic model (bench/synthetic.py; --expert-gb
of experts decides its layers) once per prefill_chunk setting; request A streams (sampled
at temperature 1, fixed seed); after its 20th token request B sends a prompt of about
--prompt-tokens tokens (the byte-level tokenizer: one token a character) for one token.
Prints one JSON object, per setting: A's usual interval between tokens (the median before
B), A's largest gap while B was in (from B's send to its reply) and their ratio (the
target: at most 2 with chunks; the median and 99th percentile gaps too), B's time to its
token, and the forward steps B's prompt took; then as many of A's tokens again with
nothing beside it, whose largest gap (and 99th percentile) against the same interval is
the box's own jitter, the floor for the ratios above. bench/prefix.py runs this measure as its part (c).
"""

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from control_plane import start_daemon  # noqa: E402
from synthetic import build  # noqa: E402

from colibri.ctl.client import Client  # noqa: E402


def one_run(sock: str, prompt_tokens: int, rng) -> dict:
    a, b = Client(sock).connect(), Client(sock).connect()
    rid = a.send("generate", prompt="".join(rng.choice(list("abcdefgh"), 16)), max_tokens=2 * prompt_tokens + 100,
                 temperature=1.0, seed=1)  # (auto may take a step per prompt token, and then A runs alone as long)
    times = []
    while len(times) < 20:
        msg = a.recv(600000)
        if msg["type"] == "generate_stream":
            times.append(time.perf_counter())
        elif msg["type"].endswith("_reply"):
            raise SystemExit(f"request A ended before its 20th token: {msg.get('error') or msg.get('finish_reason')}")
    got, steps0 = {}, b.call("stats")["experts"]["steps"]
    long_prompt = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), prompt_tokens))

    def send_b():
        got["t0"] = time.perf_counter()
        got["reply"] = b.call("generate", timeout_ms=None, prompt=long_prompt, max_tokens=1)
        got["t1"] = time.perf_counter()

    t = threading.Thread(target=send_b)
    t.start()
    while t.is_alive() or not got.get("t1"):
        try:
            msg = a.recv(20)
        except Exception:
            continue
        if msg["type"] == "generate_stream":
            times.append(time.perf_counter())
        elif msg["type"].endswith("_reply"):
            raise SystemExit(f"request A ended early: {msg.get('error') or msg.get('finish_reason')}")
    t.join()
    steps = Client(sock).connect().call("stats")["experts"]["steps"] - steps0
    n_inside = sum(1 for x in times if got["t0"] <= x <= got["t1"])
    alone = []  # the same number of A's tokens again with nothing beside it: the box's own jitter
    while len(alone) < n_inside + 1:
        msg = a.recv(600000)
        if msg["type"] == "generate_stream":
            alone.append(time.perf_counter())
        elif msg["type"].endswith("_reply"):
            break
    a.send("cancel", target=rid)
    alone_gaps = np.diff(np.array(alone)) if len(alone) > 1 else np.zeros(1)
    times = np.array(times)
    usual = float(np.median(np.diff(times[:20])))
    inside = times[(times >= got["t0"]) & (times <= got["t1"])]
    edges = np.concatenate(([got["t0"]], inside, [got["t1"]]))
    gaps = np.diff(edges)
    largest = float(gaps.max())
    return {"a_interval_s": round(usual, 4), "a_largest_gap_s": round(largest, 4),
            "gap_ratio": round(largest / usual, 2), "gap_ratio_p50": round(float(np.median(gaps)) / usual, 2),
            "gap_ratio_p99": round(float(np.percentile(gaps, 99)) / usual, 2), "a_tokens_meanwhile": int(len(inside)),
            "alone_gap_ratio": round(float(alone_gaps.max()) / usual, 2),
            "alone_gap_ratio_p99": round(float(np.percentile(alone_gaps, 99)) / usual, 2),
            "b_prompt_tokens": got["reply"]["stats"]["n_prompt_tokens"], "b_time_s": round(got["t1"] - got["t0"], 3),
            "steps_meanwhile": steps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench"))
    ap.add_argument("--expert-gb", type=float, default=2.0)
    ap.add_argument("--budget", default="all", help="expert cache: all, min or bytes")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--chunks", default="0,auto,64", help="prefill_chunk settings to compare")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    path = build(a.workdir, a.expert_gb)
    tmp = tempfile.mkdtemp(prefix="colibri-gap-")
    out = {"benchmark": "prefill_gap", "container": path, "budget": a.budget, "runs": []}
    for chunk in a.chunks.split(","):
        cfg = os.path.join(tmp, f"chunk-{chunk}.yaml")
        with open(cfg, "w") as f:
            # A asks for more tokens than the daemon's default limit allows (see one_run)
            f.write(f"prefill_chunk: {chunk}\nmax_tokens_limit: {2 * a.prompt_tokens + 100}\n")
        sock, proc = start_daemon(path, a.budget, tmp, "--config", cfg, name=f"chunk-{chunk}")
        try:
            run = one_run(sock, a.prompt_tokens, np.random.default_rng(5))
            Client(sock, operator=True).connect().call("shutdown")
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
        run["prefill_chunk"] = chunk
        print(json.dumps(run), file=sys.stderr)
        out["runs"].append(run)
    print(provenance.dumps(out, indent=2))


if __name__ == "__main__":
    main()
