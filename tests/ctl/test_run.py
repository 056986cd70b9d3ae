"""`colictl run` and `colictl demo-model` end to end, as a user runs them: a real
process, text and --json, prompt from the argument and from stdin, and one clear line
with a distinct exit code for each kind of bad input."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from colibri.ctl import exitcodes
from colibri.engine.tokenizer import Tokenizer
from colibri.storage.demo import write_demo_model

from hf_models import REFERENCE, rewrite_config

CTL = [sys.executable, "-m", "colibri.ctl"]


def colictl(*args, stdin=None, env=None):
    return subprocess.run([*CTL, *map(str, args)], input=stdin, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture
def broken(demo, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(demo, dst)
    return dst


def run_json(model, *args, stdin=None):
    r = colictl("run", "--model", model, "--json", *args, stdin=stdin)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1  # exactly one JSON object on stdout
    return json.loads(lines[0])


def test_text_streams_to_stdout_timings_to_stderr(demo):
    r = colictl("run", "--model", demo, "--max-tokens", 12, "Hello, colibri")
    assert r.returncode == 0, r.stderr
    ref = run_json(demo, "--max-tokens", 12, "Hello, colibri")
    assert r.stdout == ref["text"] + "\n"
    assert "tok/s" in r.stderr and "finish: length" in r.stderr


def test_json_fields_and_greedy_tokens_match_transformers(demo):
    out = run_json(demo, "--max-tokens", 16, "The quick brown fox")
    tok = Tokenizer(demo)
    assert out["prompt_token_ids"] == tok.encode("The quick brown fox")
    assert len(out["token_ids"]) == 16 and out["finish_reason"] == "length"
    assert out["text"] == tok.decode(out["token_ids"])
    for k in ("prefill_s", "decode_s", "decode_tok_s", "n_prompt_tokens", "n_generated_tokens"):
        assert k in out["stats"]
    assert out["stats"]["n_generated_tokens"] == 16
    # the demo model is a real qwen3_moe checkpoint: transformers agrees token for token
    import transformers

    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(demo, dtype=torch.float32, **REFERENCE).eval()
    with torch.no_grad():
        gen = ref.generate(torch.tensor([out["prompt_token_ids"]]), max_new_tokens=16, min_new_tokens=16,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    assert gen[0, len(out["prompt_token_ids"]):].tolist() == out["token_ids"]


def test_prompt_from_stdin_and_dash(demo):
    a = run_json(demo, "--max-tokens", 5, "piped words")
    b = run_json(demo, "--max-tokens", 5, stdin="piped words")
    c = run_json(demo, "--max-tokens", 5, "-", stdin="piped words")
    assert a["token_ids"] == b["token_ids"] == c["token_ids"]
    assert a["prompt_token_ids"] == b["prompt_token_ids"]


def test_seed_repeats_sampling(demo):
    args = ("--max-tokens", 24, "--temperature", 1.0, "--top-k", 50, "--top-p", 0.95)
    a = run_json(demo, *args, "--seed", 7, "abc")
    b = run_json(demo, *args, "--seed", 7, "abc")
    c = run_json(demo, *args, "--seed", 8, "abc")
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]


def test_stop_string(demo):
    full = run_json(demo, "--max-tokens", 20, "stop test")
    stop = full["text"][5:7]
    out = run_json(demo, "--max-tokens", 20, "--stop", stop, "stop test")
    assert out["finish_reason"] == "stop"
    assert out["text"] == full["text"][: full["text"].index(stop)]


def test_eos_stops(demo, broken):
    first = run_json(demo, "--max-tokens", 3, "eos test")["token_ids"][0]
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    out = run_json(broken, "--max-tokens", 10, "eos test")
    assert out["finish_reason"] == "stop" and out["token_ids"] == [first]


def test_chat_applies_the_template(demo):
    out = run_json(demo, "--max-tokens", 3, "--chat", "hi there")
    tok = Tokenizer(demo)
    want = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert out["prompt_token_ids"] == tok.encode(want, special=False)


def test_demo_model_is_deterministic(tmp_path):
    a = colictl("demo-model", tmp_path / "a")
    b = colictl("demo-model", tmp_path / "b")
    assert a.returncode == b.returncode == 0
    for name in os.listdir(tmp_path / "a"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    again = colictl("demo-model", tmp_path / "a")
    assert again.returncode == exitcodes.USAGE and "--force" in again.stderr


def one_line_error(r, code, *words):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_missing_directory(tmp_path):
    one_line_error(colictl("run", "--model", tmp_path / "none", "x"), exitcodes.MODEL, "none")


def test_no_config(broken):
    os.remove(broken / "config.json")
    one_line_error(colictl("run", "--model", broken, "x"), exitcodes.MODEL, "config.json")


def test_unknown_model_type(broken):
    rewrite_config(broken, lambda c: c.update(model_type="gpt2"))
    one_line_error(colictl("run", "--model", broken, "x"), exitcodes.MODEL, "gpt2", "qwen3_moe", "mixtral")


def test_truncated_safetensors(broken):
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100000])
    one_line_error(colictl("run", "--model", broken, "x"), exitcodes.MODEL, "model.safetensors")


def test_corrupted_header(broken):
    f = broken / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:16] = b"\x00garbag\xff"
    f.write_bytes(bytes(raw))
    one_line_error(colictl("run", "--model", broken, "x"), exitcodes.MODEL, "model.safetensors")


def test_missing_tensor(broken):
    from colibri.storage.safetensors import SafetensorsFile, write_safetensors

    f = SafetensorsFile(broken / "model.safetensors")
    tensors = {n: f.read(n) for n in f.entries if n != "model.layers.2.mlp.experts.5.up_proj.weight"}
    write_safetensors(broken / "model.safetensors", tensors)
    one_line_error(colictl("run", "--model", broken, "x"), exitcodes.MODEL, "experts.5.up_proj")


def test_missing_tokenizer(broken):
    os.remove(broken / "tokenizer.json")
    one_line_error(colictl("run", "--model", broken, "x"), exitcodes.MODEL, "tokenizer.json")


def test_prompt_longer_than_context(demo):
    n_ctx = json.load(open(os.path.join(demo, "config.json")))["max_position_embeddings"]
    r = colictl("run", "--model", demo, stdin=" y" * 2 * n_ctx)
    one_line_error(r, exitcodes.BAD_REQUEST, f"context is {n_ctx}")


@pytest.mark.parametrize("args,word", [(("--temperature", "-1"), "temperature"), (("--top-p", "0"), "top_p"),
                                       (("--top-k", "-3"), "top_k"), (("--max-tokens", "0"), "max_tokens")])
def test_invalid_sampling(demo, args, word):
    one_line_error(colictl("run", "--model", demo, *args, "x"), exitcodes.BAD_REQUEST, word)


def test_chat_without_template(broken):
    cfg = json.loads((broken / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (broken / "tokenizer_config.json").write_text(json.dumps(cfg))
    one_line_error(colictl("run", "--model", broken, "--chat", "x"), exitcodes.MODEL, "chat_template")


def test_demo_is_the_default_model_in_the_daemons_place(tmp_path):
    from colibri.daemon.config import Config, resolved
    from colibri.storage.container import is_container

    env = {"STATE_DIRECTORY": str(tmp_path)}
    r = colictl("run", "--max-tokens", 4, "--json", "hi", env=env)
    assert r.returncode == 0, r.stderr
    assert is_container(str(tmp_path / "demo-model"))  # a container, so the cache commands work on it
    out = json.loads(r.stdout)
    assert 1 <= len(out["token_ids"]) <= 4 and out["finish_reason"] in ("stop", "length")
    os.environ["STATE_DIRECTORY"], old = str(tmp_path), os.environ.get("STATE_DIRECTORY")
    try:
        assert resolved(Config())["model"] == str(tmp_path / "demo-model")  # the daemon's demo: the same one
    finally:
        os.environ.pop("STATE_DIRECTORY") if old is None else os.environ.update(STATE_DIRECTORY=old)


def test_client_path_does_not_load_numpy():
    code = "import sys; import colibri.ctl.main; assert 'numpy' not in sys.modules and 'numba' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_demo_weights_are_bf16(demo):
    from colibri.storage.safetensors import SafetensorsFile, bf16_to_f32

    f = SafetensorsFile(os.path.join(demo, "model.safetensors"))
    assert {e.dtype for e in f.entries.values()} == {"BF16"}
    assert np.isfinite(bf16_to_f32(f.read("model.embed_tokens.weight"))).all()


def test_run_learns_into_a_history_and_policies_keep_the_tokens(demo, tmp_path):
    c = tmp_path / "c"
    assert colictl("convert", demo, c).returncode == 0
    hist = tmp_path / "state"
    want = run_json(demo, "--max-tokens", 12, "policies")["token_ids"]  # may stop early (EOS): a step per token
    for policy in ("lru", "lru+pinned", "learned"):
        out = run_json(c, "--max-tokens", 12, "--expert-cache", "min", "--policy", policy, "--history", hist,
                       "--prefetch", 2, "policies")
        assert out["token_ids"] == want, policy
        assert out["stats"]["model"]["experts"]["policy"]["name"] == policy
    saved = json.load(open(next((hist / "history").iterdir())))
    assert saved["steps"] == 3 * len(want)  # three runs of a step per token, each loading the last one's history
    ro = run_json(c, "--max-tokens", 4, "--history", hist, "--history-read-only", "policies")
    assert ro["stats"]["model"]["experts"]["history"]["steps_loaded"] == 3 * len(want)
    assert json.load(open(next((hist / "history").iterdir())))["steps"] == 3 * len(want)  # read-only: not written


def test_a_session_continues_the_conversation_turn_by_turn(demo, tmp_path):
    """`run --session FILE` three times: each turn computes only its new tokens on the saved
    conversation, and the last turn gives what one request of the whole conversation (its
    token ids) gives; a damaged file is moved aside with a warning and the conversation
    starts afresh; a session of another model is refused with exit 4, a turn of the other kind
    (chat or text) with exit 2; a chat session continues from its rendered messages."""
    from colibri.engine.generate import SamplingParams, generate

    from hf_models import load_model

    ses = tmp_path / "talk.session"
    turns, whole = [], []
    for text in ("Once upon a time", " the king said", " and the cat"):
        r = colictl("run", "--model", demo, "--session", ses, "--max-tokens", 5, "--json", text)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["stats"]["session"]["continued_tokens"] == len(whole)
        turns.append(out)
        whole += out["prompt_token_ids"] + out["token_ids"]
    last = turns[-1]
    prompt = whole[: len(whole) - len(last["token_ids"])]
    want = [e.token_id for e in generate(load_model(str(demo)), prompt, SamplingParams(max_tokens=5))
            if e.kind == "token"]
    assert last["token_ids"][: len(want)] == want[: len(last["token_ids"])]

    ses.write_bytes(ses.read_bytes()[:100])  # truncated
    r = colictl("run", "--model", demo, "--session", ses, "--max-tokens", 2, "--json", "Fresh")
    assert r.returncode == 0 and "moved aside" in r.stderr
    assert json.loads(r.stdout)["stats"]["session"]["continued_tokens"] == 0
    assert any(p.name.startswith("talk.session.corrupt-") for p in tmp_path.iterdir())

    other = tmp_path / "other"
    shutil.copytree(demo, other)
    rewrite_config(other, lambda c: c.update(rms_norm_eps=1e-3))  # another model: its config differs
    r = colictl("run", "--model", other, "--session", ses, "--max-tokens", 2, "Hello")
    assert r.returncode == exitcodes.BAD_REQUEST and "another model" in r.stderr and "Traceback" not in r.stderr
    r = colictl("run", "--model", demo, "--session", ses, "--chat", "Hello")
    assert r.returncode == exitcodes.USAGE and "text session" in r.stderr

    chat = tmp_path / "chat.session"  # a chat: each turn renders the whole conversation, computes only what is new
    first = json.loads(colictl("run", "--model", demo, "--session", chat, "--chat", "--json", "--max-tokens", 4,
                               "Hello").stdout)
    second = json.loads(colictl("run", "--model", demo, "--session", chat, "--chat", "--json", "--max-tokens", 4,
                                "Again").stdout)
    assert second["stats"]["session"]["continued_tokens"] == len(first["prompt_token_ids"] + first["token_ids"])


def test_a_prompt_far_longer_than_the_context_is_refused_before_it_is_tokenised(demo):
    import time

    text = "word " * 600_000  # 3 MB: tokenising it took 7 s and 1 GB of RAM before the refusal
    # a wrapper whose one child is colictl reports that child's peak RSS (KiB) on its last line
    peak = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", peak, *CTL, "run", "--model", str(demo)], input=text,
                       capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == exitcodes.BAD_REQUEST and "far more than the model's context" in r.stderr, r.stderr
    assert took < 5 and "Traceback" not in r.stderr  # (under a second on an idle box: imports and the files' checks)
    assert int(r.stderr.splitlines()[-1]) < 400 * 1024, r.stderr


def test_a_trace_that_is_not_one_is_a_named_error_for_plan_and_tune(demo, tmp_path):
    for name, data in (("bad.jsonl", b"{}\n"), ("binary.jsonl", bytes(range(256)) * 4), ("empty.jsonl", b"")):
        (tmp_path / name).write_bytes(data)
        for cmd in ("plan", "tune"):
            r = colictl(cmd, "--model", demo, "--trace", tmp_path / name, "--memory", "1GiB")
            assert r.returncode == exitcodes.BAD_REQUEST, (name, cmd, r.stderr)
            assert name in r.stderr and "routing trace" in r.stderr and "internal error" not in r.stderr, r.stderr
