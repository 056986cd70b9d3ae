"""Every benchmark's JSON says where it comes from (bench/provenance.py)."""

import glob
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import provenance  # noqa: E402

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")


def test_a_stamped_result_names_the_date_commit_cpu_and_command():
    out = json.loads(provenance.dumps({"benchmark": "x", "value": 1}))
    p = out["provenance"]
    head = subprocess.run(["git", "-C", BENCH, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    assert out["value"] == 1 and p["commit"].split("+")[0] == head.strip()
    assert re.match(r"\d{4}-\d\d-\d\dT", p["date"]) and p["cpu"]["model"] and p["cores"] >= 1
    assert p["command"].startswith("python ")


def test_every_benchmark_stamps_what_it_prints():
    helpers = {"provenance.py", "synthetic.py", "traces.py", "next_use.py"}  # (they print no result of their own)
    for path in sorted(glob.glob(os.path.join(BENCH, "*.py"))):
        if os.path.basename(path) in helpers:
            continue
        text = open(path).read()
        assert "provenance.dumps(" in text, f"{os.path.basename(path)} prints a result without its provenance"
