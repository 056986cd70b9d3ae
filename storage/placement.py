"""Placement: where a model's weights live while it runs, put together in one place.

`open_model(path, placement, build)` opens a Hugging Face checkpoint, a GGUF file or a
colibri container, checks it fully (the same checks `colictl doctor` reports, in the same
order), and places it: the dense weights resident, the routed experts either all
resident (a safetensors checkpoint) or behind the expert cache (a container, a GGUF file:
gguf_experts.py) with its policy, usage history, reader, drives and fault drills.
`colictl run` and the daemon both call it.

Storage knows no model family: `build(path, config)` is the engine's registry, and the
model it returns offers what placement needs (ModelShape). The engine then sees only the
ExpertSource protocol (experts.py); the runtime control of the cache (resize, pins,
policy, history) is the separate `control`, None when every expert is resident.

`colictl plan` takes its experts here too: `sample_experts` (a resident sample, in the
precision the model would run in) and `resident_cache` (every expert behind the real cache).
"""

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TextIO

import numpy as np

from .cache import ExpertCache
from .checkpoint import load_config, open_checkpoint
from .container import Container, ContainerInvalid, is_container, open_container
from .convert import expert_values
from .errors import BudgetInvalid, ColibriError
from .experts import ExpertSource, TracedSource
from .faults import FaultPlan
from .formats import QUANT_DTYPES
from .gguf import is_gguf
from .gguf_experts import GGUFExperts
from .history import DEFAULT_HALF_LIFE, UsageHistory, history_path
from .memory import MemoryRoom
from .policy import Policy
from .quant import from_record
from .sizes import fmt_bytes
from .slots import budget_bytes
from .tables import TableCache, streamed_table_bytes

log = logging.getLogger("colibri.storage")


class ModelShape(Protocol):
    """What placement needs of a model (the engine's MoEModel)."""

    MODEL_TYPE: str
    ATTENTION: str  # the attention kind (GQA, MLA), for doctor and run
    n_layer: int
    moe_layers: list[int]
    n_expert: int
    n_expert_used: int  # top-k: the cache keeps at least this many slots per layer

    def expert_names(self, il: int, ie: int) -> tuple[str, ...]: ...

    def source(self, checkpoint): ...

    def spell(self, store) -> None: ...

    def check(self, src, with_experts: bool = True) -> None: ...

    def kv_bytes_per_token(self) -> int: ...

    def state_bytes_per_sequence(self) -> int: ...

    def load(self, src, experts: ExpertSource | None = None, progress=None, precision: dict | None = None): ...


class CacheControl(Protocol):
    """What an operator may change while a container's model runs (call between steps)."""

    policy: Policy

    def resize(self, budget: int | str, pinned_bytes: int | str | None = None) -> dict: ...

    def set_policy(self, policy: Policy) -> dict: ...

    def pin(self, il: int, ie: int) -> None: ...

    def unpin(self, il: int, ie: int) -> None: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class Placement:
    """How to place a model: colictl run's flags and colibrid's configuration.

    `budget`: the expert cache in bytes, "min", "all", or None for the default (every
    expert if that fits in half the available memory, else that half); a checkpoint takes
    no budget. `policy`: storage/policy.py (None: `learned`); `prefetch` overrides its
    prefetch_reads. The usage history lives in `state_dir`/history (None: in memory only).
    `verify` (first, always, off) checks expert reads against the manifest's checksums;
    `drives` are directories on other drives with copies of the expert files, which share
    the reads (drives.py).
    `faults` is a COLIBRI_FAULTS drill spec (faults.py). `trace` receives the routing trace.
    `table_budget` streams a container's tables (Qwen4-Exp's n-gram tables) by pages under
    that many bytes (tables.py; None: table_cache_bytes's default, "all": read in).
    `coalesce` reads a step's misses that are adjacent in their file as one request.
    """

    budget: int | str | None = None
    io_threads: int = 2
    direct: bool = True
    mlock: bool = False
    hugetlb: bool = False
    policy: Policy | None = None
    prefetch: int | None = None
    state_dir: str | None = None
    history_read_only: bool = False
    history_half_life: float | None = None
    verify: str = "first"
    drives: tuple[str, ...] = ()
    faults: str | None = None
    trace: TextIO | None = None
    coalesce: bool = True  # read a step's misses that are adjacent in their file as one request
    reader: str = "preadv"  # preadv (a thread pool), io_uring, or auto (storage/reader.py)
    queue_depth: int = 32  # io_uring: reads in flight at most
    sqpoll_cpu: int | None = None  # io_uring: a kernel thread on this CPU polls for submissions
    beside_bytes: int = 0  # RAM the daemon's other budgets take (the prefix cache): the experts' budget fits beside
    table_budget: int | str | None = None  # a container's streamed tables (tables.py): bytes, min, all (resident); None: default


