"""colibrid as a real process on a temporary socket, with a fake NOTIFY_SOCKET."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from colibri.ctl import exitcodes
from colibri.ctl.client import Client, ReplyError
from colibri.daemon import protocol as P
from colibri.storage.demo import write_demo_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Notify:
    """The datagram socket systemd would own: a thread collects what the daemon tells it."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        while True:
            try:
                self.lines += self.sock.recv(4096).decode().splitlines()
            except TimeoutError:
                pass
            except OSError:
                return

    def wait_for(self, line: str, timeout: float) -> bool:
        end = time.time() + timeout
        while time.time() < end and line not in self.lines:
            time.sleep(0.05)
        return line in self.lines


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("model") / "demo")


def start(tmp_path, model, *extra, env=None, sock=None):
    notify = Notify(tmp_path / "notify")
    sock = sock or str(tmp_path / "colibri.sock")
    env = {**os.environ, "NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000",
           "STATE_DIRECTORY": str(tmp_path / "state"), **(env or {})}
    env.pop("COLIBRI_SOCKET", None)
    log = open(tmp_path / "colibrid.log", "w")  # a file, not a pipe nobody reads
    proc = subprocess.Popen([sys.executable, "-m", "colibri.daemon", "--model", str(model), "--socket", sock, *extra],
                            env=env, stderr=log, text=True)
    assert notify.wait_for("READY=1", 120), "no READY=1"
    return proc, sock, notify


