"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3's layer (MLA, always with interleaved rotary;
the grouped sigmoid MoE, dense or sparse by `mlp_layer_types`) plus DeepSeek Sparse
Attention on every layer. The indexer is GLM-5's (glm_moe_dsa.py, which transformers
derives from this model) but for two things: every layer runs its own (no shared layers),
and it rotates its first qk_rope_head_dim dims as two halves, not interleaved pairs.

`layer_types` names every layer `indexed_attention`; the checkpoint's MTP layer
(`model.layers.{num_hidden_layers}.*`) is never read, as for V3."""

from dataclasses import dataclass

from ..model import require
from . import glm_moe_dsa

MODEL_TYPE = "deepseek_v32"
ALIASES = glm_moe_dsa.ALIASES


@dataclass
class ModelArgs(glm_moe_dsa.ModelArgs):  # GLM-5's fields with DeepSeek-V3.2's defaults
    intermediate_size: int = 18432
    max_position_embeddings: int = 163840
    q_lora_rank: int | None = 1536
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    rms_norm_eps: float = 1e-6
    index_n_heads: int = 64
    first_k_dense_replace: int = 3
    layer_types: list | None = None

    def __post_init__(self):
        n = self.num_hidden_layers
        self.layer_types = self.layer_types or ["indexed_attention"] * n
        require(len(self.layer_types) == n and set(self.layer_types) == {"indexed_attention"},
                "layer_types needs indexed_attention for every layer")
        self.indexer_types = ["full"] * n  # (no field of V3.2's: every layer chooses its own keys)
        super().__post_init__()


class Model(glm_moe_dsa.Model):
    MODEL_TYPE = MODEL_TYPE
    INDEXER_ROPE_INTERLEAVED = False
