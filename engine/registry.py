"""The families: every module of engine/models/, named after the `model_type` of
config.json, plus a small alias dict for names that share a file. `build_model` is what
storage/placement.py calls to learn a model's structure before it places the weights."""

import importlib
import pkgutil

from ..storage.errors import ConfigInvalid, UnsupportedModelType
from .model import MoEModel, parse_args

# model_type -> family file, where a name shares another's code
MODEL_REMAPPING: dict[str, str] = {"kimi_k2": "deepseek_v3", "qwen3_5_moe_text": "qwen3_5_moe",
                                   "inkling2_text": "inkling2", "glm5_next_text": "glm5_next",
                                   "qwen4_exp_text": "qwen4_exp"}


def supported() -> list[str]:
    """The model_type names colibri implements: the modules of the families folder."""
    from . import models

    here = [m.name for m in pkgutil.iter_modules(models.__path__) if not m.name.startswith("_")]
    return sorted(set(here) | set(MODEL_REMAPPING))


def family(model_type) -> object:
    """The family module for a model_type. Raises UnsupportedModelType listing the supported ones."""
    name = MODEL_REMAPPING.get(model_type, model_type)
    if not isinstance(name, str) or name not in supported():
        raise UnsupportedModelType(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported())}"
        )
    return importlib.import_module(f"{__package__}.models.{name}")


def build_model(path: str, cfg: dict) -> MoEModel:
    """The model's structure from its config (no weights). Raises ConfigInvalid,
    UnsupportedModelType."""
    if "model_type" not in cfg:
        raise ConfigInvalid(f"{path}/config.json: no model_type")
    fam = family(cfg["model_type"])
    where = f"{path}/config.json"
    # an image-text model's family reads its text model's config (fam.text_config)
    text = fam.text_config(cfg) if hasattr(fam, "text_config") else cfg
    args = parse_args(fam.ModelArgs, text, getattr(fam, "ALIASES", None), where=where)
    return fam.Model(args, cfg, where)
