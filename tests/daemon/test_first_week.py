"""An operator's first week: nothing the product writes can stop the service, a budget
means what it says, and the signals tell the truth. colibrid and colictl as real
processes on the demo model, in a temporary state directory."""

import json
import os
import subprocess
import sys
import time

import pytest

from colibri.ctl import exitcodes
from colibri.ctl.client import Client
from colibri.storage.container import open_container
from colibri.storage.demo import write_demo_model
from colibri.storage.memory import ram_bytes
from colibri.storage.sizes import parse_size
from colibri.storage.slots import min_budget_bytes

DAEMON_START = 3  # colibrid's exit codes (daemon/main.py)
DAEMON_CONFIG = 2


@pytest.fixture()
def box(tmp_path):
    """A state directory, a configuration file and the environment colictl and colibrid share."""
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path / "state")}
    env.pop("COLIBRI_SOCKET", None)
    env.pop("COLIBRI_OPERATOR_SOCKET", None)
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text(f"socket: {tmp_path / 'c.sock'}\n")
    return tmp_path, cfg, env


def colictl(env, *args, timeout=300, stdin=None):
    return subprocess.run([sys.executable, "-m", "colibri.ctl", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, input=stdin)


def colibrid(env, *args, wait=True):
    """A colibrid process; with `wait`, until it serves or exits."""
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", *map(str, args)], env=env,
                            stderr=subprocess.PIPE, text=True)
    return proc


def serving(sock: str, proc, timeout: float = 120) -> bool:
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        try:
            c = Client(sock, timeout_s=2).connect(wait_s=1)
            try:
                if c.call("hello", protocol="1.4").get("phase") == "serving":
                    return True
            finally:
                c.close()
        except Exception:
            pass
        time.sleep(0.2)
    return False


def stop(proc) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def test_tune_with_little_memory_writes_a_config_the_daemon_starts_with(box):
    tmp, cfg, env = box
    r = colictl(env, "tune", "--config", cfg, "--memory", "360MiB")  # (the process takes 320 MiB: PROCESS_BYTES)
    assert r.returncode == 0, r.stderr
    frag = tmp / "colibri.yaml.d" / "50-tune.yaml"
    keys = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in frag.read_text().splitlines()
                                             if line and not line.startswith("#"))}
    c = open_container(str(tmp / "state" / "demo-model"))
    budget = parse_size(keys["expert_cache"])
    assert budget == "all" or budget >= min_budget_bytes(len(c.moe_layers), c.record_bytes), keys
    proc = colibrid(env, "--config", cfg)
    try:
        assert serving(str(tmp / "c.sock"), proc), proc.stderr.read() if proc.poll() is not None else "not serving"
        stats = json.loads(colictl(env, "--socket", tmp / "c.sock", "stats", "--json").stdout)
        assert stats["plan"]["predicted"]["tok_s"] > 0  # tune's plan, with its prediction at the budget now
    finally:
        stop(proc)
    # memory the model cannot run in: nothing written, the fragment as it was
    before = frag.read_text()
    r = colictl(env, "tune", "--config", cfg, "--memory", "100MiB")
    assert r.returncode == exitcodes.BAD_REQUEST and "nothing written" in r.stderr and "short" in r.stderr, r.stderr
    assert frag.read_text() == before and "Traceback" not in r.stderr


def test_a_fragment_the_daemon_cannot_use_is_named_by_file_and_key(box):
    tmp, cfg, env = box
    (tmp / "colibri.yaml.d").mkdir()
    (tmp / "colibri.yaml.d" / "10-typo.yaml").write_text("io_thread: 3\nmax_queue: 5\n")
    proc = colibrid(env, "--config", cfg)
    try:
        assert serving(str(tmp / "c.sock"), proc)
        status = json.loads(colictl(env, "--socket", tmp / "c.sock", "status", "--json").stdout)
        assert status["config"]["max_queue"] == 5  # the fragment's other key applies
    finally:
        err = stop(proc)
    assert "10-typo.yaml: unknown key 'io_thread' (did you mean 'io_threads'?)" in err, err
    (tmp / "colibri.yaml.d" / "20-small.yaml").write_text("expert_cache: 1KiB\n")
    proc = colibrid(env, "--config", cfg)
    assert proc.wait(120) == DAEMON_START
    err = proc.stderr.read()
    assert "20-small.yaml: expert_cache = 1KiB" in err and "too small" in err and "Traceback" not in err, err


