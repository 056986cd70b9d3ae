"""Named conversations that colibrid keeps for its users (`colictl chat --session NAME`,
`colictl generate --session NAME`), so each turn sends and computes only what is new.

A session is a session file (storage/sessions.py: the conversation's tokens and KV cache,
written atomically after each completed turn) at

    STATE_DIR/sessions/<model fingerprint>/<uid>/<name>.safetensors

The model fingerprint keys it to the container (a session's KV means nothing to another
model); the uid is the peer's, read from the Unix socket's credentials (SO_PEERCRED,
which ZeroMQ reports as the frame's Peer-Address), so one user can neither read nor
continue another's: the name space is per uid, and nothing in a request can name
another's. Between turns a session lives in its file (in the page cache while it is
warm), not in the daemon's RAM, which the expert cache needs more. A damaged file is
moved aside with a warning and the conversation starts afresh.

Budgets: `sessions_bytes` (all session files of every model and user together) and
`sessions_age_days`; past them, the least recently used sessions are removed, after each
write and at start. A session a request is using, and the one just written, are never
removed (a single session larger than the budget still keeps its last turn).

A session is raw text (its turns `prompt`s, appended as tokens) or a chat (its turns
`messages`, the whole conversation rendered with the chat template each turn and
continued from the longest common prefix with the saved tokens); a turn of the other
kind is refused.
"""

import contextlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass

from ..storage.safetensors import SafetensorsFile
from ..storage.sessions import chat_messages, load_session, mode_metadata, save_session, session_summary

log = logging.getLogger("colibri.daemon")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
SUFFIX = ".safetensors"


class SessionInUse(Exception):
    """Another request is using this session now."""


@dataclass
class Saved:
    """A session as its file holds it."""

    tokens: list[int]
    kv: dict
    mode: str  # "text" or "chat"
    messages: list[dict] | None  # a chat's messages, its replies included
    turns: int
    created: float


class SessionStore:
    """The session files of one model in one state directory. Thread-safe: the engine
    thread loads and saves, the I/O thread lists and removes."""

    def __init__(self, root: str, fingerprints: tuple[str, str], vocab_size: int, max_bytes: int, max_age_days: float):
        self.root = root  # STATE_DIR/sessions
        self.model_fp, self.tokenizer_fp = fingerprints
        self.dir = os.path.join(root, self.model_fp.split(":")[-1])
        self.vocab_size = vocab_size
        self.max_bytes, self.max_age_s = max_bytes, max_age_days * 86400
        self.lock = threading.Lock()
        self.busy: set[tuple[int, str]] = set()
        self.removed = 0  # sessions removed by the budgets since start

    def path(self, uid: int, name: str) -> str:
        return os.path.join(self.dir, str(uid), name + SUFFIX)

    # ---- a turn: take, then release (saving it when it completed) ---------------------------------

    def take(self, uid: int, name: str) -> Saved | None:
        """Mark the session in use and return what its file holds (None: a new session, or
        a damaged file, moved aside). Raises SessionInUse, SessionMismatch, OSError."""
        with self.lock:
            if (uid, name) in self.busy:
                raise SessionInUse(f"session {name!r} is in use by another request; retry when it has finished")
            self.busy.add((uid, name))
        try:
            got = load_session(self.path(uid, name), self.model_fp, self.tokenizer_fp, self.vocab_size)
        except BaseException:
            self.release(uid, name)
            raise
        if got is None:
            return None
        tokens, kv, meta = got
        messages = chat_messages(meta)
        if meta.get("mode") == "chat" and messages is None:  # a chat session whose messages are lost: afresh
            log.warning("%s: a chat session without readable messages; starting it afresh", self.path(uid, name))
            return None
        return Saved(tokens, kv, "chat" if messages is not None else "text", messages, int(meta.get("turns", "0")),
                     float(meta.get("created", time.time())))

    def release(self, uid: int, name: str, saved: Saved | None = None) -> None:
        """The turn is over; `saved`: it completed, write the session (atomically) and
        apply the budgets. Raises OSError when the write fails (the session file keeps its
        previous turn)."""
        try:
            if saved is not None:
                extra = mode_metadata(saved.messages) | {"turns": str(saved.turns), "created": repr(saved.created),
                                                         "updated": repr(time.time())}
                path = self.path(uid, name)
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                save_session(path, saved.tokens, saved.kv, self.model_fp, self.tokenizer_fp, extra)
        finally:
            with self.lock:
                self.busy.discard((uid, name))
        if saved is not None:
            self.expire(keep=self.path(uid, name))

    # ---- what a user sees ------------------------------------------------------------------

    def describe(self, uid: int, name: str) -> dict | None:
        """A session's summary (None: no such session of this uid)."""
        path = self.path(uid, name)
        got = session_summary(path) if os.path.isfile(path) else None
        if got is None:
            return None
        meta, n_tokens = got
        st = os.stat(path)
        return {"name": name, "mode": meta.get("mode", "text"), "turns": int(meta.get("turns", "0")),
                "tokens": n_tokens, "bytes": st.st_size, "created": float(meta.get("created", st.st_mtime)),
                "updated": st.st_mtime, "in_use": (uid, name) in self.busy}

    def conversation(self, uid: int, name: str) -> dict:
        """What `session show` prints: {"messages"} of a chat, {"tokens"} of raw text.
        Raises CheckpointError, OSError when the file cannot be read."""
        f = SafetensorsFile(self.path(uid, name))
        messages = chat_messages(f.metadata)
        return {"messages": messages} if messages is not None else {"tokens": [int(t) for t in f.read("tokens")]}

    def list(self, uid: int) -> list[dict]:
        folder = os.path.join(self.dir, str(uid))
        try:
            names = sorted(n.removesuffix(SUFFIX) for n in os.listdir(folder) if n.endswith(SUFFIX))
        except FileNotFoundError:
            return []
        return [d for d in (self.describe(uid, n) for n in names) if d is not None]

    def remove(self, uid: int, name: str) -> bool:
        """Delete a session; False when there is none. Raises SessionInUse."""
        with self.lock:
            if (uid, name) in self.busy:
                raise SessionInUse(f"session {name!r} is in use by a running request; cancel it first")
            try:
                os.unlink(self.path(uid, name))
            except FileNotFoundError:
                return False
        return True

    # ---- budgets ---------------------------------------------------------------------------

    def expire(self, keep: str | None = None) -> int:
        """Remove sessions (of every model and user) older than the age budget, then the
        least recently used until all fit the byte budget; never one in use, nor `keep`.
        Returns how many were removed."""
        files = []
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if n.endswith(SUFFIX) or ".corrupt-" in n:
                    p = os.path.join(dirpath, n)
                    with contextlib.suppress(FileNotFoundError):
                        st = os.stat(p)
                        files.append((st.st_mtime, st.st_size, p))
        files.sort()  # least recently written first
        total = sum(size for _, size, _ in files)
        now, gone = time.time(), 0
        with self.lock:
            busy = {self.path(uid, name) for uid, name in self.busy}
            for mtime, size, p in files:
                old = self.max_age_s and now - mtime > self.max_age_s
                if not old and total <= self.max_bytes:
                    continue
                if p in busy or p == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
                    total -= size
                    gone += 1
                    log.info("session %s removed (%s)", p, "older than sessions_age_days" if old else
                             "least recently used beyond sessions_bytes")
        self.removed += gone
        return gone
