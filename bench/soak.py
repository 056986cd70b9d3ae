"""Load and soak: many clients, random requests, cancels and disconnects, for a while.

    python bench/soak.py [--model DIR] [--clients 8] [--minutes 5] [--seed 0] [--json]

Starts colibrid (on --model, default the demo model it writes itself) on a temporary
socket and runs --clients threads until --minutes have passed. Each client sends
generate requests with random prompts and lengths, one at a time; some it cancels
after a random delay, and sometimes it disconnects in the middle of a stream (closes its
socket and reconnects as a new client). It prints one JSON object:

- requests sent, completed, failed, cancelled, busy, disconnected;
- `lost` (a request whose client stayed and never got its final reply) and
  `duplicated` (a second final reply): both must be 0;
- the daemon's own count of requests ended (served + failed + cancelled) against the
  requests it accepted, which must agree (a disconnected client's request is cancelled
  by the daemon, so every request ends exactly once there too); `never_arrived`, the
  requests a client sent right before closing its socket that never left it (at most
  the disconnects);
- latency to the final reply, p50 and p99, of completed requests; RSS of the daemon at
  start and end, and the bytes its prefix cache holds at the end (`kv_cache_mib`, at most
  its budget): the random prompts fill that cache, which is growth the budget bounds, not a
  leak.
"""

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from control_plane import wait_ready  # noqa: E402

from colibri.ctl.client import Client  # noqa: E402
from colibri.daemon import protocol as P  # noqa: E402

WORDS = "the a expert cache layer token router disk memory stream model box edge weeks warm cold read".split()


def client_loop(sock: str, deadline: float, seed: int, tally: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    c = Client(sock, timeout_s=30).connect()
    mine = {"sent": 0, "completed": 0, "failed": 0, "cancelled": 0, "busy": 0, "disconnected": 0, "lost": 0,
            "duplicated": 0}
    latencies = []
    while time.time() < deadline:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        n = rng.randint(1, 24)
        action = rng.random()
        t0 = time.time()
        rid = c.send("generate", prompt=prompt, max_tokens=n, temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 99))
        mine["sent"] += 1
        if action < 0.1:  # disconnect in the middle of the stream, come back as a new client
            time.sleep(rng.uniform(0, 0.05))
            c.close()
            mine["disconnected"] += 1
            c = Client(sock, timeout_s=30).connect()
            continue
        cancel_at = t0 + rng.uniform(0, 0.1) if action < 0.25 else None
        finals = 0
        while True:
            if cancel_at and time.time() >= cancel_at:
                c.send("cancel", target=rid)
                cancel_at = None
            if not c.sock.poll(10 if cancel_at else 30_000):
                if cancel_at:
                    continue
                mine["lost"] += 1
                break
            msg = P.decode(c.sock.recv())
            if msg.get("id") != rid or msg["type"] != "generate_reply":
                continue  # stream events, and the cancel's own reply
            finals += 1
            if msg["status"] == "ok":
                mine["completed"] += 1
                latencies.append(time.time() - t0)
            else:
                name = msg["error"]["name"]
                mine["cancelled" if name == "CANCELLED" else "busy" if name == "BUSY" else "failed"] += 1
            if not c.sock.poll(20):  # a second final reply would be a duplicate
                break
            extra = P.decode(c.sock.recv())
            if extra.get("id") == rid and extra["type"] == "generate_reply":
                mine["duplicated"] += 1
            break
    c.close()
    with lock:
        for k, v in mine.items():
            tally[k] = tally.get(k, 0) + v
        tally.setdefault("latencies", []).extend(latencies)


def rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the demo model, written into a temporary state dir)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="colibri-soak-")
    sock = os.path.join(tmp, "colibri.sock")
    env = {**os.environ, "STATE_DIRECTORY": os.path.join(tmp, "state")}
    env.pop("NOTIFY_SOCKET", None)
    cmd = [sys.executable, "-m", "colibri.daemon", "--socket", sock]
    if a.model:
        cmd += ["--model", a.model]
    log = open(os.path.join(tmp, "colibrid.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stderr=log)
    try:
        wait_ready(sock, proc)
        rss0 = rss(proc.pid)
        tally: dict = {}
        lock = threading.Lock()
        deadline = time.time() + a.minutes * 60
        threads = [threading.Thread(target=client_loop, args=(sock, deadline, a.seed * 1000 + i, tally, lock))
                   for i in range(a.clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        end = time.time() + 30  # the daemon ends the disconnected clients' requests when it next writes to them
        while True:
            stats = Client(sock).connect().call("stats")["requests"]
            accepted, ended = stats["accepted"], stats["served"] + stats["failed"] + stats["cancelled"]
            if ended >= accepted or time.time() > end:
                break
            time.sleep(0.2)
        kv = Client(sock).connect().call("stats").get("kv") or {}
        lat = sorted(tally.pop("latencies", []))
        out = {"benchmark": "soak", "clients": a.clients, "minutes": round(wall / 60, 2), **tally,
               "daemon_accepted": accepted, "daemon_ended": ended, "daemon_alive": proc.poll() is None,
               # a request sent just before its client closed the socket may never have left it
               "never_arrived": tally["sent"] - tally["busy"] - accepted,
               "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
               "latency_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3) if lat else None,
               "rss_start_mib": round(rss0 / 2**20, 1), "rss_end_mib": round(rss(proc.pid) / 2**20, 1),
               # the prefix cache keeps the prompts' KV blocks up to its budget (kv_cache): growth, not a leak
               "kv_cache_mib": round(max(kv.get("bytes") or 0, kv.get("pool_bytes") or 0) / 2**20, 1),
               "kv_budget_mib": round((kv.get("budget_bytes") or 0) / 2**20, 1)}
        Client(sock, operator=True).connect().call("shutdown")
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(provenance.dumps(out, indent=None if a.json else 2))
    return out


if __name__ == "__main__":
    main()
