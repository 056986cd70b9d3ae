"""setup.sh on a distribution's own Python: pip refuses to install into it (PEP 668's
EXTERNALLY-MANAGED marker), so setup.sh must make and use a virtual environment."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def managed_python() -> str | None:
    """A Python that carries the EXTERNALLY-MANAGED marker (Debian's and Ubuntu's do), or None."""
    for exe in ("/usr/bin/python3", "/usr/bin/python3.12", "/usr/bin/python3.11"):
        if not os.access(exe, os.X_OK):
            continue
        r = subprocess.run([exe, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"], capture_output=True,
                           text=True)
        if r.returncode == 0 and os.path.exists(os.path.join(r.stdout.strip(), "EXTERNALLY-MANAGED")):
            return exe
    return None


@pytest.mark.skipif(managed_python() is None, reason="no distribution Python with an EXTERNALLY-MANAGED marker here")
def test_setup_installs_into_a_virtual_environment_on_a_managed_python(tmp_path):
    exe = managed_python()
    refused = subprocess.run([exe, "-m", "pip", "install", "--dry-run", "-e", ROOT], capture_output=True, text=True)
    assert refused.returncode != 0  # what the README's command met before: pip will not install here
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "COLIBRI_VENV")}
    env["PYTHON"] = exe
    r = subprocess.run(["sh", os.path.join(ROOT, "setup.sh"), "--venv", str(venv), "--no-compile"], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "externally-managed" not in (r.stdout + r.stderr).lower()
    assert "./demo.sh" in r.stdout  # the next command
    for tool in ("colictl", "colibrid", "colibri-gateway"):
        assert os.access(venv / "bin" / tool, os.X_OK), tool
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import colibri, sys; print(colibri.__file__); "
                            "print(sys.base_prefix)"], capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    path, base = where.stdout.split()
    assert path.startswith(ROOT) and base.startswith("/usr")  # this checkout, on the distribution's Python
    version = subprocess.run([str(venv / "bin" / "colictl"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "colictl" in version.stdout
    assert subprocess.run([exe, "-c", "import colibri"], capture_output=True).returncode != 0  # the system untouched


def test_every_package_of_the_tree_is_installed():
    """pyproject's explicit package list names every directory with an __init__.py: a
    package left out works in the editable install the tests use and is missing from a
    wheel (engine/formats and storage/formats were, when they came)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]["setuptools"]
    listed = {tool["package-dir"].get(p, p.replace("colibri.", "").replace(".", "/")) for p in tool["packages"]}
    found = {os.path.relpath(d, ROOT).replace(os.sep, "/") for d, _, files in os.walk(ROOT)
             if "__init__.py" in files and not any((part != "." and part.startswith(".")) or part in ("tests", "bench", "build")
                                                   for part in os.path.relpath(d, ROOT).split(os.sep))}
    assert found == listed
