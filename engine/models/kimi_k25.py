"""Kimi K2.5 / K2.6 (`kimi_k25`): an image-text model whose text model is Kimi K2, that is
DeepSeek-V3 (deepseek_v3.py; its `text_config` may say `kimi_k2`). colibri runs the text
model and never reads the vision tower or its projector (left out of a container).

The weights come in two spellings: the hub's (`language_model.model.layers.*`,
`language_model.lm_head.weight`, `vision_tower.*`, `mm_projector.*`), which transformers
renames as it loads (to `model.language_model.*`, `lm_head.weight`), and what its
save_pretrained writes: the hub's names again, but its vision tower's `blocks` -> `layers`
rule, reversed, also names the text model's layers `language_model.model.blocks.*`.
spell() takes the one the checkpoint has. Whether
the output head is the embeddings is the image-text config's own `tie_word_embeddings`
(transformers ties by it; its default is true)."""

from ..model import text_config, wrapped_names
from . import deepseek_v3

MODEL_TYPE = "kimi_k25"
ALIASES = deepseek_v3.ALIASES
ModelArgs = deepseek_v3.ModelArgs
SPELLINGS = {  # the text model's prefixes, the output head
    "hub": ({"model.": "language_model.model."}, "language_model.lm_head.weight"),
    "saved": ({"model.layers.": "language_model.model.blocks.", "model.": "language_model.model."},
              "language_model.lm_head.weight"),
}


class Model(deepseek_v3.Model):
    MODEL_TYPE = MODEL_TYPE

    def __init__(self, args: ModelArgs, config: dict, where: str = "config.json"):
        args.tie_word_embeddings = bool(config.get("tie_word_embeddings", True))
        self.spelled("hub")
        super().__init__(args, text_config(config), where)

    def spelled(self, spelling: str) -> None:
        self.NAMES = wrapped_names(deepseek_v3.NAMES, *SPELLINGS[spelling])

    def spell(self, store) -> None:
        for spelling in SPELLINGS:  # told apart by the first layer's norm
            if store.has(wrapped_names(deepseek_v3.NAMES, *SPELLINGS[spelling])["in_norm"].format(il=0)):
                return self.spelled(spelling)
