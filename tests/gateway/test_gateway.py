"""colibri-gateway against a real colibrid on a temporary socket, driven by the official
`openai` client: the same tokens as colictl, streamed or not; OpenAI's error statuses; a
client that leaves cancels its request; a non-loopback bind without a token is refused."""

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from daemons import colibrid, free_port, gateway

from colibri.storage.demo import write_demo_model

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw")
    model = write_demo_model(tmp / "demo")
    with colibrid(tmp, model) as sock, gateway(sock) as url:
        yield sock, url


def colictl(sock, *args):
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "--socket", sock, *map(str, args)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_chat_and_completions_give_colictls_tokens_streamed_or_not(served):
    sock, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["demo"]
    want = colictl(sock, "generate", "--json", "--chat", "--max-tokens", 16, "--seed", 3, "Tell me a fortune")
    got = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Tell me a fortune"}],
                                         max_tokens=16, seed=3)
    assert got.choices[0].message.content == want["text"] and got.choices[0].finish_reason == want["finish_reason"]
    assert got.usage.completion_tokens == len(want["token_ids"])
    assert got.usage.prompt_tokens == len(want["prompt_token_ids"])
    chunks = list(client.chat.completions.create(model="demo", max_tokens=16, seed=3, stream=True,
                                                 stream_options={"include_usage": True},
                                                 messages=[{"role": "user", "content": "Tell me a fortune"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["text"] and chunks[-1].usage.completion_tokens == len(want["token_ids"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want["finish_reason"]
    plain = colictl(sock, "generate", "--json", "--max-tokens", 12, "--temperature", 0.7, "--seed", 5, "Once upon")
    done = client.completions.create(model="demo", prompt="Once upon", max_tokens=12, temperature=0.7, seed=5)
    assert done.choices[0].text == plain["text"]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="demo", prompt="Once upon", max_tokens=12, temperature=0.7, seed=5, stream=True))
    assert streamed == plain["text"]


def test_errors_have_openais_shape_and_status(served, tmp_path):
    sock, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], n=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], top_p=7.0)
    r = httpx.post(url + "/v1/completions", content=b"{" + b" " * (2 << 20) + b"}", timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert httpx.post(url + "/v1/completions", content=b"[1]").status_code == 400
    with gateway(str(tmp_path / "nobody.sock")) as down:
        r = httpx.post(down + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-some-length\n")
    token.chmod(0o600)
    with gateway(sock, "--token-file", str(token)) as locked:
        assert httpx.get(locked + "/v1/models").status_code == 401
        ok = openai.OpenAI(base_url=locked + "/v1", api_key="s3cret-token-of-some-length")
        assert ok.models.list().data[0].id == "demo"


def test_a_busy_daemon_is_429(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    model = write_demo_model(tmp_path / "demo")
    with colibrid(tmp_path, model, "max_active: 1\nmax_queue: 1\n") as sock, gateway(sock) as url:
        def post(i):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": "Once upon a time", "max_tokens": 64, "seed": i, "temperature": 1.0})
            return r.status_code, r.json()
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(post, range(8)))
    statuses = [s for s, _ in got]
    assert 200 in statuses and 429 in statuses, statuses  # one runs, one waits, the rest are turned away
    busy = next(body for s, body in got if s == 429)
    assert busy["error"]["type"] == "rate_limit_error" and busy["error"]["code"] == "busy"


def test_a_client_that_leaves_cancels_its_request(served):
    sock, url = served
    before = colictl(sock, "stats", "--json")["requests"]["cancelled"]
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 2000, "stream": True,
            "temperature": 1.0, "seed": 1}) as r:
        lines = r.iter_lines()
        assert any(line.startswith("data: ") for line in lines)  # it runs
    for _ in range(100):  # the connection closed: the daemon stops the request
        if colictl(sock, "stats", "--json")["requests"]["cancelled"] > before:
            break
        time.sleep(0.1)
    assert colictl(sock, "stats", "--json")["requests"]["cancelled"] == before + 1


def test_a_network_address_needs_a_token_file():
    r = subprocess.run([sys.executable, "-m", "colibri.gateway", "--host", "0.0.0.0", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs --allow-remote and --token-file" in r.stderr and r.stderr.count("\n") == 1


def scrape(url) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_parse_and_move_as_requests_run(served, tmp_path):
    sock, url = served
    before = scrape(url)
    assert before[("colibri_up", ())] == 1 and before[("colibri_serving", ())] == 1
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    client.completions.create(model="demo", prompt="Once upon a time", max_tokens=8, seed=1)
    after = scrape(url)
    served_key = ("colibri_requests_total", (("outcome", "served"),))
    assert after[served_key] == before[served_key] + 1
    assert after[("colibri_tokens_generated_total", ())] > before[("colibri_tokens_generated_total", ())]
    ttft = ("colibri_time_to_first_token_seconds_count", ())
    assert after[ttft] == before[ttft] + 1 and after[("colibri_inter_token_latency_seconds_count", ())] > 0
    layers = [k for k in after if k[0] == "colibri_expert_hits_total"]
    assert len(layers) == 4  # the demo's four MoE layers, one labelled sample each
    assert sum(after[k] for k in layers) + sum(after[k] for k in after if k[0] == "colibri_expert_misses_total") > 0
    assert after[("colibri_resident_memory_bytes", ())] > 10 << 20
    assert ("colibri_queue_requests", (("state", "queued"),)) in after
    with gateway(str(tmp_path / "nobody.sock")) as down:
        assert scrape(down) == {("colibri_up", ()): 0}


def test_a_session_continues_through_the_gateway(served):
    sock, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    first = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Remember kiwi"}],
                                           max_tokens=8, extra_body={"session": "gw-notes"})
    second = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Which fruit?"}],
                                            max_tokens=8, extra_body={"session": "gw-notes"})
    s1, s2 = first.model_extra["session"], second.model_extra["session"]
    assert s1["name"] == s2["name"] == "gw-notes" and s2["turns"] == s1["turns"] + 1 and s2["reused_tokens"] > 0
    listed = subprocess.run([sys.executable, "-m", "colibri.ctl", "--socket", sock, "session", "list"],
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and "gw-notes" in listed.stdout  # the gateway's user's session


def test_a_waiting_client_that_gives_up_cancels_its_request(tmp_path):
    """A non-streamed request: the gateway watches the connection while the daemon works,
    and a client that gives up has its request cancelled within a second, counted as such."""
    from colibri.engine.registry import build_model
    from colibri.storage.demo import ensure_demo_container

    model = ensure_demo_container(str(tmp_path / "demo"), build_model, lambda phase: None)  # streamed: slower
    with colibrid(tmp_path, model, "expert_cache: min\n") as sock, gateway(sock) as url:
        before = colictl(sock, "stats", "--json")["requests"]
        with pytest.raises(httpx.TimeoutException):  # greedy from "The" runs to the context's end: seconds
            httpx.post(url + "/v1/completions", timeout=0.5, json={"prompt": "The", "max_tokens": 1000})
        gave_up = time.monotonic()
        while time.monotonic() - gave_up < 1.0:
            now = colictl(sock, "stats", "--json")["requests"]
            if now["cancelled"] > before["cancelled"]:
                break
            time.sleep(0.05)
        assert now["cancelled"] == before["cancelled"] + 1 and now["served"] == before["served"], now


def test_a_port_in_use_is_one_line_before_anything_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "colibri.gateway", "--port", str(port)], capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 3 and r.stderr.strip() == \
        f"colibri-gateway: cannot listen on 127.0.0.1:{port}: Address already in use", r.stderr


def test_the_model_and_fingerprint_follow_a_daemon_that_restarts(tmp_path):
    """The gateway asks colibrid which model it serves; a daemon still loading, gone or
    restarted with another model is asked again at the next request, never answered with
    a name or a fingerprint from before (it kept "colibri" / "colibri-None" for 10 s)."""
    import os
    import shutil

    first = write_demo_model(tmp_path / "alpha")
    second = shutil.copytree(first, tmp_path / "beta")
    sock = str(tmp_path / "colibri.sock")
    with gateway(sock) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code >= 500  # no daemon yet
        os.environ["COLIBRI_TEST_LOAD_DELAY_S"] = "4"  # (the daemon loads slowly: the gateway sees it loading)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--model", first, "--socket", sock],
                                    stderr=subprocess.DEVNULL, env={**os.environ, "STATE_DIRECTORY": str(tmp_path)})
        finally:
            del os.environ["COLIBRI_TEST_LOAD_DELAY_S"]
        try:
            while httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code != 200:
                time.sleep(0.2)
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()
            assert r["model"] == "alpha" and r["system_fingerprint"] == "colibri-bf16", r
        finally:
            proc.terminate()
            proc.wait(30)
        with colibrid(tmp_path, second):  # (the same socket) another model
            r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).json()
            assert r["model"] == "beta" and r["system_fingerprint"] == "colibri-bf16", r
            models = httpx.get(url + "/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["beta"]
