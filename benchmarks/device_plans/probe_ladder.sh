#!/usr/bin/env bash
# Which part of the streaming linear kernel keeps it below the read ceiling?  The linear sweep on the eight Qwen3-32B /
# Llama-3.3-70B layers at T = 1, 8 and 16, in one process: the plan; the plan without its decode (stream-plan-nodecode,
# DECODE_COPY: 14.5 SASS instructions per code word on sm_90 against 25.2); without its scale arithmetic too
# (stream-plan-raw, DECODE_RAW: the loads, MMAs, loop and cross-CTA sums, 10.5 per word); its loads alone on its grid
# (stream-plan-loads*, benchmarks/stream_loads_probe.py: a mask and an add per loaded word, 9.2 per word; checked;
# -nox without the activation loads, -nosum without the cross-CTA sums); the plan and the loads probe on one CTA per
# row tile (stream-plan-rowtiles, stream-plan-loads-rowtiles: the ceiling's kind of grid); and the read-only ceiling.
# On an H100 (runs 102-103) the first probe gained <= 10 % on 21 of 24 rows; the H200 (the goals' GPU, 1.38x the bytes
# per SM-cycle) is the one to run it on.  Writes $OUT/linear_decode.json, $OUT/sweep.log and $OUT/linear_decode.txt
# (the summary, then the ladder: each row's fractions of read bandwidth side by side).  About two minutes.
# Then the same question for the MoE decode layer: the table's streaming gate_up and down (H = 2048: the 64 x 8 two-row-
# warp gate_up; H >= 4096: the 32 x 8 one; the late-cast down) as a pair, beside their walks with the loads alone
# (--loads-probe, checked exactly; alone, as a pair and without the cross-CTA sums) and the two-launch read ceiling
# (plain grids), at T = 1, 4, 8 on the four shapes.  Writes $OUT/moe_narrow/ and $OUT/moe_wide/ with their logs.
# About five minutes in all (the timeouts keep it under a call's 600 s); every file comes back (7 of the 8 allowed).
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${SWEEP_S:-220} python3 benchmarks/linear_decode_sweep.py --out $OUT --t 1,8,16 \
  --candidates 'stream-plan$,stream-plan-nodecode,stream-plan-raw,stream-plan-loads,stream-plan-rowtiles,read-only$' \
  --min-bytes 1e9 --repeats 10 \
  > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -i "fail\|error" $OUT/sweep.log | head -5; cat $OUT/linear_decode.txt
for part in "narrow qwen3-30b-a3b,qwen3-next-80b gus-m64t8-rw2" "wide qwen3-235b-a22b,deepseek-v3 gus-m32t8"; do
  set -- $part
  timeout ${MOE_S:-170} python3 benchmarks/moe_decode_sweep.py --out $OUT/moe_$1 --shapes $2 --tokens 1,4,8 \
    --gate-up $3 --down dns-m64t8-rw2-lc-c4 --pairs $3+dns-m64t8-rw2-lc-c4 --read-ceiling \
    --loads-probe $3,dns-m64t8-rw2-lc-c4 --no-baseline --repeats 10 > $OUT/moe_$1.log 2>&1
  echo "moe $1 rc $?"; grep -i "fail\|error" $OUT/moe_$1.log | head -5; tail -30 $OUT/moe_$1.log
done
