"""Conversations continued turn by turn (sessions): a turn restores the conversation's KV
cache and computes only its new tokens, giving what one request of the whole conversation
gives."""

import numpy as np
import pytest

from colibri.engine import layers
from colibri.engine.errors import InvalidRequest
from colibri.engine.generate import Conversation, SamplingParams, generate

from hf_models import CASES, build, load_model


@pytest.fixture(scope="module", autouse=True)
def _init():
    layers.init()


def tokens(events):
    return [e.token_id for e in events if e.kind == "token"]


@pytest.mark.parametrize("family,case,same_bits", [
    ("qwen3_moe", "basic", True), ("mixtral", "odd_tied_window", True),
    ("deepseek_v3", "q_lora_groups_interleaved", True), ("gpt_oss", "sinks_sliding_clamped", True),
    ("glm_moe_dsa", "full_shared_topk4", False), ("deepseek_v32", "odd_topk7_yarn_mlp_types", False),
    ("deepseek_v4", "odd_sigmoid_hc3_yarn", True),
    *[(fam, case, True) for fam in ("qwen3_next", "qwen3_5_moe", "kimi_linear", "inkling2", "glm5_next", "qwen4_exp")
      for case, _ in CASES[fam]]])
def test_three_turns_equal_one_request_of_the_whole_conversation(tmp_path, family, case, same_bits):
    """Each turn feeds the last sampled token and its new prompt on the restored cache; the
    third turn's tokens are those of one request whose prompt is the whole conversation.
    The caches are the same bits too (a hybrid's recurrent state with them), except
    glm_moe_dsa's: its sampled tokens' rows (one a step) and the same tokens in a prompt
    round differently (the tokens agree)."""
    build(family, case, tmp_path / "hf", seed=31)
    model = load_model(str(tmp_path / "hf"))
    rng = np.random.default_rng(1)
    turns = [rng.integers(0, model.args.vocab_size, n).tolist() for n in (7, 4, 9)]
    conv, got = None, []
    for t in turns:
        events = list(generate(model, t, SamplingParams(max_tokens=6), prior=conv, keep=True))
        got.append(tokens(events))
        conv = events[-1].conversation
        assert conv.tokens[-1] == got[-1][-1] and len(conv.tokens) == sum(map(len, turns[: len(got)])) + 6 * len(got)
    whole = turns[0] + got[0] + turns[1] + got[1] + turns[2]
    one = list(generate(model, whole, SamplingParams(max_tokens=6), keep=True))
    assert tokens(one) == got[2]
    assert one[-1].conversation.tokens == conv.tokens
    same = all(np.array_equal(one[-1].conversation.kv[k], conv.kv[k]) for k in conv.kv)
    assert same == same_bits


def test_a_conversation_of_another_shape_is_refused(tmp_path):
    build("qwen3_moe", "basic", tmp_path / "hf", seed=2)
    model = load_model(str(tmp_path / "hf"))
    conv = list(generate(model, [1, 2, 3], SamplingParams(max_tokens=2), keep=True))[-1].conversation
    bad = Conversation(conv.tokens, {"k": conv.kv["k"][:, :1], "v": conv.kv["v"]})
    with pytest.raises(InvalidRequest, match="does not fit"):
        list(generate(model, [4], SamplingParams(max_tokens=2), prior=bad))
    long = Conversation(conv.tokens + [5], conv.kv)  # one token more than the cache holds
    with pytest.raises(InvalidRequest, match="fewer than"):
        list(generate(model, [4], SamplingParams(max_tokens=2), prior=long))


def test_a_conversation_continued_by_a_rerendered_whole_keeps_only_the_shared_prefix(tmp_path):
    """A chat session renders the whole conversation again each turn: where the new
    rendering differs from the saved tokens (a template that drops a reply's thinking, a
    reply tokenized otherwise), the cache is kept up to the first difference and the rest
    is computed; the tokens are those of the rendering computed from nothing."""
    build("qwen3_moe", "basic", tmp_path / "hf", seed=5)
    model = load_model(str(tmp_path / "hf"))
    rng = np.random.default_rng(3)
    first = rng.integers(0, model.args.vocab_size, 9).tolist()
    conv = list(generate(model, first, SamplingParams(max_tokens=5), keep=True))[-1].conversation
    new = rng.integers(0, model.args.vocab_size, 6).tolist()
    for rendered, kept in [(conv.tokens + new, len(conv.tokens) - 1),  # it extends the saved conversation
                           (conv.tokens[:11] + new, 11),  # it differs after 11 tokens (within the reply)
                           (new, 0)]:  # nothing in common
        if rendered[:1] == conv.tokens[:1] and kept == 0:
            continue
        prior, rest = conv.continued(rendered)
        assert len(prior.tokens) - 1 == kept and prior.tokens + rest == rendered
        fresh = tokens(generate(model, rendered, SamplingParams(max_tokens=5)))
        assert tokens(generate(model, rest, SamplingParams(max_tokens=5), prior=prior)) == fresh
