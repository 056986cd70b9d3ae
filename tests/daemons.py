"""A real colibrid for tests outside tests/daemon: started on a temporary socket with a
configuration, waited for until it serves, stopped after."""

import contextlib
import os
import subprocess
import sys
import time

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
        for _ in range(600):
            if c.call("hello", protocol="1.4").get("phase") == "serving":
                break
            time.sleep(0.1)
        c.close()
        yield sock
    finally:
        proc.terminate()
        proc.wait(30)
