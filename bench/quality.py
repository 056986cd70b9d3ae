"""What the lossy choices cost: int8 and int4 experts, each on exact float32 activations and
on int8 ones (the integer dot products), and with the dense matrices in int8 or int4 too,
against the model as published, on the same text.

    python bench/quality.py [--model demo|peer|HF_DIR] [--group-size 64] [--windows 24]

The text is fed to every variant (teacher forcing) in windows of --window tokens; at every
position the next-token distributions are compared: mean and max KL(bf16 || variant) in
nats, top-1 agreement with bf16, and each variant's loss on the text's real next token.
- demo (the default): the built-in demo model on its held-out fortunes (the 5 % that
  tools/train_demo.py left out of training, drawn with its seed; needs `apt-get install
  fortunes`), a trained model on text it never saw.
- peer: bench/peer.py's benchmark model (random weights from bench/synthetic.py's recipe,
  --layers deep) on text drawn from the recipe: how far the kernels' and formats' errors
  move its outputs, not how a trained model's quality changes.
- a Hugging Face checkpoint directory: on the held-out fortunes too.
Prints one JSON object with provenance.
"""

import argparse
import os
import random
import sys
import tempfile

for var, val in {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}.items():
    os.environ.setdefault(var, val)

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import provenance  # noqa: E402
from synthetic import load_model  # noqa: E402

from colibri.engine import layers  # noqa: E402
from colibri.engine.registry import build_model  # noqa: E402
from colibri.engine.tokenizer import Tokenizer  # noqa: E402
from colibri.storage.checkpoint import load_config, open_checkpoint  # noqa: E402
from colibri.storage.container import MANIFEST  # noqa: E402
from colibri.storage.convert import ExpertPlan, convert  # noqa: E402

# (experts, activations, dense matrices): the dense part bf16 (None) or int8 / int4 (attention and LM head)
VARIANTS = [("int8", "float32", None), ("int8", "int8", None), ("int4", "float32", None), ("int4", "int8", None),
            ("int8", "int8", "int8"), ("int4", "int8", "int8"), ("int4", "int8", "int4")]


def log_softmax(x):
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def held_out_fortunes(src: str) -> list[str]:
    """The demo's held-out fortunes: tools/train_demo.py's corpus, shuffled with the seed its
    training.json records, the first 5 %."""
    import json

    from train_demo import read_corpus

    seed = 20261201
    info = os.path.join(src, "training.json")
    if os.path.isfile(info):
        seed = json.load(open(info)).get("seed", seed)
    _, texts = read_corpus()
    random.Random(seed).shuffle(texts)
    return texts[: len(texts) // 20]


def windows(ids: list[int], n: int, length: int) -> list[np.ndarray]:
    return [np.asarray(ids[i : i + length]) for i in range(0, len(ids) - length, length)][:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="demo, peer, or a Hugging Face checkpoint directory")
    ap.add_argument("--layers", type=int, default=2, help="--model peer: layers of the benchmark model")
    ap.add_argument("--group-size", type=int, default=64, help="int8 and int4 weights' group")
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "colibri-bench-quality"))
    a = ap.parse_args()
    layers.init()
    os.makedirs(a.workdir, exist_ok=True)
    if a.model == "demo":
        from colibri.storage.demo import write_demo_model

        src = os.path.join(a.workdir, "demo")
        if not os.path.isfile(os.path.join(src, "config.json")):
            write_demo_model(src)
    elif a.model == "peer":
        import peer

        src = peer.checkpoint(a.workdir, a.layers)
    else:
        src = a.model
    structure = build_model(src, load_config(src))
    plan = ExpertPlan(structure.moe_layers, structure.n_expert, structure.expert_names, None,
                      structure.int_dense_names())
    ckpt = open_checkpoint(src)
    if a.model == "peer":
        import peer
        import synthetic

        texts, seqs = "synthetic recipe", [np.asarray(synthetic.prompt(np.random.default_rng(900 + i), a.window,
                                                                        vocab=peer.SHAPE["vocab_size"]))
                                           for i in range(a.windows)]
    else:
        tok = Tokenizer(src)
        eot = tok.token_id("<|endoftext|>")
        ids = []
        for t in held_out_fortunes(src):
            ids += tok.encode(t, special=False) + ([eot] if eot is not None else [])
        texts, seqs = "held-out fortunes (tools/train_demo.py's split)", windows(ids, a.windows, a.window)
    ref_model = load_model(src)  # the checkpoint as it is: bf16 experts, exact
    conts = {}
    for kind, _, dense in VARIANTS:
        dst = os.path.join(a.workdir, f"{os.path.basename(src.rstrip('/'))}-{kind}-g{a.group_size}-d{dense or 'bf16'}")
        if not os.path.isfile(os.path.join(dst, MANIFEST)):
            convert(ckpt, dst, plan, expert_dtype=kind, group_size=a.group_size, dense_dtype=dense, force=True)
        conts[kind, dense] = dst
    rows = {v: {"kl": [], "agree": [], "nll": []} for v in VARIANTS}
    ref_nll = []
    refs = []
    for seq in seqs:
        lr = log_softmax(ref_model.forward(seq, ref_model.new_cache(len(seq)), all_logits=True).astype(np.float64))
        refs.append(lr)
        ref_nll += list(-lr[np.arange(len(seq) - 1), seq[1:]])
    del ref_model
    for kind, acts, dense in VARIANTS:
        m = load_model(conts[kind, dense], budget="all")
        m.set_activations(acts)
        r = rows[kind, acts, dense]
        for seq, lr in zip(seqs, refs):
            lq = log_softmax(m.forward(seq, m.new_cache(len(seq)), all_logits=True).astype(np.float64))
            r["kl"] += list((np.exp(lr) * (lr - lq)).sum(axis=-1))
            r["agree"] += list(lr.argmax(-1) == lq.argmax(-1))
            r["nll"] += list(-lq[np.arange(len(seq) - 1), seq[1:]])
        del m
    out = {"benchmark": "quality", "model": os.path.abspath(src), "text": texts, "reference": "bf16 experts (exact)",
           "group_size": a.group_size, "n_windows": len(seqs), "window": a.window,
           "n_positions": len(rows[VARIANTS[0]]["agree"]), "reference_loss_nats": round(float(np.mean(ref_nll)), 4),
           "results": [{"experts": k, "activations": acts, "dense_matrices": dense or "bf16",
                        "mean_kl_nats": round(float(np.mean(r["kl"])), 6),
                        "max_kl_nats": round(float(np.max(r["kl"])), 6),
                        "top1_agreement": round(float(np.mean(r["agree"])), 4),
                        "loss_nats": round(float(np.mean(r["nll"])), 4)} for (k, acts, dense), r in rows.items()]}
    sys.stdout.write(provenance.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
