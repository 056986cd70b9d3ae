"""colibrid's configuration: etc/colibri.yaml, loaded once, validated, frozen.

Every key has a default here and a line in etc/colibri.yaml; an unknown key or a bad
value stops the daemon at start with a message naming the key (ConfigError). Fragments in
FILE.d/*.yaml (in name order; `colictl tune` writes one) are read after FILE, a key in a
later one overriding an earlier value.
"""

import dataclasses
import logging
import os
from dataclasses import dataclass, field

from ..storage.errors import ColibriError

log = logging.getLogger("colibri.daemon")


class ConfigError(ColibriError):
    """The configuration file or a flag has an unknown key or a bad value."""


@dataclass(frozen=True)
class Config:
    model: str | None = None  # model directory; None: the demo model, written into state_dir
    socket: str | None = None  # user socket path; None: the runtime directory's (docs/protocol.md)
    operator_socket: str | None = None  # operator socket path; None: colibri-operator.sock next to the user one
    socket_group: str | None = None  # group of the user socket (mode 0660); None: the daemon's own group
    operator_group: str | None = None  # group of the operator socket; None: the daemon's own group
    state_dir: str | None = None  # None: $STATE_DIRECTORY, else ~/.local/state/colibri
    expert_cache: str = "all"  # RAM for routed experts of a container: SIZE, min or all
    table_cache: str = "auto"  # RAM for a container's streamed embedding tables (Qwen4-Exp's n-gram tables): SIZE, min, all or auto
    io_threads: int = 2  # threads reading experts
    compute_threads: int = 0  # 0: every CPU the daemon may run on
    cpus: list = field(default_factory=list)  # CPU affinity, e.g. [0, 1]; empty: leave as started
    numa_node: int | None = None  # run on this NUMA node and prefer its memory (libnuma); None: any
    hugepages: bool = False  # put the expert arena on reserved hugepages (vm.nr_hugepages), else THP
    mlock: bool = False  # lock the dense weights and the expert cache in RAM (within RLIMIT_MEMLOCK)
    prefetch_reads: int = 8  # router lookahead: reads started ahead per MoE layer and token of the step; 0: off
    policy: str = "learned"  # expert cache policy: lru, lru+pinned, learned or learned-opt (storage/policy.py)
    hot_set: float = 0.5  # learned hot set: this fraction of the cache above the LRU minimum
    repin_every: int = 32  # forward steps between revisions of the hot set; 0: only at start
    repin_margin: float = 0.25  # a challenger's usage must exceed the coldest pin's by this factor
    history: bool | str = True  # usage history in state_dir: true, false or read-only (loaded, never written)
    history_half_life: int = 4096  # forward steps over which a usage count halves
    history_save_s: float = 300.0  # seconds between writes of the usage history (and at stop)
    verify: str = "first"  # check expert reads against the manifest's crc32: first (per start), always, off
    drives: list = field(default_factory=list)  # directories on other drives with copies of the expert files: they share the reads
    reader: str = "auto"  # expert reads: preadv (thread pool), io_uring, auto (io_uring where installed and faster)
    queue_depth: int = 32  # io_uring: expert reads in flight at most
    sqpoll_cpu: int | None = None  # io_uring: a kernel thread pinned to this CPU polls for submissions; null: none
    coalesce_reads: bool = True  # a step's missing experts adjacent in their file are read as one request
    tune_drives: bool = False  # set the expert drives' scheduler, read-ahead and interrupts at start (storage/devices.py)
    placement: str = "local"  # local, or ray: experts also on other boxes of a Ray cluster (docs/scale-out.md)
    ray_address: str = "auto"  # placement ray: the cluster to join (ray.init's address)
    ray_boxes: list = field(default_factory=list)  # placement ray: per box {path, node (an IP) or resources, ...}
    ray_head_weight: float | None = None  # placement ray: fixed weights instead of measured capacities (head's)
    max_queue: int = 64  # requests waiting beyond the running ones; more get BUSY
    max_active: int = 8  # requests decoding together in one batch
    batch_window_ms: float = 20.0  # an idle engine waits this long after a request for others sent with it
    prefill_chunk: int | str = 64  # prompt tokens a step takes while others decode: N, auto, 0 (whole)
    max_tokens_limit: int = 4096  # the largest max_tokens a request may ask for
    max_streams_per_client: int = 4  # requests one client may have running or queued; more get BUSY
    max_message_bytes: int = 1048576  # (protocol.DEFAULT_MAX_MESSAGE_BYTES) the largest request; larger ones get TOO_LARGE (far larger: disconnected)
    kv_cache: str = "512MiB"  # the prefix cache: KV blocks of computed prompts kept for requests that share them; 0: off
    activations: str = "auto"  # routed experts on float32 or int8 activations (int8: lossy, int8/int4 experts only); auto: as the container was converted
    state_snapshot_tokens: int | str = "auto"  # hybrids: the prefix cache keeps their recurrent state every this many prompt tokens; auto: engine/prefix.snapshot_interval
    sessions_bytes: str = "4GiB"  # all session files together; beyond it the least recently used go
    sessions_age_days: float = 30.0  # a session unused this long is removed; 0: never
    watchdog_s: float = 0.0  # 0: use WATCHDOG_USEC from systemd when set
    log_level: str = "info"  # debug, info, warning, error

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def table_budget(self) -> int | str | None:
        """The table cache's budget for Placement (None: auto, storage/placement.py's default)."""
        from ..storage.sizes import parse_size

        return None if self.table_cache == "auto" else parse_size(self.table_cache)

    def cache_policy(self):
        """The expert cache policy these settings describe (storage/policy.py)."""
        from ..storage.policy import Policy

        return Policy(name=self.policy, hot_set=float(self.hot_set), repin_every=self.repin_every,
                      repin_margin=float(self.repin_margin), prefetch_reads=self.prefetch_reads)


