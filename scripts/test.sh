#!/usr/bin/env bash
# Runs every test tier in order and prints how long each phase took.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
# The trainer tier's JAX compilation cache outlives the run (like pip's and Go's caches):
# on a machine that has run the tests once, only programs that changed compile again.
export POSTTRAIN_TEST_JAX_CACHE="${POSTTRAIN_TEST_JAX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/posttrain/jax-compile}"

phase() {
  local name=$1; shift
  local start=$SECONDS
  echo "=== phase: $name"
  "$@"
  echo "=== phase: $name took $((SECONDS - start))s"
}

phase lint bash -c "ruff check . && ruff format --check ."
# --durations: each tier prints its slowest tests, so growth shows where it comes from.
phase unit pytest -q --durations=5 tests/unit
phase trainer pytest -q --durations=25 tests/trainer
phase integration pytest -q --durations=25 tests/integration
phase e2e pytest -q --durations=15 tests/e2e
