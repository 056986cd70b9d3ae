"""Every setting's origin is visible and an edit wins (issue 66): values kept with
--persist belong to the model they were made on, a configuration edited after them wins,
--print-config and status name each value's origin, colictl lists and drops them; and a
reload says "needs a restart" for exactly the keys that differ from what runs."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from daemons import converted
from test_daemon import ctl
from test_daemon import serving as serving_once

from colibri.storage.demo import write_demo_model

MiB = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two models: the demo checkpoint converted as it is (A) and to int8 experts (B)."""
    root = tmp_path_factory.mktemp("models")
    src = write_demo_model(root / "demo")
    return Path(converted(src, root / "a")), Path(converted(src, root / "b", "--dtype", "int8"))


@contextlib.contextmanager
def serving(tmp_path, model, *extra):
    """A daemon on tmp_path's socket, its state in tmp_path/state: started again and again."""
    (tmp_path / "notify").unlink(missing_ok=True)
    with serving_once(tmp_path, model, *extra) as got:
        yield got


def op(sock, *args):
    return ctl(sock, "--operator-socket", os.path.join(os.path.dirname(sock), "colibri-operator.sock"), *args)


def budget(sock) -> int:
    r = op(sock, "cache", "show", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["placement"]["budget_bytes"]


def status(sock) -> dict:
    r = ctl(sock, "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def print_config(tmp_path, cfg, model) -> str:
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", cfg, "--model", model, "--print-config"],
                       env={**os.environ, "STATE_DIRECTORY": str(tmp_path / "state")}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def kept_file(tmp_path) -> dict:
    path = tmp_path / "state" / "runtime.yaml"
    return yaml.safe_load(path.read_text()) if path.exists() else {}


def test_kept_values_belong_to_their_model_and_an_edit_wins(tmp_path, models):
    a, b = models
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text("expert_cache: all\nmax_queue: 32\n")
    with serving(tmp_path, a, "--config", cfg) as (_, sock):
        r = op(sock, "cache", "set", "--experts", "3MiB", "--persist")
        assert r.returncode == 0 and "kept for the next start" in r.stderr, r.stderr
        r = op(sock, "policy", "set", "policy=lru", "--persist")
        assert r.returncode == 0, r.stderr
    entry = next(iter(kept_file(tmp_path)["models"].values()))
    assert entry["model"] == str(a) and entry["values"]["expert_cache"]["value"] == "3MiB"
    assert entry["values"]["expert_cache"]["by"] == "cache set --persist" and entry["values"]["policy"]["at"]

    # no edit: the kept values apply, and the start, status and --print-config say where they come from
    with serving(tmp_path, a, "--config", cfg) as (_, sock):
        assert budget(sock) == 3 * MiB
        notes = {n["key"]: n for n in status(sock)["runtime"]["kept_at_start"]}
        assert notes["expert_cache"]["applied"] and notes["expert_cache"]["configured"] == "all"
        assert notes["expert_cache"]["configured_in"] == str(cfg) and notes["policy"]["configured_in"] == "default"
        shown = ctl(sock, "status").stdout
        assert "kept      expert_cache 3MiB from runtime.yaml, kept by `cache set --persist` at" in shown, shown
        assert f"the configuration says all ({cfg})" in shown
    log = (tmp_path / "colibrid.log").read_text()
    assert "expert_cache 3MiB from runtime.yaml, kept by `cache set --persist`" in log, log
    printed = print_config(tmp_path, cfg, a)
    rt = str(tmp_path / "state" / "runtime.yaml")
    assert f"expert_cache: 3MiB  # {rt}" in printed and f"policy: lru  # {rt}" in printed, printed
    assert f"max_queue: 32  # {cfg}" in printed and "max_active: 8  # default" in printed
    assert f"model: {a}  # command line" in printed
    assert yaml.safe_load(printed)["expert_cache"] == "3MiB"

    # the configuration edited after the value was kept: the edit wins, and the start says so
    time.sleep(0.05)
    cfg.write_text("expert_cache: 5MiB\nmax_queue: 32\n")
    with serving(tmp_path, a, "--config", cfg) as (_, sock):
        assert budget(sock) == 5 * MiB
        notes = {n["key"]: n for n in status(sock)["runtime"]["kept_at_start"]}
        assert not notes["expert_cache"]["applied"] and "edited after it was kept" in notes["expert_cache"]["why"]
        assert notes["policy"]["applied"]  # (the file does not set it)
    log = (tmp_path / "colibrid.log").read_text()
    assert "expert_cache 3MiB kept by `cache set --persist` at" in log and "the edit wins" in log, log
    values = next(iter(kept_file(tmp_path)["models"].values()))["values"]
    assert "expert_cache" not in values and values["policy"]["value"] == "lru"
    assert "expert_cache: 5MiB  # " + str(cfg) in print_config(tmp_path, cfg, a)

    # model B: nothing kept for A applies; colictl lists A's values as another model's, and drops them
    with serving(tmp_path, b, "--config", cfg) as (_, sock):
        st = status(sock)
        assert st["runtime"]["kept_at_start"] == []
        assert json.loads(op(sock, "policy", "show", "--json").stdout)["policy"]["name"] == "learned"
        listed = json.loads(op(sock, "kept", "--json").stdout)["kept"]
        assert [(k["key"], k["value"], k["this_model"]) for k in listed] == [("policy", "lru", False)]
        assert "for another model" in op(sock, "kept").stdout
        r = op(sock, "kept", "drop", "policy")
        assert r.returncode == 4 and "nothing kept" in r.stderr, r.stderr  # (B's own: none)
        r = op(sock, "kept", "drop", "--all-models")
        assert r.returncode == 0 and "dropped policy lru" in r.stdout, r.stdout
        assert json.loads(op(sock, "kept", "--json").stdout)["kept"] == []
    assert not (tmp_path / "state" / "runtime.yaml").exists()


def test_a_flag_wins_and_the_first_format_is_not_applied(tmp_path, models):
    a, _ = models
    state = tmp_path / "state"
    state.mkdir()
    (state / "runtime.yaml").write_text("expert_cache: 3MiB\npolicy: lru\n")  # (an older colibri's file)
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text("max_queue: 32\n")
    printed = print_config(tmp_path, cfg, a)
    assert "expert_cache: all  # default" in printed and "policy: learned  # default" in printed, printed
    with serving(tmp_path, a, "--config", cfg) as (_, sock):
        r = op(sock, "cache", "set", "--experts", "4MiB", "--persist")
        assert r.returncode == 0, r.stderr
    assert "first format" in (tmp_path / "colibrid.log").read_text()
    with serving(tmp_path, a, "--config", cfg, "--expert-cache", "2MiB") as (_, sock):
        assert budget(sock) == 2 * MiB
        (note,) = status(sock)["runtime"]["kept_at_start"]
        assert not note["applied"] and note["why"] == "the command line sets it"


def test_reload_names_exactly_the_keys_that_differ_from_what_runs(tmp_path, models):
    a, _ = models
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text("max_queue: 32\n")
    with serving(tmp_path, a, "--config", cfg) as (proc, sock):
        cfg.write_text("max_queue: 16\ncompute_threads: 1\n")
        r = op(sock, "reload")
        assert r.returncode == 0 and r.stdout.strip() == "applied: max_queue; needs a restart: compute_threads", r.stdout
        assert status(sock)["runtime"]["restart_needed"] == ["compute_threads"]
        assert "changed since the start, applied at the next one: compute_threads" in ctl(sock, "status").stdout
        cfg.write_text("max_queue: 16\n")  # back to the value the process runs
        r = op(sock, "reload")
        assert r.stdout.strip() == "applied: nothing; needs a restart: nothing", r.stdout
        assert status(sock)["runtime"]["restart_needed"] == []
        # the same through SIGHUP
        cfg.write_text("max_queue: 16\ncompute_threads: 1\nio_threads: 3\n")
        proc.send_signal(signal.SIGHUP)
        end = time.monotonic() + 10
        while sorted(status(sock)["runtime"]["restart_needed"]) != ["compute_threads", "io_threads"]:
            assert time.monotonic() < end, status(sock)["runtime"]["restart_needed"]
            time.sleep(0.1)
        cfg.write_text("max_queue: 16\nio_threads: 3\n")
        proc.send_signal(signal.SIGHUP)
        while status(sock)["runtime"]["restart_needed"] != ["io_threads"]:
            assert time.monotonic() < end + 10, status(sock)["runtime"]
            time.sleep(0.1)