_KINDS = {  # key -> what a valid value is
    "model": "path", "socket": "socket", "operator_socket": "socket", "socket_group": "group",
    "operator_group": "group", "state_dir": "path", "expert_cache": "size", "table_cache": "table_size",
    "io_threads": "positive", "compute_threads": "count", "cpus": "cpus", "mlock": "bool",
    "numa_node": "node", "hugepages": "bool", "prefetch_reads": "count", "policy": "policy",
    "hot_set": "fraction", "repin_every": "count", "repin_margin": "seconds",
    "history": "history", "history_half_life": "positive", "history_save_s": "seconds", "verify": "verify",
    "drives": "paths", "tune_drives": "bool", "placement": "placement", "ray_address": "path",
    "ray_boxes": "boxes", "ray_head_weight": "weight", "coalesce_reads": "bool", "reader": "reader",
    "queue_depth": "positive", "sqpoll_cpu": "node",
    "max_queue": "positive", "max_active": "positive", "batch_window_ms": "milliseconds",
    "prefill_chunk": "chunk",
    "max_tokens_limit": "positive",
    "max_streams_per_client": "positive", "max_message_bytes": "positive", "sessions_bytes": "disk", "kv_cache": "bytes",
    "state_snapshot_tokens": "positive_auto", "activations": "activations",
    "sessions_age_days": "days",
    "watchdog_s": "seconds", "log_level": "level",
}
LOG_LEVELS = ("debug", "info", "warning", "error")
RUNTIME_FILE = "runtime.yaml"  # in the state directory: what `--persist` kept, per model (daemon/kept.py)
PERSISTABLE = ("expert_cache", "kv_cache", "table_cache", "policy", "hot_set", "repin_every", "repin_margin", "prefetch_reads")
BOX_KEYS = {"path", "node", "resources", "weight", "expert_cache", "threads", "env"}  # a ray_boxes entry


