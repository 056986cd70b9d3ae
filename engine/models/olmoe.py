"""OLMoE: q/k RMSNorm over the whole projection (before the head split), optional
`clip_qkv`, softmax -> top-k router renormalised only with `norm_topk_prob`."""

from dataclasses import dataclass

import numpy as np

from ..attention import AttnSpec, attention
from ..layers import linear, rmsnorm
from ..model import HF_NAMES, MoEModel, check_moe_args
from ..moe import moe, softmax_top_k

MODEL_TYPE = "olmoe"
ALIASES = {"num_experts": ("num_local_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 2048
    num_key_value_heads: int | None = None
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    clip_qkv: float | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        check_moe_args(self, self.num_experts)


def route(logits: np.ndarray, n_expert_used: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    # logits [T, E] -> ids [T, A], weights [T, A]: softmax over all experts, top-k, renormalised if asked
    return softmax_top_k(logits, n_expert_used, norm_topk_prob)


class Model(MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = HF_NAMES
    INT_DENSE_KEYS = ("q", "k", "v", "o")  # the attention's matrices: only linear() reads them

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        hd = args.hidden_size // args.num_attention_heads
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, hd, args.rms_norm_eps,
                                  qk_norm="full", clip_qkv=args.clip_qkv)
        self.n_expert = args.num_experts
        super().__init__(args, config, where)

    def shapes(self):
        a = self.args

        def per_layer(il):
            return self.attn_shapes(a.attention_bias, a.attention_bias) | {"router": (a.num_experts, a.hidden_size)}

        return self.global_shapes(), per_layer, self.expert_shapes(a.intermediate_size)

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        return route(linear(x, self.layers[il]["router"]), self.args.num_experts_per_tok, self.args.norm_topk_prob)

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        h = h + attention(self.attn_spec, L, rmsnorm(h, L["in_norm"], a.rms_norm_eps), step, il)
        x = rmsnorm(h, L["post_norm"], a.rms_norm_eps)
        ids, w = self.router(il, x)  # [T, A]
        return h + moe(x, ids, w, self.experts, il, step)
