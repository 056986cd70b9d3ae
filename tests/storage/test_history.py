"""The usage history: decay, persistence, and crash safety of its file."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from colibri.storage.history import FORMAT, UsageHistory, history_path

LAYERS, N = [0, 2, 3], 6


def hist(path=None, **kw):
    return UsageHistory(LAYERS, N, "sha256:abc", path, **kw)


def test_counts_decay_by_half_over_the_half_life():
    h = hist(half_life=10)
    h.step()
    h.record(2, [1, 4])
    h.record(3, [1])
    assert h.value((2, 1)) == pytest.approx(1.0) and h.value((0, 1)) == 0
    for _ in range(10):
        h.step()
    assert h.value((2, 1)) == pytest.approx(0.5)
    h.record(2, [4])
    assert h.value((2, 4)) == pytest.approx(1.5) and h.hottest(1) == [(2, 4)]
    assert len(h.hottest(99)) == 3  # only experts ever used


def test_lazy_decay_renormalises_without_losing_order():
    h = hist(half_life=1)
    h.record(0, [0])
    for _ in range(400):  # the weight passes 1e100 and is folded back
        h.step()
    h.record(0, [1])
    assert h.weight < 1e100 and h.hottest(1) == [(0, 1)]


def test_saved_history_survives_a_restart(tmp_path):
    path = history_path(str(tmp_path), "sha256:abc")
    h = hist(path)
    for s in range(5):
        h.step()
        h.record(3, [s % N])
    assert h.save()
    again = hist(path)
    assert again.steps == 5 and again.loaded_steps == 5
    np.testing.assert_allclose(again.values(), h.values(), rtol=1e-5)
    d = again.describe()
    assert d["file_bytes"] == os.path.getsize(path) and d["experts_seen"] == 5 and d["saved_age_s"] is not None


def test_read_only_history_is_never_written(tmp_path):
    path = str(tmp_path / "h.json")
    h = hist(path)
    h.record(0, [1])
    h.save()
    before = open(path).read()
    ro = hist(path, read_only=True)
    ro.record(0, [2])
    assert not ro.save() and open(path).read() == before


CHILD = textwrap.dedent("""
    import os, sys, time
    from colibri.storage.history import UsageHistory
    h = UsageHistory([0, 2, 3], 6, "sha256:abc", sys.argv[1])
    for _ in range(50):
        h.step()
        h.record(0, [5])
    real_fsync = os.fsync
    def hang(fd):  # the new version is written into its temporary file: stop right here
        print("writing", flush=True)
        time.sleep(60)
    os.fsync = hang
    h.save()
""")


def test_kill_9_in_the_middle_of_a_write_leaves_the_previous_version(tmp_path, caplog):
    path = str(tmp_path / "state" / "h.json")
    h = hist(path)
    h.step()
    h.record(2, [3])
    h.save()
    child = subprocess.Popen([sys.executable, "-c", CHILD, path], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    leftovers = [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]
    assert leftovers  # the half-done write exists...
    child.send_signal(signal.SIGKILL)
    child.wait()
    again = hist(path)  # ...but the file is the previous version, and the leftover is cleaned up
    assert again.steps == 1 and again.hottest(1) == [(2, 3)]
    assert [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")] == []


def test_what_the_optimum_taught_survives_a_restart(tmp_path):
    path = history_path(str(tmp_path), "sha256:abc")
    h = hist(path)
    h.learn_optimum(4, 1)
    for s in range(60):  # expert 1 comes back every other visit, the rest are one-offs
        h.step()
        h.record(2, [1] if s % 2 else [2 + s % 4])
    scores = h.keep_scores.copy()
    assert scores[LAYERS.index(2), 1] == 7  # the optimum kept it every time
    assert h.worth((2, 1)) == pytest.approx(8 * h.value((2, 1)))
    assert h.save()
    again = hist(path)
    np.testing.assert_array_equal(again.keep_scores, scores)
    assert again.worth((2, 1)) == pytest.approx(again.value((2, 1)))  # counts alone until learning again
    again.learn_optimum(4, 1)
    assert again.worth((2, 1)) == pytest.approx(8 * again.value((2, 1)))
    again.learn_optimum(None, 1)
    assert again.learner is None and again.keep_scores is not None


@pytest.mark.parametrize("damage", ["garbage", "truncated", "version", "other model", "bad counts", "bad scores"])
def test_a_damaged_history_is_moved_aside_and_the_start_goes_on(tmp_path, caplog, damage):
    path = str(tmp_path / "h.json")
    h = hist(path)
    h.record(0, [1])
    h.save()
    text = open(path).read()
    obj = json.loads(text)
    bad = {"garbage": "\x00\xff not json", "truncated": text[: len(text) // 2],
           "version": json.dumps(obj | {"version": 99}), "other model": json.dumps(obj | {"fingerprint": "x"}),
           "bad counts": json.dumps(obj | {"counts": [[-1] * N] * len(LAYERS)}),
           "bad scores": json.dumps(obj | {"keep_scores": [[9] * N] * len(LAYERS)})}[damage]
    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(bad)
    with caplog.at_level(logging.WARNING, logger="colibri.storage"):
        again = hist(path)
    assert again.steps == 0 and not again.counts.any()
    aside = [f for f in os.listdir(tmp_path) if ".corrupt-" in f]
    assert len(aside) == 1 and not os.path.exists(path)
    assert any("moved aside" in r.message for r in caplog.records)
    again.record(0, [2])
    assert again.save() and json.load(open(path))["format"] == FORMAT  # and it is written afresh
