"""Train colibri's built-in demo model: a tiny qwen3_moe that writes English.

    python tools/train_demo.py [--steps 2000] [--seed 20261201] [--out storage/demo_model]

A development tool (it needs torch and transformers, the test dependencies); colibri
never runs it: the weights it writes are shipped in the repository and copied by
`colictl demo-model` and the daemon's first start.

Corpus: the fortune cookies of Debian's `fortunes` package (/usr/share/games/fortunes,
`apt-get install fortunes`), BSD licensed (Ken Arnold's BSD fortune(6) and its data files;
see /usr/share/doc/fortunes/copyright). The files that are not English prose (ASCII art,
the translation exercises, Zippy's non sequiturs) and those whose jokes are about groups of
people (ethnic, men-women) or drugs are left out. The fortunes are shuffled with the seed;
5 % are held out for the held-out loss and the routing statistics.

Model: Qwen3MoeForCausalLM (transformers' own class, so the names and semantics are the
reference's), 4 layers, hidden 256, 8 query and 2 key/value heads of 32, 16 experts of 64
per layer (every matrix row a multiple of 64, so `colictl convert --dtype int4` works with
its default groups), top-4 with normalised weights, tied embeddings, its own byte-level
BPE of 2048 tokens with ChatML specials; about 4.3 M parameters, written as bf16 (about
8.7 MB).
Trained with AdamW on 16 x 128-token windows, the router's load-balancing loss on (as the
family's own training does), float32, 2 torch threads.

Writes the checkpoint to --out and `training.json` next to it: the corpus and its licence,
the exact command, seed, steps, the loss curve, the final held-out loss (of the bf16
weights as shipped), the routing statistics and the sha256 of model.safetensors.
"""

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time

# the same ChatML specials and chat template as storage/demo.py's random models
from colibri.storage.demo import CHAT_TEMPLATE, SPECIALS

CORPUS_DIR = "/usr/share/games/fortunes"
LEFT_OUT = {"ascii-art", "translate-me", "zippy", "ethnic", "men-women", "drugs"}
DESCRIPTION = ("colibri's built-in demo: a tiny mixture-of-experts model (4.3 M parameters) trained on fortune "
               "cookies to show streaming experts; not a useful assistant")


