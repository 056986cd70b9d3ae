"""The built-in demo model: the checkpoint its training log describes, English from a
newcomer's first command, the same tokens as transformers, at any expert budget."""

import hashlib
import json
import os
import re

import numpy as np
import pytest
import torch

from colibri.engine import layers
from colibri.engine.generate import SamplingParams, generate
from colibri.engine.registry import build_model
from colibri.engine.tokenizer import Tokenizer, eos_ids
from colibri.storage.checkpoint import load_config
from colibri.storage.demo import DEMO_DIR, ensure_demo_container, write_demo_model

from hf_models import REFERENCE, load_model

WORDS = "/usr/share/dict/words"  # Debian's wamerican (./setup.sh --test installs it)
PROMPTS = ["Once upon a time", "The best thing about computers is", "Love is", "A wise man once said"]
ENGLISH = 0.8  # the share of a greedy continuation's words that must be dictionary words (noise: ~0.1)


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "m")


def continuation(model, tok, prompt, n=32, **sampling):
    params = SamplingParams(max_tokens=n, **sampling)
    ids = [e.token_id for e in generate(model, tok.encode(prompt), params, (), tok) if e.kind == "token"]
    return ids


def test_the_shipped_checkpoint_is_the_one_its_training_log_records():
    log = json.load(open(os.path.join(DEMO_DIR, "training.json")))
    digest = hashlib.sha256(open(os.path.join(DEMO_DIR, "model.safetensors"), "rb").read()).hexdigest()
    assert digest == log["model_safetensors_sha256"]
    assert log["corpus"]["licence"].startswith("BSD") and log["loss_curve"] and log["final_held_out_loss"] < 5
    assert os.path.getsize(os.path.join(DEMO_DIR, "model.safetensors")) < 10 * 2**20
    routing = log["routing"]  # it routes like a trained model, not uniformly
    assert routing["top_quarter_share"] > 0.3 and routing["consecutive_reuse"] > routing["uniform_consecutive_reuse"]


def test_it_writes_english(demo):
    words = {w.strip().lower() for w in open(WORDS, encoding="utf-8", errors="replace")}
    model, tok = load_model(demo), Tokenizer(demo)
    said = []
    for p in PROMPTS:
        said += re.findall(r"[A-Za-z]+(?:'[a-z]+)?", tok.decode(continuation(model, tok, p)))
    known = sum(w.lower() in words for w in said)
    assert len(said) >= 6 * len(PROMPTS) and known / len(said) >= ENGLISH, (known, said)


def test_tokens_are_transformers_own_and_the_same_at_the_minimum_budget(demo, tmp_path):
    import transformers

    tok = Tokenizer(demo)
    ours = load_model(demo)
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(demo, dtype=torch.float32, **REFERENCE).eval()
    ids = tok.encode(PROMPTS[0])
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert continuation(ours, tok, PROMPTS[0], 24) == want
    container = ensure_demo_container(str(tmp_path / "c"), build_model)
    streamed = load_model(container, budget="min")
    assert continuation(streamed, tok, PROMPTS[0], 24) == want
    sampled = [continuation(m, tok, PROMPTS[1], 24, temperature=0.8, top_p=0.95, seed=5) for m in (ours, ours, streamed)]
    assert sampled[0] == sampled[1] == sampled[2]
    assert eos_ids(demo, load_config(demo), tok)


def test_an_old_demo_container_is_rebuilt_from_the_shipped_weights(tmp_path):
    path = ensure_demo_container(str(tmp_path / "c"), build_model)
    with open(os.path.join(path, "demo-source"), "w") as f:
        f.write("an older demo")
    again = ensure_demo_container(path, build_model)
    assert open(os.path.join(again, "demo-source")).read() == json.load(
        open(os.path.join(DEMO_DIR, "training.json")))["model_safetensors_sha256"]
    assert np.isfinite(load_model(again).forward(np.array([1, 2, 3]), load_model(again).new_cache(8))).all()