@contextlib.contextmanager
def serving(tmp_path, model, *extra, env=None):
    """A daemon for the `with` block; SIGTERM at its end must stop it cleanly (exit 0)."""
    proc, sock, _ = start(tmp_path, model, *extra, env=env)
    try:
        yield proc, sock
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.fixture
def daemon(tmp_path, demo):
    proc, sock, notify = start(tmp_path, demo)
    yield proc, sock, notify
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def ctl(sock, *args, stdin=None):
    return subprocess.run([sys.executable, "-m", "colibri.ctl", "--socket", sock, *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_ready_watchdog_status_and_sigterm(daemon):
    proc, sock, notify = daemon
    assert any(line.startswith("STATUS=") for line in notify.lines)
    assert notify.wait_for("WATCHDOG=1", 5)
    r = ctl(sock, "status", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["pid"] == proc.pid and st["model"]["type"] == "qwen3_moe" and "cpus" in st["boot"]
    (drive,) = st["boot"]["drives"]  # the model's drive, reported; tune_drives is off: nothing changed
    assert "device" in drive and "would_change" in drive and "changed" not in drive
    assert oct(os.stat(sock).st_mode & 0o777) == "0o660"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert notify.wait_for("STOPPING=1", 5)
    assert not os.path.exists(sock)


def test_generate_matches_run_in_process(daemon, demo):
    _, sock, _ = daemon
    r = ctl(sock, "generate", "--json", "--max-tokens", 20, stdin="The daemon and the process agree")
    assert r.returncode == 0, r.stderr
    # the process on one thread, the daemon on every CPU: the same tokens
    ref = subprocess.run([sys.executable, "-m", "colibri.ctl", "run", "--model", str(demo), "--json", "--max-tokens",
                          "20", "--threads", "1", "The daemon and the process agree"], capture_output=True, text=True,
                         timeout=120)
    assert json.loads(r.stdout)["token_ids"] == json.loads(ref.stdout)["token_ids"]
    text = ctl(sock, "generate", "--max-tokens", 20, "The daemon and the process agree")
    assert text.stdout == json.loads(ref.stdout)["text"] + "\n"


def generate(sock, prompt, n, results, key):
    c = Client(sock).connect()
    try:
        c.hello()
        r = c.call("generate", timeout_ms=120000, prompt=prompt, max_tokens=n)
        results[key] = r["token_ids"]
    finally:
        c.close()


def test_concurrent_clients_get_their_own_tokens(daemon):
    _, sock, _ = daemon
    prompts = [f"client number {i} says" + " hello" * i for i in range(8)]
    alone = {}
    for i, p in enumerate(prompts):
        generate(sock, p, 16, alone, i)
    together = {}
    threads = [threading.Thread(target=generate, args=(sock, p, 16, together, i), daemon=True) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


@pytest.mark.parametrize("window_ms", [0, 1000])
def test_requests_sent_together_share_their_first_step(tmp_path, demo, window_ms):
    """An idle engine waits batch_window_ms after a request for others sent with it, so
    their prompts are one forward step (one pass over the weights and experts). Without
    the window, requests 100 ms apart start in separate steps (the control)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"batch_window_ms: {window_ms}\n")
    proc, sock, _ = start(tmp_path, demo, "--config", str(cfg))
    try:
        clients = [Client(sock).connect() for _ in range(3)]
        steps0 = clients[0].call("stats")["experts"]["steps"]
        for i, c in enumerate(clients):
            c.send("generate", prompt=f"the prompt of client {i}", max_tokens=1)
            time.sleep(0.1)
        for c in clients:
            while not c.recv(30000)["type"].endswith("_reply"):
                pass
        steps = clients[0].call("stats")["experts"]["steps"] - steps0
        assert steps == 1 if window_ms else steps > 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize("chunk", [4, "auto", 0])
def test_a_long_prompt_arriving_does_not_stop_a_running_stream(tmp_path, demo, chunk):
    """With prefill_chunk 4, a long prompt arriving while a request decodes goes in 4
    tokens a step, the running request advancing at each (engine/generate.py's Batcher,
    tested step by step in tests/engine/test_batching.py); `auto` starts at 1 and at most
    doubles a step (so 85 tokens take at least 7 steps); with 0 it is one step (the
    control). Counted in forward steps, not in wall time."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"prefill_chunk: {chunk}\n")
    proc, sock, _ = start(tmp_path, demo, "--config", str(cfg))
    try:
        a, b = Client(sock).connect(), Client(sock).connect()
        rid = a.send("generate", prompt="The", max_tokens=3000)  # (greedy, the demo runs past 200 tokens)
        assert a.recv(30000)["type"] == "generate_stream"
        steps0 = b.call("stats")["experts"]["steps"]
        reply = b.call("generate", timeout_ms=120000, prompt="The law of the land says " * 12, max_tokens=1)
        steps = b.call("stats")["experts"]["steps"] - steps0
        n_prompt = reply["stats"]["n_prompt_tokens"]
        assert n_prompt > 40
        if chunk == "auto":
            assert steps >= 7
        elif chunk:
            assert steps >= -(-n_prompt // chunk)  # a step for every chunk, the running request in each
        else:
            assert steps <= 10  # the prompt in one step (and the few the running request took meanwhile)
        assert b.call("status")["requests"]["active"] == 1  # the running request was running throughout
        a.send("cancel", target=rid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_cancel_and_status_during_generation(daemon):
    _, sock, _ = daemon
    c = Client(sock).connect()
    rid = c.send("generate", prompt="a long one", max_tokens=3000)
    first = c.recv(30000)
    assert first["type"] == "generate_stream" and first["id"] == rid
    t0 = time.perf_counter()
    other = Client(sock).connect()
    assert other.call("ping")["status"] == "ok"
    assert other.call("status")["requests"]["active"] == 1
    assert time.perf_counter() - t0 < 1.0  # the I/O thread answers while the engine works
    c.send("cancel", target=rid)
    while True:
        msg = c.recv(30000)
        if msg.get("id") == rid and msg["type"] == "generate_reply":
            break
    assert msg["status"] == "error" and msg["error"]["name"] == "CANCELLED"
    assert len(msg["token_ids"]) < 3000
    assert other.call("stats")["requests"]["cancelled"] == 1
    c.close()
    other.close()


def test_client_killed_mid_stream(daemon):
    _, sock, _ = daemon
    p = subprocess.Popen([sys.executable, "-m", "colibri.ctl", "--socket", sock, "generate", "--max-tokens", "3000",
                          "forever"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert p.stdout.read(5)  # it streams
    p.kill()
    p.wait()
    c = Client(sock).connect()
    for _ in range(100):
        if c.call("stats")["requests"]["cancelled"] == 1:
            break
        time.sleep(0.1)
    assert c.call("stats")["requests"]["cancelled"] == 1
    assert c.call("status")["requests"]["active"] == 0
    assert ctl(sock, "generate", "--max-tokens", 3, "still fine").returncode == 0
    c.close()


def test_bad_messages_get_error_replies(daemon):
    proc, sock, _ = daemon
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(P.endpoint(sock))
    cases = [b"\xff\xfe not json", b"[1, 2]", b'{"no": "type"}',
             P.encode({"type": "frobnicate_request", "id": "1"}),
             P.encode({"type": "ping_request", "id": "2", "v": "2.0"}),
             P.encode({"type": "generate_request", "id": "3", "prompt": 7}),
             P.encode({"type": "generate_request", "id": "4", "prompt": "x", "max_tokens": 10**9}),
             P.encode({"type": "generate_request", "id": "5", "prompt": "x", "temperature": -1}),
             P.encode({"type": "cancel_request", "id": "6", "target": "nothing"})]
    want = ["BAD_MESSAGE", "BAD_MESSAGE", "BAD_MESSAGE", "UNKNOWN_TYPE", "VERSION_MISMATCH", "BAD_MESSAGE",
            "INVALID_REQUEST", "INVALID_REQUEST", "NOT_FOUND"]
    got = []
    for frame in cases:
        s.send(frame)
        assert s.poll(10000)
        msg = json.loads(s.recv())
        assert msg["status"] == "error" and msg["error"]["code"] == P.ERRORS[msg["error"]["name"]]
        got.append(msg["error"]["name"])
    assert got == want
    s.close()
    assert proc.poll() is None and Client(sock).connect().call("ping")["status"] == "ok"
    r = ctl(sock, "generate", "--temperature", "-1", "x")
    assert r.returncode == exitcodes.BAD_REQUEST and "temperature" in r.stderr and "Traceback" not in r.stderr


def test_daemon_down_is_one_line_and_its_own_exit_code(tmp_path):
    r = ctl(str(tmp_path / "none.sock"), "ping")
    assert r.returncode == exitcodes.DAEMON_DOWN and len(r.stderr.strip().splitlines()) == 1
    assert "not running" in r.stderr


def test_shutdown_command(daemon):
    proc, sock, notify = daemon
    assert ctl(sock, "shutdown").returncode == 0
    assert proc.wait(30) == 0 and notify.wait_for("STOPPING=1", 5)


def test_bad_config_names_the_key(tmp_path, demo):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("expert_cache: 1GiB\nio_thread: 3\n")
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", str(cfg), "--model", str(demo)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "io_thread" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    out = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", os.path.join(ROOT, "etc/colibri.yaml"),
                          "--print-config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "expert_cache: all" in out.stdout and "table_cache: auto" in out.stdout
    cfg.write_text("table_cache: some\n")
    r = subprocess.run([sys.executable, "-m", "colibri.daemon", "--config", str(cfg), "--print-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "table_cache" in r.stderr and "min, all or auto" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def container(demo, tmp_path_factory):
    dst = tmp_path_factory.mktemp("container") / "demo-c"
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "convert", str(demo), str(dst)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return dst


def test_cache_resize_under_load(tmp_path, container):
    with serving(tmp_path, container, "--expert-cache", "all") as (proc, sock):
        prompts = [f"resize test {i}" + "!" * i for i in range(4)]
        alone = {}
        for i, p in enumerate(prompts):
            generate(sock, p, 40, alone, i)
        together = {}
        threads = [threading.Thread(target=generate, args=(sock, p, 40, together, i), daemon=True) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        sizes = []
        for size in ("min", "3MiB", "all", "min"):
            r = ctl(sock, "cache", "set", "--experts", size)
            assert r.returncode == 0, r.stderr
            placement = json.loads(ctl(sock, "cache", "show", "--json").stdout)["placement"]
            sizes.append(placement["slots"])
        for t in threads:
            t.join(120)
        assert together == alone  # nothing failed, nothing changed but speed
        assert sizes == [4, 3 * 2**20 // placement["record_bytes"], 64, 4]  # slots, over the 4 MoE layers
        stats = Client(sock).connect().call("stats")["requests"]
        assert stats["failed"] == 0 and stats["served"] == 8
        bad = ctl(sock, "cache", "set", "--experts", "1KiB")
        assert bad.returncode == exitcodes.BAD_REQUEST and "minimum" in bad.stderr


def test_protocol_doc_matches_the_code():
    doc = open(os.path.join(ROOT, "docs/protocol.md")).read()
    assert re.search(r"Protocol version: \*\*([\d.]+)\*\*", doc).group(1) == P.PROTOCOL_VERSION
    errors = doc[doc.index("## Errors"):doc.index("`colictl` maps them")]
    table = dict((name, int(code)) for code, name in re.findall(r"^\| (\d+) \| ([A-Z_]+) \|", errors, re.M))
    assert table == P.ERRORS
    for kind in P.REQUEST_TYPES:
        assert f"`{kind}_request`" in doc


def test_unit_client_reports_reply_errors(daemon):
    _, sock, _ = daemon
    with pytest.raises(ReplyError) as e:
        Client(sock).connect().call("cancel", target="x")
    assert e.value.name == "NOT_FOUND"


def test_chat_keeps_the_conversation(daemon):
    _, sock, _ = daemon
    r = ctl(sock, "chat", "--max-tokens", 6, stdin="first question\nsecond question\n")
    assert r.returncode == 0, r.stderr
    c = Client(sock).connect()
    first = c.call("generate", timeout_ms=60000, messages=[{"role": "user", "content": "first question"}], max_tokens=6)
    second = c.call("generate", timeout_ms=60000, max_tokens=6, messages=[
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "second question"}])
    assert r.stdout == first["text"] + "\n" + second["text"] + "\n"  # each reply ends its line
    c.close()


def test_reload_applies_what_it_can(tmp_path, container):
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text("expert_cache: all\nio_threads: 2\n")
    with serving(tmp_path, container, "--config", str(cfg)) as (proc, sock):
        cfg.write_text("expert_cache: min\nio_threads: 3\nlog_level: debug\nstate_snapshot_tokens: 250\n")
        r = ctl(sock, "reload")
        assert r.returncode == 0, r.stderr
        applied = r.stdout.split("applied: ")[1].split(";")[0].split(", ")
        assert sorted(applied) == ["expert_cache", "log_level", "state_snapshot_tokens"], r.stdout
        assert "needs a restart: io_threads" in r.stdout
        assert json.loads(ctl(sock, "stats", "--json").stdout)["kv"]["snapshot_tokens"] == 240  # (whole blocks)
        for _ in range(50):
            if json.loads(ctl(sock, "cache", "show", "--json").stdout)["placement"]["slots_per_layer"] == 1:
                break
            time.sleep(0.1)
        assert json.loads(ctl(sock, "cache", "show", "--json").stdout)["placement"]["slots_per_layer"] == 1
        cfg.write_text("expert_cache: lots\n")
        bad = ctl(sock, "reload")
        assert bad.returncode == exitcodes.BAD_REQUEST and "expert_cache" in bad.stderr and "unchanged" in bad.stderr
        proc.send_signal(signal.SIGHUP)  # the same bad file through SIGHUP: logged, nothing changes
        time.sleep(0.5)
        assert proc.poll() is None and ctl(sock, "ping").returncode == 0
        assert "reload refused" in (tmp_path / "colibrid.log").read_text()


def proc_status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(key + ":"))


@contextlib.contextmanager
def reserved_hugepages(n: int):
    """n more 2 MiB hugepages reserved for the block (as root), as they were after; yields
    whether the kernel gave them."""
    path = "/proc/sys/vm/nr_hugepages"
    before = int(open(path).read())
    try:
        with open(path, "w") as f:
            f.write(str(before + n))
        got = int(open(path).read()) >= before + n
    except OSError:
        got = False
    try:
        yield got
    finally:
        try:
            with open(path, "w") as f:
                f.write(str(before))
        except OSError:
            pass


def test_boot_placement_reports_what_the_kernel_gave(tmp_path, container):
    """Each step as the kernel reports it back where this box allows it (CPU affinity, the
    memory policy, VmLck, hugetlb pages), and a named fallback where it does not."""
    import ctypes.util

    cfg = tmp_path / "colibri.yaml"
    cfg.write_text("numa_node: 0\nhugepages: true\nmlock: true\ncpus: [0]\nio_threads: 3\n")
    root = os.geteuid() == 0  # CAP_IPC_LOCK: mlock beyond RLIMIT_MEMLOCK
    with reserved_hugepages(16) as have_hugepages, serving(tmp_path, container, "--config", str(cfg)) as (proc, sock):
        boot = json.loads(ctl(sock, "status", "--json").stdout)["boot"]
        assert boot["cpus"]["asked"] == [0] and boot["cpus"]["got"] == [0]
        assert os.sched_getaffinity(proc.pid) == {0}  # what the process really has (NUMA must not widen it)
        assert boot["numa"]["asked"] == 0 and boot["io_threads"]["got"] == 3
        if ctypes.util.find_library("numa"):
            policies = open(f"/proc/{proc.pid}/numa_maps").read()
            assert boot["numa"]["got"] == 0 and "prefer:0" in policies, boot["numa"]
        else:
            assert boot["numa"]["got"] == "any" and "libnuma" in boot["numa"]["fallback"]
        locked_kb = int(proc_status(proc.pid, "VmLck").split()[0])
        if root:  # the dense weights and the expert arena locked, as the kernel counts them
            assert boot["mlock_dense"]["got"] == boot["mlock_dense"]["asked"] > 0, boot["mlock_dense"]
            assert boot["mlock_experts"]["got"] == "locked"
            assert locked_kb * 1024 >= boot["mlock_dense"]["asked"], locked_kb
        else:
            assert "RLIMIT_MEMLOCK" in boot["mlock_dense"].get("fallback", "RLIMIT_MEMLOCK")
        assert boot["hugepages"]["asked"] == "reserved"
        if have_hugepages:
            huge_kb = sum(int(line.split()[1]) for line in open(f"/proc/{proc.pid}/smaps")
                          if line.startswith("Private_Hugetlb:"))
            assert boot["hugepages"]["got"].startswith("reserved") and huge_kb >= 2048, (boot["hugepages"], huge_kb)
        else:
            assert "vm.nr_hugepages" in boot["hugepages"]["got"], boot["hugepages"]
        assert ctl(sock, "generate", "--max-tokens", 4, "placed").returncode == 0


def test_pin_and_unpin(tmp_path, container):
    with serving(tmp_path, container, "--expert-cache", "min") as (proc, sock):
        r = ctl(sock, "pin", "1:3")
        assert r.returncode == exitcodes.BAD_REQUEST and "no room to pin" in r.stderr
        assert ctl(sock, "cache", "set", "--experts", "8MiB", "--pinned", "1MiB").returncode == 0
        r = ctl(sock, "pin", "1:3")
        assert r.returncode == 0 and "1:3" in r.stdout, r.stderr
        show = json.loads(ctl(sock, "cache", "show", "--json").stdout)["placement"]
        assert show["pinned"] == ["1:3"] and show["pinned_bytes"] > 0
        assert ctl(sock, "generate", "--max-tokens", 8, "pinned").returncode == 0
        assert ctl(sock, "unpin", "1:3").returncode == 0
        r = ctl(sock, "unpin", "1:3")
        assert r.returncode == exitcodes.BAD_REQUEST and "not pinned" in r.stderr
        r = ctl(sock, "pin", "99:0")
        assert r.returncode == exitcodes.BAD_REQUEST and "no expert 99:0" in r.stderr
        assert ctl(sock, "pin", "nonsense").returncode == exitcodes.USAGE


def test_usage_history_survives_a_restart_and_policy_changes_live(tmp_path, container):
    conf = tmp_path / "colibri.yaml"
    conf.write_text("repin_every: 2\nhot_set: 1.0\n")
    with serving(tmp_path, container, "--expert-cache", "8MiB", "--config", conf) as (proc, sock):
        want = ctl(sock, "generate", "--max-tokens", 16, "--json", "learn me").stdout
        st = json.loads(ctl(sock, "stats", "--json").stdout)
        assert st["policy"] == "learned" and st["history"]["steps"] == 16 and st["history"]["experts_seen"] > 0
        assert "history: 16 steps" in ctl(sock, "stats").stdout
        r = ctl(sock, "policy", "set", "policy=lru", "prefetch_reads=4")
        assert r.returncode == 0 and "name=lru" in r.stdout and "prefetch_reads=4" in r.stdout, r.stderr
        assert json.loads(ctl(sock, "generate", "--max-tokens", 16, "--json", "learn me").stdout)["token_ids"] \
            == json.loads(want)["token_ids"]  # another policy: the same tokens
        assert json.loads(ctl(sock, "stats", "--json").stdout)["experts"]["prefetch_issued"] > 0
        for bad in (["policy=fifo"], ["hot_set=2"], ["colour=red"]):
            r = ctl(sock, "policy", "set", *bad)
            assert r.returncode == exitcodes.BAD_REQUEST and r.stderr.count("\n") == 1, r.stderr
        assert ctl(sock, "policy", "set", "nonsense").returncode == exitcodes.USAGE
        assert json.loads(ctl(sock, "policy", "show", "--json").stdout)["policy"]["name"] == "lru"
    files = os.listdir(tmp_path / "state" / "history")
    assert len(files) == 1 and files[0].endswith(".json")  # written at stop, named by the container
    os.unlink(tmp_path / "notify")
    with serving(tmp_path, container, "--expert-cache", "8MiB", "--config", conf) as (proc, sock):
        st = json.loads(ctl(sock, "stats", "--json").stdout)
        assert st["history"]["steps_loaded"] == 32  # what the box learned before the restart
        assert st["experts"]["bytes_read"] > 0 and st["experts"]["misses"] == 0  # read in at start, from it
        assert json.loads(ctl(sock, "generate", "--max-tokens", 16, "--json", "learn me").stdout)["token_ids"] \
            == json.loads(want)["token_ids"]


@pytest.mark.parametrize("kind,why", [("eio", "Input/output error"), ("short", "short read"),
                                      ("corrupt", "checksum mismatch")])
def test_a_failing_expert_fails_the_request_not_the_daemon(tmp_path, container, kind, why):
    faults = ",".join(f"{kind}@1:{e}" for e in range(16))  # every expert of layer 1: any prompt needs one
    with serving(tmp_path, container, "--expert-cache", "min", env={"COLIBRI_FAULTS": faults}) as (proc, sock):
        r = ctl(sock, "generate", "--max-tokens", 4, "doomed")
        assert r.returncode == exitcodes.MODEL and "cannot read layer 1 expert" in r.stderr and why in r.stderr
        assert "experts-0001.safetensors at offset" in r.stderr and r.stderr.count("\n") == 1
        status = ctl(sock, "status")
        assert status.returncode == 0 and "BAD       expert 1:" in status.stdout
        assert ctl(sock, "ping").returncode == 0 and proc.poll() is None
        st = json.loads(ctl(sock, "stats", "--json").stdout)
        assert st["experts"]["read_errors"] >= 2 and st["requests"]["failed"] == 1


def test_limits_answer_with_named_errors(tmp_path, demo):
    import zmq

    conf = tmp_path / "limits.yaml"
    conf.write_text("max_message_bytes: 4096\nmax_streams_per_client: 2\n")
    with serving(tmp_path, demo, "--config", conf) as (proc, sock):
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(P.endpoint(sock))
        raw.send(P.encode(P.request("generate", "big", prompt="x" * 5000)))
        assert raw.poll(5000)
        reply = P.decode(raw.recv())
        assert reply["error"]["name"] == "TOO_LARGE" and "4096" in reply["error"]["message"]
        raw.send(b"\x00" * 100_000)  # far above: the daemon drops the connection instead of buffering it
        time.sleep(0.3)
        assert proc.poll() is None and ctl(sock, "ping").returncode == 0
        for i in range(3):  # one client, three long requests: the third is one too many
            raw.send(P.encode(P.request("generate", f"r{i}", prompt="hello", max_tokens=200)))
        replies = {}
        end = time.time() + 60
        while time.time() < end and "r2" not in replies:
            if raw.poll(1000):
                m = P.decode(raw.recv())
                if m["type"] == "generate_reply":
                    replies[m["id"]] = m
        assert replies["r2"]["error"]["name"] == "BUSY" and "max_streams_per_client" in replies["r2"]["error"]["message"]
        for i in range(2):
            raw.send(P.encode(P.request("cancel", f"c{i}", target=f"r{i}")))
        raw.close()
        ctx.term()
        assert ctl(sock, "generate", "--max-tokens", 4, "still here").returncode == 0  # another client is fine


def as_user(uid: int, groups: list[int], argv: list[str]) -> tuple[int, str]:
    """Run colictl's own command code as another uid; its exit code and output. Python
    lives under /root on this box, closed to other users, so the child is forked with
    colictl already imported and drops to the uid, rather than exec'd through setpriv."""
    import colibri.ctl.client  # noqa: F401 (imported before the fork)
    from colibri.ctl.main import cli

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.close(r)
            sys.stdout = sys.stderr = os.fdopen(w, "w", buffering=1)  # pytest's capture is not inherited
            os.setgroups(groups)
            os.setgid(groups[0])
            os.setuid(uid)
            try:
                cli.main(argv, standalone_mode=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch uids")
def test_access_is_by_socket_file_permissions(tmp_path, demo):
    import grp
    import tempfile

    users = grp.getgrnam("users").gr_gid
    nobody, nogroup = 65534, grp.getgrnam("nogroup").gr_gid
    run_dir = tempfile.mkdtemp(prefix="colibri-acl-")
    os.chmod(run_dir, 0o755)  # the runtime directory: reachable, the sockets' modes decide
    conf = tmp_path / "acl.yaml"
    conf.write_text("socket_group: users\n")
    sock = f"{run_dir}/colibri.sock"
    proc, _, _ = start(tmp_path, demo, "--config", conf, sock=sock)
    try:
        st_user, st_op = os.stat(sock), os.stat(f"{run_dir}/colibri-operator.sock")
        assert st_user.st_mode & 0o777 == 0o660 and st_op.st_mode & 0o777 == 0o660
        assert st_user.st_gid == users and st_op.st_gid == os.getgid()
        code, out = as_user(nobody, [users], ["--socket", sock, "ping"])
        assert code == 0 and "pong" in out, out  # a member of the socket's group
        code, out = as_user(nobody, [users], ["--socket", sock, "shutdown"])
        assert code == exitcodes.PERMISSION and "permission denied on" in out and "colibri-operator.sock" in out
        assert out.count("\n") == 1, out
        code, out = as_user(nobody, [nogroup], ["--socket", sock, "ping"])
        assert code == exitcodes.PERMISSION and "group 'users'" in out, out
        raw = Client(sock).connect()  # an operator request on the user socket is refused by the daemon too
        with pytest.raises(ReplyError) as e:
            raw.call("shutdown")
        assert e.value.name == "FORBIDDEN"
        raw.close()
        assert proc.poll() is None and ctl(sock, "cache", "show").returncode == 0  # root: the operator socket
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        shutil.rmtree(run_dir, ignore_errors=True)


def test_fuzzing_the_user_socket_leaves_the_daemon_serving(tmp_path, demo):
    """10,000 generated messages (raw bytes, arbitrary JSON, requests of every type with
    fields of any type) on the user socket: every one gets exactly one reply, and after
    them the daemon still answers, generates the same tokens, and has not grown."""
    import psutil
    import zmq
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    conf = tmp_path / "fuzz.yaml"
    conf.write_text("max_tokens_limit: 2\nmax_queue: 4\n")
    with serving(tmp_path, demo, "--config", conf) as (proc, sock):
        want = json.loads(ctl(sock, "generate", "--json", "--max-tokens", 2, "fuzz").stdout)["token_ids"]
        rss0 = psutil.Process(proc.pid).memory_info().rss
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(P.endpoint(sock))
        counts = {"sent": 0, "replies": 0}
        # a message with a string id must be answered with that id, once; any other one once,
        # with its id when the daemon could read it, else with a null id
        by_id, others, answered = Counter(), Counter(), Counter()

        def expect(frame):
            try:
                msg = P.decode(frame)
            except P.ProtocolError:
                msg = None
            key = json.dumps(msg.get("id"), sort_keys=True) if msg is not None else "null"
            (by_id if msg is not None and isinstance(msg.get("id"), str) else others)[key] += 1

        def drain(timeout_ms=0):
            while dealer.poll(timeout_ms):
                reply = P.decode(dealer.recv())
                if reply["type"].endswith("_reply"):
                    counts["replies"] += 1
                    answered[json.dumps(reply.get("id"), sort_keys=True)] += 1
                timeout_ms = 0

        scalars = st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(
            max_size=40)
        values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
            st.text(max_size=8), inner, max_size=4), max_leaves=12)
        fields = st.sampled_from(["id", "v", "prompt", "messages", "max_tokens", "temperature", "top_k", "top_p",
                                  "seed", "stop", "target", "protocol", "action", "experts", "layer", "expert"])
        request = st.builds(
            lambda kind, extra, rid, version: {"type": kind, "id": rid, "v": version, **extra},
            st.sampled_from([f"{k}_request" for k in P.REQUEST_TYPES] + ["nonsense", "generate_reply", ""]),
            st.dictionaries(fields, values, max_size=6),
            st.text(max_size=6) | values, st.sampled_from([P.PROTOCOL_VERSION, "1.0", "2.0", "x", None]))
        frames = (st.binary(max_size=300) | values.map(lambda v: json.dumps(v).encode())
                  | request.map(lambda m: json.dumps(m).encode()))

        @settings(max_examples=1_000, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(frames, min_size=10, max_size=10))
        def send(batch):  # ten messages an example: 10,000 in all
            for frame in batch:
                dealer.send(frame)
                expect(frame)
                counts["sent"] += 1
            drain()

        t0 = time.time()
        send()
        end = time.time() + 60
        while counts["replies"] < counts["sent"] and time.time() < end:
            drain(200)
        assert counts["sent"] >= 10_000 and counts["replies"] == counts["sent"]  # one reply each, none lost
        assert {k: answered[k] for k in by_id} == dict(by_id)  # each string id answered as often as sent
        stray = {k: v for k, v in answered.items() if k not in by_id and k != "null" and v > others[k]}
        assert not stray, stray  # no reply with an id no message carried, nor more than the messages with it
        assert time.time() - t0 < 300
        dealer.close()
        ctx.term()
        assert proc.poll() is None and ctl(sock, "ping").returncode == 0
        assert json.loads(ctl(sock, "generate", "--json", "--max-tokens", 2, "fuzz").stdout)["token_ids"] == want
        assert psutil.Process(proc.pid).memory_info().rss - rss0 < 64 * 2**20  # bounded: nothing piles up


def test_kill_9_keeps_the_last_saved_history_and_a_damaged_one_is_moved_aside(tmp_path, container):
    conf = tmp_path / "save.yaml"
    conf.write_text("history_save_s: 0.2\n")
    proc, sock, _ = start(tmp_path, container, "--expert-cache", "8MiB", "--config", conf)
    assert ctl(sock, "generate", "--max-tokens", 8, "remember this").returncode == 0
    time.sleep(1.0)  # a periodic save happens between steps
    assert ctl(sock, "ping").returncode == 0
    proc.kill()  # no goodbye: only what was saved survives
    proc.wait(30)
    folder = tmp_path / "state" / "history"
    (saved,) = list(folder.iterdir())
    os.unlink(tmp_path / "notify")
    proc, sock, _ = start(tmp_path, container, "--expert-cache", "8MiB", "--config", conf)
    try:
        assert json.loads(ctl(sock, "stats", "--json").stdout)["history"]["steps_loaded"] == 8
    finally:
        proc.kill()
        proc.wait(30)
    saved.write_bytes(b"\x00garbage")  # a damaged state file: moved aside, the daemon starts anyway
    os.unlink(tmp_path / "notify")
    with serving(tmp_path, container, "--expert-cache", "8MiB", "--config", conf) as (proc, sock):
        assert json.loads(ctl(sock, "stats", "--json").stdout)["history"]["steps_loaded"] == 0
        assert any(".corrupt-" in f.name for f in folder.iterdir())
        assert "moved aside" in (tmp_path / "colibrid.log").read_text()


def test_the_daemon_shares_reads_between_drives_and_shows_the_rotation(tmp_path, container):
    copy = tmp_path / "drive1"
    r = ctl("-", "drives", "stage", "--model", container, copy)
    assert r.returncode == 0 and "4 files copied" in r.stderr, r.stderr
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text(f"expert_cache: min\nmirror: {copy}\n")  # the old key: read as drives, said so in the log
    with serving(tmp_path, container, "--config", str(cfg)) as (proc, sock):
        assert ctl(sock, "generate", "--max-tokens", 8, "two drives").returncode == 0
        ds = [json.loads(line) for line in ctl(sock, "drives", "status", "--json").stdout.splitlines()]
        assert [d["path"] for d in ds] == [str(container), str(copy)] and all(d["in_rotation"] for d in ds)
        assert all(d["measured_gbs"] > 0 for d in ds) and sum(d["bytes"] for d in ds) > 0
        text = ctl(sock, "drives", "status").stdout
        assert text.count("drive ") == 2 and "in rotation" in text and "4/4 expert files" in text
        assert json.loads(ctl(sock, "status", "--json").stdout)["config"]["drives"] == [str(copy)]
    assert "mirror is now drives" in (tmp_path / "colibrid.log").read_text()


def test_stats_compare_the_tuned_plan_with_the_measured_rate(tmp_path, container):
    cfg = tmp_path / "colibri.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\nexpert_cache: 2MiB\n")
    r = ctl("-", "tune", "--model", container, "--config", cfg)
    assert r.returncode == 0 and "the plan is in" in r.stderr, r.stderr
    (tmp_path / "colibri.yaml.d" / "50-tune.yaml").unlink()  # keep the small budget: a prediction off "all"
    with serving(tmp_path, container, "--config", str(cfg)) as (proc, sock):
        assert ctl(sock, "generate", "--max-tokens", 12, "how fast").returncode == 0
        plan = json.loads(ctl(sock, "stats", "--json").stdout)["plan"]
        assert 0 < plan["predicted"]["budget_fraction"] < 1 and plan["predicted"]["tok_s"] > 0
        assert plan["measured_tok_s"] > 0 and plan["decode_steps"] >= 10
        assert "plan: predicted" in ctl(sock, "stats").stdout
