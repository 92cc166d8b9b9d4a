set -u
rm -rf /tmp/fresh /tmp/freshhome; mkdir -p /tmp/freshhome; export HOME=/tmp/freshhome
git clone -q /work/main /tmp/fresh && cd /tmp/fresh
t0=$(date +%s.%N)
python3 -m venv .venv && .venv/bin/pip install -q -e '.[gemma]' > /tmp/fresh-pip.log 2>&1
t1=$(date +%s.%N); echo "install_s $(echo "$t1 - $t0" | bc)"
.venv/bin/mlx-headroom serve > /tmp/fresh-serve.log 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 0.5; kill -0 $pid 2>/dev/null || { echo died; tail /tmp/fresh-serve.log; exit 1; }; done
t2=$(date +%s.%N); echo "first_start_s $(echo "$t2 - $t1" | bc)"
curl -s http://127.0.0.1:8000/health; echo
for i in 1 2; do
  a=$(date +%s.%N)
  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{"model":"google/gemma-3-270m","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":30,"temperature":0}' > /tmp/fresh-answer-$i.json
  b=$(date +%s.%N); echo "answer_${i}_s $(echo "$b - $a" | bc)"; python3 -c "import json;d=json.load(open('/tmp/fresh-answer-$i.json'));print(d['model'],d['usage'],repr(d['choices'][0]['message']['content'][:200]))"
done
kill -TERM $pid; wait $pid; echo "serve rc=$?"
t3=$(date +%s.%N)
.venv/bin/mlx-headroom serve > /tmp/fresh-serve2.log 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:8000/health >/dev/null; do sleep 0.5; done
t4=$(date +%s.%N); echo "second_start_s $(echo "$t4 - $t3" | bc)"
kill -TERM $pid; wait $pid; echo "serve rc=$?"; pgrep -f "/tmp/fresh/.venv/bin/mlx-headroom" || echo "nothing left running"
grep -i "terms\|gemma" /tmp/fresh-serve.log | head -5
