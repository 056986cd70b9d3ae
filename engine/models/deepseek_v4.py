"""DeepSeek-V4 (`deepseek_v4`; V4-Flash, V4-Pro).

Attention by `layer_types`: every layer attends to its last `sliding_window` tokens; a
`compressed_sparse_attention` (CSA) layer also to compressed entries, one per
`compress_rates[CSA]` tokens, of which a lightning indexer picks the top `index_topk`
per query; a `heavily_compressed_attention` (HCA) layer to every compressed entry, one per
`compress_rates[HCA]` tokens. One shared key/value head of `head_dim` (K = V) with a
learned sink per query head, queries through `q_lora_rank` (then RMS-normed per head
without a weight), RoPE on each head's last `rope_dim` dims as interleaved pairs (`main`
rope on sliding layers, `compress` rope, base `compress_rope_theta`, on the others),
undone on the output's rotated dims at the query's position, and the grouped low-rank
output projection (`o_groups`, `o_lora_rank`).

A compressed entry is a softmax-gated sum over its window of the compressor's per-token
projections (plus a learned bias per window slot), RMS-normed, rotated at the window's
first position. CSA's windows overlap: entry w mixes the first half of window w-1's
projection with the second half of window w's (over 2 x rate slots). The indexer keeps its
own, smaller compressed keys the same way and scores an entry as the sum over its heads of
weight x relu(q . k).

The residual stream is `hc_mult` streams (hyper-connections): before each half of a layer,
weights from the flattened, normed streams collapse them into the half's input
(`pre`), and after it the output is spread back (`post`) onto the streams mixed by a
Sinkhorn-normalised matrix (`comb`); the last layer's streams are collapsed by `hc_head`.

MoE by `mlp_layer_types`: `hash_moe` layers take the experts the checkpoint's frozen
`tid2eid` table gives the token id, `moe` layers the top-k of score + bias; either weighs
them by the scores (`scoring_func`: sqrtsoftplus, softmax or sigmoid) renormalised, times
`routed_scaling_factor`, whatever `norm_topk_prob` says (as transformers); one shared
expert; SwiGLU with the gate clamped above and the up projection clamped both ways at
`swiglu_limit`. (transformers cannot run `softmax` scoring: its activation table has no
such entry; colibri's is the softmax over the experts.)

A sequence keeps what V4's own cache keeps, so a long context takes little memory: as a
fixed-size state (state_layout), every layer's last `sliding_window` keys, the compressors'
projections of the positions not yet in a closed entry and each compressed layer's last
closed entry; in the KV pool, per token, a piece (head_dim / rate) of a closed entry:
entry w is cut in `rate` pieces written into the rows of window w + 1's tokens, each at its
own step, so rows never change once written and the prefix cache shares them as any
model's. With a state, a request resumes from the prefix cache at a state snapshot (as
the hybrids do), and sessions save it. The entries are gathered back from the pieces once
per sequence and kept beside it (`V4Cache`) as more close. The checkpoint's MTP layer is
never read.
"""

from dataclasses import dataclass
from functools import partial

import numpy as np

from ...storage.errors import ConfigInvalid
from ...storage.experts import QuantWeight, dequantize
from ..attention import AttnSpec
from ..layers import embed_rows, linear, rmsnorm
from ..model import MoEModel, check_moe_args, require
from ..moe import moe, softmax
from ..recurrent import sigmoid, softplus
from ..rope import Rope, rope_inv_freq

