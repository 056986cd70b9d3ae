"""A failing disk: EIO, short reads and corrupted bytes on chosen experts. Every read is
retried, then read from the mirror; what still fails is a named error that says where,
and the cache never hands out bytes that failed their checksum."""

import shutil

import numpy as np
import pytest

from colibri.storage.cache import ExpertCache
from colibri.storage.errors import ExpertReadError
from colibri.storage.faults import FaultPlan, FaultSpecInvalid

from hf_models import build_container, served


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return build_container(tmp_path_factory.mktemp("faults"), "qwen3_moe", "basic", seed=12)


@pytest.fixture(scope="module")
def mirror(container, tmp_path_factory):
    d = tmp_path_factory.mktemp("mirror")
    for r in {r.file for r in container.records.values()}:
        shutil.copy(r, d)
    return str(d)



def same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_fault_spec():
    plan = FaultPlan.parse("eio@1:2, short@1:3x2,corrupt@mirror:0:4,stall@drive2:0:5")
    assert plan.take(0, 1, 2) == "eio" and plan.take(0, 1, 2) == "eio"  # every read
    assert [plan.take(0, 1, 3) for _ in range(3)] == ["short", "short", None]  # twice, then clean
    assert plan.take(0, 0, 4) is None and plan.take(1, 0, 4) == "corrupt"  # mirror: drive 1
    assert plan.take(1, 0, 5) is None and plan.take(2, 0, 5) == "stall"
    assert FaultPlan.parse("") is None
    for bad in ("eio@1", "melt@1:2", "eio@1:2x", "eio@a:b", "eio@drive:1:2"):
        with pytest.raises(FaultSpecInvalid, match=r"KIND@\[driveN:\]LAYER:EXPERT"):
            FaultPlan.parse(bad)


@pytest.mark.parametrize("kind", ["eio", "short", "corrupt"])
def test_a_failing_read_is_retried_once(container, kind):
    il = container.moe_layers[0]
    c = ExpertCache(container, "all", faults=FaultPlan.parse(f"{kind}@{il}:3x1"))
    ref = ExpertCache(container, "all")
    same(served(c, il, [3])[3], served(ref, il, [3])[3])
    assert c.stats.read_errors == 1 and not c.reader.bad


@pytest.mark.parametrize("kind,why", [("eio", "Input/output error"), ("short", "short read"),
                                      ("corrupt", "checksum mismatch")])
def test_a_bad_expert_is_a_named_error_and_the_rest_still_serve(container, kind, why):
    il = container.moe_layers[-1]
    c = ExpertCache(container, "min", faults=FaultPlan.parse(f"{kind}@{il}:5"))
    rec = container.records[(il, 5)]
    with pytest.raises(ExpertReadError) as e:
        served(c, il, [4, 5, 6])
    msg = str(e.value)
    assert f"layer {il} expert 5" in msg and rec.file in msg and f"offset {rec.offset}" in msg and why in msg
    assert msg.count(why) == 1 and "(2 tries)" in msg  # the read and its retry, said once
    assert list(c.reader.bad) == [(il, 5)] and "5" in c.describe()["bad_experts"][0]
    assert 5 not in c.lru[il]  # never kept: its bytes failed
    ref = ExpertCache(container, "all")
    for ie in (4, 6, 7):  # the rest of the layer, through the same single slot
        same(served(c, il, [ie])[ie], served(ref, il, [ie])[ie])


def drilled(container, copy, spec):
    """A cache reading from the container and `copy`, with the drill `spec` on the drive each
    expert is read from first and FIRST/OTHER standing for those drives' indices."""
    c = ExpertCache(container, "all", drives=[copy], faults=FaultPlan.parse("eio@0:999"))  # (reads one record at a time)
    il = container.moe_layers[0]

    def plan(ie):
        order = [d.index for d in c.reader.drives.order(container.records[(il, ie)])]
        return {"FIRST": f"drive{order[0]}:", "OTHER": f"drive{order[1]}:"}

    c.reader.faults = FaultPlan.parse(",".join(spec(il, ie, plan(ie)) for ie in (1, 2, 3)))
    return c, il


def test_another_drive_takes_over(container, mirror):
    c, il = drilled(container, mirror, lambda il, ie, p: f"corrupt@{p['FIRST']}{il}:2,eio@{p['FIRST']}{il}:3")
    ref = ExpertCache(container, "all")
    got = served(c, il, [2]) | served(c, il, [3])  # one at a time: each goes to the drive its unit hashes to
    for ie in (2, 3):
        same(got[ie], served(ref, il, [ie])[ie])
    assert c.stats.read_errors == 4 and not c.reader.bad
    drives = c.reader.drives.describe()
    assert sum(d["errors"] for d in drives) == 4 and sum(not d["in_rotation"] for d in drives) == 1  # (the EIO)
    both, il = drilled(container, mirror, lambda il, ie, p: f"eio@{p['FIRST']}{il}:1,short@{p['OTHER']}{il}:1")
    with pytest.raises(ExpertReadError, match=r"(primary|drive 1) .*Input/output error.* \(2 tries\); "
                                              r"(primary|drive 1) .*short read"):
        served(both, il, [1])


def test_verify_first_checks_each_expert_once_and_costs_are_counted(container):
    il = container.moe_layers[0]
    c = ExpertCache(container, "min")
    for ie in (0, 1, 0, 1):
        served(c, il, [ie])
    assert c.stats.verified == 2 and c.stats.verify_s > 0  # two experts, each checked on its first read
    always = ExpertCache(container, "min", verify="always")
    for ie in (0, 1, 0, 1):
        served(always, il, [ie])
    assert always.stats.verified == 4
    off = ExpertCache(container, "min", verify="off", faults=FaultPlan.parse(f"corrupt@{il}:0"))
    served(off, il, [0])  # unchecked: the documented risk of verify: off
    assert off.stats.verified == 0
