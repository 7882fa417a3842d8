#!/usr/bin/env bash
# Runs every test tier in order and prints how long each phase took.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

phase() {
  local name=$1; shift
  local start=$SECONDS
  echo "=== phase: $name"
  "$@"
  echo "=== phase: $name took $((SECONDS - start))s"
}

phase lint bash -c "ruff check . && ruff format --check ."
phase unit pytest -q tests/unit
phase trainer pytest -q tests/trainer
phase integration pytest -q tests/integration
phase e2e pytest -q tests/e2e
