#!/bin/sh
# The main job on the built-in demo model: start colibrid, pipe a prompt through
# `colictl generate`, show `colictl stats`, stop the daemon.
set -eu
SOCK="${COLIBRI_SOCKET:-/tmp/colibri-demo-$(id -u)/colibri.sock}"   # the operator socket goes next to it
export COLIBRI_SOCKET="$SOCK"
colibrid --socket "$SOCK" &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
# the first start writes the demo model and compiles the kernels: wait until it answers
i=0
until colictl ping >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || { echo "colibrid exited" >&2; exit 1; }
    i=$((i + 1)); [ "$i" -le 600 ] || { echo "colibrid did not start" >&2; exit 1; }
    sleep 0.5
done
echo "Once upon a time" | colictl generate --max-tokens 48
colictl stats
colictl shutdown
wait "$pid"
