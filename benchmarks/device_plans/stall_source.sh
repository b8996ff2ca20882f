#!/usr/bin/env bash
# Which instructions the decode loops' warps stall at: Nsight Compute's per-SASS-instruction warp-state samples
# (SourceCounters) of the streaming linear kernel on Qwen3-32B's qkv at T = 2 and of the op's Qwen3-30B-A3B kernels at
# T = 1, written to $OUT/source.csv (every profiled kernel's SASS with its sampled stall reasons).  The
# per-kernel totals are in stall_profile.sh; this says where in the loop they fall.
set -x
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
timeout ${SOURCE_S:-240} ncu --clock-control none --nvtx --nvtx-include 'regex:(moe|stream)-.*/' \
  -k 'regex:moe|stream' --section SourceCounters --section WarpStateStats --import-source no -o /tmp/src -f \
  python3 benchmarks/ncu_probe.py --moe 'qwen3-30b-a3b:1' --linear '' --linear-stream '10240x5120:2' \
  > $OUT/source.log 2>&1
echo "ncu rc $?"
# The source page of every profiled kernel, one after another (a header line names each kernel).
ncu -i /tmp/src.ncu-rep --page source --print-source sass --csv > $OUT/source.csv 2>> $OUT/source.log \
  || ncu -i /tmp/src.ncu-rep --page source --csv > $OUT/source.csv 2>> $OUT/source.log
wc -l $OUT/source.csv; ls -la $OUT
tail -3 $OUT/source.log