MODEL_TYPE = "deepseek_v4"
ALIASES = {"n_routed_experts": ("num_local_experts",)}
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy `compress_ratios` per layer
SCORES = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    moe_intermediate_size: int = 2048
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True  # (transformers renormalises the chosen scores whatever it says)
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    layer_types: list | None = None
    compress_rates: dict | None = None
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: list | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    partial_rotary_factor: float | None = None
    # the older spellings transformers folds in
    compress_ratios: list | None = None
    compress_rate_csa: int | None = None
    compress_rate_hca: int | None = None
    num_hash_layers: int | None = None
    qk_rope_head_dim: int | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        rates = dict(self.compress_rates or {CSA: 4, HCA: 128})
        if self.compress_rate_csa is not None:
            rates[CSA] = self.compress_rate_csa
        if self.compress_rate_hca is not None:
            rates[HCA] = self.compress_rate_hca
        self.compress_rates = rates
        # lists given as such must have one entry a layer (transformers validates them first); the
        # older compress_ratios may also list the MTP layer: cut to the layers, as transformers does
        require(self.layer_types is None or len(self.layer_types) == n, "layer_types needs one entry per layer")
        require(self.mlp_layer_types is None or len(self.mlp_layer_types) == n,
                "mlp_layer_types needs one entry per layer")
        if self.layer_types is None and self.compress_ratios is not None:
            require(set(self.compress_ratios) <= set(RATIO_TYPES), "compress_ratios entries must be 0, 4 or 128")
            self.layer_types = [RATIO_TYPES[r] for r in self.compress_ratios]
        if self.layer_types is None:  # transformers' default: two HCA layers, then CSA and HCA in turn
            self.layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        self.layer_types = list(self.layer_types[:n])
        if self.mlp_layer_types is None:
            k = 3 if self.num_hash_layers is None else self.num_hash_layers
            self.mlp_layer_types = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
        self.mlp_layer_types = list(self.mlp_layer_types[:n])
        if self.partial_rotary_factor is None:
            self.partial_rotary_factor = (self.qk_rope_head_dim / self.head_dim if self.qk_rope_head_dim is not None
                                          else 64 / 512)
        self.rope_dim = self.qk_rope_head_dim = int(self.head_dim * self.partial_rotary_factor)  # (as transformers)
        require(len(self.layer_types) == n and set(self.layer_types) <= {SLIDING, CSA, HCA},
                "layer_types needs one of sliding_attention, compressed_sparse_attention, "
                "heavily_compressed_attention per layer")
        require(len(self.mlp_layer_types) == n and set(self.mlp_layer_types) <= {"hash_moe", "moe"},
                "mlp_layer_types needs one of hash_moe or moe per layer")
        require(all(rates.get(t, 0) > 0 for t in (CSA, HCA) if t in self.layer_types),
                "compress_rates needs a positive rate for each compressed layer type")
        require(self.scoring_func in SCORES, f"scoring_func must be one of {', '.join(SCORES)}")
        require(self.num_key_value_heads == 1, "DeepSeek-V4 has one shared key/value head")
        require(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= min(self.head_dim, self.index_head_dim),
                "the rotary dims (head_dim x partial_rotary_factor) must be even and fit index_head_dim")
        require(self.num_attention_heads * self.head_dim % self.o_groups == 0,
                "num_attention_heads x head_dim must be a multiple of o_groups")
        check_moe_args(self, self.n_routed_experts)


ATTN = "model.layers.{il}.attn."
L_ = "model.layers.{il}."
NAMES = {  # as transformers' save_pretrained writes them (spell(): the hub's, without `model.`)
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "in_norm": L_ + "attn_norm.weight",
    "post_norm": L_ + "ffn_norm.weight",
    "q_a": ATTN + "wq_a.weight",
    "q_a_norm": ATTN + "q_norm.weight",
    "q_b": ATTN + "wq_b.weight",
    "kv": ATTN + "wkv.weight",
    "kv_norm": ATTN + "norm.weight",
    "o_a": ATTN + "wo_a.weight",
    "o_b": ATTN + "wo_b.weight",
    "sinks": ATTN + "attn_sink",
    "c_kv": ATTN + "compressor.wkv.weight",
    "c_gate": ATTN + "compressor.wgate.weight",
    "c_bias": ATTN + "compressor.ape",
    "c_norm": ATTN + "compressor.norm.weight",
    "i_kv": ATTN + "indexer.compressor.wkv.weight",
    "i_gate": ATTN + "indexer.compressor.wgate.weight",
    "i_bias": ATTN + "indexer.compressor.ape",
    "i_norm": ATTN + "indexer.compressor.norm.weight",
    "i_q": ATTN + "indexer.wq_b.weight",
    "i_w": ATTN + "indexer.weights_proj.weight",
    "hc_attn_fn": L_ + "hc_attn_fn",
    "hc_attn_base": L_ + "hc_attn_base",
    "hc_attn_scale": L_ + "hc_attn_scale",
    "hc_ffn_fn": L_ + "hc_ffn_fn",
    "hc_ffn_base": L_ + "hc_ffn_base",
    "hc_ffn_scale": L_ + "hc_ffn_scale",
    "router": L_ + "ffn.gate.weight",
    "router_bias": L_ + "ffn.gate.bias",
    "tid2eid": L_ + "ffn.gate.tid2eid",
    "shared_gate_proj": L_ + "ffn.shared_experts.w1.weight",
    "shared_up": L_ + "ffn.shared_experts.w3.weight",
    "shared_down": L_ + "ffn.shared_experts.w2.weight",
    "expert_gate": L_ + "ffn.experts.{ie}.w1.weight",
    "expert_up": L_ + "ffn.experts.{ie}.w3.weight",
    "expert_down": L_ + "ffn.experts.{ie}.w2.weight",
}
HUB = {"embed": "embed.weight", "norm": "norm.weight", "lm_head": "head.weight", "hc_head_fn": "hc_head_fn",
       "hc_head_base": "hc_head_base", "hc_head_scale": "hc_head_scale"}
