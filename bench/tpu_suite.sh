#!/usr/bin/env bash
# What posttrain measures on a TPU, in one command on the chip's machine (docs/tpu.md):
#   bash bench/tpu_suite.sh [PART...]     parts: tests bench attention decode loop grpo (default: all)
# Each part has a time limit; results go to $OUT (default /tmp/out): tests.txt, bench.jsonl,
# bench.txt, attention.txt, decode.jsonl, decode.txt, loop.jsonl, loop.txt, grpo.jsonl, grpo.txt. Run from the project root after `source .tpu-kit/setup.sh`
# (../shared/tpu/README.md), or anywhere posttrain and JAX with a TPU are installed.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
parts=${*:-tests bench attention decode loop grpo}
echo "posttrain $(git rev-parse --short HEAD 2>/dev/null || echo '?') on $(date -u +%FT%TZ)" | tee -a "$OUT/suite.txt"
# the trainer's imports, checked in seconds rather than minutes into a part (the TPU
# machine's index lacks portpicker, which Grain's prefetch imports: docs/tpu.md)
if ! python3 -c "import posttrain.trainer.data.loader" 2> "$OUT/imports.txt"; then
  tail -1 "$OUT/imports.txt" | tee -a "$OUT/suite.txt"
  echo "the trainer does not import here: install what is missing first (docs/tpu.md, How to measure)" | tee -a "$OUT/suite.txt"
  exit 2
fi
for part in $parts; do
  t=$SECONDS
  case $part in
    tests) timeout "${TESTS_LIMIT:-240}" python3 -m pytest -q -s -p no:cacheprovider tests/tpu 2>&1 | tail -40 > "$OUT/tests.txt" ;;
    bench) timeout "${BENCH_LIMIT:-400}" python3 bench/tpu.py ${BENCH_ARGS:-} --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.txt" ;;
    attention) timeout "${ATTENTION_LIMIT:-240}" python3 bench/attention.py ${ATTENTION_ARGS:-} 2>&1 | tee "$OUT/attention.txt" ;;
    decode) timeout "${DECODE_LIMIT:-240}" python3 bench/tpu_decode.py ${DECODE_ARGS:-} --json "$OUT/decode.jsonl" 2>&1 | tee "$OUT/decode.txt" ;;
    loop) timeout "${LOOP_LIMIT:-420}" python3 bench/tpu_loop.py ${LOOP_ARGS:-} --json "$OUT/loop.jsonl" 2>&1 | tee "$OUT/loop.txt" ;;
    grpo) timeout "${GRPO_LIMIT:-300}" python3 bench/tpu_grpo.py ${GRPO_ARGS:-} --json "$OUT/grpo.jsonl" 2>&1 | tee "$OUT/grpo.txt" ;;
    *) echo "unknown part $part (tests, bench, attention, decode, loop, grpo)" >&2; exit 2 ;;
  esac
  echo "$part took $((SECONDS - t)) s" | tee -a "$OUT/suite.txt"
done
