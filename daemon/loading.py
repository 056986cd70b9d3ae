"""The daemon's model, placed: what `Server.load` runs on the engine thread at start.

The model's directory (the demo written and converted on a first start without one), its
placement as the configuration says (storage/placement.py: budgets, policy, history,
reader, drives), the tokenizer and EOS ids, the kernels compiled, the dense weights
locked when asked, the drives reported (or set up, daemon/boot.py), the prefix cache and
the session store, and with `placement: ray` the expert boxes. Each step it takes is
reported in `boot` for `colictl status`; `phase(text, done, total)` hears each one.
"""

import logging
import os
import time
from dataclasses import dataclass, field

from ..engine import layers
from ..engine.prefix import PrefixCache, snapshot_interval
from ..engine.registry import build_model
from ..engine.tokenizer import Tokenizer, eos_ids
from ..storage.checkpoint import load_config
from ..storage.demo import default_demo_path, ensure_demo_container
from ..storage.errors import BudgetInvalid, ColibriError
from ..storage.gguf import tokenizer_spec
from ..storage.memory import MemoryRoom
from ..storage.placement import Placement, faults_from_env, open_model
from ..storage.sessions import fingerprints
from ..storage.sizes import parse_size
from .boot import drives_report_path, drives_set_at_boot, lock_arrays, set_up_drives
from .config import Config, state_dir
from .kept import budget_refusal, effective, model_fingerprint
from .maps import RoutingLog
from .protocol import kept_note
from .sessions import SessionStore

log = logging.getLogger("colibri.daemon")


@dataclass
class Loaded:
    """A placed model and what serving it needs."""

    model: object  # the engine's model, its experts wrapped in the live map's RoutingLog
    tokenizer: Tokenizer
    eos: list[int]
    path: str  # the model's directory
    control: object | None  # the expert cache's runtime control; None: every expert resident
    history: object | None  # the usage history the daemon saves
    room: MemoryRoom  # the RAM the budgets may share (runtime resizes are checked against it)
    prefix: PrefixCache
    sessions: SessionStore
    cfg: Config  # the configuration as it runs this model: with its values kept by --persist (daemon/kept.py)
    fingerprint: str  # the model's, which its kept values are filed under
    kept: list  # what became of each kept value (kept.effective's notes)
    boot: dict = field(default_factory=dict)  # step -> what it asked and got (status)


