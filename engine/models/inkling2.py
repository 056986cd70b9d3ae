"""Inkling-2 (`inkling2`, its text model `inkling2_text`): attention without rotary, by
`layer_types` sliding (`hybrid_sliding`: its own head counts `swa_*`, the last
`sliding_window_size` keys) or full (`hybrid`). Each attention layer's keys and values pass a
short causal convolution of `conv_kernel_size` taps added to them (sliding: static taps;
full: static taps plus per-token taps projected from the key's or value's input, per key
head), keys are clipped to an L2 norm, values RMS-normed without a weight; queries are
scaled per head and clipped (full layers: then scaled by 1 + alpha log((pos + 1) / floor)
past `log_scaling_n_floor`). A relative position bias over the last `rel_extent` keys mixes
a learned bank of profiles by per-token, per-head states (clipped and scaled as the
queries); a per-token sink logit per head; the output gated by a sigmoid of the layer's
input. A short convolution follows the attention and the MoE too.

The residual is the block attention residual: every `n_layers_per_attn_res_block` layers
the stream is kept as a block; a layer's input (three for a full layer: q, k, v), its MoE
input and the final output are each a softmax mix, by a learned query, of the normed
blocks and the current stream. So a token's state through the layers is [blocks + 1, D].

MoE: the sigmoid router with its selection bias (`scoring_func`), top-k renormalised,
times `route_scale`; the experts a SwiGLU whose linear gate factor and up projection are
soft-capped (`mlp_gate_softcap`, `mlp_up_softcap`), no shared expert. The embeddings are
RMS-normed; the output head covers the `unpadded_vocab_size` first rows of its padded
table, its logits soft-capped (`final_logit_softcapping`).

The hub's checkpoints (and what transformers saves) name the text model `model.llm.*`
whether the model is the text one or the image-text one, whose vision tower (`model.visual.*`)
is never read; each layer's experts are stacked, gate and up rows interleaved
(`w13_weight` [E, 2I, D]): StackedExperts shows them one expert at a time. A sequence
keeps, per layer, the convolutions' last inputs (state_layout) and the keys and values of
its attention (the sliding and full layers' apart: their heads differ)."""

import math
from dataclasses import dataclass, replace
from functools import partial

import numba as nb
import numpy as np

from ...storage.errors import ScalesMismatch, TensorShapeMismatch
from ...storage.experts import (
    FP8_DTYPES,
    QuantWeight,
    check_finite,
    check_fp8_scales,
    dequantize,
    fp8_scale_shape,
    scales_f32,
)
from ..attention import AttnSpec
from ..jit import JIT, family_warm
from ..layers import embed_rows, linear, rmsnorm
from ..model import MoEModel, check_moe_args, require, text_config
from ..moe import moe, softmax
from ..recurrent import sigmoid, softplus

MODEL_TYPE = "inkling2"
ALIASES = {"sliding_window_size": ("sliding_window",), "n_routed_experts": ("num_local_experts",),
           "conv_kernel_size": ("sconv_kernel_size",), "moe_intermediate_size": ("intermediate_size",),
           "route_scale": ("routed_scaling_factor",)}
SLIDING, FULL = "hybrid_sliding", "hybrid"
SCORES = {"sigmoid": sigmoid, "sqrtsoftplus": lambda x: np.sqrt(softplus(x))}  # (transformers' ACT2FN by name)


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    unpadded_vocab_size: int | None = None
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 48
    swa_num_key_value_heads: int = 8
    swa_head_dim: int = 128
    sliding_window_size: int = 1024
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int = 128000
    log_scaling_alpha: float = 0.1
    layer_types: list | None = None
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    route_scale: float = 8.0
    qk_l2_clip_threshold: float = 22.627416997969522
    rel_l2_clip_threshold: float = 8.0
    n_layers_per_attn_res_block: int = 6
    mlp_gate_softcap: float = 4.0
    mlp_up_softcap: float = 25.0
    final_logit_softcapping: float = 30.0
    scoring_func: str = "sigmoid"
    tie_word_embeddings: bool = False  # (never: embed and unembed are separate tensors)
    hidden_act: str = "silu"

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers' default: every sixth layer full
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        if self.unpadded_vocab_size is None:
            self.unpadded_vocab_size = self.vocab_size
        require(len(self.layer_types) == n and set(self.layer_types) <= {SLIDING, FULL},
                "layer_types needs one of hybrid_sliding or hybrid per layer")
        require(0 < self.unpadded_vocab_size <= self.vocab_size, "unpadded_vocab_size must be 1..vocab_size")
        require(self.num_attention_heads % self.num_key_value_heads == 0
                and self.swa_num_attention_heads % self.swa_num_key_value_heads == 0,
                "attention heads must be a multiple of key/value heads")
        require(self.conv_kernel_size >= 1 and self.n_layers_per_attn_res_block >= 1 and self.rel_extent >= 1
                and self.sliding_window_size >= 1, "conv_kernel_size, n_layers_per_attn_res_block, rel_extent and "
                "sliding_window_size must be positive")
        require(self.scoring_func in SCORES, f"scoring_func must be one of {', '.join(SCORES)}")
        self.tie_word_embeddings = False
        check_moe_args(self, self.n_routed_experts)


