#!/usr/bin/env bash
# The streaming down with the cast by the last CTA ("-lc"): GPU tests against moe_ref (every streaming down after
# either gate_up, graph replays), then the downs alone and in layers beside the table's downs.  Narrow layers (H =
# 2048) with the table's streaming gate_up at T = 1-8; with WIDE=1 the wide layers with the 32 x 8 gate_up.
# About 5 minutes each way.
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
D3=exp-n64k256-w2-st2-shift; DN=exp-n64k256-w2-tma-st2-shift; DT=tok-n32k128-w1-st3-shift
S=dns-m32t8; SL=dns-m32t8-lc; S2=dns-m64t8-rw2; S2L=dns-m64t8-rw2-lc
if [ -z "$WIDE" ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 tests/kernels/test_gluon_moe_decode.py \
    -k "layer_against or replays" 2>&1 | tail -4
  G=gus-m64t8-rw2; SHAPES=qwen3-30b-a3b,qwen3-next-80b; TOK=1,2,4,6,8; DOWNS=$D3,$DN,$DT,$S,$SL,$S2,$S2L
else
  G=gus-m32t8; SHAPES=qwen3-235b-a22b,deepseek-v3; TOK=1,2,4,8; DOWNS=$D3,$S,$SL,$S2L
fi
PAIRS=$(echo $DOWNS | tr ',' '\n' | sed "s/^/$G+/" | paste -sd,)
timeout 330 python3 benchmarks/moe_decode_sweep.py --out $OUT/sweep --shapes $SHAPES --tokens $TOK --no-baseline \
  --repeats 10 --gate-up $G --down $DOWNS --pairs $PAIRS 2>&1 | grep -v '^#  ' | tail -60
python3 - "$OUT/sweep/moe_decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], "T", r["T"], "floor", round(r["floor_us"], 1), "failed", r["failed"])
    print("   down alone:", {k: round(v, 1) for k, v in r["down_us"].items()})
    print("   layer:", {k.split("+")[1]: round(v, 1) for k, v in r["pairs_us"].items()})
PY
