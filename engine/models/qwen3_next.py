"""Qwen3-Next (`qwen3_next`): a hybrid. Its `layer_types` interleave linear-attention
layers (Gated DeltaNet: a fixed-size recurrent state per value head, engine/recurrent.py)
with full-attention layers (grouped-query attention with per-head q/k norm, partial rotary
and a sigmoid output gate from the q projection). Every RMSNorm but the gated one scales by
(1 + w). MoE: softmax top-k (renormalised with `norm_topk_prob`) plus a shared expert
scaled by a sigmoid gate; dense MLP layers via `mlp_only_layers` / `decoder_sparse_step`.

A sequence keeps KV blocks for the full layers only, and for each linear layer its state
[value heads, key dim, value dim] and the short convolution's last inputs (state_layout)."""

from dataclasses import dataclass

import numpy as np

from ..attention import AttnSpec, attention
from ..layers import linear, rmsnorm, swiglu
from ..model import HF_NAMES, MoEModel, check_moe_args, require
from ..moe import moe, softmax_top_k
from ..recurrent import delta_rule, l2norm, layer_slots, short_conv, sigmoid, softplus

MODEL_TYPE = "qwen3_next"
ALIASES = {"num_experts": ("num_local_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 5632
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_key_value_heads: int = 2
    head_dim: int = 256
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    layer_types: list | None = None
    full_attention_interval: int = 4  # (the hub's spelling of layer_types: every n-th layer full)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # a GGUF file's layout (storage/gguf.py), as llama.cpp's converter wrote it: in_proj_qkvz
    # split into qkv and z, the (1 + w) norms stored as 1 + w, A_log as A = -exp(A_log), the
    # convolution squeezed to [C, K]; `v_heads_tiled` (Qwen3.5's): the value heads in tiled
    # order (value head h reads key head h % Hk, not h // (Hv / Hk))
    gguf_layout: bool = False
    v_heads_tiled: bool = False

    def __post_init__(self):
        self.mlp_only_layers = self.mlp_only_layers or []
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = ["linear_attention" if (il + 1) % n else "full_attention"
                                for il in range(self.num_hidden_layers)]
        require(len(self.layer_types) == self.num_hidden_layers, "layer_types needs one entry per layer")
        require(set(self.layer_types) <= {"linear_attention", "full_attention"},
                "layer_types entries must be linear_attention or full_attention")
        require(self.linear_num_value_heads % self.linear_num_key_heads == 0,
                "linear_num_value_heads must be a multiple of linear_num_key_heads")
        require(self.linear_conv_kernel_dim >= 1, "linear_conv_kernel_dim must be positive")
        check_moe_args(self, self.num_experts)


LIN = "model.layers.{il}.linear_attn."
NAMES = HF_NAMES | {
    "lin_qkvz": LIN + "in_proj_qkvz.weight",
    "lin_ba": LIN + "in_proj_ba.weight",
    "conv": LIN + "conv1d.weight",
    "dt_bias": LIN + "dt_bias",
    "A_log": LIN + "A_log",
    "lin_norm": LIN + "norm.weight",
    "lin_out": LIN + "out_proj.weight",
    "shared_gate": "model.layers.{il}.mlp.shared_expert_gate.weight",
    "shared_gate_proj": "model.layers.{il}.mlp.shared_expert.gate_proj.weight",
    "shared_up": "model.layers.{il}.mlp.shared_expert.up_proj.weight",
    "shared_down": "model.layers.{il}.mlp.shared_expert.down_proj.weight",
}
ONE_PLUS = ("in_norm", "post_norm", "q_norm", "k_norm")  # per-layer norms that scale by (1 + w), as `norm`


def route(logits: np.ndarray, n_expert_used: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids [T, A], weights [T, A]: softmax over all experts, top-k, renormalised if asked
    return softmax_top_k(logits, n_expert_used, norm_topk_prob)


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    KERNEL_GROUPS = ("recurrent",)  # (jit.family_warm: kernels of its own, compiled before its first step)
    NAMES = NAMES
    ATTENTION = "hybrid: Gated DeltaNet + GQA"
    ROPE_DEFAULTS = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25}
    F32_KEYS = MoEModel.F32_KEYS | {"conv", "dt_bias", "A_log", "lin_norm"}
    # the matrices only linear() reads (swiglu's too, for the dense and shared experts' MLPs):
    # what --dense-dtype int8/int4 quantizes; the Gated DeltaNet's projections are most of them
    INT_DENSE_KEYS = ("q", "k", "v", "o", "lin_qkvz", "lin_ba", "lin_qkv", "lin_z", "lin_b", "lin_a", "lin_out",
                      "gate", "up", "down", "shared_gate_proj", "shared_up", "shared_down")

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps, qk_norm="head", output_gate=True)
        self.n_expert = args.num_experts
        self.slot, self.n_full, self.n_lin = layer_slots(args.layer_types)  # a layer's row in the cache
        Hk, Hv = args.linear_num_key_heads, args.linear_num_value_heads
        dk, dv, r = args.linear_key_head_dim, args.linear_value_head_dim, Hv // Hk
        self.key_dim, self.value_dim = Hk * dk, Hv * dv
        # in_proj_qkvz's rows come per key head as [q dk, k dk, v r*dv, z r*dv], in_proj_ba's
        # as [b r, a r]: the columns of each part in head order
        group, cols = 2 * dk + 2 * r * dv, np.arange(Hk)[:, None]

        def part(width: int, lo: int, size: int) -> np.ndarray:  # columns lo .. lo + size of every group
            return (cols * width + lo + np.arange(size)[None, :]).reshape(-1)

        self.cols = {"q": part(group, 0, dk), "k": part(group, dk, dk), "v": part(group, 2 * dk, r * dv),
                     "z": part(group, 2 * dk + r * dv, r * dv), "b": part(2 * r, 0, r), "a": part(2 * r, r, r)}
        if args.gguf_layout and "lin_qkvz" in self.NAMES:  # (the split projections under HF's names)
            self.NAMES = {k: v for k, v in self.NAMES.items() if k != "lin_qkvz"} | {
                "lin_qkv": LIN + "in_proj_qkv.weight", "lin_z": LIN + "in_proj_z.weight"}
        super().__init__(args, config, where)

    def is_moe(self, il: int) -> bool:
        a = self.args
        return il not in a.mlp_only_layers and a.num_experts > 0 and (il + 1) % a.decoder_sparse_step == 0

    def shapes(self):
        a = self.args
        D, S = a.hidden_size, a.shared_expert_intermediate_size
        Hv, K = a.linear_num_value_heads, a.linear_conv_kernel_dim
        conv_dim = 2 * self.key_dim + self.value_dim

        def per_layer(il):
            if a.layer_types[il] == "full_attention":
                s = self.attn_shapes(a.attention_bias, a.attention_bias)
            else:
                s = {"in_norm": (D,), "post_norm": (D,), **self.projection_shapes(),
                     "conv": (conv_dim, K) if a.gguf_layout else (conv_dim, 1, K),
                     "dt_bias": (Hv,), "A_log": (Hv,), "lin_norm": (a.linear_value_head_dim,),
                     "lin_out": (D, self.value_dim)}
            if self.is_moe(il):
                return s | {"router": (a.num_experts, D), "shared_gate": (1, D),
                            "shared_gate_proj": (S, D), "shared_up": (S, D), "shared_down": (D, S)}
            I = a.intermediate_size  # (a dense layer: never in Qwen3.5, whose layers are all MoE)
            return s | {"gate": (I, D), "up": (I, D), "down": (D, I)}

        return self.global_shapes(), per_layer, self.expert_shapes(a.moe_intermediate_size)

    def projection_shapes(self) -> dict:
        D, Hv = self.args.hidden_size, self.args.linear_num_value_heads
        if self.args.gguf_layout:
            return {"lin_qkv": (2 * self.key_dim + self.value_dim, D), "lin_z": (self.value_dim, D),
                    "lin_ba": (2 * Hv, D)}
        return {"lin_qkvz": (2 * self.key_dim + 2 * self.value_dim, D), "lin_ba": (2 * Hv, D)}

    def load(self, *args, **kwargs):
        super().load(*args, **kwargs)
        one = np.float32(0.0 if self.args.gguf_layout else 1.0)  # (a GGUF file stores 1 + w)
        self.glob["norm"] = self.glob["norm"] + one  # (1 + w), computed once in float32 as transformers does
        for L in self.layers:
            for key in ONE_PLUS:
                if key in L:
                    L[key] = L[key] + one
            if "A_log" in L and self.args.gguf_layout:
                L["A"] = L.pop("A_log")  # (a GGUF file's is A itself)
            if "conv" in L:
                L["conv"] = np.ascontiguousarray(L["conv"].reshape(L["conv"].shape[0], -1))  # [C, K]
        return self

    def kv_layout(self):
        sp = self.attn_spec
        return {"k": (self.n_full, sp.n_kv_head, sp.head_dim), "v": (self.n_full, sp.n_kv_head, sp.hv)}, {}, \
            frozenset()

    def state_layout(self) -> dict[str, tuple]:
        a = self.args
        conv_dim = 2 * self.key_dim + self.value_dim
        return {"delta": (self.n_lin, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim),
                "conv": (self.n_lin, conv_dim, a.linear_conv_kernel_dim - 1)}

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        return route(linear(x, self.layers[il]["router"]), self.args.num_experts_per_tok, self.args.norm_topk_prob)

    def projections(self, L: dict, x: np.ndarray) -> tuple:
        # x [T, D] -> (q, k, v side by side [T, 2 key_dim + value_dim], z [T, value_dim], b, a
        # [T, Hv]): in_proj_qkvz and in_proj_ba, their columns taken apart by head
        c = self.cols
        ba = linear(x, L["lin_ba"])
        if "lin_qkv" in L:  # (a GGUF file's: q, k, v by head already, z apart)
            return linear(x, L["lin_qkv"]), linear(x, L["lin_z"]), ba[:, c["b"]], ba[:, c["a"]]
        qkvz = linear(x, L["lin_qkvz"])
        mixed = np.concatenate([qkvz[:, c["q"]], qkvz[:, c["k"]], qkvz[:, c["v"]]], axis=1)
        return mixed, qkvz[:, c["z"]], ba[:, c["b"]], ba[:, c["a"]]

    def output_gate(self, z: np.ndarray) -> np.ndarray:
        # the gated norm's activation of z: SiLU
        return z * sigmoid(z)

    def gated_delta_net(self, L: dict, x: np.ndarray, step, il: int) -> np.ndarray:
        # x [T, D] (normed) -> [T, D]: the projections over the whole step, the convolution and
        # the delta rule per sequence, on its own state
        a = self.args
        T = x.shape[0]
        Hk, Hv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
        mixed, z, b, a_ = self.projections(L, x)
        mixed = np.ascontiguousarray(mixed, dtype=np.float32)  # [T, conv_dim]
        z = z.reshape(T, Hv, dv)
        beta = sigmoid(b)  # [T, Hv]
        A = L["A"] if "A" in L else -np.exp(L["A_log"])  # [Hv]
        g = (A * softplus(a_ + L["dt_bias"])).astype(np.float32)  # [T, Hv]
        conv = np.empty_like(mixed)  # [T, conv_dim]
        core = np.empty((T, Hv, dv), np.float32)
        s = self.slot[il]
        for sg in step.segments:
            rows = slice(sg.start, sg.start + sg.n)
            short_conv(mixed[rows], L["conv"], sg.cache.state["conv"][s], conv[rows])
            q = l2norm(conv[rows, : self.key_dim].reshape(sg.n, Hk, dk)) / np.float32(dk**0.5)
            k = l2norm(conv[rows, self.key_dim : 2 * self.key_dim].reshape(sg.n, Hk, dk))
            if a.v_heads_tiled and Hv != Hk:  # value head h reads key head h % Hk: each its own copy
                q, k = np.tile(q, (1, Hv // Hk, 1)), np.tile(k, (1, Hv // Hk, 1))
            v = np.ascontiguousarray(conv[rows, 2 * self.key_dim :].reshape(sg.n, Hv, dv))
            delta_rule(np.ascontiguousarray(q), np.ascontiguousarray(k), v, np.ascontiguousarray(g[rows, :, None]),
                             np.ascontiguousarray(beta[rows]), sg.cache.state["delta"][s], core[rows])
        out = rmsnorm(core, L["lin_norm"], a.rms_norm_eps) * self.output_gate(z)  # the gated norm, per value head
        return linear(out.reshape(T, Hv * dv), L["lin_out"])

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        x = rmsnorm(h, L["in_norm"], a.rms_norm_eps)
        if a.layer_types[il] == "full_attention":
            h = h + attention(self.attn_spec, L, x, step, self.slot[il])
        else:
            h = h + self.gated_delta_net(L, x, step, il)
        x = rmsnorm(h, L["post_norm"], a.rms_norm_eps)
        if not self.is_moe(il):
            return h + swiglu(x, L["gate"], L["up"], L["down"])
        ids, w = self.router(il, x)  # [T, A]
        shared = swiglu(x, L["shared_gate_proj"], L["shared_up"], L["shared_down"])  # [T, D]
        return h + moe(x, ids, w, self.experts, il, step) + sigmoid(linear(x, L["shared_gate"])) * shared
