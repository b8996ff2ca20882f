#!/usr/bin/env bash
# The streaming down with the cast by the last CTA ("-lc"), the overlapped runs ("-ov") and 4 CTAs per SM ("-c4")
# beside the table's downs, alone and in layers (every candidate checked against moe_ref first): the narrow layers
# (H = 2048) with the table's streaming gate_up and its overlapped twin at T = 1, 4, 8 (TOK and DOWNS narrow this
# sweep), then the GPU tests (the -lc downs twice after the zeroing gate_up, graph replays, the overlapped gate_up's
# bits against the plain tile's); T = 12 and 16 with the table's Triton gate_up; with WIDE=1 the wide layers.
# About 7 minutes (8 with WIDE=1).  PARTS picks the parts where a call must be short: "a" the narrow layers at
# T <= 8 and the GPU tests (~5 min), "b" T = 12 and 16 (and WIDE).
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
D3=exp-n64k256-w2-st2-shift; DN=exp-n64k256-w2-tma-st2-shift
DT=tok-n32k128-w1-st3-shift; S=dns-m32t8; SL=dns-m32t8-lc; S2L=dns-m64t8-rw2-lc; G=gus-m64t8-rw2
sweep() {  # name, gate_ups, shapes, tokens, downs, seconds (pairs: every gate_up with every down)
  local pairs=$(for g in ${2//,/ }; do echo $5 | tr ',' '\n' | sed "s/^/$g+/"; done | paste -sd,)
  timeout $6 python3 benchmarks/moe_decode_sweep.py --out $OUT/$1 --shapes $3 --tokens $4 --no-baseline \
    --repeats 10 --gate-up $2 --down $5 --pairs $pairs 2>&1 | grep -v '^#  ' | tail -30
  python3 - "$OUT/$1/moe_decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], "T", r["T"], "floor", round(r["floor_us"], 1), "failed", r["failed"])
    print("   gate_up alone:", {k: round(v, 1) for k, v in r["gate_up_us"].items()}, r["errors"])
    print("   down alone:", {k: round(v, 1) for k, v in r["down_us"].items()})
    print("   layer:", {k: round(v, 1) for k, v in r["pairs_us"].items()})
PY
}
if [[ ${PARTS:-a b} == *a* ]]; then
NARROW_DOWNS=$D3,$DN,$S,$SL,$S2L,$SL-ov,$S2L-ov,$SL-c4,$S2L-c4
sweep narrow $G,$G-ov qwen3-30b-a3b,qwen3-next-80b ${TOK:-1,4,8} ${DOWNS:-$NARROW_DOWNS} 270
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 tests/kernels/test_gluon_moe_decode.py \
  -k "late or replays or overlapped" 2>&1 | tail -4
fi
[[ ${PARTS:-a b} == *b* ]] || exit 0
# T = 12 and 16 with the table's gate_up there, the 16-route streaming down beside the table's downs
sweep narrow16 gu-n32k128-w2-st3-shift qwen3-30b-a3b,qwen3-next-80b 12,16 $D3,$DN,$DT,dns-m32t16-lc 150
[ -n "$WIDE" ] && sweep wide gus-m32t8,gus-m32t8-ov qwen3-235b-a22b,deepseek-v3 1,4,8 $D3,$S,$SL,$SL-ov 200
