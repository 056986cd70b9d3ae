"""What quantizing the experts costs: int8 and int4 containers against the bf16 container
of the same model, on the same prompts.

    python bench/quality.py [--model HF_DIR] [--group-size 64] [--tokens 48]

For every prompt, the bf16 model's greedy continuation is fed to all three models
(teacher forcing); at every position the next-token distributions are compared:
mean KL(bf16 || quantized) in nats, and top-1 agreement. Prints one JSON object.
Without --model it uses a larger copy of the demo model (random weights, so the
numbers say how much the kernels' and the format's error moves the outputs, not how a
trained model's quality changes).
"""

import argparse
import os
import sys
import tempfile

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402
from synthetic import load_model  # noqa: E402

from colibri.engine import layers  # noqa: E402
from colibri.engine.generate import SamplingParams, generate  # noqa: E402
from colibri.engine.registry import build_model  # noqa: E402
from colibri.engine.tokenizer import Tokenizer  # noqa: E402
from colibri.storage.checkpoint import load_config, open_checkpoint  # noqa: E402
from colibri.storage.convert import ExpertPlan, convert  # noqa: E402
from colibri.storage.demo import write_random_model  # noqa: E402

PROMPTS = ["The history of the printing press", "def fibonacci(n):", "Dear colleagues, the meeting on",
           "In 1969 the first humans", "Mixture-of-experts models route each token"]
DEMO_SHAPE = dict(hidden_size=512, moe_intermediate_size=512, num_experts=32, head_dim=64, num_hidden_layers=4)


def log_softmax(x):
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face checkpoint directory (default: a larger demo model)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colibri-bench-quality"))
    a = ap.parse_args()
    layers.init()
    src = a.model or os.path.join(a.workdir, "demo-hf")
    if not a.model and not os.path.isfile(os.path.join(src, "config.json")):
        write_random_model(src, force=True, **DEMO_SHAPE)
    structure = build_model(src, load_config(src))
    plan = ExpertPlan(structure.moe_layers, structure.n_expert, structure.expert_names)
    ckpt = open_checkpoint(src)
    models = {}
    for dtype in ("bf16", "int8", "int4"):
        dst = os.path.join(a.workdir, f"c-{dtype}-g{a.group_size}")
        convert(ckpt, dst, plan, expert_dtype=dtype, group_size=a.group_size if dtype != "bf16" else None,
                force=True)
        models[dtype] = load_model(dst, budget="all")
    tok = Tokenizer(src)
    kl = {"int8": [], "int4": []}
    agree = {"int8": [], "int4": []}
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        cont = [e.token_id for e in generate(models["bf16"], ids, SamplingParams(max_tokens=a.tokens))
                if e.kind == "token"]
        seq = np.asarray(ids + cont[:-1])
        ref = log_softmax(models["bf16"].forward(seq, models["bf16"].new_cache(len(seq)), all_logits=True)
                          .astype(np.float64))[len(ids) - 1:]
        for dtype in ("int8", "int4"):
            m = models[dtype]
            lq = log_softmax(m.forward(seq, m.new_cache(len(seq)), all_logits=True).astype(np.float64))[len(ids) - 1:]
            kl[dtype] += list((np.exp(ref) * (ref - lq)).sum(axis=-1))
            agree[dtype] += list(ref.argmax(-1) == lq.argmax(-1))
    out = {"benchmark": "quality", "model": os.path.abspath(src), "reference": "bf16 container",
           "group_size": a.group_size, "n_prompts": len(PROMPTS), "n_positions": len(agree["int8"]),
           "results": [{"dtype": d, "mean_kl_nats": round(float(np.mean(kl[d])), 6),
                        "max_kl_nats": round(float(np.max(kl[d])), 6),
                        "top1_agreement": round(float(np.mean(agree[d])), 4),
                        "expert_bytes": models[d].experts.c.expert_bytes} for d in ("int8", "int4")]}
    sys.stdout.write(provenance.dumps(out, indent=2) + "\n")
    print()


if __name__ == "__main__":
    main()
