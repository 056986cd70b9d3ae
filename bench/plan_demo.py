"""How close `colictl tune`'s prediction comes on the demo model, as an operator sees it:
tune writes its fragment and plan, colibrid starts with that configuration, requests go
through the socket one after another, and `colictl stats` gives the plan's prediction at
the budget the cache has beside the decode tok/s the daemon measured (decode-only steps
over their time) after each request.

    python bench/plan_demo.py [--requests 6] [--tokens 256] [--memory SIZE]

JSON: per request the measured tok/s so far and its ratio to the prediction; the first
request includes the daemon's first steps (kernels warming, the cache filling), the
later ones the steady state the plan predicts. Provenance: date, commit, CPU, command.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import provenance


def colictl(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibri.ctl", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--memory", default=None, help="tune --memory (default: what is available)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="colibri-plan-demo-")
    env = {**os.environ, "STATE_DIRECTORY": os.path.join(tmp, "state")}
    env.pop("COLIBRI_SOCKET", None)
    cfg, sock = os.path.join(tmp, "colibri.yaml"), os.path.join(tmp, "c.sock")
    with open(cfg, "w") as f:
        f.write(f"socket: {sock}\n")
    r = colictl(env, "tune", "--config", cfg, *(["--memory", a.memory] if a.memory else []))
    if r.returncode:
        sys.exit(f"tune failed: {r.stderr}")
    fragment = open(os.path.join(tmp, "colibri.yaml.d", "50-tune.yaml")).read()
    daemon = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--config", cfg], env=env,
                              stderr=subprocess.DEVNULL)
    rows = []
    try:
        if colictl(env, "--socket", sock, "ping", "--wait").returncode:
            sys.exit("colibrid did not start")
        for i in range(a.requests):
            # greedy from "The": the demo runs on to the length asked (sampled, it stops within tens of tokens)
            r = colictl(env, "--socket", sock, "generate", "--wait", "--max-tokens", a.tokens, "--json", "The")
            if r.returncode:
                sys.exit(f"generate failed: {r.stderr}")
            plan = json.loads(colictl(env, "--socket", sock, "stats", "--json").stdout)["plan"]
            got, want = plan["measured_tok_s"], plan["predicted"]["tok_s"]
            rows.append({"request": i + 1, "decode_steps": plan["decode_steps"], "measured_tok_s": got,
                         "predicted_tok_s": want, "predicted_over_measured": round(want / got, 3) if got else None,
                         "budget_fraction": plan["predicted"]["budget_fraction"]})
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        colictl(env, "--socket", sock, "shutdown")
        daemon.wait(60)
    steady = rows[-1]["predicted_over_measured"]
    print(provenance.dumps({"benchmark": "plan_demo", "tune_fragment": fragment, "tokens": a.tokens,
                      "results": rows, "steady_predicted_over_measured": steady,
                      "within_25_percent": steady is not None and abs(steady - 1) <= 0.25}, indent=2))


if __name__ == "__main__":
    main()
