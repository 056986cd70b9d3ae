"""What an operator met on a fresh clone (issue 66's smaller list): the dense precision
convert wrote is named, the model is a positional argument wherever convert takes one."""

import json
import subprocess
import sys

from colibri.ctl import exitcodes
from colibri.storage.demo import write_demo_model


def colictl(*args):
    return subprocess.run([sys.executable, "-m", "colibri.ctl", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_convert_names_the_dense_precision_and_commands_take_the_model_as_convert_does(tmp_path):
    src = write_demo_model(tmp_path / "demo")
    r = colictl("convert", src, tmp_path / "c", "--dtype", "int8", "--dense-dtype", "int8")
    assert r.returncode == 0, r.stderr
    assert "dense int8 g32 (16 matrices; the rest bf16)" in r.stderr, r.stderr
    r = colictl("doctor", tmp_path / "c", "--json")
    got = json.loads(r.stdout)
    assert r.returncode == 0 and got["model"] == str(tmp_path / "c"), r.stderr
    container = {c["check"]: c for c in got["checks"]}["container"]["detail"]
    assert "dense bf16 (matrices int8 g32)" in container, container
    r = colictl("doctor", tmp_path / "c", "--model", src)
    assert r.returncode == exitcodes.USAGE and "two models given" in r.stderr
    assert colictl("doctor", "--model", tmp_path / "c").returncode == 0
    r = colictl("plan", tmp_path / "c", "--memory", "1KiB")
    assert r.returncode == exitcodes.BAD_REQUEST and "the model needs at least" in r.stderr  # (the positional model's)
