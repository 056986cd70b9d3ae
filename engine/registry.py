"""The families: every module of this folder with a `Model` class, named after the
`model_type` of config.json, plus a small alias dict for names that share a file."""

import importlib
import pkgutil
from pathlib import Path

from ..storage.checkpoint import load_config, open_checkpoint
from ..storage.errors import ConfigInvalid, UnsupportedModelType
from .model import MoEModel, parse_args

MODEL_REMAPPING: dict[str, str] = {}  # model_type -> family file, where a name shares another's code
_NOT_FAMILIES = {"kernels", "layers", "model", "registry", "generate", "tokenizer", "demo", "errors", "sampling"}


def supported() -> list[str]:
    """The model_type names colibri implements."""
    here = [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name not in _NOT_FAMILIES]
    return sorted(set(here) | set(MODEL_REMAPPING))


def family(model_type) -> object:
    """The family module for a model_type. Raises UnsupportedModelType listing the supported ones."""
    name = MODEL_REMAPPING.get(model_type, model_type)
    if not isinstance(name, str) or name not in supported():
        raise UnsupportedModelType(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported())}"
        )
    return importlib.import_module(f"{__package__}.{name}")


def load_model(path: str) -> MoEModel:
    """Open a model directory, check it fully, and load it (all experts resident).

    Raises the storage errors (ModelNotFound, ConfigMissing, ConfigInvalid, header and
    tensor errors) and UnsupportedModelType.
    """
    cfg = load_config(path)
    if "model_type" not in cfg:
        raise ConfigInvalid(f"{path}/config.json: no model_type")
    fam = family(cfg["model_type"])
    where = f"{path}/config.json"
    args = parse_args(fam.ModelArgs, cfg, getattr(fam, "ALIASES", None), where=where)
    model = fam.Model(args, cfg, where)
    return model.load(open_checkpoint(path))
