"""The families: every module of engine/models/, named after the `model_type` of
config.json, plus a small alias dict for names that share a file."""

import importlib
import logging
import os
import pkgutil

from ..storage.checkpoint import load_config, open_checkpoint
from ..storage.container import ContainerInvalid
from ..storage.errors import ColibriError, ConfigInvalid, UnsupportedModelType
from .model import MoEModel, parse_args

log = logging.getLogger("colibri.engine")
MODEL_REMAPPING: dict[str, str] = {}  # model_type -> family file, where a name shares another's code


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
    args = parse_args(fam.ModelArgs, cfg, getattr(fam, "ALIASES", None), where=where)
    return fam.Model(args, cfg, where)


def open_model_files(path: str, tokenizer: bool = False, report=None):
    """Every check that loading makes before it reads a weight, in loading's order (colictl
    doctor runs the same): the config and its family (`model`), the container's manifest
    and index against the config or the checkpoint's files (`container` / `checkpoint`),
    every dense tensor with its shape (`dense`), and with `tokenizer` the tokenizer and
    chat template (`tokenizer`). `report(name, detail)` hears each check that passed.
    Returns (config dict, model without weights, the Container or Checkpoint).

    Raises the storage errors (ModelNotFound, ConfigMissing, ConfigInvalid, header and
    tensor errors, ContainerInvalid), UnsupportedModelType, TokenizerMissing; each carries
    `check`, the name of the check that failed."""
    from ..storage.container import is_container, open_container

    report = report or (lambda name, detail: None)
    name = "model"
    try:
        cfg = load_config(path)
        model = build_model(path, cfg)
        report(name, f"{path}: {model.MODEL_TYPE}, {model.n_layer} layers, {model.n_expert} experts per MoE layer")
        if is_container(path):
            name = "container"
            store = open_container(path)
            p = store.precision()
            report(name, f"format v{store.manifest['version']}, {len(store.records)} expert records of "
                         f"{store.record_bytes / 2**20:.2f} MiB in {len({x.file for x in store.records.values()})} "
                         f"files, dense {p['dense']}, experts {p['experts']}{' (lossy)' if p['lossy'] else ''}")
            name = "index"
            if store.moe_layers != model.moe_layers or store.n_expert != model.n_expert:
                raise ContainerInvalid(f"{path}: the manifest's experts do not match config.json")
            store.check_index(model.moe_layers, model.n_expert)
            report(name, f"every expert of {len(model.moe_layers)} MoE layers indexed once, records aligned to "
                         "4 KiB and inside their files")
            name = "dense"
            model.check(store.dense, with_experts=False)
            report(name, "dense.safetensors has every dense tensor, with the shapes config.json implies")
        else:
            name = "checkpoint"
            store = open_checkpoint(path)
            model.check(store)
            size = sum(sf.file_bytes for sf in store.files.values())
            report(name, f"{len(store.files)} safetensors file(s), {size / 2**30:.2f} GiB, every tensor present with "
                         "the shape its config implies (experts all resident: no budget)")
        if tokenizer:
            from .tokenizer import Tokenizer

            name = "tokenizer"
            tok = Tokenizer(path)
            report(name, "tokenizer.json loads" + ("" if tok.chat_template else
                                                   "; no chat template (--chat and colictl chat will not work)"))
    except ColibriError as e:
        e.check = name
        raise
    return cfg, model, store


def default_budget(container) -> int:
    """Without --expert-cache: every expert if that fits in half the available memory, else that half."""
    import psutil

    return max(min(container.expert_bytes, psutil.virtual_memory().available // 2), 1)


def load_model(path: str, budget: int | str | None = None, io_threads: int = 2, direct: bool = True,
               mlock: bool = False, trace=None, hugetlb: bool = False, prefetch: int | None = None,
               policy=None, state_dir: str | None = None, history_read_only: bool = False,
               history_half_life: float | None = None, verify: str = "first", mirror: str | None = None,
               progress=None) -> MoEModel:
    """Open a model directory (a Hugging Face checkpoint or a colibri container), check it
    fully and load it. A checkpoint's experts are all read into RAM; a container's are
    streamed through an expert cache of `budget` bytes ("min", "all", or None for the
    default) run by `policy` (storage/policy.py; None: the default, `learned`). Its usage
    history is kept in `state_dir`/history (None: in memory only) under the container's
    fingerprint, and the learned hot set is read from it now. `trace`, a text file,
    receives the routing trace. `prefetch` (None: the policy's) > 0 turns on the router
    lookahead with at most that many reads started ahead per layer. `verify` (first,
    always, off) checks expert reads against the manifest's checksums; `mirror`, a
    directory with copies of the expert files, is read when the primary fails. The
    debug setting COLIBRI_FAULTS (storage/faults.py) injects read faults. `progress(phase,
    done, total)` hears each dense tensor and each expert of the warm start.

    Raises the storage errors (ModelNotFound, ConfigMissing, ConfigInvalid, header and
    tensor errors, ContainerInvalid), UnsupportedModelType, BudgetInvalid.
    """
    from dataclasses import replace

    from ..storage.cache import BudgetInvalid, ExpertCache
    from ..storage.container import is_container
    from ..storage.experts import TracedSource
    from ..storage.faults import FaultPlan
    from ..storage.history import DEFAULT_HALF_LIFE, UsageHistory, history_path
    from ..storage.policy import Policy

    _, model, store = open_model_files(path)
    if is_container(path):
        c = store
        policy = policy or Policy()
        if prefetch is not None:
            policy = replace(policy, prefetch_reads=prefetch)
        history = UsageHistory(c.moe_layers, c.n_expert, c.fingerprint,
                               history_path(state_dir, c.fingerprint) if state_dir else None,
                               history_half_life or DEFAULT_HALF_LIFE, history_read_only)
        faults = FaultPlan.parse(os.environ.get("COLIBRI_FAULTS"))
        if faults:
            log.warning("COLIBRI_FAULTS is set: expert reads fail on purpose (%s)", os.environ["COLIBRI_FAULTS"])
        experts = ExpertCache(c, default_budget(c) if budget is None else budget, io_threads, direct, mlock, hugetlb,
                              top_k=model.args.num_experts_per_tok, policy=policy, history=history, verify=verify,
                              mirror=mirror, faults=faults)
        model.container = c
        model.load(c.dense, TracedSource(experts, trace) if trace else experts, progress)
        model.prefetch_reads = policy.prefetch_reads
        experts.warm_start(progress)
        return model
    if budget is not None:
        raise BudgetInvalid(f"{path} is a Hugging Face checkpoint; an expert budget needs a container: "
                            f"colictl convert {path} DST, then run --model DST")
    model.load(store, progress=progress)
    if trace:
        model.experts = TracedSource(model.experts, trace)
    return model
