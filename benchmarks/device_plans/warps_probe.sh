#!/usr/bin/env bash
# Do more warps per SM pay for themselves in the streaming linear kernel?  The linear sweep on the eight Qwen3-32B /
# Llama-3.3-70B layers at T = 1, 2, 8, 16: the plan, the listed 96-register tiles and the spill probes (register caps
# that give 5-8 CTAs per SM at T <= 8 and 4 at T = 16), every candidate checked against the reference first; then
# the stall profile (stall_profile.sh).  Writes $OUT/linear_decode.json, $OUT/sweep.log, $OUT/stall.csv and .log.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${SWEEP_S:-300} python3 benchmarks/linear_decode_sweep.py --out $OUT --t 1,2,8,16 \
  --candidates stream-plan,spill,c96 --min-bytes 1e9 --repeats 10 > $OUT/sweep.log 2>&1
echo "sweep rc $?"
STALL_S=${STALL_S:-170} bash benchmarks/device_plans/stall_profile.sh > $OUT/stall.log 2>&1
echo "stall rc $?"
