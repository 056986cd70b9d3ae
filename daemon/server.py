"""colibrid: the model placed once, served to many clients. This module is the daemon's
lifecycle and sockets; the model is placed by loading.py, the requests are answered by
handlers.py, the engine thread's loop is scheduler.py, and every wire message is built by
protocol.py.

Sockets: a user socket (generate, chat, status, stats, ping, cancel) and an operator
socket (everything, including cache, pins, policy, reload and shutdown), each a socket
file of mode 0660 whose group the configuration names; access is by file permissions.
Inside the daemon a client's identity is prefixed with the socket it came on (b"U" or
b"O"), so replies and stream events go back the way the request came.

Threads:
- the I/O thread (the main thread) owns the ROUTER sockets and never runs model code, so
  ping, status, stats and cancel answer at once, even during heavy generation;
- the engine thread places the model, then runs the scheduler: every active request
  advances one token per step; it hands the I/O thread (identity, frame) pairs over an
  inproc PUSH/PULL pair.
ZMQ sockets stay in the thread that made them; requests go to the engine thread as typed
messages (scheduler.py) through a queue.

Start-up: the sockets are bound first (after checking that no other daemon answers on
them), then the engine thread loads the model while the I/O thread already answers:
ping, status and stats report the phase and its progress, requests that need the model
get LOADING. READY=1 goes to systemd once the model is placed.
"""

import gc
import grp
import json
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import replace

import zmq

from ..engine.prefix import snapshot_interval
from ..storage.errors import ColibriError
from ..storage.sizes import parse_size
from . import kept
from . import protocol as P
from .boot import set_cpus, set_numa
from .config import Config, ConfigError, runtime_path, state_dir
from .handlers import Handlers
from .logs import setup_logging
from .metrics import Latencies
from .notify import notify, watchdog_interval_s
from .planner import PLAN_VERSION, plan_path
from .scheduler import Cancel, Resize, Scheduler, SetPolicy

log = logging.getLogger("colibri.daemon")