@dataclass
class Placed:
    model: ModelShape  # loaded: dense weights resident, experts behind its ExpertSource
    control: CacheControl | None  # None: every expert is resident, nothing to retune
    history: object | None  # the usage history (history.py) the daemon saves, or None
    fit: "Fit | None" = None  # the RAM it holds, by part (fit_of)


Build = Callable[[str, dict], ModelShape]


def check_model(path: str, build: Build, report=None):
    """Every check that placing makes before it reads a weight, in its order: the config
    and its family (`model`), the container's manifest and index against the config or the
    checkpoint's files (`container`, `index` / `checkpoint`), every dense tensor with its
    shape (`dense`). `report(name, detail)` hears each check that passed.
    Returns (model without weights, the Container or Checkpoint).

    Raises the storage errors (ModelNotFound, ConfigMissing, ConfigInvalid, header and
    tensor errors, ContainerInvalid) and what `build` raises (UnsupportedModelType); each
    carries `check`, the name of the check that failed."""
    report = report or (lambda name, detail: None)
    name = "model"
    try:
        model = build(path, load_config(path))
        report(name, f"{path}: {model.MODEL_TYPE}, {model.n_layer} layers, {model.n_expert} experts per MoE layer, "
                     f"{model.ATTENTION} attention, {fmt_bytes(model.kv_bytes_per_token())} of KV cache per token"
                     + (f", {fmt_bytes(s)} of recurrent state per sequence" if (s := model.state_bytes_per_sequence())
                        else ""))
        if is_container(path):
            name = "container"
            store = open_container(path)
            p = store.precision()
            report(name, f"format v{store.manifest['version']}, {len(store.records)} expert records of "
                         f"{store.record_bytes / 2**20:.2f} MiB in {len({x.file for x in store.records.values()})} "
                         f"files, dense {p['dense']}{f' (matrices {q})' if (q := p.get('dense_int')) else ''}, "
                         f"experts {p['experts']}"
                         f"{', activations int8' if p['activations'] == 'int8' else ''}{' (lossy)' if p['lossy'] else ''}")
            name = "index"
            if store.moe_layers != model.moe_layers or store.n_expert != model.n_expert:
                raise ContainerInvalid(f"{path}: the manifest's experts do not match config.json")
            store.check_index(model.moe_layers, model.n_expert)
            report(name, f"every expert of {len(model.moe_layers)} MoE layers indexed once, records aligned to "
                         "4 KiB and inside their files")
            name = "dense"
            model.spell(store.dense)
            model.check(store.dense, with_experts=False)
            report(name, "dense.safetensors has every dense tensor, with the shapes config.json implies")
        else:
            name = "checkpoint"
            store = model.source(open_checkpoint(path))
            model.check(store)
            size = sum(sf.file_bytes for sf in store.files.values())
            how = ("experts streamed from the file under the expert budget, no checksums" if is_gguf(path)
                   else "experts all resident: no budget")
            report(name, f"{len(store.files)} {'GGUF' if is_gguf(path) else 'safetensors'} file(s), "
                         f"{size / 2**30:.2f} GiB, every tensor present with the shape its config implies ({how})")
    except ColibriError as e:
        e.check = name
        raise
    return model, store


