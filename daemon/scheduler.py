"""The engine thread's loop: continuous batching, and the operator actions applied
between two steps.

The I/O thread feeds it typed messages through the daemon's inbox (a queue); it sends
stream events and final replies back as (identity, frame) pairs over an inproc PUSH
socket. Every active request advances one token per step; a new one joins at the next
step, its prompt a `prefill_chunk` at a time while others decode. An idle engine's first
request waits `batch_window_ms` for those sent with it. Budget, pin and policy changes
run between two steps, so a running request sees them only in its speed. A request that
continues a session takes it (open_turn) and writes it back when it completes (end_turn).

The engine (engine.generate) is imported inside the methods that run on the engine
thread: the server imports this module before it binds its sockets, and the engine's
import (numba) takes about a second that the sockets should not wait for.
"""

import logging
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from ..engine.errors import PromptTooLong
from ..storage.errors import BudgetInvalid, ColibriError, ExpertReadError
from ..storage.sessions import SessionMismatch
from ..storage.sizes import size_text
from . import protocol as P
from .protocol import ProtocolError
from .sessions import Saved, SessionInUse

log = logging.getLogger("colibri.daemon")
# the errors that end a request the user can mend (counted `rejected`); the others are
# colibrid's own failures (MODEL_ERROR, INTERNAL: counted `failed`)
REJECTED = frozenset({"BAD_MESSAGE", "INVALID_REQUEST", "NOT_FOUND", "BUSY", "TOO_LARGE", "FORBIDDEN"})

Key = tuple[bytes, str]  # (client identity with its socket tag, request id)


@dataclass(frozen=True)
class Generate:
    key: Key
    msg: dict  # the generate_request, checked by the handler
    uid: int | None = None  # the sender's uid (its sessions are the ones it may use)


@dataclass
class Turn:
    """A request's session: what to write when it completes."""

    uid: int
    name: str
    mode: str  # "text" or "chat"
    messages: list | None  # a chat's messages so far (the reply is added when it completes)
    turns: int  # completed turns before this one
    created: float
    reused: int  # positions taken from the session's cache


@dataclass(frozen=True)
class Cancel:
    key: Key  # a running request leaves at the next step, a waiting one at once


@dataclass(frozen=True)
class Resize:
    reply_to: Key | None  # None: a reload asked it, nobody waits for the reply
    budget: int | str | None  # the expert cache's; None: as before
    pinned: int | str | None  # bytes, "auto", or None: as before
    kv: int | None = None  # the prefix cache's bytes; None: as before
    persist: bool = False  # keep the change for the next start (STATE_DIR/runtime.yaml)
    tables: int | None = None  # the streamed embedding tables' cache, bytes; None: as before


@dataclass(frozen=True)
class Pin:
    reply_to: Key
    kind: str  # "pin" or "unpin"
    il: int
    ie: int


@dataclass(frozen=True)
class SetPolicy:
    reply_to: Key | None  # None: a reload asked it
    policy: object  # storage.policy.Policy
    persist: bool = False  # keep the change for the next start (STATE_DIR/runtime.yaml)


