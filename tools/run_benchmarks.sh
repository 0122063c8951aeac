#!/usr/bin/env bash
# Reproduces the numbers in docs/benchmarks.md. Run on a quiet machine: on 2 cores any other
# busy process makes torch's worker threads wait for a core and every op ~100x slower.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench}
mkdir -p "$OUT"
# The team's dev set (10 code + 10 chat prompts) when it is next to the repository; else the
# same mix from the shipped sets (benchmarks/prompts/): the first 10 of each.
PROMPTS=${PROMPTS:-../shared/prompts/dev.jsonl}
if [ ! -f "$PROMPTS" ]; then
  PROMPTS="$OUT/prompts.jsonl"
  { head -n 10 benchmarks/prompts/code.jsonl; head -n 10 benchmarks/prompts/chat.jsonl; } > "$PROMPTS"
  echo "using $PROMPTS (10 code + 10 chat prompts from benchmarks/prompts/)" >&2
fi
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
      --server "$ADDR" --compare-inprocess --json "$OUT/runtime.json" | tee "$OUT/runtime.txt" ;;&
  load|all)
    # 1000 short requests at concurrency 64 with speculation on, through the client library
    # and through the websocket bridge; then with 20% of the clients vanishing mid-stream.
    ADDR=${LOAD_ADDR:-tcp://127.0.0.1:5612}
    WS=${LOAD_WS:-8766}
    overlap serve --config configs/smollm2-135m-draft.toml --zmq "$ADDR" --ws "$WS" 2> "$OUT/load_serve.log" &
    LOADSERVE=$!
    trap 'kill $LOADSERVE 2>/dev/null; wait $LOADSERVE 2>/dev/null' EXIT
    until grep -q "serving" "$OUT/load_serve.log"; do sleep 1; kill -0 $LOADSERVE; done
    python tools/loadtest.py --server "$ADDR" --requests 1000 --concurrency 64 --max-tokens 16 \
      --json "$OUT/load_zmq.json" > "$OUT/load_zmq.txt"
    python tools/loadtest.py --server "$ADDR" --requests 1000 --concurrency 64 --max-tokens 16 \
      --disconnect-fraction 0.2 --json "$OUT/load_zmq_disconnect.json" > "$OUT/load_zmq_disconnect.txt"
    python tools/loadtest.py --ws "ws://127.0.0.1:$WS/" --server "$ADDR" --requests 1000 --concurrency 64 \
      --max-tokens 16 --disconnect-fraction 0.2 --json "$OUT/load_ws_disconnect.json" > "$OUT/load_ws_disconnect.txt" ;;
esac