def _valid(kind: str, v) -> str | None:
    """Why v is not a valid value of this kind, or None."""
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if kind == "path":
        return None if v is None or (isinstance(v, str) and v) else "a path or null"
    if kind == "paths":
        return None if isinstance(v, list) and all(isinstance(p, str) and p for p in v) else "a list of paths"
    if kind == "socket":
        from .protocol import socket_path_problem

        return None if v is None else socket_path_problem(v)
    if kind == "table_size" and v == "auto":
        return None
    if kind in ("size", "table_size"):
        from ..storage.errors import BudgetInvalid
        from ..storage.sizes import parse_size

        try:
            size = parse_size(str(v)) if isinstance(v, str | int) and not isinstance(v, bool) else parse_size("?")
        except BudgetInvalid:
            return "a size: bytes, KiB/MiB/GiB, " + ("min, all or auto" if kind == "table_size" else "min or all")
        return _above_ram(size)
    if kind in ("bytes", "disk"):  # disk: a size on disk, not held in RAM
        from ..storage.errors import BudgetInvalid
        from ..storage.sizes import parse_size

        try:
            ok = isinstance(v, str | int) and not isinstance(v, bool) and isinstance(parse_size(str(v)), int)
        except BudgetInvalid:
            ok = False
        if not ok:
            return "a size: bytes or KiB/MiB/GiB"
        return None if kind == "disk" else _above_ram(parse_size(str(v)))
    if kind == "positive":
        return None if is_int and v >= 1 else "an integer of at least 1"
    if kind == "count":
        return None if is_int and v >= 0 else "an integer of at least 0"
    if kind == "positive_auto":
        return None if (is_int and v >= 1) or v == "auto" else "an integer of at least 1, or auto"
    if kind == "chunk":
        return None if (is_int and v >= 0) or v == "auto" else "a number of tokens, auto, or 0 (prompts whole)"
    if kind == "cpus":
        ok = isinstance(v, list) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in v)
        return None if ok else "a list of CPU numbers"
    if kind == "node":
        return None if v is None or (is_int and v >= 0) else "a NUMA node number or null"
    if kind == "bool":
        return None if isinstance(v, bool) else "true or false"
    if kind in ("seconds", "milliseconds", "days"):
        return None if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else f"{kind}, at least 0"
    if kind == "fraction":
        ok = isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1
        return None if ok else "a fraction from 0 to 1"
    if kind == "policy":
        from ..storage.policy import POLICIES

        return None if v in POLICIES else f"one of {', '.join(POLICIES)}"
    if kind == "group":
        return None if v is None or (isinstance(v, str) and v) else "a group name or null"
    if kind == "verify":
        return None if v in ("first", "always", "off", False) else "first, always or off"  # YAML reads off as false
    if kind == "reader":
        from ..storage.reader import READERS

        return None if v in READERS else f"one of {', '.join(READERS)}"
    if kind == "placement":
        return None if v in ("local", "ray") else "local or ray"
    if kind == "weight":
        return None if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 else "a number above 0"
    if kind == "boxes":
        ok = isinstance(v, list) and all(
            isinstance(b, dict) and isinstance(b.get("path"), str) and set(b) <= BOX_KEYS
            and (b.get("node") is None or isinstance(b["node"], str))
            and (b.get("resources") is None or isinstance(b["resources"], dict))
            and (b.get("env") is None or isinstance(b["env"], dict))
            and (b.get("expert_cache") is None or _valid("size", b["expert_cache"]) is None)
            and isinstance(b.get("threads", 0), int) and not isinstance(b.get("threads", 0), bool)
            and isinstance(b.get("weight", 1.0), int | float) for b in v)
        return None if ok else f"a list of {{{', '.join(sorted(BOX_KEYS))}}} (docs/scale-out.md)"
    if kind == "activations":
        return None if v in ("auto", "float32", "int8") else "auto, float32 or int8"
    if kind == "history":
        return None if isinstance(v, bool) or v == "read-only" else "true, false or read-only"
    if kind == "level":
        return None if v in LOG_LEVELS else f"one of {', '.join(LOG_LEVELS)}"
    raise AssertionError(kind)


def _above_ram(size) -> str | None:
    """Why a budget of `size` bytes cannot be (more than this box's RAM), or None. The
    exact limit, less the model's dense weights, is checked when the model is placed."""
    from ..storage.memory import ram_bytes
    from ..storage.sizes import fmt_bytes

    if isinstance(size, int) and size > ram_bytes():
        return f"it is above this box's RAM of {fmt_bytes(ram_bytes())} ({ram_bytes()} bytes)"
    return None


def _check(key: str, value, where: str):
    why = _valid(_KINDS[key], value)
    if why:
        raise ConfigError(f"{where}: {key} = {value!r} is not valid: "
                          + (why if why.startswith("it ") else f"it must be {why}"))
    return value


