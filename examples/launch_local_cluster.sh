#!/usr/bin/env bash
# A whole cluster on loopback: control, a cache server, a prefill pool and a
# decode pool, each pool in its own parallel config.
#
#   [MODEL=dir] [PORT=8000] [PREFILL_WORKERS=1] [PREFILL_TP=2] [PREFILL_PP=1]
#   [DECODE_WORKERS=1] [DECODE_TP=1] [DECODE_PP=1] [CACHE_GB=0.5]
#   [CACHE_MODE=shared|local|none] [BACKEND=tcp|ucx] [TOKEN=...]
#   examples/launch_local_cluster.sh
#
# Then: curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "hello", "max_tokens": 8}'
# Logs per process in $LOGDIR (kvrelay-logs); Ctrl-C stops everything.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/cluster_lib.sh"
MODEL=${MODEL:-.kvrelay-demo/model}
PORT=${PORT:-8000} TOKEN=${TOKEN:-kvrelay-local} BACKEND=${BACKEND:-tcp}
CACHE_MODE=${CACHE_MODE:-shared} CACHE_GB=${CACHE_GB:-0.5}
PAGE_SIZE=${PAGE_SIZE:-64} DTYPE=${DTYPE:-float32}
if [ ! -f "$MODEL/config.json" ]; then
  $KVRELAY make-model "$MODEL" --arch llama --layers 2 --hidden 128 --heads 4 --kv-heads 2 --vocab 256 \
    --max-positions 65536
fi
control_args=(launch control --listen "127.0.0.1:$PORT" --token "$TOKEN")
CACHE=""
if [ "$CACHE_MODE" = shared ]; then
  page_bytes=$(python3 - "$MODEL" "$DTYPE" "$PAGE_SIZE" <<'PY'
import sys
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
model, dtype, page_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
print(kv_spec(model, ModelConfig.from_dir(model), dtype, page_size).page_bytes)
PY
)
  start cache0 launch cache --token "$TOKEN" --page-bytes "$page_bytes" \
    --arena-gb "$CACHE_GB" --backend "$BACKEND"
  CACHE=$(json_field "$(wait_ready cache0)" listen)
  control_args+=(--cache "$CACHE")
  echo "cache0: $CACHE"
fi
start control "${control_args[@]}"
wait_ready control > /dev/null
CONTROL="http://127.0.0.1:$PORT"
echo "control: $CONTROL"
worker_args=(--page-size "$PAGE_SIZE" --dtype "$DTYPE")
[ "$CACHE_MODE" = none ] && worker_args+=(--no-local-cache)
export CONTROL TOKEN MODEL BACKEND CACHE LOGDIR KVRELAY READY_TIMEOUT
WORKERS=${PREFILL_WORKERS:-1} TP=${PREFILL_TP:-2} PP=${PREFILL_PP:-1} \
  setsid "$HERE/launch_prefill_pool.sh" "${worker_args[@]}" > "$LOGDIR/prefill-pool.log" 2>&1 &
PIDS+=($!)
WORKERS=${DECODE_WORKERS:-1} TP=${DECODE_TP:-1} PP=${DECODE_PP:-1} \
  setsid "$HERE/launch_decode_pool.sh" "${worker_args[@]}" > "$LOGDIR/decode-pool.log" 2>&1 &
PIDS+=($!)
for pool in prefill-pool decode-pool; do
  for _ in $(seq $((READY_TIMEOUT * 5))); do
    grep -q "up; Ctrl-C" "$LOGDIR/$pool.log" 2>/dev/null && break
    sleep 0.2
  done
  grep -q "up; Ctrl-C" "$LOGDIR/$pool.log" || { cat "$LOGDIR/$pool.log" >&2; exit 1; }
done
echo "cluster up at $CONTROL (cache: $CACHE_MODE); logs in $LOGDIR; Ctrl-C stops it"
wait
