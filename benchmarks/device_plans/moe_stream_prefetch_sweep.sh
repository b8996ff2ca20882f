#!/usr/bin/env bash
# The prefetch tiles beside the same tiles without it, alone and in layers (narrow layers at T = 4-8, where a CTA's
# range is 2-3 short runs; the wide ones at T = 1 and 8, where runs are long), and the token-major down against the
# pointer-load down at I = 768 (Qwen3-30B-A3B), and the row-pointer tiles ("-rp") beside the same tiles without.
# About 8 minutes.
set -x
source .carry/env.sh
D3=exp-n64k256-w2-st2-shift; DN=exp-n64k256-w2-tma-st2-shift; DT=tok-n32k128-w1-st3-shift
R=gus-m64t8-rw2; M=gus-m32t8
timeout 330 python3 benchmarks/moe_decode_sweep.py --out $OUT/narrow --shapes qwen3-30b-a3b,qwen3-next-80b \
  --tokens 4,6,8 --no-baseline --repeats 10 --gate-up $R,$R-pf2,$R-pf8,$R-rp,$R-pf8-rp,$M,$M-pf2,$M-pf8,$M-rp \
  --down $D3,$DN,$DT --pairs $R+$D3,$R-pf2+$D3,$R-pf8+$D3,$R-rp+$D3,$R-pf8-rp+$D3,$R+$DN,$R-pf2+$DN,$R-pf8+$DN,\
$R-rp+$DN,$R-pf8-rp+$DN,$R+$DT,$R-pf8+$DT,$R-rp+$DT,$M+$DT,$M-rp+$DT 2>&1 | tail -90
timeout 200 python3 benchmarks/moe_decode_sweep.py --out $OUT/wide --shapes qwen3-235b-a22b,deepseek-v3 \
  --tokens 1,4,8 --no-baseline --repeats 10 --gate-up $M,$M-pf2,$M-pf8,$M-rp --down $D3 2>&1 | tail -30
