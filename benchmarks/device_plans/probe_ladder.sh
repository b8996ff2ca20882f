#!/usr/bin/env bash
# Which part of the streaming linear kernel keeps it below the read ceiling?  The linear sweep on the eight Qwen3-32B /
# Llama-3.3-70B layers at T = 1, 8 and 16, in one process: the plan; the plan without its decode (stream-plan-nodecode,
# DECODE_COPY: 14.5 SASS instructions per code word on sm_90 against 25.2); without its scale arithmetic too
# (stream-plan-raw, DECODE_RAW: the loads, MMAs, loop and cross-CTA sums, 10.5 per word); its loads alone on its grid
# (stream-plan-loads*, benchmarks/stream_loads_probe.py: one add per loaded word, 7.7 per word; checked exactly;
# -nox without the activation loads, -nosum without the cross-CTA sums); and the read-only ceiling (a plain grid).
# On an H100 (runs 102-103) the first probe gained <= 10 % on 21 of 24 rows; the H200 (the goals' GPU, 1.38x the bytes
# per SM-cycle) is the one to run it on.  Writes $OUT/linear_decode.json and $OUT/sweep.log.  About two minutes.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${SWEEP_S:-300} python3 benchmarks/linear_decode_sweep.py --out $OUT --t 1,8,16 \
  --candidates 'stream-plan$,stream-plan-nodecode,stream-plan-raw,stream-plan-loads,read-only$' --min-bytes 1e9 \
  --repeats 10 \
  > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -i "fail\|error" $OUT/sweep.log | head -5; cat $OUT/linear_decode.txt
grep "stream-plan" $OUT/sweep.log | awk '{print $1, $2, $4, $5, $NF}' | head -200