P, L_ = "model.llm.", "model.llm.layers.{il}."
A_ = L_ + "attn."
EXPERT = L_ + "mlp.experts."
NAMES = {  # the hub's, as transformers' save_pretrained writes them too
    "embed": P + "embed.weight", "embed_norm": P + "embed_norm.weight", "norm": P + "norm.weight",
    "lm_head": P + "unembed.weight", "final_q": P + "attn_res.output_query",
    "mlp_q": P + "attn_res.mlp_queries.{il}",
    "in_norm": L_ + "attn_norm.weight", "q_in_norm": L_ + "q_input_norm.weight",
    "k_in_norm": L_ + "k_input_norm.weight", "v_in_norm": L_ + "v_input_norm.weight",
    "post_norm": L_ + "mlp_norm.weight", "attn_conv": L_ + "attn_sconv.weight", "mlp_conv": L_ + "mlp_sconv.weight",
    "q": A_ + "wq_du.weight", "q_scale": A_ + "q_l2_clip.scale", "k": A_ + "wk_dv.weight", "v": A_ + "wv_dv.weight",
    "k_conv": A_ + "k_sconv.weight", "v_conv": A_ + "v_sconv.weight",
    "k_static": A_ + "k_sconv.static_w", "k_dyn": A_ + "k_sconv.weight_proj",
    "v_static": A_ + "v_sconv.static_w", "v_dyn": A_ + "v_sconv.weight_proj",
    "gate": A_ + "gate_attn.weight", "o": A_ + "wo_ud.weight", "sink": A_ + "attn_sink_proj.weight",
    "rel": A_ + "wr_du.weight", "rel_scale": A_ + "rel_l2_clip.scale", "rel_proj": A_ + "rel_logits_proj.proj",
    "router": L_ + "mlp.gate.weight", "router_bias": L_ + "mlp.gate.bias",
    # one expert's view of the stacked tensors (StackedExperts): these names are not in the files
    "expert_gate": EXPERT + "{ie}.gate_proj.weight", "expert_up": EXPERT + "{ie}.up_proj.weight",
    "expert_down": EXPERT + "{ie}.down_proj.weight",
}
STACKED = {"gate": EXPERT + "w13_weight", "up": EXPERT + "w13_weight", "down": EXPERT + "w2_weight"}
STACKED_SCALES = "_scale"  # an MXFP8 release's: w13_weight -> w13_weight_scale, e8m0 bytes [E, N, K / 32]


