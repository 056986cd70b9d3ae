"""DeepSeek-V3 (and Kimi K2, which shares it): Multi-head Latent Attention, a sigmoid router
with a selection-only bias and group-limited top-k, shared experts, dense first layers.

MLA: a token's keys and values come from one compressed latent (`kv_lora_rank`, RMS-normed)
and one rotary key shared by every head (`qk_rope_head_dim`); the KV cache keeps exactly
those per token and layer. Attention runs in the absorbed form: each head's query is taken
through the key half of `kv_b_proj` into the latent space, so scores and the weighted sum
are over the cached latents themselves (one "head" of latent + rotary key, the latent also
serving as the value), and the value half of `kv_b_proj` lifts the result back per head.
The same arithmetic as transformers' expanded form, summed in another order.

The checkpoints' multi-token-prediction layers (`model.layers.{num_hidden_layers}.*`) are
not part of the model: never read, and left out of a converted container.
"""

import math
from dataclasses import dataclass

import numpy as np

from ...storage.experts import QuantWeight
from .. import kernels
from ..attention import NO_SINKS, AttnSpec, attend, deinterleave
from ..layers import linear, rmsnorm, swiglu, to_f32
from ..model import HF_NAMES, MoEModel, check_moe_args, require
from ..moe import moe, sigmoid_top_k
from ..rope import Rope, rope_inv_freq

