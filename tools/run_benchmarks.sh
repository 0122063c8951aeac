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
      --num-spec-tokens 4 --json "$OUT/spec.json" | tee "$OUT/spec.txt" ;;&
  runtime|all)
    # The daemon (three processes) vs the in-process engine, and overlap off vs on, in one run.
    ADDR=${ADDR:-tcp://127.0.0.1:5611}
    overlap serve --config configs/smollm2-135m-draft.toml --zmq "$ADDR" 2> "$OUT/runtime_serve.log" &
    SERVE=$!
    trap 'kill $SERVE 2>/dev/null; wait $SERVE 2>/dev/null' EXIT
    until grep -q "serving" "$OUT/runtime_serve.log"; do sleep 1; kill -0 $SERVE; done
    overlap bench --prompts "$PROMPTS" --num-prompts 16 --max-tokens 64 --concurrency 1 8 \
      --config configs/smollm2-135m-draft.toml --spec none draft --no-overlap \
      --server "$ADDR" --compare-inprocess --json "$OUT/runtime.json" | tee "$OUT/runtime.txt" ;;
esac
