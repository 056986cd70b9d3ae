"""What the gateway costs over colictl's own path: time to first token and decode tok/s of
the same requests through colibrid's socket directly (ctl/client.py, what colictl uses) and
through colibri-gateway's streamed /v1/completions, and the map's drawing time for a
60-layer x 256-expert model in headless chromium.

    python bench/gateway.py [--model DIR] [--requests 8] [--tokens 64]

Starts its own colibrid (default: the built-in demo model, written to a temporary
directory) and gateway on loopback. Requests alternate between the two paths, greedy, so
both produce the same tokens. Prints one JSON object: per path the median TTFT and tok/s,
the overhead (tok/s ratio, TTFT added in ms, latency added per token in ms) against the
targets (< 5 % tok/s, < 5 ms TTFT), and the map's frame time.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["Once upon a time", "The computer said", "Love is", "Never trust a", "A wise man once",
           "The law of", "In the beginning", "Your lucky number is"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct(sock: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, tokens) through the socket, as colictl generate does; the
    times of tokens that bring text (as the gateway's chunks do: a token whose text is held
    back, an incomplete character or a possible stop string, sends no chunk)."""
    from colibri.ctl.client import Client

    times = []
    t0 = time.perf_counter()  # (colictl connects and says hello for each command too)
    c = Client(sock, timeout_s=60).connect()
    c.hello()
    rid = c.send("generate", prompt=prompt, max_tokens=tokens, temperature=0.0)
    c.reply_to(rid, None, stream=lambda m: times.append(time.perf_counter()) if m.get("text") else None)
    c.close()
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0, len(times)


def http(client: httpx.Client, url: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, tokens) through the gateway's streamed completions, on a
    kept-alive connection as OpenAI's client uses (a new httpx client per request costs
    ~50 ms of its own, making an SSL context)."""
    times = []
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["text"]:
                    times.append(time.perf_counter())
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0, len(times)


def map_frame_ms(url: str) -> dict | None:
    """The Brain's drawing time for 60 x 256 experts (a synthetic state, every cell heated
    and a step's 8 experts a layer flashing), in headless chromium; None without one."""
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    if not binary or not driver:
        return None
    opts = Options()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        b.get(url + "/")
        time.sleep(1.0)
        return b.execute_script("""
            const L = 60, E = 256, where = [], heat = [], flash = {};
            for (let l = 0; l < L; l++) {
              where.push(Array.from({length: E}, (_, e) => "pcd"[(l * 7 + e) % 3]).join(""));
              heat.push(Array.from({length: E}, (_, e) => "0123456789abcdefghijklmnopqrstuvwxyz"[(l + e) % 36]).join(""));
              flash[l] = Array.from({length: 8}, (_, k) => (l * 13 + k * 31) % E);
            }
            const base = {layers: [...Array(L).keys()], n_expert: E, where, heat, flash,
                          counters: {t: 0, hits: 0, experts: 0, bytes_read: 0, io_wait_s: 0, tokens: 0}};
            const times = [];
            for (let i = 0; i < 60; i++) {
              onState({...base, step: 100000 + i, counters: {...base.counters, t: i}});
              const t = performance.now(); drawBrain(t); times.push(performance.now() - t);
            }
            times.sort((a, b) => a - b);
            return {cells: window.colibriMap.cells, frames: times.length,
                    p50_ms: times[30], p95_ms: times[57], canvas: [brain.width, brain.height]};
        """)
    finally:
        b.quit()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model directory (default: the built-in demo model)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="colibri-bench-gw-")
    model = a.model
    if model is None:
        from colibri.storage.demo import write_demo_model

        model = str(write_demo_model(os.path.join(work, "demo")))
    sock, port = os.path.join(work, "colibri.sock"), free_port()
    env = {**os.environ, "STATE_DIRECTORY": os.path.join(work, "state")}
    daemon = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--model", model, "--socket", sock],
                              env=env, stderr=subprocess.DEVNULL)
    gw = subprocess.Popen([sys.executable, "-m", "colibri.gateway", "--port", str(port), "--socket", sock,
                           "--log-level", "warning"], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        from colibri.ctl.client import Client

        c = Client(sock).connect(wait_s=120)
        while c.call("hello", protocol="1.4").get("phase") != "serving":
            time.sleep(0.2)
        c.close()
        for _ in range(100):
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        client = httpx.Client()
        direct(sock, PROMPTS[0], 8)  # warm both paths (first requests compile and connect)
        http(client, url, PROMPTS[0], 8)
        rows = {"direct": [], "gateway": []}
        for i in range(a.requests):
            p = PROMPTS[i % len(PROMPTS)]
            for name in (("direct", "gateway") if i % 2 == 0 else ("gateway", "direct")):
                rows[name].append(direct(sock, p, a.tokens) if name == "direct" else http(client, url, p, a.tokens))
        frame = map_frame_ms(url)
    finally:
        gw.terminate()
        daemon.terminate()
        gw.wait(10)
        daemon.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    def summary(rs):
        return {"ttft_ms_p50": round(1e3 * statistics.median(r[0] for r in rs), 3),
                "tok_s_p50": round(statistics.median(r[1] for r in rs), 3),
                "tokens": [r[2] for r in rs]}

    d, g = summary(rows["direct"]), summary(rows["gateway"])
    print(provenance.dumps({"benchmark": "gateway", "model": a.model or "demo", "requests": a.requests,
                      "max_tokens": a.tokens, "direct": d, "gateway": g,
                      "overhead": {"tok_s_ratio": round(g["tok_s_p50"] / d["tok_s_p50"], 4),
                                   "ttft_added_ms": round(g["ttft_ms_p50"] - d["ttft_ms_p50"], 3),
                                   "per_token_added_ms": round(1e3 / g["tok_s_p50"] - 1e3 / d["tok_s_p50"], 3)},
                      "targets": {"tok_s_overhead": "< 5 %", "ttft_added_ms": "< 5"},
                      "map_frame": frame}, indent=2))


if __name__ == "__main__":
    main()
