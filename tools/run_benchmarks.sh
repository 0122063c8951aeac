#!/usr/bin/env bash
# Reproduces the numbers in docs/benchmarks.md. Run on a quiet machine: on 2 cores any other
# busy process makes torch's worker threads wait for a core and every op ~100x slower.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${PROMPTS:-../shared/prompts/dev.jsonl}
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
case "${1:-all}" in
  foundation|all)
    overlap bench --prompts "$PROMPTS" --max-tokens 128 --concurrency 1 8 --compare-hf --dtype float32 \
      --json "$OUT/foundation_float32.json" | tee "$OUT/foundation_float32.txt"
    overlap bench --prompts "$PROMPTS" --max-tokens 128 --concurrency 1 8 --compare-hf --dtype bfloat16 \
      --json "$OUT/foundation_bfloat16.json" | tee "$OUT/foundation_bfloat16.txt" ;;&
  spec|all)
    overlap bench --prompts "$PROMPTS" --max-tokens 128 --concurrency 1 4 --spec none draft ngram \
      --num-spec-tokens 4 --json "$OUT/spec.json" | tee "$OUT/spec.txt" ;;
esac
