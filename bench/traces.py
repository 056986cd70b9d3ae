"""Routing traces for bench/cache_policy.py, written by the engine running prompts.

- `synthetic`: the decode benchmark's Qwen3-30B-A3B-shaped model (synthetic.py, routers
  built with structure), several requests one after another, each a prompt drawn from
  the model's own topic process followed by sampled text (temperature 1, fixed seeds);
  a second, separate set of requests makes the warm-up trace.
- `demo`: the built-in demo model (trained on fortune cookies) continuing English prompts,
  sampled at temperature 1 with fixed seeds; another set of prompts makes the warm-up.
- the tiny test checkpoints (tests/hf_models.py, one per family, built with transformers
  when it is installed): random prompts of their small vocabularies.
- the library (`library_traces`, bench/cache_policy.py --library): one model per family
  with the real model's expert count, top-k and router kind (Qwen3-MoE at 128 experts and
  at 64, DeepSeek-V3's 256 in 8 groups with sigmoid scores, GLM-4.5's 160, gpt-oss's 128
  top-4), 12 layers narrowed to hidden 512 so each builds in seconds, its routers and
  embeddings made by synthetic.py's recipe (popular experts, topic experts, text that
  stays on a topic); each serves a chat-like workload (prompts of 12 to 300 tokens, 48
  tokens generated each, one after another as a daemon serves them), and another set of
  requests makes its warm-up trace. Plus the demo model's trace.

Each trace line carries the router lookahead's prediction too ("predicted").
"""

import os
import sys

import numpy as np

from colibri.engine import layers
from colibri.engine.generate import SamplingParams, generate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from synthetic import load_model  # noqa: E402


def _run(model, prompts, tokens: int, path: str, seed: int) -> None:
    from colibri.storage.experts import TracedSource

    inner = model.experts
    with open(path, "w") as f:
        model.experts = TracedSource(inner, f)
        for i, p in enumerate(prompts):
            for _ in generate(model, p, SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed + i)):
                pass
    model.experts = inner


def synthetic_traces(out: str, tokens: int, workdir: str, n_layer: int | None = None) -> tuple[str, str, int]:
    sys.path.insert(0, HERE)
    from synthetic import SHAPE, build, prompt

    path = build(workdir, 16.0, n_layer)
    model = load_model(path, budget=int(0.25 * 16e9) if n_layer is None else "all")
    per_request = max(tokens // 4, 1)
    names = []
    for kind, seed in (("", 100), ("-warmup", 200)):
        rng = np.random.default_rng(seed)
        prompts = [prompt(rng, 32) for _ in range(4)]
        names.append(os.path.join(out, f"synthetic{kind}.jsonl"))
        print(f"tracing {names[-1]}", file=sys.stderr)
        _run(model, prompts, per_request, names[-1], seed)
    model.experts.close()
    return names[0], names[1], SHAPE["num_experts_per_tok"]


DEMO_PROMPTS = (["Once upon a time", "The computer said", "Love is", "Never trust a"],
                ["A wise man once", "The law of", "In the beginning", "Your lucky number is"])  # trace, warm-up


def small_traces(out: str, tokens: int, families: bool = True) -> dict:
    """The demo model and, with transformers installed and `families`, each family's basic
    test checkpoint."""
    from colibri.engine.tokenizer import Tokenizer
    from colibri.storage.demo import write_demo_model

    models = {"demo": write_demo_model(os.path.join(out, "models", "demo"), force=True)}
    tok = Tokenizer(models["demo"])
    try:
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        import hf_models
    except ImportError:
        hf_models = None
        print("transformers is not installed: tracing the demo model only", file=sys.stderr)
    for fam in hf_models.CASES if hf_models is not None and families else ():
        p = os.path.join(out, "models", fam)
        if not os.path.isdir(p):
            hf_models.build(fam, "basic", p)
        models[fam] = p
    res = {}
    for name, path in models.items():
        model = load_model(path)
        vocab, k = model.args.vocab_size, model.args.num_experts_per_tok
        paths = []
        for i, (kind, seed) in enumerate((("", 100), ("-warmup", 200))):
            rng = np.random.default_rng(seed)
            paths.append(os.path.join(out, f"{name}{kind}.jsonl"))
            prompts = [tok.encode(p) for p in DEMO_PROMPTS[i]] if name == "demo" else \
                [list(rng.integers(0, vocab, 16)) for _ in range(4)]
            _run(model, prompts, max(tokens // 4, 1), paths[-1], seed)
        res[name] = (paths[0], paths[1], k)
    return res


# the library's models: each family's routing (experts, top-k, groups, scores) as released,
# the width narrowed (routing structure comes from the recipe, not the width)
NARROW = {"hidden_size": 512, "moe_intermediate_size": 64, "intermediate_size": 512}
LIBRARY = {
    "qwen3_moe-128": ("qwen3_moe", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}),
    "qwen3_moe-64": ("qwen3_moe", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                                   "num_experts": 64}),
    "deepseek_v3": ("deepseek_v3", {"num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64,
                                    "q_lora_rank": 96, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
                                    "v_head_dim": 32}),
    "glm4_moe": ("glm4_moe", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}),
    "gpt_oss": ("gpt_oss", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                            "intermediate_size": 64}),
}
LIBRARY_LAYERS = 12
WORKLOAD = {"prompt_tokens": (300, 40, 250, 12, 120), "tokens": 48}  # one request per prompt, in turn


def library_traces(out: str, workdir: str, names=None) -> dict:
    """{name: (trace, warm-up trace, top_k)} for the library's models (LIBRARY; `names` a
    subset) and the demo model."""
    from synthetic import build, prompt

    res = {}
    for name in names or LIBRARY:
        family, overrides = LIBRARY[name]
        path = build(workdir, 0.0, LIBRARY_LAYERS, family, "bf16", NARROW | overrides)
        model = load_model(path, budget="all")
        paths = []
        for kind, seed in (("", 1), ("-warmup", 2)):
            rng = np.random.default_rng(seed)
            prompts = [prompt(rng, n) for n in WORKLOAD["prompt_tokens"]]
            paths.append(os.path.join(out, f"{name}{kind}.jsonl"))
            print(f"tracing {paths[-1]}", file=sys.stderr)
            _run(model, prompts, WORKLOAD["tokens"], paths[-1], 100 * seed)
        model.experts.close()
        res[name] = (paths[0], paths[1], model.args.num_experts_per_tok)
    if names is None:
        res |= small_traces(out, 4 * WORKLOAD["tokens"], families=False)
    return res


def make_traces(out: str, tokens: int, workdir: str | None = None, only: str | None = None,
                library: bool = False) -> dict:
    """{name: (trace, warm-up trace, top_k)}; `only` "demo" traces the demo model alone;
    `library`: the trace library (library_traces) instead of the synthetic model's."""
    os.makedirs(out, exist_ok=True)
    layers.init()
    if only == "demo":
        return small_traces(out, tokens, families=False)
    workdir = workdir or os.path.join(os.path.expanduser("~"), ".cache", "colibri", "bench")
    os.makedirs(workdir, exist_ok=True)
    if library:
        return library_traces(out, workdir)
    return {"synthetic": synthetic_traces(out, tokens, workdir), **small_traces(out, tokens)}
