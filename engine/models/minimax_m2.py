"""MiniMax-M2 (`minimax_m2`): Mixtral's layout (block_sparse_moe, experts w1/w3/w2, every
layer MoE, no shared expert) with q/k RMSNorm over the whole projection, partial rotary
(`rotary_dim`, or `partial_rotary_factor`), and a sigmoid router whose bias
(`e_score_correction_bias`) counts for the choice only; the weights are renormalised."""

from dataclasses import dataclass

from ..attention import AttnSpec
from ..layers import linear
from ..moe import sigmoid_top_k
from ..rope import Rope, rope_inv_freq
from . import mixtral

MODEL_TYPE = "minimax_m2"
ALIASES = mixtral.ALIASES


@dataclass
class ModelArgs(mixtral.ModelArgs):  # Mixtral's fields, MiniMax-M2's defaults, and rotary_dim
    intermediate_size: int = 1536
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 196608
    rotary_dim: int | None = None


NAMES = mixtral.NAMES | {"router_bias": "model.layers.{il}.block_sparse_moe.e_score_correction_bias"}


def route(logits, bias, n_expert_used):
    # logits [T, E] f32 -> ids [T, A], weights [T, A]: sigmoid, the bias for the choice only,
    # top-k, renormalised (moe.sigmoid_top_k with one group and no scaling)
    return sigmoid_top_k(logits, bias, n_expert_used, 1, 1, True, 1.0)


class Model(mixtral.Model):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    ROPE_DEFAULTS = {"rope_theta": 5e6, "rope_type": "default"}
    F32_KEYS = mixtral.Model.F32_KEYS | {"router_bias"}

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        super().__init__(args, config, where)
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps, qk_norm="full")
        self.window = 0

    def make_rope(self, params: dict) -> Rope:
        a = self.args
        if "partial_rotary_factor" not in params and a.rotary_dim:  # the released checkpoints' spelling
            params = params | {"partial_rotary_factor": a.rotary_dim / a.head_dim}
        return Rope(*rope_inv_freq(params, a.head_dim, a.max_position_embeddings))

    def shapes(self):
        glob, per_layer, per_expert = super().shapes()
        return glob, lambda il: per_layer(il) | {"router_bias": (self.n_expert,)}, per_expert

    def router(self, il, x):
        # x [T, D] -> ids, weights [T, A]
        L = self.layers[il]
        return route(linear(x, L["router"]), L["router_bias"], self.args.num_experts_per_tok)
