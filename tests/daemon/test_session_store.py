"""daemon/sessions.py's store on real files: per-uid name spaces, turns written
atomically, the byte and age budgets (never a session in use, nor the one just written)."""

import os
import time

import numpy as np
import pytest

from colibri.daemon.sessions import Saved, SessionInUse, SessionStore

FP = ("sha256:" + "a" * 32, "sha256:" + "b" * 32)


def saved(n_tokens: int, turns: int = 1) -> Saved:
    kv = {"k": np.ones((2, 1, n_tokens - 1, 8), np.float32), "v": np.ones((2, 1, n_tokens - 1, 8), np.float32)}
    return Saved(list(range(n_tokens)), kv, "text", None, turns, time.time())


def store(tmp_path, max_bytes=1 << 30, days=30.0) -> SessionStore:
    return SessionStore(str(tmp_path / "sessions"), FP, 1000, max_bytes, days)


def write(st: SessionStore, uid: int, name: str, n_tokens: int = 100) -> None:
    st.take(uid, name)
    st.release(uid, name, saved(n_tokens))


def test_a_turn_round_trips_and_uids_do_not_share_names(tmp_path):
    st = store(tmp_path)
    assert st.take(1000, "a") is None  # new
    st.release(1000, "a", saved(50, turns=3))
    got = st.take(1000, "a")
    assert got.tokens == list(range(50)) and got.turns == 3 and got.kv["k"].shape == (2, 1, 49, 8)
    with pytest.raises(SessionInUse):
        st.take(1000, "a")  # one turn at a time
    with pytest.raises(SessionInUse):
        st.remove(1000, "a")
    st.release(1000, "a")  # a turn that did not complete: the file keeps the last one
    assert st.take(1000, "a").turns == 3
    st.release(1000, "a")
    assert st.take(1001, "a") is None and st.list(1001) == []  # another uid: its own name space
    st.release(1001, "a")
    assert [d["name"] for d in st.list(1000)] == ["a"] and st.describe(1000, "a")["tokens"] == 50
    assert oct(os.stat(os.path.dirname(st.path(1000, "a"))).st_mode & 0o777) == "0o700"
    assert st.remove(1000, "a") and not st.remove(1000, "a") and st.list(1000) == []


def test_the_byte_budget_removes_the_least_recently_used_first(tmp_path):
    st = store(tmp_path)
    write(st, 1, "old")
    one = os.path.getsize(st.path(1, "old"))
    st.max_bytes = 2 * one + one // 2  # room for two
    past = time.time() - 100
    os.utime(st.path(1, "old"), (past, past))
    write(st, 2, "middle")
    os.utime(st.path(2, "middle"), (past + 10, past + 10))
    assert st.take(1, "old") is not None  # in use: never removed
    write(st, 1, "new")
    assert os.path.exists(st.path(1, "old")) and not os.path.exists(st.path(2, "middle"))
    st.release(1, "old")
    st.max_bytes = one // 2  # smaller than one session: all go but the one just written
    write(st, 3, "last")
    assert [os.path.exists(st.path(u, n)) for u, n in ((1, "old"), (1, "new"), (3, "last"))] == [False, False, True]
    assert st.removed == 3


def test_the_age_budget(tmp_path):
    st = store(tmp_path, days=1.0)
    write(st, 1, "stale")
    write(st, 1, "fresh")
    past = time.time() - 2 * 86400
    os.utime(st.path(1, "stale"), (past, past))
    assert st.expire() == 1 and [d["name"] for d in st.list(1)] == ["fresh"]
    st.max_age_s = 0  # 0: no age limit
    os.utime(st.path(1, "fresh"), (past, past))
    assert st.expire() == 0
