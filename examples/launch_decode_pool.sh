#!/usr/bin/env bash
# A pool of decode workers; same settings as launch_prefill_pool.sh.
# With CACHE set, decode also writes each finished conversation's pages back
# to the tier (--write-back), so a conversation's next turn hits on the answer.
set -euo pipefail
extra=()
[ -n "${CACHE:-}" ] && extra+=(--write-back)
ROLE=decode exec "$(dirname "$0")/launch_prefill_pool.sh" "${extra[@]}" "$@"
