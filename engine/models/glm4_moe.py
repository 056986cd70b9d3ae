"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): grouped-query attention with partial rotary
(`partial_rotary_factor`), optional per-head q/k RMSNorm (`use_qk_norm`) and q/k/v biases;
the feed-forward half of DeepSeek-V3's layer as it is (deepseek_v3.GroupedMoE: the
grouped sigmoid router, shared experts, `first_k_dense_replace` dense layers). The
checkpoints' MTP layers (`model.layers.{num_hidden_layers}.*`) are never read and left out
of a container."""

from dataclasses import dataclass

from ..attention import AttnSpec, attention
from ..layers import rmsnorm
from ..model import HF_NAMES, MoEModel
from .deepseek_v3 import MOE_NAMES, GroupedMoE, check_grouped_moe

MODEL_TYPE = "glm4_moe"
ALIASES = {"n_routed_experts": ("num_local_experts",)}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_key_value_heads: int = 8
    head_dim: int | None = None
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        check_grouped_moe(self)


NAMES = HF_NAMES | MOE_NAMES


class Model(GroupedMoE, MoEModel):
    MODEL_TYPE = MODEL_TYPE
    NAMES = NAMES
    ROPE_DEFAULTS = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}  # half the head

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        self.attn_spec = AttnSpec(args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                                  args.rms_norm_eps, qk_norm="head" if args.use_qk_norm else "none")
        self.n_expert = args.n_routed_experts
        super().__init__(args, config, where)

    def shapes(self):
        a = self.args

        def per_layer(il):
            return self.attn_shapes(qkv_bias=a.attention_bias) | self.mlp_shapes(il)

        return self.global_shapes(), per_layer, self.expert_shapes(a.moe_intermediate_size)

    def block(self, il, h, step):
        # h [T, D] residual stream
        a, L = self.args, self.layers[il]
        h = h + attention(self.attn_spec, L, rmsnorm(h, L["in_norm"], a.rms_norm_eps), step, il)
        return h + self.mlp(il, rmsnorm(h, L["post_norm"], a.rms_norm_eps), step)
