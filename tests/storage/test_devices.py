"""storage/devices.py: the block device behind a file, found through sysfs (a plain file,
a loop device with a file system on it, a virtual file system), and its set-up, written
only when asked and reported step by step."""

import contextlib
import os

import pytest
from loop import loop_file_system

from colibri.storage.devices import cpu_set, discover, plan, tune


def sysfs(d, name):
    with open(os.path.join(d["sysfs"], "queue", name)) as f:
        return f.read().strip()


def test_a_plain_file_is_traced_to_its_block_device(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"x")
    d = discover(str(f))
    if d["device"] is None:
        pytest.skip(f"the test directory has no block device: {d['why']}")
    assert os.path.isdir(os.path.join(d["sysfs"], "queue"))
    assert d["nr_requests"] == int(sysfs(d, "nr_requests"))
    assert d["read_ahead_kb"] == int(sysfs(d, "read_ahead_kb"))
    assert f"[{d['scheduler']}]" in sysfs(d, "scheduler") or d["scheduler"] == sysfs(d, "scheduler")
    assert all(isinstance(i, int) for i in d["irqs"])


def test_a_virtual_file_system_has_no_device_and_says_so():
    d = discover("/proc/self/status")
    assert d["device"] is None and "without a block device" in d["why"]
    assert plan(d, [0]) == [] and tune(d, [0]) == []
    assert discover("/no/such/file")["why"].startswith("cannot stat")


@contextlib.contextmanager
def one_file_on_a_loop_device(tmp_path):
    with loop_file_system(tmp_path) as (mnt, dev, image):
        (mnt / "experts-0000.safetensors").write_bytes(b"\0" * 4096)
        yield str(mnt / "experts-0000.safetensors"), dev, image


def test_a_loop_device_is_found_and_tuned_only_when_asked(tmp_path):
    with one_file_on_a_loop_device(tmp_path) as (file, dev, image):
        d = discover(file)
        assert d["device"] == os.path.basename(dev) and d["backing_file"] == image and d["irqs"] == []
        q = os.path.join(d["sysfs"], "queue")
        with open(os.path.join(q, "read_ahead_kb"), "w") as f:  # a setting tuning would change
            f.write("4096")
        has_scheduler = "mq-deadline" in d["schedulers"] and "none" in d["schedulers"]
        if has_scheduler:
            with open(os.path.join(q, "scheduler"), "w") as f:
                f.write("mq-deadline")
        d = discover(file)
        steps = plan(d, sorted(os.sched_getaffinity(0)))
        assert {s["what"] for s in steps} == {"read_ahead_kb"} | ({"scheduler"} if has_scheduler else set())
        assert sysfs(d, "read_ahead_kb") == "4096"  # planning writes nothing
        done = tune(d, sorted(os.sched_getaffinity(0)))
        assert all(s["done"] for s in done) and [s["what"] for s in done] == [s["what"] for s in steps]
        after = discover(file)
        assert after["read_ahead_kb"] == 128 and (after["scheduler"] == "none" or not has_scheduler)
        assert plan(after, sorted(os.sched_getaffinity(0))) == []  # nothing left to do


def test_cpu_lists():
    assert cpu_set("0-3,8") == {0, 1, 2, 3, 8} and cpu_set("5") == {5}
