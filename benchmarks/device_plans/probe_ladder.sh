#!/usr/bin/env bash
# Which part of the streaming linear kernel keeps it below the read ceiling?  The linear sweep on the eight Qwen3-32B /
# Llama-3.3-70B layers at T = 1, 8 and 16, in one process: the plan; the plan without its decode (stream-plan-nodecode,
# DECODE_COPY: 14.5 SASS instructions per code word on sm_90 against 25.2); without its scale arithmetic too
# (stream-plan-raw, DECODE_RAW: the loads, MMAs, loop and cross-CTA sums, 10.5 per word); and the read-only ceiling.
# On an H100 (runs 102-103) the first probe gained <= 10 % on 21 of 24 rows; the H200 (the goals' GPU, 1.38x the bytes
# per SM-cycle) is the one to run it on.  Writes $OUT/linear_decode.json and $OUT/sweep.log.  About one minute.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${SWEEP_S:-300} python3 benchmarks/linear_decode_sweep.py --out $OUT --t 1,8,16 \
  --candidates 'stream-plan$,stream-plan-nodecode,stream-plan-raw,read-only$' --min-bytes 1e9 --repeats 10 \
  > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -i "fail\|error" $OUT/sweep.log | head -5; cat $OUT/linear_decode.txt
