"""The requests colibrid answers, one handler each, run on the I/O thread.

A handler gets (identity, request id, message) and returns the fields of its ok reply, or
None when the engine thread replies later (generate, and the operator actions applied
between two steps). It refuses by raising ProtocolError; `dispatch` turns every frame
into its reply through protocol.answer, the one place where exceptions become error
replies. The table is explicit: a wire string never reaches getattr.
"""

import logging
import os
import time

from .. import __version__
from ..storage.errors import BudgetInvalid, ColibriError
from ..storage.policy import PolicyInvalid
from ..storage.sizes import parse_size
from . import kept
from . import protocol as P
from .config import ConfigError, runtime_path
from .maps import snapshot
from .planner import predicted_now
from .protocol import ProtocolError
from .scheduler import Cancel, Generate, Pin, Resize, SetPolicy
from .sessions import NAME, NAME_RULE, SessionInUse

log = logging.getLogger("colibri.daemon")

RESIDENT = ("this model's experts are all resident (a checkpoint); convert it to a container "
            "(colictl convert) to stream them under a budget")
NEEDS_MODEL = ("generate", "session", "map", "cache", "pin", "unpin", "policy", "reload", "kept")  # answered LOADING until placed


class Handlers:
    """The request table of one daemon (`server`: daemon/server.py's Server, whose state
    the handlers read and whose inbox feeds the engine thread's scheduler)."""

    def __init__(self, server):
        self.s = server
        self.table = {  # request type -> handler
            "hello_request": self.on_hello,
            "ping_request": self.on_ping,
            "status_request": self.on_status,
            "stats_request": self.on_stats,
            "generate_request": self.on_generate,
            "cancel_request": self.on_cancel,
            "session_request": self.on_session,
            "map_request": self.on_map,
            "shutdown_request": self.on_shutdown,
            "cache_request": self.on_cache,
            "reload_request": self.on_reload,
            "pin_request": self.on_pin,
            "unpin_request": self.on_pin,
            "policy_request": self.on_policy,
            "kept_request": self.on_kept,
        }

    def dispatch(self, tag: bytes, identity: bytes, payload: bytes, uid: int | None = None) -> dict | None:
        """The reply to one frame from a client on the socket `tag` (b"U" user, b"O"
        operator) whose process runs as `uid` (None: unknown), or None when the engine
        thread replies later."""
        s = self.s
        self.uid = uid  # the sender of the frame being answered: its sessions are the ones it may use
        if len(payload) > s.cfg.max_message_bytes:
            log.warning("refused a message of %d bytes on the %s socket: above max_message_bytes (%d)", len(payload),
                        "user" if tag == b"U" else "operator", s.cfg.max_message_bytes)
            return P.error("unknown", None, "TOO_LARGE", f"a request of {len(payload)} bytes is above this daemon's "
                                                         f"max_message_bytes of {s.cfg.max_message_bytes}")
        try:
            msg = P.decode(payload)
        except ProtocolError as e:
            return P.refusal("unknown", None, e)
        return P.answer(msg["type"].removesuffix("_request"), msg.get("id"), lambda: self.handle(tag, identity, msg))

    def handle(self, tag: bytes, identity: bytes, msg: dict) -> dict | None:
        """The checks every request passes, then its handler. Raises ProtocolError."""
        kind, rid = msg["type"].removesuffix("_request"), msg.get("id")
        handler = self.table.get(msg["type"])
        if handler is None:
            raise ProtocolError("UNKNOWN_TYPE", f"colibrid does not handle {msg['type']!r} "
                                                f"(protocol {P.PROTOCOL_VERSION})")
        if tag == b"U" and kind not in P.USER_TYPES:
            raise ProtocolError("FORBIDDEN", f"{kind} is an operator request: send it on the operator socket "
                                             f"{self.s.operator_path}")
        if "v" in msg and not P.compatible(msg["v"]):
            raise ProtocolError("VERSION_MISMATCH", f"client speaks protocol {msg['v']}, colibrid "
                                                    f"{P.PROTOCOL_VERSION}: upgrade the older side")
        if not isinstance(rid, str):
            raise ProtocolError("BAD_MESSAGE", "a request needs a string 'id'", id=None)
        if self.s.model is None and kind in NEEDS_MODEL:
            raise ProtocolError("LOADING", f"colibrid is still loading its model ({self.s.phase_text()}); retry "
                                           "when `colictl status` says serving (generate --wait waits)")
        return handler(identity, rid, msg)

    # ---- what any client may ask -------------------------------------------------------------

    def loading(self) -> dict:
        """`phase` (loading's step, or serving) and `progress` ({done, total} or null)."""
        p = self.s.progress
        return {"phase": self.s.phase, "progress": {"done": p[0], "total": p[1]} if p else None}

    def model_summary(self) -> dict | None:
        s = self.s
        if s.model is None:
            return None
        info = s.model.describe()
        return {"path": s.model_path, "type": info["model_type"], "precision": info["precision"],
                "placement": info["experts"], "n_layer": info["n_layer"], "n_expert": info["n_expert"],
                "n_ctx": info["n_ctx"], **({"note": info["note"]} if "note" in info else {}),
                **({"tables": info["tables"]} if "tables" in info else {})}

    def on_hello(self, identity, rid, msg):
        if not P.compatible(msg.get("protocol")):
            raise ProtocolError("VERSION_MISMATCH", f"client speaks protocol {msg.get('protocol')}, "
                                                    f"colibrid {P.PROTOCOL_VERSION}")
        return {"protocol": P.PROTOCOL_VERSION, "server": f"colibrid {__version__}", "model": self.model_summary(),
                "max_message_bytes": self.s.cfg.max_message_bytes, **self.loading()}

    def on_ping(self, identity, rid, msg):
        return {"t": time.time()}

    def on_status(self, identity, rid, msg):
        s = self.s
        # what the process has now, read back from the kernel, not what boot once got
        boot = s.boot | {"cpus": s.boot.get("cpus", {}) | {"got": sorted(os.sched_getaffinity(0))}}
        if "boxes" in boot and s.model is not None:  # boxes leave and come back
            boot["boxes"] = s.model.experts.describe_boxes()
        return {"pid": os.getpid(), "uptime_s": round(time.time() - s.t_start, 3), "socket": s.socket_path,
                "operator_socket": s.operator_path, "model": self.model_summary(), "boot": boot,
                "requests": {"active": len(s.inflight), "queued": s.inbox.qsize()}, "config": s.cfg.as_dict(),
                "runtime": s.runtime() if s.model is not None else None,
                **self.loading()}

    def on_stats(self, identity, rid, msg):
        s = self.s
        learned = {"policy": s.control.policy.name, "history": s.history.describe()} \
            if s.control is not None else {"policy": None}
        return {"experts": s.model.experts.stats.as_dict() if s.model is not None else None,
                "tables": s.model.tables.stats() if getattr(s.model, "tables", None) is not None else None,
                "kv": s.prefix.describe() if s.prefix is not None else None,
                "drives": s.control.drives() if s.control is not None else None, "plan": self.plan_vs_measured(),
                "experts_by_layer": s.model.experts.layer_stats() if s.model is not None else None,
                "boxes": s.model.experts.describe_boxes() if s.model is not None and s.cfg.placement == "ray"
                else None,
                "latency": s.latency.as_dict(), "queue": {"active": len(s.inflight), "queued": s.inbox.qsize()},
                "memory": self.memory(),
                "requests": dict(s.counters), "uptime_s": round(time.time() - s.t_start, 3), **self.loading(),
                **learned}

    def on_map(self, identity, rid, msg):
        """The live map's state: where each expert is, its heat, and the routing of the
        steps after `since` (absent: the latest step's)."""
        since = msg.get("since")
        if since is not None and (isinstance(since, bool) or not isinstance(since, int)):
            raise ProtocolError("BAD_MESSAGE", "'since' must be an integer (a step)")
        return snapshot(self.s.model, self.s.model.experts, since)

    def memory(self) -> dict:
        """The process's resident memory, and the expert cache's budget and arena."""
        s = self.s
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out = {"rss_bytes": rss}
        if s.control is not None:
            out |= {"expert_budget_bytes": s.control.budget_bytes, "expert_arena_bytes": s.control.arena_bytes}
        return out

    def plan_vs_measured(self) -> dict | None:
        """What `colictl tune`'s plan predicts at the budget the cache has now, and the
        decode tok/s a running stream has got (decode-only steps over their time)."""
        s = self.s
        plan = s.current_plan()
        if plan is None:
            return None
        b = s.batcher
        measured = round(b.decode_steps / b.decode_s, 3) if b is not None and b.decode_s > 0 else None
        return {"made": plan.get("made"), "predicted": predicted_now(plan, s.control.budget_bytes),
                "measured_tok_s": measured, "decode_steps": b.decode_steps if b is not None else 0}

    def on_generate(self, identity, rid, msg):
        s = self.s
        if s.stopping.is_set():
            raise ProtocolError("SHUTTING_DOWN", "colibrid is stopping")
        check_generate(msg, s.cfg.max_tokens_limit)
        key = (identity, rid)
        if key in s.inflight:
            raise ProtocolError("INVALID_REQUEST", f"a request with id {rid!r} is already running")
        if len(s.inflight) >= s.cfg.max_active + s.cfg.max_queue:
            raise ProtocolError("BUSY", f"{len(s.inflight)} requests are running or queued; retry later")
        mine = sum(1 for ident, _ in s.inflight if ident == identity)
        if mine >= s.cfg.max_streams_per_client:
            raise ProtocolError("BUSY", f"this client has {mine} requests running or queued, the most one client "
                                        "may have (max_streams_per_client); retry later")
        session = msg.get("session")
        if session is not None:
            self.session_name(session)
        s.inflight[key] = time.time()
        s.counters["accepted"] += 1  # each ends as exactly one of served, rejected, failed, cancelled
        s.latency.arrive(key)
        s.inbox.put(Generate(key, msg, self.uid))
        return None  # the engine thread streams and replies

    def on_cancel(self, identity, rid, msg):
        target = msg.get("target")
        if (identity, target) not in self.s.inflight:
            raise ProtocolError("NOT_FOUND", f"no running request {target!r} of this client")
        self.s.inbox.put(Cancel((identity, target)))
        return {"cancelled": True}

    def session_name(self, name) -> str:
        """A session name of a request from a peer whose uid is known. Raises ProtocolError."""
        if not isinstance(name, str):
            raise ProtocolError("BAD_MESSAGE", "'session' must be a string")
        if not NAME.fullmatch(name):
            raise ProtocolError("INVALID_REQUEST", f"session name {name!r} is not valid: {NAME_RULE}")
        self.need_uid()
        return name

    def need_uid(self) -> int:
        """The sender's uid. Raises ProtocolError when the socket did not tell it."""
        if self.uid is None:
            raise ProtocolError("FORBIDDEN", "colibrid cannot tell which user sent this request (no peer credentials "
                                             "on the socket), so it keeps no session for it")
        return self.uid

    def on_session(self, identity, rid, msg):
        store, action = self.s.sessions, msg.get("action")
        if action not in ("list", "show", "rm"):
            raise ProtocolError("BAD_MESSAGE", "'action' must be \"list\", \"show\" or \"rm\"")
        if action == "list":
            return {"sessions": store.list(self.need_uid())}
        name = self.session_name(msg.get("name"))
        if action == "rm":
            try:
                if not store.remove(self.uid, name):
                    raise ProtocolError("NOT_FOUND", f"no session {name!r} of this user")
            except SessionInUse as e:
                raise ProtocolError("BUSY", str(e)) from None
            return {"removed": name}
        info = store.describe(self.uid, name)
        if info is None:
            raise ProtocolError("NOT_FOUND", f"no session {name!r} of this user")
        try:
            said = store.conversation(self.uid, name)
        except (ColibriError, OSError) as e:
            raise ProtocolError("MODEL_ERROR", f"session {name!r} cannot be read: {e}") from None
        if "tokens" in said:
            said = {"text": self.s.tokenizer.decode(said["tokens"])}
        return {"session": info | said}

    # ---- operators ---------------------------------------------------------------------------

    def on_shutdown(self, identity, rid, msg):
        log.info("shutdown requested")
        self.s.stopping.set()
        return {"stopping": True}

    def on_reload(self, identity, rid, msg):
        try:
            return self.s.reload()
        except ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            raise ProtocolError("INVALID_REQUEST", f"{e} (the running configuration is unchanged)") from None

    def on_cache(self, identity, rid, msg):
        s = self.s
        action = msg.get("action")
        if action == "show":
            return {"placement": s.model.experts.describe(), "experts": s.model.experts.stats.as_dict(),
                    "kv": s.prefix.describe(), "tables": s.model.tables.stats() if getattr(s.model, "tables", None)
                    else None}
        if action != "set":
            raise ProtocolError("BAD_MESSAGE", "'action' must be \"show\" or \"set\"")
        size, kv, tables = msg.get("experts"), msg.get("kv"), msg.get("tables")
        if size is None and kv is None and tables is None:
            raise ProtocolError("BAD_MESSAGE", "a cache set needs 'experts', 'kv' or 'tables'")
        for name, value in (("experts", size), ("kv", kv), ("tables", tables)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, str | int)):
                raise ProtocolError("BAD_MESSAGE", f"'{name}' must be a size: bytes, KiB/MiB/GiB"
                                    + {"experts": ", min or all", "kv": "", "tables": " or min"}[name])
        if tables is not None:
            tables = size_arg(tables, "tables: ")
            if tables == "min":
                tables = 0
            if not isinstance(tables, int):
                raise ProtocolError("INVALID_REQUEST", "tables must be a size in bytes, KiB, MiB or GiB, or min "
                                    "(reading them all in, table_cache: all, needs a restart)")
            if getattr(s.model, "tables", None) is None:
                raise ProtocolError("INVALID_REQUEST", "this model streams no embedding tables (none, or read in: "
                                    "table_cache: all)")
        budget = size_arg(size) if size is not None else None
        if kv is not None:
            kv = size_arg(kv, "kv: ")
            if not isinstance(kv, int):
                raise ProtocolError("INVALID_REQUEST", "kv must be a size in bytes, KiB, MiB or GiB (0: off)")
        pinned = msg.get("pinned")
        if pinned is not None and budget is None:
            raise ProtocolError("BAD_MESSAGE", "'pinned' is the part of 'experts': give both")
        if pinned is not None and pinned != "auto":
            pinned = size_arg("?" if isinstance(pinned, bool) else pinned, "pinned: ")
            if not isinstance(pinned, int):
                raise ProtocolError("INVALID_REQUEST", "pinned must be a size in bytes, KiB, MiB or GiB")
        if s.control is None and budget is not None:
            raise ProtocolError("INVALID_REQUEST", RESIDENT)
        s.inbox.put(Resize((identity, rid), budget, pinned, kv, persist_arg(msg), tables))  # applied between two steps
        return None

    def on_pin(self, identity, rid, msg):
        s = self.s
        kind = msg["type"].removesuffix("_request")
        il, ie = msg.get("layer"), msg.get("expert")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (il, ie)):
            raise ProtocolError("BAD_MESSAGE", "'layer' and 'expert' must be integers")
        if s.control is None:
            raise ProtocolError("INVALID_REQUEST", RESIDENT)
        m = s.model
        if il not in m.moe_layers or not 0 <= ie < m.n_expert:
            raise ProtocolError("INVALID_REQUEST", f"no expert {il}:{ie}: MoE layers are {m.moe_layers[0]}.."
                                                   f"{m.moe_layers[-1]}, experts 0..{m.n_expert - 1}")
        s.inbox.put(Pin((identity, rid), kind, il, ie))
        return None

    def on_policy(self, identity, rid, msg):
        s = self.s
        action = msg.get("action")
        if action not in ("show", "set"):
            raise ProtocolError("BAD_MESSAGE", "'action' must be \"show\" or \"set\"")
        if s.control is None:  # all resident: nothing to choose, but a query is answered
            if action == "show":
                return {"policy": {"policy": "resident"}, "history": None}
            raise ProtocolError("INVALID_REQUEST", RESIDENT)
        if action == "show":
            return {"policy": s.control.policy.as_dict(), "history": s.history.describe()}
        settings = msg.get("settings")
        if not isinstance(settings, dict) or not settings:
            raise ProtocolError("BAD_MESSAGE", "'settings' must be a non-empty object of KEY: VALUE")
        try:
            policy = s.control.policy.with_settings(settings)
        except PolicyInvalid as e:
            raise ProtocolError("INVALID_REQUEST", str(e)) from None
        s.inbox.put(SetPolicy((identity, rid), policy, persist_arg(msg)))  # applied between two steps
        return None


    def on_kept(self, identity, rid, msg):
        """The values kept with --persist (daemon/kept.py): list them, or drop some."""
        s = self.s
        action = msg.get("action")
        if action not in ("list", "drop"):
            raise ProtocolError("BAD_MESSAGE", "'action' must be \"list\" or \"drop\"")
        keys, every = msg.get("keys"), msg.get("all_models", False)
        if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise ProtocolError("BAD_MESSAGE", "'keys' must be a list of setting names")
        if not isinstance(every, bool):
            raise ProtocolError("BAD_MESSAGE", "'all_models' must be true or false")
        try:
            if action == "list":
                return {"kept": kept.listing(s.cfg.state_dir, s.fingerprint), "file": runtime_path(s.cfg.state_dir)}
            gone = kept.drop(s.cfg.state_dir, None if every else s.fingerprint, keys or None)
        except (ConfigError, OSError) as e:
            raise ProtocolError("INVALID_REQUEST", f"{runtime_path(s.cfg.state_dir)}: "
                                                   f"{getattr(e, 'strerror', None) or e}") from None
        for k in {g["key"] for g in gone if g["fingerprint"] == s.fingerprint}:
            s.runtime_kept.discard(k)
        log.info("dropped kept values: %s", ", ".join(f"{g['key']} {g['value']}" for g in gone) or "none")
        return {"dropped": gone, "file": runtime_path(s.cfg.state_dir)}


