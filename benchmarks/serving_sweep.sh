#!/usr/bin/env bash
# Latency against request rate for `pagedlm serve`: start the server, wait for /health, run
# `pagedlm bench serving` once per rate on the same ShareGPT requests (Poisson arrivals,
# seed 0; "inf" sends everything at once), one JSON per rate, then stop the server.
#
# usage: benchmarks/serving_sweep.sh [--rates "0.5 1 inf"] [--num-prompts 24] [--port 8090]
#            [--out DIR] [-- extra `pagedlm serve` flags, e.g. --weight-dtype float16]
# Then: pagedlm bench plot latency DIR/serving_pagedlm_rate*.json -o DIR/latency_vs_rate.png
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
RATES="0.5 1 inf"
NUM_PROMPTS=24
PORT=8090
OUT="$HERE/results"
SERVE_FLAGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rates) RATES="$2"; shift 2 ;;
        --num-prompts) NUM_PROMPTS="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --) shift; SERVE_FLAGS=("$@"); break ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
BASE="http://127.0.0.1:$PORT"
pagedlm serve --port "$PORT" "${SERVE_FLAGS[@]}" > "$OUT/serving_pagedlm_server.log" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    curl -sf "$BASE/health" > /dev/null && break
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited; see $OUT/serving_pagedlm_server.log" >&2; exit 1; }
    sleep 1
done
for RATE in $RATES; do
    echo "== pagedlm serve: request rate $RATE, $NUM_PROMPTS ShareGPT requests"
    pagedlm bench serving --base-url "$BASE" --dataset sharegpt --num-prompts "$NUM_PROMPTS" \
        --request-rate "$RATE" --seed 0 --temperature 1 --top-p 1 --ignore-eos --disable-tqdm \
        --label "pagedlm rate $RATE" --output-json "$OUT/serving_pagedlm_rate${RATE}.json"
done
