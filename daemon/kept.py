"""Settings kept with `--persist`: STATE_DIR/runtime.yaml, per model.

An operator's runtime change (`colictl cache set --persist`, `policy set --persist`)
belongs to the model it was made on: runtime.yaml keeps each value under the model's
fingerprint (storage/sessions.fingerprints), with when it was kept and by what command.
At start and at every reload (`effective`) the configuration's values are read first, then
this model's kept values on top, except where an edit wins:
- a flag on the command line wins over a kept value;
- a configuration file or fragment that sets the key and was modified after the value
  was kept wins over it, and the kept value is dropped from the file (the start says so).
Every value's origin is reported (`origins`): colibrid's log at start, `--print-config`,
`status`. Values kept in the first format (one flat mapping, no model, no time) are not
applied: nothing says which model they were meant for.

File (YAML): {"version": 2, "models": {FINGERPRINT: {"model": path, "values": {KEY:
{"value": V, "at": ISO 8601 time, "by": command}}}}}.
"""

import logging
import os
from dataclasses import replace
from datetime import UTC, datetime

from .config import PERSISTABLE, Config, ConfigError, _checked, _load_yaml, fragments, load, runtime_path

log = logging.getLogger("colibri.daemon")

VERSION = 2
HEAD = ("# colictl ... --persist: runtime changes colibrid applies at each start of the model they\n"
        "# were made on, unless a flag or a later edit of the configuration sets the key\n"
        "# (colictl kept lists them, colictl kept drop removes them; docs/operations.md)\n")


def read(state: str | None) -> dict:
    """runtime.yaml's models: {fingerprint: {"model": path, "values": {key: {value, at, by}}}};
    {} without the file. A file of the first format gives {} (its values are not applied,
    with a warning); an unreadable one, ConfigError."""
    path = runtime_path(state)
    if not os.path.exists(path):
        return {}
    data = _load_yaml(path)
    if data.get("version") != VERSION:
        flat = sorted(k for k in data if k in PERSISTABLE)
        if flat:
            log.warning("%s keeps %s in its first format, without the model they were made on: not applied "
                        "(set them again with --persist, or remove the file)", path, ", ".join(flat))
        return {}
    models = data.get("models") or {}
    if not isinstance(models, dict):
        raise ConfigError(f"{path}: models is a mapping of fingerprints")
    return models


def write(state: str | None, models: dict) -> str:
    """runtime.yaml with `models`, atomically (removed when nothing is kept). Returns its path.
    Raises OSError."""
    import yaml

    from ..storage.statefile import write_atomic

    path = runtime_path(state)
    models = {fp: m for fp, m in models.items() if m.get("values")}
    if not models:
        if os.path.exists(path):
            os.unlink(path)
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, (HEAD + yaml.safe_dump({"version": VERSION, "models": models}, sort_keys=True)).encode())
    return path


def now_text() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def at_seconds(text: str) -> float:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0  # (a hand-edited time: any edit of the configuration wins over it)


def keep(state: str | None, fingerprint: str, model: str, keys: dict, by: str) -> str:
    """Keep runtime changes of the model `fingerprint` (at `model`) for its next starts,
    made by the command `by`. Returns the file. Raises ConfigError (a key that is not kept,
    a bad value), OSError."""
    path = runtime_path(state)
    unknown = set(keys) - set(PERSISTABLE)
    if unknown:
        raise ConfigError(f"{', '.join(sorted(unknown))}: not kept across restarts (only {', '.join(PERSISTABLE)})")
    checked = _checked(path, keys)
    models = read(state)
    entry = models.setdefault(fingerprint, {"model": model, "values": {}})
    entry["model"] = model
    at = now_text()
    for k, v in checked.items():
        entry.setdefault("values", {})[k] = {"value": str(v) if k.endswith("_cache") else v,
                                             "at": at, "by": by}
    return write(state, models)


def drop(state: str | None, fingerprint: str | None, keys: list[str] | None) -> list[dict]:
    """Remove kept values: `keys` (None: all) of the model `fingerprint` (None: every
    model). Returns what was removed, [{fingerprint, model, key, value}]. Raises
    ConfigError, OSError."""
    models = read(state)
    gone = []
    for fp, m in models.items():
        if fingerprint is not None and fp != fingerprint:
            continue
        for k in list(m.get("values", {})):
            if keys is None or k in keys:
                gone.append({"fingerprint": fp, "model": m.get("model"), "key": k, "value": m["values"][k]["value"]})
                del m["values"][k]
    if gone:
        write(state, models)
    return gone


