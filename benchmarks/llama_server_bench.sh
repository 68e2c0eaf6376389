#!/usr/bin/env bash
# llama.cpp's own server as a baseline: start `llama-server` on the SmolLM2 GGUF with N parallel
# slots and continuous batching, wait for /health, and load it with `pagedlm bench serving`:
# the same ShareGPT requests as `pagedlm bench throughput` (same tokenizer, seed and count),
# all sent at once, sampled as that benchmark samples (temperature 1, top-p 1, no top-k/min-p,
# EOS ignored so every request generates exactly its length). One JSON per slot count.
#
# usage: benchmarks/llama_server_bench.sh [--slots "16 64"] [--num-prompts 64] [--threads 2]
#            [--ctx-per-slot 2048] [--port 8089] [--server PATH] [--model GGUF] [--out DIR]
#            [-- extra `pagedlm bench serving` flags]
# llama-server comes from benchmarks/build_llama_cpp.sh (default
# ~/.cache/pagedlm/llama.cpp/<version>/bin/llama-server).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
VERSION=0.3.36
SLOTS="16 64"
NUM_PROMPTS=64
THREADS=2
CTX_PER_SLOT=2048  # a ShareGPT request has at most 2048 tokens (prompt + output)
PORT=8089
SERVER="$HOME/.cache/pagedlm/llama.cpp/$VERSION/bin/llama-server"
MODEL=""
OUT="$HERE/results"
PYTHON="${PYTHON:-python}"
EXTRA=()

while [[ $# -gt 0 ]]; do
    case "$1" in
        --slots) SLOTS="$2"; shift 2 ;;
        --num-prompts) NUM_PROMPTS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --ctx-per-slot) CTX_PER_SLOT="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --server) SERVER="$2"; shift 2 ;;
        --model) MODEL="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

if [[ ! -x "$SERVER" ]]; then
    echo "no llama-server at $SERVER: run benchmarks/build_llama_cpp.sh first (or pass --server)" >&2
    exit 1
fi
if [[ -z "$MODEL" ]]; then
    MODEL="$("$PYTHON" -c 'from pagedlm.loader.gguf_loader import default_model_path; print(default_model_path())')"
fi
mkdir -p "$OUT"
BASE="http://127.0.0.1:$PORT"
SERVER_PID=""
cleanup() { if [[ -n "$SERVER_PID" ]]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT

for NP in $SLOTS; do
    CTX=$((NP * CTX_PER_SLOT))  # llama-server splits -c evenly between the slots
    LOG="$OUT/llama_server_np${NP}.log"
    echo "== llama-server: $NP slots, context $CTX, $THREADS threads (log: $LOG)"
    "$SERVER" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -np "$NP" -c "$CTX" \
        -t "$THREADS" -tb "$THREADS" --cont-batching --no-webui > "$LOG" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 300); do
        if curl -fsS "$BASE/health" > /dev/null 2>&1; then break; fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "llama-server exited; see $LOG" >&2; exit 1; fi
        sleep 1
    done
    curl -fsS "$BASE/health" > /dev/null

    INFO="$(mktemp)"
    "$PYTHON" - "$SERVER" "$NP" "$CTX" "$THREADS" "$MODEL" > "$INFO" <<'EOF'
import json, subprocess, sys
server, np_, ctx, threads, model = sys.argv[1:]
version = subprocess.run([server, "--version"], capture_output=True, text=True)
print(json.dumps({
    "engine": "llama-server (llama.cpp)",
    "version": (version.stdout + version.stderr).strip(),
    "parallel_slots": int(np_), "ctx_size": int(ctx), "threads": int(threads),
    "cont_batching": True, "model_file": model,
}))
EOF
    "$PYTHON" -m pagedlm.entrypoints.cli bench serving --base-url "$BASE" \
        --dataset sharegpt --num-prompts "$NUM_PROMPTS" --seed 0 --request-rate inf \
        --temperature 1.0 --top-p 1.0 --top-k 0 --min-p 0.0 --ignore-eos \
        --dtype "gguf (llama.cpp kernels on the file's own types)" --server-info "$INFO" \
        --label "llama-server np=$NP" --disable-tqdm \
        --output-json "$OUT/llama_server_np${NP}_sharegpt${NUM_PROMPTS}.json" "${EXTRA[@]}"
    rm -f "$INFO"
    cleanup
    SERVER_PID=""
done
