#!/bin/sh
# `posttrain` in the operator and trainer images (installed as /opt/posttrain/bin/posttrain,
# first on PATH). The JobSet runs `posttrain train ...` as the container's command, which
# bypasses any ENTRYPOINT, so signal handling lives here:
# - as the container's first process (PID 1) it execs tini, which forwards SIGTERM to
#   Python (the trainer catches it to write a checkpoint) and reaps zombies;
# - otherwise it execs Python directly (same PID: signals reach it unchanged).
set -eu
real="${POSTTRAIN_BIN:-/opt/venv/bin/posttrain}"
if [ "$$" = 1 ] && [ -x /usr/bin/tini ]; then
  exec /usr/bin/tini -- "$real" "$@"
fi
exec "$real" "$@"
