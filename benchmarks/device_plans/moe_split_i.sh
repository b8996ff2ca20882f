#!/usr/bin/env bash
# The one-launch decode MoE layer with the down split over I (kernels/moe_decode_split_i.py).  PARTS picks: tests
# (its GPU tests against moe_ref: the six sweep pairs on the real shapes, fp16 / gelu / maps, graph replay),
# narrow (Qwen3-30B-A3B and Qwen3-Next-80B at T = 1-4: the split-I pairs as layers beside today's op, the sweep's
# baseline, every pair checked against moe_ref first), wide (Qwen3-235B-A22B and DeepSeek-V3 at T = 1-2), stall
# (Nsight Compute's warp states of the op's narrow T = 1 kernels and of the linear streaming kernel: where the
# warps wait; to $OUT/stall.csv).
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}  # kept by a warm machine between calls
on() { [[ " ${PARTS:-tests narrow wide stall} " == *" $1 "* ]]; }  # whole words
show() {  # the sweep's layer times per shape and T
  python3 - "$1" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], "T", r["T"], "floor", round(r["floor_us"], 1), "today", round(r.get("today_us", 0), 1),
          "failed", r["failed"], {k: f"{v:.2g}" for k, v in r["errors"].items()})
    print("   layer:", {k: round(v, 1) for k, v in sorted(r["pairs_us"].items(), key=lambda kv: kv[1])})
PY
}
G1=gu-n16k256-kw4-st3-shift
P=$G1-r128+spl-h64,$G1-r128+spl-h64-pf,$G1+spl-h128-pf-c4,$G1+spl-h256-pf,gu-n32k256-kw4-st2-shift-r168+spl-h64
P=$P,gu-n16k128-w2-st3+spl-h128-c4
if on tests; then
  timeout ${TESTS_S:-300} python3 -m pytest -q -m gpu -n 8 tests/kernels/test_moe_decode_split_i.py 2>&1 | tail -6
fi
if on narrow; then
  timeout ${NARROW_S:-300} python3 benchmarks/moe_decode_sweep.py --out $OUT/narrow \
    --shapes qwen3-30b-a3b,qwen3-next-80b --tokens 1,2,3,4 --repeats 10 --pairs $P 2>&1 | grep -v '^#  ' | tail -12
  show $OUT/narrow/moe_decode.json
fi
if on wide; then
  timeout ${WIDE_S:-240} python3 benchmarks/moe_decode_sweep.py --out $OUT/wide \
    --shapes qwen3-235b-a22b,deepseek-v3 --tokens 1,2 --repeats 10 --pairs $P 2>&1 | grep -v '^#  ' | tail -8
  show $OUT/wide/moe_decode.json
fi
if on stall; then
  timeout ${STALL_S:-240} ncu --clock-control none --nvtx --nvtx-include 'regex:(moe|linear)-.*/' \
    -k 'regex:moe|gemv|stream' --section WarpStateStats --section SchedulerStats --csv \
    python3 benchmarks/ncu_probe.py --moe 'qwen3-30b-a3b:1' --linear '10240x5120:2;51200x5120:8' \
    > $OUT/stall.csv 2> $OUT/stall.err
  echo "ncu rc $?"; tail -3 $OUT/stall.err; wc -l $OUT/stall.csv
fi
true