HUB_NAMES = {k: HUB.get(k, v.removeprefix("model.")) for k, v in NAMES.items()}  # DeepSeek's own release


def route(logits: np.ndarray, bias: np.ndarray | None, fixed: np.ndarray | None, n_used: int, score: str,
          scaling: float) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids, weights [T, A]: the experts a hash layer's table gives (fixed) or
    # the top-k of score + bias, weighted by their scores renormalised, times the scaling
    scores = score_of(logits, score)  # [T, E]
    if fixed is None:
        ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :n_used]
    else:
        ids = fixed.astype(np.int64)
    w = np.take_along_axis(scores, ids, axis=-1)
    w = w / (w.sum(-1, keepdims=True) + np.float32(1e-20))
    return ids, (w * np.float32(scaling)).astype(np.float32)


def score_of(logits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "softmax":
        return softmax(logits)
    if kind == "sigmoid":
        return sigmoid(logits)
    return np.sqrt(softplus(logits)).astype(np.float32)


def unweighted_rmsnorm(x: np.ndarray, eps: float) -> np.ndarray:
    # x [..., d] -> x / rms(x) over the last axis
    return (x * (np.float32(1) / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + np.float32(eps)))).astype(np.float32)


def rope_tail(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # x [T, H, d], cos/sin [T, r/2] -> x with its last r dims turned as interleaved pairs
    # (2i, 2i+1) by angle i (a copy)
    r = 2 * cos.shape[-1]
    out = np.array(x, dtype=np.float32)
    even, odd = x[..., -r::2], x[..., -r + 1 :: 2]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., -r::2] = even * c - odd * s
    out[..., -r + 1 :: 2] = odd * c + even * s
    return out


