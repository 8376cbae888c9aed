#!/usr/bin/env bash
# steady-state main-thread (event loop) profile of one tree ($1): 32 streamed chats x 64 tokens, after a warm-up
TREE=$1; PORT=$2; OUT=$3
cd /tmp
PROF=$OUT PYTHONPATH=$TREE TFSERVE_KERNELS_DIR=/tmp/kernels-$(basename $TREE) python /work/bench/s31/profmain.py serve --port $PORT > $OUT.log 2>&1 &
PID=$!
for i in $(seq 120); do [ "$(curl -s -o /dev/null -w "%{http_code}" localhost:$PORT/health)" = 200 ] && break; sleep 1; done
python /work/bench/s31/drive.py $PORT   # warm-up pass (same work)
kill -USR1 $PID; sleep 0.5
python /work/bench/s31/drive.py $PORT
kill -USR2 $PID; sleep 2
kill -INT $PID; wait $PID
python - $OUT <<'PY'
import pstats, sys, json
st = pstats.Stats(sys.argv[1])
tokens = json.load(open("/tmp/drive_tokens.json"))
py = {k: v for k, v in st.stats.items() if "tfserve" in k[0]}
print(f"tokens {tokens} all calls/token {st.total_calls/tokens:.1f} tfserve calls/token {sum(v[1] for v in py.values())/tokens:.1f} main-thread tt/token {1e6*st.total_tt/tokens:.0f} us")
PY