def read_corpus() -> tuple[list[str], list[str]]:
    names = sorted(n for n in os.listdir(CORPUS_DIR) if "." not in n and n not in LEFT_OUT)
    if not names:
        sys.exit(f"no fortunes in {CORPUS_DIR}: apt-get install fortunes")
    texts = []
    for n in names:
        with open(os.path.join(CORPUS_DIR, n), encoding="utf-8", errors="replace") as f:
            texts += [t.strip() for t in f.read().split("\n%\n")]
    return names, sorted({t for t in texts if t})


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def routing_stats(model, seqs, n_expert: int, top_k: int) -> dict:
    """What the cache can learn from: the share of routings the most used quarter of each
    layer's experts takes, the share of a token's experts its predecessor also chose (same
    layer), and how well layer l+1's router applied to layer l+1's input (before its
    attention, as colibri's lookahead does) predicts layer l+1's choice."""
    import torch

    counts, reuse, ahead = None, [], []
    with torch.no_grad():
        for ids in seqs:
            out = model(input_ids=torch.tensor([ids]), output_router_logits=True, output_hidden_states=True)
            chosen = [logits.topk(top_k, dim=-1).indices for logits in out.router_logits]  # [L] of [T, k]
            if counts is None:
                counts = torch.zeros(len(chosen), n_expert)
            for il, c in enumerate(chosen):
                counts[il] += torch.bincount(c.flatten(), minlength=n_expert)
                for t in range(1, c.shape[0]):
                    reuse.append(len(set(c[t].tolist()) & set(c[t - 1].tolist())) / top_k)
            for il in range(1, len(chosen)):
                layer = model.model.layers[il]
                h = layer.post_attention_layernorm(out.hidden_states[il][0])
                guess = (h @ layer.mlp.gate.weight.T).topk(top_k, dim=-1).indices
                ahead += [len(set(g.tolist()) & set(a.tolist())) / top_k for g, a in zip(guess, chosen[il])]
    top = counts.sort(dim=1, descending=True).values
    quarter = (top[:, : n_expert // 4].sum(1) / top.sum(1)).mean().item()
    return {"top_quarter_share": round(quarter, 3), "uniform_top_quarter_share": 0.25,
            "consecutive_reuse": round(sum(reuse) / len(reuse), 3),
            "uniform_consecutive_reuse": round(top_k / n_expert, 3),
            "lookahead_precision": round(sum(ahead) / len(ahead), 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "storage", "demo_model"))
    a = ap.parse_args(argv)

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    names, texts = read_corpus()
    rng.shuffle(texts)
    n_held = len(texts) // 20
    held, train = texts[:n_held], texts[n_held:]
    tok = train_tokenizer(train, 2048)
    eot = tok.token_to_id("<|endoftext|>")

    def stream(items):
        ids = []
        for t in items:
            ids += tok.encode(t).ids + [eot]
        return ids

    train_ids, held_ids = stream(train), stream(held)
    cfg = Qwen3MoeConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
                         moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         rms_norm_eps=1e-6, router_aux_loss_coef=0.01, output_router_logits=True,
                         bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=eot)
    model = Qwen3MoeForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(a.steps // 20, 1)

    def lr_at(step):  # linear warm-up, then cosine to a tenth
        if step < warm:
            return a.lr * (step + 1) / warm
        p = (step - warm) / max(a.steps - warm, 1)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    def held_loss() -> float:
        model.eval()
        total, n = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(held_ids) - a.seq - 1, a.seq):
                x = torch.tensor([held_ids[i : i + a.seq + 1]])
                out = model(input_ids=x[:, :-1], labels=x[:, :-1], output_router_logits=False)
                total, n = total + out.loss.item(), n + 1
        model.train()
        return total / n

    curve, t0 = [], time.time()
    model.train()
    for step in range(a.steps):
        starts = [rng.randrange(0, len(train_ids) - a.seq - 1) for _ in range(a.batch)]
        x = torch.tensor([train_ids[s : s + a.seq] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == a.steps - 1:
            point = {"step": step, "loss": round(out.loss.item(), 4), "s": round(time.time() - t0, 1)}
            if step % 250 == 0 or step == a.steps - 1:
                point["held_out_loss"] = round(held_loss(), 4)
            curve.append(point)
            print(json.dumps(point), flush=True)

    model = model.to(torch.bfloat16).float()  # what is shipped: the bf16 weights
    final = held_loss()
    model.eval()
    seqs = [held_ids[i : i + a.seq] for i in range(0, min(len(held_ids), 64 * a.seq), a.seq)]
    stats = routing_stats(model, seqs, cfg.num_experts, cfg.num_experts_per_tok)
    out_dir = os.path.abspath(a.out)
    os.makedirs(out_dir, exist_ok=True)
    model.config.output_router_logits = False
    model.config.colibri_demo = DESCRIPTION
    model.to(torch.bfloat16).save_pretrained(out_dir)
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "chat_template": CHAT_TEMPLATE, "model_max_length": cfg.max_position_embeddings}, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"), eot], "do_sample": False}, f, indent=2)
    with open(os.path.join(out_dir, "model.safetensors"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    log = {"description": DESCRIPTION, "command": "python tools/train_demo.py " + " ".join(argv or sys.argv[1:]),
           "corpus": {"source": f"Debian package fortunes, {CORPUS_DIR}", "licence": "BSD (see "
                      "/usr/share/doc/fortunes/copyright)", "files": names, "left_out": sorted(LEFT_OUT),
                      "fortunes": len(texts), "held_out_fortunes": n_held, "train_tokens": len(train_ids),
                      "held_out_tokens": len(held_ids)},
           "seed": a.seed, "steps": a.steps, "batch": a.batch, "seq": a.seq, "lr": a.lr, "parameters": n_params,
           "torch": torch.__version__, "loss_curve": curve, "final_held_out_loss": round(final, 4),
           "routing": stats, "train_s": round(time.time() - t0, 1),
           "model_safetensors_sha256": digest}
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(json.dumps({k: log[k] for k in ("final_held_out_loss", "routing", "model_safetensors_sha256")}))


if __name__ == "__main__":
    main()
