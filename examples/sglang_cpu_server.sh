#!/usr/bin/env bash
# An SGLang server on CPU with HiCache and kvrelay as its L3: a kvrelay cache
# server, then SGLang through kvrelay's CPU layer (pure-torch stand-ins for
# the sgl_kernel ops SGLang's CPU engine needs; `make sglang-deps` installs
# SGLang). Serves until interrupted; stops the cache server on exit.
#
#   examples/sglang_cpu_server.sh MODEL_DIR [PORT]     (e.g. `kvrelay make-model ...`)
#
# Environment: PYTHON (default .venv/bin/python), DTYPE (bfloat16), PAGE (16),
# LAYOUT (layer_first or page_first_direct), TOKEN (cluster token), TOKENS
# (the device pool in tokens, 65536: on CPU SGLang otherwise sizes it to most
# of the host's memory and leaves none for HiCache's host pool, twice that).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: $0 MODEL_DIR [PORT]}
PORT=${2:-30000}
PYTHON=${PYTHON:-.venv/bin/python}
DTYPE=${DTYPE:-bfloat16}
PAGE=${PAGE:-16}
LAYOUT=${LAYOUT:-layer_first}
TOKEN=${TOKEN:-sglang-cpu-example}
TOKENS=${TOKENS:-65536}
export PYTHONPATH=$PWD:$PWD/.venv-sglang${PYTHONPATH:+:$PYTHONPATH}
KVRELAY="$PYTHON -m kvrelay.cli"
source examples/cluster_lib.sh

# The model's unified page size and identity, as kvrelay's workers name them.
read -r PAGE_BYTES MODEL_ID FINGERPRINT < <("$PYTHON" -c "
import sys
from kvrelay.model.config import ModelConfig
from kvrelay.model.loader import kv_spec
s = kv_spec(sys.argv[1], ModelConfig.from_dir(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
print(s.page_bytes, s.model_id, s.weights_fingerprint)" "$MODEL" "$DTYPE" "$PAGE")

start cache launch cache --token "$TOKEN" --page-bytes "$PAGE_BYTES" --arena-gb 1
CACHE=$(json_field "$(wait_ready cache)" listen)
EXTRA=$(printf '{"backend_name": "kvrelay", "module_path": "kvrelay.adapters.sglang.storage",
  "class_name": "KvrelayHiCacheStorage", "interface_v1": 1, "servers": ["%s"],
  "token": "%s", "model_id": "%s", "weights_fingerprint": "%s"}' \
  "$CACHE" "$TOKEN" "$MODEL_ID" "$FINGERPRINT")
echo "kvrelay cache server on $CACHE; SGLang on 127.0.0.1:$PORT (log: $LOGDIR/sglang.log)"
SGLANG_USE_CPU_ENGINE=1 setsid "$PYTHON" -m kvrelay.adapters.sglang.cpu.launch_server \
  --model-path "$MODEL" --dtype "$DTYPE" --device cpu --attention-backend torch_native \
  --disable-cuda-graph --skip-tokenizer-init --host 127.0.0.1 --port "$PORT" \
  --page-size "$PAGE" --max-total-tokens "$TOKENS" --enable-hierarchical-cache \
  --hicache-ratio 2 --hicache-io-backend direct \
  --hicache-mem-layout "$LAYOUT" --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config "$EXTRA" > "$LOGDIR/sglang.log" 2>&1 < /dev/null &
PIDS+=($!)
wait "${PIDS[-1]}"
