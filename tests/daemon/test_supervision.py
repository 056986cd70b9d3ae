"""What systemd sees of the daemon: a crashed engine thread is a failed exit (so
Restart=on-failure restarts it), and the watchdog stops when the engine stops moving."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_daemon import ctl, start

from colibri.ctl import exitcodes
from colibri.ctl.client import Client
from colibri.engine.registry import build_model
from colibri.storage.demo import ensure_demo_container


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return ensure_demo_container(str(tmp_path_factory.mktemp("demo") / "c"), build_model)


def test_an_engine_crash_is_a_failed_exit_and_its_request_gets_an_answer(tmp_path, container):
    proc, sock, notify = start(tmp_path, container, env={"COLIBRI_TEST_ENGINE_CRASH": "1"})
    try:
        r = ctl(sock, "generate", "--max-tokens", 4, "hello")
        assert r.returncode == exitcodes.INTERNAL and "engine failed" in r.stderr, r.stderr
        assert proc.wait(30) != 0  # not 0: Restart=on-failure restarts it
    finally:
        proc.kill()


def test_the_watchdog_stops_while_a_step_hangs_on_a_stalled_drive(tmp_path, container):
    # layer 1 expert 5's first read hangs 3 s (storage/faults.py); the minimum budget reads it
    proc, sock, notify = start(tmp_path, container, "--expert-cache", "min",
                               env={"COLIBRI_FAULTS": "stall@1:5x1,stall@2:5x1,stall@3:5x1"})
    try:
        beats, pings = [], []
        done = threading.Event()

        def watch():
            seen = 0
            while not done.is_set():
                n = notify.lines.count("WATCHDOG=1")
                if n > seen:
                    beats.append(time.monotonic())
                    seen = n
                time.sleep(0.05)

        threading.Thread(target=watch, daemon=True).start()
        time.sleep(1)
        result = {}
        gen = threading.Thread(target=lambda: result.update(r=ctl(sock, "generate", "--max-tokens", 24,
                                                                   "The five experts of the second layer")))
        gen.start()
        while gen.is_alive():
            t0 = time.monotonic()
            Client(sock).connect().call("ping")  # the I/O thread answers all along
            pings.append(time.monotonic() - t0)
            time.sleep(0.2)
        done.set()
        assert result["r"].returncode == 0, result["r"].stderr  # the stall passed; the request was served
        gaps = [b - a for a, b in zip(beats, beats[1:])]
        assert beats and max(gaps) >= 2.0, gaps  # no WATCHDOG=1 while the engine hung (3 s)
        assert max(pings) < 1.0
        assert len(beats) > 10  # and it is fed while the engine moves
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()


def test_exit_code_of_a_clean_stop_is_zero(tmp_path, container):
    proc, sock, _ = start(tmp_path, container)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0 and not os.path.exists(sock)
