#!/usr/bin/env bash
# Is the streaming kernel's load pattern (64 bytes of each of 8 rows per load instruction) what holds it below the read
# ceiling?  The linear sweep on the eight Qwen3-32B / Llama-3.3-70B layers at T = 1 and 8: the plan, the plan without
# its decode (stream-plan-nodecode), the 8-warp tiles (a CTA step over 512 bytes of each row instead of 256; each
# checked against the reference first), and the read-only kernel at 512, 128 and 64 bytes of a row per load
# instruction (read-only, -w32, -w16), in one process.  Then the MoE layer on the four shapes at T = 4
# and 8 with the 8-warp streaming gate_up (gus-m16t8-w8) beside the table's two, each before the table's streaming
# down, every pair checked against moe_ref first.  Writes $OUT/linear_decode.json, $OUT/sweep.log, $OUT/moe/ and
# $OUT/moe_sweep.log.  About four minutes.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${SWEEP_S:-400} python3 benchmarks/linear_decode_sweep.py --out $OUT --t 1,8 \
  --candidates 'stream-plan$,stream-plan-nodecode,w8r1,read-only$,read-only-w' --min-bytes 1e9 --repeats 10 \
  > $OUT/sweep.log 2>&1
echo "sweep rc $?"; grep -i "fail\|error" $OUT/sweep.log | head -5; cat $OUT/linear_decode.txt
D=dns-m64t8-rw2-lc-c4
timeout ${MOE_S:-150} python3 benchmarks/moe_decode_sweep.py --out $OUT/moe --tokens 4,8 --no-baseline --repeats 10 \
  --pairs "gus-m32t8+$D,gus-m64t8-rw2+$D,gus-m16t8-w8+$D" > $OUT/moe_sweep.log 2>&1
echo "moe sweep rc $?"; grep -c FAIL $OUT/moe_sweep.log; sed -n '/rows in/,$p' $OUT/moe_sweep.log | tail -30