def load(path: str | None, overrides: dict | None = None, fragment: tuple[str, str] | None = None) -> Config:
    """The configuration from `path` (YAML; None: defaults only) and its fragments, with
    `overrides` (flags) on top (the values kept with --persist come on top of this, per
    model: daemon/kept.py's effective). `fragment` (NAME, FILE): read FILE as the fragment NAME
    (in NAME's place, whether or not NAME exists yet; strictly, as the main file): how
    `colictl tune` checks a fragment before it is renamed into place. Raises ConfigError
    naming the file and key."""
    values: dict = {}
    files = [path, *fragments(path)] if path else []
    if fragment is not None:
        name = os.path.abspath(fragment[0])
        files = [path] + sorted({os.path.abspath(f) for f in files[1:]} | {name}) if path else [name]
    for one in files:
        if fragment is not None and one == os.path.abspath(fragment[0]):
            values |= _read(fragment[1])
        else:
            values |= _read(one) if one == path else _read_fragment(one)
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _check(key, value, "command line")
    if values.get("verify") is False:
        values["verify"] = "off"
    for key in ("expert_cache", "kv_cache", "sessions_bytes"):
        if key in values:
            values[key] = str(values[key])
    return Config(**values)


def _read_fragment(path: str) -> dict:
    """A fragment's keys that are valid. A key it cannot use (or the whole fragment, when
    it cannot be read) is left out with an error naming the file and key: the earlier
    value applies, so a fragment a tool wrote cannot stop the daemon on its own."""
    try:
        raw = _load_yaml(path)
    except ConfigError as e:
        log.error("%s (the fragment is ignored)", e)
        return {}
    values = {}
    for key, value in raw.items():
        try:
            values |= _checked(path, {key: value})
        except ConfigError as e:
            log.error("%s (ignored: the value before %s applies)", e, os.path.basename(path))
    return values


def runtime_path(state: str | None) -> str:
    """The file `--persist` keeps runtime changes in: STATE_DIR/runtime.yaml."""
    from ..storage.statefile import default_state_dir

    return os.path.join(state or default_state_dir(), RUNTIME_FILE)


def fragments(path: str) -> list[str]:
    """The configuration fragments of `path`: PATH.d/*.yaml, in name order."""
    import glob

    return sorted(glob.glob(os.path.join(glob.escape(path + ".d"), "*.yaml")))


def _read(path: str) -> dict:
    """One configuration file's keys, checked. Raises ConfigError naming the file and key."""
    return _checked(path, _load_yaml(path))


def _load_yaml(path: str) -> dict:
    """A configuration file's mapping, unchecked. Raises ConfigError naming the file."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the configuration ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {what}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the configuration is a mapping of keys to values")
    return data


def _checked(path: str, data: dict) -> dict:
    """`data`'s keys checked. Raises ConfigError naming the file and key."""
    values: dict = {}
    for key, value in data.items():
        if key == "mirror":  # (before drives shared the reads, one copy was read only on failure)
            log.warning("%s: mirror is now drives: [%s]; every copy shares the reads", path, value)
            key, value = "drives", [value] if value else []
        if key not in _KINDS:
            import difflib

            near = difflib.get_close_matches(str(key), _KINDS, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}?" if near else "etc/colibri.yaml lists every key"
            raise ConfigError(f"{path}: unknown key {key!r} ({hint})")
        values[key] = _check(key, value, path)
    return values


def resolved(cfg: Config) -> dict:
    """The configuration as the daemon will use it: the model, sockets and state directory
    that its defaults (null) stand for, spelled out (colibrid --print-config)."""
    from ..storage.demo import default_demo_path
    from .protocol import default_socket, operator_socket

    sock = cfg.socket or default_socket()
    return cfg.as_dict() | {"model": cfg.model or default_demo_path(state_dir(cfg)), "socket": sock,
                            "operator_socket": cfg.operator_socket or operator_socket(sock),
                            "state_dir": state_dir(cfg)}


def state_dir(cfg: Config) -> str:
    from ..storage.statefile import default_state_dir

    return cfg.state_dir or default_state_dir()
