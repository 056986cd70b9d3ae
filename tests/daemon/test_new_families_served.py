"""The frontier families end to end: a checkpoint made by transformers converts with
colictl convert and is served by colibrid under the minimum expert budget, giving the
tokens colictl run gives in-process (which the engine tests tie to transformers)."""

import json
import subprocess
import sys
import time

import pytest
from test_daemon import ctl, serving

from colibri.storage.demo import CHAT_TEMPLATE, _tokenizer_json

from hf_models import build, build_fp4, build_fp8, build_k25, build_mxfp4, k25_hub_names

PUBLISHED = {"fp8": lambda f, c, p: build_fp8(f, c, p, seed=13, block=(16, 16), vocab_size=259),
             "mxfp4": lambda f, c, p: build_mxfp4(f, c, p, seed=13, vocab_size=259, hidden_size=64, intermediate_size=32),
             "fp4": lambda f, c, p: build_fp4(f, c, p, seed=13, vocab_size=259, hidden_size=64, moe_intermediate_size=32),
             "image-text": lambda f, c, p: (build_k25(p, c, None, seed=13, vocab_size=259), k25_hub_names(p))}


@pytest.mark.parametrize("family,case,precision", [
    ("deepseek_v3", "q_lora_groups_interleaved", None), ("glm_moe_dsa", "full_shared_topk4", None),
    ("deepseek_v32", "topk4_dense_first", "fp8"), ("deepseek_v4", "all_types_hash_first", "fp4"),
    ("glm4_moe", "odd_no_norm_two_shared", None), ("minimax_m2", "rotary_dim_half", None),
    ("gpt_oss", "sinks_sliding_clamped", None),
    ("deepseek_v3", "q_lora_groups_interleaved", "fp8"), ("gpt_oss", "sinks_sliding_clamped", "mxfp4"),
    ("qwen3_next", "odd_mix_sparse_tied", None), ("qwen3_5_moe", "basic_three_to_one", None),
    ("kimi_linear", "q_lora_groups_mixed", None), ("kimi_k25", "q_lora_groups_interleaved", "image-text"),
    ("inkling2", "sliding_full_blocks", None), ("glm5_next", "kda_pools_shared_hc2", None),
    ("qwen4_exp", "ple_qsa_hc2", None)])
