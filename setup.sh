#!/bin/sh
# Install colibri and everything it needs on a fresh Debian/Ubuntu machine.
#   ./setup.sh          system packages + colibri (editable)
#   ./setup.sh --test   the same, plus the test dependencies (pytest, transformers, torch==2.13.0 CPU, ruff,
#                       the gateway's stack and the openai client, selenium) and the io_uring binding
#                       (colibri[uring], built from source: its tests need it) and Ray (colibri[ray])
# System packages: libsystemd-dev and pkg-config, which systemd-python needs to build.
set -eu
cd "$(dirname "$0")"

pkgs="libsystemd-dev pkg-config"
# systemd-analyze verifies the units in the tests; wamerican's word list tells the demo's English from noise;
# chromium and its driver show the gateway's live map to its test in a headless browser
[ "${1:-}" = "--test" ] && pkgs="$pkgs systemd wamerican chromium chromium-driver"
need=""
for pkg in $pkgs; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need="$need $pkg"
done
if [ -n "$need" ]; then
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need
fi

PY=${PYTHON:-python3}
if [ "${1:-}" = "--test" ]; then
    # torch is pinned: an unpinned torch pulls a multi-GB GPU build
    $PY -m pip install -q -e '.[test,uring,ray]'
else
    $PY -m pip install -q -e .
fi

# compile the kernels now, into numba's cache (keyed by the source files and this CPU, so a
# new version or another CPU compiles afresh): the daemon's first start does not wait for it
$PY -m colibri.daemon --compile-only
