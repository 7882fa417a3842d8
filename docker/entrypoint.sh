#!/bin/sh
# `posttrain` in the operator and trainer images (installed as /opt/posttrain/bin/posttrain,
# first on PATH). The JobSet runs `posttrain train ...` as the container's command, which
# bypasses any ENTRYPOINT, so signal handling lives here:
# - as the container's first process (PID 1) it execs tini, which forwards SIGTERM to
#   Python (the trainer catches it to write a checkpoint) and reaps zombies;
# - otherwise it execs Python directly (same PID: signals reach it unchanged).
# POSTTRAIN_NCCL_ENV_SCRIPT (set by the renderer on GPUDirect-TCPXO/RDMA nodes) names the
# NCCL settings script of the node's NCCL plugin; it is sourced first, so its settings
# (LD_LIBRARY_PATH included) are there when the process starts.
set -eu
real="${POSTTRAIN_BIN:-/opt/venv/bin/posttrain}"
nccl_env="${POSTTRAIN_NCCL_ENV_SCRIPT:-}"
if [ -n "$nccl_env" ]; then
  if [ -r "$nccl_env" ]; then
    set +eu
    . "$nccl_env"
    set -eu
  else
    echo "posttrain: $nccl_env not found: is the cluster's NCCL plugin installer" \
      "DaemonSet running on this node? NCCL falls back to TCP sockets (slow)." >&2
  fi
fi
if [ "$$" = 1 ] && [ -x /usr/bin/tini ]; then
  exec /usr/bin/tini -- "$real" "$@"
fi
exec "$real" "$@"
