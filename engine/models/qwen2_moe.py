"""Qwen2-MoE: q/k/v biases, routed experts plus a shared expert scaled by a sigmoid gate,
softmax -> top-k router (renormalised only with `norm_topk_prob`), dense MLP layers via
`mlp_only_layers` / `decoder_sparse_step`, sliding window on the layers `layer_types` says."""

from dataclasses import dataclass

import numpy as np

from ..attention import AttnSpec, attention
from ..layers import linear, rmsnorm, swiglu
from ..model import HF_NAMES, MoEModel, check_moe_args, require
from ..moe import moe, softmax_top_k

MODEL_TYPE = "qwen2_moe"
ALIASES = {"num_experts": ("num_local_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 5632
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_key_value_heads: int | None = 16  # (transformers' default; null: num_attention_heads)
    num_experts: int = 60
    num_experts_per_tok: int = 4
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    qkv_bias: bool = True
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.mlp_only_layers = self.mlp_only_layers or []
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (il + 1) % 2 and il < self.max_window_layers and self.use_sliding_window
                else "full_attention"
                for il in range(self.num_hidden_layers)
            ]
        require(len(self.layer_types) == self.num_hidden_layers, "layer_types needs one entry per layer")
        check_moe_args(self, self.num_experts)


NAMES = HF_NAMES | {
    "shared_gate": "model.layers.{il}.mlp.shared_expert_gate.weight",
    "shared_gate_proj": "model.layers.{il}.mlp.shared_expert.gate_proj.weight",
    "shared_up": "model.layers.{il}.mlp.shared_expert.up_proj.weight",
    "shared_down": "model.layers.{il}.mlp.shared_expert.down_proj.weight",
}


def route(logits: np.ndarray, n_expert_used: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids [T, A], weights [T, A]: softmax over all experts, top-k, renormalised if asked
    return softmax_top_k(logits, n_expert_used, norm_topk_prob)


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    INT_DENSE_KEYS = ("q", "k", "v", "o")  # the attention's matrices: only linear() reads them

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        hd = args.hidden_size // args.num_attention_heads
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, hd, args.rms_norm_eps)
        self.n_expert = args.num_experts
        window = args.sliding_window if args.use_sliding_window and args.sliding_window else 0
        self.windows = [window if t == "sliding_attention" else 0 for t in args.layer_types]
        super().__init__(args, config, where)

    def is_moe(self, il: int) -> bool:
        a = self.args
        return il not in a.mlp_only_layers and a.num_experts > 0 and (il + 1) % a.decoder_sparse_step == 0

    def shapes(self):
        a = self.args
        D, I, S = a.hidden_size, a.intermediate_size, a.shared_expert_intermediate_size

        def per_layer(il):
            s = self.attn_shapes(qkv_bias=a.qkv_bias)
            if self.is_moe(il):
                return s | {"router": (a.num_experts, D), "shared_gate": (1, D),
                            "shared_gate_proj": (S, D), "shared_up": (S, D), "shared_down": (D, S)}
            return s | {"gate": (I, D), "up": (I, D), "down": (D, I)}

        return self.global_shapes(), per_layer, self.expert_shapes(a.moe_intermediate_size)

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        return route(linear(x, self.layers[il]["router"]), self.args.num_experts_per_tok, self.args.norm_topk_prob)

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        h = h + attention(self.attn_spec, L, rmsnorm(h, L["in_norm"], a.rms_norm_eps), step, il, self.windows[il])
        x = rmsnorm(h, L["post_norm"], a.rms_norm_eps)
        if not self.is_moe(il):
            return h + swiglu(x, L["gate"], L["up"], L["down"])
        ids, w = self.router(il, x)  # [T, A]
        shared = swiglu(x, L["shared_gate_proj"], L["shared_up"], L["shared_down"])  # [T, D]
        gate = 1.0 / (1.0 + np.exp(-linear(x, L["shared_gate"])))  # [T, 1]
        return h + moe(x, ids, w, self.experts, il, step) + gate * shared