def sinkhorn_weights(h: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, a) -> tuple:
    # h [T, n, D] streams -> pre [T, n], post [T, n], comb [T, n, n] (rows and columns summing
    # to ~1): one hyper-connection's weights from the flattened, normed streams
    T, n = h.shape[:2]
    mix = linear(unweighted_rmsnorm(h.reshape(T, -1), a.rms_norm_eps), fn)  # [T, (2 + n) n]
    eps = np.float32(a.hc_eps)
    pre = sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = np.float32(2) * sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    c = mix[:, 2 * n :].reshape(T, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    c = np.exp(c - c.max(-1, keepdims=True))
    comb = c / c.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(a.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return pre.astype(np.float32), post.astype(np.float32), comb.astype(np.float32)


def softmax_with_sink(s: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    # s [H, S] logits (-inf: masked), sinks [H] -> probabilities [H, S]; the sink takes its share
    m = np.maximum(s.max(-1), sinks)[:, None]
    e = np.exp(s - m)
    return (e / (e.sum(-1, keepdims=True) + np.exp(sinks[:, None] - m))).astype(np.float32)


def compress(kv: np.ndarray, gate: np.ndarray, off: int, bias: np.ndarray, w0: int, w1: int, rate: int,
             overlap: bool, norm: np.ndarray, eps: float, rope: Rope) -> np.ndarray:
    # kv, gate [S - off, width] a sequence's compressor projections at positions off..; ->
    # entries w0..w1-1 [w1 - w0, d]: per window the softmax over its slots of gate + bias
    # weighs the kv, then RMS norm, then RoPE at the window's first position. overlap (CSA):
    # width 2d; slots: the first half of the previous window's, the second half of its own
    n, d = w1 - w0, kv.shape[1] // (2 if overlap else 1)
    cur = slice(w0 * rate - off, w1 * rate - off)
    k = kv[cur].reshape(n, rate, -1)
    g = gate[cur].reshape(n, rate, -1) + bias  # [n, rate, width]
    if overlap:
        pk, pg = np.zeros((n, rate, d), np.float32), np.full((n, rate, d), -np.inf, np.float32)
        if w0 > 0:
            prev = slice((w0 - 1) * rate - off, w0 * rate - off)
            pk[0], pg[0] = kv[prev, :d], gate[prev, :d] + bias[:, :d]
        pk[1:], pg[1:] = k[:-1, :, :d], g[:-1, :, :d]
        k, g = np.concatenate([pk, k[..., d:]], 1), np.concatenate([pg, g[..., d:]], 1)  # [n, 2 rate, d]
    p = np.exp(g - g.max(1, keepdims=True))
    p = p / p.sum(1, keepdims=True)
    e = rmsnorm((k * p).sum(1).astype(np.float32), norm, eps)  # [n, d]
    cos, sin = rope.at(np.arange(w0, w1) * rate)
    return rope_tail(e[:, None], cos, sin)[:, 0]


def rope_settings(config: dict, a: ModelArgs) -> tuple[dict, dict]:
    """The `main` and `compress` RoPE settings, as transformers derives them: nested in
    rope_parameters, or from a flat one (or the hub's rope_scaling), whose YaRN applies to
    the compressed layers only, at compress_rope_theta and without YaRN's attention factor."""
    rp = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if "type" in flat:
            flat.setdefault("rope_type", flat.pop("type"))
        main = {"rope_type": "default", "rope_theta": a.rope_theta}
        comp = {**flat, "rope_theta": a.compress_rope_theta}
        comp.setdefault("rope_type", "default")
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
        main["partial_rotary_factor"] = comp["partial_rotary_factor"] = a.partial_rotary_factor
    for p in (main, comp):
        p["rope_type"] = p.get("rope_type", p.get("type", "default"))
        require(p["rope_type"] in ("default", "linear", "yarn"), f"rope type {p['rope_type']!r} is not supported")
    return main, comp


class V4Cache:
    """The compressed entries a sequence has closed so far, per compressor, gathered back
    from its pool pieces and state once and kept beside it as more close (a new request
    from the prefix cache or a session starts with none and gathers them again: the same
    bits). Each grows in place, its room doubled when full, so a step copies no history."""

    def __init__(self):
        self.arrays: dict[tuple[str, int], np.ndarray] = {}
        self.counts: dict[tuple[str, int], int] = {}

    def get(self, key) -> np.ndarray | None:
        a = self.arrays.get(key)
        return None if a is None else a[: self.counts[key]]

    def set(self, key, entries: np.ndarray) -> None:
        self.arrays[key] = np.array(entries, np.float32)
        self.counts[key] = len(entries)

    def append(self, key, new: np.ndarray) -> np.ndarray:
        a, n = self.arrays[key], self.counts[key]
        if n + len(new) > len(a):
            grown = np.empty((max(2 * len(a), n + len(new), 16), a.shape[1]), np.float32)
            grown[:n] = a[:n]
            self.arrays[key] = a = grown
        a[n : n + len(new)] = new
        self.counts[key] = n + len(new)
        return a[: n + len(new)]


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    ATTENTION = "sliding + compressed sparse (DeepSeek-V4)"
    EXPERT_KEYS = ("expert_gate", "expert_up", "expert_down")
    F32_KEYS = MoEModel.F32_KEYS | {"q_a_norm", "kv_norm", "c_bias", "c_norm", "i_bias", "i_norm", "hc_attn_fn",
                                    "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                                    "hc_head_fn", "hc_head_base", "hc_head_scale", "router_bias"}
    INTEGER_KEYS = frozenset({"tid2eid"})
    CREW_EXPERTS = False  # its clamped SwiGLU runs expert by expert (moe's ffn): not the integer job

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        a = args
        self.attn_spec = AttnSpec(a.num_attention_heads, 1, a.head_dim, a.rms_norm_eps)
        self.n_expert = a.n_routed_experts
        try:
            main, comp = rope_settings(config, a)
        except ValueError as e:
            raise ConfigInvalid(f"{where}: {e}") from None
        self.ropes = {"main": Rope(*rope_inv_freq(main, a.head_dim, a.max_position_embeddings)),
                      "compress": Rope(*rope_inv_freq(comp, a.head_dim, a.max_position_embeddings))}
        types = a.layer_types
        self.slot = {}  # a compressed layer's row in its arrays
        for kind in (CSA, HCA):
            for i, il in enumerate([il for il in range(a.num_hidden_layers) if types[il] == kind]):
                self.slot[il] = i
        self.n_csa, self.n_hca = types.count(CSA), types.count(HCA)
        super().__init__(args, {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}, where)

    def make_rope(self, params: dict) -> Rope:
        return self.ropes["main"]

    def spell(self, store) -> None:
        if not store.has(self.NAMES["embed"]) and store.has(HUB_NAMES["embed"]):
            self.NAMES = HUB_NAMES

    def is_moe(self, il: int) -> bool:
        return self.args.n_routed_experts > 0

    def global_shapes(self) -> dict:
        a = self.args
        n, D = a.hc_mult, a.hidden_size
        return super().global_shapes() | {"hc_head_fn": (n, n * D), "hc_head_base": (n,), "hc_head_scale": (1,)}

    def shapes(self):
        a = self.args
        D, H, hd, n = a.hidden_size, a.num_attention_heads, a.head_dim, a.hc_mult
        ihd, iH, I = a.index_head_dim, a.index_n_heads, a.moe_intermediate_size

        def per_layer(il):
            kind = a.layer_types[il]
            s = {"in_norm": (D,), "post_norm": (D,), "q_a": (a.q_lora_rank, D), "q_a_norm": (a.q_lora_rank,),
                 "q_b": (H * hd, a.q_lora_rank), "kv": (hd, D), "kv_norm": (hd,),
                 "o_a": (a.o_groups * a.o_lora_rank, H * hd // a.o_groups), "o_b": (D, a.o_groups * a.o_lora_rank),
                 "sinks": (H,)}
            for half in ("attn", "ffn"):
                s |= {f"hc_{half}_fn": ((2 + n) * n, n * D), f"hc_{half}_base": ((2 + n) * n,),
                      f"hc_{half}_scale": (3,)}
            if kind != SLIDING:
                w, rate = (2 if kind == CSA else 1) * hd, a.compress_rates[kind]
                s |= {"c_kv": (w, D), "c_gate": (w, D), "c_bias": (rate, w), "c_norm": (hd,)}
            if kind == CSA:
                rate = a.compress_rates[CSA]
                s |= {"i_kv": (2 * ihd, D), "i_gate": (2 * ihd, D), "i_bias": (rate, 2 * ihd), "i_norm": (ihd,),
                      "i_q": (iH * ihd, a.q_lora_rank), "i_w": (iH, D)}
            s |= {"router": (a.n_routed_experts, D), "shared_gate_proj": (I, D), "shared_up": (I, D),
                  "shared_down": (D, I)}
            if a.mlp_layer_types[il] == "hash_moe":
                s["tid2eid"] = (a.vocab_size, a.num_experts_per_tok)
            else:
                s["router_bias"] = (a.n_routed_experts,)
            return s

        return self.global_shapes(), per_layer, self.expert_shapes(I)

    def load(self, *args, **kwargs):
        super().load(*args, **kwargs)
        r = self.args.o_lora_rank
        # the grouped output projection: each group's rows of o_a, as stored (views: no bytes more)
        self.o_a_groups = [[rows(L["o_a"], g * r, (g + 1) * r) for g in range(self.args.o_groups)]
                           for L in self.layers]
        return self

    def kv_layout(self):
        # per token and compressed layer: a piece of a closed compressed entry (entry w is cut
        # in `rate` pieces, written into the rows of window w + 1's tokens, each at its own
        # step, so rows never change once written); the window's keys and what is not yet an
        # entry are the sequence's state (state_layout)
        shapes = {}
        for name, (n, width, kind) in self.entry_arrays().items():
            if n:
                shapes[name] = (n, 1, -(-width // self.args.compress_rates[kind]))
        return shapes, {}, frozenset()

    def entry_arrays(self) -> dict:
        # pool array -> (layers, entry width, layer kind): the CSA compressor's, its indexer's, HCA's
        a = self.args
        return {"ce": (self.n_csa, a.head_dim, CSA), "ie": (self.n_csa, a.index_head_dim, CSA),
                "he": (self.n_hca, a.head_dim, HCA)}

    def state_layout(self) -> dict[str, tuple]:
        # a sequence's fixed-size part: every layer's last sliding_window keys (a ring by
        # position), the compressors' projections of the positions that do not make a whole
        # entry yet (CSA: also the window before, whose first half the next entry mixes in;
        # rings by position), and each compressed layer's last closed entry (being spread
        # over the pool rows of the window after it)
        a = self.args
        hd, ihd, W = a.head_dim, a.index_head_dim, a.sliding_window
        out = {"ring": (self.n_layer, W, hd)}
        if self.n_csa:
            rc = a.compress_rates[CSA]
            out |= {"cpk": (self.n_csa, 2 * rc, 2 * hd), "cpg": (self.n_csa, 2 * rc, 2 * hd),
                    "ipk": (self.n_csa, 2 * rc, 2 * ihd), "ipg": (self.n_csa, 2 * rc, 2 * ihd),
                    "cre": (self.n_csa, hd), "ire": (self.n_csa, ihd)}
        if self.n_hca:
            rh = a.compress_rates[HCA]
            out |= {"hpk": (self.n_hca, rh, hd), "hpg": (self.n_hca, rh, hd), "hre": (self.n_hca, hd)}
        return out

    # ---- the residual streams ----
    def embed(self, ids):
        self.step_ids = np.asarray(ids, np.int64)  # (the hash layers route by them)
        h = embed_rows(self.glob["embed"], ids)  # [T, D]
        return np.ascontiguousarray(np.repeat(h[:, None, :], self.args.hc_mult, axis=1))  # [T, n, D]

    def head_input(self, h):
        # h [R, n, D] -> [R, D]: the streams collapsed by hc_head's weights
        a, g = self.args, self.glob
        R = h.shape[0]
        mix = linear(unweighted_rmsnorm(h.reshape(R, -1), a.rms_norm_eps), g["hc_head_fn"])  # [R, n]
        pre = sigmoid(mix * g["hc_head_scale"][0] + g["hc_head_base"]) + np.float32(a.hc_eps)
        return (pre[:, :, None] * h).sum(1).astype(np.float32)

    def block(self, il, h, step):
        # h [T, n, D] streams -> [T, n, D]
        a, L = self.args, self.layers[il]
        pre, post, comb = sinkhorn_weights(h, L["hc_attn_fn"], L["hc_attn_base"], L["hc_attn_scale"], a)
        x = rmsnorm((pre[:, :, None] * h).sum(1).astype(np.float32), L["in_norm"], a.rms_norm_eps)
        out = self.attention(il, x, step)  # [T, D]
        h = post[:, :, None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, h)
        pre, post, comb = sinkhorn_weights(h, L["hc_ffn_fn"], L["hc_ffn_base"], L["hc_ffn_scale"], a)
        x = rmsnorm((pre[:, :, None] * h).sum(1).astype(np.float32), L["post_norm"], a.rms_norm_eps)
        out = self.mlp(il, x, step)
        return (post[:, :, None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, h)).astype(np.float32)

    def moe_input(self, il, h):
        # the lookahead's guess at layer il's MoE input: its feed-forward collapse of the
        # streams as they are before the layer (the real one follows its attention). A hash
        # layer's router takes the table's experts for the step's token ids whatever its
        # input: its reads ahead are exact
        a, L = self.args, self.layers[il]
        pre, _, _ = sinkhorn_weights(h, L["hc_ffn_fn"], L["hc_ffn_base"], L["hc_ffn_scale"], a)
        return rmsnorm((pre[:, :, None] * h).sum(1).astype(np.float32), L["post_norm"], a.rms_norm_eps)

    # ---- the feed-forward half ----
    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        a, L = self.args, self.layers[il]
        fixed = L["tid2eid"][self.step_ids] if "tid2eid" in L else None
        return route(linear(x, L["router"]), L.get("router_bias"), fixed, a.num_experts_per_tok, a.scoring_func,
                     a.routed_scaling_factor)

    def mlp(self, il, x, step):
        a, L = self.args, self.layers[il]
        ids, w = self.router(il, x)
        shared = clamped_swiglu(a.swiglu_limit, x, (L["shared_gate_proj"], L["shared_up"], L["shared_down"]))
        return moe(x, ids, w, self.experts, il, step, ffn=partial(clamped_swiglu, a.swiglu_limit)) + shared

    # ---- attention ----
    def attention(self, il, x, step):
        # x [T, D] normed -> [T, D]
        a, L = self.args, self.layers[il]
        T, H, hd = x.shape[0], a.num_attention_heads, a.head_dim
        kind = a.layer_types[il]
        rope = self.ropes["main" if kind == SLIDING else "compress"]
        q_res = rmsnorm(linear(x, L["q_a"]), L["q_a_norm"], a.rms_norm_eps)  # [T, q_lora]
        q = unweighted_rmsnorm(linear(q_res, L["q_b"]).reshape(T, H, hd), a.rms_norm_eps)  # [T, H, hd]
        kv = rmsnorm(linear(x, L["kv"]), L["kv_norm"], a.rms_norm_eps)[:, None]  # [T, 1, hd]
        cos, sin = self.row_tables(rope, step)
        q, kv = rope_tail(q, cos, sin), rope_tail(kv, cos, sin)
        proj = {}
        if kind != SLIDING:
            proj = {"kv": linear(x, L["c_kv"]), "gate": linear(x, L["c_gate"])}
        if kind == CSA:
            proj |= {"ikv": linear(x, L["i_kv"]), "igate": linear(x, L["i_gate"]),
                     "iq": rope_tail(linear(q_res, L["i_q"]).reshape(T, a.index_n_heads, -1), cos, sin),
                     "iw": linear(x, L["i_w"]) * np.float32(a.index_n_heads ** -0.5)}
        out = np.empty((T, H, hd), np.float32)
        for sg in step.segments:
            rows = slice(sg.start, sg.start + sg.n)
            out[rows] = self.attend_sequence(il, sg, q[rows], kv[rows], {k: v[rows] for k, v in proj.items()})
        out = rope_tail(out, cos, -sin)  # the values' rotation undone at the query's position
        groups = out.reshape(T, a.o_groups, -1)  # [T, g, H hd / g]
        y = np.concatenate([linear(np.ascontiguousarray(groups[:, g]), w) for g, w in enumerate(self.o_a_groups[il])], 1)
        return linear(y, L["o_b"])  # y [T, g o_lora_rank]

    def row_tables(self, rope: Rope, step) -> tuple[np.ndarray, np.ndarray]:
        # cos, sin [T, r/2] at each row's position
        if rope is self.ropes["main"]:
            return step.cos, step.sin
        tables = [rope.table(sg.cache.n_pos, sg.n) for sg in step.segments]
        return np.concatenate([c for c, _ in tables]), np.concatenate([s for _, s in tables])

    def attend_sequence(self, il, sg, q, kv, proj) -> np.ndarray:
        # one sequence's n queries [n, H, hd] at positions pos0.. -> [n, H, hd]: each against
        # its window's keys and the compressed entries closed at or before it; the state and
        # the pool rows brought up to pos0 + n
        a, L = self.args, self.layers[il]
        cache, pos0, n = sg.cache, sg.cache.n_pos, sg.n
        kind, W = a.layer_types[il], a.sliding_window
        start = max(0, pos0 - W + 1)
        ring = cache.state["ring"][il]
        window = np.concatenate([ring[np.arange(start, pos0) % W], kv[:, 0]])  # keys of positions start..
        ring[np.arange(max(pos0, pos0 + n - W), pos0 + n) % W] = kv[-W:, 0]
        entries = keys = None
        if kind != SLIDING:
            rate = a.compress_rates[kind]
            c, e = ("c", "ce") if kind == CSA else ("h", "he")
            entries = self.entries(cache, il, c, e, pos0, proj["kv"], proj["gate"], rate, L["c_bias"], L["c_norm"])
        if kind == CSA:
            keys = self.entries(cache, il, "i", "ie", pos0, proj["ikv"], proj["igate"], rate, L["i_bias"], L["i_norm"])
        scale, sinks = np.float32(a.head_dim ** -0.5), L["sinks"]
        out = np.empty(q.shape, np.float32)
        for i in range(n):
            p = pos0 + i
            k = window[max(0, p - W + 1) - start : p + 1 - start]  # [w, hd]
            if entries is not None:
                ready = (p + 1) // rate  # entries whose windows end at or before p
                chosen = np.arange(ready)
                if kind == CSA and ready > a.index_topk:
                    score = np.maximum(proj["iq"][i] @ keys[:ready].T, 0) * np.float32(a.index_head_dim ** -0.5)
                    index = (score * proj["iw"][i][:, None]).sum(0)  # [ready]
                    chosen = np.sort(np.argsort(-index, kind="stable")[: a.index_topk])
                k = np.concatenate([k, entries[chosen]])
            pr = softmax_with_sink((q[i] @ k.T) * scale, sinks)  # [H, keys]
            out[i] = pr @ k
        return out

    def entries(self, cache, il: int, c: str, e: str, pos0: int, kv, gate, rate: int, bias, norm) -> np.ndarray:
        # one compressor of layer il: its projections kv, gate [n, width] of positions
        # pos0.. -> every entry closed by pos0 + n [(pos0 + n) // rate, d]. Those closed
        # before come from the pool's pieces and the state's last entry (kept in memory per
        # sequence as they are gathered); the new ones from the state's pending projections
        # and these. The state and this chunk's pool rows brought up to date.
        a, st, n = self.args, cache.state, len(kv)
        overlap, slot = a.layer_types[il] == CSA, self.slot[il]
        d = norm.shape[0]
        ring_k, ring_g, recent = st[c + "pk"][slot], st[c + "pg"][slot], st[c + "re"][slot]
        span = len(ring_k)  # positions the pending rings hold (rate, or 2 rate with the overlap)
        c0, c1 = pos0 // rate, (pos0 + n) // rate  # entries closed before, after
        memo = getattr(cache, "v4", None)
        if memo is None:
            memo = cache.v4 = V4Cache()
        have = memo.get((c, il))
        if have is None or len(have) != c0:  # (a sequence new to this process: gather them)
            have = np.zeros((c0, d), np.float32)
            if c0 > 1:
                pieces = cache.gather(e, slot, 0, c0 * rate, rate)  # [(c0 - 1) rate, piece]
                have[: c0 - 1] = pieces.reshape(c0 - 1, -1)[:, :d]
            if c0:
                have[c0 - 1] = recent
            memo.set((c, il), have)
        if c1 > c0:  # entries closing in this chunk: from the pending positions and the chunk
            base = max(0, (c0 - 1) * rate if overlap else c0 * rate)
            past = np.arange(base, pos0)
            k = np.concatenate([ring_k[past % span], kv])
            g = np.concatenate([ring_g[past % span], gate])
            new = compress(k, g, base, bias, c0, c1, rate, overlap, norm, a.rms_norm_eps, self.ropes["compress"])
            have = memo.append((c, il), new)
        positions = np.arange(pos0, pos0 + n)
        ring_k[positions[-span:] % span], ring_g[positions[-span:] % span] = kv[-span:], gate[-span:]
        if c1:
            recent[:] = have[c1 - 1]
        # this chunk's rows: position p holds piece p % rate of entry p // rate - 1
        width = cache.pool.shapes[e][2]
        owner = positions // rate - 1
        rows = np.zeros((n, 1, width), np.float32)  # [n, 1, piece]
        ok = owner >= 0
        if ok.any():  # the entries these rows hold pieces of, each cut in rate pieces
            lo, hi = owner[ok][0], owner[ok][-1] + 1
            cut = np.zeros((hi - lo, rate * width), np.float32)
            cut[:, :d] = have[lo:hi]
            rows[ok, 0] = cut.reshape(hi - lo, rate, width)[owner[ok] - lo, positions[ok] % rate]
        cache.write(e, slot, pos0, rows)
        return have


def rows(w, lo: int, hi: int):
    # rows lo..hi of a weight as stored: a view of a plain matrix; of an FP8 one, its codes
    # and the scales of whole row blocks when the rows fall on them, else the rows' values
    # in float32 (exactly: code x scale)
    if not isinstance(w, QuantWeight):
        return w[lo:hi]
    if lo % w.row_block == 0 and (hi % w.row_block == 0 or hi == w.q.shape[0]):
        return QuantWeight(w.kind, np.ascontiguousarray(w.q[lo:hi]),
                           np.ascontiguousarray(w.scales[lo // w.row_block : -(-hi // w.row_block)]), w.group_size,
                           w.row_block)
    return np.ascontiguousarray(dequantize(w)[lo:hi])


def clamped_swiglu(limit: float, x, w):
    # x [n, D], (gate, up, down) -> [n, D]: SwiGLU with the gate clamped above and up both ways
    gate, up, down = w[:3]
    g = np.minimum(linear(x, gate), np.float32(limit))
    u = np.clip(linear(x, up), -limit, limit)
    return linear((g / (1 + np.exp(-g)) * u).astype(np.float32), down)
