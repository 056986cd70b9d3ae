"""Qwen3-MoE: per-head q/k RMSNorm, softmax -> top-k router with optional renormalisation
(`norm_topk_prob`), dense MLP layers via `mlp_only_layers` / `decoder_sparse_step`."""

from dataclasses import dataclass

import numpy as np

from ..attention import AttnSpec, attention
from ..layers import linear, rmsnorm, swiglu
from ..model import HF_NAMES, MoEModel, check_moe_args
from ..moe import moe, softmax_top_k

MODEL_TYPE = "qwen3_moe"
ALIASES = {"num_local_experts": ("num_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_key_value_heads: int | None = 4  # (transformers' default; null: num_attention_heads)
    head_dim: int | None = None
    num_local_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = self.mlp_only_layers or []
        check_moe_args(self, self.num_local_experts)




def route(logits: np.ndarray, n_expert_used: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids [T, A], weights [T, A]: softmax over all experts, top-k, renormalised if asked
    return softmax_top_k(logits, n_expert_used, norm_topk_prob)


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = HF_NAMES
    INT_DENSE_KEYS = ("q", "k", "v", "o")  # the attention's matrices: only linear() reads them

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps, qk_norm="head")
        self.n_expert = args.num_local_experts
        self.window = args.sliding_window if args.use_sliding_window and args.sliding_window else 0
        super().__init__(args, config, where)

    def is_moe(self, il: int) -> bool:
        a = self.args
        return il not in a.mlp_only_layers and a.num_local_experts > 0 and (il + 1) % a.decoder_sparse_step == 0

    def shapes(self):
        a = self.args
        D, I = a.hidden_size, a.intermediate_size

        def per_layer(il):
            s = self.attn_shapes(a.attention_bias, a.attention_bias)
            if self.is_moe(il):
                return s | {"router": (a.num_local_experts, D)}
            return s | {"gate": (I, D), "up": (I, D), "down": (D, I)}

        return self.global_shapes(), per_layer, self.expert_shapes(a.moe_intermediate_size)

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        return route(linear(x, self.layers[il]["router"]), self.args.num_experts_per_tok, self.args.norm_topk_prob)

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        h = h + attention(self.attn_spec, L, rmsnorm(h, L["in_norm"], a.rms_norm_eps), step, il, self.window)
        x = rmsnorm(h, L["post_norm"], a.rms_norm_eps)
        if not self.is_moe(il):
            return h + swiglu(x, L["gate"], L["up"], L["down"])
        ids, w = self.router(il, x)  # [T, A]
        return h + moe(x, ids, w, self.experts, il, step)
