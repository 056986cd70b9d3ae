"""The README's daemon walkthrough, run as a script against the demo model: every command
it shows works on what a new user starts (colibrid with no model)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_readme_walkthrough_runs_on_the_demo(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"<!-- walkthrough: .*? -->\n```sh\n(.*?)```\n<!-- end walkthrough -->", readme, re.S).group(1)
    assert block.startswith("colibrid &") and "colictl shutdown" in block
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "STATE_DIRECTORY": str(tmp_path / "state"), "COLIBRI_SOCKET": str(tmp_path / "c.sock"),
           "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    env.pop("COLIBRI_OPERATOR_SOCKET", None)
    # every command must succeed and the daemon stop cleanly; a failure must not leave it running
    script = "set -eu\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + block + 'wait "$!"\n'
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout
    assert '"prompt_token_ids"' in out and "pinned: 3:7" in out and "name=lru" in out, out
    assert "FAIL" not in out and "colibrid is stopping" in r.stderr, out
