"""Session files: a round trip keeps every bit; damaged or foreign files are moved aside,
a session of another model is refused."""

import logging

import numpy as np
import pytest

from colibri.storage.safetensors import write_safetensors
from colibri.storage.sessions import SessionMismatch, load_session, save_session


def test_a_session_round_trips_and_only_its_model_reads_it(tmp_path):
    kv = {"k": np.random.default_rng(0).standard_normal((2, 1, 5, 4), dtype=np.float32)}
    path = str(tmp_path / "s")
    save_session(path, [3, 1, 4, 1, 5, 9], kv, "m1", "t1", {"turns": "2", "format": "not this"})
    tokens, got, meta = load_session(path, "m1", "t1", 10)
    assert tokens == [3, 1, 4, 1, 5, 9] and np.array_equal(got["k"], kv["k"])
    assert meta["turns"] == "2" and meta["format"] == "colibri-session"  # extra metadata never hides the format
    with pytest.raises(SessionMismatch, match="another model"):
        load_session(path, "m2", "t1", 10)
    with pytest.raises(SessionMismatch):
        load_session(path, "m1", "t2", 10)
    assert load_session(str(tmp_path / "none"), "m1", "t1", 10) is None


@pytest.mark.parametrize("damage", ["truncated", "not a session", "version", "token out of range", "stray tensor"])
def test_a_damaged_session_is_moved_aside(tmp_path, caplog, damage):
    path = tmp_path / "s"
    kv = {"k": np.zeros((1, 1, 2, 2), np.float32)}
    if damage == "truncated":
        save_session(str(path), [1, 2, 3], kv, "m", "t")
        path.write_bytes(path.read_bytes()[:40])
    elif damage == "not a session":
        write_safetensors(str(path), {"w": np.zeros(3, np.float32)})
    elif damage == "version":
        write_safetensors(str(path), {"tokens": np.array([1], np.int64)}, {"format": "colibri-session", "version": "9",
                                                                          "model": "m", "tokenizer": "t"})
    elif damage == "token out of range":
        save_session(str(path), [1, 2, 99], kv, "m", "t")
    else:
        save_session(str(path), [1, 2, 3], kv | {"x": np.zeros(1, np.float32)}, "m", "t")
        data = path.read_bytes().replace(b'"kv.x"', b'"zz.x"')
        path.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="colibri.storage"):
        assert load_session(str(path), "m", "t", 10) is None
    assert not path.exists() and any(p.name.startswith("s.corrupt-") for p in tmp_path.iterdir())
    assert "moved aside" in caplog.text