MODEL_TYPE = "deepseek_v3"
ALIASES = {"n_routed_experts": ("num_local_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    rope_interleave: bool = True
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        check_grouped_moe(self)
        require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")


def check_grouped_moe(a) -> None:
    """ModelArgs checks of the grouped sigmoid router (raise ValueError, see model.require)."""
    a.n_group, a.topk_group = a.n_group or 1, a.topk_group or 1
    check_moe_args(a, a.n_routed_experts)
    require(a.n_routed_experts % a.n_group == 0, "n_routed_experts must be a multiple of n_group")
    require(0 < a.topk_group <= a.n_group, "topk_group must be between 1 and n_group")
    require(a.n_routed_experts // a.n_group >= 2, "each expert group needs at least 2 experts")
    require(a.num_experts_per_tok <= a.topk_group * a.n_routed_experts // a.n_group,
            "num_experts_per_tok is more than the chosen groups hold")


MOE_NAMES = {  # the MoE half of a layer, beside HF_NAMES' router and experts
    "router_bias": "model.layers.{il}.mlp.gate.e_score_correction_bias",
    "shared_gate_proj": "model.layers.{il}.mlp.shared_experts.gate_proj.weight",
    "shared_up": "model.layers.{il}.mlp.shared_experts.up_proj.weight",
    "shared_down": "model.layers.{il}.mlp.shared_experts.down_proj.weight",
}
ATTN = "model.layers.{il}.self_attn."
NAMES = HF_NAMES | MOE_NAMES | {
    "q": ATTN + "q_proj.weight",
    "q_a": ATTN + "q_a_proj.weight",
    "q_a_bias": ATTN + "q_a_proj.bias",
    "q_a_norm": ATTN + "q_a_layernorm.weight",
    "q_b": ATTN + "q_b_proj.weight",
    "kv_a": ATTN + "kv_a_proj_with_mqa.weight",
    "kv_a_bias": ATTN + "kv_a_proj_with_mqa.bias",
    "kv_a_norm": ATTN + "kv_a_layernorm.weight",
    "kv_b": ATTN + "kv_b_proj.weight",
    "o": ATTN + "o_proj.weight",
    "o_bias": ATTN + "o_proj.bias",
}


def route(logits: np.ndarray, bias: np.ndarray, n_expert_used: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] f32 -> ids [T, A], weights [T, A]: sigmoid scores, the bias for the choice
    # only, group-limited top-k (moe.sigmoid_top_k)
    return sigmoid_top_k(logits, bias, n_expert_used, n_group, topk_group, norm_topk_prob, scaling)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class GroupedMoE:
    """The feed-forward half of a DeepSeek-V3 layer, which GLM-4.5 took as it is (as
    transformers' modular files do): dense layers before first_k_dense_replace, then the
    grouped sigmoid router, the routed experts and n_shared_experts shared ones."""

    F32_KEYS = MoEModel.F32_KEYS | {"router_bias"}

    def is_moe(self, il: int) -> bool:
        return il >= self.args.first_k_dense_replace and self.args.n_routed_experts > 0

    def mlp_shapes(self, il: int) -> dict:
        a = self.args
        D, I = a.hidden_size, a.intermediate_size
        if not self.is_moe(il):
            return {"gate": (I, D), "up": (I, D), "down": (D, I)}
        s = {"router": (a.n_routed_experts, D), "router_bias": (a.n_routed_experts,)}
        if a.n_shared_experts:
            n = a.moe_intermediate_size * a.n_shared_experts
            s |= {"shared_gate_proj": (n, D), "shared_up": (n, D), "shared_down": (D, n)}
        return s

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        a, L = self.args, self.layers[il]
        return route(linear(x, L["router"]), L["router_bias"], a.num_experts_per_tok, a.n_group, a.topk_group,
                     a.norm_topk_prob, a.routed_scaling_factor)

    def mlp(self, il, x, step):
        # x [T, D] normed -> [T, D]
        a, L = self.args, self.layers[il]
        if not self.is_moe(il):
            return swiglu(x, L["gate"], L["up"], L["down"])
        ids, w = self.router(il, x)  # [T, A]
        out = moe(x, ids, w, self.experts, il, step)
        if a.n_shared_experts:
            out = out + swiglu(x, L["shared_gate_proj"], L["shared_up"], L["shared_down"])
        return out


class Model(GroupedMoE, MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    ATTENTION = "MLA"
    F32_KEYS = GroupedMoE.F32_KEYS | {"q_a_norm", "kv_a_norm", "q_a_bias", "kv_a_bias"}
    ROTARY = True  # the shared key's and the queries' rotary part is rotated (Kimi Linear's MLA: not, NoPE)

    def kv_row(self, il: int) -> int:
        # layer il's row in the KV pool's arrays (a hybrid keeps rows for its attention layers only)
        return il

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        a = args
        scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
            scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
        # the absorbed view: one shared head of latent + rotary key, values the latent
        self.attn_spec = AttnSpec(a.num_attention_heads, 1, a.kv_lora_rank + a.qk_rope_head_dim, a.rms_norm_eps,
                                  v_head_dim=a.kv_lora_rank, rope_interleaved=a.rope_interleave, scale=scale)
        self.n_expert = a.n_routed_experts
        super().__init__(args, config, where)

    def make_rope(self, params: dict) -> Rope:
        return Rope(*rope_inv_freq(params, self.args.qk_rope_head_dim, self.args.max_position_embeddings))

    def kv_layout(self):
        # per token and layer: the normed latent, then the rotary key; the latent is also the
        # values (a view, not a copy)
        a = self.args
        return {"k": (self.n_layer, 1, a.kv_lora_rank + a.qk_rope_head_dim)}, {"v": ("k", a.kv_lora_rank)}, \
            frozenset()

    def shapes(self):
        a = self.args
        D, H, S = a.hidden_size, a.num_attention_heads, a.moe_intermediate_size
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim

        def per_layer(il):
            s = {"in_norm": (D,), "post_norm": (D,), "kv_a": (a.kv_lora_rank + a.qk_rope_head_dim, D),
                 "kv_a_norm": (a.kv_lora_rank,), "kv_b": (H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                 "o": (D, H * a.v_head_dim)}
            if a.q_lora_rank is None:
                s["q"] = (H * qk, D)
            else:
                s |= {"q_a": (a.q_lora_rank, D), "q_a_norm": (a.q_lora_rank,), "q_b": (H * qk, a.q_lora_rank)}
            if a.attention_bias:
                s |= {"kv_a_bias": (a.kv_lora_rank + a.qk_rope_head_dim,), "o_bias": (D,)}
                if a.q_lora_rank is not None:
                    s["q_a_bias"] = (a.q_lora_rank,)
            return s | self.mlp_shapes(il)

        return self.global_shapes(), per_layer, self.expert_shapes(S)

    def load(self, src, experts=None, progress=None, precision=None, tables=None):
        super().load(src, experts, progress, precision, tables)
        a = self.args
        H, nope, hv, lat = a.num_attention_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        for L in self.layers:
            if "kv_b" not in L:  # (a hybrid's layers without MLA)
                continue
            kv_b = L.pop("kv_b")
            if isinstance(kv_b, QuantWeight):  # FP8: absorbed per head, its values in float32 (exact;
                kv_b = to_f32(kv_b)  # a head's slice does not fall on the scale blocks in general)
            kv_b = kv_b.reshape(H, nope + hv, lat)  # [H, nope + hv, latent], storage precision
            L["kv_b_k"] = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))  # [H, latent, nope]
            L["kv_b_v"] = np.ascontiguousarray(kv_b[:, nope:])  # [H, hv, latent]
        return self

    def attention(self, il, x, step):
        # x [T, D] normed -> [T, D]; writes each sequence's latents at its cache.n_pos
        qa, _ = self.absorbed_queries(il, x, step)  # [T, H, latent + rope]
        out = np.empty(qa.shape[:2] + (self.args.kv_lora_rank,), np.float32)  # [T, H, latent]
        for sg in step.segments:
            rows = slice(sg.start, sg.start + sg.n)
            attend(qa[rows], sg.cache, self.kv_row(il), "k", "v", 0, np.float32(self.attn_spec.scale), NO_SINKS,
                   out[rows])
        return self.lift(il, out)

    def absorbed_queries(self, il, x, step):
        # x [T, D] normed -> the absorbed queries [T, H, latent + rope] and the q_lora residual
        # [T, q_lora_rank] (None without q_lora); writes each sequence's latent and rotated key
        # at its cache.n_pos
        a, L, sp = self.args, self.layers[il], self.attn_spec
        T, H, nope, rope, lat = x.shape[0], a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        q_resid = None
        if a.q_lora_rank is None:
            q = linear(x, L["q"])
        else:
            q_resid = rmsnorm(linear(x, L["q_a"], L.get("q_a_bias")), L["q_a_norm"], a.rms_norm_eps)
            q = linear(q_resid, L["q_b"])
        q = q.reshape(T, H, nope + rope)  # [T, H, nope + rope]
        ckv = linear(x, L["kv_a"], L.get("kv_a_bias"))  # [T, latent + rope]
        latent = rmsnorm(ckv[:, :lat], L["kv_a_norm"], a.rms_norm_eps)  # [T, latent]
        q_rot = np.ascontiguousarray(q[:, :, nope:])  # [T, H, rope]
        k_rot = np.ascontiguousarray(ckv[:, None, lat:])  # [T, 1, rope]
        if self.ROTARY:
            if sp.rope_interleaved:
                q_rot, k_rot = deinterleave(q_rot, rope // 2), deinterleave(k_rot, rope // 2)
            kernels.rope(q_rot, step.cos, step.sin)
            kernels.rope(k_rot, step.cos, step.sin)
        qa = np.empty((T, H, lat + rope), np.float32)  # [T, H, latent + rope]
        for h in range(H):
            qa[:, h, :lat] = linear(q[:, h, :nope], L["kv_b_k"][h])  # [T, latent]
        qa[:, :, lat:] = q_rot
        for sg in step.segments:
            rows, cache, pos0 = slice(sg.start, sg.start + sg.n), sg.cache, sg.cache.n_pos
            cache.write("k", self.kv_row(il), pos0, np.concatenate([latent[rows], k_rot[rows, 0]], axis=1)[:, None])
        return qa, q_resid

    def lift(self, il, out):
        # out [T, H, latent], attention over the latents -> [T, D]: each head's values, then o_proj
        a, L = self.args, self.layers[il]
        T, H = out.shape[:2]
        v = np.empty((T, H, a.v_head_dim), np.float32)  # [T, H, hv]
        for h in range(H):
            v[:, h] = linear(out[:, h], L["kv_b_v"][h])
        return linear(v.reshape(T, H * a.v_head_dim), L["o"], L.get("o_bias"))

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        h = h + self.attention(il, rmsnorm(h, L["in_norm"], a.rms_norm_eps), step)
        return h + self.mlp(il, rmsnorm(h, L["post_norm"], a.rms_norm_eps), step)