def persist_arg(msg: dict) -> bool:
    """A request's `persist` (1.5): keep the change for the next start. Raises ProtocolError."""
    v = msg.get("persist", False)
    if not isinstance(v, bool):
        raise ProtocolError("BAD_MESSAGE", "'persist' must be true or false")
    return v


def size_arg(value, what: str = ""):
    """A size from a request (bytes, KiB/MiB/GiB, min, all). Raises ProtocolError."""
    try:
        return parse_size(str(value))
    except BudgetInvalid as e:
        raise ProtocolError("INVALID_REQUEST", f"{what}{e}") from None


def check_generate(msg: dict, max_tokens_limit: int) -> None:
    """Raises ProtocolError (BAD_MESSAGE for a field of the wrong type, INVALID_REQUEST for
    a value out of range) for a generate request that cannot run."""
    prompt, messages = msg.get("prompt"), msg.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError("BAD_MESSAGE", "a generate request has exactly one of 'prompt' (a string) or "
                                           "'messages' (a list)")
    if prompt is not None and not isinstance(prompt, str):
        raise ProtocolError("BAD_MESSAGE", "'prompt' must be a string")
    if messages is not None and not (
        isinstance(messages, list) and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
        raise ProtocolError("BAD_MESSAGE", "'messages' must be a non-empty list of {\"role\": str, \"content\": str}")
    for name, types in (("max_tokens", int), ("top_k", int), ("seed", int), ("temperature", int | float),
                        ("top_p", int | float)):
        v = msg.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
            raise ProtocolError("BAD_MESSAGE", f"'{name}' must be a number" if types is not int else
                                f"'{name}' must be an integer")
    stop = msg.get("stop")
    if msg.get("session") is not None and not isinstance(msg["session"], str):
        raise ProtocolError("BAD_MESSAGE", "'session' must be a string")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ProtocolError("BAD_MESSAGE", "'stop' must be a list of strings")
    texts = [("prompt", prompt)] if prompt is not None else \
        [(f"messages[{i}].{k}", m[k]) for i, m in enumerate(messages) for k in ("role", "content")]
    for name, text in texts + [(f"stop[{i}]", s) for i, s in enumerate(stop or ())]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's \ud800 escapes can carry a lone surrogate in
            raise ProtocolError("BAD_MESSAGE", f"'{name}' is not valid Unicode: a lone surrogate at character "
                                               f"{e.start}") from None
    if msg.get("max_tokens", 1) > max_tokens_limit:
        raise ProtocolError("INVALID_REQUEST", f"max_tokens {msg['max_tokens']} is above this daemon's limit of "
                                               f"{max_tokens_limit}")
