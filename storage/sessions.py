"""Session files: a conversation kept between turns (its tokens and its KV cache), so the
next turn computes only its new tokens. `colictl run --session FILE` keeps one per file.

A session file is safetensors: "tokens" (int64 [n]: every token of the conversation, the
last one sampled and not yet fed to the model) and "kv.<name>" (float32: the cache's
arrays for the first n - 1 positions, engine.layers.KVCache.snapshot), with metadata
{"format": "colibri-session", "version": "1", "model": <model fingerprint>, "tokenizer":
<tokenizer fingerprint>, "mode": "text" or "chat" (with "messages", JSON)}. It is written whole to a temporary file and renamed into place
(statefile's discipline): a crash mid-write leaves the previous turn's file. A file that
cannot be read as a session (truncated, another format or version, bad tokens) is moved
aside with a warning and the conversation starts afresh; a valid session of another model
or tokenizer is refused (SessionMismatch): its KV means nothing to this model.
"""

import contextlib
import hashlib
import json
import logging
import os

import numpy as np

from .errors import CheckpointError, ColibriError
from .safetensors import SafetensorsFile, write_safetensors
from .statefile import quarantine

log = logging.getLogger("colibri.storage")

FORMAT, VERSION = "colibri-session", "1"


class SessionMismatch(ColibriError):
    """A session file saved with another model or tokenizer (the message says which)."""


def fingerprints(model_dir: str) -> tuple[str, str]:
    """(model, tokenizer) fingerprints of a container, a checkpoint directory or a GGUF file:
    short hashes of what a session's KV and tokens depend on. A container's manifest names
    its source and every expert's checksum; for a checkpoint, its config and the safetensors
    headers (names, shapes, offsets: not the weights, which would take a full read); for a
    GGUF file, its parts' headers (the tokenizer is in them)."""
    from .container import MANIFEST, is_container
    from .gguf import is_gguf

    def digest(parts) -> str:
        h = hashlib.sha256()
        for part in parts:
            h.update(part)
        return "sha256:" + h.hexdigest()[:32]

    def whole(name: str) -> bytes:
        p = os.path.join(model_dir, name)
        if not os.path.isfile(p):
            return b""
        with open(p, "rb") as f:
            return name.encode() + f.read()

    def header(name: str) -> bytes:
        with open(os.path.join(model_dir, name), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return name.encode() + f.read(min(n, 1 << 26))

    if is_gguf(model_dir):  # every part's header: the metadata, tokenizer too, and each tensor's place
        from .convert import fingerprint
        from .gguf import GGUFCheckpoint

        model = digest([fingerprint(GGUFCheckpoint(model_dir)).encode()])
        return model, model
    if is_container(model_dir):
        model = digest([whole(MANIFEST)])
    else:
        shards = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
        model = digest([whole("config.json")] + [header(n) for n in shards])
    return model, digest([whole("tokenizer.json"), whole("tokenizer_config.json")])


def save_session(path: str, tokens: list[int], kv: dict[str, np.ndarray], model: str, tokenizer: str,
                 extra: dict[str, str] | None = None) -> None:
    """Write the conversation to `path`, atomically and durably, with `extra` metadata (the
    daemon's: turns, times, a chat's messages). Raises OSError."""
    tensors = {"tokens": np.asarray(tokens, np.int64)} | {f"kv.{k}": a for k, a in kv.items()}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    write_safetensors(path, tensors, (extra or {}) | {"format": FORMAT, "version": VERSION, "model": model,
                                                      "tokenizer": tokenizer})
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def load_session(path: str, model: str, tokenizer: str, vocab_size: int) -> tuple[list[int], dict, dict] | None:
    """(tokens, kv, metadata) saved at `path`; None when there is no file, or when it is
    damaged (then moved aside with a warning). Raises SessionMismatch for a session of
    another model or tokenizer, OSError when it cannot be read."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{path}.tmp")  # what a write killed before its rename left (write_safetensors' name)
    if not os.path.exists(path):
        return None
    try:
        f = SafetensorsFile(path)
        meta = f.metadata
        why = None
        if meta.get("format") != FORMAT:
            why = "not a colibri session"
        elif meta.get("version") != VERSION:
            why = f"session version {meta.get('version')!r}, this colibri reads version {VERSION}"
        elif "tokens" not in f.entries or any(not (n == "tokens" or n.startswith("kv.")) for n in f.entries):
            why = "not the tensors of a session"
        if why is None:
            tokens = f.read("tokens")
            if tokens.dtype != np.int64 or tokens.ndim != 1 or not len(tokens) or tokens.min() < 0 \
                    or tokens.max() >= vocab_size:
                why = "its tokens are not token ids of this vocabulary"
    except CheckpointError as e:
        why = f"unreadable ({e})"
    if why:
        quarantine(path, why)
        return None
    if meta.get("model") != model or meta.get("tokenizer") != tokenizer:
        raise SessionMismatch(f"{path}: the session of another model or tokenizer (saved with {meta.get('model')}, "
                              f"this is {model}); use another session file")
    kv = {n[3:]: f.read(n) for n in f.entries if n.startswith("kv.")}
    return [int(t) for t in tokens], kv, meta


def session_summary(path: str) -> tuple[dict, int] | None:
    """(metadata, number of tokens) of a session file, from its header alone; None when it
    is not a readable session (left for load_session to move aside)."""
    try:
        f = SafetensorsFile(path)
        entry = f.entries.get("tokens")
    except (CheckpointError, OSError):
        return None
    if f.metadata.get("format") != FORMAT or entry is None or len(entry.shape) != 1:
        return None
    return f.metadata, int(entry.shape[0])


def mode_metadata(messages: list[dict] | None) -> dict[str, str]:
    """The metadata that says what a session's turns are: a chat's messages (its replies
    included), or raw text (None)."""
    if messages is None:
        return {"mode": "text"}
    return {"mode": "chat", "messages": json.dumps(messages, ensure_ascii=False)}


def chat_messages(meta: dict) -> list[dict] | None:
    """A chat session's messages from its metadata; None for a raw-text session, or when
    they cannot be read (the session then starts afresh)."""
    if meta.get("mode") != "chat":
        return None
    with contextlib.suppress(ValueError):
        messages = json.loads(meta.get("messages", ""))
        if isinstance(messages, list):
            return messages
    return None
