#!/usr/bin/env bash
# The down kernel per T on the narrow layers: the pointer-load, TMA and token-major downs beside the table's gate_up
# at T = 5-8 (streaming) and 12-16 (Triton), alone and in pairs.  About 3 minutes.
set -x
source .carry/env.sh
D3=exp-n64k256-w2-st2-shift; DN=exp-n64k256-w2-tma-st2-shift; DT=tok-n32k128-w1-st3-shift
R=gus-m64t8-rw2; G=gu-n32k128-w2-st3-shift
timeout 200 python3 benchmarks/moe_decode_sweep.py --out $OUT/t5_8 --shapes qwen3-30b-a3b,qwen3-next-80b \
  --tokens 5,6,7,8 --no-baseline --repeats 10 --gate-up $R --down $D3,$DN,$DT --pairs $R+$D3,$R+$DN,$R+$DT \
  2>&1 | grep -v '^#  ' | tail -40
timeout 150 python3 benchmarks/moe_decode_sweep.py --out $OUT/t12_16 --shapes qwen3-30b-a3b,qwen3-next-80b \
  --tokens 12,16 --no-baseline --repeats 10 --gate-up $G --down $D3,$DN,$DT --pairs $G+$D3,$G+$DN,$G+$DT \
  2>&1 | grep -v '^#  ' | tail -20