def test_a_checkpoint_with_an_expert_budget_is_refused_as_colictl_run_refuses_it(box):
    tmp, cfg, env = box
    model = write_demo_model(tmp / "ckpt")
    proc = colibrid(env, "--model", model, "--socket", tmp / "c.sock", "--expert-cache", "1MiB")
    assert proc.wait(120) == DAEMON_START
    err = proc.stderr.read()
    assert "is a Hugging Face checkpoint; an expert budget needs a container: colictl convert" in err, err
    r = colictl(env, "run", "--model", model, "--expert-cache", "1MiB", "--max-tokens", "2", "Hi")
    assert r.returncode == exitcodes.BAD_REQUEST and "an expert budget needs a container" in r.stderr


def test_budgets_above_the_boxs_ram_are_refused_everywhere(box):
    tmp, cfg, env = box
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", cfg, "--expert-cache", "10TiB"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == DAEMON_CONFIG and "above this box's RAM" in r.stderr, r.stderr
    (tmp / "bad.yaml").write_text("kv_cache: 100TiB\n")
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", tmp / "bad.yaml", "--print-config"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == DAEMON_CONFIG and "bad.yaml: kv_cache" in r.stderr and "RAM" in r.stderr, r.stderr
    r = colictl(env, "run", "--expert-cache", "10TiB", "--max-tokens", "2", "Hi")
    assert r.returncode == exitcodes.BAD_REQUEST and "above this box's limit" in r.stderr, r.stderr
    proc = colibrid(env, "--config", cfg)
    op = tmp / "colibri-operator.sock"
    try:
        assert serving(str(tmp / "c.sock"), proc)
        for flags in (["--experts", "10TiB"], ["--kv", "100TiB"], ["--experts", str(ram_bytes() - (1 << 20))]):
            r = colictl(env, "--socket", op, "cache", "set", *flags)
            assert r.returncode == exitcodes.BAD_REQUEST and "above this box's limit" in r.stderr, (flags, r.stderr)
        r = colictl(env, "--socket", op, "cache", "set", "--experts", "min", "--kv", "1MiB")
        assert r.returncode == 0, r.stderr
    finally:
        stop(proc)


