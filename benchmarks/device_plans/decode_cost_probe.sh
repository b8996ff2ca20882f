#!/usr/bin/env bash
# What the shift decode's instructions cost the streaming linear kernel on this GPU, and the K-tail rules' GPU tests.
# 1. k_tail_tests.sh (the linear op at a K that is not a multiple of 128, the MoE flow's odd shape).
# 2. The linear sweep on the eight Qwen3-32B / Llama-3.3-70B layers at T = 1, 8, 16: the plan, the plan without its
#    decode (`stream-plan-nodecode`, gluon_gemv_stream.DECODE_COPY: ~10 fewer SASS instructions per code word on sm_90,
#    a timing probe with no result to check), and the read-only ceilings (pointer loads and TMA), all in one process.
#    If the probe runs near the read ceiling, the decode's instructions are what holds the plan back on this GPU; if
#    it runs near the plan, they are not.
# Writes $OUT/k_tail_tests.log, $OUT/linear_decode.json and $OUT/sweep.log.  About six minutes.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
TESTS_S=${TESTS_S:-200} bash benchmarks/device_plans/k_tail_tests.sh
timeout ${SWEEP_S:-330} python3 benchmarks/linear_decode_sweep.py --out $OUT --t 1,8,16 \
  --candidates 'stream-plan$,stream-plan-nodecode,read-only' --min-bytes 1e9 --repeats 10 > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -c "us " $OUT/sweep.log; grep -i "fail\|error" $OUT/sweep.log | head -5
