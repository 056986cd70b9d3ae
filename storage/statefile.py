"""State files that must survive a crash: written whole or not at all.

`write_atomic` writes a temporary file in the same directory, fsyncs it, renames it over
the old one and fsyncs the directory, so a crash or `kill -9` at any moment leaves
either the previous good version or the new one, never half of one. `read_json_state`
reads such a file back; a file that is not what it should be is moved aside (kept for
a person to look at) with a warning, and the caller starts from nothing: a damaged
state file never stops the daemon from starting.
"""

import json
import logging
import os
import tempfile
import time

log = logging.getLogger("colibri.storage")


def default_state_dir() -> str:
    """Where colibri keeps its state (usage history, the demo model) when nothing says:
    $STATE_DIRECTORY (systemd's StateDirectory=), else ~/.local/state/colibri."""
    return os.environ.get("STATE_DIRECTORY", "").split(":")[0] or os.path.join(
        os.path.expanduser("~"), ".local", "state", "colibri")


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data`, atomically and durably. Raises OSError."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def remove_temporaries(path: str) -> int:
    """Delete what a write of `path` killed before its rename left behind; returns how many."""
    folder, name = os.path.split(os.path.abspath(path))
    n = 0
    try:
        for entry in os.listdir(folder):
            if entry.startswith(f".{name}.") and entry.endswith(".tmp"):
                os.unlink(os.path.join(folder, entry))
                n += 1
    except OSError:
        pass
    return n


def quarantine(path: str, why: str) -> str:
    """Move a damaged state file aside (PATH.corrupt-TIMESTAMP) and warn; returns the new name."""
    aside = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        os.replace(path, aside)
    except OSError as e:
        log.warning("%s: %s; could not move it aside (%s), ignoring it", path, why, e.strerror)
        return path
    log.warning("%s: %s; moved aside to %s, starting without it", path, why, aside)
    return aside


def read_json_state(path: str, check) -> dict | None:
    """The JSON object in `path`, or None when there is none. `check(obj)` returns why the
    object is unusable (or None when it is fine); an unreadable, malformed or unusable file
    is quarantined and None returned; leftovers of an interrupted write are removed.
    Never raises for the file's contents."""
    remove_temporaries(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("%s: cannot read (%s), starting without it", path, e.strerror)
        return None
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        quarantine(path, f"not valid JSON ({e})")
        return None
    why = check(obj) if isinstance(obj, dict) else "not a JSON object"
    if why:
        quarantine(path, why)
        return None
    return obj