def test_a_frontier_family_converts_and_is_served(tmp_path, family, case, precision):
    hf = tmp_path / "hf"
    if precision:  # at its published precision, kept by convert; or an image-text checkpoint as the hub has it
        PUBLISHED[precision](family, case, hf)
    else:
        build(family, case, hf, seed=13, vocab_size=259)  # the byte-level tokenizer's 256 + 3 tokens
    (hf / "tokenizer.json").write_text(_tokenizer_json())
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    colictl = [sys.executable, "-m", "colibri.ctl"]
    r = subprocess.run([*colictl, "convert", str(hf), str(tmp_path / "c")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    run = subprocess.run([*colictl, "run", "--model", str(tmp_path / "c"), "--expert-cache", "min", "--json",
                          "--max-tokens", "12", "streamed experts"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    want = json.loads(run.stdout)
    assert len(want["token_ids"]) == 12
    hybrid = family in ("qwen3_next", "qwen3_5_moe", "kimi_linear", "inkling2", "glm5_next", "qwen4_exp")
    # (Qwen4-Exp's n-gram tables streamed by pages under a budget of two)
    (tmp_path / "c.yaml").write_text(("prefill_chunk: auto\n" if hybrid else "{}\n")
                                     + ("table_cache: 8KiB\n" if family == "qwen4_exp" else ""))
    with serving(tmp_path, tmp_path / "c", "--expert-cache", "min", "--config", str(tmp_path / "c.yaml")) as (_, sock):
        got = ctl(sock, "generate", "--json", "--max-tokens", 12, "streamed experts")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["token_ids"] == want["token_ids"]
        status = json.loads(ctl(sock, "status", "--json").stdout)
        assert status["model"]["type"] == family
        if family == "qwen4_exp":
            assert json.dumps(status).count('"bytes_read"') and '"budget_bytes": 8192' in json.dumps(status)
            assert "tables: " in ctl(sock, "stats").stdout  # (colictl stats says what they read)
            # the tables' cache retuned while serving: the same tokens; above the box's RAM refused, nothing changed
            r = ctl(sock, "cache", "set", "--tables", "64KiB")
            assert r.returncode == 0 and "tables: " in r.stdout, r.stderr
            assert json.loads(ctl(sock, "cache", "show", "--json").stdout)["tables"]["budget_bytes"] == 65536
            assert json.loads(ctl(sock, "generate", "--json", "--max-tokens", 12, "streamed experts").stdout)[
                "token_ids"] == want["token_ids"]
            r = ctl(sock, "cache", "set", "--tables", "100TiB")
            assert r.returncode == 4 and "the embedding tables' cache" in r.stderr, r.stderr
            assert json.loads(ctl(sock, "cache", "show", "--json").stdout)["tables"]["budget_bytes"] == 65536
            (tmp_path / "c.yaml").write_text("prefill_chunk: auto\ntable_cache: 16KiB\n")  # a reload applies it
            assert ctl(sock, "reload").returncode == 0
            for _ in range(50):  # (applied between two steps, by the engine's thread)
                if json.loads(ctl(sock, "cache", "show", "--json").stdout)["tables"]["budget_bytes"] == 16384:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the reloaded table_cache was not applied")
        elif hybrid:
            r = ctl(sock, "cache", "set", "--tables", "1MiB")
            assert r.returncode == 4 and "streams no embedding tables" in r.stderr, r.stderr
        if precision in ("fp8", "mxfp4", "fp4"):  # (FP4 experts are computed as MXFP4)
            assert {"fp4": "mxfp4"}.get(precision, precision) in json.dumps(status["model"])
        if hybrid:  # requests of different lengths at once, each its own state, prompts in auto-sized chunks
            prompts = ["a", "several words of a longer prompt than the other one, past one KV block"]
            alone = [json.loads(subprocess.run([*colictl, "run", "--model", str(tmp_path / "c"), "--json",
                                                "--max-tokens", "10", p], capture_output=True, text=True,
                                               timeout=300).stdout)["token_ids"] for p in prompts]
            procs = [subprocess.Popen([*colictl, "--socket", sock, "generate", "--json", "--max-tokens", "10", p],
                                      stdout=subprocess.PIPE, text=True) for p in prompts]
            assert [json.loads(p.communicate(timeout=120)[0])["token_ids"] for p in procs] == alone
            # the longer prompt again: resumed from the state the prefix cache kept at its last block
            again = json.loads(ctl(sock, "generate", "--json", "--max-tokens", 10, prompts[1]).stdout)
            assert again["token_ids"] == alone[1] and again["stats"]["cached_prompt_tokens"] >= 48


@pytest.mark.parametrize("family,case", [("qwen3_next", "odd_mix_sparse_tied"), ("kimi_linear", "q_lora_groups_mixed")])
def test_a_hybrids_session_survives_a_restart(tmp_path, family, case):
    """A hybrid's session keeps its KV blocks and its recurrent state in the session file:
    after colibrid restarts, the next turn gives what colictl run's own session gives."""
    hf = tmp_path / "hf"
    build(family, case, hf, seed=13, vocab_size=259)
    (hf / "tokenizer.json").write_text(_tokenizer_json())
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    colictl = [sys.executable, "-m", "colibri.ctl"]
    assert subprocess.run([*colictl, "convert", str(hf), str(tmp_path / "c")], capture_output=True).returncode == 0
    turns = ["the first turn of it", " and a second one"]
    want = [json.loads(subprocess.run([*colictl, "run", "--model", str(tmp_path / "c"), "--json", "--max-tokens", "6",
                                       "--session", str(tmp_path / "ref"), t], capture_output=True, text=True,
                                      timeout=300).stdout)["token_ids"] for t in turns]
    got = []
    for t in turns:  # one daemon per turn: the second starts from the session file alone
        (tmp_path / "notify").unlink(missing_ok=True)
        with serving(tmp_path, tmp_path / "c") as (_, sock):
            r = ctl(sock, "generate", "--json", "--max-tokens", 6, "--session", "hybrid", t)
            assert r.returncode == 0, r.stderr
            got.append(json.loads(r.stdout)["token_ids"])
    assert got == want
