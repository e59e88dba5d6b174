#!/usr/bin/env bash
# A pool of prefill workers, each a TP x PP group of rank processes.
#
#   CONTROL=http://127.0.0.1:8000 TOKEN=secret MODEL=path/to/model \
#   [CACHE=127.0.0.1:7000,...] [WORKERS=2] [TP=2] [PP=1] [BACKEND=ucx|tcp] \
#   examples/launch_prefill_pool.sh [extra kvrelay launch prefill flags]
#
# Without CACHE the workers use only their own pools' prefix caches.
# Logs: $LOGDIR/prefill<i>.log. Ctrl-C stops the pool.
set -euo pipefail
ROLE=${ROLE:-prefill}
source "$(dirname "$0")/cluster_lib.sh"
: "${CONTROL:?set CONTROL to the control URL}" "${TOKEN:?set TOKEN}" "${MODEL:?set MODEL}"
WORKERS=${WORKERS:-1} TP=${TP:-1} PP=${PP:-1} BACKEND=${BACKEND:-tcp}
args=(--model "$MODEL" --tp "$TP" --pp "$PP" --control "$CONTROL" --token "$TOKEN"
      --backend "$BACKEND")
[ -n "${CACHE:-}" ] && args+=(--cache "$CACHE")
for i in $(seq 0 $((WORKERS - 1))); do
  start "$ROLE$i" launch "$ROLE" "${args[@]}" "$@"
  echo "$ROLE$i: $(wait_ready "$ROLE$i")"
done
echo "$WORKERS $ROLE worker(s) TP=$TP PP=$PP up; Ctrl-C stops them"
wait
