#!/bin/sh
# The main job on the built-in demo model: start colibrid, pipe a prompt through
# `colictl generate`, show `colictl stats`, stop the daemon.
set -eu
# the commands from the virtual environment setup.sh made (.venv, or $COLIBRI_VENV), else the PATH's
venv="${COLIBRI_VENV:-$(cd "$(dirname "$0")" && pwd)/.venv}"
[ -x "$venv/bin/colibrid" ] && PATH="$venv/bin:$PATH"
SOCK="${COLIBRI_SOCKET:-/tmp/colibri-demo-$(id -u)/colibri.sock}"   # the operator socket goes next to it
export COLIBRI_SOCKET="$SOCK"
colibrid --socket "$SOCK" &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
# the first start writes the demo model and converts it to a container; --wait waits for
# the socket and the load (colictl status shows the phase meanwhile)
echo "Once upon a time" | colictl generate --wait --max-tokens 48   # the tiny demo model: fortune-cookie English
colictl stats
colictl shutdown
wait "$pid"
