"""GLM-5.3-Flash (`glm5_next`, its text model `glm5_next_text`): Kimi Linear's hybrid
(kimi_linear.py: KDA layers with a recurrent state between MLA layers without rotary) with
three changes, and the residual as DeepSeek-V4's hyper-connections.

- KDA's forget gate has a lower bound (`linear_lower_bound`: decay = bound x sigmoid(exp(A_log)
  x (f + dt_bias)) per key channel; None: Kimi's -exp(A_log) x softplus(f + dt_bias)).
- The MLA layers (`indexed_attention`) attend to the tokens a DeepSeek Sparse Attention
  indexer picks, by pools of `index_kpool` tokens: a pool's key is the softmax (over its
  tokens, per channel, of a gate projection plus a learned bias per slot) mix of its tokens'
  LayerNorm'ed indexer keys; a query scores each complete pool it sees as the sum over heads
  of weight x relu(q . key / sqrt(d)), keeps the best `index_topk / index_kpool` pools and
  with `index_kpool_always_select_tail` the tokens after the last complete pool. A "shared"
  layer (`indexer_types`) reuses the layer before's choice.
- SwiGLU everywhere (dense layers, shared and routed experts) clamps its gate above and its
  up projection both ways at `swiglu_limit`.

The residual is `hc_mult` streams, collapsed before each half of a layer and spread back
after it with a Sinkhorn-normalised mix (deepseek_v4.sinkhorn_weights, the same
arithmetic); the last layer's streams are averaged. The hub ships the image-text model: the
text model's weights under `model.language_model.*`, the output head `lm_head.weight`, the
vision tower (`model.visual.*`) never read. A sequence keeps the KDA layers' states, the MLA
layers' latents, and per token the full indexers' keys and pool gates."""

from dataclasses import dataclass
from functools import partial

import numba as nb
import numpy as np

from ..attention import chosen_attention
from ..jit import JIT, family_warm
from ..layers import embed_rows, linear, rmsnorm
from ..model import require, text_config, wrapped_names
from ..moe import moe
from ..recurrent import sigmoid
from . import deepseek_v3, glm_moe_dsa, kimi_linear
from .deepseek_v4 import clamped_swiglu, sinkhorn_weights

