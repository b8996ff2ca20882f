#!/usr/bin/env bash
# The decode table's rows between measured points, as layers (every pair checked against moe_ref first): the
# narrow layers at T = 2, 3, 5, 7 with the Triton row's gate_up and the streaming gate_up, each with the row's
# Triton downs and the streaming late-cast down (4 CTAs per SM); Qwen3-235B-A22B at T = 1-3 with the same two
# downs beside the row's gate_ups.  About 5 minutes; PARTS picks the sweeps (n23, n57, w; all by default).
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}  # kept by a warm machine between calls
G1=gu-n16k128-w2-st3; G3=gu-n32k128-w2-st3-shift; GS=gus-m64t8-rw2; GW=gus-m32t8
DT2=exp-n32k256-w2-tma-st2; DT=exp-n64k256-w2-tma-st2-shift; DP=exp-n64k256-w2-st2-shift; DS=dns-m64t8-rw2-lc-c4
sweep() {  # name, shapes, tokens, pairs, seconds
  timeout $5 python3 benchmarks/moe_decode_sweep.py --out $OUT/$1 --shapes $2 --tokens $3 --no-baseline \
    --repeats 10 --pairs $4 2>&1 | grep -v '^#  ' | tail -30
  python3 - "$OUT/$1/moe_decode.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], "T", r["T"], "floor", round(r["floor_us"], 1), "failed", r["failed"], r["errors"])
    print("   layer:", {k: round(v, 1) for k, v in sorted(r["pairs_us"].items(), key=lambda kv: kv[1])})
PY
}
pairs() { for g in ${1//,/ }; do for d in ${2//,/ }; do echo -n "$g+$d,"; done; done | sed 's/,$//'; }
on() { [[ ${PARTS:-n23 n57 w} == *$1* ]]; }
on n23 && sweep narrow23 qwen3-30b-a3b,qwen3-next-80b 2,3 $(pairs $G1,$G3,$GS $DT2,$DT,$DP,$DS) 200
on n57 && sweep narrow57 qwen3-30b-a3b,qwen3-next-80b 5,7 \
  $(pairs $G3,$GS $DT,$DP,$DS,tok-n32k128-w1-st3-shift) 200
on w && sweep wide123 qwen3-235b-a22b 1,2,3 $(pairs gu-n16k256-kw4-st3-shift,$G1,$GW $DP,$DS) 150