def room_for(container, table_budget: int | str | None = None, ram: int = 0) -> MemoryRoom:
    """The RAM a container's (or a GGUF file's) budgets may take: the box's (or `ram`
    bytes), less its dense weights (its streamed tables apart) and the process, and its
    tables' `table_budget` (table_cache_bytes)."""
    streamed = streamed_table_bytes(container)
    return MemoryRoom(container.dense_bytes - streamed, ram, table_cache_bytes(streamed, table_budget))


def table_cache_bytes(total: int, budget: int | str | None) -> int:
    """The RAM streamed tables of `total` bytes take under `budget`: all of them for "all"
    (read in), 0 for "min" (a step's pages at a time), that many bytes for a size, and by
    default every table page if that fits in a quarter of the available memory, else that
    quarter (beside the experts' default half). 0 without tables."""
    import psutil

    if not total or budget == "min":
        return 0
    if budget == "all":
        return total
    return int(budget) if budget is not None else min(total, psutil.virtual_memory().available // 4)


@dataclass(frozen=True)
class Fit:
    """The RAM a placed model holds, by part, and the limit it was checked against: the
    figure colibrid, doctor, plan and tune all take from `fit_of` (memory.py's room)."""

    dense_bytes: int  # resident weights (a checkpoint: all of them; streamed tables apart)
    expert_bytes: int  # the expert cache's arena (0: a checkpoint's experts are in dense_bytes)
    table_bytes: int  # the streamed tables' cache, or the tables read in
    kv_bytes: int  # the prefix cache's budget
    process_bytes: int  # the interpreter, libraries, kernels, a step's temporaries (memory.PROCESS_BYTES)
    limit_bytes: int  # this box's RAM, or its cgroup's limit

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes + self.table_bytes + self.kv_bytes + self.process_bytes

    def as_dict(self) -> dict:
        return {"dense_bytes": self.dense_bytes, "expert_bytes": self.expert_bytes, "table_bytes": self.table_bytes,
                "kv_bytes": self.kv_bytes, "process_bytes": self.process_bytes, "total_bytes": self.total_bytes,
                "limit_bytes": self.limit_bytes}

    def text(self) -> str:
        parts = [f"dense {fmt_bytes(self.dense_bytes)}"]
        parts += [f"{name} {fmt_bytes(n)}" for name, n in (("expert cache", self.expert_bytes),
                                                           ("embedding tables", self.table_bytes),
                                                           ("prefix cache", self.kv_bytes)) if n]
        return (f"{fmt_bytes(self.total_bytes)} held at most ({', '.join(parts)}, the process "
                f"{fmt_bytes(self.process_bytes)}) of this box's {fmt_bytes(self.limit_bytes)}")


def fit_of(c, budget: int | str | None, beside_bytes: int = 0, table_budget: int | str | None = None,
           ram: int = 0) -> Fit:
    """What a container (or a GGUF file's experts) holds in RAM under an expert `budget`
    (None: the default), `beside_bytes` of prefix cache and its tables' `table_budget`:
    the one decision of whether a model fits, which placing it (open_model), colictl doctor,
    plan and tune all make (`ram`: a memory to fit in other than this box's, plan's
    --memory). Raises BudgetInvalid (below the minimum, above this box's RAM)."""
    from .memory import PROCESS_BYTES

    room = room_for(c, table_budget, ram)
    room.check_tables("the embedding tables' cache (table_cache)" if table_budget != "all" else
                      "the embedding tables, resident (table_cache all),")
    experts = budget_bytes(default_budget(c) if budget is None else budget, len(c.moe_layers), c.n_expert,
                           c.record_bytes, room, beside_bytes)
    return Fit(room.dense_bytes, experts, room.table_bytes, beside_bytes, PROCESS_BYTES, room.total)


def check_budgets(path: str, budget: int | str | None, beside_bytes: int = 0, build: Build | None = None,
                  table_budget: int | str | None = None) -> Fit:
    """Whether a model would be placed with an expert `budget` beside `beside_bytes` of
    other budgets (the prefix cache) and its tables' `table_budget`, as open_model checks it
    (fit_of), without reading a weight (a GGUF file's experts are found through the family
    `build` gives). Returns what it would hold.
    Raises BudgetInvalid (a budget for a checkpoint, below the minimum, above this box's
    RAM), the storage errors of opening the model."""
    if is_gguf(path) and build is not None:
        model, store = check_model(path, build)
        c = GGUFExperts(store, model)
    elif not is_container(path):
        return check_resident(path, open_checkpoint(path), budget, beside_bytes)
    else:
        c = open_container(path)
    return fit_of(c, budget, beside_bytes, table_budget)


def check_resident(path: str, checkpoint, budget, beside_bytes: int) -> Fit:
    """A checkpoint's experts are all resident: a budget other than "all" is refused (it
    needs a container), and so are weights above this box's RAM. Returns what it holds.
    Raises BudgetInvalid."""
    from .memory import PROCESS_BYTES

    if budget not in (None, "all"):
        raise BudgetInvalid(f"{path} is a Hugging Face checkpoint; an expert budget needs a container: "
                            f"colictl convert {path} DST, then give DST as the model")
    weights = sum(sf.file_bytes for sf in checkpoint.files.values())
    room = MemoryRoom(0)
    try:
        room.check("the checkpoint's weights, every expert resident,", weights, beside_bytes, "the prefix cache")
    except BudgetInvalid as e:
        raise BudgetInvalid(f"{e}: convert it (colictl convert {path} DST) and stream its experts under a "
                            "budget") from None
    return Fit(weights, 0, 0, beside_bytes, PROCESS_BYTES, room.total)


def default_budget(container) -> int:
    """Without a budget: every expert if that fits in half the available memory, else that half."""
    import psutil

    return max(min(container.expert_bytes, psutil.virtual_memory().available // 2), 1)


def open_model(path: str, placement: Placement, build: Build, progress=None, checked=None) -> Placed:
    """Check the model directory at `path` (check_model), then place it as `placement`
    says. `checked(model)` runs once every check passed, before a weight is read (colictl
    run loads the tokenizer there, so that a broken one, or a prompt too long for the
    model, costs no read). `progress(phase, done,
    total)` hears each dense tensor and each expert of the warm start.

    Raises what check_model raises, BudgetInvalid (a budget for a checkpoint, or too small
    for the model), FaultSpecInvalid, ExpertReadError (the warm start), OSError."""
    pl = placement
    model, store = check_model(path, build)
    if checked:
        checked(model)
    if is_container(path):
        c, dense, precision = store, store.dense, store.precision()
    elif is_gguf(path):  # its experts streamed from the file itself
        c, dense, precision = GGUFExperts(store, model), store, None
    else:
        fit = check_resident(path, store, pl.budget, pl.beside_bytes)
        model.load(store, progress=progress)
        if pl.trace:
            model.experts = TracedSource(model.experts, pl.trace)
        return Placed(model, None, None, fit)
    policy = pl.policy or Policy()
    if pl.prefetch is not None:
        policy = replace(policy, prefetch_reads=pl.prefetch)
    history = UsageHistory(c.moe_layers, c.n_expert, c.fingerprint,
                           history_path(pl.state_dir, c.fingerprint) if pl.state_dir else None,
                           pl.history_half_life or DEFAULT_HALF_LIFE, pl.history_read_only)
    faults = FaultPlan.parse(pl.faults)
    if faults:
        log.warning("COLIBRI_FAULTS is set: expert reads fail on purpose (%s)", pl.faults)
    fit = fit_of(c, pl.budget, pl.beside_bytes, pl.table_budget)  # (the verdict doctor, plan and tune give)
    room = room_for(c, pl.table_budget)
    cache = ExpertCache(c, default_budget(c) if pl.budget is None else pl.budget, pl.io_threads, pl.direct, pl.mlock,
                        pl.hugetlb, top_k=model.n_expert_used, policy=policy, history=history, verify=pl.verify,
                        drives=list(pl.drives), faults=faults, coalesce=pl.coalesce, reader=pl.reader,
                        queue_depth=pl.queue_depth, sqpoll_cpu=pl.sqpoll_cpu, room=room, beside=pl.beside_bytes)
    tables = None
    if pl.table_budget != "all" and streamed_table_bytes(c):
        tables = TableCache(c, room.table_bytes, cache.reader)
    model.load(dense, TracedSource(cache, pl.trace) if pl.trace else cache, progress, precision, tables=tables)
    cache.warm_start(progress)
    return Placed(model, cache, history, fit)


def quant_group(src, names: list[str]) -> int | None:
    """The int4 group size a plan tries for these checkpoint matrices (64, else 32 when 64
    does not divide their columns), or None when neither does."""
    cols = [src.entry(n).shape[1] for n in names]
    return next((g for g in (64, 32) if all(c % g == 0 for c in cols)), None)


def sample_experts(store, model: ModelShape, k: int, max_bytes: int,
                   dtype: str | None = None) -> tuple[list[list[tuple]], int | None]:
    """A resident sample of experts, for timing a step without the disk (colictl plan): k
    experts of each of the model's first MoE layers, as many layers as `max_bytes` holds
    (at least one), as the engine gets them when placed. `store` a container (its records,
    in its precision; `dtype` ignored) or the model's checkpoint source (its matrices as
    published, or int8/int4 quantized as convert would: int8 a scale per row, int4
    quant_group). Returns (layers [sample layer][expert] of (gate, up, down, biases...),
    the int4 group size or None)."""
    if isinstance(store, Container):
        c = store
        n = max(1, min(len(c.moe_layers), max_bytes // max(1, k * c.record_bytes)))
        layers = []
        for il in c.moe_layers[:n]:
            experts = []
            for ie in range(min(k, c.n_expert)):
                r = c.records[(il, ie)]
                buf = np.empty(r.length, np.uint8)
                with open(r.file, "rb") as f:
                    f.seek(r.offset)
                    f.readinto(buf)
                experts.append(c.expert_views(buf, (il, ie)))
            layers.append(experts)
        return layers, c.group_size if c.expert_dtype == "int4" else None
    first = model.expert_names(model.moe_layers[0], 0)
    group = quant_group(store, first[:3]) if dtype == "int4" else None
    per = sum(int(np.prod(store.entry(n).shape)) for n in first[:3]) * (2 if dtype is None else 1)
    n = max(1, min(len(model.moe_layers), max_bytes // max(1, k * per)))
    layers = []
    for il in model.moe_layers[:n]:
        experts = []
        for ie in range(min(k, model.n_expert)):
            names = model.expert_names(il, ie)
            mats = []
            for name in names[:3]:
                if dtype in QUANT_DTYPES:
                    v = expert_values(store, name, dtype, group or store.entry(name).shape[1])
                    mats.append(from_record(dtype, v["weight"], v["scales"]))
                else:
                    mats.append(store.read_weight(name))
            experts.append(tuple(mats) + tuple(store.read_weight(b) for b in names[3:]))
        layers.append(experts)
    return layers, group


def resident_cache(container, top_k: int):
    """The container's experts behind the real expert cache (every one read in, policy
    `learned`), for timing a warm step with the cache's own work in it (a small model's
    plan)."""
    cache = ExpertCache(container, "all", top_k=top_k, policy=Policy())
    for il in container.moe_layers:
        for _ in cache.stream(il, list(range(container.n_expert))):
            pass
    return cache


def faults_from_env() -> str | None:
    """The COLIBRI_FAULTS drill spec of this process's environment (a debug setting)."""
    return os.environ.get("COLIBRI_FAULTS")
