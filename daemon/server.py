"""colibrid: the model placed once, served to many clients.

Sockets: a user socket (generate, chat, status, stats, ping, cancel) and an operator
socket (everything, including cache, pins, policy, reload and shutdown), each a socket
file of mode 0660 whose group the configuration names; access is by file permissions.
Inside the daemon a client's identity is prefixed with the socket it came on (b"U" or
b"O"), so replies and stream events go back the way the request came.

Threads:
- the I/O thread (the main thread) owns the ROUTER sockets and never runs model code, so
  ping, status, stats and cancel answer at once, even during heavy generation;
- the engine thread runs the Batcher: every active request advances one token per step;
  it hands the I/O thread (identity, frame) pairs over an inproc PUSH/PULL pair.
ZMQ sockets stay in the thread that made them; requests go to the engine thread through
a queue.

Start-up: the sockets are bound first (after checking that no other daemon answers on
them), then the engine thread loads the model while the I/O thread already answers:
ping, status and stats report the phase and its progress, requests that need the model
get LOADING. READY=1 goes to systemd once the model is placed.
"""

import logging
import os
import queue
import signal
import threading
import time

import zmq

from ..storage.errors import ColibriError
from . import protocol as P
from .config import Config, state_dir
from .notify import notify, watchdog_interval_s

log = logging.getLogger("colibri.daemon")

EVENTS = "inproc://colibri-events"
EXIT_STUCK = 1
EXIT_ENGINE_FAILED = 1  # non-zero, so systemd's Restart=on-failure restarts the daemon
RESIDENT = ("this model's experts are all resident (a checkpoint); convert it to a container "
            "(colictl convert) to stream them under a budget")
NEEDS_MODEL = ("generate", "cache", "pin", "unpin", "policy", "reload")  # answered LOADING until placed


class Stopped(Exception):
    """The daemon was told to stop while it was loading."""