class Scheduler:
    """Runs on the engine thread once the model is placed. `daemon` is the Server: the
    scheduler reads its cfg (which a reload may replace), model, control, history,
    tokenizer, eos, inbox, stopping and counters, and moves its engine_beat."""

    def __init__(self, daemon, push: zmq.Socket):
        from ..engine.generate import Batcher

        self.d, self.push = daemon, push
        self._chunk = daemon.cfg.prefill_chunk
        self.batcher = daemon.batcher = Batcher(daemon.model, self._chunk, daemon.prefix)  # (stats reads its counters)
        self.waiting: list[Generate] = []
        self.state: dict[Key, tuple] = {}  # key -> (request, token ids, text pieces)
        self.turns: dict[Key, Turn] = {}  # requests that continue a session
        self.by_client: set[Key] = set()  # requests their client cancelled (the others a stop cancels)
        self._saved_steps = None  # the usage history's step count at its last write
        # the history's file is written off the engine thread: a write with its fsync can take
        # a shared disk hundreds of milliseconds, a stall of every running stream
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="colibri-history")
        self.actions = {Generate: self.on_generate, Cancel: self.on_cancel, Resize: self.on_resize,
                        Pin: self.on_pin, SetPolicy: self.on_policy}

    def out(self, key: Key, msg: dict) -> None:
        self.push.send_multipart([key[0], P.encode(msg)])

    def run(self) -> None:
        """Serve until the daemon stops and nothing runs. Raises what a bug in the loop
        raises (the daemon then exits non-zero, for systemd to restart it)."""
        d = self.d
        saved_at = time.monotonic()
        try:
            while True:
                if d.stopping.is_set():  # finish nothing new: cancel what runs and waits
                    for r in self.batcher.active:
                        r.cancelled = True
                    for g in self.waiting:
                        self.out(g.key, P.error("generate", g.key[1], "SHUTTING_DOWN", "colibrid is stopping"))
                    self.waiting.clear()
                    if not self.batcher.active:
                        return
                d.engine_beat = time.monotonic()
                self.take_messages()
                self.start_waiting()
                if time.monotonic() - saved_at >= d.cfg.history_save_s:
                    self.save_history()
                    saved_at = time.monotonic()
                if self.batcher.active:
                    self.step()
        finally:
            self.writer.shutdown(wait=True)
            self.save_history(wait=True)

    def take_messages(self) -> None:
        """Apply what the inbox holds; block briefly when idle (an idle engine's first
        request waits batch_window_ms for those sent with it)."""
        d = self.d
        idle = not self.batcher.active and not self.waiting
        block = idle and not d.stopping.is_set()
        gather_until = None
        try:
            while True:
                if block:
                    item = d.inbox.get(timeout=0.1)
                elif gather_until is not None and len(self.waiting) < d.cfg.max_active and (
                        left := gather_until - time.monotonic()) > 0:
                    item = d.inbox.get(timeout=left)
                else:
                    item = d.inbox.get_nowait()
                block = False
                self.actions[type(item)](item)
                if isinstance(item, Generate) and idle and gather_until is None:
                    gather_until = time.monotonic() + d.cfg.batch_window_ms / 1e3
        except queue.Empty:
            pass

    def start_waiting(self) -> None:
        """Waiting requests join the batch while it has room."""
        from ..engine.generate import Request, SamplingParams

        d = self.d
        while self.waiting and len(self.batcher.active) < d.cfg.max_active:
            g = self.waiting.pop(0)
            key, msg = g.key, g.msg
            try:
                if msg.get("session") is not None:
                    ids, prior = self.open_turn(g)
                elif "messages" in msg:
                    ids, prior = d.tokenizer.encode(d.tokenizer.apply_chat_template(msg["messages"]),
                                                    special=False), None
                else:
                    ids, prior = d.tokenizer.encode(msg["prompt"]), None
                params = SamplingParams(max_tokens=msg.get("max_tokens", 256),
                                        temperature=float(msg.get("temperature", 0.0)), top_k=msg.get("top_k", 0),
                                        top_p=float(msg.get("top_p", 1.0)), seed=msg.get("seed"),
                                        stop=tuple(msg.get("stop") or ()))
                req = Request(d.model, ids, params, d.eos, d.tokenizer, rid=key, prior=prior, keep=key in self.turns)
            except ProtocolError as e:
                self.end_turn(key)
                self.fail(key, e.name, str(e))
                continue
            except ColibriError as e:
                self.end_turn(key)
                self.fail(key, "INVALID_REQUEST", str(e) + (f" (colictl session rm {msg['session']} starts it afresh)"
                                                            if isinstance(e, PromptTooLong) and key in self.turns
                                                            else ""))
                continue
            except Exception as e:  # a bug must cost this request, never the engine thread
                log.exception("starting request %s", key[1])
                self.end_turn(key)
                self.fail(key, "INTERNAL", f"{type(e).__name__}: {e}")
                continue
            self.batcher.add(req)
            self.state[key] = (req, [], [])
            if os.environ.get("COLIBRI_TEST_ENGINE_CRASH"):  # a test hook: a bug in the loop itself
                raise RuntimeError("COLIBRI_TEST_ENGINE_CRASH is set")

    def open_turn(self, g: Generate) -> tuple[list[int], object]:
        """(new token ids, prior conversation or None) of a request that continues a
        session; the session is taken (in use) until end_turn. Raises ProtocolError."""
        from ..engine.generate import Conversation
        d, msg, name = self.d, g.msg, g.msg["session"]
        mode = "chat" if "messages" in msg else "text"
        try:
            saved = d.sessions.take(g.uid, name)
        except SessionInUse as e:
            raise ProtocolError("BUSY", str(e)) from None
        except SessionMismatch as e:
            raise ProtocolError("INVALID_REQUEST", str(e)) from None
        except OSError as e:
            raise ProtocolError("MODEL_ERROR", f"session {name!r} cannot be read: {e.strerror}") from None
        if saved is not None and saved.mode != mode:
            d.sessions.release(g.uid, name)
            how = "messages (colictl chat --session)" if saved.mode == "chat" else "prompts (colictl generate --session)"
            raise ProtocolError("INVALID_REQUEST", f"session {name!r} is a {saved.mode} session: continue it with "
                                                   f"{how}, or use another name")
        prior = Conversation(saved.tokens, saved.kv) if saved is not None else None
        turn = Turn(g.uid, name, mode, None, saved.turns if saved else 0, saved.created if saved else time.time(), 0)
        self.turns[g.key] = turn
        if mode == "text":
            ids = d.tokenizer.encode(msg["prompt"])
        else:  # the whole conversation rendered afresh; the part it shares with the session is not computed again
            turn.messages = (saved.messages if saved else []) + msg["messages"]
            ids = d.tokenizer.encode(d.tokenizer.apply_chat_template(turn.messages), special=False)
            if prior is not None:
                prior, ids = prior.continued(ids)
        turn.reused = len(prior.tokens) - 1 if prior is not None else 0
        return ids, prior

    def end_turn(self, key: Key, conversation=None, text: str = "") -> dict | None:
        """Release the request's session (writing it when the turn completed, with the
        `conversation` after it); what the reply says about it, or None without a session."""
        turn = self.turns.pop(key, None)
        if turn is None:
            return None
        saved = None
        if conversation is not None:
            messages = turn.messages + [{"role": "assistant", "content": text}] if turn.mode == "chat" else None
            saved = Saved(conversation.tokens, conversation.kv, turn.mode, messages, turn.turns + 1, turn.created)
        info = {"name": turn.name, "turns": turn.turns + (saved is not None), "reused_tokens": turn.reused,
                "saved": False}
        try:
            self.d.sessions.release(turn.uid, turn.name, saved)
            info["saved"] = saved is not None
        except OSError as e:
            log.warning("session %s of uid %d could not be saved: %s", turn.name, turn.uid, e.strerror)
        if saved is not None:
            info["tokens"] = len(saved.tokens)
        return info

    def fail(self, key: Key, name: str, message: str) -> None:
        """End a request with an error reply, counted as `rejected` when the request could
        not run as asked (the user's to mend) and as `failed` when colibrid could not serve it."""
        self.out(key, P.error("generate", key[1], name, message))
        self.d.counters["rejected" if name in REJECTED else "failed"] += 1

    def step(self) -> None:
        """One forward step of every active request; its events go out."""
        d = self.d
        if d.cfg.prefill_chunk != self._chunk:  # (a reload may change it)
            self._chunk = d.cfg.prefill_chunk
            self.batcher.set_prefill_chunk(self._chunk)
        try:
            events = self.batcher.step()
        except Exception as e:  # e.g. an expert read failed: fail this step's requests, serve on
            model_error = isinstance(e, ColibriError)
            if model_error:
                log.error("step failed: %s", e)
            else:
                log.exception("step failed")
            for r in self.batcher.abort():
                self.state.pop(r.id, None)
                self.end_turn(r.id)
                self.fail(r.id, "MODEL_ERROR" if model_error else "INTERNAL",
                          str(e) if model_error else f"{type(e).__name__}: {e}")
            return
        for req, ev in events:
            key = req.id
            _, ids, pieces = self.state[key]
            if ev.kind == "token":
                ids.append(ev.token_id)
                pieces.append(ev.text)
                d.counters["tokens"] += 1
                d.latency.token(key)
                self.out(key, P.stream(key[1], ev.token_id, ev.text))
                continue
            pieces.append(ev.text)
            del self.state[key]
            d.latency.done(key)
            made = {"token_ids": ids, "text": "".join(pieces)}
            session = self.end_turn(key, ev.conversation, made["text"])
            if session is not None:
                made["session"] = session
            if ev.finish_reason == "cancelled":
                d.counters["cancelled"] += 1
                if key in self.by_client:
                    self.by_client.discard(key)
                    self.out(key, P.error("generate", key[1], "CANCELLED", "the request was cancelled", **made))
                else:
                    self.out(key, P.error("generate", key[1], "SHUTTING_DOWN", "colibrid is stopping: the request "
                                                                               "was cut short (retry when it is "
                                                                               "back)", **made))
            else:
                d.counters["served"] += 1
                self.out(key, P.ok("generate", key[1], prompt_token_ids=req.prompt_ids, **made,
                                   finish_reason=ev.finish_reason, stats=ev.stats))

    # ---- the messages ------------------------------------------------------------------------

    def on_generate(self, m: Generate) -> None:
        self.waiting.append(m)

    def on_cancel(self, m: Cancel) -> None:
        if m.key in self.state:
            self.state[m.key][0].cancelled = True
            self.by_client.add(m.key)
        elif any(g.key == m.key for g in self.waiting):
            self.waiting = [g for g in self.waiting if g.key != m.key]
            self.out(m.key, P.error("generate", m.key[1], "CANCELLED", "cancelled before it started"))
            self.d.counters["cancelled"] += 1

    def reply(self, kind: str, to: Key | None, handle) -> None:
        answer = P.answer(kind, to[1] if to else None, handle)
        if to is not None:
            self.out(to, answer)

    def on_resize(self, m: Resize) -> None:
        def resize():
            d = self.d
            try:
                if m.kv is not None and m.budget is None:  # beside the experts' budget as it is
                    d.room.check("a prefix cache (kv)", m.kv, d.control.arena_bytes if d.control else 0,
                                 "the expert cache")
                if m.budget is not None:  # beside the prefix cache's budget, the new one if both change
                    t0 = time.perf_counter()
                    beside = d.control.beside
                    d.control.beside = d.prefix.budget if m.kv is None else m.kv
                    try:
                        desc = d.control.resize(m.budget, m.pinned)
                    except BudgetInvalid:
                        d.control.beside = beside
                        raise
                if m.tables is not None:  # beside both caches as they are now (or are asked to be)
                    d.resize_tables(m.tables, d.prefix.budget if m.kv is None else m.kv)
            except BudgetInvalid as e:
                raise ProtocolError("INVALID_REQUEST", str(e)) from None
            if m.budget is not None:
                log.info("expert cache resized to %d bytes in %.2f s", desc["arena_bytes"], time.perf_counter() - t0)
            if m.kv is not None:
                if d.control is not None:
                    d.control.beside = m.kv
                d.prefix.resize(m.kv)
                log.info("prefix cache budget: %d bytes (%d blocks kept)", m.kv, len(d.prefix.blocks))
            changed = {k: size_text(v) for k, v in (("expert_cache", m.budget), ("kv_cache", m.kv),
                                                    ("table_cache", m.tables)) if v is not None}
            return {"placement": d.model.experts.describe(), "experts": d.model.experts.stats.as_dict(),
                    "kv": d.prefix.describe(), "tables": d.model.tables.stats() if d.model.tables else None,
                    **d.changed_at_runtime(changed, m.persist, m.reply_to is not None)}

        self.reply("cache", m.reply_to, resize)

    def on_pin(self, m: Pin) -> None:
        def pin():
            control = self.d.control
            try:
                (control.pin if m.kind == "pin" else control.unpin)(m.il, m.ie)
            except BudgetInvalid as e:
                raise ProtocolError("INVALID_REQUEST", str(e)) from None
            except KeyError:
                raise ProtocolError("NOT_FOUND", f"expert {m.il}:{m.ie} is not pinned") from None
            except ExpertReadError as e:
                raise ProtocolError("MODEL_ERROR", str(e)) from None
            log.info("%sned expert %d:%d", m.kind, m.il, m.ie)
            return {"pinned": control.describe()["pinned"]}

        self.reply(m.kind, m.reply_to, pin)

    def on_policy(self, m: SetPolicy) -> None:
        def set_policy():
            try:
                desc = self.d.control.set_policy(m.policy)
            except BudgetInvalid as e:
                raise ProtocolError("INVALID_REQUEST", str(e)) from None
            log.info("expert cache policy: %s", m.policy.as_dict())
            p = m.policy
            changed = {"policy": p.name, "hot_set": p.hot_set, "repin_every": p.repin_every,
                       "repin_margin": p.repin_margin, "prefetch_reads": p.prefetch_reads}
            return {"policy": desc["policy"], "history": desc["history"],
                    **self.d.changed_at_runtime(changed, m.persist, m.reply_to is not None)}

        self.reply("policy", m.reply_to, set_policy)

    def save_history(self, wait: bool = False) -> None:
        """Write the usage history (atomically): encoded here, on the engine thread (a
        consistent copy), written by the writer thread (or here, `wait`); a failure is
        logged."""
        history = self.d.history
        if history is None or history.steps == self._saved_steps:
            return  # nothing new since the last write
        self._saved_steps = history.steps
        data = history.snapshot()
        if data is None:
            return

        def write():
            try:
                history.write(data)
                log.debug("usage history saved to %s", history.path)
            except OSError as e:
                log.warning("could not save the usage history to %s: %s", history.path, e.strerror)

        if wait:
            write()
        else:
            self.writer.submit(write)
