# Shared by the launch_*.sh scripts: start kvrelay processes with a log each,
# wait for their ready line, stop them all (and their rank processes) on exit.
# Each process runs in its own session (setsid), so one signal to its process
# group also reaches the ranks it spawned.

# The project's environment, which `make test` creates: its bin/ goes first
# on PATH when it exists, so `kvrelay` and `python3` are the project's own
# without activating anything; elsewhere (an installed kvrelay) PATH is kept.
KVRELAY_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -x "$KVRELAY_ROOT/.venv/bin/kvrelay" ]; then
  PATH="$KVRELAY_ROOT/.venv/bin:$PATH"
  export PATH
fi
KVRELAY=${KVRELAY:-kvrelay}
LOGDIR=${LOGDIR:-kvrelay-logs}
READY_TIMEOUT=${READY_TIMEOUT:-120}
PIDS=()
mkdir -p "$LOGDIR"

# start NAME ARGS... : runs `kvrelay ARGS...` with output in $LOGDIR/NAME.log
start() {
  local name=$1; shift
  echo "\$ $KVRELAY $*" > "$LOGDIR/$name.log"
  setsid $KVRELAY "$@" >> "$LOGDIR/$name.log" 2>&1 < /dev/null &
  PIDS+=($!)
  LAST_PID=$!
}

# wait_ready NAME : until the process printed its JSON ready line; echoes it
wait_ready() {
  local name=$1 pid=${2:-$LAST_PID} waited=0 line
  while :; do
    line=$(grep -m1 '^{' "$LOGDIR/$name.log" 2>/dev/null || true)
    if [ -n "$line" ]; then echo "$line"; return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name exited before it was ready; last lines of $LOGDIR/$name.log:" >&2
      tail -n 20 "$LOGDIR/$name.log" >&2
      return 1
    fi
    if [ "$waited" -ge $((READY_TIMEOUT * 5)) ]; then
      echo "$name not ready after ${READY_TIMEOUT}s (see $LOGDIR/$name.log)" >&2
      return 1
    fi
    sleep 0.2; waited=$((waited + 1))
  done
}

# json_field LINE FIELD : one string field of a JSON ready line
json_field() {
  python3 -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"
}

stop_all() {
  trap - INT TERM EXIT
  local pid i
  # Newest first: workers deregister before control and the cache go.
  for ((i=${#PIDS[@]}-1; i>=0; i--)); do kill -TERM -- "-${PIDS[i]}" 2>/dev/null || true; done
  for _ in $(seq 100); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.2
  done
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  echo "stopped; logs in $LOGDIR"
}
trap 'stop_all; exit 130' INT TERM
trap stop_all EXIT