class Server:
    """Config loaded once, then Server(config).run()."""

    def __init__(self, cfg: Config, config_path: str | None = None, overrides: dict | None = None):
        self.cfg = cfg
        self.config_path, self.overrides = config_path, overrides or {}
        self.t_start = time.time()
        self.stopping = threading.Event()
        self.signals = 0
        self.hup = False
        self.inbox: queue.Queue = queue.Queue()  # I/O thread -> engine thread
        self.inflight: dict[tuple[bytes, str], float] = {}  # generate requests not yet replied to
        self.gone: set[tuple[bytes, str]] = set()  # of those, the ones whose client vanished
        self._saved_steps = None  # the usage history's step count at its last write
        self.counters = {"accepted": 0, "served": 0, "failed": 0, "cancelled": 0, "tokens": 0}
        self.boot: dict = {}
        self.model = None  # set by the engine thread once placed
        self.phase, self.progress = "starting", None  # what loading does now, (done, total) of it
        self.load_error: BaseException | None = None
        self.engine_failed = False
        self.engine_beat = time.monotonic()  # when the engine thread last moved (see engine_progresses)
        self._status_at = 0.0
        self.socket_path = cfg.socket or P.default_socket()
        self.operator_path = cfg.operator_socket or P.operator_socket(self.socket_path)
        self.routers: dict[bytes, zmq.Socket] = {}  # b"U": user socket, b"O": operator socket
        self.handlers = {  # request type -> handler (explicit: never getattr on a wire string)
            "hello_request": self.on_hello,
            "ping_request": self.on_ping,
            "status_request": self.on_status,
            "stats_request": self.on_stats,
            "generate_request": self.on_generate,
            "cancel_request": self.on_cancel,
            "shutdown_request": self.on_shutdown,
            "cache_request": self.on_cache,
            "reload_request": self.on_reload,
            "pin_request": self.on_pin,
            "unpin_request": self.on_pin,
            "policy_request": self.on_policy,
        }

    # ---- start-up --------------------------------------------------------------------------

    def place(self) -> None:
        """Boot-time placement before the model loads: CPUs, NUMA node (daemon/boot.py)."""
        from .boot import set_cpus, set_numa

        # the node first: numa_run_on_node sets the affinity to all of the node's CPUs, which
        # would undo the CPUs asked for if it came second
        self.boot["numa"] = set_numa(self.cfg.numa_node)
        self.boot["cpus"] = set_cpus(self.cfg.cpus)
        self.boot["io_threads"] = {"asked": self.cfg.io_threads, "got": self.cfg.io_threads}

    def set_phase(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        """Loading's progress, for status and the log (a new phase) and systemd's STATUS= (at
        most twice a second). Raises Stopped when the daemon is stopping, so a load ends at
        its next step."""
        if self.stopping.is_set():
            raise Stopped()
        self.engine_beat = time.monotonic()
        new = phase != self.phase
        self.phase, self.progress = phase, (done, total) if total else None
        if new:
            log.info("%s", phase)
        now = time.monotonic()
        if new or now - self._status_at >= 0.5:
            self._status_at = now
            notify(f"STATUS={self.phase_text()}")
        if new and phase == "reading dense weights" and os.environ.get("COLIBRI_TEST_LOAD_DELAY_S"):
            # a test hook (like COLIBRI_FAULTS): a load slow enough to watch from a client
            end = time.monotonic() + float(os.environ["COLIBRI_TEST_LOAD_DELAY_S"])
            log.warning("COLIBRI_TEST_LOAD_DELAY_S is set: loading waits on purpose")
            while time.monotonic() < end:
                if self.stopping.wait(0.05):
                    raise Stopped()

    def phase_text(self) -> str:
        if self.progress:
            done, total = self.progress
            return f"{self.phase}: {done}/{total}"
        return self.phase

    def load(self) -> None:
        """On the engine thread: the model placed, its kernels compiled. Raises the model's
        errors (ColibriError, OSError), Stopped."""
        from ..engine import layers
        from ..engine.demo import default_demo_path, ensure_demo_container
        from ..engine.registry import load_model
        from ..engine.tokenizer import Tokenizer, eos_ids
        from ..storage.cache import parse_size
        from ..storage.checkpoint import load_config
        from ..storage.container import is_container

        path = self.cfg.model or default_demo_path(state_dir(self.cfg))
        if self.cfg.model is None:
            ensure_demo_container(path, self.set_phase)
        self.set_phase("checking the model's files")
        t0 = time.perf_counter()
        n = self.cfg.compute_threads or len(os.sched_getaffinity(0))
        budget = parse_size(self.cfg.expert_cache) if is_container(path) else None
        history = self.cfg.history
        model = load_model(path, budget=budget, io_threads=self.cfg.io_threads, mlock=self.cfg.mlock,
                           hugetlb=self.cfg.hugepages, policy=self.cfg.cache_policy(),
                           state_dir=state_dir(self.cfg) if history else None,
                           history_read_only=history == "read-only", history_half_life=self.cfg.history_half_life,
                           verify=self.cfg.verify, mirror=self.cfg.mirror, progress=self.set_phase)
        tokenizer = Tokenizer(path)
        self.eos = eos_ids(path, load_config(path), tokenizer)
        layers.init(n, self.set_phase)
        self.tokenizer, self.model_path = tokenizer, path
        self.boot["compute_threads"] = {"asked": self.cfg.compute_threads or "all", "got": n}
        experts = model.experts.describe()
        if "mlock" in experts:
            self.boot["mlock_experts"] = {"asked": self.cfg.mlock, "got": experts["mlock"]}
            self.boot["hugepages"] = {"asked": "reserved" if self.cfg.hugepages else "transparent",
                                      "got": experts.get("hugepages")}
        if self.cfg.mlock:
            from .boot import lock_arrays

            dense = list(model.glob.values()) + [a for L in model.layers for a in L.values()]
            self.boot["mlock_dense"] = lock_arrays(dense, "dense weights")
        self.boot["load_s"] = round(time.perf_counter() - t0, 3)
        self.model = model  # the I/O thread serves requests that need it from here on
        self.phase, self.progress = "serving", None
        log.info("model %s placed in %.2f s", path, self.boot["load_s"])

    def bind(self, ctx: zmq.Context, path: str, group: str | None) -> zmq.Socket:
        """A ROUTER on `path`, mode 0660, of `group` (None: the daemon's). Raises
        ColibriError when another daemon serves the path or the group cannot be set."""
        os.makedirs(os.path.dirname(path) or ".", mode=0o750, exist_ok=True)
        if os.path.exists(path):  # a stale file from a killed daemon, unless one still answers
            if self._answers(ctx, path):
                raise ColibriError(f"another colibrid already serves {path}")
            os.unlink(path)
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, 0)
        # a hard bound on what a peer can make us buffer; up to it, an oversized request gets TOO_LARGE
        router.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_message_bytes + 4096)
        router.bind(P.endpoint(path))
        os.chmod(path, 0o660)
        if group:
            import grp

            try:
                os.chown(path, -1, grp.getgrnam(group).gr_gid)
            except (KeyError, PermissionError) as e:
                router.close(0)
                why = "no such group" if isinstance(e, KeyError) else "colibrid is not a member of it"
                raise ColibriError(f"cannot give {path} to group {group!r}: {why}") from None
        return router

    @staticmethod
    def _answers(ctx, path) -> bool:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        try:
            s.connect(P.endpoint(path))
            s.send(P.encode(P.request("ping", "probe")))
            return bool(s.poll(500))
        finally:
            s.close()

    # ---- main loop -------------------------------------------------------------------------

    def run(self) -> int:
        """Bind the sockets, place the model while answering, serve until told to stop,
        return the exit code. Raises ColibriError (a socket that cannot be set up, another
        daemon on it), and what loading the model raised."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        notify("STATUS=starting")
        ctx = zmq.Context()
        try:
            self.routers = {b"U": self.bind(ctx, self.socket_path, self.cfg.socket_group)}
            self.routers[b"O"] = self.bind(ctx, self.operator_path, self.cfg.operator_group)
        except Exception:
            for tag, router in self.routers.items():
                router.close(0)
                os.unlink(self.socket_path if tag == b"U" else self.operator_path)
            ctx.term()
            raise
        log.info("listening on %s (operators: %s); placing the model", self.socket_path, self.operator_path)
        self.place()
        events = ctx.socket(zmq.PULL)
        events.bind(EVENTS)
        engine = threading.Thread(target=self.engine_loop, args=(ctx,), name="colibri-engine", daemon=True)
        engine.start()
        watchdog = watchdog_interval_s(self.cfg.watchdog_s)
        last_ping = 0.0
        poller = zmq.Poller()
        by_socket = {}
        for tag, router in self.routers.items():
            poller.register(router, zmq.POLLIN)
            by_socket[router] = tag
        poller.register(events, zmq.POLLIN)
        try:
            while not self.stopping.is_set() or self.inflight:
                if self.stopping.is_set() and not engine.is_alive():
                    while events.poll(0):  # its last events (SHUTTING_DOWN replies) still go out
                        self.deliver(*events.recv_multipart())
                    for identity, rid in list(self.inflight):  # the engine died with them: each still gets one
                        self.deliver(identity, P.encode(P.error("generate", rid, "INTERNAL", "colibrid's engine "
                                                                "failed (a bug: see its log); it is stopping")))
                    break
                for sock, _ in poller.poll(100):
                    if sock is not events:
                        self.on_frames(by_socket[sock], sock.recv_multipart())
                    else:
                        identity, frame = events.recv_multipart()
                        self.deliver(identity, frame)
                if self.hup:
                    self.hup = False
                    try:
                        self.reload()
                    except ColibriError as e:
                        log.error("SIGHUP: reload refused, keeping the running configuration: %s", e)
                now = time.monotonic()
                if watchdog and now - last_ping >= watchdog and self.engine_progresses(engine, now, watchdog):
                    notify("WATCHDOG=1")
                    last_ping = now
        finally:
            notify("STOPPING=1", "STATUS=stopping")
            self.stopping.set()
            engine.join(timeout=10)
            for router in self.routers.values():
                router.close(linger=1000)  # the last replies (SHUTTING_DOWN) still reach their clients
            events.close(0)
            for path in (self.socket_path, self.operator_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            if engine.is_alive():  # stuck in a kernel or a read: nothing left to save
                log.warning("the engine thread did not stop in 10 s; exiting without it")
                os._exit(EXIT_STUCK)
            ctx.term()
            log.info("stopped")
        if self.load_error is not None:
            raise self.load_error
        return EXIT_ENGINE_FAILED if self.engine_failed else 0

    def engine_progresses(self, engine: threading.Thread, now: float, interval: float) -> bool:
        """Whether the watchdog may be fed: the engine thread is alive and has moved (an
        idle loop, a step, a layer, a loading phase) within the interval (at least 1 s), so
        a step hung on a stalled drive or a stuck kernel stops the pings and systemd
        restarts the daemon."""
        beat = max(self.engine_beat, getattr(self.model, "beat", 0.0))
        return engine.is_alive() and now - beat < max(interval, 1.0)

    def _on_stop_signal(self, signum, frame):
        self.signals += 1
        if self.signals > 1:
            os._exit(1)  # a second signal: stop now
        log.info("signal %d: stopping (a second one forces exit)", signum)
        self.stopping.set()

    def _on_hup(self, signum, frame):
        self.hup = True  # handled by the main loop, outside the signal handler

    POLICY_KEYS = ("policy", "hot_set", "repin_every", "repin_margin", "prefetch_reads")
    RUNTIME_KEYS = ("expert_cache", "max_queue", "max_active", "batch_window_ms", "max_tokens_limit", "log_level", "watchdog_s",
                    "history_save_s", *POLICY_KEYS)

    def reload(self, key=None) -> dict:
        """Read the configuration again (flags still override it) and apply what can change
        while running; say what needs a restart. A bad file changes nothing.
        Raises ConfigError."""
        from .config import load
        from .logs import setup_logging

        new = load(self.config_path, self.overrides)
        old = self.cfg
        changed = [k for k in new.as_dict() if getattr(new, k) != getattr(old, k)]
        applied = [k for k in changed if k in self.RUNTIME_KEYS]
        restart = [k for k in changed if k not in self.RUNTIME_KEYS]
        self.cfg = new
        if "log_level" in applied:
            setup_logging(new.log_level)
        if set(applied) & set(self.POLICY_KEYS) and hasattr(self.model.experts, "set_policy"):
            self.inbox.put(("policy_set", None, new.cache_policy()))
        if "expert_cache" in applied and hasattr(self.model.experts, "resize"):
            from ..storage.cache import parse_size

            self.inbox.put(("cache_set", key, parse_size(new.expert_cache), None))
        log.info("configuration reloaded: applied %s; needs a restart: %s", applied or "nothing", restart or "nothing")
        return {"applied": applied, "restart_needed": restart}

    def on_reload(self, identity, rid, msg):
        from .config import ConfigError

        try:
            return P.ok("reload", rid, **self.reload())
        except ConfigError as e:
            log.error("reload refused, keeping the running configuration: %s", e)
            return P.error("reload", rid, "INVALID_REQUEST", f"{e} (the running configuration is unchanged)")

    # ---- I/O thread: frames in, replies out ------------------------------------------------

    def send(self, identity: bytes, msg: dict) -> bool:
        """Send to one client (identity: socket tag + ZMQ identity); False if it is gone
        (ROUTER_MANDATORY makes that an error)."""
        try:
            self.routers[identity[:1]].send_multipart([identity[1:], P.encode(msg)])
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def on_frames(self, tag: bytes, frames: list[bytes]) -> None:
        identity, payload = tag + frames[0], frames[-1]
        if len(payload) > self.cfg.max_message_bytes:
            log.warning("refused a message of %d bytes on the %s socket: above max_message_bytes (%d)", len(payload),
                        "user" if tag == b"U" else "operator", self.cfg.max_message_bytes)
            self.send(identity, P.error("unknown", None, "TOO_LARGE", f"a request of {len(payload)} bytes is above "
                                                                      f"this daemon's max_message_bytes of "
                                                                      f"{self.cfg.max_message_bytes}"))
            return
        try:
            msg = P.decode(payload)
        except P.ProtocolError as e:
            self.send(identity, P.error("unknown", None, e.name, str(e)))
            return
        kind = msg["type"].removesuffix("_request")
        rid = msg.get("id")
        handler = self.handlers.get(msg["type"])
        if handler is None:
            self.send(identity, P.error(kind, rid, "UNKNOWN_TYPE",
                                        f"colibrid does not handle {msg['type']!r} (protocol {P.PROTOCOL_VERSION})"))
            return
        if tag == b"U" and kind not in P.USER_TYPES:
            self.send(identity, P.error(kind, rid, "FORBIDDEN", f"{kind} is an operator request: send it on the "
                                                                f"operator socket {self.operator_path}"))
            return
        if "v" in msg and not P.compatible(msg["v"]):
            self.send(identity, P.error(kind, rid, "VERSION_MISMATCH",
                                        f"client speaks protocol {msg['v']}, colibrid {P.PROTOCOL_VERSION}: "
                                        "upgrade the older side"))
            return
        if not isinstance(rid, str):
            self.send(identity, P.error(kind, None, "BAD_MESSAGE", "a request needs a string 'id'"))
            return
        if self.model is None and kind in NEEDS_MODEL:
            self.send(identity, P.error(kind, rid, "LOADING", f"colibrid is still loading its model "
                                                              f"({self.phase_text()}); retry when `colictl status` "
                                                              "says serving (generate --wait waits)"))
            return
        try:
            reply = handler(identity, rid, msg)
        except Exception as e:  # a bug must cost one request, never the daemon
            log.exception("handling %s", msg["type"])
            reply = P.error(kind, rid, "INTERNAL", f"{type(e).__name__}: {e}")
        if reply is not None:
            self.send(identity, reply)

    def deliver(self, identity: bytes, frame: bytes) -> None:
        """An engine event for a client; a final reply ends the request's bookkeeping."""
        msg = P.decode(frame)
        key = (identity, msg.get("id"))
        if msg["type"].endswith("_reply"):
            self.inflight.pop(key, None)
            self.gone.discard(key)
        try:
            self.routers[identity[:1]].send_multipart([identity[1:], frame])
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
        if key in self.inflight and key not in self.gone:  # the client is gone
            log.info("client of request %s is gone: cancelling it", key[1])
            self.gone.add(key)
            self.inbox.put(("cancel", key))

    def model_summary(self) -> dict | None:
        if self.model is None:
            return None
        info = self.model.describe()
        return {"path": self.model_path, "type": info["model_type"], "precision": info["precision"],
                "placement": info["experts"], "n_layer": info["n_layer"], "n_expert": info["n_expert"],
                "n_ctx": info["n_ctx"], **({"note": info["note"]} if "note" in info else {})}

    def on_hello(self, identity, rid, msg):
        if not P.compatible(msg.get("protocol")):
            return P.error("hello", rid, "VERSION_MISMATCH",
                           f"client speaks protocol {msg.get('protocol')}, colibrid {P.PROTOCOL_VERSION}")
        from .. import __version__

        return P.ok("hello", rid, protocol=P.PROTOCOL_VERSION, server=f"colibrid {__version__}",
                    model=self.model_summary(), max_message_bytes=self.cfg.max_message_bytes, **self.loading())

    def loading(self) -> dict:
        """`phase` (loading's step, or serving) and `progress` ({done, total} or null)."""
        p = self.progress
        return {"phase": self.phase, "progress": {"done": p[0], "total": p[1]} if p else None}

    def on_ping(self, identity, rid, msg):
        return P.ok("ping", rid, t=time.time())

    def on_status(self, identity, rid, msg):
        # what the process has now, read back from the kernel, not what boot once got
        boot = self.boot | {"cpus": self.boot.get("cpus", {}) | {"got": sorted(os.sched_getaffinity(0))}}
        return P.ok("status", rid, pid=os.getpid(), uptime_s=round(time.time() - self.t_start, 3),
                    socket=self.socket_path, operator_socket=self.operator_path, model=self.model_summary(),
                    boot=boot,
                    requests={"active": len(self.inflight), "queued": self.inbox.qsize()},
                    config=self.cfg.as_dict(), **self.loading())

    def on_stats(self, identity, rid, msg):
        experts = self.model.experts if self.model is not None else None
        extra = {"policy": experts.policy.name, "history": experts.history.describe()} \
            if hasattr(experts, "policy") else {"policy": None}
        return P.ok("stats", rid, experts=experts.stats.as_dict() if experts is not None else None,
                    requests=dict(self.counters), uptime_s=round(time.time() - self.t_start, 3), **self.loading(),
                    **extra)

    def on_policy(self, identity, rid, msg):
        from ..storage.policy import PolicyInvalid

        experts = self.model.experts
        action = msg.get("action")
        if action not in ("show", "set"):
            return P.error("policy", rid, "BAD_MESSAGE", "'action' must be \"show\" or \"set\"")
        if not hasattr(experts, "set_policy"):  # all resident: nothing to choose, but a query is answered
            if action == "show":
                return P.ok("policy", rid, policy={"policy": "resident"}, history=None)
            return P.error("policy", rid, "INVALID_REQUEST", RESIDENT)
        if action == "show":
            return P.ok("policy", rid, policy=experts.policy.as_dict(), history=experts.history.describe())
        settings = msg.get("settings")
        if not isinstance(settings, dict) or not settings:
            return P.error("policy", rid, "BAD_MESSAGE", "'settings' must be a non-empty object of KEY: VALUE")
        try:
            policy = experts.policy.with_settings(settings)
        except PolicyInvalid as e:
            return P.error("policy", rid, "INVALID_REQUEST", str(e))
        self.inbox.put(("policy_set", (identity, rid), policy))  # applied between two steps
        return None

    def on_generate(self, identity, rid, msg):
        if self.stopping.is_set():
            return P.error("generate", rid, "SHUTTING_DOWN", "colibrid is stopping")
        why = check_generate(msg, self.cfg.max_tokens_limit)
        if why:
            return P.error("generate", rid, "BAD_MESSAGE" if why[0] == "type" else "INVALID_REQUEST", why[1])
        key = (identity, rid)
        if key in self.inflight:
            return P.error("generate", rid, "INVALID_REQUEST", f"a request with id {rid!r} is already running")
        if len(self.inflight) >= self.cfg.max_active + self.cfg.max_queue:
            return P.error("generate", rid, "BUSY", f"{len(self.inflight)} requests are running or queued; "
                                                    "retry later")
        mine = sum(1 for ident, _ in self.inflight if ident == identity)
        if mine >= self.cfg.max_streams_per_client:
            return P.error("generate", rid, "BUSY", f"this client has {mine} requests running or queued, the most "
                                                    "one client may have (max_streams_per_client); retry later")
        self.inflight[key] = time.time()
        self.counters["accepted"] += 1  # each ends as exactly one of served, failed, cancelled
        self.inbox.put(("generate", key, msg))
        return None  # the engine thread streams and replies

    def on_cancel(self, identity, rid, msg):
        target = msg.get("target")
        if (identity, target) not in self.inflight:
            return P.error("cancel", rid, "NOT_FOUND", f"no running request {target!r} of this client")
        self.inbox.put(("cancel", (identity, target)))
        return P.ok("cancel", rid, cancelled=True)

    def on_cache(self, identity, rid, msg):
        action = msg.get("action")
        if action == "show":
            return P.ok("cache", rid, placement=self.model.experts.describe(),
                        experts=self.model.experts.stats.as_dict())
        if action != "set":
            return P.error("cache", rid, "BAD_MESSAGE", "'action' must be \"show\" or \"set\"")
        from ..storage.cache import BudgetInvalid, parse_size

        size = msg.get("experts")
        if isinstance(size, bool) or not isinstance(size, str | int):
            return P.error("cache", rid, "BAD_MESSAGE", "'experts' must be a size: bytes, KiB/MiB/GiB, min or all")
        try:
            budget = parse_size(str(size))
        except BudgetInvalid as e:
            return P.error("cache", rid, "INVALID_REQUEST", str(e))
        pinned = msg.get("pinned")
        if pinned is not None and pinned != "auto":
            try:
                pinned = parse_size(str(pinned)) if not isinstance(pinned, bool) else parse_size("?")
            except BudgetInvalid as e:
                return P.error("cache", rid, "INVALID_REQUEST", f"pinned: {e}")
            if not isinstance(pinned, int):
                return P.error("cache", rid, "INVALID_REQUEST", "pinned must be a size in bytes, KiB, MiB or GiB")
        if not hasattr(self.model.experts, "resize"):
            return P.error("cache", rid, "INVALID_REQUEST", RESIDENT)
        self.inbox.put(("cache_set", (identity, rid), budget, pinned))  # the engine thread resizes between two steps
        return None

    def on_pin(self, identity, rid, msg):
        kind = msg["type"].removesuffix("_request")
        il, ie = msg.get("layer"), msg.get("expert")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (il, ie)):
            return P.error(kind, rid, "BAD_MESSAGE", "'layer' and 'expert' must be integers")
        if not hasattr(self.model.experts, "pin"):
            return P.error(kind, rid, "INVALID_REQUEST", RESIDENT)
        if il not in self.model.moe_layers or not 0 <= ie < self.model.n_expert:
            return P.error(kind, rid, "INVALID_REQUEST", f"no expert {il}:{ie}: MoE layers are "
                                                         f"{self.model.moe_layers[0]}..{self.model.moe_layers[-1]}, "
                                                         f"experts 0..{self.model.n_expert - 1}")
        self.inbox.put((kind, (identity, rid), il, ie))
        return None

    def on_shutdown(self, identity, rid, msg):
        log.info("shutdown requested")
        self.stopping.set()
        return P.ok("shutdown", rid, stopping=True)

    # ---- engine thread ---------------------------------------------------------------------

    def engine_loop(self, ctx: zmq.Context) -> None:
        from ..engine.generate import Batcher

        try:
            self.load()
        except Stopped:
            log.info("stopped while loading")
            return
        except BaseException as e:  # the main thread re-raises it once the sockets are closed
            self.load_error = e
            self.phase, self.progress = "failed", None
            self.stopping.set()
            return
        notify("READY=1", f"STATUS=serving {self.model_path} on {self.socket_path}")
        log.info("serving %s", self.model_path)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(EVENTS)
        batcher = Batcher(self.model)
        saved_at = time.monotonic()
        waiting: list = []
        state: dict = {}  # key -> (request, token ids, text pieces)
        by_client: set = set()  # requests their client cancelled (the others a stop cancels)

        def out(key, msg):
            push.send_multipart([key[0], P.encode(msg)])

        try:
            while True:
                if self.stopping.is_set():  # finish nothing new: cancel what runs and waits
                    for r in batcher.active:
                        r.cancelled = True
                    for key, _ in waiting:
                        out(key, P.error("generate", key[1], "SHUTTING_DOWN", "colibrid is stopping"))
                    waiting.clear()
                    if not batcher.active:
                        return
                self.engine_beat = time.monotonic()
                idle = not batcher.active and not waiting
                block = idle and not self.stopping.is_set()
                gather_until = None  # an idle engine's first request waits for those sent with it
                try:
                    while True:
                        if block:
                            item = self.inbox.get(timeout=0.1)
                        elif gather_until is not None and len(waiting) < self.cfg.max_active and (
                                left := gather_until - time.monotonic()) > 0:
                            item = self.inbox.get(timeout=left)
                        else:
                            item = self.inbox.get_nowait()
                        block = False
                        if item[0] == "generate":
                            waiting.append((item[1], item[2]))
                            if idle and gather_until is None:
                                gather_until = time.monotonic() + self.cfg.batch_window_ms / 1e3
                        elif item[0] == "cache_set":
                            reply = self.resize(item[1][1] if item[1] else None, item[2], item[3])
                            if item[1]:  # None: a reload asked, nobody waits for the reply
                                out(item[1], reply)
                        elif item[0] in ("pin", "unpin"):
                            out(item[1], self.pin(item[0], item[1][1], item[2], item[3]))
                        elif item[0] == "policy_set":
                            reply = self.set_policy(item[1][1] if item[1] else None, item[2])
                            if item[1]:
                                out(item[1], reply)
                        else:  # cancel: a running request leaves at the next step, a waiting one now
                            key = item[1]
                            if key in state:
                                state[key][0].cancelled = True
                                by_client.add(key)
                            elif any(k == key for k, _ in waiting):
                                waiting = [(k, m) for k, m in waiting if k != key]
                                out(key, P.error("generate", key[1], "CANCELLED", "cancelled before it started"))
                                self.counters["cancelled"] += 1
                except queue.Empty:
                    pass
                while waiting and len(batcher.active) < self.cfg.max_active:
                    key, msg = waiting.pop(0)
                    try:
                        req = self.new_request(key, msg)
                    except ColibriError as e:
                        out(key, P.error("generate", key[1], "INVALID_REQUEST", str(e)))
                        self.counters["failed"] += 1
                        continue
                    except Exception as e:  # a bug must cost this request, never the engine thread
                        log.exception("starting request %s", key[1])
                        out(key, P.error("generate", key[1], "INTERNAL", f"{type(e).__name__}: {e}"))
                        self.counters["failed"] += 1
                        continue
                    batcher.add(req)
                    state[key] = (req, [], [])
                    if os.environ.get("COLIBRI_TEST_ENGINE_CRASH"):  # a test hook: a bug in the loop itself
                        raise RuntimeError("COLIBRI_TEST_ENGINE_CRASH is set")
                if time.monotonic() - saved_at >= self.cfg.history_save_s:
                    self.save_history()
                    saved_at = time.monotonic()
                if not batcher.active:
                    continue
                try:
                    events = batcher.step()
                except Exception as e:  # e.g. an expert read failed: fail this step's requests, serve on
                    model_error = isinstance(e, ColibriError)
                    if model_error:
                        log.error("step failed: %s", e)
                    else:
                        log.exception("step failed")
                    for r in batcher.active:
                        key = r.id
                        out(key, P.error("generate", key[1], "MODEL_ERROR" if model_error else "INTERNAL",
                                         str(e) if model_error else f"{type(e).__name__}: {e}"))
                        state.pop(key, None)
                        self.counters["failed"] += 1
                    batcher.active.clear()
                    continue
                for req, ev in events:
                    key = req.id
                    _, ids, pieces = state[key]
                    if ev.kind == "token":
                        ids.append(ev.token_id)
                        pieces.append(ev.text)
                        self.counters["tokens"] += 1
                        out(key, P.stream(key[1], ev.token_id, ev.text))
                        continue
                    pieces.append(ev.text)
                    del state[key]
                    if ev.finish_reason == "cancelled":
                        self.counters["cancelled"] += 1
                        reply = P.error("generate", key[1], "CANCELLED", "the request was cancelled") \
                            if key in by_client else \
                            P.error("generate", key[1], "SHUTTING_DOWN", "colibrid is stopping: the request was "
                                                                         "cut short (retry when it is back)")
                        by_client.discard(key)
                        out(key, reply | {"token_ids": ids, "text": "".join(pieces)})
                    else:
                        self.counters["served"] += 1
                        out(key, P.ok("generate", key[1], prompt_token_ids=req.prompt_ids, token_ids=ids,
                                      text="".join(pieces), finish_reason=ev.finish_reason, stats=ev.stats))
        except Exception:
            log.exception("the engine thread failed; stopping")
            self.engine_failed = True
            self.stopping.set()
        finally:
            self.save_history()
            push.close(linger=1000)  # its last events reach the I/O thread

    def save_history(self) -> None:
        """Write the usage history (atomically) from the engine thread; a failure is logged."""
        history = getattr(self.model.experts, "history", None) if self.model is not None else None
        if history is None or history.steps == self._saved_steps:
            return  # nothing new since the last write
        self._saved_steps = history.steps
        try:
            if history.save():
                log.debug("usage history saved to %s", history.path)
        except OSError as e:
            log.warning("could not save the usage history to %s: %s", history.path, e.strerror)

    def set_policy(self, rid, policy) -> dict:
        """Between two steps, on the engine thread."""
        from ..storage.cache import BudgetInvalid

        try:
            desc = self.model.experts.set_policy(policy)
        except BudgetInvalid as e:
            return P.error("policy", rid, "INVALID_REQUEST", str(e))
        self.model.prefetch_reads = policy.prefetch_reads
        log.info("expert cache policy: %s", policy.as_dict())
        return P.ok("policy", rid, policy=desc["policy"], history=desc["history"])

    def pin(self, kind, rid, il, ie) -> dict:
        """Between two steps, on the engine thread."""
        from ..storage.cache import BudgetInvalid, ExpertReadError

        try:
            (self.model.experts.pin if kind == "pin" else self.model.experts.unpin)(il, ie)
        except BudgetInvalid as e:
            return P.error(kind, rid, "INVALID_REQUEST", str(e))
        except KeyError:
            return P.error(kind, rid, "NOT_FOUND", f"expert {il}:{ie} is not pinned")
        except ExpertReadError as e:
            return P.error(kind, rid, "MODEL_ERROR", str(e))
        log.info("%sned expert %d:%d", kind, il, ie)
        return P.ok(kind, rid, pinned=self.model.experts.describe()["pinned"])

    def resize(self, rid, budget, pinned=None) -> dict:
        """Between two steps, on the engine thread: no request sees the change but in speed."""
        from ..storage.cache import BudgetInvalid

        try:
            t0 = time.perf_counter()
            desc = self.model.experts.resize(budget, pinned)
        except BudgetInvalid as e:
            return P.error("cache", rid, "INVALID_REQUEST", str(e))
        log.info("expert cache resized to %d bytes in %.2f s", desc["arena_bytes"], time.perf_counter() - t0)
        return P.ok("cache", rid, placement=desc, experts=self.model.experts.stats.as_dict())

    def new_request(self, key, msg):
        from ..engine.generate import Request, SamplingParams

        if "messages" in msg:
            text = self.tokenizer.apply_chat_template(msg["messages"])
            ids = self.tokenizer.encode(text, special=False)
        else:
            ids = self.tokenizer.encode(msg["prompt"])
        params = SamplingParams(max_tokens=msg.get("max_tokens", 256), temperature=float(msg.get("temperature", 0.0)),
                                top_k=msg.get("top_k", 0), top_p=float(msg.get("top_p", 1.0)), seed=msg.get("seed"),
                                stop=tuple(msg.get("stop") or ()))
        return Request(self.model, ids, params, self.eos, self.tokenizer, rid=key)