class StackedExperts:
    """A checkpoint with each layer's experts stacked (w13 [E, 2I, D], gate and up rows
    interleaved; w2 [E, D, I]) shown one expert at a time under NAMES' per-expert names:
    `read` takes its rows (exact, in the storage dtype), `read_weight` an MXFP8 release's
    as an FP8 QuantWeight of its codes and scales; everything else is the checkpoint's."""

    def __init__(self, checkpoint, model: "Model"):
        self.ckpt, self.model = checkpoint, model
        self.virtual = {name: (il, ie, which) for il in model.moe_layers for ie in range(model.n_expert)
                        for name, which in zip(model.expert_names(il, ie), ("gate", "up", "down"))}
        self._layer: tuple = (None, {})  # (layer, its stacked tensors), while its experts are read

    def __getattr__(self, name):
        return getattr(self.ckpt, name)

    def has(self, name: str) -> bool:
        return name in self.virtual or self.ckpt.has(name)

    def _stacked(self, il: int, name: str) -> np.ndarray:
        # a stacked tensor of layer il (its scales too), kept while the layer's experts are read
        if self._layer[0] != il:
            self._layer = (il, {})
        got = self._layer[1]
        if name not in got:
            got[name] = self.ckpt.read(name)
        return got[name]

    def _fp8(self, il: int, which: str) -> bool:
        return self.ckpt.entry(STACKED[which].format(il=il)).dtype in FP8_DTYPES

    def entry(self, name: str):
        if name not in self.virtual:
            return self.ckpt.entry(name)
        il, _, which = self.virtual[name]
        I, D = self.model.args.moe_intermediate_size, self.model.args.hidden_size
        return replace(self.ckpt.entry(STACKED[which].format(il=il)), shape=(D, I) if which == "down" else (I, D))

    def expect(self, name: str, shape: tuple, integer: bool = False):
        if name not in self.virtual:
            return self.ckpt.expect(name, shape, integer)
        il, _, which = self.virtual[name]
        E, I, D = self.model.n_expert, self.model.args.moe_intermediate_size, self.model.args.hidden_size
        stacked, full = STACKED[which].format(il=il), (E, D, I) if which == "down" else (E, 2 * I, D)
        e = self.ckpt.entry(stacked)
        if e.dtype not in FP8_DTYPES:
            self.ckpt.expect(stacked, full)
        elif tuple(e.shape) != full:
            raise TensorShapeMismatch(f"{self.ckpt.file_of(stacked)}: tensor {stacked!r} has shape {list(e.shape)}, "
                                      f"config implies {list(full)}")
        else:  # FP8 codes: their scales per block of each expert's rows
            if self.ckpt.quant is None or self.ckpt.quant.method != "fp8" or not self.ckpt.has(stacked + STACKED_SCALES):
                raise ScalesMismatch(f"{self.ckpt.file_of(stacked)}: FP8 tensor {stacked!r} has no scales "
                                     f"({stacked + STACKED_SCALES!r}) or config.json no fp8/mxfp8 quantization_config")
            check_fp8_scales(self.ckpt, stacked + STACKED_SCALES, full,
                             (E, *fp8_scale_shape(self.ckpt.quant, full[1:])))
        return self.entry(name)

    def _rows(self, name: str, suffix: str = "") -> np.ndarray:
        # expert `name`'s rows of its stacked tensor (suffix: of its scales)
        il, ie, which = self.virtual[name]
        w = self._stacked(il, STACKED[which].format(il=il) + suffix)[ie]
        return np.ascontiguousarray(w if which == "down" else w[0 if which == "gate" else 1 :: 2])

    def read(self, name: str) -> np.ndarray:
        if name not in self.virtual:
            return self.ckpt.read(name)
        if self._fp8(*self.virtual[name][::2]):  # the float32 values (exact); read_weight keeps the codes
            return dequantize(self.read_weight(name))
        return self._rows(name)

    def read_weight(self, name: str):
        if name not in self.virtual:
            return self.ckpt.read_weight(name)
        il, _, which = self.virtual[name]
        if not self._fp8(il, which):
            return self._rows(name)
        e, s = self.ckpt.entry(STACKED[which].format(il=il)), self.ckpt.entry(STACKED[which].format(il=il) + STACKED_SCALES)
        bn, bk = self.ckpt.quant.block
        if bn != 1:
            raise ScalesMismatch(f"{self.ckpt.file_of(e.name)}: stacked experts scaled in blocks of {bn} rows; "
                                 "colibri reads an expert's gate and up rows apart with one scale row each")
        q = self._rows(name)
        check_finite(q, FP8_DTYPES[e.dtype], f"{self.ckpt.file_of(e.name)}: {e.name!r}")
        return QuantWeight(FP8_DTYPES[e.dtype], q, np.ascontiguousarray(scales_f32(self._rows(name, STACKED_SCALES),
                                                                                  s.dtype)), bk, bn)


def route(logits: np.ndarray, bias: np.ndarray, n_used: int, score, scale: float) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids, weights [T, A]: the top-k of score + bias, weighted by their scores
    # renormalised, times route_scale
    scores = score(logits)
    ids = np.argsort(-(scores + bias), axis=-1, kind="stable")[:, :n_used]
    w = np.take_along_axis(scores, ids, axis=-1)
    return ids, (w / (w.sum(-1, keepdims=True) + np.float32(1e-20)) * np.float32(scale)).astype(np.float32)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    return (np.tanh(x / np.float32(cap)) * np.float32(cap)).astype(np.float32)


