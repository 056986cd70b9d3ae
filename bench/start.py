"""How long colibrid takes to serve the demo model after setup.sh (its kernels compiled into
numba's cache): a first start in an empty state directory (writing the demo model and
converting it to a container) and later starts (the container already there).

    python bench/start.py [--repeat 3]

Per start: the seconds from the process's start until `hello` says serving, and the
daemon's own `boot.load_s` (checking the files, reading the dense weights, placing the
experts, loading the kernels). JSON, with its provenance.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import provenance

from colibri.ctl.client import Client


def one_start(state: str, sock: str) -> dict:
    env = {**os.environ, "STATE_DIRECTORY": state}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--socket", sock], env=env,
                            stderr=subprocess.DEVNULL)
    try:
        c = Client(sock, timeout_s=5).connect(wait_s=60)
        while c.call("hello", protocol="1.5").get("phase") != "serving":
            time.sleep(0.01)
        serving_s = time.perf_counter() - t0
        boot = c.call("status")["boot"]
        c.close()
    finally:
        proc.terminate()
        proc.wait(60)
    return {"serving_s": round(serving_s, 3), "load_s": boot["load_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    firsts, laters = [], []
    for _ in range(a.repeat):
        tmp = tempfile.mkdtemp(prefix="colibri-start-")
        state, sock = os.path.join(tmp, "state"), os.path.join(tmp, "c.sock")
        firsts.append(one_start(state, sock))
        laters.append(one_start(state, sock))
        print(json.dumps({"first": firsts[-1], "later": laters[-1]}), file=sys.stderr)
    print(provenance.dumps({"benchmark": "start", "model": "demo", "first_start": firsts, "later_start": laters},
                           indent=2))


if __name__ == "__main__":
    main()
