"""The benchmarks' synthetic model: shaped like Qwen3-30B-A3B (hidden 2048, 32 query / 4
KV heads of 128, expert intermediate 768, 128 experts, top-8, vocabulary 32000), experts
int4 g64, dense bf16, random weights drawn from per-tensor seeds, built once into a
container and kept on disk.

Random weights alone route uniformly: every expert equally popular and consecutive
tokens sharing almost nothing, which no cache policy can learn from. Real MoE routers
are not like that: some experts are hot in every layer, routing follows the token
(frequent tokens make their experts hot) and the topic of the text (nearby tokens
reuse experts). The recipe builds that structure into the residual stream and the
routers, in the open:

- Topics. The vocabulary is split into TOPICS groups (token t is in topic t mod TOPICS).
  Every embedding row is token noise + A * u + B * T[topic], with u one direction
  shared by all tokens and T[k] one direction per topic (all of norm sqrt(hidden)).
  The layers' own outputs are scaled (attention output by ATTN_OUT, expert down by
  EXPERT_OUT) so that the token, its topic and u persist down the residual stream, as
  the token identity does in real models, while each layer still moves it a little.
- Routers. Router row e of layer l = SIGMA_TOKEN * random (the token's own preference)
  + SIGMA_POP * p[l, e] * u (popularity: p a standard normal per layer and expert, so
  a few experts of each layer are hot for every token) + SIGMA_TOPIC * sum_k
  q[l, e, k] * T[k] (topic preference: q standard normal, so each topic has its own
  hot experts), each scaled to give logits of the stated standard deviation.
- Text. The LM head prefers tokens of the current token's topic by STAY logits, and
  inside a topic Zipf-frequent tokens (rank r gets -ZIPF * log(1 + r)), so sampled text
  stays on a topic for a while and repeats frequent tokens. `prompt()` draws prompts
  from the same process (stay on the topic with probability P_STAY, Zipf tokens).

`trace_stats()` in cache_policy.py measures what this gives: the share of routings that
go to each layer's most popular quarter of experts, and the experts consecutive tokens
share.
"""

import json
import os
import shutil
import sys
import time
import zlib

import numpy as np

from colibri.engine.registry import build_model
from colibri.storage.convert import convert, plan_for
from colibri.storage.demo import _tokenizer_json
from colibri.storage.fpformats import QuantConfig
from colibri.storage.quant import QuantWeight, quantized_shapes
from colibri.storage.safetensors import TensorEntry, f32_to_bf16

SHAPE = {
    "model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
    "eos_token_id": None,
}
# the other families' layers as the real models have them (every layer MoE, the same
# vocabulary as above so the embeddings stay small): DeepSeek-V3 / Kimi K2 and GLM-4.5
SHAPES = {
    "qwen3_moe": SHAPE,
    "deepseek_v3": {
        "model_type": "deepseek_v3", "vocab_size": 32000, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "first_k_dense_replace": 0, "norm_topk_prob": True,
        "rope_interleave": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1e4,
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": None,
    },
    "glm4_moe": {
        "model_type": "glm4_moe", "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_routed_experts": 160, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 0, "norm_topk_prob": True, "use_qk_norm": True,
        "attention_bias": True, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": None,
    },
    "qwen3_5_moe": {  # a Qwen3.5-122B-A10B-like hybrid: 3 Gated DeltaNet layers to 1 of attention
        "model_type": "qwen3_5_moe", "vocab_size": 32000, "hidden_size": 3072, "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
        "num_experts": 256, "num_experts_per_tok": 8, "linear_num_key_heads": 16, "linear_num_value_heads": 64,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": None,
    },
    "deepseek_v4": {  # DeepSeek-V4-Flash: 256 experts of 2048, top-6, hyper-connections of 4 streams
        "model_type": "deepseek_v4", "vocab_size": 32000, "hidden_size": 4096, "moe_intermediate_size": 2048,
        "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "n_routed_experts": 256,
        "num_experts_per_tok": 6, "o_groups": 8, "o_lora_rank": 1024, "hc_mult": 4, "sliding_window": 128,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "partial_rotary_factor": 0.125,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": None,
    },
    "qwen4_exp": {  # Qwen3.8-Flash-Next / Qwen4-Exp: 512 experts of 512, top-10, 4 low-rank-mixed streams, QSA,
        # n-gram tables on two layers (8 hashes per order, orders 2 and 3: 16 rows of 128 a token and layer) of
        # 16 x ~500k rows (~2 GB bf16 each: the published model's are tens of billions of parameters)
        "model_type": "qwen4_exp", "vocab_size": 32000, "hidden_size": 2048, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "num_experts": 512, "num_experts_per_tok": 10, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "hc_count": 4,
        "hc_lowrank": 320, "ple_layer_ids": [1, 3], "ple_embed_dim": 2048, "ple_conv_kernel_size": 4, "ngram_size": 3,
        "heads_per_ngram": 8, "ngram_vocab_size_base": 500_000, "indexer_n_heads": 16, "indexer_kv_heads": 1,
        "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10]},
    },
    "gpt_oss": {  # gpt-oss-120b
        "model_type": "gpt_oss", "vocab_size": 32000, "hidden_size": 2880, "intermediate_size": 2880,
        "moe_intermediate_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 150000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": None,
    },
}
GROUP = 64
RECIPE = {"version": 4, "topics": 64, "A": 0.5, "B": 1.0, "attn_out": 0.6, "expert_out": 0.3, "sigma_token": 1.2,
          "sigma_pop": 0.6, "sigma_topic": 0.8, "stay": 6.0, "zipf": 1.0, "p_stay": 0.93}


