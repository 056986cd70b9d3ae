"""A start that cannot bind its sockets or use its directories fails within seconds with
one line and exit 3, under systemd too, and the unit does not restart it for that (issue
66: colibrid used to hang forever on a socket it could not bind)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest
from test_daemon import Notify, serving

from colibri.storage.demo import write_demo_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("model") / "demo")


def colibrid(tmp_path, demo, *argv, notify=None):
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path / "state")}
    env.pop("NOTIFY_SOCKET", None)
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.path
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--model", str(demo), *map(str, argv)], env=env,
                       capture_output=True, text=True, timeout=60)
    return r, time.monotonic() - t0


def fails_fast(r, took, *words):
    assert r.returncode == 3, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert took < 5 + 3, took  # (5 s on a loaded box, plus the interpreter's start)
    for w in words:
        assert w in lines[0], lines[0]


def test_sockets_that_cannot_be_bound(tmp_path, demo):
    long = tmp_path / ("s" * max(1, 120 - len(str(tmp_path)) - 1))
    assert len(str(long)) >= 120
    cases = [
        (["--socket", "/sys/colibri.sock"], ("/sys/colibri.sock", "not permitted")),
        (["--socket", tmp_path / "no" / "such" / "c.sock"], (str(tmp_path / "no"), "does not exist")),
        (["--socket", long], (str(long), "107")),
        (["--socket", tmp_path / "u.sock", "--operator-socket", "/sys/o.sock"], ("/sys/o.sock",)),
    ]
    for argv, words in cases:
        r, took = colibrid(tmp_path, demo, *argv)
        fails_fast(r, took, "cannot listen on", *words)
    assert not os.path.exists(tmp_path / "u.sock")  # the user socket it had bound is gone again
    # a runtime directory one level deep is made, as systemd's RuntimeDirectory would be
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        r, took = colibrid(tmp_path, demo, "--socket", ro / "c.sock")
        fails_fast(r, took, str(ro / "c.sock"), "Read-only file system")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_a_busy_socket_and_a_fake_notify_socket(tmp_path, demo):
    (tmp_path / "first").mkdir()
    with serving(tmp_path / "first", demo) as (_, sock):
        notify = Notify(tmp_path / "notify")
        r, took = colibrid(tmp_path, demo, "--socket", sock, notify=notify)
        fails_fast(r, took, sock, "another colibrid already serves it")
        time.sleep(0.3)
        assert "READY=1" not in notify.lines
        assert any(line.startswith("STATUS=cannot start: cannot listen on") for line in notify.lines), notify.lines
    r, took = colibrid(tmp_path, demo, "--socket", "/sys/c.sock", notify=Notify(tmp_path / "notify2"))
    fails_fast(r, took, "/sys/c.sock")


def test_a_state_directory_that_cannot_be_used(tmp_path, demo):
    for state in ("/proc/colibri-state", "/sys/colibri"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"state_dir: {state}\n")
        r, took = colibrid(tmp_path, demo, "--config", cfg, "--socket", tmp_path / "c.sock")
        fails_fast(r, took, "cannot use the state directory", state)
        assert not os.path.exists(tmp_path / "c.sock")
    state = tmp_path / "st"
    (state / "sessions").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(state / "sessions")], check=True)
    try:
        cfg.write_text(f"state_dir: {state}\n")
        r, took = colibrid(tmp_path, demo, "--config", cfg, "--socket", tmp_path / "c.sock")
        fails_fast(r, took, str(state / "sessions"), "read-only")
    finally:
        subprocess.run(["umount", str(state / "sessions")], check=True)


def test_the_unit_does_not_restart_a_configuration_error(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: ./setup.sh --test installs it"
    unit = open(os.path.join(ROOT, "systemd", "colibrid.service")).read()
    assert "RestartPreventExitStatus=2 3" in unit.splitlines()
    colibrid = os.path.join(sysconfig.get_path("scripts"), "colibrid")
    (tmp_path / "colibrid.service").write_text(unit.replace("/opt/colibri/.venv/bin/colibrid", colibrid))
    r = subprocess.run([analyze, "verify", str(tmp_path / "colibrid.service")], capture_output=True, text=True)
    assert r.returncode == 0 and "colibrid.service" not in r.stderr, r.stderr
    from colibri.daemon.main import EXIT_CONFIG, EXIT_START

    assert (EXIT_CONFIG, EXIT_START) == (2, 3)
