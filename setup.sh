#!/bin/sh
# Install colibri and everything it needs on a Debian or Ubuntu machine, into a virtual
# environment: a distribution's own Python refuses pip installs outside one (PEP 668), and
# the environment keeps colibri's packages apart from the system's.
#
#   ./setup.sh [--venv DIR] [--no-compile]          system packages, then colibri (editable) in DIR
#   ./setup.sh --test [--venv DIR] [--no-compile]   the same, plus the test dependencies (pytest,
#                       transformers, torch==2.13.0 CPU, ruff, the gateway's stack and the openai
#                       client, selenium), the io_uring binding (colibri[uring]) and Ray (colibri[ray])
#
# DIR defaults to .venv in this checkout ($COLIBRI_VENV overrides it); the environment is made from
# $PYTHON (default python3), any Python 3.11 or newer: the distribution's, pyenv's or conda's.
# System packages, with apt and only those missing (nothing installed is upgraded): libsystemd-dev
# and pkg-config, which systemd-python builds against, and python3.X-venv where the distribution
# ships venv apart. --no-compile leaves the kernels to be compiled at the first start.
set -eu
cd "$(dirname "$0")"

test="" venv="${COLIBRI_VENV:-.venv}" compile=1
while [ $# -gt 0 ]; do
    case "$1" in
        --test) test=1 ;;
        --venv) [ $# -ge 2 ] || { echo "setup.sh: --venv needs a directory" >&2; exit 2; }; venv=$2; shift ;;
        --no-compile) compile="" ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $1 (--test, --venv DIR, --no-compile, --help)" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "setup.sh: no $PY on the PATH (PYTHON=... names another)" >&2; exit 2; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    { echo "setup.sh: $PY is Python $("$PY" -V 2>&1); colibri needs 3.11 or newer (PYTHON=... names another)" >&2; exit 2; }

pkgs="libsystemd-dev pkg-config"
# systemd-analyze verifies the units in the tests; wamerican's word list tells the demo's English from noise;
# chromium and its driver show the gateway's live map to its test in a headless browser
[ -n "$test" ] && pkgs="$pkgs systemd wamerican chromium chromium-driver"
# Debian and Ubuntu ship venv for their Python as a package of its own
if [ ! -x "$venv/bin/python" ] && ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    pkgs="$pkgs python$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv"
fi
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }
need=""
for pkg in $pkgs; do
    installed "$pkg" || need="$need $pkg"
done
if [ -n "$need" ]; then
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    echo "setup.sh: installing$need with apt"
    $SUDO apt-get update -qq
    # libsystemd-dev must be the installed libsystemd0's version: asked for as is, apt takes the
    # archive's newest and upgrades libsystemd0, and with it systemd and libudev, to match
    want=""
    for pkg in $need; do
        if [ "$pkg" = libsystemd-dev ] && installed libsystemd0; then
            pkg="libsystemd-dev=$(dpkg-query -W -f='${Version}' libsystemd0)"
        fi
        want="$want $pkg"
    done
    # anything else apt would upgrade for them is held at its installed version
    keep=$(apt-get -s install $want 2>/dev/null | sed -n 's/^Inst \([^ ]*\) \[\([^]]*\)\].*/\1=\2/p' | tr '\n' ' ')
    if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $want $keep; then
        echo "setup.sh: apt cannot install$need without upgrading what is installed (${keep:-see above});" \
             "install them yourself (apt-get install$need), then run ./setup.sh again" >&2
        exit 1
    fi
fi

if ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
    echo "setup.sh: making the virtual environment $venv from $PY ($("$PY" -V 2>&1))"
    "$PY" -m venv --clear "$venv"
fi
VPY="$venv/bin/python"
if [ -n "$test" ]; then
    echo "setup.sh: installing colibri and its test dependencies into $venv (a few minutes the first time)"
    # torch is pinned: an unpinned torch pulls a multi-GB GPU build
    "$VPY" -m pip install -q --disable-pip-version-check -e '.[test,uring,ray]'
else
    echo "setup.sh: installing colibri into $venv"
    "$VPY" -m pip install -q --disable-pip-version-check -e .
fi

# compile the kernels now, into numba's cache (keyed by the source files and this CPU, so a
# new version or another CPU compiles afresh): the daemon's first start does not wait for it
if [ -n "$compile" ]; then
    "$VPY" -m colibri.daemon --compile-only
fi

echo "setup.sh: colibri is installed in $venv. Next:"
if [ -n "$test" ]; then
    echo "  $venv/bin/ruff check . && $venv/bin/python -m pytest     the tests (what CI runs)"
fi
echo "  ./demo.sh                   the demo: colibrid on the demo model, a prompt, its stats"
echo "  . $venv/bin/activate        colictl, colibrid and colibri-gateway on your PATH"
