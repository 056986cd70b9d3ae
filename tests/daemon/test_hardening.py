"""What a newcomer and an operator hit in the first hour (issue 16), each as a test that
failed before: large prompts, a daemon that stops or vanishes mid-stream, start-up an
operator can watch, socket paths, stale sockets, doctor against loading."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_daemon import Notify, ctl, serving, start

from colibri.ctl import exitcodes
from colibri.ctl.client import Client, ConnectionClosed, DaemonDown, ReplyError
from colibri.daemon import protocol as P
from colibri.storage.demo import write_demo_model


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("model") / "demo")


def one_line(r, code):
    assert r.returncode == code, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_large_prompts_end_with_one_line_in_bounded_time(tmp_path, demo):
    with serving(tmp_path, demo) as (proc, sock):
        for n in (3 * 2**19, 5 * 2**20):  # 1.5 MiB: the daemon could answer; 5 MiB: it would drop the peer
            t0 = time.monotonic()
            r = ctl(sock, "generate", stdin="a" * n)
            one_line(r, exitcodes.BAD_REQUEST)
            assert "TOO_LARGE" in r.stderr and "max_message_bytes" in r.stderr and time.monotonic() - t0 < 30
        # a client that does not check first: the daemon's answer has no id (it could not read
        # the message) and is taken as the reply; far larger, the closed connection ends the wait
        c = Client(sock).connect()
        with pytest.raises(ReplyError) as e:
            c.call("generate", timeout_ms=None, prompt="a" * 3 * 2**19)
        assert e.value.name == "TOO_LARGE"
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosed):
            c.call("generate", timeout_ms=None, prompt="a" * 5 * 2**20)
        assert time.monotonic() - t0 < 10
        c.close()
        assert ctl(sock, "generate", "--max-tokens", 2, "still serving").returncode == 0
    log = open(tmp_path / "colibrid.log").read()
    assert "refused a message of" in log and "aaaa" not in log  # logged, without the content


def test_a_daemon_stopping_mid_stream_is_the_busy_code_and_a_vanished_one_is_down(tmp_path, demo):
    proc, sock, _ = start(tmp_path, demo)
    try:
        gen = subprocess.Popen([sys.executable, "-m", "colibri.ctl", "--socket", sock, "generate", "--max-tokens",
                                "4000", "tell me a long story"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        assert gen.stdout.read(1)  # it streams
        proc.send_signal(signal.SIGTERM)
        _, err = gen.communicate(timeout=60)
        assert gen.returncode == exitcodes.BUSY and "SHUTTING_DOWN" in err, err
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    (tmp_path / "again").mkdir()
    proc, sock, _ = start(tmp_path / "again", demo)
    try:
        gen = subprocess.Popen([sys.executable, "-m", "colibri.ctl", "--socket", sock, "generate", "--max-tokens",
                                "4000", "tell me a long story"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        assert gen.stdout.read(1)
        proc.kill()  # no goodbye at all
        _, err = gen.communicate(timeout=30)
        assert gen.returncode == exitcodes.DAEMON_DOWN and "closed the connection" in err, err
        t0 = time.monotonic()  # the socket file it left behind is reported at once
        with pytest.raises(DaemonDown, match="stale socket"):
            Client(sock).connect()
        assert time.monotonic() - t0 < 1
    finally:
        proc.kill()


def test_start_up_answers_while_loading_and_a_second_daemon_stops_before_loading(tmp_path, demo):
    notify = Notify(tmp_path / "notify")
    sock = str(tmp_path / "c.sock")
    env = {**os.environ, "NOTIFY_SOCKET": notify.path, "STATE_DIRECTORY": str(tmp_path / "state"),
           "COLIBRI_TEST_LOAD_DELAY_S": "8"}
    log = open(tmp_path / "colibrid.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--model", str(demo), "--socket", sock],
                            env=env, stderr=log)
    try:
        c = Client(sock).connect(wait_s=60)
        st = c.call("status")
        assert st["model"] is None and st["phase"] != "serving" and "READY=1" not in notify.lines
        assert c.call("stats")["experts"] is None
        with pytest.raises(ReplyError) as e:
            c.call("generate", prompt="too early")
        assert e.value.name == "LOADING"
        r = ctl(sock, "generate", "too early")
        one_line(r, exitcodes.LOADING)
        assert "loading" in r.stderr
        end = time.monotonic() + 60
        while c.call("status")["phase"] != "reading dense weights" and time.monotonic() < end:
            time.sleep(0.1)
        r = ctl(sock, "status")
        assert r.returncode == 0 and "loading: reading dense weights" in r.stdout, r.stdout
        # a second daemon on the live socket: out before it loads anything
        t0 = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "colibri.daemon", "--model", str(demo), "--socket", sock],
                                env={**os.environ, "STATE_DIRECTORY": str(tmp_path / "state2")},
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 3 and "another colibrid already serves" in second.stderr
        assert "reading dense weights" not in second.stderr and time.monotonic() - t0 < 20
        # --wait waits for the load and then generates
        r = ctl(sock, "generate", "--wait", "--max-tokens", 3, "now")
        assert r.returncode == 0, r.stderr
        assert notify.wait_for("READY=1", 30) and c.call("status")["phase"] == "serving"
        assert any(line.startswith("STATUS=reading dense weights") for line in notify.lines)
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    phases = open(tmp_path / "colibrid.log").read()
    for phase in ("checking the model's files", "reading dense weights", "compiling kernels", "placed in"):
        assert phase in phases


def test_a_load_that_fails_after_binding_exits_with_one_line_and_leaves_no_socket(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "gpt2"}')
    sock = tmp_path / "c.sock"
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--model", str(bad), "--socket", str(sock)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and "gpt2" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(sock)


def test_network_sockets_are_refused_before_loading(tmp_path, demo):
    for argv in (["--socket", "tcp://127.0.0.1:55123"], ["--socket", "tcp://127.0.0.1:55123", "--print-config"],
                 ["--operator-socket", "ipc:///tmp/x"]):
        r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--model", str(demo), *argv], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        one_line(r, 2)
        assert "not a filesystem path" in r.stderr
    assert os.listdir(tmp_path) == []  # no stray tcp: directory
    cfg = tmp_path / "c.yaml"
    cfg.write_text("socket: tcp://0.0.0.0:80\n")
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    one_line(r, 2)
    one_line(ctl("tcp://127.0.0.1:55123", "ping"), exitcodes.USAGE)


def test_doctor_fails_where_run_fails_and_honours_socket(tmp_path, demo):
    model = tmp_path / "m"
    shutil.copytree(demo, model)
    os.unlink(model / "tokenizer.json")
    run = subprocess.run([sys.executable, "-m", "colibri.ctl", "run", "--model", str(model), "x"],
                         capture_output=True, text=True, timeout=120)
    one_line(run, exitcodes.MODEL)
    doc = subprocess.run([sys.executable, "-m", "colibri.ctl", "--socket", str(tmp_path / "here" / "c.sock"),
                          "doctor", "--model", str(model), "--deep", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert doc.returncode == exitcodes.CHECK_FAILED, doc.stdout + doc.stderr
    checks = {c["check"]: c for c in json.loads(doc.stdout)["checks"]}
    assert checks["tokenizer"]["status"] == "FAIL" and "tokenizer.json" in checks["tokenizer"]["detail"]
    assert str(tmp_path / "here") in checks["socket"]["detail"]  # --socket, not the default path
    ok = subprocess.run([sys.executable, "-m", "colibri.ctl", "doctor", "--model", str(demo), "--deep"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "skip checksums" in ok.stdout and "no checksums" in ok.stdout, ok.stdout


def test_random_bytes_never_give_a_traceback(tmp_path, demo):
    """Random bytes through every entry point that reads text: generate (stdin, argument,
    --stop), chat (stdin, --system), run (stdin, argument), policy set, and colibrid's
    config file and --model."""
    rnd = random.Random(16)

    def junk(n=40, arg=False):
        b = bytes(rnd.randrange(1, 256) for _ in range(n))
        return b.replace(b"-", b"_") if arg else b  # an argument starting with '-' would be a flag

    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path / "state")}

    def cmd(argv, stdin=b"", module="colibri.ctl"):
        r = subprocess.run([sys.executable, "-m", module, *argv], input=stdin, capture_output=True, timeout=120,
                           env=env, cwd=tmp_path)
        err = r.stderr.decode("utf-8", "replace")
        assert b"Traceback" not in r.stderr and r.returncode not in (exitcodes.INTERNAL,), (argv, err)
        return r.returncode, err

    with serving(tmp_path, demo) as (_, sock):
        s = ["--socket", sock]
        for _ in range(3):
            code, err = cmd([*s, "generate"], junk())
            assert code == exitcodes.BAD_REQUEST and "not valid UTF-8" in err and "offset" in err
            code, err = cmd([*s, "generate", junk(arg=True)])
            assert code == exitcodes.BAD_REQUEST
            code, _ = cmd([*s, "generate", "--stop", junk(arg=True), "x"])
            assert code == exitcodes.BAD_REQUEST
            code, _ = cmd([*s, "chat"], junk() + b"\n")
            assert code == exitcodes.BAD_REQUEST
            code, _ = cmd([*s, "chat", "--system", junk(arg=True)], b"hi\n")
            assert code == exitcodes.BAD_REQUEST
            code, _ = cmd(["--operator-socket", str(tmp_path / "colibri-operator.sock"), *s, "policy", "set",
                           junk(arg=True)])
            assert code in (exitcodes.BAD_REQUEST, exitcodes.USAGE)
        code, _ = cmd([*s, "generate", "--input-errors", "replace", "--max-tokens", "2"], junk())
        assert code == 0
    for stdin, argv in ((junk(), ["run", "--model", str(demo)]), (b"", ["run", "--model", str(demo), junk(arg=True)]),
                        (b"", ["run", "--model", junk(arg=True).replace(b"/", b"_"), "x"])):
        code, _ = cmd(argv, stdin)
        assert code in (exitcodes.BAD_REQUEST, exitcodes.MODEL)
    conf = tmp_path / "junk.yaml"
    conf.write_bytes(junk(200))
    code, err = cmd(["--config", str(conf), "--model", str(demo)], module="colibri.daemon")
    assert code == 2 and len(err.strip().splitlines()) == 1
    code, err = cmd(["--model", junk(arg=True).replace(b"/", b"_"), "--socket", str(tmp_path / "j.sock")],
                    module="colibri.daemon")
    assert code == 3 and not os.path.exists(tmp_path / "j.sock")


def test_lone_surrogates_from_a_raw_client_are_refused_not_fatal(tmp_path, demo):
    import zmq

    with serving(tmp_path, demo) as (proc, sock):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(P.endpoint(sock))
        for frame in (b'{"type": "generate_request", "id": "1", "prompt": "a\\ud800b"}',
                      b'{"type": "ping_request", "id": "\\udfff"}',
                      b'{"type": "\\ud800_request", "id": "3"}'):
            s.send(frame)
            assert s.poll(10000)
            msg = P.decode(s.recv())
            assert msg["status"] in ("ok", "error")
        s.close()
        assert proc.poll() is None and Client(sock).connect().call("ping")["status"] == "ok"


def test_small_edges(tmp_path, demo):
    def colictl(*argv, stdin=None):
        return subprocess.run([sys.executable, "-m", "colibri.ctl", *map(str, argv)], input=stdin, text=True,
                              capture_output=True, timeout=120)

    bare = colictl()
    assert bare.returncode == 0 and "generate" in bare.stdout
    r = colictl("run", "--model", tmp_path / "nonexistent", "x")
    one_line(r, exitcodes.MODEL)
    assert "no such model directory" in r.stderr and "tokenizer" not in r.stderr, r.stderr
    one_line(colictl("--socket", tmp_path / "x.sock", "generate", stdin=""), exitcodes.USAGE)
    for argv in (("generate", "--help"), ("cache", "show", "--help"), ("policy", "show", "--help")):
        helptext = colictl(*argv).stdout
        assert all(line.split("  ", 1)[-1].strip() for line in helptext.splitlines()
                   if line.strip().startswith(("--stop", "--json")))
    conv = subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", str(demo), str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=120)
    assert conv.returncode == 0, conv.stderr
    again = colictl("convert", tmp_path / "c", tmp_path / "d")
    one_line(again, exitcodes.USAGE)
    assert "already a colibri container" in again.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: x\n  socket: [\n")
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    one_line(r, 2)
    assert "line 2" in r.stderr
    out = subprocess.run([sys.executable, "-m", "colibri.daemon", "--print-config"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "STATE_DIRECTORY": str(tmp_path / "st"),
                                          "COLIBRI_SOCKET": str(tmp_path / "s.sock")}).stdout
    assert f"model: {tmp_path / 'st' / 'demo-model'}" in out and f"socket: {tmp_path / 's.sock'}" in out
    assert "null" not in out.split("operator_group")[0].split("socket_group")[0]


def test_status_words_and_lossy_on_stderr(tmp_path, demo):
    q4 = tmp_path / "q4"
    assert subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", "--dtype", "int4", str(demo), str(q4)],
                          capture_output=True, timeout=300).returncode == 0
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "run", "--model", str(q4), "--json", "--max-tokens", "2",
                        "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "LOSSY" in r.stderr and json.loads(r.stdout)["token_ids"]
    with serving(tmp_path, q4, "--expert-cache", "min") as (_, sock):
        st = ctl(sock, "status").stdout
        assert "1 slot per layer" in st and "O_DIRECT reads" in st and "True" not in st, st
        g = ctl(sock, "generate", "--json", "--max-tokens", 2, "x")
        assert g.returncode == 0 and "LOSSY" in g.stderr and json.loads(g.stdout)["prompt_token_ids"]


def test_compile_only_fills_numbas_cache_keyed_by_source_and_cpu():
    import glob

    import llvmlite.binding as llvm
    import numba

    import colibri.engine

    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--compile-only"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "kernels ready" in r.stderr, r.stderr
    where = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(os.path.dirname(colibri.engine.__file__), "__pycache__")
    index = glob.glob(os.path.join(where, "**", "kernels*.nbi"), recursive=True)
    assert index, where
    for f in index:  # numba keys each entry by the source file's stamp, its own version and the CPU
        data = open(f, "rb").read()
        assert llvm.get_host_cpu_name().encode() in data and numba.__version__.encode() in data, f
