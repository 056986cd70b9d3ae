"""One memory-size grammar for plan, tune, doctor and run (issue 66): sizes, `min` and
`all`; a size above this box's RAM refused, a memory below the model's floor refused by
plan and tune before they measure anything, and a plan that does not fit recommends
nothing."""

import json
import os
import subprocess
import sys
import time

import pytest
from daemons import converted

from colibri.ctl import exitcodes
from colibri.storage.demo import write_demo_model
from colibri.storage.memory import PROCESS_BYTES, ram_bytes


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    ckpt = write_demo_model(root / "demo")
    return ckpt, converted(ckpt, root / "c")


def colictl(*args, state=None):
    env = {**os.environ, "STATE_DIRECTORY": str(state)} if state else None
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", *map(str, args)], capture_output=True, text=True,
                       timeout=300, env=env)
    return r, time.monotonic() - t0


def one_line(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_plan_and_tune_take_min_all_and_sizes(tmp_path, models):
    ckpt, c = models
    above = f"{ram_bytes() // 2**30 + 1}GiB"
    for cmd in ("plan", "tune"):
        # below the floor and above RAM: refused before anything is measured (tune writes nothing)
        for memory, words in (("0", ("the model needs at least", "nothing measured", "the process 320.0 MiB")),
                              ("5MiB", ("the model needs at least",)), (above, ("above this box's RAM",)),
                              ("lots", ("cannot read 'lots' as a size",))):
            r, took = colictl(cmd, "--model", c, "--memory", memory, *(["--write", tmp_path / "t.yaml"]
                                                                     if cmd == "tune" else []))
            one_line(r, exitcodes.BAD_REQUEST, *words)
            assert took < 20 and not (tmp_path / "t.yaml").exists()
    r, _ = colictl("plan", "--model", c, "--memory", "min", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    own = p["precisions"][p["precision"]]
    floor = p["dense_bytes"] + own["min_budget_bytes"] + PROCESS_BYTES
    assert p["memory_bytes"] == floor and p["recommend"]["fits"], p["recommend"]
    assert p["recommend"]["expert_cache"] == "384KiB" and p["recommend"]["kv_cache"] == "0"
    r, _ = colictl("plan", "--model", c, "--memory", "all", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["memory_bytes"] == ram_bytes(), r.stderr
    r, _ = colictl("tune", "--model", c, "--memory", "min", "--write", tmp_path / "t.yaml", state=tmp_path / "st")
    assert r.returncode == 0, r.stderr
    written = (tmp_path / "t.yaml").read_text()
    assert "expert_cache: 384KiB" in written and "kv_cache: 0" in written, written
    # a checkpoint in too little memory: "does not fit", no settings, exit 4
    r, _ = colictl("plan", "--model", ckpt, "--memory", "100MiB")
    assert r.returncode == exitcodes.BAD_REQUEST and "does not fit" in r.stdout, (r.stdout, r.stderr)
    assert "recommended" not in r.stdout
    r, _ = colictl("plan", "--model", ckpt, "--memory", "min")
    one_line(r, exitcodes.BAD_REQUEST, "--memory min needs a container")


def test_doctor_and_run_refuse_a_budget_above_ram_and_take_min(models):
    _, c = models
    above = f"{ram_bytes() // 2**30 + 1}GiB"
    r, _ = colictl("doctor", "--model", c, "--expert-cache", above)
    one_line(r, exitcodes.USAGE, "above this box's RAM")
    r, _ = colictl("run", "--model", c, "--expert-cache", above, "--max-tokens", "1", "x")
    one_line(r, exitcodes.BAD_REQUEST, "above this box's limit")
    r, _ = colictl("doctor", "--model", c, "--expert-cache", "min", "--json")
    memory = {x["check"]: x for x in json.loads(r.stdout)["checks"]}["memory"]
    assert r.returncode == 0 and memory["status"] == "ok" and "expert cache 384.0 KiB" in memory["detail"], memory
    r, _ = colictl("doctor", "--model", c, "--expert-cache", "1KiB")
    assert r.returncode == exitcodes.CHECK_FAILED and "FAIL memory     command line: expert_cache = 1KiB" in r.stdout