MODEL_TYPE = "glm5_next"
ALIASES = {"n_routed_experts": ("num_local_experts",)}
LINEAR, INDEXED = "linear_attention", "indexed_attention"


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int | None = 1
    topk_group: int | None = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    mlp_layer_types: list | None = None
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    layer_types: list | None = None
    indexer_types: list | None = None
    index_topk_pattern: str | list | None = None  # the older spellings of indexer_types
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    linear_attn_config: dict | None = None  # (the hub's spelling of the linear_* fields)
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope_interleave = False  # (not fields: what the MLA and KDA code it reuses reads)
    gguf_layout = False
    first_k_dense_replace = 0

    def __post_init__(self):
        n = self.num_hidden_layers
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.mlp_layer_types is None:  # as transformers derives them
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0)
        if self.layer_types is None:
            self.layer_types = [LINEAR if il % 4 != 3 else INDEXED for il in range(n)]
        self.indexer_types = glm_moe_dsa.indexer_types(self)
        lac = self.linear_attn_config or {}
        self.linear_head_dim = lac.get("head_dim", self.linear_head_dim)
        self.linear_num_heads = lac.get("num_heads", self.linear_num_heads)
        self.linear_conv_kernel_dim = lac.get("short_conv_kernel_size", self.linear_conv_kernel_dim)
        if "gate_lower_bound" in lac:
            self.linear_lower_bound = lac["gate_lower_bound"]
        if lac.get("safe_gate", False) and self.linear_lower_bound is None:
            self.linear_lower_bound = -5.0
        types = self.layer_types = [INDEXED if t == "full_attention" else t for t in self.layer_types]  # (as transformers)
        require(len(types) == n and set(types) <= {LINEAR, INDEXED},
                "layer_types needs one of linear_attention or indexed_attention per layer")
        require(len(self.mlp_layer_types) == n and set(self.mlp_layer_types) <= {"dense", "sparse"},
                "mlp_layer_types needs one of dense or sparse per layer")
        require(len(self.indexer_types) == n and set(self.indexer_types) <= {"full", "shared"},
                "indexer_types needs one of full or shared per layer")
        for il, t in enumerate(types):  # (transformers hands a shared layer the choice of the layer before only)
            require(t != INDEXED or self.indexer_types[il] == "full" or (
                il > 0 and types[il - 1] == INDEXED and self.indexer_types[il - 1] == "full"),
                    "a shared indexer's layer must follow an indexed layer with a full indexer")
        require(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads must be num_attention_heads")
        require(self.q_lora_rank is not None, "q_lora_rank must be set (the indexer reads its residual)")
        require(self.qk_rope_head_dim == 0, "GLM-5.3-Flash's MLA has no rotary (qk_rope_head_dim 0)")
        require(self.index_kpool >= 1 and self.index_topk % self.index_kpool == 0,
                "index_topk must be a multiple of a positive index_kpool")
        require(self.hc_mult >= 1, "hc_mult must be positive")
        deepseek_v3.check_grouped_moe(self)


TEXT = {  # the text model's names (transformers' Glm5NextTextModel), before the image-text prefix
    **{k: v.replace("block_sparse_moe", "mlp") for k, v in kimi_linear.NAMES.items()},
    **{k: v for k, v in glm_moe_dsa.NAMES.items() if k.startswith("ix_")},
    "ix_ape": glm_moe_dsa.INDEXER + "index_kpool_compress_ape",
    "ix_gate": glm_moe_dsa.INDEXER + "index_kpool_compress_gate",
    "expert_gate": "model.layers.{il}.mlp.experts.{ie}.gate_proj.weight",
    "expert_up": "model.layers.{il}.mlp.experts.{ie}.up_proj.weight",
    "expert_down": "model.layers.{il}.mlp.experts.{ie}.down_proj.weight",
    **{f"hc_{h}_{p}": f"model.layers.{{il}}.hc_{h}_{p}" for h in ("attn", "ffn") for p in ("fn", "base", "scale")},
}
NAMES = wrapped_names(TEXT, {"model.": "model.language_model."})


@nb.njit(**JIT)
def pool_scores(q, keys, w, scale, out):
    # q [n, H, d] a sequence's rows' indexer queries, keys [M, d] its pools' keys, w [n, H] the
    # heads' weights -> out [n, M]: sum over heads of w x relu(q . key x scale), each row alone
    # (its bits the same whichever rows share its step)
    n, H, d = q.shape
    for t in range(n):
        for m in range(keys.shape[0]):
            total = np.float32(0.0)
            for h in range(H):
                acc = np.float32(0.0)
                for j in range(d):
                    acc += q[t, h, j] * keys[m, j]
                total += w[t, h] * max(acc * scale, np.float32(0.0))
            out[t, m] = total


@family_warm("glm5_next")
def warm() -> None:
    # pool_scores on tiny C arrays, as the indexer calls it
    pool_scores(np.ones((2, 2, 4), np.float32), np.ones((3, 4), np.float32), np.ones((2, 2), np.float32),
                np.float32(0.5), np.empty((2, 3), np.float32))


class Model(kimi_linear.Model):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    ATTENTION = "hybrid: KDA + MLA with pooled sparse attention (NoPE), hyper-connections"
    F32_KEYS = kimi_linear.Model.F32_KEYS | {"ix_k_norm", "ix_k_norm_bias", "ix_ape", "hc_attn_fn", "hc_attn_base",
                                             "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"}
    CREW_EXPERTS = False  # its clamped SwiGLU runs expert by expert (moe's ffn): not the integer job
    KERNEL_GROUPS = ("recurrent", "chosen", "glm5_next")
    FULL = INDEXED

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        args.tie_word_embeddings = bool(config.get("tie_word_embeddings", args.tie_word_embeddings))
        super().__init__(args, text_config(config), where)
        self.full = [il for il in range(self.n_layer)  # the layers whose indexer runs: their rows in "ik", "ig"
                     if args.layer_types[il] == INDEXED and args.indexer_types[il] == "full"]
        self.full_rows = {il: i for i, il in enumerate(self.full)}

    def spell(self, store) -> None:
        # the text model alone (Glm5NextTextModel's names) or inside the image-text model
        if not store.has(NAMES["norm"]) and store.has(TEXT["norm"]):
            self.NAMES = TEXT

    def is_moe(self, il: int) -> bool:
        return self.args.mlp_layer_types[il] == "sparse" and self.args.n_routed_experts > 0

    def kv_layout(self):
        shapes, views, _ = super().kv_layout()
        if self.full:  # per token, each full indexer's key and pool gate (saved without a heads axis)
            dI = self.args.index_head_dim
            shapes |= {"ik": (len(self.full), 1, dI), "ig": (len(self.full), 1, dI)}
        return shapes, views, frozenset({"ik", "ig"})

    def shapes(self):
        a = self.args
        glob, per_layer, expert = super().shapes()
        D, n, Hi, dI = a.hidden_size, a.hc_mult, a.index_n_heads, a.index_head_dim

        def layer(il):
            s = per_layer(il) | {f"hc_{h}_fn": ((2 + n) * n, n * D) for h in ("attn", "ffn")} | \
                {f"hc_{h}_base": ((2 + n) * n,) for h in ("attn", "ffn")} | {f"hc_{h}_scale": (3,) for h in ("attn", "ffn")}
            if "A_log" in s:  # (GLM's is [H]; Kimi Linear's [1, 1, H, 1])
                s["A_log"] = (a.linear_num_heads,)
            if a.layer_types[il] == INDEXED and a.indexer_types[il] == "full":
                s |= {"ix_wq_b": (Hi * dI, a.q_lora_rank), "ix_wk": (dI, D), "ix_k_norm": (dI,),
                      "ix_k_norm_bias": (dI,), "ix_weights": (Hi, D), "ix_ape": (a.index_kpool, dI),
                      "ix_gate": (dI, D)}
            return s

        return glob, layer, expert

    # ---- the residual streams ----
    def embed(self, ids):
        h = embed_rows(self.glob["embed"], ids)  # [T, D]
        return np.ascontiguousarray(np.repeat(h[:, None, :], self.args.hc_mult, axis=1))  # [T, n, D]

    def head_input(self, h):
        return h.mean(1, dtype=np.float32)  # [R, D]: the streams averaged

    def block(self, il, h, step):
        # h [T, n, D] streams -> [T, n, D]
        a, L = self.args, self.layers[il]
        pre, post, comb = sinkhorn_weights(h, L["hc_attn_fn"], L["hc_attn_base"], L["hc_attn_scale"], a)
        x = rmsnorm((pre[:, :, None] * h).sum(1, dtype=np.float32), L["in_norm"], a.rms_norm_eps)
        out = self.attention(il, x, step) if a.layer_types[il] == INDEXED else self.kda(L, x, step, il)
        h = post[:, :, None] * out[:, None, :] + (comb[..., None] * h[:, :, None]).sum(1, dtype=np.float32)
        pre, post, comb = sinkhorn_weights(h, L["hc_ffn_fn"], L["hc_ffn_base"], L["hc_ffn_scale"], a)
        x = rmsnorm((pre[:, :, None] * h).sum(1, dtype=np.float32), L["post_norm"], a.rms_norm_eps)
        out = self.mlp(il, x, step)
        return (post[:, :, None] * out[:, None, :] + (comb[..., None] * h[:, :, None]).sum(1, dtype=np.float32)
                ).astype(np.float32)

    def moe_input(self, il, h):
        # the lookahead's guess at layer il's MoE input: its feed-forward collapse of the
        # streams as they are before the layer (the real one follows its attention)
        a, L = self.args, self.layers[il]
        pre, _, _ = sinkhorn_weights(h, L["hc_ffn_fn"], L["hc_ffn_base"], L["hc_ffn_scale"], a)
        return rmsnorm((pre[:, :, None] * h).sum(1, dtype=np.float32), L["post_norm"], a.rms_norm_eps)

    # ---- the halves ----
    def decay(self, L, f):
        # f [T, H, d] forget-gate logits (dt_bias added) -> the log decay per key channel
        a = self.args
        if a.linear_lower_bound is None:
            return super().decay(L, f)
        rate = np.exp(L["A_log"])[None, :, None]  # [1, H, 1]
        return (np.float32(a.linear_lower_bound) * sigmoid(rate * f)).astype(np.float32)

    def mlp(self, il, x, step):
        # x [T, D] normed -> [T, D]: the clamped SwiGLU of a dense layer, or routed + shared experts
        a, L = self.args, self.layers[il]
        if not self.is_moe(il):
            return clamped_swiglu(a.swiglu_limit, x, (L["gate"], L["up"], L["down"]))
        ids, w = self.router(il, x)  # [T, A]
        out = moe(x, ids, w, self.experts, il, step, ffn=partial(clamped_swiglu, a.swiglu_limit))
        if a.n_shared_experts:
            out = out + clamped_swiglu(a.swiglu_limit, x, (L["shared_gate_proj"], L["shared_up"], L["shared_down"]))
        return out

    def attention(self, il, x, step):
        # x [T, D] normed -> [T, D]: MLA over the tokens the layer's (or the layer before's) indexer chose
        qa, q_resid = self.absorbed_queries(il, x, step)  # [T, H, latent]
        if self.args.indexer_types[il] == "full":
            step.chosen = self.choose(il, x, q_resid, step)
        lat = self.args.kv_lora_rank
        out = np.empty(qa.shape[:2] + (lat,), np.float32)  # [T, H, latent]
        for sg, allowed in zip(step.segments, step.chosen):
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            kv = cache.gather("k", self.kv_row(il), 0, pos0 + sg.n)[:, None]  # [S, 1, latent + rope]
            chosen_attention(np.ascontiguousarray(qa[rows]), kv, np.ascontiguousarray(kv[..., :lat]), allowed,
                             np.float32(self.attn_spec.scale), out[rows])
        return self.lift(il, out)

    def choose(self, il, x, q_resid, step) -> list:
        # per sequence, allowed [n, S] bool: each query's tokens of its best complete pools
        # (the pools whose last token it sees), and the tokens after the last one
        a, L = self.args, self.layers[il]
        T, Hi, dI, P = x.shape[0], a.index_n_heads, a.index_head_dim, a.index_kpool
        q = np.ascontiguousarray(linear(q_resid, L["ix_wq_b"]).reshape(T, Hi, dI))  # [T, Hi, dI]
        k = glm_moe_dsa.layer_norm(linear(x, L["ix_wk"]), L["ix_k_norm"], L["ix_k_norm_bias"], 1e-6)  # [T, dI]
        gate = linear(x, L["ix_gate"])  # [T, dI]
        w = np.ascontiguousarray(linear(x, L["ix_weights"]) * np.float32(Hi**-0.5))  # [T, Hi]
        row, chosen = self.full_rows[il], []
        for sg in step.segments:
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            cache.write("ik", row, pos0, k[rows, None])
            cache.write("ig", row, pos0, gate[rows, None])
            S = pos0 + sg.n
            M = S // P  # the complete pools
            if M:
                keys = cache.gather("ik", row, 0, M * P).reshape(M, P, dI)
                logits = cache.gather("ig", row, 0, M * P).reshape(M, P, dI) + L["ix_ape"]
            else:
                keys = logits = np.zeros((0, P, dI), np.float32)
            p = np.exp(logits - logits.max(1, keepdims=True))
            pooled = np.ascontiguousarray((p / p.sum(1, keepdims=True) * keys).sum(1, dtype=np.float32))  # [M, dI]
            scores = np.empty((sg.n, M), np.float32)
            pool_scores(q[rows], pooled, w[rows], np.float32(dI**-0.5), scores)
            pos = pos0 + np.arange(sg.n)  # [n]
            seen = (np.arange(M)[None, :] + 1) * P - 1 <= pos[:, None]  # [n, M]: the pools a query sees
            scores = np.where(seen, scores, -np.inf)
            top = np.argsort(-scores, axis=-1, kind="stable")[:, : a.index_topk // P]  # [n, pools kept]
            picked = np.zeros((sg.n, M), bool)
            np.put_along_axis(picked, top, True, axis=-1)
            allowed = np.repeat(picked & seen, P, axis=1)  # [n, M P]
            allowed = np.concatenate([allowed, np.zeros((sg.n, S - M * P), bool)], axis=1)  # [n, S]
            if a.index_kpool_always_select_tail:  # the tokens after a query's last complete pool
                tok = np.arange(S)[None, :]
                allowed |= (tok >= (pos[:, None] + 1) // P * P) & (tok <= pos[:, None])
            chosen.append(allowed)
        return chosen