def expert(gate_cap: float, up_cap: float, x, w):
    # x [n, D], one expert's (gate, up, down) -> [n, D]: the SwiGLU whose sigmoid sees the raw
    # gate while the gate's linear factor and the up projection are soft-capped (a module
    # function, so an expert box on Ray gets it by name)
    gate, up, down = w
    g, u = linear(x, gate), linear(x, up)  # [n, I]
    return linear((softcap(g, gate_cap) * sigmoid(g) * softcap(u, up_cap)).astype(np.float32), down)


def l2_clip(x: np.ndarray, threshold: float) -> np.ndarray:
    # x [..., d] -> x scaled down to the threshold's L2 norm where longer
    norm = np.sqrt(np.square(x).sum(-1, keepdims=True, dtype=np.float32))
    return (x * np.minimum(np.float32(threshold) / (norm + np.float32(1e-6)), np.float32(1))).astype(np.float32)


def unweighted_rmsnorm(x: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + np.float32(eps))).astype(np.float32)


def mix_blocks(blocks: np.ndarray, current: np.ndarray, query: np.ndarray) -> np.ndarray:
    # blocks [T, n, D], current [T, D], query [Q, D] -> [Q, T, D]: per query, the softmax (by
    # query . key / sqrt(D)) mix of the normed blocks and current stream (the block attention
    # residual; its norm's eps transformers' default, 1e-6)
    # (sums along axes, not einsum: a row's bits do not depend on the rows beside it)
    states = unweighted_rmsnorm(np.concatenate([blocks, current[:, None]], axis=1), 1e-6)  # [T, n + 1, D]
    scores = (states[:, None] * query[None, :, None]).sum(-1, dtype=np.float32)  # [T, Q, n + 1]
    p = softmax((scores * np.float32(states.shape[-1] ** -0.5)).reshape(-1, scores.shape[-1])).reshape(scores.shape)
    return (p[..., None] * states[:, None]).sum(2, dtype=np.float32).transpose(1, 0, 2)  # [Q, T, D]


@nb.njit(**JIT)
def rel_attend(q, keys, vals, pos, start, window, rel, sinks, scale, out):
    # one sequence's rows: q [n, H, hd] at positions pos [n], keys and values [S, Hkv, hd] of
    # positions start.., rel [n, H, extent] the relative bias by distance, sinks [n, H] ->
    # out [n, H, hd]. Each row over exactly the keys it sees (the last `window`, 0: all), in
    # position order: its bits are the same whichever rows share its step
    n, H, hd = q.shape
    G, extent = H // keys.shape[1], rel.shape[2]
    for t in range(n):
        p = pos[t]
        lo = start if window == 0 else max(start, p - window + 1)
        sc = np.empty(p - lo + 1, np.float32)
        for h in range(H):
            g = h // G
            m = sinks[t, h]
            for j in range(lo, p + 1):
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += q[t, h, d] * keys[j - start, g, d]
                s = acc * scale
                if p - j < extent:
                    s += rel[t, h, p - j]
                sc[j - lo] = s
                m = max(m, s)
            den = np.float32(math.exp(sinks[t, h] - m))
            for j in range(p - lo + 1):
                sc[j] = np.float32(math.exp(sc[j] - m))
                den += sc[j]
            for d in range(hd):
                acc = np.float32(0.0)
                for j in range(lo, p + 1):
                    acc += sc[j - lo] * vals[j - start, g, d]
                out[t, h, d] = acc / den


def conv_step(x: np.ndarray, state: np.ndarray, taps) -> np.ndarray:
    # x [n, C] one sequence's rows, state [K-1, C] its last K-1 inputs (oldest first; updated)
    # -> [n, C]: sum over lag of taps(lag) [n or 1, C] x the input `lag` steps back
    K = state.shape[0] + 1
    ext = np.concatenate([state, x]) if K > 1 else x  # [n + K - 1, C]
    n = len(x)
    out = np.zeros_like(x)
    for lag in range(K):
        out += taps(lag) * ext[K - 1 - lag : K - 1 - lag + n]
    if K > 1:
        state[:] = ext[-(K - 1):]
    return out