def _unit_rows(seed: int, n: int, d: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


PRECISIONS = ("int4", "bf16", "fp8_e4m3", "mxfp4")  # the experts' precision: colibri's int4 g64, bf16, or a published one
FP8_BLOCK = (128, 128)


class SyntheticSource:
    """A checkpoint that exists only as a recipe: each tensor drawn from its own seed when
    read; experts handed out already quantized: int4 (random nibbles, small scales), or in a
    published precision as such a checkpoint holds them (`read_weight`: FP8 codes of values
    below 2 with 128 x 128 block scales, MXFP4 random codes with one power-of-two scale)."""

    def __init__(self, path: str, cfg: dict, recipe: dict = RECIPE, precision: str = "int4"):
        self.path, self.config, self.files, self.r = path, cfg, {}, recipe
        self.precision = precision
        self.quant = QuantConfig("fp8", FP8_BLOCK) if precision == "fp8_e4m3" else QuantConfig("mxfp4") \
            if precision == "mxfp4" else None
        model = build_model(path, cfg)
        glob, per_layer, per_expert = model.shapes()
        self.shapes = {model.NAMES[k]: s for k, s in glob.items()}
        for il in range(model.n_layer):
            self.shapes |= {model.NAMES[k].format(il=il): s for k, s in per_layer(il).items()}
            for ie in range(model.n_expert):
                self.shapes |= dict(zip(model.expert_names(il, ie), per_expert.values()))
        self.where = dict.fromkeys(self.shapes, "synthetic")
        self.seeds = {n: zlib.crc32(n.encode()) for n in self.shapes}
        self.model = model
        self.expert_names = {n for il in model.moe_layers for ie in range(model.n_expert) for n in model.expert_names(il, ie)}
        self.routers = {model.NAMES["router"].format(il=il) for il in model.moe_layers}  # the family's router names
        self.tables = set(model.table_names())  # Qwen4-Exp's n-gram tables
        D = cfg["hidden_size"]
        self.u = _unit_rows(1, 1, D)[0]  # [D]
        self.T = _unit_rows(2, recipe["topics"], D)  # [K, D]

    def entry(self, name):
        return TensorEntry(name, "I64" if name.endswith("tid2eid") else "BF16", self.shapes[name], 0, 0)

    def read(self, name):
        shape, r = self.shapes[name], self.r
        rng = np.random.default_rng(self.seeds[name])
        if name.endswith("tid2eid"):  # DeepSeek-V4's hash layers: distinct experts for each token id
            return np.argsort(rng.random((shape[0], self.model.n_expert)), axis=1)[:, : shape[1]].astype(np.int64)
        x = rng.standard_normal(shape, dtype=np.float32) if name not in self.tables else None
        if len(shape) == 1:  # norms around 1; biases and sinks small, as trained ones are
            return f32_to_bf16(0.1 * x if name.endswith(("bias", "sinks")) else 1 + 0.1 * x)
        if name in self.tables:  # an n-gram table: unit rows, drawn a million rows at a time
            out = np.empty(shape, np.uint16)
            for r0 in range(0, shape[0], 1 << 20):
                part = rng.standard_normal((min(1 << 20, shape[0] - r0), shape[1]), dtype=np.float32)
                out[r0 : r0 + len(part)] = f32_to_bf16(part * shape[1] ** -0.5)
            return out
        D = self.config["hidden_size"]
        norm = np.sqrt(1 + r["A"] ** 2 + r["B"] ** 2)  # the embedding's RMS: x = rmsnorm(h) divides by it
        topic = np.arange(self.config["vocab_size"]) % r["topics"]
        if name.endswith("embed_tokens.weight"):  # [V, D]: noise + A u + B T[topic]
            return f32_to_bf16(x + np.sqrt(D) * (r["A"] * self.u + r["B"] * self.T[topic]))
        if name in self.routers:  # router [E, D]
            E = shape[0]
            p = rng.standard_normal(E).astype(np.float32)  # [E] popularity
            q = rng.standard_normal((E, r["topics"])).astype(np.float32)  # [E, K] topic preference
            row = (r["sigma_token"] * x * norm
                   + r["sigma_pop"] * p[:, None] * self.u * norm / r["A"]
                   + r["sigma_topic"] * (q @ self.T) * norm / r["B"])
            return f32_to_bf16(row / np.sqrt(D))
        if name == "lm_head.weight":  # [V, D]: noise + STAY on the topic + Zipf inside it
            rank = np.arange(self.config["vocab_size"]) // r["topics"]
            row = (x + (r["stay"] * self.T[topic] * norm / r["B"]
                        - r["zipf"] * np.log1p(rank)[:, None] * self.u * norm / r["A"]))
            return f32_to_bf16(row / np.sqrt(D))
        scale = shape[-1] ** -0.5
        if name.endswith("o_proj.weight"):
            scale *= r["attn_out"]
        if "down_proj" in name and name in self.expert_names:  # bf16 experts: as the quantized ones
            scale *= r["expert_out"]
        return f32_to_bf16(x * scale)

    def read_quantized(self, name, kind, group):
        shape = self.shapes[name]
        qshape, sshape = quantized_shapes(kind, shape, group)
        rng = np.random.default_rng(self.seeds[name])
        q = np.frombuffer(rng.bytes(int(np.prod(qshape))), np.uint8).reshape(qshape)
        scale = shape[-1] ** -0.5 / 4.6  # std of a uniform nibble is ~4.6
        if "down_proj" in name:
            scale *= self.r["expert_out"]
        return QuantWeight(kind, q, np.full(sshape, np.float16(scale), np.float16), group)


    def read_weight(self, name):
        if self.precision in ("int4", "bf16") or name not in self.expert_names:
            return self.read(name)
        n, d = self.shapes[name]
        rng = np.random.default_rng(self.seeds[name])
        scale = d ** -0.5 * (self.r["expert_out"] if "down_proj" in name else 1.0)
        if self.precision == "fp8_e4m3":  # codes of 2 ** -6 <= |v| < 2 (exponent field 1, 3, 5, 7): RMS ~0.6;
            # none subnormal, as in real checkpoints (one in ~10^4), which the CPU multiplies slowly
            q = np.frombuffer(rng.bytes(n * d), np.uint8).reshape(n, d) & np.uint8(0xBF) | np.uint8(0x08)
            bn, bk = FP8_BLOCK
            return QuantWeight("fp8_e4m3", q, np.full((-(-n // bn), -(-d // bk)), scale / 0.6, np.float32), bk, bn)
        q = np.frombuffer(rng.bytes(n * d // 2), np.uint8).reshape(n, d // 2)  # e2m1 codes: RMS ~3.1
        e = np.uint8(127 + round(np.log2(scale / 3.1)))
        return QuantWeight("mxfp4", q, np.full((n, d // 32), e, np.uint8), 32)


def prompt(rng: np.random.Generator, n: int, recipe: dict = RECIPE, vocab: int = SHAPE["vocab_size"]) -> list[int]:
    """n token ids drawn like the model's own text: a topic kept with probability p_stay,
    Zipf-frequent tokens inside it."""
    K = recipe["topics"]
    per_topic = vocab // K
    w = np.exp(-recipe["zipf"] * np.log1p(np.arange(per_topic)))
    w /= w.sum()
    out, k = [], int(rng.integers(K))
    for _ in range(n):
        if rng.random() > recipe["p_stay"]:
            k = int(rng.integers(K))
        out.append(int(rng.choice(per_topic, p=w)) * K + k)
    return out


def build(workdir: str, expert_gb: float, n_layer: int | None = None, family: str = "qwen3_moe",
          precision: str = "int4", overrides: dict | None = None, dense_dtype: str | None = None) -> str:
    """The container's path, built into workdir unless it is there already: as many
    layers as give `expert_gb` of experts and fit in half the free disk (or n_layer), in
    the shape SHAPES[family] says (with `overrides` of its config), the experts in
    `precision` (PRECISIONS), the dense matrices the family computes by linear() in
    `dense_dtype` (int8, int4: convert --dense-dtype, lossy; None: as built, bf16)."""
    shape = SHAPES[family] | (overrides or {})
    n_expert = shape.get("num_experts") or shape.get("num_local_experts") or shape["n_routed_experts"]
    D, I = shape["hidden_size"], shape["moe_intermediate_size"]
    per_weight = {"int4": 0.5 + 2 / GROUP, "bf16": 2, "fp8_e4m3": 1 + 4 / 128 ** 2, "mxfp4": 0.5 + 1 / 32}[precision]
    one_layer = int(n_expert * 3 * I * D * per_weight)
    if n_layer is None:
        free = shutil.disk_usage(workdir).free
        n_layer = int(max(1, min(expert_gb * 1e9 // one_layer + 1, free * 0.5 // (one_layer * 1.15))))
    name = "qwen3-30b-a3b" if family == "qwen3_moe" else family
    if overrides:
        name += "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = os.path.join(workdir, f"{name}-shaped-{precision}{'-d' + dense_dtype if dense_dtype else ''}-{n_layer}l")
    cfg = shape | {"num_hidden_layers": n_layer}
    if family == "deepseek_v4" and "layer_types" not in cfg:  # every kind of layer in a few: a sliding one,
        # then compressed sparse and heavily compressed in turn; hash routing on the first layers, one moe at least
        cfg["layer_types"] = ["sliding_attention"] + ["compressed_sparse_attention" if i % 2 == 0
                                                      else "heavily_compressed_attention" for i in range(n_layer - 1)]
        cfg["mlp_layer_types"] = ["hash_moe"] * min(3, n_layer - 1) + ["moe"] * (n_layer - min(3, n_layer - 1))
    stamp = os.path.join(path, "bench-config.json")
    if os.path.isfile(stamp) and json.load(open(stamp)) == cfg | {"recipe": RECIPE}:
        return path
    src = os.path.join(workdir, "synthetic-src")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(src, "tokenizer.json"), "w") as f:
        f.write(_tokenizer_json())
    synth = SyntheticSource(src, cfg, precision=precision)
    plan = plan_for(synth.model)
    t0 = time.perf_counter()
    print(f"building {n_layer} layers ({n_layer * one_layer / 1e9:.1f} GB of experts) in {path}", file=sys.stderr)
    convert(synth, path, plan, expert_dtype="int4" if precision == "int4" else None,
            group_size=GROUP if precision == "int4" else None, force=True, dense_dtype=dense_dtype,
            progress=lambda d, t: print(f"\r{d}/{t}", end="", file=sys.stderr) if d % 512 == 0 else None)
    with open(stamp, "w") as f:
        json.dump(cfg | {"recipe": RECIPE}, f)
    print(f"\nbuilt in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def load_model(path, **placement):
    """The model at `path` placed as `placement` says (storage.placement.Placement's fields)."""
    from colibri.storage.placement import Placement, open_model

    return open_model(str(path), Placement(**placement), build_model).model