EVENTS = "inproc://colibri-events"
EXIT_STUCK = 1
IPC_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path less its NUL)
EXIT_ENGINE_FAILED = 1  # non-zero, so systemd's Restart=on-failure restarts the daemon


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
        self.counters = {"accepted": 0, "served": 0, "rejected": 0, "failed": 0, "cancelled": 0, "tokens": 0}
        self.boot: dict = {}
        self.model = None  # set by the engine thread once placed
        self.control = None  # the expert cache's runtime control; None when every expert is resident
        self.latency = Latencies()  # time to first token and between tokens (stats, the gateway's /metrics)
        self.plan: dict | None = None  # colictl tune's plan for the container (stats: predicted vs measured)
        self.plan_stamp: int | None = None  # the plan file's mtime when read (None: there was none)
        self.runtime_changes: dict = {}  # settings operators changed since start (cache set, policy set)
        self.runtime_kept: set = set()  # of those, the ones kept for the next start (--persist)
        self.reloaded: list[str] = []  # the last reload's keys that need a restart
        self.started = cfg  # the configuration the process runs: what a restart-only key is compared with
        self.fingerprint: str | None = None  # the model's, which values kept with --persist are filed under
        self.kept_notes: list = []  # what became of each value kept for this model (daemon/kept.py)
        self.batcher = None  # the engine's, once it runs (stats read its decode counters)
        self.history = None  # the usage history the daemon saves, or None
        self.phase, self.progress = "starting", None  # what loading does now, (done, total) of it
        self.load_error: BaseException | None = None
        self.engine_failed = False
        self.engine_beat = time.monotonic()  # when the engine thread last moved (see engine_progresses)
        self._status_at = 0.0
        self.socket_path = cfg.socket or P.default_socket()
        self.operator_path = cfg.operator_socket or P.operator_socket(self.socket_path)
        self.routers: dict[bytes, zmq.Socket] = {}  # b"U": user socket, b"O": operator socket
        self.sessions = None  # daemon/sessions.py's SessionStore once the model is placed
        self.prefix = None  # engine/prefix.py's PrefixCache once the model is placed
        self.handlers = Handlers(self)

    # ---- start-up --------------------------------------------------------------------------

    def place(self) -> None:
        """Boot-time placement before the model loads: CPUs, NUMA node (daemon/boot.py)."""
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
        if self.progress and self.phase == "compiling kernels":  # (engine/jit.py's Ticker: seconds)
            return f"compiling kernels: {self.progress[0]} s of about {self.progress[1]} s"
        if self.progress:
            done, total = self.progress
            return f"{self.phase}: {done}/{total}"
        return self.phase

    def load(self) -> None:
        """On the engine thread: the model placed (daemon/loading.py), then served from here
        on. Raises the model's errors (ColibriError, OSError), Stopped."""
        from .loading import place  # (the engine's import takes a second: after the sockets are bound)

        got = place(self.cfg, self.config_path, self.overrides, self.set_phase)
        self.boot |= got.boot
        self.tokenizer, self.eos, self.model_path = got.tokenizer, got.eos, got.path
        self.control, self.history, self.room = got.control, got.history, got.room
        self.sessions, self.prefix = got.sessions, got.prefix
        self.cfg = self.started = got.cfg  # with this model's kept values (kept.effective)
        self.fingerprint, self.kept_notes = got.fingerprint, got.kept
        self.plan = self.load_plan()
        # the model, tokenizer and libraries live as long as the process: frozen, the cyclic
        # collector's full passes skip them (one took ~50 ms, a step's time, at a random step)
        gc.collect()
        gc.freeze()
        self.model = got.model  # the I/O thread serves requests that need it from here on
        self.phase, self.progress = "serving", None
        log.info("model %s placed in %.2f s", got.path, self.boot["load_s"])

    def resize_tables(self, budget: int, kv: int) -> None:
        """The streamed embedding tables' cache to `budget` bytes, now: within this box's RAM
        beside the expert cache's arena and `kv` bytes of prefix cache. Raises BudgetInvalid."""
        room = replace(self.room, table_bytes=budget)
        room.check_tables("the embedding tables' cache (table_cache)",
                          (self.control.arena_bytes if self.control is not None else 0) + kv,
                          "the expert and prefix caches")
        self.room = room
        if self.control is not None:
            self.control.room = self.room  # (the experts' next resize fits beside it)
        self.model.tables.resize(budget)
        log.info("embedding tables' cache: %d bytes", budget)

    def changed_at_runtime(self, keys: dict, persist: bool, by_operator: bool) -> dict:
        """Note settings an operator changed while running (a reload's changes are the
        configuration's own, not noted), and with `persist` keep them for the next start.
        What the reply says of it: {"persisted": the file, or null; "persist_error"}."""
        if not by_operator:
            for k in keys:
                self.runtime_changes.pop(k, None)
            return {}
        same = {k for k, v in keys.items() if str(getattr(self.cfg, k)) == str(v)}  # back to the configuration's
        for k in same:
            self.runtime_changes.pop(k, None)
            self.runtime_kept.discard(k)
        keys = {k: v for k, v in keys.items() if k not in same}
        self.runtime_changes |= keys
        if not persist or not keys:
            return {"persisted": None}
        try:
            by = "policy set --persist" if set(keys) & set(self.POLICY_KEYS) else "cache set --persist"
            where = kept.keep(self.cfg.state_dir, self.fingerprint, self.model_path, keys, by)
        except (ConfigError, OSError) as e:
            log.warning("could not keep %s for the next start: %s", ", ".join(keys), getattr(e, "strerror", None) or e)
            return {"persisted": None, "persist_error": str(getattr(e, "strerror", None) or e)}
        self.runtime_kept |= set(keys)
        log.info("kept %s in %s for the next start", ", ".join(f"{k}: {v}" for k, v in keys.items()), where)
        return {"persisted": where}

    def runtime(self) -> dict:
        """What changed at runtime and whether a restart keeps it, and what became of the
        values kept for this model at start (status)."""
        pins = sorted(f"{il}:{ie}" for il, ie in self.control.hand_pins) if self.control is not None else []
        lost = [k for k in self.runtime_changes if k not in self.runtime_kept]
        return {"changed": self.runtime_changes, "kept": sorted(self.runtime_kept & set(self.runtime_changes)),
                "lost_at_restart": lost + (["pins"] if pins else []), "hand_pins": pins,
                "kept_in": runtime_path(self.cfg.state_dir), "kept_at_start": self.kept_notes,
                "restart_needed": self.pending_restart()}

    def pending_restart(self) -> list[str]:
        """The keys whose configured value differs from the one this process runs (a reload
        could not apply them)."""
        return list(self.reloaded)

    def current_plan(self) -> dict | None:
        """The plan as `colictl tune` left it: read again when its file changed since the
        last look (one stat), so a tune's prediction shows at once, without a restart."""
        if self.control is None:
            return None
        try:
            stamp = os.stat(plan_path(state_dir(self.cfg), self.control.c.fingerprint)).st_mtime_ns
        except OSError:
            stamp = None
        if stamp != self.plan_stamp:
            self.plan = self.load_plan()
        return self.plan

    def load_plan(self) -> dict | None:
        """The plan `colictl tune` kept for this container (daemon/planner.py), or None."""
        if self.control is None:
            return None
        where = plan_path(state_dir(self.cfg), self.control.c.fingerprint)
        try:
            self.plan_stamp = os.stat(where).st_mtime_ns
            with open(where) as f:
                plan = json.load(f)
        except FileNotFoundError:
            self.plan_stamp = None
            return None
        except (OSError, ValueError) as e:
            log.warning("plan %s unreadable (%s): stats show no prediction", where, e)
            return None
        if plan.get("version") != PLAN_VERSION:
            log.warning("plan %s is of another version: run colictl tune again", where)
            return None
        log.info("plan of %s: made %s, predicted %s tok/s at its recommended settings", where, plan.get("made"),
                 plan.get("recommend", {}).get("predicted_tok_s"))
        return plan

    def bind(self, ctx: zmq.Context, path: str, group: str | None) -> zmq.Socket:
        """A ROUTER on `path`, mode 0660, of `group` (None: the daemon's). Its directory is
        made when only that last level is missing (a runtime directory). Raises
        ColibriError naming the path and the reason: a path too long for a Unix socket, a
        directory that is missing or not writable, another daemon on it, a group that
        cannot be set."""
        if len(os.fsencode(path)) > IPC_PATH_MAX:
            raise ColibriError(f"cannot listen on {path}: the path is {len(os.fsencode(path))} bytes, a Unix socket's "
                               f"holds at most {IPC_PATH_MAX} (choose a shorter socket path)")
        where = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(where):
            if not os.path.isdir(os.path.dirname(where)):
                raise ColibriError(f"cannot listen on {path}: the directory {os.path.dirname(where)} does not exist")
            try:
                os.mkdir(where, 0o750)
            except FileExistsError:
                pass
            except OSError as e:
                raise ColibriError(f"cannot listen on {path}: cannot make {where}: {e.strerror}") from None
        if os.path.exists(path):  # a stale file from a killed daemon, unless one still answers
            if self._answers(ctx, path):
                raise ColibriError(f"cannot listen on {path}: another colibrid already serves it")
            try:
                os.unlink(path)
            except OSError as e:
                raise ColibriError(f"cannot listen on {path}: cannot remove the old socket file: {e.strerror}") from None
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.LINGER, 0)
        # a hard bound on what a peer can make us buffer; up to it, an oversized request gets TOO_LARGE
        router.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.max_message_bytes + 4096)
        try:
            router.bind(P.endpoint(path))
            os.chmod(path, 0o660)
        except (zmq.ZMQError, OSError) as e:
            router.close(0)  # (an open socket would keep the context's termination waiting forever)
            raise ColibriError(f"cannot listen on {path}: {os.strerror(e.errno) if e.errno else e}") from None
        if group:
            try:
                os.chown(path, -1, grp.getgrnam(group).gr_gid)
            except (KeyError, PermissionError) as e:
                router.close(0)
                why = "no such group" if isinstance(e, KeyError) else "colibrid is not a member of it"
                raise ColibriError(f"cannot give {path} to group {group!r}: {why}") from None
        return router

    def check_dirs(self) -> None:
        """The state directory and its sessions directory, made if missing and writable,
        before anything is bound or loaded. Raises ColibriError naming the directory."""
        state = state_dir(self.cfg)
        for d in (state, os.path.join(state, "sessions")):
            try:
                os.makedirs(d, mode=0o750, exist_ok=True)
            except OSError as e:
                raise ColibriError(f"cannot use the state directory {d}: {e.strerror}") from None
            if not os.access(d, os.W_OK | os.X_OK):
                why = "a read-only file system" if os.statvfs(d).f_flag & os.ST_RDONLY else "not writable by colibrid"
                raise ColibriError(f"cannot use the state directory {d}: {why}")

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
        self.check_dirs()
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
                        self.on_frames(by_socket[sock], sock.recv_multipart(copy=False))
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
        beat = max(self.engine_beat, self.model.beat if self.model is not None else 0.0)
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
    RUNTIME_KEYS = ("expert_cache", "max_queue", "max_active", "batch_window_ms", "prefill_chunk", "max_tokens_limit",
                    "log_level", "watchdog_s", "history_save_s", "kv_cache", "table_cache", "state_snapshot_tokens",
                    "sessions_bytes", "sessions_age_days",
                    *POLICY_KEYS)

    def reload(self) -> dict:
        """Read the configuration again (flags still override it, this model's kept values
        still apply as at start) and apply what can change while running; say which keys
        need a restart: those whose new value differs from the one this process runs (not
        from the last reload's). A bad file changes nothing. Raises ConfigError."""
        new, notes = kept.effective(self.config_path, self.overrides, self.fingerprint)
        for n in notes:
            if not n["applied"]:
                log.info("%s", P.kept_note(n))
        old = self.cfg
        # (the tables' cache resizes while running; reading them in, or a model without streamed tables, restarts)
        runtime = [k for k in self.RUNTIME_KEYS if k != "table_cache" or (
            getattr(self.model, "tables", None) is not None and new.table_cache != "all")]
        applied = [k for k in new.as_dict() if k in runtime and getattr(new, k) != getattr(old, k)]
        restart = [k for k in new.as_dict() if k not in runtime and getattr(new, k) != getattr(self.started, k)]
        self.reloaded = restart
        # what runs: the new values of the keys that change at runtime, the process's own of the others
        self.cfg = replace(new, **{k: getattr(self.started, k) for k in new.as_dict() if k not in runtime})
        if "log_level" in applied:
            setup_logging(new.log_level)
        if self.sessions is not None:
            self.sessions.max_bytes = parse_size(new.sessions_bytes)
            self.sessions.max_age_s = new.sessions_age_days * 86400
        if set(applied) & set(self.POLICY_KEYS) and self.control is not None:
            self.inbox.put(SetPolicy(None, new.cache_policy()))
        if "expert_cache" in applied and self.control is not None:
            self.inbox.put(Resize(None, parse_size(new.expert_cache), None))
        if "kv_cache" in applied and self.prefix is not None:
            self.inbox.put(Resize(None, None, None, parse_size(new.kv_cache)))
        if "table_cache" in applied:
            from ..storage.placement import table_cache_bytes

            self.inbox.put(Resize(None, None, None, tables=table_cache_bytes(self.model.tables.table_bytes,
                                                                            new.table_budget())))
        if "state_snapshot_tokens" in applied and self.prefix is not None:
            self.prefix.set_snapshot_tokens(snapshot_interval(new.state_snapshot_tokens, self.model))  # (read per request)
        log.info("configuration reloaded: applied %s; needs a restart: %s", applied or "nothing", restart or "nothing")
        return {"applied": applied, "restart_needed": restart}

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

    def on_frames(self, tag: bytes, frames: list[zmq.Frame]) -> None:
        identity = tag + frames[0].bytes
        reply = self.handlers.dispatch(tag, identity, frames[-1].bytes, peer_uid(frames[-1]))
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
            self.inbox.put(Cancel(key))

    # ---- engine thread ---------------------------------------------------------------------

    def engine_loop(self, ctx: zmq.Context) -> None:
        """Place the model, then run the scheduler until the daemon stops."""
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
        try:
            Scheduler(self, push).run()
        except Exception:
            log.exception("the engine thread failed; stopping")
            self.engine_failed = True
            self.stopping.set()
        finally:
            push.close(linger=1000)  # its last events reach the I/O thread


def peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process that sent `frame` on an ipc socket: libzmq reads the peer's
    credentials (SO_PEERCRED) when it connects and reports them as the frame's
    Peer-Address, "localhost:UID:GID:PID"; None where it does not."""
    try:
        parts = (frame.get("Peer-Address") or "").split(":")
        return int(parts[1]) if len(parts) == 4 else None
    except (zmq.ZMQError, ValueError):
        return None
