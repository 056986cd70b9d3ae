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
    plan = FaultPlan.parse("eio@1:2, short@1:3x2,corrupt@mirror:0:4")
    assert plan.take("primary", 1, 2) == "eio" and plan.take("primary", 1, 2) == "eio"  # every read
    assert [plan.take("primary", 1, 3) for _ in range(3)] == ["short", "short", None]  # twice, then clean
    assert plan.take("primary", 0, 4) is None and plan.take("mirror", 0, 4) == "corrupt"
    assert FaultPlan.parse("") is None
    for bad in ("eio@1", "melt@1:2", "eio@1:2x", "eio@a:b"):
        with pytest.raises(FaultSpecInvalid, match="KIND@LAYER:EXPERT"):
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


def test_the_mirror_takes_over(container, mirror):
    il = container.moe_layers[0]
    c = ExpertCache(container, "all", mirror=mirror, faults=FaultPlan.parse(f"corrupt@{il}:2,eio@{il}:3"))
    ref = ExpertCache(container, "all")
    got = served(c, il, [2, 3])
    for ie in (2, 3):
        same(got[ie], served(ref, il, [ie])[ie])
    assert c.stats.read_errors == 4 and not c.reader.bad
    both = ExpertCache(container, "all", mirror=mirror, faults=FaultPlan.parse(f"eio@{il}:1,short@mirror:{il}:1"))
    with pytest.raises(ExpertReadError, match="primary .*Input/output error.*mirror .*short read"):
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
