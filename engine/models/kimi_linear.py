"""Kimi Linear (`kimi_linear`): a hybrid. Its `layer_types` interleave Kimi Delta Attention
(KDA: the gated delta rule with a decay per key channel, engine/recurrent.py; short causal
convolutions on q, k and v; a low-rank forget gate; a sigmoid-gated output RMSNorm) with
DeepSeek-V3's Multi-head Latent Attention without rotary (NoPE: the shared key part is used
as it is), on deepseek_v3's latent KV cache. The feed-forward half is DeepSeek-V3's grouped
sigmoid router with its selection bias and shared experts, dense or sparse by
`mlp_layer_types`. The hub's config spells the linear layers in `linear_attn_config`
(1-indexed `kda_layers` / `full_attn_layers`, `head_dim`, `num_heads`,
`short_conv_kernel_size`) and the MoE fields its own way (ALIASES)."""

from dataclasses import dataclass

import numpy as np

from ..layers import linear, rmsnorm
from ..model import require
from ..recurrent import delta_rule, l2norm, layer_slots, short_conv, sigmoid, softplus
from . import deepseek_v3

MODEL_TYPE = "kimi_linear"
ALIASES = {"n_routed_experts": ("num_local_experts", "num_experts"), "num_experts_per_tok": ("num_experts_per_token",),
           "n_group": ("num_expert_group",), "n_shared_experts": ("num_shared_experts",),
           "norm_topk_prob": ("moe_renormalize",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.446
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 1
    topk_group: int | None = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1  # (read only to make mlp_layer_types when the config has none)
    mlp_layer_types: list | None = None
    layer_types: list | None = None
    linear_attn_config: dict | None = None
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope_interleave = False  # (not a field: the deepseek_v3 attention it reuses never rotates here)
    # a GGUF file's layout (storage/gguf.py), as llama.cpp's converter wrote it: A_log stored
    # as A = -exp(A_log) (used as stored), the convolutions [1, channels, 1, kernel]
    gguf_layout: bool = False

    def __post_init__(self):
        n = self.num_hidden_layers
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        # transformers' KimiLinearForCausalLM ties nothing, whatever the config says: its
        # output head is always a tensor of its own
        self.tie_word_embeddings = False
        lac = self.linear_attn_config or {}
        self.linear_head_dim = lac.get("head_dim", self.linear_head_dim)
        self.linear_num_heads = lac.get("num_heads", self.linear_num_heads)
        self.linear_conv_kernel_dim = lac.get("short_conv_kernel_size", self.linear_conv_kernel_dim)
        if self.layer_types is None:
            if "full_attn_layers" in lac and "kda_layers" in lac:
                types = [None] * n
                for il in lac["full_attn_layers"]:
                    types[il - 1] = "full_attention"
                for il in lac["kda_layers"]:
                    types[il - 1] = "linear_attention"
                self.layer_types = types
            else:
                self.layer_types = ["full_attention" if il and il % 4 == 0 else "linear_attention" for il in range(n)]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if il < self.first_k_dense_replace else "sparse" for il in range(n)]
        require(len(self.layer_types) == n and set(self.layer_types) <= {"linear_attention", "full_attention"},
                "layer_types needs one entry per layer, linear_attention or full_attention")
        require(len(self.mlp_layer_types) == n and set(self.mlp_layer_types) <= {"dense", "sparse"},
                "mlp_layer_types needs one entry per layer, dense or sparse")
        deepseek_v3.check_grouped_moe(self)


LAYER = "model.layers.{il}."
ATTN, MOE = LAYER + "self_attn.", LAYER + "block_sparse_moe."
NAMES = deepseek_v3.NAMES | {
    "router": MOE + "gate.weight",
    "router_bias": MOE + "gate.e_score_correction_bias",
    "expert_gate": MOE + "experts.{ie}.w1.weight",
    "expert_up": MOE + "experts.{ie}.w3.weight",
    "expert_down": MOE + "experts.{ie}.w2.weight",
    "shared_gate_proj": MOE + "shared_experts.gate_proj.weight",
    "shared_up": MOE + "shared_experts.up_proj.weight",
    "shared_down": MOE + "shared_experts.down_proj.weight",
    "gate": MOE + "gate_proj.weight",
    "up": MOE + "up_proj.weight",
    "down": MOE + "down_proj.weight",
    # KDA (q and o share MLA's names: a layer has one or the other)
    "k": ATTN + "k_proj.weight",
    "v": ATTN + "v_proj.weight",
    "q_conv": ATTN + "q_conv1d.weight",
    "k_conv": ATTN + "k_conv1d.weight",
    "v_conv": ATTN + "v_conv1d.weight",
    "A_log": ATTN + "A_log",
    "dt_bias": ATTN + "dt_bias",
    "f_a": ATTN + "f_a_proj.weight",
    "f_b": ATTN + "f_b_proj.weight",
    "b_proj": ATTN + "b_proj.weight",
    "g_a": ATTN + "g_a_proj.weight",
    "g_b": ATTN + "g_b_proj.weight",
    "o_norm": ATTN + "o_norm.weight",
}


class Model(deepseek_v3.Model):
    MODEL_TYPE = MODEL_TYPE
    KERNEL_GROUPS = ("recurrent",)  # (jit.family_warm: kernels of its own, compiled before its first step)
    NAMES = NAMES
    ATTENTION = "hybrid: KDA + MLA (NoPE)"
    ROTARY = False
    F32_KEYS = deepseek_v3.Model.F32_KEYS | {"q_conv", "k_conv", "v_conv", "A_log", "dt_bias", "o_norm"}

    FULL = "full_attention"  # layer_types' word for an MLA layer

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        self.slot, self.n_full, self.n_lin = layer_slots(  # a layer's row in the cache
            ["full_attention" if t == self.FULL else t for t in args.layer_types])
        super().__init__(args, config, where)

    def is_moe(self, il: int) -> bool:
        return self.args.mlp_layer_types[il] == "sparse" and self.args.n_routed_experts > 0

    def kv_row(self, il: int) -> int:
        return self.slot[il]

    def kv_layout(self):
        a = self.args
        return {"k": (self.n_full, 1, a.kv_lora_rank + a.qk_rope_head_dim)}, {"v": ("k", a.kv_lora_rank)}, frozenset()

    def state_layout(self) -> dict[str, tuple]:
        a = self.args
        H, d = a.linear_num_heads, a.linear_head_dim
        return {"delta": (self.n_lin, H, d, d), "conv": (self.n_lin, 3 * H * d, a.linear_conv_kernel_dim - 1)}

    def shapes(self):
        glob, attn_layer, expert = super().shapes()
        a = self.args
        D, H, d, K = a.hidden_size, a.linear_num_heads, a.linear_head_dim, a.linear_conv_kernel_dim
        Hd = H * d

        def per_layer(il):
            if a.layer_types[il] == self.FULL:
                return attn_layer(il)
            return {"in_norm": (D,), "post_norm": (D,), "q": (Hd, D), "k": (Hd, D), "v": (Hd, D),
                    **{c: (1, Hd, 1, K) if a.gguf_layout else (Hd, 1, K) for c in ("q_conv", "k_conv", "v_conv")},
                    "A_log": (1, 1, H, 1),
                    "dt_bias": (Hd,), "f_a": (d, D), "f_b": (Hd, d), "b_proj": (H, D), "g_a": (d, D), "g_b": (Hd, d),
                    "o_norm": (d,), "o": (D, Hd)} | self.mlp_shapes(il)

        return glob, per_layer, expert

    def load(self, src, experts=None, progress=None, precision=None, tables=None):
        super().load(src, experts, progress, precision, tables)
        for L in self.layers:
            if "q_conv" in L:  # a KDA layer: its three convolutions as one over q, k, v side by side
                convs = [L.pop(k) for k in ("q_conv", "k_conv", "v_conv")]
                K = self.args.linear_conv_kernel_dim
                L["conv"] = np.ascontiguousarray(np.concatenate([c.reshape(-1, K) for c in convs]))  # [3 Hd, K]
                L["A" if self.args.gguf_layout else "A_log"] = L.pop("A_log").reshape(-1)  # [H] (a GGUF file's: A)
        return self

    def decay(self, L: dict, f: np.ndarray) -> np.ndarray:
        # f [T, H, d] forget-gate logits (dt_bias added) -> the log decay per key channel
        A = L["A"] if "A" in L else -np.exp(L["A_log"])  # [H]
        return (A[None, :, None] * softplus(f)).astype(np.float32)

    def kda(self, L: dict, x: np.ndarray, step, il: int) -> np.ndarray:
        # x [T, D] (normed) -> [T, D]: projections, forget gate, write strength and output gate
        # over the whole step; the convolutions and the delta rule per sequence, on its own state
        a = self.args
        T, H, d = x.shape[0], a.linear_num_heads, a.linear_head_dim
        Hd = H * d
        mixed = np.ascontiguousarray(np.concatenate([linear(x, L["q"]), linear(x, L["k"]), linear(x, L["v"])], axis=1),
                                     dtype=np.float32)  # [T, 3 Hd]
        f = (linear(linear(x, L["f_a"]), L["f_b"]) + L["dt_bias"]).reshape(T, H, d)
        g = self.decay(L, f)  # [T, H, d] per key channel
        beta = sigmoid(linear(x, L["b_proj"]))  # [T, H]
        gate = linear(linear(x, L["g_a"]), L["g_b"]).reshape(T, H, d)
        conv = np.empty_like(mixed)
        core = np.empty((T, H, d), np.float32)
        scale, s = np.float32(1.0 / d**0.5), self.slot[il]
        for sg in step.segments:
            rows = slice(sg.start, sg.start + sg.n)
            short_conv(mixed[rows], L["conv"], sg.cache.state["conv"][s], conv[rows])
            q = l2norm(conv[rows, :Hd].reshape(sg.n, H, d), divide=True) * scale
            k = l2norm(conv[rows, Hd : 2 * Hd].reshape(sg.n, H, d), divide=True)
            v = np.ascontiguousarray(conv[rows, 2 * Hd :].reshape(sg.n, H, d))
            delta_rule(np.ascontiguousarray(q), np.ascontiguousarray(k), v, np.ascontiguousarray(g[rows]),
                             np.ascontiguousarray(beta[rows]), sg.cache.state["delta"][s], core[rows])
        out = rmsnorm(core, L["o_norm"], a.rms_norm_eps) * sigmoid(gate)  # the gated output norm, per head
        return linear(out.reshape(T, Hd), L["o"])

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        x = rmsnorm(h, L["in_norm"], a.rms_norm_eps)
        if a.layer_types[il] == self.FULL:
            h = h + self.attention(il, x, step)
        else:
            h = h + self.kda(L, x, step, il)
        return h + self.mlp(il, rmsnorm(h, L["post_norm"], a.rms_norm_eps), step)
