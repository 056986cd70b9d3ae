"""The memory a process may use is its own cgroup's limit (or an ancestor's), not only the
root's: a budget placed past it would end in the kernel's OOM killer."""

import os
import subprocess
import sys
import uuid

import pytest

from colibri.storage.memory import cgroup_limit_files

V1 = "/sys/fs/cgroup/memory"


def test_the_files_of_a_cgroup_and_its_ancestors(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/a/b\n3:cpu:/a\n0::/svc/x.service\n")
    assert cgroup_limit_files(str(proc)) == [
        f"{V1}/a/b/memory.limit_in_bytes", f"{V1}/a/memory.limit_in_bytes", f"{V1}/memory.limit_in_bytes",
        "/sys/fs/cgroup/svc/x.service/memory.max", "/sys/fs/cgroup/svc/memory.max", "/sys/fs/cgroup/memory.max"]
    assert cgroup_limit_files(str(tmp_path / "none")) == []


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir(V1), reason="a v1 memory cgroup needs root")
def test_a_process_in_a_limited_cgroup_sees_its_limit():
    own = next((line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":memory:" in line), "/")
    path = os.path.join(V1 + own, f"colibri-test-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    try:
        limit = 700 << 20
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))

        def enter():
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        out = subprocess.run([sys.executable, "-c", "from colibri.storage.memory import ram_bytes; print(ram_bytes())"],
                             capture_output=True, text=True, preexec_fn=enter, timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == limit
    finally:
        os.rmdir(path)
