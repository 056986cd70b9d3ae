"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3's layer (MLA, always with interleaved rotary; the
grouped sigmoid MoE) plus DeepSeek Sparse Attention: an indexer picks, for every query,
the `index_topk` cached tokens it may attend to.

The indexer of a "full" layer (`indexer_types`) projects the q_lora residual into
`index_n_heads` small queries, the hidden state into one key (LayerNorm'ed, the first
qk_rope_head_dim dims rotated, interleaved), scores every cached token as the sum over
heads of weight * relu(q . k) and keeps the top `index_topk`; a "shared" layer uses the
previous full layer's choice. While a sequence holds at most `index_topk` tokens every
token is chosen and attention is the dense kernel's; past it, the chosen tokens only.
The cache keeps the indexer's key per token for the full layers beside MLA's latent.
"""

from dataclasses import dataclass

import numpy as np

from .. import kernels
from ..attention import NO_SINKS, attend, deinterleave
from ..layers import linear
from ..model import require
from . import deepseek_v3

MODEL_TYPE = "glm_moe_dsa"
ALIASES = deepseek_v3.ALIASES


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):  # DeepSeek-V3's fields with GLM-5's defaults, and the indexer's
    intermediate_size: int = 12288
    max_position_embeddings: int = 202752
    moe_intermediate_size: int = 2048
    q_lora_rank: int | None = 2048
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int | None = 1
    topk_group: int | None = 1
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: list | None = None
    index_topk_pattern: str | list | None = None  # the older spellings of indexer_types
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    mlp_layer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        self.rope_interleave = True  # GLM-5 rotates interleaved pairs, in attention and indexer alike
        n = self.num_hidden_layers
        self.indexer_types = indexer_types(self)
        if self.mlp_layer_types is None:
            k = min(self.first_k_dense_replace, n)
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        require(self.q_lora_rank is not None, "q_lora_rank must be set (the indexer reads its residual)")
        require(len(self.indexer_types) == n and set(self.indexer_types) <= {"full", "shared"},
                "indexer_types needs one of full or shared per layer")
        require(self.indexer_types[0] == "full", "the first layer's indexer must be full (shared reuses an earlier one)")
        require(len(self.mlp_layer_types) == n and set(self.mlp_layer_types) <= {"dense", "sparse"},
                "mlp_layer_types needs one of dense or sparse per layer")
        require(self.qk_rope_head_dim <= self.index_head_dim, "index_head_dim must hold the rotary dims")


def indexer_types(a) -> list:
    """Each layer's indexer, full or shared: the config's indexer_types, else as transformers
    derives them from the older index_topk_pattern or index_topk_freq and index_skip_topk_offset."""
    if a.indexer_types is not None:
        return a.indexer_types
    p = a.index_topk_pattern
    if p is not None:
        return [{"F": "full", "S": "shared"}[c] for c in p] if isinstance(p, str) else list(p)
    freq = max(a.index_topk_freq, 1)
    return ["full" if max(i - a.index_skip_topk_offset + 1, 0) % freq == 0 else "shared"
            for i in range(a.num_hidden_layers)]


INDEXER = "model.layers.{il}.self_attn.indexer."
NAMES = deepseek_v3.NAMES | {
    "ix_wq_b": INDEXER + "wq_b.weight",
    "ix_wk": INDEXER + "wk.weight",
    "ix_k_norm": INDEXER + "k_norm.weight",
    "ix_k_norm_bias": INDEXER + "k_norm.bias",
    "ix_weights": INDEXER + "weights_proj.weight",
}


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    # x [T, d] f32 -> [T, d]: (x - mean) / sqrt(var + eps) * w + b
    mean = x.mean(-1, keepdims=True, dtype=np.float32)
    var = ((x - mean) ** 2).mean(-1, keepdims=True, dtype=np.float32)
    return ((x - mean) / np.sqrt(var + np.float32(eps)) * w + b).astype(np.float32)


def masked_attention(q: np.ndarray, kv: np.ndarray, n_latent: int, allowed: np.ndarray, scale: float) -> np.ndarray:
    # q [n, H, L] absorbed queries; kv [S, L] cached latent | rotary key; allowed [n, S] bool
    # -> [n, H, latent]: softmax over the allowed keys only, the latent as values
    s = np.einsum("nhl,sl->nhs", q, kv) * np.float32(scale)  # [n, H, S]
    s = np.where(allowed[:, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nhs,sl->nhl", p, kv[:, :n_latent]).astype(np.float32)


class Model(deepseek_v3.Model):
    MODEL_TYPE = MODEL_TYPE
    DECODE_ROWS_EXACT = False  # a sampled token's rows round otherwise than in a prompt (tokens agree)
    NAMES = NAMES
    ATTENTION = "MLA+DSA"
    F32_KEYS = deepseek_v3.Model.F32_KEYS | {"ix_k_norm", "ix_k_norm_bias"}
    INDEXER_ROPE_INTERLEAVED = True  # GLM-5 rotates the indexer's pairs interleaved (DeepSeek-V3.2: halves)

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        super().__init__(args, config, where)
        self.full = [il for il in range(self.n_layer) if args.indexer_types[il] == "full"]
        self.full_rows = {il: i for i, il in enumerate(self.full)}

    def is_moe(self, il: int) -> bool:
        return self.args.mlp_layer_types[il] == "sparse" and self.args.n_routed_experts > 0

    def kv_layout(self):
        # MLA's latent and rotary key per token and layer, and the indexer's key per token for
        # each full layer (full_rows[il] its row; saved without a heads axis)
        shapes, views, _ = super().kv_layout()
        return shapes | {"ik": (len(self.full), 1, self.args.index_head_dim)}, views, frozenset({"ik"})

    def shapes(self):
        a = self.args
        glob, per_layer, per_expert = super().shapes()
        Hi, dI, D = a.index_n_heads, a.index_head_dim, a.hidden_size

        def with_indexer(il):
            s = per_layer(il)
            if a.indexer_types[il] == "full":
                s |= {"ix_wq_b": (Hi * dI, a.q_lora_rank), "ix_wk": (dI, D), "ix_k_norm": (dI,),
                      "ix_k_norm_bias": (dI,), "ix_weights": (Hi, D)}
            return s

        return glob, with_indexer, per_expert

    def attention(self, il, x, step):
        # x [T, D] normed -> [T, D]; the full layers choose each query's keys (step.chosen),
        # the shared ones take the last full layer's choice
        qa, q_resid = self.absorbed_queries(il, x, step)  # [T, H, latent + rope]
        if self.args.indexer_types[il] == "full":
            step.chosen = self.choose(il, x, q_resid, step)
        lat = self.args.kv_lora_rank
        out = np.empty(qa.shape[:2] + (lat,), np.float32)  # [T, H, latent]
        for sg, allowed in zip(step.segments, step.chosen):
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            if allowed is None:  # every cached token chosen: the dense kernel
                attend(qa[rows], cache, il, "k", "v", 0, np.float32(self.attn_spec.scale), NO_SINKS, out[rows])
            else:  # (numpy over the keys gathered in one array)
                out[rows] = masked_attention(qa[rows], cache.gather("k", il, 0, pos0 + sg.n), lat, allowed,
                                             self.attn_spec.scale)
        return self.lift(il, out)

    def choose(self, il, x, q_resid, step) -> list:
        # per sequence: None while it holds at most index_topk tokens (all chosen), else
        # allowed [n, S] bool: each query's top index_topk cached tokens by the indexer's score
        a, L = self.args, self.layers[il]
        T, Hi, dI, rope = x.shape[0], a.index_n_heads, a.index_head_dim, a.qk_rope_head_dim
        q = linear(q_resid, L["ix_wq_b"]).reshape(T, Hi, dI)  # [T, Hi, dI]
        k = layer_norm(linear(x, L["ix_wk"]), L["ix_k_norm"], L["ix_k_norm_bias"], 1e-6)[:, None]  # [T, 1, dI]
        if self.INDEXER_ROPE_INTERLEAVED:  # (q and k alike reordered: their dot products stay)
            q_rot, k_rot = deinterleave(q[..., :rope], rope // 2), deinterleave(k[..., :rope], rope // 2)
        else:
            q_rot, k_rot = q[..., :rope].copy(), k[..., :rope].copy()
        kernels.rope(q_rot, step.cos, step.sin)
        kernels.rope(k_rot, step.cos, step.sin)
        q[..., :rope], k[..., :rope] = q_rot, k_rot
        w = linear(x, L["ix_weights"]) * np.float32(Hi**-0.5)  # [T, Hi]
        chosen = []
        for sg in step.segments:
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            cache.write("ik", self.full_rows[il], pos0, k[rows])  # [n, 1, dI]
            S = pos0 + sg.n
            if S <= a.index_topk:
                chosen.append(None)
                continue
            ik = cache.gather("ik", self.full_rows[il], 0, S)  # [S, dI]
            scores = np.maximum(np.einsum("nhd,sd->nhs", q[rows], ik) * np.float32(dI**-0.5), 0)  # [n, Hi, S]
            index = np.einsum("nh,nhs->ns", w[rows], scores)  # [n, S]
            causal = np.arange(S)[None, :] <= (pos0 + np.arange(sg.n))[:, None]  # [n, S]
            index = np.where(causal, index, -np.inf)
            top = np.argsort(-index, axis=-1, kind="stable")[:, : a.index_topk]  # [n, index_topk]
            allowed = np.zeros((sg.n, S), bool)
            np.put_along_axis(allowed, top, True, axis=-1)
            chosen.append(allowed & causal)
        return chosen
