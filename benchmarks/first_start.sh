#!/bin/bash
# The README's first command on a fresh machine, timed: a new virtualenv, empty pip, model
# and kernel caches (TORCH_EXTENSIONS_DIR too, for revisions built by torch's builder),
# `pip install --no-compile "torch==2.13.0" -e SRC`, then `pagedlm serve` until /health
# answers. Prints both times, the start's log (seconds after the install) and the log of
# the kernel build pip's install started; then times a later start of the same install.
#
#   benchmarks/first_start.sh [SRC (default: this checkout)] [PORT (default: 8431)]
set -u
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
PORT=${2:-8431}
W=$(mktemp -d)
trap 'pkill -f "pagedlm serve --port $PORT" 2>/dev/null; rm -rf "$W"' EXIT
python -m venv "$W/venv"
export PIP_CACHE_DIR=$W/pip-cache XDG_CACHE_HOME=$W/cache TORCH_EXTENSIONS_DIR=$W/kernels PAGEDLM_KERNEL_DIR=$W/kernels
unset PAGEDLM_CACHE_DIR PAGEDLM_DISABLE_CPU_KERNELS PAGEDLM_PREBUILT_KERNELS
now() { date +%s.%N; }
T0=$(now)
"$W/venv/bin/pip" install -q --no-compile "torch==2.13.0" -e "$SRC" > "$W/pip.log" 2>&1 \
  || { echo "pip install failed:"; tail "$W/pip.log"; exit 1; }
T1=$(now)
( "$W/venv/bin/pagedlm" serve --port "$PORT" 2>&1 | while IFS= read -r line; do
    printf '%6.1f %s\n' "$(echo "$(now) - $T1" | bc)" "$line"; done > "$W/serve.log" ) &
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  sleep 0.1
  if [ "$(echo "$(now) - $T1 > 600" | bc)" = 1 ]; then echo "not ready in 600 s"; cat "$W/serve.log"; exit 1; fi
done
T2=$(now)
printf 'pip install %.1f s; pagedlm serve ready %.1f s later; %.1f s in all\n' \
  "$(echo "$T1 - $T0" | bc)" "$(echo "$T2 - $T1" | bc)" "$(echo "$T2 - $T0" | bc)"
cat "$W/serve.log"
# A later start of the same install (model, kernels and bytecode cached), timed the same way.
pkill -f "pagedlm serve --port $PORT"; sleep 2
T3=$(now)
"$W/venv/bin/pagedlm" serve --port "$PORT" > "$W/serve2.log" 2>&1 &
timeout 600 bash -c "until curl -sf http://127.0.0.1:$PORT/health > /dev/null; do sleep 0.1; done" \
  || { echo "a later start: not ready in 600 s"; cat "$W/serve2.log"; exit 1; }
printf 'a later start: ready %.1f s after it\n' "$(echo "$(now) - $T3" | bc)"
# The build pip's install started in the background (where the revision has one).
[ -f "$W/kernels/install.log" ] && sed "s/^/install.log: /" "$W/kernels/install.log"
exit 0
