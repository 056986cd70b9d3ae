"""A real colibrid for tests outside tests/daemon: started on a temporary socket with a
configuration, waited for until it serves, stopped after; and a gateway in front of one."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx

from colibri.ctl.client import Client


@contextlib.contextmanager
def colibrid(tmp, model, config: str = ""):
    """colibrid serving `model` on tmp/colibri.sock with `config` (YAML text); yields the socket."""
    sock = str(tmp / "colibri.sock")
    cfg = tmp / "colibri.yaml"
    cfg.write_text(config or "max_queue: 64\n")
    log = open(tmp / "colibrid.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--model", str(model), "--socket", sock,
                             "--config", str(cfg)], stderr=log, env={**os.environ, "STATE_DIRECTORY": str(tmp / "st")})
    try:
        c = Client(sock).connect(wait_s=60)
        end = time.monotonic() + 300  # (a loaded 2-core box: Ray's boxes alone may take a minute to start)
        while c.call("hello", protocol="1.4").get("phase") != "serving":
            assert proc.poll() is None and time.monotonic() < end, (tmp / "colibrid.log").read_text()[-2000:]
            time.sleep(0.1)
        c.close()
        yield sock
    finally:
        proc.terminate()
        proc.wait(30)


def converted(src, dst, *flags) -> str:
    """The checkpoint `src` converted to a container at `dst` by colictl convert (`flags`:
    --dtype and the like); returns dst."""
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", str(src), str(dst), *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return str(dst)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gateway(sock, *extra):
    """colibri-gateway on a free local port for the `with` block, in front of `sock`; yields its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "colibri.gateway", "--port", str(port), "--socket", sock, *extra],
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
