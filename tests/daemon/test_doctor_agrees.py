"""doctor runs the daemon's own checks (issue 66): for a container, a checkpoint and a GGUF
file, each under a budget below its minimum, at it and above this box's RAM, doctor's
verdict is colibrid's start, and doctor's memory line is the figure colibrid holds."""

import json
import os
import signal
import subprocess
import sys

import pytest
from daemons import converted
from gguf_models import write_gguf
from test_daemon import Notify, ctl

from colibri.storage.demo import write_demo_model
from colibri.storage.memory import ram_bytes


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    ckpt = write_demo_model(root / "demo")
    return {"container": converted(ckpt, root / "container"), "checkpoint": ckpt,
            "gguf": write_gguf(ckpt, root / "demo.gguf", tokenizer=ckpt)}


BUDGETS = {"below": "10KiB", "min": "min", "all": "all", "above_ram": str(ram_bytes() - (1 << 20))}
GRID = [(kind, b) for kind in ("container", "gguf") for b in ("below", "min", "above_ram")] + \
       [("checkpoint", "min"), ("checkpoint", "all"), ("checkpoint", "above_ram")]


def doctor(cfg, model, env):
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "doctor", "--json", "--config", cfg, "--model", model],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 7), r.stderr
    return r.returncode, {c["check"]: c for c in json.loads(r.stdout)["checks"]}


def colibrid_start(tmp_path, cfg, model, env):
    """(exit code or None while it serves, its one line of stderr or its status)."""
    notify = Notify(tmp_path / "notify")
    sock = str(tmp_path / "c.sock")
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--config", cfg, "--model", model, "--socket",
                             sock], env={**env, "NOTIFY_SOCKET": notify.path}, stderr=subprocess.PIPE, text=True)
    try:
        while not notify.wait_for("READY=1", 0.2):
            if proc.poll() is not None:
                return proc.returncode, proc.stderr.read().strip().splitlines()[-1]
        r = ctl(sock, "status", "--json")
        assert r.returncode == 0, r.stderr
        return None, json.loads(r.stdout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0


@pytest.mark.parametrize("kind,budget", GRID)
def test_doctor_says_what_colibrid_does(tmp_path, models, kind, budget):
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text(f"expert_cache: {BUDGETS[budget]}\nkv_cache: 64MiB\n")
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path / "state")}
    code, checks = doctor(cfg, models[kind], env)
    started, got = colibrid_start(tmp_path, cfg, models[kind], env)
    if started is None:  # colibrid serves: doctor passes, with the figure colibrid holds
        assert code == 0 and checks["memory"]["status"] == "ok", checks["memory"]
        held = got["boot"]["memory"]
        assert checks["memory"]["detail"].startswith(held + ";"), (checks["memory"]["detail"], held)
        assert "the process 320.0 MiB" in held and "prefix cache 64.0 MiB" in held
    else:  # colibrid refuses: doctor fails the memory check with colibrid's own line
        assert started == 3 and (code, checks["memory"]["status"]) == (7, "FAIL"), (started, got, checks["memory"])
        assert got == f"colibrid: {checks['memory']['detail']}", (got, checks["memory"]["detail"])
    expected = {"below": False, "min": kind != "checkpoint", "all": True, "above_ram": False}[budget]
    assert (started is None) == expected