@family_warm("inkling2")
def warm() -> None:
    # rel_attend on tiny C arrays, as the attention layers call it
    q, kv = np.ones((2, 2, 4), np.float32), np.ones((3, 1, 4), np.float32)
    rel_attend(q, kv, kv, np.array([1, 2]), 0, 0, np.zeros((2, 2, 4), np.float32), np.zeros((2, 2), np.float32),
               np.float32(0.5), np.empty_like(q))


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    ATTENTION = "sliding + full with relative bias and sinks (Inkling-2)"
    CREW_EXPERTS = False  # its soft-capped SwiGLU runs expert by expert (moe's ffn): not the integer job
    KERNEL_GROUPS = ("inkling2",)
    ROTARY = False  # a relative position bias instead: the base class's rotary table is never read

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        a = args
        self.attn_spec = AttnSpec(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps)
        self.n_expert = a.n_routed_experts
        self.slot, counts = {}, {SLIDING: 0, FULL: 0}
        for il, t in enumerate(a.layer_types):  # a layer's row among its kind's
            self.slot[il], counts[t] = counts[t], counts[t] + 1
        self.n_swa, self.n_full = counts[SLIDING], counts[FULL]
        self.score = SCORES[a.scoring_func]
        # the block attention residual's queries: layer il's input (il >= 1), by the hub's index il - 1
        self.NAMES = NAMES | {f"attn_q{il}": P + f"attn_res.attn_queries.{il - 1}" for il in range(1, a.num_hidden_layers)}
        self.F32_KEYS = MoEModel.F32_KEYS | {
            "embed_norm", "final_q", "mlp_q", "q_in_norm", "k_in_norm", "v_in_norm", "attn_conv", "mlp_conv",
            "q_scale", "k_conv", "v_conv", "k_static", "v_static", "rel_scale", "rel_proj", "router_bias",
            *(f"attn_q{il}" for il in range(1, a.num_hidden_layers))}
        super().__init__(args, text_config(config), where)

    def source(self, checkpoint):
        self.spell(checkpoint)
        return StackedExperts(checkpoint, self)

    def heads(self, il: int) -> tuple[int, int, int]:
        # layer il's (query heads, key/value heads, head dim)
        a = self.args
        if a.layer_types[il] == SLIDING:
            return a.swa_num_attention_heads, a.swa_num_key_value_heads, a.swa_head_dim
        return a.num_attention_heads, a.num_key_value_heads, a.head_dim

    def global_shapes(self) -> dict:
        a = self.args
        D = a.hidden_size
        return {"embed": (a.vocab_size, D), "embed_norm": (D,), "norm": (D,), "lm_head": (a.vocab_size, D),
                "final_q": (D,)} | {f"attn_q{il}": (D,) if a.layer_types[il] == SLIDING else (3, D)
                                    for il in range(1, self.n_layer)}

    def shapes(self):
        a = self.args
        D, K, E, R = a.hidden_size, a.conv_kernel_size, a.n_routed_experts, a.d_rel

        def per_layer(il):
            H, Hkv, hd = self.heads(il)
            extent = a.sliding_window_size if a.layer_types[il] == SLIDING else a.rel_extent
            s = {"mlp_q": (D,), "post_norm": (D,), "attn_conv": (D, 1, K), "mlp_conv": (D, 1, K),
                 "q": (H * hd, D), "q_scale": (H, hd), "k": (Hkv * hd, D), "v": (Hkv * hd, D),
                 "gate": (H * hd, D), "o": (D, H * hd), "sink": (H, D), "rel": (H * R, D), "rel_scale": (H, R),
                 "rel_proj": (R, extent), "router": (E, D), "router_bias": (E,)}
            if a.layer_types[il] == SLIDING:
                return s | {"in_norm": (D,), "k_conv": (Hkv * hd, 1, K), "v_conv": (Hkv * hd, 1, K)}
            return s | {"q_in_norm": (D,), "k_in_norm": (D,), "v_in_norm": (D,), "k_static": (K, Hkv * hd),
                        "k_dyn": (Hkv * K, D), "v_static": (K, Hkv * hd), "v_dyn": (Hkv * K, D)}

        return self.global_shapes(), per_layer, self.expert_shapes(a.moe_intermediate_size)

    def load(self, *args, **kwargs):
        super().load(*args, **kwargs)
        for L in self.layers:  # the static convolutions' taps [C, 1, K] -> [K, C], by lag (0: the current input)
            for key in ("attn_conv", "mlp_conv", "k_conv", "v_conv"):
                if key in L:
                    L[key] = np.ascontiguousarray(L[key][:, 0, ::-1].T)
            L["rel_proj_t"] = np.ascontiguousarray(L["rel_proj"].T)  # [extent, d_rel]: linear's [N, D]
        self.lm_head = self.glob["lm_head"][: self.args.unpadded_vocab_size]  # (the padded rows are never logits)
        return self

    def kv_layout(self):
        a = self.args
        shapes = {}
        if self.n_swa:
            shapes |= {"ks": (self.n_swa, a.swa_num_key_value_heads, a.swa_head_dim),
                       "vs": (self.n_swa, a.swa_num_key_value_heads, a.swa_head_dim)}
        if self.n_full:
            shapes |= {"k": (self.n_full, a.num_key_value_heads, a.head_dim),
                       "v": (self.n_full, a.num_key_value_heads, a.head_dim)}
        return shapes, {}, frozenset()

    def state_layout(self) -> dict[str, tuple]:
        # a sequence's convolutions' last K-1 inputs: keys' and values' per attention kind, and
        # every layer's after its attention and after its MoE
        a = self.args
        K1, out = a.conv_kernel_size - 1, {}
        if self.n_swa:
            w = a.swa_num_key_value_heads * a.swa_head_dim
            out |= {"cks": (self.n_swa, K1, w), "cvs": (self.n_swa, K1, w)}
        if self.n_full:
            w = a.num_key_value_heads * a.head_dim
            out |= {"ckf": (self.n_full, K1, w), "cvf": (self.n_full, K1, w)}
        return out | {"ca": (self.n_layer, K1, a.hidden_size), "cm": (self.n_layer, K1, a.hidden_size)}

    # ---- the stream: [T, blocks + 1, D], the current one last ----
    def embed(self, ids):
        h = rmsnorm(embed_rows(self.glob["embed"], ids), self.glob["embed_norm"], self.args.rms_norm_eps)
        return h[:, None]

    def head_input(self, h):
        return mix_blocks(h[:, :-1], h[:, -1], self.glob["final_q"][None])[0]

    def logits(self, x):
        return softcap(linear(x, self.lm_head), self.args.final_logit_softcapping)

    def moe_input(self, il, h):
        # (the lookahead's prediction from the layer's input: its MoE input mixes the stream
        # after the attention, which is not there yet)
        return rmsnorm(mix_blocks(h[:, :-1], h[:, -1], self.layers[il]["mlp_q"][None])[0], self.layers[il]["post_norm"],
                       self.args.rms_norm_eps)

    def router(self, il, x):
        a, L = self.args, self.layers[il]
        return route(linear(x, L["router"]), L["router_bias"], a.num_experts_per_tok, self.score, a.route_scale)

    def block(self, il, h, step):
        a, L = self.args, self.layers[il]
        blocks, hs = h[:, :-1], np.ascontiguousarray(h[:, -1])
        eps = a.rms_norm_eps
        if a.layer_types[il] == SLIDING:
            x = hs if il == 0 else mix_blocks(blocks, hs, self.glob[f"attn_q{il}"][None])[0]
            xq = xk = xv = rmsnorm(x, L["in_norm"], eps)
        else:
            q_in, k_in, v_in = (hs, hs, hs) if il == 0 else mix_blocks(blocks, hs, self.glob[f"attn_q{il}"])
            xq, xk, xv = (rmsnorm(v, L[k], eps) for v, k in ((q_in, "q_in_norm"), (k_in, "k_in_norm"),
                                                            (v_in, "v_in_norm")))
        attn = self.conv(self.attention(il, xq, xk, xv, step), step, "ca", il, L["attn_conv"])
        if il % a.n_layers_per_attn_res_block == 0:  # a block boundary: the input becomes a block
            blocks, residual = np.concatenate([blocks, hs[:, None]], axis=1), attn
        else:
            residual = hs + attn
        x = rmsnorm(mix_blocks(blocks, residual, L["mlp_q"][None])[0], L["post_norm"], eps)
        ids, w = self.router(il, x)
        y = moe(x, ids, w, self.experts, il, step, ffn=partial(expert, a.mlp_gate_softcap, a.mlp_up_softcap))
        out = residual + self.conv(y, step, "cm", il, L["mlp_conv"])
        return np.concatenate([blocks, out[:, None]], axis=1)

    def conv(self, x, step, state: str, row: int, taps: np.ndarray) -> np.ndarray:
        # x [T, C] -> (x + the static short convolution of it) / sqrt(K + 1), per sequence on its state
        out = np.empty_like(x)
        scale = np.float32(np.sqrt(taps.shape[0] + 1))
        for sg in step.segments:
            rows = slice(sg.start, sg.start + sg.n)
            out[rows] = (conv_step(x[rows], sg.cache.state[state][row], lambda lag: taps[lag]) + x[rows]) / scale
        return out

    def dynamic_conv(self, x, dyn_in, step, state: str, row: int, static: np.ndarray, dyn: np.ndarray, Hkv: int):
        # x [T, C] (C = Hkv x hd) -> (x + its convolution by static taps [K, C] plus the per-token
        # taps dyn_in projected by dyn [Hkv x K, D], one per key head) / sqrt(2K + 1)
        T, C = x.shape
        K = static.shape[0]
        taps = linear(dyn_in, dyn).reshape(T, Hkv, 1, K)  # [T, Hkv, 1, K]
        out = np.empty_like(x)
        for sg in step.segments:
            rows = slice(sg.start, sg.start + sg.n)
            t = taps[rows]

            def tap(lag, t=t):
                return (static[lag].reshape(Hkv, -1)[None] + t[..., lag]).reshape(len(t), C)

            out[rows] = conv_step(x[rows], sg.cache.state[state][row], tap) + x[rows]
        return out / np.float32(np.sqrt(2 * K + 1))

    def attention(self, il, xq, xk, xv, step):
        # xq, xk, xv [T, D] (normed) -> [T, D]
        a, L = self.args, self.layers[il]
        H, Hkv, hd = self.heads(il)
        T, s, sliding = len(xq), self.slot[il], a.layer_types[il] == SLIDING
        k, v = linear(xk, L["k"]), linear(xv, L["v"])  # [T, Hkv*hd]
        if sliding:
            k = self.conv(k, step, "cks", s, L["k_conv"])
            v = self.conv(v, step, "cvs", s, L["v_conv"])
        else:
            k = self.dynamic_conv(k, xk, step, "ckf", s, L["k_static"], L["k_dyn"], Hkv)
            v = self.dynamic_conv(v, xv, step, "cvf", s, L["v_static"], L["v_dyn"], Hkv)
        k = l2_clip(k.reshape(T, Hkv, hd), a.qk_l2_clip_threshold)
        v = unweighted_rmsnorm(v.reshape(T, Hkv, hd), a.rms_norm_eps)
        q = l2_clip(linear(xq, L["q"]).reshape(T, H, hd) * L["q_scale"], a.qk_l2_clip_threshold)  # [T, H, hd]
        rel = l2_clip(linear(xq, L["rel"]).reshape(T, H, a.d_rel) * L["rel_scale"], a.rel_l2_clip_threshold)
        pos = np.concatenate([sg.cache.n_pos + np.arange(sg.n) for sg in step.segments])  # [T]
        if not sliding:  # the full layers' log scaling of queries and relative states
            tau = (1 + a.log_scaling_alpha * np.log(np.maximum((pos + 1) / a.log_scaling_n_floor, 1.0)))
            tau = tau.astype(np.float32)[:, None, None]
            q, rel = (q * tau).astype(np.float32), (rel * tau).astype(np.float32)
        rel_logits = linear(rel.reshape(T * H, a.d_rel), L["rel_proj_t"]).reshape(T, H, -1)  # [T, H, extent]
        sinks = linear(xq, L["sink"])  # [T, H]
        names, window = ("ks", "vs") if sliding else ("k", "v"), a.sliding_window_size if sliding else 0
        out = np.empty((T, H, hd), np.float32)
        for sg in step.segments:
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            cache.write(names[0], s, pos0, k[rows])
            cache.write(names[1], s, pos0, v[rows])
            start, end = max(0, pos0 - window + 1) if window else 0, pos0 + sg.n
            keys, vals = (np.ascontiguousarray(np.stack([cache.gather(nm, s, g, end, start) for g in range(Hkv)], 1))
                          for nm in names)  # [S, Hkv, hd]
            rel_attend(np.ascontiguousarray(q[rows]), keys, vals, pos[rows], start, window,
                       np.ascontiguousarray(rel_logits[rows]), np.ascontiguousarray(sinks[rows]),
                       np.float32(hd**-0.5), out[rows])
        gated = out.reshape(T, H * hd) * sigmoid(linear(xq, L["gate"]))
        return linear(gated, L["o"])