def test_operator_signals_tell_the_truth(box):
    tmp, cfg, env = box
    proc = colibrid(env, "--config", cfg)
    sock, op = tmp / "c.sock", tmp / "colibri-operator.sock"
    try:
        assert serving(str(sock), proc)
        # a user's mistake is `rejected`, not colibrid's failure
        r = colictl(env, "--socket", sock, "generate", "--temperature", "-1", "x")
        assert r.returncode == exitcodes.BAD_REQUEST
        req = json.loads(colictl(env, "--socket", sock, "stats", "--json").stdout)["requests"]
        assert req["rejected"] == 1 and req["failed"] == 0, req
        # a runtime change says whether a restart keeps it
        r = colictl(env, "--socket", op, "cache", "set", "--experts", "2MiB")
        assert r.returncode == 0 and "until the daemon restarts" in r.stderr, r.stderr
        r = colictl(env, "--socket", op, "policy", "set", "policy=lru", "--persist")
        assert r.returncode == 0 and "kept for the next start" in r.stderr, r.stderr
        shown = colictl(env, "--socket", sock, "status").stdout
        assert "expert_cache: 2MiB: LOST at a restart" in shown and "policy: lru: kept for the next start" in shown
        assert "boot      drives" not in shown and "drive     " in shown  # a line a person reads, not JSON
        # min after a pinned part set by hand: the refusal says how to go on
        r = colictl(env, "--socket", op, "cache", "set", "--experts", "4MiB", "--pinned", "1MiB")
        assert r.returncode == 0, r.stderr
        r = colictl(env, "--socket", op, "cache", "set", "--experts", "min")
        assert r.returncode == exitcodes.BAD_REQUEST and "--pinned" in r.stderr, r.stderr
        # a non-streamed request whose client is killed is cancelled (streamed at the minimum: seconds)
        assert colictl(env, "--socket", op, "cache", "set", "--experts", "min", "--pinned", "0").returncode == 0
        gen = subprocess.Popen([sys.executable, "-m", "colibri.ctl", "--socket", str(sock), "generate", "--json",
                                "--max-tokens", "1000", "The"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        gen.kill()
        gen.wait()
        end = time.time() + 5
        while time.time() < end:
            req = json.loads(colictl(env, "--socket", sock, "stats", "--json").stdout)["requests"]
            if req["cancelled"] + req["served"] >= 1:
                break
            time.sleep(0.1)
        assert req["cancelled"] == 1 and req["served"] == 0, req
    finally:
        stop(proc)
    assert proc.returncode == 0
    # the kept setting applies at the next start, the other does not
    printed = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", cfg, "--print-config"], env=env,
                             capture_output=True, text=True).stdout
    assert "policy: lru" in printed and "expert_cache: all" in printed, printed
    # a daemon killed mid-request: the client says so, and nothing about the request's size
    proc = colibrid(env, "--config", cfg)
    try:
        assert serving(str(sock), proc)
        gen = subprocess.Popen([sys.executable, "-m", "colibri.ctl", "--socket", str(sock), "generate",
                                "--max-tokens", "1000", "The"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        assert gen.stdout.read(1)
        proc.kill()
        _, err = gen.communicate(timeout=30)
        assert gen.returncode == exitcodes.DAEMON_DOWN and "stopped or was killed" in err and "larger" not in err, err
    finally:
        proc.kill()
        proc.wait()


def test_the_privileged_step_sets_the_drives_up_and_the_daemon_reports_it(box):
    """The unit's ExecStartPre=+colibrid drives: root, before the daemon, from the same
    configuration; the daemon (which the unit keeps from writing /sys) shows what it set."""
    from loop import loop_file_system

    from colibri.engine.registry import build_model
    from colibri.storage.demo import ensure_demo_container

    tmp, cfg, env = box
    with loop_file_system(tmp, "d", 64 << 20) as (mnt, dev, _):
        model = ensure_demo_container(str(mnt / "demo"), build_model)
        ra = f"/sys/block/{os.path.basename(dev)}/queue/read_ahead_kb"
        with open(ra, "w") as f:
            f.write("4096")
        cfg.write_text(f"socket: {tmp / 'c.sock'}\nmodel: {model}\ntune_drives: true\n")
        r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", cfg, "drives"], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "read_ahead_kb 4096 -> 128" in r.stderr, r.stderr
        assert open(ra).read().strip() == "128"
        proc = colibrid(env, "--config", cfg)
        try:
            assert serving(str(tmp / "c.sock"), proc)
            status = json.loads(colictl(env, "--socket", tmp / "c.sock", "status", "--json").stdout)
            (drive,) = status["boot"]["drives"]
            assert drive["set_by"].startswith("colibrid drives at") and drive["read_ahead_kb"] == 128, drive
            assert {"what": "read_ahead_kb", "from": 4096, "to": 128, "done": True}.items() <= drive["changed"][0].items()
            shown = colictl(env, "--socket", tmp / "c.sock", "status").stdout
            assert "set up (colibrid drives at" in shown and "read_ahead_kb 4096 -> 128" in shown, shown
        finally:
            stop(proc)
