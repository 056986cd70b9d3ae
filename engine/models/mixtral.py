"""Mixtral: softmax -> top-k -> always renormalised router, experts w1/w3/w2, optional
sliding-window attention on every layer."""

from dataclasses import dataclass

import numpy as np

from ..attention import AttnSpec, attention
from ..layers import linear, rmsnorm
from ..model import HF_NAMES, MoEModel, check_moe_args
from ..moe import moe, softmax_top_k

MODEL_TYPE = "mixtral"
ALIASES = {"num_local_experts": ("num_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8  # (transformers' default; null: num_attention_heads)
    head_dim: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        check_moe_args(self, self.num_local_experts)


NAMES = HF_NAMES | {
    "router": "model.layers.{il}.block_sparse_moe.gate.weight",
    "expert_gate": "model.layers.{il}.block_sparse_moe.experts.{ie}.w1.weight",
    "expert_up": "model.layers.{il}.block_sparse_moe.experts.{ie}.w3.weight",
    "expert_down": "model.layers.{il}.block_sparse_moe.experts.{ie}.w2.weight",
}


def route(logits: np.ndarray, n_expert_used: int) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids [T, A], weights [T, A]: softmax, top-k, renormalise over the k
    return softmax_top_k(logits, n_expert_used, renormalise=True)


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    INT_DENSE_KEYS = ("q", "k", "v", "o")  # the attention's matrices: only linear() reads them
    ROPE_DEFAULTS = {"rope_theta": 1e6, "rope_type": "default"}

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps)
        self.n_expert = args.num_local_experts
        self.window = args.sliding_window or 0
        super().__init__(args, config, where)

    def shapes(self):
        a = self.args

        def per_layer(il):
            return self.attn_shapes() | {"router": (a.num_local_experts, a.hidden_size)}

        return self.global_shapes(), per_layer, self.expert_shapes(a.intermediate_size)

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        return route(linear(x, self.layers[il]["router"]), self.args.num_experts_per_tok)

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        h = h + attention(self.attn_spec, L, rmsnorm(h, L["in_norm"], a.rms_norm_eps), step, il, self.window)
        x = rmsnorm(h, L["post_norm"], a.rms_norm_eps)
        ids, w = self.router(il, x)  # [T, A]
        return h + moe(x, ids, w, self.experts, il, step)