def listing(state: str | None, fingerprint: str | None = None) -> list[dict]:
    """Every kept value, [{fingerprint, model, key, value, at, by, this_model}]."""
    return [{"fingerprint": fp, "model": m.get("model"), "key": k, **v, "this_model": fp == fingerprint}
            for fp, m in sorted(read(state).items()) for k, v in sorted((m.get("values") or {}).items())]


def setters(config_path: str | None, key: str) -> list[str]:
    """The configuration files and fragments that set `key`, in the order they are read."""
    found = []
    for one in [config_path, *fragments(config_path)] if config_path else []:
        try:
            if key in _load_yaml(one):
                found.append(one)
        except ConfigError:
            continue
    return found


def effective(config_path: str | None, overrides: dict | None, fingerprint: str | None,
              model: str | None = None) -> tuple[Config, list[dict]]:
    """The configuration as colibrid runs the model `fingerprint` (None: a model not made
    yet): its files, then that model's kept values where neither a flag nor a later edit
    sets the key. Returns (config, notes); a note per kept value of this model, {key, value,
    at, by, configured, configured_in, applied: bool, why}. Kept values a later edit
    overrides are dropped from runtime.yaml (logged). Raises ConfigError."""
    cfg = load(config_path, overrides)
    if fingerprint is None:
        return cfg, []
    state = cfg.state_dir
    try:
        kept = (read(state).get(fingerprint) or {}).get("values") or {}
    except ConfigError as e:
        log.error("%s (kept values not applied)", e)
        return cfg, []
    notes, apply, stale = [], {}, []
    for key, v in sorted(kept.items()):
        if key not in PERSISTABLE:
            continue
        files = setters(config_path, key)
        note = {"key": key, "value": v.get("value"), "at": v.get("at"), "by": v.get("by"),
                "configured": getattr(cfg, key), "configured_in": files[-1] if files else "default"}
        if (overrides or {}).get(key) is not None:
            note |= {"applied": False, "why": "the command line sets it"}
        elif any(os.stat(f).st_mtime > at_seconds(v.get("at")) for f in files):
            newer = next(f for f in files if os.stat(f).st_mtime > at_seconds(v.get("at")))
            note |= {"applied": False, "why": f"{newer} was edited after it was kept: the edit wins, the kept "
                                              "value is dropped"}
            stale.append(key)
        else:
            try:
                apply |= _checked(runtime_path(state), {key: v.get("value")})
                note["applied"] = True
            except ConfigError as e:
                note |= {"applied": False, "why": str(e)}
        notes.append(note)
    if stale:
        try:
            drop(state, fingerprint, stale)
        except (ConfigError, OSError) as e:
            log.warning("could not drop %s from %s: %s", ", ".join(stale), runtime_path(state), e)
    for key in ("expert_cache", "kv_cache", "table_cache"):
        if key in apply:
            apply[key] = str(apply[key])
    return replace(cfg, **apply), notes


def origins(config_path: str | None, overrides: dict | None, notes: list[dict], state: str | None) -> dict:
    """Each key's origin: "command line", runtime.yaml (a kept value applied), the last
    file or fragment that sets it, or "default"."""
    applied = {n["key"] for n in notes if n["applied"]}
    out = {}
    for key in Config.__dataclass_fields__:
        if (overrides or {}).get(key) is not None:
            out[key] = "command line"
        elif key in applied:
            out[key] = runtime_path(state)
        else:
            files = setters(config_path, key)
            out[key] = files[-1] if files else "default"
    return out


def model_fingerprint(path: str | None) -> str | None:
    """The fingerprint kept values are filed under (storage/sessions.fingerprints), or None
    for a model that does not exist (yet) or cannot be read."""
    if not path or not os.path.exists(path):
        return None
    from ..storage.errors import ColibriError
    from ..storage.sessions import fingerprints

    try:
        return fingerprints(path)[0]
    except (ColibriError, OSError, ValueError):
        return None


def budget_refusal(e: Exception, cfg: Config, config_path: str | None, overrides: dict | None,
                   notes: list[dict]) -> str:
    """A budget the model cannot take, as colibrid and doctor both say it: the file, flag
    or runtime.yaml that set it, the values, and why (e: a BudgetInvalid)."""
    where = origins(config_path, overrides, notes, cfg.state_dir)["expert_cache"]
    return f"{where}: expert_cache = {cfg.expert_cache} (kv_cache = {cfg.kv_cache}): {e}"