def check_generate(msg: dict, max_tokens_limit: int) -> tuple[str, str] | None:
    """("type" or "value", why) for a generate request that cannot run, else None."""
    prompt, messages = msg.get("prompt"), msg.get("messages")
    if (prompt is None) == (messages is None):
        return "type", "a generate request has exactly one of 'prompt' (a string) or 'messages' (a list)"
    if prompt is not None and not isinstance(prompt, str):
        return "type", "'prompt' must be a string"
    if messages is not None and not (
        isinstance(messages, list) and messages
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
        return "type", "'messages' must be a non-empty list of {\"role\": str, \"content\": str}"
    for name, types in (("max_tokens", int), ("top_k", int), ("seed", int), ("temperature", int | float),
                        ("top_p", int | float)):
        v = msg.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
            return "type", f"'{name}' must be a number" if types is not int else f"'{name}' must be an integer"
    stop = msg.get("stop")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return "type", "'stop' must be a list of strings"
    texts = [("prompt", prompt)] if prompt is not None else \
        [(f"messages[{i}].{k}", m[k]) for i, m in enumerate(messages) for k in ("role", "content")]
    for name, text in texts + [(f"stop[{i}]", s) for i, s in enumerate(stop or ())]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's \ud800 escapes can carry a lone surrogate in
            return "type", f"'{name}' is not valid Unicode: a lone surrogate at character {e.start}"
    if msg.get("max_tokens", 1) > max_tokens_limit:
        return "value", f"max_tokens {msg['max_tokens']} is above this daemon's limit of {max_tokens_limit}"
    return None
