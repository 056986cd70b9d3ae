"""Warm context in colibrid (issue 23), against a real daemon on a temporary socket: the
prefix cache (a repeated prompt computes only its new part, with the same tokens; the
budget set at runtime), and sessions (`generate`/`chat --session NAME`: a continued
conversation equals computing it whole, it survives kill -9, a damaged file is moved
aside, and another uid cannot reach it)."""

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
from test_daemon import ctl, start

from colibri.ctl import exitcodes
from colibri.ctl.client import Client
from colibri.storage.demo import write_demo_model


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("model") / "demo")


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo):
    """A daemon whose socket directory other users may enter (the uid test connects as nobody)."""
    where = tempfile.mkdtemp(prefix="colibri-sessions-")
    os.chmod(where, 0o755)
    tmp = tmp_path_factory.mktemp("daemon")
    proc, sock, _ = start(tmp, demo, sock=os.path.join(where, "colibri.sock"))
    yield sock, tmp / "state"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def call(sock, **fields):
    c = Client(sock).connect()
    try:
        return c.call("generate", timeout_ms=120000, **fields)
    finally:
        c.close()


def user(text):
    return [{"role": "user", "content": text}]


def test_a_shared_prefix_is_computed_once(served):
    sock, _ = served
    head = "You are a fortune teller. Answer in one line, kindly, and never mention the future twice. "
    cold = call(sock, prompt=head + "What will today bring?", max_tokens=8)
    warm = call(sock, prompt=head + "What will today bring?", max_tokens=8)
    other = call(sock, prompt=head + "And tomorrow?", max_tokens=8)
    assert cold["stats"]["cached_prompt_tokens"] == 0
    n = len(cold["prompt_token_ids"])
    assert warm["stats"]["cached_prompt_tokens"] == (n - 1) // 16 * 16 > 0 and warm["token_ids"] == cold["token_ids"]
    assert other["stats"]["cached_prompt_tokens"] >= 16
    kv = json.loads(ctl(sock, "stats", "--json").stdout)["kv"]
    assert kv["blocks"] >= 3 and kv["hit_requests"] >= 2 and kv["held_blocks"] == 0
    op = os.path.join(os.path.dirname(sock), "colibri-operator.sock")
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "--socket", sock, "--operator-socket", op, "cache",
                        "show", "--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout)["kv"]["blocks"] == kv["blocks"]
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "--socket", sock, "--operator-socket", op, "cache",
                        "set", "--kv", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "kv: 0 blocks" in r.stdout, r.stderr
    again = call(sock, prompt=head + "What will today bring?", max_tokens=8)
    assert again["stats"]["cached_prompt_tokens"] == 0 and again["token_ids"] == cold["token_ids"]
    r = subprocess.run([sys.executable, "-m", "colibri.ctl", "--socket", sock, "--operator-socket", op, "cache",
                        "set", "--kv", "64MiB"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_chat_session_over_three_turns_equals_the_whole_conversation(served):
    sock, _ = served
    said, tokens = [], 0
    for i, line in enumerate(["Tell me a fortune", "Another one, please", "And the last?"]):
        r = call(sock, messages=user(line), session="talk", max_tokens=12)
        s = r["session"]
        assert s["name"] == "talk" and s["turns"] == i + 1 and s["saved"]
        # only what is new is computed: the template renders the earlier turns as the
        # session saved them, so every saved position is reused
        assert s["reused_tokens"] == max(tokens - 1, 0)
        assert len(r["prompt_token_ids"]) == s["tokens"] - s["reused_tokens"] - len(r["token_ids"])
        tokens = s["tokens"]
        said += user(line) + [{"role": "assistant", "content": r["text"]}]
    whole = call(sock, messages=said[:-1], max_tokens=12)  # the third turn computed from nothing
    assert whole["token_ids"] == r["token_ids"] and whole["text"] == r["text"]
    assert whole["prompt_token_ids"][-len(r["prompt_token_ids"]) + 1:] == r["prompt_token_ids"][1:]
    shown = json.loads(ctl(sock, "session", "show", "--json", "talk").stdout)
    assert shown["turns"] == 3 and shown["mode"] == "chat" and shown["messages"] == said
    listed = [json.loads(line) for line in ctl(sock, "session", "list", "--json").stdout.splitlines()]
    assert "talk" in [d["name"] for d in listed]


def test_text_session_equals_colictl_run_with_a_session_file(served, demo, tmp_path):
    sock, _ = served
    for i, prompt in enumerate(["Once upon a time", " and then", " the end"]):
        r = call(sock, prompt=prompt, session="story", max_tokens=10)
        assert r["session"]["turns"] == i + 1
        ref = subprocess.run([sys.executable, "-m", "colibri.ctl", "run", "--model", str(demo), "--json",
                              "--max-tokens", "10", "--threads", "1", "--session", str(tmp_path / "story"), prompt],
                             capture_output=True, text=True, timeout=120)
        assert ref.returncode == 0, ref.stderr
        assert r["token_ids"] == json.loads(ref.stdout)["token_ids"]  # (run's session is tested against the whole)


def test_session_refusals_are_one_line_and_change_nothing(served):
    sock, _ = served
    call(sock, prompt="A raw story", session="raw", max_tokens=4)
    for args, code, words in [
        (("generate", "--session", "bad/name", "x"), exitcodes.BAD_REQUEST, "not valid"),
        (("generate", "--chat", "--session", "raw", "x"), exitcodes.BAD_REQUEST, "text session"),
        (("session", "show", "nothing-here"), exitcodes.BAD_REQUEST, "NOT_FOUND"),
        (("session", "rm", "nothing-here"), exitcodes.BAD_REQUEST, "NOT_FOUND"),
    ]:
        r = ctl(sock, *args)
        assert r.returncode == code and words in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert json.loads(ctl(sock, "session", "show", "--json", "raw").stdout)["turns"] == 1
    # one turn at a time: a second request on a session in use is BUSY; a cancelled turn is not kept
    c = Client(sock).connect()
    try:
        first = c.send("generate", prompt="The", session="busy", max_tokens=400)
        second = c.send("generate", prompt="The", session="busy", max_tokens=4)
        assert c.reply_to(second, 120000)["error"]["name"] == "BUSY"
        c.send("cancel", target=first)
        assert c.reply_to(first, 120000)["error"]["name"] == "CANCELLED"
    finally:
        c.close()
    assert ctl(sock, "session", "show", "busy").returncode == exitcodes.BAD_REQUEST
    assert "raw" in ctl(sock, "session", "list").stdout and " 1 turn " in ctl(sock, "session", "list").stdout
    # several names: each is said, the ones removed and the one missing; exit 4 for the missing one
    call(sock, prompt="Another", session="raw2", max_tokens=2)
    r = ctl(sock, "session", "rm", "raw", "missing", "raw2")
    assert r.returncode == exitcodes.BAD_REQUEST and r.stdout.split() == ["removed", "raw", "removed", "raw2"], r
    assert r.stderr.strip() == "colictl: missing: NOT_FOUND: " + r.stderr.strip().split(": ", 3)[-1], r.stderr
    assert ctl(sock, "session", "show", "raw").returncode == exitcodes.BAD_REQUEST


def test_a_damaged_session_file_is_moved_aside(served):
    sock, state = served
    call(sock, prompt="Keep this", session="damaged", max_tokens=4)
    (path,) = glob.glob(str(state / "sessions" / "*" / str(os.getuid()) / "damaged.safetensors"))
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)  # the header length: not a safetensors file any more
    r = call(sock, prompt="Keep this", session="damaged", max_tokens=4)
    assert r["session"]["turns"] == 1 and r["session"]["reused_tokens"] == 0  # afresh
    assert glob.glob(path + ".corrupt-*")


def test_another_uid_can_neither_read_nor_continue_a_session(served):
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    sock, _ = served
    mine = call(sock, prompt="A secret of root", session="private", max_tokens=6)
    os.chmod(sock, 0o666)  # let the other user connect at all (a group does this in production)
    code = """if True:
        import json, os, sys
        from colibri.ctl.client import Client, ReplyError
        os.setgid(65534); os.setuid(65534)
        c = Client(sys.argv[1]).connect()
        out = {"list": c.call("session", action="list")["sessions"]}
        for action in ("show", "rm"):
            try:
                c.call("session", action=action, name="private")
                out[action] = "ok"
            except ReplyError as e:
                out[action] = e.name
        r = c.call("generate", timeout_ms=120000, prompt="A secret of root", session="private", max_tokens=6)
        out["session"] = r["session"]
        print(json.dumps(out))
    """
    # imports first, then the uid drops: the child needs no access to the source tree
    r = subprocess.run([sys.executable, "-c", code, sock], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    theirs = json.loads(r.stdout)
    assert theirs["list"] == [] and theirs["show"] == "NOT_FOUND" and theirs["rm"] == "NOT_FOUND"
    assert theirs["session"]["turns"] == 1 and theirs["session"]["reused_tokens"] == 0  # their own, new
    again = call(sock, prompt=" and more", session="private", max_tokens=4)  # root's is untouched
    assert again["session"]["turns"] == 2 and again["session"]["reused_tokens"] == mine["session"]["tokens"] - 1


def test_a_session_survives_kill_9_between_turns(tmp_path, demo):
    proc, sock, _ = start(tmp_path, demo)
    try:
        first = call(sock, messages=user("Before the crash"), session="durable", max_tokens=8)
        assert first["session"]["saved"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        os.unlink(tmp_path / "notify")  # (the stale sockets the daemon clears itself)
        proc, sock, _ = start(tmp_path, demo)
        second = call(sock, messages=user("After it"), session="durable", max_tokens=8)
        assert second["session"]["turns"] == 2
        assert second["session"]["reused_tokens"] == first["session"]["tokens"] - 1  # restored, not recomputed
        whole = call(sock, messages=user("Before the crash") + [{"role": "assistant", "content": first["text"]}]
                     + user("After it"), max_tokens=8)
        assert whole["token_ids"] == second["token_ids"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
