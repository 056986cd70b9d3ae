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


def test_every_readme_figure_names_a_json_that_says_where_it_comes_from():
    """Each row of the README's figures table names its JSON in bench/results, and that JSON
    carries its date, machine and command (stamped, or reconstructed from
    docs/benchmarks.md for a run before bench/provenance.py, and saying so)."""
    root = os.path.join(BENCH, "..")
    readme = open(os.path.join(root, "README.md")).read()
    table = readme[readme.index("| what | figure | target |"):]
    rows = [r for r in table.split("\n\n")[0].splitlines()[2:] if r.startswith("|")]
    listed = open(os.path.join(root, "docs", "benchmarks.md")).read()
    listed = listed[listed.index("| figure | value | target | JSON | date |"):]
    full = [r for r in listed.split("\n\n")[0].splitlines()[2:] if r.startswith("|")]
    assert len(rows) >= 5 and len(full) >= 15  # (the README's headline; docs/benchmarks.md's every current one)
    for row in rows + full:
        names = re.findall(r"(\d{4}-\d\d-\d\d-[\w.-]+\.json)", row)
        assert names, f"a figure without its JSON: {row[:80]}"
        for name in names:
            d = json.load(open(os.path.join(BENCH, "results", name)))
            p = d.get("provenance") or {"date": d.get("date"), "command": d.get("command"), "cpu": d.get("machine")}
            assert p["date"] and p["command"] and p["cpu"], name
