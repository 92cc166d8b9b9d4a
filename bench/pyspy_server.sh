#!/usr/bin/env bash
# Where our server's threads spend a load: py-spy samples every thread's Python stack
# (idle frames included) while bench.loadgen drives the dummy 8B model.
#   bash bench/pyspy_server.sh OUT_DIR [CONCURRENCY] [SECONDS]
# Writes OUT_DIR/pyspy-cC.txt (py-spy's raw collapsed stacks, one line per stack with its
# sample count; `python -m bench.pyspy_split FILE` sums them per thread and function) and
# the load's summary. Needs py-spy on PATH (staged with the device wheels).
set -euo pipefail
out=$1; c=${2:-32}; secs=${3:-20}
port=18123
python3 -m server.cli serve --load-format dummy --model llama3-8b --dtype bfloat16 \
  --served-model-name bench --log-level warning --port $port > "$out/pyspy-server.log" 2>&1 &
pid=$!
python3 - "$port" <<'PY'
import sys, time, httpx
for _ in range(600):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
PY
python3 -m bench.loadgen --url http://127.0.0.1:$port --model bench -c "$c" -p 1000 -t 256 \
  -n $((c * 6)) > "$out/pyspy-load-c$c.json" &
load=$!
sleep 5  # past the first wave's prefill
py-spy record --pid $pid --duration "$secs" --rate 250 --format raw --threads --idle --nonblocking \
  -o "$out/pyspy-c$c.txt" || echo "py-spy failed: $?"
wait $load
kill $pid
wait $pid || true