def place(cfg: Config, config_path: str | None, overrides: dict, phase) -> Loaded:
    """Place the configured model. Raises ColibriError (a model or budget that cannot be
    used: the budget's message names the file or flag that set it), OSError."""
    path = cfg.model or default_demo_path(state_dir(cfg))
    if cfg.model is None:
        ensure_demo_container(path, build_model, phase)
    fingerprint = model_fingerprint(path)
    cfg, notes = effective(config_path, overrides, fingerprint)  # this model's values kept with --persist
    for n in notes:
        log.info("%s", kept_note(n))
    phase("checking the model's files")
    t0 = time.perf_counter()
    boot: dict = {}
    n = cfg.compute_threads or len(os.sched_getaffinity(0))
    kv = parse_size(cfg.kv_cache)
    placement = Placement(budget=parse_size(cfg.expert_cache), beside_bytes=kv,
                          io_threads=cfg.io_threads, mlock=cfg.mlock, hugetlb=cfg.hugepages,
                          policy=cfg.cache_policy(), state_dir=state_dir(cfg) if cfg.history else None,
                          history_read_only=cfg.history == "read-only", history_half_life=cfg.history_half_life,
                          verify=cfg.verify, drives=tuple(cfg.drives), faults=faults_from_env(),
                          coalesce=cfg.coalesce_reads, reader=cfg.reader,
                          queue_depth=cfg.queue_depth, sqpoll_cpu=cfg.sqpoll_cpu,
                          table_budget=cfg.table_budget())
    try:
        placed = open_model(path, placement, build_model, progress=phase)
    except BudgetInvalid as e:  # say where the budget was set: a fragment `colictl tune` wrote, a flag, ...
        raise BudgetInvalid(budget_refusal(e, cfg, config_path, overrides, notes)) from None
    model = placed.model
    boot["memory"] = placed.fit.text()  # (the figure colictl doctor gives)
    tokenizer = Tokenizer(path, tokenizer_spec(path))
    eos = eos_ids(path, load_config(path), tokenizer)
    boot["compute_threads"] = {"asked": cfg.compute_threads or "all", "got": n}
    experts = model.experts.describe()
    if "mlock" in experts:
        boot["mlock_experts"] = {"asked": cfg.mlock, "got": experts["mlock"]}
        boot["hugepages"] = {"asked": "reserved" if cfg.hugepages else "transparent",
                             "got": experts.get("hugepages")}
    if cfg.mlock:
        dense = list(model.glob.values()) + [a for L in model.layers for a in L.values()]
        boot["mlock_dense"] = lock_arrays(dense, "dense weights")
    boot["load_s"] = round(time.perf_counter() - t0, 3)
    boot["drives"] = drives_at_start(cfg, path)
    control, history = placed.control, placed.history
    room = control.room if control is not None else resident_room(path)
    sessions = session_store(cfg, path, model)
    if cfg.placement == "ray":
        if control is None:
            raise ColibriError("placement: ray spreads a container's experts: convert the checkpoint first "
                               "(colictl convert)")
        from .scaleout import place_on_ray  # (ray is an optional dependency)

        phase("starting the expert boxes on Ray")
        model.experts = place_on_ray(model, control, history, cfg.ray_address, cfg.ray_boxes,
                                     cfg.ray_head_weight, placement.budget, cfg.io_threads)
        boot["boxes"] = model.experts.describe_boxes()
    model.experts = RoutingLog(model.experts)  # the live map's routing (gateway)
    # on the source as the daemon wraps it; auto keeps what the container was converted with
    model.set_activations(model.activations if cfg.activations == "auto" else cfg.activations)
    layers.init(n, phase, model.kernel_kinds())  # every kernel its steps take, before it says it serves
    prefix = PrefixCache(kv, snapshot_interval(cfg.state_snapshot_tokens, model))
    snap = model.state_bytes_per_sequence()
    if snap and kv and kv < 4 * snap:
        log.warning("kv_cache %s holds %d state snapshot(s) of this model (%d MB each): raise kv_cache for warm "
                    "context", cfg.kv_cache, kv // snap, snap >> 20)
    return Loaded(model, tokenizer, eos, path, control, history, room, prefix, sessions, cfg, fingerprint, notes, boot)


def drives_at_start(cfg: Config, path: str) -> list[dict]:
    """The drives of the expert files (the model's, the copies'), as boot reports them:
    what each is and how it queues reads, and what tuning changed (tune_drives) or would
    change. Under the shipped unit the daemon may not write /sys: the privileged
    `colibrid drives` step did it before the daemon started, and its report (of this
    boot) is what `changed` shows."""
    places, cpus = [path, *cfg.drives], sorted(os.sched_getaffinity(0))
    done = drives_set_at_boot(drives_report_path(state_dir(cfg))) if cfg.tune_drives else None
    if done is None:
        return set_up_drives(places, cpus, cfg.tune_drives)
    now = set_up_drives(places, cpus, False)  # as the drives are now
    earlier = {d["path"]: d for d in done["drives"]}
    for d in now:
        d["changed"] = earlier.get(d["path"], {}).get("changed", [])
        d["set_by"] = f"colibrid drives at {done['made']}"
    return now


def session_store(cfg: Config, path: str, model) -> SessionStore:
    """The named sessions of this model, in the state directory, with the budgets applied."""
    store = SessionStore(os.path.join(state_dir(cfg), "sessions"), fingerprints(path), model.args.vocab_size,
                         parse_size(cfg.sessions_bytes), cfg.sessions_age_days)
    try:
        store.expire()
    except OSError as e:
        log.warning("could not apply the session budgets in %s: %s", store.root, e.strerror)
    return store


def resident_room(path: str) -> MemoryRoom:
    """The RAM budgets may take beside a checkpoint whose weights are all resident."""
    import glob

    return MemoryRoom(sum(os.path.getsize(f) for f in glob.glob(os.path.join(glob.escape(path), "*.safetensors"))))
