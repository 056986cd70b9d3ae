"""Qwen3.5 / 3.6 MoE (`qwen3_5_moe`, its text model `qwen3_5_moe_text`): Qwen3-Next's hybrid
(qwen3_next.py) with the linear layers' projections apart (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`), every layer MoE, and the router's top-k always renormalised.

The hub ships these models as an image-text model (`Qwen3_5MoeForConditionalGeneration`):
config.json holds the text model's config under `text_config` and its weights under
`model.language_model.`; colibri runs the text model, and never reads the vision tower
(`model.visual.*`, left out of a container). For text, the multimodal rotary embedding is
the ordinary one: its three position rows are the same token position."""

from dataclasses import dataclass

from ..layers import linear
from ..model import text_config, wrapped_names
from . import qwen3_next

MODEL_TYPE = "qwen3_5_moe"
ALIASES = {"num_experts": ("num_local_experts",)}
LANGUAGE_MODEL = "model.language_model."  # the text model's weights in the image-text checkpoint


@dataclass
class ModelArgs(qwen3_next.ModelArgs):
    # Qwen3_5MoeTextConfig's fields are Qwen3-Next's but for these defaults; it has no dense
    # layers (intermediate_size, mlp_only_layers, decoder_sparse_step are never read) and its
    # router always renormalises (norm_topk_prob stays True)
    num_experts: int = 256
    num_experts_per_tok: int = 8


LIN = qwen3_next.LIN
NAMES = {k: v for k, v in qwen3_next.NAMES.items() if k not in ("lin_qkvz", "lin_ba")} | {
    "lin_qkv": LIN + "in_proj_qkv.weight",
    "lin_z": LIN + "in_proj_z.weight",
    "lin_b": LIN + "in_proj_b.weight",
    "lin_a": LIN + "in_proj_a.weight",
}


class Model(qwen3_next.Model):
    MODEL_TYPE = MODEL_TYPE

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        wrapped = text_config(config) is not config
        # the image-text checkpoint keeps the text model one level down (the output head stays),
        # and its own config says whether the head is the embeddings (transformers ties by it)
        self.NAMES = wrapped_names(NAMES, {"model.": LANGUAGE_MODEL}) if wrapped else NAMES
        if wrapped:
            args.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        super().__init__(args, text_config(config), where)

    def is_moe(self, il: int) -> bool:
        return self.args.num_experts > 0

    def projection_shapes(self) -> dict:
        D, Hv = self.args.hidden_size, self.args.linear_num_value_heads
        return {"lin_qkv": (2 * self.key_dim + self.value_dim, D), "lin_z": (self.value_dim, D), "lin_b": (Hv, D),
                "lin_a": (Hv, D)}

    def projections(self, L: dict, x):
        # x [T, D] -> (q, k, v [T, 2 key_dim + value_dim], z [T, value_dim], b, a [T, Hv]): each its own projection
        return linear(x, L["lin_qkv"]), linear(x, L["lin_z"]), linear(x, L["lin_b"]), linear(x, L["lin_a"])
